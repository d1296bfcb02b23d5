"""Qwen3: the Llama layout plus a per-head RMSNorm on queries and keys before RoPE.

``LlamaAttention`` adds ``q_norm`` / ``k_norm`` when ``ModelConfig.uses_qk_norm`` is set,
so Qwen3 is the same module tree under its own name; its checkpoints (and nano-vLLM's only
model) load through the same name mapping.
"""

from __future__ import annotations

from nanoengine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models (e.g. Qwen3-0.6B: 28 layers, 16 query / 8 KV heads, head_dim 128)."""
