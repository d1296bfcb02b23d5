"""v11 - the draft-free proposer: guess the next tokens by looking back (card 16).

Speculative decoding needs cheap guesses of the next few tokens. Many outputs copy from
their own context - code edits, quotes, lists, a greedy model stuck in a loop - so the
cheapest guesser is the request itself: take its last ``n`` tokens, find the same ``n``
tokens earlier in its prompt + output, and propose what followed them there. No second
model, no extra KV, no probabilities ("prompt lookup decoding"; vLLM's ``ngram`` method).

The search tries the longest suffix first (``n = max_n`` down to ``min_n``): a longer match
is better evidence that what followed will follow again. Among the matches of one ``n`` it
takes the earliest, as vLLM's proposer does. A match must end before the suffix itself
does, so at least one token follows it.
"""


def propose_ngram(token_ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the earliest match of the longest matching suffix.

    token_ids: the request's prompt + output so far. Returns [] when no suffix of length
    ``min_n`` .. ``max_n`` occurs earlier, or when ``k`` is 0.
    """
    # TODO(v11): For n from min(max_n, len - 1) down to min_n: take the last n tokens and
    # find their EARLIEST earlier occurrence (a window starting before len - n); return up
    # to k tokens that follow it. The first n with a match wins; [] if none (or k is 0).
    raise NotImplementedError("TODO(v11): write propose_ngram (see NOTES.md)")
