"""The scheduler: which requests and how many of their tokens ride on the next step (chapter 5).

Continuous batching, vLLM v1 style: there is no global prefill or decode phase. Each step
has a *token budget* (``max_num_batched_tokens``). Running requests go first: each asks
for ``num_tokens - num_computed_tokens`` tokens (one for a request that is decoding, the
rest of its prompt, or a chunk of it, for one still prefilling). Then waiting requests are
admitted in arrival order while budget, sequence slots and KV blocks last; a prompt longer
than the remaining budget is split into chunks (chunked prefill) and finished over later
steps, so decodes never stall behind a long prompt.

When a running request needs a block and the pool is empty, the newest running request
is *preempted*: its blocks are freed, its progress reset, and it goes back to the front of
the waiting queue to be recomputed later (recompute preemption). A step that preempted
admits nobody new.

``prefill_first`` is the older policy (nano-vLLM, early vLLM) kept for comparison: a step
that can admit a waiting request runs prefill work only, and decodes wait.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.request import Request, RequestStatus
from nanoengine.events import EventBus, RequestFinished, RequestPreempted, RequestScheduled


@dataclass
class SchedulerOutput:
    """This step's batch: requests in model order and how many tokens each computes."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    token_budget: int = 0

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for r, n in self.scheduled if not self._is_decode(r, n))

    @property
    def num_decode_tokens(self) -> int:
        return sum(n for r, n in self.scheduled if self._is_decode(r, n))

    @property
    def total_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @staticmethod
    def _is_decode(request: Request, num_tokens: int) -> bool:
        """A decode computes exactly the newest token of a request with outputs."""
        return num_tokens == 1 and request.num_output_tokens > 0 \
            and request.num_computed_tokens == request.num_tokens - 1


class Scheduler:
    """Waiting and running queues, the token budget, admission and preemption."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True, policy: str = "fcfs",
                 events: EventBus | None = None) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.events = events or block_manager.events
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.step = 0
        self.num_preemptions = 0

    # ------------------------------------------------------------ lifecycle
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End ``request`` (stop, length or abort) and give its blocks back."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.block_manager.free(request)
        self.events.emit(RequestFinished(self.step, request.request_id, status.finish_reason,
                                         request.num_output_tokens))

    # ----------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch within the token budget and the KV pool."""
        out = SchedulerOutput(token_budget=self.max_num_batched_tokens)
        budget = self.max_num_batched_tokens
        if self.policy == "prefill_first":
            budget = self._schedule_prefills_only(out, budget)
            if out.scheduled:
                return self._announce(out)
        budget = self._schedule_running(out, budget)
        if not out.preempted and self.policy == "fcfs":
            self._admit_waiting(out, budget)
        return self._announce(out)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give each running request its tokens, preempting the newest when blocks run out."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens_to_compute, budget)
            while not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Move waiting requests to running while budget, slots and blocks allow."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_cached = self.block_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.block_manager.allocate_slots(request, num_new, computed_blocks):
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:  # first admission, not a recompute
                self.block_manager.prefix_queries += request.num_prompt_tokens
                self.block_manager.prefix_hits += min(num_cached, request.num_prompt_tokens)
                request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
        return budget

    def _schedule_prefills_only(self, out: SchedulerOutput, budget: int) -> int:
        """``prefill_first``: continue chunked prefills and admit new requests, no decodes."""
        for request in self.running:
            if budget == 0:
                break
            if request.num_tokens_to_compute > 1 or request.num_output_tokens == 0:
                num_new = min(request.num_tokens_to_compute, budget)
                if self.block_manager.allocate_slots(request, num_new):
                    out.scheduled.append((request, num_new))
                    budget -= num_new
        return self._admit_waiting(out, budget)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        num_blocks = len(request.block_ids)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
        self.events.emit(RequestPreempted(self.step, request.request_id, num_blocks))

    def _announce(self, out: SchedulerOutput) -> SchedulerOutput:
        for request, num_new in out.scheduled:
            self.events.emit(RequestScheduled(self.step, request.request_id, num_new,
                                              request.num_computed_tokens, not out._is_decode(request, num_new)))
        return out

    # ------------------------------------------------------------- updating
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance progress, append sampled tokens, finish requests that are done.

        ``sampled`` maps a request id to its new token; requests mid-prefill have none.
        Returns the requests that produced a token this step.
        """
        produced = []
        for request, num_new in out.scheduled:
            request.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(request)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_output_token(token)
            produced.append(request)
            status = self._check_stop(request, token)
            if status is not None:
                self.finish_request(request, status)
        return produced

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if not params.ignore_eos and token in request.eos_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
