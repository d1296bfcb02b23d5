"""Structured output (chapter 14): every token drawn from what a grammar allows next.

A request that asks for JSON matching a schema, a regex, one of a few choices or a grammar
(``SamplingParams(structured_outputs=StructuredOutputsParams(...))``) gets a matcher compiled from it (llguidance,
behind vLLM's backend interface). Each step the matcher says which tokens may come next, as one bit per token;
the logits of the others are set to -inf before temperature and the filters, so the sampler can draw nothing
else. The matcher then advances with the token the request got, and the request finishes when the constraint is
complete. Where each module acts in a step: ``docs/ARCHITECTURE.md``.
"""

from nanoengine.structured_output.backend import (StructuredOutputBackend, StructuredOutputGrammar,
                                                  allocate_token_bitmask, apply_token_bitmask)
from nanoengine.structured_output.config import StructuredOutputsConfig
from nanoengine.structured_output.manager import StructuredOutputManager, StructuredOutputRequest

__all__ = ["StructuredOutputBackend", "StructuredOutputGrammar", "StructuredOutputManager", "StructuredOutputRequest",
           "StructuredOutputsConfig", "allocate_token_bitmask", "apply_token_bitmask"]
