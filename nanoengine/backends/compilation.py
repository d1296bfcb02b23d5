"""torch.compile for the engine's small fused ops on CUDA (chapter 10), opt-in with ``compile=True``.

``torch.compile`` (Dynamo, then Inductor) turns a small function of several operators, such as RMSNorm with its
residual add, into one generated kernel that reads its inputs once: one launch instead of several. nano-vLLM
compiles exactly these (``COMPILED_OPS``); the GEMMs stay cuBLAS calls. On a CPU there is no launch to save, each
compiled call pays Dynamo's guards, and each decoder layer already runs as one native call, so ``compile=True`` is
refused there before anything loads (``backends.check_compile``).

A CUDA backend built with ``compile=True`` gives its layers ``compiled_kernels``; ``compile_runner`` warms them
up, timed, before CUDA graphs are captured. One compiled version per function serves the whole process
(``Compiler``); ``dynamic=True`` serves every token count but 1, which Dynamo specialises (``WARM_UP_SIZES``).
If Triton is missing or compiling fails, every compiled function runs eagerly from then on (``CompiledFunction``).
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, replace
from typing import Callable

import torch

from nanoengine import kernels


class CompileFallbackWarning(RuntimeWarning):
    """torch.compile could not be used; the engine runs eagerly (the message says why)."""


@dataclass(frozen=True)
class CompileReport:
    """What ``compile=True`` did for one runner."""

    requested: bool  # the engine was built with compile=True
    compiled: bool  # compiled code is in use (False after a fallback)
    seconds: float  # wall time of compiling and warming up, spent when the runner was built
    ops: tuple[str, ...]  # the compiled functions, e.g. ``RMSNorm.add_norm_fn``
    fallback_reason: str | None = None  # why the engine runs eagerly although compile=True, else None

    @classmethod
    def not_requested(cls) -> "CompileReport":
        return cls(requested=False, compiled=False, seconds=0.0, ops=())


class CompiledFunction:
    """One eager function and its ``torch.compile``'d twin; called like the function.

    Compilation happens on the first call with inputs of a new kind. If it raises, the same call is rerun
    eagerly: when that succeeds the compiler was at fault, the process records it (one warning) and every
    compiled function runs eagerly from then on; when the eager call fails too, the inputs were bad: it propagates.
    """

    def __init__(self, eager: Callable, compiler: "Compiler") -> None:
        self.eager = eager
        self.compiler = compiler
        self.compiled = torch.compile(eager, dynamic=True)

    def __call__(self, *args):
        if self.compiler.failure is not None:
            return self.eager(*args)
        try:
            return self.compiled(*args)
        except Exception as exc:  # noqa: BLE001 (any compiler error: Dynamo, Inductor, Triton)
            error = exc
        result = self.eager(*args)  # outside the handler: an eager error is not chained to it
        first_line = (str(error).strip() or "(no message)").splitlines()[0][:300]
        self.compiler.fail(f"compiling {self.eager.__qualname__} failed with {type(error).__name__}: {first_line}")
        return result


class Compiler:
    """The process's compiled functions (one per eager function) and whether compiling failed: process-wide on
    purpose, as Dynamo caches compiled code per function for the whole process and a missing Triton is missing
    for every engine."""

    def __init__(self) -> None:
        self.functions: dict[Callable, CompiledFunction] = {}
        self.failure: str | None = None

    def compiled(self, eager: Callable) -> CompiledFunction:
        if eager not in self.functions:
            self.functions[eager] = CompiledFunction(eager, self)
        return self.functions[eager]

    def fail(self, reason: str) -> None:
        """Record the first failure and warn about it; later ones change nothing."""
        if self.failure is None:
            self.failure = reason
            warnings.warn(f"compile=True: {reason}; running eagerly instead", CompileFallbackWarning, stacklevel=2)


COMPILER = Compiler()

# The warm-up's step sizes: 1 (Dynamo specialises a size of 1: one decode token) and one symbolic size for all
# others, a prime so that it equals no model dimension: Dynamo's "duck sizing" gives equal sizes one symbol and
# ties them together (64 tokens in a model of hidden size 64 compiled a graph for 64 tokens only).
WARM_UP_SIZES = (1, 67)


def compiler_problem() -> str | None:
    """Why torch.compile cannot work on CUDA here, or None when it should."""
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    from torch import _dynamo

    if not _dynamo.is_dynamo_supported():
        return f"torch.compile does not support this Python ({sys.version.split()[0]})"
    return None if kernels.triton_available() else "Inductor needs Triton on CUDA, and triton cannot be imported"


# What compile=True compiles: the kernels' field, and the layer attribute that calls it.
COMPILED_OPS = {"rms_norm": "RMSNorm.norm_fn", "add_rms_norm": "RMSNorm.add_norm_fn",
                "rotate_half": "RotaryEmbedding.rotate_fn", "silu_and_mul": "SiluAndMul.silu_and_mul_fn",
                "sampling_probs": "Sampler.probs_fn"}


def compiled_kernels(kernels, compiler: Compiler | None = None):
    """``kernels`` with the small fused ops compiled (the layers' own eager functions, compiled):
    the kernels of a CUDA backend built with ``compile=True``."""
    from nanoengine.layers.activation import silu_and_mul
    from nanoengine.layers.layernorm import add_rms_norm, rms_norm
    from nanoengine.layers.rotary import rotate_half
    from nanoengine.layers.sampler import sampling_probs

    compiler = compiler or COMPILER
    eager = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rotate_half": rotate_half,
             "silu_and_mul": silu_and_mul, "sampling_probs": sampling_probs}
    return replace(kernels, name=f"{kernels.name}, compiled small ops",
                   **{field: compiler.compiled(fn) for field, fn in eager.items()})


def compile_runner(runner, compiler: Compiler | None = None) -> CompileReport:
    """Warm up the compiled functions ``runner``'s model and sampler were built with; time it.

    ``runner`` is a ``ModelRunner`` whose KV cache is bound and whose backend's kernels are
    ``compiled_kernels``. On failure the functions run eagerly and the report says why.
    """
    compiler = compiler or COMPILER
    if (problem := compiler_problem()) is not None:
        compiler.fail(problem)
    seconds = 0.0
    if compiler.failure is None:
        start = time.perf_counter()
        for num_tokens in WARM_UP_SIZES:  # compiles now, not in the first steps
            runner.warm_up(num_tokens)
        seconds = time.perf_counter() - start
    if compiler.failure is not None:
        return CompileReport(requested=True, compiled=False, seconds=seconds, ops=(), fallback_reason=compiler.failure)
    return CompileReport(requested=True, compiled=True, seconds=seconds, ops=tuple(sorted(COMPILED_OPS.values())))
