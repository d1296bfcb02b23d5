"""``compile_model`` (``backends.cpu_graph``): the CPU model compiled whole, one graph, eager's tokens.

By default (``compile_model=None``) a model whose layers fuse is compiled; ``enforce_eager=True``
is the way back, and the engines the tests compare against are built with it.

The tiny Llama compiles in seconds. The graph takes only token ids and positions (the
step's metadata is read by the attention operator at run time) and the number of tokens
is unbacked, so one graph serves every step: a decode token, a batch, a prefill chunk.
"""

from __future__ import annotations

import pytest
import torch

from nanoengine import SamplingParams
from nanoengine.backends import cpu_graph
from nanoengine.config import EngineConfig
from nanoengine.backends import compilation
from nanoengine.backends.compilation import CompileFallbackWarning, compiler_problem
import test_compile as compile_tests  # its helpers (tests/engine is on sys.path)
from test_compile import compiled_graphs, tokens

pytestmark = [pytest.mark.usefixtures("one_thread")]

CONFIG = dict(device="cpu", max_model_len=256, num_kv_blocks=1024, block_size=8, max_num_batched_tokens=64)
EAGER = {**CONFIG, "enforce_eager": True}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROBLEM = compiler_problem(torch.device("cpu"))
needs_compile = pytest.mark.skipif(PROBLEM is not None, reason=f"torch.compile cannot run here: {PROBLEM}")


def prompts(n: int, seed: int = 0, lengths: tuple[int, int] = (3, 90)) -> list[list[int]]:
    return compile_tests.prompts(n, seed, lengths)  # longer than a step's budget: chunked prefill too


# ------------------------------------------------------------------- config
@pytest.mark.parametrize("value", [1, "yes", "auto"])
def test_compile_model_must_be_none_or_a_bool(value):
    with pytest.raises(ValueError, match=rf"compile_model must be None \(the CPU backend decides\), True or False, "
                                         rf"got {value!r}"):
        EngineConfig(compile_model=value)


@pytest.mark.parametrize("options", [dict(enforce_eager=True), dict(compile=True), dict(tensor_parallel_size=2)])
def test_the_default_does_not_compile_eager_small_op_or_split_engines(options):
    assert EngineConfig(device="cpu", **options).compile_model is False


def test_the_default_is_left_to_the_cpu_backend():
    assert EngineConfig(device="cpu").compile_model is None


@pytest.mark.parametrize("other", ["compile", "enforce_eager"])
def test_compile_model_refuses_the_other_modes(other):
    with pytest.raises(ValueError, match=rf"cannot be combined with {other}=True.*choose one"):
        EngineConfig(device="cpu", compile_model=True, **{other: True})


def test_compile_model_with_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match=r"compile_model=True runs in one process only.*\(got 2\)"):
        EngineConfig(device="cpu", compile_model=True, tensor_parallel_size=2)


@needs_compile
def test_compiled_by_default_with_eager_bits_and_eager_on_request(build_tiny_llm):
    default, eager = build_tiny_llm(CONFIG), build_tiny_llm(EAGER)
    assert default.engine.runner.compilation.compiled and "compiled (whole model)" in default.engine.runner.backend.describe()
    for runner in (eager.engine.runner, build_tiny_llm({**CONFIG, "compile_model": False}).engine.runner):
        assert runner.backend.compiled_forward is None and not runner.compilation.requested
        assert "eager (one native call per decoder layer)" in runner.backend.describe()
    # every operator in the graph is eager's own: the logits are the same bits, not just close
    prompt = prompts(1, seed=5)[0]
    assert torch.equal(default.engine.next_token_logits(prompt), eager.engine.next_token_logits(prompt))
    batch = prompts(4, seed=6)
    assert tokens(default, batch) == tokens(eager, batch)


def test_a_model_whose_layers_do_not_fuse_stays_eager_by_default(build_tiny_llm, monkeypatch):
    from nanoengine.backends import cpu_fused

    monkeypatch.setattr(cpu_fused, "unfit_reason", lambda model, backend: "not fusable, for this test")
    runner = build_tiny_llm(CONFIG).engine.runner
    assert runner.backend.compiled_forward is None and not runner.compilation.requested


