"""Exercise checks of chapter 5 (the scheduler): token budget, KV pool, scheduling policy.

``run_trace`` is the chapter's experiment: it feeds requests to a live engine at given
steps, steps it until every request has finished, and records what each step did from the
engine's public events and snapshots (who was scheduled, prefill and decode tokens, who
waited, who was preempted, which running decodes were skipped). The chapter runs it on the
real model (static vs continuous batching, preemption); the checks below run it on a tiny
random engine (``widgets.tiny_engine``: mechanics only, the same scheduling decisions for
the same token counts, in milliseconds):

* ``check_token_budget`` (5.1): the smallest ``max_num_batched_tokens`` with which a
  120-token prompt, arriving while three requests decode, is prefilled within 3 steps;
* ``check_pool_size`` (5.2): the smallest ``num_kv_blocks`` for which the preemption trace
  runs without a single preemption;
* ``check_skipped_decodes`` (5.3): how many decode steps the running requests lose while
  that newcomer is prefilled under ``prefill_first`` with a 36-token budget (a number to
  work out from the policy's rule, not a choice among the policies).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Sequence


from nanoengine import LLMEngine, RequestOutput, SamplingParams
from nanoengine.config import POLICIES
from nanoengine.events import RequestPreempted, RequestScheduled, StepFinished
from translations import tr
from widgets._common import TokenSource, single_thread, tiny_engine
from widgets.exercises import CheckResult, todo, verdict, whole

NEWCOMER_LEN = 120  # exercises 5.1 and 5.3: the long prompt that arrives while others decode
NEWCOMER_STEP = 3  # ... at this step
PREFILL_WITHIN = 3  # exercise 5.1: its prefill must be done within this many steps
BLOCK_SIZE = 16
PREEMPTION_PROMPTS = (20, 28, 36, 44)  # exercise 5.2: prompt tokens of the four requests
PREEMPTION_OUTPUT = 40  # ... each generating this many tokens (EOS ignored)
SKIP_BUDGET = 36  # exercise 5.3: the token budget under prefill_first
SKIP_POLICY = "prefill_first"


@dataclass(frozen=True)
class StepStat:
    """One engine step as ``run_trace`` saw it."""

    step: int
    chunks: tuple[tuple[str, int, bool], ...]  # (request id, tokens, is prefill) in scheduling order
    num_prefill_tokens: int
    num_decode_tokens: int
    preempted: tuple[str, ...]
    waiting_before: int  # requests waiting when the step began
    running_before: int  # requests running when the step began
    stalled: tuple[str, ...]  # running requests ready to decode that got no token this step
    seconds: float  # the engine's own timing of the step (StepFinished.total_time)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def scheduled(self) -> tuple[str, ...]:
        """Request ids that computed tokens this step."""
        return tuple(rid for rid, _, _ in self.chunks)


@dataclass(frozen=True)
class RequestStat:
    request_id: str
    arrival_step: int
    first_scheduled_step: int | None
    first_token_step: int | None
    finish_step: int | None
    num_prompt_tokens: int
    num_output_tokens: int
    ttft: float | None  # seconds, from the engine's RequestMetrics
    text: str


@dataclass(frozen=True)
class TraceRun:
    """What one run of a trace did, step by step and request by request."""

    policy: str
    max_num_seqs: int
    steps: tuple[StepStat, ...]
    requests: tuple[RequestStat, ...]  # in the order they were added
    preemptions: tuple[tuple[int, str, int, int], ...]  # (step, request id, blocks freed, tokens it had computed)
    recomputed_tokens: int  # token computations repeated after a preemption (a token redone twice counts twice)
    seconds: float  # wall time of the whole run
    cpu_seconds: float = 0.0  # CPU time this process spent on it (all threads): steadier on a shared machine
    times_computed: tuple[tuple[int, int], ...] = ()  # (times a token position was computed, how many positions)
    progress_at_preemption: tuple[tuple[tuple[str, int], ...], ...] = ()  # per preemption: (request, computed
    #                                             tokens) of every request running when that step began

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)

    @property
    def slot_utilisation(self) -> float:
        """Busy (step, slot) pairs over all of them: requests computing / (steps x max_num_seqs)."""
        return sum(len(s.scheduled) for s in self.steps) / (self.num_steps * self.max_num_seqs)

    @property
    def utilisation_while_waiting(self) -> float:
        """The same, over the steps that began with a request waiting (work was there to do)."""
        busy = [s for s in self.steps if s.waiting_before]
        return sum(len(s.scheduled) for s in busy) / (len(busy) * self.max_num_seqs) if busy else float("nan")

    @property
    def tokens_computed_more_than_once(self) -> dict[int, int]:
        """{times computed: token positions} for the positions computed two or more times."""
        return {times: n for times, n in self.times_computed if times > 1}

    @property
    def num_stalls(self) -> int:
        """(step, request) pairs where a running request ready to decode got no token."""
        return sum(len(s.stalled) for s in self.steps)

    def request(self, request_id: str) -> RequestStat:
        return next(r for r in self.requests if r.request_id == request_id)


Trace = Sequence[tuple[int, "str | list[int]", SamplingParams]]  # (arrival step, prompt, params)


def run_trace(engine: LLMEngine, trace: Trace) -> TraceRun:
    """Add each request of ``trace`` when its arrival step comes, step until all have finished.

    Everything recorded comes from ``engine.events`` and ``engine.snapshot()``. Recomputed
    tokens are counted as in chapter 4: after a ``RequestPreempted``, scheduled tokens
    below the progress the request had reached are computed a second time.
    """
    if engine.has_unfinished_requests():
        raise ValueError("run_trace needs an idle engine: finish or abort its requests first")
    pending = sorted(trace, key=lambda t: t[0])
    steps: list[StepStat] = []
    preemptions: list[tuple[int, str, int, int]] = []
    arrival: dict[str, int] = {}
    first_sched: dict[str, int] = {}
    first_token: dict[str, int] = {}
    finish: dict[str, int] = {}
    final: dict[str, RequestOutput] = {}
    reached: dict[str, int] = {}
    progress: dict[str, int] = {}  # tokens computed, from the last snapshot
    current: dict = {"scheduled": [], "preempted": []}
    recomputed = 0
    computed_at: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # position -> times
    progress_at_preemption: list[tuple[tuple[str, int], ...]] = []

    def on_event(event) -> None:
        nonlocal recomputed
        if isinstance(event, RequestScheduled):
            current["scheduled"].append((event.request_id, event.num_tokens, event.is_prefill))
            first_sched.setdefault(event.request_id, event.step)
            start, end = event.num_computed_tokens, event.num_computed_tokens + event.num_tokens
            before = reached.get(event.request_id, 0)
            recomputed += max(0, min(end, before) - start)
            reached[event.request_id] = max(before, end)
            computed_at[event.request_id].update(range(start, end))
        elif isinstance(event, RequestPreempted):
            current["preempted"].append(event.request_id)
            preemptions.append((event.step, event.request_id, event.num_blocks_freed,
                                progress.get(event.request_id, 0)))
            progress_at_preemption.append(tuple(current["progress"]))
        elif isinstance(event, StepFinished):
            current["finished"] = event

    unsubscribe = engine.events.subscribe(on_event)
    step = 0
    start_time, start_cpu = time.perf_counter(), time.process_time()
    try:
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][0] <= step:
                _, prompt, params = pending.pop(0)
                arrival[engine.add_request(prompt, params)] = step
            snap = engine.snapshot()
            progress.update({r.request_id: r.num_computed_tokens for r in snap.running})
            current["progress"] = [(r.request_id, r.num_computed_tokens) for r in snap.running]
            ready = [r.request_id for r in snap.running
                     if r.num_output_tokens > 0 and r.num_computed_tokens == r.num_tokens - 1]
            current.update(scheduled=[], preempted=[], finished=None)
            outputs = engine.step()
            done = current["finished"]
            if done is not None:
                sched = tuple(current["scheduled"])
                steps.append(StepStat(step, sched, done.num_prefill_tokens, done.num_decode_tokens,
                                      tuple(current["preempted"]), len(snap.waiting), len(snap.running),
                                      tuple(r for r in ready if r not in {c[0] for c in sched}), done.total_time))
            for out in outputs:
                if out.token_ids:
                    first_token.setdefault(out.request_id, step)
                if out.finished:
                    finish[out.request_id] = step
                    final[out.request_id] = out
            step += 1
    finally:
        unsubscribe()
    seconds, cpu_seconds = time.perf_counter() - start_time, time.process_time() - start_cpu
    requests = tuple(RequestStat(rid, arrival[rid], first_sched.get(rid), first_token.get(rid), finish.get(rid),
                                 len(final[rid].prompt_token_ids), len(final[rid].token_ids),
                                 final[rid].metrics.ttft, final[rid].text) for rid in arrival)
    histogram = collections.Counter(times for counts in computed_at.values() for times in counts.values())
    return TraceRun(engine.config.scheduling_policy, engine.config.max_num_seqs, tuple(steps), requests,
                    tuple(preemptions), recomputed, seconds, cpu_seconds, tuple(sorted(histogram.items())),
                    tuple(progress_at_preemption))


# --------------------------------------------------------- exercises 5.1 and 5.3
def newcomer_trace(vocab_size: int = 256) -> list[tuple[int, list[int], SamplingParams]]:
    """Three short requests decoding 40 tokens each; at step 3 a 120-token prompt arrives."""
    tokens = TokenSource(vocab_size, seed=5)
    decoding = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    trace = [(0, tokens.tokens(8), decoding) for _ in range(3)]
    trace.append((NEWCOMER_STEP, tokens.tokens(NEWCOMER_LEN), SamplingParams(temperature=0.0, max_tokens=8,
                                                                             ignore_eos=True)))
    return trace


def newcomer_run(max_num_batched_tokens: int = 32, scheduling_policy: str = "fcfs") -> TraceRun:
    """``newcomer_trace`` on a tiny engine with the given budget and policy."""
    # max_num_seqs may not exceed the budget (a running request needs a token of every step)
    engine = tiny_engine(num_kv_blocks=64, block_size=BLOCK_SIZE, max_model_len=256,
                         max_num_seqs=min(8, max_num_batched_tokens),
                         max_num_batched_tokens=max_num_batched_tokens, scheduling_policy=scheduling_policy,
                         enable_prefix_caching=False)
    with single_thread():
        return run_trace(engine, newcomer_trace())


def check_token_budget(max_num_batched_tokens) -> CheckResult:
    """5.1: the smallest budget that prefills the newcomer within 3 steps of its arrival."""
    if todo(max_num_batched_tokens):
        return verdict("5.1", False, "", tr("replace ... with a token budget per step (a whole number from 1 to "
                                            "512), then run the cell again."))
    b = whole(max_num_batched_tokens, 1, 512)
    if b is None:
        return verdict("5.1", False, "", tr("max_num_batched_tokens must be a whole number from 1 to 512, "
                                            "got {value!r}.", value=max_num_batched_tokens))

    def steps_to_prefill(budget: int) -> tuple[int, TraceRun]:
        run = newcomer_run(budget)
        newcomer = run.requests[-1]
        return newcomer.first_token_step - newcomer.arrival_step + 1, run

    took, run = steps_to_prefill(b)
    chunks = [n for s in run.steps for rid, n, prefill in s.chunks
              if rid == run.requests[-1].request_id and prefill]
    seen = tr("With a {b}-token budget the {length}-token prompt took {took} step(s) (chunks of {chunks}) and "
              "running decodes were skipped {stalls} time(s)",
              b=b, length=NEWCOMER_LEN, took=took, chunks=chunks, stalls=run.num_stalls)
    if took > PREFILL_WITHIN:
        return verdict("5.1", False, "", tr("{seen}: too slow. Each step the three decodes take their token "
                                            "first; the prompt gets what is left of the budget.", seen=seen))
    smaller, _ = steps_to_prefill(b - 1) if b > 1 else (PREFILL_WITHIN + 1, None)
    if smaller <= PREFILL_WITHIN:
        return verdict("5.1", False, "", tr("{seen}: fast enough, but not the smallest budget that is. Work out "
                                            "how many prompt tokens each of the {within} steps must carry.",
                                            seen=seen, within=PREFILL_WITHIN))
    return verdict("5.1", True, tr("{seen}; {fewer} would need {smaller}. Three decodes take 3 tokens of every "
                                   "step, so 3 x ({b} - 3) >= {length} is what the chunks need.",
                                   seen=seen, fewer=b - 1, smaller=smaller, b=b, length=NEWCOMER_LEN), "")


# ------------------------------------------------------------------ exercise 5.2
def preemption_trace(vocab_size: int = 256) -> list[tuple[int, list[int], SamplingParams]]:
    """Four requests at once: prompts of 20, 28, 36 and 44 tokens, 40 output tokens each."""
    tokens = TokenSource(vocab_size, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=PREEMPTION_OUTPUT, ignore_eos=True)
    return [(0, tokens.tokens(n), params) for n in PREEMPTION_PROMPTS]


def preemption_run(num_kv_blocks: int, scheduling_policy: str = "fcfs",
                   max_num_batched_tokens: int = 2048) -> TraceRun:
    """``preemption_trace`` on a tiny engine with a pool of ``num_kv_blocks`` 16-token blocks."""
    engine = tiny_engine(num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZE, max_model_len=96,
                         scheduling_policy=scheduling_policy, enable_prefix_caching=False,
                         max_num_batched_tokens=max_num_batched_tokens)
    with single_thread():
        return run_trace(engine, preemption_trace())


def check_pool_size(num_kv_blocks) -> CheckResult:
    """5.2: the smallest pool with which the preemption trace runs without a preemption."""
    low = 96 // BLOCK_SIZE
    if todo(num_kv_blocks):
        return verdict("5.2", False, "", tr("replace ... with a number of {bs}-token blocks (a whole number from "
                                            "{low} to 64), then run the cell again.", bs=BLOCK_SIZE, low=low))
    n = whole(num_kv_blocks, low, 64)
    if n is None:
        return verdict("5.2", False, "", tr("num_kv_blocks must be a whole number from {low} to 64, "
                                            "got {value!r}.", low=low, value=num_kv_blocks))
    run = preemption_run(n)
    seen = tr("With {n} blocks the trace took {steps} steps, {preemptions} preemption(s) and {recomputed} "
              "recomputed tokens", n=n, steps=run.num_steps, preemptions=len(run.preemptions),
              recomputed=run.recomputed_tokens)
    if run.preemptions:
        return verdict("5.2", False, "", tr("{seen}: the pool is too small. Count the blocks each request holds "
                                            "when it finishes.", seen=seen))
    fewer = preemption_run(n - 1) if n > low else None
    if fewer is not None and not fewer.preemptions:
        return verdict("5.2", False, "", tr("{seen}: no preemption, but this is not the smallest such pool. Count "
                                            "the blocks each request holds at the end instead of trying values.",
                                            seen=seen))
    return verdict("5.2", True, tr("{seen}; with {fewer} blocks it preempts {preemptions} time(s). A request holds "
                                   "ceil((prompt + output - 1) / {bs}) blocks at the end: the last sampled token is "
                                   "never written to the cache.", seen=seen, fewer=n - 1,
                                   preemptions=len(fewer.preemptions), bs=BLOCK_SIZE), "")


# ------------------------------------------------------------------ exercise 5.3
def check_skipped_decodes(skipped) -> CheckResult:
    """5.3: decode steps lost by the three running requests under prefill_first, budget 36.

    The answer is a count to reason out from the policy's rule (a step that has prefill work
    runs prefill only, and the prompt is cut into chunks of the budget); the check runs the
    trace and compares with what the engine did.
    """
    if todo(skipped):
        return verdict("5.3", False, "", tr("replace ... with a number of skipped decode steps (a whole number "
                                            "from 0 to 100), then run the cell again."))
    n = whole(skipped, 0, 100)
    if n is None:
        return verdict("5.3", False, "", tr("skipped must be a whole number from 0 to 100, got {value!r}.",
                                            value=skipped))
    run = newcomer_run(SKIP_BUDGET, SKIP_POLICY)
    newcomer = run.requests[-1]
    chunks = [k for s in run.steps for rid, k, prefill in s.chunks if rid == newcomer.request_id and prefill]
    if n == run.num_stalls:
        return verdict("5.3", True, tr("The {length}-token prompt went in chunks of {chunks}; each of those "
                                       "{n_chunks} steps ran prefill only, so each of the 3 running requests lost a "
                                       "decode step in each: {stalls}. Under fcfs the same trace loses "
                                       "{fcfs_stalls}.", length=NEWCOMER_LEN, chunks=chunks, n_chunks=len(chunks),
                                       stalls=run.num_stalls,
                                       fcfs_stalls=newcomer_run(SKIP_BUDGET, 'fcfs').num_stalls), "")
    if n == 0:
        hint = tr("under prefill_first a step that can do prefill work does only that: do the running requests "
                  "get their token in it?")
    elif n % 3:
        hint = tr("each prefill-only step costs every running request its token, and three are running: the "
                  "count is a multiple of 3.")
    else:
        hint = tr("{n} is {steps} prefill-only step(s) for each of the 3 running requests: into how many chunks "
                  "of at most {budget} tokens is a {length}-token prompt cut?",
                  n=n, steps=n // 3, budget=SKIP_BUDGET, length=NEWCOMER_LEN)
    return verdict("5.3", False, "", tr("{n} is not what the engine did: {hint}", n=n, hint=hint))


__all__ = ["RequestStat", "StepStat", "TraceRun", "check_pool_size", "check_skipped_decodes", "check_token_budget",
           "newcomer_run", "newcomer_trace", "preemption_run", "preemption_trace", "run_trace"]
