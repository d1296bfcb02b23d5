"""Tests for widgets.step_cost_explorer: the fitted step cost and the arrival scenario it predicts.

Headless: the fit is checked on points drawn from a known line, the predictions against
counts done by hand, and the view through its own sliders.
"""

from __future__ import annotations

import re

import pytest

from widgets.step_cost_explorer import StepCostExplorer, StepCostFit, explore

LINE = StepCostFit(0.080, 0.001, 0.002)  # 80 ms a step, 1 ms per prefill token, 2 ms per decode token


def test_fit_recovers_the_line_it_was_drawn_from() -> None:
    points = [(n, 0, LINE.step_time(n, 0)) for n in (16, 64, 256)] + \
             [(0, b, LINE.step_time(0, b)) for b in (1, 4, 16, 64)]
    fit = StepCostFit.fit(points)
    assert fit.num_points == 7
    assert fit.fixed == pytest.approx(0.080) and fit.per_prefill_token == pytest.approx(0.001)
    assert fit.per_decode_token == pytest.approx(0.002)


def test_fit_clips_a_negative_slope_instead_of_predicting_faster_steps() -> None:
    # decode steps that got *cheaper* with the batch (noise): the decode slope is clipped to 0
    points = [(16, 0, 0.10), (256, 0, 0.34), (0, 1, 0.09), (0, 64, 0.085)]
    fit = StepCostFit.fit(points)
    assert fit.per_decode_token == 0.0 and fit.per_prefill_token > 0 and fit.fixed > 0


@pytest.mark.parametrize("points, what", [([(16, 0, 0.1), (0, 1, 0.08)], "at least 3"),
                                          ([(16, 0, 0.1), (32, 0, 0.2), (64, 0, 0.3)], "do not determine"),
                                          ([(16, 0, 0.1), (0, 1, 0.08), (0, 0, 0.05)], "not both 0"),
                                          ([(16, 0, -0.1), (0, 1, 0.08), (0, 4, 0.09)], "seconds > 0")])
def test_fit_refuses_points_that_cannot_give_a_line(points, what) -> None:
    with pytest.raises(ValueError, match=what):
        StepCostFit.fit(points)


def test_fcfs_chunks_the_prompt_around_the_decodes() -> None:
    p = explore(LINE, prompt_len=1500, budget=512, num_decoders=4, policy="fcfs")
    assert [pre for pre, _, _ in p.steps] == [508, 508, 484] and all(d == 4 for _, d, _ in p.steps)
    assert p.ttft == pytest.approx(3 * (0.080 + 0.008) + 1.5)
    assert p.worst_gap == pytest.approx(0.080 + 0.508 + 0.008)  # the longest step, which carries them
    assert p.decode_step == pytest.approx(0.088)


def test_prefill_first_makes_the_decoders_wait_through_every_prefill_step() -> None:
    p = explore(LINE, prompt_len=1500, budget=512, num_decoders=4, policy="prefill_first")
    assert [pre for pre, _, _ in p.steps] == [512, 512, 476] and all(d == 0 for _, d, _ in p.steps)
    assert p.worst_gap == pytest.approx(p.ttft + 0.088)
    assert p.worst_gap > explore(LINE, 1500, 512, 4, "fcfs").worst_gap


def test_a_smaller_budget_trades_the_prompts_ttft_for_the_decoders_worst_gap() -> None:
    small, big = explore(LINE, 1500, 256), explore(LINE, 1500, 2048)
    assert small.num_steps == 6 and big.num_steps == 1
    assert small.worst_gap < big.worst_gap and small.ttft > big.ttft


@pytest.mark.parametrize("kwargs, what", [(dict(budget=4), "budget must be above"),
                                          (dict(policy="static"), "policy must be one of"),
                                          (dict(prompt_len=0), "prompt length")])
def test_bad_scenarios_say_what_is_allowed(kwargs, what) -> None:
    args = dict(fit=LINE, prompt_len=1500, budget=512, num_decoders=4, policy="fcfs") | kwargs
    with pytest.raises(ValueError, match=what):
        explore(**args)


def test_the_view_redraws_when_a_slider_moves_and_reports_bad_settings() -> None:
    view = StepCostExplorer(LINE, prompt_len=1504, budget=512, machine="a test machine")
    assert 'data-steps="3"' in view.output.value and view.last.num_steps == 3
    view.budget.value = 256
    assert view.last.budget == 256 and 'data-steps="6"' in view.output.value
    ttft = re.search(r"TTFT</td><td><b>(\d+) ms", view.output.value).group(1)
    assert int(ttft) == round(1e3 * view.last.ttft)
    view.num_decoders.value = 64
    view.budget.value = 48  # below the decodes' share under fcfs
    assert "budget must be above" in view.message.value and view.last.budget == 256  # the last good prediction stays
    view.policy.value = "prefill_first"  # now the budget is fine: the prompt gets all of it
    assert view.last.policy == "prefill_first" and view.message.value == ""
