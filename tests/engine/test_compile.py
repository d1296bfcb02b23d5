"""``compile=True`` (``backends.compilation``): eager's greedy tokens, no recompiles, one warning on failure.

The tiny Llama keeps compile time small; ``dynamic=True`` plus the runner's warm-up mean
the batches below, of every size, compile nothing more. The compiled functions are shared
by the whole process, so only the first compiled engine pays. On a CPU, inputs of fewer
than ``CPU_MIN_ROWS`` rows run eagerly, so the batches are chosen to take both paths.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanoengine import SamplingParams
from nanoengine.config import EngineConfig
from nanoengine.backends import compilation
from nanoengine.kernels import cpu_native
from nanoengine.backends.compilation import (CPU_MIN_ROWS, CompileFallbackWarning, CompiledFunction, Compiler,
                                           compilable_objects,
                                           compiler_problem, runs_compiled)
from nanoengine.layers.sampler import Sampler, sampling_params_columns, sampling_probs

pytestmark = [pytest.mark.usefixtures("one_thread"),  # tiny models: see conftest
              pytest.mark.slow]  # every test compiles a model

CONFIG = dict(device="cpu", max_model_len=256, num_kv_blocks=1024, block_size=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROBLEM = compiler_problem(torch.device("cpu"))
needs_compile = pytest.mark.skipif(PROBLEM is not None, reason=f"torch.compile cannot run here: {PROBLEM}")
ALL_OPS = ("RMSNorm.add_norm_fn", "RMSNorm.norm_fn", "RotaryEmbedding.rotate_fn", "Sampler.probs_fn",
           "SiluAndMul.silu_and_mul_fn")


def prompts(n: int, seed: int = 0, lengths: tuple[int, int] = (3, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 5000) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def tokens(llm, batch, params=GREEDY) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(batch, params)]


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# ------------------------------------------------------------------- config
@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_compile_must_be_a_bool(value):
    with pytest.raises(ValueError, match=rf"compile must be True or False, got {value!r}"):
        EngineConfig(compile=value)


def test_compile_with_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match=r"compile=True .* tensor_parallel_size > 1 \(got 2\)"):
        EngineConfig(compile=True, tensor_parallel_size=2)


def test_small_ops_not_compiled_by_default(build_tiny_llm):
    runner = build_tiny_llm(CONFIG).engine.runner
    assert runner.compilation.ops == ()  # nothing compiled unless compile=True
    native = (cpu_native.rms_norm, cpu_native.add_rms_norm, cpu_native.rotate_half, cpu_native.silu_and_mul,
              sampling_probs)  # the CPU backend's own kernels and the sampler's eager filters, not compiled code
    assert all(vars(obj)[attr] in native for obj in compilable_objects(runner) for attr in type(obj).compilable)


# ------------------------------------------------------------------ compiled
@pytest.mark.slow
@needs_compile
def test_compiled_greedy_tokens_equal_eager_at_every_batch_size(build_tiny_llm):
    eager = build_tiny_llm(CONFIG)
    compiled = build_tiny_llm({**CONFIG, "compile": True})
    report = compiled.engine.runner.compilation
    assert report.compiled and report.fallback_reason is None, report
    assert report.ops == ALL_OPS and report.seconds > 0
    graphs = compiled_graphs()
    batches = {
        "one short prompt: every step eager": prompts(1),
        "one long prompt: compiled prefill, eager decodes": prompts(1, seed=1, lengths=(100, 120)),
        "a few prompts": prompts(3, seed=2),
        "many prompts: compiled prefill and decodes": prompts(CPU_MIN_ROWS + 6, seed=3),
    }
    for name, batch in batches.items():
        assert tokens(compiled, batch) == tokens(eager, batch), name
    assert compiled_graphs() == graphs, "a step recompiled after the warm-up"


@needs_compile
def test_compiled_seeded_sampling_matches_eager(build_tiny_llm):
    eager = build_tiny_llm(CONFIG)
    compiled = build_tiny_llm({**CONFIG, "compile": True})
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, max_tokens=6, seed=s, ignore_eos=True)
              for s in range(4)]
    batch = prompts(4, seed=3)
    ours = [list(o.token_ids) for o in compiled.generate(batch, params)]
    assert ours == [list(o.token_ids) for o in eager.generate(batch, params)]


@pytest.mark.slow
@needs_compile
def test_compiled_sampling_probs_match_eager():
    with torch.inference_mode():  # as the runner's logits are: the warm-up's graphs then serve this call
        logits = torch.randn(CPU_MIN_ROWS + 5, 1000, generator=torch.Generator().manual_seed(0)) * 4
    assert runs_compiled(logits)
    settings = ((1.0, -1, 1.0, 0.0), (0.5, 10, 1.0, 0.0), (1.3, -1, 0.8, 0.0), (0.7, 50, 0.95, 0.05), (2.0, 0, 0.5, 0.1))
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in (settings[i % len(settings)] for i in range(logits.shape[0]))]
    columns = sampling_params_columns(logits, params)
    expected = sampling_probs(logits, *columns)
    got = compilation.COMPILER.compiled(sampling_probs)(logits, *columns)
    assert compilation.COMPILER.failure is None
    assert torch.equal(got > 0, expected > 0)  # the same tokens survive the filters
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------- failure
def test_a_failing_compiler_warns_once_and_runs_eagerly(build_tiny_llm, monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("simulated C++ build failure\nsecond line")
        return run

    monkeypatch.setattr(compilation, "COMPILER", Compiler())  # the process's own record stays clean
    monkeypatch.setattr(torch, "compile", broken_compile)
    eager = build_tiny_llm(CONFIG)
    with pytest.warns(CompileFallbackWarning) as caught:
        compiled = build_tiny_llm({**CONFIG, "compile": True})
        second = build_tiny_llm({**CONFIG, "compile": True})
        batch = prompts(3)
        assert tokens(compiled, batch) == tokens(second, batch) == tokens(eager, batch)
    ours = [w for w in caught if issubclass(w.category, CompileFallbackWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert "RuntimeError: simulated C++ build failure" in message and "running eagerly" in message
    assert "second line" not in message
    for llm in (compiled, second):
        report = llm.engine.runner.compilation
        assert report.requested and not report.compiled and "simulated" in report.fallback_reason
        # the layers hold the compiled functions they were built with, and each now runs its eager function
        held = [vars(obj)[attr] for obj in compilable_objects(llm.engine.runner) for attr in type(obj).compilable]
        assert held and all(isinstance(fn, CompiledFunction) and fn.compiler.failure for fn in held)


def test_no_cpp_compiler_is_named_in_one_warning(build_tiny_llm, monkeypatch):
    monkeypatch.setattr(compilation, "COMPILER", Compiler())
    monkeypatch.setattr(compilation, "_cpp_compilers", lambda: ("no-such-c++",))
    assert "C++ compiler" in compiler_problem(torch.device("cpu"))
    with pytest.warns(CompileFallbackWarning, match=r"needs a C\+\+ compiler.*'no-such-c\+\+'") as caught:
        llm = build_tiny_llm({**CONFIG, "compile": True})
        tokens(llm, prompts(2))
    assert len([w for w in caught if issubclass(w.category, CompileFallbackWarning)]) == 1
    report = llm.engine.runner.compilation
    assert not report.compiled and report.seconds == 0.0 and "no-such-c++" in report.fallback_reason


def test_an_input_error_is_not_blamed_on_the_compiler(monkeypatch):
    compiler = Compiler()
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # "compiled" = eager: both raise
    bad = compiler.compiled(sampling_probs)
    rows = CPU_MIN_ROWS
    with pytest.raises(RuntimeError):  # columns of the wrong length
        bad(torch.zeros(rows, 5), torch.ones(3, 1), torch.ones(7, 1, dtype=torch.long), torch.ones(rows, 1),
            torch.zeros(rows, 1))
    assert compiler.failure is None


def test_sampler_columns_are_per_row_tensors():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1)]
    temperature, top_k, top_p, min_p = sampling_params_columns(torch.zeros(2, 4), params)
    assert temperature.tolist() == [[1.0], [0.5]]  # a greedy row is filtered at T=1 (it takes the argmax anyway)
    assert top_k.dtype == torch.long and top_k.tolist() == [[-1], [3]]
    assert top_p.tolist() == [[1.0], [pytest.approx(0.9)]] and min_p.tolist() == [[0.0], [pytest.approx(0.1)]]
    assert Sampler.probs_fn is sampling_probs


def test_small_inputs_run_eagerly_on_a_cpu():
    assert not runs_compiled(torch.zeros(CPU_MIN_ROWS - 1, 8)) and runs_compiled(torch.zeros(CPU_MIN_ROWS, 8))
    calls = []
    compiler = Compiler()
    function = compiler.compiled(lambda x: x + 1)
    function.compiled = lambda x: calls.append(len(x)) or x + 1
    function(torch.zeros(3)), function(torch.zeros(CPU_MIN_ROWS))
    assert calls == [CPU_MIN_ROWS]
