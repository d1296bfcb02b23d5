"""Tests of the Triton kernels (``nanoengine.kernels.triton_kernels``) against the reference.

Three layers, cheapest first:

* Input validation, in this process: the wrappers' ``check_*`` helpers are plain Python,
  so bad shapes, dtypes, strides and devices are tested on CPU without running a kernel.
* The kernels under the Triton interpreter, on CPU. ``TRITON_INTERPRET=1`` must be set
  before ``@triton.jit`` decorates the kernels, i.e. before ``triton_kernels`` is first
  imported, and another test in this process may already have imported it. So the
  kernel cases run in a child process: this file, run as a script
  (``python tests/engine/test_triton_kernels.py interpret CASE...``), with the variable set. One
  child runs every selected case; each case is still its own pytest test. Shapes are tiny
  because the interpreter executes every program instance in NumPy.
* ``@pytest.mark.gpu``: the compiled kernels on CUDA at realistic shapes (skipped here).
  On CPU, one test compiles the kernels ahead of time for an sm_90 (H100/H200) target, so
  code that only the real compiler rejects (e.g. a ``tl.dot`` dimension under 16) fails in
  CPU CI too.

Tolerances (max abs and rel error vs the reference, which computes in fp32):
fp32 1e-4, fp16 2e-3, bf16 2e-2. The low-precision bounds cover rounding the attention
probabilities to the V dtype before the ``p @ V`` product (as flash attention does) and
rounding the output; store_kv is a copy and must be bit exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nanoengine.kernels import reference

REPO_ROOT = Path(__file__).resolve().parents[2]
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
RESULT_MARKER = "TRITON-CASE-RESULTS:"
CHILD_TIMEOUT_S = 300


# --------------------------------------------------------------------------------------
# Builders shared by the interpreted cases and the GPU tests
# --------------------------------------------------------------------------------------


def make_paged_cache(context_lens, num_kv_heads, head_dim, block_size, dtype, device="cpu",
                     spare_blocks=2, padding=-1, seed=0):
    """Random K/V caches and shuffled block tables for sequences of ``context_lens`` tokens.

    Physical blocks are handed out in a random order (so tables are non-contiguous), with
    ``spare_blocks`` unused blocks of noise; table entries past a sequence's last block are
    ``padding`` (-1, or a valid id of somebody else's block: either must never be read).
    Returns (k_cache, v_cache, block_tables int32, context_lens int32).
    """
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(context_lens), max(per_seq, default=0) + 1), padding,
                        dtype=torch.int32)
    cursor = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = order[cursor:cursor + n]
        cursor += n
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return k_cache.to(device), v_cache.to(device), tables.to(device), lens.to(device)


def cu_seqlens(q_lens, device="cpu"):
    return torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def max_error(actual, expected):
    return float((actual.float() - expected.float()).abs().max()) if actual.numel() else 0.0


def assert_matches(actual, expected, dtype):
    tol = TOLERANCES[dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# --------------------------------------------------------------------------------------
# Interpreted cases: each runs in the child process and returns its max abs error
# --------------------------------------------------------------------------------------


def _store_case(num_kv_heads, head_dim, block_size, dtype, slot_dtype, skip_every,
                strided=False):
    def run(tk):
        gen = torch.Generator().manual_seed(3)
        num_blocks, num_tokens = 6, 17
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        slots[::skip_every] = -1
        slot_mapping = slots.to(slot_dtype)
        width = 2 * num_kv_heads if strided else num_kv_heads
        # strided: K/V are head slices of a wider tensor, like a fused QKV projection.
        key = torch.randn(num_tokens, width, head_dim, generator=gen).to(dtype)[:, :num_kv_heads]
        value = torch.randn(num_tokens, width, head_dim, generator=gen).to(dtype)[:, :num_kv_heads]
        expected_k, expected_v = k_cache.clone(), v_cache.clone()
        reference.store_kv(key, value, expected_k, expected_v, slot_mapping)
        tk.store_kv(key, value, k_cache, v_cache, slot_mapping)
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
        return 0.0
    return run


def _decode_case(lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                 index_dtype=torch.int32, padding=-1, strided_query=False):
    def run(tk):
        k_cache, v_cache, tables, ctx = make_paged_cache(lens, num_kv_heads, head_dim,
                                                         block_size, dtype, padding=padding)
        tables, ctx = tables.to(index_dtype), ctx.to(index_dtype)
        gen = torch.Generator().manual_seed(5)
        width = 2 * head_dim if strided_query else head_dim
        query = torch.randn(len(lens), num_heads, width, generator=gen).to(dtype)[..., :head_dim]
        scale = head_dim ** -0.5
        out = tk.paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale)
        expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale)
        assert_matches(out, expected, dtype)
        return max_error(out, expected)
    return run


def _prefill_case(q_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                  padding=-1):
    def run(tk):
        k_cache, v_cache, tables, ctx = make_paged_cache(context_lens, num_kv_heads, head_dim,
                                                         block_size, dtype, padding=padding)
        gen = torch.Generator().manual_seed(7)
        query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
        cu = cu_seqlens(q_lens)
        scale = head_dim ** -0.5
        out = tk.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, scale)
        expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx,
                                                     scale)
        assert_matches(out, expected, dtype)
        return max_error(out, expected)
    return run


def _decode_empty_context_case(tk):
    """A context_len of 0 (a padded CUDA-graph slot) gives zeros, not NaN; others unharmed.

    (The reference returns NaN for such a row: softmax over no keys.)
    """
    k_cache, v_cache, tables, ctx = make_paged_cache([9, 0, 20], 2, 16, 4, torch.float32)
    query = torch.randn(3, 4, 16)
    out = tk.paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = [0, 2]
    expected = reference.paged_decode_attention(query[keep], k_cache, v_cache, tables[keep],
                                                ctx[keep], 0.25)
    assert_matches(out[keep], expected, torch.float32)
    return max_error(out[keep], expected)


def _chunked_prefill_then_decode_case(tk):
    """The engine's data path end to end, all through Triton: a sequence with a 21-token
    cached prefix stores its next 19-token chunk, prefills it, stores one more token and
    decodes it; a second sequence prefills from scratch. Compared with the same steps
    through the reference."""
    dtype, block_size, num_heads, num_kv_heads, head_dim = torch.float16, 8, 4, 2, 32
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache, tables, _ = make_paged_cache([41, 13], num_kv_heads, head_dim,
                                                   block_size, dtype)
    caches = {name: (k_cache.clone(), v_cache.clone()) for name in ("triton", "reference")}
    slots_of = lambda s, positions: torch.tensor(  # noqa: E731 - a one-line slot formula
        [int(tables[s, p // block_size]) * block_size + p % block_size for p in positions])
    q_lens, prefix = [19, 13], [21, 0]
    ctx = torch.tensor([40, 13], dtype=torch.int32)
    new_k = torch.randn(sum(q_lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    new_v = torch.randn(sum(q_lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    chunk_slots = torch.cat([slots_of(s, range(prefix[s], prefix[s] + q_lens[s]))
                             for s in range(2)])
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    step_k = torch.randn(2, num_kv_heads, head_dim, generator=gen).to(dtype)
    step_v = torch.randn(2, num_kv_heads, head_dim, generator=gen).to(dtype)
    step_q = torch.randn(2, num_heads, head_dim, generator=gen).to(dtype)
    step_slots = torch.cat([slots_of(0, [40]), torch.tensor([-1])])  # seq 1 sits this out
    outputs = {}
    for name, impl in (("triton", tk), ("reference", reference)):
        k_cache, v_cache = caches[name]
        impl.store_kv(new_k, new_v, k_cache, v_cache, chunk_slots)
        prefill = impl.paged_prefill_attention(query, k_cache, v_cache, tables,
                                               cu_seqlens(q_lens), ctx, head_dim ** -0.5)
        impl.store_kv(step_k, step_v, k_cache, v_cache, step_slots)
        decode = impl.paged_decode_attention(step_q, k_cache, v_cache, tables,
                                             ctx + torch.tensor([1, 0], dtype=torch.int32),
                                             head_dim ** -0.5)
        outputs[name] = (prefill, decode)
    assert torch.equal(caches["triton"][0], caches["reference"][0])
    assert torch.equal(caches["triton"][1], caches["reference"][1])
    for actual, expected in zip(outputs["triton"], outputs["reference"]):
        assert_matches(actual, expected, dtype)
    return max(max_error(a, e) for a, e in zip(outputs["triton"], outputs["reference"]))


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CASES = {
    # store_kv: bit-exact copies, -1 slots skipped, int32/int64 slots, strided K/V.
    "store-fp32-int64-slots": _store_case(2, 16, 4, F32, torch.int64, skip_every=3),
    "store-fp16-int32-slots-strided": _store_case(2, 64, 16, F16, torch.int32, 4, strided=True),
    "store-bf16-3-kv-heads-bs8": _store_case(3, 32, 8, BF16, torch.int32, skip_every=5),
    # decode: lengths on and off block and tile (64) boundaries, shuffled tables.
    "decode-mha-fp32-bs16": _decode_case([64, 17, 1, 33], 4, 4, 32, 16, F32),
    "decode-gqa-fp32-bs4-on-boundaries": _decode_case([16, 64, 8], 4, 2, 64, 4, F32),
    "decode-mqa-fp32-bs8-int64-junk-padding": _decode_case([40, 7], 8, 1, 16, 8, F32,
                                                           index_dtype=torch.int64, padding=0),
    "decode-gqa3-fp32-bs6-multi-tile": _decode_case([130, 5], 6, 2, 16, 6, F32),
    "decode-gqa-fp32-head-dim-24-strided-query": _decode_case([23, 50], 4, 2, 24, 8, F32,
                                                              strided_query=True),
    "decode-gqa-fp16-bs16-d64": _decode_case([64, 50], 4, 2, 64, 16, F16),
    "decode-gqa-bf16-bs8-d128": _decode_case([63, 65], 4, 2, 128, 8, BF16),
    "decode-empty-context-gives-zeros": _decode_empty_context_case,
    # prefill: without a cached prefix (q_len == context_len) and with one.
    "prefill-mha-fp32-no-prefix-bs16": _prefill_case([64, 17], [64, 17], 2, 2, 32, 16, F32),
    "prefill-gqa-fp32-prefix-bs8": _prefill_case([10, 40], [64, 40], 4, 2, 32, 8, F32),
    "prefill-mqa-fp32-bs4-junk-padding": _prefill_case([5, 1, 12], [21, 1, 12], 4, 1, 16, 4,
                                                       F32, padding=0),
    "prefill-gqa-fp32-multi-tile-and-empty-chunk": _prefill_case([70, 0, 3], [100, 9, 3],
                                                                 4, 2, 16, 16, F32),
    "prefill-gqa-fp32-head-dim-24-bs5": _prefill_case([13, 20], [30, 20], 2, 1, 24, 5, F32),
    "prefill-gqa-fp16-long-prefix-multi-tile": _prefill_case([40, 130], [150, 130], 2, 1, 32,
                                                             16, F16),
    "prefill-gqa-fp16-prefix-d64": _prefill_case([24, 32], [56, 32], 4, 2, 64, 16, F16),
    "prefill-gqa-bf16-prefix-d128": _prefill_case([20, 9], [48, 30], 4, 2, 128, 8, BF16),
    "chunked-prefill-then-decode-fp16": _chunked_prefill_then_decode_case,
}


def _run_cases(names):
    """Child-process entry: run the named cases (TRITON_INTERPRET=1 already in the env)."""
    from nanoengine.kernels import triton_kernels as tk

    assert tk.INTERPRETED, "the child must be started with TRITON_INTERPRET=1"
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            error = CASES[name](tk)
            results[name] = {"ok": True, "max_error": error}
        except Exception as exc:  # report every case; the parent turns this into a failure
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        results[name]["seconds"] = round(time.perf_counter() - start, 3)
    return results


def _compile_for_sm90():
    """Child-process entry: compile each kernel ahead of time for an sm_90 GPU target.

    ``triton.compile`` runs the whole CUDA pipeline (TTIR, TTGIR, LLVM, PTX, ptxas) with
    no GPU present. Two configurations: fp16, MHA (GQA group 1, padded to 16), head_dim
    64, block size 16; and bf16, GQA group 4, head_dim 128, block size 8.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanoengine.kernels import triton_kernels as tk

    assert not tk.INTERPRETED, "the compile child must run without TRITON_INTERPRET"
    index_args = {"block_tables_ptr", "context_lens_ptr", "cu_seqlens_q_ptr", "slot_mapping_ptr"}
    compiled = []
    for dtype, group, head_dim, block_size in (("fp16", 1, 64, 16), ("bf16", 4, 128, 8)):
        configs = {
            tk._store_kv_kernel: dict(NUM_KV_HEADS=2, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                                      BLOCK_H=2, BLOCK_D=head_dim),
            tk._paged_decode_kernel: dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                                          BLOCK_G=16, BLOCK_D=head_dim,
                                          BLOCK_N=tk.DECODE_BLOCK_N, UPCAST=False),
            tk._paged_prefill_kernel: dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                                           BLOCK_M=tk.PREFILL_BLOCK_M, BLOCK_D=head_dim,
                                           BLOCK_N=tk.PREFILL_BLOCK_N, UPCAST=False),
        }
        for kernel, constants in configs.items():
            names = kernel.arg_names
            signature = {
                name: "constexpr" if name in constants
                else ("*i32" if name in index_args else f"*{dtype}") if name.endswith("_ptr")
                else "fp32" if name.startswith("scale") else "i32"
                for name in names
            }
            constexprs = {(names.index(n),): v for n, v in constants.items()}
            binary = triton.compile(ASTSource(kernel, signature, constexprs),
                                    target=GPUTarget("cuda", 90, 32))
            assert binary.asm.get("cubin"), f"{kernel.__name__}: no cubin produced"
            compiled.append(f"{kernel.__name__}[{dtype}, d={head_dim}]")
    return compiled


