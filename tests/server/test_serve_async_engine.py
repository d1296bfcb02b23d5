"""The async engine (nanoengine.entrypoints.openai.async_engine): one thread owns the engine,
asyncio callers add and abort through commands, outputs come back on per-request queues.

A tiny random model (mechanics only), token-id prompts, no HTTP."""

from __future__ import annotations

import argparse
import os
import asyncio
import sys
import threading
import time

import pytest

from nanoengine import LLMEngine, SamplingParams
from nanoengine.backends.cpu_platform import build_on_a_passing_thread
from nanoengine.entrypoints.openai.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from nanoengine.loader.weights import random_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)


def tiny(**config) -> LLMEngine:
    settings = {**dict(device="cpu", num_kv_blocks=256, block_size=4, max_model_len=1024, max_num_seqs=4), **config}
    return LLMEngine.from_model(random_model("tiny-llama", seed=0, std=0.08), None, **settings)


def run(coroutine_fn, engine: LLMEngine, **options):
    """Run ``coroutine_fn(async_engine)`` on a fresh event loop with the engine thread
    started, and always stop the thread (bounded: 60 s)."""
    async def main():
        async_engine = AsyncLLMEngine(engine, **options)
        async_engine.start()
        try:
            return await asyncio.wait_for(coroutine_fn(async_engine), 60)
        finally:
            async_engine.shutdown()
            assert not async_engine.is_running

    return asyncio.run(main())


def test_outputs_stream_back_in_order_and_match_the_engine_alone():
    alone = tiny()
    alone.add_request([5, 6, 7], GREEDY, request_id="a")
    expected = None
    while alone.has_unfinished_requests():
        expected = alone.step()[0].token_ids

    async def scenario(ae: AsyncLLMEngine):
        stream = await ae.add_requests([("a", [5, 6, 7], GREEDY)])
        outs = [out async for out in stream]
        return outs, stream.finished

    outs, finished = run(scenario, tiny())
    assert [len(o.token_ids) for o in outs] == list(range(1, 7)) and finished  # one output per step
    assert outs[-1].finished and outs[-1].token_ids == expected


def test_several_prompts_share_one_stream_each_with_its_own_params():
    async def scenario(ae: AsyncLLMEngine):
        two, four = (SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 4))
        stream = await ae.add_requests([("r-0", [1, 2], two), ("r-1", [3, 4, 5, 6], four)])
        return {o.request_id: len(o.token_ids) async for o in stream if o.finished}

    assert run(scenario, tiny()) == {"r-0": 2, "r-1": 4}


def test_a_bad_prompt_adds_nothing_and_later_requests_still_run():
    engine = tiny()

    async def scenario(ae: AsyncLLMEngine):
        with pytest.raises(ValueError, match="prompt token ids"):
            await ae.add_requests([("ok", [1, 2], GREEDY), ("bad", [1, 10**6], GREEDY)])
        with pytest.raises(ValueError, match="max_model_len is 1024"):
            await ae.add_requests([("long", [1] * 1025, GREEDY)])
        assert await asyncio.wrap_future(ae.call(lambda e: e.has_unfinished_requests())) is False
        stream = await ae.add_requests([("ok", [1, 2], GREEDY)])  # the id is free again: nothing was left
        return [o async for o in stream][-1]

    assert run(scenario, engine).finish_reason == "length"


def test_abort_frees_the_blocks_between_two_steps():
    engine = tiny()
    free_at_start = engine.block_manager.num_free_blocks

    async def scenario(ae: AsyncLLMEngine):
        stream = await ae.add_requests([("long", list(range(1, 30)), LONG)])
        first = await stream.__anext__()
        held = await asyncio.wrap_future(ae.call(lambda e: e.block_manager.num_free_blocks))
        stream.abort()
        stream.abort()  # twice is harmless
        state = await asyncio.wrap_future(ae.call(lambda e: (e.has_request("long"), e.block_manager.num_free_blocks)))
        return first, held, state

    first, held, (still_there, free_after) = run(scenario, engine)
    assert len(first.token_ids) == 1 and held < free_at_start
    assert not still_there and free_after == free_at_start
    engine.check_invariants()


