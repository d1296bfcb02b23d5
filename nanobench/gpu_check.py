"""The GPU check: what CPU CI cannot test, in one command on a CUDA machine (chapters 4, 6, 11).

    ./course gpu-check                            # python -m nanobench.gpu_check; < 8 min on an H200
    python -m nanobench.gpu_check --quick        # a reduced workload, a few minutes
    python -m nanobench.gpu_check --cpu-smoke    # tiny shapes on the CPU: how CI tests this script
    python -m nanobench.gpu_check --nano-vllm    # nano-vLLM's bench workload alone (< 6 min on an H200)

Four sub-checks, each recorded as pass / fail / skipped with its numbers:

a. **kernels**: every Triton kernel (``kernels/triton_kernels.py``) against its PyTorch
   reference (``kernels/reference.py``) at realistic shapes (SmolLM2-135M's and
   Qwen3-0.6B's heads, contexts up to 2048 tokens), fp32/fp16/bf16, with the tolerances
   of ``tests/engine/test_triton_kernels.py``; store-KV must be bit exact. Each kernel is timed too.
b. **cuda_graphs**: the same greedy requests with CUDA-graph decode (``enforce_eager=False``)
   and eager (``enforce_eager=True``). Output lengths vary, so the decode batch shrinks
   through many graph sizes. A differing token is accepted only where eager's own top-2
   logprobs at that position are closer than the near-tie tolerance.
c. **hf_parity**: greedy tokens against Hugging Face transformers on a small random Qwen3
   saved with ``save_pretrained`` (both load the same files). fp32 is the gate (near-tie
   tolerance 1e-3, as in ``nanoengine bench``); bf16 is reported with a wider tolerance.
d. **benchmark**: throughput (output tokens / wall time) against transformers' static
   batching and its continuous batching on a Qwen3-0.6B-shaped model with random weights
   (``models.presets.PRESETS["Qwen3-0.6B"]``: the GPU machine reaches no model hub), bf16,
   256 requests with random prompts of 100-1024 tokens and outputs of 100-1024 tokens,
   greedy, EOS ignored.

How transformers is run in (d), and why:

* static batching (``benchmark.run_hf_static``): batches of ``hf_static_batch`` requests
  in workload order; a batch generates until its longest request is done and each
  request's output is truncated to its own length (the waste is what static batching
  costs); only requested tokens count. It runs on the first ``hf_static_requests``
  requests (stated in the JSON): its batches are independent, so a subset measures its
  rate, and all 256 at 1024 steps a batch would not fit the time limit.
* continuous batching (``generate_batch``'s manager, which switches the model to paged
  attention itself): each request with its
  own ``max_new_tokens``, timed after transformers' own warm-up (CUDA-graph capture), as
  the engine's graphs are captured before its clock starts.

Every stage has a time budget; a stage that runs out stops early (or is skipped) and says
so in the JSON, so the whole check stays within ``--time-budget-s``. Results go to
``results/gpu-check-<date>.json`` with the GPU, the versions, the date and the command.
Without CUDA the command prints why and exits 0; ``--cpu-smoke`` then runs every stage at
tiny sizes on the CPU (Triton under its interpreter), which is what CI runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanoengine.models.config import ModelConfig
from nanobench.timing import median_ms
from nanoengine.models.presets import PRESETS

TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # as tests/engine/test_triton_kernels.py
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NO_CUDA_MESSAGE = ("nanoengine gpu-check: no CUDA device is visible, so there is nothing to check here: the "
                   "Triton kernels, CUDA graphs and the GPU benchmark need an NVIDIA GPU.\n"
                   "Run `python -m nanobench.gpu_check --cpu-smoke` to exercise every stage at tiny sizes on "
                   "the CPU (what CI runs).")

# A small Qwen3 for the correctness stages: big enough to use every code path (GQA, q/k
# norms, several layers), small enough to load in a second.
SMALL_QWEN3 = ModelConfig(
    architecture="Qwen3ForCausalLM", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=8192, rms_norm_eps=1e-6,
    rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
TINY_QWEN3 = dataclasses.replace(SMALL_QWEN3, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512)


@dataclass(frozen=True)
class KernelShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16


@dataclass(frozen=True)
class Mode:
    """Sizes and time budgets of one way to run the check (budgets in seconds)."""

    name: str
    device: str
    kernel_shapes: tuple[KernelShape, ...]
    kernel_dtypes: tuple[str, ...]
    decode_lens: tuple[int, ...]  # context length of each decoding sequence
    prefill_context_lens: tuple[int, ...]
    prefill_q_lens: tuple[int, ...]  # query chunk of each prefill (<= its context length)
    store_tokens: int
    small_model: ModelConfig  # stages b and c
    check_requests: int  # stages b and c: requests, prompt lengths, output lengths
    check_prompt_len: tuple[int, int]
    check_output_len: tuple[int, int]
    bench_model_name: str
    bench_model: ModelConfig  # stage d
    bench_dtype: str
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    hf_static_requests: int
    hf_static_batch: int
    hf_cb_requests: int
    engine_kwargs: dict = field(default_factory=dict)  # stage d engine settings
    hf_cb_config: dict = field(default_factory=dict)  # ContinuousBatchingConfig fields; {} = its defaults
    time_budget_s: float = 450.0
    stage_budget_s: dict = field(default_factory=dict)  # the most each stage may take


def _edge_and_random_lens(n: int, longest: int, seed: int = 0) -> tuple[int, ...]:
    """Block-boundary edge cases plus random lengths up to ``longest``."""
    rng = random.Random(seed)
    edges = [1, 15, 16, 17, longest]
    return tuple(edges + [rng.randint(1, longest) for _ in range(n - len(edges))])


_GPU_SHAPES = (KernelShape("SmolLM2-135M", 9, 3, 64), KernelShape("Qwen3-0.6B", 16, 8, 128))
_GPU_PREFILL = dict(prefill_context_lens=(2048, 1500, 1024, 777, 512, 300, 64, 9),
                    prefill_q_lens=(2048, 500, 1, 777, 100, 300, 63, 9))  # fresh prompts, prefix hits, chunks

MODES = {
    "full": Mode(
        name="full", device="cuda", kernel_shapes=_GPU_SHAPES, kernel_dtypes=("float32", "float16", "bfloat16"),
        decode_lens=_edge_and_random_lens(128, 2048), store_tokens=4096, **_GPU_PREFILL,
        small_model=SMALL_QWEN3, check_requests=24, check_prompt_len=(4, 200), check_output_len=(4, 96),
        bench_model_name="Qwen3-0.6B", bench_model=PRESETS["Qwen3-0.6B"], bench_dtype="bfloat16",
        num_requests=256, prompt_len=(100, 1024), output_len=(100, 1024),
        hf_static_requests=64, hf_static_batch=32, hf_cb_requests=256,
        engine_kwargs=dict(max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_memory_gb=40.0),
        # 7 minutes of budget: the stages that cannot stop mid-way (a static batch, the
        # continuous-batching warm-up and teardown) may overrun their share a little.
        time_budget_s=420.0,
        stage_budget_s=dict(kernels=60, cuda_graphs=60, hf_parity=45, engine=120, hf_static=75,
                            hf_generate_batch=120)),
    "quick": Mode(
        name="quick", device="cuda", kernel_shapes=_GPU_SHAPES[1:], kernel_dtypes=("float16", "bfloat16"),
        decode_lens=_edge_and_random_lens(64, 2048), store_tokens=4096, **_GPU_PREFILL,
        small_model=SMALL_QWEN3, check_requests=24, check_prompt_len=(4, 200), check_output_len=(4, 96),
        bench_model_name="Qwen3-0.6B", bench_model=PRESETS["Qwen3-0.6B"], bench_dtype="bfloat16",
        num_requests=64, prompt_len=(100, 512), output_len=(100, 256),
        hf_static_requests=32, hf_static_batch=32, hf_cb_requests=64,
        engine_kwargs=dict(max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_memory_gb=16.0),
        time_budget_s=240.0,
        stage_budget_s=dict(kernels=40, cuda_graphs=45, hf_parity=30, engine=45, hf_static=30,
                            hf_generate_batch=45)),
    "cpu-smoke": Mode(
        name="cpu-smoke", device="cpu", kernel_shapes=(KernelShape("tiny", 4, 2, 16, block_size=8),),
        kernel_dtypes=("float32", "bfloat16"), decode_lens=(1, 9, 30), prefill_context_lens=(12, 9, 5),
        prefill_q_lens=(12, 3, 1), store_tokens=10,
        small_model=TINY_QWEN3, check_requests=6, check_prompt_len=(4, 16), check_output_len=(2, 6),
        bench_model_name="tiny Qwen3 (stands in for Qwen3-0.6B on the CPU)", bench_model=TINY_QWEN3,
        bench_dtype="float32", num_requests=4, prompt_len=(8, 16), output_len=(4, 8),
        hf_static_requests=2, hf_static_batch=2, hf_cb_requests=4,
        engine_kwargs=dict(max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=64),
        # transformers sizes its cache from free memory, which on a CPU means the whole RAM.
        hf_cb_config=dict(num_blocks=16, max_batch_tokens=256),
        # Generous caps: ~30 s on an idle 2-core CPU, but CI machines are shared.
        time_budget_s=300.0,
        stage_budget_s=dict(kernels=120, cuda_graphs=120, hf_parity=120, engine=60, hf_static=60,
                            hf_generate_batch=60)),
}


class Budget:
    """The whole check's deadline, and each stage's share of what is left."""

    def __init__(self, total_s: float, stage_s: dict[str, float]) -> None:
        self.start = time.monotonic()
        self.total_s = total_s
        self.stage_s = stage_s

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.start)

    def stage_limit(self, stage: str) -> float:
        """Seconds ``stage`` may take from now: its own share, capped by what is left."""
        return max(0.0, min(self.stage_s.get(stage, self.total_s), self.left()))


# ------------------------------------------------------------------ (a) kernels
def _paged_cache(lens, shape: KernelShape, dtype: torch.dtype, device: str, seed: int, spare_blocks: int = 8):
    """Random K/V caches and block tables handed out in a shuffled order, -1 padded."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: GBs on a GPU
    per_seq = [-(-n // shape.block_size) for n in lens]
    num_blocks = sum(per_seq) + spare_blocks
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, generator=values, device=device).to(dtype)  # (blocks, B, kvh, d)
    v_cache = torch.randn(cache_shape, generator=values, device=device).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(per_seq) + 1), -1, dtype=torch.int32)  # (S, max_blocks)
    cursor = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = order[cursor:cursor + n]
        cursor += n
    return k_cache, v_cache, tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def _time_ms(fn, device: str, repeats: int = 10) -> float | None:
    """Mean milliseconds per call on CUDA (events, after one warm-up call); None on the CPU."""
    if device != "cuda":
        return None
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _compare(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> dict:
    tol = TOLERANCES[dtype]
    diff = (actual.float() - expected.float()).abs()
    ok = bool((diff <= tol + tol * expected.float().abs()).all()) and actual.shape == expected.shape
    return {"max_abs_error": float(diff.max()) if diff.numel() else 0.0, "tolerance": tol, "pass": ok}


def check_kernels(mode: Mode, time_limit_s: float) -> dict:
    """Every Triton kernel against its reference, per shape and dtype."""
    from nanoengine.kernels import reference
    from nanoengine.kernels import triton_kernels as tk

    device, cases = mode.device, []
    deadline = time.monotonic() + time_limit_s
    for shape in mode.kernel_shapes:
        for dtype_name in mode.kernel_dtypes:
            if time.monotonic() > deadline:
                return {"status": "fail", "reason": "out of time before every case ran", "cases": cases}
            dtype = DTYPES[dtype_name]
            scale = shape.head_dim ** -0.5
            label = dict(shape=shape.name, heads=shape.num_heads, kv_heads=shape.num_kv_heads,
                         head_dim=shape.head_dim, block_size=shape.block_size, dtype=dtype_name)

            # store_kv: a copy, so bit exact; every 7th slot is -1 (skipped).
            gen = torch.Generator().manual_seed(1)
            k_cache, v_cache, _, _ = _paged_cache([mode.store_tokens], shape, dtype, device, seed=1)
            slots = torch.randperm(k_cache.shape[0] * shape.block_size, generator=gen)[:mode.store_tokens]
            slots[::7] = -1
            slots = slots.to(device)
            key = torch.randn(mode.store_tokens, shape.num_kv_heads, shape.head_dim, generator=gen).to(dtype)
            key, value = key.to(device), torch.randn_like(key.float()).to(dtype).to(device)
            expected_k, expected_v = k_cache.clone(), v_cache.clone()
            reference.store_kv(key, value, expected_k, expected_v, slots)
            tk.store_kv(key, value, k_cache, v_cache, slots)
            exact = torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
            cases.append({"op": "store_kv", **label, "tokens": mode.store_tokens, "bit_exact": exact, "pass": exact,
                          "triton_ms": _time_ms(lambda: tk.store_kv(key, value, k_cache, v_cache, slots), device),
                          "reference_ms": _time_ms(lambda: reference.store_kv(key, value, expected_k, expected_v,
                                                                              slots), device)})

            # decode: one query per sequence over its whole paged context.
            k_cache, v_cache, tables, ctx = _paged_cache(mode.decode_lens, shape, dtype, device, seed=2)
            query = torch.randn(len(mode.decode_lens), shape.num_heads, shape.head_dim).to(dtype).to(device)
            args = (query, k_cache, v_cache, tables, ctx, scale)
            result = _compare(tk.paged_decode_attention(*args), reference.paged_decode_attention(*args), dtype)
            cases.append({"op": "paged_decode_attention", **label, "num_seqs": len(mode.decode_lens),
                          "max_context": max(mode.decode_lens), **result,
                          "triton_ms": _time_ms(lambda: tk.paged_decode_attention(*args), device),
                          "reference_ms": _time_ms(lambda: reference.paged_decode_attention(*args), device)})

            # prefill: causal chunks over cached prefixes (fresh prompts, prefix hits, later chunks).
            k_cache, v_cache, tables, ctx = _paged_cache(mode.prefill_context_lens, shape, dtype, device, seed=3)
            query = torch.randn(sum(mode.prefill_q_lens), shape.num_heads, shape.head_dim).to(dtype).to(device)
            cu = torch.tensor([0] + list(_cumsum(mode.prefill_q_lens)), dtype=torch.int32, device=device)
            args = (query, k_cache, v_cache, tables, cu, ctx, scale)
            result = _compare(tk.paged_prefill_attention(*args), reference.paged_prefill_attention(*args), dtype)
            cases.append({"op": "paged_prefill_attention", **label, "q_lens": list(mode.prefill_q_lens),
                          "context_lens": list(mode.prefill_context_lens), **result,
                          "triton_ms": _time_ms(lambda: tk.paged_prefill_attention(*args), device),
                          "reference_ms": _time_ms(lambda: reference.paged_prefill_attention(*args), device)})
    failed = [f"{c['op']} {c['shape']} {c['dtype']}" for c in cases if not c["pass"]]
    return {"status": "fail" if failed else "pass", "failed_cases": failed, "cases": cases,
            "interpreted": os.environ.get("TRITON_INTERPRET") == "1"}


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total


# ----------------------------------------------------------- models to test on
def save_random_qwen3(shape: ModelConfig, path: Path, peaked: bool, dtype: str = "float32", seed: int = 0) -> Path:
    """A transformers Qwen3 of ``shape`` with random weights, saved with ``save_pretrained``.

    ``peaked``: N(0, 0.08) weights and perturbed norms (as ``tests/conftest.py``) so the
    next-token distributions are sharp and greedy comparisons are not decided by
    near-ties; otherwise transformers' own initialisation (N(0, 0.02): near-flat logits,
    fine for throughput). Saved in ``dtype``, so both systems read the very same values.
    """
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim, rms_norm_eps=shape.rms_norm_eps,
        rope_theta=shape.rope_theta, max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings, bos_token_id=shape.bos_token_id,
        eos_token_id=shape.eos_token_ids[0] if shape.eos_token_ids else None)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    if peaked:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.08)
    model.to(DTYPES[dtype]).eval().save_pretrained(path)
    return path


