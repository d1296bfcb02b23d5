"""Decode attention tuned for the CPU (chapter 10: the same arithmetic, fewer passes over memory).

``reference.paged_decode_attention`` is the definition: a loop over sequences, each gathering
its keys and values through its block table. ``paged_decode_attention`` here computes exactly
that for the whole batch at once, the way that is fast on a CPU, where decode attention is
limited by memory traffic: a ``DecodePlan`` turns the block tables into cache-row indices once
per step (the CPU backend builds it with the step's metadata and every layer reuses it), keys are
gathered a bounded group of sequences at a time, and values are never copied (the function's
docstring says how; the A/B figures: ``results/README.md``). The CPU backend (``backends/cpu.py``)
runs this path where its native decode kernel (``cpu_native.paged_decode_attention``, C++ that
reads each K/V row where it lies, with no gather) cannot be built; tests compare both with the
reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


# The most bytes of keys one group gathers: a group's copy stays in the CPU's caches while
# its scores are computed, and under glibc's mmap threshold (``backends.cpu_platform``), so it
# is never mapped and faulted in afresh. A few dozen short sequences make one group.
GATHER_BUDGET_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class DecodeGroup:
    """Some sequences of a decode batch, gathered together (padded to their longest)."""

    seqs: torch.Tensor | None  # (G,) their rows in the batch; None: the whole batch, in order
    rows: torch.Tensor  # (G, kv_heads, L) the cache row of each sequence's token t, padded to L
    bags: torch.Tensor  # (G * heads, L) the value rows each output row sums (query head -> KV head)
    past_end: torch.Tensor  # (G, L) True for padding: past the sequence's length


@dataclass(frozen=True)
class DecodePlan:
    """Where every decode sequence's K/V rows are: the same for all layers of one step.

    The cache is read as rows of ``head_dim`` values, row ``slot * kv_heads + head``.
    Sequences are padded to the longest of their group. One group is the whole batch while
    its padded keys fit ``GATHER_BUDGET_BYTES``; a larger batch (long contexts, hundreds of
    sequences) is sorted by length and cut into groups that each fit, so the padding stays
    small and no layer copies hundreds of megabytes of keys at once. Building the plan is
    index arithmetic only; a step builds it once (the CPU backend, with the step's
    metadata) and every layer reuses it.
    """

    groups: tuple[DecodeGroup, ...]

    @classmethod
    def build(cls, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
              num_kv_heads: int, num_heads: int, head_dim: int, element_size: int) -> "DecodePlan":
        row_bytes = num_kv_heads * head_dim * element_size  # one token's keys
        lens = context_lens.tolist()
        if row_bytes * len(lens) * max(lens) <= GATHER_BUDGET_BYTES:
            return cls((cls._group(None, block_tables, context_lens, max(lens), block_size, num_kv_heads, num_heads),))
        order = sorted(range(len(lens)), key=lens.__getitem__)
        groups, start = [], 0
        while start < len(order):
            end = start + 1  # lengths ascend: the group's padding is its last sequence's length
            while end < len(order) and row_bytes * (end + 1 - start) * lens[order[end]] <= GATHER_BUDGET_BYTES:
                end += 1
            seqs = torch.tensor(order[start:end], device=block_tables.device)
            groups.append(cls._group(seqs, block_tables[seqs], context_lens[seqs], lens[order[end - 1]], block_size,
                                     num_kv_heads, num_heads))
            start = end
        return cls(tuple(groups))

    @staticmethod
    def _group(seqs: torch.Tensor | None, block_tables: torch.Tensor, context_lens: torch.Tensor, longest: int,
               block_size: int, num_kv_heads: int, num_heads: int) -> DecodeGroup:
        device = block_tables.device
        max_blocks = (longest + block_size - 1) // block_size
        table = block_tables[:, :max_blocks].long().clamp(min=0)  # padding entries read block 0, masked
        slots = (table[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)  # (G, L)
        heads = torch.arange(num_kv_heads, device=device)
        rows = slots[:, None, :] * num_kv_heads + heads[None, :, None]
        num_seqs, padded_len = slots.shape
        group = num_heads // num_kv_heads
        bags = rows[:, :, None, :].expand(-1, -1, group, -1).reshape(num_seqs * num_heads, padded_len)
        past_end = torch.arange(padded_len, device=device)[None, :] >= context_lens.to(device)[:, None]
        return DecodeGroup(seqs, rows, bags, past_end)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           plan: DecodePlan | None = None) -> torch.Tensor:
    """One query token per sequence against its paged context (``reference.paged_decode_attention``).

    query (num_seqs, num_heads, head_dim) -> output of the same shape. Batched, so a step
    costs a handful of tensor ops per group of sequences (``DecodePlan``), whatever the batch:

    1. a group's keys are gathered into a padded (seqs, kv_heads, max_len, head_dim)
       tensor and one batched matmul gives the scores, in float32; padding is masked out;
    2. the weighted sum of values reads them straight from the cache: ``embedding_bag``
       with per-sample weights *is* a gather fused with a weighted sum (each output row is
       the sum of ``probability * cache row`` over that row's bag of slots), so the values
       are never copied out. Decode attention is memory-bound, so not copying V saves much of
       its time (results/README.md).
       ``embedding_bag`` wants the weights in the cache's dtype: a bfloat16 cache gets its
       probabilities rounded to bfloat16 (the output is rounded to bfloat16 anyway).

    ``plan`` is the step's ``DecodePlan`` for these tables (built once per step by the CPU
    backend, so the layers skip its index arithmetic); without one it is built here.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if plan is None:
        plan = DecodePlan.build(block_tables, context_lens, k_cache.shape[1], num_kv_heads, num_heads, head_dim,
                                k_cache.element_size())
    if len(plan.groups) == 1 and plan.groups[0].seqs is None:
        return _attend(query, k_cache, v_cache, plan.groups[0], scale)
    out = torch.empty_like(query)
    for group in plan.groups:
        out.index_copy_(0, group.seqs, _attend(query.index_select(0, group.seqs), k_cache, v_cache, group, scale))
    return out


def _attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
            scale: float) -> torch.Tensor:
    """Decode attention of one group's queries (G, heads, head_dim) over its gathered context."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    padded_len = group.rows.shape[2]
    keys = k_cache.view(-1, head_dim).index_select(0, group.rows.flatten())
    keys = keys.view(num_seqs, num_kv_heads, padded_len, head_dim).float()
    # The query heads sharing a KV head (grouped-query attention) are the rows of one small matmul.
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale)  # (G, kvh, group, L)
    scores.masked_fill_(group.past_end[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)  # exactly 0 on padding
    out = F.embedding_bag(group.bags, v_cache.view(-1, head_dim), mode="sum",
                          per_sample_weights=probs.view(num_seqs * num_heads, padded_len).to(v_cache.dtype))
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)
