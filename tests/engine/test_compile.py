"""``compile=True`` (``backends.compilation``): CUDA only; eager's greedy tokens, no recompiles, one warning on failure.

On a CPU the option is refused before anything loads (the CPU's fast path is one native call
per decoder layer). The machinery that compiles, warms up and falls back is tested here on
CPU with a stand-in for ``torch.compile``; the compiled engine itself runs in the tests marked
``gpu`` (skipped without CUDA), on the tiny Llama: ``dynamic=True`` plus the runner's warm-up
mean the batches below, of every size, compile nothing more.
"""

from __future__ import annotations

import random
import types

import pytest
import torch

from nanoengine import LLM, LLMEngine, SamplingParams
from nanoengine.backends import compilation, select_backend
from nanoengine.backends.compilation import (WARM_UP_SIZES, CompiledFunction, CompileFallbackWarning, Compiler,
                                             compile_runner, compiled_kernels, compiler_problem)
from nanoengine.config import EngineConfig
from nanoengine.layers.kernels import LayerKernels
from nanoengine.layers.sampler import Sampler, sampling_params_columns, sampling_probs
from nanoengine.loader.weights import random_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ALL_OPS = ("RMSNorm.add_norm_fn", "RMSNorm.norm_fn", "RotaryEmbedding.rotate_fn", "Sampler.probs_fn",
           "SiluAndMul.silu_and_mul_fn")


def prompts(n: int, seed: int = 0, lengths: tuple[int, int] = (3, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 5000) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def tokens(llm, batch, params=GREEDY) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(batch, params)]


# ------------------------------------------------------------------- config
@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_compile_must_be_a_bool(value):
    with pytest.raises(ValueError, match=rf"compile must be True or False, got {value!r}"):
        EngineConfig(compile=value)


def test_compile_with_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match=r"compile=True .* tensor_parallel_size > 1 \(got 2\)"):
        EngineConfig(compile=True, tensor_parallel_size=2)


def test_compile_on_a_cpu_is_refused_before_anything_loads():
    refused = (r"compile=True applies to CUDA only, and this engine runs on 'cpu'\. On a CPU the default fast path "
               r"already runs each decoder layer as one native call, and enforce_eager=True runs the layers' "
               r"Python forward")
    with pytest.raises(ValueError, match=refused):
        EngineConfig(device="cpu", compile=True)
    with pytest.raises(ValueError, match=refused):  # no such checkpoint: the option is refused before any loading
        LLM("/no/such/checkpoint", device="cpu", compile=True)
    with pytest.raises(ValueError, match=refused):
        select_backend("cpu", compile=True)  # the backend refuses it too, for callers that skip the config
    assert EngineConfig(device="cpu", compile=False).compile is False and EngineConfig(device="cpu").compile is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks CUDA here")
def test_compile_on_auto_without_cuda_is_refused():
    with pytest.raises(ValueError, match="compile=True applies to CUDA only, and this engine runs on 'cpu'"):
        EngineConfig(compile=True)  # device="auto" is the CPU here


def test_a_cpu_engine_holds_no_compiled_code(build_tiny_llm):
    llm = build_tiny_llm(dict(device="cpu", max_model_len=64, num_kv_blocks=64, block_size=8))
    runner = llm.engine.runner
    assert not runner.compilation.requested and runner.compilation.ops == ()
    held = [vars(m)[name] for m in [*runner.model.modules(), runner.sampler] for name in
            ("norm_fn", "add_norm_fn", "rotate_fn", "silu_and_mul_fn", "probs_fn") if name in vars(m)]
    assert len(held) >= 5 and not any(isinstance(fn, CompiledFunction) for fn in held)


# ------------------------------------------------------------ the machinery
def test_compiled_kernels_wrap_the_layers_own_functions_and_keep_the_rest():
    from nanoengine.layers.activation import silu_and_mul
    from nanoengine.layers.layernorm import add_rms_norm, rms_norm
    from nanoengine.layers.rotary import rotate_half

    compiler = Compiler()
    attention, linear_method = object(), object()
    kernels = compiled_kernels(LayerKernels(name="cuda", attention=attention, linear_method=linear_method), compiler)
    assert kernels.name == "cuda, compiled small ops"
    assert kernels.attention is attention and kernels.linear_method is linear_method
    wrapped = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rotate_half": rotate_half,
               "silu_and_mul": silu_and_mul, "sampling_probs": sampling_probs}
    for field, eager in wrapped.items():
        fn = getattr(kernels, field)
        assert isinstance(fn, CompiledFunction) and fn.eager is eager and fn is compiler.compiled(eager)
    assert sorted(compilation.COMPILED_OPS.values()) == list(ALL_OPS)


