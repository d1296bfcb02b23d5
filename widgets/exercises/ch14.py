"""Exercise checks of chapter 14 (structured output): read a mask, size a step's bitmask, write a matcher.

Every scenario is fixed in this module, so each check gives the same verdict on every machine
and needs no model; what a check compares against is the engine's own code
(``nanoengine.structured_output.backend``) or the rule the engine's manager follows
(``StructuredOutputManager.grammar_bitmask``):

* ``check_unpack`` (14.1): the token ids allowed by the packed row ``MASK_WORDS`` over a
  vocabulary of ``MASK_VOCAB`` tokens; right is what ``apply_token_bitmask`` leaves finite.
* ``check_bitmask_shape`` (14.2): the shape of the bitmask of the step ``STEP_REQUESTS`` (which
  requests sample, which are constrained, how many drafts each checks) over ``STEP_VOCAB`` tokens.
* ``check_choice_matcher`` (14.3): the learner's ``allowed_tokens(prefix)`` for the constraint
  ``choice=CHOICES`` over the toy vocabulary ``TOY_VOCAB`` (``EOS`` ends the output), checked at
  every prefix in ``PREFIXES``.
"""

from __future__ import annotations

import torch

from nanoengine.structured_output.backend import BITS, apply_token_bitmask
from translations import tr
from widgets.exercises import CheckResult, todo, verdict, whole

# ------------------------------------------------------------------ exercise 14.1
MASK_VOCAB = 40  # tokens 0..39; the row has ceil(40 / 32) = 2 words, the last 24 bits past the vocabulary
MASK_WORDS: tuple[int, ...] = (0b1000_0000_0000_0000_0000_0001_0010_0110 - 2**32, 0b1111_1111_0000_0101)


def unpack(words: tuple[int, ...], vocab: int) -> list[int]:
    """The allowed token ids of one packed row, by the engine's own ``apply_token_bitmask``."""
    logits = torch.zeros(1, vocab)
    apply_token_bitmask(logits, torch.tensor([list(words)], dtype=torch.int32))
    return [int(t) for t in torch.nonzero(torch.isfinite(logits[0])).flatten()]


def _msb_first(words: tuple[int, ...], vocab: int) -> list[int]:  # the mistake: bit 31 read as the first token
    ids = []
    for w, word in enumerate(words):
        for b in range(BITS):
            if (word >> (BITS - 1 - b)) & 1:
                ids.append(w * BITS + b)
    return [t for t in ids if t < vocab]


def _ids(value, limit: int) -> list[int] | None:
    if not isinstance(value, (list, tuple, set, frozenset)) or len(value) > limit:
        return None
    ids = [whole(v, -10**9, 10**9) for v in value]
    return None if any(i is None for i in ids) else sorted(ids)


def check_unpack(allowed) -> CheckResult:
    """14.1: the token ids that the row MASK_WORDS allows over MASK_VOCAB tokens."""
    if todo(allowed):
        return verdict("14.1", False, "", tr("replace ... with the list of allowed token ids, then run the cell "
                                             "again."))
    ids = _ids(allowed, 2 * BITS * len(MASK_WORDS))
    if ids is None:
        return verdict("14.1", False, "", tr("give a list of token ids (whole numbers), got {allowed!r:.80}.",
                                             allowed=allowed))
    right = unpack(MASK_WORDS, MASK_VOCAB)
    if ids == right:
        return verdict("14.1", True,
                       tr("token t is bit t % 32 of word t // 32, counted from the least significant bit; the "
                          "first word is negative only because its bit 31 is set, and the bits past token {last} "
                          "are ignored: the row is wider than the vocabulary. {n} tokens allowed of {vocab}.",
                          last=MASK_VOCAB - 1, n=len(right), vocab=MASK_VOCAB), "")
    if ids == _msb_first(MASK_WORDS, MASK_VOCAB):
        hint = tr("you read each word from its most significant bit. Token t is bit t % 32, counted from bit 0.")
    elif any(t >= MASK_VOCAB for t in ids):
        hint = tr("some of your ids are {vocab} or more: the vocabulary has {vocab} tokens, and the bits after "
                  "them in the last word are padding.", vocab=MASK_VOCAB)
    elif set(ids) < set(right):
        hint = tr("you are missing allowed tokens: did you read every bit of both words, the sign bit included?")
    else:
        hint = tr("one of your ids has its bit at 0. Write each word in binary and number its bits from the "
                  "right.")
    return verdict("14.1", False, "", hint)


# ------------------------------------------------------------------ exercise 14.2
STEP_VOCAB = 49_152
#: (request, constrained?, drafts it checks this step); every request listed samples this step.
STEP_REQUESTS: tuple[tuple[str, bool, int], ...] = (("a", True, 3), ("b", False, 0), ("c", True, 0),
                                                     ("d", False, 4), ("e", True, 2))


