"""Rotary position embedding (RoPE).

Each pair of channels (i, i + head_dim/2) of a query or key is rotated by an angle
``position * theta^(-2i/head_dim)``, so the dot product of a query and a key depends on
their distance only. cos/sin are precomputed for every position once; applying them is
an elementwise multiply, cheap next to the matmuls. This is the "rotate half" (GPT-NeoX)
layout that Hugging Face Llama and Qwen checkpoints use.

The math is the plain function ``apply_rotary`` (gather cos/sin, split, multiply, add,
concatenate: about a dozen small ops for q and k). The module calls it through
``rotate_fn``, which ``engine.compilation`` replaces with a ``torch.compile``'d version
on one model's instances when the engine runs with ``compile=True``.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, heads, d) and k (T, kv_heads, d) by their positions (T,). Tables (max_pos, d/2)."""
    cos = cos_table[positions].unsqueeze(1)  # (T, 1, d/2)
    sin = sin_table[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    compilable = ("rotate_fn",)  # see engine.compilation; the class attribute is the eager one
    rotate_fn = staticmethod(apply_rotary)

    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if rope_scaling:
            inv_freq = _scale_inv_freq(inv_freq, rope_scaling)
        positions = torch.arange(max_position, dtype=torch.float64)
        angles = torch.outer(positions, inv_freq)  # (max_position, head_dim/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q (T, heads, head_dim), k (T, kv_heads, head_dim) -> rotated copies."""
        return self.rotate_fn(positions, q, k, self.cos, self.sin)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3.1's frequency-dependent RoPE scaling ("rope_type": "llama3")."""
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: 'default', 'llama3'")
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen) - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
