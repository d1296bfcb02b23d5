"""The output router (issue 25 §1.1): readers sharing an LLM each get every one of their outputs.

Each test compares a request's text (or tokens) when it shares the engine with another
reader to its text when it runs alone: greedy decoding over the same weights must give
the same tokens whatever else is in the batch, so any lost output shows as a difference.
"""

from __future__ import annotations

import pytest

from nanoengine import SamplingParams
from nanoengine.engine.output_router import OutputRouter
from nanoengine.sampling_params import RequestOutputKind

CONFIG = dict(device="cpu", max_model_len=128, num_kv_blocks=48, block_size=8)
STREAMED = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
OTHER = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest


@pytest.fixture(scope="module")
def make_llm(build_tiny_llm):
    return lambda: build_tiny_llm(CONFIG)


@pytest.fixture(scope="module")
def alone(make_llm) -> dict[str, str]:
    """Each prompt's text when it runs by itself."""
    llm = make_llm()
    return {p: llm.generate(p, params)[0].text
            for p, params in (("Once upon a time", STREAMED), ("The weather today", STREAMED),
                              ("A list of fruits", OTHER))}


def _assert_clean(llm) -> None:
    llm.engine.check_invariants()
    snap = llm.engine.snapshot()
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert snap.num_free_blocks == snap.num_blocks, "blocks leaked"
    assert llm.router.num_unread == 0


def test_generate_during_an_open_stream_loses_none_of_the_streams_deltas(make_llm, alone):
    llm = make_llm()
    stream = llm.stream("Once upon a time", STREAMED)
    deltas = [next(stream), next(stream)]
    (other,) = llm.generate(["A list of fruits"], OTHER)  # steps the engine many times meanwhile
    deltas += list(stream)
    assert other.text == alone["A list of fruits"] and other.finish_reason == "length"
    assert "".join(deltas) == alone["Once upon a time"]
    _assert_clean(llm)


def test_two_streams_read_alternately_each_get_all_their_text(make_llm, alone):
    llm = make_llm()
    a, b = llm.stream("Once upon a time", STREAMED), llm.stream("The weather today", STREAMED)
    texts = {"a": [], "b": []}
    open_streams = {"a": a, "b": b}
    while open_streams:
        for name, stream in list(open_streams.items()):
            delta = next(stream, None)
            if delta is None:
                del open_streams[name]
            else:
                texts[name].append(delta)
    assert "".join(texts["a"]) == alone["Once upon a time"]
    assert "".join(texts["b"]) == alone["The weather today"]
    _assert_clean(llm)


def test_a_request_added_to_the_engine_during_a_stream_gets_its_final_output(make_llm, alone):
    llm = make_llm()
    stream = llm.stream("Once upon a time", STREAMED)
    next(stream)
    request_id = llm.engine.add_request("A list of fruits", OTHER)  # behind the LLM's back
    assert "".join(stream)  # the stream runs to its end, finishing the other request on the way
    final = llm.router.wait(request_id)
    assert final is not None and final.finished and final.text == alone["A list of fruits"]
    assert llm.router.wait(request_id) is None  # read once; the router keeps nothing after
    _assert_clean(llm)


def test_every_output_of_an_unwatched_request_is_kept_in_order(make_llm, alone):
    llm = make_llm()
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    request_id = llm.engine.add_request("A list of fruits", params)
    list(llm.stream("Once upon a time", STREAMED))
    pieces = []
    while (out := llm.router.next_output(request_id)) is not None:
        pieces.append(out)
    assert sum(len(p.token_ids) for p in pieces) == 7 and pieces[-1].finished
    assert "".join(p.text for p in pieces) == alone["A list of fruits"]
    _assert_clean(llm)


def test_a_sink_receives_outputs_and_a_released_request_keeps_running(make_llm):
    llm = make_llm()
    router = OutputRouter(llm.engine)
    got = []
    watched = llm.engine.add_request("Once upon a time", STREAMED)
    router.watch(watched, sink=got.append)
    dropped = llm.engine.add_request("A list of fruits", OTHER)
    router.watch(dropped)
    router.step()
    router.release(dropped)  # nobody reads it any more, but it is not aborted
    while llm.engine.has_unfinished_requests():
        router.step()
    assert len(got) == STREAMED.max_tokens and got[-1].finished and got[-1].request_id == watched
    assert router.pop(dropped) is None and router.num_unread == 0 and router.num_held == 0
    with pytest.raises(TypeError, match="sink must be a function"):
        router.watch("x", sink="not callable")


def test_engine_abort_between_steps_ends_next_output(make_llm):
    llm = make_llm()
    request_id = llm.engine.add_request("Once upon a time", STREAMED)
    llm.router.watch(request_id)
    assert llm.router.next_output(request_id) is not None
    final = llm.engine.abort(request_id)  # the caller of abort gets the final output
    assert final.finish_reason == "abort"
    steps = llm.engine.step_count
    assert llm.router.next_output(request_id) is None and llm.engine.step_count == steps
    _assert_clean(llm)


def test_close_hands_back_the_waiting_sinks_and_holds_nothing_after(make_llm):
    llm = make_llm()
    router = OutputRouter(llm.engine)
    sunk, queued, released = (llm.engine.add_request(p, STREAMED) for p in ("a", "b", "c"))
    sink = [].append
    router.watch(sunk, sink=sink)
    router.watch(queued)
    router.step()
    router.release(released)
    assert router.num_held == 3 and router.num_unread == 1
    assert router.close() == {sunk: sink}
    assert router.num_held == 0 and router.num_unread == 0
    for request_id in (sunk, queued, released):  # the requests themselves still run: the owner aborts them
        llm.engine.abort(request_id)
    _assert_clean(llm)
