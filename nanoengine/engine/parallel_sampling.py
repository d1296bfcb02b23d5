"""Parallel sampling: one user request, ``n`` completions of the same prompt (chapter 8).

``SamplingParams(n=4)`` asks for four completions. Computing the prompt four times would
waste three prefills and three copies of its KV. A ``ParentRequest`` stands for the user
request and does everything ``n > 1`` needs; the scheduler, the requests, the batch
planner and the invariant checks only ever see ordinary requests:

1. **fan out**: the parent makes ``n`` ordinary ``Request`` objects, its *children*, named
   ``"{i}_{id}"`` (vLLM's names; with ``n == 1`` the one child keeps the user's id). A
   seeded request gives child ``i`` the seed ``seed + i``, so each is reproducible and
   they differ from one another. Only child 0 is queued at first; the siblings wait in
   the parent, outside the scheduler, and take no sequence slot and no block.
2. **prefill once**: child 0 is scheduled like any request and computes the prompt.
3. **release** (``after_update``, called by the engine once per step, after the
   scheduler has appended the step's tokens): when child 0 has its first token, its
   prompt's KV exists, so the parent queues the siblings. Each is promised child 0's
   full prompt blocks (``BlockManager.offer_prefix``); when the scheduler admits it, the
   block manager forks them to it (reference counts raised, ``BlockManager.fork``), and
   the sibling computes only the prompt's last, partly filled block and samples its own
   first token from its own logits. From then on the children are independent: each
   is scheduled, preempted and finished on its own.
4. **gather**: the output processor reports the ``n`` children as one ``RequestOutput``
   (``gather_metrics`` covers the timings); the user request ends when its last child
   does. Aborting it finishes every child, released or not.

Siblings enter the waiting queue like new requests, so ``max_num_seqs`` and the token
budget hold without special rules; the price is that they start a step after child 0
(with the ``static`` policy, in the next batch). If child 0 loses its blocks before a
sibling is admitted (preempted, or finished at its first token), the offer lapses and
the sibling finds the prompt in the prefix cache, or computes it.

vLLM v1 has the same object in vllm/v1/engine/parallel_sampling.py: a ``ParentRequest``
that makes the child requests and their seeds and gathers their outputs. It queues all
children at once and lets its prefix cache share the prompt, which only works when
caching is on and a child is scheduled after another one's prompt is in the cache;
holding the siblings back until the prompt is computed makes "prefill once" certain.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.request import Request
from nanoengine.outputs import RequestMetrics
from nanoengine.sampling_params import SamplingParams


def completion_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's n completions: the request's own when n == 1, else "{i}_{id}"."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def completion_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion ``index``'s parameters: the request's, with seed ``seed + index`` when seeded."""
    if params.n == 1 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % 2**63)


class ParentRequest:
    """A user request's ``n`` children, and the siblings still held back until the prompt is computed.

    ``make(child_id, params, index)`` builds one ``Request``.
    """

    def __init__(self, request_id: str, params: SamplingParams,
                 make: Callable[[str, SamplingParams, int], Request]) -> None:
        self.request_id = request_id
        self.children = [make(child_id, completion_params(params, i), i)
                         for i, child_id in enumerate(completion_ids(request_id, params.n))]
        self.held_back = self.children[1:]  # not yet given to the scheduler

    @property
    def first(self) -> Request:
        """Child 0: the one queued at once, which computes the prompt."""
        return self.children[0]

    def release_siblings(self, block_manager: BlockManager) -> list[Request]:
        """The held-back siblings, each promised the first child's full prompt blocks; none after this.

        The last prompt token is always left for the sibling to compute (its logits give
        the sibling's first token), so the promise covers ``(prompt - 1) // block_size``
        blocks: the prompt's partly filled block, or its last full one, is recomputed.
        """
        siblings, self.held_back = self.held_back, []
        num_blocks = (self.first.num_prompt_tokens - 1) // block_manager.block_size
        for sibling in siblings:
            if num_blocks:
                block_manager.offer_prefix(self.first, sibling, num_blocks)
        return siblings


class ParentRequests:
    """The parents whose siblings are still held back, found by their first child's id.

    The engine calls ``after_update`` once per step; it costs a dictionary lookup per
    request that produced a token, and nothing at all when no request has ``n > 1``.
    """

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.holding: dict[str, ParentRequest] = {}  # child 0's id -> its parent

    def add(self, parent: ParentRequest) -> None:
        if parent.held_back:
            self.holding[parent.first.request_id] = parent

    def after_update(self, produced: list[Request]) -> list[Request]:
        """Siblings to queue now: those of every first child that has just sampled its first token."""
        if not self.holding:
            return []
        ready = []
        for request in produced:
            parent = self.holding.pop(request.request_id, None)
            if parent is not None:
                ready.extend(parent.release_siblings(self.block_manager))
        return ready

    def forget(self, first_child_id: str) -> None:
        """The user request was aborted: its held-back siblings are never queued."""
        self.holding.pop(first_child_id, None)


def gather_metrics(completions: list[Request]) -> RequestMetrics:
    """One request's timings over all its completions.

    The first token is the earliest of any, the finish the last, and ``token_times``
    holds every completion's tokens in time order.
    """
    if len(completions) == 1:  # the usual case, built every step of a stream: read straight off
        c = completions[0]
        return RequestMetrics(
            arrival_time=c.arrival_time, first_scheduled_time=c.first_scheduled_time,
            first_token_time=c.first_token_time, finished_time=c.finished_time if c.is_finished else None,
            num_output_tokens=c.num_output_tokens, token_times=tuple(c.output_token_times))
    scheduled = [c.first_scheduled_time for c in completions if c.first_scheduled_time is not None]
    first_tokens = [c.first_token_time for c in completions if c.first_token_time is not None]
    finished = all(c.is_finished for c in completions)
    return RequestMetrics(
        arrival_time=completions[0].arrival_time,
        first_scheduled_time=min(scheduled, default=None),
        first_token_time=min(first_tokens, default=None),
        finished_time=max(c.finished_time for c in completions) if finished else None,
        num_output_tokens=sum(c.num_output_tokens for c in completions),
        token_times=tuple(sorted(t for c in completions for t in c.output_token_times)))
