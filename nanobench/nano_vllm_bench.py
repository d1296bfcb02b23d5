"""nano-vLLM's benchmark workload on this engine (chapter 11; ``gpu-check --nano-vllm``).

nano-vLLM's ``bench.py`` is the figure its README quotes against vLLM: 256 sequences,
prompts of random token ids with lengths uniform in [100, 1024], outputs uniform in
[100, 1024], sampled at temperature 0.6 with EOS ignored, Qwen3-0.6B, throughput = output
tokens / wall time. This module runs the same shape of workload through ``LLMEngine``:

* the model is Qwen3-0.6B's shape with random weights (the GPU machines reach no model
  hub; the arithmetic per token is the real model's), in bfloat16 on CUDA;
* the workload is drawn with seed 0 (``make_workload``), all requests queued at once;
* the clock runs from the first request added to the last one finished, after a warm-up
  request (CUDA graphs are captured when the engine is built, as nano-vLLM does).

Beyond tokens per second it reports what the engine's own timers say about each step
(``StepFinished``): the median model time of a decode-only step, the median whole step,
and the *host share*: the fraction of a step spent outside the model (scheduling, block
bookkeeping, input preparation, sampling, output processing). On a GPU that share is the
engine's overhead; nano-vLLM's point is that a thin host side lets a small engine keep up
with vLLM.

    python -m nanobench.gpu_check --nano-vllm            # on a CUDA machine
    python -m nanobench.gpu_check --nano-vllm --cpu-smoke   # tiny sizes on the CPU (CI)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from nanobench.timing import median_ms
from nanoengine.models.config import ModelConfig


@dataclass(frozen=True)
class NanoVllmWorkload:
    """The workload's shape: nano-vLLM's ``bench.py`` at full size, tiny for the CPU smoke."""

    model_name: str
    model: ModelConfig
    dtype: str
    device: str
    num_requests: int = 256
    prompt_len: tuple[int, int] = (100, 1024)
    output_len: tuple[int, int] = (100, 1024)
    temperature: float = 0.6
    seed: int = 0
    engine_kwargs: dict = field(default_factory=dict)
    time_limit_s: float = 300.0


def draw_workload(w: NanoVllmWorkload) -> tuple[list[list[int]], list[int]]:
    """Prompts of random ids (< 10,000, as nano-vLLM draws them) and each request's output length."""
    from nanobench.benchmark import make_varlen_workload

    return make_varlen_workload(w.num_requests, w.prompt_len, w.output_len, w.model.vocab_size, w.seed)


def run_nano_vllm_bench(w: NanoVllmWorkload) -> dict:
    """Serve the workload once; tok/s, step timings and the host share of each step."""
    from nanoengine.engine.llm_engine import LLMEngine
    from nanoengine.events import StepFinished
    from nanoengine.loader.weights import random_model
    from nanoengine.sampling_params import RequestOutputKind, SamplingParams

    dtype = getattr(torch, w.dtype)
    prompts, output_lens = draw_workload(w)
    max_model_len = w.prompt_len[1] + w.output_len[1]
    net = random_model(w.model, device=w.device, dtype=dtype, max_position_embeddings=max(
        max_model_len, w.model.max_position_embeddings))
    engine = LLMEngine.from_model(net, None, device=w.device, dtype=w.dtype, max_model_len=max_model_len,
                                  **w.engine_kwargs)
    try:
        def params(n: int) -> SamplingParams:
            return SamplingParams(temperature=w.temperature, max_tokens=n, ignore_eos=True, seed=None,
                                  output_kind=RequestOutputKind.FINAL_ONLY)

        engine.add_request(prompts[0][:16], params(4))  # warm-up: first calls, allocator
        while engine.has_unfinished_requests():
            engine.step()
        engine.reset_prefix_cache()
        steps: list[StepFinished] = []
        engine.events.subscribe(steps.append, StepFinished)
        outputs = {}
        start = time.perf_counter()
        deadline = time.monotonic() + w.time_limit_s
        ids = [engine.add_request(p, params(n)) for p, n in zip(prompts, output_lens)]
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            for out in engine.step():
                outputs[out.request_id] = out
        seconds = time.perf_counter() - start
        complete = len(outputs) == len(ids)
        for request_id in ids:  # out of time: what the rest produced still counts, then they stop
            if request_id not in outputs:
                outputs[request_id] = engine.abort(request_id)
    finally:
        engine.shutdown()
    tokens = sum(len(outputs[i].token_ids) for i in ids)
    decodes = [s for s in steps if s.num_prefill_tokens == 0]

    phases = ("schedule_time", "block_manager_time", "prepare_time", "model_time", "sample_time", "update_time",
              "detokenize_time")
    return {
        "workload": {"source": "nano-vLLM bench.py shape", "num_requests": len(ids),
                     "prompt_len": list(w.prompt_len), "output_len": list(w.output_len),
                     "temperature": w.temperature, "ignore_eos": True, "seed": w.seed,
                     "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": sum(output_lens)},
        "model": f"{w.model_name} shape, random weights, {w.dtype}", "device": w.device,
        "engine_settings": {**w.engine_kwargs, "max_model_len": max_model_len},
        "complete": complete, "seconds": seconds, "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds if seconds else None,
        "steps": len(steps), "decode_steps": len(decodes),
        "median_decode_step_ms": {"model": median_ms([s.model_time for s in decodes]),
                                  "whole_step": median_ms([s.total_time for s in decodes])},
        "median_step_ms": median_ms([s.total_time for s in steps]),
        "host_share_of_step": {"median": statistics.median(s.host_time / s.total_time for s in steps)
                               if steps else None,
                               "all_steps": sum(s.host_time for s in steps) / sum(s.total_time for s in steps)
                               if steps else None},
        "median_decode_phase_ms": {name.removesuffix("_time"): median_ms([getattr(s, name) for s in decodes])
                                   for name in phases},
    }
