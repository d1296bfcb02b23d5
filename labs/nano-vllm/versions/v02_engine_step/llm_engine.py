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
        seq = Sequence(self._next_seq_id, prompt_token_ids, max_tokens)
        self._next_seq_id += 1
        self.waiting.append(seq)
        return seq.seq_id

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def step(self) -> StepOutput:
        """Pick the request to run, run the model once, record the result."""
        if not self.running:  # pick: the oldest waiting request, first come first served
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        seq = self.running[0]
        token_id = toy_next_token(seq.token_ids)  # run: the full context, every time
        seq.append_token(token_id)  # record: the new token joins the request state
        finished = ()
        if token_id == EOS_TOKEN or seq.num_completion_tokens >= seq.max_tokens:
            seq.status = SequenceStatus.FINISHED
            self.running.remove(seq)
            finished = (RequestOutput(seq.seq_id, tuple(seq.completion_token_ids)),)
        return StepOutput((seq.seq_id,), ((seq.seq_id, token_id),), finished)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Add every prompt, step until idle, return completions in prompt order."""
        seq_ids = [self.add_request(prompt, max_tokens) for prompt in prompts]
        outputs: dict[int, list[int]] = {}
        while not self.is_finished():
            for request_output in self.step().finished:
                outputs[request_output.seq_id] = list(request_output.completion_token_ids)
        return [outputs[seq_id] for seq_id in seq_ids]
