"""Exercise checks of chapter 11 (Benchmarks): what static batching computes, the batch size,
and the tightest latency SLO a run met.

Each check judges a structural fact the learner has to reason out, never a timing against a
threshold (the machine is shared and noisy):

* ``check_static_tokens`` (11.1): how many output tokens transformers' static batching
  *computes* for the chapter's workload in batches of ``STATIC_BATCH`` (every request of a
  batch runs to the batch's longest; only the requested tokens count in tok/s). Judged with
  the benchmark's own ``static_computed_tokens``;
* ``check_max_num_seqs`` (11.2): the smallest ``max_num_seqs`` that serves
  ``SLOT_LENS`` (8 requests of uneven lengths, all queued at once) in the fewest engine
  steps, counted on a tiny random engine (mechanics only) with the learner's value, and one
  less;
* ``check_ttft_slo`` (11.3): the tightest whole-millisecond TTFT limit that at least
  ``SLO_TARGET`` of the requests of a measured run met (DistServe's SLO attainment), judged
  on that run's own per-request TTFTs, so the answer is this machine's.
"""

from __future__ import annotations

import math

from nanoengine import SamplingParams
from nanoengine.events import StepFinished
from nanobench import make_output_lens, make_workload, static_computed_tokens
from widgets._common import single_thread, tiny_engine
from widgets.exercises import CheckResult, todo, verdict, whole

NUM_REQUESTS = 8  # the chapter's workload: 8 requests, prompts 16-32 ids, 4-12 output tokens
MIN_PROMPT, MAX_PROMPT = 16, 32
MIN_OUTPUT, MAX_OUTPUT = 4, 12
SEED = 0
STATIC_BATCH = 3  # exercise 11.1: static batches of 3 requests, in workload order
SLOT_LENS = [12, 3, 3, 4, 12, 2, 5, 3]  # exercise 11.2: output tokens of 8 requests, in arrival order
SLO_TARGET = 0.9  # exercise 11.3: the share of requests that must meet the limit


def chapter_workload(vocab_limit: int = 10000) -> tuple[list[list[int]], list[int]]:
    """The chapter's requests (random token-id prompts) and their output lengths, seeded."""
    prompts = make_workload(NUM_REQUESTS, MIN_PROMPT, MAX_PROMPT, SEED, vocab_limit=vocab_limit)
    return prompts, make_output_lens(NUM_REQUESTS, MIN_OUTPUT, MAX_OUTPUT, SEED)


def check_static_tokens(computed) -> CheckResult:
    """11.1: the output tokens static batching computes for the chapter's workload."""
    name = "11.1"
    if todo(computed):
        return verdict(name, False, "", "set computed to a whole number of output tokens.")
    value = whole(computed, 0, 10**6)
    if value is None:
        return verdict(name, False, "", "computed is a whole number of tokens.")
    _, lens = chapter_workload()
    right = static_computed_tokens(lens, STATIC_BATCH)
    requested = sum(lens)
    if value == right:
        return verdict(name, True, f"{right} tokens computed for {requested} requested: "
                       f"{right - requested} were computed for requests that had already finished, and are thrown "
                       "away. Throughput counts only the requested ones, so that waste shows up as a longer run, "
                       "not as more tokens.", "")
    if value == requested:
        hint = "that is what the requests asked for; a static batch computes more than that."
    elif value < requested:
        hint = "fewer than the requests asked for: every requested token is computed, and then some."
    else:
        hint = (f"not what {STATIC_BATCH}-request batches in workload order compute: take the batches one by one, "
                "and for each, how long it runs and how many rows it has.")
    return verdict(name, False, "", hint)


def steps_to_serve(max_num_seqs: int, output_lens: list[int] | None = None) -> int:
    """Engine steps a tiny random engine (mechanics only) takes to serve ``output_lens``
    (default: the chapter's), every request queued at the start, at most ``max_num_seqs``
    per step; the prompts are the chapter's."""
    prompts, lens = chapter_workload(vocab_limit=256)
    lens = lens if output_lens is None else output_lens
    engine = tiny_engine(num_kv_blocks=256, block_size=4, max_model_len=64, max_num_seqs=max_num_seqs)
    steps = []
    engine.events.subscribe(lambda e: steps.append(e) if isinstance(e, StepFinished) else None)
    with single_thread():
        for p, n in zip(prompts, lens):
            engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    return len(steps)