def test_the_queue_limit_refuses_what_would_wait_beyond_it():
    async def scenario(ae: AsyncLLMEngine):
        running = await ae.add_requests([("run", [1, 2, 3], LONG)])
        await running.__anext__()  # it holds the only seat now
        waiting = [await ae.add_requests([(f"w{i}", [4, 5], GREEDY)]) for i in range(2)]
        with pytest.raises(QueueFullError, match="2 requests are already waiting"):
            await ae.add_requests([("w2", [4, 5], GREEDY)])
        with pytest.raises(QueueFullError):  # two more at once would leave 3 waiting
            await ae.add_requests([("x0", [4], GREEDY), ("x1", [4], GREEDY)])
        stats = await asyncio.wrap_future(ae.call(lambda e: (len(e.scheduler.waiting), e.has_request("x0"))))
        running.abort()
        finished = [[o async for o in s][-1].finish_reason for s in waiting]
        return stats, finished

    (num_waiting, x0_added), finished = run(scenario, tiny(max_num_seqs=1), max_waiting=2)
    assert num_waiting == 2 and not x0_added and finished == ["length", "length"]


def _thread_cpu_seconds(native_id: int) -> float:
    import psutil

    thread = next(t for t in psutil.Process().threads() if t.id == native_id)
    return thread.user_time + thread.system_time


@pytest.mark.slow
def test_the_thread_sleeps_when_idle_and_publishes_stats():
    engine = tiny()

    async def scenario(ae: AsyncLLMEngine):
        stream = await ae.add_requests([("a", [1, 2, 3], GREEDY)])
        [_ async for _ in stream]
        await asyncio.sleep(0.05)
        steps, cpu = ae.stats.num_steps, _thread_cpu_seconds(ae._thread.native_id)
        await asyncio.sleep(0.5)  # idle: the thread waits on its condition; no step, no spinning
        return steps, ae.stats, _thread_cpu_seconds(ae._thread.native_id) - cpu

    steps, stats, idle_cpu = run(scenario, engine)
    assert steps == stats.num_steps == 6 and stats.num_running == stats.num_waiting == 0
    assert idle_cpu < 0.05, f"the idle engine thread used {idle_cpu:.3f} s of CPU in 0.5 s"
    assert stats.num_free_kv_blocks == stats.num_kv_blocks == 256
    assert not any(t.name == "nanoengine-engine" for t in threading.enumerate())  # stopped by shutdown


def test_shutdown_aborts_what_is_running_and_ends_its_stream_with_an_error():
    engine = tiny()
    finals = []

    dead = []

    async def main():
        ae = AsyncLLMEngine(engine, on_finished=finals.append, on_dead=lambda: dead.append(1))
        ae.start()
        stream = await ae.add_requests([("long", [1, 2, 3], LONG)])
        await stream.__anext__()
        ae.shutdown()
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await ae.add_requests([("late", [1], GREEDY)])
        with pytest.raises(EngineDeadError):
            ae.call(lambda e: None).result(1)

    asyncio.run(asyncio.wait_for(main(), 60))
    assert [f.finish_reason for f in finals] == ["abort"]
    assert engine.block_manager.num_free_blocks == 256 and not engine.has_unfinished_requests()  # the caller's again
    assert not dead  # a shutdown is not a death: the server does not exit with an error


def test_a_failing_step_fails_every_request_and_stops_the_thread():
    engine = tiny()

    def broken_step():
        raise RuntimeError("device lost")

    dead = []

    async def main():
        ae = AsyncLLMEngine(engine, on_dead=lambda: dead.append(ae.error))
        ae.start()
        engine.step = broken_step  # the next step fails (set before any request exists)
        stream = await ae.add_requests([("a", [1, 2, 3], GREEDY)])
        with pytest.raises(EngineDeadError, match="device lost"):
            await stream.__anext__()
        for _ in range(100):
            if not ae.is_running:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError, match="device lost"):
            await ae.add_requests([("b", [1], GREEDY)])
        return ae

    ae = asyncio.run(asyncio.wait_for(main(), 60))
    assert not ae.is_running and isinstance(ae.error, RuntimeError)
    assert not engine.has_unfinished_requests()  # aborted on the way out
    assert dead == [ae.error]  # told once, on the event loop: the command-line server then exits


@pytest.mark.parametrize("engine_thread", [False, True])
def test_serve_exits_with_status_1_when_its_engine_has_failed(monkeypatch, tiny_llama_tok_dir, engine_thread):
    from types import SimpleNamespace

    from nanoengine.backends import cpu_platform
    from nanoengine.entrypoints.openai import api_server
    from nanoengine.entrypoints.openai.cli_args import add_arguments

    engine = SimpleNamespace(max_model_len=8, num_blocks=1, shutdown=lambda: None, error=RuntimeError("device lost"))
    monkeypatch.setattr(api_server.LLMEngine, "from_pretrained", lambda *a, **k: engine)
    monkeypatch.setattr(api_server, "EngineCoreClient", lambda build: build())
    monkeypatch.setattr(api_server, "build_app",
                        lambda engine, *a, **k: SimpleNamespace(state=SimpleNamespace(engine=engine)))
    monkeypatch.setattr(cpu_platform.os, "nice", lambda increment: None)
    monkeypatch.setattr(sys, "setswitchinterval", lambda seconds: None)
    monkeypatch.setattr(api_server, "run_server", lambda *a, **k: None)  # served until the engine failed
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as exited:
        api_server.serve_from_args(parser.parse_args(["--model", str(tiny_llama_tok_dir), "--port", "0"]
                                                     + ["--engine-thread"] * engine_thread))
    assert exited.value.code == 1


