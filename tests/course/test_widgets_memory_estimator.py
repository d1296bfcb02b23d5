"""Tests for widgets.memory_estimator: formulas, the view, and the engine's real allocation."""

from __future__ import annotations

import html

import pytest

from nanoengine.models.presets import PRESETS
from widgets import default_engine, single_thread, tiny_engine
from widgets.memory_estimator import DTYPE_BYTES, GiB, MemoryEstimator, MemoryEstimatorController

DEVICES = {"24 GiB": 24 * GiB, "80 GiB (H100)": 80 * GiB}


@pytest.fixture(scope="module")
def engine():
    with single_thread():
        yield default_engine()


@pytest.mark.slow  # loads the default model
def test_kv_formula_matches_the_default_engines_kv_tensor(engine) -> None:
    snap = engine.snapshot()
    check = MemoryEstimatorController.compare_with_engine(engine)
    assert check["kv_formula"] == check["kv_allocated"] == engine.runner.kv_cache_bytes
    assert engine.model_config.kv_bytes_per_token(4) * snap.num_blocks * snap.block_size == engine.runner.kv_cache_bytes
    # the preset the estimator uses is the loaded model's shape
    preset, loaded = PRESETS["SmolLM2-135M"], engine.model_config
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings"):
        assert getattr(preset, field) == getattr(loaded, field), field
    # the engine's pool, read as batch x context (the estimator caps context at the model's 8192)
    tokens = snap.num_blocks * snap.block_size
    batch = next(b for b in range(1, tokens + 1) if tokens % b == 0 and tokens // b <= preset.max_position_embeddings)
    estimate = MemoryEstimatorController(devices=DEVICES).estimate(
        "SmolLM2-135M", context_len=tokens // batch, batch_size=batch, dtype="float32")
    assert estimate.kv_bytes == engine.runner.kv_cache_bytes


@pytest.mark.slow  # loads the default model
def test_weight_formula_matches_the_default_engines_parameters(engine) -> None:
    check = MemoryEstimatorController.compare_with_engine(engine)
    assert check["weights_formula"] == check["weights_allocated"]
    estimate = MemoryEstimatorController(devices=DEVICES).estimate("SmolLM2-135M", 1, 1, "float32")
    assert estimate.weights_bytes == check["weights_allocated"]


def test_known_figures_for_the_presets() -> None:
    c = MemoryEstimatorController(devices=DEVICES)
    e = c.estimate("Llama-3-8B", context_len=8192, batch_size=8, dtype="bfloat16", device="80 GiB (H100)")
    assert e.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072  # 128 KiB per token
    assert e.kv_bytes == 8 * GiB and e.weights_bytes == 8_030_261_248 * 2
    assert e.fits and e.max_batch_size == (80 * GiB - e.weights_bytes) // (131072 * 8192)
    big = c.estimate("Llama-3-70B", context_len=8192, batch_size=1, dtype="bfloat16", device="80 GiB (H100)")
    assert not big.fits and big.weights_bytes > 80 * GiB and big.max_batch_size == 0
    smol = c.estimate("SmolLM2-135M", 2048, 1, "float8 / int8", "24 GiB")
    assert smol.kv_bytes_per_token == 2 * 30 * 3 * 64 and set(DTYPE_BYTES) >= {"float32", "bfloat16"}


@pytest.mark.slow
def test_the_view_redraws_on_every_control() -> None:
    view = MemoryEstimator(MemoryEstimatorController(devices=DEVICES), model="Llama-3-8B", context_len=8192,
                           batch_size=8, dtype="bfloat16")
    assert "8.00 GiB" in view.summary.value and "14.96 GiB" in view.summary.value
    assert view.chart.value[:4] == b"\x89PNG"
    chart = view.chart.value
    view.batch_size.value = 64  # 64 GiB of KV + 15 GiB of weights: no longer fits in 24 GiB
    assert "does not fit" in view.summary.value and view.chart.value != chart
    view.device.value = "80 GiB (H100)"
    assert "fits," in view.summary.value
    view.dtype.value = "float32"
    assert view.estimate.kv_bytes == 128 * GiB and "does not fit" in view.summary.value
    view.model.value = "SmolLM2-135M"
    assert view.estimate.weights_bytes == PRESETS["SmolLM2-135M"].num_parameters() * 4


@pytest.mark.slow
def test_bad_values_show_a_message() -> None:
    view = MemoryEstimator(MemoryEstimatorController(devices=DEVICES))
    assert view.chart.layout.display is None and view.chart.value[:4] == b"\x89PNG"
    view.context_len.value = 100_000
    assert "handles at most 8192 positions" in html.unescape(view.message.value)
    assert view.estimate is None and "no estimate" in view.summary.value
    assert view.chart.layout.display == "none"  # the old chart must not sit under "no estimate"
    view.context_len.value = 4096
    assert view.message.value == "" and view.estimate is not None
    assert view.chart.layout.display is None
    view.batch_size.value = 0
    assert "batch size must be" in view.message.value
    with pytest.raises(ValueError, match="unknown model"):
        view.controller.estimate("GPT-5", 10, 1)


@pytest.mark.slow
def test_the_engine_check_line_in_the_view() -> None:
    engine = tiny_engine()
    view = MemoryEstimator(MemoryEstimatorController(devices=DEVICES), engine=engine)
    assert f"{engine.runner.kv_cache_bytes:,} B (equal)" in view.engine_check.value
