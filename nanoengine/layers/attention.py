"""The attention layer over the paged KV cache (chapters 3 and 4).

A step's tokens arrive packed in one flat batch: first one token per *decoding* sequence, then the
query chunks of the *prefilling* sequences. The layer writes this step's K/V into the cache at the
slots the scheduler chose, then runs paged decode attention for the decode tokens and paged prefill
attention for the chunks, both reading K/V through the block tables.

``AttentionMetadata`` carries that layout, built once per step by the device backend (a subclass may
add fields, such as the CPU's ``all_slots_stored``) and passed down the model (no global context).
The kernels are the backend's ``AttentionImpl``, taken by each layer when it is built
(``layers.kernels``); the runner then binds each layer to its share of the KV cache. The layer never
asks which device it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanoengine.kernels import reference
from nanoengine.layers.kernels import current_kernels


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) where each token's K/V is written; -1: nowhere
    num_decode_tokens: int  # the first num_decode_tokens tokens are decodes, one per sequence
    decode_block_tables: torch.Tensor  # (num_decodes, max_blocks)
    decode_context_lens: torch.Tensor  # (num_decodes,)
    prefill_block_tables: torch.Tensor  # (num_prefills, max_blocks)
    prefill_cu_seqlens_q: torch.Tensor  # (num_prefills + 1,) chunk boundaries
    prefill_context_lens: torch.Tensor  # (num_prefills,) cached tokens incl. this chunk
    one_call_layers: bool = False  # layers with a one-call version (LayerKernels.decoder_layer) run it this step

    @property
    def num_prefills(self) -> int:
        return self.prefill_context_lens.shape[0]


class AttentionImpl:
    """How a device stores K/V and attends over the paged cache (a backend provides one).

    ``k_cache``/``v_cache`` are one layer's (num_blocks, block_size, kv_heads, head_dim)
    views; ``meta`` is the step's metadata as the backend built it.
    """

    name = "abstract"

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        raise NotImplementedError

    def decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        raise NotImplementedError

    def prefill(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """One layer's step: store this step's K/V, then decode rows and prefill chunks. -> (T, heads, d)."""
        self.store_kv(k, v, k_cache, v_cache, meta)
        num_decode = meta.num_decode_tokens
        if meta.num_prefills == 0:
            return self.decode(q, k_cache, v_cache, meta, scale)
        prefill = self.prefill(q[num_decode:], k_cache, v_cache, meta, scale)
        if num_decode == 0:
            return prefill
        decode = self.decode(q[:num_decode], k_cache, v_cache, meta, scale)
        return torch.cat((decode, prefill), dim=0)


class ReferenceAttention(AttentionImpl):
    """The specification kernels (``kernels.reference``), or a subclass's ``kernels`` module of the same
    signatures (the CUDA backend's Triton kernels)."""

    name = "reference"
    kernels = reference

    def store_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        self.kernels.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    def decode(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self.kernels.paged_decode_attention(query, k_cache, v_cache, meta.decode_block_tables,
                                                   meta.decode_context_lens, scale)

    def prefill(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self.kernels.paged_prefill_attention(query, k_cache, v_cache, meta.prefill_block_tables,
                                                    meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale)


class Attention(nn.Module):
    """Scaled dot-product attention of already-projected q, k, v over the paged cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.impl: AttentionImpl = current_kernels().attention or ReferenceAttention()
        # Bound by the model runner: views into the engine's one KV tensor.
        self.k_cache: torch.Tensor | None = None  # (num_blocks, block_size, kv_heads, head_dim)
        self.v_cache: torch.Tensor | None = None

    def bind(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Give this layer its share of the KV cache."""
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q (T, heads, d), k/v (T, kv_heads, d) -> (T, heads, d), by the backend's kernels."""
        return self.impl.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
