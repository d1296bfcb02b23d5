"""Prepacked weights for the CPU's matrix multiplies (chapter 10: layout is performance).

A GEMM library does not multiply matrices in the layout it is handed. It first copies
("packs") panels of each operand into small blocked tiles that fit the CPU's registers
and caches, then runs its micro-kernel over the tiles. ``F.linear`` hands every call to
MKL's ``sgemm`` with the weight in PyTorch's plain row-major layout, so the weight is
re-packed on every call. In a decode step that is most of the work: the activations are
a few rows, the weights are the whole model (540 MB for SmolLM2-135M in fp32).

An inference engine's weights never change, so the packing can be done once. oneDNN
(the CPU kernel library bundled with PyTorch) can reorder a weight into its own blocked
layout ahead of time (``pack_weight``) and multiply by it directly (``packed_linear``).
On the model's own shapes, packed weights make a step's GEMMs faster at every batch
size measured, most for a few dozen to a few hundred tokens, and the large LM head most
of all (the figures: ``results/README.md``).

This is the CPU path only (float32 or bfloat16 weights on a CPU, PyTorch built with oneDNN;
bfloat16 where oneDNN has bfloat16 kernels for this CPU, natively with avx512_bf16 or AMX).
Everything
else keeps ``F.linear``; ``pack_weight`` returns None when packing is not possible, and
callers fall back. The packed copy is a snapshot: a model's weights must not change
after its engine has packed them. It is also a copy: the dense weights stay (loading,
tensor-parallel slicing and the notebooks read them), so the weights take twice their
memory (measured: +523 MiB resident for SmolLM2-135M's 513 MiB of fp32 weights).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this PyTorch build has oneDNN and its prepacked linear operators for ``dtype``.

    Probed by packing and multiplying a tiny matrix: a build or CPU without the kernels
    raises (or, for bfloat16 on a CPU oneDNN has no bfloat16 path for, answers wrongly),
    and the caller keeps plain ``F.linear``.
    """
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        probe = torch.ones(2, 3, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(probe)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 3, dtype=dtype), packed, None, "none", [], "")
    except (AttributeError, RuntimeError):  # an older or oneDNN-less build: plain F.linear
        return False
    return bool(torch.equal(out, torch.full((1, 2), 3.0, dtype=dtype)))


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight (out_features, in_features) reordered for oneDNN, or None if not possible."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not packing_available(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed with the packed weight. x (..., in_features)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:  # oneDNN rejects empty inputs; the answer is empty anyway
        return x.new_empty(*x.shape[:-1], out_features)
    out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out_features)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, one_row_packed: bool = True) -> torch.Tensor:
    """y = x W^T + b, with the packed copy of W when there is one and it is the faster way.

    ``one_row_packed``: whether a one-row product (one sequence decoding) should use the
    packed copy too; ``tune_single_row`` measures which way is faster on this CPU.
    """
    if packed is None or x.dtype != weight.dtype or (x.numel() == x.shape[-1] and not one_row_packed):
        return F.linear(x, weight, bias)
    return packed_linear(x, packed, weight.shape[0], bias)


def tune_single_row(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[tuple[int, int], bool]:
    """Time one-row products (a decode step of one sequence) both ways for each weight shape.

    ``pairs`` are (weight, packed copy). A single row is a matrix-vector product: it only
    streams the weight once, and which library streams faster depends on the CPU: on one
    machine MKL's plain ``F.linear`` won on every layer weight, on another the packed LM
    head won (``results/README.md``). So each shape is timed over every weight of that
    shape in turn (so the weights come from memory, as in a real step). Returns
    {shape: packed is faster}; the caller (one engine's CPU backend) keeps the answer, so
    one engine's decision never changes another's path.
    """
    import time
    from collections import defaultdict

    groups = defaultdict(list)
    for weight, packed in pairs:
        groups[tuple(weight.shape)].append((weight, packed))
    decided = {}
    with torch.inference_mode():
        for shape, group in groups.items():
            x = torch.randn(1, shape[1], dtype=group[0][0].dtype)

            def best(product) -> float:
                times = []
                for _ in range(4):  # the first pass warms up; the minimum of the rest
                    start = time.perf_counter()
                    for weight, packed in group:
                        product(weight, packed)
                    times.append(time.perf_counter() - start)
                return min(times[1:])

            plain = best(lambda weight, packed: F.linear(x, weight))
            packed_time = best(lambda weight, packed: packed_linear(x, packed, shape[0]))
            decided[shape] = packed_time < plain
    return decided
