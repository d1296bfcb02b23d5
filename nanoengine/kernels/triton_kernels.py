"""Triton kernels for the paged-KV data plane: the CUDA path of ``nanoengine.kernels``.

Each function has the signature and contract of its PyTorch reference in ``reference.py`` (the
specification) and computes it in one kernel launch (chapters 3, 4 and 10). A program finds token
``t`` of its sequence through the block table (the "virtual memory" of chapter 4)::

    physical_block = block_tables[seq, t // block_size]
    k_cache[physical_block, t % block_size, kv_head, :]

Gathering per token, a tile of ``BLOCK_N`` keys may span cache blocks of any size in any order.

Only this module imports triton (``nanoengine.kernels`` imports it lazily). Tests run the kernels
on CPU under ``TRITON_INTERPRET=1``, which must be set before this module is imported
(``@triton.jit`` reads it). Every wrapper validates its inputs in plain Python first (the
``check_*`` helpers): inside a kernel a bad shape or dtype is an illegal memory access or silently
wrong numbers, never a readable error.
"""
from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256  # q, k, v and acc tiles of BLOCK_D columns must fit in registers
LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)); exp2 is the cheaper instruction

# Tile sizes. tl.dot on tensor cores needs every dimension >= 16, so smaller extents (a GQA
# group of 1, a head_dim of 8) are padded up to 16 and masked. The 64s are not tuned.
DECODE_BLOCK_N = 64  # context tokens per step of the decode loop
PREFILL_BLOCK_M = 64  # query tokens per prefill program
PREFILL_BLOCK_N = 64  # context tokens per step of the prefill loop
MIN_DOT_DIM = 16


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """``a @ b`` with fp32 accumulation.

    ``input_precision="ieee"`` keeps fp32 inputs exact (the tensor-core default, tf32, keeps only 10
    mantissa bits; fp16/bf16 inputs ignore it). ``UPCAST`` is set only under the interpreter with bf16
    data: Triton 3.9's interpreter multiplies the raw bf16 bit patterns in ``tl.dot``
    (triton-lang/triton#11584); a bf16 x bf16 product is exact in fp32, so upcasting gives a GPU's numbers.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_t, stride_key_h,  # key (num_tokens, num_kv_heads, head_dim)
    stride_value_t, stride_value_h,
    stride_kc_b, stride_kc_o, stride_kc_h,  # k_cache (num_blocks, block_size, kvh, d)
    stride_vc_b, stride_vc_o, stride_vc_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid ``(num_tokens,)``: program ``t`` copies token ``t``'s K and V into its slot.

    Each program moves one (num_kv_heads, head_dim) tile of K and one of V, padded to
    powers of two (BLOCK_H, BLOCK_D) and masked. A program whose slot is -1 does nothing
    (a scalar branch: the whole program skips, no masked loads needed).
    """
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * stride can be big
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(key_ptr + token * stride_key_t + offs_h[:, None] * stride_key_h
                    + offs_d[None, :], mask=mask)  # (BLOCK_H, BLOCK_D)
        v = tl.load(value_ptr + token * stride_value_t + offs_h[:, None] * stride_value_h
                    + offs_d[None, :], mask=mask)
        tl.store(k_cache_ptr + block * stride_kc_b + offset * stride_kc_o
                 + offs_h[:, None] * stride_kc_h + offs_d[None, :], k, mask=mask)
        tl.store(v_cache_ptr + block * stride_vc_b + offset * stride_vc_o
                 + offs_h[:, None] * stride_vc_h + offs_d[None, :], v, mask=mask)


