"""Who am I in a tensor-parallel group, and how do ranks combine results (chapter 9).

Layers take a ``TPGroup`` instead of reading a global, so two engines (or a test and an
engine) can live in one process. ``TPGroup.single()`` is the trivial group of one rank:
every collective is then the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    process_group: object | None = None  # a torch.distributed group when size > 1

    @classmethod
    def single(cls) -> "TPGroup":
        return cls(0, 1, None)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks, in place (row-parallel outputs, embeddings)."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self.process_group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along the last dim (vocab-parallel logits)."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=-1)
