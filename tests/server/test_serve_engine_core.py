"""The engine core in a process of its own (nanoengine.entrypoints.openai.engine_core): the
client has the async engine's interface, outputs come back over a pipe, errors and deaths
of the core reach every caller.

A tiny random Llama saved to disk (the core loads it in its own process), token-id prompts,
no HTTP; test_serve_cli serves through it end to end."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import types

import pytest

from nanoengine import LLMEngine, SamplingParams
from nanoengine.entrypoints.openai.async_engine import EngineDeadError, QueueFullError
from nanoengine.backends.cpu_platform import ENGINE_CORE_SPINCOUNT
from nanoengine.entrypoints.openai.engine_core import EngineCoreClient

pytestmark = pytest.mark.slow  # each test spawns the core's process (python and torch load in ~2 s)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
SETTINGS = dict(device="cpu", num_kv_blocks=256, block_size=4, max_model_len=1024, max_num_seqs=4)


def build(path, **settings) -> functools.partial:
    return functools.partial(LLMEngine.from_pretrained, str(path), **{**SETTINGS, **settings})


def failing_on_step(path) -> LLMEngine:
    """An engine whose third step raises (a device error, say): built in the core's process."""
    engine = LLMEngine.from_pretrained(str(path), **SETTINGS)
    real_step, steps = engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("the device fell over")
        return real_step()

    engine.step = step
    return engine


def num_free_blocks(engine: LLMEngine) -> int:
    return engine.block_manager.num_free_blocks


def openmp_settings(engine: LLMEngine) -> tuple:
    return os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY")


def run(coroutine_fn, client: EngineCoreClient):
    """Run ``coroutine_fn(client)`` on a fresh event loop with the client started; always
    shut the core down (bounded: 60 s)."""
    async def main():
        client.start()
        try:
            return await asyncio.wait_for(coroutine_fn(client), 60)
        finally:
            client.shutdown()
            assert not client.is_running and not client._process.is_alive()
            assert client._conn.closed  # its end of the pipe is not left to the garbage collector

    return asyncio.run(main())


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    """The tokens the engine alone generates for the prompts these tests send."""
    alone = build(tiny_llama_dir)()
    alone.add_request([5, 6, 7], GREEDY, request_id="a")
    alone.add_request([9, 8], GREEDY, request_id="b")
    tokens = {}
    while alone.has_unfinished_requests():
        tokens.update({out.request_id: out.token_ids for out in alone.step() if out.finished})
    return tokens


def test_outputs_come_back_in_order_and_match_the_engine_alone(tiny_llama_dir, expected):
    client = EngineCoreClient(build(tiny_llama_dir))
    assert client.max_model_len == 1024 and client.num_blocks == 256 and client.config.block_size == 4
    finished = []
    client.on_finished = finished.append

    async def scenario(core: EngineCoreClient):
        one = await core.add_requests([("a", [5, 6, 7], GREEDY)])
        two = await core.add_requests([("b", [9, 8], GREEDY)])
        outs_a = [out async for out in one]
        outs_b = [out async for out in two]
        return outs_a, outs_b, one.finished and two.finished

    outs_a, outs_b, done = run(scenario, client)
    assert done and [len(o.token_ids) for o in outs_a] == list(range(1, 7))  # one output per step
    assert outs_a[-1].token_ids == expected["a"] and outs_b[-1].token_ids == expected["b"]
    assert sorted(out.request_id for out in finished) == ["a", "b"]
    assert client.stats.num_running == 0 and client.stats.num_steps >= 6


def test_refused_requests_add_nothing_and_later_ones_still_run(tiny_llama_dir, expected):
    client = EngineCoreClient(build(tiny_llama_dir), max_waiting=2)

    async def scenario(core: EngineCoreClient):
        with pytest.raises(ValueError, match="prompt token ids"):
            await core.add_requests([("ok", [1, 2], GREEDY), ("bad", [1, 10**6], GREEDY)])
        with pytest.raises(ValueError, match="at most 2"):
            await core.add_requests([(f"r{i}", [1, 2], GREEDY) for i in range(3)])
        assert core._streams == {}  # the refused requests' queues are gone
        with pytest.raises(ValueError, match="unique"):
            await core.add_requests([("twice", [1, 2], GREEDY), ("twice", [3, 4], GREEDY)])
        cancelled = asyncio.ensure_future(core.add_requests([("gone", [1, 2], LONG)]))
        await asyncio.sleep(0)  # sent to the core; the caller goes away before the reply
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert "gone" not in core._streams
        stream = await core.add_requests([("a", [5, 6, 7], GREEDY)])
        tokens = [out async for out in stream][-1].token_ids
        while core.stats.num_running or core.stats.num_waiting:  # the cancelled add was aborted in the core
            await asyncio.sleep(0.05)
        return tokens

    assert run(scenario, client) == expected["a"]


