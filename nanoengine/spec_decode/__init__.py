"""Speculative decoding (chapter 13): propose a few tokens cheaply, check them all in one pass.

A decode step of a small batch is bound by reading the weights (chapter 6), so a forward pass over k+1 query
tokens of one sequence costs about what a pass over one does. If some cheap *proposer* guesses the next k tokens,
one pass of the target model scores all of them, and every guess it agrees with is a token gained for free. The
output must not change: greedy stays token for token the same, and sampling keeps exactly the target's
distribution (``rejection``). Where each module acts in a step: ``docs/ARCHITECTURE.md``.
"""

from nanoengine.spec_decode.config import SpeculativeConfig
from nanoengine.spec_decode.ngram_proposer import NgramProposer, propose_ngram
from nanoengine.spec_decode.rejection import accept_drafts, accept_greedy

__all__ = ["NgramProposer", "SpeculativeConfig", "accept_drafts", "accept_greedy", "propose_ngram"]
