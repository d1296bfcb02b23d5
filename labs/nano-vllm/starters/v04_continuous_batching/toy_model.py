"""v04 - the toy "model" with a per-request KV cache, now taking a *batch* of requests (card 8).

Same rule and same contiguous cache as v03. New in v04: ``prefill`` and ``decode`` take a
list of sequences and return one next token per sequence, because the scheduler now
puts several requests into one step. On a GPU a batch is one kernel launch over all the
rows; here it is a loop, but the contract is the batched one.
"""

from sequence import Sequence

VOCAB_SIZE = 64  # token ids are 0..63
EOS_TOKEN = 0  # generating this id ends the request early


def token_feature(token_id: int, position: int) -> int:
    """What the model 'remembers' about one token at one position (the toy K/V)."""
    return (7 * token_id + 3 * position) % 97


class ToyModel:
    """The toy rule behind a batched prefill/decode interface, with a per-request cache."""

    def __init__(self) -> None:
        self.kv_cache: dict[int, list[int]] = {}  # seq_id -> one feature per token
        self.num_features_computed = 0  # work counter, for the trace

    def prefill(self, seqs: list[Sequence]) -> list[int]:
        """For each sequence: cache a feature for every token; return its next token."""
        next_tokens = []
        for seq in seqs:
            self.kv_cache[seq.seq_id] = [token_feature(t, pos) for pos, t in enumerate(seq.token_ids)]
            self.num_features_computed += len(seq)
            next_tokens.append(self._next_token(self.kv_cache[seq.seq_id], seq.last_token))
        return next_tokens

    def decode(self, seqs: list[Sequence]) -> list[int]:
        """For each sequence: cache the feature of its last token; return its next token."""
        next_tokens = []
        for seq in seqs:
            cache = self.kv_cache[seq.seq_id]
            cache.append(token_feature(seq.last_token, len(cache)))
            self.num_features_computed += 1
            next_tokens.append(self._next_token(cache, seq.last_token))
        return next_tokens

    def free(self, seq_id: int) -> None:
        """Forget a finished request's cache."""
        del self.kv_cache[seq_id]

    @staticmethod
    def _next_token(features: list[int], last_token: int) -> int:
        # Identical to v00's toy_next_token, but reading cached features.
        return (sum(features) + 13 * last_token) % VOCAB_SIZE
