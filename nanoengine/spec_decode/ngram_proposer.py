"""Prompt lookup: propose the tokens that followed the request's last n tokens earlier on.

Text that copies, edits, quotes or continues a pattern repeats itself, so the last few tokens of a request have
often appeared before in its own prompt or output, and what followed them then is a good guess, at no model's cost.

``propose_ngram`` follows vLLM's rule (``vllm/v1/spec_decode/ngram_proposer.py``): the *longest* suffix of
length ``min_n..max_n`` that occurs earlier, at its *earliest* occurrence, and up to ``k`` tokens after it,
found by a numpy sliding window rather than vLLM's numba-compiled KMP-style scan (chapter 13, section 8).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from nanoengine.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from nanoengine.engine.request import Request


def propose_ngram(token_ids: Sequence[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the longest earlier match of the context's suffix.

    Tries n = max_n down to min_n: the last n tokens are searched for in the context before
    its final token (a match must end before the suffix itself does, so something follows
    it); the first n with a match wins, at its earliest position. [] when nothing matches.
    """
    if k < 1 or min_n < 1 or min_n > max_n:
        raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n, got k={k}, min_n={min_n}, max_n={max_n}")
    tokens = np.asarray(token_ids, dtype=np.int64)
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        # windows[i] = tokens[i:i+n], for every start whose window ends before the last token
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n  # the first token after the earliest match
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """The ngram proposer of one engine: its config, and a cap from the model's length."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, token_ids: Sequence[int], max_tokens_left: int, k: int | None = None) -> list[int]:
        """Drafts for one request: at most k, never past the model's length or the request's own end.

        ``max_tokens_left``: tokens the request may still generate; a verify pass that accepts every draft
        yields one more, so at most ``max_tokens_left - 1`` drafts are useful. ``k``: this step's k
        (``SpeculativeConfig.tokens_for_batch``); None: ``num_speculative_tokens``.
        """
        k = self.config.num_speculative_tokens if k is None else k
        room = min(k, self.max_model_len - len(token_ids) - 1, max_tokens_left - 1)
        if room < 1:
            return []
        return propose_ngram(token_ids, room, self.config.prompt_lookup_max, self.config.prompt_lookup_min)

    def propose_drafts(self, requests: Sequence[Request], batch_size: int) -> None:
        """After a step's update, draft for each request that produced a token and still decodes (vLLM's
        ``propose_draft_token_ids``): its ``spec_token_ids``, cut to the prefix its grammar accepts (the grammar's
        ``validate_tokens``, which vLLM's scheduler asks too), [] for the others. ``batch_size``: the step's
        scheduled requests, which choose this step's k (``SpeculativeConfig.tokens_for_batch``; 0 drafts nothing).
        """
        k = self.config.tokens_for_batch(batch_size)
        for request in requests:
            if k == 0 or request.is_finished or request.num_tokens_to_compute != 1:
                request.spec_token_ids = []
                continue
            left = request.sampling_params.max_tokens - request.num_output_tokens
            drafts = self.propose(request.all_token_ids, left, k)
            if drafts and request.structured_output is not None:  # only what its grammar accepts is worth verifying
                drafts = request.structured_output.grammar.validate_tokens(drafts)
            request.spec_token_ids = drafts
