"""Tests for widgets.throughput_explorer: SLO attainment, goodput, the batch-size view, bad
values, and the view driven headless from a real (tiny) engine's measured runs."""

from __future__ import annotations

import pytest

from nanobench import benchmark as bench
from widgets import single_thread, tiny_engine
from widgets.throughput_explorer import OnlineRun, ThroughputExplorer, ThroughputExplorerController, meets


def sweep_row(size: int, tok_s: float, tpot: float, ttft: float) -> dict:
    return {"max_num_seqs": size, "output_tokens_per_s": tok_s, "tpot_ms": {"p50": tpot, "p99": tpot},
            "ttft_ms": {"p50": ttft, "p99": 2 * ttft}}


SWEEP = [sweep_row(4, 30.0, 90.0, 500.0), sweep_row(1, 12.0, 70.0, 1800.0), sweep_row(8, 50.0, 95.0, 380.0)]
# at 1 req/s every request is fast; at 2 one of four is slow on TTFT; at 4 two are slow on TPOT
ONLINE = [OnlineRun(2.0, 3.0, 40, ((0.10, 0.08), (0.12, 0.09), (0.30, 0.08), (0.11, None))),
          OnlineRun(1.0, 5.0, 40, ((0.10, 0.08), (0.11, 0.08), (0.10, 0.09), (0.12, 0.08))),
          OnlineRun(4.0, 2.0, 40, ((0.15, 0.20), (0.14, 0.08), (0.16, 0.21), (0.15, 0.09)))]


def test_a_request_meets_the_slo_only_on_both_limits() -> None:
    assert meets(0.1, 0.05, 0.2, 0.1)
    assert not meets(0.3, 0.05, 0.2, 0.1) and not meets(0.1, 0.2, 0.2, 0.1)
    assert meets(0.1, None, 0.2, 0.1)  # one output token: no TPOT to judge


def test_attainment_and_goodput() -> None:
    c = ThroughputExplorerController(SWEEP, ONLINE, target=0.75)
    assert c.rates == [1.0, 2.0, 4.0] and c.sizes == [1, 4, 8]
    assert c.attainment(1.0, 200, 100) == 1.0
    assert c.attainment(2.0, 200, 100) == 0.75  # the 300 ms TTFT misses
    assert c.attainment(4.0, 200, 100) == 0.5  # two TPOTs over 100 ms
    assert c.goodput(200, 100) == 2.0
    assert c.goodput(400, 250) == 4.0  # a looser SLO: every rate passes
    assert c.goodput(50, 100) is None  # tighter than any TTFT
    assert ThroughputExplorerController(SWEEP, ONLINE, target=0.9).goodput(200, 100) == 1.0


def test_batch_point_reports_gain_and_cost_from_the_next_smaller_size() -> None:
    c = ThroughputExplorerController(SWEEP, ONLINE)
    first, mid = c.batch_point(1), c.batch_point(4)
    assert first["throughput_gain"] is None and first["tokens_per_s"] == 12.0
    assert mid["throughput_gain"] == pytest.approx(30 / 12) and mid["tpot_cost"] == pytest.approx(90 / 70)


@pytest.mark.parametrize("call", [lambda c: c.batch_point(3), lambda c: c.run_at(3.0),
                                  lambda c: c.attainment(1.0, 0, 100), lambda c: c.attainment(1.0, 100, -1),
                                  lambda c: c.attainment(1.0, True, 100), lambda c: c.goodput("100", 100)])
def test_bad_values_say_what_is_allowed(call) -> None:
    c = ThroughputExplorerController(SWEEP, ONLINE)
    with pytest.raises(ValueError, match="measured|positive"):
        call(c)


def test_bad_construction_is_refused() -> None:
    with pytest.raises(ValueError):
        ThroughputExplorerController([], ONLINE)
    with pytest.raises(ValueError):
        ThroughputExplorerController(SWEEP, ONLINE, target=1.5)


def test_the_view_follows_its_controls() -> None:
    view = ThroughputExplorer(ThroughputExplorerController(SWEEP, ONLINE, target=0.75), machine="test machine",
                              ttft_slo_ms=200, tpot_slo_ms=100)
    assert "Goodput" in view.slo_view.value and "<b>2 req/s</b>" in view.slo_view.value
    view.rate.value = 4.0
    assert "At 4 req/s, 50% of the requests met" in view.slo_view.value
    view.ttft_slo.value, view.tpot_slo.value = 400.0, 250.0
    assert "<b>4 req/s</b>" in view.slo_view.value
    view.size.value = 4
    assert "2.50x" in view.batch_view.value  # 30 / 12 tok/s from max_num_seqs 1
    assert view.message.value in ("", None) or "error" not in view.message.value


def test_driven_by_a_real_engines_measured_runs() -> None:
    """The same objects the chapter builds: RequestMetrics of Poisson runs on a (tiny) engine."""
    class _LLM:  # run_engine_once needs only .engine
        def __init__(self, engine) -> None:
            self.engine = engine

    prompts = bench.make_workload(4, 8, 12, 0, vocab_limit=200)
    lens = [3, 4, 5, 6]
    with single_thread():
        llm = _LLM(tiny_engine(num_kv_blocks=64, block_size=4, max_model_len=64))
        runs = []
        for rate in (50.0, 200.0):
            run = bench.run_engine_once(llm, prompts, lens, bench.poisson_arrivals(len(prompts), rate, 0))
            runs.append(OnlineRun.from_metrics(rate, run.seconds, sum(lens), run.metrics))
    c = ThroughputExplorerController([sweep_row(4, 10.0, 5.0, 5.0)], runs, target=0.9)
    assert all(len(r.latencies) == 4 and all(t > 0 for t, _ in r.latencies) for r in runs)
    loose = 1e3 * max(t for r in runs for t, _ in r.latencies) + 1
    assert c.goodput(loose, 1e6) == 200.0
    view = ThroughputExplorer(c)
    view.ttft_slo.value = view.ttft_slo.min  # 1 ms: tighter than any prefill here
    assert "met both SLOs" in view.rate_view.value
