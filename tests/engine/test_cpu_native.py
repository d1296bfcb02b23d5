"""The native CPU kernels (kernels/cpu_native.py): right answers, fixed bits, routing, fallback."""

from __future__ import annotations

import itertools
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

from nanoengine.backends.cpu import CpuAttention, CpuBackend, CpuLinearMethod
from nanoengine.kernels import cpu_gemm, cpu_native, reference
from nanoengine.layers.attention import AttentionImpl
from nanoengine.layers.kernels import building_with
from nanoengine.layers.linear import ColumnParallelLinear

needs_kernel = pytest.mark.skipif(cpu_native.unavailable_reason() is not None or not cpu_native.load(),
                                  reason="the native kernels cannot be built on this machine")


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("in_features", [576, 40, 17])  # 17 and 40: the scalar tail after the 16-wide steps
def test_kernel_computes_what_f_linear_does(rows, in_features):
    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, in_features), torch.randn(96, in_features), torch.randn(96)
    torch.testing.assert_close(cpu_native.few_rows_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_native.few_rows_linear(x, weight, bias), F.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-4)


@needs_kernel
def test_bfloat16_is_summed_in_float32_and_rounded_once():
    torch.manual_seed(0)
    x, weight = torch.randn(3, 576, dtype=torch.bfloat16), torch.randn(200, 576, dtype=torch.bfloat16)
    out = cpu_native.few_rows_linear(x, weight)
    exact = F.linear(x.double(), weight.double())
    assert out.dtype == torch.bfloat16
    # One rounding to bfloat16 (8 bits of mantissa) of a float32 sum: within 2^-8 relative.
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()


@needs_kernel
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_threads():
    """The summation order is fixed by the source: alone or beside 7 others, on 1 or 2 threads."""
    torch.manual_seed(0)
    x, weight = torch.randn(8, 576), torch.randn(3072, 576)
    together = cpu_native.few_rows_linear(x, weight)
    for i in range(8):
        assert torch.equal(cpu_native.few_rows_linear(x[i:i + 1], weight), together[i:i + 1])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(cpu_native.few_rows_linear(x, weight), together)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_an_empty_inner_dimension_gives_the_bias_or_zeros():
    x, weight, bias = torch.randn(3, 0), torch.randn(5, 0), torch.randn(5)
    assert torch.equal(cpu_native.few_rows_linear(x, weight), F.linear(x, weight))
    assert torch.equal(cpu_native.few_rows_linear(x, weight, bias), F.linear(x, weight, bias))


