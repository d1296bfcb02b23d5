"""Prepacked CPU GEMM weights (nanoengine.kernels.cpu_gemm) give F.linear's results."""

import pytest
import torch
import torch.nn.functional as F

from nanoengine.backends.cpu import CpuBackend, CpuLinearMethod
from nanoengine.kernels import cpu_gemm
from nanoengine.layers.linear import UnquantizedLinearMethod
from nanoengine.layers.embed_head import ParallelLMHead
from nanoengine.layers.kernels import building_with
from nanoengine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

needs_packing = pytest.mark.skipif(not cpu_gemm.packing_available(), reason="this torch build has no oneDNN packing")


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 40, generator=gen)
    packed = cpu_gemm.pack_weight(weight)
    assert packed is not None
    torch.testing.assert_close(cpu_gemm.linear(x, weight, bias, packed), F.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_gemm.packing_available(torch.bfloat16),
                    reason="oneDNN has no bfloat16 packing on this CPU")
@pytest.mark.parametrize("rows", [1, 32])
def test_bfloat16_weights_pack_and_give_f_linear_results(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen).bfloat16()
    x = torch.randn(rows, 40, generator=gen).bfloat16()
    packed = cpu_gemm.pack_weight(weight)
    assert packed is not None
    # Both round once to bfloat16 from a float32 accumulation; summation order may differ.
    torch.testing.assert_close(cpu_gemm.packed_linear(x, packed, 96), F.linear(x, weight), rtol=1.6e-2, atol=1e-2)


@needs_packing
def test_packed_linear_keeps_leading_dims_and_empty_inputs():
    weight = torch.randn(12, 8)
    packed = cpu_gemm.pack_weight(weight)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(cpu_gemm.linear(x, weight, None, packed), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert cpu_gemm.linear(torch.randn(0, 8), weight, None, packed).shape == (0, 12)
    non_contiguous = torch.randn(8, 5).t()  # (5, 8) with strides (1, 5)
    torch.testing.assert_close(cpu_gemm.linear(non_contiguous, weight, None, packed), F.linear(non_contiguous, weight),
                               rtol=1e-5, atol=1e-5)


def test_pack_weight_declines_what_it_cannot_pack():
    assert cpu_gemm.pack_weight(torch.randn(4, 4, dtype=torch.float16)) is None
    assert not cpu_gemm.packing_available(torch.float16)
    assert cpu_gemm.pack_weight(torch.randn(4)) is None
    # No packed copy: plain F.linear, also when the input dtype differs from a packed weight's.
    weight = torch.randn(3, 4)
    x = torch.randn(2, 4)
    torch.testing.assert_close(cpu_gemm.linear(x, weight), F.linear(x, weight))


@needs_packing
def test_parallel_layers_pack_and_compute_the_same():
    torch.manual_seed(0)
    backend = CpuBackend("cpu")
    makers = [lambda: QKVParallelLinear(16, 4, 4, 2, bias=True), lambda: MergedColumnParallelLinear(16, [24, 24]),
              lambda: RowParallelLinear(16, 10, bias=True), lambda: ParallelLMHead(50, 16)]
    for make in makers:
        plain = make()  # built outside a backend: F.linear
        with building_with(backend.kernels):  # as loader.build_model builds a model for the CPU
            packed = make()
        for p, q in zip(plain.parameters(), packed.parameters()):
            q.data.copy_(p.data.normal_())
        assert isinstance(plain.linear_method, UnquantizedLinearMethod)
        assert isinstance(packed.linear_method, CpuLinearMethod) and packed.linear_method.packed is None
        backend.process_weights_after_loading(packed)  # what the model runner does once the weights are loaded
        assert packed.linear_method.packed is not None
        x = torch.randn(5, 16)
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)


@needs_packing
def test_engine_packs_every_gemm_weight_and_generates_what_plain_weights_do(tiny_llama_dir, monkeypatch):
    from nanoengine import LLM, SamplingParams

    prompts = [[5, 9, 200, 31, 7], list(range(40, 90)), [3] * 17]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    packed = LLM(tiny_llama_dir, device="cpu", num_kv_blocks=64)
    layers = packed.engine.model_config.num_hidden_layers
    assert packed.engine.runner.backend.num_prepared_weights == 4 * layers + 1  # qkv, o, gate_up, down per layer + LM head
    packed_logits = packed.engine.next_token_logits(prompts[1])
    packed_tokens = [o.token_ids for o in packed.generate(prompts, params)]

    monkeypatch.setattr(cpu_gemm, "pack_weight", lambda weight: None)
    plain = LLM(tiny_llama_dir, device="cpu", num_kv_blocks=64)
    assert plain.engine.runner.backend.num_prepared_weights == 0
    torch.testing.assert_close(packed_logits, plain.engine.next_token_logits(prompts[1]), rtol=1e-4, atol=1e-4)
    assert packed_tokens == [o.token_ids for o in plain.generate(prompts, params)]
