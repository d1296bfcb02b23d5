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
    if k < 0 or min_n < 1 or min_n > max_n:
        raise ValueError(f"need k >= 0 and 1 <= min_n <= max_n, got k={k}, min_n={min_n}, max_n={max_n}")
    total = len(token_ids)
    if k == 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = token_ids[total - n:]
        for start in range(total - n):  # windows token_ids[start:start+n] that end before the last token
            if token_ids[start:start + n] == suffix:
                follow = start + n  # the first token after the match
                return token_ids[follow:follow + k]
    return []
