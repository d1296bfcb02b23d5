"""Tests for widgets.sampling_playground on the real default model (loaded once, shared).

The playground must show what the engine does: its filters are the engine's functions
(checked with a spy on ``kept_mask``), its seeded draws are the engine sampler's draws, and
its "Generate" is a real request through the engine.
"""

from __future__ import annotations

import html
import re

import pytest
import torch

import nanoengine.layers.sampler as sampler_module
from nanoengine import SamplingParams
from nanoengine.layers.sampler import Sampler, filter_logits
from widgets import default_engine, single_thread
from widgets.sampling_playground import SamplingPlayground

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine():
    with single_thread():  # a shared 2-core CPU runs this small model faster on one thread
        yield default_engine()


@pytest.fixture(scope="module")
def shared_view(engine):
    return SamplingPlayground(engine, prompt=PROMPT)


@pytest.fixture()
def view(shared_view, engine):
    """The module's playground, back at its prompt and neutral settings for each test."""
    shared_view.prompt.value = PROMPT
    set_sliders(shared_view)
    shared_view.show_message("")
    yield shared_view
    assert not engine.has_unfinished_requests()
    engine.check_invariants()


def set_sliders(view: SamplingPlayground, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> None:
    view.temperature.value, view.top_k.value, view.top_p.value, view.min_p.value = temperature, top_k, top_p, min_p


def kept_tokens(view: SamplingPlayground) -> list[int]:
    return [int(t) for t in re.findall(r'<tr class="ne-token" data-token="(\d+)"', view.dist.value)]


def cut_tokens(view: SamplingPlayground) -> list[int]:
    return [int(t) for t in re.findall(r'<tr class="ne-token ne-cut" data-token="(\d+)"', view.dist.value)]


@pytest.mark.slow
def test_logits_are_computed_once_per_prompt(engine) -> None:
    view = SamplingPlayground(engine, prompt=PROMPT)
    c = view.controller
    assert c.num_logit_computations == 1 and "logits computed" in view.message.value
    first = view.dist.value
    for t in (0.3, 0.7, 1.5):
        view.temperature.value = t
    view.top_k.value, view.top_p.value, view.min_p.value = 10, 0.8, 0.05
    assert c.num_logit_computations == 1 and view.dist.value != first
    view.prompt.value = "Once upon a time"
    assert c.num_logit_computations == 2
    view.prompt.value = PROMPT  # seen before: cached
    assert c.num_logit_computations == 2
    assert torch.allclose(c.logits, c.engine.next_token_logits(PROMPT).float(), atol=1e-4)


def test_sliders_redraw_with_the_engines_filter(view, monkeypatch) -> None:
    calls = []
    real = sampler_module.kept_mask

    def spy(*args, **kwargs):
        calls.append(args[1:])
        return real(*args, **kwargs)

    monkeypatch.setattr(sampler_module, "kept_mask", spy)  # filter_logits looks it up at call time
    set_sliders(view, temperature=0.8, top_k=3)
    assert calls and calls[-1][0] == [0.8] * 4 and calls[-1][1] == [-1, 3, 3, 3]
    dist = view.controller.distribution()
    assert len(kept_tokens(view)) == 3 and [r.token_id for r in dist.kept_rows] == kept_tokens(view)
    assert all(r.cut_by == "top-k" for r in dist.rows if r.rank >= 3)
    assert dist.stages[2].num_kept == 3 and ">top-k<" in view.dist.value
    expected = torch.softmax(filter_logits(view.controller.logits[None], 0.8, 3, 1.0, 0.0), dim=-1)[0]
    assert torch.allclose(view.controller.final_probs(), expected)
    assert sum(r.p_final for r in dist.kept_rows) == pytest.approx(1.0, abs=1e-5)


def test_each_filter_cuts_and_is_named(view) -> None:
    set_sliders(view, temperature=1.0, top_p=0.5)
    dist = view.controller.distribution()
    assert dist.rows[0].cut_by is None and any(r.cut_by == "top-p" for r in dist.rows)
    set_sliders(view, temperature=1.0, min_p=0.2)
    dist = view.controller.distribution()
    assert any(r.cut_by == "min-p" for r in dist.rows)
    top = dist.rows[0].p_temperature
    for r in dist.rows:  # min-p keeps exactly the tokens at least 0.2 x as likely as the top one
        assert (r.cut_by is None) == (r.p_temperature >= 0.2 * top - 1e-7)
    assert set(cut_tokens(view)) == {r.token_id for r in dist.rows if r.cut_by}


def test_temperature_changes_the_entropy_and_zero_is_greedy(view) -> None:
    entropies = []
    for t in (0.5, 1.0, 1.5):
        view.temperature.value = t
        entropies.append(view.controller.distribution().stages[1].entropy_bits)
        shown = re.findall(r'class="ne-entropy">([\d.]+)<', view.stages.value)
        assert float(shown[1]) == pytest.approx(entropies[-1], abs=0.006)
    assert entropies[0] < entropies[1] < entropies[2]
    view.temperature.value = 0.0
    dist = view.controller.distribution()
    argmax = int(view.controller.logits.argmax())
    assert kept_tokens(view) == [argmax] and "greedy" in view.dist.value
    assert dist.stages[-1].num_kept == 1 and view.controller.sample(5, 0) == [argmax] * 5


def test_seeded_draws_are_the_engine_samplers_draws(view) -> None:
    set_sliders(view, temperature=1.3, top_k=40, top_p=0.95, min_p=0.01)
    c = view.controller
    params = SamplingParams(temperature=1.3, top_k=40, top_p=0.95, min_p=0.01)
    ours = c.sample(6, seed=11, per_request=True)
    theirs = [Sampler()(c.logits[None], [params], [torch.Generator().manual_seed(11 + i)]).token_ids[0]
              for i in range(6)]
    assert ours == theirs
    kept = set(torch.nonzero(c.final_probs()).flatten().tolist())
    fast = c.sample(2000, seed=3)
    assert set(fast) <= kept and fast == c.sample(2000, seed=3) and fast != c.sample(2000, seed=4)
    counts = dict(c.histogram(2000, seed=3))
    top = int(c.logits.argmax())
    assert counts[top] / 2000 == pytest.approx(float(c.final_probs()[top]), abs=0.05)


def test_sample_button_draws_a_histogram(view) -> None:
    set_sliders(view, temperature=1.0, top_k=5)
    view.num_samples.value, view.sample_seed.value = 300, 5
    view.sample_button.click()
    png = view.histogram.value
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    text = html.unescape(view.histogram_text.value)
    assert "300 samples (seed 5)" in text and "␣Paris" in text
    view.sample_seed.value = 6
    view.sample_button.click()
    assert view.histogram.value != png


@pytest.mark.slow
def test_generate_runs_a_real_request_through_the_engine(view, engine) -> None:
    set_sliders(view, temperature=0.0)
    view.gen_tokens.value, view.gen_seed.value = 3, -1
    view.gen_button.click()
    assert "generated request" in view.message.value and "finish reason: length" in view.generation.value
    reference_id = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=3))
    text = None
    while text is None:
        text = next((o.text for o in engine.step() if o.request_id == reference_id and o.finished), None)
    assert f"<b>{html.escape(text)}</b>" in view.generation.value
    assert "Paris" in text


