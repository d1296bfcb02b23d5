"""Exercise checks of chapter 8 (sampling): top-p, temperature, seeds and n.

Each check takes the value the learner chose and judges what the engine does with it on
the real default model (SmolLM2-135M-Instruct), through the engine's public API and the
sampler's public functions (``nanoengine.layers.sampler``), never the learner's code:

* ``check_top_p`` (8.1): a ``top_p`` that keeps exactly ``KEEP_TOKENS`` tokens of the next-token
  distribution after ``PEAKED_PROMPT`` (temperature 1, no other filter), counted with the
  engine's own ``kept_mask``;
* ``check_temperature`` (8.2): a temperature that puts the most likely token after
  ``PEAKED_PROMPT`` between ``TOP_PROB_LOW`` and ``TOP_PROB_HIGH``, computed with the engine's
  ``sampling_probs``;
* ``check_gumbel_draw`` (8.3): the learner's ``draw(logits, generator)`` must pick one token per
  row as the argmax of the logits plus noise (the Gumbel-max trick, the log form of vLLM v1's
  exponential race): its draws must fit the softmax of the logits (Pearson's chi-square over
  ``GUMBEL_DRAWS`` rows of the real logits after ``STORY_PROMPT``'s top ``GUMBEL_TOKENS``), be
  reproducible from the generator, and be *coupled* the way an argmax of fixed noise is:
  raising one token's logit, with the same random numbers, may only switch a draw *to* that
  token, never to a third one (an inverse-CDF draw, one uniform number looked up in the
  cumulative probabilities, fits the distribution but fails this).
"""

from __future__ import annotations

import torch

from nanoengine import LLM, LLMEngine
from nanoengine.layers.sampler import kept_mask, sampling_probs
from translations import tr
from widgets._common import single_thread, token_label
from widgets.exercises import CheckResult, todo, verdict, whole

PEAKED_PROMPT = "The capital of France is"  # exercises 8.1 and 8.2: a confident next token
KEEP_TOKENS = 3  # exercise 8.1
TOP_PROB_LOW, TOP_PROB_HIGH = 0.40, 0.50  # exercise 8.2
STORY_PROMPT = "Once upon a time, there was a"  # exercise 8.3: an open next token
GUMBEL_TOKENS = 20  # exercise 8.3: the story prompt's 20 most likely tokens
GUMBEL_DRAWS = 20_000  # rows drawn at once
GUMBEL_MIN_P_VALUE = 1e-3  # a right draw fails the fit test one time in a thousand; the seed is fixed


def _engine(llm_or_engine) -> LLMEngine:
    if isinstance(llm_or_engine, LLM):
        return llm_or_engine.engine
    if isinstance(llm_or_engine, LLMEngine):
        return llm_or_engine
    raise TypeError(f"pass the chapter's LLM (or its engine), got {type(llm_or_engine).__name__}")


def _number(value, low: float, high: float) -> float | None:
    """``value`` as a float in (low, high], or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value) if low < value <= high else None


def peaked_logits(engine: LLMEngine) -> torch.Tensor:
    """The model's next-token logits after ``PEAKED_PROMPT``. (vocab,) float32"""
    return engine.next_token_logits(PEAKED_PROMPT).float().cpu()


# ------------------------------------------------------------------ exercise 8.1
def kept_by_top_p(engine: LLMEngine, top_p: float) -> list[int]:
    """Token ids that top-p alone (temperature 1) keeps after ``PEAKED_PROMPT``, most likely first."""
    logits = peaked_logits(engine)
    with single_thread():
        keep = kept_mask(logits[None], 1.0, -1, top_p, 0.0)[0]  # (V,) the engine's own filter
    ids = torch.nonzero(keep).flatten()
    return ids[logits[ids].argsort(descending=True)].tolist()


