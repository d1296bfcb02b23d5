"""Decoder layers fused on decode steps (``backends.cpu_fused``): eager's bits, only where it fits."""

from __future__ import annotations

import contextlib

import pytest
import torch

from nanoengine import SamplingParams
from nanoengine.backends import cpu_fused
from nanoengine.backends.cpu import CpuBackend
from nanoengine.engine.model_runner import BatchPlan
from nanoengine.kernels import cpu_native
from test_compile import prompts

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(cpu_native.unavailable_reason() is not None or not cpu_native.load(),
                                 reason="the native kernels cannot be built on this machine")]

CONFIG = dict(device="cpu", max_model_len=256, num_kv_blocks=512, block_size=8, max_num_batched_tokens=64)


def outputs(llm, batch, params) -> list:
    """Each request's tokens and logprobs (the logprobs carry the logits' bits)."""
    llm.engine.reset_prefix_cache()
    return [(list(o.outputs[0].token_ids), repr(o.outputs[0].logprobs)) for o in llm.generate(batch, params)]


@contextlib.contextmanager
def unfused(backend: CpuBackend):
    """Run the next steps with the layers' Python forward (the eager path), on the same engine."""
    backend.fuse_decode = False
    try:
        yield
    finally:
        backend.fuse_decode = True


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


def test_bfloat16_steps_match_eager_too(build_tiny_llm, tiny_llama_tok_dir):
    from nanoengine import LLM

    llm = LLM(str(tiny_llama_tok_dir), dtype="bfloat16", **CONFIG)
    backend = llm.engine.runner.backend
    assert backend.fused_layers == 2
    batch, params = prompts(4, seed=7), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    fused = outputs(llm, batch, params)
    with unfused(backend):
        assert outputs(llm, batch, params) == fused


def test_only_steps_of_decodes_with_slots_are_fused(build_tiny_llm):
    llm = build_tiny_llm(CONFIG)
    engine, backend = llm.engine, llm.engine.runner.backend
    seen = []
    build = backend.build_metadata
    backend.build_metadata = lambda plan: seen.append(build(plan)) or seen[-1]
    def run() -> list[bool]:
        seen.clear()
        engine.add_request(list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        return [m.fused_decode for m in seen]

    assert run() == [False, True, True]  # the prefill, then two decode steps
    with unfused(backend):
        assert run() == [False, False, False]  # what the bit-for-bit comparisons run as "eager"
    assert not build(BatchPlan.dummy(2)).fused_decode  # a warm-up step: its tokens have no slot


def test_the_layers_keep_their_python_forward_where_fusing_does_not_fit(build_tiny_llm, tiny_qwen3_dir):
    from nanoengine import LLM

    compiled = build_tiny_llm({**CONFIG, "compile": True}).engine.runner.backend
    assert compiled.fused_layers == 0  # compile=True puts its own compiled ops in the layers
    qwen3 = LLM(str(tiny_qwen3_dir), **CONFIG).engine.runner.backend
    assert qwen3.fused_layers == 0 and qwen3.unfused_reason == "per-head query and key norms (Qwen3)"


def test_the_reason_names_what_is_missing(build_tiny_llm):
    runner = build_tiny_llm(CONFIG).engine.runner
    backend = runner.backend
    backend.native_kernels = False
    try:
        assert "native kernels are not loaded" in cpu_fused.unfit_reason(runner.model, backend)
    finally:
        backend.native_kernels = True


def test_the_operator_refuses_a_step_that_is_not_all_decodes():
    hidden = torch.randn(2, 8)
    caches = torch.zeros(2, 4, 4, 1, 4)
    with pytest.raises(RuntimeError, match="one block-table row per token"):
        torch.ops.nanoengine.llama_decode_layer(
            hidden, None, torch.ones(8), torch.ones(8), 1e-5, torch.randn(16, 8), None, None, torch.randn(8, 8), None,
            torch.randn(32, 8), None, torch.randn(8, 16), None, 8, torch.ones(2, 1, 4), torch.zeros(2, 1, 4),
            caches[0], caches[1], torch.tensor([0, 1]), torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 2, 1, 0.5)
    assert not caches.any()  # nothing was written before the check
