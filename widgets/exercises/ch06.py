"""Chapter 6 (prefill vs decode): the cost model of a step, the arrival experiment, the checks.

Two pieces of the chapter live here so that the notebook, its exercises and the worked
solutions (``notebooks/solutions/06_prefill_vs_decode.ipynb``) run the very same code:

* ``step_cost``: the FLOPs and the bytes one engine step moves, computed from the model's
  shapes (``nanobench.timing.model_gemm_shapes`` plus the attention output
  projection, the attention itself and the LM head), so that a step's *arithmetic
  intensity* (FLOPs per byte) can be placed on the roofline;
* ``run_arrival``: a long prompt arrives while a few short requests are decoding, on the real
  default model with a chosen token budget (``max_num_batched_tokens``) and scheduling
  policy; the engine's ``StepFinished`` events and per-token timestamps
  (``RequestMetrics.token_times``) say what each step carried and how long the decoding
  requests waited between tokens.

The checks judge what the engine did through its public API, with margins wide enough for
a noisy shared machine, or by structural facts (how many tokens each step carried):

* ``check_decode_batch`` (6.1): the smallest decode batch whose arithmetic intensity reaches
  this machine's ridge point, confirmed on the engine (a step of that many decodes);
* ``check_token_budget`` (6.2): the largest token budget whose longest chunked-prefill step
  (four decodes and a chunk of the long prompt) the chapter's step-cost fit predicts at no
  more than twice a decode-only step: decided by the fit the chapter measured on the
  arrival's own steps (with its attention term, ``StepCostFit.fit(..., attention=True)``),
  not by a new timing;
* ``check_policy`` (6.3): a policy and budget under which the decoding requests produce a
  token in every step of the long prefill, the prefill takes at most 4 steps and no step
  carries more than 400 tokens (structural: read from the steps' token counts).
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from nanoengine import LLMEngine, SamplingParams
from nanoengine.events import StepFinished
from nanobench import Roofline, measure, model_gemm_shapes
from nanoengine.models.config import ModelConfig
from translations import tr
from widgets.exercises import CheckResult, todo, verdict, whole
from widgets.step_cost_explorer import StepCostFit, explore

DECODE_CONTEXT = 16  # exercise 6.1: tokens already in each decoding request's context
BUDGET_DECODERS = 4  # exercise 6.2: requests decoding while the long prompt is chunked
BUDGET_STEP_RATIO = 2.0  # exercise 6.2: a chunked step may take at most this many decode-only steps
POLICY_PREFILL_STEPS = 4  # exercise 6.3: the prefill in at most this many steps
POLICY_MAX_STEP_TOKENS = 400  # exercise 6.3: ... none of them carrying more tokens than this
LONG_PROMPT_TOKENS = 1500
SHORT_QUESTIONS = ("Write a haiku about the sea.", "Name three colours of autumn leaves.",
                   "What is a good name for a cat?", "Describe a rainy morning in one sentence.")


# ------------------------------------------------------------------ the cost of a step
def step_cost(config: ModelConfig, sequences: Sequence[tuple[int, int]], dtype_bytes: int = 4) -> tuple[float, float]:
    """(FLOPs, bytes moved) of one forward pass over ``sequences``.

    Each sequence is ``(new_tokens, context_len)``: it computes ``new_tokens`` tokens and ends
    with ``context_len`` tokens in the KV cache (a decode is ``(1, context)``, a whole prompt's
    prefill ``(n, n)``). The counts follow what the engine runs:

    * every layer's matrix multiplies (fused QKV, attention output, fused gate/up, down) on
      all new tokens: 2 FLOPs (multiply, add) per weight per token; each weight is read once
      per step, whatever the number of tokens (that is the whole point of batching), and
      each token's input and output rows are read and written;
    * attention: each new token scores and mixes ``context_len`` keys and values per head
      (2 x 2 FLOPs per head dimension); the cached K and V of every sequence are read once;
    * the LM head only on each sequence's last token (the engine computes logits there only).

    Norms, rotary and the activation function are left out: they are a few FLOPs per value.
    """
    h, heads, hd = config.hidden_size, config.num_attention_heads, config.head_dim
    shapes = list(model_gemm_shapes(config)) + [(h, heads * hd)]  # + the attention output projection
    tokens = sum(n for n, _ in sequences)
    kv_per_token_layer = config.kv_bytes_per_token(dtype_bytes) // config.num_hidden_layers
    flops = bytes_ = 0.0
    for out_f, in_f in shapes:
        flops += 2 * tokens * out_f * in_f
        bytes_ += dtype_bytes * (out_f * in_f + tokens * (in_f + out_f))  # weight once, rows in and out
    for n, ctx in sequences:
        flops += 2 * 2 * n * ctx * heads * hd  # q.k and p.v over the context (causal: an upper bound)
        bytes_ += ctx * kv_per_token_layer  # this sequence's cached K and V, read once per layer
    flops *= config.num_hidden_layers
    bytes_ *= config.num_hidden_layers
    rows = len(sequences)  # the LM head runs on each sequence's last token only
    flops += 2 * rows * config.vocab_size * h
    bytes_ += dtype_bytes * (config.vocab_size * h + rows * (h + config.vocab_size))
    return float(flops), float(bytes_)


def intensity(config: ModelConfig, sequences: Sequence[tuple[int, int]], dtype_bytes: int = 4) -> float:
    """Arithmetic intensity (FLOPs per byte) of one step over ``sequences`` (see ``step_cost``)."""
    flops, moved = step_cost(config, sequences, dtype_bytes)
    return flops / moved


def decode_intensity(config: ModelConfig, batch: int, context: int = DECODE_CONTEXT, dtype_bytes: int = 4) -> float:
    """Intensity of a decode step of ``batch`` requests, each with ``context`` tokens cached."""
    return intensity(config, [(1, context)] * batch, dtype_bytes)


def ridge_batch(config: ModelConfig, ridge_point: float, context: int = DECODE_CONTEXT,
                dtype_bytes: int = 4) -> int | None:
    """The smallest decode batch whose intensity reaches ``ridge_point``, or None if none does.

    A decode step's FLOPs and bytes both grow linearly with the batch: the weights are a
    fixed cost, but every sequence adds its own cached K and V to read. So the intensity
    rises towards a ceiling (FLOPs per sequence / KV bytes per sequence); when that ceiling
    is below the ridge point, no batch makes decode compute-bound.
    """
    f1, m1 = step_cost(config, [(1, context)], dtype_bytes)
    f2, m2 = step_cost(config, [(1, context)] * 2, dtype_bytes)
    df, dm = f2 - f1, m2 - m1  # per extra sequence
    f0, m0 = f1 - df, m1 - dm  # the fixed part (weights)
    if df <= ridge_point * dm:
        return None
    return max(1, math.ceil((ridge_point * m0 - f0) / (df - ridge_point * dm) - 1e-9))


# ------------------------------------------------------------------ the arrival experiment
def long_prompt_ids(tokenizer, num_tokens: int = LONG_PROMPT_TOKENS) -> list[int]:
    """A real ~``num_tokens``-token prompt: a request to summarise the engine's scheduler source."""
    import inspect

    from nanoengine.engine import scheduler

    head = tokenizer.encode("Summarise what the following Python module does:\n\n", add_special_tokens=False)
    body = tokenizer.encode(inspect.getsource(scheduler), add_special_tokens=False)
    return (head + body)[:num_tokens]


