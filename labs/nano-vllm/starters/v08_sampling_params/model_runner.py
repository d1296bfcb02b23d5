"""v08 - the model runner: prefix-aware prepare, model, then the sampler (cards 10-12).

The scheduler thinks in requests and blocks; the model thinks in flat arrays. The
``ModelRunner`` translates, and owns everything on the "GPU worker" side of the engine:
the model and the KV pool. Its contract (the names of nano-vLLM's
``engine/model_runner.py``, kept for every later version including the real
Transformer of v09):

- ``prepare_prefill(seqs)``: every token of each sequence rides; positions 0..n-1; each
  token's slot comes from the sequence's block table;
- ``prepare_decode(seqs)``: only each sequence's last token rides, at position n-1;
- ``run(seqs, is_prefill)``: prepare, call the model, return one token id per sequence.

Why split it off? The scheduler can then be tested without a model, the model without a
scheduler, and the same engine can drive a toy rule (here) or a neural network (v09).
In nano-vLLM the runner is also what runs in each tensor-parallel worker process.

New in v07: ``prepare_prefill`` puts only the tokens *after* ``seq.num_cached_tokens``
on the step (their KV is already in shared blocks), while ``context_lens`` still covers
the whole sequence, so the model reads the cached prefix through the block table. The
model itself is unchanged: a prefix hit is invisible to it except as less work.

New in v08: the model returns logits and ``run`` hands them to a ``Sampler`` together
with each request's sampling state, gathered by ``prepare_sample`` (nano-vLLM's
``ModelRunner.prepare_sample`` gathers temperatures the same way). The contract of
``run`` does not change: sequences in, one token id per sequence out.
"""

from dataclasses import dataclass

import torch

from sampler import Sampler
from sequence import Sequence
from toy_model import ToyModel


@dataclass(frozen=True)
class ModelInput:
    """One step's batch, flattened the way a GPU kernel wants it."""

    is_prefill: bool
    input_ids: tuple[int, ...]  # every token that rides this step, sequences back to back
    positions: tuple[int, ...]  # each token's position within its own sequence
    slot_mapping: tuple[int, ...]  # pool slot where each token's KV is written
    cu_seqlens_q: tuple[int, ...]  # sequence i owns input rows [cu_seqlens_q[i], cu_seqlens_q[i+1])
    context_lens: tuple[int, ...]  # tokens of KV each sequence reads (cached + new)
    block_tables: tuple[tuple[int, ...], ...]  # where each sequence's KV lives, block by block


class ModelRunner:
    """Owns the model and the KV pool; turns scheduled sequences into token ids."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.model = ToyModel(block_size)
        self.kv_cache: list[int | None] = [None] * (num_blocks * block_size)  # the pool
        self.sampler = Sampler()
        self.last_input: ModelInput | None = None  # the most recent batch, for traces and tests
        self.last_logits: torch.Tensor | None = None  # ... and the logits it produced

    def _slot(self, seq: Sequence, position: int) -> int:
        block_id = seq.block_table[position // self.block_size]
        return block_id * self.block_size + position % self.block_size

    def prepare_prefill(self, seqs: list[Sequence]) -> ModelInput:
        input_ids, positions, slot_mapping, cu_seqlens_q = [], [], [], [0]
        for seq in seqs:
            start = seq.num_cached_tokens  # tokens before ``start`` are prefix-cache hits
            input_ids.extend(seq.token_ids[start:])
            positions.extend(range(start, len(seq)))
            slot_mapping.extend(self._slot(seq, p) for p in range(start, len(seq)))
            cu_seqlens_q.append(cu_seqlens_q[-1] + len(seq) - start)
        return ModelInput(True, tuple(input_ids), tuple(positions), tuple(slot_mapping),
                          tuple(cu_seqlens_q), tuple(len(seq) for seq in seqs),
                          tuple(tuple(seq.block_table) for seq in seqs))

    def prepare_decode(self, seqs: list[Sequence]) -> ModelInput:
        return ModelInput(
            False,
            input_ids=tuple(seq.last_token for seq in seqs),
            positions=tuple(len(seq) - 1 for seq in seqs),
            slot_mapping=tuple(self._slot(seq, len(seq) - 1) for seq in seqs),
            cu_seqlens_q=tuple(range(len(seqs) + 1)),  # one row per sequence
            context_lens=tuple(len(seq) for seq in seqs),
            block_tables=tuple(tuple(seq.block_table) for seq in seqs),
        )

    def prepare_sample(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor,
                                                            list[torch.Generator | None]]:
        # TODO(v08): Return (temperatures as a float32 tensor (B,), top_ks as an int64
        # tensor (B,), the list of each sequence's generator).
        raise NotImplementedError("TODO(v08): write ModelRunner.prepare_sample (see NOTES.md)")

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """One model step for ``seqs``: prepare the flat batch, run, sample; token ids out."""
        model_input = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        logits = self.model.forward(model_input, self.kv_cache)  # (num_seqs, vocab)
        self.last_input, self.last_logits = model_input, logits
        return self.sampler(logits, *self.prepare_sample(seqs))
