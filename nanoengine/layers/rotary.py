"""Rotary position embedding (RoPE), in the "rotate half" (GPT-NeoX) layout of Hugging Face Llama and Qwen.

Each pair of channels (i, i + head_dim/2) of a query or key is rotated by an angle
``position * theta^(-2i/head_dim)``, so the dot product of a query and a key depends on their
distance only. The tables hold every position's rows at full width, ``cos = [cos | cos]`` and a
signed ``sin = [-sin | sin]``, so rotating is ``x * cos + swap_halves(x) * sin`` (the textbook
products and sums in the same order: the same bits). The model keeps one ``RotaryEmbedding`` for
all its layers and gathers a step's rows once (``rows``); each layer rotates its queries and keys
in one call, as one (tokens, heads + kv_heads, head_dim) view, by the plain function
``rotate_half`` or the version its backend's kernels gave it (``layers.kernels``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from nanoengine.layers.kernels import current_kernels


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, heads, d) by rows cos / signed sin (T, 1, d); computed in float32, returned in x's dtype.

    Channel i < d/2 becomes ``x_i cos - x_(i+d/2) sin``, channel i + d/2 becomes
    ``x_(i+d/2) cos + x_i sin``: one 2-D rotation per pair of channels.
    """
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((x2, x1), dim=-1) * sin).to(dtype)


class RotaryEmbedding(nn.Module):
    rotate_fn = staticmethod(rotate_half)  # the eager function; each instance calls the one its kernels gave it

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotate_fn = current_kernels().rotate_half or rotate_half
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if rope_scaling:
            inv_freq = _scale_inv_freq(inv_freq, rope_scaling)
        positions = torch.arange(max_position, dtype=torch.float64)
        angles = torch.outer(positions, inv_freq)  # (max_position, head_dim/2)
        cos, sin = angles.cos().float(), angles.sin().float()
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)  # (max_position, d)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and signed sin rows of ``positions`` (T,), each (T, 1, head_dim): once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotate(self, x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x (T, n, head_dim), any mix of query and key heads, rotated by ``rows`` -> a rotated copy."""
        return self.rotate_fn(x, *rows)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q (T, heads, head_dim), k (T, kv_heads, head_dim) -> rotated copies."""
        rows = self.rows(positions)
        return self.rotate(q, rows), self.rotate(k, rows)


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
