"""Exercise checks of chapter 11 (Benchmarks): what static batching computes, the batch size,
and the tightest latency SLO a run met.

Each check judges a structural fact the learner has to reason out, never a timing against a
threshold (the machine is shared and noisy):

* ``check_static_tokens`` (11.1): how many output tokens transformers' static batching
  *computes* for the chapter's workload in batches of ``STATIC_BATCH`` (every request of a
  batch runs to the batch's longest; only the requested tokens count in tok/s). Judged with
  the benchmark's own ``static_computed_tokens``;
* ``check_max_num_seqs`` (11.2): the smallest ``max_num_seqs`` that serves ``SLOT_LENS`` (8
  requests of uneven lengths, all queued at once) in the fewest engine steps, counted on a tiny
  random engine (mechanics only) with the learner's value, and one less;
* ``check_ttft_slo`` (11.3): the tightest whole-millisecond TTFT limit that at least
  ``SLO_TARGET`` of the requests of a measured run met (DistServe's SLO attainment), judged
  on that run's own per-request TTFTs, so the answer is this machine's.
"""

from __future__ import annotations

import math

from nanoengine import SamplingParams
from nanoengine.events import StepFinished
from nanobench import make_output_lens, make_workload, static_computed_tokens
from translations import tr
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
        return verdict(name, False, "", tr("set computed to a whole number of output tokens."))
    value = whole(computed, 0, 10**6)
    if value is None:
        return verdict(name, False, "", tr("computed is a whole number of tokens."))
    _, lens = chapter_workload()
    right = static_computed_tokens(lens, STATIC_BATCH)
    requested = sum(lens)
    if value == right:
        return verdict(name, True, tr("{right} tokens computed for {requested} requested: "
                                      "{wasted} were computed for requests that had already finished, and are thrown "
                                      "away. Throughput counts only the requested ones, so that waste shows up as a "
                                      "longer run, not as more tokens.",
                                      right=right, requested=requested, wasted=right - requested), "")
    if value == requested:
        hint = tr("that is what the requests asked for; a static batch computes more than that.")
    elif value < requested:
        hint = tr("fewer than the requests asked for: every requested token is computed, and then some.")
    else:
        hint = tr("not what {batch}-request batches in workload order compute: take the batches one by one, "
                  "and for each, how long it runs and how many rows it has.", batch=STATIC_BATCH)
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
        return verdict(name, False, "", tr("set max_num_seqs to a whole number of sequences."))
    value = whole(max_num_seqs, 1, 256)
    if value is None:
        return verdict(name, False, "", tr("max_num_seqs is a whole number of sequences per step, 1 to 256."))
    fewest = steps_to_serve(len(SLOT_LENS), SLOT_LENS)  # every request in every step: nothing waits
    steps = steps_to_serve(value, SLOT_LENS)
    if steps > fewest:
        return verdict(name, False, "", tr("with {value} sequences per step the workload takes {steps} steps, "
                                           "not the fewest: some request starts too late to finish with the longest. "
                                           "Which requests must start in the first step?", value=value, steps=steps))
    below = steps_to_serve(value - 1, SLOT_LENS) if value > 1 else None
    if below == steps:
        return verdict(name, False, "", tr("{value} sequences per step reach the fewest steps, but so does one "
                                           "less: look for the smallest. A short request that waits for a slot can "
                                           "still finish in time.", value=value))
    return verdict(name, True, tr("{value} sequences per step serve the workload in {steps} steps, the fewest; "
                                  "{fewer} would need {below}. The long requests must start at once, and the short "
                                  "ones fit into the slots that free up; beyond that, more slots cost memory and buy "
                                  "nothing.", value=value, steps=steps, fewer=value - 1, below=below), "")


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
        return verdict(name, False, "", tr("set slo_ms to a number of milliseconds."))
    if isinstance(slo_ms, bool) or not isinstance(slo_ms, (int, float)) or not slo_ms > 0 \
            or (isinstance(slo_ms, float) and not slo_ms.is_integer()):
        return verdict(name, False, "", tr("slo_ms is a whole, positive number of milliseconds."))
    ttfts = [t for t, _ in run.latencies]
    n, k = len(ttfts), math.ceil(SLO_TARGET * len(ttfts) - 1e-9)
    met = sum(t * 1e3 <= slo_ms for t in ttfts)
    need = needed_ms(ttfts)
    if met < k:
        return verdict(name, False, "", tr("with {slo_ms:g} ms, {met} of the {n} requests met the limit; at least "
                                           "{target:.0%} of {n} is {k}. A percentile printed above is interpolated "
                                           "between requests: which request has to be inside the limit?",
                                           slo_ms=slo_ms, met=met, n=n, target=SLO_TARGET, k=k))
    if slo_ms > need:
        return verdict(name, False, "", tr("with {slo_ms:g} ms, {met} of the {n} requests met the limit, but a "
                                           "tighter limit would still be met by enough of them: find the tightest.",
                                           slo_ms=slo_ms, met=met, n=n))
    return verdict(name, True, tr("{slo_ms:g} ms is met by {met} of {n} requests ({share:.0%}), and one millisecond "
                                  "less would leave fewer than {k}: with {n} requests, {target:.0%} attainment means "
                                  "{k} of them, so the limit is set by the slowest of the {k} fastest TTFTs, not by a "
                                  "percentile.", slo_ms=slo_ms, met=met, n=n, share=met / n, k=k, target=SLO_TARGET),
                   "")


