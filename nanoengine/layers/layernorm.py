"""RMSNorm, optionally fused with the residual add (chapter 10's fusion example).

RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight. Transformer blocks add the residual stream right
before normalising it, so ``forward(x, residual)`` returns both the normalised sum and the new
residual. Eager PyTorch runs the two plain functions below op by op (a pass over the activations
each); the module calls the versions its backend's kernels gave it (``layers.kernels``): the CPU's
one-pass native kernel, or compiled on CUDA.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoengine.layers.kernels import current_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., H) -> (..., H), computed in float32 and returned in x's dtype.

    ``torch.rms_norm`` without a weight is ``x * rsqrt(mean(x^2) + eps)`` (the same values,
    bit for bit, in float32: tests/engine/test_layers.py), one call from Python instead of
    five. The weight multiplies after rounding to x's dtype, as Hugging Face's Llama does.
    """
    normed = torch.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalised x + residual, x + residual): the sum is the next residual stream."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


class RMSNorm(nn.Module):
    norm_fn = staticmethod(rms_norm)
    add_norm_fn = staticmethod(add_rms_norm)

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        kernels = current_kernels()
        self.norm_fn = kernels.rms_norm or rms_norm
        self.add_norm_fn = kernels.add_rms_norm or add_rms_norm
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.norm_fn(x, self.weight, self.eps)
        return self.add_norm_fn(x, residual, self.weight, self.eps)
