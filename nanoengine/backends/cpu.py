"""The CPU backend: every trick a CPU needs, in one room (chapter 10).

A GPU engine gets several things for free that a CPU engine must arrange itself. vLLM keeps its CPU tricks
in ``vllm/v1/attention/backends/cpu_attn.py`` and ``vllm/platforms/cpu.py``; this engine keeps them here,
each explained where it is made (what each bought: ``results/README.md``):

* GEMM weights prepacked once loaded in oneDNN's blocked layout (``CpuLinearMethod``, ``kernels.cpu_gemm``).
* Kernels of its own (``kernels.cpu_native``): up to ``cpu_native.MAX_ROWS`` rows of a product take the
  few-rows kernel, a fixed rule, not timed, so two engines built alike compute alike.
* Each decoder layer in one native call (``backends.cpu_fused``; ``enforce_eager=True``: the Python forward).
* Store-KV with no host synchronisation in the layers: whether a token has no slot (-1, a warm-up row) is
  decided once per step (``CpuAttentionMetadata.all_slots_stored``).
* The host's settings (``backends.cpu_platform``): freed memory kept, the weights moved into huge pages.
* Logits in chunks that come from the reused heap, each sampled before the next (``logits_rows_per_chunk``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from nanoengine.backends import cpu_fused
from nanoengine.backends.base import Backend
from nanoengine.backends.cpu_platform import (bytes_in_huge_page_regions, move_budget, move_to_huge_pages,
                                                tune_engine_process)
from nanoengine.kernels import cpu_gemm, cpu_native, reference
from nanoengine.layers.attention import AttentionImpl, AttentionMetadata
from nanoengine.layers.kernels import LayerKernels

LOGITS_CHUNK_BYTES = 30 * 1024 * 1024  # a chunk's logits: under glibc's 32 MiB mmap threshold (cpu_platform)


@dataclass
class CpuAttentionMetadata(AttentionMetadata):
    """``AttentionMetadata`` plus what the CPU kernels derive from it once per step."""

    all_slots_stored: bool = True  # every token of the step has a cache slot (no -1 in slot_mapping)

    @functools.cached_property
    def layer_step(self) -> tuple[list[torch.Tensor], int]:
        """The step's arguments of ``nanoengine::llama_layer`` from ``step`` on (its schema), gathered once a step."""
        return ([self.slot_mapping, self.decode_block_tables, self.decode_context_lens, self.prefill_block_tables,
                 self.prefill_cu_seqlens_q, self.prefill_context_lens], self.num_decode_tokens)


