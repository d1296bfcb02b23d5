"""The scheduler: which requests and how many of their tokens ride on the next step (chapter 5).

Continuous batching, vLLM v1 style: there is no global prefill or decode phase. Each step
has a *token budget* (``max_num_batched_tokens``). Running requests go first: each asks
for ``num_tokens - num_computed_tokens`` tokens (one for a request that is decoding, the
rest of its prompt, or a chunk of it, for one still prefilling). Then waiting requests are
admitted in arrival order while budget, sequence slots and KV blocks last; a prompt longer
than the remaining budget is split into chunks (chunked prefill) and finished over later
steps, so decodes never stall behind a long prompt.

At admission a request skips the leading full blocks that are already computed: hits in
the prefix cache, or, for a parallel-sampling sibling with the cache off, the prompt its
first completion computed (``computed_blocks``); the block manager shares them.

When a running request needs a block and the pool is empty, the newest running request
is *preempted*: its blocks are freed, its progress reset, and it goes back to the front of
the waiting queue to be recomputed later (recompute preemption). A step that preempted
admits nobody new.

That order is the ``fcfs`` policy's; ``engine/scheduling_policy.py`` says what a policy
decides, and has the other two (``prefill_first``, ``static``).

Each scheduled request gets a ``ScheduledRequest`` that the runner, the events and the step
statistics all read: whether it is a prefill chunk or a decode (decided here, once), the
blocks it gained for the step (``new_block_ids``, what ``engine/block_table.py`` appends), and
the drafts it checks (speculative decoding, chapter 13: ``_fitting_drafts``). Whether a
request has finished after a token is decided in one function, ``check_stop``, and applied
in one place, ``update_from_output``, as in vLLM v1's scheduler.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanoengine.engine.block_manager import BlockManager, gained_blocks
from nanoengine.engine.request import Request, RequestStatus
from nanoengine.engine.scheduling_policy import make_policy
from nanoengine.events import DraftsVerified, EventBus, RequestFinished, RequestPreempted, RequestScheduled
from nanoengine.spec_decode.metrics import SpecDecodeStats

if TYPE_CHECKING:
    from nanoengine.engine.model_runner import ModelRunnerOutput
    from nanoengine.engine.output_processor import OutputProcessor


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's part of a step, decided by the scheduler and fixed for the step: ``num_computed_tokens``
    is the progress *before* the step, so what derives from the record (positions, which kernel, token
    counts) stays true after ``update_from_output`` has moved the request on."""

    request: Request
    num_tokens: int  # tokens computed this step
    num_computed_tokens: int  # tokens already in the KV cache before this step
    is_prefill: bool  # False: one new token (and its drafts) over a cached context (the decode kernel)
    samples: bool  # reaches the request's last known token, so a new token is sampled
    draft_token_ids: tuple[int, ...] = ()  # speculative tokens checked this step (counted in num_tokens)
    new_block_ids: tuple[int, ...] = ()  # the last blocks of request.block_ids, gained for this step

    @classmethod
    def make(cls, request: Request, num_tokens: int, draft_token_ids: tuple[int, ...] = (),
             new_block_ids: tuple[int, ...] = ()) -> "ScheduledRequest":
        start = request.num_computed_tokens
        known = num_tokens - len(draft_token_ids)  # tokens of the request itself, without the guesses
        return cls(request, num_tokens, start, is_prefill=not (known == 1 and start > 0),
                   samples=start + known == request.num_tokens, draft_token_ids=draft_token_ids,
                   new_block_ids=new_block_ids)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def positions(self) -> range:
        return range(self.num_computed_tokens, self.num_computed_tokens + self.num_tokens)


