"""Chapter 8's exercise checks (widgets.exercises.ch08) on the real default model: placeholders
and bad values are "not yet", and each check accepts exactly what its exercise asks for."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("draw", [..., None, "argmax", 3])
def test_gumbel_placeholders_and_bad_values_are_not_yet(engine, draw) -> None:
    result = ch08.check_gumbel_draw(engine, draw)
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


def _uniform(logits, generator):
    return torch.rand(logits.shape, generator=generator, dtype=torch.float64).clamp_min(1e-300)


def gumbel_max(logits, generator):  # the worked solution
    return (logits.double() - torch.log(-torch.log(_uniform(logits, generator)))).argmax(dim=-1)


def test_the_gumbel_max_draw_passes(engine) -> None:
    assert ch08.check_gumbel_draw(engine, gumbel_max).right


@pytest.mark.parametrize("wrong", [
    lambda x, g: (x - torch.log(_uniform(x, g))).argmax(dim=-1),  # exponential noise added: not Gumbel
    lambda x, g: (x + _uniform(x, g)).argmax(dim=-1),  # uniform noise
    lambda x, g: (torch.softmax(x, -1) * _uniform(x, g)).argmax(dim=-1),  # p * U instead of p / E
])
def test_plausible_noises_do_not_fit_the_softmax(engine, wrong) -> None:
    result = ch08.check_gumbel_draw(engine, wrong)
    assert not result.right and "fit to the softmax: no" in " ".join(str(result).split())


def test_an_inverse_cdf_draw_fits_but_is_not_coupled(engine) -> None:
    def inverse_cdf(x, g):  # one uniform per row, looked up in the cumulative probabilities
        cdf = torch.softmax(x.double(), -1).cumsum(-1)
        u = torch.rand(x.shape[0], 1, generator=g, dtype=torch.float64) * cdf[:, -1:]
        return torch.searchsorted(cdf, u)[:, 0].clamp(max=x.shape[1] - 1)

    result = ch08.check_gumbel_draw(engine, inverse_cdf)
    text = " ".join(str(result).split())
    assert not result.right and "fit to the softmax: yes" in text and "to another one" in text


def test_a_draw_that_ignores_the_generator_is_not_reproducible(engine) -> None:
    result = ch08.check_gumbel_draw(engine, lambda x, g: gumbel_max(x, torch.Generator().manual_seed(
        int(torch.randint(0, 2**30, ())))))
    assert not result.right and "seeded the same" in " ".join(str(result).split())


def test_torch_multinomial_is_itself_an_exponential_race() -> None:
    """What the chapter says of the engine's draw: one sample of torch.multinomial is argmax(p / E)."""
    p = torch.softmax(torch.randn(500), -1)
    for seed in range(20):
        drawn = torch.multinomial(p, 1, generator=torch.Generator().manual_seed(seed)).item()
        race = (p / torch.empty_like(p).exponential_(1, generator=torch.Generator().manual_seed(seed))).argmax()
        assert drawn == race.item()
