"""The attention layer over the paged KV cache (chapters 3 and 4).

A step's tokens arrive packed in one flat batch: first one token for each *decoding*
sequence, then the query chunks of the *prefilling* sequences. The layer

1. writes this step's K/V into the cache at the slots the scheduler chose (store-KV),
2. runs paged decode attention for the decode tokens and paged prefill attention for the
   prefill chunks, both reading K/V through the block tables.

``AttentionMetadata`` carries that layout. It is built once per step by the model runner
and passed down the model explicitly (no global context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from nanoengine import kernels


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) where each token's K/V is written
    num_decode_tokens: int  # the first num_decode_tokens tokens are decodes, one per sequence
    decode_block_tables: torch.Tensor  # (num_decodes, max_blocks)
    decode_context_lens: torch.Tensor  # (num_decodes,)
    prefill_block_tables: torch.Tensor  # (num_prefills, max_blocks)
    prefill_cu_seqlens_q: torch.Tensor  # (num_prefills + 1,) chunk boundaries
    prefill_context_lens: torch.Tensor  # (num_prefills,) cached tokens incl. this chunk
    # What a kernel derives from the fields above once per step and every layer reuses
    # (the CPU decode kernel's gather plan). Lives and dies with this step's metadata.
    step_cache: dict = field(default_factory=dict)

    @property
    def num_prefills(self) -> int:
        return self.prefill_context_lens.shape[0]


class Attention(nn.Module):
    """Scaled dot-product attention of already-projected q, k, v over the paged cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Views into the engine's one KV tensor, bound by the model runner.
        self.k_cache: torch.Tensor | None = None  # (num_blocks, block_size, kv_heads, head_dim)
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q (T, heads, d), k/v (T, kv_heads, d) -> (T, heads, d)."""
        kernels.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        if meta.num_prefills == 0:
            return kernels.paged_decode_attention(q, self.k_cache, self.v_cache, meta.decode_block_tables,
                                                  meta.decode_context_lens, self.scale, meta.step_cache)
        prefill = kernels.paged_prefill_attention(q[num_decode:], self.k_cache, self.v_cache,
                                                  meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                                                  meta.prefill_context_lens, self.scale)
        if num_decode == 0:
            return prefill
        decode = kernels.paged_decode_attention(q[:num_decode], self.k_cache, self.v_cache,
                                                meta.decode_block_tables, meta.decode_context_lens, self.scale,
                                                meta.step_cache)
        return torch.cat((decode, prefill), dim=0)
