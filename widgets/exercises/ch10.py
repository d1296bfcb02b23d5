"""Exercise checks of chapter 10 (the optimization stack): tile size, dtype, fusion.

Each check runs the experiment with the learner's choice and judges what it observed,
never the learner's code:

* ``check_tile_size`` (10.1): the learner's tiled online-softmax attention (written in the
  chapter) with their tile sizes must equal naive attention, must really work in tiles (every
  matrix product it runs, recorded by a ``TorchDispatchMode``, is at most ``block_q`` rows by
  ``block_k`` or head_dim columns, and there is one score product per pair of tiles), its tiles
  must be powers of two of at least ``MIN_TILE`` (what a GPU kernel can use: Triton's
  ``tl.arange`` takes powers of two, and the tensor cores multiply 16-wide fragments), fit a
  ``SRAM_BYTES`` on-chip budget, and move at most ``TRAFFIC_TARGET`` of naive attention's bytes;
* ``check_dtype`` (10.2): the learner measures the largest magnitude in the model's hidden
  states (``largest_activation``; the check measures it too, with forward hooks) and picks a
  dtype. An engine built with it (``LLM(dtype=...)``, the real model) must hold its weights and
  each token's KV in at most half the bytes of float32, pick the same greedy next token as
  float32 on the chapter's prompts, and square that largest hidden state without overflowing
  (an RMSNorm computed in the storage dtype squares every value: the case that tells float16,
  largest value 65,504, from bfloat16);
* ``check_fusion`` (10.3): the learner's fused SiLU-and-mul must return what the engine's
  ``silu_and_mul`` returns while running a single pass (one operator or one compiled graph)
  where eager PyTorch runs two, as ``torch.profiler`` records them.

The byte formulas and ``operator_calls`` are used by the chapter too, so its figures and the
checks count the same way.
"""

from __future__ import annotations

import math
import os
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from translations import tr
from widgets.exercises import CheckResult, todo, verdict, whole

# Exercise 10.1: one head, 1,024 tokens, head_dim 64, fp32 (4 bytes a number).
ATTN_TOKENS = 1024
ATTN_HEAD_DIM = 64
ITEMSIZE = 4
SRAM_BYTES = 96 * 1024  # the on-chip budget of one program's tiles in the exercise
TRAFFIC_TARGET = 0.30  # at most this share of naive attention's bytes
ATTN_TOLERANCE = 1e-4
MIN_TILE = 16  # the smallest tile a GPU kernel would use (see check_tile_size)

# Exercise 10.2: prompts whose greedy next token must not change.
DTYPE_PROMPTS = ("The capital of France is", "Water boils at a temperature of",
                 "def fibonacci(n):\n    if n <")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ACTIVATION_TOLERANCE = 0.05  # the learner's largest activation must be within 5% of the check's

# Exercise 10.3: SmolLM2-135M's gated MLP, 128 tokens: gate and up, 1,536 each.
FUSION_SHAPE = (128, 2 * 1536)

# Operators that move no data (views, shape changes) or only allocate: not a pass over memory.
NO_DATA_OPS = {"aten::chunk", "aten::split", "aten::split_with_sizes", "aten::narrow", "aten::slice",
               "aten::as_strided", "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::unsqueeze",
               "aten::squeeze", "aten::expand", "aten::permute", "aten::transpose", "aten::t", "aten::select",
               "aten::detach", "aten::alias", "aten::empty", "aten::empty_strided", "aten::empty_like",
               "aten::resolve_conj", "aten::resolve_neg", "aten::lift_fresh", "aten::unbind"}
COMPILED_GRAPH = "compiled graph"


# ------------------------------------------------------------------ bytes moved by attention
def naive_attention_bytes(n: int, d: int, itemsize: int = ITEMSIZE) -> int:
    """Bytes naive attention moves through main memory for one head of ``n`` tokens.

    Q and K read to form S = QK^T (2nd), S written (n^2), S read and P = softmax(S)
    written (2n^2), P and V read (n^2 + nd), O written (nd): 4nd + 4n^2 numbers.
    """
    return itemsize * (4 * n * d + 4 * n * n)


