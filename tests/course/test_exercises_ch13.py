"""Chapter 13's exercise checks (widgets.exercises.ch13): placeholders and bad values are "not yet",
the right answer passes, plausible wrong answers are rejected with feedback that does not give the
answer away, and the answers agree with the engine's own rules. No model is loaded."""

from __future__ import annotations

import math

import pytest
import torch

from nanoengine import SamplingParams
from nanoengine.events import DraftsVerified
from nanoengine.spec_decode.rejection import accept_drafts, accept_greedy
from widgets._common import tiny_engine
from widgets.exercises import ch13


def _text(result) -> str:
    return " ".join(str(result).split())


def _not_yet(result) -> bool:
    return not result.right and "not yet. Hint: " in _text(result)


# ------------------------------------------------------------------ 13.1
GREEDY_RIGHT = accept_greedy(ch13.GREEDY_TARGETS, ch13.GREEDY_DRAFTS)
MISMATCH = len(GREEDY_RIGHT) - 1


def test_the_greedy_scenario_has_its_first_mismatch_in_the_middle() -> None:
    assert len(ch13.GREEDY_DRAFTS) == 5 and len(ch13.GREEDY_TARGETS) == 6
    assert 1 <= MISMATCH <= 3 and ch13.GREEDY_DRAFTS[MISMATCH] != ch13.GREEDY_TARGETS[MISMATCH]
    later = range(MISMATCH + 1, 5)  # a draft after the mismatch agrees with its row: a trap for "keep every match"
    assert any(ch13.GREEDY_DRAFTS[i] == ch13.GREEDY_TARGETS[i] for i in later)


@pytest.mark.parametrize("value", [..., None, "1010 2718", 3, [1.5], [-1], [True], {1010}])
def test_greedy_placeholders_and_bad_values_are_not_yet(value) -> None:
    assert _not_yet(ch13.check_greedy_verify(value))


def test_greedy_right_answer_passes_as_list_or_tuple() -> None:
    assert ch13.check_greedy_verify(list(GREEDY_RIGHT)).right
    assert ch13.check_greedy_verify(tuple(GREEDY_RIGHT)).right


D, T, K = list(ch13.GREEDY_DRAFTS), list(ch13.GREEDY_TARGETS), len(ch13.GREEDY_DRAFTS)
GREEDY_WRONG = {
    "draft kept at the mismatch": D[:MISMATCH + 1],
    "only the accepted drafts": D[:MISMATCH],
    "bonus after a mismatch": T[:MISMATCH + 1] + [T[K]],
    "every draft": D,
    "every draft and the bonus": D + [T[K]],
    "every target row": T,
    "matching drafts only, skipping the mismatch": [d for d, t in zip(D, T) if d == t],
    "nothing": [],
}


@pytest.mark.parametrize("name", GREEDY_WRONG)
def test_greedy_wrong_answers_are_rejected_without_giving_the_answer(name) -> None:
    result = ch13.check_greedy_verify(GREEDY_WRONG[name])
    assert _not_yet(result), name
    text = _text(result)
    assert str(GREEDY_RIGHT) not in text and str(tuple(GREEDY_RIGHT)) not in text
    assert str(ch13.GREEDY_TARGETS[MISMATCH]) not in text  # not even the correction token


# ------------------------------------------------------------------ 13.2
START, K2, A, B = ch13.ROLLBACK_START, ch13.ROLLBACK_DRAFTS, ch13.ROLLBACK_ACCEPTED, ch13.ROLLBACK_BLOCK_SIZE
ROLL_RIGHT = (START + 1 + A, START + A + 2, math.ceil((START + A + 2) / B))


@pytest.mark.parametrize("value", [..., None, (..., ..., ...), (64, ..., 9), (64, 65), "64, 65, 9", (64.0, 65, 9),
                                   (64, 65, -1), (True, 65, 9)])
def test_roll_back_placeholders_and_bad_values_are_not_yet(value) -> None:
    assert _not_yet(ch13.check_roll_back(value))


def test_roll_back_right_answer_passes() -> None:
    assert ch13.check_roll_back(ROLL_RIGHT).right and ch13.check_roll_back(list(ROLL_RIGHT)).right


ROLL_WRONG = {
    "every draft's KV counted": (START + 1 + K2, START + A + 2, ROLL_RIGHT[2]),
    "the emitted token counted as computed": (START + A + 2, START + A + 2, ROLL_RIGHT[2]),
    "blocks of every draft kept": (ROLL_RIGHT[0], ROLL_RIGHT[1], math.ceil((START + 1 + K2) / B)),
    "the newest token's KV forgotten": (START + A, START + A + 2, ROLL_RIGHT[2]),
    "the emitted token not counted": (ROLL_RIGHT[0], START + A + 1, ROLL_RIGHT[2]),
    "blocks for the computed tokens only": (ROLL_RIGHT[0], ROLL_RIGHT[1], math.ceil(ROLL_RIGHT[0] / B)),
    "no roll-back at all": (START + 1 + K2, START + K2 + 2, math.ceil((START + 1 + K2) / B)),
}


