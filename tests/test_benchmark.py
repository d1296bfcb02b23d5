"""The benchmark command runs end to end on a tiny checkpoint and writes honest results."""

from __future__ import annotations

import json

import pytest

from nanoengine.__main__ import main
from nanoengine.measure.benchmark import compare_greedy, make_workload, workload_flops
from nanoengine.engine.compilation import CPU_MIN_ROWS
from nanoengine.models.presets import PRESETS


@pytest.mark.slow  # three systems and a GEMM roofline
def test_bench_command_compares_with_transformers_and_writes_results(tiny_llama_dir, tmp_path):
    out = tmp_path / "bench.json"
    code = main(["bench", "--model", str(tiny_llama_dir), "--num-requests", "6", "--min-prompt", "8",
                 "--max-prompt", "40", "--output-len", "8", "--hf-batch-size", "3",
                 "--single-stream-tokens", "4", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    systems = results["systems"]
    assert set(systems) == {"nanoengine", "hf_static", "hf_generate_batch"}
    for name in ("hf_static", "hf_generate_batch"):
        check = systems[name]["greedy_check"]
        assert check["total"] == 6 and not check["unexplained"], check
    assert 0 < systems["nanoengine"]["fraction_of_gemm_peak"] < 1.5
    assert results["workload"]["num_requests"] == 6 and results["workload"]["output_len"] == 8
    assert results["environment"]["torch"] and results["date"] and "bench" in results["command"]
    assert "nanoengine_revision" in results["environment"] and results["environment"]["omp_wait_policy"]
    assert all(value is None or len(value) == 3 for value in results["load_average"].values())
    single = results["single_stream_decode"]
    assert single["repeats"] >= 3 and single["tokens"] == 4
    assert single["ratio"] is None or single["ratio"] == pytest.approx(single["nanoengine_tok_s"] / single["hf_tok_s"])
    assert results["ratios_engine_over"]["hf_static"] == pytest.approx(
        systems["nanoengine"]["output_tokens_per_s"] / systems["hf_static"]["output_tokens_per_s"])


def test_workload_is_reproducible_and_in_range():
    a = make_workload(10, 32, 256, seed=3)
    assert a == make_workload(10, 32, 256, seed=3)
    assert all(32 <= len(p) <= 256 for p in a) and all(0 <= t < 10000 for p in a for t in p)
    with pytest.raises(ValueError, match="min_prompt"):
        make_workload(1, 10, 5, seed=0)


def test_compare_greedy_accepts_only_near_ties():
    import torch

    top2 = [torch.tensor([[5.0, 1.0], [3.0, 2.9995]])]
    assert compare_greedy([[1, 2]], [[1, 2]], top2)["identical"] == 1
    tie = compare_greedy([[1, 7]], [[1, 2]], top2, tolerance=1e-3)
    assert tie["near_tie_divergences"] == 1 and not tie["unexplained"]
    real = compare_greedy([[9, 2]], [[1, 2]], top2, tolerance=1e-3)
    assert real["unexplained"] == [{"request": 0, "position": 0, "top2_gap": 4.0}]


def test_workload_flops_counts_weights_head_and_attention():
    config = PRESETS["SmolLM2-135M"]
    one = workload_flops(config, [[0] * 10], output_len=1)
    layer_params = config.num_parameters() - config.vocab_size * config.hidden_size - config.hidden_size
    assert one > 2 * layer_params * 10 + 2 * config.vocab_size * config.hidden_size



def test_bench_runs_transformers_on_the_engines_device_and_dtype(tiny_llama_dir, tmp_path):
    out = tmp_path / "bench-bf16.json"
    code = main(["bench", "--model", str(tiny_llama_dir), "--device", "cpu", "--dtype", "bfloat16",
                 "--num-requests", "3", "--min-prompt", "4", "--max-prompt", "12", "--output-len", "4",
                 "--hf-batch-size", "3", "--single-stream-tokens", "0", "--skip-generate-batch", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    assert results["device"] == "cpu" and results["dtype"] == "bfloat16" and results["gemm_peak_dtype"] == "bfloat16"
    hf = results["systems"]["hf_static"]
    assert (hf["device"], hf["dtype"]) == ("cpu", "bfloat16")  # read back from the loaded model
    assert hf["greedy_check"]["total"] == 3


def test_load_hf_puts_the_model_on_the_device_in_the_dtype(tiny_llama_dir):
    import torch

    from nanoengine.measure.benchmark import load_hf

    model = load_hf(tiny_llama_dir, device="cpu", dtype=torch.bfloat16)
    assert model.device.type == "cpu" and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.generation_config.eos_token_id is None


def test_bench_compile_compares_eager_and_compiled_in_one_run(tiny_llama_dir, tmp_path):
    out = tmp_path / "bench-compile.json"
    code = main(["bench", "--model", str(tiny_llama_dir), "--skip-hf", "--compile", "--compile-repeats", "2",
                 "--num-requests", "4", "--min-prompt", "4", "--max-prompt", "24", "--output-len", "6",
                 "--single-stream-tokens", "4", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    compiled = results["compile"]
    assert compiled["greedy_tokens_equal"] and compiled["greedy_check"]["identical"] == 4
    assert compiled["deterministic_across_repeats"]
    workload = compiled["workload"]
    assert workload["repeats"] == 2 and all(len(workload["seconds"][k]) == 2 for k in ("eager", "compiled"))
    assert workload["speedup"] == pytest.approx(
        workload["output_tokens_per_s"]["compiled"] / workload["output_tokens_per_s"]["eager"])
    if compiled["compiled"]:
        assert compiled["compile_seconds"] > 0 and "RMSNorm.add_norm_fn" in compiled["compiled_ops"]
    else:
        assert compiled["fallback_reason"]
    for system in ("eager", "compiled"):
        shares = compiled["op_time"][system]
        assert 0 < shares["workload"]["share"] < 1
        assert set(shares["decode_step"]["per_op_ms"]) >= {"RMSNorm.add_norm_fn", "SiluAndMul.silu_and_mul_fn"}
    assert "compiled / eager" in compiled["explanation"] and "of the workload's time" in compiled["explanation"]
    assert compiled["single_stream_decode"]["tokens"] == 4
    assert compiled["cpu_min_rows"] == CPU_MIN_ROWS and f"at least {CPU_MIN_ROWS} rows" in compiled["explanation"]
