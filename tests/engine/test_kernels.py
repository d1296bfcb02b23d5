"""Tests of the PyTorch reference kernels (``nanoengine.kernels.reference``) and dispatch.

The reference *is* the specification the Triton kernels are tested against, so it is
checked here against the most naive attention there is: dense K/V per sequence, scores
for every (query, key) pair, an explicit causal mask and a softmax spelled out in float64.
The paged layout is built by scattering each sequence's tokens into shuffled blocks with
junk padding entries, so a reference that read the wrong block or a padding entry fails.
"""

from __future__ import annotations

import math

import pytest
import torch

import nanoengine.kernels as kernels
from nanoengine.kernels import reference

# Reference (fp32 compute) vs naive float64: fp32 rounding only; fp16/bf16: output rounding.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def naive_attention(q, k, v, scale, q_offset):
    """Plain causal attention for one sequence, in float64.

    q (q_len, num_heads, d); k, v (ctx, num_kv_heads, d). Query ``i`` sits at position
    ``q_offset + i`` and sees keys ``0 .. q_offset + i``. Query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.
    """
    q_len, num_heads, _ = q.shape
    ctx, num_kv_heads, head_dim = k.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(q_len, num_heads, head_dim, dtype=torch.float64)
    for h in range(num_heads):
        kh = h // group
        for i in range(q_len):
            visible = q_offset + i + 1  # keys 0 .. q_offset + i
            scores = [
                float(q[i, h].double() @ k[j, kh].double()) * scale for j in range(visible)
            ]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for j in range(visible):
                out[i, h] += weights[j] / total * v[j, kh].double()
    return out


def make_paged(dense_k, dense_v, block_size, extra_blocks=3, padding="junk", seed=0):
    """Scatter per-sequence dense K/V into a shuffled paged cache.

    Returns (k_cache, v_cache, block_tables, context_lens). Physical blocks are handed out
    in a random order; table entries past a sequence's last block are padding: ``-1`` or
    (``padding="junk"``) ids of blocks that belong to *other* sequences.
    """
    gen = torch.Generator().manual_seed(seed)
    lens = [k.shape[0] for k in dense_k]
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + extra_blocks
    num_kv_heads, head_dim = dense_k[0].shape[1:]
    dtype = dense_k[0].dtype
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(per_seq) + 2
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    cursor = 0
    for s, (k, v) in enumerate(zip(dense_k, dense_v)):
        for b in range(per_seq[s]):
            block = order[cursor]
            cursor += 1
            tables[s, b] = block
            chunk = slice(b * block_size, min((b + 1) * block_size, lens[s]))
            n = chunk.stop - chunk.start
            k_cache[block, :n] = k[chunk]
            v_cache[block, :n] = v[chunk]
        if padding == "junk":
            tables[s, per_seq[s]:] = order[(s + 1) % len(order)]
    return k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def random_sequences(lens, num_kv_heads, head_dim, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in lens]
    vs = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in lens]
    return ks, vs


HEADS = [pytest.param(4, 4, id="mha"), pytest.param(4, 2, id="gqa"), pytest.param(6, 1, id="mqa")]


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size,lens", [
    pytest.param(4, [1, 8, 13], id="bs4"),
    pytest.param(16, [16, 32, 5], id="bs16-on-boundaries"),
    pytest.param(5, [11, 3], id="bs5"),
])
def test_decode_matches_naive(num_heads, num_kv_heads, block_size, lens):
    head_dim = 8
    ks, vs = random_sequences(lens, num_kv_heads, head_dim, torch.float32)
    k_cache, v_cache, tables, context_lens = make_paged(ks, vs, block_size)
    query = torch.randn(len(lens), num_heads, head_dim)
    scale = head_dim ** -0.5
    out = reference.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, scale)
    for s, n in enumerate(lens):
        # The decode query is the sequence's last token: position n - 1 sees everything.
        expected = naive_attention(query[s:s + 1], ks[s], vs[s], scale, q_offset=n - 1)[0]
        torch.testing.assert_close(out[s].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("q_lens,context_lens", [
    pytest.param([7, 12], [7, 12], id="no-prefix"),
    pytest.param([3, 12, 1], [11, 12, 9], id="cached-prefix"),
    pytest.param([4, 0, 5], [8, 6, 5], id="empty-chunk"),
])
def test_prefill_matches_naive(num_heads, num_kv_heads, q_lens, context_lens):
    head_dim, block_size = 8, 4
    ks, vs = random_sequences(context_lens, num_kv_heads, head_dim, torch.float32)
    k_cache, v_cache, tables, ctx = make_paged(ks, vs, block_size)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_dim)
    scale = head_dim ** -0.5
    out = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, scale)
    for s, (q_len, n) in enumerate(zip(q_lens, context_lens)):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        expected = naive_attention(query[rows], ks[s], vs[s], scale, q_offset=n - q_len)
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_matches_naive(dtype):
    lens, num_heads, num_kv_heads, head_dim = [9, 6], 4, 2, 16
    ks, vs = random_sequences(lens, num_kv_heads, head_dim, dtype)
    k_cache, v_cache, tables, ctx = make_paged(ks, vs, block_size=4)
    scale = head_dim ** -0.5
    query = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    out = reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale)
    assert out.dtype == dtype
    for s, n in enumerate(lens):
        expected = naive_attention(query[s:s + 1], ks[s], vs[s], scale, q_offset=n - 1)[0]
        torch.testing.assert_close(out[s].double(), expected, atol=TOLERANCES[dtype],
                                   rtol=TOLERANCES[dtype])
    chunk = torch.randn(sum(lens), num_heads, head_dim).to(dtype)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    out = reference.paged_prefill_attention(chunk, k_cache, v_cache, tables, cu, ctx, scale)
    for s, n in enumerate(lens):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        expected = naive_attention(chunk[rows], ks[s], vs[s], scale, q_offset=0)
        torch.testing.assert_close(out[rows].double(), expected, atol=TOLERANCES[dtype],
                                   rtol=TOLERANCES[dtype])
    assert out.dtype == dtype


