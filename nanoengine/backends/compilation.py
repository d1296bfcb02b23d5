"""torch.compile for the engine's small fused ops (chapter 10), opt-in with ``compile=True``.

What fusion buys
----------------
Eager PyTorch runs a model one operator at a time. RMSNorm with its residual add is seven
operators (add, pow, mean, add, rsqrt, mul, mul) plus dtype casts: seven passes over the
activations, six temporaries, and seven trips through Python and PyTorch's dispatcher.
``torch.compile`` traces such a function (TorchDynamo) and its Inductor backend generates
one loop nest for it: the inputs are read once, the outputs written once, one call does
the work of seven. nano-vLLM decorates exactly these functions with ``@torch.compile``:
RMSNorm (+ residual), rotary embedding, SiLU-and-mul and the sampler. On a GPU every
operator is a kernel launch of a few microseconds, so a 30-layer decode step saves
hundreds of launches, and each fused kernel reads memory once instead of seven times.

Why on a CPU the gain may be small
----------------------------------
A CPU runs an operator as an ordinary function call: there is no launch to save, only
PyTorch's per-operator overhead and a few extra passes over activations that fit in the
cache. A decode step spends its time streaming the weights through the matrix multiplies
(memory-bound, chapter 6) and in attention; the ops fused here touch a few kilobytes per
token. Fusion can save at most the time these ops take, and a compiled call adds its own
fixed cost: on every call Dynamo checks its guards (are the inputs still of the kind it
compiled for?) before the generated code runs. Measured per op (``results/README.md``), that
fixed cost made a compiled call several times slower than eager at 1 row, and the fused loop
caught up around 64 rows. So on a CPU a compiled function runs its compiled code only for inputs
of at least ``CPU_MIN_ROWS`` rows (prefill chunks, large decode batches) and calls the eager
function below that. On CUDA the compiled code always runs: CUDA graphs replay it without any Python.
``python -m nanoengine bench --compile`` measures both engines in one run and the share of
a step these ops take (fields in ``results/README.md``).

How it is wired
---------------
Each layer keeps its math in a plain function and calls it through an attribute named in
its class's ``compilable`` tuple: ``RMSNorm.norm_fn`` / ``add_norm_fn``,
``RotaryEmbedding.rotate_fn``, ``SiluAndMul.silu_and_mul_fn``, ``Sampler.probs_fn``. The
class attribute is the eager function, the readable default. With ``compile=True`` the
backend's kernels (``layers.kernels``) are ``compiled_kernels``: those functions compiled, so
the layers of that engine's model take the compiled ones when they are built, and other
engines in the same process stay as they were. ``compile_runner`` then warms them up.

* One compiled version per function, shared by all layers and engines of the process
  (Dynamo's cache lives on the function's code anyway).
* ``dynamic=True``: the number of tokens changes every step. Compiled with symbolic sizes,
  one graph serves them all; Dynamo still specialises a size of 1 (one decode token). The
  warm-up runs the sizes that will use compiled code (one step of ``WARM_UP_ROWS`` tokens
  on a CPU; also a 1-token step on CUDA), so later steps compile nothing.
* The warm-up runs when the runner is built and is timed (``CompileReport.seconds``);
  otherwise the first steps of a compiled engine would take seconds each.
* Failure: Inductor needs a C++ compiler on a CPU (Triton on a GPU). If it is missing or
  compiling fails, the engine warns once, naming the cause, and every compiled function
  runs its eager function from then on: it never crashes for it and never warns per call.
* The GEMMs are not compiled: they keep calling oneDNN with the weights prepacked by
  the CPU backend (``backends/cpu.py``, ``kernels.cpu_gemm``). The device backend calls
  ``compile_runner`` from ``prepare_forward``; on CUDA it compiles before it captures CUDA
  graphs, so the graphs record the compiled kernels.

Why not compile the whole decode step (the model's forward) on a CPU? Measured against the
CPU backend's layers run eagerly, one native call each (``backends.cpu_fused``), a compiled
graph of them bought nothing and tripled the time an engine takes to build (results/README.md:
engine v4's choice of one CPU fast path).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from nanoengine import kernels


class CompileFallbackWarning(RuntimeWarning):
    """torch.compile could not be used; the engine runs eagerly (the message says why)."""


@dataclass(frozen=True)
class CompileReport:
    """What ``compile=True`` did for one runner.

    requested: the engine was built with compile=True.
    compiled: compiled code is in use (False after a fallback).
    seconds: wall time of compiling and warming up, spent when the runner was built.
    ops: the compiled functions, e.g. ``RMSNorm.add_norm_fn``.
    fallback_reason: why the engine runs eagerly although compile=True, else None.
    """

    requested: bool
    compiled: bool
    seconds: float
    ops: tuple[str, ...]
    fallback_reason: str | None = None

    @classmethod
    def not_requested(cls) -> "CompileReport":
        return cls(requested=False, compiled=False, seconds=0.0, ops=())


class CompiledFunction:
    """One eager function and its ``torch.compile``'d twin; called like the function.

    On a CPU, calls with fewer than ``CPU_MIN_ROWS`` rows run the eager function
    (``runs_compiled``). Compilation happens on the first compiled call with inputs of a
    new kind. If it raises, the same call is rerun eagerly: when that succeeds the
    compiler was at fault, the process records it (one warning) and every compiled
    function runs eagerly from then on; when the eager call fails too, the inputs were
    bad and that error propagates.
    """

    def __init__(self, eager: Callable, compiler: "Compiler") -> None:
        self.eager = eager
        self.compiler = compiler
        self.compiled = torch.compile(eager, dynamic=True)

    def __call__(self, *args):
        if self.compiler.failure is not None or not runs_compiled(args[0]):
            return self.eager(*args)
        try:
            return self.compiled(*args)
        except Exception as exc:  # noqa: BLE001 (any compiler error: Dynamo, Inductor, the C++ build)
            error = exc
        result = self.eager(*args)  # outside the handler: an eager error is not chained to it
        self.compiler.fail(f"compiling {self.eager.__qualname__} failed with {type(error).__name__}: "
                           f"{_first_line(error)}")
        return result


class Compiler:
    """The process's compiled functions (one per eager function) and whether compiling failed.

    Process-wide on purpose: Dynamo caches compiled code per function for the whole process,
    and a missing C++ compiler is missing for every engine.
    """

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

# Below this many rows (tokens, or sampled sequences) a CPU runs the eager function: the
# compiled call's fixed cost exceeds what fusion saves (measured: see the module docstring).
CPU_MIN_ROWS = 64


def runs_compiled(rows: torch.Tensor) -> bool:
    """Whether a call whose first argument is ``rows`` (dim 0 = tokens) uses compiled code."""
    return rows.is_cuda or (rows.dim() > 0 and rows.shape[0] >= CPU_MIN_ROWS)


# The warm-up's step size for the general (symbolic) graph: >= CPU_MIN_ROWS, and a prime, so
# that it equals no model dimension. Dynamo's "duck sizing" gives equal sizes one symbol and
# ties them together (64 tokens in a model of hidden size 64 compiled a graph for 64 tokens only).
WARM_UP_ROWS = 67


def warm_up_sizes(device: torch.device) -> tuple[int, ...]:
    """The step sizes that compile every graph later steps use (see ``runs_compiled``)."""
    return (1, WARM_UP_ROWS) if device.type == "cuda" else (WARM_UP_ROWS,)


def compiler_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot work for ``device`` here, or None when it should."""
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    from torch import _dynamo

    if not _dynamo.is_dynamo_supported():
        return f"torch.compile does not support this Python ({sys.version.split()[0]})"
    if device.type == "cuda":
        return None if kernels.triton_available() else "Inductor needs Triton on CUDA, and triton cannot be imported"
    candidates = _cpp_compilers()
    if not any(shutil.which(name) for name in candidates):
        return (f"Inductor needs a C++ compiler to generate CPU code and none of {candidates} is on PATH "
                f"(install g++ or set CXX)")
    return None