def _workload(mode: Mode, num_requests: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Random prompts and a random output length for each (``benchmark.make_varlen_workload``)."""
    from nanobench.benchmark import make_varlen_workload

    return make_varlen_workload(num_requests, mode.prompt_len, mode.output_len, vocab, seed)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _check_workload(mode: Mode, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts and output lengths for stages b and c (lengths vary: the decode batch shrinks)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(mode.small_model.vocab_size) for _ in range(rng.randint(*mode.check_prompt_len))]
               for _ in range(mode.check_requests)]
    return prompts, [rng.randint(*mode.check_output_len) for _ in prompts]


def _small_kv_cache(mode: Mode) -> dict:
    """KV pool settings for the small model: a fixed block count on the CPU (a memory budget
    would allocate gigabytes for a tiny model), a modest budget on the GPU."""
    return {"num_kv_blocks": 256} if mode.device == "cpu" else {"kv_cache_memory_gb": 2.0}


def _first_divergence(ours: list[int], ref: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)


# -------------------------------------------------------------- (b) CUDA graphs
def _generate_with_logprobs(model_dir: Path, prompts, output_lens, mode: Mode, dtype: str, enforce_eager: bool):
    """Greedy outputs (with top-2 logprobs) and the model time of each decode-only step."""
    from nanoengine import LLM, SamplingParams
    from nanoengine.events import StepFinished

    llm = LLM(model_dir, device=mode.device, dtype=dtype, enforce_eager=enforce_eager, max_model_len=512,
              **_small_kv_cache(mode))
    try:
        decode_times = []
        llm.engine.events.subscribe(lambda e: decode_times.append(e.model_time)
                                    if isinstance(e, StepFinished) and e.num_prefill_tokens == 0 else None)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in output_lens]
        outs = llm.generate(prompts, params)
        graph_attrs = sorted(name for name in vars(llm.engine.runner) if "graph" in name.lower())
        return outs, decode_times, graph_attrs
    finally:
        llm.shutdown()
        del llm
        _free_memory()


def check_cuda_graphs(model_dir: Path, mode: Mode, dtype: str = "bfloat16", tolerance: float = 0.1) -> dict:
    """CUDA-graph decode gives eager's greedy tokens (near-ties in eager's own logprobs excepted)."""
    if mode.device == "cpu":
        dtype = "float32"
    prompts, output_lens = _check_workload(mode, seed=5)
    graphs, graph_steps, graph_attrs = _generate_with_logprobs(model_dir, prompts, output_lens, mode, dtype, False)
    eager, eager_steps, _ = _generate_with_logprobs(model_dir, prompts, output_lens, mode, dtype, True)
    identical, ties, unexplained = 0, 0, []
    for i, (g, e) in enumerate(zip(graphs, eager)):
        pos = _first_divergence(list(g.token_ids), list(e.token_ids))
        if pos is None:
            identical += 1
            continue
        top = [lp.logprob for lp in e.logprobs[pos]]
        gap = max(top) - sorted(top)[-2] if len(top) >= 2 else None
        if gap is not None and gap < tolerance:
            ties += 1
        else:
            unexplained.append({"request": i, "position": pos, "eager_top2_gap": gap})
    result = {"status": "fail" if unexplained else "pass", "dtype": dtype, "requests": len(prompts),
              "identical": identical, "near_tie_divergences": ties, "unexplained": unexplained,
              "near_tie_tolerance": tolerance,
              "median_decode_step_ms": {"cuda_graphs": median_ms(graph_steps), "eager": median_ms(eager_steps)},
              "runner_graph_attributes": graph_attrs}
    if mode.device == "cpu":
        result["note"] = "CUDA graphs exist only on CUDA: on the CPU both runs are eager (the script is exercised)"
    return result


# ------------------------------------------------------------ (c) HF parity
class InputsOnModelDevice:
    """Hands ``benchmark.run_hf_static``'s CPU input tensors to a model on another device.

    ``run_hf_static`` was written for the CPU benchmark and builds its inputs on the CPU;
    this wrapper moves them to the model's device and changes nothing else.
    """

    def __init__(self, model) -> None:
        self.model = model

    def generate(self, input_ids=None, attention_mask=None, **kwargs):
        device = self.model.device
        if attention_mask is not None:
            attention_mask = attention_mask.to(device)
        return self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask, **kwargs)


def _load_hf(model_dir: Path, device: str, dtype: str):
    """``benchmark.load_hf`` (fp32, CPU, EOS off), then moved to ``device`` and ``dtype``."""
    from nanobench.benchmark import load_hf

    return load_hf(model_dir).to(device=device, dtype=DTYPES[dtype])


def check_hf_parity(model_dir: Path, mode: Mode) -> dict:
    """Greedy tokens equal transformers', request by request (fp32 gates; bf16 is reported)."""
    from nanobench.benchmark import compare_greedy, run_engine, run_hf_static

    prompts, output_lens = _check_workload(mode, seed=9)
    prompts, output_len = prompts[:8], max(output_lens)
    runs = {}
    for dtype, tolerance, gating in (("float32", 1e-3, True), ("bfloat16", 0.125, False)):
        if mode.device == "cpu" and dtype == "bfloat16":
            continue  # bf16 on a 2-core CPU adds minutes and nothing the fp32 run does not show
        ours, _ = run_engine(model_dir, prompts, output_len, device=mode.device, dtype=dtype, max_model_len=512,
                             **_small_kv_cache(mode))
        _free_memory()
        hf = _load_hf(model_dir, mode.device, dtype)
        theirs, _, top2 = run_hf_static(InputsOnModelDevice(hf), prompts, output_len, batch_size=len(prompts))
        del hf
        _free_memory()
        check = compare_greedy(ours, theirs, [t.float().cpu() for t in top2], tolerance)
        runs[dtype] = {**check, "near_tie_tolerance": tolerance, "gating": gating, "pass": not check["unexplained"]}
    passed = all(r["pass"] for r in runs.values() if r["gating"])
    return {"status": "pass" if passed else "fail", "model": "small random Qwen3 (save_pretrained)",
            "requests": len(prompts), "output_len": output_len, "runs": runs}


