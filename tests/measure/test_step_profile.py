"""Where each engine spends its step (nanobench/step_profile.py, ``bench --profile``): the
classifier on synthetic profiler events, the profiler around a real step, a real engine on
the tiny model, the command line's checks, and vLLM's side through the stand-in runner."""

from __future__ import annotations

import json

import pytest
import torch

from nanobench.step_profile import (CATEGORIES, SAMPLING_RANGES, STEP_RANGE, Span, classify_step, mark_engine,
                                    op_category, profile_engine, profile_steps, step_times, summarize)
from nanoengine.__main__ import main


# ------------------------------------------------------------- op names
@pytest.mark.parametrize("name", ["aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
                                  "mkldnn::_linear_pointwise", "nanoengine::few_rows_linear", "_C::onednn_mm",
                                  "_C::weight_packed_linear"])
def test_matrix_products_are_gemms(name):
    assert op_category(name) == "gemm"


@pytest.mark.parametrize("name", ["nanoengine::paged_decode_attention", "aten::scaled_dot_product_attention",
                                  "aten::_scaled_dot_product_flash_attention_for_cpu",
                                  "vllm::unified_attention_with_output", "_C::cpu_attention_with_kv_cache",
                                  "_C::cpu_attn_reshape_and_cache"])
def test_attention_kernels_are_attention(name):
    assert op_category(name) == "attention"


@pytest.mark.parametrize("name", ["aten::softmax", "aten::add", "aten::index_copy_", "nanoengine::rms_norm",
                                  "_C::rotary_embedding", "graph_0_cpp_fused_mm_add_rsqrt_0", "aten::empty"])
def test_other_operators_are_neither(name):
    assert op_category(name) is None


# ------------------------------------------------------------- one step
def op(name, start, end, thread=0):
    return Span(name, start, end, thread)


def scope(name, start, end, thread=0):
    return Span(name, start, end, thread, is_range=True)


def test_a_step_is_cut_into_disjoint_categories_that_add_up_to_it():
    step = scope(STEP_RANGE, 0, 100)
    spans = [
        op("aten::empty", -10, -5),  # before the step: not counted
        scope("nanoengine: model", 5, 58),  # a range that is no category counts nothing itself
        op("aten::linear", 10, 30), op("aten::t", 10, 11), op("aten::mm", 12, 28),  # GEMM: 20, t included
        scope("nanobench: nanoengine attention", 30, 50), op("aten::index_copy_", 31, 33),  # attention: 20
        op("aten::softmax", 50, 55), op("aten::_softmax", 51, 54),  # other ops: 2 + 3
        scope(SAMPLING_RANGES[0], 60, 70), op("aten::argmax", 61, 69),  # sampling: 10, ops inside included
        op("aten::add", 80, 84, thread=7),  # another thread: reported apart, not in the sum
    ]
    times = classify_step(step, [step, *spans])
    assert times == {"gemm": 20, "attention": 20, "other_ops": 5, "sampling": 10, "host": 45, "step_us": 100,
                     "other_threads_us": 4}
    assert sum(times[c] for c in CATEGORIES) == times["step_us"]


def test_an_attention_operator_takes_the_products_inside_it():
    step = scope(STEP_RANGE, 0, 50)
    spans = [op("vllm::unified_attention_with_output", 0, 40), op("_C::cpu_attention_with_kv_cache", 5, 35),
             op("aten::bmm", 10, 20)]
    times = classify_step(step, spans)
    assert times["attention"] == 40 and times["gemm"] == 0 and times["host"] == 10


def test_steps_are_found_in_order_and_overlapping_ones_refused():
    spans = [scope(STEP_RANGE, 100, 150), op("aten::mm", 110, 120), scope(STEP_RANGE, 0, 50), op("aten::mm", 5, 45)]
    assert [t["gemm"] for t in step_times(spans)] == [40, 10]
    with pytest.raises(ValueError, match="overlap"):
        step_times([scope(STEP_RANGE, 0, 50), scope(STEP_RANGE, 40, 90)])


def step(gemm, sampling, total, attention=0.0, other=0.0):
    return {"gemm": gemm, "attention": attention, "other_ops": other, "sampling": sampling,
            "host": total - gemm - attention - other - sampling, "step_us": total, "other_threads_us": 0.0}


def test_summarize_reports_medians_and_shares_of_the_steps_that_ran_the_model():
    figures = summarize([step(600, 100, 1000), step(800, 100, 2000), step(700, 200, 3000), step(0, 0, 50)])
    assert figures["steps"] == 3 and figures["idle_steps"] == 1  # the step without a product ran no model
    assert figures["step_ms"] == {"median": 2.0, "mean": 2.0}
    assert figures["categories"]["gemm"] == {"median_ms": 0.7, "share": 2100 / 6000}
    assert figures["categories"]["host"]["median_ms"] == pytest.approx(1.1)  # hosts 0.3, 1.1, 2.1 ms
    assert sum(c["share"] for c in figures["categories"].values()) == pytest.approx(1.0)


