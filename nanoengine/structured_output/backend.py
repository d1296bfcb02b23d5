"""The grammar library's side of structured output, in the shape of vLLM's interface (chapter 14).

vLLM keeps every grammar library behind two small classes (``vllm/v1/structured_output/backend_types.py``): a
*backend* validates and compiles a constraint for the engine's tokenizer, and each request holds a *grammar*:
a matcher that knows which tokens may come next, writes them into its row of the step's packed int32 bitmask,
and advances by the tokens the request really got (drafts: ``manager.fill_rows``). ``apply_token_bitmask``
turns the packed rows into ``-inf`` for every token a row forbids.
"""

from __future__ import annotations

import abc

import torch

BITS = 32  # tokens per int32 word of the bitmask


class StructuredOutputGrammar(abc.ABC):
    """One request's matcher: where it is in its constraint, and what may come next."""

    @abc.abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance by ``tokens``; False if one of them is not allowed where it comes."""

    @abc.abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the constraint accepts from here; nothing advances."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (bit ``t % 32`` of word ``t // 32``)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """True once the constraint is complete and no more text may follow."""


class StructuredOutputBackend(abc.ABC):
    """A grammar library, set up once for the engine's tokenizer."""

    name: str
    vocab_size: int  # the bitmask's width in tokens (the model's vocabulary)

    @abc.abstractmethod
    def validate(self, kind: str, spec) -> None:
        """Raise ``ValueError`` with the library's reason if the constraint cannot compile."""

    @abc.abstractmethod
    def compile_grammar(self, kind: str, spec) -> StructuredOutputGrammar:
        """A new matcher for the constraint (``StructuredOutputsParams.kind`` and ``.spec``)."""


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A (rows, ceil(vocab / 32)) int32 bitmask with every bit set: every token allowed."""
    return torch.full((num_rows, -(-vocab_size // BITS)), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set each forbidden token's logit to -inf, in place. logits (rows, vocab); bitmask (rows, words).

    Token t is allowed in a row when bit ``t % 32`` of the row's word ``t // 32`` is set. The
    bits are unpacked with a shift and a mask, so the mask crosses from the grammar's thread to
    the model's device as 4 bytes per 32 tokens (6 KB per row for a 49,152-token vocabulary).
    """
    shifts = torch.arange(BITS, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :logits.shape[-1]]
    logits.masked_fill_(allowed == 0, float("-inf"))