def tiled_attention_bytes(n: int, d: int, block_q: int, itemsize: int = ITEMSIZE) -> int:
    """Bytes the tiled online-softmax attention moves: Q read once and O written once
    (2nd); every tile of ``block_q`` queries reads all of K and V (2nd per query tile).
    Scores never leave the tile, so no n^2 term; the key tile size does not appear."""
    return itemsize * (2 * n * d + math.ceil(n / block_q) * 2 * n * d)


def tile_working_set_bytes(block_q: int, block_k: int, d: int, itemsize: int = ITEMSIZE) -> int:
    """On-chip bytes one program holds: Q tile and output accumulator (block_q x d each),
    K and V tiles (block_k x d each), the score tile (block_q x block_k) and the running
    max and sum (block_q each)."""
    return itemsize * (2 * block_q * d + 2 * block_k * d + block_q * block_k + 2 * block_q)


def attention_inputs(n: int = ATTN_TOKENS, d: int = ATTN_HEAD_DIM, seed: int = 0):
    """Seeded q, k, v of shape (n, d) in float32: one head."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, d, generator=g) for _ in range(3))


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v, the whole n x n score matrix at once. (n, d) -> (n, d)."""
    scores = q @ k.T / math.sqrt(q.shape[-1])  # (n, n)
    return torch.softmax(scores, dim=-1) @ v


# ------------------------------------------------------------------ operator counting
def operator_calls(fn: Callable[[], object]) -> list[str]:
    """The operators one call of ``fn`` runs that pass over data, as ``torch.profiler`` records
    them: the outermost aten operators (an operator's own sub-operators are part of it), minus
    views, allocations and casts to the dtype a tensor already has; a call into torch.compile's generated code counts as one
    ``"compiled graph"``."""
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no profiler start/stop log lines in the outputs
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = []
    for event in prof.events():
        if event.name.startswith("## Call CompiledFxGraph"):
            names.append(COMPILED_GRAPH)
            continue
        if not event.name.startswith("aten::") or event.name in NO_DATA_OPS:
            continue
        if event.name == "aten::to" and not event.cpu_children:  # already that dtype: returns its input
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("aten::") or parent.name.startswith("## Call CompiledFxGraph"):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            names.append(event.name)
    return names


# ------------------------------------------------------------------ exercise 10.1
_PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
             torch.ops.aten.baddbmm.default}