@dataclass(frozen=True)
class ArrivalRun:
    """What one run of the arrival experiment did, read from the engine's events and metrics."""

    budget: int
    policy: str
    steps: tuple[StepFinished, ...]  # every step of the run, in order
    step_ends: tuple[float, ...]  # when each step finished (perf_counter seconds)
    prefill_steps: tuple[int, ...]  # indices of the steps that carried part of the long prompt
    decoder_itls: tuple[float, ...]  # every gap between two tokens of a decoding request (seconds)
    gap_steps: tuple[int, ...]  # index of the step that ended each of those gaps
    long_ttft: float  # the long prompt's time to first token (seconds)

    @property
    def itl_p50(self) -> float:
        return float(np.percentile(self.decoder_itls, 50))

    @property
    def itl_p99(self) -> float:
        """The 99th percentile gap; with fewer than 100 gaps it is (nearly) the largest one."""
        return float(np.percentile(self.decoder_itls, 99))

    @property
    def itl_max(self) -> float:
        """The decoders' longest wait between two tokens: what a streaming reader notices."""
        return float(max(self.decoder_itls))

    @property
    def stalled_steps(self) -> int:
        """Steps of the long prefill in which the decoding requests got no token."""
        return sum(self.steps[i].num_decode_tokens == 0 for i in self.prefill_steps)

    @property
    def largest_step_tokens(self) -> int:
        """The most tokens (prefill + decode) any step of the run computed."""
        return max(s.num_prefill_tokens + s.num_decode_tokens for s in self.steps)

    def describe(self) -> str:
        return tr("budget {budget:>4}, {policy:<13}: long prompt in {steps} step(s), {stalled} without decodes; "
                  "decode ITL p50 {p50:.0f} ms, worst {worst:.0f} ms (of {gaps} gaps); long prompt TTFT {ttft:.0f} ms",
                  budget=self.budget, policy=self.policy, steps=len(self.prefill_steps), stalled=self.stalled_steps,
                  p50=1e3 * self.itl_p50, worst=1e3 * self.itl_max, gaps=len(self.decoder_itls),
                  ttft=1e3 * self.long_ttft)


