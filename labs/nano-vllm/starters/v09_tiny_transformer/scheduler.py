"""v08 - the scheduler, deciding who gets KV-cache blocks (cards 8-9, 12).

Continuous batching as in v04 (prefill first, otherwise decode every running request),
plus memory: a request can only run if its KV has somewhere to go.

- **admission** (prefill) needs ``block_manager.can_allocate``: a free block for every
  ``block_size`` tokens of the request; ``allocate`` then fills its block table.
- **decode** needs ``can_append``: if the token about to be written starts a new block,
  one free block must exist; ``may_append`` takes it.
- if a running request cannot get its block, the scheduler **preempts** the newest
  running request: its blocks go back to the pool and it returns to the *front* of the
  waiting queue with all its tokens (prompt + generated so far). When it is admitted
  again its KV is recomputed by a prefill ("recompute" preemption, as in nano-vLLM and
  vLLM v1). Its output does not change; only work is repeated.
- ``postprocess`` returns a finished request's blocks immediately, so the next step can
  admit someone else.

New in v08: ``postprocess`` honours ``ignore_eos`` from the request's ``SamplingParams``.

Invariant: a sequence is in exactly one of ``waiting`` / ``running``, or is finished; a
running sequence always holds ``ceil(tokens whose KV is written / block_size)`` blocks.
"""

from collections import deque
from dataclasses import dataclass

from block_manager import BlockManager
from sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledBatch:
    """The scheduler's decision for one step: which sequences, which kind, who was evicted."""

    seqs: tuple[Sequence, ...]
    is_prefill: bool
    preempted: tuple[Sequence, ...] = ()


class Scheduler:
    """Chooses the batch for each step and applies each step's results."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_id: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, got "
                             f"{max_num_seqs} and {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_id = eos_token_id
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        if len(seq) > self.max_num_batched_tokens:
            raise ValueError(f"prompt of {len(seq)} tokens can never fit the per-step budget "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}")
        max_blocks = -(-(len(seq) + seq.max_tokens) // self.block_manager.block_size)
        if max_blocks > self.block_manager.num_blocks:
            # Otherwise the request could preempt itself forever.
            raise ValueError(f"request may need {max_blocks} blocks; the pool has "
                             f"{self.block_manager.num_blocks}")
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> ScheduledBatch:
        """Admit waiting requests for a prefill if any fit; otherwise decode all running."""
        scheduled: list[Sequence] = []
        num_batched_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (num_batched_tokens + len(seq) > self.max_num_batched_tokens
                    or not self.block_manager.can_allocate(seq)):
                break
            self.block_manager.allocate(seq)
            num_batched_tokens += len(seq)
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return ScheduledBatch(tuple(scheduled), is_prefill=True)

        preempted: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                victim = self.running.pop() if self.running else seq  # the newest request
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        assert scheduled, "add() guarantees a lone request always fits"
        self.running.extend(scheduled)
        return ScheduledBatch(tuple(scheduled), is_prefill=False, preempted=tuple(preempted))

    def _preempt(self, seq: Sequence) -> None:
        """Evict: free the blocks, go back to the front of the queue, recompute later."""
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: tuple[Sequence, ...], token_ids: list[int]) -> list[Sequence]:
        """Append each new token; finish the requests that are done and free their blocks."""
        finished = []
        for seq, token_id in zip(seqs, token_ids, strict=True):
            seq.append_token(token_id)
            hit_eos = token_id == self.eos_token_id and not seq.ignore_eos
            if hit_eos or seq.num_completion_tokens >= seq.max_tokens:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished
