"""Tests for nanobench.timing: the one helper every timing in the course goes through."""

from __future__ import annotations

import math

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from nanobench import timing
from nanobench.timing import (MIN_REPEATS, Roofline, RooflinePoint, Timing, machine_description, measure,
                              measure_gemm_peak, measure_memory_bandwidth, plot_roofline, roofline)


ROOT = Path(__file__).resolve().parents[2]  # the subprocesses import this checkout


def fake_clock(durations):
    """A clock whose successive (start, stop) readings are `durations` apart."""
    readings = []
    t = 100.0
    for d in durations:
        readings += [t, t + d]
        t += d + 1.0
    now = iter(readings)
    return lambda: next(now)


def test_median_quartiles_and_min_on_a_fake_clock() -> None:
    calls = []
    durations = [0.005, 0.001, 0.003, 0.002, 0.004, 0.010, 0.006]
    t = measure(lambda: calls.append(1), repeats=7, warmup=3, clock=fake_clock(durations), synchronize=None)
    assert len(calls) == 10  # 3 warm-up calls, untimed, then 7 timed
    assert t.runs == pytest.approx(durations)
    assert t.median == pytest.approx(0.004)
    # sorted: 1 2 3 4 5 6 10 ms; inclusive quartiles at ranks 1.5 and 4.5
    assert t.quartiles == pytest.approx((0.0025, 0.0055))
    assert t.iqr == pytest.approx(0.003) and t.min == pytest.approx(0.001) and t.repeats == 7
    text = t.describe()
    assert "4 ms median (IQR 2.5 ms - 5.5 ms, min 1 ms) over 7 runs after 3 warm-up" in text
    assert t.machine in text and t.revision in text and str(t) == text


def test_in_turn_reverses_the_order_every_other_round() -> None:
    systems = {"engine": 1, "vllm": 2, "hf": 3}
    orders = [timing.in_turn(systems, turn) for turn in range(4)]
    assert orders == [["engine", "vllm", "hf"], ["hf", "vllm", "engine"]] * 2
    firsts = [order[0] for order in orders]
    assert firsts.count("engine") == firsts.count("hf") == 2  # over an even number of rounds each end leads as often
    assert timing.in_turn(("a", "b"), 1) == ["b", "a"]  # names as well as a dict's keys


def test_units_follow_the_median() -> None:
    def timing(runs):
        return Timing(tuple(runs), 0, "m", "r", True)

    assert "µs median" in timing([2e-6] * 5).describe()
    assert "ns median" in timing([5e-8] * 5).describe()
    assert "1.5 s median" in timing([1.5] * 5).describe()
    assert "250 ms median" in timing([0.25] * 5).describe()


def test_real_sleeps_are_measured() -> None:
    t = measure(lambda: time.sleep(0.002), repeats=5, warmup=0)
    assert 0.002 <= t.min and t.median < 0.2


@pytest.mark.parametrize("repeats", [0, 1, 4, 2.5])
def test_fewer_than_five_repeats_are_refused(repeats) -> None:
    with pytest.raises(ValueError, match=f"repeats must be an integer >= {MIN_REPEATS}"):
        measure(lambda: None, repeats=repeats)
    with pytest.raises(ValueError, match="at least 5 runs"):
        Timing((1.0,) * 4, 0, "m", "r", True)
    with pytest.raises(ValueError, match="warmup"):
        measure(lambda: None, warmup=-1)


