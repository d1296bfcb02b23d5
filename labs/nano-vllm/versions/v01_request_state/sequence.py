"""v01 - request state: a ``Sequence`` bundles everything one request needs (card 5).

In v00 the state of a request was a bare list of token ids plus a few loop variables.
An engine that serves many requests needs that state as an object it can queue, pass
around and inspect: which tokens came from the prompt, which were generated, how many
more may be generated, and whether the request is done.

Design choices (kept in every later version, as in nano-vLLM's ``engine/sequence.py``):

- prompt and completion live in one list, ``token_ids``; ``num_prompt_tokens`` marks
  where the prompt ends. The model always needs the full list, the user only the tail.
- everything that can be derived (``num_tokens``, ``last_token``, ``completion_token_ids``,
  ``is_finished``) is a property, not a stored field, so it can never go stale.
"""

from toy_model import EOS_TOKEN


class Sequence:
    """One request: its prompt, its generated tokens and its stopping rule."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], max_tokens: int) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must contain at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, prompt={self.prompt_token_ids}, "
                f"completion={self.completion_token_ids}, finished={self.is_finished})")

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
        """Done when the budget is used up or the last generated token is EOS."""
        if self.num_completion_tokens >= self.max_tokens:
            return True
        return self.num_completion_tokens > 0 and self.last_token == EOS_TOKEN

    def append_token(self, token_id: int) -> None:
        """Record one generated token. The only way a Sequence grows."""
        if self.is_finished:
            raise RuntimeError(f"sequence {self.seq_id} is finished; cannot append")
        self.token_ids.append(token_id)