@dataclass
class SchedulerOutput:
    """This step's batch: what each scheduled request computes, in scheduling order."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    token_budget: int = 0

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if not s.is_prefill)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_draft_tokens(self) -> int:
        return sum(s.num_draft_tokens for s in self.scheduled)

    def add(self, request: Request, num_tokens: int, draft_token_ids: tuple[int, ...] = (),
            new_block_ids: tuple[int, ...] = ()) -> None:
        """Schedule ``num_tokens`` of ``request`` (``draft_token_ids`` among them); ``new_block_ids``: the
        blocks allocated for them, the last of its ``block_ids`` (``gained_blocks``)."""
        self.scheduled.append(ScheduledRequest.make(request, num_tokens, draft_token_ids, new_block_ids))


class Scheduler:
    """Waiting and running queues, the token budget, admission and preemption."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True, policy: str = "fcfs",
                 events: EventBus | None = None, spec_decode_stats: SpecDecodeStats | None = None) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = make_policy(policy)  # in what order a step is filled (scheduling_policy.py)
        self.events = events or block_manager.events
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.step = 0  # the step being scheduled, stamped on events (``schedule``)
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens at first admission (a recompute is no new query)
        self.prefix_hits = 0  # those of them the prefix cache held
        self.spec_decode_stats = spec_decode_stats or SpecDecodeStats(0)  # what each verify pass accepted

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
        request.finished_time = time.perf_counter()
        self.policy.forget(request)
        request.fork_source = None  # a sibling aborted while waiting: nothing to share any more
        self.block_manager.free(request)
        self.events.emit(RequestFinished(self.step, request.request_id, status.finish_reason,
                                         request.num_output_tokens))

    def schedule(self, step: int) -> SchedulerOutput:
        """Pick the batch of step number ``step`` (what its events and the block manager's carry) within the
        token budget and the KV pool, in the policy's order (``fcfs``: ``schedule_running``, then
        ``admit_waiting`` unless someone was preempted)."""
        self.step = self.block_manager.step = step
        out = SchedulerOutput(token_budget=self.max_num_batched_tokens)
        self.policy.schedule(self, out)
        now, announce = time.perf_counter(), self.events.wants(RequestScheduled)
        for s in out.scheduled:
            if s.request.first_scheduled_time is None:  # its queueing delay ends
                s.request.first_scheduled_time = now
            if announce:
                self.events.emit(RequestScheduled(self.step, s.request.request_id, s.num_tokens,
                                                  s.num_computed_tokens, s.is_prefill))
        return out

    def schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give each running request its tokens, preempting the newest when blocks run out."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            held = len(request.block_ids)
            num_new = min(request.num_tokens_to_compute, budget)
            drafts = self._fitting_drafts(request, budget)  # if any, their slots (and its token's) are allocated
            while not drafts and not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.add(request, num_new + len(drafts), drafts, gained_blocks(request, held))
                budget -= num_new + len(drafts)
                i += 1
        return budget

    def _fitting_drafts(self, request: Request, budget: int) -> tuple[int, ...]:
        """The drafts a decoding request checks this step, their slots allocated; () if none fit.

        As many as the budget leaves room for next to the request's own token; none when
        their slots would need blocks the pool does not have (a plain decode then, which
        may preempt as usual: guesses never push a request out).
        """
        if not request.spec_token_ids or request.num_tokens_to_compute != 1:
            return ()
        drafts = tuple(request.spec_token_ids[:budget - 1])
        if drafts and self.block_manager.allocate_slots(request, 1 + len(drafts)):
            return drafts
        return ()

    def admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Move waiting requests to running while budget, slots and blocks allow.

        A request whose grammar is still compiling is passed over, not waited for: the ones
        behind it may go first, and it keeps its place at the front for the next step.
        """
        compiling = []
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if request.waits_for_grammar:
                compiling.append(self.waiting.popleft())
                continue
            if len(self.running) >= self.max_num_seqs or not self.policy.may_admit(request):
                break  # no free slot, or (static batching) the current batch must finish first
            computed_blocks, num_cached, forked_from = self.computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.block_manager.allocate_slots(request, num_new, computed_blocks, forked_from):
                break
            request.fork_source = None  # admitted: shared or computed, the mark has done its work
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:  # first admission, not a recompute
                self.prefix_queries += request.num_prompt_tokens
                self.prefix_hits += min(num_cached, request.num_prompt_tokens)
                request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.add(request, num_new, new_block_ids=gained_blocks(request, 0))  # a waiting request held none
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))
        return budget

    def computed_blocks(self, request: Request) -> tuple[list[int], int, str | None]:
        """The leading full blocks ``request`` need not compute: (block ids, their tokens, forked from).

        Usually the prefix cache's hits. A sibling with ``fork_source`` (``parallel_sampling``, cache off)
        takes that completion's full prompt blocks only while they are computed (a preempted or finished
        source holds none); else it computes its prompt like any request.
        """
        if request.fork_source is not None:
            source, num_blocks = request.fork_source
            num_tokens = num_blocks * self.block_manager.block_size
            if source.num_computed_tokens >= num_tokens and len(source.block_ids) >= num_blocks:
                return source.block_ids[:num_blocks], num_tokens, source.request_id
        computed_blocks, num_cached = self.block_manager.get_computed_blocks(request)
        return computed_blocks, num_cached, None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        num_blocks = len(request.block_ids)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
        self.events.emit(RequestPreempted(self.step, request.request_id, num_blocks))

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput,
                           detokenizer: OutputProcessor) -> list[Request]:
        """The step's tokens into their requests, each stop decided; returns the requests that produced one.

        Progress advances by the tokens each request computed. The new tokens (up to k+1 after k drafts:
        ``accept_token``) are taken in rounds, token i of every request in round i, as plain decoding would
        have taken them; after each round the output processor reads them (logprobs, text, stop strings)
        and ``check_stop`` decides, so nothing after a stop is emitted. Last, the blocks only rejected
        drafts used go back. A request in ``result.failed`` takes nothing more; the engine ends it.
        """
        now = time.perf_counter()
        produced = []
        for s in out.scheduled:
            request = s.request
            request.num_computed_tokens += s.num_tokens - s.num_draft_tokens
            self._cache_if_filled(request)
            if result.sampled.get(request.request_id):
                produced.append(request)
        faults = result.failed
        for index in range(max((len(result.sampled[r.request_id]) for r in produced), default=0)):
            batch = [r for r in produced if len(result.sampled[r.request_id]) > index and not r.is_finished
                     and r.request_id not in faults]
            for request in batch:
                token = result.sampled[request.request_id][index]
                if request.structured_output is not None and not self._advance_grammar(request, token, faults):
                    continue
                if index == 0:
                    request.append_output_token(token, now)
                else:
                    self.accept_token(request, token, now)
            if faults:
                batch = [r for r in batch if r.request_id not in faults]
            logprobs = {r.request_id: result.logprobs[r.request_id][index] for r in batch
                        if r.request_id in result.logprobs}
            stop_strings = detokenizer.detokenize(batch, logprobs, faults)
            for request in batch:
                if request.request_id not in faults:
                    self.finish_if_stopped(request, stop_strings.get(request.request_id))
        if out.num_draft_tokens:
            self._observe_drafts(out, result.sampled)
            self.release_rejected_slots(out)
        return produced

    @staticmethod
    def _advance_grammar(request: Request, token: int, faults: dict[str, Exception]) -> bool:
        """Advance ``request``'s grammar by its new token (chapter 14); False, with the fault
        recorded, if the grammar refuses it: the step's mask allowed only what the grammar
        accepts, so that is an engine bug, and the token is never emitted."""
        if request.structured_output.grammar.accept_tokens(request.request_id, [token]):
            return True
        faults[request.request_id] = RuntimeError(
            f"token {token} was sampled for request {request.request_id} but its grammar does not allow it "
            f"there (after {request.num_output_tokens} output tokens): the step's bitmask and the grammar disagree")
        return False

    def _observe_drafts(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Count what each verify pass accepted (the counts vLLM reports) and announce it (``DraftsVerified``)."""
        announce = self.events.wants(DraftsVerified)
        for s in out.scheduled:
            if s.num_draft_tokens and s.request.request_id in sampled:
                emitted = sampled[s.request.request_id]
                self.spec_decode_stats.observe(s.draft_token_ids, emitted)
                if announce:
                    self.events.emit(DraftsVerified(self.step, s.request.request_id, s.draft_token_ids,
                                                    tuple(emitted)))

    def accept_token(self, request: Request, token: int, now: float | None = None) -> None:
        """One more token of an accepted run (after its first): the draft before it was right, so
        its KV, written by the verify pass, counts as computed."""
        request.num_computed_tokens += 1
        self._cache_if_filled(request)
        request.append_output_token(token, now)

    def release_rejected_slots(self, out: SchedulerOutput) -> None:
        """Give back the blocks that only this step's rejected drafts used. Rejected slots lie at or after
        the first uncomputed position, so no later step reads them and no block holding them is hashed;
        the next step overwrites those in the blocks it keeps."""
        for s in out.scheduled:
            if s.num_draft_tokens and s.request.status == RequestStatus.RUNNING:
                self.block_manager.release_slots_after(s.request, s.request.num_tokens)

    def _cache_if_filled(self, request: Request) -> None:
        if request.num_computed_tokens >= (len(request.block_hashes) + 1) * self.block_manager.block_size:
            self.block_manager.cache_full_blocks(request)

    def finish_if_stopped(self, request: Request, stop_string: str | None = None) -> None:
        """Finish ``request`` if its newest token ends it (see ``check_stop``)."""
        decision = check_stop(request, stop_string, self.max_model_len)
        if decision is not None:
            status, request.stop_reason = decision
            self.finish_request(request, status)


def check_stop(request: Request, stop_string: str | None,
               max_model_len: int) -> tuple[RequestStatus, str | int | None] | None:
    """Whether ``request`` is done after its newest token: (status, stop_reason), or None.

    The one place that decides a request has finished by itself (an abort is ``LLMEngine.abort``'s).
    The first rule below that holds wins, so a stop matched on the last allowed token still reports
    "stop", as vLLM (``check_stop`` in vllm/v1/core/sched/utils.py) and the OpenAI API do. The stop
    reason is the stop token id or stop string that matched, else None. A complete grammar stops
    here, where vLLM forces EOS and stops on that: one step saved, the same text.
    """
    token = request.output_token_ids[-1]
    params = request.sampling_params
    if not params.ignore_eos and token in request.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED, None
    if token in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED, token
    if stop_string is not None:
        return RequestStatus.FINISHED_STOPPED, stop_string
    if request.structured_output is not None and request.structured_output.grammar.is_terminated():
        return RequestStatus.FINISHED_STOPPED, None
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None