class _ProductShapes(TorchDispatchMode):
    """Records the output shape of every matrix product run inside the ``with`` block."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _PRODUCTS:
            self.shapes.append(tuple(out.shape))
        return out


def product_shapes(fn: Callable[[], object]) -> tuple[object, list[tuple[int, ...]]]:
    """Run ``fn()`` and return its result and the shapes of the matrix products it computed."""
    with _ProductShapes() as recorder:
        result = fn()
    return result, recorder.shapes


def _power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def check_tile_size(attention_fn, block_q, block_k) -> CheckResult:
    """10.1: a function that really tiles, with GPU-sized tiles that fit ``SRAM_BYTES`` and move
    <= 30% of naive's bytes, and the same result as naive attention."""
    n, d = ATTN_TOKENS, ATTN_HEAD_DIM
    if todo(block_q) or todo(block_k):
        return verdict("10.1", False, "", tr("replace both ... with tile sizes in tokens (whole numbers from 1 to "
                                             "{n}), then run the cell again.", n=n))
    bq, bk = whole(block_q, 1, n), whole(block_k, 1, n)
    if bq is None or bk is None:
        return verdict("10.1", False, "", tr("block_q and block_k must be whole numbers from 1 to {n}, got "
                                             "{block_q!r} and {block_k!r}.", n=n, block_q=block_q, block_k=block_k))
    if not callable(attention_fn):
        return verdict("10.1", False, "", tr("pass the chapter's tiled attention function as the first argument."))
    if not (_power_of_two(bq) and _power_of_two(bk)) or min(bq, bk) < MIN_TILE:
        return verdict("10.1", False, "", tr("block_q={bq}, block_k={bk}: a GPU kernel could not use these tiles. "
                                             "Triton's tl.arange only makes tiles whose size is a power of two, and "
                                             "the tensor cores multiply fragments {min_tile} wide: a smaller tile "
                                             "is padded to {min_tile} and spends the padding's arithmetic on zeros.",
                                             bq=bq, bk=bk, min_tile=MIN_TILE))
    naive, tiled = naive_attention_bytes(n, d), tiled_attention_bytes(n, d, bq)
    sram = tile_working_set_bytes(bq, bk, d)
    share = tiled / naive
    seen = tr("block_q={bq}, block_k={bk}: the tiles take {sram_kib:.1f} KiB on chip (budget {budget_kib} KiB) "
              "and the kernel moves {tiled_mib:.1f} MiB, {percent:.0f}% of naive attention's {naive_mib:.1f} MiB",
              bq=bq, bk=bk, sram_kib=sram / 1024, budget_kib=SRAM_BYTES // 1024, tiled_mib=tiled / 2**20,
              percent=100 * share, naive_mib=naive / 2**20)
    if sram > SRAM_BYTES:
        return verdict("10.1", False, "", tr("{seen}: the tiles do not fit. Count which buffers grow with "
                                             "block_q and which with block_k.", seen=seen))
    if share > TRAFFIC_TARGET:
        return verdict("10.1", False, "", tr("{seen}: above {target:.0f}%. Look at the byte formula: "
                                             "which of the two tile sizes appears in it?",
                                             seen=seen, target=100 * TRAFFIC_TARGET))
    q, k, v = attention_inputs(n, d)
    result, shapes = product_shapes(lambda: attention_fn(q, k, v, bq, bk))
    out = result[0] if isinstance(result, tuple) else result
    if not isinstance(out, torch.Tensor) or out.shape != (n, d):
        return verdict("10.1", False, "", tr("{seen}, but the function returned {kind} {shape}, not an ({n}, {d}) "
                                             "tensor.", seen=seen, kind=type(out).__name__,
                                             shape=getattr(out, 'shape', ''), n=n, d=d))
    too_big = [s for s in shapes if len(s) < 2 or math.prod(s[:-1]) > bq or s[-1] > max(bk, d)]
    score_tiles = sum(1 for s in shapes if len(s) >= 2 and math.prod(s[:-1]) <= bq and s[-1] <= bk)
    needed = math.ceil(n / bq) * math.ceil(n / bk)
    if too_big or score_tiles < needed:
        what = (tr("a product of shape {shape}, larger than a {bq} x {cols} tile",
                   shape=too_big[0], bq=bq, cols=max(bk, d)) if too_big else
                tr("{score_tiles} products of at most {bq} x {bk}, where one per (query tile, key tile) pair is "
                   "{needed}", score_tiles=score_tiles, bq=bq, bk=bk, needed=needed))
        return verdict("10.1", False, "", tr("{seen}, but the function did not work in those tiles: it computed "
                                             "{what}. The check runs your function with your tile sizes: it "
                                             "must be the tiled loop, not naive attention.", seen=seen, what=what))
    error = float((out - naive_attention(q, k, v)).abs().max())
    right = error <= ATTN_TOLERANCE
    return verdict("10.1", right,
                   tr("{seen}; it ran {score_tiles} score tiles and equals naive attention within "
                      "{tolerance:g}. A big query tile reads K and V fewer times; a small key tile keeps the "
                      "tiles on chip and costs no bytes.",
                      seen=seen, score_tiles=score_tiles, tolerance=ATTN_TOLERANCE),
                   tr("{seen}, but the result is not naive attention's (off by more than {tolerance:g}): "
                      "check the rescaling of the running sum and accumulator.", seen=seen, tolerance=ATTN_TOLERANCE))


# ------------------------------------------------------------------ exercise 10.2
def _greedy_tokens(llm) -> list[int]:
    return [int(torch.argmax(llm.engine.next_token_logits(p))) for p in DTYPE_PROMPTS]


