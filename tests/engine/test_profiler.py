"""The step profiler: disjoint phases, nested time charged to the inner phase, free when off."""

from __future__ import annotations

import time

import pytest

from nanoengine import LLMEngine, SamplingParams
from nanoengine.engine import profiler as profiler_module
from nanoengine.engine.profiler import PHASES, StepProfiler
from nanoengine.events import StepFinished
from nanoengine.loader.weights import random_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest


class FakeClock:
    def __init__(self) -> None:
        self.now, self.reads = 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(profiler_module, "_clock", fake)
    return fake


def test_nested_time_belongs_to_the_innermost_phase_and_gaps_to_nobody(clock):
    p = StepProfiler()
    p.start(enabled=True)
    with p.phase("schedule"):
        clock.now += 1.0
        with p.phase("block_manager"):
            clock.now += 0.25
        clock.now += 0.5
    clock.now += 2.0  # between phases: the engine's own bookkeeping
    with p.phase("update"):
        with p.phase("detokenize"):
            clock.now += 0.125
    times = p.finish()
    assert times == {"schedule_time": 1.5, "block_manager_time": 0.25, "prepare_time": 0.0, "model_time": 0.0,
                     "sample_time": 0.0, "update_time": 0.0, "detokenize_time": 0.125, "total_time": 3.875}
    reads = clock.reads
    with p.phase("schedule"):  # after finish, until the next start: off
        pass
    assert clock.reads == reads and not p.enabled
    p.start(enabled=True)  # a new step starts from zero
    assert all(v == 0.0 for k, v in p.finish().items() if k != "total_time")


def test_a_disabled_profiler_reads_no_clock_and_an_exception_closes_its_phase(clock):
    p = StepProfiler()
    p.start(enabled=False)
    for name in PHASES:
        with p.phase(name):
            pass
    assert clock.reads == 0
    p.start(enabled=True)
    with pytest.raises(KeyError):
        with p.phase("model"):
            raise KeyError("boom")
    assert p.finish()["model_time"] == 0.0  # closed: finish does not complain of an open phase
    with pytest.raises(ValueError, match="unknown phase 'modle'.*schedule"):
        p.phase("modle")


def _engine() -> LLMEngine:
    return LLMEngine.from_model(random_model("tiny-llama-eos", std=0.08), None, device="cpu", block_size=4,
                                num_kv_blocks=64, max_model_len=64)


def test_an_unwatched_engine_step_reads_no_profiler_clock(monkeypatch):
    engine = _engine()
    reads = []
    monkeypatch.setattr(profiler_module, "_clock", lambda: reads.append(1) or time.perf_counter())
    engine.add_request([5, 9, 200, 31, 7], SamplingParams(temperature=0.0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert reads == []
    steps = []
    engine.events.subscribe(steps.append, StepFinished)
    engine.add_request([5, 9, 200, 31, 7], SamplingParams(temperature=0.0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(steps) == 3 and reads  # watched: every step is timed
    for step in steps:
        phases = [getattr(step, f"{name}_time") for name in PHASES]
        assert all(t >= 0 for t in phases) and sum(phases) <= step.total_time * 1.0001
        assert step.model_time > 0 and step.schedule_time > 0 and step.block_manager_time > 0