def test_the_scenario_leaves_blocks_to_give_back() -> None:
    assert ROLL_RIGHT == ch13._roll_back(START, K2, A, B) and A < K2
    assert math.ceil((START + 1 + K2) / B) > ROLL_RIGHT[2] > math.ceil(ROLL_RIGHT[0] / B)


def test_the_roll_back_constants_tell_the_wrong_answers_apart() -> None:
    assert len(set(ROLL_WRONG.values()) | {ROLL_RIGHT}) == len(ROLL_WRONG) + 1
    assert all(wrong[i] != ROLL_RIGHT[i] for wrong in ROLL_WRONG.values() for i in range(3)
               if wrong[i] != ROLL_RIGHT[i])


@pytest.mark.parametrize("name", ROLL_WRONG)
def test_roll_back_wrong_answers_are_rejected_without_giving_the_answer(name) -> None:
    result = ch13.check_roll_back(ROLL_WRONG[name])
    assert _not_yet(result), name
    text = _text(result)
    assert str(ROLL_RIGHT) not in text
    for number in ROLL_RIGHT:  # none of the right numbers is named
        assert f" {number}" not in text and f"({number}" not in text, (name, text)


@pytest.mark.slow  # builds a tiny engine
def test_roll_back_arithmetic_is_the_engines() -> None:
    """On a live tiny engine that speculates, every verify pass leaves the request as _roll_back says."""
    block_size = 4
    engine = tiny_engine(num_kv_blocks=64, block_size=block_size, max_model_len=128, vocab_size=64, seed=1,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                             "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    seen: list = []
    engine.events.subscribe(seen.append)
    phrase = [11, 12, 13, 14, 15, 16]
    rid = engine.add_request([30, 31] + phrase * 3, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    checked = 0
    while engine.has_unfinished_requests():
        before = {r.request_id: r for r in engine.snapshot().running}
        seen.clear()
        engine.step()
        after = {r.request_id: r for r in engine.snapshot().running}
        for event in seen:
            if isinstance(event, DraftsVerified) and event.request_id in after and event.request_id in before:
                start = before[rid].num_computed_tokens
                want = ch13._roll_back(start, len(event.draft_token_ids), event.num_accepted, block_size)
                got = after[rid]
                assert (got.num_computed_tokens, got.num_tokens, len(got.block_ids)) == want
                checked += 1
    assert checked >= 3 and engine.spec_decode_stats.num_accepted_tokens > 0


# ------------------------------------------------------------------ 13.3
def engine_rule(probs, draft, generator):  # the worked solution: the engine's own rule with one draft
    return accept_drafts(probs, [draft], generator)


def written_rule(probs, draft, generator):  # the same rule written out, drawing its numbers differently
    p = probs[0]
    if torch.rand(1, generator=generator).item() < p[draft]:
        return [draft, int(torch.multinomial(probs[1], 1, generator=generator))]
    rest = p.clone()
    rest[draft] = 0
    return [int(torch.multinomial(rest / rest.sum(), 1, generator=generator))]


@pytest.mark.parametrize("value", [..., None, "accept", 3])
def test_accept_placeholders_and_bad_values_are_not_yet(value) -> None:
    assert _not_yet(ch13.check_accept(value))


@pytest.mark.parametrize("bad", [lambda p, x, g: "x", lambda p, x, g: [], lambda p, x, g: [x, 0, 1],
                                 lambda p, x, g: [99], lambda p, x: [x]])
def test_accept_functions_that_return_nonsense_or_fail_are_not_yet(bad) -> None:
    assert _not_yet(ch13.check_accept(bad))


@pytest.mark.slow  # ACCEPT_DRAWS calls per draft
@pytest.mark.parametrize("rule", [engine_rule, written_rule])
def test_right_acceptance_rules_pass(rule) -> None:
    result = ch13.check_accept(rule)
    assert result.right, str(result)


def _u(g) -> float:
    return float(torch.rand((), generator=g, dtype=torch.float64))


def _bonus(probs, g) -> int:
    return int(torch.multinomial(probs[1], 1, generator=g))


def _without(p, x):
    rest = p.clone()
    rest[x] = 0
    return rest / rest.sum()


ACCEPT_WRONG = {
    "always accept": (lambda p, x, g: [x, _bonus(p, g)], "every draft was accepted"),
    "resample without removing the draft": (
        lambda p, x, g: [x, _bonus(p, g)] if _u(g) < p[0, x] else [int(torch.multinomial(p[0], 1, generator=g))],
        "leave out"),
    "accept with 1 - p(x)": (
        lambda p, x, g: [x, _bonus(p, g)] if _u(g) > p[0, x] else [int(torch.multinomial(_without(p[0], x), 1,
                                                                                          generator=g))],
        "check the comparison"),
    "resample uniformly": (
        lambda p, x, g: [x, _bonus(p, g)] if _u(g) < p[0, x] else [int(torch.multinomial(
            _without(torch.ones_like(p[0]), x), 1, generator=g))],
        "other tokens"),
    "no bonus token": (
        lambda p, x, g: [x] if _u(g) < p[0, x] else [int(torch.multinomial(_without(p[0], x), 1, generator=g))],
        "two tokens"),
    "bonus from the first row": (
        lambda p, x, g: [x, int(torch.multinomial(p[0], 1, generator=g))] if _u(g) < p[0, x]
        else [int(torch.multinomial(_without(p[0], x), 1, generator=g))],
        "bonus token"),
    "greedy rule on a sampled request": (
        lambda p, x, g: [x, _bonus(p, g)] if int(p[0].argmax()) == x else [int(p[0].argmax())],
        "not follow"),
    "a fresh generator": (lambda p, x, g: engine_rule(p, x, torch.Generator().manual_seed(
        int(torch.randint(0, 2**30, ())))), "seeded the same"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ACCEPT_WRONG)
def test_plausible_wrong_acceptance_rules_are_rejected(name) -> None:
    rule, says = ACCEPT_WRONG[name]
    result = ch13.check_accept(rule)
    text = _text(result)
    assert _not_yet(result) and says in text, (name, text)
    assert "p(x)" not in text and "1 - p" not in text  # the rule is not spelled out


# ------------------------------------------------------------------ 13.4
def _tokens_per_ms(batch: int, k: int, expected) -> float:
    return expected(ch13.ALPHA, k) / ch13.VERIFY_MS[batch][k]


def _best(batch: int, expected) -> int:
    return max(range(ch13.MAX_DRAFTS + 1), key=lambda k: _tokens_per_ms(batch, k, expected))


def geometric(alpha, k):
    return sum(alpha ** i for i in range(k + 1))


BEST_RIGHT = (_best(1, geometric), _best(32, geometric))


def test_expected_tokens_per_verify_is_the_geometric_sum() -> None:
    for k in range(8):
        assert ch13.expected_tokens_per_verify(0.7, k) == pytest.approx(geometric(0.7, k))
    assert ch13.expected_tokens_per_verify(1.0, 3) == 4 and ch13.expected_tokens_per_verify(0.0, 3) == 1
    with pytest.raises(ValueError):
        ch13.expected_tokens_per_verify(1.5, 2)


def test_the_fixed_tables_are_flat_at_batch_1_and_grow_at_batch_32() -> None:
    t1, t32 = ch13.VERIFY_MS[1], ch13.VERIFY_MS[32]
    assert len(t1) == len(t32) == 8 and list(t1) == sorted(t1) and list(t32) == sorted(t32)
    assert t1[-1] / t1[0] < 1.2 and t32[-1] / t32[0] > 4
    steps = [b - a for a, b in zip(t32, t32[1:])]
    assert max(steps) / min(steps) < 1.5  # roughly linear


@pytest.mark.parametrize("value", [..., None, (..., ...), (6, ...), (6,), "6, 1", (6, 8), (-1, 1), (6.0, 1),
                                   (True, 1)])
def test_best_k_placeholders_and_bad_values_are_not_yet(value) -> None:
    assert _not_yet(ch13.check_best_k(value))


def test_best_k_right_answer_passes() -> None:
    assert 0 < BEST_RIGHT[1] < BEST_RIGHT[0] < ch13.MAX_DRAFTS  # neither end of the range: it needs computing
    assert ch13.check_best_k(BEST_RIGHT).right and ch13.check_best_k(list(BEST_RIGHT)).right


BEST_WRONG = {
    "1 + k * alpha": (_best(1, lambda a, k: 1 + k * a), _best(32, lambda a, k: 1 + k * a)),
    "step time ignored: the most drafts": (ch13.MAX_DRAFTS, ch13.MAX_DRAFTS),
    "batch 1's table for both": (BEST_RIGHT[0], BEST_RIGHT[0]),
    "no speculation at batch 32": (BEST_RIGHT[0], 0),
    "tokens per step without the step time": (_best(1, lambda a, k: geometric(a, k) * ch13.VERIFY_MS[1][k]),
                                              _best(32, lambda a, k: geometric(a, k) * ch13.VERIFY_MS[32][k])),
}


@pytest.mark.parametrize("name", BEST_WRONG)
def test_best_k_wrong_answers_are_rejected_without_giving_the_answer(name) -> None:
    wrong = BEST_WRONG[name]
    assert wrong != BEST_RIGHT, name
    result = ch13.check_best_k(wrong)
    text = _text(result)
    assert _not_yet(result), name
    assert str(BEST_RIGHT) not in text and f"k={BEST_RIGHT[0]}" not in text and f"k={BEST_RIGHT[1]}" not in text
