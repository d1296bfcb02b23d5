"""v05 - the toy "model", now reading and writing a *paged* KV cache (card 9).

Same rule as v00-v04. What changed is where the cached features live: no longer a list
per request but one flat pool, ``kv_cache``, of ``num_blocks * block_size`` slots - the
toy version of the big KV tensor a GPU engine allocates once at start-up. A token's
slot is found through its request's block table::

    slot = block_table[position // block_size] * block_size + position % block_size

Prefill writes one slot per prompt token; decode writes one slot for the last token;
both then gather the request's features back through the block table. The model does
not own blocks and never frees anything: the ``BlockManager`` decides which slots a
request may use, and a freed block is simply overwritten by its next owner.
"""

from sequence import Sequence

VOCAB_SIZE = 64  # token ids are 0..63
EOS_TOKEN = 0  # generating this id ends the request early


def token_feature(token_id: int, position: int) -> int:
    """What the model 'remembers' about one token at one position (the toy K/V)."""
    return (7 * token_id + 3 * position) % 97


class ToyModel:
    """The toy rule behind a batched prefill/decode interface, over a paged KV pool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv_cache: list[int | None] = [None] * (num_blocks * block_size)  # the pool
        self.num_features_computed = 0  # work counter, for the trace

    def slot(self, seq: Sequence, position: int) -> int:
        """The pool index holding the KV of ``seq``'s token at ``position``."""
        # TODO(v05): The pool index of the token at `position`: block_table[position //
        # block_size] * block_size + position % block_size.
        raise NotImplementedError("TODO(v05): write ToyModel.slot (see NOTES.md)")

    def prefill(self, seqs: list[Sequence]) -> list[int]:
        """For each sequence: write a feature for every token into its slots; next token."""
        for seq in seqs:
            for position, token_id in enumerate(seq.token_ids):
                self.kv_cache[self.slot(seq, position)] = token_feature(token_id, position)
            self.num_features_computed += len(seq)
        return [self._next_token(seq) for seq in seqs]

    def decode(self, seqs: list[Sequence]) -> list[int]:
        """For each sequence: write the feature of its last token; next token."""
        for seq in seqs:
            position = len(seq) - 1
            self.kv_cache[self.slot(seq, position)] = token_feature(seq.last_token, position)
            self.num_features_computed += 1
        return [self._next_token(seq) for seq in seqs]

    def _next_token(self, seq: Sequence) -> int:
        # Identical to v00's toy_next_token, but gathering cached features page by page.
        features = [self.kv_cache[self.slot(seq, p)] for p in range(len(seq))]
        return (sum(features) + 13 * seq.last_token) % VOCAB_SIZE