@needs_kernel
def test_bad_inputs_are_refused_with_what_was_wrong():
    weight = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.nanoengine.few_rows_linear(torch.randn(1, 8, dtype=torch.float64), weight, None)
    with pytest.raises(RuntimeError, match=r"x \(M, K\) and weight \(N, K\)"):
        torch.ops.nanoengine.few_rows_linear(torch.randn(1, 7), weight, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.nanoengine.few_rows_linear(torch.randn(1, 8), torch.randn(8, 4).t(), None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.nanoengine.few_rows_linear(torch.randn(1, 8), weight, torch.randn(5))


@needs_kernel
def test_the_backend_sends_few_rows_to_the_kernel_and_more_to_the_library():
    torch.manual_seed(0)
    backend = CpuBackend("cpu")
    with building_with(backend.kernels):
        layer = ColumnParallelLinear(48, 40)
    torch.nn.init.normal_(layer.weight)
    backend.process_weights_after_loading(torch.nn.ModuleList([layer]))
    method = layer.linear_method
    assert isinstance(method, CpuLinearMethod) and method.few_rows and backend.native_kernels
    assert "few-rows kernel" in backend.describe()
    few = torch.randn(cpu_native.MAX_ROWS, 48)
    many = torch.randn(cpu_native.MAX_ROWS + 1, 48)
    with torch.inference_mode():
        assert torch.equal(layer(few), cpu_native.few_rows_linear(few, layer.weight))
        assert torch.equal(layer(many), cpu_gemm.linear(many, layer.weight, None, method.packed))
        assert torch.equal(layer(few[:1].reshape(1, 1, 48)), cpu_native.few_rows_linear(few[:1], layer.weight)[None])


def test_a_stale_build_lock_is_removed_with_a_warning_and_a_fresh_one_kept(tmp_path):
    import os

    lock = tmp_path / "lock"
    assert cpu_native.clear_stale_lock(tmp_path) is False  # no lock at all
    lock.touch()  # another process building right now
    assert cpu_native.clear_stale_lock(tmp_path) is False and lock.exists()
    old = time.time() - cpu_native.STALE_LOCK_S - 60
    os.utime(lock, (old, old))  # left by a process that stopped while building
    with pytest.warns(cpu_native.KernelBuildWarning, match=r"a build lock 11 minutes old"):
        assert cpu_native.clear_stale_lock(tmp_path) is True
    assert not lock.exists()


def test_without_the_kernel_one_warning_names_why_and_the_libraries_compute(monkeypatch):
    monkeypatch.setattr(cpu_native, "unavailable_reason", lambda: "a test said so")
    cpu_native.load.cache_clear()
    try:
        with pytest.warns(cpu_native.KernelBuildWarning, match="a test said so"):
            assert cpu_native.load() is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the answer is kept: no second warning
            assert cpu_native.load() is False
            backend = CpuBackend("cpu")
            with building_with(backend.kernels):
                layer = ColumnParallelLinear(48, 40)
            torch.nn.init.normal_(layer.weight)
            backend.process_weights_after_loading(torch.nn.ModuleList([layer]))
        assert not backend.native_kernels and "few-rows" not in backend.describe()
        assert backend.kernels.name == "cpu, PyTorch libraries" and backend.kernels.decoder_layer is None
        assert not backend.attention.native and "reference decode" in backend.attention.name
        x = torch.randn(1, 48)
        expected = (cpu_gemm.linear(x, layer.weight, None, layer.linear_method.packed)
                    if isinstance(layer.linear_method, CpuLinearMethod) else F.linear(x, layer.weight))
        with torch.inference_mode():
            assert torch.equal(layer(x), expected)
    finally:
        cpu_native.load.cache_clear()


def test_the_build_is_named_for_its_torch_python_and_instruction_set():
    name = cpu_native.build_name()
    assert torch.__version__.split("+")[0].replace(".", "_") in name and name.endswith(f"_{cpu_native.isa()}")
    assert cpu_native.isa() in cpu_native.ISA_FLAGS
    assert cpu_native.build_directory().name == name


def _paged_case(dtype, lens, *, heads=9, kv_heads=3, head_dim=64, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(1, max((n + block_size - 1) // block_size for n in lens))
    num_blocks = max(64, len(lens) * max_blocks)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * max_blocks].view(len(lens), max_blocks).int()
    query = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [dict(), dict(heads=4, kv_heads=2, head_dim=128, block_size=8),
                                   dict(heads=14, kv_heads=2, head_dim=32), dict(heads=8, kv_heads=1, head_dim=64),
                                   dict(heads=4, kv_heads=4, head_dim=20, block_size=4)],
                         ids=["gqa, 64-wide heads", "gqa, 128-wide heads", "groups of 7, 32-wide heads",
                              "groups of 8", "mha, 20-wide heads (no register path)"])
def test_native_decode_attention_is_the_reference(dtype, shape):
    lens = [1, 17, 64, 100, 33, 16]
    query, k_cache, v_cache, tables, context_lens = _paged_case(dtype, lens, **shape)
    out = cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, 0.125)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, 0.125)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, expected, **tolerance)
    for i in range(len(lens)):  # a sequence's bits do not depend on the others in its batch
        alone = cpu_native.paged_decode_attention(query[i:i + 1], k_cache, v_cache, tables[i:i + 1],
                                                  context_lens[i:i + 1], 0.125)
        assert torch.equal(alone, out[i:i + 1])
    long_tables = cpu_native.paged_decode_attention(query, k_cache, v_cache, tables.long(), context_lens.long(), 0.125)
    assert torch.equal(long_tables, out)


# The AVX2 build's attention (decode or prefill) of the cases below, computed in a process PyTorch is
# told to run on AVX2 (the pinned path the notebooks are checked on), so it loads that build.
_AVX2_BUILD_SCRIPT = """
import sys, torch
from nanoengine.kernels import cpu_native
assert cpu_native.isa() == "avx2_fma" and cpu_native.load(), cpu_native.isa()
cases = torch.load(sys.argv[1])
torch.save([getattr(cpu_native, op)(*case, 0.125) for op, case in cases], sys.argv[2])
"""


