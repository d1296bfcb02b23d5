"""The benchmark command runs end to end on a tiny checkpoint and writes honest results."""

from __future__ import annotations

import json

import pytest
import torch

from nanoengine.__main__ import main
from nanobench.benchmark import (cb_config_for, compare_greedy, latency_summary, make_output_lens, make_workload,
                                 percentiles, poisson_arrivals, spread, static_computed_tokens,
                                 workload_flops)
from nanoengine.models.presets import PRESETS


@pytest.mark.slow  # three systems and a GEMM roofline
def test_bench_command_compares_with_transformers_and_writes_results(tiny_llama_dir, tmp_path):
    out = tmp_path / "bench.json"
    code = main(["bench", "--model", str(tiny_llama_dir), "--num-requests", "6", "--min-prompt", "8",
                 "--max-prompt", "40", "--output-len", "8", "--hf-batch-size", "3",
                 "--single-stream-tokens", "4", "--repeats", "1", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    systems = results["systems"]
    assert set(systems) == {"nanoengine", "hf_static", "hf_generate_batch"}
    assert systems["hf_generate_batch"]["setup_seconds"]["median"] > 0  # timed apart from generation
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



@pytest.mark.slow
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

    from nanobench.benchmark import load_hf

    model = load_hf(tiny_llama_dir, device="cpu", dtype=torch.bfloat16)
    assert model.device.type == "cpu" and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.generation_config.eos_token_id is None


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compile=True is CUDA's: needs a CUDA GPU")
def test_bench_compile_compares_eager_and_compiled_in_one_run(tiny_llama_dir, tmp_path):
    out = tmp_path / "bench-compile.json"
    code = main(["bench", "--model", str(tiny_llama_dir), "--device", "cuda", "--skip-hf", "--compile",
                 "--compile-repeats", "2", "--num-requests", "4", "--min-prompt", "4", "--max-prompt", "24",
                 "--output-len", "6", "--single-stream-tokens", "4", "--out", str(out)])
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
    assert "compiled / eager" in compiled["explanation"] and "op_time" not in compiled
    assert compiled["single_stream_decode"]["tokens"] == 4


@pytest.mark.slow  # every option on a tiny checkpoint: uneven lengths, repeats, online arrivals, a sweep
def test_bench_uneven_lengths_online_and_sweep(tiny_llama_dir, tmp_path):
    out = tmp_path / "bench-all.json"
    code = main(["bench", "--model", str(tiny_llama_dir), "--num-requests", "6", "--min-prompt", "8",
                 "--max-prompt", "30", "--output-len", "10", "--min-output-len", "2", "--repeats", "2",
                 "--hf-batch-size", "3", "--single-stream-tokens", "0", "--online-rates", "50", "2",
                 "--batch-sizes", "1", "4", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    lens = make_output_lens(6, 2, 10, seed=0)
    assert results["workload"]["output_len_range"] == [2, 10] and results["workload"]["output_tokens"] == sum(lens)
    engine = results["systems"]["nanoengine"]
    assert engine["repeats"] == 2 and len(engine["tokens_per_s_spread"]["runs"]) == 2
    assert engine["deterministic_across_repeats"]
    assert engine["latency"]["ttft_ms"]["count"] == 12  # 6 requests x 2 repeats
    assert engine["latency"]["itl_ms"]["count"] == 2 * sum(n - 1 for n in lens)
    for name in ("hf_static", "hf_generate_batch"):  # each request's own length, greedy equal to the engine's
        check = results["systems"][name]["greedy_check"]
        assert check["total"] == 6 and not check["unexplained"], (name, check)
    assert results["systems"]["hf_static"]["computed_output_tokens"] == static_computed_tokens(lens, 3) > sum(lens)
    online = {row["rate_requests_per_s"]: row for row in results["online"]}
    assert set(online) == {50.0, 2.0}
    # At 2 requests/s the 6 arrivals span seconds, far longer than this tiny model needs to serve them
    assert online[2.0]["seconds"] >= online[2.0]["arrival_span_s"] > online[50.0]["arrival_span_s"]
    assert online[2.0]["ttft_ms"]["count"] == 6
    sweep = {row["max_num_seqs"]: row for row in results["batch_sweep"]}
    assert set(sweep) == {1, 4} and all(row["output_tokens_per_s"] > 0 for row in sweep.values())
    roof = results["roofline"]
    assert roof["ridge_flops_per_byte"] == pytest.approx(roof["gemm_peak_gflops"] / roof["memory_bandwidth_gbs"])


def test_output_lengths_and_arrivals_are_seeded_and_in_range():
    lens = make_output_lens(50, 4, 9, seed=1)
    assert lens == make_output_lens(50, 4, 9, seed=1) and set(lens) == set(range(4, 10))
    assert make_output_lens(3, 7, 7, seed=0) == [7, 7, 7]
    arrivals = poisson_arrivals(2000, rate=4.0, seed=2)
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, rate=0, seed=0)


def test_statistics_helpers():
    s = spread([3.0, 1.0, 2.0, 10.0])
    assert (s["median"], s["min"], s["max"]) == (2.5, 1.0, 10.0) and s["q1"] <= s["median"] <= s["q3"]
    p = percentiles([0.001 * i for i in range(1, 101)])
    assert p["count"] == 100 and p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
    assert percentiles([]) is None
    assert static_computed_tokens([2, 8, 3, 3], batch_size=2) == 2 * 8 + 2 * 3


def test_latency_summary_reads_the_engines_timestamps():
    from nanoengine.outputs import RequestMetrics

    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.1, first_token_time=10.5, finished_time=10.9,
                       num_output_tokens=3, token_times=(10.5, 10.7, 10.9))
    summary = latency_summary([m])
    assert summary["ttft_ms"]["p50"] == pytest.approx(500) and summary["tpot_ms"]["p50"] == pytest.approx(200)
    assert summary["itl_ms"]["count"] == 2 and summary["e2e_ms"]["p99"] == pytest.approx(900)


def test_transformers_cache_is_sized_for_every_request_at_once():
    prompts = [[1] * 250, [2] * 10, [3] * 600]
    config = cb_config_for(prompts, [10, 5, 100], max_batch_tokens=512)
    # pages of 256 tokens: 260 -> 2, 15 -> 1, 700 -> 3
    assert config == {"page_size": 256, "max_batch_tokens": 512, "num_blocks": 6}