# ------------------------------------------------------------------ compiled
@pytest.mark.slow
@needs_compile
def test_one_graph_gives_eager_greedy_tokens_at_every_step_shape(build_tiny_llm):
    eager = build_tiny_llm(EAGER)
    before = compiled_graphs()
    compiled = build_tiny_llm({**CONFIG, "compile_model": True})
    report = compiled.engine.runner.compilation
    assert report.compiled and report.fallback_reason is None and report.seconds > 0, report
    assert report.ops == ("LlamaForCausalLM.forward",)
    assert "compiled (whole model) forward" in compiled.engine.runner.backend.describe()
    # at most one graph for a 67-token and a 1-token warm-up step (none where an engine built by
    # default, also compiled, had one for this model already)
    assert compiled_graphs() <= before + 1
    before = compiled_graphs()
    # one request alone (1-token decode steps), a batch of decodes, prompts longer than a step's
    # 64-token budget (chunked prefill beside decodes)
    for batch in (prompts(1, seed=1), prompts(5, seed=2), prompts(6, seed=3, lengths=(70, 140))):
        assert tokens(compiled, batch) == tokens(eager, batch)
    assert compiled_graphs() == before  # nothing compiled after the warm-up
    compiled.engine.check_invariants()


@pytest.mark.slow
@needs_compile
def test_seeded_sampling_and_logprobs_match_eager(build_tiny_llm):
    eager = build_tiny_llm(EAGER)
    compiled = build_tiny_llm({**CONFIG, "compile_model": True})
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=6, seed=7, logprobs=2)
    batch = prompts(3, seed=4)
    got, expected = compiled.generate(batch, params), eager.generate(batch, params)
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in expected]
    for a, b in zip(got, expected):
        assert len(a.logprobs) == len(b.logprobs) == 6
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert [t.token_id for t in step_a] == [t.token_id for t in step_b]
            assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(step_a, step_b))


@pytest.mark.slow
@needs_compile
def test_a_second_engine_of_the_same_model_reuses_the_graph(build_tiny_llm):
    build_tiny_llm({**CONFIG, "compile_model": True})
    before = compiled_graphs()
    second = build_tiny_llm({**CONFIG, "compile_model": True})
    assert second.engine.runner.compilation.compiled and compiled_graphs() == before
    tokens(second, prompts(2, seed=5))


# ------------------------------------------------------ the registered layers
@pytest.mark.slow
@needs_compile
def test_the_graph_calls_each_fused_layer_as_one_registered_operator(build_tiny_llm):
    before = compiled_graphs()
    compiled = build_tiny_llm({**CONFIG, "compile_model": True})
    backend = compiled.engine.runner.backend
    layers = compiled.engine.runner.model.model.layers
    assert backend.registered_model is not None and backend.fused_layers == len(layers)
    assert all(layer.forward.__func__ is cpu_graph.graph_layer_forward for layer in layers)
    graphed = []  # per step: whether it ran the compiled graph (every step of a request is fused)
    original = backend.compiled_forward

    def recording(model, ids, pos, meta):
        graphed.append(meta.fused)
        return original(model, ids, pos, meta)

    backend.compiled_forward = recording
    eager = build_tiny_llm(EAGER)
    batch = prompts(3, seed=8)
    assert tokens(compiled, batch) == tokens(eager, batch)
    assert graphed and all(graphed) and compiled_graphs() <= before + 1


@pytest.mark.slow
@needs_compile
def test_a_step_with_a_hook_runs_the_eager_layers_and_the_hook_sees_them(build_tiny_llm):
    compiled = build_tiny_llm({**CONFIG, "compile_model": True})
    eager = build_tiny_llm(EAGER)
    seen = []
    handle = compiled.engine.runner.model.model.layers[0].mlp.register_forward_hook(
        lambda module, args, out: seen.append(out.shape[0]))
    batch = prompts(2, seed=9)
    try:
        assert tokens(compiled, batch) == tokens(eager, batch)
    finally:
        handle.remove()
    # each token went through the hooked MLP once: the prompts' and all but the last generated
    assert sum(seen) == sum(len(p) for p in batch) + len(batch) * (GREEDY.max_tokens - 1)
    assert tokens(compiled, batch) == tokens(eager, batch)  # unhooked, compiled again


@pytest.mark.slow
@needs_compile
def test_models_whose_layers_do_not_fuse_compile_op_by_op(tiny_qwen3_dir):
    from nanoengine import LLM

    settings = dict(device="cpu", max_model_len=128, num_kv_blocks=64, block_size=8, dtype="float32")
    compiled = LLM(str(tiny_qwen3_dir), compile_model=True, **settings)
    backend = compiled.engine.runner.backend
    assert backend.unfused_reason is not None and backend.registered_model is None
    assert compiled.engine.runner.compilation.compiled
    assert all(isinstance(layer.impl, cpu_graph.GraphAttention)
               for layer in compiled.engine.runner.model.attention_layers())
    eager = LLM(str(tiny_qwen3_dir), **settings)
    batch = [[3, 4, 5, 6, 7], [8, 9]]
    assert tokens(compiled, batch) == tokens(eager, batch)


