"""The tensor-parallel stepper (widgets.tp_stepper) driven headless on the real default model:
the stages compute the split on the layer's real weights, the all-reduced sum equals the unsplit
MLP, bad rank counts are refused without changing anything, and the view's buttons work."""

from __future__ import annotations

import pytest
import torch

from widgets.tp_stepper import STAGES, TPStepper, TPStepperController

pytestmark = pytest.mark.slow  # loads the default model


@pytest.fixture(scope="module")
def stepper(default_llm):
    return TPStepperController(default_llm, layer=0, tp=3)


def test_stepping_walks_the_five_stages_and_the_sum_is_the_unsplit_mlp(stepper) -> None:
    stepper.configure(layer=0, tp=3)
    seen = [stepper.describe().name]
    while not stepper.finished:
        seen.append(stepper.step().name)
    assert seen == list(STAGES)
    last = stepper.describe()
    assert last.verdict.endswith("True") and last.bytes_sent == stepper.x.shape[0] * stepper.hidden * 4
    assert torch.allclose(stepper.total, stepper.unsplit, atol=1e-4)
    assert stepper.step().index == len(STAGES) - 1  # stepping past the end stays at the end
    assert stepper.back().name == "partials"


def test_the_shards_are_the_real_weight_slices(stepper, default_llm) -> None:
    stepper.configure(layer=5, tp=4)
    mlp = default_llm.engine.runner.model.model.layers[5].mlp
    k = stepper.intermediate // 4
    gate = mlp.gate_up_proj.weight[:stepper.intermediate]
    assert torch.equal(stepper.shards[2][0], gate[2 * k:3 * k])
    assert torch.equal(stepper.shards[2][2], mlp.down_proj.weight[:, 2 * k:3 * k])
    partials = stepper.step() and stepper.step() and stepper.step()
    assert partials.name == "partials" and "True" in partials.verdict  # no partial is the output alone
    assert all(r.shape == (stepper.x.shape[0], stepper.hidden) for r in partials.ranks)


def test_bad_rank_counts_and_layers_are_refused_and_change_nothing(stepper) -> None:
    stepper.configure(layer=1, tp=2)
    stepper.step()
    before = (stepper.layer, stepper.tp, stepper.stage)
    for bad in ({"tp": 5}, {"tp": 0}, {"tp": "3"}, {"layer": 99}, {"layer": -1}):
        with pytest.raises(ValueError):
            stepper.configure(**bad)
        assert (stepper.layer, stepper.tp, stepper.stage) == before
    with pytest.raises(ValueError, match="allowed"):
        stepper.configure(tp=7)
    assert 5 not in stepper.allowed_tp() and 3 in stepper.allowed_tp()


def test_the_view_steps_changes_ranks_and_never_touches_the_engine(stepper, default_llm) -> None:
    engine = default_llm.engine
    before = engine.snapshot()
    view = TPStepper(controller=stepper)
    view.reset_button.click()
    assert view.back_button.disabled and "input" in view.header.value
    for _ in STAGES[1:]:
        view.step_button.click()
    assert view.step_button.disabled and "all-reduce" in view.header.value and "True" in view.header.value
    view.tp.value = 4
    assert stepper.tp == 4 and stepper.stage == 0 and view.message.value == ""
    view.layer.value = 7
    assert stepper.layer == 7 and "rank 3" in view.table.value
    assert engine.snapshot() == before
