"""The GPU check script (``nanobench/gpu_check.py``), exercised on the CPU.

The real check needs a CUDA GPU; here ``--cpu-smoke`` runs every stage at tiny sizes
(Triton under its interpreter, the engine and transformers on the CPU), in a child
process because ``TRITON_INTERPRET`` must be set before the kernels are first imported.
The JSON it writes is the contract with whoever reads a GPU run's results.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nanobench import gpu_check
from nanoengine.models.presets import PRESETS

pytestmark = pytest.mark.slow  # the CPU smoke run builds and benchmarks models

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanobench.gpu_check", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check") / "smoke.json"
    start = time.monotonic()
    proc = _run("--cpu-smoke", "--out", str(out))
    return proc, out, time.monotonic() - start


@pytest.mark.slow  # every stage of the GPU check, in a subprocess
def test_cpu_smoke_runs_every_stage_and_passes(smoke):
    proc, out, seconds = smoke
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout
    report = json.loads(out.read_text())
    assert report["mode"] == "cpu-smoke" and report["passed"] is True
    assert "--cpu-smoke" in report["command"] and report["date"]
    for key in ("python", "torch", "transformers", "triton", "cuda_available"):
        assert key in report["environment"]
    assert list(report["checks"]) == ["kernels", "cuda_graphs", "hf_parity", "benchmark"]
    # Every stage ran and passed (one that found the budget spent would be "skipped"). The seconds are not
    # held to a limit (a busy machine makes any such limit flaky): the whole run's include its stages'.
    assert all(c["status"] == "pass" for c in report["checks"].values())
    assert sum(c["seconds"] for c in report["checks"].values()) <= report["seconds"] + 0.05
    print(f"cpu smoke: {seconds:.0f} s wall, stages {[c['seconds'] for c in report['checks'].values()]}")


@pytest.mark.slow
def test_cpu_smoke_checks_each_kernel_against_its_reference(smoke):
    kernels = json.loads(smoke[1].read_text())["checks"]["kernels"]
    assert kernels["interpreted"] is True
    ops = {(c["op"], c["dtype"]) for c in kernels["cases"]}
    assert ops == {(op, dt) for op in ("store_kv", "paged_decode_attention", "paged_prefill_attention")
                   for dt in ("float32", "bfloat16")}
    for case in kernels["cases"]:
        assert case["pass"]
        if case["op"] == "store_kv":
            assert case["bit_exact"]
        else:
            assert case["max_abs_error"] <= case["tolerance"]


def test_cpu_smoke_parity_graphs_and_benchmark_numbers(smoke):
    checks = json.loads(smoke[1].read_text())["checks"]
    graphs = checks["cuda_graphs"]
    assert graphs["identical"] == graphs["requests"] and not graphs["unexplained"]
    fp32 = checks["hf_parity"]["runs"]["float32"]
    assert fp32["gating"] and fp32["identical"] == fp32["total"] > 0
    bench = checks["benchmark"]
    assert set(bench["systems"]) == {"nanoengine", "hf_static", "hf_generate_batch"}
    for name, system in bench["systems"].items():
        assert system["output_tokens_per_s"] > 0, name
    assert bench["systems"]["nanoengine"]["complete"]
    assert bench["systems"]["nanoengine"]["output_tokens"] == bench["workload"]["output_tokens"]
    static = bench["systems"]["hf_static"]
    assert static["output_tokens"] <= static["generated_tokens"]  # truncation to each request's length
    assert set(bench["ratios_engine_over"]) == {"hf_static", "hf_generate_batch"}


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the real check would run")
def test_without_cuda_it_says_why_and_exits_0(tmp_path):
    out = tmp_path / "never.json"
    proc = _run("--out", str(out), timeout=120)
    assert proc.returncode == 0
    assert "no CUDA device" in proc.stdout and "--cpu-smoke" in proc.stdout
    assert not out.exists()


def test_unknown_stage_is_refused(capsys):
    assert gpu_check.main(["--cpu-smoke", "--stages", "kernels,warp_drive"]) == 2
    assert "warp_drive" in capsys.readouterr().err


def test_gpu_workload_is_the_one_the_issue_asks_for():
    full = gpu_check.MODES["full"]
    assert full.bench_model == PRESETS["Qwen3-0.6B"] and full.bench_dtype == "bfloat16"
    assert (full.num_requests, full.prompt_len, full.output_len) == (256, (100, 1024), (100, 1024))
    assert set(full.kernel_dtypes) >= {"float16", "bfloat16"}
    assert full.time_budget_s < 8 * 60  # the whole check must fit 8 minutes on an H200
    quick = gpu_check.MODES["quick"]
    assert quick.time_budget_s < full.time_budget_s and quick.num_requests < full.num_requests


def test_budget_caps_each_stage_by_what_is_left():
    budget = gpu_check.Budget(100.0, {"engine": 30.0})
    assert 29.0 < budget.stage_limit("engine") <= 30.0
    assert 99.0 < budget.stage_limit("unnamed") <= 100.0
    budget.start -= 90.0  # 90 s spent
    assert budget.stage_limit("engine") <= 10.0
    budget.start -= 20.0
    assert budget.stage_limit("engine") == 0.0


# ------------------------------------------------------------------ --nano-vllm
def test_nano_vllm_workload_on_the_cpu_reports_rate_steps_and_host_share(tmp_path):
    out = tmp_path / "nano-vllm.json"
    assert gpu_check.main(["--nano-vllm", "--cpu-smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    bench = report["nano_vllm_bench"]
    from nanobench.nano_vllm_bench import NanoVllmWorkload, draw_workload

    _, lens = draw_workload(NanoVllmWorkload(**gpu_check.NANO_VLLM_WORKLOADS["cpu-smoke"]))
    assert bench["complete"] and bench["output_tokens"] == sum(lens) == bench["workload"]["output_tokens"]
    assert bench["output_tokens_per_s"] == pytest.approx(bench["output_tokens"] / bench["seconds"])
    assert 0 < bench["host_share_of_step"]["median"] < 1 and bench["decode_steps"] > 0
    assert 0 < bench["median_decode_step_ms"]["model"] < bench["median_decode_step_ms"]["whole_step"]
    assert set(bench["median_decode_phase_ms"]) >= {"schedule", "block_manager", "prepare", "model", "sample"}
    assert report["environment"]["torch"] and report["date"] and "--nano-vllm" in report["command"]


def test_nano_vllm_workload_is_nano_vllms_bench():
    cuda = gpu_check.NANO_VLLM_WORKLOADS["cuda"]
    from nanobench.nano_vllm_bench import NanoVllmWorkload

    w = NanoVllmWorkload(**cuda)
    assert (w.model, w.dtype, w.num_requests, w.prompt_len, w.output_len, w.seed) == (
        PRESETS["Qwen3-0.6B"], "bfloat16", 256, (100, 1024), (100, 1024), 0)
    assert w.time_limit_s <= 5 * 60  # loading and warm-up included, the command must end within 6 minutes


def test_nano_vllm_refuses_other_stage_flags(capsys):
    assert gpu_check.main(["--nano-vllm", "--cpu-smoke", "--stages", "kernels"]) == 2
    assert "--nano-vllm" in capsys.readouterr().err
