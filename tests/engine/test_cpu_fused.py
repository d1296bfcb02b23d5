"""Decoder layers as one native call each (``backends.cpu_fused``): eager's bits, only where it fits."""

from __future__ import annotations

import contextlib
from typing import Callable

import pytest
import torch

from nanoengine import SamplingParams
from nanoengine.backends import cpu_fused
from nanoengine.backends.cpu import CpuAttentionMetadata, CpuBackend
from nanoengine.engine.model_runner import BatchPlan
from nanoengine.kernels import cpu_native
from test_compile import prompts

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(cpu_native.unavailable_reason() is not None or not cpu_native.load(),
                                 reason="the native kernels cannot be built on this machine")]

# The default: each decoder layer one native call (enforce_eager=True: the layers' Python forward).
CONFIG = dict(device="cpu", max_model_len=256, num_kv_blocks=512, block_size=8, max_num_batched_tokens=64)


def outputs(llm, batch, params) -> list:
    """Each request's tokens and logprobs (the logprobs carry the logits' bits)."""
    llm.engine.reset_prefix_cache()
    return [(list(o.outputs[0].token_ids), repr(o.outputs[0].logprobs)) for o in llm.generate(batch, params)]


@contextlib.contextmanager
def unfused(backend: CpuBackend):
    """Run the next steps with the layers' Python forward (the eager path), on the same engine."""
    backend.fuse_layers = False
    try:
        yield
    finally:
        backend.fuse_layers = True


def record_metadata(backend: CpuBackend) -> tuple[list, Callable]:
    """Keep every step's metadata the backend builds from now on: (that list, the original builder)."""
    seen, build = [], backend.build_metadata
    backend.build_metadata = lambda plan: seen.append(build(plan)) or seen[-1]
    return seen, build


def test_every_layer_is_fused_by_default(build_tiny_llm):
    backend = build_tiny_llm(CONFIG).engine.runner.backend
    assert backend.fused_layers == 2 and backend.unfused_reason is None  # the tiny Llama has 2 layers
    assert "one native call per decoder layer" in backend.describe()
    with unfused(backend):
        assert "native call" not in backend.describe()


@pytest.mark.parametrize("num_requests", [1, 3, 12])  # 12: more rows than the few-rows kernel takes (oneDNN)
def test_fused_steps_give_eager_tokens_and_logprobs_bit_for_bit(build_tiny_llm, num_requests):
    llm = build_tiny_llm(CONFIG)
    backend = llm.engine.runner.backend
    batch = prompts(num_requests, seed=num_requests, lengths=(3, 90))  # chunked prefill, then decodes
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    fused = outputs(llm, batch, params)
    with unfused(backend):
        eager = outputs(llm, batch, params)
    assert fused == eager


def test_bfloat16_steps_match_eager_too(tiny_llama_tok_dir):
    from nanoengine import LLM

    llm = LLM(str(tiny_llama_tok_dir), dtype="bfloat16", **CONFIG)
    backend = llm.engine.runner.backend
    assert backend.fused_layers == 2
    batch = prompts(4, seed=7, lengths=(3, 90))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    fused = outputs(llm, batch, params)
    with unfused(backend):
        assert outputs(llm, batch, params) == fused


