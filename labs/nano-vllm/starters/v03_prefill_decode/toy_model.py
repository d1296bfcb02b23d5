"""v03 - the toy "model", now with a KV cache and two entry points: prefill and decode (card 7).

Up to v02 the model was one function, ``toy_next_token(all_token_ids)``, that recomputed
a feature for every token of the context at every step. But a token's feature depends
only on the token and its position, so it never changes once computed. Real Transformers
have the same property for their key/value vectors, which is why engines keep a
*KV cache*. With a cache the model has two very different jobs:

- **prefill**: the prompt arrives; compute and store a feature for every prompt token
  (many tokens at once), then produce the first new token;
- **decode**: one new token arrives; compute and store its feature only, read all the
  cached ones, produce the next token.

Same outputs as before, much less work: the ``num_features_computed`` counter shows it.
The cache here is the simplest possible one - one Python list per request, growing at
the end. v05 replaces it with fixed-size pages.
"""

VOCAB_SIZE = 64  # token ids are 0..63
EOS_TOKEN = 0  # generating this id ends the request early


def token_feature(token_id: int, position: int) -> int:
    """What the model 'remembers' about one token at one position (the toy K/V)."""
    return (7 * token_id + 3 * position) % 97


class ToyModel:
    """The toy rule of v00 behind a prefill/decode interface, with a per-request cache."""

    def __init__(self) -> None:
        self.kv_cache: dict[int, list[int]] = {}  # seq_id -> one feature per token
        self.num_features_computed = 0  # work counter, for the trace

    def prefill(self, seq_id: int, token_ids: list[int]) -> int:
        """Cache a feature for every token of the prompt; return the first new token."""
        # TODO(v03): Cache token_feature(t, position) for every prompt token as
        # kv_cache[seq_id], add their number to num_features_computed, and return
        # _next_token(cache, last token).
        raise NotImplementedError("TODO(v03): write ToyModel.prefill (see NOTES.md)")

    def decode(self, seq_id: int, token_id: int) -> int:
        """Cache the feature of one new token (at the next position); return the next token."""
        # TODO(v03): Append the feature of the one new token (its position is len(cache)) to
        # the request's cache, count 1 feature, and return _next_token(cache, token_id).
        raise NotImplementedError("TODO(v03): write ToyModel.decode (see NOTES.md)")

    def free(self, seq_id: int) -> None:
        """Forget a finished request's cache."""
        del self.kv_cache[seq_id]

    @staticmethod
    def _next_token(features: list[int], last_token: int) -> int:
        # Identical to v00's toy_next_token, but reading cached features.
        return (sum(features) + 13 * last_token) % VOCAB_SIZE
