"""The step-cost explorer: prompt length and token budget against TTFT, TPOT and throughput (chapter 6).

Chapter 6 measures engine steps on this machine: prefills of N prompt tokens and decode
steps of B requests. ``StepCostFit.fit`` turns those measurements into the simplest model
that explains them, a straight line in the tokens a step carries:

    step time = fixed + per_prefill_token x prefill tokens + per_decode_token x decode tokens

``fixed`` is what every step pays whatever it carries (reading the weights, the engine's
own work), the two slopes what each extra token adds. That line is fitted to short prompts
computed from position 0; a chunk of a long prompt also attends over everything before it,
and attention's work grows with (tokens in the chunk) x (tokens they attend over), which a
line in the tokens cannot see. ``StepCostFit.fit(..., attention=True)`` adds that term:

    step time = fixed + per_prefill_token x p + per_decode_token x d + per_attention_pair x pairs

where ``pairs`` counts, for every prefill token, the tokens it attends over (``attention_pairs``:
a chunk of c tokens after ``start`` cached ones has c x start + c (c + 1) / 2). Chapter 6
fits it to the engine's own steps of the arrival scenario (``arrival_points``), the shapes
that matter, and sets both fits beside the measured runs. ``explore`` then replays the
chapter's arrival scenario with that model instead of the engine: ``num_decoders`` requests
are decoding when a prompt of ``prompt_len`` tokens arrives; the scheduler runs steps of at
most ``budget`` tokens under ``fcfs`` (the decodes first, the prompt's chunk in what is
left) or ``prefill_first`` (a step with prefill work carries nothing else). It predicts the
prompt's time to first token, the decoders' worst gap between two tokens and the tokens
per second of the window, so a learner can move the budget and see the trade-off that
section 6 measured at four points. The predictions are only as good as the line: the
notebook sets them beside the measured runs.

``StepCostExplorer`` draws it: sliders for the prompt length, the budget and the decoders,
a policy choice, and a table with one bar per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import ipywidgets as W
import numpy as np

from translations import tr
from widgets._common import MessageView, check_int, escape, guarded

POLICIES = ("fcfs", "prefill_first")


def attention_pairs(chunk: int, start: int = 0) -> int:
    """(query, key) pairs of causal attention for ``chunk`` prefill tokens after ``start``
    cached tokens: token i of the chunk attends over start + i + 1 tokens."""
    return chunk * start + chunk * (chunk + 1) // 2


@dataclass(frozen=True)
class StepCostFit:
    """A step's time in seconds as ``fixed + per_prefill_token * p + per_decode_token * d``
    (+ ``per_attention_pair * pairs`` when fitted with ``attention=True``)."""

    fixed: float
    per_prefill_token: float
    per_decode_token: float
    num_points: int = 0  # measurements the line was fitted to (0: written by hand)
    per_attention_pair: float = 0.0  # seconds per (prefill token, token it attends over) pair

    def __post_init__(self) -> None:
        for name in ("fixed", "per_prefill_token", "per_decode_token", "per_attention_pair"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")

    @classmethod
    def fit(cls, points: Sequence[tuple], attention: bool = False) -> "StepCostFit":
        """Least squares over ``(prefill tokens, decode tokens, seconds)`` measurements, or
        ``(prefill tokens, decode tokens, attention pairs, seconds)`` with ``attention=True``.

        Needs steps of both kinds and at least two sizes of one of them (three prefill shapes
        with ``attention``), or the coefficients are not determined. A coefficient the data
        would make negative (noise on a flat curve) is clipped to 0 and the others refitted,
        since a token cannot make a step faster.
        """
        width = 4 if attention else 3
        if any(len(pt) != width for pt in points):
            raise ValueError(f"each point is {width} numbers: (prefill tokens, decode tokens"
                             f"{', attention pairs' if attention else ''}, seconds)")
        rows = [(int(pt[0]), int(pt[1]), int(pt[2]) if attention else 0, float(pt[-1])) for pt in points]
        if len(rows) < width:
            raise ValueError(f"fit needs at least {width} measured steps, got {len(rows)}")
        if any(p < 0 or d < 0 or q < 0 or p + d == 0 or not (s > 0) for p, d, q, s in rows):
            raise ValueError("each point is (prefill tokens >= 0, decode tokens >= 0, not both 0, seconds > 0)")
        x = np.array([[1.0, p, d, q][:width] for p, d, q, _ in rows])
        y = np.array([s for *_, s in rows])
        if np.linalg.matrix_rank(x) < width:
            raise ValueError("the points do not determine the line: measure prefill steps and decode steps, "
                             "at two sizes or more" + (" (prefill chunks at several positions)" if attention else ""))
        keep = list(range(width))
        while True:
            coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            negative = [k for k, c in zip(keep, coef) if c < 0]
            if not negative:
                break
            keep.remove(negative[0])
        full = dict(zip(keep, coef))
        return cls(float(full.get(0, 0.0)), float(full.get(1, 0.0)), float(full.get(2, 0.0)), len(rows),
                   float(full.get(3, 0.0)))

    def step_time(self, prefill_tokens: int, decode_tokens: int, start: int = 0) -> float:
        """Predicted seconds of a step carrying these tokens; ``start``: tokens of the prompt
        already cached before this chunk (they are attended over, not computed)."""
        return (self.fixed + self.per_prefill_token * prefill_tokens + self.per_decode_token * decode_tokens
                + self.per_attention_pair * attention_pairs(prefill_tokens, start))

    def describe(self) -> str:
        pairs = (tr(" + {ms:.3f} ms per 1,000 attention pairs", ms=1e6 * self.per_attention_pair)
                 if self.per_attention_pair else "")
        return (tr("step time = {fixed:.1f} ms + {prefill:.3f} ms per prefill token + {decode:.3f} ms per decode "
                   "token{pairs}", fixed=1e3 * self.fixed, prefill=1e3 * self.per_prefill_token,
                   decode=1e3 * self.per_decode_token, pairs=pairs)
                + (tr(" (least squares over {n} measured steps)", n=self.num_points) if self.num_points else ""))


def arrival_points(run) -> list[tuple[int, int, int, float]]:
    """``(prefill, decode, attention pairs, seconds)`` of the steps of one arrival run
    (``widgets.exercises.ch06.ArrivalRun``) whose shape is known: the long prompt's prefill
    steps (each chunk after the ones before it) and the decode-only steps. The decoders' own
    first prefill (several short prompts in one step) is left out."""
    points, start = [], 0
    for i, s in enumerate(run.steps):
        if i in run.prefill_steps:
            points.append((s.num_prefill_tokens, s.num_decode_tokens,
                           attention_pairs(s.num_prefill_tokens, start), s.total_time))
            start += s.num_prefill_tokens
        elif s.num_prefill_tokens == 0 and s.num_decode_tokens:
            points.append((0, s.num_decode_tokens, 0, s.total_time))
    return points


def read_prediction(name: str, measured: Sequence[float], predicted: Sequence[float],
                    tolerance: float = 0.10) -> str:
    """How far a fit's predictions fall from the measured values: under, over or within
    ``tolerance`` of every one, or on both sides."""
    if not measured or len(measured) != len(predicted) or min(measured) <= 0:
        raise ValueError("need as many predictions as measured values, all measured > 0")
    errors = [p / m - 1 for m, p in zip(measured, predicted)]
    span = (f"{100 * min(abs(e) for e in errors):.0f}-{100 * max(abs(e) for e in errors):.0f}%")
    if all(abs(e) <= tolerance for e in errors):
        return tr("{name} is within {tolerance:.0%} of every measured value", name=name, tolerance=tolerance)
    if all(e < 0 for e in errors):
        return tr("{name} under-predicts every measured value, by {span}", name=name, span=span)
    if all(e > 0 for e in errors):
        return tr("{name} over-predicts every measured value, by {span}", name=name, span=span)
    return tr("{name} misses on both sides, by {span}", name=name, span=span)


@dataclass(frozen=True)
class Prediction:
    """What the fitted line predicts for one prompt arriving while requests decode."""

    prompt_len: int
    budget: int
    num_decoders: int
    policy: str
    steps: tuple[tuple[int, int, float], ...]  # the prompt's prefill steps: (prefill tokens, decode tokens, s)
    decode_step: float  # a step of the decoders alone (seconds)
    ttft: float  # the prompt's time to first token: its prefill steps, end to end
    worst_gap: float  # the decoders' longest wait between two tokens
    tokens_per_s: float  # tokens computed per second over the prefill window (prompt + decodes)

    @property
    def num_steps(self) -> int:
        return len(self.steps)


def explore(fit: StepCostFit, prompt_len: int, budget: int, num_decoders: int = 4,
            policy: str = "fcfs") -> Prediction:
    """Replay the arrival scenario of chapter 6 on the fitted line (see the module docstring)."""
    prompt_len = check_int(tr("prompt length"), prompt_len, 1, 1_000_000)
    budget = check_int(tr("token budget"), budget, 1, 1_000_000)
    num_decoders = check_int(tr("decoding requests"), num_decoders, 0, 10_000)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if policy == "fcfs" and budget <= num_decoders:
        raise ValueError(tr("under fcfs the {n} decodes take the first {n} tokens of every step: the budget must be "
                            "above that to leave room for the prompt, got {budget}", n=num_decoders, budget=budget))
    steps, left = [], prompt_len
    while left:
        decodes = num_decoders if policy == "fcfs" else 0
        chunk = min(left, budget - decodes)
        steps.append((chunk, decodes, fit.step_time(chunk, decodes, start=prompt_len - left)))
        left -= chunk
    decode_step = fit.step_time(0, num_decoders) if num_decoders else 0.0
    ttft = sum(s for _, _, s in steps)
    if not num_decoders:
        worst = 0.0
    elif policy == "fcfs":
        worst = max(s for _, _, s in steps)  # every prefill step also carries their tokens
    else:
        worst = ttft + decode_step  # they wait through every prefill-only step, then decode
    tokens = sum(p + d for p, d, _ in steps)
    return Prediction(prompt_len, budget, num_decoders, policy, tuple(steps), decode_step, ttft, worst,
                      tokens / ttft)


def render_prediction(p: Prediction) -> str:
    """A small table and one bar per prefill step, as long as its predicted time."""
    longest = max(s for _, _, s in p.steps)
    bars = "".join(
        f'<div title="{tr("{pre} prefill + {dec} decode tokens: {ms:.0f} ms", pre=pre, dec=dec, ms=1e3 * s)}" style="display:inline-block;'
        f'vertical-align:bottom;width:{max(2.0, 300 * s / max(longest, 1e-9) / max(1, len(p.steps) / 8)):.0f}px;'
        f'height:14px;margin-right:1px;background:{"#1f77b4" if dec else "#9467bd"}"></div>'
        for pre, dec, s in p.steps[:200])
    more = tr(" (first 200 of {n})", n=p.num_steps) if p.num_steps > 200 else ""
    rows = [(tr("prefill steps"), f"{p.num_steps}{more}"),
            (tr("the prompt's TTFT"), f"{1e3 * p.ttft:.0f} ms"),
            (tr("the decoders' worst gap"), f"{1e3 * p.worst_gap:.0f} ms" if p.num_decoders else tr("no decoders")),
            (tr("a decode-only step"), f"{1e3 * p.decode_step:.0f} ms" if p.num_decoders else "-"),
            (tr("tokens per second in the window"), f"{p.tokens_per_s:.0f}")]
    table = "".join(f"<tr><td style='padding-right:12px'>{escape(k)}</td><td><b>{escape(v)}</b></td></tr>"
                    for k, v in rows)
    return (f'<div class="ne-step-cost" data-steps="{p.num_steps}" style="font-size:12px;max-width:100%;'
            f'overflow:hidden"><table>{table}</table><div style="margin-top:4px">{bars}</div>'
            '<div style="color:#555">' + tr("one bar per prefill step, its length the predicted time; blue: the "
                                            "decodes ride along, purple: prefill only") + '</div></div>')


class StepCostExplorer(MessageView, W.VBox):
    """Sliders over the arrival scenario, predicted from a ``StepCostFit``."""

    def __init__(self, fit: StepCostFit, prompt_len: int = 1500, budget: int = 512, num_decoders: int = 4,
                 policy: str = "fcfs", machine: str = "") -> None:
        self.fit = fit
        self.message = W.HTML()
        self.prompt_len = W.IntSlider(value=prompt_len, min=16, max=8192, step=16, description=tr("prompt"),
                                      continuous_update=False, style={"description_width": "90px"})
        self.budget = W.IntSlider(value=budget, min=16, max=8192, step=16, description=tr("token budget"),
                                  continuous_update=False, style={"description_width": "90px"})
        self.num_decoders = W.IntSlider(value=num_decoders, min=0, max=64, description=tr("decoders"),
                                        continuous_update=False, style={"description_width": "90px"})
        self.policy = W.ToggleButtons(options=list(POLICIES), value=policy)
        self.output = W.HTML()
        self.last: Prediction | None = None
        header = W.HTML(f"<div style='font-size:12px;color:#555'>{escape(fit.describe())}"
                        + (tr("; measured on {machine}", machine=escape(machine)) if machine else "") + "</div>")

        @guarded(self.show_message)
        def update(_=None):
            self.last = explore(self.fit, self.prompt_len.value, self.budget.value, self.num_decoders.value,
                                self.policy.value)
            self.output.value = render_prediction(self.last)
            self.show_message("")

        for control in (self.prompt_len, self.budget, self.num_decoders, self.policy):
            control.observe(update, names="value")
        super().__init__([header, W.HBox([self.prompt_len, self.budget]), W.HBox([self.num_decoders, self.policy]),
                          self.message, self.output])
        self.add_class("ne-step-cost-explorer")
        update()


__all__ = ["POLICIES", "Prediction", "StepCostExplorer", "StepCostFit", "arrival_points", "attention_pairs", "explore",
           "read_prediction", "render_prediction"]
