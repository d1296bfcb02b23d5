"""Batch size and request rate against throughput, latency and goodput (chapter 11).

The explorer reads the chapter's own measurements, never a formula: the batch-size sweep
(``bench.run_batch_sweep``: one row per ``max_num_seqs``) and the online runs (the engine
serving Poisson arrivals at several rates, with every request's ``RequestMetrics``). Moving
a control picks a measured point and shows what it cost:

* **batch size**: throughput, TPOT and TTFT of the sweep's row, and what the step from the
  previous size bought (throughput gained against TPOT lost);
* **request rate**: the run at that offered rate, throughput against its latency
  percentiles;
* **SLO**: a TTFT and a TPOT limit; the explorer counts, at every measured rate, the share of
  requests that met both (*SLO attainment*) and reports *goodput* as DistServe defines it
  (Zhong et al., OSDI 2024, https://arxiv.org/abs/2401.09670): the highest rate served with
  at least ``target`` of its requests inside the SLO.

``ThroughputExplorerController`` holds the arithmetic (tested headless in
``tests/course/test_widgets_throughput_explorer.py``); ``ThroughputExplorer`` is the ipywidgets view.
Bad values (a size or rate that was not measured, a limit that is not positive) raise a
``ValueError`` that says what is allowed, and the view shows it as a message, leaving the
last good reading on screen marked as such. Nothing here touches an engine, so the explorer
still works after the chapter has run to its end.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import ipywidgets as W

from translations import tr
from widgets._common import MessageView, guarded


@dataclass(frozen=True)
class OnlineRun:
    """One measured rate: the offered rate (requests/s), the run's wall time (first arrival to
    last finish, seconds), its output tokens, and each request's (TTFT, TPOT) in seconds
    (TPOT None for a request with a single output token)."""

    rate: float
    seconds: float
    output_tokens: int
    latencies: tuple[tuple[float, float | None], ...]

    @classmethod
    def from_metrics(cls, rate: float, seconds: float, output_tokens: int, metrics) -> "OnlineRun":
        """From the engine's ``RequestMetrics`` of every request of the run."""
        return cls(float(rate), float(seconds), int(output_tokens), tuple((m.ttft, m.tpot) for m in metrics))

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def meets(ttft: float, tpot: float | None, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    """Whether one request met both limits; a request without a TPOT (one output token) is
    judged on its TTFT alone."""
    return ttft <= ttft_slo_s and (tpot is None or tpot <= tpot_slo_s)


class ThroughputExplorerController:
    """The chapter's measured sweep and online runs, and what an SLO makes of them."""

    def __init__(self, sweep: list[dict], online: list[OnlineRun], target: float = 0.9) -> None:
        if not sweep or not online:
            raise ValueError("the explorer needs the measured batch-size sweep and at least one online run")
        if not 0 < target <= 1:
            raise ValueError(f"target is the share of requests that must meet the SLO, in (0, 1], got {target!r}")
        self.sweep = sorted(sweep, key=lambda row: row["max_num_seqs"])
        self.online = sorted(online, key=lambda run: run.rate)
        self.target = target

    @property
    def sizes(self) -> list[int]:
        return [row["max_num_seqs"] for row in self.sweep]

    @property
    def rates(self) -> list[float]:
        return [run.rate for run in self.online]

    def batch_point(self, size: int) -> dict:
        """The sweep's row for ``size`` and, from the next smaller size, the throughput gained
        and the TPOT paid (ratios; None for the smallest size)."""
        if size not in self.sizes:
            raise ValueError(tr("max_num_seqs {size!r} was not measured; the sweep has {sizes}", size=size,
                                sizes=self.sizes))
        i = self.sizes.index(size)
        row = self.sweep[i]
        prev = self.sweep[i - 1] if i else None
        return {"max_num_seqs": size, "tokens_per_s": row["output_tokens_per_s"],
                "tpot_p50_ms": row["tpot_ms"]["p50"], "ttft_p50_ms": row["ttft_ms"]["p50"],
                "ttft_p99_ms": row["ttft_ms"]["p99"],
                "throughput_gain": None if prev is None else row["output_tokens_per_s"] / prev["output_tokens_per_s"],
                "tpot_cost": None if prev is None else row["tpot_ms"]["p50"] / prev["tpot_ms"]["p50"]}

    def run_at(self, rate: float) -> OnlineRun:
        for run in self.online:
            if abs(run.rate - rate) <= 1e-9 * max(1.0, abs(rate)):
                return run
        raise ValueError(tr("the rate {rate!r} requests/s was not measured; the runs have {rates}", rate=rate,
                            rates=self.rates))

    @staticmethod
    def _check_slo(ttft_slo_ms: float, tpot_slo_ms: float) -> None:
        for name, value in (("TTFT", ttft_slo_ms), ("TPOT", tpot_slo_ms)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(tr("the {name} limit is a positive number of milliseconds, got {value!r}", name=name,
                                    value=value))

    def attainment(self, rate: float, ttft_slo_ms: float, tpot_slo_ms: float) -> float:
        """Share of the run's requests that met both limits."""
        self._check_slo(ttft_slo_ms, tpot_slo_ms)
        run = self.run_at(rate)
        good = sum(meets(t, p, ttft_slo_ms / 1e3, tpot_slo_ms / 1e3) for t, p in run.latencies)
        return good / len(run.latencies)

    def goodput(self, ttft_slo_ms: float, tpot_slo_ms: float) -> float | None:
        """The highest measured rate whose attainment reaches ``target``; None if none does.
        (A rate above a failing one can pass by luck of its draws; goodput is read as the
        highest rate that passes, as measured, not interpolated.)"""
        passing = [r for r in self.rates if self.attainment(r, ttft_slo_ms, tpot_slo_ms) >= self.target]
        return max(passing) if passing else None


def _table(header: list[str], rows: list[list[str]], selected: int | None) -> str:
    head = "".join(f"<th style='padding:2px 8px;text-align:right'>{html.escape(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        style = "background:#fff3bf;font-weight:bold" if i == selected else ""
        cells = "".join(f"<td style='padding:2px 8px;text-align:right'>{html.escape(c)}</td>" for c in row)
        body.append(f"<tr style='{style}'>{cells}</tr>")
    return f"<table style='border-collapse:collapse;font-size:12px'><tr>{head}</tr>{''.join(body)}</table>"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


class ThroughputExplorer(MessageView, W.VBox):
    """Sliders over the measured batch sizes and rates, and an SLO that turns runs into goodput."""

    def __init__(self, controller: ThroughputExplorerController, machine: str = "",
                 ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None) -> None:
        self.controller = c = controller
        self.message = W.HTML()
        style = {"description_width": "120px"}
        self.size = W.SelectionSlider(options=c.sizes, value=c.sizes[-1], description="max_num_seqs", style=style)
        self.rate = W.SelectionSlider(options=[(f"{r:g}", r) for r in c.rates], value=c.rates[-1],
                                      description=tr("offered req/s"), style=style)
        worst_ttft = max(t for run in c.online for t, _ in run.latencies) * 1e3
        worst_tpot = max((p for run in c.online for _, p in run.latencies if p is not None), default=0.1) * 1e3
        self.ttft_slo = W.FloatSlider(value=ttft_slo_ms or round(worst_ttft / 2, 1), min=1.0,
                                      max=round(worst_ttft * 1.5 + 1, 1), step=1.0, description="TTFT SLO (ms)",
                                      style=style, readout_format=".0f")
        self.tpot_slo = W.FloatSlider(value=tpot_slo_ms or round(worst_tpot, 1), min=1.0,
                                      max=round(worst_tpot * 1.5 + 1, 1), step=1.0, description="TPOT SLO (ms)",
                                      style=style, readout_format=".0f")
        self.batch_view, self.rate_view, self.slo_view = W.HTML(), W.HTML(), W.HTML()
        header = W.HTML("<div style='font-size:12px;color:#555'>"
                        + (tr("Measured in this chapter on {machine}; every number is a run, none is interpolated.",
                              machine=html.escape(machine)) if machine
                           else tr("Measured in this chapter; every number is a run, none is interpolated."))
                        + "</div>")

        @guarded(self.show_message)
        def redraw(_=None):
            self.redraw()

        for w in (self.size, self.rate, self.ttft_slo, self.tpot_slo):
            w.observe(redraw, names="value")
        super().__init__([header, W.HBox([W.VBox([self.size, self.batch_view]), W.VBox([self.rate, self.ttft_slo,
                                                                                        self.tpot_slo])]),
                          self.message, self.rate_view, self.slo_view])
        self.add_class("ne-throughput-explorer")
        redraw()

    def redraw(self) -> None:
        """Redraw the three panels for the controls' values (raises ValueError on a bad one)."""
        c = self.controller
        point = c.batch_point(self.size.value)
        rows = [[str(r["max_num_seqs"]), f"{r['output_tokens_per_s']:.1f}", f"{r['tpot_ms']['p50']:.0f}",
                 f"{r['ttft_ms']['p50']:.0f}"] for r in c.sweep]
        self.batch_view.value = (
            _table(["max_num_seqs", "tok/s", "TPOT p50 ms", "TTFT p50 ms"], rows, c.sizes.index(point["max_num_seqs"]))
            + ("<div style='font-size:12px'>" + tr("from the next smaller size: throughput {gain}, TPOT {cost}",
                                                   gain=_pct(point['throughput_gain']), cost=_pct(point['tpot_cost']))
               + "</div>" if point["throughput_gain"] is not None else ""))
        ttft_slo, tpot_slo = self.ttft_slo.value, self.tpot_slo.value
        rate_rows = []
        for run in c.online:
            ttfts = sorted(t * 1e3 for t, _ in run.latencies)
            share = c.attainment(run.rate, ttft_slo, tpot_slo)
            rate_rows.append([f"{run.rate:g}", f"{run.tokens_per_s:.1f}", f"{ttfts[len(ttfts) // 2]:.0f}",
                              f"{ttfts[-1]:.0f}", f"{share:.0%}"])
        self.rate_view.value = _table([tr("offered req/s"), "tok/s", tr("TTFT median ms"), tr("TTFT max ms"),
                                       tr("met both SLOs")], rate_rows, c.rates.index(c.run_at(self.rate.value).rate))
        best = c.goodput(ttft_slo, tpot_slo)
        selected = c.attainment(self.rate.value, ttft_slo, tpot_slo)
        self.slo_view.value = (
            "<div style='font-size:13px'>"
            + tr("At {rate:g} req/s, {selected:.0%} of the requests met TTFT &le; {ttft:.0f} ms and TPOT &le; "
                 "{tpot:.0f} ms. Goodput (the highest measured rate with at least {target:.0%} inside the SLO): ",
                 rate=self.rate.value, selected=selected, ttft=ttft_slo, tpot=tpot_slo, target=c.target)
            + (f"<b>{best:g} req/s</b>" if best is not None else tr("<b>none of the measured rates</b>")) + "</div>")
        self.show_message("")
