"""Scheduling policies: in what order a step's batch is filled (chapter 5).

The scheduler owns what every policy shares: the waiting and running queues, the token
budget, the KV blocks, admission (``Scheduler.admit_waiting``), serving the running
requests (``Scheduler.schedule_running``) and preemption. A policy only decides the order in
which a step uses them, and which waiting requests may be admitted at all. Each is chosen
by name, ``EngineConfig.scheduling_policy``: ``fcfs``, continuous batching as vLLM v1 does it
(the default); ``prefill_first``, nano-vLLM's and early vLLM's policy, kept for comparison;
``static``, the baseline that continuous batching replaced (chapters 5 and 11).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from nanoengine.engine.block_manager import gained_blocks

if TYPE_CHECKING:
    from nanoengine.engine.request import Request
    from nanoengine.engine.scheduler import Scheduler, SchedulerOutput


class FirstComeFirstServed:
    """``fcfs``: the running requests (a decode token each, or a prompt's next chunk), then the waiting
    ones in arrival order while budget, slots and blocks last."""

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
    """``prefill_first``: a step that can admit a waiting request runs prefill work only; the decodes wait."""

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
    """``static``: up to ``max_num_seqs`` requests admitted as one batch, and nobody new until every one of
    them has finished, so the slots short requests free stay idle."""

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
