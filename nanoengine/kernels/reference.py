"""PyTorch reference kernels: the specification of the paged-KV data plane.

Three operations touch the paged KV cache (chapters 3 and 4):

* ``store_kv`` writes the keys/values of this step's tokens into their cache slots.
  A *slot* is ``block_id * block_size + offset``: the scheduler's block table says which
  physical block holds a token, the offset says where inside it.
* ``paged_decode_attention`` attends one query token per sequence over that sequence's
  whole context, reading K/V block by block through its block table.
* ``paged_prefill_attention`` attends a chunk of query tokens per sequence (variable
  lengths, causal). Earlier tokens of the sequence may already sit in the cache, from a
  previous chunk or a prefix-cache hit, so query ``j`` of a sequence with ``q_len``
  query tokens and ``context_len`` cached tokens (this chunk included) sits at position
  ``context_len - q_len + j`` and sees keys ``0 .. context_len - q_len + j``.

Shapes used throughout::

    k_cache, v_cache : (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables     : (num_seqs, max_blocks_per_seq) int32; entries past a sequence's
                       last block are padding and never read
    context_lens     : (num_seqs,) int32, tokens in the cache for each sequence

These run on any device and are the CPU path of the engine; ``triton_kernels`` holds the
CUDA versions, tested against these. Grouped-query attention (GQA) is handled by letting
each group of ``num_heads // num_kv_heads`` query heads share one KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` (num_tokens, num_kv_heads, head_dim) into their slots.

    ``slot_mapping`` (num_tokens,) holds each token's flat slot; ``-1`` means "do not
    store" (used for padded positions).
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    if bool(keep.all()):
        flat_k[slot_mapping] = key
        flat_v[slot_mapping] = value
    else:
        flat_k[slot_mapping[keep]] = key[keep]
        flat_v[slot_mapping[keep]] = value[keep]


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> torch.Tensor:
    """The first ``context_len`` cached vectors of one sequence, in token order.

    Returns (context_len, num_kv_heads, head_dim). This is the "virtual memory" view of
    chapter 4: logical token ``t`` lives in block ``block_table[t // block_size]`` at
    offset ``t % block_size``.
    """
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # (nb, block_size, kvh, d)
    return blocks.flatten(0, 1)[:context_len]


@dataclass(frozen=True)
class DecodePlan:
    """Where every decode sequence's K/V rows are: the same for all layers of one step.

    The cache is read as rows of ``head_dim`` values, row ``slot * kv_heads + head``.
    Building the plan is index arithmetic only; a step builds it once (the first layer)
    and every other layer reuses it (see ``paged_decode_attention``'s ``step_cache``).
    """

    rows: torch.Tensor  # (S, kv_heads, L) the cache row of each sequence's token t, padded to L
    bags: torch.Tensor  # (S * heads, L) the value rows each output row sums (query head -> KV head)
    past_end: torch.Tensor  # (S, L) True for padding: past the sequence's length

    @classmethod
    def build(cls, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
              num_kv_heads: int, num_heads: int) -> "DecodePlan":
        device = block_tables.device
        max_blocks = (int(context_lens.max()) + block_size - 1) // block_size
        table = block_tables[:, :max_blocks].long().clamp(min=0)  # padding entries read block 0, masked
        slots = (table[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)  # (S, L)
        heads = torch.arange(num_kv_heads, device=device)
        rows = slots[:, None, :] * num_kv_heads + heads[None, :, None]
        num_seqs, padded_len = slots.shape
        group = num_heads // num_kv_heads
        bags = rows[:, :, None, :].expand(-1, -1, group, -1).reshape(num_seqs * num_heads, padded_len)
        past_end = torch.arange(padded_len, device=device)[None, :] >= context_lens.to(device)[:, None]
        return cls(rows, bags, past_end)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    step_cache: dict | None = None,
) -> torch.Tensor:
    """One query token per sequence against its paged context.

    query (num_seqs, num_heads, head_dim) -> output of the same shape. Batched, so a step
    costs a handful of tensor ops whatever the batch:

    1. every sequence's keys are gathered into a padded (num_seqs, kv_heads, max_len,
       head_dim) tensor and one batched matmul gives the scores; padding is masked out;
    2. the weighted sum of values reads them straight from the cache: ``embedding_bag``
       with per-sample weights *is* a gather fused with a weighted sum (each output row is
       the sum of ``probability * cache row`` over that row's bag of slots), so the values
       are never copied out. Decode attention is memory-bound; not copying V is ~30%.

    ``step_cache``, a dict that lives for one step, keeps the ``DecodePlan`` so the
    layers after the first skip its index arithmetic (pass None to always rebuild).
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads  # grouped-query attention: query heads per KV head
    plan = step_cache.get("decode_plan") if step_cache is not None else None
    if plan is None:
        plan = DecodePlan.build(block_tables, context_lens, k_cache.shape[1], num_kv_heads, num_heads)
        if step_cache is not None:
            step_cache["decode_plan"] = plan
    padded_len = plan.rows.shape[2]
    compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    keys = k_cache.view(-1, head_dim).index_select(0, plan.rows.flatten())
    keys = keys.view(num_seqs, num_kv_heads, padded_len, head_dim).to(compute_dtype)
    # The `group` query heads sharing a KV head are the rows of one small matmul.
    q = query.view(num_seqs, num_kv_heads, group, head_dim).to(compute_dtype)
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale)  # (S, kvh, group, L)
    scores.masked_fill_(plan.past_end[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)  # exactly 0 on padding
    if v_cache.dtype == compute_dtype:
        out = F.embedding_bag(plan.bags, v_cache.view(-1, head_dim), mode="sum",
                              per_sample_weights=probs.view(num_seqs * num_heads, padded_len))
    else:  # half-precision cache: gather the values and sum in float32
        values = v_cache.view(-1, head_dim).index_select(0, plan.rows.flatten())
        values = values.view(num_seqs, num_kv_heads, padded_len, head_dim).to(compute_dtype)
        out = torch.matmul(probs, values)
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for variable-length query chunks over a paged context.

    query (total_q_tokens, num_heads, head_dim), sequences packed back to back with
    boundaries ``cu_seqlens_q`` (num_seqs + 1,). The chunk's own K/V must already be
    stored in the cache. Returns (total_q_tokens, num_heads, head_dim).
    """
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    lengths = context_lens.tolist()
    for seq, context_len in enumerate(lengths):
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
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # (1, h, q_len, d)
        out[q_start:q_end] = attn[0].transpose(0, 1).to(query.dtype)
    return out
