"""The Llama family (SmolLM2, Llama-3) as a paged-KV model (chapters 1-3).

A decoder-only Transformer: embed tokens, then ``num_hidden_layers`` blocks of
(RMSNorm -> attention -> residual, RMSNorm -> gated MLP -> residual), a final RMSNorm,
and the LM head. Module names mirror Hugging Face's, so checkpoint tensors map onto
parameters by name; only q/k/v and gate/up are packed (see ``PACKED_MODULES``).

The forward pass takes a flat batch of tokens from many sequences at once; attention
finds each token's sequence through ``AttentionMetadata``. Logits are computed only for
the rows the runner asks for (each sequence's last token), not for every prompt token.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoengine.distributed.parallel_state import TPGroup
from nanoengine.layers.activation import SiluAndMul
from nanoengine.layers.attention import Attention, AttentionMetadata
from nanoengine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoengine.layers.kernels import current_kernels
from nanoengine.layers.layernorm import RMSNorm
from nanoengine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoengine.layers.rotary import RotaryEmbedding
from nanoengine.models.config import ModelConfig

# checkpoint name fragment -> (parameter name fragment, shard id)
PACKED_MODULES = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias, tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                        bias=False, tp=tp)
        self.rotary_emb = rotary_emb  # one module for all layers: the same tables
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)
        if config.uses_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata,
                rotary_rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``rotary_rows``: this step's cos/sin rows, gathered once for all layers (``RotaryEmbedding.rows``)."""
        num_tokens, heads, kv_heads, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)  # (T, q_size + 2 * kv_size): [q | k | v]
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, heads + kv_heads, d)  # query and key heads
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, kv_heads, d)  # (T, kvh, d)
        if hasattr(self, "q_norm"):  # Qwen3: each head normalised on its own before the rotation
            q, k = qk.split([heads, kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qk = self.rotary_emb.rotate(qk, rotary_rows)  # all heads in one call
        q, k = qk.split([heads, kv_heads], dim=1)  # (T, h, d), (T, kvh, d)
        out = self.attn(q, k, v, meta)  # (T, h, d)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, tp=tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp=tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The backend's version of this whole layer as one call, where it has one (on a CPU with the
        # native kernels: backends.cpu_fused), else None. It makes the calls below, in their order.
        make_one_call = current_kernels().decoder_layer
        self.one_call = make_one_call(self) if make_one_call is not None else None

    def forward(self, hidden, residual, meta, rotary_rows):
        if self.one_call is not None and meta.one_call_layers:  # decided once per step by the backend
            return self.one_call(hidden, residual, meta, rotary_rows)
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, meta, rotary_rows)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_position: int, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, self.rotary_emb, tp)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        hidden, residual = self.embed_tokens(input_ids), None  # (T, hidden)
        rotary_rows = self.rotary_emb.rows(positions)  # the same in every layer: gathered once
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, meta, rotary_rows)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    packed_modules = PACKED_MODULES

    def __init__(self, config: ModelConfig, max_position: int | None = None, tp: TPGroup = TPGroup.single()):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_position or config.max_position_embeddings, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """(T,) token ids and positions -> (T, hidden) final hidden states."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, hidden) -> (B, vocab)."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
