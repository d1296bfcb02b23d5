"""Exercise checks of chapter 10 (the optimization stack): tile size, dtype, fusion.

Each check runs the experiment with the learner's choice and judges what it observed,
never the learner's code:

* ``check_tile_size`` (10.1): the learner's tiled online-softmax attention (written in the
  chapter) with their tile sizes must equal naive attention, its tiles must fit a
  ``SRAM_BYTES`` on-chip budget, and it must move at most ``TRAFFIC_TARGET`` of naive
  attention's bytes;
* ``check_dtype`` (10.2): an engine built with the chosen ``dtype`` (``LLM(dtype=...)``,
  the real model) must hold its weights and each token's KV in at most half the bytes of
  float32, and still pick the same greedy next token as float32 on the chapter's prompts;
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

from widgets.exercises import CheckResult, todo, verdict, whole

# Exercise 10.1: one head, 1,024 tokens, head_dim 64, fp32 (4 bytes a number).
ATTN_TOKENS = 1024
ATTN_HEAD_DIM = 64
ITEMSIZE = 4
SRAM_BYTES = 96 * 1024  # the on-chip budget of one program's tiles in the exercise
TRAFFIC_TARGET = 0.30  # at most this share of naive attention's bytes
ATTN_TOLERANCE = 1e-4

# Exercise 10.2: prompts whose greedy next token must not change.
DTYPE_PROMPTS = ("The capital of France is", "Water boils at a temperature of",
                 "def fibonacci(n):\n    if n <")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

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
def check_tile_size(attention_fn, block_q, block_k) -> CheckResult:
    """10.1: tiles that fit ``SRAM_BYTES``, move <= 30% of naive's bytes, same result."""
    n, d = ATTN_TOKENS, ATTN_HEAD_DIM
    if todo(block_q) or todo(block_k):
        return verdict("10.1", False, "", "replace both ... with tile sizes in tokens (whole numbers from 1 to "
                                          f"{n}), then run the cell again.")
    bq, bk = whole(block_q, 1, n), whole(block_k, 1, n)
    if bq is None or bk is None:
        return verdict("10.1", False, "", f"block_q and block_k must be whole numbers from 1 to {n}, got "
                                          f"{block_q!r} and {block_k!r}.")
    if not callable(attention_fn):
        return verdict("10.1", False, "", "pass the chapter's tiled attention function as the first argument.")
    naive, tiled = naive_attention_bytes(n, d), tiled_attention_bytes(n, d, bq)
    sram = tile_working_set_bytes(bq, bk, d)
    share = tiled / naive
    seen = (f"block_q={bq}, block_k={bk}: the tiles take {sram / 1024:.1f} KiB on chip (budget "
            f"{SRAM_BYTES // 1024} KiB) and the kernel moves {tiled / 2**20:.1f} MiB, {100 * share:.0f}% of naive "
            f"attention's {naive / 2**20:.1f} MiB")
    if sram > SRAM_BYTES:
        return verdict("10.1", False, "", f"{seen}: the tiles do not fit. The Q tile and the accumulator "
                                          f"grow with block_q, the K and V tiles with block_k.")
    if share > TRAFFIC_TARGET:
        return verdict("10.1", False, "", f"{seen}: above {100 * TRAFFIC_TARGET:.0f}%. Every query tile reads "
                                          f"all of K and V once, so only block_q changes the bytes.")
    q, k, v = attention_inputs(n, d)
    result = attention_fn(q, k, v, bq, bk)
    out = result[0] if isinstance(result, tuple) else result
    if not isinstance(out, torch.Tensor) or out.shape != (n, d):
        return verdict("10.1", False, "", f"{seen}, but the function returned {type(out).__name__} "
                                          f"{getattr(out, 'shape', '')}, not an ({n}, {d}) tensor.")
    error = float((out - naive_attention(q, k, v)).abs().max())
    right = error <= ATTN_TOLERANCE
    return verdict("10.1", right,
                   f"{seen}; max abs difference from naive attention {error:.1e}. A big query tile reads K and V "
                   f"fewer times; a small key tile keeps the tiles on chip and costs no bytes.",
                   f"{seen}, but the result differs from naive attention by {error:.1e}: check the rescaling "
                   f"of the running sum and accumulator.")