def arrival_engine(budget: int, policy: str = "fcfs") -> LLMEngine:
    """The engine of the arrival experiment: the default model, the given token budget and
    policy, the prefix cache off (every run computes the whole prompt), 320 KV blocks of 16 tokens."""
    return LLMEngine.from_pretrained(max_num_batched_tokens=budget, scheduling_policy=policy,
                                     enable_prefix_caching=False, num_kv_blocks=320, max_model_len=2048)


def run_arrival(budget: int, policy: str = "fcfs", *, prompt_tokens: int = LONG_PROMPT_TOKENS,
                num_decoders: int = 4, decode_tokens: int = 14, arrive_after: int = 3) -> ArrivalRun:
    """A long prompt arrives while ``num_decoders`` short requests decode; measure what they feel.

    Builds the default model's engine with ``max_num_batched_tokens=budget`` and
    ``scheduling_policy=policy`` (``arrival_engine``), starts the short chat requests
    (greedy, ``decode_tokens`` tokens each, end-of-sequence ignored so they all decode to the
    end), lets them decode for ``arrive_after`` steps after their prefill, then adds the long
    prompt (2 output tokens) and steps until everything is done.
    """
    engine = arrival_engine(budget, policy)
    tok = engine.tokenizer
    steps: list[StepFinished] = []
    ends: list[float] = []

    def observe(event) -> None:
        if isinstance(event, StepFinished):
            steps.append(event)
            ends.append(time.perf_counter())

    unsubscribe = engine.events.subscribe(observe)
    short = [[{"role": "user", "content": q}] for q in SHORT_QUESTIONS[:num_decoders]]  # conversations
    decoders = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True))
                for p in short]
    final = {}
    long_id, prefill_steps = None, []
    while engine.has_unfinished_requests():
        if long_id is None and len(steps) == 1 + arrive_after:  # the decoders' prefill, then their decodes
            long_id = engine.add_request(long_prompt_ids(tok, prompt_tokens),
                                         SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        snap = engine.snapshot()
        mine = [r for r in snap.waiting + snap.running if r.request_id == long_id]
        before = mine[0].num_computed_tokens if mine else None
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if mine and before < mine[0].num_prompt_tokens:
            after = engine.snapshot()
            now = [r for r in after.running if r.request_id == long_id]
            if long_id in final or (now and now[0].num_computed_tokens > before):
                prefill_steps.append(len(steps) - 1)
    unsubscribe()
    itls, gap_steps = [], []
    for rid in decoders:
        times = final[rid].metrics.token_times
        for a, b in zip(times, times[1:]):
            itls.append(b - a)
            gap_steps.append(next(i for i, end in enumerate(ends) if end >= b))
    run = ArrivalRun(budget, policy, tuple(steps), tuple(ends), tuple(prefill_steps), tuple(itls),
                     tuple(gap_steps), float(final[long_id].metrics.ttft))
    engine.shutdown()
    del engine
    gc.collect()
    return run


# ------------------------------------------------------------------ readings
def read_token_costs(prefill_s_per_token: float, decode_s_per_token: float) -> str:
    """Section 1's reading: what a token cost inside the prefill step against a decode step's."""
    if not (prefill_s_per_token > 0 and decode_s_per_token > 0):
        raise ValueError("the costs must be > 0 seconds")
    r = decode_s_per_token / prefill_s_per_token
    if r >= 2:
        return tr("reading: per token, the prefill was far cheaper than a decode step ({r:.0f}x less per token)", r=r)
    if r >= 1.25:
        return tr("reading: per token, the prefill was cheaper than a decode step ({r:.1f}x less per token)", r=r)
    if r > 0.8:
        return tr("reading: per token, the prefill cost about what a decode step did ({r:.2f}x)", r=r)
    return tr("reading: per token, the prefill cost more than a decode step ({more:.1f}x more per token)", more=1 / r)


def read_chunking(runs: dict, similar: float = 0.05) -> list[str]:
    """Section 6's readings of the arrival runs, ``{(budget, policy): ArrivalRun}``: how the
    decoders' worst gap moves with the fcfs budget, each chunked run's TTFT against the
    unchunked fcfs run (the largest budget), and prefill_first's worst gap against it."""
    fcfs = sorted((b, r) for (b, p), r in runs.items() if p == "fcfs")
    if len(fcfs) < 2:
        raise ValueError("need fcfs runs at two budgets or more")
    gaps = [r.itl_max for _, r in fcfs]
    names = ", ".join(tr("{ms:.0f} ms at {budget}", ms=1e3 * g, budget=b) for (b, _), g in zip(fcfs, gaps))
    lines = [tr("the decoders' worst gap grows with the budget ({names})", names=names)
             if all(x < y for x, y in zip(gaps, gaps[1:])) else
             tr("the decoders' worst gap does not grow steadily with the budget ({names})", names=names)]
    top_budget, top = fcfs[-1]

    def compare(x: float, y: float, other: str) -> str:
        if abs(x / y - 1) <= similar:
            return tr("about the same as {other} (within {similar:.0%})", other=other, similar=similar)
        return (tr("{share:.0%} longer than {other}", share=x / y - 1, other=other) if x > y else
                tr("{share:.0%} shorter than {other}", share=1 - x / y, other=other))

    for b, r in fcfs[:-1]:
        verdict_ = compare(r.long_ttft, top.long_ttft, tr("unchunked"))
        if r.long_ttft < (1 - similar) * top.long_ttft:
            lines.append(tr("budget {budget}: the long prompt's TTFT is {verdict} (noise: the same work cannot "
                            "finish sooner)", budget=b, verdict=verdict_))
        else:
            lines.append(tr("budget {budget}: the long prompt's TTFT is {verdict}", budget=b, verdict=verdict_))
    for (b, p), r in runs.items():
        if p == "prefill_first":
            lines.append(tr("prefill_first, budget {budget}: the decoders' worst gap is {verdict}", budget=b,
                            verdict=compare(r.itl_max, top.itl_max, tr("fcfs at {budget}", budget=top_budget))))
    return [tr("reading: {line}", line=line) for line in lines]


# ------------------------------------------------------------------ the checks
# ------------------------------------------------------------------ exercise 6.1
def decode_step_tokens(engine: LLMEngine, batch: int, repeats: int = 5):
    """Run ``batch`` requests to their decode phase on ``engine`` and time ``repeats`` decode steps.

    Returns the timed steps' ``StepFinished`` events, their ``Timing`` and the requests' mean
    context length during the timed steps; the requests are aborted afterwards, so the engine
    is left as it was.
    """
    prompt = engine.tokenizer.encode("Once upon a time, in a small village by the sea,", add_special_tokens=False)
    ids = [engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
           for _ in range(batch)]
    while engine.snapshot().waiting or any(r.num_output_tokens == 0 for r in engine.snapshot().running):
        engine.step()  # the prompts' prefill
    seen: list[StepFinished] = []
    unsubscribe = engine.events.subscribe(lambda e: seen.append(e) if isinstance(e, StepFinished) else None)
    timing = measure(engine.step, repeats=repeats, warmup=1, label=f"decode step, batch {batch}")
    unsubscribe()
    context = len(prompt) + 1 + repeats // 2 + 1  # the middle timed step: prompt, the warm-up and half the runs
    for rid in ids:
        if engine.has_request(rid):
            engine.abort(rid)
    return seen[-repeats:], timing, context


def check_decode_batch(decode_batch, roof: Roofline | None, engine: LLMEngine | None) -> CheckResult:
    """6.1: the smallest decode batch (contexts of ``DECODE_CONTEXT`` tokens) whose arithmetic
    intensity reaches ``roof``'s ridge point; a step of that many decodes is run on ``engine``."""
    if todo(decode_batch):
        return verdict("6.1", False, "", tr("replace ... with a decode batch size (a whole number from 1 to 4096), "
                                            "then run the cell again."))
    b = whole(decode_batch, 1, 4096)
    if b is None:
        return verdict("6.1", False, "", tr("decode_batch must be a whole number from 1 to 4096, got {value!r}.",
                                            value=decode_batch))
    if roof is None or engine is None:
        return verdict("6.1", False, "", tr("run the chapter's roofline section first (it defines roof and engine)."))
    cfg = engine.model_config
    ai, below = decode_intensity(cfg, b), decode_intensity(cfg, b - 1) if b > 1 else 0.0
    best = ridge_batch(cfg, roof.ridge_point)
    seen = tr("a decode step of {b} requests ({context}-token contexts) does {ai:.1f} FLOPs per byte; "
              "this machine's ridge point is {ridge:.1f} FLOPs per byte",
              b=b, context=DECODE_CONTEXT, ai=ai, ridge=roof.ridge_point)
    if ai < roof.ridge_point:
        return verdict("6.1", False, "", tr("{seen}: still memory-bound. Raise the batch: each extra sequence reuses "
                                            "the weights the step reads anyway.", seen=seen))
    if below >= roof.ridge_point:
        return verdict("6.1", False, "", tr("{seen}: it reaches the ridge, but so does a smaller batch. Solve for "
                                            "the batch where the intensity first reaches the ridge point.", seen=seen))
    steps, timing, context = decode_step_tokens(engine, min(b, engine.config.max_num_seqs))
    decodes = {s.num_decode_tokens for s in steps}
    ran = all(s.num_prefill_tokens == 0 for s in steps) and decodes == {b}
    right = ran and b == best
    achieved = step_cost(cfg, [(1, context)] * b)[0] / timing.median
    return verdict("6.1", right,
                   tr("{seen}, and {fewer} requests stay below it ({below:.1f}). On the engine the step computed "
                      "{b} decode tokens in {ms:.0f} ms median, {achieved:.0f} GFLOP/s of the roof's {roof:.0f} "
                      "GFLOP/s: from here on, more sequences per step cost compute time, no longer only memory time.",
                      seen=seen, fewer=b - 1, below=below, b=b, ms=1e3 * timing.median, achieved=achieved / 1e9,
                      roof=roof.attainable(ai) / 1e9),
                   tr("{seen}, but the engine's steps carried {decodes} decode tokens; raise max_num_seqs.",
                      seen=seen, decodes=sorted(decodes)))


# ------------------------------------------------------------------ exercise 6.2
def longest_chunk_step(fit: StepCostFit, budget: int, decoders: int = BUDGET_DECODERS,
                       prompt_tokens: int = LONG_PROMPT_TOKENS) -> float:
    """The longest step of the long prompt's chunked prefill under fcfs (``decoders`` decodes
    and a chunk of what is left of ``budget``), predicted by ``fit``: with an attention term
    the later chunks, which attend over more of the prompt, cost more."""
    return max(s for _, _, s in explore(fit, prompt_tokens, budget, decoders, "fcfs").steps)


def largest_budget(fit: StepCostFit, decoders: int = BUDGET_DECODERS, ratio: float = BUDGET_STEP_RATIO,
                   prompt_tokens: int = LONG_PROMPT_TOKENS, high: int = 8192) -> int:
    """The largest budget whose longest fcfs step of the prompt's chunked prefill the fit
    predicts at no more than ``ratio`` decode-only steps of ``decoders`` requests."""
    if fit.per_prefill_token == 0 and fit.per_attention_pair == 0:
        raise ValueError("the fit has no cost per prefill token: every budget fits")
    limit = ratio * fit.step_time(0, decoders) + 1e-12
    ok = [b for b in range(decoders + 1, high + 1) if longest_chunk_step(fit, b, decoders, prompt_tokens) <= limit]
    return max(ok) if ok else decoders


def check_token_budget(budget, fit: StepCostFit | None) -> CheckResult:
    """6.2: the largest budget whose longest chunked-prefill step the fit predicts at most
    twice a decode-only step of the four decoders (judged on ``fit``, the chapter's own
    measurement of the arrival's steps)."""
    if todo(budget):
        return verdict("6.2", False, "", tr("replace ... with a token budget (max_num_batched_tokens, a whole number "
                                            "from {low} to 8192), then run the cell again.", low=BUDGET_DECODERS + 1))
    b = whole(budget, BUDGET_DECODERS + 1, 8192)  # the four decodes take the first tokens of every step
    if b is None:
        return verdict("6.2", False, "", tr("the budget must be a whole number from {low} to 8192 (the {decoders} "
                                            "decodes come first), got {value!r}.", low=BUDGET_DECODERS + 1,
                                            decoders=BUDGET_DECODERS, value=budget))
    if not isinstance(fit, StepCostFit):
        return verdict("6.2", False, "", tr("run section 6 first: it fits the step cost of the arrival's own steps "
                                            "(arrival_fit) that this check uses."))
    d = BUDGET_DECODERS
    decode_only = fit.step_time(0, d)
    step = longest_chunk_step(fit, b, d)
    limit = BUDGET_STEP_RATIO * decode_only + 1e-12
    seen = tr("budget {b}: the longest step of the prompt's chunked prefill ({d} decodes and a chunk of up to "
              "{chunk} tokens) is predicted at {ms:.0f} ms, {ratio:.2f}x a decode-only step ({decode_ms:.0f} ms)",
              b=b, d=d, chunk=b - d, ms=1e3 * step, ratio=step / decode_only, decode_ms=1e3 * decode_only)
    if step > limit:
        return verdict("6.2", False, "", tr("{seen}: above {limit:g}x. Under fcfs the decodes take their {d} tokens "
                                            "first; the chunk is the rest of the budget, and a late chunk also "
                                            "attends over the prompt's earlier chunks.",
                                            seen=seen, limit=BUDGET_STEP_RATIO, d=d))
    if largest_budget(fit, d) > b:
        return verdict("6.2", False, "", tr("{seen}: within {limit:g}x, but not the largest budget that is. Which "
                                            "chunk is the most expensive, and what does it cost?",
                                            seen=seen, limit=BUDGET_STEP_RATIO))
    return verdict("6.2", True, tr("{seen}, and no larger budget stays within {limit:g}x. Every step pays the fixed "
                                   "cost once, so a chunk may add about one fixed cost's worth of work, and the last "
                                   "chunk pays the most attention; a larger budget lets a long prompt stretch the "
                                   "decoders' gaps further.", seen=seen, limit=BUDGET_STEP_RATIO), "")


# ------------------------------------------------------------------ exercise 6.3
def check_policy(policy, budget) -> CheckResult:
    """6.3: decoders get a token in every step of the long prefill, which takes at most
    ``POLICY_PREFILL_STEPS`` steps (structural: read from the steps' token counts)."""
    from nanoengine.config import POLICIES

    if todo(policy) or todo(budget):
        return verdict("6.3", False, "", tr("replace both ... with a policy ('fcfs' or 'prefill_first') and a token "
                                            "budget, then run the cell again."))
    if policy not in ("fcfs", "prefill_first"):
        return verdict("6.3", False, "", tr("policy must be 'fcfs' or 'prefill_first' (the engine knows "
                                            "{policies}), got {value!r}.", policies=POLICIES, value=policy))
    b = whole(budget, 16, 4096)
    if b is None:
        return verdict("6.3", False, "", tr("the budget must be a whole number from 16 to 4096, got {value!r}.",
                                            value=budget))
    run = run_arrival(b, policy)
    n = len(run.prefill_steps)
    largest = max(run.steps[i].num_prefill_tokens + run.steps[i].num_decode_tokens for i in run.prefill_steps)
    seen = tr("{policy} with budget {b}: the long prompt took {n} step(s); in {stalled} of them the decoding "
              "requests got no token (decode tokens per step: {per_step}); the largest step carried {largest} tokens",
              policy=policy, b=b, n=n, stalled=run.stalled_steps,
              per_step=[run.steps[i].num_decode_tokens for i in run.prefill_steps], largest=largest)
    right = run.stalled_steps == 0 and n <= POLICY_PREFILL_STEPS and largest <= POLICY_MAX_STEP_TOKENS
    hint = (tr("prefill_first runs a step with prefill work as prefill only: the decoders wait in every one of those "
               "steps, however small the chunks") if run.stalled_steps else
            tr("too many chunks: the prompt must fit in {steps} steps", steps=POLICY_PREFILL_STEPS)
            if n > POLICY_PREFILL_STEPS else
            tr("a step carried more than {tokens} tokens: the budget caps a step", tokens=POLICY_MAX_STEP_TOKENS))
    return verdict("6.3", right, tr("{seen}. fcfs schedules the running decodes first and gives the prefill what is "
                                    "left of the budget, so nobody stalls.", seen=seen), f"{seen}: {hint}.")


__all__ = ["ArrivalRun", "arrival_engine", "check_decode_batch", "check_policy", "check_token_budget",
           "decode_intensity", "decode_step_tokens", "intensity", "largest_budget", "long_prompt_ids",
           "longest_chunk_step", "read_chunking", "read_token_costs", "ridge_batch",
           "run_arrival",
           "step_cost"]
