"""Parallel sampling: one user request, ``n`` completions of the same prompt (chapter 8).

``SamplingParams(n=4)`` asks for four completions; computing the prompt four times would waste
three prefills and three copies of its KV. A ``ParentRequest`` stands for the user request and
does almost all that ``n > 1`` needs: the rest of the engine sees ordinary requests, and the
scheduler reads one mark (``Request.fork_source``), only with the prefix cache off.

1. **fan out**: the parent makes ``n`` ordinary ``Request`` objects, its *children*, named
   ``"{i}_{id}"`` (vLLM's names; with ``n == 1`` the one child keeps the user's id). Only child 0
   is queued; the siblings wait in the parent, taking no sequence slot and no block.
2. **prefill once, then release** (``ParentRequests.after_update``): once child 0 has computed the
   prompt and sampled its first token, the siblings are queued like new requests (so
   ``max_num_seqs`` and the token budget hold). An admitted sibling shares child 0's full prompt
   blocks (a ``PrefixCacheHit``; with the cache off, a ``BlocksForked``), computes only the partly
   filled last one and samples its own first token; from then on each child runs on its own.
3. **gather**: the output processor reports the ``n`` children as one ``RequestOutput``
   (``gather_metrics``); the user request ends when its last child does, or, aborted, with all.

Only *full* blocks are shared. vLLM v0 copied the partly filled last block on write (a device-side
KV copy in every worker); here each sibling recomputes its tokens instead (at most a block): no copy
kernel, and unchanged under tensor parallelism. vLLM v1's ``ParentRequest``
(vllm/v1/engine/parallel_sampling.py) queues all children at once, since it registers a block's
digest when the block is *scheduled*; this engine registers it once computed, hence the one-step
hold. If child 0 loses its blocks first, nothing stale is shared: a hit is verified as every hit
is, and a fork is taken only while child 0 holds the blocks computed (``Scheduler.computed_blocks``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

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
    """A user request's ``n`` children (``make(child_id, params, index)`` builds one), and the
    siblings still held back until the prompt is computed."""

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

    def release_siblings(self, block_size: int, fork: bool) -> list[Request]:
        """The held-back siblings, to be queued now that child 0 has computed the prompt; none after this.

        With ``fork`` (the prefix cache is off) each is marked with the blocks it may share
        (``Request.fork_source``): child 0's full prompt blocks, ``(prompt - 1) // block_size``
        of them, since the last prompt token is always left for the sibling to compute (its
        logits give the sibling's first token). With the cache on they need no mark.
        """
        siblings, self.held_back = self.held_back, []
        num_blocks = (self.first.num_prompt_tokens - 1) // block_size
        if fork and num_blocks:
            for sibling in siblings:
                sibling.fork_source = (self.first, num_blocks)
        return siblings


class ParentRequests:
    """The parents whose siblings are still held back, found by their first child's id.

    ``after_update`` costs a dict lookup per request that produced a token, nothing when no
    request has ``n > 1``. ``fork``: mark released siblings for an explicit fork (cache off).
    """

    def __init__(self, block_size: int, fork: bool) -> None:
        self.block_size = block_size
        self.fork = fork
        self.holding: dict[str, ParentRequest] = {}  # child 0's id -> its parent

    def add(self, parent: ParentRequest) -> None:
        if parent.held_back:
            self.holding[parent.first.request_id] = parent

    def after_update(self, produced: list[Request], queue: Callable[[Request], None]) -> None:
        """Hand ``queue`` the siblings of every first child that has just sampled its first token."""
        if not self.holding:
            return
        for request in produced:
            parent = self.holding.pop(request.request_id, None)
            if parent is not None:
                for sibling in parent.release_siblings(self.block_size, self.fork):
                    queue(sibling)

    def forget(self, first_child_id: str) -> None:
        """The user request was aborted: its held-back siblings are never queued."""
        self.holding.pop(first_child_id, None)


def gather_metrics(completions: list[Request]) -> RequestMetrics:
    """One request's timings over all its completions, as ``RequestMetrics`` describes them."""
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
