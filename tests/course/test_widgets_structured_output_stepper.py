"""The structured output stepper (chapter 14) on a tiny model with SmolLM2's tokenizer: every step's
record matches the engine (the token taken was allowed, the mask's top token is what greedy took),
the output obeys the constraint, bad input changes nothing, and the view draws and steps."""

from __future__ import annotations

import re

import pytest

from nanoengine import SamplingParams
from nanoengine.sampling_params import StructuredOutputsParams
from widgets import StructuredOutputStepper, StructuredOutputStepperController

CONFIG = {"structured_outputs_config": {"disable_any_whitespace": True}, "max_model_len": 256}
REGEX = "(yes|no), [0-9]{2}"


@pytest.fixture
def engine(build_tiny_llm):
    llm = build_tiny_llm(CONFIG)
    yield llm.engine
    llm.shutdown()


def test_every_step_records_the_mask_and_the_token_greedy_took(engine) -> None:
    c = StructuredOutputStepperController(engine, "Answer:", StructuredOutputsParams(regex=REGEX), max_tokens=20)
    records = c.run_to_end()
    assert c.finished and c.finish_reason == "stop"
    assert re.fullmatch(REGEX, c.text), c.text
    for s in records:
        assert 1 <= s.num_allowed < s.vocab_size
        if s.appended:
            assert s.token == s.top_after[0][0]  # greedy: the masked distribution's top token
            assert s.forced == (s.num_allowed == 1)
    assert records[-1].terminated
    assert c.num_forced == sum(s.num_allowed == 1 for s in records)


def test_a_choice_forces_tokens_and_overrules_the_model(engine) -> None:
    c = StructuredOutputStepperController(engine, "Pick:", StructuredOutputsParams(choice=["alpha", "beta"]),
                                          max_tokens=10)
    c.run_to_end()
    assert c.text in ("alpha", "beta")
    assert c.num_overruled >= 1  # a random model's favourite is never one of the two choices' pieces


def test_bad_input_changes_nothing(engine) -> None:
    with pytest.raises(ValueError, match="does not compile"):
        StructuredOutputStepperController(engine, "x", StructuredOutputsParams(regex="[0-9"))
    with pytest.raises(TypeError):
        StructuredOutputStepperController(engine, "x", {"regex": "a"})
    with pytest.raises(ValueError, match="max tokens"):
        StructuredOutputStepperController(engine, "x", StructuredOutputsParams(regex="a"), max_tokens=0)
    assert not engine.has_unfinished_requests()
    busy = engine.add_request("other", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="unfinished"):
        StructuredOutputStepperController(engine, "x", StructuredOutputsParams(regex="a"))
    engine.abort(busy)


def test_reset_aborts_the_old_request_and_starts_again(engine) -> None:
    c = StructuredOutputStepperController(engine, "Answer:", StructuredOutputsParams(regex=REGEX), max_tokens=20)
    c.step()
    old = c.request_id
    new = c.reset()
    assert new != old and not engine.has_request(old) and c.steps == []
    c.run_to_end()
    with pytest.raises(ValueError, match="finished"):
        c.step()


def test_the_view_draws_and_steps(engine) -> None:
    view = StructuredOutputStepper(engine, "Answer:", StructuredOutputsParams(regex=REGEX), max_tokens=20)
    assert "no step yet" in view.last_step.value
    view.step_button.click()
    assert "tokens allowed" in view.last_step.value and "ne-so-row" in view.history.value
    view.run_button.click()
    assert view.step_button.disabled and "finished" in view.last_step.value
    view.close()