def test_the_queue_limit_refuses_what_would_wait_beyond_it(tiny_llama_dir):
    client = EngineCoreClient(build(tiny_llama_dir, max_num_seqs=1), max_waiting=1)

    async def scenario(core: EngineCoreClient):
        running = await core.add_requests([("running", [1, 2], LONG)])
        await running.__anext__()  # admitted: it runs, it no longer waits
        waiting = await core.add_requests([("waiting", [3, 4], LONG)])
        with pytest.raises(QueueFullError, match="1 requests are already waiting"):
            await core.add_requests([("refused", [5, 6], GREEDY)])
        running.abort()
        waiting.abort()

    run(scenario, client)


def test_abort_frees_the_blocks_and_call_runs_a_function_in_the_core(tiny_llama_dir, monkeypatch):
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):  # scripts/test.sh sets a policy: a user's choice, kept
        monkeypatch.delenv(name, raising=False)
    client = EngineCoreClient(build(tiny_llama_dir))

    async def scenario(core: EngineCoreClient):
        free_before = await asyncio.wrap_future(core.call(num_free_blocks))
        # the core's OpenMP threads sleep sooner than an engine's alone (engine_core's docstring)
        assert await asyncio.wrap_future(core.call(openmp_settings)) == (str(ENGINE_CORE_SPINCOUNT), None)
        stream = await core.add_requests([("long", list(range(1, 40)), LONG)])
        await stream.__anext__()
        assert await asyncio.wrap_future(core.call(num_free_blocks)) < free_before
        stream.abort()
        with pytest.raises(TypeError, match="module-level function"):
            core.call(lambda engine: engine.step_count)
        only_here = types.ModuleType("only_in_the_server_process")  # pickles here, cannot be imported there
        exec("def peek(engine):\n    return engine.step_count", only_here.__dict__)
        monkeypatch.setitem(sys.modules, only_here.__name__, only_here)
        with pytest.raises(ModuleNotFoundError, match="only_in_the_server_process"):
            await asyncio.wrap_future(core.call(only_here.peek))
        while True:  # the aborted final output is routed like any other, then nothing stays behind
            out = await asyncio.wait_for(stream._queue.get(), 30)
            if out.finished:
                break
        assert out.outputs[0].finish_reason == "abort"
        return free_before, await asyncio.wrap_future(core.call(num_free_blocks))

    free_before, free_after = run(scenario, client)
    assert free_after == free_before and "GOMP_SPINCOUNT" not in os.environ


def test_shutdown_ends_the_streams_in_flight_with_an_error(tiny_llama_dir):
    client = EngineCoreClient(build(tiny_llama_dir))
    finished = []
    client.on_finished = finished.append

    async def scenario(core: EngineCoreClient):
        stream = await core.add_requests([("long", [1, 2, 3], LONG)])
        await stream.__anext__()
        core.shutdown()
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await core.add_requests([("late", [1, 2], GREEDY)])

    run(scenario, client)
    assert [out.request_id for out in finished] == ["long"] and finished[0].finished


def test_a_failing_step_fails_every_request_and_the_core_stops(tiny_llama_dir):
    client = EngineCoreClient(functools.partial(failing_on_step, tiny_llama_dir))

    async def scenario(core: EngineCoreClient):
        stream = await core.add_requests([("a", [1, 2, 3], LONG)])
        with pytest.raises(EngineDeadError, match="the device fell over"):
            async for _ in stream:
                pass
        assert not core.is_running
        with pytest.raises(EngineDeadError, match="the device fell over"):
            await core.add_requests([("b", [1, 2], GREEDY)])

    run(scenario, client)


def test_a_killed_core_is_noticed_and_every_stream_ends(tiny_llama_dir):
    client = EngineCoreClient(build(tiny_llama_dir))

    async def scenario(core: EngineCoreClient):
        stream = await core.add_requests([("a", [1, 2, 3], LONG)])
        await stream.__anext__()
        os.kill(core._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited unexpectedly"):
            async for _ in stream:
                pass
        assert not core.is_running

    run(scenario, client)


def test_the_core_keeps_the_openmp_settings_a_user_chose(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    client = EngineCoreClient(build(tiny_llama_dir))

    async def scenario(core: EngineCoreClient):
        return await asyncio.wrap_future(core.call(openmp_settings))

    assert run(scenario, client) == (None, "PASSIVE")
    assert "GOMP_SPINCOUNT" not in os.environ  # set only for the core's start, never here


def test_a_core_that_cannot_build_its_engine_raises_the_reason_here(tmp_path):
    with pytest.raises(ValueError, match="nowhere' is neither"):
        EngineCoreClient(functools.partial(LLMEngine.from_pretrained, str(tmp_path / "nowhere")))