def largest_hidden_state(llm) -> torch.Tensor:
    """The hidden-state row (hidden,) with the largest magnitude that any decoder layer's
    attention or MLP writes into the residual stream, over ``DTYPE_PROMPTS``, measured with
    forward hooks on the engine's own module tree (float32 when the engine runs float32)."""
    net = llm.engine.runner.model
    best: list[torch.Tensor] = [torch.zeros(1)]

    def hook(_module, _inputs, output):
        out = (output[0] if isinstance(output, tuple) else output).detach().float()
        rows = out.reshape(-1, out.shape[-1])
        row = rows[rows.abs().amax(dim=-1).argmax()]
        if float(row.abs().max()) > float(best[0].abs().max()):
            best[0] = row.clone()

    handles = [m.register_forward_hook(hook) for layer in net.model.layers for m in (layer.self_attn, layer.mlp)]
    try:
        for prompt in DTYPE_PROMPTS:
            llm.engine.reset_prefix_cache()
            llm.engine.next_token_logits(prompt)
    finally:
        for h in handles:
            h.remove()
    return best[0]


def check_dtype(dtype, largest_activation) -> CheckResult:
    """10.2: the model's largest activation, and a dtype with half the bytes of weights and KV per
    token, the same greedy next tokens as float32, and room for that activation squared."""
    from nanoengine import LLM

    name = dtype if isinstance(dtype, str) else next((k for k, v in DTYPES.items() if v == dtype), None)
    if todo(dtype) or todo(largest_activation):
        return verdict("10.2", False, "", tr("replace both ... (a dtype name, one of {names}, and the "
                                             "largest activation you measured), then run the cell again.",
                                             names=sorted(DTYPES)))
    if name not in DTYPES:
        return verdict("10.2", False, "", tr("dtype must be one of {names}, got {dtype!r}.",
                                             names=sorted(DTYPES), dtype=dtype))
    if isinstance(largest_activation, bool) or not isinstance(largest_activation, (int, float)) \
            or not 0 < largest_activation < float("inf"):
        return verdict("10.2", False, "", tr("largest_activation must be a positive number (a magnitude), got "
                                             "{value!r}.", value=largest_activation))
    reference = LLM(dtype="float32", num_kv_blocks=16, max_model_len=128)
    base, base_tokens = reference.memory_report(), _greedy_tokens(reference)
    row = largest_hidden_state(reference)
    reference.shutdown()
    measured = float(row.abs().max())
    if abs(largest_activation - measured) > ACTIVATION_TOLERANCE * measured:
        return verdict("10.2", False, "", tr("largest_activation={value:g} is not what the model's "
                                             "hidden states reach on the chapter's prompts (the check measures "
                                             "them with forward hooks on every layer's self_attn and mlp, over "
                                             "ch10.DTYPE_PROMPTS): measure the largest |value| the same way.",
                                             value=largest_activation))
    chosen = LLM(dtype=name, num_kv_blocks=16, max_model_len=128)
    report, tokens = chosen.memory_report(), _greedy_tokens(chosen)
    chosen.shutdown()
    weights, kv = report.weight_bytes / base.weight_bytes, report.kv_bytes_per_token / base.kv_bytes_per_token
    same = sum(a == b for a, b in zip(tokens, base_tokens))
    squares = row.to(DTYPES[name]).pow(2)  # what an RMSNorm computed in the storage dtype does first
    finite = bool(torch.isfinite(squares).all())
    seen = tr("{name}: weights {weight_mib:.0f} MiB ({weight_percent:.0f}% of float32), KV "
              "{kv_bytes:,} bytes per token ({kv_percent:.0f}%); greedy next token equal to "
              "float32's on {same} of {prompts} prompts; the largest activation squared in {name} "
              "is {square}", name=name, weight_mib=report.weight_bytes / 2**20, weight_percent=100 * weights,
              kv_bytes=report.kv_bytes_per_token, kv_percent=100 * kv, same=same, prompts=len(DTYPE_PROMPTS),
              square=tr("finite") if finite else tr("inf (overflow)"))
    halved = weights <= 0.5 and kv <= 0.5
    right = halved and same == len(DTYPE_PROMPTS) and finite
    if not halved:
        hint = tr("the bytes did not halve: how many bytes does each dtype store per number?")
    elif not finite:
        hint = tr("squaring {measured:,.0f} overflows this dtype: compare that square with "
                  "torch.finfo({name}).max, and look at how many exponent bits each 2-byte dtype keeps",
                  measured=measured, name=name)
    else:
        hint = tr("the bytes halved but the greedy answers changed")
    return verdict("10.2", right,
                   tr("{seen}. Half the bytes is up to twice the tokens per second where memory bandwidth is the "
                      "limit, and twice the KV capacity; bfloat16 keeps float32's 8 exponent bits, so the "
                      "model's rare huge activations and their squares stay in range, where float16's 5 do not.",
                      seen=seen),
                   tr("{seen}: {hint}.", seen=seen, hint=hint))


