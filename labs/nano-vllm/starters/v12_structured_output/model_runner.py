"""v12 - the model runner with tensors, a real KV pool, a real Transformer, verify passes and masks (cards 10-17).

The contract is exactly v06-v08's - ``prepare_prefill(seqs)``, ``prepare_decode(seqs)``,
``run(seqs, is_prefill) -> list[int]`` - and so is the logic; what changes is the
material:

- ``ModelInput`` holds ``torch`` tensors (what a GPU kernel would receive), and
  ``block_tables`` is one ``(num_seqs, max_blocks)`` tensor padded with -1
  (``prepare_block_tables``, as in nano-vLLM);
- the KV pool is one tensor, ``kv_cache`` of shape
  ``(2, num_layers, num_blocks, block_size, num_heads, head_dim)`` - K and V for every
  layer, every block, every slot; nano-vLLM allocates the same layout in
  ``ModelRunner.allocate_kv_cache``, sized to fill the free GPU memory;
- the model is ``TinyTransformer``, a ``torch.nn.Module``; its logits go through the same
  ``Sampler`` as v08's toy logits.

Where does a token's KV go? ``prepare_*`` computes ``slot_mapping`` from the block
table (``block_id * block_size + offset``) and the model's ``store_kv`` writes K and V at
those slots in every layer.

New in v11: a decode step is a *verify pass*. Each sequence feeds its uncomputed tokens
(its last one) plus its drafts, ``1 + k`` rows at positions ``num_computed_tokens`` onward,
over its whole cached context, and gets logits at every one of those rows
(``ModelInput.logits_indices``): row ``i`` is the model's next-token distribution after
draft ``i``. ``run`` then keeps drafts by the rule in ``rejection_sampler.py`` and returns,
per sequence, the 1 to ``k + 1`` tokens it emits. With no drafts this is v09's decode.

New in v12: ``run`` takes the step's grammar bitmask (one bool row per logits row, from the
scheduler) and applies it to the logits first, with ``apply_grammar_bitmask``: forbidden
tokens get ``-inf`` *before* temperature and top-k, so the sampler's softmax renormalises
over the allowed tokens and top-k picks among them. Greedy takes the argmax of the masked
row; a verify pass judges draft ``i`` against row ``i``'s masked distribution. The runner
does not know what the constraint is; it only sees the mask, as vLLM's GPU worker does.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from rejection_sampler import accept_greedy, accept_sampled
from sampler import Sampler
from sequence import Sequence
from structured_output import apply_grammar_bitmask
from tiny_transformer import TinyConfig, TinyTransformer


@dataclass(frozen=True)
class ModelInput:
    """One step's batch, flattened into tensors the way a GPU kernel wants it."""

    is_prefill: bool
    input_ids: torch.Tensor  # (N,) every token that rides this step, sequences back to back
    positions: torch.Tensor  # (N,) each token's position within its own sequence
    slot_mapping: torch.Tensor  # (N,) pool slot where each token's KV is written
    cu_seqlens_q: torch.Tensor  # (B+1,) sequence i owns rows [cu_seqlens_q[i], cu_seqlens_q[i+1])
    context_lens: torch.Tensor  # (B,) tokens of KV each sequence reads (cached + new)
    block_tables: torch.Tensor  # (B, max_blocks) where each sequence's KV lives; -1 = padding
    logits_indices: torch.Tensor  # (R,) rows that get logits: last rows (prefill), all rows (verify)


