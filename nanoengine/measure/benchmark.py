"""Benchmark: the engine against Hugging Face transformers on the same requests (chapter 11).

One process, one run, the same prompts for everyone:

* nanoengine (paged KV, continuous batching, chunked prefill),
* transformers ``generate`` with static batches (left-padded, ``--hf-batch-size`` at a time),
* transformers ``generate_batch`` (its own continuous batching with paged attention),

all greedy with EOS ignored, on the same device and in the same dtype (``--device``,
``--dtype``, resolved as the engine resolves them: "auto" is float32 on a CPU, bfloat16 on
CUDA), so every system produces exactly ``output_len`` tokens per request. The greedy tokens are compared request by request: a difference is accepted only
where transformers' own top-2 logits at the first differing position are closer than
``--tie-tolerance`` (floating-point order can then flip the argmax), and reported either
way. Throughput is output tokens / wall time. The machine's GEMM peak (in the benchmark's
dtype, on its device) is measured in the same run on the model's own matrix shapes, and the
engine's achieved FLOP/s is given as a fraction of it (the roofline of chapter 6). Results
go to a JSON file that names the hardware, the versions, the engine's git revision, the
date and the command; ``results/README.md`` explains every field.

``--compile`` adds an A/B of the engine itself, eager against ``compile=True``
(``benchmark_compile``).

Run it on an otherwise idle machine. PyTorch's OpenMP threads spin while they wait for
work by default, which is fastest when nothing else runs and very slow when something
does; the test script sets ``OMP_WAIT_POLICY=PASSIVE`` for shared CI machines. On the
course's 2-core VM the engine's part of the default workload took ~31 s with the default
policy and ~37 s with PASSIVE (2026-11-29), so the policy is recorded in the results.

    python -m nanoengine bench                                   # default workload
    python -m nanoengine bench --num-requests 4 --output-len 8   # a quick look
    python -m nanoengine bench --compile --skip-hf               # eager vs torch.compile
    python -m nanoengine bench --device cuda --dtype bfloat16    # on a GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from nanoengine.measure.timing import cpu_model
from nanoengine.models.config import ModelConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda; for every system")
    p.add_argument("--dtype", default="auto",
                   help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16; for every system")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=16, help="static batch size for transformers")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--single-stream-tokens", type=int, default=32,
                   help="tokens for the single-stream decode comparison (0 skips it, else >= 2)")
    p.add_argument("--skip-hf", action="store_true", help="only run the engine")
    p.add_argument("--skip-generate-batch", action="store_true")
    p.add_argument("--tie-tolerance", type=float, default=1e-3)
    p.add_argument("--compile", action="store_true",
                   help="also compare the engine eager against compile=True (same run, alternating)")
    p.add_argument("--compile-repeats", type=int, default=3, help="workload runs per engine for --compile")
    p.add_argument("--out", default=None, help="results JSON (default: results/bench-<device>-<date>.json)")


def make_workload(num_requests: int, min_prompt: int, max_prompt: int, seed: int,
                  vocab_limit: int = 10000) -> list[list[int]]:
    """Random token-id prompts of random lengths (nano-vLLM's benchmark style)."""
    if not 1 <= min_prompt <= max_prompt:
        raise ValueError(f"need 1 <= min_prompt <= max_prompt, got {min_prompt} and {max_prompt}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    return [[rng.randrange(vocab_limit) for _ in range(rng.randint(min_prompt, max_prompt))]
            for _ in range(num_requests)]


# --------------------------------------------------------------------- systems
def run_engine(model_dir: Path, prompts: list[list[int]], output_len: int, **engine_kwargs):
    """Greedy tokens per request and the wall time of the whole batch."""
    from nanoengine import LLM, SamplingParams

    llm = LLM(model_dir, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    llm.engine.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    llm.shutdown()
    return [list(o.token_ids) for o in outs], seconds


def load_hf(model_dir: Path, attn_implementation: str | None = None, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32):
    """transformers' model on ``device`` in ``dtype`` (the engine's, so the race is fair), EOS off."""
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **kwargs).to(device).eval()
    model.generation_config.eos_token_id = None  # EOS ignored: exactly output_len tokens
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def run_hf_static(model, prompts: list[list[int]], output_len: int, batch_size: int,
                  device: torch.device | str = "cpu"):
    """transformers ``generate`` on left-padded static batches (inputs built on ``device``, the
    model's); also returns its top-2 logits per step."""
    tokens, scores = [], []
    model.generate(torch.tensor([prompts[0][:8]], device=device), max_new_tokens=2, do_sample=False)  # warm-up
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False,
                             return_dict_in_generate=True, output_scores=True)
        new = out.sequences[:, width:]
        step_scores = torch.stack(out.scores, dim=1)  # (B, output_len, vocab)
        for row in range(len(batch)):
            tokens.append(new[row].tolist())
            scores.append(step_scores[row].topk(2, dim=-1).values.float().cpu())  # (output_len, 2)
    return tokens, time.perf_counter() - start, scores


