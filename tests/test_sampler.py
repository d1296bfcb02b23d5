"""The sampler's filters and draws (the playground widget calls the same functions)."""

from __future__ import annotations

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
