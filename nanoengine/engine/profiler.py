"""Where one engine step's time went, phase by phase (chapters 2 and 10).

To show which part of a step a faster engine must shrink, ``StepFinished`` reports the
step's time cut into disjoint phases:

=================  ==============================================================
``schedule``       the scheduler's own decisions
``block_manager``  every block-manager call (allocating while scheduling, caching
                   full blocks and freeing while updating)
``prepare``        planning the batch and building its tensors
``model``          the forward pass and the logits (a GPU is waited for)
``sample``         the sampler
``update``         appending tokens, stop checks, building outputs
``detokenize``     turning token ids into text
=================  ==============================================================

The code that does the work opens its phase: ``with profiler.phase("schedule"): ...``. Nested
time belongs to the innermost phase only (the block manager's is taken out of ``schedule``'s and
``update``'s), so the phases never overlap; the rest of the step's wall time is the engine's own
bookkeeping. Profiling reads the clock at every phase boundary, so it runs only for steps somebody
watches (``start(events.wants(StepFinished))``); a disabled profiler's ``phase`` measures nothing.
"""

from __future__ import annotations

import contextlib
import time

_clock = time.perf_counter  # the profiler's only clock (tests replace it to count its reads)

PHASES = ("schedule", "block_manager", "prepare", "model", "sample", "update", "detokenize")
_KNOWN = frozenset(PHASES)
_NO_PHASE = contextlib.nullcontext()  # what ``phase`` returns while profiling is off: measures nothing


class _Phase:
    __slots__ = ("profiler", "name")

    def __init__(self, profiler: "StepProfiler", name: str) -> None:
        self.profiler, self.name = profiler, name

    def __enter__(self) -> None:
        self.profiler._switch(self.name)

    def __exit__(self, *exc) -> bool:
        self.profiler._switch(None)
        return False


class StepProfiler:
    """Exclusive seconds per phase of the current step (see the module docstring)."""

    def __init__(self) -> None:
        self.enabled = False
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._open: list[str] = []  # phases entered and not yet left, innermost last
        self._since = 0.0  # when the innermost open phase last resumed
        self._step_start = 0.0

    def start(self, enabled: bool) -> None:
        """Begin a step; with ``enabled=False`` every phase of it is free and unmeasured."""
        self.enabled = enabled
        if enabled:
            self.seconds = dict.fromkeys(PHASES, 0.0)
            self._open.clear()
            self._step_start = self._since = _clock()

    def phase(self, name: str):
        """A context manager whose body's time (minus nested phases) is charged to ``name``."""
        if name not in _KNOWN:
            raise ValueError(f"unknown phase {name!r}; the phases are {', '.join(PHASES)}")
        return _Phase(self, name) if self.enabled else _NO_PHASE

    def finish(self) -> dict[str, float]:
        """End the step: its phases as ``StepFinished`` fields (``schedule_time`` ...) plus ``total_time``.
        Profiling stays off until the next ``start``: work between steps reads no clock."""
        if self._open:
            raise RuntimeError(f"phases still open at the end of the step: {self._open}")
        times = {f"{name}_time": seconds for name, seconds in self.seconds.items()}
        times["total_time"] = _clock() - self._step_start
        self.enabled = False
        return times

    def _switch(self, entering: str | None) -> None:
        """Charge the time since the last boundary to the innermost open phase, then enter or leave one."""
        now = _clock()
        if self._open:
            self.seconds[self._open[-1]] += now - self._since
        if entering is None:
            self._open.pop()
        else:
            self._open.append(entering)
        self._since = now


# For objects built without an engine (a block manager on its own): never started, so always off.
NO_PROFILER = StepProfiler()