@needs_kernel
@pytest.mark.slow
@pytest.mark.skipif(cpu_native.isa() != "avx512", reason="this process uses the AVX2 build: there is one build only")
def test_native_attention_has_the_same_bits_in_both_builds(tmp_path):
    """Sixteen lanes (this process's AVX-512 build) against eight (the AVX2 build, in a process of
    its own): every remainder of the key steps, four head sizes, two dtypes, softmaxes that underflow;
    decode, and prefill chunks with and without tokens cached before them."""
    import os
    import subprocess
    import sys

    lens = list(range(1, 42)) + [64, 100, 255]
    cases = []
    for dtype, head_dim in itertools.product((torch.float32, torch.bfloat16), (32, 64, 128, 48)):
        query, k_cache, v_cache, tables, context_lens = _paged_case(dtype, lens, head_dim=head_dim, seed=head_dim)
        cases += [("paged_decode_attention", (q, k_cache, v_cache, tables, context_lens)) for q in (query, query * 40)]
        for lens_, q_lens in PREFILL_CASES:
            cases.append(("paged_prefill_attention", _prefill_case(dtype, lens_, q_lens, head_dim=head_dim)))
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "2"}
    subprocess.run([sys.executable, "-c", _AVX2_BUILD_SCRIPT, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                   env=env, check=True, timeout=600)
    for (op, case), eight_lanes in zip(cases, torch.load(tmp_path / "out.pt"), strict=True):
        assert torch.equal(getattr(cpu_native, op)(*case, 0.125), eight_lanes), op


@needs_kernel
def test_native_decode_attention_refuses_what_would_read_outside_the_cache():
    query, k_cache, v_cache, tables, context_lens = _paged_case(torch.float32, [5, 20])
    bad_block = tables.clone()
    bad_block[1, 1] = 64  # the cache has blocks 0..63
    with pytest.raises(RuntimeError, match="block 1 is 64; the cache has blocks 0..63"):
        cpu_native.paged_decode_attention(query, k_cache, v_cache, bad_block, context_lens, 1.0)
    with pytest.raises(RuntimeError, match="context length 33; allowed 1..32"):
        cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, torch.tensor([5, 33], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="context length 0"):
        cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, torch.tensor([0, 3], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_native.paged_decode_attention(query.double(), k_cache, v_cache, tables, context_lens, 1.0)
    with pytest.raises(RuntimeError, match="kv_heads must be >= 1"):
        cpu_native.paged_decode_attention(query, k_cache[:, :, :0], v_cache[:, :, :0], tables, context_lens, 1.0)


@needs_kernel
def test_the_backend_decodes_with_the_native_kernel_and_builds_no_plan():
    backend = CpuBackend("cpu")
    assert isinstance(backend.attention, CpuAttention) and backend.attention.native
    assert "native paged decode" in backend.attention.name
    assert backend.kernels.attention is backend.attention  # what the attention layers built for it call
    assert not CpuBackend("cpu", torch.float16).attention.native  # a dtype the kernels do not take: PyTorch's


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (5, 576), (3, 4, 20), (2, 7)], ids=str)
def test_native_rms_norm_is_the_layers_definition(dtype, shape):
    from nanoengine.layers.layernorm import add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    weight = torch.rand(shape[-1], generator=gen).to(dtype) + 0.5
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(cpu_native.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5), **tolerance)
    out, new_residual = cpu_native.add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_residual = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, expected_residual)  # one rounded add: the same bits
    torch.testing.assert_close(out, expected_out, **tolerance)
    assert torch.equal(cpu_native.rms_norm(x[:1], weight, 1e-5), cpu_native.rms_norm(x, weight, 1e-5)[:1])


@needs_kernel
def test_native_rms_norm_refuses_mismatched_inputs():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match=r"x \(..., H\) and weight \(H,\)"):
        cpu_native.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_native.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="residual must be"):
        cpu_native.add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-5)


