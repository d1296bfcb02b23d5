"""Exercise checks of chapter 4 (PagedAttention): block size, pool size, parallel sampling.

Each check takes the value the learner chose, runs the experiment on a tiny random engine
(mechanics only: ``widgets.tiny_engine``) through the engine's public API, and judges what
it observed (the waste of the paged pool, the preemptions, the blocks the completions
share), never the learner's code:

* ``check_block_size`` (4.1): the largest power-of-two block size for which the paged
  engine wastes under 3% of the memory it uses on the chapter's request trace
  (``chapter_trace``); the chapter's sweep measures 4, 16, 64 and 256, so the answer must
  be reasoned from how the waste grows with the block size;
* ``check_pool_size`` (4.2): a KV pool small enough that the engine preempts at least 3
  times on the same trace, yet still serves every request;
* ``check_parallel_sampling`` (4.3): the smallest ``SamplingParams(n=...)`` whose
  completions save at least 1,000 token slots by sharing their prompt's full blocks.

``replay_trace`` is the experiment behind 4.1 and 4.2, kept here so the checks and the
worked solutions (``notebooks/solutions/04_paged_attention.ipynb``) run the same thing.

The chapter's readings of its measurements are computed here from the numbers its cells
measured, so that they say the opposite when the numbers do: ``read_block_size_sweep``
(section 8's sweep), ``read_paged_overhead`` (section 8's kernel timings) and
``read_recompute_vs_swap`` (section 6).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nanoengine import SamplingParams
from nanoengine.events import RequestScheduled
from translations import tr
from widgets._common import TokenSource, single_thread, tiny_engine
from widgets.block_allocator import BlockAllocatorController
from widgets.exercises import CheckResult, todo, verdict, whole

TOKEN_SLOTS = 2048  # the memory of every pool below, in token slots (blocks x block size)
MAX_MODEL_LEN = 512
WASTE_TARGET = 0.03  # exercise 4.1: the largest power-of-two block size wasting under this
MIN_PREEMPTIONS = 3  # exercise 4.2
SAVED_TARGET = 1000  # exercise 4.3: token slots
SAMPLING_PROMPT_LEN = 200  # exercise 4.3


def chapter_trace(seed: int = 0, num_requests: int = 16, every: int = 4) -> list[tuple[int, int, int]]:
    """The chapter's request trace: (arrival step, prompt tokens, max tokens), one request every
    ``every`` steps, prompts of 16-199 tokens and 8-159 output tokens (seeded, so the same
    everywhere)."""
    rng = np.random.default_rng(seed)
    return [(every * i, int(rng.integers(16, 200)), int(rng.integers(8, 160))) for i in range(num_requests)]


@dataclass(frozen=True)
class TraceResult:
    """What one run of the trace did to the paged pool."""

    block_size: int
    num_blocks: int
    steps: int
    paged_waste: float  # mean over the steps of the paged pool's wasted share of the memory in use
    mean_table_len: float  # mean block-table length of the running requests
    num_preemptions: int
    recomputed_tokens: int  # tokens computed again after a preemption
    num_finished: int


def replay_trace(block_size: int = 16, num_kv_blocks: int | None = None, trace=None) -> TraceResult:
    """Run ``trace`` (default ``chapter_trace()``) on a tiny engine and measure its paged pool.

    The pool holds ``TOKEN_SLOTS`` token slots unless ``num_kv_blocks`` says otherwise.
    Recomputed tokens are counted from the engine's events: after a preemption,
    scheduled tokens below the request's earlier progress are computed a second time.
    """
    trace = chapter_trace() if trace is None else list(trace)
    num_kv_blocks = num_kv_blocks or TOKEN_SLOTS // block_size
    engine = tiny_engine(num_kv_blocks=num_kv_blocks, block_size=block_size, max_model_len=MAX_MODEL_LEN)
    controller = BlockAllocatorController(engine, shared_prefix_len=1)  # the trace's prompts share nothing
    reached: dict[str, int] = {}  # request id -> tokens it had computed before
    recomputed = 0

    def on_event(event) -> None:
        nonlocal recomputed
        if isinstance(event, RequestScheduled):
            start, end = event.num_computed_tokens, event.num_computed_tokens + event.num_tokens
            before = reached.get(event.request_id, 0)
            recomputed += max(0, min(end, before) - start)
            reached[event.request_id] = max(before, end)

    unsubscribe = engine.events.subscribe(on_event)
    pending, wastes, tables, step, finished = list(trace), [], [], 0, 0
    with single_thread():  # the tiny model's matrices are too small for a second thread to help
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][0] <= step:
                _, prompt_len, max_tokens = pending.pop(0)
                controller.add_request(prompt_len, max_tokens)
            finished += sum(out.finished for out in engine.step())
            step += 1
            snap = engine.snapshot()
            wastes.append(controller.paged_report(snap).waste_fraction)
            tables += [len(r.block_ids) for r in snap.running]
    unsubscribe()
    controller.close()
    preemptions = engine.snapshot().num_preemptions
    return TraceResult(block_size, num_kv_blocks, step, float(np.mean(wastes)),
                       float(np.mean(tables)) if tables else 0.0, preemptions, recomputed, finished)


# ------------------------------------------------------------------ readings
def _sizes(values: dict) -> str:
    return ", ".join(str(v) for v in values.values())


def read_block_size_sweep(sweep: dict) -> str:
    """Section 8's reading of the block-size sweep, from its own numbers.

    ``sweep`` maps block size -> a result with ``paged_waste``, ``num_preemptions`` and
    ``mean_table_len`` (a ``TraceResult``). Says whether the waste grows with the block size,
    whether big blocks preempted more than small ones (the larger half of the sizes against
    the smaller half), and whether block tables shrink.
    """
    sizes = sorted(sweep)
    if len(sizes) < 2:
        raise ValueError("the sweep needs at least two block sizes")
    waste = [sweep[b].paged_waste for b in sizes]
    pre = {b: sweep[b].num_preemptions for b in sizes}
    tables = [sweep[b].mean_table_len for b in sizes]
    lo, hi = f"{sizes[0]}", f"{sizes[-1]}"
    if all(x < y for x, y in zip(waste, waste[1:])):
        w = tr("the waste grows with the block size ({first:.1f}% at {lo} -> {last:.1f}% at {hi})",
               first=100 * waste[0], lo=lo, last=100 * waste[-1], hi=hi)
    else:
        w = tr("the waste does not grow steadily with the block size ({wastes} at {sizes})",
               wastes=', '.join(f'{100 * x:.1f}%' for x in waste), sizes=', '.join(map(str, sizes)))
    half = len(sizes) // 2
    small, big = {b: pre[b] for b in sizes[:half]}, {b: pre[b] for b in sizes[-half:]}
    counts = tr("{big_counts} with blocks of {big_sizes} against {small_counts} with {small_sizes}",
                big_counts=_sizes(big), big_sizes=', '.join(map(str, big)), small_counts=_sizes(small),
                small_sizes=', '.join(map(str, small)))
    steady = all(x <= y for x, y in zip(pre.values(), list(pre.values())[1:]))
    if len(set(pre.values())) == 1:
        p = tr("the preemptions are the same at every block size ({n})", n=pre[sizes[0]])
    elif min(big.values()) > max(small.values()):
        if steady:
            p = tr("big blocks preempted more often ({counts}): their unfilled tails leave fewer slots for tokens, "
                   "so the pool runs out sooner", counts=counts)
        else:
            p = tr("big blocks preempted more often ({counts}): their unfilled tails leave fewer slots for tokens, "
                   "so the pool runs out sooner; not steadily, though: the count does not rise at every step of "
                   "the sweep", counts=counts)
    elif max(big.values()) < min(small.values()):
        p = tr("big blocks preempted less often ({counts})", counts=counts)
    else:
        p = tr("the preemptions show no clear trend with the block size ({counts})", counts=counts)
    if all(x > y for x, y in zip(tables, tables[1:])):
        t = tr("the block tables shrink as blocks grow ({first:.1f} -> {last:.1f} entries)",
               first=tables[0], last=tables[-1])
    else:
        t = tr("the block tables do not shrink steadily ({entries} entries)",
               entries=', '.join(f'{x:.1f}' for x in tables))
    return tr("reading: {waste}; {preempt_words}; {tables}.", waste=w, preempt_words=p, tables=t)


def read_paged_overhead(ratios: dict, similar: float = 0.10) -> str:
    """Section 8's reading of the kernel timings: ``ratios`` maps block size -> paged time /
    contiguous time (medians). Says whether paging cost time at every block size, and
    whether bigger blocks cost less (a change of more than ``similar`` between the smallest
    and the largest size)."""
    if not ratios:
        raise ValueError("no timings to read")
    sizes = sorted(ratios)
    rs = [ratios[b] for b in sizes]
    span = tr("{low:.2f}x-{high:.2f}x the contiguous time", low=min(rs), high=max(rs))
    if min(rs) > 1:
        side = tr("the paged kernel was slower than contiguous SDPA at every block size ({span})", span=span)
    elif max(rs) < 1:
        side = tr("the paged kernel was faster than contiguous SDPA at every block size ({span})", span=span)
    else:
        side = tr("the paged kernel was slower at some block sizes and faster at others ({span})", span=span)
    first, last = rs[0], rs[-1]
    ends = dict(first=first, smallest=sizes[0], last=last, largest=sizes[-1])
    if first > (1 + similar) * last:
        trend = tr("bigger blocks cost less ({first:.2f}x at {smallest}, {last:.2f}x at {largest}: fewer, longer "
                   "reads)", **ends)
    elif last > (1 + similar) * first:
        trend = tr("bigger blocks cost more ({first:.2f}x at {smallest}, {last:.2f}x at {largest})", **ends)
    else:
        trend = tr("the block size made little difference (within {similar:.0%} from {smallest} to {largest})",
                   similar=similar, **ends)
    return tr("reading: {side}; {trend}.", side=side, trend=trend)


def read_recompute_vs_swap(recompute_s: float, swap_s: float) -> str:
    """Section 6's reading: the measured recompute against the cited transfer time of a swap."""
    if not (recompute_s > 0 and swap_s > 0):
        raise ValueError("both times must be > 0 seconds")
    ratio = recompute_s / swap_s
    if ratio > 1:
        return tr("reading: the recompute measured here took {ratio:,.0f}x the time the swap's transfers would "
                  "take on a GPU's link: on this machine recomputing costs more than moving the blocks would.",
                  ratio=ratio)
    return tr("reading: the recompute measured here took {ratio:.2f}x the time the swap's transfers would take on "
              "a GPU's link: recomputing costs less than moving the blocks would.", ratio=ratio)


