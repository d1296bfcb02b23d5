"""The CPU platform: every host setting a CPU engine and its server make, in one module (chapters 10 and 12).

vLLM keeps these in ``vllm/platforms/cpu.py``. Each setting, and why (what each bought: ``results/README.md``):

* Freed memory kept (``keep_freed_memory``): every step allocates the same large temporaries, which glibc
  would otherwise ``mmap`` and unmap, so each step faulted every page in again; the price is that the peak
  working set stays (glibc only; never over the user's ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``).
* Weights in huge pages (``move_to_huge_pages``: fewer TLB misses, chapter 10): PyTorch's allocator never asks.
* Freed memory given back when idle (``IdleTrim``): the holes that steps of ever-different shapes leave in the
  heap make a server's memory creep up for hours (``NANOENGINE_TRIM_WHEN_IDLE=0``: off).
* oneDNN's shape caches bounded (``bound_shape_caches``): a server meets a new row count with nearly every prefill.
* A server's engine core with its OpenMP spin bounded (``engine_core_environment``), one OpenMP team per
  process (``build_on_a_passing_thread``), the front end's priority lowered (``serving``): chapter 12, section 3.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import os
import platform
import re
import time
from pathlib import Path
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's maximum on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024  # a round figure far above what a step frees, so no step trims
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

# Entries each shape cache keeps: every row count of a decode batch (one product per linear
# layer shape, five shapes) stays cached beside the prefills of the last few steps.
SHAPE_CACHE_ENTRIES = 128
SHAPE_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_shape_caches() -> dict[str, str]:
    """Bound oneDNN's two caches of per-shape primitives; a value the user set stays. Returns the variables."""
    return {name: os.environ.setdefault(name, str(SHAPE_CACHE_ENTRIES)) for name in SHAPE_CACHE_VARIABLES}


def on_glibc() -> bool:
    """Whether this process runs on Linux with glibc, the ``malloc`` this module tunes."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@functools.lru_cache(maxsize=None)
def glibc() -> ctypes.CDLL | None:
    """The C library, loaded once, where it is glibc; None elsewhere or if it cannot be loaded."""
    if not on_glibc():
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
    """Apply the two settings once per process. Returns whether they are in force."""
    if not on_glibc() or any(name in os.environ for name in USER_VARIABLES):
        return False  # not glibc, or the user tuned malloc themselves
    libc = glibc()
    try:
        return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
            bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    except AttributeError:
        return False


TRIM_VARIABLE = "NANOENGINE_TRIM_WHEN_IDLE"
# How long a server's engine must have had nothing to do before it gives freed memory back: longer
# than the gaps between a client's requests (what a trim costs the next request: results/README.md).
TRIM_AFTER_IDLE_S = 1.0


def trim_when_idle() -> bool:
    """Whether the engine core gives freed memory back when it goes idle: ``TRIM_VARIABLE`` 1 (default) or 0."""
    text = os.environ.get(TRIM_VARIABLE, "1")
    if text not in ("0", "1"):
        raise ValueError(f"{TRIM_VARIABLE} must be 1 (give freed memory back when the engine goes idle, the "
                         f"default) or 0 (keep it), got {text!r}")
    return text == "1"


def release_free_heap() -> bool:
    """Give every whole free page of glibc's heaps back to the kernel (``malloc_trim(0)``);
    whether any went back (a no-op, False, where the C library is not glibc)."""
    libc = glibc()
    return libc is not None and bool(libc.malloc_trim(0))


class IdleTrim:
    """When an engine's loop gives freed memory back: once per idle period, after it has stepped and then had
    nothing to do for ``TRIM_AFTER_IDLE_S``. Built where the loop starts, so a bad ``TRIM_VARIABLE`` fails there."""

    def __init__(self) -> None:
        self.enabled = trim_when_idle()
        self.stepped = False  # the engine stepped since the last trim

    def idle(self, wait_for_work: Callable[[float | None], bool]) -> None:
        """Sleep until work may have arrived: ``wait_for_work(timeout)`` (None: no limit) returns
        False when the timeout passed without any. Trims first if the engine stepped since the last
        trim and the first ``TRIM_AFTER_IDLE_S`` pass without work."""
        if self.enabled and self.stepped:
            if wait_for_work(TRIM_AFTER_IDLE_S):
                return
            release_free_heap()
            self.stepped = False
        wait_for_work(None)


HUGE_PAGE_BYTES = 2 * 1024 * 1024  # the size of a transparent huge page on x86-64
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ALIGNMENT = 64  # each tensor's start in the region: a cache line (the kernels' vector loads)
# How long the CPU backend lets the move take at load (finding contiguous memory may take the kernel seconds)
# unless the environment variable says otherwise: seconds, or "inf" for no limit. Chosen: results/README.md.
MOVE_BUDGET_S = 1.0
MOVE_BUDGET_VARIABLE = "NANOENGINE_HUGE_PAGE_SECONDS"


def move_budget() -> float | None:
    """The move's budget in seconds (None: no limit), from ``MOVE_BUDGET_VARIABLE`` or ``MOVE_BUDGET_S``."""
    text = os.environ.get(MOVE_BUDGET_VARIABLE)
    if text is None:
        return MOVE_BUDGET_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:
        raise ValueError(f"{MOVE_BUDGET_VARIABLE} must be a number of seconds >= 0 (0: no weights in huge pages) "
                         f"or 'inf' (no limit), got {text!r}")
    return None if seconds == float("inf") else seconds


