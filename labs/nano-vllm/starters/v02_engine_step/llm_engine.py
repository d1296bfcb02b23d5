"""v02 - the engine step loop: ``LLMEngine`` with ``add_request``, ``step``, ``generate`` (card 6).

v01 had a ``for`` loop that ran each request to completion. v02 turns that loop inside
out: the caller *adds* requests and the engine advances them one ``step`` at a time.
This is the shape of every serving engine, because a server cannot know all prompts in
advance - new requests arrive while others are generating.

- ``add_request`` creates a ``Sequence`` (status WAITING) and queues it.
- ``step`` does one unit of model work and returns a typed ``StepOutput`` saying who ran,
  which tokens came out (the output stream) and which requests finished.
- ``generate`` is only a convenience: add everything, call ``step`` until idle.

Still missing on purpose: one request runs at a time (the next waits until it finishes:
head-of-line blocking, fixed in v04), and every step recomputes the whole context
(fixed in v03).
"""

from collections import deque
from dataclasses import dataclass

from sequence import Sequence, SequenceStatus
from toy_model import EOS_TOKEN, toy_next_token


@dataclass(frozen=True)
class RequestOutput:
    """A finished request, as handed back to the caller."""

    seq_id: int
    completion_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class StepOutput:
    """What one ``step`` did. ``new_tokens`` is the output stream: (seq_id, token_id)."""

    scheduled_seq_ids: tuple[int, ...]
    new_tokens: tuple[tuple[int, int], ...]
    finished: tuple[RequestOutput, ...]


class LLMEngine:
    """Owns all requests and advances them; one request runs at a time in v02."""

    def __init__(self) -> None:
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # at most one sequence in v02
        self._next_seq_id = 0

    def add_request(self, prompt_token_ids: list[int], max_tokens: int) -> int:
        """Queue a new request (status WAITING) and return its id."""
        # TODO(v02): Make a Sequence with the next id (self._next_seq_id, then increment
        # it), queue it on self.waiting (its status is WAITING) and return its id.
        raise NotImplementedError("TODO(v02): write LLMEngine.add_request (see NOTES.md)")

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def step(self) -> StepOutput:
        """Pick the request to run, run the model once, record the result."""
        # TODO(v02): If nothing runs, move the oldest waiting request to self.running with
        # status RUNNING. Run toy_next_token on the running request's whole context and
        # append the token. On EOS or max_tokens set FINISHED and remove it from running.
        # Return StepOutput((seq_id,), ((seq_id, token),), finished) where finished holds a
        # RequestOutput if it finished.
        raise NotImplementedError("TODO(v02): write LLMEngine.step (see NOTES.md)")

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Add every prompt, step until idle, return completions in prompt order."""
        # TODO(v02): Add every prompt, call step() until is_finished(), collect the
        # RequestOutputs from each StepOutput.finished, and return the completions (lists)
        # in prompt order.
        raise NotImplementedError("TODO(v02): write LLMEngine.generate (see NOTES.md)")
