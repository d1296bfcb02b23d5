"""Prepacked weights for the CPU's matrix multiplies (chapter 10: layout is performance).

A GEMM library first copies ("packs") panels of each operand into blocked tiles that fit the CPU's
registers and caches. ``F.linear`` hands MKL's ``sgemm`` the weight in PyTorch's row-major layout,
so it is re-packed on every call: in a decode step, whose activations are a few rows, most of the
work. Weights never change, so oneDNN (bundled with PyTorch) reorders each one once
(``pack_weight``) and multiplies by it directly (``packed_linear``): faster at every batch size
measured (``results/README.md``).

CPU only: float32 or bfloat16 weights (bfloat16 where oneDNN has bfloat16 kernels for this CPU),
PyTorch built with oneDNN; elsewhere ``pack_weight`` returns None and callers keep ``F.linear``. The
packed copy is a snapshot (weights must not change once packed) and a copy: the dense weights stay
(loading, tensor-parallel slicing and the notebooks read them), so the weights take twice their memory.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this PyTorch build has oneDNN and its prepacked linear operators for ``dtype``.

    Probed by packing and multiplying a tiny matrix: a build or CPU without the kernels raises (or,
    for bfloat16 without a bfloat16 path, answers wrongly), and the caller keeps plain ``F.linear``.
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
    if x.dim() == 2 and x.shape[0]:  # the model's activations: (tokens, features)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:  # oneDNN rejects empty inputs; the answer is empty anyway
        return x.new_empty(*x.shape[:-1], out_features)
    out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out_features)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b, with the packed copy of W when there is one (``F.linear`` otherwise)."""
    if packed is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return packed_linear(x, packed, weight.shape[0], bias)
