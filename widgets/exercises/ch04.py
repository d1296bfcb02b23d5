"""Exercise checks of chapter 4 (PagedAttention): block size, pool size, parallel sampling.

Each check takes the value the learner chose, runs the experiment on a tiny random engine
(mechanics only: ``widgets.tiny_engine``) through the engine's public API, and judges what
it observed (the waste of the paged pool, the preemptions, the blocks the completions
share), never the learner's code:

* ``check_block_size`` (4.1): a block size for which the paged engine wastes under 0.5% of
  the memory it uses on the chapter's request trace (``chapter_trace``);
* ``check_pool_size`` (4.2): a KV pool small enough that the engine preempts at least 3
  times on the same trace, yet still serves every request;
* ``check_parallel_sampling`` (4.3): the smallest ``SamplingParams(n=...)`` whose
  completions save at least 1,000 token slots by sharing their prompt's full blocks.

``replay_trace`` is the experiment behind 4.1 and 4.2, kept here so the checks and the
worked solutions (``notebooks/solutions/04_paged_attention.ipynb``) run the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nanoengine import SamplingParams
from nanoengine.events import RequestScheduled
from widgets._common import TokenSource, single_thread, tiny_engine
from widgets.block_allocator import BlockAllocatorController
from widgets.exercises import CheckResult, todo, verdict, whole

TOKEN_SLOTS = 2048  # the memory of every pool below, in token slots (blocks x block size)
MAX_MODEL_LEN = 512
WASTE_TARGET = 0.005  # exercise 4.1
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


# ------------------------------------------------------------------ exercise 4.1
def check_block_size(block_size) -> CheckResult:
    """4.1: the paged pool wastes under 0.5% of the memory it uses on the chapter's trace."""
    if todo(block_size):
        return verdict("4.1", False, "", "replace ... with a block size in tokens (a whole number from 1 to 256), "
                                         "then run the cell again.")
    bs = whole(block_size, 1, 256)
    if bs is None:
        return verdict("4.1", False, "", f"block_size must be a whole number from 1 to 256, got {block_size!r}.")
    r = replay_trace(bs)
    seen = (f"With {bs}-token blocks ({r.num_blocks} of them) the paged pool wasted {100 * r.paged_waste:.1f}% "
            f"of the memory in use, and block tables held {r.mean_table_len:.1f} entries on average")
    return verdict("4.1", r.paged_waste < WASTE_TARGET,
                   f"{seen}. Only the unfilled end of each request's last block is wasted, so smaller blocks "
                   f"waste less, at the price of longer block tables (more entries to read per token).",
                   f"{seen}: above {100 * WASTE_TARGET:.1f}%. The waste is the unfilled end of each request's "
                   f"last block, up to block_size - 1 slots per request.")


# ------------------------------------------------------------------ exercise 4.2
def check_pool_size(num_kv_blocks) -> CheckResult:
    """4.2: a pool of 16-token blocks small enough for at least 3 preemptions on the trace."""
    low = MAX_MODEL_LEN // 16
    if todo(num_kv_blocks):
        return verdict("4.2", False, "", f"replace ... with a number of 16-token blocks, from {low} (one "
                                         f"{MAX_MODEL_LEN}-token request must fit) to 128, then run the cell again.")
    n = whole(num_kv_blocks, low, 128)
    if n is None:
        return verdict("4.2", False, "", f"num_kv_blocks must be a whole number from {low} to 128, "
                                         f"got {num_kv_blocks!r}.")
    r = replay_trace(16, n)
    seen = (f"With {n} blocks ({16 * n:,} token slots) the engine preempted {r.num_preemptions} time(s), "
            f"recomputed {r.recomputed_tokens:,} tokens and took {r.steps} steps; {r.num_finished} of "
            f"{len(chapter_trace())} requests finished")
    right = r.num_preemptions >= MIN_PREEMPTIONS and r.num_finished == len(chapter_trace())
    return verdict("4.2", right,
                   f"{seen}. Each preemption frees a request's blocks and later computes its tokens again: "
                   f"memory is paid back in compute.",
                   f"{seen}. A smaller pool runs out of blocks sooner while requests grow; "
                   f"aim for at least {MIN_PREEMPTIONS} preemptions.")


# ------------------------------------------------------------------ exercise 4.3
def sampling_savings(n: int, prompt_len: int = SAMPLING_PROMPT_LEN, block_size: int = 16) -> tuple[int, int]:
    """(block-table entries, distinct blocks) of the n completions of one prompt, just after
    the siblings forked, read from a tiny engine's snapshot."""
    engine = tiny_engine(num_kv_blocks=256, block_size=block_size, max_model_len=512)
    prompt = TokenSource(engine.model_config.vocab_size, seed=1).tokens(prompt_len)
    rid = engine.add_request(prompt, SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True))
    with single_thread():
        engine.step()  # the prompt's prefill by the first completion, which samples its first token
        engine.step()  # the siblings are admitted: they fork its full prompt blocks and compute the rest
    tables = [r.block_ids for r in engine.snapshot().running if r.parent_id == rid]
    engine.abort(rid)
    return sum(len(t) for t in tables), len({b for t in tables for b in t})


def check_parallel_sampling(n) -> CheckResult:
    """4.3: the smallest n whose completions save at least 1,000 token slots by sharing."""
    if todo(n):
        return verdict("4.3", False, "", "replace ... with the number of completions n (a whole number from 1 "
                                         "to 64), then run the cell again.")
    k = whole(n, 1, 64)
    if k is None:
        return verdict("4.3", False, "", f"n must be a whole number from 1 to 64, got {n!r}.")
    entries, distinct = sampling_savings(k)
    saved = 16 * (entries - distinct)
    per_sibling = 16 * (SAMPLING_PROMPT_LEN // 16)  # the full prompt blocks each extra completion shares
    seen = (f"n={k}: the completions' block tables have {entries} entries but only {distinct} distinct blocks, "
            f"so sharing saves {saved:,} token slots ({per_sibling} per extra completion)")
    if saved >= SAVED_TARGET and saved - per_sibling < SAVED_TARGET:
        return verdict("4.3", True, f"{seen}; n={k - 1} would save {saved - per_sibling:,}, under "
                                    f"{SAVED_TARGET:,}.", "")
    hint = "too few: raise n" if saved < SAVED_TARGET else f"n={k - 1} already saves {saved - per_sibling:,}"
    return verdict("4.3", False, "", f"{seen}: {hint}. Each extra completion shares the prompt's "
                                     f"{SAMPLING_PROMPT_LEN // 16} full blocks.")


__all__ = ["TraceResult", "chapter_trace", "check_block_size", "check_parallel_sampling", "check_pool_size",
           "replay_trace", "sampling_savings"]