def bitmask_shape(requests=STEP_REQUESTS, vocab: int = STEP_VOCAB) -> tuple[int, int]:
    """The engine's rule (``grammar_bitmask``): one row per logits row that samples, every request's
    (1 + drafts); ceil(vocab / 32) words per row."""
    return sum(1 + drafts for _, _, drafts in requests), -(-vocab // BITS)


def check_bitmask_shape(shape) -> CheckResult:
    """14.2: (rows, int32 words per row) of the step's bitmask."""
    if todo(shape) or (isinstance(shape, tuple) and any(v is ... for v in shape)):
        return verdict("14.2", False, "", tr("replace each ... with a whole number: (rows, words per row), then "
                                             "run the cell again."))
    if not isinstance(shape, (tuple, list)) or len(shape) != 2 or any(whole(v, 0, 10**7) is None for v in shape):
        return verdict("14.2", False, "", tr("give two whole numbers (rows, words per row), got {shape!r:.80}.",
                                             shape=shape))
    rows, words = (int(v) for v in shape)
    right_rows, right_words = bitmask_shape()
    constrained = [(n, c, d) for n, c, d in STEP_REQUESTS if c]
    hints = []
    if words != right_words:
        hints.append(tr("a row packs 32 tokens per int32 word, and a last partial word still counts")
                     if words != STEP_VOCAB else tr("the row is packed: how many tokens does one int32 hold?"))
    if rows != right_rows:
        if rows == sum(1 + d for _, _, d in constrained) or rows == len(constrained):
            hints.append(tr("the runner applies the mask to all the step's logits rows at once, so unconstrained "
                            "requests have rows too (all ones)"))
        elif rows == len(STEP_REQUESTS):
            hints.append(tr("a request that checks k drafts samples at k + 1 positions, and each needs its own "
                            "row"))
        else:
            hints.append(tr("count the logits rows that sample: each request's own position plus one per draft"))
    if not hints:
        return verdict("14.2", True,
                       tr("{rows} rows (each request's 1 + drafts, constrained or not) of {words} words: "
                          "{kib:.0f} KiB filled on the CPU and applied in one pass; a step with no constrained "
                          "request makes none at all.", rows=right_rows, words=right_words,
                          kib=right_rows * right_words * 4 / 1024), "")
    return verdict("14.2", False, "", "; ".join(hints) + ".")


# ------------------------------------------------------------------ exercise 14.3
CHOICES: tuple[str, ...] = ("yes", "no", "not sure")
EOS = "<eos>"
TOY_VOCAB: tuple[str, ...] = ("y", "ye", "yes", "es", "s", "n", "no", "not", "o", "t", " ", " sure", "sure", "e",
                              "nos", EOS)
PREFIXES: tuple[str, ...] = ("", "y", "ye", "n", "no", "not", "not ", "not sure", "yes", "x")


def choice_allowed(prefix: str) -> set[str]:
    """The rule a matcher for ``choice=CHOICES`` follows: a token may come next if the text with it is
    still the start of some choice; EOS only once the text is a whole choice."""
    allowed = {t for t in TOY_VOCAB if t != EOS and any(c.startswith(prefix + t) for c in CHOICES)}
    return allowed | ({EOS} if prefix in CHOICES else set())


def check_choice_matcher(allowed_tokens) -> CheckResult:
    """14.3: the learner's ``allowed_tokens(prefix)`` against ``choice_allowed`` at every prefix in PREFIXES."""
    if todo(allowed_tokens) or not callable(allowed_tokens):
        return verdict("14.3", False, "", tr("fill in the line marked # TODO so that allowed_tokens(prefix) "
                                             "returns the set of TOY_VOCAB tokens allowed next, then run the cell "
                                             "again."))
    for prefix in PREFIXES:
        try:
            got = allowed_tokens(prefix)
        except Exception as exc:  # the learner's code: say where it failed, not a traceback
            return verdict("14.3", False, "", tr("allowed_tokens({prefix!r}) raised {kind}: {exc}.", prefix=prefix,
                                                 kind=type(exc).__name__, exc=exc))
        if not isinstance(got, (set, frozenset, list, tuple)):
            return verdict("14.3", False, "", tr("allowed_tokens({prefix!r}) should return a set of tokens, got "
                                                 "{kind}.", prefix=prefix, kind=type(got).__name__))
        got, right = set(got), choice_allowed(prefix)
        if got == right:
            continue
        if EOS in right and EOS not in got:
            hint = tr("after {prefix!r} the output is already a whole choice: what must be allowed so it can end?",
                      prefix=prefix)
        elif EOS in got and EOS not in right:
            hint = tr("after {prefix!r} the output is not one of the choices yet, so it may not end there.",
                      prefix=prefix)
        elif got - right:
            hint = tr("after {prefix!r} you allow a token with which the text is no longer the start of any "
                      "choice (being inside a choice is not enough: the output begins at its first character).",
                      prefix=prefix)
        else:
            hint = tr("after {prefix!r} you miss a token: a token may cover several characters, and a prefix "
                      "that is a whole choice may still continue into a longer one.", prefix=prefix)
        return verdict("14.3", False, "", hint)
    return verdict("14.3", True,
                   tr("a token is allowed when the text with it is still the start of a choice, EOS when the text "
                      "is a whole choice; after 'no' both 't' and EOS are allowed, because 'not sure' goes on. "
                      "llguidance does the same over the tokenizer's 49,152 tokens with a trie, not a loop."), "")
