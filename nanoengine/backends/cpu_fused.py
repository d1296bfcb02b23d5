"""A step's decoder layers, one call each (the CPU backend; chapter 10).

Run from Python, a decode step spends what the GEMMs leave almost all in operator calls, about 25 per layer.
GPU engines hide this behind CUDA graphs, vLLM's CPU backend behind ``torch.compile`` (why this engine does not
compile its model whole: results/README.md, engine v4's choice of one CPU fast path).

So each ``LlamaDecoderLayer`` runs as one C++ operator, ``nanoengine::llama_layer`` (``kernels/csrc/llama_layer.cpp``),
which makes the operator calls the layer's Python ``forward`` makes on a CPU, in the same order, so the hidden
states are the Python forward's, bit for bit (tests/engine/test_cpu_fused.py). Each layer makes this one call
(its ``one_call``, from the CPU backend's kernels) except on a step where a forward hook would see it
(``hooked``) or that has a token without a cache slot; ``unfit_reason`` names the models this does not cover.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from nanoengine.kernels import cpu_native

if TYPE_CHECKING:
    from nanoengine.backends.cpu import CpuAttentionMetadata


class FusedLayer:
    """A ``LlamaDecoderLayer``'s step as one native call: the layer's ``one_call``, run on the steps the backend fuses.

    Made in the layer's constructor, before its weights are loaded: the weights, their packed copies and the
    layer's KV cache are read at the first call and kept (final once the runner has processed and bound them).
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer

    @functools.cached_property
    def arguments(self) -> tuple:
        """The layer's arguments of ``nanoengine::llama_layer``, ``weights`` to ``scale``, read at its first call."""
        layer, attn = self.layer, self.layer.self_attn
        linears = linear_layers(layer)
        weights = [*(m.weight for m in linears), layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        return (weights, [m.linear_method.packed for m in linears], attn.qkv_proj.bias, attn.attn.k_cache,
                attn.attn.v_cache, layer.input_layernorm.eps, cpu_native.MAX_ROWS, attn.attn.scale)

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None, meta: CpuAttentionMetadata,
                 rotary_rows: tuple[torch.Tensor, torch.Tensor]):
        return torch.ops.nanoengine.llama_layer(hidden, residual, *self.arguments, *rotary_rows, *meta.layer_step)


def unfit_reason(layer: torch.nn.Module) -> str | None:
    """Why this just-built decoder layer cannot run as one call, or None when it can."""
    from nanoengine.backends.cpu import CpuLinearMethod
    from nanoengine.models.llama import LlamaDecoderLayer

    if type(layer) is not LlamaDecoderLayer:
        return f"{type(layer).__name__} is not a plain LlamaDecoderLayer"
    if layer.self_attn.o_proj.tp.size != 1:
        return "tensor parallelism (each layer's output is all-reduced between ranks)"
    if hasattr(layer.self_attn, "q_norm"):
        return "per-head query and key norms (Qwen3)"
    if layer.self_attn.o_proj.bias is not None:
        return "a bias on o_proj"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(norm.norm_fn is cpu_native.rms_norm and norm.add_norm_fn is cpu_native.add_rms_norm for norm in norms):
        return "a norm without the native kernel (its dtype)"
    if not all(isinstance(m.linear_method, CpuLinearMethod) and m.linear_method.few_rows for m in linear_layers(layer)):
        return "a linear layer without the few-rows kernel"
    if not getattr(layer.self_attn.attn.impl, "native", False):
        return "attention without the native kernels (the KV cache's dtype)"
    return None


def one_call(layer: torch.nn.Module) -> FusedLayer | None:
    """``LayerKernels.decoder_layer`` on a CPU: the layer's one call, or None where it does not fit."""
    return FusedLayer(layer) if unfit_reason(layer) is None else None


def hooked(modules: tuple[torch.nn.Module, ...]) -> bool:
    """Whether a forward hook would see any of ``modules`` run: one of theirs, or a global one."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def linear_layers(layer: torch.nn.Module) -> tuple:
    """A decoder layer's four GEMM layers, in the order the operator takes them."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
