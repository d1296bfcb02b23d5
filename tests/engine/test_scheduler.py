"""The scheduler (chapter 5): policies, the prefill/decode decision, the token budget."""

from __future__ import annotations

import pytest

from nanoengine import LLMEngine, SamplingParams
from nanoengine.engine.request import Request
from nanoengine.engine.scheduler import ScheduledRequest, check_stop
from nanoengine.engine.scheduling_policy import POLICIES, make_policy
from nanoengine.events import RequestScheduled, StepFinished
from nanoengine.loader.weights import random_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest


def engine(**config) -> LLMEngine:
    options = dict(device="cpu", block_size=4, num_kv_blocks=256, max_model_len=128, max_num_seqs=3)
    return LLMEngine.from_model(random_model("tiny-llama-eos", std=0.08), None, **{**options, **config})


def trace(e: LLMEngine, lengths: list[int]) -> tuple[dict, list[list[str]]]:
    """Run requests of the given output lengths; (final tokens by id, running ids after each step)."""
    ids = [e.add_request(list(range(10 + i, 20 + i)), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
           for i, n in enumerate(lengths)]
    tokens, running = {}, []
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
        running.append([r.request_id for r in e.snapshot().running])
        e.check_invariants()
    return {i: tokens[i] for i in ids}, running


@pytest.mark.parametrize("name", list(POLICIES))
def test_each_policy_is_an_object_of_its_own_named_as_configured(name):
    e = engine(scheduling_policy=name)
    assert type(e.scheduler.policy) is POLICIES[name] and e.scheduler.policy.name == name
    assert make_policy(name) is not make_policy(name)  # a static batch is one engine's, not shared


def test_an_unknown_policy_is_refused_with_the_names_allowed():
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \('fcfs', 'prefill_first', 'static'\)"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        engine(scheduling_policy="lifo")


def test_static_batching_admits_nobody_until_the_whole_batch_has_finished():
    lengths = [2, 9, 3, 4, 2]
    static_tokens, static_running = trace(engine(scheduling_policy="static"), lengths)
    fcfs_tokens, fcfs_running = trace(engine(), lengths)
    assert static_tokens == fcfs_tokens  # the same text, only the timing differs
    # Request 3 (the fourth) may only start once 0, 1 and 2 have all finished.
    first_with_3 = next(i for i, ids in enumerate(static_running) if "3" in ids)
    assert not {"0", "1", "2"} & set(static_running[first_with_3])
    assert all(len(ids) <= 3 for ids in static_running)
    # Continuous batching gives a freed slot away at once: request 3 joins while 1 decodes.
    assert any({"1", "3"} <= set(ids) for ids in fcfs_running)
    assert len(static_running) > len(fcfs_running)  # idle slots cost steps


def test_static_batch_includes_a_request_whose_prompt_is_chunked_over_steps():
    e = engine(scheduling_policy="static", max_num_batched_tokens=8)
    tokens, running = trace(e, [3, 3])
    assert all(len(t) == 3 for t in tokens.values())
    assert ["0", "1"] in running  # both members run together once their prompts are in


def test_the_scheduler_decides_prefill_or_decode_once():
    request = Request("r", [1, 2, 3, 4, 5], SamplingParams())
    first = ScheduledRequest.make(request, 3)
    assert first.is_prefill and not first.samples and first.positions == range(0, 3)
    request.num_computed_tokens = 3
    one_token_chunk = ScheduledRequest.make(request, 1)  # one query over a cached context: the decode kernel
    assert not one_token_chunk.is_prefill and not one_token_chunk.samples
    request.num_computed_tokens = 4
    last = ScheduledRequest.make(request, 1)
    assert not last.is_prefill and last.samples
    assert ScheduledRequest.make(Request("s", [7], SamplingParams()), 1).is_prefill  # nothing cached yet


def test_step_statistics_and_events_read_the_scheduler_records():
    e = engine(max_num_batched_tokens=16)
    seen = []
    e.events.subscribe(lambda ev: seen.append(ev) if isinstance(ev, (RequestScheduled, StepFinished)) else None)
    e.add_request(list(range(60, 66)), SamplingParams(temperature=0, max_tokens=3))
    e.add_request(list(range(30, 50)), SamplingParams(temperature=0, max_tokens=3))  # 20 tokens: chunked
    while e.has_unfinished_requests():
        e.step()
    steps = [ev for ev in seen if isinstance(ev, StepFinished)]
    for step in steps:
        mine = [ev for ev in seen if isinstance(ev, RequestScheduled) and ev.step == step.step]
        assert step.num_prefill_tokens == sum(ev.num_tokens for ev in mine if ev.is_prefill)
        assert step.num_decode_tokens == sum(ev.num_tokens for ev in mine if not ev.is_prefill)
        assert step.num_prefill_tokens + step.num_decode_tokens <= 16
    assert (steps[0].num_prefill_tokens, steps[0].num_decode_tokens) == (16, 0)  # 6 + a 10-token chunk
    assert (steps[1].num_prefill_tokens, steps[1].num_decode_tokens) == (10, 1)  # the chunk's rest beside a decode


def test_scheduling_policy_is_validated():
    with pytest.raises(ValueError, match="scheduling_policy must be one of .*'static'"):
        engine(scheduling_policy="round_robin")


# ------------------------------------------------------- the one stop decision (issue 25 §1.2)
def _request_after(tokens: list[int], **params) -> Request:
    request = Request("r", [5, 6, 7], SamplingParams(**params), eos_token_ids=(2,))
    for t in tokens:
        request.append_output_token(t)
    return request


@pytest.mark.parametrize("tokens, params, stop_string, expected", [
    pytest.param([9, 2], dict(max_tokens=2), None, ("finished_stopped", None), id="EOS on the last allowed token"),
    pytest.param([9, 2], dict(max_tokens=2, ignore_eos=True), None, ("finished_length", None), id="EOS ignored"),
    pytest.param([9, 4], dict(max_tokens=2, stop_token_ids=[4]), None, ("finished_stopped", 4),
                 id="stop token on the last allowed token"),
    pytest.param([9, 4], dict(max_tokens=2), "ab", ("finished_stopped", "ab"), id="stop string on the last allowed token"),
    pytest.param([9, 2], dict(max_tokens=5), "ab", ("finished_stopped", None), id="EOS before a stop string"),
    pytest.param([9, 4], dict(max_tokens=5, stop_token_ids=[4]), "ab", ("finished_stopped", 4),
                 id="stop token before a stop string"),
    pytest.param([9, 4], dict(max_tokens=2), None, ("finished_length", None), id="length"),
    pytest.param([9, 4], dict(max_tokens=5), None, None, id="not finished"),
])
def test_check_stop_states_one_precedence(tokens, params, stop_string, expected):
    decision = check_stop(_request_after(tokens, **params), stop_string, max_model_len=100)
    assert (None if decision is None else (decision[0].value, decision[1])) == expected


def test_check_stop_ends_a_request_at_max_model_len():
    status, reason = check_stop(_request_after([9, 9]), None, max_model_len=5)
    assert (status.value, reason) == ("finished_length", None)


def test_a_stop_string_on_the_last_allowed_token_reports_stop(build_tiny_llm):
    """The issue's bug: the text was cut, but the reason said "length"."""
    llm = build_tiny_llm(dict(device="cpu", max_model_len=64, num_kv_blocks=16, block_size=8))
    decode = llm.engine.decode
    tokens = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].token_ids
    # The last token whose text is new (not in the text before it): a stop string only it completes.
    k = max(i for i in range(len(tokens)) if decode([tokens[i]]).strip()
            and decode([tokens[i]]).strip() not in decode(list(tokens[:i])))
    piece = decode([tokens[k]]).strip()
    greedy = dict(temperature=0.0, max_tokens=k + 1, ignore_eos=True)
    free = llm.generate("Once upon a time", SamplingParams(**greedy))[0]
    out = llm.generate("Once upon a time", SamplingParams(**greedy, stop=[piece]))[0]
    assert out.token_ids == free.token_ids  # it ended on the same, last allowed, token
    assert (out.finish_reason, out.stop_reason) == ("stop", piece)
    assert out.text == free.text[:free.text.index(piece)]
    assert (free.finish_reason, free.stop_reason) == ("length", None)


def test_a_stop_token_reports_its_id_and_the_output_processor_finishes_nothing(build_tiny_llm):
    llm = build_tiny_llm(dict(device="cpu", max_model_len=64, num_kv_blocks=16, block_size=8))
    free = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    stop_id = free.token_ids[2]
    out = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                           stop_token_ids=[stop_id]))[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.token_ids == free.token_ids[:free.token_ids.index(stop_id) + 1]
    assert not hasattr(llm.engine.output_processor, "scheduler")