def test_a_caller_cancelled_while_adding_leaves_nothing_behind():
    engine = tiny()

    async def scenario(ae: AsyncLLMEngine):
        slow = await ae.add_requests([("slow", list(range(1, 60)), LONG)])  # keeps the thread stepping
        task = asyncio.ensure_future(ae.add_requests([("gone", [1, 2], LONG)]))
        await asyncio.sleep(0)  # the add is submitted
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        slow.abort()
        deadline = time.monotonic() + 10
        while await asyncio.wrap_future(ae.call(lambda e: e.has_unfinished_requests())):
            assert time.monotonic() < deadline, "the cancelled add was not undone"
            await asyncio.sleep(0.01)
        return True

    assert run(scenario, engine)


def test_bad_settings_and_a_second_start_are_refused():
    with pytest.raises(ValueError, match="max_waiting"):
        AsyncLLMEngine(tiny(), max_waiting=0)

    async def main():
        ae = AsyncLLMEngine(tiny())
        ae.start()
        try:
            with pytest.raises(RuntimeError, match="already started"):
                ae.start()
        finally:
            ae.shutdown()

    asyncio.run(main())
    with pytest.raises(EngineDeadError, match="not been started"):
        AsyncLLMEngine(tiny()).call(lambda e: None).result(1)


def test_the_router_holds_nothing_after_finished_aborted_refused_and_parallel_requests():
    """Every request the engine thread routes leaves the router once it ends, however it
    ends: finished, aborted mid-stream, refused at add, or with n > 1 completions (routed
    by the one user request id)."""
    engine = tiny()
    parallel = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=4, ignore_eos=True)

    async def scenario(ae: AsyncLLMEngine):
        held = lambda: asyncio.wrap_future(ae.call(lambda e: ae.router.num_held))
        for i in range(4):
            finished = await ae.add_requests([(f"done-{i}", [1, 2, 3], GREEDY)])
            outs = [o async for o in finished]
            assert outs[-1].finished and len(outs[-1].outputs) == 1
            aborted = await ae.add_requests([(f"gone-{i}", [4, 5], LONG)])
            await aborted.__anext__()
            assert await held() == 1
            aborted.abort()
            with pytest.raises(ValueError):
                await ae.add_requests([(f"ok-{i}", [1, 2], GREEDY), (f"bad-{i}", [1, 10**6], GREEDY)])
        fanned = await ae.add_requests([("pair", [6, 7, 8], parallel)])
        outs = [o async for o in fanned]
        assert {o.request_id for o in outs} == {"pair"} and outs[-1].finished
        assert [len(c.token_ids) for c in outs[-1].outputs] == [4, 4]
        deadline = time.monotonic() + 10
        while await asyncio.wrap_future(ae.call(lambda e: e.has_unfinished_requests())):
            assert time.monotonic() < deadline, "the aborts were not applied"
            await asyncio.sleep(0.01)
        return await held()

    assert run(scenario, engine) == 0


def test_build_on_a_passing_thread_returns_what_the_thread_built_and_lets_it_end():
    seen = {}

    def build():
        seen["thread"] = threading.current_thread()
        return ["built"]

    assert build_on_a_passing_thread(build) == ["built"]
    assert seen["thread"] is not threading.current_thread() and not seen["thread"].is_alive()


def test_build_on_a_passing_thread_raises_the_builders_error_here():
    def build():
        raise FileNotFoundError("no such model: /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        build_on_a_passing_thread(build)


def test_serve_loads_the_model_on_a_thread_that_ends(monkeypatch, tiny_llama_tok_dir):
    from nanoengine.entrypoints.openai import api_server
    from nanoengine.entrypoints.openai.cli_args import add_arguments

    loaded_on = []

    def from_pretrained(*args, **kwargs):
        loaded_on.append(threading.current_thread())
        raise RuntimeError("stop here: the test only asks where the model loads")

    monkeypatch.setattr(api_server.LLMEngine, "from_pretrained", from_pretrained)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_llama_tok_dir), "--port", "0", "--engine-thread"])
    with pytest.raises(RuntimeError, match="stop here"):
        api_server.serve_from_args(args)
    assert loaded_on and loaded_on[0] is not threading.main_thread() and not loaded_on[0].is_alive()


