"""Decode step times and ``LLM()``'s build time of one engine, in a fresh process (results/README.md).

    OMP_NUM_THREADS=2 PYTHONPATH=$PWD .venv/bin/python scripts/measure_decode_steps.py LABEL

Run it alternately on two checkouts (each with its own ``PYTHONPATH``) to compare them: one
line per process, ``LABEL``, the build time of ``LLM()`` (imports included), then twice each
batch of 1 and 24 requests of 64 random-token prompts: the median of 40 decode steps in ms and
the time to the first token of every request in ms (``b1:<decode>/<prefill>``).
"""

import time

START = time.perf_counter()

import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from nanoengine import LLM, SamplingParams  # noqa: E402

llm = LLM()
build_s = time.perf_counter() - START
engine = llm.engine


def decode_steps(batch: int, steps: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(batch)
    ids = [engine.add_request(torch.randint(100, 40000, (64,), generator=gen).tolist(),
                              SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
           for _ in range(batch)]
    start = time.perf_counter()
    while any(engine.requests[i].num_output_tokens == 0 for i in ids):
        engine.step()
    prefill = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for i in ids:
        engine.abort(i)
    return statistics.median(times) * 1e3, prefill * 1e3


figures = []
for _ in range(2):
    for batch in (1, 24):
        decode, prefill = decode_steps(batch, 40)
        figures.append(f"b{batch}:{decode:.2f}/{prefill:.0f}")
print(sys.argv[1] if len(sys.argv) > 1 else "engine", f"LLM() {build_s:.2f}s", " ".join(figures), flush=True)
