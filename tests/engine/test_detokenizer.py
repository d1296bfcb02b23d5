"""Incremental detokenization (chapter 8): streamed deltas never show half a character or a stop string."""

from __future__ import annotations

import copy

import pytest

from nanoengine.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, token_decoder
from nanoengine.loader.weights import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_tok_dir):
    return load_tokenizer(tiny_llama_tok_dir)  # SmolLM2's byte-level BPE


def stream(tokenizer, text: str, stop: tuple[str, ...] = ()) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = [detok.update([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]
    return detok, deltas


@pytest.mark.parametrize("text", ["안녕하세요, 세계!", "naïve café 🙂🚀 done", "plain ascii text"])
def test_multibyte_characters_are_never_split(tokenizer, text):
    detok, deltas = stream(tokenizer, text)
    assert "".join(deltas) == detok.text == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    if text.startswith("안"):  # some Korean characters take two byte-level tokens: held back once
        assert "" in deltas[:-1]


def test_a_stop_string_is_cut_and_its_prefix_held_back(tokenizer):
    detok, deltas = stream(tokenizer, "The answer is 42. END of story", stop=("END",))
    assert detok.stop_hit == "END"
    assert "".join(deltas) == detok.text == "The answer is 42. "
    # No delta ever showed text the final result dropped.
    assert all("E" not in d for d in deltas)


def test_a_tail_that_could_start_a_stop_string_is_released_when_it_does_not(tokenizer):
    detok, deltas = stream(tokenizer, "Say STOP not STORE", stop=("STOP!",))
    assert detok.stop_hit is None and "".join(deltas) == "Say STOP not STORE"
    assert detok.flushed


def test_without_a_tokenizer_there_is_no_text():
    detok = IncrementalDetokenizer(None)
    assert detok.update([1, 2, 3], finished=True) == "" and detok.text == "" and detok.flushed


def test_the_window_gives_the_whole_decode_and_reads_a_bounded_number_of_tokens(tokenizer):
    import random

    rng = random.Random(0)
    text = "Streaming 안녕하세요 🙂 naïve text, " * 20
    sequences = [tokenizer.encode(text, add_special_tokens=False),
                 [rng.randrange(tokenizer.vocab_size) for _ in range(400)]]  # random ids: broken bytes too
    for ids in sequences:
        decoded = []
        detok = IncrementalDetokenizer(tokenizer)
        real = detok.decode_ids
        detok.decode_ids = lambda t, skip: decoded.append(len(t)) or real(t, skip)
        deltas = [detok.update([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]
        whole = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert "".join(deltas) == detok.text == whole
        assert max(decoded) <= 16  # a window of a few tokens, never the whole output


def test_the_direct_decoder_is_the_tokenizers_own_decode(tokenizer):
    """The Rust call the fast path makes returns what ``decode`` returns (clean-up off),
    special tokens and broken bytes included; a tokenizer that decodes its own way keeps it."""
    import random

    rng = random.Random(1)
    decode = token_decoder(tokenizer)
    assert decode.__code__ is not token_decoder(object()).__code__  # the fast path was taken
    special = list(tokenizer.all_special_ids)
    for _ in range(300):
        ids = [rng.choice(special) if rng.random() < 0.2 else rng.randrange(tokenizer.vocab_size)
               for _ in range(rng.randrange(13))]
        for skip in (True, False):
            assert decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip,
                                                         clean_up_tokenization_spaces=False)

    class Shouting(type(tokenizer)):
        def decode(self, token_ids, **kwargs):
            return super().decode(token_ids, **kwargs).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    ids = tokenizer.encode("quiet words", add_special_tokens=False)
    assert token_decoder(shouting)(ids, True) == "QUIET WORDS"
    assert IncrementalDetokenizer(shouting).update(ids, finished=True) == "QUIET WORDS"