def _ints(values: Iterable[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


class ModelRunner:
    """Owns the model and the KV pool; turns scheduled sequences into token ids."""

    def __init__(self, num_blocks: int, block_size: int, config: TinyConfig) -> None:
        self.block_size = block_size
        self.model = TinyTransformer(config).eval()
        self.kv_cache = torch.zeros(2, config.num_layers, num_blocks, block_size,
                                    config.num_heads, config.head_dim)  # the pool
        self.sampler = Sampler()
        self.last_input: ModelInput | None = None  # the most recent batch, for traces and tests
        self.last_logits: torch.Tensor | None = None  # ... and the logits it produced

    def _slot(self, seq: Sequence, position: int) -> int:
        block_id = seq.block_table[position // self.block_size]
        return block_id * self.block_size + position % self.block_size

    def prepare_block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        return torch.tensor([seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs],
                            dtype=torch.int64)  # (B, width)

    def prepare_prefill(self, seqs: list[Sequence]) -> ModelInput:
        input_ids, positions, slot_mapping, cu_seqlens_q = [], [], [], [0]
        for seq in seqs:
            start = seq.num_cached_tokens  # tokens before ``start`` are prefix-cache hits
            input_ids.extend(seq.token_ids[start:])
            positions.extend(range(start, len(seq)))
            slot_mapping.extend(self._slot(seq, p) for p in range(start, len(seq)))
            cu_seqlens_q.append(cu_seqlens_q[-1] + len(seq) - start)
        return ModelInput(True, _ints(input_ids), _ints(positions), _ints(slot_mapping),
                          _ints(cu_seqlens_q), _ints(len(seq) for seq in seqs),
                          self.prepare_block_tables(seqs), _ints(cu_seqlens_q[1:]) - 1)

    def prepare_decode(self, seqs: list[Sequence]) -> ModelInput:
        """A verify pass: each sequence's uncomputed token(s) plus its drafts, logits at every row."""
        input_ids, positions, slot_mapping, cu_seqlens_q = [], [], [], [0]
        for seq in seqs:
            rows = seq.token_ids[seq.num_computed_tokens:] + seq.draft_token_ids  # last token + k drafts
            start = seq.num_computed_tokens
            input_ids.extend(rows)
            positions.extend(range(start, start + len(rows)))
            slot_mapping.extend(self._slot(seq, p) for p in range(start, start + len(rows)))
            cu_seqlens_q.append(cu_seqlens_q[-1] + len(rows))
        return ModelInput(False, _ints(input_ids), _ints(positions), _ints(slot_mapping),
                          _ints(cu_seqlens_q), _ints(len(seq) + len(seq.draft_token_ids) for seq in seqs),
                          self.prepare_block_tables(seqs), torch.arange(cu_seqlens_q[-1]))

    def prepare_sample(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor,
                                                            list[torch.Generator | None]]:
        temperatures = torch.tensor([seq.temperature for seq in seqs], dtype=torch.float32)  # (B,)
        top_ks = torch.tensor([seq.top_k for seq in seqs], dtype=torch.int64)  # (B,)
        return temperatures, top_ks, [seq.generator for seq in seqs]

    def accept(self, seqs: list[Sequence], logits: torch.Tensor, cu_seqlens_q: torch.Tensor) -> list[list[int]]:
        """Per sequence, the tokens its verify pass emits: kept drafts, then one of the model's."""
        temperatures, top_ks, generators = self.prepare_sample(seqs)
        emitted = []
        for i, seq in enumerate(seqs):
            rows = logits[int(cu_seqlens_q[i]):int(cu_seqlens_q[i + 1])]  # (k+1, V)
            if seq.temperature == 0:
                emitted.append(accept_greedy(rows.argmax(dim=-1).tolist(), seq.draft_token_ids))
            else:
                probs = self.sampler.probs(rows, temperatures[i].expand(len(rows)), top_ks[i].expand(len(rows)))
                emitted.append(accept_sampled(probs, seq.draft_token_ids, generators[i]))
        return emitted

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool,
            grammar_bitmask: torch.Tensor | None = None) -> list[list[int]]:
        """One model step for ``seqs``: prepare the flat batch, run, mask, sample or verify; tokens out.

        ``grammar_bitmask`` (R, vocab) bool, or None: the tokens each logits row may produce.
        Returns, per sequence, the tokens it emits: one after a prefill, 1 to k+1 after a verify."""
        model_input = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        logits = self.model(model_input, self.kv_cache)  # (R, vocab): one row per logits index
        logits = apply_grammar_bitmask(logits, grammar_bitmask)  # before temperature and top-k
        self.last_input, self.last_logits = model_input, logits
        if is_prefill:
            return [[token_id] for token_id in self.sampler(logits, *self.prepare_sample(seqs))]
        return self.accept(seqs, logits, model_input.cu_seqlens_q)
