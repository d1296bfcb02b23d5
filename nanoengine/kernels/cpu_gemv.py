"""A hand-written kernel for a few rows times a weight (chapter 10: decode reads every weight).

When one sequence decodes, each linear layer multiplies one row of activations by its whole
weight matrix: two flops per weight read, so the step's speed is how fast the weights stream
from memory. The GEMM libraries PyTorch calls are tuned for many rows: measured on a 2-core
AMD EPYC (AVX2) that copies memory at ~18 GB/s, MKL's ``F.linear`` read SmolLM2's layer
weights at 6-10 GB/s for one row (and slower with two threads than one) and oneDNN's packed
GEMM at 6-13 GB/s; this kernel, splitting each weight's rows between the two threads and
streaming them once, at 11-14 GB/s, and it stays there for 2-4 rows, where the libraries
slowed down further (``results/README.md`` has the table and the command).

``cpu_gemv.cpp`` is C++ with AVX2 and FMA intrinsics, registered as the operator
``torch.ops.nanoengine.few_rows_linear(x, weight, bias=None)``. It is compiled the first time
an engine needs it (about 15 s, said once on stderr), with PyTorch's own extension builder,
into ``~/.cache/nanoengine/kernels/`` under a name that carries the torch and Python versions
and the instruction set it was built for, so another PyTorch or another CPU never loads it;
``./course setup`` builds it ahead. Its summation order is fixed by the source, not by the
CPU, the thread count or the number of rows (see the .cpp), so every machine with AVX2 gets
the same bits, and a row gets the same bits whether it is computed alone or in a batch.

Without a C++ compiler, ninja, or AVX2 + FMA, ``load`` says why in one warning and returns
False; the CPU backend then uses the GEMM libraries for every row count.
"""

from __future__ import annotations

import functools
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_gemv.cpp")
# Built for exactly this instruction set (no -march=native): the bits are the same on any
# x86-64 CPU that has it.
ISA = "avx2_fma"
COMPILE_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
# Row counts up to this take the kernel; from about 16 rows on, each weight is reused enough
# for a GEMM library's blocking to catch up (SmolLM2's shapes, measured by
# scripts/measure_few_rows_kernel.py: results/README.md).
MAX_ROWS = 8
DTYPES = (torch.float32, torch.bfloat16)


class KernelBuildWarning(UserWarning):
    """The few-rows kernel could not be built or loaded; the GEMM libraries are used instead."""


def build_name() -> str:
    """The extension's name: what it is, for which PyTorch, Python and instruction set."""
    torch_version = torch.__version__.split("+")[0].replace(".", "_")
    return f"nanoengine_cpu_gemv_torch{torch_version}_py{sys.version_info.major}{sys.version_info.minor}_{ISA}"


def build_directory() -> Path:
    from nanoengine.default_model import cache_root

    return cache_root() / "kernels" / build_name()


def unavailable_reason() -> str | None:
    """Why this machine cannot run the kernel, or None if it can (before trying to build it)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it is written for x86-64 and this machine is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"it needs AVX2 and FMA and PyTorch reports this CPU's capability as {capability}"
    return None


@functools.lru_cache(maxsize=None)
def load(verbose: bool = False) -> bool:
    """Build (the first time) and load the operator; True when ``few_rows_linear`` is usable.

    Called once per process; the answer is kept. A build that fails is reported in one
    ``KernelBuildWarning`` naming why, and the caller falls back to the GEMM libraries.
    """
    reason = unavailable_reason()
    if reason is None:
        try:
            _build_and_load(verbose)
        except Exception as exc:  # no compiler, no ninja, a failed compile: the libraries still work
            reason = f"building it failed ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]})"
    if reason is not None:
        warnings.warn(f"nanoengine's CPU few-rows kernel is off: {reason}; decode uses the GEMM libraries "
                      "(slower for one sequence)", KernelBuildWarning, stacklevel=2)
        return False
    return True


def _build_and_load(verbose: bool) -> None:
    from torch.utils.cpp_extension import load as load_extension

    directory = build_directory()
    built = (directory / f"{build_name()}.so").exists()
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # PyTorch's builder recompiles only when the source or flags changed, and takes a lock
    # in the directory so two processes never build it at once.
    load_extension(build_name(), [str(SOURCE)], extra_cflags=COMPILE_FLAGS, extra_ldflags=["-fopenmp"],
                   build_directory=str(directory), is_python_module=False, verbose=verbose)
    if not built:
        print(f"nanoengine: compiled the CPU few-rows kernel in {time.perf_counter() - start:.1f} s "
              f"(once; kept in {directory})", file=sys.stderr)
    _register_fake()


def _register_fake() -> None:
    """Shapes for torch.compile: the operator is opaque to Dynamo and Inductor."""
    if getattr(_register_fake, "done", False):
        return

    @torch.library.register_fake("nanoengine::few_rows_linear")
    def _(x, weight, bias=None):
        return x.new_empty(x.shape[0], weight.shape[0])

    _register_fake.done = True


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x (..., in_features) with few rows, by the kernel.

    ``load()`` must have returned True. The rows are made contiguous (a view when they are).
    """
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
    out = torch.ops.nanoengine.few_rows_linear(rows, weight, bias)  # (M, N)
    return out.reshape(*x.shape[:-1], weight.shape[0])


if __name__ == "__main__":  # ./course setup builds it ahead: python -m nanoengine.kernels.cpu_gemv
    if load():
        print(f"CPU few-rows kernel ready ({build_directory()})")
