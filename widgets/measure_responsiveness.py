"""Measure how fast the simulators react, on this machine, and print the numbers.

    python -m widgets.measure_responsiveness            # torch's default thread count
    python -m widgets.measure_responsiveness --threads 1

Targets (from the course's issue): a sampling-slider move redraws in under 200 ms with the
default model (its logits computed once per prompt); a scheduler step with a few requests
completes and redraws in under 1 s; with 64 requests on a 1,000-block engine the allocator
grid and the stepper still redraw quickly. Every time is wall-clock around the same call a
click or a slider move triggers in a notebook (the controller's work plus building the
view's content), without the browser's own painting.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Callable

import torch

from nanoengine import SamplingParams


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def report(name: str, times: list[float], target: float | None) -> bool:
    med, worst = statistics.median(times), max(times)
    ok = target is None or med < target
    verdict = "" if target is None else f"  target < {1000 * target:.0f} ms: {'PASS' if ok else 'FAIL'} (median)"
    print(f"  {name:<58} median {1000 * med:8.1f} ms   max {1000 * worst:8.1f} ms   n={len(times)}{verdict}")
    return ok


def machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",) * 3
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
            f"with {torch.get_num_threads()} threads, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")


def measure_playground(engine) -> bool:
    from widgets.sampling_playground import SamplingPlayground

    view = SamplingPlayground(engine, prompt="The capital of France is")
    calls = view.controller.num_logit_computations
    temps = iter([0.3, 0.5, 0.7, 0.9, 1.1, 1.3, 1.5, 1.7] * 4)
    ok = report("sampling: temperature slider move -> redraw",
                timed(lambda: setattr(view.temperature, "value", next(temps)), 24), 0.2)
    for name, values in (("top_k", [5, 10, 20, 40, 80, -1]), ("top_p", [0.5, 0.7, 0.9, 0.95, 1.0, 0.8]),
                         ("min_p", [0.05, 0.1, 0.2, 0.0, 0.02, 0.3])):
        slider, moves = getattr(view, name), iter(values * 3)
        ok &= report(f"sampling: {name.replace('_', '-')} slider move -> redraw",
                     timed(lambda: setattr(slider, "value", next(moves)), 18), 0.2)
    assert view.controller.num_logit_computations == calls, "a slider move ran the model"
    start = time.perf_counter()
    view.prompt.value = "Once upon a time, in a small village,"
    print(f"  {'sampling: new prompt (one model prefill + redraw)':<58} {1000 * (time.perf_counter() - start):8.1f} ms")
    return ok


def measure_stepper(engine) -> bool:
    from widgets.scheduler_stepper import SchedulerStepper

    view = SchedulerStepper(engine)
    prompts = ["Explain continuous batching in one sentence.", "Name three colours.",
               "Write a haiku about memory.", "What is a KV cache?"]
    for i, prompt in enumerate(prompts):
        view.controller.add_requests(prompt, SamplingParams(temperature=0.7, seed=i, max_tokens=12, ignore_eos=True))
    first = timed(view.step_button.click, 1)
    ok = report("scheduler: Step, 4 requests, prefill step (+ redraw)", first, 1.0)
    ok &= report("scheduler: Step, 4 requests decoding (+ redraw)", timed(view.step_button.click, 8), 1.0)
    view.reset_button.click()
    return ok


def measure_large(threads_note: str) -> bool:
    from widgets._common import tiny_engine
    from widgets.block_allocator import BlockAllocatorView
    from widgets.scheduler_stepper import SchedulerStepper

    engine = tiny_engine(num_kv_blocks=1000, block_size=16, max_model_len=256, max_num_seqs=64,
                         max_num_batched_tokens=16384)
    allocator = BlockAllocatorView(engine)
    for i in range(64):
        allocator.controller.add_request(120 + i, 16, shared_prefix=i % 2 == 0)
    while engine.snapshot().waiting:
        allocator.controller.step()
    snap = engine.snapshot()
    print(f"  (tiny model, {snap.num_blocks} blocks, {len(snap.running)} running requests, "
          f"{snap.num_blocks - snap.num_free_blocks} blocks in use{threads_note})")
    ok = report("allocator: full redraw (grid, contiguous bar, tables)", timed(allocator.refresh, 10), 1.0)
    stepper = SchedulerStepper(engine)
    ok &= report("stepper: redraw with 64 requests", timed(stepper.refresh, 10), 1.0)
    ok &= report("stepper: Step (64 decodes) + redraw", timed(stepper.step_button.click, 5), 1.0)
    ok &= report("allocator: Step (64 decodes) + redraw", timed(allocator.step_button.click, 5), 1.0)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before measuring")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from widgets._common import default_engine

    print(f"machine: {machine()}")
    start = time.perf_counter()
    engine = default_engine()
    print(f"default model loaded in {time.perf_counter() - start:.1f} s "
          f"({engine.snapshot().num_blocks} KV blocks of {engine.config.block_size} tokens)")
    ok = measure_playground(engine)
    ok &= measure_stepper(engine)
    ok &= measure_large("")
    print(f"machine after: {machine()}")
    print("all targets met" if ok else "some targets missed (see FAIL above; note the load average)")


if __name__ == "__main__":
    main()