def test_every_step_whose_tokens_have_slots_is_fused(build_tiny_llm):
    llm = build_tiny_llm(CONFIG)
    engine, backend = llm.engine, llm.engine.runner.backend
    seen, build = record_metadata(backend)
    def run() -> list[tuple[int, int, bool]]:
        seen.clear()
        engine.add_request(list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        engine.step()  # the first prompt's prefill
        engine.add_request(list(range(5, 30)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        return [(m.num_decode_tokens, m.num_prefills, m.one_call_layers) for m in seen]

    # a prefill, a decode beside the second prompt's prefill, a decode
    assert run() == [(0, 1, True), (1, 1, True), (1, 0, True)]
    with unfused(backend):
        assert [fused for *_, fused in run()] == [False] * 3  # what the bit-for-bit comparisons run as "eager"
    assert not build(BatchPlan.dummy(2)).one_call_layers  # a warm-up step: its tokens have no slot


def test_enforce_eager_runs_the_python_forward_with_the_same_bits(build_tiny_llm):
    """The CPU's two forward modes: one native call per layer (the default) and the layers' Python
    forward (``enforce_eager=True``); the same tokens and logits, not just close ones."""
    default, eager = build_tiny_llm(CONFIG), build_tiny_llm({**CONFIG, "enforce_eager": True})
    assert default.engine.forward_mode == "eager (one native call per decoder layer)"
    assert eager.engine.forward_mode == "eager" and not eager.engine.runner.backend.fuse_layers
    assert not default.engine.runner.compilation.requested and not eager.engine.runner.compilation.requested
    prompt = list(range(3, 40))
    assert torch.equal(default.engine.next_token_logits(prompt), eager.engine.next_token_logits(prompt))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batch = [list(range(5, 5 + n)) for n in (3, 20, 70)]  # 70: longer than a step's budget, chunked
    assert ([o.outputs[0].token_ids for o in default.generate(batch, params)]
            == [o.outputs[0].token_ids for o in eager.generate(batch, params)])


def test_the_model_compiled_whole_is_no_longer_an_option():
    from nanoengine.config import EngineConfig

    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['compile_model'\]"):
        EngineConfig.from_kwargs(compile_model=True)


def test_the_layers_keep_their_python_forward_where_fusing_does_not_fit(build_tiny_llm, tiny_qwen3_dir):
    from nanoengine import LLM

    qwen3 = LLM(str(tiny_qwen3_dir), **CONFIG).engine.runner.backend
    assert qwen3.fused_layers == 0 and qwen3.unfused_reason == "per-head query and key norms (Qwen3)"


def test_a_layer_gets_its_one_call_when_it_is_built_and_the_reason_names_what_is_missing():
    from nanoengine.backends import Backend
    from nanoengine.loader.weights import random_model

    native = random_model("tiny-llama")  # the CPU backend's kernels
    assert all(isinstance(layer.one_call, cpu_fused.FusedLayer) for layer in native.model.layers)
    reference = random_model("tiny-llama", backend=Backend("cpu"))
    assert all(layer.one_call is None for layer in reference.model.layers)
    assert cpu_fused.unfit_reason(reference.model.layers[0]) == "a norm without the native kernel (its dtype)"


def layer_call(tokens: int, num_decode_tokens: int, decode_rows: int, prefill_bounds: list[int],
               num_prefills: int | None = None, caches=None):
    """torch.ops.nanoengine.llama_layer on a made-up 8-wide layer (2 heads of 4, 1 KV head) and step;
    ``num_prefills`` chunks' context lengths (default: one per pair of bounds)."""
    num_prefills = len(prefill_bounds) - 1 if num_prefills is None else num_prefills
    step = CpuAttentionMetadata(
        torch.arange(tokens), num_decode_tokens, torch.zeros(decode_rows, 1, dtype=torch.int32),
        torch.full((decode_rows,), 1, dtype=torch.int32), torch.zeros(num_prefills, 1, dtype=torch.int32),
        torch.tensor(prefill_bounds, dtype=torch.int32), torch.full((num_prefills,), 4, dtype=torch.int32))
    weights = [torch.randn(16, 8), torch.randn(8, 8), torch.randn(32, 8), torch.randn(8, 16)] + [torch.ones(8)] * 2
    return torch.ops.nanoengine.llama_layer(torch.randn(tokens, 8), None, weights, [None] * 4, None, *caches, 1e-5, 8,
                                            0.5, torch.ones(tokens, 1, 4), torch.zeros(tokens, 1, 4), *step.layer_step)


@pytest.mark.parametrize("step, message", [
    ((2, 1, 1, [0]), "1 decode tokens and prefill chunks from 0 to 0 do not make the step's 2 tokens"),
    ((2, 1, 2, [0]), "one decode block-table row for each of the first 1 of 2 tokens"),
    ((3, 1, 1, [0, 1]), "1 decode tokens and prefill chunks from 0 to 1 do not make the step's 3 tokens"),
    ((3, 1, 1, [1, 2]), "1 decode tokens and prefill chunks from 1 to 2 do not make the step's 3 tokens"),
    ((3, 1, 1, [0, 2], 2), r"prefill_cu_seqlens_q \(2 prefills \+ 1,\)"),  # two chunks' lengths, one boundary
])
def test_the_operator_refuses_a_step_whose_parts_do_not_add_up(step, message):
    caches = torch.zeros(2, 4, 4, 1, 4)
    with pytest.raises(RuntimeError, match=message):
        layer_call(*step, caches=caches)
    assert not caches.any()  # nothing was written before the check


def test_the_operator_runs_decodes_and_prefill_chunks_in_one_step():
    caches = torch.zeros(2, 4, 4, 1, 4)
    out, stream = layer_call(3, 1, 1, [0, 2], caches=caches)  # one decode, then a 2-token chunk
    assert out.shape == stream.shape == (3, 8) and out.isfinite().all()
    assert caches[:, 0, :3].any() and not caches[:, 0, 3:].any()  # the step's three slots were written


def test_a_step_with_a_forward_hook_runs_the_python_forward_so_the_hook_sees_every_layer(build_tiny_llm):
    llm = build_tiny_llm(CONFIG)
    engine, backend = llm.engine, llm.engine.runner.backend
    seen, _ = record_metadata(backend)
    calls = []
    layers = engine.runner.model.model.layers
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    fused = outputs(llm, prompts(2, seed=3), params)
    assert seen and all(m.one_call_layers for m in seen)
    for hook_on in (layers[1].self_attn.attn, layers[0].mlp):
        seen.clear()
        handle = hook_on.register_forward_pre_hook(lambda module, args: calls.append(module))
        try:
            assert outputs(llm, prompts(2, seed=3), params) == fused  # the same bits either way
        finally:
            handle.remove()
        assert seen and not any(m.one_call_layers for m in seen)
        assert calls.count(hook_on) == len(seen)  # once a step: a prefill and each decode
        calls.clear()
    seen.clear()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)  # a global hook too
    try:
        outputs(llm, prompts(1, seed=3), params)
    finally:
        handle.remove()
    assert seen and not any(m.one_call_layers for m in seen)
