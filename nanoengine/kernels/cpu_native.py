"""The CPU backend's own kernels, in C++ (chapter 10: when the libraries are not enough).

Each ``csrc/`` file opens with why its operators exist and what they must agree with;
``silu_and_mul``, ``paged_attention`` and ``llama_layer`` make eager PyTorch's calls from C++ (one
call from Python, eager's bits). They are PyTorch operators (``torch.ops.nanoengine.*``, signatures
in ``csrc/ops.h``) on PyTorch's thread pool, compiled the first time an engine needs them
(``./course setup`` builds them ahead) into ``~/.cache/nanoengine/kernels/``.

Two builds, each for exactly its instruction set (not ``-march=native``): AVX-512 where PyTorch's
own kernels use it (``ATEN_CPU_CAPABILITY=avx2`` lowers that), else AVX2 + FMA. Decode attention,
where the width paid (results/README.md), is written once over ``csrc/cpu_vec.h``'s ``Vec``; the
others, bound by memory or by calls, are AVX2 in both builds. Prefill attention is decode's loop run once
per query token over the keys that token sees.

Every sum's order is fixed by the source, not by the CPU, the threads or the batch: a row gets the
same bits alone or in a batch, attention the same in both builds (``test_cpu_native.py``), and
a fused layer is the Python forward bit for bit (``test_cpu_fused.py``). Without a C++ compiler,
ninja, or AVX2 + FMA, ``load`` says why in one warning and returns False; the CPU backend then uses
the libraries and the reference attention (``kernels.reference``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))
# -ffp-contract=off: the intrinsics' FMAs are written out; no scalar ``a * b + c`` is fused behind
# our back, where another compiler version might decide otherwise.
ISA_FLAGS = {"avx2_fma": ["-mavx2", "-mfma"],
             "avx512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]}
COMPILE_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
# Row counts up to this take the few-rows kernel; from about 16 rows on, each weight is reused
# enough for a GEMM library's blocking to catch up (measured: results/README.md).
MAX_ROWS = 8
DTYPES = (torch.float32, torch.bfloat16)


class KernelBuildWarning(UserWarning):
    """The native kernels could not be built or loaded; the libraries are used instead."""


def isa() -> str:
    """The build this process uses: AVX-512 where PyTorch's own kernels use it, else AVX2."""
    return "avx512" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "avx2_fma"


def build_name() -> str:
    """The extension's name: what it is, for which PyTorch, Python and instruction set."""
    torch_version = torch.__version__.split("+")[0].replace(".", "_")
    return f"nanoengine_cpu_kernels_torch{torch_version}_py{sys.version_info.major}{sys.version_info.minor}_{isa()}"


def build_directory() -> Path:
    from nanoengine.default_model import cache_root

    return cache_root() / "kernels" / build_name()


