"""v03 - the engine step loop with a prefill / decode split (card 7).

``LLMEngine`` keeps the v02 lifecycle (WAITING -> RUNNING -> FINISHED) and API
(``add_request``, ``step``, ``generate``). What changed is the model work inside
``step``:

- a WAITING request gets a **prefill**: the whole prompt goes into the model once, its
  KV cache is filled, and the first token comes out; the request becomes RUNNING;
- a RUNNING request gets a **decode**: only its last token goes in.

This is the central axis of every serving engine: prefill is many tokens of one request
(compute-heavy), decode is one token per request (memory-heavy, and repeated many times).
nano-vLLM's ``Scheduler.schedule`` makes exactly this choice and hands the model runner
an ``is_prefill`` flag. ``StepOutput`` now says which kind of step ran and how many
tokens went into the model.

Still missing on purpose: one request at a time (v04).
"""

from collections import deque
from dataclasses import dataclass

from sequence import Sequence, SequenceStatus
from toy_model import EOS_TOKEN, ToyModel


@dataclass(frozen=True)
class RequestOutput:
    """A finished request, as handed back to the caller."""

    seq_id: int
    completion_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class StepOutput:
    """What one ``step`` did. ``new_tokens`` is the output stream: (seq_id, token_id)."""

    is_prefill: bool
    num_input_tokens: int
    scheduled_seq_ids: tuple[int, ...]
    new_tokens: tuple[tuple[int, int], ...]
    finished: tuple[RequestOutput, ...]


class LLMEngine:
    """Owns all requests and advances them; one request runs at a time in v03."""

    def __init__(self) -> None:
        self.model = ToyModel()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # at most one sequence in v03
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
        """Prefill the next waiting request, or decode the running one."""
        # TODO(v03): Nothing running: prefill the oldest waiting request (it becomes
        # RUNNING; its whole prompt goes in). Otherwise decode the running one (only its
        # last token goes in). Append the token; on EOS or max_tokens finish it, remove it
        # and free its cache with self.model.free. Return StepOutput(is_prefill,
        # num_input_tokens, ...).
        raise NotImplementedError("TODO(v03): write LLMEngine.step (see NOTES.md)")

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Add every prompt, step until idle, return completions in prompt order."""
        seq_ids = [self.add_request(prompt, max_tokens) for prompt in prompts]
        outputs: dict[int, list[int]] = {}
        while not self.is_finished():
            for request_output in self.step().finished:
                outputs[request_output.seq_id] = list(request_output.completion_token_ids)
        return [outputs[seq_id] for seq_id in seq_ids]
