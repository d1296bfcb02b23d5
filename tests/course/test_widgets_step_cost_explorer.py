"""Tests for widgets.step_cost_explorer: the fitted step cost and the arrival scenario it predicts.

Headless: the fit is checked on points drawn from a known line, the predictions against
counts done by hand, and the view through its own sliders.
"""

from __future__ import annotations

import re

import pytest

import types

from widgets.step_cost_explorer import (StepCostExplorer, StepCostFit, arrival_points, attention_pairs, explore,
                                        read_prediction)

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


ATTN = StepCostFit(0.030, 0.0008, 0.001, per_attention_pair=4e-7)  # + 0.4 us per (token, context token) pair


def test_attention_pairs_count_causal_attention_over_the_cached_context() -> None:
    assert attention_pairs(3) == 1 + 2 + 3
    assert attention_pairs(2, start=10) == 11 + 12
    assert attention_pairs(0, start=100) == 0


def test_attention_fit_recovers_all_four_coefficients_from_chunks_at_several_positions() -> None:
    points = [(c, 4, attention_pairs(c, s), ATTN.step_time(c, 4, start=s)) for c, s in
              ((252, 0), (252, 504), (252, 1008), (508, 0), (508, 1016), (1500, 0))]
    points += [(0, d, 0, ATTN.step_time(0, d)) for d in (4, 5, 3)]
    fit = StepCostFit.fit(points, attention=True)
    for name in ("fixed", "per_prefill_token", "per_decode_token", "per_attention_pair"):
        assert getattr(fit, name) == pytest.approx(getattr(ATTN, name), rel=1e-6)
    assert "per 1,000 attention pairs" in fit.describe()
    with pytest.raises(ValueError, match="4 numbers"):
        StepCostFit.fit([(16, 0, 0.1)] * 4, attention=True)


def test_explore_charges_later_chunks_for_the_context_before_them() -> None:
    p = explore(ATTN, prompt_len=1500, budget=512, num_decoders=4)
    times = [s for _, _, s in p.steps]
    assert times[0] == pytest.approx(ATTN.step_time(508, 4))
    assert times[1] == pytest.approx(ATTN.step_time(508, 4, start=508)) and times[1] > times[0]
    assert p.worst_gap == max(times)
    # the line without the attention term predicts less: what chapter 6's first fit missed
    line = StepCostFit(ATTN.fixed, ATTN.per_prefill_token, ATTN.per_decode_token)
    assert explore(line, 1500, 512).ttft < p.ttft


def test_arrival_points_keep_the_long_prompts_chunks_and_the_decode_only_steps() -> None:
    step = lambda p, d, t: types.SimpleNamespace(num_prefill_tokens=p, num_decode_tokens=d, total_time=t)
    run = types.SimpleNamespace(steps=(step(120, 0, 0.2), step(0, 4, 0.03), step(252, 4, 0.3), step(252, 4, 0.35),
                                       step(0, 5, 0.04)), prefill_steps=(2, 3))
    assert arrival_points(run) == [(0, 4, 0, 0.03), (252, 4, attention_pairs(252), 0.3),
                                   (252, 4, attention_pairs(252, 252), 0.35), (0, 5, 0, 0.04)]


def test_prediction_reading_follows_its_numbers() -> None:
    # the saved run: section 2's line predicted 1346 ms for a measured 1966 ms TTFT, and so on
    assert "under-predicts every measured value, by 30-34%" in read_prediction(
        "the line", [1.966, 1.892, 1.701], [1.346, 1.251, 1.188])
    assert "over-predicts" in read_prediction("f", [1.0, 2.0], [1.2, 2.1])
    assert "within 10%" in read_prediction("f", [1.0, 2.0], [1.09, 1.82])
    assert "under-predicts" in read_prediction("f", [1.0, 2.0], [0.89, 1.9])
    assert "both sides" in read_prediction("f", [1.0, 2.0], [1.2, 1.6])
