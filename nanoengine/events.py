"""Events for observers: what the engine did, as frozen records (chapters 2, 4, 5, 7).

The simulators and the notebooks watch the live engine through these instead of its
internals (vLLM v1: request events QUEUED / SCHEDULED / PREEMPTED, KV events BlockStored /
BlockRemoved). Events carry plain values, so an observer cannot change the engine through one.
"""

from __future__ import annotations

import collections
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Event:
    """Base of all events: the engine step it happened in and when."""

    step: int
    timestamp: float = field(default_factory=time.perf_counter, kw_only=True)


@dataclass(frozen=True)
class RequestQueued(Event):
    request_id: str
    num_prompt_tokens: int


@dataclass(frozen=True)
class RequestScheduled(Event):
    """A request got ``num_tokens`` tokens of this step's budget."""

    request_id: str
    num_tokens: int
    num_computed_tokens: int  # before this step
    is_prefill: bool


@dataclass(frozen=True)
class DraftsVerified(Event):
    """Speculative decoding (chapter 13): one forward pass checked a request's drafts. ``emitted`` are the
    tokens it produced: the first ``num_accepted`` drafts, then one of the model's own. A stop among them
    may end the request before all of them reach its output."""

    request_id: str
    draft_token_ids: tuple[int, ...]
    emitted: tuple[int, ...]

    @property
    def num_accepted(self) -> int:
        return len(self.emitted) - 1


@dataclass(frozen=True)
class RequestPreempted(Event):
    """Evicted to make room; its blocks are freed and it will be recomputed."""

    request_id: str
    num_blocks_freed: int


@dataclass(frozen=True)
class RequestFinished(Event):
    request_id: str
    finish_reason: str
    num_output_tokens: int


@dataclass(frozen=True)
class BlocksAllocated(Event):
    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlocksFreed(Event):
    """Blocks whose reference count fell to zero (they may stay cached until reused)."""

    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlocksForked(Event):
    """A parallel-sampling sibling now shares these blocks of ``parent_id`` (ref count + 1); only
    with the prefix cache off (with it on, a sibling finds them as a ``PrefixCacheHit``)."""

    request_id: str
    parent_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockStored(Event):
    """A full block's chained digest entered the prefix cache."""

    block_id: int
    block_hash: bytes
    parent_hash: bytes | None  # None for a sequence's first block


@dataclass(frozen=True)
class BlockEvicted(Event):
    """A cached free block was reused for new tokens; its digest left the prefix cache."""

    block_id: int
    block_hash: bytes


@dataclass(frozen=True)
class PrefixCacheHit(Event):
    request_id: str
    num_cached_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class BatchRow:
    """One request's share of a step's batch, as the model runner lays it out (chapter 3).

    ``positions[i]`` is the position of the i-th token this request computes, and
    ``slot_mapping[i]`` the KV-cache slot its key and value are written to:
    ``block_table[position // block_size] * block_size + position % block_size``.
    """

    request_id: str
    is_prefill: bool
    positions: tuple[int, ...]
    slot_mapping: tuple[int, ...]
    block_table: tuple[int, ...]
    samples: bool  # its last known token is in this step, so a new token is sampled


@dataclass(frozen=True)
class BatchPrepared(Event):
    """The batch a step is about to run: decodes first, then prefill chunks (model order); built only when
    someone subscribes (it copies every index list), never kept in the history."""

    rows: tuple[BatchRow, ...]


@dataclass(frozen=True)
class StepFinished(Event):
    """One engine step: its batch and where its time went (seconds).

    A ``*_time`` per phase of ``engine/profiler.py`` (its docstring says what each holds); they
    do not overlap, and ``total_time`` beyond their sum is the engine's own bookkeeping. All but
    ``model_time`` is *host* time: Python and small tensor work that a GPU waits on.
    """

    num_prefill_tokens: int
    num_decode_tokens: int
    num_scheduled_requests: int
    num_preempted: int
    token_budget: int
    schedule_time: float
    prepare_time: float
    model_time: float
    sample_time: float
    total_time: float
    block_manager_time: float = 0.0
    update_time: float = 0.0
    detokenize_time: float = 0.0

    @classmethod
    def of(cls, step: int, batch, times: dict[str, float]) -> StepFinished:
        """The event of step ``step``, which ran ``batch`` (a ``SchedulerOutput``) in the profiler's ``times``."""
        return cls(step, batch.num_prefill_tokens, batch.num_decode_tokens, len(batch.scheduled),
                   len(batch.preempted), batch.token_budget, **times)

    @property
    def host_time(self) -> float:
        """Everything but the model: the overhead a faster model cannot remove."""
        return self.total_time - self.model_time


Observer = Callable[[Event], None]


class EventBus:
    """Fan events out to observers; keep a bounded history only for those who ask for one.

    The engine asks ``wants(EventType)`` before it builds an event, so with no observer and no
    history a step builds no events and its profiler reads no clock. The history (``keep_history()``)
    is off by default, since it would build and keep every request's events; while it is on, every
    event is wanted. An observer that raises becomes a warning; the step goes on.
    """

    def __init__(self) -> None:
        self._observers: list[tuple[Observer, tuple[type, ...] | None]] = []
        self.history: collections.deque[Event] = collections.deque(maxlen=0)

    def keep_history(self, maxlen: int = 10_000) -> collections.deque[Event]:
        """Keep the last ``maxlen`` events (0 turns the history off again); returns the history."""
        if isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen < 0:
            raise ValueError(f"maxlen must be a whole number of events >= 0, got {maxlen!r}")
        self.history = collections.deque(self.history, maxlen=maxlen)
        return self.history

    def subscribe(self, observer: Observer, *event_types: type) -> Callable[[], None]:
        """Register ``observer`` for every event, or for ``event_types`` only; returns an unsubscribe function."""
        if not callable(observer):
            raise TypeError(f"observer must be callable, got {observer!r}")
        bad = [t for t in event_types if not (isinstance(t, type) and issubclass(t, Event))]
        if bad:
            raise TypeError(f"event_types must be Event classes (e.g. StepFinished), got {bad!r}")
        entry = (observer, event_types or None)
        self._observers.append(entry)
        return lambda: self._observers.remove(entry) if entry in self._observers else None

    def wants(self, event_type: type, keep: bool = True) -> bool:
        """True when an event of ``event_type`` would reach an observer (or, with ``keep``, the history)."""
        if keep and self.history.maxlen:
            return True
        return any(types is None or issubclass(event_type, types) for _, types in self._observers)

    def emit(self, event: Event, keep: bool = True) -> None:
        """Send ``event`` to every observer that asked for it; ``keep=False`` leaves it out of the history."""
        if keep and self.history.maxlen:
            self.history.append(event)
        for observer, types in list(self._observers):
            if types is not None and not isinstance(event, types):
                continue
            try:
                observer(event)
            except Exception as exc:  # observers must never take the engine down
                warnings.warn(f"event observer {observer!r} raised {exc!r}", RuntimeWarning, stacklevel=2)
