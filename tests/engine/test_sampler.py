"""The sampler's filters and draws (the playground widget calls the same functions)."""

from __future__ import annotations

import pytest
import torch

from nanoengine.layers.sampler import Sampler, filter_logits, kept_mask
from nanoengine.sampling_params import SamplingParams


def test_top_p_one_keeps_the_whole_vocabulary():
    torch.manual_seed(0)
    logits = torch.randn(1, 49152) * 6  # peaked: the tail's preceding mass rounds to 1.0 in fp32
    assert int(kept_mask(logits, 1.0, -1, 1.0, 0.0).sum()) == 49152


def test_each_filter_cuts_what_it_should():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))
    assert kept_mask(logits, 1.0, 2, 1.0, 0.0).tolist() == [[True, True, False, False, False]]
    # top-p 0.8: 0.5 + 0.25 = 0.75 < 0.8, so the third token is still needed
    assert kept_mask(logits, 1.0, -1, 0.8, 0.0).tolist() == [[True, True, True, False, False]]
    # min-p 0.2: keep tokens with p >= 0.2 * 0.5 = 0.1
    assert kept_mask(logits, 1.0, -1, 1.0, 0.2).tolist() == [[True, True, True, False, False]]
    assert kept_mask(logits, 1.0, 0, 1.0, 0.0).all()  # top_k 0 = no limit


def test_temperature_scales_before_filtering():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    cold = torch.softmax(filter_logits(logits, 0.5, -1, 1.0, 0.0), -1)
    hot = torch.softmax(filter_logits(logits, 2.0, -1, 1.0, 0.0), -1)
    assert cold[0, 0] > torch.softmax(logits, -1)[0, 0] > hot[0, 0]


def test_rows_use_their_own_parameters_and_generators():
    logits = torch.randn(3, 100)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=1.0, top_k=1)]
    gens = [None, torch.Generator().manual_seed(5), None]
    result = Sampler()(logits, params, gens, torch.Generator().manual_seed(0))
    assert result.token_ids[0] == int(logits[0].argmax())
    assert result.token_ids[2] == int(logits[2].argmax())  # top-k 1 is greedy
    again = Sampler()(logits[1:2], [params[1]], [torch.Generator().manual_seed(5)])
    assert again.token_ids[0] == result.token_ids[1]  # the seed alone decides


def _candidate_distribution(logits: torch.Tensor, params: list[SamplingParams]):
    """The fast path's distribution scattered back over the vocabulary, and its exact flags."""
    probs, candidates, _, exact = Sampler._candidate_probs(logits, params)
    return torch.zeros_like(logits).scatter_(1, candidates, probs), exact


def test_candidate_filters_match_the_whole_vocabulary_definition():
    # Peaked rows, like a real model's: every filter's survivors lie among the top candidates.
    torch.manual_seed(1)
    logits = torch.randn(6, 49152) * 4
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
              SamplingParams(temperature=1.0, top_k=7),
              SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.3, min_p=0.05),
              SamplingParams(temperature=1.0, top_p=0.5, min_p=0.2),
              SamplingParams(temperature=0.5, top_k=2000, top_p=0.99, min_p=0.01)]
    fast, exact = _candidate_distribution(logits, params)
    assert exact.all()
    temperature, top_k, top_p, min_p = (torch.tensor([getattr(p, f) for p in params], dtype=torch.float32)[:, None]
                                        for f in ("temperature", "top_k", "top_p", "min_p"))
    reference = torch.softmax(filter_logits(logits, temperature, top_k.long(), top_p, min_p), dim=-1)
    assert torch.equal(fast > 0, reference > 0)  # the same tokens survive
    assert torch.allclose(fast, reference, atol=1e-6)


@pytest.mark.slow
def test_a_row_too_flat_for_its_candidates_falls_back_to_the_whole_vocabulary():
    torch.manual_seed(2)
    flat = torch.randn(2, 49152) * 0.01  # top-p 0.9 needs ~44,000 tokens here
    _, exact = _candidate_distribution(flat, [SamplingParams(top_p=0.9), SamplingParams(top_k=40, top_p=0.9)])
    assert exact.tolist() == [False, True]  # top-k bounds the second row, whatever its shape
    # The sampler then draws the flat row from the whole vocabulary, as kept_mask defines it.
    seen = {Sampler()(flat[:1], [SamplingParams(top_p=0.9, seed=s)], [torch.Generator().manual_seed(s)]).token_ids[0]
            for s in range(200)}
    assert len(seen) > 150 and max(seen) >= 1024  # far beyond any candidate list


def test_greedy_and_sampled_rows_mix_and_unseeded_rows_share_the_engine_generator():
    torch.manual_seed(3)
    logits = torch.randn(5, 1000) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=20),
              SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0)]
    first = Sampler()(logits, params, [None] * 5, torch.Generator().manual_seed(11)).token_ids
    again = Sampler()(logits, params, [None] * 5, torch.Generator().manual_seed(11)).token_ids
    assert first == again  # the engine's generator alone decides unseeded rows
    assert first[0] == int(logits[0].argmax()) and first[3] == int(logits[3].argmax())
    assert first[1] in logits[1].topk(20).indices.tolist()


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    torch.manual_seed(4)
    logits = torch.randn(3, 5000) * 3
    seeded = SamplingParams(temperature=1.0, top_k=5, seed=9)
    alone = Sampler()(logits[:1], [seeded], [torch.Generator().manual_seed(9)]).token_ids[0]
    for other in (SamplingParams(top_p=0.5), SamplingParams(top_k=3000), SamplingParams(temperature=0.0)):
        batch = Sampler()(logits[:2], [seeded, other], [torch.Generator().manual_seed(9), None],
                          torch.Generator().manual_seed(1)).token_ids
        assert batch[0] == alone, other


@pytest.mark.slow
def test_temperature_alone_draws_from_the_scaled_softmax_without_filtering(monkeypatch):
    import nanoengine.layers.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "kept_mask", lambda *a: (_ for _ in ()).throw(AssertionError("sorted")))
    sampler = Sampler()
    sampler.probs_fn = lambda *a: (_ for _ in ()).throw(AssertionError("filtered"))
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = [SamplingParams(temperature=0.5, seed=s) for s in range(3000)]
    counts = torch.zeros(4)
    for p in params[:3000]:
        token = sampler(logits, [p], [torch.Generator().manual_seed(p.seed)]).token_ids[0]
        counts[token] += 1
    expected = torch.softmax(logits[0] / 0.5, dim=-1)
    assert torch.allclose(counts / counts.sum(), expected, atol=0.03)


def test_has_filters_is_true_only_when_a_filter_may_cut():
    assert not SamplingParams().has_filters and not SamplingParams(top_k=0, temperature=0.7).has_filters
    assert all(SamplingParams(**f).has_filters for f in ({"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.05}))
