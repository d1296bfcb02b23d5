"""Tensor parallelism, seen from the engine: a model runner whose model lives elsewhere (chapter 9).

With ``tensor_parallel_size=N`` the engine's process becomes the *driver*: it keeps the scheduler, the block
manager and the sampler, and sends each step's ``BatchPlan`` to N worker processes (``worker.py``, which lists
the messages) that hold the model's shards. The driver never joins a process group itself, so two engines can
live side by side in one program.

Sampling in the driver, as in ``ModelRunner`` (both are a ``SamplingRunner``), makes a seeded request give the
same tokens at any tensor-parallel size; greedy tokens match too, up to floating-point summation order
(row-parallel layers add partial sums across ranks).

Failure is loud and bounded (``WorkerGroup``): a worker that raises, dies or stops answering becomes a
``RuntimeError`` naming the rank and the cause, after every worker of the engine has been stopped. Workers
start with "spawn" (a fresh interpreter: safe with threads and CUDA), so a script that builds an
``LLM(tensor_parallel_size=N)`` must guard its top level with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing
import shutil
import signal
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from pathlib import Path

import numpy as np
import torch

from nanoengine.config import EngineConfig
from nanoengine.distributed.worker import WorkerSpec, default_num_threads, run_worker
from nanoengine.engine.model_runner import BatchPlan, SamplingRunner
from nanoengine.models.config import ModelConfig


def _split_sizes(model_config: ModelConfig) -> dict[str, int]:
    """Every size a rank must hold a whole share of, by name."""
    return {"attention heads": model_config.num_attention_heads,
            "KV heads": model_config.num_key_value_heads,
            "vocabulary size": model_config.vocab_size,
            "intermediate size": model_config.intermediate_size}


def allowed_tensor_parallel_sizes(model_config: ModelConfig) -> list[int]:
    """The sizes that divide heads, KV heads, vocabulary and MLP width: their common divisors."""
    common = math.gcd(*_split_sizes(model_config).values())
    return [d for d in range(1, common + 1) if common % d == 0]


def check_tensor_parallel_size(model_config: ModelConfig, tp_size: int, device: torch.device) -> None:
    """Refuse a split the model cannot take, before any process starts: a head never spans two ranks
    (attention then needs no communication), and the vocab and MLP are cut into equal slices."""
    sizes = _split_sizes(model_config)
    bad = [name for name, value in sizes.items() if value % tp_size]
    if bad:
        def named(names):
            return ", ".join(f"{name} ({sizes[name]})" for name in names)

        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide this model's {named(bad)}. Each rank must hold an "
            f"equal whole share of the {named(sizes)}, so the allowed tensor_parallel_size values are their "
            f"common divisors: {allowed_tensor_parallel_sizes(model_config)}")
    if device.type == "cuda" and torch.cuda.device_count() < tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} needs {tp_size} CUDA devices (one per rank), "
                         f"but {torch.cuda.device_count()} are visible")


class WorkerGroup:
    """The N worker processes, their pipes and their rendezvous folder; holds no reference to the runner, so
    ``weakref.finalize`` can close it when the runner is collected."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.tmpdir = Path(tempfile.mkdtemp(prefix="nanoengine-tp-"))
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.pids: list[int] = []  # kept after the process objects are closed
        self.conns: list[Connection] = []
        self.closed = False

    def start(self, spec: WorkerSpec, timeout_s: float) -> list[dict[str, int]]:
        """Spawn ranks 0..N-1 and wait until each has loaded; returns each rank's memory usage."""
        ctx = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=run_worker, args=(rank, theirs, spec), name=f"nanoengine-tp-rank{rank}",
                               daemon=True)
            proc.start()
            theirs.close()  # only the worker holds its end now: its death closes the pipe
            self.processes.append(proc)
            self.pids.append(proc.pid)
            self.conns.append(ours)
        usage: list[dict[str, int]] = [{} for _ in range(self.world_size)]
        waiting = set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        while waiting:
            for rank, message in self._next_messages(deadline, "to load the model", waiting):
                if message[0] != "ready":
                    self.fail([f"rank {rank} sent {message[0]!r} while loading"])
                usage[rank] = message[2]
                waiting.discard(rank)
        return usage

    def broadcast(self, message: tuple, timeout_s: float) -> None:
        """Send ``message`` to every rank; a dead rank, or one that stops reading, fails the group."""
        self.check_alive()
        sends = [_Send(conn, message) for conn in self.conns]
        deadline = time.monotonic() + timeout_s
        for send in sends:
            send.join(max(0.0, deadline - time.monotonic()))
        stuck = [str(rank) for rank, send in enumerate(sends) if send.is_alive()]
        if stuck:
            self.fail([f"rank {', '.join(stuck)} did not take a message within {timeout_s:.0f} s "
                       f"(alive, but not reading its pipe)"])
        for rank, send in enumerate(sends):
            if send.error is not None:  # its end is closed: it died between the check and the send
                self.fail(self._collect_failures(grace_s=1.0) or [f"rank {rank}: {send.error!r}"])

    def receive_logits(self, step_id: int, timeout_s: float) -> np.ndarray:
        """Rank 0's logits for ``step_id`` (a late answer to an abandoned step is dropped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for rank, message in self._next_messages(deadline, f"to answer step {step_id}", {0}):
                if message[0] == "logits" and message[1] == step_id:
                    return message[2]

    def _next_messages(self, deadline: float, doing: str, expected: set[int]):
        """Messages that arrive before ``deadline``; any error, death or timeout fails the group."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            ranks = ", ".join(str(r) for r in sorted(expected))
            self.fail([f"rank {ranks} took more than the time limit {doing} (still alive, not answering)"])
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        ready = wait(self.conns + list(sentinels), timeout=min(remaining, 1.0))
        messages = []
        for obj in ready:
            if obj in sentinels:  # a process exited; its last words (if any) are in the pipe
                self.fail(self._collect_failures(grace_s=1.0))
            rank = self.conns.index(obj)
            try:
                message = obj.recv()
            except (EOFError, OSError):
                self.fail(self._collect_failures(grace_s=1.0))
            if message[0] == "error":
                self.fail(self._collect_failures(grace_s=1.0, first=(rank, message[2])))
            messages.append((rank, message))
        return messages

    def check_alive(self) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel workers of this engine have been shut down; "
                               "create a new LLM / LLMEngine")
        if not all(p.is_alive() for p in self.processes):
            self.fail(self._collect_failures(grace_s=0.5))

    def _collect_failures(self, grace_s: float, first: tuple[int, str] | None = None) -> list[str]:
        """What went wrong on each rank: traceback texts sent, and deaths.

        Waits ``grace_s`` so a failure's consequences on other ranks (a peer's collective erroring out) arrive
        too; a rank that died without a word is listed first, as the likeliest cause, then errors as they came.
        """
        errors: dict[int, str] = {} if first is None else {first[0]: first[1]}
        deadline = time.monotonic() + grace_s
        while True:
            for rank, conn in enumerate(self.conns):
                with contextlib.suppress(EOFError, OSError):  # closed without a word: it shows up below as a death
                    while rank not in errors and conn.poll():
                        message = conn.recv()
                        if message[0] == "error":
                            errors[rank] = message[2]
            accounted = all(rank in errors or not p.is_alive() for rank, p in enumerate(self.processes))
            if accounted or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        deaths = [f"rank {rank} (pid {self.pids[rank]}) died {_exit_reason(proc.exitcode)} without reporting an error"
                  for rank, proc in enumerate(self.processes) if not proc.is_alive() and rank not in errors]
        raised = [f"rank {rank} (pid {self.pids[rank]}) raised {_last_line(text)}" for rank, text in errors.items()]
        tracebacks = [f"--- rank {rank} traceback ---\n{text.rstrip()}" for rank, text in errors.items()]
        return deaths + raised + tracebacks

    def fail(self, failures: list[str]) -> None:
        """Stop every worker, then raise one error that says which ranks failed and how."""
        self.close(timeout_s=1.0)  # the group is broken: no point waiting long for a clean exit
        detail = "\n".join(failures) if failures else "a worker stopped without giving a reason"
        raise RuntimeError(f"tensor-parallel worker failure (all {self.world_size} workers of this engine were "
                           f"stopped; create a new engine to continue):\n{detail}")

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask the workers to leave, wait ``timeout_s``, then terminate and kill what is left."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:  # in threads: a full pipe must not block the shutdown
            _Send(conn, ("shutdown",))
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self.conns:
            conn.close()
        for proc in self.processes:
            if not proc.is_alive():
                proc.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