def _cpp_compilers() -> tuple[str, ...]:
    """The compilers Inductor will try, in order (its ``cpp.cxx`` setting, from ``CXX``)."""
    try:
        from torch._inductor import config

        names = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    except (ImportError, AttributeError):  # a torch without that setting: its documented default
        names = (os.environ.get("CXX", "g++"),)
    return tuple(name for name in names if name)


def compilable_objects(runner) -> list:
    """The runner's modules whose class names ``compilable`` functions, and its sampler."""
    modules = [m for m in runner.model.modules() if getattr(type(m), "compilable", ())]
    return modules + [runner.sampler]


# What compile=True compiles: the kernels' field, and the layer attribute that calls it.
COMPILED_OPS = {"rms_norm": "RMSNorm.norm_fn", "add_rms_norm": "RMSNorm.add_norm_fn",
                "rotate_half": "RotaryEmbedding.rotate_fn", "silu_and_mul": "SiluAndMul.silu_and_mul_fn",
                "sampling_probs": "Sampler.probs_fn"}


def compiled_kernels(kernels, compiler: Compiler | None = None):
    """``kernels`` with the small fused ops compiled (the layers' own eager functions, compiled):
    the kernels of a backend built with ``compile=True``. The decoder layers keep their Python
    forward (no one-call version): the compiled ops are what runs."""
    import dataclasses

    from nanoengine.layers.activation import silu_and_mul
    from nanoengine.layers.layernorm import add_rms_norm, rms_norm
    from nanoengine.layers.rotary import rotate_half
    from nanoengine.layers.sampler import sampling_probs

    compiler = compiler or COMPILER
    eager = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rotate_half": rotate_half,
             "silu_and_mul": silu_and_mul, "sampling_probs": sampling_probs}
    return dataclasses.replace(kernels, name=f"{kernels.name}, compiled small ops", decoder_layer=None,
                               **{field: compiler.compiled(fn) for field, fn in eager.items()})


def compile_runner(runner, compiler: Compiler | None = None) -> CompileReport:
    """Warm up the compiled functions ``runner``'s model and sampler were built with; time it.

    ``runner`` is a ``ModelRunner`` whose KV cache is bound and whose backend's kernels are
    ``compiled_kernels``. On failure the functions run eagerly and the report says why.
    """
    compiler = compiler or COMPILER
    problem = compiler_problem(runner.device)
    if problem is not None:
        compiler.fail(problem)
    seconds = 0.0
    if compiler.failure is None:
        start = time.perf_counter()
        for num_tokens in warm_up_sizes(runner.device):  # compiles now, not in the first steps
            runner.warm_up(num_tokens)
        seconds = time.perf_counter() - start
    if compiler.failure is not None:
        return CompileReport(requested=True, compiled=False, seconds=seconds, ops=(), fallback_reason=compiler.failure)
    return CompileReport(requested=True, compiled=True, seconds=seconds, ops=tuple(sorted(COMPILED_OPS.values())))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else "(no message)"
