"""v04 - the scheduler: waiting/running queues and continuous batching (card 8).

Up to v03 the engine served one request at a time, so a short request queued behind a
long one waited for all of it (head-of-line blocking), and each decode step used the
model for a single token. The scheduler fixes both by deciding, every step, *which
requests ride on the next model call*:

- ``waiting`` holds requests that have no KV cache yet; ``running`` holds the ones that do.
- **prefill first**: if a waiting request can be admitted (fewer than ``max_num_seqs``
  running, and its prompt fits in the ``max_num_batched_tokens`` budget together with
  the others admitted this step), admit as many as fit and prefill them together.
- otherwise **decode every running request in one batch**: one token each.
- ``postprocess`` appends each new token to its request, finishes requests on EOS or
  ``max_tokens``, and removes them from ``running`` - so the *next* step can admit a
  waiting request in their place. That "refill as soon as a slot frees" is what makes
  the batching *continuous* (as opposed to waiting for the whole batch to finish).

This is nano-vLLM's policy (``Scheduler.schedule``: a step is prefill-only if any waiting
request can be admitted, otherwise decode-only). vLLM v1 mixes both in one step; see
the README's comparison.

Invariant: a sequence is in exactly one of ``waiting`` / ``running``, or is finished.
"""

from collections import deque
from dataclasses import dataclass

from sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledBatch:
    """The scheduler's decision for one step: which sequences, and which kind of step."""

    seqs: tuple[Sequence, ...]
    is_prefill: bool


class Scheduler:
    """Chooses the batch for each step and applies each step's results."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, eos_token_id: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, got "
                             f"{max_num_seqs} and {max_num_batched_tokens}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_id = eos_token_id
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        if len(seq) > self.max_num_batched_tokens:
            raise ValueError(f"prompt of {len(seq)} tokens can never fit the per-step budget "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}")
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> ScheduledBatch:
        """Admit waiting requests for a prefill if any fit; otherwise decode all running."""
        # TODO(v04): Prefill first: while requests wait and fewer than max_num_seqs run,
        # admit the oldest waiting request if its tokens fit what is left of
        # max_num_batched_tokens this step (status RUNNING, waiting -> running). If any were
        # admitted, return them as a prefill batch. Otherwise return a decode batch of every
        # running request. Admitting as soon as a slot frees, while others are still
        # decoding, is what makes the batching continuous.
        raise NotImplementedError("TODO(v04): write Scheduler.schedule (see NOTES.md)")

    def postprocess(self, seqs: tuple[Sequence, ...], token_ids: list[int]) -> list[Sequence]:
        """Append each new token to its request; finish and remove the ones that are done."""
        # TODO(v04): For each (seq, token_id): append the token; on EOS or max_tokens set
        # FINISHED and remove the sequence from running. Return the finished sequences.
        raise NotImplementedError("TODO(v04): write Scheduler.postprocess (see NOTES.md)")
