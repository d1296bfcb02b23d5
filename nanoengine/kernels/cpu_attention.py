"""Decode attention tuned for the CPU (chapter 10: the same arithmetic, fewer passes over memory).

``reference.paged_decode_attention`` is the definition: a loop over sequences, each
gathering its keys and values through its block table. This module computes exactly that
for the whole batch at once, in the way that is fast on a CPU, where decode attention is
limited by memory traffic:

* a ``DecodePlan`` turns the block tables into cache-row indices once per step, and every
  layer of that step reuses it (the tables are the same in all layers);
* keys are gathered straight into the layout of one batched matmul;
* values are never copied: ``embedding_bag`` with per-sample weights is a gather fused
  with a weighted sum, which is what "probabilities times values" is.

Both choices made a decode step faster than gathering the values for SDPA, the
``embedding_bag`` values most (the A/B figures: ``results/README.md``).
``kernels.paged_decode_attention`` picks
this path for CPU tensors; tests compare it with the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    """One query token per sequence against its paged context (``reference.paged_decode_attention``).

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