class _Send(threading.Thread):
    """One message to one worker, sent from a daemon thread of its own (started at once): a big plan to a
    worker that stopped reading would block ``send`` for good, and here it only costs the caller's time limit
    (the thread ends, with an error, when the worker is killed and the pipe breaks)."""

    def __init__(self, conn: Connection, message: tuple) -> None:
        super().__init__(name="nanoengine-tp-send", daemon=True)
        self.conn, self.message = conn, message
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.conn.send(self.message)
        except Exception as exc:  # a broken pipe (the worker is gone) or a handle the driver closed
            self.error = exc


def _last_line(text: str) -> str:
    """The exception line of a traceback ("IndexError: index 7 is out of bounds ...")."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "an error without a message"


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "(still running)"
    killer = {s.value: s.name for s in signal.Signals}.get(-exitcode)  # a negative exit code names the signal
    return f"with exit code {exitcode}" + (f" (killed by {killer})" if killer else "")


class TensorParallelRunner(SamplingRunner):
    """``ModelRunner``'s interface over N worker processes; sampling stays here."""

    startup_timeout_s = 600.0  # loading a checkpoint in every rank
    step_timeout_s = 600.0  # one forward pass; a hung collective fails here instead of forever

    def __init__(self, source: str | Path, model_config: ModelConfig, config: EngineConfig,
                 max_model_len: int, num_blocks: int) -> None:
        tp_size = config.tensor_parallel_size
        device = config.torch_device
        check_tensor_parallel_size(model_config, tp_size, device)
        # The driver's device is the CPU: the requests' generators and the sampler live here.
        super().__init__(model_config, num_blocks, config.block_size, torch.device("cpu"), config.seed)
        self._step_id = 0
        self._workers = WorkerGroup(tp_size)
        self._finalizer = weakref.finalize(self, self._workers.close)
        spec = WorkerSpec(
            source=str(source), model_config=model_config, world_size=tp_size,
            store_path=str(self._workers.tmpdir / "rendezvous"), device_type=device.type,
            dtype=str(config.torch_dtype).removeprefix("torch."), num_blocks=self.num_blocks,
            block_size=config.block_size, max_position=max_model_len, seed=config.seed,
            num_threads=default_num_threads(tp_size), collective_timeout_s=self.step_timeout_s)
        try:
            self.rank_memory = self._workers.start(spec, self.startup_timeout_s)
        except BaseException:  # an interrupt while loading must not leave workers behind
            self.shutdown()
            raise

    @property
    def kv_cache_bytes(self) -> int:
        """The KV cache of all ranks together (each holds KV heads / tp of every block)."""
        return sum(report["kv_cache_bytes"] for report in self.rank_memory)

    @property
    def worker_pids(self) -> list[int]:
        return self._workers.pids

    def run_plan(self, plan: BatchPlan) -> torch.Tensor:
        """Send one step's plan to every rank; rank 0's logits of the sampled rows. -> (S, vocab)."""
        self._step_id += 1
        self._workers.broadcast(("execute", self._step_id, dataclasses.asdict(plan)), self.step_timeout_s)
        logits = self._workers.receive_logits(self._step_id, self.step_timeout_s)
        return torch.from_numpy(logits)

    run_model = run_plan  # what ``SamplingRunner`` runs a prepared step with: the trip through the pipes included

    def prepare_inputs(self, plan: BatchPlan) -> BatchPlan:
        """The plan is already what the workers receive: plain lists, pickled through the pipes."""
        return plan

    def memory_usage(self) -> dict[str, int | str]:
        """What the ranks reported after loading, added up (every rank's backend says the same of its copies)."""
        return {**{name: sum(report[name] for report in self.rank_memory)
                   for name in ("weight_bytes", "weight_copy_bytes", "kv_cache_bytes")},
                "weight_copies": self.rank_memory[0]["weight_copies"]}

    def shutdown(self) -> None:
        """Stop the workers and remove the rendezvous folder (safe to call more than once)."""
        self._finalizer()
