"""llguidance behind the backend interface: the engine's grammar library (vLLM's "guidance" backend).

llguidance (Microsoft's guidance project, in Rust) compiles a JSON schema, a regular expression, a list of
choices or a Lark grammar into a matcher over the tokenizer's vocabulary; its lexer walks a trie of the tokens'
bytes, so a step's mask is cheap (``results/README.md``: measured against xgrammar, and why this is the default).
"""

from __future__ import annotations

import torch

from nanoengine.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar


class GuidanceGrammar(StructuredOutputGrammar):
    """One request's llguidance ``LLMatcher``."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return self.matcher.consume_tokens(tokens)

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens[:self.matcher.validate_tokens(tokens)]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        # llguidance writes the row's words in place (a stopped matcher allows EOS only). Its
        # ``llguidance.torch`` helper does the same, but importing it costs seconds.
        words = bitmask[row]
        assert words.is_contiguous() and words.dtype == torch.int32 and words.device.type == "cpu"
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.nbytes)

    def is_terminated(self) -> bool:
        # Stopped: nothing but EOS may follow (also in an error state, which accept_tokens has reported).
        return self.matcher.is_stopped()


class GuidanceBackend(StructuredOutputBackend):
    """llguidance set up for one tokenizer: its token bytes, the vocabulary size and the EOS ids."""

    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 whitespace_flexible: bool = True) -> None:
        import llguidance.hf

        self.vocab_size = max(vocab_size, len(tokenizer))
        self.whitespace_flexible = whitespace_flexible
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,
                                                      eos_token=list(eos_token_ids) or None)

    def grammar_text(self, kind: str, spec) -> str:
        """The constraint in llguidance's own grammar format (JSON or Lark text)."""
        import llguidance

        if kind in ("json", "json_object"):
            schema = spec if kind == "json" else '{"type": "object"}'
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": self.whitespace_flexible})
        return llguidance.grammar_from(kind, list(spec) if kind == "choice" else spec)

    def validate(self, kind: str, spec) -> None:
        import llguidance

        try:
            error = llguidance.LLMatcher.validate_grammar(self.grammar_text(kind, spec), self.tokenizer)
        except (ValueError, TypeError) as exc:
            error = str(exc)
        if error:
            raise ValueError(f"structured_outputs {kind} does not compile: {error.strip()}")

    def compile_grammar(self, kind: str, spec) -> GuidanceGrammar:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar_text(kind, spec))
        if matcher.is_error():
            raise ValueError(f"structured_outputs {kind} does not compile: {matcher.get_error().strip()}")
        return GuidanceGrammar(matcher)
