"""Scheduling policies: in what order a step's batch is filled (chapter 5).

The scheduler owns what every policy shares: the waiting and running queues, the token
budget, the KV blocks, admission (``Scheduler.admit_waiting``), serving the running
requests (``Scheduler.schedule_running``) and preemption. A policy only decides the order in
which a step uses them, and which waiting requests may be admitted at all. Each is chosen
by name, ``EngineConfig.scheduling_policy``:

* ``fcfs`` (first come, first served): continuous batching as vLLM v1 does it, the default.
  Running requests first (a decode token each, or the next chunk of a prompt), then waiting
  requests in arrival order while budget, slots and blocks last.
* ``prefill_first``: the older policy (nano-vLLM, early vLLM), kept for comparison. A step
  that can admit a waiting request runs prefill work only, and the decodes wait.
* ``static``: the baseline that continuous batching replaced (chapters 5 and 11). Up to
  ``max_num_seqs`` requests are admitted together as one batch, and nobody new until every
  one of them has finished, so the slots short requests free stay idle.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from nanoengine.engine.block_manager import gained_blocks

if TYPE_CHECKING:
    from nanoengine.engine.request import Request
    from nanoengine.engine.scheduler import Scheduler, SchedulerOutput


class FirstComeFirstServed:
    """``fcfs``: the running requests, then the waiting ones in arrival order."""

    name = "fcfs"

    def schedule(self, scheduler: Scheduler, out: SchedulerOutput) -> None:
        """Fill ``out`` within its token budget."""
        budget = scheduler.schedule_running(out, out.token_budget)
        if not out.preempted:  # the memory a preemption freed is for the running requests
            scheduler.admit_waiting(out, budget)

    def may_admit(self, request: Request) -> bool:
        """Whether ``request``, first in the waiting queue, may be admitted now."""
        return True

    def forget(self, request: Request) -> None:
        """``request`` has finished or was aborted."""


class PrefillFirst(FirstComeFirstServed):
    """``prefill_first``: prompts first; the decodes run only in a step with no prefill work."""

    name = "prefill_first"

    def schedule(self, scheduler: Scheduler, out: SchedulerOutput) -> None:
        budget = out.token_budget
        for request in scheduler.running:  # the prompts still being prefilled, chunk by chunk
            if budget == 0:
                break
            if request.num_tokens_to_compute > 1 or request.num_output_tokens == 0:
                num_new, held = min(request.num_tokens_to_compute, budget), len(request.block_ids)
                if scheduler.block_manager.allocate_slots(request, num_new):
                    out.add(request, num_new, new_block_ids=gained_blocks(request, held))
                    budget -= num_new
        budget = scheduler.admit_waiting(out, budget)
        if not out.scheduled:  # no prefill work this step: the decodes get it
            scheduler.schedule_running(out, budget)


class StaticBatching(FirstComeFirstServed):
    """``static``: one batch at a time, the next only when the whole of this one has finished."""

    name = "static"

    def __init__(self) -> None:
        self.batch: set[str] = set()  # ids of the batch now being served

    def schedule(self, scheduler: Scheduler, out: SchedulerOutput) -> None:
        if not self.batch and not scheduler.running:  # the waiting requests that fill the slots
            self.batch = {r.request_id for r in itertools.islice(scheduler.waiting, scheduler.max_num_seqs)}
        super().schedule(scheduler, out)

    def may_admit(self, request: Request) -> bool:
        return request.request_id in self.batch

    def forget(self, request: Request) -> None:
        self.batch.discard(request.request_id)


POLICIES = {policy.name: policy for policy in (FirstComeFirstServed, PrefillFirst, StaticBatching)}


def make_policy(name: str) -> FirstComeFirstServed:
    """A fresh policy object for ``name`` (one of ``POLICIES``)."""
    if name not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {tuple(POLICIES)}, got {name!r}")
    return POLICIES[name]()