def _run_child(args, interpret: bool, timeout=CHILD_TIMEOUT_S):
    """Run this file as a script in a fresh interpreter; returns its decoded JSON result."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__, *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):])
    raise AssertionError(
        f"child {args} exited {proc.returncode} without results:\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )


# --------------------------------------------------------------------------------------
# Interpreted kernel tests (CPU)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreted_results(request):
    """Run every selected case in one TRITON_INTERPRET=1 child (one startup, not 19)."""
    pytest.importorskip("triton")
    selected = sorted({
        item.callspec.params["case"] for item in request.session.items
        if getattr(item, "module", None) is sys.modules[__name__]
        and "case" in getattr(getattr(item, "callspec", None), "params", {})
    }) or sorted(CASES)
    return _run_child(["interpret", *selected], interpret=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernel_matches_reference(case, interpreted_results):
    result = interpreted_results[case]
    assert result["ok"], f"{case}: {result['error']}"


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """Catches what only the real compiler rejects, on a machine without a GPU."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:
        pytest.skip(f"triton {triton.__version__} has no NVIDIA backend here")
    compiled = _run_child(["compile"], interpret=False)
    assert len(compiled) == 6, compiled


# --------------------------------------------------------------------------------------
# Input validation (in this process; no kernel runs)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tk():
    pytest.importorskip("triton")
    from nanoengine.kernels import triton_kernels

    return triton_kernels