@triton.jit
def _paged_decode_kernel(
    out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    scale_log2e,
    stride_q_s, stride_q_h,  # query (num_seqs, num_heads, head_dim)
    stride_o_s, stride_o_h,  # out, same shape
    stride_kc_b, stride_kc_o, stride_kc_h,
    stride_vc_b, stride_vc_o, stride_vc_h,
    stride_bt_s,  # block_tables (num_seqs, max_blocks_per_seq)
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid ``(num_seqs, num_kv_heads)``: program (s, kvh) attends the ``GROUP`` query
    heads that share KV head ``kvh`` of sequence ``s`` over its ``context_lens[s]`` tokens.

    Per tile of BLOCK_N context tokens, gathered through the block table, one (BLOCK_G, BLOCK_N)
    tl.dot scores all GROUP queries, and the online softmax folds the tile in::

        m_new = max(m, rowmax(s));  alpha = 2^(m - m_new);  p = 2^(s - m_new)
        l = l * alpha + rowsum(p);  acc = acc * alpha + p @ V_tile

    and finally writes ``acc / l``. Scores are in log2 units (scaled by ``scale * log2(e)``) so the
    exponentials are exp2. A sequence with ``context_len == 0`` (a padded CUDA-graph slot) gets zeros,
    not NaN; nothing reads a length on the host, so the launch can be captured in a CUDA graph.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g  # (BLOCK_G,) query heads of this KV head

    q = tl.load(query_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_G, BLOCK_D)
    context_len = tl.load(context_lens_ptr + seq)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(0, context_len, BLOCK_N):
        pos = start + offs_n  # (BLOCK_N,) logical token positions
        valid = pos < context_len
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kc_b + offset[:, None] * stride_kc_o
                    + kv_head * stride_kc_h + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vc_b + offset[:, None] * stride_vc_o
                    + kv_head * stride_vc_h + offs_d[None, :], mask=kv_mask, other=0.0)

        s = _dot(q, tl.trans(k), UPCAST) * scale_log2e  # (BLOCK_G, BLOCK_N)
        s = tl.where(valid[None, :], s, float("-inf"))
        # start < context_len, so every tile has a valid key and m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)  # (BLOCK_G, BLOCK_D)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_o_s + heads[:, None] * stride_o_h + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _paged_prefill_kernel(
    out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr,
    context_lens_ptr,
    scale_log2e,
    stride_q_t, stride_q_h,  # query (total_q_tokens, num_heads, head_dim)
    stride_o_t, stride_o_h,
    stride_kc_b, stride_kc_o, stride_kc_h,
    stride_vc_b, stride_vc_o, stride_vc_h,
    stride_bt_s,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid ``(cdiv(max_q_len, BLOCK_M), num_heads, num_seqs)``: program (i, h, s) computes
    query tokens ``i*BLOCK_M .. (i+1)*BLOCK_M - 1`` of sequence ``s``'s chunk, head ``h``.

    Chunk query ``j`` sits at position ``prefix + j`` (``prefix = context_len - q_len``) and sees
    keys ``0 .. prefix + j``, so the program walks keys up to its tile's last position with the
    decode kernel's online softmax; tiles past a short sequence's chunk do nothing.
    """
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)
    prefix = context_len - q_len  # tokens cached before this chunk
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) index within the chunk
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < q_len
    q_pos = prefix + offs_m  # (BLOCK_M,) position of each query in its sequence
    tokens = q_start + offs_m  # rows of the packed query/output
    q = tl.load(query_ptr + tokens[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

    # Keys this tile can see: up to its last query's position (a tile past the chunk: none).
    kv_end = tl.minimum(context_len, prefix + (tile + 1) * BLOCK_M)
    kv_end = tl.where(tile * BLOCK_M < q_len, kv_end, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        pos = start + offs_n  # (BLOCK_N,) key positions
        valid = pos < context_len
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kc_b + offset[:, None] * stride_kc_o
                    + kv_head * stride_kc_h + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vc_b + offset[:, None] * stride_vc_o
                    + kv_head * stride_vc_h + offs_d[None, :], mask=kv_mask, other=0.0)

        s = _dot(q, tl.trans(k), UPCAST) * scale_log2e  # (BLOCK_M, BLOCK_N)
        visible = (pos[None, :] <= q_pos[:, None]) & valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        # Key 0 is in the first tile and visible to every row (q_pos >= 0), so m_i is
        # finite from the first tile on and a fully masked row-tile later adds exp2(-inf)=0.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)  # (BLOCK_M, BLOCK_D)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_o_t + head * stride_o_h + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


# True when ``@triton.jit`` built interpreter functions (TRITON_INTERPRET=1 at import time): the
# kernels then run on CPU tensors with NumPy.
INTERPRETED: bool = type(_store_kv_kernel).__name__ == "InterpretedFunction"


def _check_tensor(name: str, tensor, ndim: int, layout: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """A tensor of ``ndim`` dimensions and one of ``dtypes``, contiguous in its last dimension
    (the kernels address it as ``ptr + offs``: its stride must be 1)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise TypeError(f"{name} has dtype {tensor.dtype}; allowed: {allowed}")
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tensor.stride()}; "
                         f"call .contiguous() first")


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"all tensors must be on the same device, got {listing}")


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The two caches: (num_blocks, block_size, num_kv_heads, head_dim), same dtype."""
    layout = "(num_blocks, block_size, num_kv_heads, head_dim)"
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, cache, 4, layout, FLOAT_DTYPES)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must have the same dtype, got {k_cache.dtype} and {v_cache.dtype}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size < 1 or num_kv_heads < 1:
        raise ValueError(f"k_cache has an empty dimension: shape {tuple(k_cache.shape)}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim is {head_dim}; allowed: 1 to {MAX_HEAD_DIM}")


def _check_query(query: torch.Tensor, k_cache: torch.Tensor, layout: str) -> int:
    """Query against the cache: same dtype and head_dim, whole GQA groups. Returns group."""
    _check_tensor("query", query, 3, layout, FLOAT_DTYPES)
    if query.dtype != k_cache.dtype:
        raise TypeError(f"query has dtype {query.dtype} but the cache has {k_cache.dtype}; they must match")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, cache_head_dim = k_cache.shape[2], k_cache.shape[3]
    if head_dim != cache_head_dim:
        raise ValueError(f"query head_dim {head_dim} does not match the cache's head_dim {cache_head_dim}")
    if num_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"query has {num_heads} heads, which must be a positive multiple of the cache's "
                         f"num_kv_heads={num_kv_heads} (each KV head serves a whole group of query heads)")
    return num_heads // num_kv_heads


def _check_scale(scale) -> None:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be finite and positive, got {scale}")


def check_device_supported(device: torch.device) -> None:
    """Compiled kernels need CUDA tensors; the interpreter (TRITON_INTERPRET=1) runs on CPU."""
    if device.type == "cuda" or (INTERPRETED and device.type == "cpu"):
        return
    allowed = "cuda or cpu" if INTERPRETED else "cuda (cpu only with TRITON_INTERPRET=1)"
    raise ValueError(f"Triton kernels got tensors on {device}; allowed: {allowed}")


def check_store_kv_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Validate ``store_kv``'s arguments (shapes, dtypes, strides, devices), never their values:
    reading slots back to the host is a sync, which a CUDA graph cannot capture."""
    _check_cache_pair(k_cache, v_cache)
    layout = "(num_tokens, num_kv_heads, head_dim)"
    expected = (k_cache.shape[2], k_cache.shape[3])
    for name, tensor in (("key", key), ("value", value)):
        _check_tensor(name, tensor, 3, layout, FLOAT_DTYPES)
        if tuple(tensor.shape[1:]) != expected:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected (num_tokens, {expected[0]}, "
                             f"{expected[1]}) to match the cache's (num_kv_heads, head_dim)")
        if tensor.dtype != k_cache.dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype} but the cache has {k_cache.dtype}; they must match")
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    _check_tensor("slot_mapping", slot_mapping, 1, "(num_tokens,)", INDEX_DTYPES)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries but key has "
                         f"{key.shape[0]} tokens; need one slot per token")
    _check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def _check_tables(block_tables, context_lens, num_seqs: int) -> None:
    _check_tensor("block_tables", block_tables, 2, "(num_seqs, max_blocks_per_seq)", INDEX_DTYPES)
    _check_tensor("context_lens", context_lens, 1, "(num_seqs,)", INDEX_DTYPES)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but there are {num_seqs} "
                         "sequences; need one row per sequence")
    if context_lens.shape[0] != num_seqs:
        raise ValueError(f"context_lens has {context_lens.shape[0]} entries but there are {num_seqs} "
                         "sequences; need one per sequence")


