"""Freed memory given back when the engine core goes idle (``cpu_platform.release_free_heap``,
``trim_when_idle``, ``IdleTrim`` as ``engine_core.run_engine_core`` sleeps through it), and when the
async engine's thread does (``serve --engine-thread``, the notebooks' servers).

The core's loop runs here on the test's main thread (it sets a signal handler), with a tiny
random Llama and the core's end of an in-process pipe; a thread plays the server's side.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import multiprocessing
import pickle
import signal
import threading
import time

import pytest

from nanoengine import LLMEngine, SamplingParams
from nanoengine.backends import cpu_platform
from nanoengine.entrypoints.openai import async_engine, engine_core
from nanobench.soak import process_memory

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
MiB = 1024 * 1024


# ----------------------------------------------------------------- the setting
@pytest.mark.parametrize("text, trim", [(None, True), ("1", True), ("0", False)])
def test_trimming_is_on_unless_the_environment_says_0(monkeypatch, text, trim):
    if text is None:
        monkeypatch.delenv(cpu_platform.TRIM_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(cpu_platform.TRIM_VARIABLE, text)
    assert cpu_platform.trim_when_idle() is trim


@pytest.mark.parametrize("text", ["yes", "false", "2", ""])
def test_a_bad_setting_is_refused_by_name(monkeypatch, text):
    monkeypatch.setenv(cpu_platform.TRIM_VARIABLE, text)
    with pytest.raises(ValueError, match=f"{cpu_platform.TRIM_VARIABLE} must be 1 .* or 0"):
        cpu_platform.trim_when_idle()


# ----------------------------------------------------------------- the trim
def test_nothing_to_trim_off_glibc(monkeypatch):
    monkeypatch.setattr(cpu_platform.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert cpu_platform.glibc.__wrapped__() is None
    monkeypatch.setattr(cpu_platform, "glibc", lambda: None)
    assert cpu_platform.release_free_heap() is False


@pytest.mark.skipif(not cpu_platform.on_glibc(), reason="malloc_trim is glibc's")
def test_the_holes_between_live_blocks_go_back_to_the_kernel():
    """Blocks freed below a live one stay resident after ``free``; the trim gives them back."""
    libc = cpu_platform.glibc()
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    block = 64 * 1024  # below glibc's mmap threshold: from the heap
    blocks = [libc.malloc(block) for _ in range(1600)]  # 100 MiB
    for address in blocks:
        ctypes.memset(address, 1, block)  # resident
    pin = libc.malloc(block)  # live above them: the heap's top cannot shrink past it
    for address in blocks:
        libc.free(address)
    after_free = process_memory("self")["RssAnon"]
    assert cpu_platform.release_free_heap() is True
    after_trim = process_memory("self")["RssAnon"]
    libc.free(pin)
    assert after_free - after_trim > 50 * MiB


# ----------------------------------------------------------------- the core's loop
@pytest.fixture
def sigint_restored():
    """``run_engine_core`` ignores SIGINT (the server's to handle); give pytest its handler back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


@pytest.fixture
def trims(monkeypatch, sigint_restored) -> list[float]:
    """When the core trimmed (``release_free_heap`` recorded, not run), quiet for 0.05 s before it."""
    when: list[float] = []
    monkeypatch.setattr(cpu_platform, "release_free_heap", lambda: when.append(time.monotonic()) or True)
    monkeypatch.setattr(cpu_platform, "TRIM_AFTER_IDLE_S", 0.05)
    return when


def tiny_engine(path) -> LLMEngine:
    return LLMEngine.from_pretrained(str(path), device="cpu", num_kv_blocks=64, block_size=4, max_model_len=256,
                                     max_num_seqs=4, enforce_eager=True)


def count_unfinished(engine: LLMEngine) -> int:
    return len(engine.output_processor.states)


class ServerSide:
    """The server's end of the pipe, on a thread: send commands, read the core's answers."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.tickets = 0

    def read(self) -> tuple:
        if not self.conn.poll(60):
            raise TimeoutError("the core sent nothing for 60 s")
        return self.conn.recv()

    def generate(self, *request_ids: str) -> None:
        """Add the requests and read the core's steps until all of them finished."""
        self.tickets += 1
        self.conn.send(("add", self.tickets, [(rid, [5, 6, 7], GREEDY) for rid in request_ids], time.perf_counter()))
        unfinished = set(request_ids)
        while unfinished:
            kind, *payload = self.read()
            if kind == "step":
                unfinished -= {out.request_id for out in payload[1] if out.finished}

    def call(self, fn):
        """``fn(engine)`` run by the core between two steps: its result."""
        self.tickets += 1
        self.conn.send(("call", self.tickets, pickle.dumps(fn)))
        while True:
            kind, *payload = self.read()
            if kind == "step" and payload[0]:
                (_, result, error), = payload[0]
                assert error is None
                return result

    def stop(self) -> None:
        self.conn.send(("stop",))
        while self.read()[0] != "stopped":
            pass


def run_core_with(build, scenario) -> None:
    """``run_engine_core`` here until ``scenario(server_side)``, on a thread, is done and the core stopped."""
    server_conn, core_conn = multiprocessing.Pipe()
    failures: list[BaseException] = []

    def drive() -> None:
        side = ServerSide(server_conn)
        try:
            assert side.read()[0] == "ready"
            scenario(side)
        except BaseException as exc:
            failures.append(exc)
        finally:
            side.stop()

    thread = threading.Thread(target=drive)
    thread.start()
    engine_core.run_engine_core(core_conn, build)
    thread.join(60)
    if failures:
        raise failures[0]


def wait_for(count: int, trims: list[float], settle_s: float = 0.5) -> int:
    """The number of trims once ``count`` have happened (or 10 s passed) and ``settle_s`` more passed."""
    deadline = time.monotonic() + 10
    while len(trims) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(settle_s)
    return len(trims)


def test_the_core_trims_once_per_idle_period_after_work(monkeypatch, tiny_llama_dir, trims):
    monkeypatch.delenv(cpu_platform.TRIM_VARIABLE, raising=False)
    seen: list[int] = []

    def scenario(side: ServerSide) -> None:
        seen.append(wait_for(0, trims))  # idle since it started: nothing was freed, no trim
        side.generate("a")
        seen.append(wait_for(1, trims))  # idle after work: one trim ...
        seen.append(wait_for(1, trims))  # ... not one per wake-up or per second of idleness
        assert side.call(count_unfinished) == 0
        seen.append(wait_for(1, trims))  # a command without a step frees nothing: no trim
        side.generate("b", "c")
        seen.append(wait_for(2, trims))  # the next idle period after work: the next trim

    run_core_with(functools.partial(tiny_engine, tiny_llama_dir), scenario)
    assert seen == [0, 1, 1, 1, 2]


def test_no_trim_when_switched_off(monkeypatch, tiny_llama_dir, trims):
    monkeypatch.setenv(cpu_platform.TRIM_VARIABLE, "0")
    seen: list[int] = []

    def scenario(side: ServerSide) -> None:
        side.generate("a")
        seen.append(wait_for(0, trims))

    run_core_with(functools.partial(tiny_engine, tiny_llama_dir), scenario)
    assert seen == [0]


def test_a_bad_setting_fails_the_start_before_the_engine_is_built(monkeypatch, sigint_restored):
    monkeypatch.setenv(cpu_platform.TRIM_VARIABLE, "yes")
    server_conn, core_conn = multiprocessing.Pipe()
    engine_core.run_engine_core(core_conn, lambda: pytest.fail("the engine was built"))
    kind, error = server_conn.recv()
    assert kind == "failed" and isinstance(error, ValueError) and cpu_platform.TRIM_VARIABLE in str(error)


# ----------------------------------------------------------------- the async engine's thread
@pytest.mark.parametrize("setting, expected", [(None, [0, 1, 1, 2]), ("0", [0, 0, 0, 0])])
def test_the_async_engine_trims_once_per_idle_period_after_work(monkeypatch, tiny_llama_dir, setting, expected):
    if setting is None:
        monkeypatch.delenv(cpu_platform.TRIM_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(cpu_platform.TRIM_VARIABLE, setting)
    trims: list[float] = []
    monkeypatch.setattr(cpu_platform, "release_free_heap", lambda: trims.append(time.monotonic()) or True)
    monkeypatch.setattr(cpu_platform, "TRIM_AFTER_IDLE_S", 0.05)

    async def main() -> list[int]:
        ae = async_engine.AsyncLLMEngine(tiny_engine(tiny_llama_dir))
        ae.start()
        seen = []

        async def generate(request_id: str) -> None:
            stream = await ae.add_requests([(request_id, [5, 6, 7], GREEDY)])
            assert [out async for out in stream][-1].finished

        async def settled(count: int) -> int:  # wait_for, without blocking the event loop
            deadline = time.monotonic() + (10 if count else 0)
            while len(trims) < count and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
            return len(trims)
        try:
            seen.append(await settled(0))  # idle since it started: no trim
            await generate("a")
            seen.append(await settled(expected[1]))  # idle after work: one trim ...
            seen.append(await settled(expected[2]))  # ... not one per second of idleness
            await generate("b")
            seen.append(await settled(expected[3]))  # the next idle period after work: the next
        finally:
            ae.shutdown()
        return seen

    assert asyncio.run(main()) == expected


def test_a_request_that_arrives_before_the_trim_is_served_at_once(monkeypatch, tiny_llama_dir):
    """The thread waits ``TRIM_AFTER_IDLE_S`` for work before trimming; work that arrives in that
    wait is stepped at once, and no trim comes between."""
    monkeypatch.delenv(cpu_platform.TRIM_VARIABLE, raising=False)
    trims: list[float] = []
    monkeypatch.setattr(cpu_platform, "release_free_heap", lambda: trims.append(time.monotonic()) or True)
    monkeypatch.setattr(cpu_platform, "TRIM_AFTER_IDLE_S", 600.0)

    async def main() -> None:
        ae = async_engine.AsyncLLMEngine(tiny_engine(tiny_llama_dir))
        ae.start()
        try:
            for request_id in ("a", "b"):  # "b" arrives while the thread waits to trim after "a"
                stream = await ae.add_requests([(request_id, [5, 6, 7], GREEDY)])
                outs = await asyncio.wait_for(_all(stream), 30)  # a hang guard: it takes milliseconds
                assert outs[-1].finished
                await asyncio.sleep(0.3)  # the thread is now waiting to trim
        finally:
            ae.shutdown()

    asyncio.run(main())
    assert trims == []


async def _all(stream) -> list:
    return [out async for out in stream]
