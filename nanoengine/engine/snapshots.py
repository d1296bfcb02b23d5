"""Read-only pictures of a live engine, for readers, simulators and tests (chapters 2-7).

``LLMEngine.snapshot()`` returns an ``EngineSnapshot`` (the queues, every block, the counters),
``LLMEngine.memory_report()`` a ``MemoryReport`` (what the weights, their packed copies and the
KV cache take): frozen plain values, which keep no engine object alive and change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoengine.engine.block_manager import BlockSnapshot
from nanoengine.engine.request import Request


@dataclass(frozen=True)
class RequestSnapshot:
    request_id: str
    status: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_tokens: int
    max_tokens: int
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    num_preemptions: int
    parent_id: str = ""  # the user request it belongs to (equal to request_id unless n > 1)
    spec_token_ids: tuple[int, ...] = ()  # drafts the next step will check (speculative decoding)

    @classmethod
    def of(cls, r: Request) -> "RequestSnapshot":
        return cls(r.request_id, r.status.value, r.num_prompt_tokens, r.num_output_tokens, r.num_computed_tokens,
                   r.num_tokens, r.sampling_params.max_tokens, tuple(r.block_ids), r.num_cached_tokens,
                   r.num_preemptions, r.parent_id, tuple(r.spec_token_ids))


@dataclass(frozen=True)
class EngineSnapshot:
    """A frozen picture of the engine between two steps."""

    step: int
    waiting: tuple[RequestSnapshot, ...]
    running: tuple[RequestSnapshot, ...]
    blocks: tuple[BlockSnapshot, ...]
    block_size: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_cache_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_evictions: int = 0  # cached digests forgotten: blocks handed out again, and reset_prefix_cache() drops
    scheduling_policy: str = "fcfs"
    # Speculative decoding since the engine started (``SpecDecodeStats`` has the rates); 0 without it.
    num_speculative_tokens: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True)
class MemoryReport:
    """Where an engine's memory goes (bytes, all tensor-parallel ranks together)."""

    weight_bytes: int  # the model's parameters (tied embeddings counted once)
    weight_copy_bytes: int  # copies of the weights the device backend made for its kernels (Backend.weight_copies)
    kv_cache_bytes: int  # the preallocated paged KV pool
    num_kv_blocks: int
    block_size: int
    kv_bytes_per_token: int  # K and V of one token in every layer
    dtype: str
    tensor_parallel_size: int
    weight_copies: str = ""  # what those copies are, in the backend's words ("": none)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds when every block is full."""
        return self.num_kv_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.weight_copy_bytes + self.kv_cache_bytes
