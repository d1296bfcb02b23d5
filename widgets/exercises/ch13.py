"""Exercise checks of chapter 13 (speculative decoding): verify, roll back, accept, and when to stop.

Every scenario is fixed in this module, so each check gives the same verdict on every machine
and needs no model; what a check compares against is the engine's own rule
(``nanoengine.spec_decode.rejection``) or the arithmetic the engine's scheduler and block
manager do (``Scheduler.accept_token``, ``BlockManager.release_slots_after``):

* ``check_greedy_verify`` (13.1): the tokens one greedy verify pass emits for ``GREEDY_DRAFTS``
  when the target model's argmax at the k+1 positions is ``GREEDY_TARGETS``; right is what
  ``accept_greedy`` returns.
* ``check_roll_back`` (13.2): a request had ``ROLLBACK_START`` tokens with valid KV before a step
  that checked ``ROLLBACK_DRAFTS`` drafts, of which ``ROLLBACK_ACCEPTED`` were accepted, with
  blocks of ``ROLLBACK_BLOCK_SIZE`` tokens: (tokens with valid KV after the step, tokens the
  request has, blocks it keeps).
* ``check_accept`` (13.3): the learner's ``accept(probs, draft, generator)`` for one drafted token
  of a proposer without probabilities (prompt lookup, a one-hot q): ``ACCEPT_DRAWS`` calls per
  draft on the fixed distributions ``ACCEPT_PROBS``; the first emitted token must have exactly
  row 0's distribution, the draft must be kept with probability p(draft), and an accepted draft
  must be followed by a bonus token drawn from row 1.
* ``check_best_k`` (13.4): the number of drafts that emits the most tokens per millisecond at
  batch 1 and at batch 32, from the fixed step times ``VERIFY_MS`` and the acceptance rate
  ``ALPHA`` (``expected_tokens_per_verify`` is the expected tokens of one verify pass).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from nanoengine.spec_decode.rejection import accept_greedy
from translations import tr
from widgets.exercises import CheckResult, todo, verdict, whole
from widgets.exercises.ch08 import fit_p_value

# ------------------------------------------------------------------ exercise 13.1
# Token ids of a made-up step (no tokenizer needed): k=5 drafts, and the target model's argmax
# at each drafted position and after the last draft (k+1 = 6 rows of one verify pass).
GREEDY_DRAFTS: tuple[int, ...] = (1010, 2718, 3141, 1618, 1414)
GREEDY_TARGETS: tuple[int, ...] = (1010, 2718, 5772, 1618, 6931, 4669)


def _token_list(value, length: int) -> list[int] | None:
    """``value`` as a list of token ids (a list or tuple of whole numbers >= 0, at most ``length``), else None."""
    if not isinstance(value, (list, tuple)) or len(value) > length:
        return None
    ids = [whole(v, 0, 10**9) for v in value]
    return None if any(i is None for i in ids) else ids


def check_greedy_verify(emitted) -> CheckResult:
    """13.1: the tokens a greedy verify pass emits for GREEDY_DRAFTS against GREEDY_TARGETS."""
    drafts, targets = list(GREEDY_DRAFTS), list(GREEDY_TARGETS)
    k = len(drafts)
    if todo(emitted):
        return verdict("13.1", False, "", tr("replace ... with the list of token ids the verify pass emits, in "
                                             "order, then run the cell again."))
    ids = _token_list(emitted, 2 * k + 2)
    if ids is None:
        return verdict("13.1", False, "", tr("give a list of token ids (whole numbers >= 0), got {emitted!r}.",
                                             emitted=emitted))
    right = accept_greedy(targets, drafts)
    if ids == right:
        return verdict("13.1", True,
                       tr("the drafts are kept while each equals the target's argmax; at the first mismatch the "
                          "pass emits the target's own token, which plain greedy decoding would have produced "
                          "there, and stops: the rows after it were computed with a rejected draft in their "
                          "context. {n} tokens from one pass instead of one, and the text is plain greedy's.",
                          n=len(right)), "")
    m = len(right) - 1  # the first mismatch
    if not ids:
        hint = tr("a verify pass always emits at least one token: the target's row for the first position is "
                  "there.")
    elif len(ids) > m + 1 and ids[m] == drafts[m]:
        hint = tr("you kept a draft that is not the target's argmax at its position, and went on past it. Greedy "
                  "output must equal plain greedy decoding: which token would plain greedy decoding write there?")
    elif ids == drafts[:m + 1]:
        hint = tr("your last token is a draft the target disagrees with: at a mismatch the draft is rejected, "
                  "so it cannot be emitted. What does the target's own row say at that position?")
    elif ids == drafts[:m]:
        hint = tr("you emitted only the accepted drafts. The verify pass has already computed the target's own "
                  "token at the first mismatch, for free: a pass emits one token more than it accepts.")
    elif len(ids) == m + 2 and ids[-1] == targets[k]:
        hint = tr("the token after the last draft is a bonus only when every draft was accepted: its row was "
                  "computed with the drafts in its context, and here one of them was rejected.")
    elif len(ids) > m + 1:
        hint = tr("you emitted tokens past the first rejected draft. The rows after it were computed with that "
                  "wrong draft in their context, so they are not what the target would say.")
    else:
        hint = tr("walk the drafts in order against the target's argmax at the same position: keep a draft while "
                  "they agree; at the first disagreement emit the target's token and stop; if all agree, emit "
                  "the last row's token too.")
    return verdict("13.1", False, "", hint)


# ------------------------------------------------------------------ exercise 13.2
ROLLBACK_START = 62  # tokens with valid KV (num_computed_tokens) before the step
ROLLBACK_DRAFTS = 10  # k drafts checked: the step computes the last token and the 10 drafts, 11 rows
ROLLBACK_ACCEPTED = 1  # drafts the model agreed with
ROLLBACK_BLOCK_SIZE = 8  # tokens per KV block


def _roll_back(start: int, num_drafts: int, num_accepted: int, block_size: int) -> tuple[int, int, int]:
    """(num_computed_tokens, num_tokens, blocks kept) of a request after one verify pass, as the engine does it.

    Before the step the request has ``start`` tokens with KV and one more, its newest token,
    without. The pass writes KV for that token and for every draft, but only the newest token
    and the accepted drafts hold tokens the request really has (``Scheduler.accept_token``); the
    token emitted after the accepted run was just sampled and has no KV yet. The request keeps
    the blocks its tokens need and gives back the rest (``BlockManager.release_slots_after``);
    when every draft was accepted, the emitted token may need a block the step never allocated
    (slots went to the newest token and the drafts only), which the next step allocates.
    """
    if not 0 <= num_accepted <= num_drafts:
        raise ValueError(f"need 0 <= num_accepted <= num_drafts, got {num_accepted} of {num_drafts}")
    computed = start + 1 + num_accepted
    tokens = computed + 1
    allocated = -(-(start + 1 + num_drafts) // block_size)
    return computed, tokens, min(allocated, -(-tokens // block_size))


def _blocks(tokens: int) -> int:
    return -(-tokens // ROLLBACK_BLOCK_SIZE)


def check_roll_back(answer) -> CheckResult:
    """13.2: (tokens with valid KV, tokens of the request, blocks kept) after the verify pass."""
    if todo(answer) or (isinstance(answer, tuple) and any(todo(v) for v in answer)):
        return verdict("13.2", False, "", tr("replace each ... with a whole number: (tokens with valid KV, "
                                             "tokens the request has, blocks it keeps), then run the cell again."))
    if not isinstance(answer, (tuple, list)) or len(answer) != 3:
        return verdict("13.2", False, "", tr("give three whole numbers as a tuple (computed, tokens, blocks); got "
                                             "{answer!r}.", answer=answer))
    values = [whole(v, 0, 10**6) for v in answer]
    if any(v is None for v in values):
        return verdict("13.2", False, "", tr("each of the three must be a whole number >= 0; got {answer!r}.",
                                             answer=answer))
    computed, tokens, blocks = values
    start, k, a = ROLLBACK_START, ROLLBACK_DRAFTS, ROLLBACK_ACCEPTED
    right = _roll_back(start, k, a, ROLLBACK_BLOCK_SIZE)
    if (computed, tokens, blocks) == right:
        return verdict("13.2", True,
                       tr("the newest token and the accepted drafts now have valid KV; the token emitted after "
                          "them was only just sampled, so its KV comes with the next step; and the blocks that held "
                          "only rejected drafts go back to the pool, their guesses never read and never hashed."),
                       "")
    wrong = []
    if computed != right[0]:
        if computed == start + 1 + k:
            wrong.append(tr("tokens with valid KV: the pass wrote KV for every draft, but a rejected draft's KV "
                            "belongs to a token the request does not have"))
        elif computed == right[0] + 1:
            wrong.append(tr("tokens with valid KV: the token emitted after the accepted run was sampled from the "
                            "last row's logits; no pass has fed it through the model yet"))
        elif computed == start + a:
            wrong.append(tr("tokens with valid KV: the step fed the request's newest token too, not only the drafts"))
        else:
            wrong.append(tr("tokens with valid KV: count which of the rows the pass computed hold tokens the request "
                            "keeps"))
    if tokens != right[1]:
        if tokens in (start + 1 + k, start + 2 + k):
            wrong.append(tr("tokens of the request: rejected drafts are not part of it"))
        elif tokens == right[1] - 1:
            wrong.append(tr("tokens of the request: a verify pass emits one token more than it accepts"))
        else:
            wrong.append(tr("tokens of the request: add up what it had before the step and what the pass emitted"))
    if blocks != right[2]:
        if blocks == _blocks(start + 1 + k):
            wrong.append(tr("blocks: you kept the blocks allocated for all the drafts; those that held only "
                            "rejected drafts are given back"))
        elif blocks == _blocks(right[0]):
            wrong.append(tr("blocks: every token of the request needs a slot, the one whose KV is still to come too"))
        else:
            wrong.append(tr("blocks: a request keeps the blocks of {bs} tokens that its tokens fill, the last "
                            "one perhaps partly", bs=ROLLBACK_BLOCK_SIZE))
    return verdict("13.2", False, "", "; ".join(wrong) + ".")


# ------------------------------------------------------------------ exercise 13.3
# A small vocabulary: row 0 is the target's distribution at the drafted position, row 1 after
# the draft (where an accepted draft's bonus token is drawn from). (2, 6)
ACCEPT_PROBS = torch.tensor([[0.35, 0.25, 0.15, 0.12, 0.08, 0.05],
                             [0.05, 0.10, 0.40, 0.05, 0.30, 0.10]], dtype=torch.float64)
ACCEPT_DRAFTS = (0, 4)  # a likely draft and an unlikely one (p = 0.35 and 0.08)
ACCEPT_DRAWS = 10_000  # calls per draft
ACCEPT_MIN_P_VALUE = 1e-4  # a right rule fails a fit one time in ten thousand; the seed is fixed
ACCEPT_SIGMAS = 4.5  # the acceptance share may stray this many binomial standard deviations from p(draft)


def _run_accept(accept, draft: int, seed: int, draws: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    vocab = ACCEPT_PROBS.shape[1]
    outputs = []
    for _ in range(draws):
        out = accept(ACCEPT_PROBS.clone(), draft, generator)
        if isinstance(out, torch.Tensor):
            out = out.tolist()
        ids = _token_list(out, 2)
        if not ids or any(t >= vocab for t in ids):
            raise TypeError(tr("accept(probs, draft, generator) must return a list of 1 or 2 token ids in "
                               "[0, {vocab}); got {out!r}", vocab=vocab, out=out))
        outputs.append(ids)
    return outputs


def check_accept(accept) -> CheckResult:
    """13.3: a one-hot acceptance rule: the first token has p's distribution; accepted drafts get a bonus."""
    if todo(accept):
        return verdict("13.3", False, "", tr("fill in the line marked # TODO so that accept(probs, draft, "
                                             "generator) returns the list of tokens emitted, then run the cell "
                                             "again."))
    if not callable(accept):
        return verdict("13.3", False, "", tr("accept must be a function, got {kind}.", kind=type(accept).__name__))
    p, bonus_row = ACCEPT_PROBS[0], ACCEPT_PROBS[1]
    for seed, draft in enumerate(ACCEPT_DRAFTS):
        try:
            outputs = _run_accept(accept, draft, seed, ACCEPT_DRAWS)
            again = _run_accept(accept, draft, seed, 200)
        except (TypeError, RuntimeError, ValueError, IndexError) as err:
            return verdict("13.3", False, "", tr("calling accept(probs, draft={draft}, generator) failed: {err}",
                                                 draft=draft, err=err))
        if again != outputs[:200]:
            return verdict("13.3", False, "", tr("two runs with generators seeded the same gave different tokens: "
                                                 "take every random number from the generator you are given."))
        where = tr("draft {draft} (p = {p:.2f})", draft=draft, p=float(p[draft]))
        if any(len(o) == 2 and o[0] != draft for o in outputs):
            return verdict("13.3", False, "", tr("{where}: a two-token output means the draft was accepted, so "
                                                 "its first token must be the draft itself.", where=where))
        accepted = sum(len(o) == 2 for o in outputs)
        share = accepted / ACCEPT_DRAWS
        sigma = math.sqrt(float(p[draft]) * (1 - float(p[draft])) / ACCEPT_DRAWS)
        first = torch.tensor([o[0] for o in outputs])
        fits = fit_p_value(first, p) >= ACCEPT_MIN_P_VALUE
        rejected = [o[0] for o in outputs if len(o) == 1]
        seen = tr("{where}: accepted in {percent:.1f}% of {draws:,} calls", where=where, percent=100 * share,
                  draws=ACCEPT_DRAWS)
        if accepted == 0 and fits:
            return verdict("13.3", False, "", tr("{where}: no call ever returned two tokens. When the draft is "
                                                 "accepted the pass has also computed the row after it: emit one "
                                                 "more token, drawn from that row.", where=where))
        if abs(share - float(p[draft])) > ACCEPT_SIGMAS * sigma:
            if share == 1.0:
                why = tr("every draft was accepted, so the output is whatever the proposer guessed, not the model")
            elif abs(share - (1 - float(p[draft]))) <= ACCEPT_SIGMAS * sigma:
                why = tr("the more likely the model finds the draft, the less often you keep it: check the "
                         "comparison")
            else:
                why = tr("for the first token to keep the model's distribution, how often must the draft be kept?")
            return verdict("13.3", False, "", tr("{seen}, and the first token does not follow the model's "
                                                 "distribution: {why}.", seen=seen, why=why))
        if rejected and any(t == draft for t in rejected):
            share_x = sum(t == draft for t in rejected) / len(rejected)
            return verdict("13.3", False, "", tr("{seen}, which is right, but after a rejection your resample gave "
                                                 "the draft itself {percent:.1f}% of the time, so the draft comes "
                                                 "out more often than the model says: what must the resample "
                                                 "leave out?", seen=seen, percent=100 * share_x))
        if not fits:
            return verdict("13.3", False, "", tr("{seen}, which is right, but the tokens drawn after a rejection do "
                                                 "not follow the model's distribution over the other tokens: which "
                                                 "distribution must they come from?", seen=seen))
        bonus = torch.tensor([o[1] for o in outputs if len(o) == 2])
        if fit_p_value(bonus, bonus_row) < ACCEPT_MIN_P_VALUE:
            return verdict("13.3", False, "", tr("{seen}, and the first token is right, but the bonus token after "
                                                 "an accepted draft does not follow the distribution at its own "
                                                 "position.", seen=seen))
    return verdict("13.3", True,
                   tr("over {draws:,} calls for each of the drafts {drafts}, the first token fits the model's "
                      "distribution, the draft is kept as often as the model gives it, and the bonus follows the "
                      "next row: a draft x is kept with probability p(x), and otherwise every other token y comes "
                      "out with (1 - p(x)) * p(y) / (1 - p(x)) = p(y). Speculation changes the speed, not the "
                      "text's distribution.", draws=ACCEPT_DRAWS, drafts=list(ACCEPT_DRAFTS)), "")


