"""Chapter 14's exercise checks (widgets.exercises.ch14): placeholders and bad values are "not yet",
the right answers pass, plausible wrong answers are rejected with feedback that does not give the
answer away, and the answers agree with the engine's own code. No model is loaded."""

from __future__ import annotations

import pytest
import torch

from nanoengine.structured_output.backend import allocate_token_bitmask, apply_token_bitmask
from widgets.exercises import ch14


def _text(result) -> str:
    return " ".join(str(result).split())


def _not_yet(result) -> bool:
    return not result.right and "not yet. Hint: " in _text(result)


# ------------------------------------------------------------------ 14.1
RIGHT_IDS = ch14.unpack(ch14.MASK_WORDS, ch14.MASK_VOCAB)


def test_the_row_uses_the_sign_bit_and_padding_past_the_vocabulary() -> None:
    assert ch14.MASK_WORDS[0] < 0 and 31 in RIGHT_IDS  # bit 31 of word 0 set: a negative int32
    assert any((ch14.MASK_WORDS[1] >> b) & 1 for b in range(ch14.MASK_VOCAB - 32, 32))  # padding bits set


@pytest.mark.parametrize("value", [..., None, "1 2", 3, [1.5], [True] * 100])
def test_unpack_placeholders_and_bad_values_are_not_yet(value) -> None:
    assert _not_yet(ch14.check_unpack(value))


def test_unpack_right_answer_passes_in_any_order() -> None:
    assert ch14.check_unpack(RIGHT_IDS).right and ch14.check_unpack(list(reversed(RIGHT_IDS))).right


def test_unpack_rejects_msb_first_and_padding_bits() -> None:
    msb = ch14._msb_first(ch14.MASK_WORDS, ch14.MASK_VOCAB)
    assert msb != RIGHT_IDS and _not_yet(ch14.check_unpack(msb))
    with_padding = [t for t in range(64) if (ch14.MASK_WORDS[t // 32] >> (t % 32)) & 1]
    result = ch14.check_unpack(with_padding)
    assert _not_yet(result) and "padding" in _text(result) and str(RIGHT_IDS) not in _text(result)


# ------------------------------------------------------------------ 14.2
def test_the_shape_is_what_the_engine_allocates() -> None:
    rows, words = ch14.bitmask_shape()
    assert allocate_token_bitmask(rows, ch14.STEP_VOCAB).shape == (rows, words) == (14, 1536)


@pytest.mark.parametrize("value", [..., (..., ...), "14 1536", (14,), (14.0, 1536), (-1, 1536)])
def test_shape_placeholders_and_bad_values_are_not_yet(value) -> None:
    assert _not_yet(ch14.check_bitmask_shape(value))


@pytest.mark.parametrize("wrong", [(8, 1536), (3, 1536), (5, 1536), (14, 49152), (14, 1535)])
def test_shape_rejects_plausible_mistakes(wrong) -> None:
    result = ch14.check_bitmask_shape(wrong)
    assert _not_yet(result) and "14" not in _text(result).split("Hint:")[1]


def test_shape_right_answer_passes() -> None:
    assert ch14.check_bitmask_shape((14, 1536)).right and ch14.check_bitmask_shape([14, 1536]).right


# ------------------------------------------------------------------ 14.3
def _right(prefix):
    return ch14.choice_allowed(prefix)


def test_choice_rule_allows_eos_and_a_longer_choice_after_no() -> None:
    assert ch14.choice_allowed("no") == {"t", ch14.EOS}
    assert ch14.choice_allowed("x") == set()


def test_choice_placeholder_is_not_yet() -> None:
    def allowed_tokens(prefix):
        ...  # TODO: return the set

    assert _not_yet(ch14.check_choice_matcher(allowed_tokens))
    assert _not_yet(ch14.check_choice_matcher(42))


def test_choice_right_answer_passes() -> None:
    assert ch14.check_choice_matcher(_right).right


@pytest.mark.parametrize("wrong", [
    lambda p: _right(p) - {ch14.EOS},  # never ends
    lambda p: _right(p) | ({ch14.EOS} if p else set()),  # ends anywhere
    lambda p: {t for t in ch14.TOY_VOCAB if any(p + t in c for c in ch14.CHOICES)}
    | ({ch14.EOS} if p in ch14.CHOICES else set()),  # inside a choice instead of its start
    lambda p: {t for t in ch14.TOY_VOCAB if t != ch14.EOS and len(t) == 1 and any(c.startswith(p + t) for c in ch14.CHOICES)}
    | ({ch14.EOS} if p in ch14.CHOICES else set()),  # one character per token
    lambda p: 1 / 0,
])
def test_choice_rejects_plausible_mistakes(wrong) -> None:
    assert _not_yet(ch14.check_choice_matcher(wrong))


def test_unpack_agrees_with_a_mask_filled_bit_by_bit() -> None:
    row = allocate_token_bitmask(1, ch14.MASK_VOCAB)
    row[0] = torch.tensor(list(ch14.MASK_WORDS), dtype=torch.int32)
    logits = torch.zeros(1, ch14.MASK_VOCAB)
    apply_token_bitmask(logits, row)
    assert torch.nonzero(logits[0] == 0).flatten().tolist() == RIGHT_IDS
