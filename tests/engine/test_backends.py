"""Device backends (nanoengine.backends): chosen once, and the only place a device's tricks live."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoengine import LLMEngine, SamplingParams
from nanoengine.backends import Backend, select_backend
from nanoengine.layers.attention import ReferenceAttention
from nanoengine.backends.cpu import CpuAttentionMetadata, CpuBackend
from nanoengine.config import EngineConfig
from nanoengine.engine.model_runner import BatchPlan, ModelRunner, plan_batch
from nanoengine.loader.weights import random_model


def _engine(backend: Backend | None = None) -> LLMEngine:
    """A tiny engine (always the same weights); ``backend`` replaces the one its device would pick."""
    torch.manual_seed(0)
    net = random_model("tiny-llama-eos", std=0.08, backend=backend)  # the layers take the backend's kernels
    config = EngineConfig.from_kwargs(device="cpu", num_kv_blocks=64, block_size=4, max_model_len=64)
    if backend is None:
        return LLMEngine.from_model(net, None, device="cpu", num_kv_blocks=64, block_size=4, max_model_len=64)
    return LLMEngine._build(config, net.config, lambda max_len, blocks: ModelRunner(
        net, net.config, blocks, 4, torch.device("cpu"), torch.float32, backend=backend), None)


def _greedy(engine: LLMEngine, prompts) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)) for p in prompts]
    tokens = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    return [tokens[i] for i in ids]


def test_a_cpu_gets_the_cpu_backend_and_every_attention_layer_its_kernels():
    engine = _engine()
    backend = engine.runner.backend
    assert isinstance(backend, CpuBackend) and backend.describe().startswith("cpu backend")
    assert all(layer.impl is backend.attention for layer in engine.runner.model.attention_layers())


def test_the_cpu_backend_builds_its_metadata_once_per_step_as_typed_fields():
    engine = _engine()
    engine.add_request([5, 9, 200, 31, 7], SamplingParams(temperature=0.0, max_tokens=4))
    engine.add_request(list(range(20, 33)), SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()  # both prefill
    plan, _ = plan_batch(engine.scheduler.schedule(engine.step_count), engine.config.block_size, engine.block_tables)
    backend = engine.runner.backend
    meta = backend.build_metadata(plan)
    assert isinstance(meta, CpuAttentionMetadata) and meta.num_decode_tokens == 2 and meta.all_slots_stored
    warm_up = engine.runner.backend.build_metadata(BatchPlan.dummy(3))  # slot -1: nothing stored
    assert not warm_up.all_slots_stored


@pytest.mark.parametrize("native", [True, False], ids=["native kernels", "reference kernels"])
def test_the_cpu_backend_generates_what_the_reference_kernels_do(native):
    prompts = [[5, 9, 200, 31, 7], list(range(40, 70)), [3] * 9]
    engine = _engine()
    if native and not engine.runner.backend.attention.native:
        pytest.skip("the native kernels are not built on this machine")
    engine.runner.backend.attention.native = native
    fast = _greedy(engine, prompts)
    reference = _greedy(_engine(Backend("cpu")), prompts)
    assert fast == reference and all(len(t) == 10 for t in fast)


def test_the_reference_backend_is_plain():
    backend = select_backend("meta")
    assert type(backend) is Backend and isinstance(backend.attention, ReferenceAttention)
    assert backend.logits_rows_per_chunk(300, 49152, 64) == 300 and backend.forward_mode() == "eager"


_TRITON_ENGINE = """
import json, torch
from nanoengine.backends.cuda import CudaBackend, TritonAttention
from nanoengine.config import EngineConfig
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.engine.model_runner import ModelRunner
from nanoengine.loader.weights import random_model
from nanoengine import SamplingParams

def tokens(backend):
    torch.manual_seed(0)
    net = random_model("tiny-llama-eos", std=0.08, backend=backend)
    config = EngineConfig.from_kwargs(device="cpu", num_kv_blocks=32, block_size=4, max_model_len=48)
    engine = LLMEngine._build(config, net.config, lambda max_len, blocks: ModelRunner(
        net, net.config, blocks, 4, torch.device("cpu"), torch.float32, backend=backend), None)
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
           for p in ([5, 9, 200, 31, 7, 8], list(range(40, 51)))]
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] = list(o.outputs[0].token_ids)
    return [out[i] for i in ids], engine.runner.backend

triton_tokens, backend = tokens(CudaBackend(torch.device("cpu")))  # no graphs: they need a GPU
assert isinstance(backend.attention, TritonAttention), backend.describe()
from nanoengine.backends import Backend
print(json.dumps({"triton": triton_tokens, "reference": tokens(Backend("cpu"))[0]}))
"""


@pytest.mark.slow
def test_the_cuda_backend_runs_the_engine_on_the_triton_kernels_interpreted():
    """The CUDA backend's attention (Triton, here under TRITON_INTERPRET=1 on a CPU) gives the reference's tokens."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _TRITON_ENGINE], capture_output=True, text=True, env=env,
                          timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["triton"] == result["reference"] and all(len(t) == 3 for t in result["triton"])