def test_bad_input_shows_a_message_and_leaves_the_engine_unchanged(view, engine) -> None:
    before = engine.snapshot()
    c = view.controller
    params_before, calls_before = c.params, c.num_logit_computations
    with pytest.raises(ValueError, match="top_p must be in"):
        c.set_params(top_p=0.0)  # the controller refuses what the engine refuses ...
    assert c.params == params_before
    view.top_p.value = 1.0
    assert view.message.value == ""
    for prompt, expected in (("", "prompt is empty"), ("word " * 9000, "max_model_len is 8192")):
        view.prompt.value = prompt
        assert expected in view.message.value and c.prompt == PROMPT
    view.num_samples.value = 0
    view.sample_button.click()
    assert "samples must be between" in view.message.value
    view.gen_tokens.value = 0
    view.gen_button.click()
    assert "max tokens must be" in view.message.value
    with pytest.raises(ValueError, match="unknown sampling control"):
        c.set_params(temprature=1.0)
    assert engine.snapshot() == before and c.num_logit_computations == calls_before


def test_every_slider_stays_inside_what_the_engine_accepts(view) -> None:
    """A learner dragging any slider to either end gets a distribution, never the engine's refusal."""
    c = view.controller
    for slider in (view.temperature, view.top_k, view.top_p, view.min_p):
        for end in (slider.min, slider.max):
            slider.value = end
            assert view.message.value == "", (slider.description, end, view.message.value)
            SamplingParams(temperature=view.temperature.value, top_k=view.top_k.value, top_p=view.top_p.value,
                           min_p=view.min_p.value)  # raises if the engine would refuse it
        slider.value = {"temperature": 1.0, "top-k (-1 off)": -1, "top-p": 1.0, "min-p": 0.0}[slider.description]
    view.top_p.value = 0.0  # typed below the range: the slider clamps it to its lowest stop
    assert view.top_p.value > 0 and view.message.value == "" and c.params.top_p == view.top_p.value