# ------------------------------------------------------------------ the chapter's readings
# Each reading below turns the numbers a cell measured into the sentence the cell prints, so the
# sentence follows the numbers: it says the opposite when they do (tests/course/test_exercises_ch11.py
# feeds each one numbers on both sides of its thresholds). Chapters 9 and 12 use ``step_settings``.

def step_settings(engine, *, batch: str, context: str, threads: int | None = None) -> str:
    """Under which settings a decode-step time or a TTFT was measured, in one line: batch, context,
    dtype, device, CPU threads, and how the model ran (``LLMEngine.forward_mode``: on a CPU one native
    call per decoder layer unless ``enforce_eager``, chapter 10; on CUDA, graphs unless ``enforce_eager``). ``engine`` is an ``LLM``, an ``LLMEngine`` or an ``EngineConfig``;
    ``threads`` overrides torch's thread count (a tensor-parallel worker runs its own)."""
    import torch

    engine = getattr(engine, "engine", engine)
    cfg = getattr(engine, "config", engine)
    device = cfg.torch_device.type
    if hasattr(engine, "forward_mode"):  # an engine says how it runs its model (LLMEngine.forward_mode)
        mode = engine.forward_mode
    else:  # a configuration: what it asks for
        mode = ("eager with compiled fused ops" if cfg.compile else "eager" if cfg.enforce_eager or device != "cpu"
                else "eager (one native call per decoder layer where the layers fuse)")
        if device == "cuda":
            mode += ", no CUDA graphs" if cfg.enforce_eager else ", CUDA graphs"
    threads = torch.get_num_threads() if threads is None else threads
    dtype = str(cfg.torch_dtype).removeprefix("torch.")
    return tr("settings: {batching}, {context}, {dtype} on {device}, {threads} CPU thread(s) per process, {mode}",
              batching=batch, context=context, dtype=dtype, device=device, threads=threads, mode=mode)


def read_first_call(first_s: float, warm_s: float) -> str:
    """Section 1: did the first call after the build pay a cold cost of its own (> 1.2x the warm median)?"""
    ratio = first_s / warm_s
    if ratio > 1.2:
        return tr("({ratio:.2f}x): the first call paid a cold cost of its own", ratio=ratio)
    return tr("({ratio:.2f}x): the first call paid little extra here, so this engine's cold cost sat in the build",
              ratio=ratio)


def read_oversized_cache(setup_ratio: float, big_run_s: float, runs_min_s: float, runs_max_s: float) -> str:
    """Section 3: what a 16x cache did to the manager's setup and to its generation run."""
    inside = runs_min_s * 0.9 <= big_run_s <= runs_max_s * 1.1
    setup = (tr("the 16x cache made the setup {ratio:.1f}x longer", ratio=setup_ratio) if setup_ratio > 1 else
             tr("the 16x cache made the setup {ratio:.1f}x shorter", ratio=setup_ratio))
    run = (tr("its generation run fell within 10% of the sized cache's range of runs") if inside else
           tr("its generation run fell outside the sized cache's range of runs by more than 10%"))
    return setup + "; " + run


def _moved(ratio: float, what: str) -> str:
    if ratio >= 1.25:
        return tr("{what} climbed ({ratio:.1f}x)", what=what, ratio=ratio)
    if ratio <= 0.8:
        return tr("{what} fell ({ratio:.1f}x)", what=what, ratio=ratio)
    return tr("{what} stayed within 25% ({ratio:.1f}x)", what=what, ratio=ratio)


