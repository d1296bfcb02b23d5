"""The benchmark command runs end to end on a tiny checkpoint and writes honest results."""

from __future__ import annotations

import json

import pytest

from nanoengine.__main__ import main
from nanoengine.benchmark import compare_greedy, make_workload, workload_flops
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