def test_summarize_refuses_a_profile_without_products_or_without_sampling():
    with pytest.raises(ValueError, match="no profiled step ran a matrix product"):
        summarize([step(0, 0, 50)])
    with pytest.raises(ValueError, match="no sampling range"):
        summarize([step(600, 0, 1000)])


# ------------------------------------------------------------- the profiler
class Stepper:
    """An engine's shape as ``profile_steps`` sees it: a ``step()`` the loop calls."""

    def __init__(self):
        self.weight = torch.randn(32, 64)

    def step(self):
        x = torch.randn(4, 64)
        with torch.profiler.record_function(SAMPLING_RANGES[1]):
            return torch.nn.functional.linear(x, self.weight).argmax(-1)


def test_profile_steps_ranges_each_step_and_leaves_the_object_as_it_was():
    stepper = Stepper()
    steps, result = profile_steps(stepper, lambda: [stepper.step() for _ in range(3)])
    assert len(steps) == 3 and len(result) == 3
    for times in steps:
        assert times["sampling"] > 0 and times["gemm"] == 0  # the product ran inside the sampling range
        assert sum(times[c] for c in CATEGORIES) == pytest.approx(times["step_us"])
    assert "step" not in vars(stepper)


@pytest.mark.slow  # builds the engine on the tiny model and profiles four runs
def test_the_engine_profiled_on_the_tiny_model(tiny_llama_dir):
    from nanoengine import LLM

    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32")
    alone = profile_engine(llm, [[5, 6, 7, 8, 9, 10]], [5])
    assert alone["steps"] == 5 and alone["output_tokens"] == 5  # the prefill step emits the first token
    both = profile_engine(llm, [[5, 6, 7, 8, 9, 10], [11, 12, 13]], [5, 3])
    assert both["output_tokens"] == 8
    for figures in (alone, both):
        shares = {c: figures["categories"][c]["share"] for c in CATEGORIES}
        assert sum(shares.values()) == pytest.approx(1.0)
        assert all(shares[c] > 0 for c in ("gemm", "attention", "other_ops", "sampling")), shares
        assert shares["host"] >= 0
    # mark_engine's ranges are gone afterwards, and it finds the layers it marks.
    assert "phase" not in vars(llm.engine.profiler)
    undo = mark_engine(llm)
    assert "phase" in vars(llm.engine.profiler)
    undo()
    assert "phase" not in vars(llm.engine.profiler)


# ------------------------------------------------------------- command line
@pytest.mark.parametrize("extra, message", [
    (["--speculative"], "leave out --speculative"),
    (["--overhead"], "leave out --overhead"),
    (["--device", "cuda"], "--device cpu"),
])
def test_bad_profile_arguments_are_refused_before_anything_loads(tmp_path, capsys, extra, message):
    code = main(["bench", "--profile", "--model", str(tmp_path / "none"), *extra])
    assert code == 2 and message in capsys.readouterr().err


def test_a_vllm_peer_profiles_only_with_its_model_in_process():
    from test_vllm_peer import fake_peer

    with pytest.raises(ValueError, match="VllmSettings\\(profile=True\\)"):
        fake_peer().profile([[1, 2]], [2])
    with fake_peer(profile=True) as peer:
        answer = peer.profile([[1, 2, 3], [4, 5]], [4, 2])
    assert answer["steps"] == 4 and answer["output_tokens"] == 6 and answer["engine_core_client"] == "InprocClient"


@pytest.mark.slow  # the engine and the roofline on a tiny model, twice
def test_bench_vs_vllm_profile_writes_both_engines_at_both_batches(tiny_llama_dir, tmp_path):
    """vLLM's side is the stand-in runner, which refuses to profile unless the driver put
    the engine core in its process (VLLM_ENABLE_V1_MULTIPROCESSING=0), as the real one does."""
    from test_vllm_peer import fake_venv

    out = tmp_path / "bench-vllm-profile.json"
    code = main(["bench", "--vs-vllm", "--profile", "--vllm-venv", str(fake_venv(tmp_path)),
                 "--vllm-threads-bind", "0", "--model", str(tiny_llama_dir), "--num-requests", "3",
                 "--min-prompt", "4", "--max-prompt", "12", "--output-len", "4", "--skip-hf",
                 "--single-stream-tokens", "0", "--repeats", "1", "--out", str(out)])
    assert code == 0
    profile = json.loads(out.read_text())["profile"]
    assert [(r["system"], r["batch"]) for r in profile["rows"]] == [
        ("nanoengine", 1), ("vllm", 1), ("nanoengine", 3), ("vllm", 3)]
    for row in profile["rows"]:
        assert row["output_tokens"] == 4 * row["batch"]
        assert sum(c["share"] for c in row["categories"].values()) == pytest.approx(1.0)
    assert profile["vllm"]["settings"]["profile"] is True
    assert profile["vllm"]["engine_core_client"] == "InprocClient"
    assert profile["vllm"]["environment"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
