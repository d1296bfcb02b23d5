"""widgets.quantization (chapter 10): int8 weights, the int8/fp8 KV cache, bytes, and the readings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from widgets import quantization as qz

SMOLLM2 = SimpleNamespace(hidden_size=576, intermediate_size=1536, head_dim=64, num_attention_heads=9,
                          num_key_value_heads=3, num_hidden_layers=30, vocab_size=49152)


def test_int8_quantization_is_per_output_channel_and_close() -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    w[3] *= 100  # one large row must not coarsen the others
    w[5] = 0
    q = qz.quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.scales.shape == (64,)
    assert int(q.q.abs().max()) == qz.INT8_MAX
    assert q.nbytes == 64 * 96 + 64 * 4
    err = (q.dequantize() - w).abs()
    assert bool((err <= q.scales[:, None] / 2 + 1e-6).all())  # rounding: at most half a step per row
    assert float(q.dequantize()[5].abs().max()) == 0.0


def test_int8_linear_matches_the_dequantized_product() -> None:
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(48, 64, generator=g), torch.randn(3, 64, generator=g)
    q = qz.quantize_int8(w)
    expected = x @ q.dequantize().T
    assert torch.allclose(qz.int8_linear(x, q), expected, atol=1e-4)
    assert qz.int8_linear(x.to(torch.bfloat16), q).dtype == torch.bfloat16
    assert qz.int8_linear(x[None], q).shape == (1, 3, 48)


def test_int8pack_kernel_is_probed() -> None:
    available = qz.int8pack_available()
    assert isinstance(available, bool)
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        assert not available


def test_bytes_per_decode_step_and_per_token() -> None:
    f32, bf16, i8 = (qz.decode_weight_bytes(SMOLLM2, f) for f in qz.FORMATS)
    assert bf16 * 2 == f32 and i8 < bf16 / 2 + 1e6 and i8 > f32 / 4
    assert qz.kv_bytes_per_token(SMOLLM2, "float32") == 46080  # the engine's memory report for SmolLM2
    assert qz.kv_bytes_per_token(SMOLLM2, "fp8_e4m3") == 46080 // 4
    assert qz.kv_bytes_per_token(SMOLLM2, "int8") == 46080 // 4 + 30 * 2 * 3 * 4
    with pytest.raises(ValueError):
        qz.decode_weight_bytes(SMOLLM2, "int4")


def test_kv_quantization_errors_are_ordered() -> None:
    x = torch.randn(40, 3, 64, generator=torch.Generator().manual_seed(2))
    errors = {f: float((qz.quantize_kv(x, f) - x).norm() / x.norm()) for f in qz.KV_FORMATS}
    assert errors["float32"] == 0.0
    assert 0 < errors["bfloat16"] < errors["int8"] < errors["fp8_e4m3"] < 0.1


def test_attention_error_on_rounded_kv() -> None:
    g = torch.Generator().manual_seed(3)
    captured = [(torch.randn(12, 9, 64, generator=g), torch.randn(12, 3, 64, generator=g),
                 torch.randn(12, 3, 64, generator=g)) for _ in range(2)]
    errors = qz.kv_attention_error(captured)
    assert errors["float32"].relative_error == 0.0
    assert errors["int8"].relative_error < errors["fp8_e4m3"].relative_error
    assert errors["int8"].worst_layer_error >= errors["int8"].relative_error * 0.5


def test_causal_attention_is_causal_gqa() -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(5, 4, 8, generator=g), torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    out = qz.causal_attention(q, k, v)
    assert out.shape == (5, 4, 8)
    assert torch.allclose(out[0, :2], v[0, 0].expand(2, 8), atol=1e-6)  # the first token sees only itself


def test_rounded_weights_restores_and_rounds_tied_once() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False))
    model[1].weight = model[0].weight  # tied
    before = model[0].weight.detach().clone()
    with qz.rounded_weights(model, "int8") as n:
        assert n == 1
        assert not torch.equal(model[0].weight, before)
        assert torch.equal(model[0].weight, qz.quantize_int8(before).dequantize())
    assert torch.equal(model[0].weight, before)


def test_text_quality_on_a_tiny_model() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50, bias=False))
    ids = torch.randint(0, 50, (30,))
    quality = qz.text_quality(model, ids)
    assert quality["float32"].greedy_agreement == 1.0 and quality["float32"].max_logit_error == 0.0
    assert 0 <= quality["int8"].greedy_agreement <= 1 and quality["int8"].perplexity > 1


def test_real_text_is_the_zen_of_python() -> None:
    text = qz.real_text()
    assert text.startswith("The Zen of Python") and "Beautiful is better than ugly." in text


# ------------------------------------------------------------------ readings, both sides of each threshold
def _bytes():
    return {f: qz.decode_weight_bytes(SMOLLM2, f) for f in qz.FORMATS}


def test_int8_speed_reading_both_sides() -> None:
    paid = qz.int8_speed_reading({"float32": 1.0, "bfloat16": 0.6, "int8": 0.3}, _bytes())
    assert "smaller weights paid" in paid and "did not follow" not in paid
    assert "3.3x faster than float32" in paid and "2.0x faster than bfloat16" in paid
    slow = qz.int8_speed_reading({"float32": 1.0, "bfloat16": 0.6, "int8": 5.0}, _bytes())
    assert "did not follow the bytes (fastest: bfloat16)" in slow and "5.0x slower than float32" in slow
    level = qz.int8_speed_reading({"float32": 1.0, "bfloat16": 0.6, "int8": 0.58}, _bytes())
    assert "about as fast as bfloat16" in level and "did not follow" in level


def _quality(ppl, agree):
    return qz.TextQuality("x", 100, ppl, agree, 0.0)


def test_quality_reading_both_sides() -> None:
    close = qz.quality_reading({"float32": _quality(21.8, 1.0), "int8": _quality(21.9, 0.97)})
    assert "barely changed" in close and "(95% or more)" in close
    far = qz.quality_reading({"float32": _quality(21.8, 1.0), "int8": _quality(24.0, 0.90)})
    assert "rose by 10.1%" in far and "(below 95%)" in far
    fell = qz.quality_reading({"float32": _quality(21.8, 1.0), "bfloat16": _quality(20.0, 0.99)})
    assert "fell by" in fell


def test_kv_reading_both_sides() -> None:
    kb = {f: qz.kv_bytes_per_token(SMOLLM2, f) for f in qz.KV_FORMATS}
    err = lambda f, e: qz.KVError(f, e, e)  # noqa: E731
    int8_better = qz.kv_reading({"float32": err("float32", 0), "int8": err("int8", 0.027),
                                 "fp8_e4m3": err("fp8_e4m3", 0.073)}, kb)
    assert "int8 with a scale per token and head was 2.7x closer" in int8_better and "(small)" in int8_better
    assert "fp8_e4m3 25% of float32's bytes, error 7.30% (large)" in int8_better
    fp8_better = qz.kv_reading({"float32": err("float32", 0), "int8": err("int8", 0.06),
                                "fp8_e4m3": err("fp8_e4m3", 0.02)}, kb)
    assert "fp8 with one scale per tensor was 3.0x closer" in fp8_better
