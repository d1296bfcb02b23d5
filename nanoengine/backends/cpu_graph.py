"""The CPU model compiled whole: one graph per step shape, the kernels inside it opaque (chapter 10).

Eager PyTorch runs a decode step of SmolLM2 as a few thousand operator calls: each layer's
views, reshapes, casts, rotary products, SiLU, residual adds, each through Python and the
dispatcher. vLLM's CPU backend compiles the model's forward whole with ``torch.compile``
(Dynamo traces it once, Inductor generates C++ loops for everything but the GEMMs and
attention), and this module does the same for the CPU backend with
``LLM(compile_model=True)``.

What stays a kernel of its own
------------------------------
Inductor cannot lower oneDNN's prepacked linear (``mkldnn._linear_pointwise``), and a
Python attention that reads block tables is full of data-dependent branches Dynamo would
break the graph at. Both are **custom operators** that Dynamo records as one node each and
Inductor calls as it is, knowing only the shape of what it returns (its "fake"):

* ``nanoengine::cpu_linear``: the CPU backend's product (the few-rows kernel or the packed
  oneDNN GEMM, ``CpuLinearMethod``), on the layer's weight and packed copy; registered in
  C++ (``kernels/csrc/llama_layer.cpp``), so a product costs one dispatch and no Python;
* ``nanoengine::cpu_attention``: store-KV, decode and prefill attention of one layer
  (``AttentionImpl.forward`` of the CPU kernels), writing the layer's KV cache; a Python
  ``torch.library.custom_op`` (~65 us a call on a 2-core Xeon).

The native norms (``kernels.cpu_native``) are operators already. Inductor fuses what is
left (rotary, SiLU-and-mul, the residual adds, the embedding lookup) into a few loops.

Why the step's metadata is not an input of the graph
----------------------------------------------------
A graph is compiled for the *kinds* of inputs it saw: Dynamo guards on every input
tensor's dimensions, and treats a dimension of size 0 or 1 as a constant. Block tables,
context lengths and chunk boundaries change shape every step (one decode or many, no
prefill or some), so passing them in would compile a graph for each combination. The
graph takes only the token ids and positions; the step's metadata is set around the call
(``step_metadata``) and the attention operator reads it there, at run time, as vLLM's
attention reads its "forward context". The number of tokens is marked *unbacked*: Dynamo
assumes nothing about it (not even that it is not 1) and guards on nothing, so one graph
serves a single decode token and a 2,048-token prefill alike.

Compiled once per machine
-------------------------
Inductor's generated C++ is compiled with flags for this CPU's vector instructions and
cached on disk. The cache directory is keyed by torch's version, the instruction set
PyTorch uses (``ATEN_CPU_CAPABILITY`` lowers it) and this CPU's model and flags, so another
CPU, or the same CPU told to use AVX2 only, never reuses kernels built for another
(torch 2.13 itself reused AVX-512 kernels under ``ATEN_CPU_CAPABILITY=avx2`` and produced
NaN: ``scripts/test.sh``). An engine compiles while it is built (the warm-up, timed in
``runner.compilation``); later engines of the process with the same model reuse the graph.
Without a C++ compiler the engine runs eagerly and warns once, naming why
(``engine.compilation.compiler_problem``).

What it is worth
----------------
Measured on a 2-core AVX2 EPYC (SmolLM2-135M, fp32, 8 requests and one alone): greedy
tokens identical to eager, throughput within the machine's noise of eager (the native
kernels already run the norms, GEMMs and attention, and what Inductor fuses is a few
percent of a step), and 60 s to build the first engine of a process cold, 22 s with the
disk cache warm (Dynamo traces 30 layers every process). That is why it is not the default.
Since then the eager path runs each decoder layer as one native call on every step
(``backends.cpu_fused``), which the compiled graph cannot use: on a 2-core Xeon a 37-token
prefill took ~63 ms that way against 67.5 ms compiled. Compiling one layer's forward once
for all 30 cut the build to 5 s but ran slower still (results/README.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import platform
import sys
import time
from pathlib import Path

import torch

from nanoengine.layers.attention import AttentionImpl, AttentionMetadata

# What the graph's attention operators read, set around each compiled forward: the
# AttentionImpl that computes, the step's metadata, and each layer's (k_cache, v_cache).
_STEP: contextvars.ContextVar[tuple] = contextvars.ContextVar("nanoengine_step")


@contextlib.contextmanager
def step_metadata(impl: AttentionImpl, meta: AttentionMetadata, layer_caches: list):
    """Make ``meta`` and the layers' caches what ``nanoengine::cpu_attention`` reads, for one forward pass."""
    token = _STEP.set((impl, meta, layer_caches))
    try:
        yield
    finally:
        _STEP.reset(token)