def read_online(rows: list[dict], offline_tok_s: float) -> str:
    """Section 4: from the lowest offered rate to the highest, how TTFT p50, TPOT p50 and throughput moved."""
    lo, hi = rows[0], rows[-1]
    ttft, tpot = hi["ttft_ms"]["p50"] / lo["ttft_ms"]["p50"], hi["tpot_ms"]["p50"] / lo["tpot_ms"]["p50"]
    return tr("from {lo_rate:g} to {hi_rate:g} req/s, {ttft}, {tpot}; throughput {lo_tok_s:.1f} -> {hi_tok_s:.1f} "
              "tok/s ({share:.0%} of the offline figure)",
              lo_rate=lo['rate_requests_per_s'], hi_rate=hi['rate_requests_per_s'],
              ttft=_moved(ttft, tr("TTFT p50 {lo:.0f} -> {hi:.0f} ms",
                                   lo=lo['ttft_ms']['p50'], hi=hi['ttft_ms']['p50'])),
              tpot=_moved(tpot, tr("TPOT p50 {lo:.0f} -> {hi:.0f} ms",
                                   lo=lo['tpot_ms']['p50'], hi=hi['tpot_ms']['p50'])),
              lo_tok_s=lo['output_tokens_per_s'], hi_tok_s=hi['output_tokens_per_s'],
              share=hi['output_tokens_per_s'] / offline_tok_s)


def read_goodput(goodput: float | None, best_rate: float) -> str:
    """Section 4: the goodput against the rate of highest throughput."""
    if goodput is None:
        return tr("goodput below every measured rate; the highest throughput was at {best_rate:g} req/s",
                  best_rate=best_rate)
    if goodput >= best_rate:
        return tr("goodput {goodput:g} req/s; the highest throughput was at {best_rate:g} req/s: the SLO held up "
                  "to the highest throughput measured", goodput=goodput, best_rate=best_rate)
    return tr("goodput {goodput:g} req/s; the highest throughput was at {best_rate:g} req/s: past the goodput, "
              "the extra throughput came from requests served too late", goodput=goodput, best_rate=best_rate)


def read_batch_sweep(sweep: list[dict]) -> str:
    """Section 5: the largest ``max_num_seqs`` of the sweep against its smallest: throughput gained,
    TPOT paid, and whether steps grew far less than the batch (a step bound by reading the weights)
    or nearly with it (by arithmetic). The sizes named are the sweep's own."""
    small, large = sweep[0], sweep[-1]
    batch = large["max_num_seqs"] / small["max_num_seqs"]
    gain = large["output_tokens_per_s"] / small["output_tokens_per_s"]
    cost = large["tpot_ms"]["p50"] / small["tpot_ms"]["p50"]
    fields = dict(large=large['max_num_seqs'], small=small['max_num_seqs'], batch=batch, gain=gain, cost=cost)
    if cost < 1 + (batch - 1) / 2:
        return tr("max_num_seqs {large} against {small} ({batch:g}x the sequences per step) gave {gain:.1f}x the "
                  "throughput for {cost:.1f}x the TPOT: steps grew far less than the batch, the mark of a step "
                  "bound by reading the weights", **fields)
    return tr("max_num_seqs {large} against {small} ({batch:g}x the sequences per step) gave {gain:.1f}x the "
              "throughput for {cost:.1f}x the TPOT: steps grew almost with the batch: arithmetic, not the weight "
              "read, set the step time here", **fields)


def ridge_side(intensity_min: float, intensity_max: float, ridge: float) -> str:
    """Section 6: where a kind of step sits on the roofline."""
    if intensity_max < ridge:
        return tr("left of the ridge")
    if intensity_min > ridge:
        return tr("right of the ridge")
    return tr("on both sides of the ridge")


def read_control_plane(outside_share: float) -> str:
    """Section 7: the most a zero-cost control plane could save, and whether it decides throughput (10%)."""
    speedup = 1 / (1 - outside_share)
    if outside_share < 0.1:
        return tr("a control plane that cost nothing would make these steps at most {speedup:.3f}x faster; "
                  "the model step decides this machine's throughput", speedup=speedup)
    return tr("a control plane that cost nothing would make these steps at most {speedup:.3f}x faster; "
              "the control plane is a real share of the step here: a faster one would show in throughput",
              speedup=speedup)