# ------------------------------------------------------------------ exercise 13.4
# A FIXED example, not a measurement of this machine, so that the check is the same everywhere:
# step time (ms) of one verify pass with 1..8 query tokens per sequence (the newest token and
# 0..7 drafts). At batch 1 the step reads the weights once whatever the rows (memory-bound,
# nearly flat); at batch 32 the rows multiply by 32 and the matmuls become compute-bound, so the
# time grows about in proportion to the query tokens.
VERIFY_MS: dict[int, tuple[float, ...]] = {
    1: (10.0, 10.1, 10.2, 10.35, 10.5, 10.7, 11.0, 11.5),
    32: (12.0, 19.0, 26.5, 34.0, 42.0, 50.5, 59.0, 68.0),
}
ALPHA = 0.7  # acceptance rate: each draft is accepted with this probability, independently
MAX_DRAFTS = len(VERIFY_MS[1]) - 1  # k from 0 (no speculation) to 7


def expected_tokens_per_verify(alpha: float, k: int) -> float:
    """Expected tokens one verify pass emits with k drafts, each accepted with probability ``alpha``.

    The run of accepted drafts stops at the first rejection, and the pass always emits one
    token more (the correction or the bonus): 1 + alpha + alpha**2 + ... + alpha**k
    = (1 - alpha**(k+1)) / (1 - alpha). k = 0 is plain decoding: one token.
    """
    if not 0 <= alpha <= 1 or k < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and k >= 0, got alpha={alpha}, k={k}")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def _best_k(batch: int, expected=expected_tokens_per_verify) -> int:
    """The k in 0..MAX_DRAFTS with the most expected tokens per millisecond at ``batch``."""
    times = VERIFY_MS[batch]
    return max(range(MAX_DRAFTS + 1), key=lambda k: expected(ALPHA, k) / times[k])


