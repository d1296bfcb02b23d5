"""The decode attention kernel's AVX-512 functions against its AVX2 ones, on an AVX-512 CPU (results/README.md).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/measure_avx512.py

Both compute the same bits (checked here too); the question is only time. SmolLM2's attention
(9 query heads over 3 KV heads of 64, 16-token blocks), one layer's decode attention for 1 and 32
sequences, float32 and bfloat16 caches: median of the timed calls, three rounds alternating
the two paths, and the ratio AVX2 / AVX-512 per round. This is the measurement behind keeping the
AVX-512 functions of ``csrc/paged_decode_attention.cpp`` (engine v4 keeps a second instruction
set only where it buys 10% or more).
"""

from __future__ import annotations

import statistics
import time

import torch

from nanoengine.kernels import cpu_native

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CASES = ((1, 160, torch.float32, 400), (32, 250, torch.float32, 100), (32, 250, torch.bfloat16, 100))


def decode_call(seqs: int, context: int, dtype: torch.dtype):
    """A function running one layer's decode attention for ``seqs`` sequences of ``context`` tokens."""
    blocks = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    k_cache, v_cache = (torch.randn(seqs * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))
    query = torch.randn(seqs, HEADS, HEAD_DIM).to(dtype)
    tables = torch.arange(seqs * blocks, dtype=torch.int32).reshape(seqs, blocks)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    return lambda wide: cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5,
                                                          avx512=wide)


def median_seconds(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    flags = open("/proc/cpuinfo").read()
    if not cpu_native.load() or " avx512f " not in flags:
        raise SystemExit("needs the native kernels and a CPU with AVX-512")
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads")
    for seqs, context, dtype, calls in CASES:
        attend = decode_call(seqs, context, dtype)
        assert torch.equal(attend(True), attend(False)), "the two paths must give the same bits"
        rounds = [(median_seconds(lambda: attend(True), calls), median_seconds(lambda: attend(False), calls))
                  for _ in range(3)]
        ratios = ", ".join(f"{avx2 / wide:.2f}" for wide, avx2 in rounds)
        print(f"decode {seqs} x {context} {str(dtype).removeprefix('torch.')}: AVX-512 "
              f"{statistics.median(w for w, _ in rounds) * 1e6:.1f} us, AVX2 {statistics.median(a for _, a in rounds) * 1e6:.1f}"
              f" us; AVX2 / AVX-512 per round {ratios}")


if __name__ == "__main__":
    main()