@pytest.mark.parametrize("engine_thread", [True, False])
def test_serve_sets_the_gil_interval_with_an_engine_thread_and_a_lower_priority_with_an_engine_core(
        monkeypatch, tiny_llama_tok_dir, engine_thread):
    from types import SimpleNamespace

    from nanoengine.backends import cpu_platform
    from nanoengine.entrypoints.openai import api_server
    from nanoengine.entrypoints.openai.cli_args import add_arguments

    seen = []
    engine = SimpleNamespace(max_model_len=8, num_blocks=1, shutdown=lambda: seen.append("shutdown"), error=None)
    monkeypatch.setattr(api_server.LLMEngine, "from_pretrained", lambda *a, **k: engine)
    monkeypatch.setattr(api_server, "EngineCoreClient", lambda build: build())  # no process: the test's engine
    monkeypatch.setattr(api_server, "build_app",
                        lambda engine, *a, **k: SimpleNamespace(state=SimpleNamespace(engine=engine)))
    monkeypatch.setattr(sys, "setswitchinterval", lambda seconds: seen.append(("set", seconds)))
    monkeypatch.setattr(cpu_platform.os, "nice", lambda increment: seen.append(("nice", increment)))
    monkeypatch.setattr(api_server, "run_server", lambda *a, **k: seen.append("served"))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    api_server.serve_from_args(parser.parse_args(["--model", str(tiny_llama_tok_dir), "--port", "0"]
                                                 + ["--engine-thread"] * engine_thread))
    # the GIL's interval when the engine shares the process; a lower priority when it has its own
    expected = [("set", 0.001)] if engine_thread else [("nice", cpu_platform.FRONT_END_NICENESS)]
    assert seen == expected + ["served", "shutdown"]
    assert api_server.GIL_SWITCH_INTERVAL_S == 0.001 and cpu_platform.FRONT_END_NICENESS == 5


@pytest.mark.parametrize("own_budget", [None, "2"])
def test_serve_passes_enforce_eager_and_waits_for_all_the_huge_pages_unless_told(monkeypatch, tiny_llama_tok_dir,
                                                                                 own_budget):
    from nanoengine.backends import cpu_platform
    from nanoengine.entrypoints.openai import api_server
    from nanoengine.entrypoints.openai.cli_args import add_arguments

    variable = cpu_platform.MOVE_BUDGET_VARIABLE
    monkeypatch.setenv(variable, "undo me")  # recorded, so that whatever serve sets is undone after the test
    monkeypatch.delenv(variable)
    if own_budget is not None:
        monkeypatch.setenv(variable, own_budget)
    seen = {}

    def from_pretrained(*args, **kwargs):
        seen.update(kwargs, budget=os.environ.get(variable))
        raise RuntimeError("stop here: the test only asks what the engine is built with")

    monkeypatch.setattr(api_server.LLMEngine, "from_pretrained", from_pretrained)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_llama_tok_dir), "--port", "0", "--engine-thread", "--enforce-eager"])
    with pytest.raises(RuntimeError, match="stop here"):
        api_server.serve_from_args(args)
    assert seen["enforce_eager"] is True and seen["budget"] == (own_budget or "inf")


def test_run_server_returns_when_the_engine_thread_fails():
    """The command line's path with ``--engine-thread``: a failed step ends ``run_server``
    (``serve_from_args`` then exits 1, tested above), the request in flight gets a 503."""
    import urllib.error
    import urllib.request

    from nanoengine.entrypoints.openai.api_server import bind_socket, build_app, run_server

    engine = tiny()
    real_step = engine.step

    def step():
        if any(r.num_output_tokens >= 2 for r in engine.scheduler.running):
            raise RuntimeError("device lost")
        return real_step()

    engine.step = step
    app = build_app(engine, "tiny")
    sock = bind_socket("127.0.0.1", 0)
    serving = threading.Thread(target=run_server, args=(app, sock, "warning"))
    serving.start()
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        deadline = time.monotonic() + 30
        while True:  # until uvicorn listens
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        body = b'{"prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": true}'
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=body,
                                                          headers={"Content-Type": "application/json"}), timeout=30)
        assert failed.value.code == 503 and b"device lost" in failed.value.read()
        serving.join(30)
        assert not serving.is_alive()  # the server stopped by itself
        assert isinstance(app.state.engine.error, RuntimeError)
    finally:
        app.state.stop_serving()
        serving.join(30)
        sock.close()