# ------------------------------------------------------------------ exercise 10.3
def check_fusion(fused_fn) -> CheckResult:
    """10.3: a fused SiLU-and-mul: equal to the engine's, one pass over the data instead of two."""
    from nanoengine.layers.activation import silu_and_mul

    if todo(fused_fn):
        return verdict("10.3", False, "", tr("replace ... with a fused version of silu_and_mul (a function taking "
                                             "x of shape (tokens, 2 * I)), then run the cell again."))
    if not callable(fused_fn):
        return verdict("10.3", False, "", tr("fused_silu_and_mul must be a function, got {kind}.",
                                             kind=type(fused_fn).__name__))
    x = torch.randn(*FUSION_SHAPE, generator=torch.Generator().manual_seed(0))
    expected = silu_and_mul(x)
    got = fused_fn(x)  # the first call compiles, if the function is a compiled one
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return verdict("10.3", False, "", tr("the function returned {kind} {shape}; expected shape {expected}.",
                                             kind=type(got).__name__, shape=tuple(getattr(got, 'shape', ())),
                                             expected=tuple(expected.shape)))
    error = float((got - expected).abs().max())
    eager_ops, fused_ops = operator_calls(lambda: silu_and_mul(x)), operator_calls(lambda: fused_fn(x))
    seen = tr("eager runs {eager} passes over the data ({eager_ops}), yours {fused} ({fused_ops}); equal to "
              "silu_and_mul within 1e-5: {equal}", eager=len(eager_ops), eager_ops=', '.join(eager_ops),
              fused=len(fused_ops), fused_ops=', '.join(fused_ops) or tr('none'), equal=error <= 1e-5)
    right = error <= 1e-5 and len(fused_ops) == 1
    hint = (tr("the result differs from silu_and_mul") if error > 1e-5 else
            tr("still more than one pass: torch.compile generates one loop for the whole function"))
    return verdict("10.3", right,
                   tr("{seen}. One pass reads gate and up once and writes the product once, with no temporary "
                      "for silu(gate).", seen=seen),
                   tr("{seen}: {hint}.", seen=seen, hint=hint))


# ------------------------------------------------------------------ readings of the chapter's measurements
# Each turns numbers a cell measured into the sentence printed beside them, and says the opposite
# when the numbers do (tests/course/test_exercises_ch10.py feeds both sides of every threshold).
SAME = 0.10  # two times within 10% of each other: "about the same"


def compare_times(ratio: float, this: str, other: str) -> str:
    """'<this> took 2.72x the time of <other> (slower)' / '(faster)' / '(about the same, within 10%)'."""
    if ratio > 1 + SAME:
        verdict_ = tr("slower")
    elif ratio < 1 - SAME:
        verdict_ = tr("faster")
    else:
        verdict_ = tr("about the same, within {same:.0%}", same=SAME)
    return tr("{this} took {ratio:.2f}x the time of {other} ({verdict})", this=this, ratio=ratio, other=other,
              verdict=verdict_)