# The caches are not arguments of the operator: an operator that writes an argument must
# say so (``mutates_args``), and Inductor then copies the written tensor unless it can
# prove the copy unneeded, a copy of the whole KV cache per layer and step (measured: a
# decode step took seconds). Read from the step, the cache is the operator's own business,
# as the cache is for vLLM's attention operator.
@torch.library.custom_op("nanoengine::cpu_attention", mutates_args=())
def cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """Layer ``layer``'s attention with the step's metadata and caches (``step_metadata``): (T, heads, d)."""
    try:
        impl, meta, layer_caches = _STEP.get()
    except LookupError:
        raise RuntimeError("nanoengine::cpu_attention ran outside a step: the compiled forward must be "
                           "called inside step_metadata(...)") from None
    k_cache, v_cache = layer_caches[layer]
    return impl.forward(q, k, v, k_cache, v_cache, meta, scale)


@cpu_attention.register_fake
def _(q, k, v, layer, scale):
    return torch.empty_like(q)


class GraphAttention(AttentionImpl):
    """Layer ``layer``'s attention inside the compiled graph: one opaque operator.

    ``kernels``: the ``AttentionImpl`` that computes (the CPU backend's), handed to the
    operator with the step's metadata by ``step_metadata``.
    """

    def __init__(self, kernels: AttentionImpl, layer: int) -> None:
        self.kernels = kernels
        self.layer = layer

    @property
    def name(self) -> str:
        return self.kernels.name

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        return torch.ops.nanoengine.cpu_attention(q, k, v, self.layer, scale)


def cache_directory() -> Path:
    """Where Inductor keeps this machine's compiled kernels: one folder per torch, ISA and CPU."""
    base = Path(os.environ.get("NANOENGINE_CACHE", Path.home() / ".cache" / "nanoengine"))
    return base / "inductor" / machine_key()


def machine_key() -> str:
    """torch's version, the instruction set ATen uses here, and a digest of the CPU's model and flags."""
    cpu = _cpu_identity()
    digest = hashlib.sha256(cpu.encode()).hexdigest()[:12]
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return f"torch-{torch.__version__.replace('+', '-')}-py{sys.version_info.major}{sys.version_info.minor}-" \
           f"{capability}-{digest}"


def _cpu_identity() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def use_machine_cache() -> Path:
    """Point Inductor at this machine's cache folder, unless the environment chose one."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    directory = cache_directory()
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    return directory


def compile_model(runner, backend) -> "CompileReport":
    """Compile ``runner``'s model forward whole for ``backend`` (a ``CpuBackend``), warm it up, time it.

    Every attention layer gets a ``GraphAttention`` and every linear layer the backend
    prepared a ``GraphLinearMethod``, so Dynamo sees each as one operator. On any failure
    the layers get their eager kernels back, the engine warns once and runs eagerly.
    """
    from nanoengine.backends.cpu import CpuLinearMethod, GraphLinearMethod
    from nanoengine.engine.compilation import CompileFallbackWarning, CompileReport, compiler_problem
    from nanoengine.layers.attention import Attention

    model = runner.model
    use_machine_cache()  # before anything imports Inductor: its import fixes the folder it uses
    problem = compiler_problem(runner.device)
    if problem is not None:
        _warn_once(problem, CompileFallbackWarning)
        return CompileReport(requested=True, compiled=False, seconds=0.0, ops=(), fallback_reason=problem)
    attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
    linear_layers = [m for m in model.modules() if isinstance(vars(m).get("linear_method"), CpuLinearMethod)]
    backend.layer_caches = [(layer.k_cache, layer.v_cache) for layer in attention_layers]
    for i, layer in enumerate(attention_layers):
        layer.impl = GraphAttention(backend.attention, i)
    for layer in linear_layers:
        method = layer.linear_method
        layer.linear_method = GraphLinearMethod(method.packed, method.few_rows)
    start = time.perf_counter()
    graph = torch.compile(lambda ids, pos: model(ids, pos, None), dynamic=True, fullgraph=True)

    def forward(input_ids, positions):
        # One graph for every step size: an unbacked size is never specialised (not even to 1)
        # and never guarded on, so the single token of a decode step reuses it too.
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        return graph(input_ids, positions)

    backend.compiled_forward = forward
    try:
        for num_tokens in (WARM_UP_ROWS, 1):  # compiles once; the single token reuses the graph
            runner.warm_up(num_tokens)
    except Exception as exc:  # noqa: BLE001 (Dynamo, Inductor or the C++ build: the engine still runs eagerly)
        backend.compiled_forward = None
        for layer in attention_layers:
            layer.impl = backend.attention
        for layer in linear_layers:
            layer.linear_method = CpuLinearMethod(layer.linear_method.packed, layer.linear_method.few_rows)
        reason = f"compiling the model failed with {type(exc).__name__}: {str(exc).strip()[:300]}"
        _warn_once(reason, CompileFallbackWarning)
        return CompileReport(requested=True, compiled=False, seconds=time.perf_counter() - start, ops=(),
                             fallback_reason=reason)
    seconds = time.perf_counter() - start
    return CompileReport(requested=True, compiled=True, seconds=seconds, ops=(f"{type(model).__name__}.forward",))


# The warm-up's size for the general graph: a prime, equal to no model dimension (Dynamo gives
# equal sizes one symbol: 64 tokens in a model of hidden size 64 would compile a graph for 64 only).
WARM_UP_ROWS = 67

_WARNED: set[str] = set()


def _warn_once(reason: str, category) -> None:
    import warnings

    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"the model runs eagerly: {reason}", category, stacklevel=3)