# ------------------------------------------------------------------ exercise 4.1
def _power_of_two(value) -> int | None:
    bs = whole(value, 1, 256)
    return bs if bs is not None and bs & (bs - 1) == 0 else None


def check_block_size(block_size) -> CheckResult:
    """4.1: the largest power-of-two block size whose paged pool wastes under 3% of the
    memory it uses on the chapter's trace (the pool keeps its 2,048 token slots)."""
    if todo(block_size):
        return verdict("4.1", False, "", tr("replace ... with a block size in tokens (a power of two from 1 to "
                                            "256), then run the cell again."))
    bs = _power_of_two(block_size)
    if bs is None:
        return verdict("4.1", False, "", tr("block_size must be a power of two from 1 to 256 (1, 2, 4, ... 256), "
                                            "got {value!r}.", value=block_size))
    r = replay_trace(bs)
    seen = tr("With {bs}-token blocks ({blocks} of them) the paged pool wasted {waste:.1f}% of the memory in use",
              bs=bs, blocks=r.num_blocks, waste=100 * r.paged_waste)
    target = 100 * WASTE_TARGET
    if r.paged_waste >= WASTE_TARGET:
        return verdict("4.1", False, "", tr("{seen}: not under {target:.0f}%. The waste is the unfilled end of "
                                            "each request's last block, on average about half a block per "
                                            "request.", seen=seen, target=target))
    if bs < 256 and replay_trace(2 * bs).paged_waste < WASTE_TARGET:
        return verdict("4.1", False, "", tr("{seen}: under {target:.0f}%, but a larger power of two also stays "
                                            "under it. How does the waste scale with the block size?",
                                            seen=seen, target=target))
    return verdict("4.1", True,
                   tr("{seen}, and twice that block size would pass {target:.0f}%. Each running request wastes "
                      "about half a block, so the waste grows about in proportion to the block size; smaller "
                      "blocks pay for it with longer block tables ({entries:.1f} entries on average here).",
                      seen=seen, target=target, entries=r.mean_table_len),
                   "")


