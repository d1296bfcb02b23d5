"""Quantization measured on a CPU (chapter 10): int8 weight-only linear layers, an int8 or fp8 KV cache.

Two ways of storing a model's numbers in fewer bytes than bfloat16, each measured with the real
default model and each read from its own numbers:

* **int8 weight-only linear layers.** Every weight matrix (out_features, in_features) is stored
  as int8 with one float scale per output channel (per row: ``w ≈ q * scale``, symmetric,
  ``scale = max|row| / 127``). The activations stay float; the product dequantizes on the fly.
  PyTorch has this kernel built in for CPUs, ``torch.ops.aten._weight_int8pack_mm(x, q,
  scales)``, which computes ``(x @ q.T) * scales``; ``int8_linear`` calls it (and falls back to
  dequantizing when a build lacks it, see ``int8pack_available``). A decode step reads every
  weight once, so its bytes fall to about a quarter of float32's; whether the time follows
  depends on the kernel and the CPU (measured by ``time_layer_gemms``).
* **A KV cache in int8 or fp8.** K and V of every token, in int8 with one scale per token and
  head, or in ``torch.float8_e4m3fn`` with one scale per tensor (the scheme FP8 KV caches use
  when no calibrated scales are given). ``capture_attention_inputs`` records the real q, k, v the
  engine's attention layers receive during a prefill; ``kv_attention_error`` runs attention on
  them with the cache rounded and reports how far the output moves.

Quality is measured teacher-forced on a real text (``real_text``: the Zen of Python, from the
standard library, so it is the same on every machine): the logits at every position with the
weights rounded (``rounded_weights``) against float32, as perplexity and as the share of
positions whose greedy (top-1) next token is unchanged (``text_quality``). Rounding the weights
and computing in float32 gives the numbers an int8 weight-only kernel computes, up to the order
of the additions.

The readings (``int8_speed_reading``, ``quality_reading``, ``kv_reading``) turn those numbers
into sentences and say the opposite when the numbers do (tested on both sides of every
threshold in ``tests/course/test_widgets_quantization.py``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from translations import tr

INT8_MAX = 127
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_BYTES = 4  # scales are kept in float32
FORMATS = ("float32", "bfloat16", "int8")
KV_FORMATS = ("float32", "bfloat16", "int8", "fp8_e4m3")
_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1, "fp8_e4m3": 1}


# ------------------------------------------------------------------ int8 weights
@dataclass(frozen=True)
class Int8Weight:
    """A weight (out_features, in_features) as int8 ``q`` and one float32 ``scales`` per row."""

    q: torch.Tensor  # (out, in) int8
    scales: torch.Tensor  # (out,) float32

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scales.numel() * self.scales.element_size()

    def dequantize(self) -> torch.Tensor:
        """(out, in) float32: ``q * scale`` row by row, the numbers the int8 product uses."""
        return self.q.float() * self.scales[:, None]


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8: ``scale = max|row| / 127``, ``q = round(w / scale)``."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / INT8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row: any scale works
    q = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.contiguous())


@functools.lru_cache(maxsize=None)
def int8pack_available() -> bool:
    """True when this PyTorch has ``aten._weight_int8pack_mm`` for CPU tensors and it computes
    ``(x @ q.T) * scales`` (probed on a tiny matrix)."""
    op = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    if op is None:
        return False
    try:
        q = torch.tensor([[1, -2, 3], [4, 5, -6]], dtype=torch.int8)
        out = op(torch.ones(1, 3), q, torch.tensor([1.0, 0.5]))
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(out, torch.tensor([[2.0, 1.5]])))


def int8_linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """``x @ dequantize(weight).T`` with PyTorch's int8 weight-only kernel. x (..., in) in float32 or
    bfloat16 -> (..., out) in x's dtype. Without the kernel: the same product, dequantized first."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if int8pack_available():
        out = torch.ops.aten._weight_int8pack_mm(rows, weight.q, weight.scales.to(x.dtype))
    else:
        out = F.linear(rows, weight.dequantize().to(x.dtype))
    return out.reshape(*x.shape[:-1], weight.q.shape[0])


