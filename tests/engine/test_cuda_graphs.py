"""CUDA graphs for decode steps (chapter 10): buckets, when they are used, and parity with eager."""

from __future__ import annotations

import pytest
import torch

from nanoengine import LLMEngine, SamplingParams
from nanoengine.backends.cuda_graphs import batch_buckets
from nanoengine.loader.weights import random_model


def test_cuda_graph_buckets_cover_every_batch_size():
    assert batch_buckets(1) == [1]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    for max_batch in (3, 16, 100, 512):
        buckets = batch_buckets(max_batch)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch
        assert all(any(b >= n for b in buckets) for n in range(1, max_batch + 1))


def test_no_graphs_on_the_cpu():
    engine = LLMEngine.from_model(random_model("tiny-llama"), None, device="cpu", num_kv_blocks=16,
                                  block_size=4, max_model_len=32, enforce_eager=False)
    assert engine.runner.device == torch.device("cpu") and not hasattr(engine.runner.backend, "cuda_graphs")
    assert "CUDA graphs" not in engine.runner.backend.describe()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_gives_the_eager_tokens():
    def run(enforce_eager: bool) -> tuple[list, object]:
        net = random_model("tiny-llama-eos", std=0.08, device="cuda", dtype=torch.bfloat16)
        engine = LLMEngine.from_model(net, None, device="cuda", dtype="bfloat16", num_kv_blocks=64,
                                      block_size=16, max_model_len=256, max_num_seqs=8,
                                      enforce_eager=enforce_eager)
        for i in range(5):
            engine.add_request(list(range(10 + i, 40 + 3 * i)), SamplingParams(temperature=0, max_tokens=12,
                                                                              ignore_eos=True))
        tokens = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.token_ids
        return [tokens[k] for k in sorted(tokens)], engine.runner.backend.cuda_graphs

    graphed, graphs = run(enforce_eager=False)
    eager, none = run(enforce_eager=True)
    assert graphs is not None and none is None
    assert graphed == eager
