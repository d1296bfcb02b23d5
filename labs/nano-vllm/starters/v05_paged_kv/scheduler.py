"""v05 - the scheduler, now also deciding who gets KV-cache blocks (cards 8-9).

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
        # TODO(v05): Keep v04's ValueError for a prompt over max_num_batched_tokens, and
        # also refuse (ValueError) a request whose prompt + max_tokens needs more blocks
        # than the whole pool: it could never finish, and would preempt itself forever.
        raise NotImplementedError("TODO(v05): write Scheduler.add (see NOTES.md)")

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> ScheduledBatch:
        """Admit waiting requests for a prefill if any fit; otherwise decode all running."""
        # TODO(v05): Admission as in v04, plus: stop admitting when
        # block_manager.can_allocate fails, and allocate each admitted request. Decode: pop
        # running requests oldest first; while can_append fails for one, preempt the NEWEST
        # running request (self.running.pop()), or the request itself when no other is left;
        # otherwise may_append and schedule it. Put the scheduled ones back on running and
        # return them with the preempted ones. (The roomy-pool check passes before
        # preemption is written.)
        raise NotImplementedError("TODO(v05): write Scheduler.schedule (see NOTES.md)")

    def _preempt(self, seq: Sequence) -> None:
        """Evict: free the blocks, go back to the front of the queue, recompute later."""
        # TODO(v05): Status back to WAITING, deallocate its blocks, and put it at the FRONT
        # of waiting: a later prefill recomputes its KV from all its tokens.
        raise NotImplementedError("TODO(v05): write Scheduler._preempt (see NOTES.md)")

    def postprocess(self, seqs: tuple[Sequence, ...], token_ids: list[int]) -> list[Sequence]:
        """Append each new token; finish the requests that are done and free their blocks."""
        finished = []
        for seq, token_id in zip(seqs, token_ids, strict=True):
            seq.append_token(token_id)
            if token_id == self.eos_token_id or seq.num_completion_tokens >= seq.max_tokens:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished
