"""PyTorch reference kernels: the specification of the paged-KV data plane.

``store_kv`` (chapter 3) writes this step's keys/values into their cache slots (a *slot* is
``block_id * block_size + offset``); ``paged_decode_attention`` (chapter 4) attends one query token
per sequence over its whole context; ``paged_prefill_attention`` attends a causal chunk of query
tokens per sequence. Earlier tokens may already be cached (a previous chunk, a prefix-cache hit), so
query ``j`` of a chunk of ``q_len`` tokens with ``context_len`` cached tokens (this chunk included)
sits at position ``context_len - q_len + j`` and sees keys ``0 .. context_len - q_len + j``. Shapes::

    k_cache, v_cache : (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables     : (num_seqs, max_blocks_per_seq) int32; entries past a sequence's
                       last block are padding and never read
    context_lens     : (num_seqs,) int32, tokens in the cache for each sequence

Written to be read, not to be fast, on any device: the native CPU kernels (``cpu_native``) and the
CUDA ones (``triton_kernels``) are tested against them, and the CPU backend attends with them where
its native kernels cannot be built. Grouped-query attention (GQA): each group of
``num_heads // num_kv_heads`` query heads shares one KV head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` (num_tokens, num_kv_heads, head_dim) into their slots.

    ``slot_mapping`` (num_tokens,) holds each token's flat slot; ``-1`` means "do not
    store" (used for padded positions).
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    flat_k[slot_mapping[keep]] = key[keep]
    flat_v[slot_mapping[keep]] = value[keep]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first ``context_len`` cached vectors of one sequence, in token order.

    Returns (context_len, num_kv_heads, head_dim). This is the "virtual memory" view of
    chapter 4: logical token ``t`` lives in block ``block_table[t // block_size]`` at
    offset ``t % block_size``.
    """
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # (nb, block_size, kvh, d)
    return blocks.flatten(0, 1)[:context_len]


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence against its paged context: the plain definition.

    query (num_seqs, num_heads, head_dim) -> output of the same shape. For each sequence:
    read its keys and values through its block table (``gather_kv``), let each group of
    query heads share its KV head (GQA), and take ``softmax(q k^T * scale) v``.
    """
    num_seqs, num_heads, head_dim = query.shape
    group = num_heads // k_cache.shape[2]  # grouped-query attention: query heads per KV head
    compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    out = torch.empty_like(query)
    for seq, context_len in enumerate(context_lens.tolist()):
        keys = gather_kv(k_cache, block_tables[seq], context_len).to(compute_dtype)  # (ctx, kvh, d)
        values = gather_kv(v_cache, block_tables[seq], context_len).to(compute_dtype)
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # (h, ctx, d)
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[seq].to(compute_dtype).unsqueeze(1)  # (h, 1, d)
        probs = (q @ keys.transpose(1, 2) * scale).softmax(dim=-1)  # (h, 1, ctx)
        out[seq] = (probs @ values).squeeze(1).to(query.dtype)  # (h, d)
    return out


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Causal attention for variable-length query chunks over a paged context.

    query (total_q_tokens, num_heads, head_dim), sequences packed back to back with
    boundaries ``cu_seqlens_q`` (num_seqs + 1,). The chunk's own K/V must already be
    stored in the cache. Returns (total_q_tokens, num_heads, head_dim). 16-bit inputs are
    computed in float32, as in ``paged_decode_attention``.
    """
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        q_start, q_end = starts[seq], starts[seq + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        keys = gather_kv(k_cache, block_tables[seq], context_len)
        values = gather_kv(v_cache, block_tables[seq], context_len)
        # 4-D (batch of 1) inputs: PyTorch's CPU SDPA takes its fused path only for 4-D.
        q = query[q_start:q_end].to(compute_dtype).transpose(0, 1).unsqueeze(0)  # (1, h, q_len, d)
        k = keys.to(compute_dtype).transpose(0, 1).unsqueeze(0)  # (1, kvh, ctx, d)
        v = values.to(compute_dtype).transpose(0, 1).unsqueeze(0)
        if q_len == context_len:
            mask, causal = None, True  # nothing cached before the chunk: plain causal
        else:
            q_pos = torch.arange(context_len - q_len, context_len, device=query.device)
            k_pos = torch.arange(context_len, device=query.device)
            mask, causal = k_pos[None, :] <= q_pos[:, None], False  # (q_len, ctx)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=num_heads != num_kv_heads)  # (1, h, q_len, d)
        out[q_start:q_end] = attn[0].transpose(0, 1).to(query.dtype)
    return out
