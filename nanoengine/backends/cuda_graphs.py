"""CUDA graphs for decode steps: the whole forward pass recorded once, replayed with one launch (chapter 10).

Graphs need fixed shapes and addresses, so this module keeps static input buffers, captures one graph per
*batch-size bucket* (1, 2, 4, 8, then multiples of 16), and pads a batch up to the next bucket: padded rows
write nothing (slot -1) and attend to nothing (context length 0). Only decode-only steps use graphs (prefills
vary in length); never on the CPU, nor with ``enforce_eager=True``.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoengine.layers.attention import AttentionMetadata


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 32, ... up to and including ``max_batch``."""
    sizes = [b for b in [1, 2, 4, 8] + list(range(16, max_batch + 16, 16)) if b < max_batch]
    return sizes + [max_batch]


class CudaGraphDecoder:
    """Captured decode forwards, one per bucket, replayed for decode-only steps."""

    def __init__(self, model: nn.Module, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.model = model
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        long, i32 = dict(dtype=torch.long, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(max_batch, **long)
        self.slot_mapping = torch.full((max_batch,), -1, **long)
        self.context_lens = torch.zeros(max_batch, **i32)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, **i32)
        self._no_prefill_tables = torch.zeros(0, max_blocks_per_seq, **i32)
        self._no_prefill_cu = torch.zeros(1, **i32)
        self._no_prefill_lens = torch.zeros(0, **i32)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:batch], batch, self.block_tables[:batch],
                                 self.context_lens[:batch], self._no_prefill_tables, self._no_prefill_cu,
                                 self._no_prefill_lens)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record a graph per bucket, largest first so smaller ones reuse its memory pool."""
        for batch in reversed(self.buckets):
            meta = self._metadata(batch)
            # Warm up eagerly first: Triton compiles its kernels on first use, which cannot happen inside a capture.
            self.model(self.input_ids[:batch], self.positions[:batch], meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = self.model(self.input_ids[:batch], self.positions[:batch], meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = (graph, hidden)
        torch.cuda.synchronize()

    def can_run(self, meta: AttentionMetadata) -> bool:
        return meta.num_prefills == 0 and 0 < meta.num_decode_tokens <= self.max_batch \
            and meta.decode_block_tables.shape[1] <= self.block_tables.shape[1]

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Copy this step into the static buffers, replay the bucket's graph. -> (n, hidden)."""
        n = input_ids.shape[0]
        batch = next(b for b in self.buckets if b >= n)
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:batch] = -1  # padded rows write nothing...
        self.context_lens[:n] = meta.decode_context_lens
        self.context_lens[n:batch] = 0  # ...and attend to nothing
        self.block_tables[:n, :width] = meta.decode_block_tables
        graph, hidden = self.graphs[batch]
        graph.replay()
        return hidden[:n]