def wait_for_all_huge_pages() -> None:
    """Let this process's engines (and the processes it starts) move all their weights, however long it takes,
    unless the user set ``MOVE_BUDGET_VARIABLE``: a server or a benchmark runs long enough to repay the wait."""
    os.environ.setdefault(MOVE_BUDGET_VARIABLE, "inf")


def huge_pages_unavailable() -> str | None:
    """Why this machine cannot back memory with transparent huge pages, or None when it can."""
    if platform.system() != "Linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return f"transparent huge pages are Linux's ({platform.system()} here)"
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return f"this kernel has no transparent huge pages ({THP_SETTING} cannot be read)"
    if "[never]" in setting:
        return f"transparent huge pages are off on this machine ([never] in {THP_SETTING})"
    return None


_REGION_SPANS: list[tuple[int, int]] = []  # the address ranges move_to_huge_pages has mapped in this process


def bytes_in_huge_page_regions(tensors) -> int:
    """How many bytes of ``tensors`` start in a region advised to use huge pages (``move_to_huge_pages``)."""
    return sum(t.numel() * t.element_size() for t in tensors
               if any(lo <= t.data_ptr() < hi for lo, hi in _REGION_SPANS))


def move_to_huge_pages(tensors: list[torch.Tensor], budget_s: float | None = None) -> int:
    """Copy CPU ``tensors`` (parameters) into one huge-page region; returns the bytes moved.

    Each tensor's ``.data`` becomes a view of the region holding the same values, so whatever holds the
    tensor sees the move. Tensors not on the CPU, not contiguous, or given twice stay; so does everything
    when ``huge_pages_unavailable()`` names a reason. Smallest first; none starts moving after ``budget_s``.
    """
    if huge_pages_unavailable() is not None:
        return 0
    unique = {id(t): t for t in tensors}.values()
    movable = sorted((t for t in unique if t.device.type == "cpu" and t.layout == torch.strided
                      and t.is_contiguous() and t.numel() > 0), key=lambda t: t.numel() * t.element_size())
    nbytes = [t.numel() * t.element_size() for t in movable]
    padded = [-(-n // ALIGNMENT) * ALIGNMENT for n in nbytes]  # each next tensor starts on a cache line
    if not movable:
        return 0
    try:  # an anonymous mapping a huge page longer than the tensors, so that they start on a 2 MiB boundary
        mapping = mmap.mmap(-1, sum(padded) + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages rejects the advice: nothing moves
        return 0
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    _REGION_SPANS.append((whole.data_ptr(), whole.data_ptr() + whole.numel()))
    region = whole[-whole.data_ptr() % HUGE_PAGE_BYTES:]
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    offset = moved = 0
    with torch.no_grad():
        for t, n, size in zip(movable, nbytes, padded):
            if deadline is not None and time.perf_counter() >= deadline:
                break  # the pages the region did not use were never touched: they cost nothing
            view = region[offset:offset + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.data = view
            offset += size
            moved += n
    return moved


def huge_page_bytes() -> int:
    """How many bytes of this process's memory the kernel backs with huge pages now (fewer than asked for
    where free memory is fragmented): ``AnonHugePages`` of ``/proc/self/smaps_rollup``, 0 if unreadable."""
    try:
        rollup = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0
    found = re.search(r"AnonHugePages:\s+(\d+) kB", rollup)
    return int(found.group(1)) * 1024 if found else 0


def tune_engine_process() -> None:
    """Freed memory kept, and oneDNN's shape caches bounded before the process's first oneDNN product
    (which reads them): applied by the CPU backend when it is built."""
    keep_freed_memory()
    bound_shape_caches()


ENGINE_CORE_SPINCOUNT = 10_000  # GNU OpenMP's spin count for the engine core's threads (chosen: results/README.md)
# How much lower the server's own process runs than its engine core (``os.nice``: a higher niceness is a
# smaller share of a contended CPU; chosen: results/README.md).
FRONT_END_NICENESS = 5


@contextlib.contextmanager
def engine_core_environment():
    """Around starting the engine core's process: GNU OpenMP's spin count set, unless the user chose one.

    Only around ``Process.start``: the spawned process inherits ``os.environ`` then and its OpenMP
    reads it when it loads, while this process's OpenMP, loaded long before, keeps its own.
    """
    chosen = "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ
    if not chosen:
        os.environ["GOMP_SPINCOUNT"] = str(ENGINE_CORE_SPINCOUNT)
    try:
        yield
    finally:
        if not chosen:
            del os.environ["GOMP_SPINCOUNT"]


def build_on_a_passing_thread(build: Callable[[], T]) -> T:
    """``build()`` on a thread that ends when it returns: its result, or its exception raised here.

    Load a model this way when another thread will step it: the OpenMP team that loading starts
    ends with the loading thread, so the stepping thread's team is the process's only one.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoengine-load") as loader:
        return loader.submit(build).result()  # leaving the block joins the thread


@contextlib.contextmanager
def serving(engine_in_own_process: bool):
    """``serve``'s host settings, around building its engine: every weight moved to huge pages however long it
    takes (inherited by the engine core's process), and, once that runs apart, this process's priority lowered."""
    wait_for_all_huge_pages()
    yield
    if engine_in_own_process:
        os.nice(FRONT_END_NICENESS)
