"""Layers take their kernels when they are built (``layers.kernels``): nothing rewires a model after load."""

from __future__ import annotations

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.backends import Backend
from nanoengine.layers.kernels import REFERENCE, LayerKernels, building_with, current_kernels
from nanoengine.loader import weights

# What the model runner may set on a module once the model is built: each attention layer's share
# of the KV cache (vLLM's runner binds its caches the same way).
BOUND_BY_THE_RUNNER = {"k_cache", "v_cache"}


def snapshot(model: torch.nn.Module) -> dict:
    """Every module's attributes (by identity) and every parameter's storage, as they are now."""
    state = {}
    for name, module in model.named_modules():
        attributes = {key: id(value) for key, value in vars(module).items()
                      if key not in BOUND_BY_THE_RUNNER and not key.startswith("_")}
        children = {key: id(child) for key, child in module._modules.items()}
        params = {key: (id(p), p.data_ptr(), p.dtype) for key, p in module._parameters.items() if p is not None}
        state[name] = (type(module), attributes, children, params)
    return state


@pytest.mark.parametrize("options", [{}, {"enforce_eager": True}, {"dtype": "bfloat16"}], ids=str)
def test_no_module_attribute_or_parameter_changes_after_the_model_is_built(tiny_llama_tok_dir, monkeypatch, options):
    built = {}
    build = weights.build_model

    def build_and_remember(*args, **kwargs):
        model = build(*args, **kwargs)
        built["model"], built["state"] = model, snapshot(model)
        return model

    monkeypatch.setattr(weights, "build_model", build_and_remember)
    llm = LLM(str(tiny_llama_tok_dir), device="cpu", num_kv_blocks=64, max_model_len=128, **options)
    llm.generate([list(range(5, 40)), [3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    model = built["model"]
    assert model is llm.engine.runner.model
    assert snapshot(model) == built["state"]  # weights loaded, packed, cache bound, steps run: nothing reassigned
    assert all("forward" not in vars(m) for m in model.modules())  # every module runs its class's forward
    assert all(layer.k_cache is not None for layer in model.attention_layers())


def test_the_layers_hold_the_kernels_of_the_backend_they_were_built_for(tiny_llama_tok_dir):
    llm = LLM(str(tiny_llama_tok_dir), device="cpu", num_kv_blocks=64, max_model_len=128)
    model, backend = llm.engine.runner.model, llm.engine.runner.backend
    kernels = backend.kernels
    assert model.kernels is kernels
    layer = model.model.layers[0]
    assert layer.input_layernorm.norm_fn is (kernels.rms_norm or type(layer.input_layernorm).norm_fn)
    assert layer.self_attn.rotary_emb.rotate_fn is (kernels.rotate_half or type(layer.self_attn.rotary_emb).rotate_fn)
    assert layer.self_attn.attn.impl is kernels.attention is backend.attention
    assert type(layer.self_attn.qkv_proj.linear_method).__name__ == "CpuLinearMethod"
    methods = [m.linear_method for m in model.modules() if hasattr(m, "linear_method")]
    assert len({id(m) for m in methods}) == len(methods)  # one method per layer: each keeps its own packed weight


def test_outside_a_backend_the_layers_run_their_own_pytorch_functions():
    from nanoengine.layers.layernorm import RMSNorm, rms_norm
    from nanoengine.layers.linear import ColumnParallelLinear, UnquantizedLinearMethod

    assert current_kernels() is REFERENCE
    assert RMSNorm(8).norm_fn is rms_norm
    assert isinstance(ColumnParallelLinear(4, 4).linear_method, UnquantizedLinearMethod)
    marker = LayerKernels(name="marker", rms_norm=lambda x, w, eps: x)
    with building_with(marker):
        assert current_kernels() is marker and RMSNorm(8).norm_fn is marker.rms_norm
        with building_with(REFERENCE):  # nested builds take the innermost kernels
            assert RMSNorm(8).norm_fn is rms_norm
    assert current_kernels() is REFERENCE


def test_a_model_built_for_one_backend_is_refused_by_another_before_anything_is_bound():
    from nanoengine.engine.model_runner import ModelRunner

    net = weights.random_model("tiny-llama", backend=Backend("cpu"))  # the reference kernels
    assert net.kernels.name == "reference"
    with pytest.raises(ValueError, match="built with the 'reference' kernels and this engine's backend runs 'cpu"):
        ModelRunner(net, net.config, 16, 4, torch.device("cpu"), torch.float32)
    assert all(layer.k_cache is None for layer in net.attention_layers())


def test_each_thread_builds_with_its_own_kernels():
    import threading

    from nanoengine.layers.layernorm import RMSNorm, rms_norm

    marker = LayerKernels(name="marker", rms_norm=lambda x, w, eps: x)
    seen = {}
    with building_with(marker):
        worker = threading.Thread(target=lambda: seen.setdefault("norm_fn", RMSNorm(8).norm_fn))
        worker.start()
        worker.join()
        assert RMSNorm(8).norm_fn is marker.rms_norm
    assert seen["norm_fn"] is rms_norm  # another thread, building nothing: the reference
