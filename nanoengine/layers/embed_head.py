"""Token embedding and LM head, split over ranks by vocabulary (chapter 9).

Each rank holds a contiguous slice of the vocabulary. The embedding looks up only the ids
in its slice (zeros elsewhere) and an all-reduce sums the slices; the LM head computes
logits for its slice and an all-gather concatenates them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.distributed.parallel_state import TPGroup
from nanoengine.layers.linear import GemmLayer, _copy_checked, _divide


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = TPGroup.single()) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = _divide(vocab_size, tp.size, "vocabulary size")
        self.vocab_start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param.data, loaded.narrow(0, self.vocab_start, self.shard_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * in_shard.unsqueeze(-1)
        return self.tp.all_reduce(y)


class ParallelLMHead(GemmLayer, VocabParallelEmbedding):
    """hidden -> logits over the vocabulary; may share its weight with the embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = TPGroup.single()) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        self.make_linear_method()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, hidden) -> (B, vocab)
        return self.tp.all_gather_last_dim(self.linear_method.apply(self, hidden, None))