def _good_store():
    k_cache = torch.zeros(4, 8, 2, 16)
    return dict(key=torch.zeros(5, 2, 16), value=torch.zeros(5, 2, 16), k_cache=k_cache,
                v_cache=torch.zeros_like(k_cache), slot_mapping=torch.arange(5))


def _good_decode():
    k_cache = torch.zeros(6, 8, 2, 16)
    return dict(query=torch.zeros(3, 4, 16), k_cache=k_cache, v_cache=torch.zeros_like(k_cache),
                block_tables=torch.zeros(3, 2, dtype=torch.int32),
                context_lens=torch.tensor([1, 8, 16], dtype=torch.int32), scale=0.25)


def _good_prefill():
    k_cache = torch.zeros(6, 8, 2, 16)
    return dict(query=torch.zeros(7, 4, 16), k_cache=k_cache, v_cache=torch.zeros_like(k_cache),
                block_tables=torch.zeros(2, 2, dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32),
                context_lens=torch.tensor([10, 4], dtype=torch.int32), scale=0.25)


STORE_ERRORS = [
    ("key-2d", dict(key=torch.zeros(5, 32)), ValueError, "key must be 3-D"),
    ("key-float64", dict(key=torch.zeros(5, 2, 16, dtype=torch.float64)), TypeError,
     "key has dtype torch.float64"),
    ("key-fp16-cache-fp32", dict(key=torch.zeros(5, 2, 16, dtype=torch.float16)), TypeError,
     "key has dtype torch.float16 but the cache has torch.float32"),
    ("value-wrong-heads", dict(value=torch.zeros(5, 3, 16)), ValueError, "value has shape"),
    ("value-fewer-tokens", dict(value=torch.zeros(4, 2, 16)), ValueError,
     "key and value must have the same shape"),
    ("key-head-dim-strided", dict(key=torch.zeros(5, 16, 2).transpose(1, 2)), ValueError,
     "key must be contiguous in its last"),
    ("cache-3d", dict(k_cache=torch.zeros(32, 2, 16)), ValueError, "k_cache must be 4-D"),
    ("cache-shapes-differ", dict(v_cache=torch.zeros(5, 8, 2, 16)), ValueError,
     "k_cache and v_cache must have the same shape"),
    ("cache-dtypes-differ", dict(v_cache=torch.zeros(4, 8, 2, 16, dtype=torch.float16)),
     TypeError, "k_cache and v_cache must have the same dtype"),
    ("slots-float", dict(slot_mapping=torch.zeros(5)), TypeError, "slot_mapping has dtype"),
    ("slots-int16", dict(slot_mapping=torch.zeros(5, dtype=torch.int16)), TypeError,
     "allowed: int32, int64"),
    ("slots-too-few", dict(slot_mapping=torch.arange(4)), ValueError,
     "slot_mapping has 4 entries but key has 5 tokens"),
    ("slots-not-tensor", dict(slot_mapping=[0, 1, 2, 3, 4]), TypeError,
     "slot_mapping must be a torch.Tensor"),
    ("slots-on-meta", dict(slot_mapping=torch.arange(5, device="meta")), ValueError,
     "same device.*slot_mapping on meta"),
]