@needs_kernel
def test_the_backend_gives_every_norm_the_native_kernels():
    from nanoengine.layers.layernorm import RMSNorm

    with building_with(CpuBackend("cpu").kernels):  # as loader.build_model builds a model
        model = torch.nn.ModuleList([RMSNorm(16), RMSNorm(16)])
    assert all(m.norm_fn is cpu_native.rms_norm and m.add_norm_fn is cpu_native.add_rms_norm for m in model)
    assert RMSNorm.norm_fn is not cpu_native.rms_norm  # the class keeps the eager definition
    assert RMSNorm(16).norm_fn is RMSNorm.norm_fn  # built outside a backend: the layer's own function
    assert CpuBackend("cpu", torch.float16).kernels.rms_norm is None  # a dtype the kernels do not take


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 48, 6])
def test_rotate_half_has_eagers_bits_on_a_strided_view_of_the_step(dtype, head_dim):
    from nanoengine.layers.rotary import RotaryEmbedding, rotate_half

    gen = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, 512, 10000.0)
    tokens, heads = 37, 12
    qkv = torch.randn(tokens, (heads + 3) * head_dim, generator=gen).to(dtype)  # [q | k] then v, as a layer has it
    qk = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    rows = rope.rows(torch.randint(0, 512, (tokens,), generator=gen))
    assert torch.equal(cpu_native.rotate_half(qk, *rows), rotate_half(qk, *rows))


@needs_kernel
def test_rotate_half_leaves_what_it_cannot_walk_to_eager_and_refuses_bad_tables():
    from nanoengine.layers.rotary import RotaryEmbedding, rotate_half

    rope = RotaryEmbedding(8, 16, 10000.0)
    rows = rope.rows(torch.arange(4))
    half = torch.randn(4, 2, 8).half()  # float16: the eager function
    assert torch.equal(cpu_native.rotate_half(half, *rows), rotate_half(half, *rows))
    with pytest.raises(RuntimeError, match=r"cos and sin \(tokens, 1, head_dim\)"):
        cpu_native.rotate_half(torch.randn(4, 2, 8), rows[0][:3], rows[1][:3])


@needs_kernel
def test_the_backend_gives_the_rotary_embedding_the_native_kernel():
    from nanoengine.layers.rotary import RotaryEmbedding

    with building_with(CpuBackend("cpu").kernels):
        model = torch.nn.ModuleList([RotaryEmbedding(16, 32, 10000.0)])
    assert model[0].rotate_fn is cpu_native.rotate_half and RotaryEmbedding.rotate_fn is not cpu_native.rotate_half


