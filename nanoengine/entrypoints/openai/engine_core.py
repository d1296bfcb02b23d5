"""The engine core in a process of its own: what ``python -m nanoengine serve`` runs (chapter 12).

With ``AsyncLLMEngine`` the engine thread and the event loop share one interpreter lock, so the
engine's Python between two steps (scheduling, sampling, detokenizing) waits whenever the loop
parses a request or writes a chunk. So, as vLLM v1 does (``EngineCoreProc`` behind an
``AsyncLLM`` client), ``serve`` runs the async engine's loop in a process of its own
(``run_engine_core``), whose main thread builds the engine and alone steps it, over a pipe:
commands in, and after each step one message out with the outputs, the replies and the engine's
counters. Its GNU OpenMP spin count is bounded, so that its threads do not spin through a step's
Python while the server needs a core (``cpu_platform.engine_core_environment``). The server's
``EngineCoreClient`` is an ``EngineClient`` like ``AsyncLLMEngine``: its event loop reads the
pipe when it is readable (``loop.add_reader``: no thread, no polling), and ``add_requests``
waits for the core's reply, so a refused request is an error before its response starts.

The price is a copy: every step's outputs are pickled (figures: results/README.md). Arrival
times need no translation: ``time.perf_counter`` reads one monotonic clock in every process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

from nanoengine.backends.cpu_platform import IdleTrim, engine_core_environment
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.entrypoints.openai.async_engine import (EngineClient, EngineDeadError, EngineFacts, Prompt,
                                                        RequestStream, abort_all, add_all_or_none, checked_max_waiting,
                                                        notify_finished)
from nanoengine.metrics import EngineStats
from nanoengine.outputs import RequestOutput
from nanoengine.sampling_params import SamplingParams

logger = logging.getLogger("nanoengine.serve")


def run_engine_core(conn: Connection, build: Callable[[], LLMEngine]) -> None:
    """The engine-core process: build the engine, then serve the commands on ``conn`` until "stop".

    Messages in: ``("add", ticket, requests, arrival_time)``, ``("abort", request_ids)``,
    ``("call", ticket, pickled fn)``, ``("max_waiting", n)``, ``("stop",)``. Messages out: ``("ready",
    EngineFacts)`` or ``("failed", error)`` once; then ``("step", replies, outputs, stats)`` after
    every round of commands and step, where ``replies`` are ``(ticket, result, error)``; and
    ``("stopped", error, final_outputs)`` last, with the requests it had to abort.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle; it sends "stop"
    try:
        trim = IdleTrim()  # reads its variable once; a bad value fails the start with the variable's name
        engine = build()
    except BaseException as exc:
        conn.send(("failed", _portable(exc)))
        return
    conn.send(("ready", EngineFacts.of(engine)))
    error: BaseException | None = None
    max_waiting: int | None = None
    try:
        while True:
            if not engine.has_unfinished_requests():
                trim.idle(conn.poll)  # sleep until a command arrives, giving freed memory back first if due
            replies: list[tuple[int, Any, BaseException | None]] = []
            outputs: list[RequestOutput] = []
            stop = False
            while not stop and conn.poll():
                message = conn.recv()
                kind = message[0]
                if kind == "stop":
                    stop = True
                elif kind == "abort":
                    outputs.extend(engine.abort(request_id) for request_id in message[1]
                                   if engine.has_request(request_id))
                elif kind == "max_waiting":
                    max_waiting = message[1]
                else:  # "add" or "call": the caller's errors are replies, not the engine's failure
                    ticket = message[1]
                    try:  # a call's function arrives pickled: one its process cannot import fails only the call
                        result = (add_all_or_none(engine, message[2], message[3], max_waiting) if kind == "add"
                                  else pickle.loads(message[2])(engine))
                    except Exception as exc:
                        replies.append((ticket, None, _portable(exc)))
                    else:
                        replies.append((ticket, result, None))
            if not stop and engine.has_unfinished_requests():
                outputs.extend(engine.step())
                trim.stepped = True
            if replies or outputs or not stop:
                _send_step(conn, replies, outputs, EngineStats.of(engine))
            if stop:
                break
    except (EOFError, OSError):  # the server's end of the pipe closed: nobody to serve
        return
    except Exception as exc:  # a bug or a device error: the server fails every request in flight
        logger.exception("the engine failed; every request in flight gets an error")
        error = exc
    finals = abort_all(engine, list(engine.output_processor.states))  # the user request ids still unfinished
    with contextlib.suppress(OSError, pickle.PicklingError):
        conn.send(("stopped", None if error is None else _portable(error), finals))
    engine.shutdown()


