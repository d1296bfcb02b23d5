"""Decode step times of the CPU forward modes in one engine, toggled in place (results/README.md).

    OMP_NUM_THREADS=2 NANOENGINE_HUGE_PAGE_SECONDS=inf PYTHONPATH=$PWD .venv/bin/python \
        scripts/measure_forward_modes_in_process.py

The companion of ``measure_forward_modes.py`` without its noise between processes (where each
process's weights land in huge pages or not): one default engine, its weights moved once, and
the backend's two switches (``run_compiled``, ``fuse_layers``: the model compiled whole, the
one-call layers eager, the Python layers eager) set in turn. For batches of 1 and 24 requests
of 64-token prompts, the median of 40 decode steps per mode, 3 rounds alternating the modes.
"""

import statistics
import time

import torch

from nanoengine import LLM, SamplingParams
from nanoengine.backends import cpu_platform

llm = LLM()
eng = llm.engine
b = eng.runner.backend
print("forward", eng.forward_mode, "huge pages MiB", cpu_platform.huge_page_bytes() >> 20, "of weights", b.weight_bytes >> 20)

MODES = {"compiled": (True, True), "eager-fused": (False, True), "eager-python": (False, False)}


def set_mode(m):
    b.run_compiled, b.fuse_layers = MODES[m]


def decode_steps(batch, steps):
    gen = torch.Generator().manual_seed(batch)
    ids = [eng.add_request(torch.randint(100, 40000, (64,), generator=gen).tolist(),
                           SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)) for _ in range(batch)]
    while any(eng.requests[i].num_output_tokens == 0 for i in ids):
        eng.step()
    ts = []
    for _ in range(steps):
        t = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t)
    for i in ids: eng.abort(i)
    return statistics.median(ts) * 1e3


res = {}
for rnd in range(3):
    for batch in (1, 24):
        for m in MODES:
            set_mode(m)
            res.setdefault((batch, m), []).append(decode_steps(batch, 40))
for (batch, m), v in res.items():
    print(f"batch {batch:2d} {m:13s} decode step ms per round: {', '.join(f'{x:.2f}' for x in v)}  median {statistics.median(v):.2f}")
