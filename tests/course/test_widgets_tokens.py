"""Tests for widgets.tokens: token chips that show byte-level tokens as the bytes they carry.

On SmolLM2's real tokenizer (loaded alone, without the model): Korean and emoji are written
with byte-level tokens, which used to appear as chips like '\ufffd183' with no explanation.
"""

from __future__ import annotations

import html

import pytest

from widgets.tokens import TokenEditor, render_token_chips, token_bytes, token_chips, token_pieces

KOREAN_AND_EMOJI = "LLM 추론은 안녕하세요 😀!"


@pytest.fixture(scope="module")
def tokenizer():
    from nanoengine import default_model_dir
    from nanoengine.loader.weights import load_tokenizer

    return load_tokenizer(default_model_dir())


@pytest.mark.slow
def test_pieces_carry_exactly_the_texts_bytes_and_groups_spell_whole_characters(tokenizer) -> None:
    ids = tokenizer.encode(KOREAN_AND_EMOJI, add_special_tokens=False)
    pieces = token_pieces(tokenizer, ids)
    assert [p.token_id for p in pieces] == ids
    assert b"".join(p.raw for p in pieces) == KOREAN_AND_EMOJI.encode("utf-8")
    groups = {p.group_start: p for p in pieces}
    assert "".join(groups[k].group_text for k in sorted(groups)) == KOREAN_AND_EMOJI
    fragments = [p for p in pieces if p.is_byte_fragment]
    assert fragments, "SmolLM2 has no single token for these characters: some tokens must be bytes"
    assert all(p.group_size > 1 for p in fragments)
    emoji = next(p for p in pieces if "😀" in p.group_text)
    assert b"".join(p.raw for p in pieces[emoji.group_start:emoji.group_start + emoji.group_size]).endswith(
        "😀".encode("utf-8"))


def test_whole_tokens_decode_as_the_tokenizer_decodes_them(tokenizer) -> None:
    """The byte table is right: every token that is whole text reads as the tokenizer's decode."""
    ids = tokenizer.encode("The capital of France is Paris. 2024, naïve café " + KOREAN_AND_EMOJI,
                           add_special_tokens=False)
    for piece in token_pieces(tokenizer, ids):
        if not piece.is_byte_fragment:
            assert piece.text == tokenizer.decode([piece.token_id]), piece
        assert token_bytes(tokenizer, piece.token_id) == piece.raw


def test_byte_chips_show_their_bytes_and_an_explanation_not_replacement_characters(tokenizer) -> None:
    ids, chips = token_chips(tokenizer, KOREAN_AND_EMOJI)
    assert "\ufffd" not in chips  # the old chips showed '\ufffd' and the id, nothing else
    assert "byte-level tokens" in chips and "ne-byte-note" in chips
    assert "F0 9F 98 80 = <b" in chips  # 😀 in UTF-8, under its group, then the character
    assert "😀" in html.unescape(chips)
    pieces = token_pieces(tokenizer, ids)
    pure = next(p for p in pieces if p.is_byte_fragment and min(p.raw) >= 0x80)  # only bytes of a character
    assert f"<span class='ne-token-bytes'>{pure.hex}</span><sub" in chips
    mixed = next(p for p in pieces if p.is_byte_fragment and p.raw.startswith(b" "))  # ' ' + a first byte
    assert f"␣<span class='ne-token-bytes'>{mixed.raw[1:].hex(' ').upper()}</span>" in chips


def test_plain_english_needs_no_byte_tokens_and_no_note(tokenizer) -> None:
    ids, chips = token_chips(tokenizer, "The capital of France is Paris.")
    assert "ne-byte-token" not in chips and "ne-byte-note" not in chips
    assert "␣capital" in chips and len(ids) == chips.count("class='ne-token'")


def test_the_editor_retokenizes_as_you_type(tokenizer) -> None:
    editor = TokenEditor(tokenizer, "hello")
    assert "ne-byte-note" not in editor.view.value
    editor.box.value = "😀"
    assert "F0 9F 98 80" in editor.view.value and "1 characters, 4 UTF-8 bytes" in editor.view.value
    editor.box.value = ""
    assert "0 tokens" in editor.view.value


def test_one_korean_syllable_is_three_byte_tokens_shown_as_one_group(tokenizer) -> None:
    """'안' is U+C548, UTF-8 EC 95 88; SmolLM2 spells it with one token per byte."""
    pieces = token_pieces(tokenizer, tokenizer.encode("안", add_special_tokens=False))
    assert [p.hex for p in pieces] == ["EC", "95", "88"] and all(p.is_byte_fragment for p in pieces)
    assert {(p.group_start, p.group_size, p.group_text) for p in pieces} == {(0, 3, "안")}
    rendered = render_token_chips(pieces)
    assert rendered.count("class='ne-byte-group'") == 1 and "EC 95 88 = <b style='font-size:14px'>안</b>" in rendered