def check_top_p(llm, top_p) -> CheckResult:
    """8.1: a top_p that keeps exactly KEEP_TOKENS tokens after PEAKED_PROMPT."""
    engine = _engine(llm)
    if todo(top_p):
        return verdict("8.1", False, "", tr("replace ... with a top_p (a number above 0 and at most 1), then run "
                                            "the cell again."))
    p = _number(top_p, 0.0, 1.0)
    if p is None:
        return verdict("8.1", False, "", tr("top_p must be a number above 0 and at most 1, got {value!r}.",
                                            value=top_p))
    kept = kept_by_top_p(engine, p)
    probs = torch.softmax(peaked_logits(engine), dim=-1)
    shown = ", ".join(f"{token_label(engine, t)!r} {float(probs[t]):.4f}" for t in kept[:6])
    seen = tr("top_p={p:g} keeps {n} token(s) ({shown})", p=p, n=len(kept),
              shown=shown + (", ..." if len(kept) > 6 else ""))
    fields = dict(seen=seen, keep=KEEP_TOKENS, fewer=KEEP_TOKENS - 1)
    hint = (tr("{seen}; {keep} asked. Lower p: add up the sorted probabilities and put p between the sum of the top "
               "{fewer} and the sum of the top {keep}.", **fields) if len(kept) > KEEP_TOKENS else
            tr("{seen}; {keep} asked. Raise p: add up the sorted probabilities and put p between the sum of the top "
               "{fewer} and the sum of the top {keep}.", **fields))
    return verdict("8.1", len(kept) == KEEP_TOKENS,
                   tr("{seen}. Top-p keeps a token while the mass of the tokens before it is below p, so any p "
                      "above the mass of the top {fewer} and at most that of the top {keep} keeps exactly {keep}.",
                      **fields),
                   hint)


# ------------------------------------------------------------------ exercise 8.2
def top_probability(engine: LLMEngine, temperature: float) -> float:
    """The most likely token's probability after ``PEAKED_PROMPT`` at this temperature, no filter."""
    logits = peaked_logits(engine)
    with single_thread():
        return float(sampling_probs(logits[None], temperature, -1, 1.0, 0.0)[0].max())


def check_temperature(llm, temperature) -> CheckResult:
    """8.2: a temperature putting the top token's probability in [TOP_PROB_LOW, TOP_PROB_HIGH)."""
    engine = _engine(llm)
    if todo(temperature):
        return verdict("8.2", False, "", tr("replace ... with a temperature (a number above 0, at most 10), then "
                                            "run the cell again."))
    t = _number(temperature, 0.0, 10.0)
    if t is None:
        return verdict("8.2", False, "", tr("temperature must be a number above 0 and at most 10 (0 is greedy, "
                                            "which has no distribution to shape), got {value!r}.", value=temperature))
    top = top_probability(engine, t)
    at_one = top_probability(engine, 1.0)
    if t != 1.0:
        seen = tr("at temperature {t:g} the top token has probability {top:.3f} (at temperature 1 it has "
                  "{at_one:.3f})", t=t, top=top, at_one=at_one)
    else:
        seen = tr("at temperature {t:g} the top token has probability {top:.3f}", t=t, top=top)
    right = TOP_PROB_LOW <= top < TOP_PROB_HIGH
    fields = dict(seen=seen, low=TOP_PROB_LOW, high=TOP_PROB_HIGH)
    hint = (tr("{seen}; aim for {low:g} to {high:g}: raise the temperature (T > 1 flattens, T < 1 sharpens).",
               **fields) if top >= TOP_PROB_HIGH else
            tr("{seen}; aim for {low:g} to {high:g}: lower the temperature (T > 1 flattens, T < 1 sharpens).",
               **fields))
    return verdict("8.2", right,
                   tr("{seen}. Dividing the logits by T > 1 shrinks the gaps between them, so the softmax "
                      "flattens and the top token loses probability to the rest; no token is removed.", seen=seen),
                   hint)


# ------------------------------------------------------------------ exercise 8.3
def story_head_logits(engine: LLMEngine) -> torch.Tensor:
    """The ``GUMBEL_TOKENS`` highest logits after ``STORY_PROMPT``, most likely first. (K,) float32"""
    return engine.next_token_logits(STORY_PROMPT).float().cpu().topk(GUMBEL_TOKENS).values


