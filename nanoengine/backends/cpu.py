"""The CPU backend: every trick a CPU needs, in one room (chapter 10).

A GPU engine gets several things for free that a CPU engine must arrange itself. vLLM keeps
its CPU tricks in its CPU attention backend and platform (``vllm/v1/attention/backends/
cpu_attn.py``, ``vllm/platforms/cpu.py``); this engine keeps them here:

* **Prepacked GEMM weights.** oneDNN multiplies fastest with weights reordered into its
  blocked layout; ``prepare_weights`` reorders every linear layer's weight once, at load
  (``kernels.cpu_gemm``; a copy: ``memory_report().packed_weight_bytes``), and gives the
  layer a ``PackedLinearMethod``. For a single row (one sequence decoding) plain
  ``F.linear`` can be the faster way, depending on the CPU, so each weight shape is timed
  both ways once, for this engine only (``cpu_gemm.tune_single_row``).
* **A decode plan per step, not per layer.** The CPU decode kernel gathers keys through
  cache-row indices computed from the block tables (``kernels.cpu_attention.DecodePlan``).
  The tables are the same in every layer, so ``build_metadata`` builds the plan once, as a
  field of the step's ``CpuAttentionMetadata``, and all 30 layers read it.
* **Store-KV without a check per layer.** Whether any token of the step has no slot (-1,
  a warm-up row) is decided once from the plan on the host (``all_slots_stored``); the
  layers then copy their keys and values with no host synchronisation.
* **Reused host memory.** PyTorch's CUDA caching allocator keeps freed blocks for the next
  step; on a CPU glibc hands large blocks back to the kernel and faults them in again.
  ``engine.host_memory.keep_freed_memory`` changes two malloc settings so they stay.
* **Logits in chunks.** A step's logits are (rows, vocab) float32: 256 rows of a
  49,152-token vocabulary are 50 MB, more than glibc's largest heap block (32 MiB), so they
  would be mapped fresh every step, faulted in by the LM head and unmapped when freed
  (the overhead benchmark's 256-row decode step was measured more than twice as slow in
  one chunk: ``results/README.md``). So the LM head runs on chunks of rows of at most
  ``LOGITS_CHUNK_BYTES`` and each chunk is sampled before the next is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoengine.backends.base import Backend
from nanoengine.engine.host_memory import keep_freed_memory
from nanoengine.kernels import cpu_attention, cpu_gemm, reference
from nanoengine.kernels.cpu_attention import DecodePlan
from nanoengine.layers.attention import AttentionImpl, AttentionMetadata
from nanoengine.layers.linear import GemmLayer

# A chunk's logits stay under glibc's 32 MiB mmap threshold (``engine.host_memory``), so
# they come from the reused heap.
LOGITS_CHUNK_BYTES = 30 * 1024 * 1024


@dataclass
class CpuAttentionMetadata(AttentionMetadata):
    """``AttentionMetadata`` plus what the CPU kernels derive from it once per step."""

    decode_plan: DecodePlan | None = None  # where each decode sequence's K/V rows are (None: no decodes)
    all_slots_stored: bool = True  # every token of the step has a cache slot (no -1 in slot_mapping)


class CpuAttention(AttentionImpl):
    """Store-KV by row copy, batched decode attention (``cpu_attention``), reference prefill."""

    name = "cpu (batched decode, reference prefill)"

    def store_kv(self, key, value, k_cache, v_cache, meta: CpuAttentionMetadata) -> None:
        if not meta.all_slots_stored:  # a step with slot -1 rows: the reference skips them
            reference.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
            return
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)

    def decode(self, query, k_cache, v_cache, meta: CpuAttentionMetadata, scale: float) -> torch.Tensor:
        return cpu_attention.paged_decode_attention(query, k_cache, v_cache, meta.decode_block_tables,
                                                    meta.decode_context_lens, scale, meta.decode_plan)

    def prefill(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return reference.paged_prefill_attention(query, k_cache, v_cache, meta.prefill_block_tables,
                                                 meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale)


class PackedLinearMethod:
    """A linear layer's product through its weight prepacked for oneDNN (``kernels.cpu_gemm``).

    ``one_row_packed``: whether a one-row input also takes the packed copy (measured per
    weight shape when the engine was built; ``F.linear`` otherwise).
    """

    name = "oneDNN prepacked"

    def __init__(self, packed: torch.Tensor, one_row_packed: bool) -> None:
        self.packed = packed
        self.one_row_packed = one_row_packed

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_gemm.linear(x, layer.weight, bias, self.packed, self.one_row_packed)


class CpuBackend(Backend):
    """Prepacked GEMMs, a per-step decode plan, kept host memory, chunked logits."""

    name = "cpu"

    def __init__(self, device: torch.device, compile: bool = False) -> None:
        super().__init__(device, compile)
        self.attention = CpuAttention()
        self.single_row_packed: dict[tuple[int, int], bool] = {}  # weight shape -> packed is faster (this engine)
        keep_freed_memory()

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """Prepack every GEMM weight and decide, per shape, the faster one-row product."""
        layers = [m for m in model.modules() if isinstance(m, GemmLayer)]
        packed = {id(m): cpu_gemm.pack_weight(m.weight) for m in layers}
        layers = [m for m in layers if packed[id(m)] is not None]
        self.single_row_packed = cpu_gemm.tune_single_row([(m.weight, packed[id(m)]) for m in layers])
        for module in layers:
            module.linear_method = PackedLinearMethod(packed[id(module)],
                                                      self.single_row_packed[tuple(module.weight.shape)])
        self.num_prepared_weights = len(layers)
        # A tied LM head shares its weight with the embedding: each layer's packed copy is its own.
        self.weight_copy_bytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)

    def build_metadata(self, plan) -> CpuAttentionMetadata:
        fields = self._metadata_fields(plan)
        decode_plan = None
        if plan.num_decode_tokens:
            decode_plan = DecodePlan.build(fields["decode_block_tables"], fields["decode_context_lens"],
                                           self.block_size, self.num_kv_heads, self.num_heads, self.head_dim,
                                           torch.empty(0, dtype=self.kv_dtype).element_size())
        slots = plan.slot_mapping
        all_stored = bool((slots >= 0).all()) if isinstance(slots, torch.Tensor) else min(slots, default=0) >= 0
        return CpuAttentionMetadata(**fields, decode_plan=decode_plan, all_slots_stored=all_stored)

    def logits_rows_per_chunk(self, num_rows: int, vocab_size: int, hidden_size: int) -> int:
        """How many rows of logits one LM-head call computes.

        At most ``LOGITS_CHUNK_BYTES`` of float32 logits, and at most the hidden size: then
        a chunk's logits are no more values than the head's weight, so each call writes no
        more than it reads. Small heads get small chunks that stay in cache for the sampler;
        a big head is not streamed from memory again for every few rows.
        """
        by_bytes = LOGITS_CHUNK_BYTES // (4 * vocab_size)
        return max(1, min(num_rows, hidden_size, by_bytes))
