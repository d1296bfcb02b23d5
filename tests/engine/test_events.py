"""The event bus: events are built only for someone who wants them; the history is opt-in and bounded."""

from __future__ import annotations

import pytest

from nanoengine import LLMEngine, SamplingParams
from nanoengine.engine import block_manager as block_manager_module
from nanoengine.engine import scheduler as scheduler_module
from nanoengine.events import BlocksAllocated, RequestScheduled, StepFinished
from nanoengine.loader.weights import random_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest

PROMPTS = [[5, 9, 200, 31, 7, 11, 3, 8, 40], [5, 9, 200, 31, 7, 11, 3, 8, 41]]  # two blocks shared


def engine() -> LLMEngine:
    return LLMEngine.from_model(random_model("tiny-llama-eos", std=0.08), None, device="cpu", block_size=4,
                                num_kv_blocks=64, max_model_len=64)


def run(e: LLMEngine) -> None:
    for prompt in PROMPTS:
        e.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while e.has_unfinished_requests():
            e.step()


def counting(monkeypatch, module, cls, built: list) -> None:
    monkeypatch.setattr(module, cls.__name__, lambda *a, **kw: built.append(cls) or cls(*a, **kw))


def test_an_unwatched_engine_builds_no_block_or_scheduling_events_and_keeps_none(monkeypatch):
    built = []
    counting(monkeypatch, block_manager_module, BlocksAllocated, built)
    counting(monkeypatch, scheduler_module, RequestScheduled, built)
    e = engine()
    run(e)
    assert built == [] and len(e.events.history) == 0
    assert e.snapshot().prefix_cache_hits == 8 and e.snapshot().prefix_cache_queries == 18  # counted all the same


def test_an_observer_of_one_type_gets_only_those_built():
    e = engine()
    seen = []
    e.events.subscribe(seen.append, BlocksAllocated)
    assert e.events.wants(BlocksAllocated) and not e.events.wants(StepFinished)
    run(e)
    assert seen and all(isinstance(ev, BlocksAllocated) for ev in seen)


def test_the_history_is_opt_in_bounded_and_holds_the_latest_events():
    e = engine()
    history = e.events.keep_history(5)
    assert e.events.wants(StepFinished) and e.events.history is history
    run(e)
    assert len(history) == 5 and isinstance(history[-1], StepFinished)
    assert history[-1].step == e.step_count - 1
    e.events.keep_history(0)
    assert len(e.events.history) == 0 and not e.events.wants(StepFinished)
    with pytest.raises(ValueError, match="maxlen must be a whole number of events >= 0, got -1"):
        e.events.keep_history(-1)
