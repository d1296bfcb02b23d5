"""``loader.weights.save_pretrained`` and ``ModelConfig.to_dict``: a built model written as a
Hugging Face directory loads back to the same weights, the same tokens, and splits over
tensor-parallel workers (chapter 9 runs a random tiny model at TP=2 this way)."""

from __future__ import annotations

import json

import pytest
import torch

from nanoengine import LLM, LLMEngine, SamplingParams
from nanoengine.loader.weights import load_model, random_model, save_pretrained
from nanoengine.models.config import ModelConfig
from nanoengine.models.presets import PRESETS, TINY_PRESETS

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("name", sorted({**PRESETS, **TINY_PRESETS}))
def test_to_dict_is_the_inverse_of_from_dict(name) -> None:
    config = {**PRESETS, **TINY_PRESETS}[name]
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-eos"])
def test_a_saved_model_loads_back_with_the_same_weights(tmp_path, preset) -> None:
    net = random_model(preset, seed=3, std=0.08)
    path = save_pretrained(net, tmp_path / "m")
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    again = load_model(path, ModelConfig.from_pretrained(path), torch.device("cpu"), torch.float32)
    ours, theirs = dict(net.named_parameters()), dict(again.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_qwen3_with_qk_norms_round_trips(tmp_path) -> None:
    net = random_model("tiny-llama-eos", seed=1, architecture="Qwen3ForCausalLM")
    again = load_model(save_pretrained(net, tmp_path), net.config, torch.device("cpu"), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), again.parameters()))


@pytest.mark.slow
def test_the_saved_directory_gives_the_same_tokens_alone_and_split_over_two_workers(tmp_path) -> None:
    net = random_model("tiny-llama", seed=0, std=0.08)
    path = save_pretrained(net, tmp_path)
    prompts = [[5, 17, 99, 3], [200, 201, 202]]
    small = dict(num_kv_blocks=16, block_size=4, max_model_len=64)
    ref = LLMEngine.from_model(net, device="cpu", **small)
    expected = [o.token_ids for o in LLM(path, **small).generate(prompts, GREEDY, use_tqdm=False)]
    for p in prompts:
        ref.add_request(p, GREEDY)
    outputs = []
    while ref.has_unfinished_requests():
        outputs += [o for o in ref.step() if o.finished]
    assert sorted(o.token_ids for o in outputs) == sorted(expected)
    with LLM(path, tensor_parallel_size=2, **small) as tp2:
        assert [o.token_ids for o in tp2.generate(prompts, GREEDY, use_tqdm=False)] == expected
