"""The step-cost explorer: prompt length and token budget against TTFT, TPOT and throughput (chapter 6).

Chapter 6 measures engine steps on this machine: prefills of N prompt tokens and decode
steps of B requests. ``StepCostFit.fit`` turns those measurements into the simplest model
that explains them, a straight line in the tokens a step carries:

    step time = fixed + per_prefill_token x prefill tokens + per_decode_token x decode tokens

``fixed`` is what every step pays whatever it carries (reading the weights, the engine's
own work), the two slopes what each extra token adds. ``explore`` then replays the
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

from widgets._common import MessageView, check_int, escape, guarded

POLICIES = ("fcfs", "prefill_first")


@dataclass(frozen=True)
class StepCostFit:
    """A step's time in seconds as ``fixed + per_prefill_token * p + per_decode_token * d``."""

    fixed: float
    per_prefill_token: float
    per_decode_token: float
    num_points: int = 0  # measurements the line was fitted to (0: written by hand)

    def __post_init__(self) -> None:
        for name in ("fixed", "per_prefill_token", "per_decode_token"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")

    @classmethod
    def fit(cls, points: Sequence[tuple[int, int, float]]) -> "StepCostFit":
        """Least squares over ``(prefill tokens, decode tokens, seconds)`` measurements.

        Needs steps of both kinds and at least two sizes of one of them, or the three
        coefficients are not determined. A coefficient the data would make negative (noise
        on a flat curve) is clipped to 0 and the others refitted, since a token cannot make
        a step faster.
        """
        rows = [(int(p), int(d), float(s)) for p, d, s in points]
        if len(rows) < 3:
            raise ValueError(f"fit needs at least 3 measured steps, got {len(rows)}")
        if any(p < 0 or d < 0 or p + d == 0 or not (s > 0) for p, d, s in rows):
            raise ValueError("each point is (prefill tokens >= 0, decode tokens >= 0, not both 0, seconds > 0)")
        x = np.array([[1.0, p, d] for p, d, _ in rows])
        y = np.array([s for _, _, s in rows])
        if np.linalg.matrix_rank(x) < 3:
            raise ValueError("the points do not determine the line: measure prefill steps and decode steps, "
                             "at two sizes or more")
        keep = [0, 1, 2]
        while True:
            coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            negative = [k for k, c in zip(keep, coef) if c < 0]
            if not negative:
                break
            keep.remove(negative[0])
        full = dict(zip(keep, coef))
        return cls(float(full.get(0, 0.0)), float(full.get(1, 0.0)), float(full.get(2, 0.0)), len(rows))

    def step_time(self, prefill_tokens: int, decode_tokens: int) -> float:
        """Predicted seconds of a step carrying these tokens."""
        return self.fixed + self.per_prefill_token * prefill_tokens + self.per_decode_token * decode_tokens

    def describe(self) -> str:
        return (f"step time = {1e3 * self.fixed:.1f} ms + {1e3 * self.per_prefill_token:.3f} ms per prefill token "
                f"+ {1e3 * self.per_decode_token:.3f} ms per decode token"
                + (f" (least squares over {self.num_points} measured steps)" if self.num_points else ""))


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
    prompt_len = check_int("prompt length", prompt_len, 1, 1_000_000)
    budget = check_int("token budget", budget, 1, 1_000_000)
    num_decoders = check_int("decoding requests", num_decoders, 0, 10_000)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if policy == "fcfs" and budget <= num_decoders:
        raise ValueError(f"under fcfs the {num_decoders} decodes take the first {num_decoders} tokens of every "
                         f"step: the budget must be above that to leave room for the prompt, got {budget}")
    steps, left = [], prompt_len
    while left:
        decodes = num_decoders if policy == "fcfs" else 0
        chunk = min(left, budget - decodes)
        steps.append((chunk, decodes, fit.step_time(chunk, decodes)))
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
        f'<div title="{pre} prefill + {dec} decode tokens: {1e3 * s:.0f} ms" style="display:inline-block;'
        f'vertical-align:bottom;width:{max(2.0, 300 * s / max(longest, 1e-9) / max(1, len(p.steps) / 8)):.0f}px;'
        f'height:14px;margin-right:1px;background:{"#1f77b4" if dec else "#9467bd"}"></div>'
        for pre, dec, s in p.steps[:200])
    more = f" (first 200 of {p.num_steps})" if p.num_steps > 200 else ""
    rows = [("prefill steps", f"{p.num_steps}{more}"),
            ("the prompt's TTFT", f"{1e3 * p.ttft:.0f} ms"),
            ("the decoders' worst gap", f"{1e3 * p.worst_gap:.0f} ms" if p.num_decoders else "no decoders"),
            ("a decode-only step", f"{1e3 * p.decode_step:.0f} ms" if p.num_decoders else "-"),
            ("tokens per second in the window", f"{p.tokens_per_s:.0f}")]
    table = "".join(f"<tr><td style='padding-right:12px'>{escape(k)}</td><td><b>{escape(v)}</b></td></tr>"
                    for k, v in rows)
    return (f'<div class="ne-step-cost" data-steps="{p.num_steps}" style="font-size:12px;max-width:100%;'
            f'overflow:hidden"><table>{table}</table><div style="margin-top:4px">{bars}</div>'
            f'<div style="color:#555">one bar per prefill step, its length the predicted time; blue: the decodes '
            f'ride along, purple: prefill only</div></div>')


class StepCostExplorer(MessageView, W.VBox):
    """Sliders over the arrival scenario, predicted from a ``StepCostFit``."""

    def __init__(self, fit: StepCostFit, prompt_len: int = 1500, budget: int = 512, num_decoders: int = 4,
                 policy: str = "fcfs", machine: str = "") -> None:
        self.fit = fit
        self.message = W.HTML()
        self.prompt_len = W.IntSlider(value=prompt_len, min=16, max=8192, step=16, description="prompt",
                                      continuous_update=False, style={"description_width": "90px"})
        self.budget = W.IntSlider(value=budget, min=16, max=8192, step=16, description="token budget",
                                  continuous_update=False, style={"description_width": "90px"})
        self.num_decoders = W.IntSlider(value=num_decoders, min=0, max=64, description="decoders",
                                        continuous_update=False, style={"description_width": "90px"})
        self.policy = W.ToggleButtons(options=list(POLICIES), value=policy)
        self.output = W.HTML()
        self.last: Prediction | None = None
        header = W.HTML(f"<div style='font-size:12px;color:#555'>{escape(fit.describe())}"
                        + (f"; measured on {escape(machine)}" if machine else "") + "</div>")

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


__all__ = ["POLICIES", "Prediction", "StepCostExplorer", "StepCostFit", "explore", "render_prediction"]
