"""Chapter 8's exercise checks (widgets.exercises.ch08) on the real default model: placeholders
and bad values are "not yet", and each check accepts exactly what its exercise asks for."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nanoengine import SamplingParams
from widgets import single_thread
from widgets.exercises import ch08

pytestmark = pytest.mark.slow  # loads the default model


@pytest.fixture(scope="module")
def engine(default_llm):
    with single_thread():  # one vocabulary row at a time: a second thread only costs time
        yield default_llm.engine


@pytest.mark.parametrize("check", [ch08.check_top_p, ch08.check_temperature])
@pytest.mark.parametrize("value", [..., None, "0.5", True, -1, 0, 11, float("nan")])
def test_placeholders_and_bad_values_are_not_yet(engine, check, value) -> None:
    result = check(engine, value)
    assert not result.right and str(result).startswith(f"Exercise {result.exercise}: not yet. Hint: ")


@pytest.mark.parametrize("n, seed", [(..., 10), (3, ...), (None, None), (0, 10), (9, 10), (3, -1), (3.0, 10),
                                     (True, 10)])
def test_seed_and_n_placeholders_and_bad_values_are_not_yet(engine, n, seed) -> None:
    result = ch08.check_seed_and_n(engine, n, seed)
    assert not result.right and "8.3: not yet. Hint: " in str(result)


def test_the_check_wants_the_chapters_llm_or_engine() -> None:
    with pytest.raises(TypeError):
        ch08.check_top_p("engine", 0.5)


def test_top_p_accepts_exactly_the_window_that_keeps_k_tokens(engine) -> None:
    probs = torch.softmax(ch08.peaked_logits(engine), dim=-1).double().sort(descending=True).values
    below, upto = float(probs[:ch08.KEEP_TOKENS - 1].sum()), float(probs[:ch08.KEEP_TOKENS].sum())
    assert ch08.check_top_p(engine, (below + upto) / 2).right
    assert not ch08.check_top_p(engine, below - 1e-3).right  # one token fewer
    assert not ch08.check_top_p(engine, upto + 1e-3).right  # one more


def test_temperature_above_one_lowers_the_top_probability(engine) -> None:
    tops = [ch08.top_probability(engine, t) for t in (0.5, 1.0, 1.5)]
    assert tops[0] > tops[1] > tops[2]
    low, high = 1.0, 3.0  # bisect to the middle of the window, as the worked solution does
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if ch08.top_probability(engine, mid) > 0.45 else (low, mid)
    assert ch08.check_temperature(engine, low).right
    assert not ch08.check_temperature(engine, 1.0).right


def test_completion_i_of_a_seeded_request_is_the_request_seeded_seed_plus_i(engine) -> None:
    many = ch08.story_tokens(engine, dataclasses.replace(ch08.STORY_PARAMS, n=2, seed=ch08.FIRST_SEED))
    alone = ch08.story_tokens(engine, dataclasses.replace(ch08.STORY_PARAMS, seed=ch08.FIRST_SEED + 1))
    assert many[1] == alone[0]
    assert ch08.check_seed_and_n(engine, ch08.LAST_SEED - ch08.FIRST_SEED + 1, ch08.FIRST_SEED).right
    assert not ch08.check_seed_and_n(engine, 1, ch08.FIRST_SEED).right
    assert not engine.has_unfinished_requests()
    assert isinstance(ch08.STORY_PARAMS, SamplingParams)