def unavailable_reason() -> str | None:
    """Why this machine cannot run the kernels, or None if it can (before trying to build them)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"they are written for x86-64 and this machine is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"they need AVX2 and FMA and PyTorch reports this CPU's capability as {capability}"
    return None


@functools.lru_cache(maxsize=None)
def load(verbose: bool = False) -> bool:
    """Build (the first time) and load the operators, once per process; True when they are usable.

    A build that fails is reported in one ``KernelBuildWarning`` naming why; the caller falls back.
    """
    reason = unavailable_reason()
    if reason is None:
        try:
            _build_and_load(verbose)
        except Exception as exc:  # no compiler, no ninja, a failed compile: the libraries still work
            reason = f"building them failed ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]})"
    if reason is not None:
        warnings.warn(f"nanoengine's native CPU kernels are off: {reason}; the engine uses PyTorch's libraries "
                      "and the reference attention (slower)", KernelBuildWarning, stacklevel=2)
        return False
    return True


def _build_and_load(verbose: bool) -> None:
    from torch.utils.cpp_extension import load as load_extension

    directory = build_directory()
    built = (directory / f"{build_name()}.so").exists()
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # PyTorch's builder recompiles only when a source or a flag changed (not a header: the headers'
    # hash goes in as a flag), and takes a lock in the directory so two processes never build at once.
    header_hash = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    flags = [*COMPILE_FLAGS, *ISA_FLAGS[isa()], f"-DNANOENGINE_HEADERS_SHA={header_hash}"]
    clear_stale_lock(directory)
    with pinned_ninja():
        load_extension(build_name(), [str(s) for s in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                       build_directory=str(directory), is_python_module=False, verbose=verbose)
    if not built:
        print(f"nanoengine: compiled the native CPU kernels in {time.perf_counter() - start:.1f} s "
              f"(once; kept in {directory})", file=sys.stderr)


@contextlib.contextmanager
def pinned_ninja():
    """Build with the ninja installed beside this Python (requirements.txt pins it), whatever PATH says.

    PyTorch's builder runs the first ``ninja`` on PATH, which from a Jupyter kernel or a bare
    ``.venv/bin/python`` may be the system's; two ninja versions do not read each other's build log,
    so each rebuilt every kernel for the other.
    """
    here = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if not (Path(here) / "ninja").exists() or path.split(os.pathsep)[0] == here:
        yield
        return
    os.environ["PATH"] = here + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


# A build takes under a minute; a lock file older than this was left by a process that stopped while
# building (killed, or its machine restarted), and PyTorch's builder would wait for it forever.
STALE_LOCK_S = 600.0


def clear_stale_lock(directory: Path) -> bool:
    """Remove the builder's lock file in ``directory`` if it is older than ``STALE_LOCK_S``, with a
    warning naming it; True if one was removed. A younger lock is another process building now."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= STALE_LOCK_S:
        return False
    warnings.warn(f"removed {lock}, a build lock {age / 60:.0f} minutes old: a process stopped while building "
                  f"the native kernels, and every later one would have waited for it", KernelBuildWarning,
                  stacklevel=3)
    lock.unlink(missing_ok=True)
    return True


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x (..., in_features) with few rows, by the kernel.

    ``load()`` must have returned True; weight (out_features, in_features) contiguous.
    """
    if x.dim() == 2:  # the model's activations: (tokens, features)
        return torch.ops.nanoengine.few_rows_linear(x.contiguous(), weight, bias)
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).contiguous()  # (M, K); -1 is ambiguous when K == 0
    out = torch.ops.nanoengine.few_rows_linear(rows, weight, bias)  # (M, N)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``reference.paged_decode_attention``, by the kernel. ``load()`` must have returned True."""
    if context_lens.dtype != block_tables.dtype:
        context_lens = context_lens.to(block_tables.dtype)
    return torch.ops.nanoengine.paged_decode_attention(query.contiguous(), k_cache, v_cache,
                                                       block_tables.contiguous(), context_lens.contiguous(), scale)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """``reference.paged_prefill_attention`` for a whole step, each query token attended by the decode kernel's
    loop (``csrc/paged_prefill_attention.cpp``): a token gets the bits a decode step would give it."""
    return torch.ops.nanoengine.paged_prefill_attention(query.contiguous(), k_cache, v_cache, block_tables,
                                                        cu_seqlens_q, context_lens, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``layers.layernorm.rms_norm``, by the kernel: x (..., H), weight (H,) of x's dtype."""
    return torch.ops.nanoengine.rms_norm(x.contiguous(), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers.layernorm.add_rms_norm``, by the kernel: (normalised x + residual, x + residual)."""
    return torch.ops.nanoengine.add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``layers.activation.silu_and_mul``, ATen's calls made from C++: the same bits, one call."""
    return torch.ops.nanoengine.silu_and_mul(x)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``layers.rotary.rotate_half``, by the kernel, bit for bit: x (T, heads, d) float32 or
    bfloat16, each token's heads contiguous; cos, signed sin (T, 1, d) float32. Other inputs
    (float16, a layout the kernel does not walk) take the eager function."""
    if x.dtype not in DTYPES or x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        from nanoengine.layers.rotary import rotate_half as eager

        return eager(x, cos, sin)
    return torch.ops.nanoengine.rotate_half(x, cos.contiguous(), sin.contiguous())


if __name__ == "__main__":  # ./course setup builds them ahead: python -m nanoengine.kernels.cpu_native
    if load():
        print(f"native CPU kernels ready ({build_directory()})")