def _send_step(conn: Connection, replies: list, outputs: list[RequestOutput], stats: EngineStats) -> None:
    try:
        conn.send(("step", replies, outputs, stats))
    except (pickle.PicklingError, TypeError, AttributeError) as exc:  # a call returned something unpicklable
        replies = [(ticket, None, _portable(exc)) for ticket, _, _ in replies]
        conn.send(("step", replies, outputs, stats))


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class EngineCoreClient(EngineClient):
    """An engine stepped by a process of its own, driven from asyncio (``EngineClient``).

    ``build`` makes the engine in the new process, so it must be picklable: a module-level
    function or ``functools.partial(LLMEngine.from_pretrained, path, **options)``. The constructor
    waits until the engine is built and raises the core's error if building failed.
    ``on_finished`` runs on the event loop here; ``on_dead`` also when the process dies without a word.
    """

    def __init__(self, build: Callable[[], LLMEngine], max_waiting: int | None = None,
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 startup_timeout: float = 600.0, on_dead: Callable[[], None] | None = None) -> None:
        checked_max_waiting(max_waiting)  # before the process starts
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked OpenMP or locks
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=run_engine_core, args=(child_conn, build),
                                        name="nanoengine-engine-core")
        with engine_core_environment():
            self._process.start()
        child_conn.close()  # the child holds its own copy; ours would keep the pipe open after it exits
        self._send_lock = threading.Lock()  # call() may come from any thread
        self._pending: dict[int, concurrent.futures.Future] = {}  # ticket -> waiting add or call
        self._pending_lock = threading.Lock()
        self._tickets = itertools.count()
        self._streams: dict[str, asyncio.Queue] = {}  # request id -> its HTTP request's queue (loop only)
        self._stopped = False
        super().__init__(self._wait_until_ready(startup_timeout), max_waiting, on_finished, on_dead)

    def _wait_until_ready(self, timeout: float) -> EngineFacts:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.5):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine-core process exited while building the engine "
                                   f"(exit code {self._process.exitcode})")
            if time.monotonic() > deadline:
                self._process.kill()
                raise TimeoutError(f"the engine-core process did not build the engine within {timeout} s")
        kind, payload = self._conn.recv()
        if kind == "failed":
            self._process.join(10)
            raise payload
        return payload

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start reading the core's outputs on ``loop`` (default: the running one)."""
        if self._loop is not None:
            raise RuntimeError("this EngineCoreClient was already started; build a new one")
        self._loop = loop or asyncio.get_running_loop()
        self._send(("max_waiting", self.max_waiting))
        self._loop.add_reader(self._conn.fileno(), self._read)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core: unfinished requests are aborted and their streams end with
        ``EngineDeadError``; the process exits. Safe to call twice."""
        if not self._stopped:
            with contextlib.suppress(OSError):
                self._send(("stop",))
            deadline = time.monotonic() + timeout
            with contextlib.suppress(OSError, ValueError):  # the pipe closed
                while not self._stopped and self._conn.poll(max(0.0, deadline - time.monotonic())):
                    self._read()  # the last outputs and "stopped"
        self._process.join(max(1.0, timeout))
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._close("the engine is shutting down")
        self._conn.close()  # the process is gone: nothing more to read or send

    @property
    def is_running(self) -> bool:
        return self._loop is not None and not self._stopped and self._process.is_alive()

    async def add_requests(self, requests: Sequence[tuple[str, Prompt, SamplingParams]],
                           arrival_time: float | None = None) -> RequestStream:
        """As ``AsyncLLMEngine.add_requests``."""
        requests = list(requests)
        request_ids = [request_id for request_id, _, _ in requests]
        taken = [request_id for request_id in request_ids if request_id in self._streams]
        if taken or len(set(request_ids)) < len(request_ids):
            raise ValueError(f"request ids must be unique among the requests in flight: {taken or request_ids} "
                             f"given twice")
        queue: asyncio.Queue = asyncio.Queue()
        for request_id in request_ids:  # watched before the core can answer: no output is missed
            self._streams[request_id] = queue
        try:
            await asyncio.wrap_future(self._request(
                "add", requests, time.perf_counter() if arrival_time is None else arrival_time))
        except BaseException as exc:
            for request_id in request_ids:  # nobody will read them; a late output is dropped
                self._streams.pop(request_id, None)
            if isinstance(exc, asyncio.CancelledError):  # the caller went away: undo the add if it happened
                self.abort(request_ids)
            raise
        return RequestStream(self, request_ids, queue)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort these requests between two steps (unknown or finished ids are ignored)."""
        if not self._stopped:
            with contextlib.suppress(OSError):
                self._send(("abort", list(request_ids)))

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` in the core's process between two steps; its (pickled) result
        arrives on the returned Future. ``fn`` must be importable there: a module-level function."""
        try:
            payload = pickle.dumps(fn)
        except Exception as exc:
            raise TypeError(f"the engine runs in another process, so call() needs a function it can import "
                            f"there (a module-level function, not a lambda or a closure): {exc}") from None
        return self._request("call", payload)

    def _request(self, kind: str, *args) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._pending_lock:
            if self._stopped or self._loop is None:
                done.set_exception(EngineDeadError(self._why_dead()))
                return done
            ticket = next(self._tickets)
            self._pending[ticket] = done
        try:
            self._send((kind, ticket, *args))
        except Exception as exc:  # unpicklable params, or the pipe closed
            with self._pending_lock:
                self._pending.pop(ticket, None)
            done.set_exception(exc if not isinstance(exc, OSError) else EngineDeadError(self._why_dead()))
        return done

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        """Handle every message waiting on the pipe (the event loop calls this when it is readable)."""
        try:
            while not self._stopped and self._conn.poll():
                message = self._conn.recv()
                if message[0] == "step":
                    self._on_step(*message[1:])
                else:  # "stopped"
                    self._on_stopped(*message[1:])
        except (EOFError, OSError):  # the process died without saying so
            code = self._process.exitcode
            self.error = self.error or RuntimeError(f"the engine-core process exited unexpectedly"
                                                    f"{'' if code is None else f' (exit code {code})'}")
            self._close(self._why_dead())

    def _on_step(self, replies: list, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self.stats = stats
        for ticket, result, error in replies:
            with self._pending_lock:
                done = self._pending.pop(ticket, None)
            if done is not None and done.set_running_or_notify_cancel():
                if error is None:
                    done.set_result(result)
                else:
                    done.set_exception(error)
        for out in outputs:
            if out.finished:
                notify_finished(self.on_finished, out)
                queue = self._streams.pop(out.request_id, None)
            else:
                queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _on_stopped(self, error: BaseException | None, finals: list[RequestOutput]) -> None:
        if error is not None:
            self.error = error
        for out in finals:
            notify_finished(self.on_finished, out)
        self._close(self._why_dead())

    def _close(self, why: str) -> None:
        """Nothing more will come: fail what waits, end every open stream with the error."""
        first = not self._stopped
        self._stopped = True
        if first and self._loop is not None:
            with contextlib.suppress(ValueError, OSError, RuntimeError):  # closed pipe or closed loop
                self._loop.remove_reader(self._conn.fileno())
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for done in pending.values():
            if done.set_running_or_notify_cancel():
                done.set_exception(EngineDeadError(why))
        streams, self._streams = self._streams, {}
        if first:
            self._end_streams(streams.values(), why)