# ------------------------------------------------------------------ exercise 4.2
def check_pool_size(num_kv_blocks) -> CheckResult:
    """4.2: a pool of 16-token blocks small enough for at least 3 preemptions on the trace."""
    low = MAX_MODEL_LEN // 16
    if todo(num_kv_blocks):
        return verdict("4.2", False, "", tr("replace ... with a number of 16-token blocks, from {low} (one "
                                            "{max_len}-token request must fit) to 128, then run the cell again.",
                                            low=low, max_len=MAX_MODEL_LEN))
    n = whole(num_kv_blocks, low, 128)
    if n is None:
        return verdict("4.2", False, "", tr("num_kv_blocks must be a whole number from {low} to 128, "
                                            "got {value!r}.", low=low, value=num_kv_blocks))
    r = replay_trace(16, n)
    seen = tr("With {n} blocks ({slots:,} token slots) the engine preempted {preemptions} time(s), recomputed "
              "{recomputed:,} tokens and took {steps} steps; {finished} of {total} requests finished",
              n=n, slots=16 * n, preemptions=r.num_preemptions, recomputed=r.recomputed_tokens, steps=r.steps,
              finished=r.num_finished, total=len(chapter_trace()))
    right = r.num_preemptions >= MIN_PREEMPTIONS and r.num_finished == len(chapter_trace())
    return verdict("4.2", right,
                   tr("{seen}. Each preemption frees a request's blocks and later computes its tokens again: "
                      "memory is paid back in compute.", seen=seen),
                   tr("{seen}. A smaller pool runs out of blocks sooner while requests grow; aim for at least "
                      "{minimum} preemptions.", seen=seen, minimum=MIN_PREEMPTIONS))


