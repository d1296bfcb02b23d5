"""v07 - request state, with a block table and a prefix-cache hit count (cards 5-11).

A ``Sequence`` bundles everything one request needs: prompt and generated tokens in one
list (``num_prompt_tokens`` marks the boundary) and the generation budget. Everything
that can be derived is a property, so it can never go stale.

New in v02: a request now has a *status* that the engine moves it through::

    WAITING --(engine picks it)--> RUNNING --(EOS or max_tokens)--> FINISHED

The status is set by the engine, not by the Sequence: deciding when a request stops is
the engine's job (nano-vLLM does it in ``Scheduler.postprocess``), the Sequence only
records the result. nano-vLLM has exactly these three states.

New in v05: ``block_table``, the list of KV-cache blocks (pages) that hold this request's
keys and values, in order: token at position ``p`` lives in block
``block_table[p // block_size]`` at offset ``p % block_size``. The ``BlockManager`` fills
and empties it; the Sequence only derives how many blocks it needs (``num_blocks``).

New in v07: ``num_cached_tokens``, how many leading tokens already had their KV in the
cache (a prefix-cache hit) when the request was admitted. The prefill skips them.
"""

from enum import Enum, auto


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its prompt, its generated tokens, its budget and its status."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], max_tokens: int,
                 block_size: int) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must contain at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.seq_id = seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.block_table: list[int] = []  # block ids, in token order; owned by BlockManager
        self.num_cached_tokens = 0  # leading tokens whose KV came from the prefix cache

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, prompt={self.prompt_token_ids}, "
                f"completion={self.completion_token_ids}, blocks={self.block_table})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold the KV of all ``num_tokens`` tokens (ceil division)."""
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        """How many tokens sit in the last block (1..block_size)."""
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        """The token ids that belong in block ``i`` of this sequence."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"block {i} out of range for {self.num_blocks} blocks")
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        """Record one generated token. The only way a Sequence grows."""
        if self.is_finished:
            raise RuntimeError(f"sequence {self.seq_id} is finished; cannot append")
        self.token_ids.append(token_id)
