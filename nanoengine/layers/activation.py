"""SiLU-and-multiply: the gated MLP's activation (SwiGLU).

The merged gate_up projection produces [gate | up]; the MLP output is silu(gate) * up. Eager
PyTorch makes two passes and a temporary; the module calls the version its backend's kernels
gave it (``layers.kernels``), one pass on a CPU or compiled on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.layers.kernels import current_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(T, 2*I) -> (T, I): silu(first half) * second half."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    silu_and_mul_fn = staticmethod(silu_and_mul)  # the eager function; each instance calls the one its kernels gave it

    def __init__(self) -> None:
        super().__init__()
        self.silu_and_mul_fn = current_kernels().silu_and_mul or silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, 2*I) -> (T, I)
        return self.silu_and_mul_fn(x)
