"""The native decode attention kernel's time in the build this process loads (results/README.md).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/measure_decode_attention.py               # AVX-512 build, where the CPU has it
    OMP_NUM_THREADS=2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python scripts/measure_decode_attention.py   # the AVX2 build

SmolLM2's attention (9 query heads over 3 KV heads of 64, 16-token blocks), one layer's decode
attention for 1 and 32 sequences, float32 and bfloat16 caches: the median of the timed calls. Run
the two commands in turn, a few rounds, to compare the builds: this is the measurement behind
building the kernels for AVX-512 where the CPU has it (engine v4 keeps a second instruction set
only where it buys 10% or more). Both builds compute the same bits (tests/engine/test_cpu_native.py).
"""

from __future__ import annotations

import statistics
import time

import torch

from nanoengine.kernels import cpu_native

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CASES = ((1, 160, torch.float32, 3000), (32, 250, torch.float32, 100), (32, 250, torch.bfloat16, 100))


def decode_call(seqs: int, context: int, dtype: torch.dtype):
    """A function running one layer's decode attention for ``seqs`` sequences of ``context`` tokens."""
    blocks = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    k_cache, v_cache = (torch.randn(seqs * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))
    query = torch.randn(seqs, HEADS, HEAD_DIM).to(dtype)
    tables = torch.arange(seqs * blocks, dtype=torch.int32).reshape(seqs, blocks)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    return lambda: cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5)


def median_seconds(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    if not cpu_native.load():
        raise SystemExit("needs the native kernels")
    torch.manual_seed(0)
    print(f"build {cpu_native.isa()}, {torch.get_num_threads()} threads")
    for seqs, context, dtype, calls in CASES:
        seconds = median_seconds(decode_call(seqs, context, dtype), calls)
        print(f"decode {seqs} x {context} {str(dtype).removeprefix('torch.')}: {seconds * 1e6:.1f} us")


if __name__ == "__main__":
    main()