def round_weight(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """The weight as stored in ``fmt`` and read back in its own dtype: float32 unchanged, bfloat16
    rounded, int8 quantized per output channel and dequantized."""
    if fmt == "float32":
        return weight
    if fmt == "bfloat16":
        return weight.to(torch.bfloat16).to(weight.dtype)
    if fmt == "int8":
        return quantize_int8(weight).dequantize().to(weight.dtype)
    raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


# ------------------------------------------------------------------ shapes and bytes
def layer_linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of one decoder layer's four linear layers, as the engine fuses them."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * d
    return {"qkv_proj": (qkv, h), "o_proj": (h, config.num_attention_heads * d),
            "gate_up_proj": (2 * i, h), "down_proj": (h, i)}


def decode_weight_bytes(config, fmt: str) -> int:
    """Bytes of linear-layer weights one decode step reads in ``fmt``: every layer's four matrices
    and the LM head (int8: plus one float32 scale per output channel). The embedding lookup reads
    one row per token and the norms' vectors are tiny; both are left out."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    shapes = list(layer_linear_shapes(config).values()) * config.num_hidden_layers
    shapes.append((config.vocab_size, config.hidden_size))  # the LM head
    numbers = sum(o * i for o, i in shapes)
    scales = sum(o for o, _ in shapes) * SCALE_BYTES if fmt == "int8" else 0
    return numbers * _BYTES[fmt] + scales


def kv_bytes_per_token(config, fmt: str) -> int:
    """Bytes one token's K and V take over all layers in ``fmt`` (int8: plus a float32 scale per
    token, head and K or V; fp8: one scale per tensor, nothing per token)."""
    if fmt not in KV_FORMATS:
        raise ValueError(f"fmt must be one of {KV_FORMATS}, got {fmt!r}")
    per_layer = 2 * config.num_key_value_heads * config.head_dim * _BYTES[fmt]
    if fmt == "int8":
        per_layer += 2 * config.num_key_value_heads * SCALE_BYTES
    return per_layer * config.num_hidden_layers


# ------------------------------------------------------------------ GEMM time
@dataclass(frozen=True)
class GemmTimes:
    """One decoder layer's four linear layers at ``rows`` rows: per variant ("float32", "bfloat16",
    "int8 x float32", "int8 x bfloat16" and "int8", the faster int8 one) the sum of their median times
    (seconds), and the measurements (``nanobench.timing.Timing``) per shape."""

    rows: int
    seconds: dict[str, float]
    timings: dict[str, list]
    int8_kernel: bool  # False: int8 ran dequantize-then-multiply (no _weight_int8pack_mm here)
    int8_activations: str  # the activation dtype of the faster int8 product


def time_layer_gemms(config, rows: int = 1, repeats: int = 5, warmup: int = 1, seed: int = 0) -> GemmTimes:
    """Time one layer's linear layers (``layer_linear_shapes``) at ``rows`` rows of activations:
    float32 and bfloat16 through the engine's GEMM path (``nanoengine.kernels.cpu_gemm``: oneDNN
    prepacked weights where it can pack them), and int8 weights through ``int8_linear`` with float32
    and with bfloat16 activations (``seconds["int8"]`` is the faster of the two, named in
    ``int8_activations``). Random weights of the real shapes: the time does not depend on the values."""
    from nanoengine.kernels import cpu_gemm
    from nanobench.timing import measure

    g = torch.Generator().manual_seed(seed)
    timings: dict[str, list] = {"float32": [], "bfloat16": [], "int8 x float32": [], "int8 x bfloat16": []}
    for name, (out_f, in_f) in layer_linear_shapes(config).items():
        weight = torch.randn(out_f, in_f, generator=g) * in_f ** -0.5
        x = torch.randn(rows, in_f, generator=g)
        q = quantize_int8(weight)
        for fmt, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            w, xd = weight.to(dt), x.to(dt)
            packed = cpu_gemm.pack_weight(w)
            timings[fmt].append(measure(lambda w=w, xd=xd, packed=packed: cpu_gemm.linear(xd, w, None, packed),
                                        repeats=repeats, warmup=warmup, label=f"{name} {fmt}, {rows} row(s)"))
            timings[f"int8 x {fmt}"].append(measure(lambda xd=xd: int8_linear(xd, q), repeats=repeats, warmup=warmup,
                                                    label=f"{name} int8 weights x {fmt}, {rows} row(s)"))
    seconds = {fmt: sum(t.median for t in ts) for fmt, ts in timings.items()}
    activations = min(("float32", "bfloat16"), key=lambda a: seconds[f"int8 x {a}"])
    seconds["int8"] = seconds[f"int8 x {activations}"]
    return GemmTimes(rows, seconds, timings, int8pack_available(), activations)


# ------------------------------------------------------------------ quality on a real text
def real_text() -> str:
    """The Zen of Python (PEP 20), decoded from the standard library's ``this`` module without
    printing it: real English, the same on every machine."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return "".join(this.d.get(c, c) for c in this.s)


@contextlib.contextmanager
def rounded_weights(model: torch.nn.Module, fmt: str) -> Iterator[int]:
    """Inside the block every ``nn.Linear`` weight of ``model`` holds ``round_weight(w, fmt)``
    (a weight shared by two modules, a tied LM head and embedding, is rounded once); the
    original weights come back on exit. Yields the number of matrices rounded."""
    saved: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in saved:
            saved[id(module.weight)] = (module.weight, module.weight.data)
    try:
        with torch.no_grad():
            for param, data in saved.values():
                param.data = round_weight(data, fmt)
        yield len(saved)
    finally:
        for param, data in saved.values():
            param.data = data