def fusion_reading(ratios: dict[int, float]) -> str:
    """RMSNorm + residual, compiled / eager time per row count: at each size whether compiling paid,
    and whether the compiled call's disadvantage shrank as the rows grew (its guard checks are a
    fixed cost per call, the fused pass saves work per row)."""
    sizes = sorted(ratios)
    parts = [compare_times(ratios[r], tr("at {rows} row(s) compiled", rows=r), tr("eager")) for r in sizes]
    small, large = ratios[sizes[0]], ratios[sizes[-1]]
    if len(sizes) > 1:
        if large < small * (1 - SAME):
            trend = tr("the compiled call's ratio fell from {small:.2f} to {large:.2f} as the rows grew",
                       small=small, large=large)
        elif large > small * (1 + SAME):
            trend = tr("the compiled call's ratio rose from {small:.2f} to {large:.2f} as the rows grew",
                       small=small, large=large)
        else:
            trend = tr("the ratio barely changed between {low} and {high} rows", low=sizes[0], high=sizes[-1])
        parts.append(trend)
    if large < 1 - SAME:
        parts.append(tr("at {rows} rows compiling paid on this machine", rows=sizes[-1]))
    elif large > 1 + SAME:
        parts.append(tr("even at {rows} rows compiling did not pay on this machine", rows=sizes[-1]))
    else:
        parts.append(tr("at {rows} rows compiled and eager were level on this machine", rows=sizes[-1]))
    return "; ".join(parts) + "."


def speedup_reading(speedup: float, what: str) -> str:
    """A benchmark's speed-up (eager time / compiled time, > 1 is faster) read with a 5% band."""
    if speedup > 1.05:
        return tr("{what}: {speedup:.2f}x, a speed-up", what=what, speedup=speedup)
    if speedup < 0.95:
        return tr("{what}: {speedup:.2f}x, a slow-down", what=what, speedup=speedup)
    return tr("{what}: {speedup:.2f}x, no measurable difference (within 5%)", what=what, speedup=speedup)


def dispatch_reading(overhead_s: float, step_s: float, matmul_s: float, operators_s: float) -> str:
    """A CPU decode step: the matrix multiplies' share of the profiled operator time, and the
    dispatch overhead (calls x the cost of a call that does no work) as a share of the step."""
    mm, ov = matmul_s / operators_s, overhead_s / step_s
    parts = [tr("the matrix multiplies took {share:.0%} of the profiled operator time ({how})", share=mm,
                how=tr("most of it") if mm >= 0.5 else tr("less than half of it")),
             tr("dispatch overhead was about {share:.0%} of the step ({how})", share=ov,
                how=tr("the smaller part") if ov < 0.5 else tr("the larger part: this step is dispatch-bound"))]
    return "; ".join(parts) + "."


def precision_reading(times: dict[tuple[int, str], float], halves: float = 0.55, beyond: float = 0.4) -> str:
    """bfloat16 against float32 at each row count (``times[(rows, dtype_name)]`` in seconds), and why.

    Up to ``cpu_native.MAX_ROWS`` rows a product reads its weight once for a few rows: the bytes
    set its time, so halving them can at most halve it. With many rows each weight is reused, the
    arithmetic sets the time, and bfloat16 helps only where the CPU multiplies bfloat16 itself
    (avx512_bf16, AMX); there it can take well under half of float32's time.
    """
    from nanoengine.kernels.cpu_native import MAX_ROWS

    parts = []
    for rows in sorted({r for r, _ in times}):
        ratio = times[rows, "bfloat16"] / times[rows, "float32"]
        if ratio <= beyond:
            how = (tr("far more than the halved bytes explain: the CPU multiplies bfloat16 faster than float32")
                   if rows > MAX_ROWS else tr("by more than half: more than the halved bytes explain"))
        elif ratio <= halves:
            how = (tr("about halved, as the bytes did") if rows <= MAX_ROWS else
                   tr("about halved, from faster bfloat16 arithmetic: at this many rows the products, not the "
                      "bytes, set the time"))
        elif ratio < 1 - SAME:
            how = tr("faster, by less than half")
        elif ratio <= 1 + SAME:
            how = tr("about the same (within 10%): bfloat16 was not faster")
        else:
            how = tr("slower: bfloat16 cost time here")
        parts.append(tr("at {rows} row(s) bfloat16 took {ratio:.2f}x float32's time ({how})", rows=rows, ratio=ratio,
                        how=how))
    return "; ".join(parts) + "."


