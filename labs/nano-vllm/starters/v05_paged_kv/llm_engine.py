"""v05 - the engine step loop over a paged KV cache (cards 8-9).

Same three phases as v04 (schedule -> run -> postprocess). New: the engine builds a
``BlockManager`` (``num_blocks`` pages of ``block_size`` slots) and gives it to the
scheduler, and the toy model writes into one shared pool through block tables. The
engine no longer frees anything itself - returning blocks is the scheduler's job.

``StepOutput`` grows two fields so a trace (and a test) can watch the pages:
``block_tables`` (each scheduled request's table during the step) and ``context_lens``
(how many of its tokens have KV in the cache after the step).
"""

from dataclasses import dataclass

from block_manager import BlockManager
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
    block_tables: dict[int, tuple[int, ...]]
    context_lens: dict[int, int]
    preempted_seq_ids: tuple[int, ...]


class LLMEngine:
    """add_request -> step (schedule, run, postprocess) until idle."""

    def __init__(self, num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 4,
                 max_num_batched_tokens: int = 64) -> None:
        self.block_size = block_size
        self.model = ToyModel(num_blocks, block_size)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, EOS_TOKEN)
        self._next_seq_id = 0

    def add_request(self, prompt_token_ids: list[int], max_tokens: int) -> int:
        """Queue a new request (status WAITING) and return its id."""
        seq = Sequence(self._next_seq_id, prompt_token_ids, max_tokens, self.block_size)
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
        block_tables = {seq.seq_id: tuple(seq.block_table) for seq in batch.seqs}
        context_lens = {seq.seq_id: len(seq) for seq in batch.seqs}
        finished = self.scheduler.postprocess(batch.seqs, token_ids)
        return StepOutput(
            is_prefill=batch.is_prefill,
            num_input_tokens=num_input_tokens,
            scheduled_seq_ids=tuple(seq.seq_id for seq in batch.seqs),
            new_tokens=tuple((seq.seq_id, tok) for seq, tok in zip(batch.seqs, token_ids)),
            finished=tuple(RequestOutput(s.seq_id, tuple(s.completion_token_ids)) for s in finished),
            block_tables=block_tables,
            context_lens=context_lens,
            preempted_seq_ids=tuple(seq.seq_id for seq in batch.preempted),
        )

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Add every prompt, step until idle, return completions in prompt order."""
        seq_ids = [self.add_request(prompt, max_tokens) for prompt in prompts]
        outputs: dict[int, list[int]] = {}
        while not self.is_finished():
            for request_output in self.step().finished:
                outputs[request_output.seq_id] = list(request_output.completion_token_ids)
        return [outputs[seq_id] for seq_id in seq_ids]
