"""The output router: one place steps the engine, every output reaches its reader (chapter 2).

``LLMEngine.step()`` returns the outputs of *every* request that progressed, so a reader that steps
the engine for its own request and drops the rest loses the others' (a ``generate`` run while a
stream is open would eat the stream's deltas). So readers ask the router, which steps the engine and
puts each output in its request's queue (``watch``, then ``next_output``). A queue is made for any
request that produced an output and kept until its final output is read, so nothing is lost;
``release`` drops one nobody wants.

A server's ``AsyncLLMEngine`` (chapter 12) steps on a thread of its own, calls ``route(engine.step())``
and gives ``watch`` a ``sink`` (a function called with each output) instead of a queue. vLLM's
``AsyncLLM`` routes the same way, one ``RequestOutputCollector`` per request
(vllm/v1/engine/output_processor.py). Not thread-safe, like the engine: one thread steps and reads.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterable

from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.outputs import RequestOutput

Sink = Callable[[RequestOutput], None]


class OutputRouter:
    """Steps an ``LLMEngine`` and keeps each request's outputs until its reader takes them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, collections.deque[RequestOutput]] = {}
        self._sinks: dict[str, Sink] = {}
        self._released: set[str] = set()  # unfinished requests whose reader left: outputs dropped

    def watch(self, request_id: str, sink: Sink | None = None) -> None:
        """Collect ``request_id``'s outputs from now on: in its queue, or handed to ``sink``."""
        self._released.discard(request_id)
        if sink is not None:
            if not callable(sink):
                raise TypeError(f"sink must be a function of one RequestOutput, got {sink!r:.80}")
            self._sinks[request_id] = sink
        else:
            self._queues.setdefault(request_id, collections.deque())

    def release(self, request_id: str) -> None:
        """Stop collecting for ``request_id``: drop what was not read, and its later outputs. The
        request itself keeps running (abort it with ``engine.abort`` if nobody wants it)."""
        self._queues.pop(request_id, None)
        self._sinks.pop(request_id, None)
        if self.engine.has_request(request_id):
            self._released.add(request_id)

    def route(self, outputs: Iterable[RequestOutput]) -> None:
        """Deliver outputs to their requests' sinks or queues (a queue is made if none exists)."""
        for out in outputs:
            if out.request_id in self._released:
                if out.finished:
                    self._released.discard(out.request_id)
                continue
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                if out.finished:
                    del self._sinks[out.request_id]
                sink(out)
            else:
                self._queues.setdefault(out.request_id, collections.deque()).append(out)

    def step(self) -> list[RequestOutput]:
        """One engine step, its outputs routed; returns them too (for a caller counting progress)."""
        outputs = self.engine.step()
        self.route(outputs)
        return outputs

    def pop(self, request_id: str) -> RequestOutput | None:
        """The oldest unread output of ``request_id``, without stepping; None if there is none.
        The queue goes once its final output has been taken."""
        queue = self._queues.get(request_id)
        if not queue:
            return None
        out = queue.popleft()
        if out.finished:
            del self._queues[request_id]
        return out

    def next_output(self, request_id: str) -> RequestOutput | None:
        """The next output of ``request_id``, stepping the engine until there is one; None once it
        has nothing more to give (finished and read, or aborted: ``engine.abort`` returned the last)."""
        while True:
            out = self.pop(request_id)
            if out is not None:
                return out
            if not self.engine.has_request(request_id):
                self._queues.pop(request_id, None)
                return None
            self.step()

    def wait(self, request_id: str) -> RequestOutput | None:
        """Step until ``request_id`` has finished; its final output (earlier ones are dropped), or None
        as in ``next_output``. A ``DELTA`` request's final output holds only the last piece: read
        such a request with ``next_output`` instead."""
        while (out := self.next_output(request_id)) is not None:
            if out.finished:
                return out
        return None

    def close(self) -> dict[str, Sink]:
        """Stop collecting for every request, dropping unread outputs; returns the sinks still waiting,
        by request id, whose readers must be told that nothing more will come. The requests keep
        running (an owner that stops serving aborts them)."""
        sinks, self._sinks = self._sinks, {}
        self._queues.clear()
        self._released.clear()
        return sinks

    @property
    def num_held(self) -> int:
        """Requests the router still keeps something for (a queue, a sink, or a release mark): zero
        once every request it saw has finished and been read, what a leak check asks."""
        return len(self._queues) + len(self._sinks) + len(self._released)

    @property
    def num_unread(self) -> int:
        """Outputs routed but not read yet, over all requests."""
        return sum(len(q) for q in self._queues.values())
