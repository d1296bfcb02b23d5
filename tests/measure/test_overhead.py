"""The host-overhead benchmark (``bench --overhead``): the engine's own phase timers, end to end."""

from __future__ import annotations

import json

import pytest

from nanoengine.__main__ import main
from nanoengine.events import StepFinished
from nanobench.overhead import PHASES, measure_overhead, overhead_engine


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_tok_dir):
    from nanoengine.loader.weights import load_tokenizer

    return load_tokenizer(tiny_llama_tok_dir)


def test_phases_cover_the_step_and_model_time_is_excluded(tokenizer):
    engine = overhead_engine(3, tokenizer, 49152, max_model_len=256)
    steps: list[StepFinished] = []
    engine.events.subscribe(lambda e: steps.append(e) if isinstance(e, StepFinished) else None)
    row = measure_overhead(engine, 3, {"temperature": 0.8, "top_k": 50, "top_p": 0.95}, steps=4)
    assert row["num_requests"] == 3 and row["steps"] == 4
    assert set(row["phases_ms"]) == set(PHASES.values())
    assert all(value >= 0 for value in row["phases_ms"].values())
    assert row["host_ms"] > 0 and row["model_ms"] > 0
    assert len(steps) >= row["steps"], steps  # the timed steps at least: the loop below checks something
    for step in steps:  # disjoint phases: with the model they never exceed the step
        parts = [getattr(step, field) for field in PHASES] + [step.model_time]
        assert all(p >= 0 for p in parts), step
        assert sum(parts) <= step.total_time * 1.0001, step
        assert step.host_time == pytest.approx(step.total_time - step.model_time)
    assert not engine.has_unfinished_requests()  # the measured requests are aborted
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.slow
def test_bench_overhead_writes_a_results_file(tmp_path):
    out = tmp_path / "overhead.json"
    assert main(["bench", "--overhead", "--overhead-requests", "1", "2", "--overhead-steps", "2",
                 "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [(r["sampling"], r["num_requests"]) for r in results["rows"]] == [
        ("greedy", 1), ("greedy", 2), ("top-k/top-p", 1), ("top-k/top-p", 2),
        ("greedy, streamed", 1), ("greedy, streamed", 2), ("greedy, deltas", 1), ("greedy, deltas", 2)]
    final, streamed, deltas = results["rows"][1], results["rows"][5], results["rows"][7]
    assert final["phases_ms"]["detokenize"] == 0 < streamed["phases_ms"]["detokenize"]  # text only when read
    assert deltas["phases_ms"]["detokenize"] > 0
    assert [r["output_kind"] for r in results["rows"][::2]] == ["FINAL_ONLY", "FINAL_ONLY", "CUMULATIVE", "DELTA"]
    assert results["environment"]["nanoengine_revision"] is not None or results["environment"]["torch"]
    assert results["date"] and results["kind"] == "host overhead per step"