def test_the_registered_layers_refuse_a_forward_without_a_step():
    from nanoengine.kernels import cpu_native

    if not cpu_native.load():
        pytest.skip("the native kernels are not built here")
    hidden = torch.zeros(2, 8)
    cos = torch.ones(2, 1, 4)
    with pytest.raises(RuntimeError, match="this thread set no step"):
        torch.ops.nanoengine.registered_layer(hidden, None, cos, cos, 0)
    handle = torch.ops.nanoengine.registered_model_new()
    torch.ops.nanoengine.registered_model_free(handle)
    with pytest.raises(RuntimeError, match=f"no registered model has handle {handle}"):
        torch.ops.nanoengine.registered_model_set_step(
            handle, torch.zeros(2, dtype=torch.long), 0, torch.zeros(0, 1, dtype=torch.int32),
            torch.zeros(0, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), False)


@pytest.mark.slow
@needs_compile
def test_two_engines_registered_side_by_side_keep_their_own_layers(build_tiny_llm):
    first = build_tiny_llm({**CONFIG, "compile_model": True})
    second = build_tiny_llm({**CONFIG, "compile_model": True})  # the same graph, other weights and caches
    assert first.engine.runner.backend.registered_model.handle != second.engine.runner.backend.registered_model.handle
    eager = build_tiny_llm(EAGER)
    batch = prompts(2, seed=10)
    expected = tokens(eager, batch)
    assert tokens(first, batch) == tokens(second, batch) == expected
    # the second engine's plain weights changed (what the few-rows kernel of its decode steps reads; the
    # packed copies of its prefills are not): only its tokens may change
    with torch.no_grad():
        for p in second.engine.runner.model.parameters():
            p.mul_(1.5)
    assert tokens(first, batch) == expected
    assert tokens(second, batch) != expected


# ------------------------------------------------------------------- failure
def test_a_failing_compile_warns_once_and_runs_eagerly(build_tiny_llm, monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("simulated Inductor failure")
        return run

    monkeypatch.setattr(cpu_graph, "_WARNED", set())
    monkeypatch.setattr(torch, "compile", broken_compile)
    eager = build_tiny_llm(EAGER)
    with pytest.warns(CompileFallbackWarning) as caught:
        first = build_tiny_llm({**CONFIG, "compile_model": True})
        second = build_tiny_llm({**CONFIG, "compile_model": True})
    ours = [w for w in caught if issubclass(w.category, CompileFallbackWarning)]
    assert len(ours) == 1 and "RuntimeError: simulated Inductor failure" in str(ours[0].message)
    assert "runs eagerly" in str(ours[0].message)
    batch = prompts(3, seed=6)
    for llm in (first, second):
        runner = llm.engine.runner
        assert not runner.compilation.compiled and "simulated" in runner.compilation.fallback_reason
        assert runner.backend.compiled_forward is None
        # the layers have their eager kernels back
        assert all(layer.impl is runner.backend.attention for layer in llm.engine.runner.model.attention_layers())
        assert tokens(llm, batch) == tokens(eager, batch)


def test_no_cpp_compiler_is_named_and_the_engine_runs_eagerly(build_tiny_llm, monkeypatch):
    monkeypatch.setattr(cpu_graph, "_WARNED", set())
    monkeypatch.setattr(compilation, "_cpp_compilers", lambda: ("no-such-c++",))
    with pytest.warns(CompileFallbackWarning, match=r"needs a C\+\+ compiler.*'no-such-c\+\+'"):
        llm = build_tiny_llm({**CONFIG, "compile_model": True})
    report = llm.engine.runner.compilation
    assert not report.compiled and report.seconds == 0.0 and "no-such-c++" in report.fallback_reason
    tokens(llm, prompts(2))


def test_the_attention_operator_refuses_to_run_outside_a_step():
    q = torch.zeros(2, 4, 8)
    with pytest.raises(RuntimeError, match="outside a step"):
        torch.ops.nanoengine.cpu_attention(q, q[:, :2], q[:, :2], 0, 1.0)


# ------------------------------------------------------------------- the disk cache
def test_the_cache_folder_is_keyed_by_instruction_set_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOENGINE_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    wide = cpu_graph.cache_directory()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    narrow = cpu_graph.cache_directory()
    monkeypatch.setattr(cpu_graph, "_cpu_identity", lambda: "model name : another CPU")
    other_cpu = cpu_graph.cache_directory()
    assert len({wide, narrow, other_cpu}) == 3
    assert wide.parent == narrow.parent == tmp_path / "inductor"
    assert "avx512" in wide.name and "avx2" in narrow.name and torch.__version__.split("+")[0] in wide.name


def test_a_cache_folder_chosen_by_the_environment_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert cpu_graph.use_machine_cache() == tmp_path / "mine"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("NANOENGINE_CACHE", str(tmp_path))
    chosen = cpu_graph.use_machine_cache()
    assert chosen.is_dir() and chosen.parent == tmp_path / "inductor"
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(chosen)