@pytest.mark.parametrize("overrides,error,message", [c[1:] for c in STORE_ERRORS],
                         ids=[c[0] for c in STORE_ERRORS])
def test_store_kv_rejects(tk, overrides, error, message):
    args = _good_store() | overrides
    with pytest.raises(error, match=message):
        tk.check_store_kv_args(**args)
    with pytest.raises(error, match=message):  # the wrapper checks before launching
        tk.store_kv(**args)


DECODE_ERRORS = [
    ("heads-not-multiple", dict(query=torch.zeros(3, 5, 16)), ValueError,
     "5 heads, which must be a positive multiple of the cache's num_kv_heads=2"),
    ("head-dim-mismatch", dict(query=torch.zeros(3, 4, 32)), ValueError,
     "query head_dim 32 does not match the cache's head_dim 16"),
    ("query-4d", dict(query=torch.zeros(3, 1, 4, 16)), ValueError, "query must be 3-D"),
    ("query-bf16-cache-fp32", dict(query=torch.zeros(3, 4, 16, dtype=torch.bfloat16)),
     TypeError, "query has dtype torch.bfloat16 but the cache has torch.float32"),
    ("cache-float64", dict(k_cache=torch.zeros(6, 8, 2, 16, dtype=torch.float64),
                           v_cache=torch.zeros(6, 8, 2, 16, dtype=torch.float64)),
     TypeError, "k_cache has dtype torch.float64; allowed: float32, float16, bfloat16"),
    ("head-dim-too-big", dict(query=torch.zeros(3, 4, 512), k_cache=torch.zeros(6, 8, 2, 512),
                              v_cache=torch.zeros(6, 8, 2, 512)), ValueError,
     "head_dim is 512; allowed: 1 to 256"),
    ("table-rows", dict(block_tables=torch.zeros(2, 2, dtype=torch.int32)), ValueError,
     "block_tables has 2 rows but there are 3 sequences"),
    ("table-1d", dict(block_tables=torch.zeros(6, dtype=torch.int32)), ValueError,
     "block_tables must be 2-D"),
    ("table-float", dict(block_tables=torch.zeros(3, 2)), TypeError, "block_tables has dtype"),
    ("table-strided", dict(block_tables=torch.zeros(2, 3, dtype=torch.int32).t()), ValueError,
     "block_tables must be contiguous in its last dimension"),
    ("lens-count", dict(context_lens=torch.tensor([1, 2], dtype=torch.int32)), ValueError,
     "context_lens has 2 entries but there are 3 sequences"),
    ("lens-int8", dict(context_lens=torch.tensor([1, 2, 3], dtype=torch.int8)), TypeError,
     "context_lens has dtype torch.int8"),
    ("scale-tensor", dict(scale=torch.tensor(0.25)), TypeError, "scale must be a Python float"),
    ("scale-zero", dict(scale=0.0), ValueError, "scale must be finite and positive, got 0.0"),
    ("query-on-meta", dict(query=torch.zeros(3, 4, 16, device="meta")), ValueError,
     "same device.*query on meta"),
]