@torch.no_grad()  # not inference_mode: generate_batch's worker thread updates tensors made in this one
def run_hf_generate_batch(model, prompts: list[list[int]], output_len: int):
    """transformers' continuous batching (``generate_batch``, paged attention)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    seconds = time.perf_counter() - start
    by_prompt = {}
    for out in outputs.values():
        by_prompt.setdefault(tuple(out.prompt_ids), []).append(list(out.generated_tokens))
    tokens = [by_prompt[tuple(p)].pop(0) for p in prompts]
    short = sum(1 for t in tokens if len(t) != output_len)
    if short:  # EOS is off: anything else means its generation loop failed (it logs why)
        raise RuntimeError(f"transformers' generate_batch returned {short} of {len(tokens)} requests without "
                           f"exactly {output_len} tokens: its generation loop failed, see its log above")
    return tokens, seconds


def single_stream_decode(model_dir: Path, hf_model, prompt: list[int], n: int, repeats: int = 5,
                         **engine_kwargs) -> dict:
    """Decode speed of one request alone, the engine against transformers (``decode_rates``)."""
    from nanoengine import LLM

    llm = LLM(model_dir, enable_prefix_caching=False, **engine_kwargs)
    device = hf_model.device

    @torch.inference_mode()
    def hf(k: int) -> None:
        hf_model.generate(torch.tensor([prompt], device=device), max_new_tokens=k, min_new_tokens=k,
                          do_sample=False)
        if device.type == "cuda":  # generate returns before the GPU is done
            torch.cuda.synchronize(device)

    rates = decode_rates({"nanoengine": engine_decoder(llm, prompt), "hf": hf}, n, repeats)
    llm.shutdown()
    ratio = rates["nanoengine"] / rates["hf"] if None not in rates.values() else None
    return {"nanoengine_tok_s": rates["nanoengine"], "hf_tok_s": rates["hf"],
            "ratio": ratio, "tokens": n, "prompt_tokens": len(prompt),
            "repeats": repeats, "method": "(n - 1) / (median time to n tokens - median time to 1 token)"}


def engine_decoder(llm, prompt: list[int]):
    """``run(k)``: the engine generates ``k`` greedy tokens for ``prompt``."""
    from nanoengine import SamplingParams

    def run(k: int) -> None:
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True))

    return run


def decode_rates(systems: dict, n: int, repeats: int) -> dict:
    """Single-stream decode tok/s of each system: ``{name: run(k)}`` -> ``{name: tok/s or None}``.

    Decode only: the time to generate ``n`` tokens minus the time to generate 1 (the
    prefill and first token), over ``n - 1`` tokens. Each system runs ``repeats`` times,
    alternating with the others so slow spells of a noisy machine hit all, and the
    medians are used. None: too fast to time against the machine's noise.
    """
    times = {(name, k): [] for name in systems for k in (1, n)}
    for run in systems.values():
        run(2)  # warm-up
    for _ in range(repeats):
        for name, run in systems.items():
            for k in (1, n):
                start = time.perf_counter()
                run(k)
                times[name, k].append(time.perf_counter() - start)
    decode_seconds = {name: statistics.median(times[name, n]) - statistics.median(times[name, 1])
                      for name in systems}
    return {name: (n - 1) / sec if sec > 0 else None for name, sec in decode_seconds.items()}


# --------------------------------------------------------------- comparisons
def compare_greedy(engine_tokens, reference_tokens, reference_top2=None, tolerance: float = 1e-3) -> dict:
    """Requests identical, and divergences explained (or not) by near-tied reference logits."""
    identical, ties, unexplained = 0, 0, []
    for i, (ours, ref) in enumerate(zip(engine_tokens, reference_tokens)):
        if ours == ref:
            identical += 1
            continue
        pos = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
        gap = None
        if reference_top2 is not None:
            top2 = reference_top2[i][pos]
            gap = float(top2[0] - top2[1])
        if gap is not None and gap < tolerance:
            ties += 1
        else:
            unexplained.append({"request": i, "position": pos, "top2_gap": gap})
    return {"identical": identical, "near_tie_divergences": ties, "unexplained": unexplained,
            "total": len(engine_tokens)}


def measure_gemm_peak(config: ModelConfig, tokens: int = 1024, repeats: int = 15,
                      device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """Best GFLOP/s of torch matmuls on the model's own weight shapes, in ``dtype`` on ``device``.

    On a CPU in float32 both ways to multiply are tried, ``F.linear`` (MKL) and a oneDNN
    prepacked weight (what the engine uses, ``kernels.cpu_gemm``), and the faster one
    counts: the roofline is what this machine can do, not what one library does. The
    timing is the course's one helper (``nanoengine.measure.timing``); the fastest run of
    each shape is used, as this command always has.
    """
    from nanoengine.measure.timing import measure_gemm_peak as measure_peak, model_gemm_shapes

    peak = measure_peak(model_gemm_shapes(config), tokens, repeats=repeats, warmup=1, device=device, dtype=dtype,
                        paths=("F.linear", "engine"))
    return max(m.best_flops_per_s for m in peak.measurements) / 1e9


def workload_flops(config: ModelConfig, prompts: list[list[int]], output_len: int) -> float:
    """Model FLOPs to serve the workload: 2 x weights per token, LM head per sampled
    token, and attention scores/values over each token's context."""
    layer_params = config.num_parameters() - config.vocab_size * config.hidden_size * (
        1 if config.tie_word_embeddings else 2) - config.hidden_size
    q_width = config.num_attention_heads * config.head_dim
    total = 0.0
    for p in prompts:
        n_tokens = len(p) + output_len - 1  # every prompt token and every fed-back output
        total += 2 * layer_params * n_tokens
        total += 2 * config.vocab_size * config.hidden_size * output_len
        context_sum = n_tokens * (n_tokens + 1) / 2
        total += 4 * q_width * config.num_hidden_layers * context_sum
    return total


