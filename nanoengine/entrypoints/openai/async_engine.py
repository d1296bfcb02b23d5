"""The async engine: the engine stepped on a thread, driven from asyncio (chapter 12).

``LLMEngine`` is synchronous and not thread-safe, and a step takes milliseconds to seconds: far
too long for an event loop that must keep answering other clients. So one **engine thread** owns
the engine and alone calls it: between two steps it applies the commands that arrived (add,
abort, call), then steps and hands the outputs to chapter 2's ``OutputRouter``, whose sink per
request puts each on its HTTP request's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``
(the one sanctioned way into a loop from another thread). Idle, it sleeps on a condition variable
that a new command notifies. A request arriving mid-step waits for that step to end, and its TTFT
includes the wait. A request with ``n`` completions is one request id. Prompts arrive tokenized
(``serving``); the tokenizer is shared read-only (that thread encodes, this one decodes).

The notebooks and ``serve --engine-thread`` serve with this class; plain ``serve`` runs the
same loop in a process of its own (``engine_core``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from nanoengine.backends.cpu_platform import IdleTrim
from nanoengine.config import EngineConfig
from nanoengine.engine.input_processor import InputProcessor
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.engine.output_router import OutputRouter
from nanoengine.metrics import EngineStats
from nanoengine.outputs import RequestOutput
from nanoengine.sampling_params import SamplingParams

logger = logging.getLogger("nanoengine.serve")

Prompt = str | list[int]


class QueueFullError(RuntimeError):
    """More requests are waiting than the server's limit allows (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or a step failed); nothing more can be served."""


def checked_max_waiting(max_waiting: int | None) -> int | None:
    """``max_waiting`` if it is None or an integer >= 1; else a ValueError that says so."""
    if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, int)
                                    or max_waiting < 1):
        raise ValueError(f"max_waiting must be None or an integer >= 1, got {max_waiting!r}")
    return max_waiting


def add_all_or_none(engine: LLMEngine, requests: Sequence[tuple[str, Prompt, SamplingParams]],
                    arrival_time: float, max_waiting: int | None) -> None:
    """Add one engine request per (id, prompt, params), or none of them (the error says why).

    Called by whoever steps the engine, between two steps. ``max_waiting`` (None: no limit)
    refuses an add that would leave more sequences waiting for admission (``QueueFullError``);
    a bad prompt or params raise the engine's own ``ValueError``, and the requests this call
    already added are aborted first: nothing was computed for them yet.
    """
    waiting = len(engine.scheduler.waiting)
    if max_waiting is not None and len(requests) > max_waiting:
        raise ValueError(f"this request has {len(requests)} prompts, but at most {max_waiting} "
                         f"may wait for the engine at once: send fewer per request")
    if max_waiting is not None and waiting + len(requests) > max_waiting:
        raise QueueFullError(f"{waiting} requests are already waiting for the engine (the server's limit is "
                             f"{max_waiting}); retry later")
    added: list[str] = []
    try:
        for request_id, prompt, params in requests:  # ValueError: an empty or too long prompt, bad ids or params
            engine.add_request(prompt, params, request_id, arrival_time=arrival_time)
            added.append(request_id)
    except BaseException:
        for request_id in added:
            engine.abort(request_id)
        raise


def abort_all(engine: LLMEngine, request_ids) -> list[RequestOutput]:
    """On the way out: abort each of ``request_ids`` the engine still has; their final outputs. One
    that cannot be aborted (a failed step may have broken the bookkeeping) is logged, and skipped."""
    finals = []
    for request_id in request_ids:
        try:
            if engine.has_request(request_id):
                finals.append(engine.abort(request_id))
        except Exception:
            logger.exception("could not abort request %s", request_id)
    return finals


def notify_finished(on_finished: Callable[[RequestOutput], None] | None, out: RequestOutput) -> None:
    """Tell the server's observer (``on_finished``: its metrics) that a request finished; an
    observer's bug is logged, and serving goes on."""
    if on_finished is not None:
        try:
            on_finished(out)
        except Exception:
            logger.exception("on_finished failed for request %s", out.request_id)