# ------------------------------------------------------------ (d) benchmark
def run_engine_varlen(model_dir: Path, prompts: list[list[int]], output_lens: list[int], time_limit_s: float,
                      **engine_kwargs) -> dict:
    """The engine on requests with their own output lengths; stops after ``time_limit_s`` if not done.

    Like ``benchmark.run_engine`` (warm-up, empty prefix cache, wall time of the batch), but
    with one ``SamplingParams`` per request and a time limit: it steps the engine itself so it
    can count tokens as they come and abort what is left when time is up.
    """
    from nanoengine import LLM, SamplingParams

    llm = LLM(model_dir, **engine_kwargs)
    try:
        llm.generate([prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
        llm.engine.block_manager.reset_prefix_cache()
        engine, tokens, done = llm.engine, 0, {}
        start = time.perf_counter()
        deadline = time.monotonic() + time_limit_s
        ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
               for p, n in zip(prompts, output_lens)]
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            for out in engine.step():
                tokens += 1  # a request in a step's outputs gained exactly one token
                if out.finished:
                    done[out.request_id] = list(out.token_ids)
        seconds = time.perf_counter() - start
        for request_id in list(engine.requests):
            engine.abort(request_id)
        del engine  # the last reference to the KV cache outside ``llm``
    finally:
        llm.shutdown()
        del llm
        _free_memory()
    return {"tokens": [done.get(i) for i in ids], "complete": len(done) == len(ids), "seconds": seconds,
            "output_tokens": tokens, "finished_requests": len(done)}


def run_hf_static_varlen(model, prompts: list[list[int]], output_lens: list[int], batch_size: int,
                         time_limit_s: float) -> dict:
    """``benchmark.run_hf_static`` batch by batch: each batch runs to its longest output and
    every request is truncated to its own length; no new batch starts after ``time_limit_s``."""
    from nanobench.benchmark import run_hf_static

    tokens, top2, seconds, useful, generated = [], [], 0.0, 0, 0
    deadline = time.monotonic() + time_limit_s
    last_batch_s = 0.0
    for i in range(0, len(prompts), batch_size):
        if time.monotonic() + last_batch_s > deadline:  # the next batch would not finish in time
            break
        batch, lens = prompts[i:i + batch_size], output_lens[i:i + batch_size]
        batch_start = time.monotonic()
        batch_tokens, batch_seconds, batch_top2 = run_hf_static(model, batch, max(lens), batch_size=len(batch))
        last_batch_s = time.monotonic() - batch_start
        seconds += batch_seconds
        useful += sum(lens)
        generated += max(lens) * len(batch)
        tokens += [t[:n] for t, n in zip(batch_tokens, lens)]
        top2 += [s[:n].float().cpu() for s, n in zip(batch_top2, lens)]
        del batch_top2
        _free_memory()
    return {"tokens": tokens, "top2": top2, "seconds": seconds, "output_tokens": useful,
            "generated_tokens": generated, "requests": len(tokens)}


def run_benchmark(model_dir: Path, mode: Mode, budget: Budget) -> dict:
    """Stage (d): the engine on the whole workload, then transformers' two ways on theirs."""
    prompts, output_lens = _workload(mode, mode.num_requests, mode.bench_model.vocab_size)
    systems, notes = {}, []
    result = {"model": f"{mode.bench_model_name} shape, random weights (transformers' initialisation), "
                       f"{mode.bench_dtype}",
              "workload": {"num_requests": len(prompts), "prompt_len": list(mode.prompt_len),
                           "output_len": list(mode.output_len), "prompt_tokens": sum(len(p) for p in prompts),
                           "output_tokens": sum(output_lens), "greedy": True, "ignore_eos": True, "seed": 0},
              "systems": systems, "notes": notes}

    engine = run_engine_varlen(model_dir, prompts, output_lens, budget.stage_limit("engine"),
                               device=mode.device, dtype=mode.bench_dtype,
                               max_model_len=mode.prompt_len[1] + mode.output_len[1], **mode.engine_kwargs)
    systems["nanoengine"] = {
        "requests": len(prompts), "complete": engine["complete"], "finished_requests": engine["finished_requests"],
        "seconds": engine["seconds"], "output_tokens": engine["output_tokens"],
        "output_tokens_per_s": engine["output_tokens"] / engine["seconds"], "settings": mode.engine_kwargs}
    if not engine["complete"]:
        notes.append("the engine ran out of its stage budget: its rate is over the tokens produced so far")

    hf = None
    for name, run in (("hf_static", _bench_hf_static), ("hf_generate_batch", _bench_hf_continuous)):
        if budget.left() <= 10:
            systems[name] = {"status": "skipped", "reason": "out of time budget"}
            continue
        try:
            # One model for both: continuous batching switches it to paged attention itself.
            hf = hf or _load_hf(model_dir, mode.device, mode.bench_dtype)
            systems[name] = run(hf, mode, budget, prompts, output_lens, engine["tokens"], notes)
        except Exception as exc:  # keep the engine's numbers even if transformers breaks
            systems[name] = {"status": "fail", "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()}
        _free_memory()
    del hf
    _free_memory()

    ours = systems["nanoengine"]["output_tokens_per_s"]
    result["ratios_engine_over"] = {name: ours / s["output_tokens_per_s"] for name, s in systems.items()
                                    if name != "nanoengine" and s.get("output_tokens_per_s")}
    broken = [name for name, s in systems.items() if s.get("status") == "fail"]
    result["status"] = "fail" if broken or engine["finished_requests"] == 0 else "pass"
    return result


def _bench_hf_static(hf, mode, budget, prompts, output_lens, engine_tokens, notes) -> dict:
    from nanobench.benchmark import compare_greedy

    n = min(mode.hf_static_requests, len(prompts))
    static = run_hf_static_varlen(InputsOnModelDevice(hf), prompts[:n], output_lens[:n], mode.hf_static_batch,
                                  budget.stage_limit("hf_static"))
    pairs = [(o, t, s) for o, t, s in zip(engine_tokens, static["tokens"], static["top2"]) if o is not None]
    check = compare_greedy([p[0] for p in pairs], [p[1] for p in pairs], [p[2] for p in pairs], 0.125)
    notes.append(f"transformers static batching ran on the first {static['requests']} of {len(prompts)} "
                 f"requests (its batches are independent, so the subset measures its rate)")
    return {"status": "pass", "requests": static["requests"], "batch_size": mode.hf_static_batch,
            "seconds": static["seconds"], "output_tokens": static["output_tokens"],
            "generated_tokens": static["generated_tokens"],
            "output_tokens_per_s": static["output_tokens"] / static["seconds"] if static["seconds"] else None,
            "method": "batches in workload order, each run to its longest output, outputs truncated to each "
                      "request's length; only requested tokens count",
            "greedy_check_vs_engine": {**check, "near_tie_tolerance": 0.125, "gating": False,
                                       "why_not_gating": "random N(0, 0.02) weights give near-flat logits"}}


def _bench_hf_continuous(hf, mode, budget, prompts, output_lens, engine_tokens, notes) -> dict:
    from nanobench.benchmark import run_hf_continuous

    n = min(mode.hf_cb_requests, len(prompts))
    cb = run_hf_continuous(hf, prompts[:n], output_lens[:n], budget.stage_limit("hf_generate_batch"),
                           mode.hf_cb_config)
    pairs = [(o, t) for o, t in zip(engine_tokens, cb["tokens"]) if o is not None and t is not None]
    if not cb["complete"]:
        notes.append("transformers continuous batching ran out of its stage budget: its rate counts finished "
                     "requests only, a lower bound")
    if n < len(prompts):
        notes.append(f"transformers continuous batching ran on the first {n} of {len(prompts)} requests")
    return {"status": "pass", "requests": n, "attn_implementation": cb["attn_implementation"],
            "complete": cb["complete"],
            "finished_requests": cb["finished_requests"], "seconds": cb["seconds"],
            "output_tokens": cb["output_tokens"], "output_tokens_per_s": cb["output_tokens"] / cb["seconds"],
            "greedy_identical_to_engine": sum(o == t for o, t in pairs), "greedy_compared": len(pairs)}


# ---------------------------------------------------------------------- main
def environment(device: str) -> dict:
    """``benchmark.environment()`` plus the GPU, CUDA and Triton versions."""
    from nanobench.benchmark import environment as base

    info = base()
    info["cuda_available"] = torch.cuda.is_available()
    info["torch_cuda"] = torch.version.cuda
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # reported, not fatal: the kernels stage will fail and say why
        info["triton"] = f"not importable: {exc}"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 2**30, 1),
                    gpu_capability=f"{props.major}.{props.minor}", gpu_count=torch.cuda.device_count())
    return info


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nanobench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a reduced workload (a few minutes)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run every stage at tiny sizes on the CPU (Triton interpreted); what CI runs")
    p.add_argument("--stages", default="kernels,cuda_graphs,hf_parity,benchmark",
                   help="comma-separated subset of kernels,cuda_graphs,hf_parity,benchmark")
    p.add_argument("--time-budget-s", type=float, default=None, help="overall time limit (default per mode)")
    p.add_argument("--nano-vllm", action="store_true",
                   help="instead: nano-vLLM's bench workload (256 requests, prompts and outputs 100-1024 tokens, "
                        "Qwen3-0.6B shape, bf16): tok/s, decode-step time, host share (nanobench/nano_vllm_bench.py)")
    p.add_argument("--out", default=None, help="results JSON (default: results/gpu-check-<date>.json)")
    return p