@dataclass(frozen=True)
class TextQuality:
    """Teacher-forced quality on a text of ``tokens`` tokens, against float32 weights."""

    fmt: str
    tokens: int
    perplexity: float
    greedy_agreement: float  # share of positions whose top-1 next token equals float32's
    max_logit_error: float  # largest |logit - float32 logit| over all positions and tokens


def teacher_forced_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(T,) token ids -> (T, vocab) float32 logits at every position, one forward pass."""
    with torch.inference_mode():
        out = model(ids[None])
    logits = out.logits if hasattr(out, "logits") else out
    return logits[0].float()


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """exp of the mean cross-entropy of predicting ids[1:] from logits[:-1]."""
    return math.exp(float(F.cross_entropy(logits[:-1], ids[1:])))


def text_quality(model: torch.nn.Module, ids: torch.Tensor, formats: Sequence[str] = FORMATS) -> dict[str, TextQuality]:
    """Perplexity and greedy agreement of ``model`` on ``ids`` with its weights in each format."""
    base = teacher_forced_logits(model, ids)
    result = {}
    for fmt in formats:
        with rounded_weights(model, fmt):
            logits = base if fmt == "float32" else teacher_forced_logits(model, ids)
        agree = float((logits.argmax(-1) == base.argmax(-1)).float().mean())
        result[fmt] = TextQuality(fmt, int(ids.numel()), perplexity(logits, ids), agree,
                                  float((logits - base).abs().max()))
    return result


# ------------------------------------------------------------------ KV cache in int8 / fp8
def quantize_kv(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """K or V (T, kv_heads, d) stored in ``fmt`` and read back as float32: int8 with one scale per
    (token, head), fp8 e4m3 with one scale for the whole tensor, bfloat16 rounded."""
    x = x.float()
    if fmt == "float32":
        return x
    if fmt == "bfloat16":
        return x.to(torch.bfloat16).float()
    if fmt == "int8":
        scales = (x.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        return torch.round(x / scales).clamp(-INT8_MAX, INT8_MAX).to(torch.int8).float() * scales
    if fmt == "fp8_e4m3":
        scale = max(float(x.abs().max()) / FP8_MAX, torch.finfo(torch.float32).tiny)
        return (x / scale).to(FP8).float() * scale
    raise ValueError(f"fmt must be one of {KV_FORMATS}, got {fmt!r}")


def capture_attention_inputs(engine, ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Prefill ``ids`` on ``engine`` (prefix cache reset first) and return, per decoder layer, the
    q (T, heads, d), k and v (T, kv_heads, d) its attention layer received: after the projections
    and rotary embedding, exactly what the engine writes into its KV cache."""
    model = engine.runner.model
    captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def hook(_module, args):
        q, k, v = args[:3]
        captured.append((q.detach().float().clone(), k.detach().float().clone(), v.detach().float().clone()))

    handles = [layer.self_attn.attn.register_forward_pre_hook(hook) for layer in model.model.layers]
    try:
        engine.reset_prefix_cache()
        engine.next_token_logits(list(ids))
    finally:
        for h in handles:
            h.remove()
    return captured


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention in float32: q (T, heads, d), k/v (T, kv_heads, d) -> (T, heads, d)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (T, heads, d)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)


@dataclass(frozen=True)
class KVError:
    """How far attention's output moves when K and V are stored in ``fmt``: the relative error
    ||out - out_fp32|| / ||out_fp32|| over all layers and tokens, and the worst layer's."""

    fmt: str
    relative_error: float
    worst_layer_error: float


def kv_attention_error(captured: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                       formats: Sequence[str] = KV_FORMATS) -> dict[str, KVError]:
    """Attention of every captured layer with its K and V rounded to each format, against float32."""
    exact = [causal_attention(q, k, v) for q, k, v in captured]
    result = {}
    for fmt in formats:
        num, den, worst = 0.0, 0.0, 0.0
        for (q, k, v), ref in zip(captured, exact):
            diff = float((causal_attention(q, quantize_kv(k, fmt), quantize_kv(v, fmt)) - ref).norm())
            size = float(ref.norm())
            num, den, worst = num + diff ** 2, den + size ** 2, max(worst, diff / size)
        result[fmt] = KVError(fmt, math.sqrt(num / den), worst)
    return result


# ------------------------------------------------------------------ readings
SAME_TIME = 0.10  # within 10%: "about the same time"