# ------------------------------------------------------------------ exercise 10.2
def _greedy_tokens(llm) -> list[int]:
    return [int(torch.argmax(llm.engine.next_token_logits(p))) for p in DTYPE_PROMPTS]


def check_dtype(dtype) -> CheckResult:
    """10.2: half the bytes of weights and KV per token, same greedy next tokens as float32."""
    from nanoengine import LLM

    name = dtype if isinstance(dtype, str) else next((k for k, v in DTYPES.items() if v == dtype), None)
    if todo(dtype):
        return verdict("10.2", False, "", f"replace ... with a dtype name, one of {sorted(DTYPES)}, then run the "
                                          f"cell again.")
    if name not in DTYPES:
        return verdict("10.2", False, "", f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    reference = LLM(dtype="float32", num_kv_blocks=16, max_model_len=128)
    base, base_tokens = reference.memory_report(), _greedy_tokens(reference)
    reference.shutdown()
    chosen = LLM(dtype=name, num_kv_blocks=16, max_model_len=128)
    report, tokens = chosen.memory_report(), _greedy_tokens(chosen)
    chosen.shutdown()
    weights, kv = report.weight_bytes / base.weight_bytes, report.kv_bytes_per_token / base.kv_bytes_per_token
    same = sum(a == b for a, b in zip(tokens, base_tokens))
    seen = (f"{name}: weights {report.weight_bytes / 2**20:.0f} MiB ({100 * weights:.0f}% of float32), KV "
            f"{report.kv_bytes_per_token:,} bytes per token ({100 * kv:.0f}%); greedy next token equal to "
            f"float32's on {same} of {len(DTYPE_PROMPTS)} prompts")
    halved = weights <= 0.5 and kv <= 0.5
    right = halved and same == len(DTYPE_PROMPTS)
    hint = ("a 2-byte dtype halves the bytes" if not halved else
            "the bytes halved but the answers changed: try the other 2-byte dtype")
    return verdict("10.2", right,
                   f"{seen}. Every decode step reads all the weights and the KV cache, so half the bytes is up to "
                   f"twice the tokens per second where memory bandwidth is the limit, and twice the KV capacity.",
                   f"{seen}: {hint}.")


# ------------------------------------------------------------------ exercise 10.3
def check_fusion(fused_fn) -> CheckResult:
    """10.3: a fused SiLU-and-mul: equal to the engine's, one pass over the data instead of two."""
    from nanoengine.layers.activation import silu_and_mul

    if todo(fused_fn):
        return verdict("10.3", False, "", "replace ... with a fused version of silu_and_mul (a function taking "
                                          "x of shape (tokens, 2 * I)), then run the cell again.")
    if not callable(fused_fn):
        return verdict("10.3", False, "", f"fused_silu_and_mul must be a function, got {type(fused_fn).__name__}.")
    x = torch.randn(*FUSION_SHAPE, generator=torch.Generator().manual_seed(0))
    expected = silu_and_mul(x)
    got = fused_fn(x)  # the first call compiles, if the function is a compiled one
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return verdict("10.3", False, "", f"the function returned {type(got).__name__} "
                                          f"{tuple(getattr(got, 'shape', ()))}; expected shape "
                                          f"{tuple(expected.shape)}.")
    error = float((got - expected).abs().max())
    eager_ops, fused_ops = operator_calls(lambda: silu_and_mul(x)), operator_calls(lambda: fused_fn(x))
    seen = (f"eager runs {len(eager_ops)} passes over the data ({', '.join(eager_ops)}), yours "
            f"{len(fused_ops)} ({', '.join(fused_ops) or 'none'}); max abs difference {error:.1e}")
    right = error <= 1e-5 and len(fused_ops) == 1
    hint = ("the result differs from silu_and_mul" if error > 1e-5 else
            "still more than one pass: torch.compile generates one loop for the whole function")
    return verdict("10.3", right,
                   f"{seen}. One pass reads gate and up once and writes the product once, with no temporary "
                   f"for silu(gate).",
                   f"{seen}: {hint}.")


__all__ = ["ATTN_HEAD_DIM", "ATTN_TOKENS", "SRAM_BYTES", "TRAFFIC_TARGET", "attention_inputs", "check_dtype",
           "check_fusion", "check_tile_size", "naive_attention", "naive_attention_bytes", "operator_calls",
           "tile_working_set_bytes", "tiled_attention_bytes"]
