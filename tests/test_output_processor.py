"""Output processing (chapters 2, 6 and 11): vLLM's output shape, logprobs, per-token times."""

from __future__ import annotations

import math
import time

import pytest

from nanoengine import CompletionOutput, LLMEngine, SamplingParams
from nanoengine.loader.weights import random_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest


def engine(**config) -> LLMEngine:
    options = dict(device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64)
    return LLMEngine.from_model(random_model("tiny-llama-eos", std=0.08), None, **{**options, **config})


def finish(e: LLMEngine) -> dict:
    finals = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_outputs_have_vllms_shape_and_shortcuts():
    e = engine()
    rid = e.add_request(list(range(30, 40)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2))
    out = finish(e)[rid]
    (completion,) = out.outputs
    assert isinstance(completion, CompletionOutput) and completion.index == 0 and completion.finished
    assert (out.token_ids, out.finish_reason, out.logprobs) == (completion.token_ids, "length", completion.logprobs)
    assert len(completion.logprobs) == 4 and all(len(step) >= 2 for step in completion.logprobs)
    sampled = [step[0] for step in completion.logprobs]  # the sampled token comes first
    assert [lp.token_id for lp in sampled] == list(completion.token_ids)
    assert math.isclose(completion.cumulative_logprob, sum(lp.logprob for lp in sampled), rel_tol=1e-9)
    without = engine()
    without.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    assert finish(without)["0"].outputs[0].cumulative_logprob is None


def test_every_output_token_is_timestamped():
    e = engine()
    rid = e.add_request(list(range(30, 40)), SamplingParams(max_tokens=6, ignore_eos=True))
    metrics = finish(e)[rid].metrics
    times = metrics.token_times
    assert len(times) == metrics.num_output_tokens == 6 and list(times) == sorted(times)
    assert times[0] == metrics.first_token_time and metrics.arrival_time <= metrics.first_scheduled_time <= times[0]
    assert times[-1] <= metrics.finished_time
    assert len(metrics.inter_token_latencies) == 5 and all(g >= 0 for g in metrics.inter_token_latencies)
    assert math.isclose(metrics.tpot, sum(metrics.inter_token_latencies) / 5 + (metrics.finished_time - times[-1]) / 5)


def test_arrival_time_can_be_set_for_trace_replay_and_is_checked():
    e = engine()
    arrived = time.perf_counter() - 2.0  # the request arrived two seconds ago
    rid = e.add_request([1, 2, 3], SamplingParams(max_tokens=1), arrival_time=arrived)
    metrics = finish(e)[rid].metrics
    assert metrics.arrival_time == arrived and metrics.ttft >= 2.0
    before = e.snapshot()
    for bad in (time.perf_counter() + 60, float("nan"), "now", True):
        with pytest.raises(ValueError, match="arrival_time must be"):
            e.add_request([1, 2, 3], SamplingParams(), arrival_time=bad)
    assert e.snapshot() == before and not e.requests


def test_stop_strings_end_each_completion_on_its_own(build_tiny_llm):
    """Stop strings are applied per completion; the request finishes when all have."""
    llm = build_tiny_llm({"device": "cpu", "num_kv_blocks": 64, "max_model_len": 128})
    (out,) = llm.generate("Once", SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=30, stop=["e"]))
    reasons = [c.finish_reason for c in out.outputs]
    assert "stop" in reasons and out.finished
    for c in out.outputs:
        assert "e" not in c.text
        assert (c.finish_reason, c.stop_reason) in (("stop", "e"), ("length", None))
    stopped = [c for c in out.outputs if c.finish_reason == "stop"]
    assert all(len(c.token_ids) < 30 for c in stopped)