def test_a_failing_compiler_warns_once_and_runs_eagerly(monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("simulated Triton build failure\nsecond line")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    compiler = Compiler()
    norm, act = compiler.compiled(lambda x: x * 2), compiler.compiled(lambda x: x + 1)
    x = torch.arange(4.0)
    with pytest.warns(CompileFallbackWarning) as caught:
        assert torch.equal(norm(x), x * 2) and torch.equal(act(x), x + 1) and torch.equal(norm(x), x * 2)
    ours = [w for w in caught if issubclass(w.category, CompileFallbackWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert "RuntimeError: simulated Triton build failure" in message and "running eagerly" in message
    assert "second line" not in message and compiler.failure in message


def test_an_input_error_is_not_blamed_on_the_compiler(monkeypatch):
    compiler = Compiler()
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # "compiled" = eager: both raise
    bad = compiler.compiled(sampling_probs)
    rows = 6
    with pytest.raises(RuntimeError):  # columns of the wrong length
        bad(torch.zeros(rows, 5), torch.ones(3, 1), torch.ones(7, 1, dtype=torch.long), torch.ones(rows, 1),
            torch.zeros(rows, 1))
    assert compiler.failure is None


def test_compile_runner_warms_up_each_size_and_reports(monkeypatch):
    monkeypatch.setattr(compilation, "compiler_problem", lambda: None)
    sizes = []
    report = compile_runner(types.SimpleNamespace(warm_up=sizes.append), Compiler())
    assert sizes == list(WARM_UP_SIZES) and 1 in sizes and len(sizes) == 2  # one decode token, then one symbolic size
    assert report.requested and report.compiled and report.fallback_reason is None and report.ops == ALL_OPS


def test_without_triton_compile_runner_warns_and_runs_eagerly(monkeypatch):
    from nanoengine import kernels

    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    assert "needs Triton" in compiler_problem()
    sizes = []
    with pytest.warns(CompileFallbackWarning, match="needs Triton") as caught:
        report = compile_runner(types.SimpleNamespace(warm_up=sizes.append), Compiler())
    assert len([w for w in caught if issubclass(w.category, CompileFallbackWarning)]) == 1
    assert sizes == [] and not report.compiled and report.seconds == 0.0 and "Triton" in report.fallback_reason


def test_sampler_columns_are_per_row_tensors():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1)]
    temperature, top_k, top_p, min_p = sampling_params_columns(torch.zeros(2, 4), params)
    assert temperature.tolist() == [[1.0], [0.5]]  # a greedy row is filtered at T=1 (it takes the argmax anyway)
    assert top_k.dtype == torch.long and top_k.tolist() == [[-1], [3]]
    assert top_p.tolist() == [[1.0], [pytest.approx(0.9)]] and min_p.tolist() == [[0.0], [pytest.approx(0.1)]]
    assert Sampler.probs_fn is sampling_probs


# --------------------------------------------------------------- on CUDA
def cuda_llm(compile: bool) -> LLM:
    """The tiny Llama on CUDA in float32, built for the backend the engine picks (compiled ops or not)."""
    backend = select_backend("cuda", dtype=torch.float32, compile=compile)
    net = random_model("tiny-llama", std=0.08, device="cuda", dtype=torch.float32, backend=backend)
    return LLM.from_engine(LLMEngine.from_model(net, None, device="cuda", dtype="float32", compile=compile,
                                                max_model_len=256, num_kv_blocks=1024, block_size=16))


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_greedy_tokens_equal_eager_at_every_batch_size_on_cuda():
    eager, compiled = cuda_llm(compile=False), cuda_llm(compile=True)
    report = compiled.engine.runner.compilation
    assert report.compiled and report.fallback_reason is None, report
    assert report.ops == ALL_OPS and report.seconds > 0
    assert compiled.engine.forward_mode.startswith("eager with compiled fused ops")
    graphs = compiled_graphs()
    batches = {"one short prompt": prompts(1), "one long prompt": prompts(1, seed=1, lengths=(100, 120)),
               "a few prompts": prompts(3, seed=2), "many prompts": prompts(70, seed=3)}
    for name, batch in batches.items():
        assert tokens(compiled, batch) == tokens(eager, batch), name
    assert compiled_graphs() == graphs, "a step recompiled after the warm-up"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_seeded_sampling_matches_eager_on_cuda():
    eager, compiled = cuda_llm(compile=False), cuda_llm(compile=True)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, max_tokens=6, seed=s, ignore_eos=True)
              for s in range(4)]
    batch = prompts(4, seed=3)
    assert tokens(compiled, batch, params) == tokens(eager, batch, params)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_sampling_probs_match_eager_on_cuda():
    with torch.inference_mode():  # as the runner's logits are: the warm-up's graphs then serve this call
        logits = torch.randn(69, 1000, generator=torch.Generator().manual_seed(0)).cuda() * 4
    settings = ((1.0, -1, 1.0, 0.0), (0.5, 10, 1.0, 0.0), (1.3, -1, 0.8, 0.0), (0.7, 50, 0.95, 0.05), (2.0, 0, 0.5, 0.1))
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in (settings[i % len(settings)] for i in range(logits.shape[0]))]
    columns = sampling_params_columns(logits, params)
    expected = sampling_probs(logits, *columns)
    got = compilation.COMPILER.compiled(sampling_probs)(logits, *columns)
    assert compilation.COMPILER.failure is None
    assert torch.equal(got > 0, expected > 0)  # the same tokens survive the filters
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5)
