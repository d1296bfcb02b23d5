"""Streaming under abort: every way a stream can be cut short ends it cleanly (chapters 2 and 8).

A stream ends early when its consumer closes the generator (or drops it), when someone
calls ``engine.abort`` on its request between steps, or when an event observer aborts it
in the middle of a step (while it is scheduled, prefilling a chunk, preempted or still
waiting). In every case the stream must stop without an error, the request's blocks must
go back to the pool, the invariants must hold, and the other requests in the batch must
produce exactly the tokens they produce alone.
"""

from __future__ import annotations

import gc

import pytest

from nanoengine import LLM, SamplingParams
from nanoengine.events import (BlocksAllocated, RequestFinished, RequestPreempted, RequestQueued,
                               RequestScheduled, StepFinished)

LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
OTHER = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
OTHER_PROMPT = "The other request keeps going"
CONFIG = dict(device="cpu", max_model_len=128, num_kv_blocks=32, block_size=8)
# The event bus turns an observer's exception into a RuntimeWarning; here that is a failure.
pytestmark = [pytest.mark.filterwarnings("error::RuntimeWarning"), pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def make_llm(build_tiny_llm):
    return lambda **overrides: build_tiny_llm({**CONFIG, **overrides})


@pytest.fixture(scope="module")
def other_alone(make_llm) -> tuple[int, ...]:
    """The other request's tokens when it runs by itself."""
    return make_llm().generate([OTHER_PROMPT], OTHER)[0].token_ids


class Watcher:
    """Records what the engine reports (observers only read) and any observer failure."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.events: list = []
        self.queued: list[str] = []
        llm.engine.events.subscribe(self.events.append)
        llm.engine.events.subscribe(lambda e: self.queued.append(e.request_id) if isinstance(e, RequestQueued)
                                    else None)

    def finished(self, request_id: str) -> list[str]:
        return [e.finish_reason for e in self.events if isinstance(e, RequestFinished) and e.request_id == request_id]


def _llm(make_llm, **overrides) -> tuple[LLM, Watcher]:
    llm = make_llm(**overrides)
    return llm, Watcher(llm)


def _finish_other(llm: LLM, other_id: str) -> tuple[int, ...]:
    """Run the engine until the other request is done; returns its tokens."""
    result = None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            llm.engine.check_invariants()
            if out.request_id == other_id and out.finished:
                result = out.token_ids
    assert result is not None, "the other request never finished"
    return result


def _assert_clean(llm: LLM) -> None:
    llm.engine.check_invariants()
    snap = llm.engine.snapshot()
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert snap.num_free_blocks == snap.num_blocks, "blocks leaked"


def test_closing_the_stream_aborts_it_and_spares_the_other_request(make_llm, other_alone):
    llm, watch = _llm(make_llm)
    other = llm.engine.add_request(OTHER_PROMPT, OTHER, request_id="other")
    stream = llm.stream("Tell me a long story", LONG)
    deltas = [next(stream) for _ in range(3)]
    stream_id = watch.queued[-1]
    stream.close()
    assert all(deltas)
    assert watch.finished(stream_id) == ["abort"]
    assert stream_id not in llm.engine.requests
    held = {b for r in llm.engine.snapshot().running for b in r.block_ids}
    assert llm.engine.snapshot().num_free_blocks == CONFIG["num_kv_blocks"] - len(held)  # only `other` holds blocks
    assert _finish_other(llm, other) == other_alone
    _assert_clean(llm)


@pytest.mark.slow
def test_dropping_an_unfinished_stream_aborts_it(make_llm):
    llm, watch = _llm(make_llm)
    stream = llm.stream("Tell me a long story", LONG)
    next(stream)
    stream_id = watch.queued[-1]
    del stream
    gc.collect()  # the generator's finalizer closes it
    assert watch.finished(stream_id) == ["abort"]
    _assert_clean(llm)


def test_engine_abort_between_steps_ends_the_stream_without_another_step(make_llm, other_alone):
    llm, watch = _llm(make_llm)
    other = llm.engine.add_request(OTHER_PROMPT, OTHER, request_id="other")
    stream = llm.stream("Tell me a long story", LONG)
    next(stream)
    stream_id = watch.queued[-1]
    out = llm.engine.abort(stream_id)
    assert out.finished and out.finish_reason == "abort"
    steps = llm.engine.step_count
    assert list(stream) == []  # ends at once (it used to step forever waiting for the request)
    assert llm.engine.step_count == steps
    assert watch.finished(stream_id) == ["abort"]
    assert _finish_other(llm, other) == other_alone
    _assert_clean(llm)


def _abort_when(llm: LLM, watch: Watcher, predicate) -> list[str]:
    """Subscribe an observer that aborts the streamed request the first time ``predicate(event)``."""
    fired: list[str] = []

    def observer(event) -> None:
        stream_id = next((q for q in watch.queued if q != "other"), None)
        if not fired and stream_id in llm.engine.requests and predicate(event, stream_id):
            fired.append(stream_id)
            assert llm.engine.abort(stream_id) is None  # mid-step: takes effect when the step ends

    llm.engine.events.subscribe(observer)
    return fired


MID_STEP_ABORTS = {
    # the stream's request was just scheduled for a decode
    "scheduled": lambda e, sid: isinstance(e, RequestScheduled) and e.request_id == sid and not e.is_prefill,
    # it got a new block (the model has not run yet)
    "blocks allocated": lambda e, sid: isinstance(e, BlocksAllocated) and e.request_id == sid and e.step > 2,
    # the other request finished inside the update loop, before the stream's output is built
    "other finished": lambda e, sid: isinstance(e, RequestFinished) and e.request_id == "other",
    # at the very end of a step
    "step finished": lambda e, sid: isinstance(e, StepFinished) and e.step == 3,
}


@pytest.mark.parametrize("when", sorted(MID_STEP_ABORTS))
def test_abort_from_an_observer_mid_step_ends_the_stream(make_llm, other_alone, when):
    llm, watch = _llm(make_llm)
    other = llm.engine.add_request(OTHER_PROMPT, OTHER, request_id="other")
    fired = _abort_when(llm, watch, MID_STEP_ABORTS[when])
    deltas = list(llm.stream("Tell me a long story", LONG))
    assert fired, "the observer never fired"
    stream_id = fired[0]
    assert watch.finished(stream_id) == ["abort"]
    assert len(deltas) < LONG.max_tokens
    if llm.engine.has_unfinished_requests():
        assert _finish_other(llm, other) == other_alone
    else:  # it finished while the stream stepped the engine: its final output waits in the router
        assert llm.router.wait(other).token_ids == other_alone
    _assert_clean(llm)


def test_abort_from_an_observer_during_a_chunked_prefill(make_llm):
    llm, watch = _llm(make_llm, max_num_batched_tokens=8)
    fired = _abort_when(llm, watch, lambda e, sid: isinstance(e, RequestScheduled) and e.request_id == sid
                        and e.is_prefill and e.num_computed_tokens > 0)
    assert list(llm.stream("word " * 40, LONG)) == []  # aborted before its first token
    assert fired and watch.finished(fired[0]) == ["abort"]
    _assert_clean(llm)


def test_abort_from_an_observer_while_the_stream_waits_for_a_slot(make_llm, other_alone):
    llm, watch = _llm(make_llm, max_num_seqs=1)
    other = llm.engine.add_request(OTHER_PROMPT, OTHER, request_id="other")
    fired = _abort_when(llm, watch, lambda e, sid: isinstance(e, StepFinished) and e.step == 2)
    assert list(llm.stream("Tell me a long story", LONG)) == []
    assert fired and watch.finished(fired[0]) == ["abort"]
    assert _finish_other(llm, other) == other_alone
    _assert_clean(llm)


def test_abort_from_an_observer_when_the_stream_is_preempted(make_llm):
    # Two requests that cannot both fit: the newer one (the stream) is preempted.
    llm, watch = _llm(make_llm, max_model_len=64, num_kv_blocks=8, block_size=8)
    llm.engine.add_request("word " * 30, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                           request_id="other")
    fired = _abort_when(llm, watch, lambda e, sid: isinstance(e, RequestPreempted) and e.request_id == sid)
    list(llm.stream("text " * 20, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)))
    assert fired, "the stream was never preempted"
    assert watch.finished(fired[0]) == ["abort"]
    llm.engine.check_invariants()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    _assert_clean(llm)


def test_generate_returns_an_observer_aborted_request_as_aborted(make_llm, other_alone):
    llm, watch = _llm(make_llm)
    fired = []

    def observer(event) -> None:
        if isinstance(event, StepFinished) and event.step == 2 and not fired:
            fired.append(llm.engine.abort(watch.queued[0]))

    llm.engine.events.subscribe(observer)
    outs = llm.generate(["Tell me a long story", OTHER_PROMPT], [LONG, OTHER])
    assert fired == [None]
    assert outs[0].finished and outs[0].finish_reason == "abort" and len(outs[0].token_ids) < LONG.max_tokens
    assert outs[1].finish_reason == "length" and outs[1].token_ids == other_alone
    _assert_clean(llm)
