"""A device backend: how a step runs on one kind of hardware, chosen once (chapter 10).

The scheduler, block manager, model runner and layers are the same on every device; how a step's work is done
is not. vLLM keeps those decisions in an attention backend with its metadata builder
(``vllm/v1/attention/backends/``) and a platform (``vllm/platforms/``); this engine keeps them in one
``Backend`` per engine (``backends.select_backend``): the step's attention metadata, the layers' kernels, where
the weights live and how each GEMM layer prepares them, how the forward runs, and how many rows of logits the
LM head computes at once. This base class is the readable default (the layers' own functions, the reference
attention, ``F.linear``, an eager forward, logits in one piece): it runs on any device and is what the tests
compare the tuned backends with.
"""

from __future__ import annotations

import functools

import torch

from nanoengine.layers.attention import AttentionImpl, AttentionMetadata, ReferenceAttention
from nanoengine.layers.kernels import LayerKernels


def ints(values, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A list or CPU tensor of integers as a tensor of ``dtype`` on ``device``."""
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=dtype)
    return torch.tensor(values, dtype=dtype, device=device)


def block_table_tensor(tables, device: torch.device) -> torch.Tensor:
    """(num_seqs, max_blocks) int32 on ``device``; from lists, rows are padded with -1 (never read by the kernels)."""
    if isinstance(tables, torch.Tensor):
        return tables.to(device=device, dtype=torch.int32)
    width = max((len(t) for t in tables), default=0)
    rows = [t + [-1] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(tables), width)


class Backend:
    """The reference backend, and the interface every device backend implements."""

    name = "reference"
    weight_copies = ""  # what the linear methods copy the weights into, for the memory report ("": nothing)

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.device = torch.device(device)
        self.dtype = dtype  # of the weights, the activations and the KV cache
        self.attention: AttentionImpl = ReferenceAttention()
        self.weight_copy_bytes = 0  # bytes of weight copies made by the linear methods
        self.num_prepared_weights = 0  # linear layers whose method made a copy

    @functools.cached_property
    def kernels(self) -> LayerKernels:
        """What the layers of a model built for this backend call (``layer_kernels()``, made once)."""
        return self.layer_kernels()

    def layer_kernels(self) -> LayerKernels:
        """This device's kernels for the layers (the reference: their own functions, this backend's attention)."""
        return LayerKernels(name=self.name, attention=self.attention)

    def describe(self) -> str:
        """One line for a reader: the backend, its attention kernels, how the forward runs."""
        return f"{self.name} backend: {self.attention.name} attention, {self.forward_mode()} forward"

    def place_weights(self, model: torch.nn.Module) -> None:
        """Where the parameters live, decided before they are filled (``loader.build_model``): as built by default."""

    def process_weights_after_loading(self, model: torch.nn.Module) -> None:
        """Once the weights are loaded: each GEMM layer's method prepares its weight (vLLM's hook of that name)."""
        methods = [(m, m.linear_method) for m in model.modules() if hasattr(m, "linear_method")]
        for module, method in methods:
            method.process_weights_after_loading(module)
        self.num_prepared_weights = sum(1 for _, method in methods if method.copy_bytes)
        self.weight_copy_bytes = sum(method.copy_bytes for _, method in methods)

    def bind_kv_cache(self, block_size: int, kv_dtype: torch.dtype) -> None:
        """The KV cache's block size and dtype, told once by the runner (a metadata builder may need them)."""
        self.block_size, self.kv_dtype = block_size, kv_dtype

    def build_metadata(self, plan) -> AttentionMetadata:
        """The step's ``AttentionMetadata`` on this backend's device, from a ``BatchPlan``."""
        return AttentionMetadata(**self._metadata_fields(plan))

    def _metadata_fields(self, plan) -> dict:
        return dict(
            slot_mapping=ints(plan.slot_mapping, self.device, torch.long),
            num_decode_tokens=plan.num_decode_tokens,
            decode_block_tables=block_table_tensor(plan.decode_block_tables, self.device),
            decode_context_lens=ints(plan.decode_context_lens, self.device),
            prefill_block_tables=block_table_tensor(plan.prefill_block_tables, self.device),
            prefill_cu_seqlens_q=ints(plan.prefill_cu_seqlens_q, self.device),
            prefill_context_lens=ints(plan.prefill_context_lens, self.device))

    def prepare_forward(self, runner) -> None:
        """Compile or capture what later steps replay; called once, the KV cache bound (nothing by default)."""

    def forward_mode(self) -> str:
        return "eager"

    def forward(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """One step's forward pass. -> (T, hidden) final hidden states."""
        return model(input_ids, positions, meta)

    def synchronize(self) -> None:
        """Wait until this device has finished the work launched so far (nothing to wait for by default:
        the CPU computes each operator before it returns)."""

    def logits_rows_per_chunk(self, num_rows: int, vocab_size: int, hidden_size: int) -> int:
        """How many rows of logits one LM-head call computes: all of them by default."""
        return max(1, num_rows)