def _compare(ratio: float, other: str) -> str:
    """'2.0x faster than X', '3.1x slower than X' or 'about as fast as X' for a time ratio (this / X)."""
    if ratio < 1 - SAME_TIME:
        return tr("{ratio:.1f}x faster than {other}", ratio=1 / ratio, other=other)
    if ratio > 1 + SAME_TIME:
        return tr("{ratio:.1f}x slower than {other}", ratio=ratio, other=other)
    return tr("about as fast as {other}", other=other)


def int8_speed_reading(seconds: dict[str, float], bytes_: dict[str, int]) -> str:
    """Did int8's time follow its bytes? ``seconds`` and ``bytes_`` per format (float32, bfloat16, int8)."""
    t32, t16, t8 = seconds["float32"], seconds["bfloat16"], seconds["int8"]
    share = bytes_["int8"] / bytes_["float32"]
    parts = [tr("int8 weights read {share:.0%} of float32's bytes and {share16:.0%} of bfloat16's; their products "
                "were {vs32} and {vs16}", share=share, share16=bytes_['int8'] / bytes_['bfloat16'],
                vs32=_compare(t8 / t32, 'float32'), vs16=_compare(t8 / t16, 'bfloat16'))]
    best = min(("float32", "bfloat16", "int8"), key=seconds.get)
    if best == "int8" and t8 < (1 - SAME_TIME) * min(t32, t16):
        parts.append(tr("on this CPU the smaller weights paid: the products are limited by the bytes they read"))
    else:
        parts.append(tr("on this CPU the time did not follow the bytes (fastest: {best}): these products are not "
                        "limited by reading the weights alone, and the int8 kernel also converts every weight to a "
                        "float and scales it", best=best))
    return "; ".join(parts) + "."


def quality_reading(quality: dict[str, TextQuality], close_ppl: float = 0.02, close_agree: float = 0.95) -> str:
    """What rounding the weights cost on the text: perplexity against float32's and greedy agreement."""
    base = quality["float32"].perplexity
    parts = []
    for fmt, q in quality.items():
        if fmt == "float32":
            continue
        change = q.perplexity / base - 1
        size = (tr("barely changed") if abs(change) <= close_ppl else
                tr("rose by {change:.1%}", change=abs(change)) if change > 0 else
                tr("fell by {change:.1%}", change=abs(change)))
        agree = (tr("{share:.0%} or more", share=close_agree) if q.greedy_agreement >= close_agree
                 else tr("below {share:.0%}", share=close_agree))
        parts.append(tr("{fmt}: perplexity {ppl:.2f} against float32's {base:.2f} ({size}), the same greedy next "
                        "token at {agreement:.1%} of positions ({agree})", fmt=fmt, ppl=q.perplexity, base=base,
                        size=size, agreement=q.greedy_agreement, agree=agree))
    return "; ".join(parts) + "."


def kv_reading(errors: dict[str, KVError], bytes_: dict[str, int], small: float = 0.05) -> str:
    """The KV formats by bytes per token and attention-output error; which of int8 and fp8 is closer."""
    parts = []
    for fmt, e in errors.items():
        if fmt == "float32":
            continue
        size = tr("small") if e.relative_error <= small else tr("large")
        parts.append(tr("{fmt} {share:.0%} of float32's bytes, error {error:.2%} ({size})", fmt=fmt,
                        share=bytes_[fmt] / bytes_['float32'], error=e.relative_error, size=size))
    text = "; ".join(parts)
    if "int8" in errors and "fp8_e4m3" in errors:
        i8, f8 = errors["int8"].relative_error, errors["fp8_e4m3"].relative_error
        if i8 < f8:
            text += tr(". int8 with a scale per token and head was {ratio:.1f}x closer than fp8 with one scale per "
                       "tensor: 255 evenly spaced levels fitted to each row beat fp8's 3 mantissa bits", ratio=f8 / i8)
        elif f8 < i8:
            text += tr(". fp8 with one scale per tensor was {ratio:.1f}x closer than int8 with a scale per token and "
                       "head", ratio=i8 / f8)
        else:
            text += tr(". int8 and fp8 were equally close")
    return text + "."


__all__ = ["FORMATS", "FP8", "GemmTimes", "INT8_MAX", "Int8Weight", "KVError", "KV_FORMATS", "TextQuality",
           "capture_attention_inputs", "causal_attention", "decode_weight_bytes", "int8_linear", "int8_speed_reading",
           "int8pack_available", "kv_attention_error", "kv_bytes_per_token", "kv_reading", "layer_linear_shapes",
           "perplexity", "quality_reading", "quantize_int8", "quantize_kv", "real_text", "round_weight",
           "rounded_weights", "teacher_forced_logits", "text_quality", "time_layer_gemms"]