STAGES = ("kernels", "cuda_graphs", "hf_parity", "benchmark")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        print(f"unknown stage(s) {unknown}; known: {list(STAGES)}", file=sys.stderr)
        return 2
    if args.nano_vllm:
        if args.stages != build_parser().get_default("stages") or args.quick:
            print("--nano-vllm runs nano-vLLM's workload alone: leave out --stages and --quick", file=sys.stderr)
            return 2
        return nano_vllm_main(args, argv)
    if args.cpu_smoke:
        # The interpreter must be chosen before triton_kernels is first imported.
        os.environ["TRITON_INTERPRET"] = "1"
        mode = MODES["cpu-smoke"]
    elif not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    else:
        mode = MODES["quick" if args.quick else "full"]
    budget = Budget(args.time_budget_s or mode.time_budget_s, mode.stage_budget_s)
    today = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else Path("results") / (
        f"gpu-check-{'cpu-smoke-' if mode.device == 'cpu' else ''}{today}.json")
    report = {"mode": mode.name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m nanobench.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": environment(mode.device), "time_budget_s": budget.total_s, "checks": {}}
    print(f"nanoengine gpu-check ({mode.name}) on {report['environment'].get('gpu', 'the CPU')}; "
          f"time budget {budget.total_s:.0f} s")
    with tempfile.TemporaryDirectory(prefix="nanoengine-gpu-check-") as tmp:
        small_dir = bench_dir = None
        for stage in STAGES:
            if stage not in stages:
                continue
            if budget.left() <= 5:
                report["checks"][stage] = {"status": "skipped", "reason": "out of time budget"}
                continue
            start = time.monotonic()
            try:
                if stage == "kernels":
                    result = check_kernels(mode, budget.stage_limit("kernels"))
                elif stage in ("cuda_graphs", "hf_parity"):
                    if small_dir is None:
                        small_dir = save_random_qwen3(mode.small_model, Path(tmp) / "small-qwen3", peaked=True)
                    result = (check_cuda_graphs if stage == "cuda_graphs" else check_hf_parity)(small_dir, mode)
                else:
                    if bench_dir is None:
                        bench_dir = save_random_qwen3(mode.bench_model, Path(tmp) / "bench-qwen3", peaked=False,
                                                      dtype=mode.bench_dtype)
                    result = run_benchmark(bench_dir, mode, budget)
            except Exception as exc:  # one broken stage must not hide the others' results
                result = {"status": "fail", "error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()}
            _free_memory()
            result["seconds"] = round(time.monotonic() - start, 2)
            report["checks"][stage] = result
            print(f"  {stage:<12} {result['status']:<8} {result['seconds']:7.1f} s  {_summary(stage, result)}")
    report["passed"] = all(c["status"] in ("pass", "skipped") for c in report["checks"].values())
    report["seconds"] = round(time.monotonic() - budget.start, 2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"{'all checks passed' if report['passed'] else 'SOME CHECKS FAILED'} in {report['seconds']:.0f} s; "
          f"results written to {out}")
    return 0 if report["passed"] else 1


NANO_VLLM_WORKLOADS = {
    # One H200: 256 sequences of up to 2,048 tokens need ~59 GB of bf16 KV for Qwen3-0.6B's shape;
    # nano-vLLM's defaults: a 16,384-token budget per step, up to 512 sequences (256 here: all of them).
    "cuda": dict(model_name="Qwen3-0.6B", model=PRESETS["Qwen3-0.6B"], dtype="bfloat16", device="cuda",
                 engine_kwargs=dict(max_num_seqs=256, max_num_batched_tokens=16384, kv_cache_memory_gb=64.0),
                 time_limit_s=300.0),
    "cpu-smoke": dict(model_name="tiny Qwen3 (stands in for Qwen3-0.6B on the CPU)", model=TINY_QWEN3,
                      dtype="float32", device="cpu", num_requests=8, prompt_len=(8, 32), output_len=(4, 16),
                      engine_kwargs=dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=64),
                      time_limit_s=120.0),
}


def nano_vllm_main(args, argv) -> int:
    """``--nano-vllm``: nano-vLLM's bench workload on the engine; writes its own results file."""
    from nanobench.nano_vllm_bench import NanoVllmWorkload, run_nano_vllm_bench

    if not args.cpu_smoke and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    kind = "cpu-smoke" if args.cpu_smoke else "cuda"
    workload = NanoVllmWorkload(**NANO_VLLM_WORKLOADS[kind])
    if args.time_budget_s is not None:
        workload = dataclasses.replace(workload, time_limit_s=args.time_budget_s)
    today = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else Path("results") / (
        f"gpu-check-nano-vllm-{'cpu-smoke-' if kind == 'cpu-smoke' else ''}{today}.json")
    start = time.monotonic()
    print(f"nano-vLLM's workload on {workload.device}: {workload.num_requests} requests, prompts "
          f"{workload.prompt_len[0]}-{workload.prompt_len[1]}, outputs {workload.output_len[0]}-{workload.output_len[1]}, "
          f"{workload.model_name}, {workload.dtype}")
    result = run_nano_vllm_bench(workload)
    report = {"mode": f"nano-vllm ({kind})",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m nanobench.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": environment(workload.device), "nano_vllm_bench": result,
              "anchors": ["published for this workload (nano-vLLM's bench, 133,966 output tokens, Qwen3-0.6B), as "
                          "quoted in the engine-speed-v3 issue: vLLM 0.10.2 at 8,588 tok/s on an A800-80GB",
                          "shared/spec/ANCHORS.md: on an RTX 4070 Laptop, vLLM 1,361.84 tok/s and nano-vLLM "
                          "1,434.13 tok/s (nano-vLLM's README)"],
              "seconds": round(time.monotonic() - start, 2)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    decode = result["median_decode_step_ms"]
    print(f"  {result['output_tokens']:,} output tokens in {result['seconds']:.1f} s: "
          f"{result['output_tokens_per_s']:,.0f} tok/s ({'complete' if result['complete'] else 'TIME LIMIT'}); "
          f"median decode step {decode['whole_step']:.2f} ms, of which model {decode['model']:.2f} ms; "
          f"host share of a step {result['host_share_of_step']['median']:.0%} (median)")
    print(f"results written to {out}")
    return 0 if result["complete"] else 1


def _summary(stage: str, result: dict) -> str:
    """One line per stage for the terminal; the JSON has everything."""
    if "error" in result:
        return result["error"]
    if stage == "kernels":
        return f"{len(result['cases'])} cases, failed: {result['failed_cases'] or 'none'}"
    if stage == "cuda_graphs":
        return (f"{result['identical']}/{result['requests']} identical, {result['near_tie_divergences']} near-ties, "
                f"{len(result['unexplained'])} unexplained; decode step ms {result['median_decode_step_ms']}")
    if stage == "hf_parity":
        return "; ".join(f"{d}: {r['identical']}/{r['total']} identical, {len(r['unexplained'])} unexplained"
                         for d, r in result["runs"].items())
    if stage == "benchmark":
        rates = {k: round(v["output_tokens_per_s"], 1) for k, v in result["systems"].items()
                 if v.get("output_tokens_per_s")}
        return f"output tok/s {rates}"
    return ""


if __name__ == "__main__":
    raise SystemExit(main())
