"""Parallel sampling: one user request, ``n`` completions of the same prompt (chapter 8).

``SamplingParams(n=4)`` asks for four completions. Computing the prompt four times would
waste three prefills and three copies of its KV, so the request fans out like this:

1. **fan out** (``fan_out``): the user request becomes ``n`` engine requests, the
   *completions*, named ``"{i}_{id}"`` (vLLM's names; with ``n == 1`` the one completion
   keeps the user's id). A seeded request gives completion ``i`` the seed ``seed + i``,
   so each is reproducible and they differ from one another. Completion 0 is the
   *leader*: it alone is queued; the others wait in its ``forks`` and take no blocks.
2. **prefill once**: the scheduler admits the leader with a sequence slot for each fork
   (``Request.num_seats``), and computes the prompt once.
3. **fork** (``join_forks``): when the leader samples its first token, the model runner
   samples one for each fork from the same logits, and the forks join the running queue
   sharing the leader's full prompt blocks (``BlockManager.fork``); only the partial last
   block is recomputed by each. From then on they are independent requests.
4. **gather**: the output processor reports the ``n`` completions as one
   ``RequestOutput`` (``gather_metrics`` covers the timings); the user request ends when
   its last completion does.

vLLM v1 keeps the same idea in vllm/v1/engine/parallel_sampling.py (a ``ParentRequest``
that makes the child requests and their seeds and gathers their outputs), and shares
the prompt through its prefix cache rather than an explicit fork.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.request import Request, RequestStatus
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


def fan_out(request_id: str, params: SamplingParams,
            make: Callable[[str, SamplingParams, int], Request]) -> list[Request]:
    """The n completions, in index order; the leader (index 0) carries the others as forks.

    ``make(completion_id, params, index)`` builds one ``Request``.
    """
    completions = [make(child_id, completion_params(params, i), i)
                   for i, child_id in enumerate(completion_ids(request_id, params.n))]
    completions[0].forks = completions[1:]
    return completions


def join_forks(leader: Request, block_manager: BlockManager) -> list[Request]:
    """The leader's prompt is computed: its forks share its full blocks and start running.

    Returns the forks, now RUNNING; the caller puts them in its running queue and gives
    each the token sampled for it.
    """
    forks, leader.forks = leader.forks, []
    num_full_blocks = leader.num_computed_tokens // block_manager.block_size
    for fork in forks:
        block_manager.fork(leader, fork, num_full_blocks)
        fork.num_computed_tokens = num_full_blocks * block_manager.block_size
        fork.num_cached_tokens = leader.num_cached_tokens
        fork.first_scheduled_time = leader.first_scheduled_time
        fork.status = RequestStatus.RUNNING
    return forks


def check_forks(requests: list[Request]) -> None:
    """Raise if a fork holds blocks or has started before its leader's prompt was computed."""
    for request in requests:
        for fork in request.forks:
            if fork.block_ids or fork.status != RequestStatus.WAITING:
                raise AssertionError(f"fork {fork.request_id} of {request.request_id} is {fork.status.value} "
                                     f"with blocks {fork.block_ids} before its prompt was computed")


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