def test_padding_entries_are_ignored():
    """Junk padding entries and -1 padding give bit-identical results."""
    lens, head_dim = [5, 9], 8
    ks, vs = random_sequences(lens, 2, head_dim, torch.float32)
    junk = make_paged(ks, vs, block_size=4, padding="junk")
    minus_one = make_paged(ks, vs, block_size=4, padding="none")
    assert not torch.equal(junk[2], minus_one[2])  # the tables really differ
    query = torch.randn(2, 4, head_dim)
    decode = [reference.paged_decode_attention(query, *paged, 0.3) for paged in (junk, minus_one)]
    assert torch.equal(decode[0], decode[1])
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    chunk = torch.randn(14, 4, head_dim)
    prefill = [
        reference.paged_prefill_attention(chunk, k, v, t, cu, c, 0.3)
        for k, v, t, c in (junk, minus_one)
    ]
    assert torch.equal(prefill[0], prefill[1])


def test_store_kv_round_trip_through_gather_kv():
    """Tokens stored through a slot mapping come back, in order, from gather_kv."""
    num_blocks, block_size, num_kv_heads, head_dim = 10, 4, 2, 8
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.tensor([[7, 2, 9, -1], [0, 5, -1, -1]], dtype=torch.int32)
    lens = [11, 6]
    slots = []
    for s, n in enumerate(lens):
        slots += [int(tables[s, t // block_size]) * block_size + t % block_size for t in range(n)]
    slot_mapping = torch.tensor(slots)
    key = torch.randn(len(slots), num_kv_heads, head_dim)
    value = torch.randn(len(slots), num_kv_heads, head_dim)
    reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
    start = 0
    for s, n in enumerate(lens):
        assert torch.equal(reference.gather_kv(k_cache, tables[s], n), key[start:start + n])
        assert torch.equal(reference.gather_kv(v_cache, tables[s], n), value[start:start + n])
        start += n


def test_store_kv_skips_minus_one_slots():
    k_cache = torch.zeros(3, 4, 1, 2)
    v_cache = torch.zeros(3, 4, 1, 2)
    key = torch.ones(3, 1, 2)
    value = 2 * torch.ones(3, 1, 2)
    reference.store_kv(key, value, k_cache, v_cache, torch.tensor([5, -1, 0]))
    written = {0, 5}
    for slot in range(12):
        block, offset = divmod(slot, 4)
        expect = 1.0 if slot in written else 0.0
        assert torch.all(k_cache[block, offset] == expect)
        assert torch.all(v_cache[block, offset] == 2 * expect)


@pytest.mark.parametrize("native", [True, False], ids=["native kernels built", "no native kernels"])
def test_dispatch_keeps_cpu_tensors_off_triton(monkeypatch, native):
    """CPU tensors never reach Triton: store-KV runs the reference; attention runs what the CPU
    engine runs, the native kernels where they are built (else the reference)."""
    from nanoengine.kernels import cpu_native

    if native and not cpu_native.load():
        pytest.skip("the native kernels cannot be built here")
    monkeypatch.setattr(kernels, "runs_native", lambda tensor: native)
    attention = cpu_native if native else reference
    calls = []
    for module, name in ((reference, "store_kv"), (attention, "paged_decode_attention"),
                         (attention, "paged_prefill_attention")):
        original = getattr(module, name)

        def spy(*args, _name=name, _original=original):
            calls.append(_name)
            return _original(*args)

        monkeypatch.setattr(module, name, spy)
    assert kernels._triton_for(torch.zeros(1)) is None

    k_cache = torch.zeros(4, 4, 1, 8)
    v_cache = torch.zeros(4, 4, 1, 8)
    kernels.store_kv(torch.randn(6, 1, 8), torch.randn(6, 1, 8), k_cache, v_cache,
                     torch.tensor([8, 9, 10, 11, 12, 13]))
    tables = torch.tensor([[2, 3]], dtype=torch.int32)
    ctx = torch.tensor([6], dtype=torch.int32)
    out = kernels.paged_decode_attention(torch.randn(1, 2, 8), k_cache, v_cache, tables, ctx, 0.5)
    assert out.shape == (1, 2, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    out = kernels.paged_prefill_attention(torch.randn(6, 2, 8), k_cache, v_cache, tables, cu,
                                          ctx, 0.5)
    assert out.shape == (6, 2, 8)
    assert calls == ["store_kv", "paged_decode_attention", "paged_prefill_attention"]
