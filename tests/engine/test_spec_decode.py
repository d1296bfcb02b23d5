"""Speculative decoding's parts (nanoengine/spec_decode): config, prompt lookup, the acceptance rule."""

from __future__ import annotations

import pytest
import torch

from nanoengine.config import EngineConfig
from nanoengine.spec_decode import NgramProposer, SpeculativeConfig, accept_drafts, accept_greedy, propose_ngram


# ------------------------------------------------------------------ config
def test_config_defaults_follow_vllm():
    assert (SpeculativeConfig(num_speculative_tokens=3).prompt_lookup_min,
            SpeculativeConfig(num_speculative_tokens=3).prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=4)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize("values, message", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer >= 1"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0, "prompt_lookup_max": 2}, "prompt_lookup_min must be"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle' is not supported"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown speculative_config key\\(s\\) \\['draft_model'\\]"),
])
def test_bad_configs_say_what_was_wrong(values, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", speculative_config=values)


# ------------------------------------------------------------------ prompt lookup
def test_a_batch_size_schedule_gives_each_size_its_k_as_vllm_does():
    config = SpeculativeConfig(num_speculative_tokens=6,  # the ranges unsorted, a k above 6
                               num_speculative_tokens_per_batch_size=[[4, 8, 2], [1, 1, 9], [16, 32, 0]])
    assert config.num_speculative_tokens_per_batch_size == ((1, 1, 9), (4, 8, 2), (16, 32, 0))
    # 1: its range's 9, capped at 6; 2-3 between ranges and 9-15: the range before's; past the last: the last's
    assert [config.tokens_for_batch(b) for b in (1, 2, 3, 4, 8, 9, 15, 16, 32, 100)] == [6, 6, 6, 2, 2, 2, 2, 0, 0, 0]
    assert SpeculativeConfig(num_speculative_tokens=3).tokens_for_batch(50) == 3


@pytest.mark.parametrize("schedule, message", [
    ([], "non-empty list"),
    ([[1, 4]], "three integers"),
    ([[1, 4, 2.5]], "three integers"),
    ([[2, 4, 2]], "must start at batch size 1"),
    ([[1, 4, 2], [4, 8, 1]], "overlap"),
    ([[1, 4, -1]], "k >= 0"),
    ([[3, 1, 2]], "1 <= first <= last"),
])
def test_bad_batch_size_schedules_are_refused(schedule, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(num_speculative_tokens=2, num_speculative_tokens_per_batch_size=schedule)


def test_prompt_lookup_takes_the_longest_suffix_at_its_earliest_match():
    assert propose_ngram([1, 2, 3, 4, 2, 3], k=4, max_n=3, min_n=2) == [4, 2, 3]  # vLLM's own example
    # [7, 8] occurs twice before the end: the earliest occurrence proposes what followed it
    assert propose_ngram([7, 8, 1, 7, 8, 2, 7, 8], k=1, max_n=2, min_n=1) == [1]
    # a 3-gram match wins over a more recent 1-gram match
    assert propose_ngram([5, 6, 9, 4, 0, 9, 5, 6, 9], k=2, max_n=3, min_n=1) == [4, 0]
    assert propose_ngram([1, 2, 3], k=2, max_n=2, min_n=1) == []  # nothing repeats
    assert propose_ngram([4], k=2, max_n=2, min_n=1) == []
    assert propose_ngram([3, 3, 3, 3], k=5, max_n=2, min_n=1) == [3, 3]  # fewer when the context ends


def test_the_proposer_never_drafts_past_the_request_or_the_model():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2,
                                               prompt_lookup_min=1), max_model_len=20)
    context = [1, 2, 3, 4, 5, 6, 1, 2]
    assert proposer.propose(context, max_tokens_left=10) == [3, 4, 5, 6]
    assert proposer.propose(context, max_tokens_left=3) == [3, 4]  # a verify pass adds one more token
    assert proposer.propose(context, max_tokens_left=1) == []
    assert proposer.propose(context, max_tokens_left=10, k=2) == [3, 4]  # this step's k, from a schedule
    assert NgramProposer(proposer.config, max_model_len=10).propose(context, max_tokens_left=10) == [3]


# ------------------------------------------------------------------ the acceptance rule
def test_greedy_keeps_drafts_while_they_are_the_argmax():
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all kept, plus the bonus
    assert accept_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]  # the first mismatch emits the argmax
    assert accept_greedy([3], []) == [3]
    one_hot = torch.nn.functional.one_hot(torch.tensor([4, 9, 6, 7]), 12).float()
    assert accept_drafts(one_hot, [4, 5, 6]) == [4, 9]  # the sampling rule on one-hot rows agrees


def _first_token_distribution(p: torch.Tensor, draft: int, rule, n: int = 40_000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    probs = torch.stack([p, p])  # k = 1: the draft's row and the bonus row
    counts = torch.zeros_like(p)
    for _ in range(n):
        counts[rule(probs, [draft], gen)[0]] += 1
    return counts / n


@pytest.mark.slow
@pytest.mark.parametrize("draft", [0, 2, 4], ids=["likely draft", "middling draft", "unlikely draft"])
def test_the_first_emitted_token_has_the_targets_distribution_whatever_the_draft(draft):
    """Chapter 8's kind of test: the empirical distribution over 40,000 draws against p.

    A wrong rule is caught: always accepting gives the draft probability 1; resampling from p
    on rejection (without removing the draft) gives it p(x) + (1 - p(x)) p(x).
    """
    p = torch.tensor([0.45, 0.25, 0.15, 0.10, 0.05])
    emitted = _first_token_distribution(p, draft, accept_drafts)
    assert (emitted - p).abs().max() < 0.01, (emitted, p)

    def resample_from_p(probs, drafts, gen):
        if float(torch.rand((), generator=gen)) < float(probs[0, drafts[0]]):
            return [drafts[0]]
        return [int(torch.multinomial(probs[0], 1, generator=gen))]

    biased = _first_token_distribution(p, draft, resample_from_p)
    assert (biased - p).abs().max() > 0.02  # the test would see the bias


def test_a_seed_reproduces_the_emitted_tokens_and_bad_shapes_are_refused():
    probs = torch.softmax(torch.randn(4, 30, generator=torch.Generator().manual_seed(1)), dim=-1)
    runs = [accept_drafts(probs, [3, 7, 11], torch.Generator().manual_seed(5)) for _ in range(2)]
    assert runs[0] == runs[1] and 1 <= len(runs[0]) <= 4
    with pytest.raises(ValueError, match=r"probs must be \(k\+1, vocab\) for k=3 drafts"):
        accept_drafts(probs[:3], [3, 7, 11])
    with pytest.raises(ValueError, match="need k\\+1=3 target tokens"):
        accept_greedy([1, 2], [1, 2])
