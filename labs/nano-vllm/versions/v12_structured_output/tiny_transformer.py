"""v11 - a tiny PyTorch Transformer that reads and writes the paged KV cache (cards 13, 16).

The toy rule of v00-v08 is gone. In its place: a real decoder-only Transformer
(``torch.nn.Module``: token + position embeddings, pre-norm attention and MLP blocks,
a final norm and an LM head). Its weights are random (seeded, untrained), so its
tokens mean nothing - but its logits are real, and every mechanism of the engine now
has to be right for real: if a KV vector is written to the wrong slot or read through
the wrong block table, the logits change. ``reference_logits`` recomputes the same
model with no cache at all, so the engine can be checked against it.

It sits behind exactly the contract the toy model had in v06-v08:
``forward(model_input, kv_cache) -> logits (num_seqs, vocab_size)``. Inside each
attention layer the cache is used the way every paged engine uses it:

1. ``store_kv``: write each new token's K and V into its slot
   (``kv_cache.view(-1, heads, head_dim)[slot_mapping] = k``);
2. ``paged_attention``: for each sequence, gather its context's K and V through its
   block table, then causal attention of its new queries over that context.

Storing the whole batch before any gather is what lets two requests admitted in the
same step share prefix blocks: the first one's KV is in the pages before the second
one reads them.

Simplifications against nano-vLLM's ``models/qwen3.py``: learned absolute position
embeddings instead of RoPE, no grouped-query attention, no tensor parallelism, and a
per-sequence Python loop where nano-vLLM calls flash-attention kernels.

New in v11: ``forward`` computes logits at the rows ``model_input.logits_indices`` names,
not always at each sequence's last row: a speculative verify pass needs a distribution
after every draft, k + 1 rows per sequence.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # model_runner imports this module; import its type for hints only
    from model_runner import ModelInput


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    max_position: int = 128
    eos_token_id: int = 0
    seed: int = 0  # initialises the (untrained) weights

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by "
                             f"num_heads {self.num_heads}")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id must be in [0, {self.vocab_size}), got {self.eos_token_id}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' K and V into their slots of one layer's paged cache.

    k, v: (N, H, D); k_cache, v_cache: (num_blocks, block_size, H, D); slot_mapping: (N,).
    """
    num_heads, head_dim = k.shape[1:]
    k_cache.view(-1, num_heads, head_dim)[slot_mapping] = k  # (num_slots, H, D)[N] <- (N, H, D)
    v_cache.view(-1, num_heads, head_dim)[slot_mapping] = v


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    model_input: "ModelInput", scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context.

    q: (N, H, D) for all tokens of the step; returns (N, H, D).
    """
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    cu = model_input.cu_seqlens_q.tolist()
    for i, context_len in enumerate(model_input.context_lens.tolist()):
        start, end = cu[i], cu[i + 1]
        num_blocks = -(-context_len // block_size)
        block_table = model_input.block_tables[i, :num_blocks]  # (nb,)
        k_ctx = k_cache[block_table].flatten(0, 1)[:context_len]  # (ctx, H, D): gather the pages
        v_ctx = v_cache[block_table].flatten(0, 1)[:context_len]  # (ctx, H, D)
        q_pos = model_input.positions[start:end]  # (n_q,)
        causal = torch.arange(context_len)[None, :] <= q_pos[:, None]  # (n_q, ctx)
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k_ctx.transpose(0, 1), v_ctx.transpose(0, 1),
            attn_mask=causal, scale=scale)  # (H, n_q, D)
        out[start:end] = o.transpose(0, 1)
    return out


class Attention(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)  # 3 x (N, hidden)
        shape = (x.shape[0], self.num_heads, self.head_dim)
        return q.view(shape), k.view(shape), v.view(shape)  # 3 x (N, H, D)

    def forward(self, x: torch.Tensor, model_input: "ModelInput", k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)
        store_kv(k, v, k_cache, v_cache, model_input.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, model_input, self.scale)  # (N, H, D)
        return self.o_proj(o.flatten(1))  # (N, hidden)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """One whole sequence, no cache: plain causal attention (for checking only)."""
        q, k, v = (t.transpose(0, 1) for t in self._qkv(x))  # 3 x (H, T, D)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)  # (H, T, D)
        return self.o_proj(o.transpose(0, 1).flatten(1))  # (T, hidden)


class DecoderLayer(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(config.hidden_size)
        self.attn = Attention(config)
        self.post_attention_norm = nn.RMSNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 4 * config.hidden_size), nn.SiLU(),
                                 nn.Linear(4 * config.hidden_size, config.hidden_size))

    def forward(self, x: torch.Tensor, model_input: "ModelInput", k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), model_input, k_cache, v_cache)
        return x + self.mlp(self.post_attention_norm(x))

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.forward_reference(self.input_norm(x))
        return x + self.mlp(self.post_attention_norm(x))


class TinyTransformer(nn.Module):
    """Decoder-only Transformer; ``forward`` honours the runner contract of v06-v08."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        with torch.random.fork_rng():  # seeded weights without touching the global RNG
            torch.manual_seed(config.seed)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.embed_positions = nn.Embedding(config.max_position, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
            self.norm = nn.RMSNorm(config.hidden_size)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, model_input: "ModelInput", kv_cache: torch.Tensor) -> torch.Tensor:
        """kv_cache: (2, num_layers, num_blocks, block_size, H, D). Returns (len(logits_indices), vocab)."""
        x = self.embed_tokens(model_input.input_ids) + self.embed_positions(model_input.positions)
        for layer_id, layer in enumerate(self.layers):  # x: (N, hidden)
            x = layer(x, model_input, kv_cache[0, layer_id], kv_cache[1, layer_id])
        rows = model_input.logits_indices  # (R,): the rows where a token is sampled or verified
        return self.compute_logits(self.norm(x[rows]))  # (R, vocab)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)  # (B, hidden) -> (B, vocab)

    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence, recomputed with no KV cache: (T, vocab)."""
        ids = torch.tensor(token_ids)
        x = self.embed_tokens(ids) + self.embed_positions(torch.arange(len(token_ids)))
        for layer in self.layers:
            x = layer.forward_reference(x)
        return self.compute_logits(self.norm(x))
