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
        # TODO(v01): Reject bad input with ValueError (an empty prompt, max_tokens < 1),
        # then store seq_id, token_ids (a copy of the prompt: prompt and completion share
        # this one list), num_prompt_tokens and max_tokens.
        raise NotImplementedError("TODO(v01): write Sequence.__init__ (see NOTES.md)")

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
        # TODO(v01): Return the generated part of token_ids: everything after the first
        # num_prompt_tokens.
        raise NotImplementedError("TODO(v01): write Sequence.completion_token_ids (see NOTES.md)")

    @property
    def is_finished(self) -> bool:
        """Done when the budget is used up or the last generated token is EOS."""
        # TODO(v01): True once max_tokens tokens were generated, or once the last
        # *generated* token is EOS_TOKEN (a prompt that ends in EOS does not count).
        raise NotImplementedError("TODO(v01): write Sequence.is_finished (see NOTES.md)")

    def append_token(self, token_id: int) -> None:
        """Record one generated token. The only way a Sequence grows."""
        # TODO(v01): Raise RuntimeError if the sequence is already finished; otherwise
        # append token_id.
        raise NotImplementedError("TODO(v01): write Sequence.append_token (see NOTES.md)")
