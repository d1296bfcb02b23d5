"""v04 - the engine step loop on top of a scheduler (card 8).

``LLMEngine`` keeps its API (``add_request``, ``step``, ``generate``) but no longer picks
requests itself: that moved into ``Scheduler``. ``step`` now reads top to bottom as the
three phases every engine has (nano-vLLM's ``LLMEngine.step`` is the same):

1. **schedule**: which requests ride on this step, and is it a prefill or a decode?
2. **run**: one batched model call for all of them;
3. **postprocess**: new tokens go into request state, finished requests leave.

The engine also frees the KV cache of finished requests - the cache is still a
per-request list inside the model (v05 makes it a managed pool).
"""

from dataclasses import dataclass

from scheduler import Scheduler
from sequence import Sequence
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
    """add_request -> step (schedule, run, postprocess) until idle."""

    def __init__(self, max_num_seqs: int = 4, max_num_batched_tokens: int = 64) -> None:
        self.model = ToyModel()
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens, EOS_TOKEN)
        self._next_seq_id = 0

    def add_request(self, prompt_token_ids: list[int], max_tokens: int) -> int:
        """Queue a new request (status WAITING) and return its id."""
        seq = Sequence(self._next_seq_id, prompt_token_ids, max_tokens)
        self._next_seq_id += 1
        self.scheduler.add(seq)
        return seq.seq_id

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def step(self) -> StepOutput:
        batch = self.scheduler.schedule()
        if batch.is_prefill:
            num_input_tokens = sum(len(seq) for seq in batch.seqs)
            token_ids = self.model.prefill(list(batch.seqs))
        else:
            num_input_tokens = len(batch.seqs)
            token_ids = self.model.decode(list(batch.seqs))
        finished = self.scheduler.postprocess(batch.seqs, token_ids)
        for seq in finished:
            self.model.free(seq.seq_id)
        return StepOutput(
            is_prefill=batch.is_prefill,
            num_input_tokens=num_input_tokens,
            scheduled_seq_ids=tuple(seq.seq_id for seq in batch.seqs),
            new_tokens=tuple((seq.seq_id, tok) for seq, tok in zip(batch.seqs, token_ids)),
            finished=tuple(RequestOutput(s.seq_id, tuple(s.completion_token_ids)) for s in finished),
        )

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Add every prompt, step until idle, return completions in prompt order."""
        seq_ids = [self.add_request(prompt, max_tokens) for prompt in prompts]
        outputs: dict[int, list[int]] = {}
        while not self.is_finished():
            for request_output in self.step().finished:
                outputs[request_output.seq_id] = list(request_output.completion_token_ids)
        return [outputs[seq_id] for seq_id in seq_ids]
