"""v02 - request state with an explicit lifecycle (cards 5-6).

A ``Sequence`` bundles everything one request needs: prompt and generated tokens in one
list (``num_prompt_tokens`` marks the boundary) and the generation budget. Everything
that can be derived is a property, so it can never go stale.

New in v02: a request now has a *status* that the engine moves it through::

    WAITING --(engine picks it)--> RUNNING --(EOS or max_tokens)--> FINISHED

The status is set by the engine, not by the Sequence: deciding when a request stops is
the engine's job (nano-vLLM does it in ``Scheduler.postprocess``), the Sequence only
records the result. nano-vLLM has exactly these three states.
"""

from enum import Enum, auto


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its prompt, its generated tokens, its budget and its status."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], max_tokens: int) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must contain at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.seq_id = seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, prompt={self.prompt_token_ids}, "
                f"completion={self.completion_token_ids})")

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

    def append_token(self, token_id: int) -> None:
        """Record one generated token. The only way a Sequence grows."""
        if self.is_finished:
            raise RuntimeError(f"sequence {self.seq_id} is finished; cannot append")
        self.token_ids.append(token_id)
