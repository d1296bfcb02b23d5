"""Which drafted tokens to keep: the rejection rule that leaves the output distribution unchanged (chapter 13).

The target model scored k drafted tokens in one pass: row i is the distribution ``p_i`` the engine would have
sampled position i from (after temperature, top-k, top-p and min-p), row k the one after the last draft. The
rule of Leviathan, Kalman and Matias (2023) and Chen et al. (2023) accepts a draft ``x_i`` drawn from ``q_i``
with probability ``min(1, p_i(x_i) / q_i(x_i))``, samples from ``max(0, p_i - q_i)`` renormalised at the first
rejection, and adds a bonus token from ``p_k`` when every draft is kept. Prompt lookup's ``q_i`` is one-hot at
``x_i``: accept with probability ``p_i(x_i)``, else sample from ``p_i`` without ``x_i``. Then P(emit y) = p(y):
for y = x by acceptance, for y != x as (1 - p(x)) * p(y) / (1 - p(x)) (chapter 13, section 4, derives it). Greedy
is the same rule on a one-hot ``p_i`` at its argmax, so greedy output is the engine's, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_drafts(probs: torch.Tensor, draft_token_ids: Sequence[int],
                  generator: torch.Generator | None = None) -> list[int]:
    """The tokens one verify pass emits for one request: accepted drafts, then one more.

    probs (k+1, V): the target's sampling distribution at each drafted position and after
    the last draft (rows sum to 1; a greedy request passes one-hot rows). draft_token_ids:
    the k drafted tokens. Returns between 1 and k+1 token ids. Uniform draws and samples come
    from ``generator`` (a seeded request's own), in a fixed order, so a seed reproduces.
    """
    k = len(draft_token_ids)
    if probs.dim() != 2 or probs.shape[0] != k + 1:
        raise ValueError(f"probs must be (k+1, vocab) for k={k} drafts, got {tuple(probs.shape)}")
    emitted: list[int] = []
    for i, draft in enumerate(draft_token_ids):
        p = probs[i]
        u = float(torch.rand((), generator=generator, device=p.device))
        if u < float(p[draft]):
            emitted.append(int(draft))
            continue
        residual = p.clone()
        residual[draft] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # p was one-hot at the draft: u < 1 always accepts it, so only by rounding
            emitted.append(int(draft))
            continue
        emitted.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(probs[k], 1, generator=generator)))
    return emitted


def accept_greedy(target_token_ids: Sequence[int], draft_token_ids: Sequence[int]) -> list[int]:
    """``accept_drafts`` for a greedy request, with no random draws. target_token_ids (k+1): the target's
    argmax at each drafted position and after the last draft; drafts are kept while they equal it."""
    k = len(draft_token_ids)
    if len(target_token_ids) != k + 1:
        raise ValueError(f"need k+1={k + 1} target tokens for {k} drafts, got {len(target_token_ids)}")
    emitted: list[int] = []
    for draft, target in zip(draft_token_ids, target_token_ids):
        emitted.append(int(target))
        if draft != target:
            return emitted
    emitted.append(int(target_token_ids[k]))
    return emitted
