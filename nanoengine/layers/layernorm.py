"""RMSNorm, optionally fused with the residual add (chapter 10's fusion example).

RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight. Transformer blocks add the residual
stream right before normalising it, so ``forward(x, residual)`` returns both the
normalised sum and the new residual: one pass over the activations instead of two.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
