"""Time torch.distributed's all-reduce itself between CPU processes (chapter 9, section 9).

``time_allreduce`` starts ``world_size`` fresh processes, joins them in a gloo group through a
file store (as the engine's tensor-parallel workers join theirs, ``nanoengine/distributed/
worker.py``), gives each ``threads`` CPU threads, and times ``repeats`` all-reduces (sum) of a
float32 tensor of each requested shape after ``warmup`` untimed ones. Rank 0's times come back;
an all-reduce returns on every rank only when all have contributed, so rank 0's clock sees the
whole collective. gloo moves the bytes over TCP on the loopback interface: every all-reduce is
several system calls and wake-ups of processes that share the machine's cores.

The readings of chapter 9 that use these times live beside it in ``widgets.exercises.ch09``.
"""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch.multiprocessing as mp

from translations import tr


@dataclass(frozen=True)
class AllReduceTiming:
    """Rank 0's times of one tensor shape's all-reduces, in seconds."""

    world_size: int
    shape: tuple[int, ...]
    threads: int
    runs: tuple[float, ...]

    @property
    def bytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return 4 * n  # float32

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def describe(self) -> str:
        return tr("all-reduce of a float32 {shape} tensor ({bytes:,} bytes), gloo, {world_size} processes x "
                  "{threads} thread(s): {median:.0f} µs median (IQR {q1:.0f}-{q3:.0f} µs) over {n} runs",
                  shape=self.shape, bytes=self.bytes, world_size=self.world_size, threads=self.threads,
                  median=1e6 * self.median, q1=1e6 * _q(self.runs, 0.25), q3=1e6 * _q(self.runs, 0.75), n=len(self.runs))


def _q(values, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _rank(rank: int, world_size: int, store_path: str, shapes, warmup: int, repeats: int, threads: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    results = []
    for shape in shapes:
        x = torch.ones(shape)  # e.g. (tokens, hidden): one row-parallel layer's partial output
        for _ in range(warmup):
            dist.all_reduce(x)
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(x)
            runs.append(time.perf_counter() - start)
        results.append(runs)
    dist.barrier()
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def time_allreduce(shapes: list[tuple[int, ...]], world_size: int = 2, threads: int = 1, warmup: int = 20,
                   repeats: int = 200) -> list[AllReduceTiming]:
    """All-reduce times between ``world_size`` fresh CPU processes, one ``AllReduceTiming`` per shape."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="allreduce-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, world_size, store_path, shapes, warmup, repeats, threads, out),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        results = out.get()
        for p in procs:
            p.join(timeout=60)
    return [AllReduceTiming(world_size, tuple(shape), threads, tuple(runs)) for shape, runs in zip(shapes, results)]


__all__ = ["AllReduceTiming", "time_allreduce"]
