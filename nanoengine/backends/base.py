"""A device backend: how a step runs on one kind of hardware, chosen once (chapter 10).

The generic engine (scheduler, block manager, model runner, the layers) is the same on
every device. What differs is *how* a step's work is done: which attention kernels run,
how the GEMM weights are laid out, whether the forward pass is compiled or replayed from
CUDA graphs, how the logits are computed. vLLM v1 keeps those decisions in an attention
backend with its metadata builder (``vllm/v1/attention/backends/``) and a platform
(``vllm/platforms/``); this engine keeps them in one ``Backend`` object per engine, picked
by ``backends.select_backend`` when the runner is built. Nothing below the runner asks
which device it is on again.

A backend owns five things:

1. **The step's attention metadata.** ``build_metadata(plan)`` turns the scheduler's batch
   into the typed tensors its kernels read, once per step (a backend may subclass
   ``AttentionMetadata`` with fields of its own, derived once for all layers).
2. **The attention kernels.** ``attention`` is the ``AttentionImpl`` every attention
   layer calls (``layers.attention.Attention`` never dispatches on the device).
3. **The GEMM weights.** ``prepare_weights(model)`` may give each linear layer a
   ``linear_method`` of its own (a CPU prepacks the weights); ``weight_copy_bytes`` counts
   any copies it made and ``weight_copies`` says what they are (``memory_report()`` reports both).
4. **How the forward runs.** ``prepare_forward(runner)`` compiles or captures once the KV
   cache is bound; ``forward`` runs one step (eagerly, compiled or from a graph).
5. **How logits are computed.** ``logits_rows_per_chunk`` says how many rows of logits the
   LM head computes at once (all of them, unless the backend says otherwise).

This base class is the readable default: the PyTorch reference kernels, plain ``F.linear``,
an eager forward, logits in one piece. It runs on any device and is what the tests
compare the tuned backends with.
"""

from __future__ import annotations

import torch

from nanoengine.kernels import reference
from nanoengine.layers.attention import AttentionImpl, AttentionMetadata


class ReferenceAttention(AttentionImpl):
    """The specification kernels (``kernels.reference``): a loop over sequences, any device."""

    name = "reference"

    def store_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        reference.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    def decode(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return reference.paged_decode_attention(query, k_cache, v_cache, meta.decode_block_tables,
                                                meta.decode_context_lens, scale)

    def prefill(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return reference.paged_prefill_attention(query, k_cache, v_cache, meta.prefill_block_tables,
                                                 meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale)


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
    weight_copies = ""  # what prepare_weights copies the weights into, for the memory report ("": nothing)

    def __init__(self, device: torch.device, compile: bool = False) -> None:
        self.device = torch.device(device)
        self.compile = compile  # torch.compile the small fused ops (backends.compilation)
        self.attention: AttentionImpl = ReferenceAttention()
        self.weight_copy_bytes = 0  # bytes of weight copies made by prepare_weights
        self.num_prepared_weights = 0  # linear layers given a backend-specific linear_method

    def describe(self) -> str:
        """One line for a reader: the backend, its attention kernels, how the forward runs."""
        return f"{self.name} backend: {self.attention.name} attention, {self.forward_mode()} forward"

    # ------------------------------------------------------------ weights
    def prepare_weights(self, model: torch.nn.Module) -> None:
        """Lay the loaded weights out for this device's GEMMs. The default keeps ``F.linear``."""

    # ------------------------------------------------------------ metadata
    def bind_kv_cache(self, block_size: int, num_kv_heads: int, num_heads: int, head_dim: int,
                      kv_dtype: torch.dtype) -> None:
        """The KV cache's layout, told once by the runner (a metadata builder may need it)."""
        self.block_size, self.num_kv_heads, self.num_heads, self.head_dim = block_size, num_kv_heads, num_heads, head_dim
        self.kv_dtype = kv_dtype

    def build_metadata(self, plan) -> AttentionMetadata:
        """The step's ``AttentionMetadata`` on this backend's device, from a ``BatchPlan``."""
        return AttentionMetadata(**self._metadata_fields(plan))

    def _metadata_fields(self, plan) -> dict:
        device = self.device
        return dict(
            slot_mapping=ints(plan.slot_mapping, device, torch.long),
            num_decode_tokens=plan.num_decode_tokens,
            decode_block_tables=block_table_tensor(plan.decode_block_tables, device),
            decode_context_lens=ints(plan.decode_context_lens, device),
            prefill_block_tables=block_table_tensor(plan.prefill_block_tables, device),
            prefill_cu_seqlens_q=ints(plan.prefill_cu_seqlens_q, device),
            prefill_context_lens=ints(plan.prefill_context_lens, device))

    # ------------------------------------------------------------ forward
    def prepare_forward(self, runner) -> None:
        """Compile or capture what later steps replay; called once, the KV cache bound.

        With ``compile=True`` the small fused ops are compiled and warmed up now, timed
        (``runner.compilation``, ``backends.compilation``).
        """
        if self.compile:
            from nanoengine.backends.compilation import compile_runner

            runner.compilation = compile_runner(runner)

    def forward_mode(self) -> str:
        return "eager" if not self.compile else "eager with compiled fused ops"

    def forward(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """One step's forward pass. -> (T, hidden) final hidden states."""
        return model(input_ids, positions, meta)

    def synchronize(self) -> None:
        """Wait until this device has finished the work launched so far (nothing to wait for by default:
        the CPU computes each operator before it returns)."""

    # ------------------------------------------------------------ logits
    def logits_rows_per_chunk(self, num_rows: int, vocab_size: int, hidden_size: int) -> int:
        """How many rows of logits one LM-head call computes: all of them by default."""
        return max(1, num_rows)
