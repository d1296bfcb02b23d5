"""v01 - the toy "model": a deterministic token rule, no ML.

Split out of v00's single file unchanged (in v01), so that several engine files can
import it. The rule reads every earlier token, like attention does, which is why later
versions can show what a KV cache saves.
"""

VOCAB_SIZE = 64  # token ids are 0..63
EOS_TOKEN = 0  # generating this id ends the request early


def token_feature(token_id: int, position: int) -> int:
    """What the model 'remembers' about one token at one position (the toy K/V)."""
    return (7 * token_id + 3 * position) % 97


def toy_next_token(token_ids: list[int]) -> int:
    """Next token from the full context: every feature plus the last token."""
    total = sum(token_feature(t, pos) for pos, t in enumerate(token_ids))
    return (total + 13 * token_ids[-1]) % VOCAB_SIZE
