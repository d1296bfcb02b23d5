"""v12 - request state, with a block table, prefix hits, sampling state, drafts and a grammar (cards 5-17).

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

New in v08: the request's ``SamplingParams`` (temperature, top-k, stopping rule) and, if
it has a seed, its own ``torch.Generator``. The generator lives here, with the request,
so its state carries from one step to the next and survives preemption.

New in v11: ``num_computed_tokens``, how many leading tokens have their KV written *and
valid* in the cache (vLLM's name). Between steps a running request has every token but
its last computed: ``num_computed_tokens == num_tokens - 1``. A verify pass also writes
KV for drafted tokens, but only the accepted ones count; the others are guesses the
model did not make, and the count (with the block table) is rolled back past them. And
``draft_token_ids``: the tokens proposed for this step, verified by the next model pass.

New in v12: ``grammar``, the request's structured-output state machine (a
``structured_output.Grammar``, or None when the request has no constraint). It is compiled
when the request is added and lives with the request, like the generator: preemption
keeps it, because it describes the tokens generated so far, not their KV. And
``finish_reason``: ``"stop"`` (EOS, or a constraint that is complete) or ``"length"``
(``max_tokens`` ran out first), as vLLM reports it.
"""

from enum import Enum, auto

import torch

from sampling_params import SamplingParams
from structured_output import Grammar


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its prompt, its generated tokens, its budget and its status."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 block_size: int) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must contain at least one token")
        self.seq_id = seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos
        self.temperature = sampling_params.temperature
        self.top_k = sampling_params.top_k
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)
        self.block_size = block_size
        self.block_table: list[int] = []  # block ids, in token order; owned by BlockManager
        self.num_cached_tokens = 0  # leading tokens whose KV came from the prefix cache
        self.num_computed_tokens = 0  # leading tokens whose KV is written and valid
        self.draft_token_ids: list[int] = []  # this step's proposed tokens, to be verified
        self.grammar: Grammar | None = None  # the constraint's state machine; set by the engine
        self.finish_reason: str | None = None  # "stop" or "length", once FINISHED

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