def fit_p_value(draws: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of integer draws in [0, K) against probabilities (K,)."""
    n = draws.numel()
    observed = torch.bincount(draws, minlength=probs.numel()).double()
    expected = n * probs.double()
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = probs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _run_draw(draw, logits: torch.Tensor, seed: int):
    out = draw(logits, torch.Generator().manual_seed(seed))
    if not isinstance(out, torch.Tensor) or out.shape != (logits.shape[0],) or out.dtype.is_floating_point:
        raise TypeError(tr("draw(logits, generator) must return one integer index per row, a tensor of shape "
                           "({rows},); got {kind} {shape}", rows=logits.shape[0], kind=type(out).__name__,
                           shape=tuple(getattr(out, "shape", ()))))
    return out.long()


def check_gumbel_draw(llm, draw) -> CheckResult:
    """8.3: a Gumbel-max draw: fits the softmax, reproducible, and coupled like an argmax of noise."""
    engine = _engine(llm)
    if todo(draw):
        return verdict("8.3", False, "", tr("fill in the line marked # TODO (noise = ...) so that draw(logits, "
                                            "generator) returns one token index per row, then run the cell again."))
    if not callable(draw):
        return verdict("8.3", False, "", tr("draw must be a function, got {kind}.", kind=type(draw).__name__))
    head = story_head_logits(engine)
    probs = torch.softmax(head.double(), dim=-1)
    rows = head[None].expand(GUMBEL_DRAWS, -1).contiguous()
    try:
        first = _run_draw(draw, rows, seed=0)
        again = _run_draw(draw, rows, seed=0)
    except (TypeError, RuntimeError, ValueError) as err:
        return verdict("8.3", False, "", tr("calling draw(logits, generator) on a ({rows}, {k}) batch failed: "
                                            "{error}", rows=GUMBEL_DRAWS, k=GUMBEL_TOKENS, error=err))
    if first.min() < 0 or first.max() >= GUMBEL_TOKENS:
        return verdict("8.3", False, "", tr("the indices must be in [0, {k}); got {low} to {high}.",
                                            k=GUMBEL_TOKENS, low=int(first.min()), high=int(first.max())))
    if not torch.equal(first, again):
        return verdict("8.3", False, "", tr("two calls with generators seeded the same gave different draws: take "
                                            "every random number from the generator you are given."))
    p_value = fit_p_value(first, probs)
    top_share = float((first == 0).double().mean())
    fields = dict(draws=GUMBEL_DRAWS, tokens=GUMBEL_TOKENS, share=100 * top_share, expected=100 * float(probs[0]),
                  min_p=GUMBEL_MIN_P_VALUE)
    if p_value >= GUMBEL_MIN_P_VALUE:
        seen = tr("{draws:,} draws over the story prompt's {tokens} likeliest tokens: the most likely token came up "
                  "{share:.1f}% of the time against {expected:.1f}% expected; fit to the softmax: yes (chi-square "
                  "p-value at least {min_p:g})", **fields)
    else:
        seen = tr("{draws:,} draws over the story prompt's {tokens} likeliest tokens: the most likely token came up "
                  "{share:.1f}% of the time against {expected:.1f}% expected; fit to the softmax: no (chi-square "
                  "p-value below {min_p:g})", **fields)
    if p_value < GUMBEL_MIN_P_VALUE:
        return verdict("8.3", False, "", tr("{seen}. The noise you add does not turn the argmax into a draw from "
                                            "the softmax: what distribution must the noise have, for the largest "
                                            "of logit + noise to be token t with probability p_t?", seen=seen))
    raised = rows.clone()
    bump = 5
    raised[:, bump] += 1.0  # the same rows with one token's logit raised
    moved = _run_draw(draw, raised, seed=0)
    changed = moved != first
    to_third = int((changed & (moved != bump)).sum())
    to_raised = int((changed & (moved == bump)).sum())
    coupled = to_third == 0 and to_raised > 0
    return verdict("8.3", coupled,
                   tr("{seen}; raising token {bump}'s logit by 1 with the same random numbers moved draws only to "
                      "that token. An argmax of logit + Gumbel noise is vLLM v1's exponential race in logarithms "
                      "(argmax p/E with E exponential): one random number per token, no sort, no cumulative sum, and "
                      "a raised logit can only win draws, never move them elsewhere.", seen=seen, bump=bump),
                   tr("{seen}, but raising token {bump}'s logit by 1 with the same random numbers changed {changed:,} "
                      "draws, {to_raised:,} of them to that token and {to_third:,} to another one. With one fixed "
                      "random number per token and an argmax, raising one logit can only make that token win: draw "
                      "by taking an argmax, not by walking the cumulative probabilities.",
                      seen=seen, bump=bump, changed=int(changed.sum()), to_raised=to_raised, to_third=to_third))


__all__ = ["GUMBEL_DRAWS", "GUMBEL_TOKENS", "KEEP_TOKENS", "PEAKED_PROMPT", "STORY_PROMPT", "TOP_PROB_HIGH",
           "TOP_PROB_LOW", "check_gumbel_draw", "check_temperature", "check_top_p", "fit_p_value",
           "kept_by_top_p", "peaked_logits", "story_head_logits", "top_probability"]