def environment() -> dict:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}
    info["cpu_model"] = cpu_model()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    info["nanoengine_revision"] = source_revision()
    info["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "unset (OpenMP default: threads spin, then sleep)")
    return info


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15-minute load averages (runnable processes; None where unknown).

    Above the core count, other work competed with the benchmark for the CPU.
    """
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def source_revision() -> str | None:
    """The git commit of the engine's source tree, "+modified" if it has local changes."""
    import subprocess

    root = Path(__file__).resolve().parents[2]  # the repository: nanoengine/measure/ -> ../..
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "nanoengine"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None  # not a git checkout (an installed wheel) or no git
    return rev + ("+modified" if dirty else "")


# ---------------------------------------------------------------------- main
def run_from_args(args: argparse.Namespace) -> dict:
    from nanoengine.config import EngineConfig
    from nanoengine.loader.weights import resolve_model_source

    if args.single_stream_tokens == 1 or args.single_stream_tokens < 0:
        raise ValueError(f"single_stream_tokens must be 0 (skip) or >= 2 (decode is timed after the first "
                         f"token), got {args.single_stream_tokens}")
    if args.compile_repeats < 1:
        raise ValueError(f"compile_repeats must be an integer >= 1, got {args.compile_repeats}")
    # Resolved once, the engine's way, for every system: transformers runs where the engine does.
    resolved = EngineConfig(device=args.device, dtype=args.dtype)
    device, dtype = resolved.torch_device, resolved.torch_dtype
    dtype_name = str(dtype).removeprefix("torch.")
    engine_kwargs = dict(device=args.device, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    load_at_start = load_average()
    model_dir = resolve_model_source(args.model)
    config = ModelConfig.from_pretrained(model_dir)
    prompts = make_workload(args.num_requests, args.min_prompt, args.max_prompt, args.seed,
                            vocab_limit=min(10000, config.vocab_size))
    total_out = args.num_requests * args.output_len
    print(f"workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} random ids, "
          f"{args.output_len} output tokens each, greedy, EOS ignored; model {model_dir.name}")
    print(f"every system on {device.type} in {dtype_name}")
    peak = measure_gemm_peak(config, device=device, dtype=dtype)
    print(f"{dtype_name} GEMM peak on the model's shapes: {peak:.1f} GFLOP/s")

    results: dict = {"device": device.type, "dtype": dtype_name, "systems": {}}
    engine_tokens, seconds = run_engine(model_dir, prompts, args.output_len, **engine_kwargs)
    flops = workload_flops(config, prompts, args.output_len)
    results["systems"]["nanoengine"] = {"seconds": seconds, "output_tokens_per_s": total_out / seconds,
                                        "achieved_gflops": flops / seconds / 1e9,
                                        "fraction_of_gemm_peak": flops / seconds / 1e9 / peak}
    print(f"nanoengine              {total_out / seconds:8.1f} tok/s  ({seconds:.1f} s, "
          f"{flops / seconds / 1e9:.1f} GFLOP/s = {flops / seconds / 1e9 / peak:.0%} of the GEMM peak)")

    if args.compile:
        from nanoengine.measure.benchmark_compile import compare_compile

        results["compile"] = compare_compile(model_dir, prompts, args.output_len, args.compile_repeats,
                                             args.single_stream_tokens, **engine_kwargs)

    if not args.skip_hf:
        model = load_hf(model_dir, device=device, dtype=dtype)
        hf_where = {"device": model.device.type, "dtype": str(model.dtype).removeprefix("torch.")}
        hf_tokens, hf_seconds, hf_top2 = run_hf_static(model, prompts, args.output_len, args.hf_batch_size,
                                                       device=model.device)
        check = compare_greedy(engine_tokens, hf_tokens, hf_top2, args.tie_tolerance)
        results["systems"]["hf_static"] = {"seconds": hf_seconds, "output_tokens_per_s": total_out / hf_seconds,
                                           "batch_size": args.hf_batch_size, **hf_where, "greedy_check": check}
        print(f"transformers static ({args.hf_batch_size}) {total_out / hf_seconds:8.1f} tok/s  "
              f"({hf_seconds:.1f} s); greedy tokens identical for {check['identical']}/{check['total']} "
              f"requests, {check['near_tie_divergences']} near-tie divergences, "
              f"{len(check['unexplained'])} unexplained")
        if not args.skip_generate_batch:
            # transformers >= 5.23 runs generate_batch with paged attention over sdpa itself
            cb_tokens, cb_seconds = run_hf_generate_batch(model, prompts, args.output_len)
            cb_check = compare_greedy(engine_tokens, cb_tokens, hf_top2, args.tie_tolerance)
            results["systems"]["hf_generate_batch"] = {"seconds": cb_seconds,
                                                       "output_tokens_per_s": total_out / cb_seconds,
                                                       **hf_where, "greedy_check": cb_check}
            print(f"transformers generate_batch {total_out / cb_seconds:6.1f} tok/s  ({cb_seconds:.1f} s); "
                  f"identical for {cb_check['identical']}/{cb_check['total']} requests")
        ratios = {name: results["systems"]["nanoengine"]["output_tokens_per_s"] / r["output_tokens_per_s"]
                  for name, r in results["systems"].items() if name != "nanoengine"}
        results["ratios_engine_over"] = ratios
        print("engine / transformers: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
        if args.single_stream_tokens:
            single = single_stream_decode(model_dir, model, prompts[0][:32], args.single_stream_tokens,
                                          device=args.device, dtype=args.dtype)
            results["single_stream_decode"] = single
            if single["ratio"] is None:
                print("single stream decode: too fast to time against this machine's noise; use more "
                      "--single-stream-tokens")
            else:
                print(f"single stream decode (medians of {single['repeats']}): nanoengine "
                      f"{single['nanoengine_tok_s']:.1f} tok/s, transformers {single['hf_tok_s']:.1f} tok/s "
                      f"({single['ratio']:.2f}x)")

    results.update({
        "workload": {"num_requests": args.num_requests, "prompt_len": [args.min_prompt, args.max_prompt],
                     "output_len": args.output_len, "seed": args.seed, "greedy": True, "ignore_eos": True,
                     "prompt_tokens": sum(len(p) for p in prompts)},
        "gemm_peak_gflops": peak, "gemm_peak_dtype": dtype_name, "model": model_dir.name,
        "load_average": {"start": load_at_start, "end": load_average()},
        "environment": environment(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": getattr(args, "command_line", None) or " ".join(sys.argv),
    })
    out = Path(args.out) if args.out else Path("results") / (
        f"bench-{device.type}-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"results written to {out}")
    return results

