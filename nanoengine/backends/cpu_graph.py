"""The CPU model compiled whole: one graph for every step, the kernels inside it opaque (chapter 10).

Eager PyTorch runs a decode step of SmolLM2 as a few thousand operator calls: each layer's
views, reshapes, casts, rotary products, SiLU, residual adds, each through Python and the
dispatcher. vLLM's CPU backend compiles the model's forward whole with ``torch.compile``
(Dynamo traces it once, Inductor generates C++ loops for everything but the GEMMs and
attention), and this module does the same for the CPU backend with
``LLM()`` by default wherever the layers register (below), any model with ``compile_model=True``.

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
  ``torch.library.custom_op``, whose own Python runs on every call (its cost: results/README.md).

The native norms (``kernels.cpu_native``) are operators already. Inductor fuses what is
left (rotary, SiLU-and-mul, the residual adds, the embedding lookup) into a few loops.

That is the graph for models whose layers do not run as one native call (Qwen3's per-head
norms, a bias on o_proj). SmolLM2's Llama layers do (``backends.cpu_fused``), and there the
graph calls each layer as one operator, ``nanoengine::registered_layer``
(``kernels/csrc/registered_layers.cpp``), whose arguments are only the hidden states, the
residual stream and the rotary rows: each layer's weights and cache are registered with the
native code once, at build (``RegisteredModel``), and the step's metadata once per step,
outside the graph. The graph is then the embedding, the rotary rows, 30 operator calls and
the final norm; a step the layers do not run fused (a forward hook, a warm-up row without a
cache slot) runs the layers' eager forward instead.

Why the step's metadata is not an input of the graph
----------------------------------------------------
A graph is compiled for the *kinds* of inputs it saw: Dynamo guards on every input
tensor's dimensions, and treats a dimension of size 0 or 1 as a constant. Block tables,
context lengths and chunk boundaries change shape every step (one decode or many, no
prefill or some), so passing them in would compile a graph for each combination. The
graph takes only the token ids and positions (and, for registered layers, the step's rotary
rows: ``_compiled`` says why); the step's metadata is set around the call
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
(``backends.compilation.compiler_problem``).

What it is worth, and why it is the default
-------------------------------------------
Measured with the operators above in every layer (SmolLM2-135M, fp32, 8 requests and one
alone): greedy tokens identical to eager, throughput within the machine's noise of eager,
and a long build for the first engine of a process, cold and even with the disk cache warm
(Dynamo traced 30 layers every process). With the layers registered, the graph ran at
eager's speed as long as Inductor wrote the code around it in Python: that code called the
30 operators one by one from Python, as eager does. Written in C++ (Inductor's
``cpp_wrapper``), a step enters the graph once and the 30 calls cost no Python: a lone
sequence a little faster than eager, ahead in every alternating round, the bench workload
level (compute-bound) (figures: ``results/README.md``). So an engine whose layers register
compiles by default (``compile_model=None``), and ``enforce_eager=True`` is the way back to
eager. Every operator in that graph is the eager path's own (the embedding is a gather, the
norm and the layers the native kernels), so the bits are eager's by construction. Other
models stay eager unless ``compile_model=True``: their graph fuses rotary and SiLU in
Inductor's own loops, which round differently, and it was no faster. The price is at load:
seconds for the first engine of a process with the disk cache warm (Dynamo traces the
forward, Inductor loads the compiled code), a fraction of a second for the next ones of the
same model, more the first time on a machine (``./course setup`` pays that).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
import platform
import sys
import time
import types
import weakref
from pathlib import Path

import torch

from nanoengine.layers.attention import AttentionImpl, AttentionMetadata

logger = logging.getLogger("nanoengine.compile")

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

    Where the decoder layers run as one native call each (``backend.unfused_reason`` is None),
    each layer is one ``nanoengine::registered_layer`` in the graph (``graph_layer_forward``);
    otherwise every attention layer gets a ``GraphAttention`` and every linear layer a
    ``GraphLinearMethod``. Either way Dynamo sees each as one operator. On any failure the
    layers get their eager forward back, the engine warns once and runs eagerly.
    """
    from nanoengine.backends.compilation import CompileFallbackWarning, CompileReport, compiler_problem

    use_machine_cache()  # before anything imports Inductor: its import fixes the folder it uses
    problem = compiler_problem(runner.device)
    if problem is not None:
        _warn_once(problem, CompileFallbackWarning)
        return CompileReport(requested=True, compiled=False, seconds=0.0, ops=(), fallback_reason=problem)
    graph_of = _registered_layers if backend.unfused_reason is None else _operator_layers
    install, forward, restore, warm_up_kv = graph_of(runner, backend)
    install()
    backend.compiled_forward = forward
    start = time.perf_counter()
    try:
        for num_tokens in (min(WARM_UP_ROWS, runner.num_blocks * runner.block_size), 1):
            runner.warm_up(num_tokens, write_kv=warm_up_kv)  # compiles once; the single token reuses the graph
    except Exception as exc:  # noqa: BLE001 (Dynamo, Inductor or the C++ build: the engine still runs eagerly)
        backend.compiled_forward = None
        restore()
        reason = f"compiling the model failed with {type(exc).__name__}: {str(exc).strip()[:300]}"
        _warn_once(reason, CompileFallbackWarning)
        return CompileReport(requested=True, compiled=False, seconds=time.perf_counter() - start, ops=(),
                             fallback_reason=reason)
    seconds = time.perf_counter() - start
    global _first_compile_logged
    if not _first_compile_logged:  # once per process: the first compile may have waited for the C++ compiler
        _first_compile_logged = True
        logger.info("compiled %s whole in %.1f s (Inductor's cache: %s; later engines of this process and later "
                    "processes on this CPU reuse it)", type(runner.model).__name__, seconds,
                    os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    return CompileReport(requested=True, compiled=True, seconds=seconds,
                         ops=(f"{type(runner.model).__name__}.forward",))


def _compiled(model, registered: bool = False):
    """The model's forward compiled for token ids and positions of any length (one graph).

    ``registered``: the graph is the registered layers (only C++ operators to call), so Inductor
    writes the code that calls them in C++ rather than Python (``cpp_wrapper``): a step crosses
    from Python into the graph once, not once per operator. The step's rotary rows are gathered
    before the graph and passed in, so that the rotary table (max_model_len rows) is not in it:
    Dynamo takes a weight's or buffer's sizes as constants and guards on them, and every engine
    with another max_model_len would compile a graph of its own.
    """
    def mark(*tensors):
        # One graph for every step size: an unbacked size is never specialised (not even to 1)
        # and never guarded on, so the single token of a decode step reuses it too.
        for t in tensors:
            torch._dynamo.decorators.mark_unbacked(t, 0)

    if not registered:
        graph = torch.compile(lambda ids, pos: model(ids, pos, None), dynamic=True, fullgraph=True)

        def run(input_ids, positions):
            mark(input_ids, positions)
            return graph(input_ids, positions)

        return run
    graph = torch.compile(lambda ids, pos, cos, sin: model(ids, pos, None, (cos, sin)), dynamic=True,
                          fullgraph=True, options={"cpp_wrapper": True})
    rows = model.model.rotary_emb.rows

    def run_registered(input_ids, positions):
        cos, sin = rows(positions)
        mark(input_ids, positions, cos, sin)
        with _dynamo_settings(DYNAMO_SETTINGS):
            return graph(input_ids, positions, cos, sin)

    return run_registered


@contextlib.contextmanager
def _dynamo_settings(settings: dict):
    """Dynamo's config set to ``settings`` for one call, then put back. Set directly: its own
    ``config.patch`` cost about as much a call as the Python that compiling removes
    (results/README.md)."""
    config = torch._dynamo.config
    before = {name: getattr(config, name) for name in settings}
    for name, value in settings.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(config, name, value)


def _registered_layers(runner, backend):
    """The graph for layers that run as one native call: ``graph_layer_forward`` each, their weights registered."""
    from nanoengine.backends import cpu_fused

    model = runner.model
    layers = list(model.model.layers)
    fused = [cpu_fused.FusedLayer(layer) for layer in layers]
    registered = RegisteredModel(fused)
    graph = _compiled(model, registered=True)

    def install():
        backend.registered_model = registered
        backend.fused_layers = len(layers)
        backend.fused_modules = tuple(m for layer in layers for m in layer.modules())
        for i, (layer, eager) in enumerate(zip(layers, fused)):
            layer.fused_forward, layer.graph_index = eager, i
            layer.forward = types.MethodType(graph_layer_forward, layer)

    def forward(model, input_ids, positions, meta):
        if not meta.fused:  # a hook to call, or a token without a slot: the layers' eager forward
            return model(input_ids, positions, meta)
        with registered.step(meta):
            return graph(input_ids, positions)

    def restore():
        backend.registered_model = None
        for layer in layers:
            layer.forward = layer.fused_forward

    return install, forward, restore, True  # a fused step writes KV: the warm-up must too


def _operator_layers(runner, backend):
    """The graph for other models: each attention and linear layer one operator, the rest traced."""
    from nanoengine.backends.cpu import CpuLinearMethod, GraphLinearMethod
    from nanoengine.layers.attention import Attention

    model = runner.model
    attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
    linear_layers = [m for m in model.modules() if isinstance(vars(m).get("linear_method"), CpuLinearMethod)]
    graph = _compiled(model)

    def install():
        backend.layer_caches = [(layer.k_cache, layer.v_cache) for layer in attention_layers]
        for i, layer in enumerate(attention_layers):
            layer.impl = GraphAttention(backend.attention, i)
        for layer in linear_layers:
            method = layer.linear_method
            layer.linear_method = GraphLinearMethod(method.packed, method.few_rows)

    def forward(model, input_ids, positions, meta):
        with step_metadata(backend.attention, meta, backend.layer_caches):  # the attention operators read them
            return graph(input_ids, positions)

    def restore():
        for layer in attention_layers:
            layer.impl = backend.attention
        for layer in linear_layers:
            layer.linear_method = CpuLinearMethod(layer.linear_method.packed, layer.linear_method.few_rows)

    return install, forward, restore, False


def graph_layer_forward(layer, positions, hidden, residual, meta, rotary_rows=None):
    """A decoder layer's forward in the compiled model: ``nanoengine::registered_layer``.

    Traced (``meta`` None: the graph's forward passes no metadata), the layer is one operator
    taking the hidden states, the residual stream and the rotary rows; its weights and the
    step's metadata are the ``RegisteredModel``'s. Called with a step's metadata, it is a
    step the backend runs eagerly, and ``layer.fused_forward`` (a ``FusedLayer``) runs it.
    Installed as a method bound to each layer, not as an object of its own: Dynamo guards on
    an object's identity, and a second engine of the model would compile its own graph.
    """
    if meta is not None:
        return layer.fused_forward(positions, hidden, residual, meta, rotary_rows)
    cos, sin = rotary_rows
    return torch.ops.nanoengine.registered_layer(hidden, residual, cos, sin, layer.graph_index)


class RegisteredModel:
    """An engine's decoder layers registered with the native code once (``csrc/registered_layers.cpp``).

    Each layer's norms, weights, packed weights and KV cache are handed over at build; the
    step's metadata once per step (``step``). The registration is freed with this object.
    """

    def __init__(self, fused_layers) -> None:
        ops = torch.ops.nanoengine
        self.handle = ops.registered_model_new()
        weakref.finalize(self, ops.registered_model_free, self.handle)
        for fused in fused_layers:  # each a ``cpu_fused.FusedLayer``: the arguments it passes, gathered once
            ops.registered_model_add_layer(self.handle, *fused.weights, fused.attention.k_cache,
                                           fused.attention.v_cache, *fused.shape)

    @contextlib.contextmanager
    def step(self, meta: AttentionMetadata):
        """Make ``meta`` the step this thread's ``registered_layer`` calls read."""
        ops = torch.ops.nanoengine
        ops.registered_model_set_step(self.handle, meta.slot_mapping, meta.num_decode_tokens,
                                      meta.decode_block_tables, meta.decode_context_lens, meta.prefill_block_tables,
                                      meta.prefill_cu_seqlens_q, meta.prefill_context_lens, meta.widen_prefill)
        try:
            yield
        finally:
            ops.registered_model_clear_step(self.handle)


# Dynamo's settings while it checks or traces the registered layers' graph. After 8 graphs of one
# function Dynamo gives up (with fullgraph=True: an error, and the engine ran eagerly); each model
# structure (number of layers, sizes, dtype, tied weights or not) is a graph of its own, and a
# process that builds engines of many models (the test suite does) has more than 8. 64 is
# headroom for that, not a measured need.
DYNAMO_SETTINGS = {"recompile_limit": 64}

# The warm-up's size for the general graph: a prime, equal to no model dimension (Dynamo gives
# equal sizes one symbol: 64 tokens in a model of hidden size 64 would compile a graph for 64 only).
WARM_UP_ROWS = 67

_WARNED: set[str] = set()
_first_compile_logged = False  # whether this process has said how long its first compile took


def _warn_once(reason: str, category) -> None:
    import warnings

    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"the model runs eagerly: {reason}", category, stacklevel=3)


def warm_cache() -> str:
    """Build the default model's engine once, so that its compiled graph is in this machine's cache
    (``./course setup`` runs this); says what happened."""
    from nanoengine.llm import LLM

    start = time.perf_counter()
    llm = LLM(max_model_len=256, kv_cache_memory_gb=0.1)
    report = llm.engine.runner.compilation
    llm.shutdown()
    if not report.compiled:
        return f"the model runs eagerly here: {report.fallback_reason or 'its layers do not compile by default'}"
    return (f"the default model compiled and cached in {time.perf_counter() - start:.0f} s "
            f"({os.environ.get('TORCHINDUCTOR_CACHE_DIR')})")


if __name__ == "__main__":  # ./course setup: python -m nanoengine.backends.cpu_graph
    print(warm_cache())