def call_on_loop(loop: asyncio.AbstractEventLoop | None, fn: Callable, *args) -> None:
    """Run ``fn(*args)`` on ``loop`` from any thread; nothing happens if the loop is closed or
    was never started (on the way out nobody may be listening any more)."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is not None and running is loop:
        fn(*args)
        return
    with contextlib.suppress(RuntimeError, AttributeError):  # closed, or None: never started
        loop.call_soon_threadsafe(fn, *args)


# Commands from the asyncio side to the engine thread. Each result travels back on a
# concurrent.futures.Future, which any thread may wait on (asyncio wraps it with wrap_future).
@dataclass
class _Add:
    requests: list[tuple[str, Prompt, SamplingParams]]  # (request id, prompt, params) per prompt
    queue: asyncio.Queue  # where every one of them delivers its outputs
    arrival_time: float
    done: concurrent.futures.Future


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future


class RequestStream:
    """The outputs of the engine requests one HTTP request made (one per prompt), in the
    order the engine produced them; ``async for`` ends once every one has finished."""

    def __init__(self, owner: "EngineClient", request_ids: list[str], queue: asyncio.Queue) -> None:
        self.request_ids = list(request_ids)
        self._owner = owner
        self._queue = queue
        self._unfinished = set(request_ids)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):  # the engine thread stopped
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def abort(self) -> None:
        """Abort whatever has not finished (a no-op once all have); safe to call twice."""
        if self._unfinished:
            self._owner.abort(sorted(self._unfinished))
            self._unfinished.clear()


@dataclass(frozen=True)
class EngineFacts:
    """What the server reads from the engine once, before serving: none of it changes while it runs."""

    config: EngineConfig
    max_model_len: int
    num_blocks: int
    input_processor: InputProcessor  # with the tokenizer: the server tokenizes and checks prompts itself
    stats: EngineStats

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineFacts:
        return cls(engine.config, engine.max_model_len, engine.runner.num_blocks, engine.input_processor,
                   EngineStats.of(engine))


class EngineClient:
    """What the server drives: an engine stepped on a thread of this process (``AsyncLLMEngine``)
    or in a process of its own (``engine_core.EngineCoreClient``), one interface for both.
    ``max_waiting``: as in ``add_all_or_none``. ``on_finished`` is called with every final output
    (finished, stopped or aborted), e.g. for metrics; ``on_dead`` once, on the event loop, if the
    engine stops on a fault of its own (the command-line server then exits), not when it is shut down.
    """

    def __init__(self, facts: EngineFacts, max_waiting: int | None, on_finished: Callable[[RequestOutput], None] | None,
                 on_dead: Callable[[], None] | None) -> None:
        self.max_waiting = checked_max_waiting(max_waiting)
        self.on_finished = on_finished
        self.on_dead = on_dead
        self.config, self.max_model_len, self.num_blocks = facts.config, facts.max_model_len, facts.num_blocks
        self.input_processor, self.tokenizer = facts.input_processor, facts.input_processor.tokenizer
        self.stats = facts.stats  # the latest, published after every step (read without waiting)
        self.error: BaseException | None = None  # why the engine stopped, if it failed
        self._loop: asyncio.AbstractEventLoop | None = None  # where outputs are delivered, once started

    def _why_dead(self) -> str:
        if self.error is not None:
            return f"the engine failed and stopped: {self.error!r}"
        return "the engine has not been started" if self._loop is None else "the engine is shutting down"

    def _end_streams(self, queues, why: str) -> None:
        """Nothing more will come: end each stream (once: it ends at the first error), from any thread."""
        error = EngineDeadError(why)
        for queue in set(queues):
            call_on_loop(self._loop, queue.put_nowait, error)
        if self.error is not None and self.on_dead is not None:
            call_on_loop(self._loop, self.on_dead)


class AsyncLLMEngine(EngineClient):
    """An ``LLMEngine`` stepped by its own thread (vLLM's name); ``on_finished`` runs on that thread."""

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None,
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 on_dead: Callable[[], None] | None = None) -> None:
        super().__init__(EngineFacts.of(engine), max_waiting, on_finished, on_dead)
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort | _Call] = []  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self.router = OutputRouter(engine)  # request id -> the sink of its stream; engine thread only
        self._thread: threading.Thread | None = None
        self._trim = IdleTrim()  # reads its variable once; a bad value fails here, with the variable's name

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on ``loop`` (default: the running one)."""
        if self._thread is not None:
            raise RuntimeError("this AsyncLLMEngine was already started; build a new one")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="nanoengine-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread: unfinished requests are aborted (their blocks freed) and
        their streams end with ``EngineDeadError``. Afterwards the engine is the caller's again."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the engine thread did not stop within {timeout} s")

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def add_requests(self, requests: Sequence[tuple[str, Prompt, SamplingParams]],
                           arrival_time: float | None = None) -> RequestStream:
        """Queue one engine request per (id, prompt, params), all or none: else ``ValueError`` (the
        engine's own checks), ``QueueFullError`` or ``EngineDeadError``. TTFT counts from
        ``arrival_time`` (``time.perf_counter()`` when the HTTP request came in)."""
        queue: asyncio.Queue = asyncio.Queue()
        done: concurrent.futures.Future = concurrent.futures.Future()
        requests = list(requests)
        self._submit(_Add(requests, queue, time.perf_counter() if arrival_time is None else arrival_time, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:  # the caller went away while waiting: undo the add if it happened
            self.abort([request_id for request_id, _, _ in requests])
            raise
        return RequestStream(self, [request_id for request_id, _, _ in requests], queue)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort these requests between two steps (unknown or finished ids are ignored)."""
        self._submit(_Abort(list(request_ids)))

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between two steps; its result arrives on the
        returned Future (``.result(timeout)`` from a plain thread, ``await asyncio.wrap_future``
        from asyncio). The one safe way to read or change the engine while it is served."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(fn, done))
        return done

    def _submit(self, command: _Add | _Abort | _Call) -> None:
        with self._cond:
            if self._stopping or self.error is not None or self._thread is None:
                if not isinstance(command, _Abort):
                    command.done.set_exception(EngineDeadError(self._why_dead()))
                return
            self._commands.append(command)
            self._cond.notify()

    def _run(self) -> None:
        """The engine thread: apply commands, step, deliver outputs; sleep when idle."""
        engine = self.engine
        while True:
            with self._cond:
                while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                    self._trim.idle(self._cond.wait)  # idle: no spinning, no polling; a trim first if due
                if self._stopping:
                    break
                commands, self._commands = self._commands, []
            try:
                while commands:
                    self._apply(commands[0])
                    commands.pop(0)
                if engine.has_unfinished_requests():
                    self._deliver(engine.step())
                    self._trim.stepped = True
                self.stats = EngineStats.of(engine)
            except Exception as exc:  # a fault of the engine itself (a request's own is contained by step())
                logger.exception("the engine failed; every request in flight gets an error")
                self.error = exc
                with self._cond:  # the commands not yet applied are failed with the rest
                    self._commands[:0] = commands[1:]
                break
        self._stop_everything()

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Abort):
            for request_id in command.request_ids:
                if self.engine.has_request(request_id):
                    self._deliver([self.engine.abort(request_id)])
            return
        if not command.done.set_running_or_notify_cancel():
            return
        try:
            result = self._add(command) if isinstance(command, _Add) else command.fn(self.engine)
        except Exception as exc:  # the caller's error (a bad request), not the engine's
            command.done.set_exception(exc)
        else:
            command.done.set_result(result)

    def _add(self, command: _Add) -> None:
        add_all_or_none(self.engine, command.requests, command.arrival_time, self.max_waiting)
        sink = _StreamSink(self._loop, command.queue)
        for request_id, _, _ in command.requests:
            self.router.watch(request_id, sink=sink)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Report final outputs to ``on_finished``, then route every output to its stream."""
        for out in outputs:
            if out.finished:
                notify_finished(self.on_finished, out)
        self.router.route(outputs)

    def _stop_everything(self) -> None:
        """On the way out: abort what is unfinished, fail waiting commands and streams."""
        with self._cond:
            self._stopping = True
            commands, self._commands = self._commands, []
        for command in commands:
            if not isinstance(command, _Abort) and command.done.set_running_or_notify_cancel():
                command.done.set_exception(EngineDeadError(self._why_dead()))
        sinks = self.router.close()  # the streams still waiting: they get the error, not an output
        for out in abort_all(self.engine, sinks):
            notify_finished(self.on_finished, out)
        with contextlib.suppress(Exception):
            self.stats = EngineStats.of(self.engine)
        self._end_streams([sink.queue for sink in sinks.values() if isinstance(sink, _StreamSink)], self._why_dead())


class _StreamSink:
    """The router's sink for one engine request: called on the engine thread, it puts each
    output on its stream's queue on the event loop. The prompts of one HTTP request share a queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue = loop, queue

    def __call__(self, out: RequestOutput) -> None:
        call_on_loop(self.loop, self.queue.put_nowait, out)