def check_max_num_seqs(max_num_seqs) -> CheckResult:
    """11.2: the smallest ``max_num_seqs`` that serves ``SLOT_LENS`` in the fewest steps."""
    name = "11.2"
    if todo(max_num_seqs):
        return verdict(name, False, "", "set max_num_seqs to a whole number of sequences.")
    value = whole(max_num_seqs, 1, 256)
    if value is None:
        return verdict(name, False, "", "max_num_seqs is a whole number of sequences per step, 1 to 256.")
    fewest = steps_to_serve(len(SLOT_LENS), SLOT_LENS)  # every request in every step: nothing waits
    steps = steps_to_serve(value, SLOT_LENS)
    if steps > fewest:
        return verdict(name, False, "", f"with {value} sequences per step the workload takes {steps} steps, "
                       "not the fewest: some request starts too late to finish with the longest. Which requests "
                       "must start in the first step?")
    below = steps_to_serve(value - 1, SLOT_LENS) if value > 1 else None
    if below == steps:
        return verdict(name, False, "", f"{value} sequences per step reach the fewest steps, but so does one less: "
                       "look for the smallest. A short request that waits for a slot can still finish in time.")
    return verdict(name, True, f"{value} sequences per step serve the workload in {steps} steps, the fewest; "
                   f"{value - 1} would need {below}. The long requests must start at once, and the short ones "
                   "fit into the slots that free up; beyond that, more slots cost memory and buy nothing.", "")


def needed_ms(ttfts_s: list[float], target: float = SLO_TARGET) -> int:
    """The tightest whole-millisecond limit that at least ``target`` of ``ttfts_s`` meet."""
    k = math.ceil(target * len(ttfts_s) - 1e-9)  # requests that must be inside the limit
    return math.ceil(sorted(ttfts_s)[k - 1] * 1e3 - 1e-9)


def check_ttft_slo(run, slo_ms) -> CheckResult:
    """11.3: ``slo_ms`` against the per-request TTFTs of ``run`` (a ``widgets.throughput_explorer
    .OnlineRun``): right when at least ``SLO_TARGET`` of them are within it and one millisecond
    less would not do."""
    name = "11.3"
    if todo(slo_ms):
        return verdict(name, False, "", "set slo_ms to a number of milliseconds.")
    if isinstance(slo_ms, bool) or not isinstance(slo_ms, (int, float)) or not slo_ms > 0 \
            or (isinstance(slo_ms, float) and not slo_ms.is_integer()):
        return verdict(name, False, "", "slo_ms is a whole, positive number of milliseconds.")
    ttfts = [t for t, _ in run.latencies]
    n, k = len(ttfts), math.ceil(SLO_TARGET * len(ttfts) - 1e-9)
    met = sum(t * 1e3 <= slo_ms for t in ttfts)
    need = needed_ms(ttfts)
    if met < k:
        return verdict(name, False, "", f"with {slo_ms:g} ms, {met} of the {n} requests met the limit; at least "
                       f"{SLO_TARGET:.0%} of {n} is {k}. A percentile printed above is interpolated between "
                       "requests: which request has to be inside the limit?")
    if slo_ms > need:
        return verdict(name, False, "", f"with {slo_ms:g} ms, {met} of the {n} requests met the limit, but a "
                       "tighter limit would still be met by enough of them: find the tightest.")
    return verdict(name, True, f"{slo_ms:g} ms is met by {met} of {n} requests ({met / n:.0%}), and one millisecond "
                   f"less would leave fewer than {k}: with {n} requests, {SLO_TARGET:.0%} attainment means "
                   f"{k} of them, so the limit is set by the slowest of the {k} fastest TTFTs, not by a percentile.", "")
