"""The native CPU kernels against the paths they replace, on SmolLM2's shapes (results/README.md).

    .venv/bin/python scripts/measure_native_kernels.py [float32|bfloat16]

Few rows times a weight:
For each weight shape of the default model (fused QKV, fused gate/up, down, the LM head), 30
weights of that shape (one LM head) so that they come from memory as in a decode step, and
1 to 16 rows of activations: GB/s of weights read by the few-rows kernel
(``kernels/cpu_native.py``), oneDNN's prepacked GEMM (``kernels/cpu_gemm.py``; plain
``F.linear`` where this CPU cannot pack the dtype) and MKL's ``F.linear``. Median of six
timed passes after one warm-up. This is the measurement behind ``cpu_native.MAX_ROWS``.

Decode attention: one decode step's 30 layers of SmolLM2's attention (9 query heads, 3 KV heads,
64-wide, 16-token blocks) for 1 and 24 sequences of a given context, by the native kernel and by
the reference (``kernels/reference.py``, what the CPU backend runs without the native kernels), in
ms per step (median of 5).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from nanoengine.kernels import cpu_gemm, cpu_native, reference

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
    if not cpu_native.load():
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
                kernel = gb_per_s(lambda w, p: cpu_native.few_rows_linear(x, w), weights, packed)
                library = gb_per_s(lambda w, p: cpu_gemm.linear(x, w, None, p), weights, packed)
                mkl = gb_per_s(lambda w, p: F.linear(x, w), weights, packed)
                cells.append(f"{rows} rows: kernel {kernel:.1f} packed {library:.1f} F.linear {mkl:.1f}")
            print(f"({out_features}, {in_features}) x{count} | " + " | ".join(cells))
        for seqs, context in ((1, 100), (1, 1000), (24, 300)):
            native, plain = attention_ms(dtype, seqs, context)
            print(f"decode attention, {seqs} sequence(s) x {context} tokens, 30 layers: native {native:.2f} ms, "
                  f"reference {plain:.2f} ms")


def attention_ms(dtype, seqs: int, context: int, layers: int = 30) -> tuple[float, float]:
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    blocks_per_seq = -(-context // block_size)
    k_cache = torch.randn(seqs * blocks_per_seq, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(seqs * blocks_per_seq).view(seqs, blocks_per_seq).int()
    lens = torch.full((seqs,), context, dtype=torch.int32)
    query = torch.randn(seqs, heads, head_dim, dtype=dtype)

    def step_ms(attend) -> float:
        times = []
        for _ in range(6):
            start = time.perf_counter()
            for _ in range(layers):
                attend()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:]) * 1e3

    native = step_ms(lambda: cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125))
    plain = step_ms(lambda: reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125))
    return native, plain


if __name__ == "__main__":
    main()