class CpuAttention(AttentionImpl):
    """Store-KV by row copy; decode and prefill by the native kernels where they are loaded and take the cache's
    dtype (``native``: a layer's whole step is then one ``nanoengine::paged_attention`` call), else by the
    reference kernels (``kernels.reference``)."""

    def __init__(self, native: bool = False) -> None:
        self.native = native

    @property
    def name(self) -> str:
        prefill = "native" if self.native else "reference"
        return f"cpu ({'native paged' if self.native else 'reference'} decode, {prefill} prefill)"

    def forward(self, q, k, v, k_cache, v_cache, meta: CpuAttentionMetadata, scale: float) -> torch.Tensor:
        if self.native and meta.all_slots_stored:  # ``AttentionImpl.forward``'s calls, made from C++
            return torch.ops.nanoengine.paged_attention(
                q, k, v, k_cache, v_cache, meta.slot_mapping, meta.num_decode_tokens, meta.decode_block_tables,
                meta.decode_context_lens, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                meta.prefill_context_lens, scale)
        return super().forward(q, k, v, k_cache, v_cache, meta, scale)

    def store_kv(self, key, value, k_cache, v_cache, meta: CpuAttentionMetadata) -> None:
        if not meta.all_slots_stored:  # a step with slot -1 rows: the reference skips them
            reference.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
            return
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)

    def decode(self, query, k_cache, v_cache, meta: CpuAttentionMetadata, scale: float) -> torch.Tensor:
        kernels = cpu_native if self.native else reference
        return kernels.paged_decode_attention(query, k_cache, v_cache, meta.decode_block_tables,
                                              meta.decode_context_lens, scale)

    def prefill(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kernels = cpu_native if self.native else reference  # the native one: the whole step in one call
        return kernels.paged_prefill_attention(query, k_cache, v_cache, meta.prefill_block_tables,
                                               meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale)


class CpuLinearMethod:
    """A linear layer's product on a CPU: few rows by the few-rows kernel (``few_rows``: the backend allows it
    for the model's dtype), more by oneDNN on the weight prepacked once loaded (``packed``; None where this
    build or dtype cannot pack: ``F.linear``)."""

    def __init__(self, few_rows: bool) -> None:
        self.few_rows = few_rows
        self.packed: torch.Tensor | None = None
        self.copy_bytes = 0

    def process_weights_after_loading(self, layer) -> None:
        """Pack the loaded weight: a copy (a tied LM head's too: it is the embedding's weight, packed apart)."""
        weight = layer.weight
        self.few_rows = self.few_rows and weight.device.type == "cpu" and weight.is_contiguous()
        self.packed = cpu_gemm.pack_weight(weight)
        self.copy_bytes = weight.numel() * weight.element_size() if self.packed is not None else 0

    @property
    def name(self) -> str:
        many = "oneDNN prepacked" if self.packed is not None else "F.linear"
        return f"few-rows kernel up to {cpu_native.MAX_ROWS} rows, then {many}" if self.few_rows else many

    def takes_few_rows(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``x`` goes to the few-rows kernel (else ``cpu_gemm.linear``): at most MAX_ROWS rows."""
        return self.few_rows and x.numel() <= cpu_native.MAX_ROWS * x.shape[-1] and x.dtype == weight.dtype

    def product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, the way this method computes it."""
        if self.takes_few_rows(x, weight):
            return cpu_native.few_rows_linear(x, weight, bias)
        return cpu_gemm.linear(x, weight, bias, self.packed)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.product(x, layer.weight, bias)


class CpuBackend(Backend):
    name = "cpu"
    weight_copies = "GEMM weights prepacked in oneDNN's blocked layout"

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32, fuse_layers: bool = True) -> None:
        super().__init__(device, dtype)
        tune_engine_process()  # the host's settings (backends.cpu_platform), before this process's first oneDNN product
        self.native_kernels = cpu_native.load()  # built once per machine, loaded once per process
        self.attention = CpuAttention(self.native_kernels and dtype in cpu_native.DTYPES)
        self.fused_layers = 0  # decoder layers that can run as one native call each (``backends.cpu_fused``)
        self.unfused_reason: str | None = None  # why they cannot, when they cannot
        self.fused_modules: tuple = ()  # the modules inside the fused layers (``cpu_fused.hooked``)
        self.fuse_layers = fuse_layers  # False (enforce_eager=True): every step runs the layers' Python forward
        self.huge_page_weight_bytes = 0  # weights in memory advised to use huge pages (``place_weights``)
        self.weight_bytes = 0  # all of the model's weights
        self.move_budget_s = move_budget()  # read (and checked) before any weight loads

    def describe(self) -> str:
        gemm = f"few-rows kernel up to {cpu_native.MAX_ROWS} rows, then oneDNN" if self.native_kernels else "oneDNN"
        pages = ("" if not self.huge_page_weight_bytes else ", weights in huge pages"
                 if self.huge_page_weight_bytes == self.weight_bytes
                 else f", {self.huge_page_weight_bytes / self.weight_bytes:.0%} of the weights in huge pages")
        return f"{super().describe()}, {gemm} GEMMs{pages}"

    def layer_kernels(self) -> LayerKernels:
        """The native kernels where they are loaded and take the model's dtype; else the layers' own functions."""
        native = self.attention.native  # decided with the attention's: the kernels are loaded and take the dtype
        ops = dict(rms_norm=cpu_native.rms_norm, add_rms_norm=cpu_native.add_rms_norm,
                   rotate_half=cpu_native.rotate_half, silu_and_mul=cpu_native.silu_and_mul,
                   decoder_layer=cpu_fused.one_call) if native else {}
        return LayerKernels(name=f"cpu, {'native kernels' if native else 'PyTorch libraries'}",
                            linear_method=functools.partial(CpuLinearMethod, few_rows=native),
                            attention=self.attention, **ops)

    def place_weights(self, model: torch.nn.Module) -> None:
        """Move the just-built parameters into huge pages (within the move's budget), before they are filled."""
        move_to_huge_pages(list(model.parameters()), budget_s=self.move_budget_s)

    def process_weights_after_loading(self, model: torch.nn.Module) -> None:
        """Pack every GEMM weight (the linear methods); count the weights and those in huge pages."""
        super().process_weights_after_loading(model)
        params = {id(p): p for p in model.parameters()}.values()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in params)
        self.huge_page_weight_bytes = bytes_in_huge_page_regions(params)

    def prepare_forward(self, runner) -> None:
        """Each decoder layer one native call where it can be (``backends.cpu_fused``)."""
        layers = getattr(getattr(runner.model, "model", None), "layers", ())
        fused = [layer for layer in layers if getattr(layer, "one_call", None) is not None]
        self.fused_layers = len(fused)
        if layers and not fused:
            self.unfused_reason = cpu_fused.unfit_reason(layers[0]) or "the model was built without the native kernels"
        # every module a fused layer stands in for: a step with a hook on one of them is not fused
        self.fused_modules = tuple(m for layer in fused for m in layer.modules())

    def forward_mode(self) -> str:
        if self.fused_layers and self.fuse_layers:
            return "eager (one native call per decoder layer)"
        return super().forward_mode()

    def build_metadata(self, plan) -> CpuAttentionMetadata:
        fields = self._metadata_fields(plan)
        slots = plan.slot_mapping
        all_stored = bool((slots >= 0).all()) if isinstance(slots, torch.Tensor) else min(slots, default=0) >= 0
        one_call = (self.fuse_layers and self.fused_layers > 0 and all_stored
                    and not cpu_fused.hooked(self.fused_modules))  # a hook must see the layers run
        return CpuAttentionMetadata(**fields, all_slots_stored=all_stored, one_call_layers=one_call)

    def logits_rows_per_chunk(self, num_rows: int, vocab_size: int, hidden_size: int) -> int:
        """How many rows of logits one LM-head call computes: at most ``LOGITS_CHUNK_BYTES`` of float32 logits,
        and at most the hidden size, so a call writes no more values than the head's weight holds. Small heads
        get small chunks that stay in cache for the sampler; a big head is not streamed again every few rows."""
        by_bytes = LOGITS_CHUNK_BYTES // (4 * vocab_size)
        return max(1, min(num_rows, hidden_size, by_bytes))