def test_the_wait_policy_is_recorded_and_described(monkeypatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # spinning is the default a user runs: no warning for it
        t = measure(lambda: None, repeats=5)
    assert not t.passive_wait and "[idle threads sleep" not in t.describe()
    assert timing.wait_policy() == "spin" and "idle threads spin" in machine_description()
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    # Both cases of the module's flag, whatever an earlier prepare_environment() left in it.
    monkeypatch.setattr(timing, "_policy_set_too_late", False)
    passive = measure(lambda: None, repeats=5)
    assert passive.passive_wait and "[idle threads sleep" in passive.describe()
    monkeypatch.setattr(timing, "_policy_set_too_late", True)  # set after torch loaded OpenMP: not in effect
    late = measure(lambda: None, repeats=5)
    assert not late.passive_wait and "[idle threads sleep" not in late.describe()


def test_prepare_environment_refuses_a_non_boolean() -> None:
    with pytest.raises(TypeError, match="shared_machine must be True or False"):
        timing.prepare_environment(shared_machine="yes")


@pytest.mark.slow
def test_prepare_environment_before_and_after_torch() -> None:
    # A fresh process: by default OpenMP's own (spinning) policy is left; a shared machine
    # gets PASSIVE before torch; after torch it warns and says so; a chosen policy is kept.
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}

    def run(code: str, extra_env: dict | None = None) -> list[str]:
        out = subprocess.run([sys.executable, "-c", code], env={**env, **(extra_env or {})}, capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    head = ("import sys, os, warnings\n"
            "from nanobench.timing import prepare_environment\n"
            "assert 'torch' not in sys.modules, 'importing the helper must not import torch'\n")
    assert run(head + "print(prepare_environment(), os.environ.get('OMP_WAIT_POLICY'))\n") == ["spin", "None"]
    assert run(head + "print(prepare_environment(shared_machine=True))\n") == ["PASSIVE"]
    assert run(head + "print(prepare_environment())\n", {"OMP_WAIT_POLICY": "PASSIVE"}) == ["PASSIVE"]
    late = ("import warnings, torch\n"
            "from nanobench.timing import prepare_environment\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    print(prepare_environment(shared_machine=True), "
            "any('restart the kernel' in str(x.message).lower() for x in w))\n")
    assert run(late) == ["spin", "True"]


def test_machine_description_names_the_cpu_and_is_still_importable_from_widgets() -> None:
    from widgets.course import machine_description as from_widgets

    text = machine_description()
    assert from_widgets is machine_description
    assert f"{os.cpu_count()} cores" in text and f"torch {torch.__version__}" in text
    assert text.startswith("GPU ") == torch.cuda.is_available()


def test_the_package_finds_this_checkout() -> None:
    # nanobench/ sits at the top of the repository: its paths to the README, the results and
    # the git revision go one level up (they went two from nanoengine/measure/).
    from nanobench import results_report, vllm_peer

    assert results_report.ROOT == ROOT and (results_report.ROOT / "README.md").exists()
    assert vllm_peer.REPO_ROOT == ROOT
    if (ROOT / ".git").exists():
        assert timing.source_revision() is not None


def test_roofline_math() -> None:
    roof = roofline(peak_flops=100e9, bandwidth=20e9)
    assert roof.ridge_point == pytest.approx(5.0)
    assert roof.attainable(1.0) == pytest.approx(20e9)  # memory-bound: bandwidth x intensity
    assert roof.attainable(5.0) == pytest.approx(100e9)
    assert roof.attainable(50.0) == pytest.approx(100e9)  # compute-bound: the ceiling
    assert roof.bound(1.0) == "memory" and roof.bound(10.0) == "compute"
    with pytest.raises(ValueError, match="> 0"):
        roofline(0, 1e9)
    with pytest.raises(ValueError, match="intensity"):
        roof.attainable(-1)


@pytest.mark.slow
def test_plot_roofline_has_the_roof_and_hoverable_points() -> None:
    roof = Roofline(100e9, 20e9)
    fig = plot_roofline(roof, [(0.5, 8e9, "decode"), RooflinePoint(200.0, 60e9, "prefill")])
    line, points = fig.data
    assert max(line.y) == pytest.approx(100.0) and min(line.y) < 100.0
    assert list(points.text) == ["decode", "prefill"] and "achieved" in points.hovertemplate
    assert points.customdata[0][1] == "memory" and points.customdata[1][1] == "compute"
    assert points.customdata[0][0] == pytest.approx(8e9 / 10e9)
    (label,) = fig.layout.annotations  # on the log x axis an annotation sits at log10 of its value
    assert label.x == pytest.approx(math.log10(roof.ridge_point)) and "ridge 5" in label.text


def test_gemm_peak_uses_the_engines_packed_path_on_cpu(monkeypatch) -> None:
    from nanoengine.kernels import cpu_gemm

    calls = []
    real = cpu_gemm.packed_linear
    monkeypatch.setattr(cpu_gemm, "packed_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    peak = measure_gemm_peak([(64, 32), (32, 64)], tokens=16, repeats=5, warmup=1)
    assert len(peak.measurements) == 2 and peak.flops_per_s > 0
    m = peak.best
    assert m.flops == 2 * 16 * 32 * 64 and m.flops_per_s == pytest.approx(m.flops / m.timing.median)
    if cpu_gemm.packing_available():
        assert {x.path for x in peak.measurements} == {"oneDNN packed"} and len(calls) == 2 * 6
    else:
        assert {x.path for x in peak.measurements} == {"F.linear"} and not calls
    both = measure_gemm_peak([(64, 32)], tokens=8, repeats=5, warmup=0, paths=("F.linear", "engine"))
    assert [x.path for x in both.measurements][0] == "F.linear"
    with pytest.raises(ValueError, match="paths"):
        measure_gemm_peak([(64, 32)], paths=("cublas",))


def test_memory_bandwidth_is_positive_and_counts_read_and_write() -> None:
    bw = measure_memory_bandwidth(8, repeats=5, warmup=1)
    assert bw.bytes_moved == 2 * 8 * 2**20 and bw.bytes_per_s > 0
    assert "GB/s" in bw.describe()
    with pytest.raises(ValueError, match="megabytes"):
        measure_memory_bandwidth(0)