def _linear_expected(alpha: float, k: int) -> float:  # the mistake: every draft counted as if independent
    return 1 + k * alpha


def check_best_k(answer) -> CheckResult:
    """13.4: (best k at batch 1, best k at batch 32) by expected tokens per millisecond."""
    if todo(answer) or (isinstance(answer, tuple) and any(todo(v) for v in answer)):
        return verdict("13.4", False, "", tr("replace each ... with a number of drafts k from 0 to {most}: (k at "
                                             "batch 1, k at batch 32), then run the cell again.", most=MAX_DRAFTS))
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        return verdict("13.4", False, "", tr("give two whole numbers as a tuple (k at batch 1, k at batch 32); "
                                             "got {answer!r}.", answer=answer))
    ks = [whole(v, 0, MAX_DRAFTS) for v in answer]
    if any(k is None for k in ks):
        return verdict("13.4", False, "", tr("each k must be a whole number from 0 to {most}; got {answer!r}.",
                                             most=MAX_DRAFTS, answer=answer))
    right = (_best_k(1), _best_k(32))
    if tuple(ks) == right:
        return verdict("13.4", True,
                       tr("at batch 1 a verify pass costs about one decode step, so drafts are nearly free until "
                          "the extra rows start to cost more than the ever-smaller chance that a later draft is "
                          "reached; at batch 32 each extra row costs time in proportion, and the expected gain of "
                          "another draft shrinks geometrically, so speculation pays for far fewer drafts."), "")
    linear = (_best_k(1, _linear_expected), _best_k(32, _linear_expected))
    if tuple(ks) == linear:
        return verdict("13.4", False, "", tr("your choice is what 1 + k * alpha tokens per pass would give. But "
                                             "draft i counts only if drafts 1..i-1 were all accepted: the later "
                                             "drafts are reached less and less often."))
    notes = []
    if ks[0] == ks[1] and ks[0] != right[1]:
        notes.append(tr("you chose the same k for both batches, but their step times grow very differently with "
                        "the query tokens"))
    if ks[1] != right[1]:
        if ks[1] == MAX_DRAFTS:
            notes.append(tr("at batch 32 the most drafts is not the best: the step time grows with every query "
                            "token"))
        else:
            notes.append(tr("at batch 32 another k gives more expected tokens per millisecond"))
    if ks[0] != right[0]:
        notes.append(tr("at batch 1 another k gives more expected tokens per millisecond: even a nearly flat step "
                        "time grows a little, and a later draft is reached ever less often"))
    return verdict("13.4", False, "", tr("{notes}. Divide the expected tokens of a pass by its step time for every "
                                         "k.", notes="; ".join(notes)))


__all__ = ["ACCEPT_DRAFTS", "ACCEPT_DRAWS", "ACCEPT_PROBS", "ALPHA", "GREEDY_DRAFTS", "GREEDY_TARGETS", "MAX_DRAFTS",
           "ROLLBACK_ACCEPTED", "ROLLBACK_BLOCK_SIZE", "ROLLBACK_DRAFTS", "ROLLBACK_START", "VERIFY_MS",
           "check_accept", "check_best_k", "check_greedy_verify", "check_roll_back", "expected_tokens_per_verify"]