@needs_kernel
def test_native_kernels_round_to_bfloat16_as_pytorch_does_one_value():
    """The vectorised rounding (csrc/cpu_vec.h) against c10::BFloat16's rule, lane by lane and in the tail:
    nearest with ties to even, overflow to infinity, NaN to 0x7FC0."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**15, 2**15, (64, 203), generator=gen, dtype=torch.int16)  # random bfloat16 bit patterns, NaNs and infinities among them
    x = bits.view(torch.bfloat16)
    # residuals a few binades away: their float32 sums keep bits that rounding must drop, ties included
    residual = (x.float() * torch.rand(64, 203, generator=gen).mul(2.0**-9)).to(torch.bfloat16)
    _, new_residual = cpu_native.add_rms_norm(x, residual, torch.ones(203, dtype=torch.bfloat16), 1e-5)
    total = (x.float() + residual.float()).view(torch.int32).long() & 0xFFFFFFFF
    expected = (total + 0x7FFF + ((total >> 16) & 1)) >> 16
    expected = torch.where((x.float() + residual.float()).isnan(), 0x7FC0, expected)
    assert torch.equal(new_residual.view(torch.int16).long() & 0xFFFF, expected)
    ties = ((total & 0xFFFF) == 0x8000).sum()
    assert ties > 10  # the exact halfway cases were exercised


# fresh prompts, chunks after a cached prefix, an empty chunk, one token; and one prompt that
# outweighs the rest (the bfloat16 path then runs the sequences one after another)
PREFILL_CASES = [([40, 17, 64, 100, 33, 5, 1], [40, 17, 20, 0, 33, 3, 1]), ([90, 30], [90, 12])]


def _prefill_case(dtype, lens, q_lens, seed=3, **shape):
    query, k_cache, v_cache, tables, context_lens = _paged_case(dtype, lens, block_size=16, seed=seed, **shape)
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed + 1)
    chunk = torch.randn(sum(q_lens), query.shape[1], query.shape[2], generator=gen).to(dtype)
    return chunk, k_cache, v_cache, tables, cu, context_lens


def _with_threads(threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _decode_of_each_token(chunk, k_cache, v_cache, tables, cu, context_lens):
    """Every query token of the chunks as a decode query of its own, seeing the keys up to its position."""
    rows, lengths = [], []
    for s, (q_start, q_end) in enumerate(zip(cu.tolist(), cu[1:].tolist())):
        cached = int(context_lens[s]) - (q_end - q_start)
        rows += [s] * (q_end - q_start)
        lengths += [cached + j + 1 for j in range(q_end - q_start)]
    return cpu_native.paged_decode_attention(chunk, k_cache, v_cache, tables[rows],
                                             torch.tensor(lengths, dtype=torch.int32), 0.125)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens, q_lens", PREFILL_CASES)
def test_native_prefill_attention_is_the_reference_with_decodes_bits(threads, dtype, lens, q_lens):
    """Each query token is attended by the decode kernel's loop: the reference's values, and exactly the
    bits a decode step gives that token over its visible keys, however the tokens are shared out between
    threads and whatever else the step holds."""
    args = _prefill_case(dtype, lens, q_lens)
    with torch.inference_mode():  # the engine's mode
        out = _with_threads(threads, lambda: cpu_native.paged_prefill_attention(*args, 0.125))
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, reference.paged_prefill_attention(*args, 0.125), **tolerance)
    assert torch.equal(out, _decode_of_each_token(*args))
    chunk, k_cache, v_cache, tables, cu, context_lens = args
    first = int(cu[1])  # the first sequence alone
    alone = cpu_native.paged_prefill_attention(chunk[:first], k_cache, v_cache, tables[:1], cu[:2], context_lens[:1],
                                               0.125)
    assert torch.equal(alone, out[:first])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [dict(heads=4, kv_heads=2, head_dim=128), dict(heads=4, kv_heads=4, head_dim=32),
                                   dict(heads=8, kv_heads=1, head_dim=64), dict(heads=4, kv_heads=2, head_dim=20)],
                         ids=["groups of 2, 128-wide", "mha, 32-wide", "groups of 8", "groups of 2, 20-wide"])
@pytest.mark.parametrize("lens, q_lens", PREFILL_CASES)
def test_native_prefill_attention_is_the_reference_for_every_head_shape(dtype, shape, lens, q_lens):
    args = _prefill_case(dtype, lens, q_lens, **shape)
    out = cpu_native.paged_prefill_attention(*args, 0.125)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, reference.paged_prefill_attention(*args, 0.125), **tolerance)
    assert torch.equal(out, _decode_of_each_token(*args))


@needs_kernel
def test_native_prefill_attention_refuses_what_would_read_outside_the_cache():
    query, k_cache, v_cache, tables, context_lens = _paged_case(torch.float32, [5, 9])
    chunk, cu = torch.randn(14, 9, 64), torch.tensor([0, 5, 14])
    with pytest.raises(RuntimeError, match="context length 40; allowed"):
        cpu_native.paged_prefill_attention(chunk, k_cache, v_cache, tables, cu, torch.tensor([5, 40]), 1.0)
    with pytest.raises(RuntimeError, match="has 9 query tokens and context length 3"):
        cpu_native.paged_prefill_attention(chunk, k_cache, v_cache, tables, cu, torch.tensor([5, 3]), 1.0)
    with pytest.raises(RuntimeError, match="block 0 is 99"):
        cpu_native.paged_prefill_attention(chunk, k_cache, v_cache, torch.full_like(tables, 99), cu, context_lens, 1.0)
    with pytest.raises(RuntimeError, match="must run from 0 to the query's 14 tokens"):
        cpu_native.paged_prefill_attention(chunk, k_cache, v_cache, tables, torch.tensor([0, 5, 13]), context_lens, 1.0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", ["decodes", "prefills", "both"])
def test_paged_attention_is_the_layers_python_calls_in_one(dtype, step):
    """Store-KV, then decode rows and prefill chunks: ``AttentionImpl.forward`` as CpuAttention runs it
    from Python, bit for bit, in the caches it writes and in what it returns."""
    from nanoengine.backends.base import block_table_tensor
    from nanoengine.backends.cpu import CpuAttentionMetadata

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d, block_size, num_blocks = 6, 2, 64, 4, 32
    decodes = [5, 9] if step != "prefills" else []  # context lengths of the decoding sequences
    prefills = [(7, 7), (3, 10)] if step != "decodes" else []  # (this chunk's tokens, context incl. the chunk)
    tokens = len(decodes) + sum(q for q, _ in prefills)
    free = iter(torch.randperm(num_blocks, generator=gen).tolist())
    tables = [[next(free) for _ in range((n + block_size - 1) // block_size)] for n in decodes + [c for _, c in prefills]]
    slots = [tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size for i, n in enumerate(decodes)]
    for j, (q_len, ctx) in enumerate(prefills):
        table = tables[len(decodes) + j]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]
    cu = [0]
    for q_len, _ in prefills:
        cu.append(cu[-1] + q_len)
    meta = CpuAttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_tokens=len(decodes),
        decode_block_tables=block_table_tensor(tables[:len(decodes)], torch.device("cpu")),
        decode_context_lens=torch.tensor(decodes, dtype=torch.int32),
        prefill_block_tables=block_table_tensor(tables[len(decodes):], torch.device("cpu")),
        prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        prefill_context_lens=torch.tensor([c for _, c in prefills], dtype=torch.int32))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = qkv[:, :heads * d].view(tokens, heads, d)  # strided views of the projection, as the layer passes them
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d)
    caches = torch.randn(2, num_blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    attention = CpuAttention(native=True)
    native_caches = caches.clone()
    out = attention.forward(q, k, v, native_caches[0], native_caches[1], meta, 0.125)  # the one native call
    python_caches = caches.clone()
    expected = AttentionImpl.forward(attention, q, k, v, python_caches[0], python_caches[1], meta, 0.125)
    assert torch.equal(native_caches, python_caches) and not torch.equal(native_caches, caches)
    assert torch.equal(out, expected)


@needs_kernel
def test_paged_attention_declares_the_caches_it_writes_and_refuses_a_step_that_does_not_add_up():
    schema = torch.ops.nanoengine.paged_attention.default._schema
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["k_cache", "v_cache"]
    q, kv, cache = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.zeros(4, 4, 1, 8)
    empty_table = torch.zeros(0, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="do not make the step's 3 tokens"):
        torch.ops.nanoengine.paged_attention(q, kv, kv, cache, cache.clone(), torch.arange(3), 0, empty_table,
                                             torch.zeros(0, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                                             torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
                                             1.0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_has_eagers_bits(dtype):
    from nanoengine.layers.activation import silu_and_mul

    x = torch.randn(5, 2 * 1536).to(dtype)
    assert torch.equal(cpu_native.silu_and_mul(x), silu_and_mul(x))
    with pytest.raises(RuntimeError, match="2 \\* intermediate"):
        cpu_native.silu_and_mul(torch.randn(2, 7))


@needs_kernel
def test_the_backend_gives_the_activation_the_native_kernel():
    from nanoengine.layers.activation import SiluAndMul

    with building_with(CpuBackend("cpu").kernels):
        model = torch.nn.ModuleList([SiluAndMul()])
    assert model[0].silu_and_mul_fn is cpu_native.silu_and_mul


def test_the_build_uses_the_ninja_beside_this_python_whatever_path_says(tmp_path, monkeypatch):
    """Two ninja versions read each other's build log as stale and rebuild everything: the build runs
    the one installed beside the interpreter (the pinned one in .venv/bin) first on PATH, then PATH
    is as it was."""
    import os
    import sys

    (tmp_path / "ninja").write_text("")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", "/usr/bin")
    with cpu_native.pinned_ninja():
        assert os.environ["PATH"].split(os.pathsep) == [str(tmp_path), "/usr/bin"]
    assert os.environ["PATH"] == "/usr/bin"
    (tmp_path / "ninja").unlink()  # no ninja beside it: PATH untouched
    with cpu_native.pinned_ninja():
        assert os.environ["PATH"] == "/usr/bin"