# ------------------------------------------------------------------ exercise 4.3
def sampling_savings(n: int, prompt_len: int = SAMPLING_PROMPT_LEN, block_size: int = 16) -> tuple[int, int]:
    """(block-table entries, distinct blocks) of the n completions of one prompt, just after
    the siblings were admitted, read from a tiny engine's snapshot."""
    engine = tiny_engine(num_kv_blocks=256, block_size=block_size, max_model_len=512)
    prompt = TokenSource(engine.model_config.vocab_size, seed=1).tokens(prompt_len)
    rid = engine.add_request(prompt, SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True))
    with single_thread():
        engine.step()  # the prompt's prefill by the first completion, which samples its first token
        engine.step()  # the siblings are admitted: they share its full prompt blocks and compute the rest
    tables = [r.block_ids for r in engine.snapshot().running if r.parent_id == rid]
    engine.abort(rid)
    return sum(len(t) for t in tables), len({b for t in tables for b in t})


def check_parallel_sampling(n) -> CheckResult:
    """4.3: the smallest n whose completions save at least 1,000 token slots by sharing."""
    if todo(n):
        return verdict("4.3", False, "", tr("replace ... with the number of completions n (a whole number from 1 "
                                            "to 64), then run the cell again."))
    k = whole(n, 1, 64)
    if k is None:
        return verdict("4.3", False, "", tr("n must be a whole number from 1 to 64, got {value!r}.", value=n))
    entries, distinct = sampling_savings(k)
    saved = 16 * (entries - distinct)
    per_sibling = 16 * (SAMPLING_PROMPT_LEN // 16)  # the full prompt blocks each extra completion shares
    seen = tr("n={k}: the completions' block tables have {entries} entries but only {distinct} distinct blocks, "
              "so sharing saves {saved:,} token slots ({per_sibling} per extra completion)",
              k=k, entries=entries, distinct=distinct, saved=saved, per_sibling=per_sibling)
    fewer = dict(fewer=k - 1, fewer_saved=saved - per_sibling)
    if saved >= SAVED_TARGET and saved - per_sibling < SAVED_TARGET:
        return verdict("4.3", True, tr("{seen}; n={fewer} would save {fewer_saved:,}, under {target:,}.",
                                       seen=seen, target=SAVED_TARGET, **fewer), "")
    hint = tr("too few: raise n") if saved < SAVED_TARGET else tr("n={fewer} already saves {fewer_saved:,}", **fewer)
    return verdict("4.3", False, "", tr("{seen}: {hint}. Each extra completion shares the prompt's {blocks} full "
                                        "blocks.", seen=seen, hint=hint, blocks=SAMPLING_PROMPT_LEN // 16))


__all__ = ["TraceResult", "chapter_trace", "check_block_size", "check_parallel_sampling", "check_pool_size",
           "read_block_size_sweep", "read_paged_overhead", "read_recompute_vs_swap", "replay_trace",
           "sampling_savings"]
