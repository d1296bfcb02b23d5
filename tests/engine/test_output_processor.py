"""Output processing (chapters 2, 6 and 11): vLLM's output shape, logprobs, per-token times."""

from __future__ import annotations

import math
import time

import pytest

from nanoengine import CompletionOutput, LLMEngine, RequestOutputKind, SamplingParams
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


def _outputs_by_kind(build_tiny_llm, kind: RequestOutputKind, **params) -> list:
    """Every output one request produced, read with ``kind``: a seeded sample (n=2, logprobs)."""
    llm = build_tiny_llm({"device": "cpu", "num_kv_blocks": 64, "max_model_len": 128})
    e = llm.engine
    rid = e.add_request("Once upon", SamplingParams(**{"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 12,
                                                      "logprobs": 1, "output_kind": kind, **params}))
    outputs = []
    while e.has_unfinished_requests():
        outputs += [out for out in e.step() if out.request_id == rid]
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("stop", [(), ("e",)], ids=["no stop", "stop string"])
def test_the_three_output_kinds_tell_the_same_story(build_tiny_llm, stop):
    """CUMULATIVE shows everything so far, DELTA only what is new (appended, the same),
    FINAL_ONLY one output at the end; with the same seed the completions are equal."""
    cumulative = _outputs_by_kind(build_tiny_llm, RequestOutputKind.CUMULATIVE, stop=stop)
    deltas = _outputs_by_kind(build_tiny_llm, RequestOutputKind.DELTA, stop=stop)
    (final,) = _outputs_by_kind(build_tiny_llm, RequestOutputKind.FINAL_ONLY, stop=stop)
    assert len(deltas) == len(cumulative) > 1 and final.finished and deltas[-1].finished
    end = cumulative[-1]
    for i in range(2):
        pieces = [out.outputs[i] for out in deltas]
        assert all(c.text == c.delta for c in pieces)  # a delta output's text is its delta
        assert "".join(c.text for c in pieces) == end.outputs[i].text == final.outputs[i].text
        assert sum((c.token_ids for c in pieces), ()) == end.outputs[i].token_ids == final.outputs[i].token_ids
        assert sum((c.logprobs for c in pieces), ()) == end.outputs[i].logprobs == final.outputs[i].logprobs
        assert all(len(c.logprobs) == len(c.token_ids) <= 1 for c in pieces)  # one token a step at most
        assert pieces[-1].finish_reason == end.outputs[i].finish_reason == final.outputs[i].finish_reason
        assert deltas[-1].outputs[i].cumulative_logprob == pytest.approx(final.outputs[i].cumulative_logprob)
    for delta_out, cumulative_out in zip(deltas, cumulative):  # the request's own record stays whole
        assert delta_out.prompt_token_ids == cumulative_out.prompt_token_ids
        assert delta_out.metrics.num_output_tokens == cumulative_out.metrics.num_output_tokens
    assert deltas[-1].metrics.num_output_tokens == final.metrics.num_output_tokens == len(final.metrics.token_times)


def test_an_aborted_delta_request_ends_with_what_was_not_handed_out(build_tiny_llm):
    llm = build_tiny_llm({"device": "cpu", "num_kv_blocks": 64, "max_model_len": 128})
    e = llm.engine
    rid = e.add_request("Once upon", SamplingParams(max_tokens=50, ignore_eos=True,
                                                    output_kind=RequestOutputKind.DELTA))
    seen = [out for _ in range(4) for out in e.step()]
    final = e.abort(rid)
    assert final.finished and final.finish_reason == "abort"
    handed_out = sum((out.token_ids for out in seen), ()) + final.token_ids
    assert len(handed_out) == final.metrics.num_output_tokens  # every token exactly once
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def test_a_stop_tokens_text_is_left_out_and_its_id_kept(build_tiny_llm):
    """vLLM's rule (without include_stop_str_in_output): the token that ended a request by
    its id is in ``token_ids`` but not in ``text``, however the output is read. A stop
    string that does not occur makes even FINAL_ONLY detokenize every step."""
    llm = build_tiny_llm({"device": "cpu", "num_kv_blocks": 64, "max_model_len": 128})
    e = llm.engine
    greedy = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    free = finish_one(e, SamplingParams(**greedy))
    stop_id = free.token_ids[3]
    cut = free.token_ids.index(stop_id)  # where the stop token first comes
    before = finish_one(e, SamplingParams(**{**greedy, "max_tokens": cut}))  # the tokens before it
    with_it = finish_one(e, SamplingParams(**{**greedy, "max_tokens": cut + 1}))
    assert len(with_it.text) > len(before.text), "the stop token must have text, or this test proves nothing"

    for kind in RequestOutputKind:
        for stop in (), ("never in this text",):
            outputs = outputs_of(e, SamplingParams(**greedy, stop_token_ids=[stop_id], stop=stop, output_kind=kind))
            final = outputs[-1].outputs[0]
            reads = outputs if kind == RequestOutputKind.DELTA else outputs[-1:]
            text = "".join(out.outputs[0].text for out in reads)
            token_ids = sum((out.outputs[0].token_ids for out in reads), ())
            assert (final.finish_reason, final.stop_reason) == ("stop", stop_id), (kind, stop)
            assert token_ids == free.token_ids[:cut + 1] and text == before.text, (kind, stop)


def outputs_of(e: LLMEngine, params: SamplingParams) -> list:
    """Every output of one request on ``e`` (prompt "Once upon"), stepped to its end."""
    rid = e.add_request("Once upon", params)
    outputs = []
    while e.has_unfinished_requests():
        outputs += [out for out in e.step() if out.request_id == rid]
    return outputs


def finish_one(e: LLMEngine, params: SamplingParams):
    """The final completion of one request on ``e`` (prompt "Once upon")."""
    return outputs_of(e, params)[-1].outputs[0]


def test_engine_requests_is_a_live_view_of_the_unfinished_completions(build_tiny_llm):
    """``engine.requests`` follows the engine step by step: each unfinished completion by
    its own id (``i_<id>`` when n > 1), a completion that stopped before its siblings gone
    at once, everything gone when the request ends; lookups of unknown ids say no."""
    llm = build_tiny_llm({"device": "cpu", "num_kv_blocks": 64, "max_model_len": 128})
    e = llm.engine
    view = e.requests
    rid = e.add_request("Once", SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=30, stop=["e"]))
    single = e.add_request("Once upon", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert set(view) == {"0_" + rid, "1_" + rid, "2_" + rid, single} and len(view) == 4
    assert view[single].request_id == single and rid not in view and "nobody" not in view
    with pytest.raises(KeyError):
        view["nobody"]
    saw_a_finished_sibling = False
    while e.has_unfinished_requests():
        e.step()
        unfinished = {r.request_id: r for state in e.output_processor.states.values()
                      for r in state.completions if not r.is_finished}
        assert dict(view) == unfinished and len(view) == len(unfinished)
        finished_siblings = [r for state in e.output_processor.states.values() for r in state.completions
                             if r.is_finished]
        saw_a_finished_sibling |= bool(finished_siblings)
        assert not any(r.request_id in view for r in finished_siblings)
    assert saw_a_finished_sibling, "no completion stopped before its siblings: pick another seed"
    assert not view and not e.output_processor.completions_by_id and repr(view) == "LiveRequests([])"