def check_decode_args(query, k_cache, v_cache, block_tables, context_lens, scale) -> None:
    """Validate ``paged_decode_attention``'s arguments (shapes, dtypes, strides, devices), never
    their values (a sync, which a CUDA graph cannot capture): that the block table covers each
    context is the scheduler's job."""
    _check_cache_pair(k_cache, v_cache)
    _check_query(query, k_cache, "(num_seqs, num_heads, head_dim)")
    _check_tables(block_tables, context_lens, query.shape[0])
    _check_scale(scale)
    _check_same_device(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                       context_lens=context_lens)


def check_prefill_lengths(q_lens: list[int], context_lens: list[int], total_q_tokens: int, block_size: int,
                          max_blocks_per_seq: int) -> None:
    """Validate the host-side lengths of a prefill batch (plain ints): the chunks tile the packed query,
    each fits in its context (its own K/V is already stored), each block-table row covers its context."""
    if sum(q_lens) != total_q_tokens:
        raise ValueError(f"cu_seqlens_q ends at {sum(q_lens)} but query has {total_q_tokens} tokens; "
                         "cu_seqlens_q[-1] must equal query.shape[0]")
    for seq, (q_len, context_len) in enumerate(zip(q_lens, context_lens)):
        if q_len < 0:
            raise ValueError(f"cu_seqlens_q must be non-decreasing, but sequence {seq} has q_len {q_len}")
        if context_len < q_len:
            raise ValueError(f"context_lens[{seq}] = {context_len} is smaller than that sequence's q_len {q_len}; "
                             "context_lens counts cached tokens including this chunk, so context_len >= q_len")
        needed = -(-context_len // block_size)
        if needed > max_blocks_per_seq:
            raise ValueError(f"context_lens[{seq}] = {context_len} needs {needed} blocks of "
                             f"{block_size} but block_tables has only {max_blocks_per_seq} columns")


def check_prefill_args(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale) -> list[int]:
    """Validate ``paged_prefill_attention``'s arguments; returns each sequence's q_len. Reads the lengths
    to the host (one sync: prefill is never captured in a CUDA graph) to check them and to size the grid."""
    _check_cache_pair(k_cache, v_cache)
    _check_query(query, k_cache, "(total_q_tokens, num_heads, head_dim)")
    _check_tensor("cu_seqlens_q", cu_seqlens_q, 1, "(num_seqs + 1,)", INDEX_DTYPES)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have num_seqs + 1 >= 1 entries, got 0")
    num_seqs = cu_seqlens_q.shape[0] - 1
    _check_tensor("context_lens", context_lens, 1, "(num_seqs,)", INDEX_DTYPES)
    if context_lens.shape[0] != num_seqs:
        raise ValueError(f"cu_seqlens_q has {num_seqs + 1} entries (so {num_seqs} sequences) but context_lens has "
                         f"{context_lens.shape[0]}; need len(cu_seqlens_q) == len(context_lens) + 1")
    _check_tables(block_tables, context_lens, num_seqs)
    _check_scale(scale)
    _check_same_device(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                       cu_seqlens_q=cu_seqlens_q, context_lens=context_lens)
    starts = cu_seqlens_q.tolist()
    if starts[0] != 0:
        raise ValueError(f"cu_seqlens_q must start at 0, got {starts[0]}")
    q_lens = [end - begin for begin, end in zip(starts[:-1], starts[1:])]
    check_prefill_lengths(q_lens, context_lens.tolist(), query.shape[0], k_cache.shape[1], block_tables.shape[1])
    return q_lens


def _dot_dim(extent: int) -> int:
    """A tile extent: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(MIN_DOT_DIM, triton.next_power_of_2(extent))


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` (num_tokens, num_kv_heads, head_dim) into their slots (``reference.store_kv``)."""
    check_store_kv_args(key, value, k_cache, v_cache, slot_mapping)
    check_device_supported(key.device)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride()[:2], *value.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence against its paged context (``reference.paged_decode_attention``),
    with no host sync, so a decode step using it can be captured in a CUDA graph."""
    check_decode_args(query, k_cache, v_cache, block_tables, context_lens, scale)
    check_device_supported(query.device)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out, query, k_cache, v_cache, block_tables, context_lens,
        float(scale) * LOG2E,
        *query.stride()[:2], *out.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=_dot_dim(group), BLOCK_D=_dot_dim(head_dim), BLOCK_N=DECODE_BLOCK_N,
        UPCAST=INTERPRETED and query.dtype == torch.bfloat16,
    )
    return out


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Causal attention for variable-length query chunks, paged context (``reference.paged_prefill_attention``)."""
    q_lens = check_prefill_args(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
    check_device_supported(query.device)
    total_q_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    max_q_len = max(q_lens, default=0)
    if total_q_tokens == 0 or max_q_len == 0:
        return out
    grid = (triton.cdiv(max_q_len, PREFILL_BLOCK_M), num_heads, len(q_lens))
    _paged_prefill_kernel[grid](
        out, query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
        float(scale) * LOG2E,
        *query.stride()[:2], *out.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_D=_dot_dim(head_dim), BLOCK_N=PREFILL_BLOCK_N,
        UPCAST=INTERPRETED and query.dtype == torch.bfloat16,
    )
    return out


__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "check_store_kv_args", "check_decode_args",
           "check_prefill_args", "check_prefill_lengths", "check_device_supported", "INTERPRETED"]
