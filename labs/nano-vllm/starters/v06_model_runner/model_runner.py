"""v06 - the model runner: the boundary between scheduling and model execution (card 10).

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
"""

from dataclasses import dataclass

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
        self.last_input: ModelInput | None = None  # the most recent batch, for traces and tests

    def _slot(self, seq: Sequence, position: int) -> int:
        # TODO(v06): block_table[position // block_size] * block_size + position %
        # block_size.
        raise NotImplementedError("TODO(v06): write ModelRunner._slot (see NOTES.md)")

    def prepare_prefill(self, seqs: list[Sequence]) -> ModelInput:
        # TODO(v06): Every token of each sequence rides: input_ids, positions 0..n-1 and
        # each token's slot, sequences back to back; cu_seqlens_q grows by len(seq) per
        # sequence; context_lens is len(seq); block_tables are tuples. Return
        # ModelInput(is_prefill=True, ...).
        raise NotImplementedError("TODO(v06): write ModelRunner.prepare_prefill (see NOTES.md)")

    def prepare_decode(self, seqs: list[Sequence]) -> ModelInput:
        # TODO(v06): One row per sequence: its last token, at position len(seq) - 1, and
        # that position's slot; cu_seqlens_q is 0, 1, ..., B; context_lens and block_tables
        # as in prefill.
        raise NotImplementedError("TODO(v06): write ModelRunner.prepare_decode (see NOTES.md)")

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """One model step for ``seqs``: prepare the flat batch, run, return token ids."""
        model_input = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        self.last_input = model_input
        return self.model.forward(model_input, self.kv_cache)
