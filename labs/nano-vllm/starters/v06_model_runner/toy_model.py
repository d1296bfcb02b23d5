"""v06 - the toy "model" as a pure function of a flat batch and a KV pool (card 10).

Up to v05 the model walked ``Sequence`` objects and their block tables itself. A real
model cannot: it runs on the GPU and sees only tensors. v06 therefore cuts it down to
what a Transformer forward pass actually receives, a ``ModelInput`` built by the
``ModelRunner`` (see ``model_runner.py``):

- ``input_ids`` / ``positions``: every token riding this step, sequences back to back;
- ``slot_mapping``: for each of those tokens, the pool slot its KV must be written to;
- ``block_tables`` / ``context_lens``: where each sequence's whole context can be read.

``forward`` does the two things attention does with the cache - **store** the new
tokens' KV at their slots, then **gather** each sequence's context through its block
table - and returns one next token per sequence. It knows nothing about requests,
queues or blocks being free or used.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # model_runner imports this module; import its type for hints only
    from model_runner import ModelInput

VOCAB_SIZE = 64  # token ids are 0..63
EOS_TOKEN = 0  # generating this id ends the request early


def token_feature(token_id: int, position: int) -> int:
    """What the model 'remembers' about one token at one position (the toy K/V)."""
    return (7 * token_id + 3 * position) % 97


class ToyModel:
    """The toy rule over a flat batch; stateless apart from ``block_size``."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def forward(self, model_input: "ModelInput", kv_cache: list[int | None]) -> list[int]:
        """Store the batch's features in ``kv_cache``, then one next token per sequence."""
        # TODO(v06): Store: kv_cache[slot] = token_feature(token, position) for every row.
        # Then for each sequence gather its context_len features through its block table,
        # take its last input token (row cu_seqlens_q[i + 1] - 1), and emit (sum(features) +
        # 13 * last) % VOCAB_SIZE.
        raise NotImplementedError("TODO(v06): write ToyModel.forward (see NOTES.md)")