def bytes_reading(what: str, float32_bytes: int, bfloat16_bytes: int) -> str:
    """'halve exactly' only when they do; otherwise the share, and why it can differ (tensors kept in float32)."""
    if 2 * bfloat16_bytes == float32_bytes:
        return tr("{what}: bfloat16 halves them exactly", what=what)
    return tr("{what}: bfloat16 holds {share:.1%} of float32's bytes ({why})", what=what,
              share=bfloat16_bytes / float32_bytes,
              why=tr("some tensors stay in float32") if 2 * bfloat16_bytes > float32_bytes else tr("less than half"))


def parity_reading(runs: dict[str, dict]) -> str:
    """The GPU check's greedy parity with transformers per dtype: identical outputs, and whether every
    divergence was at a near tie."""
    parts = []
    for name, run in runs.items():
        total, same, ties = run["total"], run["identical"], run["near_tie_divergences"]
        parted, unexplained = total - same, len(run["unexplained"])
        if parted == 0:
            parts.append(tr("in {name} the engine and transformers agreed token for token ({same} of {total})",
                            name=name, same=same, total=total))
        elif unexplained == 0:
            parts.append(tr("in {name} {parted} of {total} outputs parted, every one at a near tie",
                            name=name, parted=parted, total=total))
        else:
            parts.append(tr("in {name} {parted} of {total} outputs parted, {unexplained} of them not at a near tie",
                            name=name, parted=parted, total=total, unexplained=unexplained))
    return "; ".join(parts) + "."


def decode_step_settings(engine, context_tokens: int) -> str:
    """The settings a decode-step time depends on, in one line: batch, context, dtype, how the
    model runs (``LLMEngine.forward_mode``), threads and how idle threads wait."""
    from nanobench.timing import wait_policy

    return tr("1 request, context {context} tokens, {dtype}, {mode}, {threads} threads, idle threads {wait}",
              context=context_tokens, dtype=str(engine.config.torch_dtype).replace('torch.', ''),
              mode=engine.forward_mode, threads=torch.get_num_threads(),
              wait=tr("sleep") if wait_policy() == 'PASSIVE' else tr("spin"))


def decode_steps(engine, prompt, steps: int = 11) -> tuple[list[float], int]:
    """Run ``prompt`` alone on ``engine`` for ``steps`` decode steps (after its prefill) and return the
    engine's own time of each (``StepFinished.total_time``, seconds) and the context length at the
    last step: the way chapter 5 times a decode step."""
    from nanoengine import SamplingParams
    from nanoengine.events import StepFinished

    times: list[float] = []
    unsubscribe = engine.events.subscribe(
        lambda e: times.append(e.total_time) if isinstance(e, StepFinished) and not e.num_prefill_tokens else None)
    try:
        rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        unsubscribe()
    context = len(engine.tokenizer.encode(prompt, add_special_tokens=False)) if isinstance(prompt, str) else len(prompt)
    del rid
    return times, context + steps


def agreement_reading(a_s: float, b_s: float, a: str, b: str, band: float = 0.15) -> str:
    """Two medians of the same kind of step: agree (within ``band``) or not, and by how much."""
    ratio = a_s / b_s
    if abs(ratio - 1) <= band:
        return tr("{a} and {b} agree within {band:.0%} ({ratio:.2f}x)", a=a, b=b, band=band, ratio=ratio)
    return tr("{a} took {ratio:.2f}x the time of {b}: they do not agree within {band:.0%}", a=a, b=b, band=band,
              ratio=ratio)

__all__ = ["agreement_reading", "bytes_reading", "compare_times", "decode_step_settings", "decode_steps",
           "dispatch_reading", "fusion_reading", "parity_reading", "precision_reading", "speedup_reading",
           "ATTN_HEAD_DIM", "ATTN_TOKENS", "DTYPE_PROMPTS", "MIN_TILE", "SRAM_BYTES", "TRAFFIC_TARGET",
           "attention_inputs", "check_dtype", "check_fusion", "check_tile_size", "largest_hidden_state",
           "naive_attention", "naive_attention_bytes", "operator_calls", "product_shapes", "tile_working_set_bytes",
           "tiled_attention_bytes"]
