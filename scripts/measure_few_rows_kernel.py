"""How fast each way of multiplying a few rows by SmolLM2's weights streams them (results/README.md).

    .venv/bin/python scripts/measure_few_rows_kernel.py [float32|bfloat16]

For each weight shape of the default model (fused QKV, fused gate/up, down, the LM head), 30
weights of that shape (one LM head) so that they come from memory as in a decode step, and
1 to 16 rows of activations: GB/s of weights read by the few-rows kernel
(``kernels/cpu_gemv.py``), oneDNN's prepacked GEMM (``kernels/cpu_gemm.py``; plain
``F.linear`` where this CPU cannot pack the dtype) and MKL's ``F.linear``. Median of six
timed passes after one warm-up. This is the measurement behind ``cpu_gemv.MAX_ROWS``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from nanoengine.kernels import cpu_gemm, cpu_gemv

SHAPES = {(960, 576): 30, (3072, 576): 30, (576, 1536): 30, (49152, 576): 1}  # (out, in): how many
ROWS = (1, 2, 3, 4, 6, 8, 16)


def gb_per_s(product, weights, packed) -> float:
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for weight, pack in zip(weights, packed):
            product(weight, pack)
        times.append(time.perf_counter() - start)
    return sum(w.numel() * w.element_size() for w in weights) / statistics.median(times[1:]) / 1e9


def main() -> None:
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
    if not cpu_gemv.load():
        raise SystemExit("the few-rows kernel is not available here (see the warning above)")
    print(f"{dtype}, {torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    torch.manual_seed(0)
    with torch.inference_mode():
        for (out_features, in_features), count in SHAPES.items():
            weights = [torch.randn(out_features, in_features, dtype=dtype) for _ in range(count)]
            packed = [cpu_gemm.pack_weight(w) for w in weights]
            cells = []
            for rows in ROWS:
                x = torch.randn(rows, in_features, dtype=dtype)
                kernel = gb_per_s(lambda w, p: cpu_gemv.few_rows_linear(x, w), weights, packed)
                library = gb_per_s(lambda w, p: cpu_gemm.linear(x, w, None, p), weights, packed)
                mkl = gb_per_s(lambda w, p: F.linear(x, w), weights, packed)
                cells.append(f"{rows} rows: kernel {kernel:.1f} packed {library:.1f} F.linear {mkl:.1f}")
            print(f"({out_features}, {in_features}) x{count} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