@pytest.mark.parametrize("overrides,error,message", [c[1:] for c in DECODE_ERRORS],
                         ids=[c[0] for c in DECODE_ERRORS])
def test_decode_rejects(tk, overrides, error, message):
    args = _good_decode() | overrides
    with pytest.raises(error, match=message):
        tk.check_decode_args(**args)
    with pytest.raises(error, match=message):
        tk.paged_decode_attention(**args)


PREFILL_ERRORS = [
    ("cu-too-short", dict(cu_seqlens_q=torch.tensor([0, 7], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q has 2 entries \(so 1 sequences\) but context_lens has 2"),
    ("cu-end-mismatch", dict(cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32)),
     ValueError, r"cu_seqlens_q ends at 6 but query has 7 tokens"),
    ("cu-not-from-zero", dict(cu_seqlens_q=torch.tensor([1, 3, 7], dtype=torch.int32)),
     ValueError, "cu_seqlens_q must start at 0, got 1"),
    ("cu-decreasing", dict(cu_seqlens_q=torch.tensor([0, 8, 7], dtype=torch.int32),
                           context_lens=torch.tensor([10, 10], dtype=torch.int32)),
     ValueError, "non-decreasing, but sequence 1 has q_len -1"),
    ("context-shorter-than-chunk", dict(context_lens=torch.tensor([10, 3], dtype=torch.int32)),
     ValueError, r"context_lens\[1\] = 3 is smaller than that sequence's q_len 4"),
    ("table-too-narrow", dict(context_lens=torch.tensor([17, 4], dtype=torch.int32)),
     ValueError, r"context_lens\[0\] = 17 needs 3 blocks of 8 but block_tables has only 2"),
    ("cu-float", dict(cu_seqlens_q=torch.tensor([0.0, 3.0, 7.0])), TypeError,
     "cu_seqlens_q has dtype torch.float32"),
    ("table-rows", dict(block_tables=torch.zeros(3, 2, dtype=torch.int32)), ValueError,
     "block_tables has 3 rows but there are 2 sequences"),
    ("query-2d", dict(query=torch.zeros(7, 64)), ValueError, "query must be 3-D"),
    ("cu-on-meta", dict(cu_seqlens_q=torch.tensor([0, 3, 7], device="meta")), ValueError,
     "same device.*cu_seqlens_q on meta"),
]


@pytest.mark.parametrize("overrides,error,message", [c[1:] for c in PREFILL_ERRORS],
                         ids=[c[0] for c in PREFILL_ERRORS])
def test_prefill_rejects(tk, overrides, error, message):
    args = _good_prefill() | overrides
    with pytest.raises(error, match=message):
        tk.check_prefill_args(**args)
    with pytest.raises(error, match=message):
        tk.paged_prefill_attention(**args)


def test_valid_arguments_pass_validation(tk):
    tk.check_store_kv_args(**_good_store())
    tk.check_decode_args(**_good_decode())
    assert tk.check_prefill_args(**_good_prefill()) == [3, 4]
    tk.check_prefill_lengths([3, 0, 5], [3, 9, 16], 8, block_size=8, max_blocks_per_seq=2)


def test_compiled_kernels_refuse_cpu_tensors(tk):
    """Without the interpreter a CPU tensor would crash inside the launch; refuse it first."""
    if tk.INTERPRETED:
        pytest.skip("this process imported the kernels under TRITON_INTERPRET=1")
    with pytest.raises(ValueError, match="Triton kernels got tensors on cpu; allowed: cuda"):
        tk.paged_decode_attention(**_good_decode())
    tk.check_device_supported(torch.device("cuda", 0))


# --------------------------------------------------------------------------------------
# Native CUDA tests (realistic shapes; run on a GPU machine)
# --------------------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# (num_heads, num_kv_heads, head_dim): SmolLM2-135M and Qwen3-0.6B.
MODEL_SHAPES = [pytest.param(9, 3, 64, id="smollm2-9q3kv-d64"),
                pytest.param(16, 8, 128, id="qwen3-16q8kv-d128")]
GPU_DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", MODEL_SHAPES)
def test_cuda_decode_matches_reference(tk, dtype, num_heads, num_kv_heads, head_dim):
    lens = [1, 16, 17, 255, 640, 1024, 2000, 2048]
    k_cache, v_cache, tables, ctx = make_paged_cache(lens, num_kv_heads, head_dim, 16, dtype,
                                                     device="cuda", spare_blocks=64)
    query = torch.randn(len(lens), num_heads, head_dim, device="cuda", dtype=dtype)
    scale = head_dim ** -0.5
    out = tk.paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale)
    assert_matches(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx,
                                                         scale), dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", MODEL_SHAPES)
def test_cuda_prefill_matches_reference(tk, dtype, num_heads, num_kv_heads, head_dim):
    # Mixed batch: fresh prompts (q_len == context_len), prefix hits and later chunks.
    context_lens = [2048, 1500, 1024, 777, 512, 300, 64, 9]
    q_lens = [2048, 500, 1, 777, 100, 300, 63, 9]
    k_cache, v_cache, tables, ctx = make_paged_cache(context_lens, num_kv_heads, head_dim, 16,
                                                     dtype, device="cuda", spare_blocks=64)
    query = torch.randn(sum(q_lens), num_heads, head_dim, device="cuda", dtype=dtype)
    cu = cu_seqlens(q_lens, device="cuda")
    scale = head_dim ** -0.5
    out = tk.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, scale)
    expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, scale)
    assert_matches(out, expected, dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_cuda_store_kv_matches_reference(tk, dtype):
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 512, 16, 8, 128, 4096
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda",
                          dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slots[::7] = -1
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    value = torch.randn_like(key)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    tk.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.gpu
@requires_cuda
def test_cuda_decode_step_replays_from_a_cuda_graph(tk):
    """store_kv + decode make no host sync, so a decode step can be captured and replayed."""
    dtype, num_heads, num_kv_heads, head_dim = torch.bfloat16, 16, 8, 128
    lens = [100, 37, 512, 1]
    k_cache, v_cache, tables, ctx = make_paged_cache([n + 1 for n in lens], num_kv_heads,
                                                     head_dim, 16, dtype, device="cuda")
    query = torch.randn(len(lens), num_heads, head_dim, device="cuda", dtype=dtype)
    key = torch.randn(len(lens), num_kv_heads, head_dim, device="cuda", dtype=dtype)
    value = torch.randn_like(key)
    slots = torch.tensor([int(tables[s, n // 16]) * 16 + n % 16 for s, n in enumerate(lens)],
                         device="cuda")
    context = torch.tensor(lens, dtype=torch.int32, device="cuda") + 1

    def step():
        tk.store_kv(key, value, k_cache, v_cache, slots)
        return tk.paged_decode_attention(query, k_cache, v_cache, tables, context,
                                         head_dim ** -0.5)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    query.copy_(torch.randn_like(query))  # new inputs, same buffers
    key.copy_(torch.randn_like(key))
    graph.replay()
    torch.cuda.synchronize()
    expected_k = k_cache.clone()
    reference.store_kv(key, value, expected_k, v_cache.clone(), slots)
    assert torch.equal(k_cache, expected_k)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, context,
                                                head_dim ** -0.5)
    assert_matches(out, expected, dtype)


if __name__ == "__main__":
    # Child-process entry points used by the tests above (see the module docstring).
    mode, names = sys.argv[1], sys.argv[2:]
    if mode == "interpret":
        payload = _run_cases(names or list(CASES))
    elif mode == "compile":
        payload = _compile_for_sm90()
    else:
        raise SystemExit(f"unknown mode {mode!r}; use 'interpret' or 'compile'")
    print(RESULT_MARKER + json.dumps(payload))
