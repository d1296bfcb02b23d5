"""v11 - which drafts to keep: the acceptance rule of speculative decoding (card 16).

One verify pass scores ``k`` drafts at once and returns ``k + 1`` rows of logits: row ``i``
is the model's next-token distribution *given drafts 1..i*, i.e. the distribution draft
``i + 1`` must be judged against, and row ``k`` is the distribution after the last draft.
The rule keeps the output distribution exactly what plain decoding would produce:

- **greedy**: keep drafts while each equals the row's argmax; the first mismatch emits the
  argmax instead and stops; if all are kept, the last row's argmax is a free *bonus* token.
  The emitted tokens are the ones greedy decoding would have produced, token for token.
- **sampling** (``p`` = a row's distribution after temperature and top-k, as the
  ``Sampler`` computes it): the n-gram proposer puts all its probability on its draft
  ``x`` (a one-hot ``q``), so the general rule ``accept with min(1, p(x) / q(x))`` becomes
  *accept with probability p(x)*. On rejection, draw from ``p`` with ``x`` removed and
  renormalised (the general ``max(0, p - q)``), then stop. If all are kept, draw the bonus
  from the last row. For one position: P(emit x) = p(x), and for y != x
  P(emit y) = (1 - p(x)) * p(y) / (1 - p(x)) = p(y). Resampling from ``p`` itself would
  give x a second chance and bias the output towards the drafts.

Every draw comes from the request's own generator (when it has a seed), in a fixed order,
so a seed still reproduces. vLLM's ``RejectionSampler`` does the same on the GPU for a
whole batch at once.
"""

import torch


def accept_greedy(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """The tokens a greedy verify pass emits: the kept drafts, then one token of the model's.

    target_token_ids: the argmax of each of the k+1 rows; draft_token_ids: the k drafts.
    Returns 1 to k+1 tokens.
    """
    k = len(draft_token_ids)
    if len(target_token_ids) != k + 1:
        raise ValueError(f"need k+1={k + 1} target tokens for {k} drafts, got {len(target_token_ids)}")
    emitted = []
    for draft, target in zip(draft_token_ids, target_token_ids):
        emitted.append(target)  # equal to the draft when it is kept
        if draft != target:
            return emitted
    emitted.append(target_token_ids[k])  # every draft kept: the bonus token
    return emitted


def accept_sampled(probs: torch.Tensor, draft_token_ids: list[int],
                   generator: torch.Generator | None) -> list[int]:
    """The tokens a sampled verify pass emits, by the rejection rule for one-hot drafts.

    probs (k+1, V): each row's sampling distribution; draft_token_ids: the k drafts.
    Returns 1 to k+1 tokens, distributed exactly as k+1 steps of plain sampling would be.
    """
    k = len(draft_token_ids)
    if probs.dim() != 2 or probs.shape[0] != k + 1:
        raise ValueError(f"probs must be (k+1, V) for k={k} drafts, got {tuple(probs.shape)}")
    emitted = []
    for i, draft in enumerate(draft_token_ids):
        p = probs[i]  # (V,): the distribution this draft is judged against
        if float(torch.rand((), generator=generator)) < float(p[draft]):
            emitted.append(draft)  # accepted with probability p(draft)
            continue
        residual = p.clone()
        residual[draft] = 0.0  # rejected: the draft may not be drawn again
        total = float(residual.sum())
        if total <= 0.0:  # p was one-hot at the draft; only rounding can reject it
            emitted.append(draft)
            continue
        emitted.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(probs[k], 1, generator=generator)))  # the bonus token
    return emitted
