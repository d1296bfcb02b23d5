"""One tensor-parallel worker process: a rank's share of the model and KV cache (chapter 9).

``TensorParallelRunner`` (the driver, in the engine's process) spawns one per rank. Each worker joins a
torch.distributed group (gloo on CPU, NCCL on CUDA) through a ``FileStore`` in a folder the driver made for
this engine alone; loads the model with its ``TPGroup``, so each parallel layer keeps only this rank's slice;
builds a ``ModelRunner``, whose KV cache holds this rank's ``KV heads / tp``; and serves the driver::

    driver -> every rank   ("execute", step id, {BatchPlan fields as plain lists})
    rank 0 -> driver       ("logits", step id, numpy float32 array (S, vocab))
    any rank -> driver     ("ready", rank, memory usage)     once, after loading
    any rank -> driver     ("error", rank, traceback text)    then it exits
    driver -> every rank   ("shutdown",)

The step id lets the driver drop a late answer to a step it stopped waiting for (an interrupted ``generate``).
All ranks run the same forward on the same plan, in lock step through the layers' collectives. A worker never
outlives its driver: when the driver's end of the pipe closes, ``recv`` raises ``EOFError`` and it leaves.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from nanoengine.backends import select_backend
from nanoengine.distributed.parallel_state import TPGroup
from nanoengine.engine.model_runner import BatchPlan, ModelRunner
from nanoengine.loader.weights import load_model
from nanoengine.models.config import ModelConfig


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to set itself up: plain, picklable data only."""

    source: str  # the model directory or .gguf file
    model_config: ModelConfig
    world_size: int
    store_path: str  # FileStore file inside the driver's fresh temporary folder
    device_type: str  # "cpu" or "cuda"; rank r uses cuda:r
    dtype: str  # a torch dtype name, e.g. "float32"
    num_blocks: int  # KV blocks per rank (each block holds this rank's KV heads only)
    block_size: int
    max_position: int
    seed: int
    num_threads: int  # CPU threads per rank, so N ranks do not oversubscribe the cores
    collective_timeout_s: float  # a collective waiting longer than this fails instead of hanging


def run_worker(rank: int, conn: Connection, spec: WorkerSpec) -> None:
    """Process entry point. Reports any failure to the driver as text, then exits with 1."""
    # Ctrl-C in a terminal reaches every process of the foreground group; the driver owns the workers and decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        runner = _setup(rank, spec)
        conn.send(("ready", rank, runner.memory_usage()))
        _serve(rank, conn, runner)
    except (EOFError, ConnectionError):
        pass  # the driver closed its end or died: nobody is left to answer
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", rank, traceback.format_exc()))
        # Leave at once: tearing down a group whose peers may be stuck in a collective can itself hang.
        os._exit(1)
    with contextlib.suppress(Exception):  # leaving is best effort: the process is about to exit anyway
        if dist.is_initialized():
            dist.destroy_process_group()
    conn.close()
    # Skip the interpreter's teardown (seconds of freeing a loaded torch): nothing here needs it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _setup(rank: int, spec: WorkerSpec) -> ModelRunner:
    if spec.device_type == "cuda":
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
    else:
        torch.set_num_threads(spec.num_threads)
        device, backend = torch.device("cpu"), "gloo"
    store = dist.FileStore(spec.store_path, spec.world_size)
    # The default group: every worker is a process of its own, so "global" here is exactly this engine's ranks.
    dist.init_process_group(backend, store=store, rank=rank, world_size=spec.world_size,
                            timeout=datetime.timedelta(seconds=spec.collective_timeout_s))
    tp = TPGroup(rank, spec.world_size, dist.group.WORLD)
    dtype = getattr(torch, spec.dtype)
    backend = select_backend(device, dtype=dtype)  # first: the layers take their kernels from it
    net = load_model(Path(spec.source), spec.model_config, device, dtype, max_position=spec.max_position, tp=tp,
                     backend=backend)
    return ModelRunner(net, spec.model_config, spec.num_blocks, spec.block_size, device, dtype, spec.seed, backend)


def _serve(rank: int, conn: Connection, runner: ModelRunner) -> None:
    while True:
        message = conn.recv()
        kind = message[0]
        if kind == "shutdown":
            return
        if kind != "execute":
            raise ValueError(f"worker rank {rank} got an unknown message {kind!r}")
        _, step_id, fields = message
        plan = BatchPlan(**fields)
        logits = runner.run_model(runner.prepare_inputs(plan))  # (S, vocab) float32
        if rank == 0:  # every rank holds the gathered logits; one answer is enough
            conn.send(("logits", step_id, logits.cpu().numpy()))


def default_num_threads(world_size: int) -> int:
    """CPU threads per rank: the machine's cores shared out, at least one each."""
    return max(1, (os.cpu_count() or 1) // world_size)
