"""Chapter 7's exercise checks (widgets.exercises.ch07): placeholders and bad values are
"not yet", the checks judge what the prefix cache did, and the helpers measure what they say."""

from __future__ import annotations

import re

import pytest

from nanoengine import LLM
from widgets.exercises import ch07


@pytest.fixture(scope="module")
def text_llm(tiny_llama_tok_dir):
    """A tiny random Llama with SmolLM2's tokenizer: prefix hits depend on tokens, not on weights."""
    return LLM(str(tiny_llama_tok_dir), device="cpu", max_model_len=512, num_kv_blocks=64)


@pytest.mark.parametrize("check", [ch07.check_pool_size, ch07.check_prefix_padding])
@pytest.mark.parametrize("value", [..., None, "14", 2.5, True, -1, 10**6])
def test_placeholders_and_bad_values_are_not_yet(check, value) -> None:
    result = check(value)
    assert not result.right and str(result).startswith(f"Exercise {result.exercise}: not yet. Hint: ")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [..., None, 42, "{rules}{date}", "{rules}{date}{question}{x}",
                                    "{rules}{date}{question}{rules}", "{rules", "{0}{date}{question}"])
def test_prompt_layout_refuses_placeholders_and_malformed_layouts(text_llm, layout) -> None:
    result = ch07.check_prompt_layout(layout, text_llm)
    assert not result.right and str(result).startswith("Exercise 7.3: not yet. Hint: ")


@pytest.mark.slow
def test_pool_size_hits_grow_one_block_at_a_time_until_both_prompts_fit() -> None:
    blocks = ch07.TENANT_PROMPT_LEN // 16
    for n in (8, 10, 14):
        r = ch07.tenant_turns(n)
        assert r.cached_tokens[:2] == (0, 0)  # each tenant's first request finds nothing
        # the head of a prompt is freed last, so it is evicted last: a smaller pool keeps a shorter head
        assert set(r.later_requests) == {16 * min(blocks, n - 8)}
    assert ch07.check_pool_size(14).right
    assert not ch07.check_pool_size(13).right  # 12 for the two prompts + 1: a request needs 2 of its own
    assert not ch07.check_pool_size(12).right  # the two system prompts alone
    too_big = ch07.check_pool_size(15)
    assert not too_big.right and "14" not in str(too_big)  # says what is wrong, not the answer


def test_block_size_must_divide_the_shared_prefix() -> None:
    assert ch07.shared_prefix_hits(16) == (0, 96, 96)
    assert ch07.shared_prefix_hits(20) == (0, 100, 100)
    assert ch07.shared_prefix_hits(128) == (0, 0, 0)  # the prefix never fills a block


def test_exercise_7_2_accepts_the_fewest_tokens_that_align_the_prefix() -> None:
    assert ch07.padded_prefix_hits(0) == ((0, 96, 96), 100)
    assert ch07.padded_prefix_hits(12) == ((0, 112, 112), 112)
    assert ch07.check_prefix_padding(12).right
    for wrong in (0, 4, 11, 13):  # no padding; 104 is not a multiple of 16; one short; one over
        assert not ch07.check_prefix_padding(wrong).right
    result = ch07.check_prefix_padding(28)  # 128 tokens: aligned too, but not the fewest
    assert not result.right and "all of it, but" in str(result) and not re.search(r"\b12\b", str(result))


@pytest.mark.slow
def test_prompt_layout_shares_the_rules_only_when_they_come_first(text_llm) -> None:
    hits, rules_tokens = ch07.layout_hits("Today is {date}.\n{rules}\nQuestion: {question}", text_llm)
    assert hits == (0, 0, 0)
    hits, rules_tokens = ch07.layout_hits("{rules}\nToday is {date}.\nQuestion: {question}", text_llm)
    assert hits[0] == 0 and all(h == 16 * (rules_tokens // 16) for h in hits[1:])
    assert ch07.check_prompt_layout("{rules}\n{question}\n{date}", text_llm).right
    assert not ch07.check_prompt_layout("{question}\n{rules}\n{date}", text_llm).right


def test_hash_cost_reading_follows_its_numbers() -> None:
    # the saved run: 1.0 µs per block, 3.9x Python's hash, 61 ns per token
    seen = ch07.read_hash_cost(0.98e-6, 0.25e-6, 61e-9)
    assert "under a microsecond" in seen and "several times slower" in seen and "the same order as" in seen
    assert "about a microsecond" in ch07.read_hash_cost(1.01e-6, 0.25e-6, 61e-9)
    assert "a few microseconds" in ch07.read_hash_cost(2.1e-6, 0.25e-6, 61e-9)
    assert "tens of microseconds" in ch07.read_hash_cost(10.1e-6, 0.25e-6, 61e-9)
    assert "somewhat slower" in ch07.read_hash_cost(1.9e-6, 1.0e-6, 61e-9)
    assert "about as fast" in ch07.read_hash_cost(1.0e-6, 1.0e-6, 61e-9)
    assert "faster" in ch07.read_hash_cost(0.7e-6, 1.0e-6, 61e-9)
    assert "well below" in ch07.read_hash_cost(1e-6, 1e-6, 30e-9)
    assert "well above" in ch07.read_hash_cost(1e-6, 1e-6, 700e-9)


def test_ttft_agreement_reading_follows_its_numbers() -> None:
    assert "the same within 5%" in ch07.read_ttft_agreement(1.039, 1.040)
    # the saved run's warm medians, 61 ms against 66.7 ms: not "the same"
    below = ch07.read_ttft_agreement(0.061, 0.0667)
    assert "below the wall time" in below and "same" not in below
    assert "the same within 5%" in ch07.read_ttft_agreement(0.0636, 0.0667)
    assert "above the wall time" in ch07.read_ttft_agreement(0.075, 0.0667)


def test_cache_speedup_reading_follows_its_numbers() -> None:
    assert "less, because" in ch07.read_cache_speedup(15.6, 40)
    assert "about the ratio of tokens" in ch07.read_cache_speedup(38, 40)
    assert "about the ratio of tokens" in ch07.read_cache_speedup(43, 40)
    assert "more than the tokens alone" in ch07.read_cache_speedup(45, 40)
