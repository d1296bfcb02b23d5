"""Benchmark: the engine against Hugging Face transformers on the same requests (chapter 11).

One process, one run, the same prompts for everyone:

* nanoengine (paged KV, continuous batching, chunked prefill),
* transformers ``generate`` with static batches (left-padded, ``--hf-batch-size`` at a time),
* transformers' continuous batching (the manager behind ``generate_batch``, paged
  attention), timed after its setup as the engine is timed after its construction,

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

Every system runs the workload ``--repeats`` times, alternating (engine, static,
``generate_batch``, then the reverse, ...) so a slow spell of a noisy machine hits all of them
and no system always runs first or always follows another; the
files keep every run and report medians with their spread. The engine's own per-token
timestamps give TTFT, TPOT and inter-token latency percentiles (transformers' batch APIs
return whole results, so their latencies are not observable here).

Options beyond the default offline race:

* ``--min-output-len``: uneven output lengths, drawn per request from
  [min-output-len, output-len]. Static batching then runs each batch to its longest
  request and only the tokens requested count (the cost static batching really pays);
  ``generate_batch`` gets each request's own length.
* ``--online-rates R ...``: the engine serving Poisson arrivals at R requests/s: requests
  join while others run, and TTFT counts from each request's arrival. With ``--server URL``
  the same arrivals go to an OpenAI-compatible server instead (``online_client``).
* ``--batch-sizes B ...``: the engine with at most B sequences per step, for each B.
* ``--vs-vllm``: vLLM's CPU build as one more system, from its own virtualenv
  (``./course vllm-setup``), loaded once in a subprocess and timed in the same rounds;
  its greedy tokens on the first prompts are compared with the engine's, and with
  ``--online-rates`` both servers are started and raced through the same client
  (``vllm_peer``, ``vllm_runner``, ``server_race``).
* ``--vs-llamacpp``: instead, one stream: the engine against llama.cpp (llama-cpp-python from
  its own virtualenv, ``./course llamacpp-setup``) on GGUF files of the engine's own weights
  at its dtype, the same prompt and tokens, alternating rounds: time to first token, decode
  rate and the greedy tokens compared (``llamacpp_peer``, ``llamacpp_runner``, ``gguf_export``).
* ``--profile``: the engine's steps under ``torch.profiler``, at batch 1 and at the
  workload's batch, cut into GEMMs, attention, other ops, sampling and host work; with
  ``--vs-vllm`` vLLM's steps too, in a runner of its own (``step_profile``). CPU only.
* The roofline of the machine (GEMM peak and copy bandwidth, same dtype and device) is
  always recorded; ``--compile`` adds an A/B of the engine itself, eager against
  ``compile=True`` (``benchmark_compile``; CUDA only, as ``compile=True`` is).

Run it on an otherwise idle machine. PyTorch's OpenMP threads spin while they wait for
work by default, which is fastest when nothing else runs and very slow when something
does; the test script sets ``OMP_WAIT_POLICY=PASSIVE`` for shared CI machines. On an
idle machine passive waiting made the default workload measurably slower
(``results/README.md``), so the bench keeps the default and records the policy.

    python -m nanoengine bench                                   # default workload
    python -m nanoengine bench --num-requests 4 --output-len 8   # a quick look
    python -m nanoengine bench --min-output-len 8 --online-rates 0.5 1 2 --batch-sizes 1 8 32
    python -m nanoengine bench --device cuda --dtype bfloat16    # on a GPU
    python -m nanoengine bench --device cuda --compile --skip-hf # and eager vs torch.compile there
    python -m nanoengine bench --vs-vllm --dtype bfloat16        # with vLLM's CPU build (./course vllm-setup)
    python -m nanoengine bench --vs-vllm --profile --skip-hf     # and where each engine spends its step
    python -m nanoengine bench --vs-llamacpp --output-len 128    # one stream against llama.cpp (./course llamacpp-setup)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nanobench.timing import (cpu_model, in_turn, measure_gemm_peak as measure_peak, measure_memory_bandwidth,
                              model_gemm_shapes, source_revision)
from nanoengine.backends import cpu_platform
from nanoengine.models.config import ModelConfig


CB_PAGE_SIZE = 256  # tokens per page of transformers' paged cache (its default)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda; for every system")
    p.add_argument("--dtype", default="auto",
                   help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16; for every system")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (the most, with "
                   "--min-output-len)")
    p.add_argument("--min-output-len", type=int, default=None,
                   help="uneven output lengths: each request's drawn from [this, --output-len] (seeded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of the workload per system (alternating)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="static batch size for transformers")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--online-rates", type=float, nargs="+", default=[], metavar="RATE",
                   help="also serve the workload to the engine as Poisson arrivals at each RATE requests/s")
    p.add_argument("--server", default=None, metavar="URL",
                   help="with --online-rates: send those arrivals to this OpenAI-compatible server (its root or "
                   "/v1 URL) through a streaming client instead, and measure only that (nanobench/online_client.py)")
    p.add_argument("--server-saturation", action="store_true",
                   help="also start the engine's server in a process of its own and send it the whole workload "
                        "at once, alternating with the same arrivals in this process: the server's throughput at "
                        "saturation over the in-process one, --repeats rounds (nanobench/server_race.py)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[], metavar="B",
                   help="also run the engine with at most B sequences per step, for each B")
    p.add_argument("--single-stream-tokens", type=int, default=32,
                   help="tokens for the single-stream decode comparison (0 skips it, else >= 2)")
    p.add_argument("--skip-hf", action="store_true", help="only run the engine")
    p.add_argument("--skip-generate-batch", action="store_true")
    p.add_argument("--tie-tolerance", type=float, default=1e-3)
    p.add_argument("--compile", action="store_true",
                   help="also compare the engine eager against compile=True (same run, alternating); CUDA only")
    p.add_argument("--compile-repeats", type=int, default=3, help="workload runs per engine for --compile")
    p.add_argument("--overhead", action="store_true",
                   help="instead: the engine's host time per decode step on a tiny random model (no GPU needed, "
                        "no transformers), split by phase (nanobench/overhead.py)")
    p.add_argument("--overhead-requests", type=int, nargs="+", default=[1, 64, 256], metavar="N",
                   help="with --overhead: running requests per measured step, for each N (default 1 64 256)")
    p.add_argument("--overhead-steps", type=int, default=30, help="with --overhead: timed decode steps per N")
    p.add_argument("--vs-vllm", action="store_true",
                   help="also run vLLM's CPU build on the same workload, alternating with the others, from its own "
                        "virtualenv (made by ./course vllm-setup; nanobench/vllm_peer.py)")
    p.add_argument("--vllm-venv", default=None, help="with --vs-vllm: vLLM's virtualenv (default: .venv-vllm)")
    p.add_argument("--vllm-threads-bind", default=None,
                   help="with --vs-vllm: VLLM_CPU_OMP_THREADS_BIND, the cores vLLM's threads are pinned to "
                        "(default: every core this process may use, e.g. 0-1)")
    p.add_argument("--vllm-kvcache-gib", type=int, default=4,
                   help="with --vs-vllm: VLLM_CPU_KVCACHE_SPACE, vLLM's KV cache in GiB (default 4)")
    p.add_argument("--vllm-enforce-eager", action="store_true",
                   help="with --vs-vllm: run vLLM eagerly (by default it compiles its model, as its CPU build does)")
    p.add_argument("--vllm-compare-prompts", type=int, default=8,
                   help="with --vs-vllm: greedy tokens of this many first prompts compared with the engine's")
    from nanobench.llamacpp_peer import add_arguments as add_llamacpp_arguments

    add_llamacpp_arguments(p)
    p.add_argument("--speculative", action="store_true",
                   help="speculative decoding (prompt lookup) against plain decoding, alternating rounds, on a "
                        "copying and an open workload (nanobench/speculative.py)")
    p.add_argument("--spec-tokens", type=int, default=4, help="with --speculative: k, drafts per step")
    p.add_argument("--spec-lookup-max", type=int, default=4, help="with --speculative: longest n-gram looked up")
    p.add_argument("--spec-lookup-min", type=int, default=2, help="with --speculative: shortest n-gram looked up")
    p.add_argument("--spec-tokens-per-batch-size", type=_json_schedule, default=None, metavar="JSON",
                   help="with --speculative: k by batch size, vLLM's num_speculative_tokens_per_batch_size, "
                        "e.g. '[[1, 1, 7], [2, 256, 0]]' (inclusive ranges of requests per step, and their k)")
    p.add_argument("--spec-output-len", type=int, default=128,
                   help="with --speculative: most tokens per request (EOS ends one sooner)")
    p.add_argument("--structured", action="store_true",
                   help="structured output: JSON-schema-constrained against free generation of the same tokens, "
                        "batched and single stream, alternating rounds; with --vs-vllm vLLM's too "
                        "(nanobench/structured.py)")
    p.add_argument("--vllm-structured-backend", default=None,
                   help="with --structured --vs-vllm: vLLM's grammar backend (its structured_outputs_config "
                        "backend: xgrammar, guidance; default: vLLM's own choice)")
    p.add_argument("--profile", action="store_true",
                   help="also profile the engine's steps (and with --vs-vllm vLLM's, in a runner of its own) under "
                        "torch.profiler, at batch 1 and at the workload's batch: ms per step and the shares of GEMMs, "
                        "attention, other ops, sampling and host work (nanobench/step_profile.py); CPU only")
    p.add_argument("--out", default=None, help="results JSON (default: results/bench-<device>-<date>.json; with "
                   "--vs-vllm results/bench-vllm-<device>-<date>-<dtype>.json, with --vs-llamacpp "
                   "results/bench-llamacpp-cpu-<date>-<dtype>.json)")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad values before anything is loaded or measured, naming what is allowed."""
    def at_least(name: str, value, low) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

    at_least("num_requests", args.num_requests, 1)
    at_least("output_len", args.output_len, 1)
    at_least("repeats", args.repeats, 1)
    at_least("hf_batch_size", args.hf_batch_size, 1)
    at_least("compile_repeats", args.compile_repeats, 1)
    if args.min_output_len is not None:
        at_least("min_output_len", args.min_output_len, 1)
        if args.min_output_len > args.output_len:
            raise ValueError(f"need min_output_len <= output_len, got {args.min_output_len} and {args.output_len}")
    if args.single_stream_tokens == 1 or args.single_stream_tokens < 0:
        raise ValueError(f"single_stream_tokens must be 0 (skip) or >= 2 (decode is timed after the first "
                         f"token), got {args.single_stream_tokens}")
    for rate in args.online_rates:
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"online_rates must be finite request rates > 0 (requests per second), got {rate}")
    server = getattr(args, "server", None)
    if server is not None:
        from nanobench.online_client import api_root

        api_root(server)  # ValueError unless it is an http(s) URL
        if not args.online_rates:
            raise ValueError("server needs --online-rates: the server is measured with Poisson arrivals at those rates")
        if getattr(args, "server_saturation", False):
            raise ValueError("server_saturation starts the engine's own server; it cannot be combined with --server "
                             "(a server someone else started): choose one")
    for size in args.batch_sizes:
        at_least("each of batch_sizes", size, 1)
    if not (math.isfinite(args.tie_tolerance) and args.tie_tolerance >= 0):
        raise ValueError(f"tie_tolerance must be a finite number >= 0, got {args.tie_tolerance}")
    for count in args.overhead_requests:
        at_least("each of overhead_requests", count, 1)
    at_least("overhead_steps", args.overhead_steps, 1)
    if getattr(args, "speculative", False):  # the engine's own checks, before anything loads
        from nanoengine.spec_decode import SpeculativeConfig

        at_least("spec_output_len", args.spec_output_len, 1)
        SpeculativeConfig(num_speculative_tokens=args.spec_tokens, prompt_lookup_max=args.spec_lookup_max,
                          prompt_lookup_min=args.spec_lookup_min,
                          num_speculative_tokens_per_batch_size=args.spec_tokens_per_batch_size)
    if getattr(args, "profile", False):
        check_profile_arguments(args)
    if getattr(args, "structured", False):
        others = [flag for flag, on in (("--speculative", getattr(args, "speculative", False)),
                                        ("--overhead", args.overhead), ("--server", getattr(args, "server", None)),
                                        ("--vs-llamacpp", getattr(args, "vs_llamacpp", False)),
                                        ("--profile", getattr(args, "profile", False))) if on]
        if others:
            raise ValueError(f"--structured runs a workload of its own (JSON schemas; with --vs-vllm vLLM's too): "
                             f"leave out {', '.join(others)}")
        at_least("num_requests", args.num_requests, 1)
    if getattr(args, "vllm_structured_backend", None) and not (getattr(args, "structured", False) and args.vs_vllm):
        raise ValueError("--vllm-structured-backend chooses vLLM's grammar library for --structured --vs-vllm: "
                         "give both, or leave it out")
    if getattr(args, "vs_llamacpp", False):  # first: it names the options it cannot take, --vs-vllm among them
        from nanobench.llamacpp_peer import check_arguments as check_llamacpp_arguments

        check_llamacpp_arguments(args)
    if getattr(args, "vs_vllm", False):
        check_vllm_arguments(args)
    # after the peers' checks: they refuse --compile with a reason of their own
    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.compile and not on_cuda:
        raise ValueError(f"--compile compares the engine with compile=True, which applies to CUDA only (on a CPU the "
                         f"default fast path is one native call per decoder layer): run it with --device cuda, got "
                         f"--device {args.device}" + (" (auto picks the CPU here)" if args.device == "auto" else ""))


def check_profile_arguments(args: argparse.Namespace) -> None:
    """``--profile``'s own checks, before anything loads: it profiles the bench's offline
    workload, on a CPU (an operator's time is read on the host's clock, which a GPU's
    asynchronous kernels do not keep)."""
    others = [flag for flag, on in (("--speculative", getattr(args, "speculative", False)),
                                    ("--overhead", args.overhead), ("--server", getattr(args, "server", None)))
              if on]
    if others:
        raise ValueError(f"--profile profiles the bench's own workload (with --vs-vllm, vLLM's too): leave out "
                         f"{', '.join(others)}")
    if args.device not in ("auto", "cpu") or (args.device == "auto" and torch.cuda.is_available()):
        raise ValueError(f"--profile reads operators' times on the CPU (torch.profiler, CPU activity), which a GPU's "
                         f"asynchronous kernels do not keep: run it with --device cpu, got --device {args.device}"
                         + (" (auto picks CUDA here)" if args.device == "auto" else ""))


def _json_schedule(text: str) -> list:
    """``--spec-tokens-per-batch-size``'s JSON (the config checks its entries)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): {text!r}; e.g. '[[1, 1, 7], [2, 256, 0]]'") from exc


def check_cpu_peer(args: argparse.Namespace, flag: str, peer: str, dtypes: tuple[str, ...], why: str) -> None:
    """A CPU peer's first checks: the bench on a CPU (``--device cpu``, or ``auto`` where there is
    no CUDA) and ``--dtype`` one of ``dtypes`` (``why``: the peer's reason for them)."""
    if args.device not in ("auto", "cpu") or (args.device == "auto" and torch.cuda.is_available()):
        raise ValueError(f"{flag} compares with {peer}'s CPU build: run it with --device cpu, got --device "
                         f"{args.device}" + (" (auto picks CUDA here)" if args.device == "auto" else ""))
    if args.dtype not in ("auto", *dtypes):
        raise ValueError(f"{flag} runs both engines in {' or '.join(dtypes)} ({why}), got --dtype {args.dtype}")


def check_vllm_arguments(args: argparse.Namespace) -> None:
    """``--vs-vllm``'s own checks, before anything loads: vLLM's CPU build runs on a CPU in
    float32 or bfloat16, and its virtualenv must exist (``./course vllm-setup``)."""
    from nanobench.vllm_peer import DEFAULT_VENV, DTYPES, vllm_python

    check_cpu_peer(args, "--vs-vllm", "vLLM", DTYPES, "vLLM's CPU dtypes")
    if isinstance(args.vllm_kvcache_gib, bool) or not isinstance(args.vllm_kvcache_gib, int) \
            or args.vllm_kvcache_gib < 1:
        raise ValueError(f"vllm_kvcache_gib must be a whole number of GiB >= 1, got {args.vllm_kvcache_gib!r}")
    if isinstance(args.vllm_compare_prompts, bool) or not isinstance(args.vllm_compare_prompts, int) \
            or args.vllm_compare_prompts < 1:
        raise ValueError(f"vllm_compare_prompts must be an integer >= 1, got {args.vllm_compare_prompts!r}")
    if getattr(args, "server", None):
        raise ValueError("--vs-vllm starts both servers itself with --online-rates: leave out --server")
    if args.overhead or args.compile or args.batch_sizes:
        raise ValueError("--vs-vllm races the offline workload (and --online-rates): leave out --overhead, "
                         "--compile and --batch-sizes")
    vllm_python(args.vllm_venv or DEFAULT_VENV)  # VllmSetupError naming ./course vllm-setup when missing


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


def make_varlen_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                         vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Random prompts (``make_workload``, ids below 10,000) and a random output length for each.

    The GPU check's workload and nano-vLLM's (``nano_vllm_bench``) are drawn this way.
    """
    prompts = make_workload(num_requests, prompt_len[0], prompt_len[1], seed, vocab_limit=min(10000, vocab_size))
    rng = random.Random(seed + 1)
    return prompts, [rng.randint(*output_len) for _ in prompts]


def make_output_lens(num_requests: int, min_len: int, max_len: int, seed: int) -> list[int]:
    """Each request's output length, uniform in [min_len, max_len] (seeded; all max_len if equal)."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len} and {max_len}")
    rng = random.Random(seed + 1)  # not the prompts' stream: the same prompts with or without
    return [rng.randint(min_len, max_len) for _ in range(num_requests)]


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (seconds from the start) of a Poisson process of ``rate`` requests/s:
    independent exponential gaps of mean 1/rate, so arrivals bunch and thin out as real
    traffic does. The first request arrives at 0."""
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number of requests per second > 0, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


# ------------------------------------------------------------------ statistics
def spread(values: list[float]) -> dict:
    """Median, quartiles and extremes of a few runs, with the runs themselves."""
    import numpy as np

    if not values:
        raise ValueError("spread of no values")
    q1, median, q3 = (float(x) for x in np.percentile(values, [25, 50, 75]))
    return {"median": median, "q1": q1, "q3": q3, "min": float(min(values)), "max": float(max(values)),
            "runs": [float(v) for v in values]}


def percentiles(values: list[float], points=(50, 90, 99)) -> dict | None:
    """``{"p50": ..., "p90": ..., "p99": ..., "count": n}`` in milliseconds (values in seconds)."""
    import numpy as np

    if not values:
        return None
    found = np.percentile(np.asarray(values) * 1000.0, list(points))
    return {**{f"p{p}": float(v) for p, v in zip(points, found)}, "count": len(values)}


def latency_summary(metrics) -> dict:
    """TTFT, TPOT, inter-token latency and end-to-end latency percentiles (ms) of finished
    requests, from the engine's own timestamps (``RequestMetrics``).

    TTFT counts from each request's arrival; TPOT is a request's mean gap after its first
    token; ITL pools every gap between consecutive tokens of every request, so its p99 is
    the stall a streaming reader notices.
    """
    ttft = [m.ttft for m in metrics if m.ttft is not None]
    tpot = [m.tpot for m in metrics if m.tpot is not None]
    itl = [gap for m in metrics for gap in m.inter_token_latencies]
    e2e = [m.e2e_latency for m in metrics if m.e2e_latency is not None]
    return {"ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot), "itl_ms": percentiles(itl),
            "e2e_ms": percentiles(e2e)}


# --------------------------------------------------------------------- systems
def greedy_params(output_lens: list[int]) -> list:
    """Greedy sampling, EOS ignored: request i produces exactly ``output_lens[i]`` tokens.

    Only final outputs are read, as ``LLM.generate`` reads them (``FINAL_ONLY``).
    """
    from nanoengine.sampling_params import RequestOutputKind, SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
            for n in output_lens]


def build_engine(model_dir: Path, **engine_kwargs):
    """The engine loaded and warmed up (one short request), ready for timed runs."""
    from nanoengine import LLM

    llm = LLM(model_dir, **engine_kwargs)
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], greedy_params([2]))
    return llm


@dataclass(frozen=True)
class EngineRun:
    """One timed run of the workload through the engine."""

    tokens: list[list[int]]  # greedy tokens per request, in input order
    seconds: float  # first arrival to last finish
    metrics: list  # the engine's RequestMetrics per request (timestamps of every token)


def run_engine_once(llm, prompts: list[list[int]], output_lens: list[int],
                    arrivals: list[float] | None = None) -> EngineRun:
    """Serve ``prompts`` on a loaded engine, stepping it directly, with an empty prefix cache.

    ``arrivals`` None: every request is queued at the start (offline). Otherwise each
    request is added when its offset (seconds) comes, with that moment as its arrival
    time, so its TTFT includes waiting for the step that was running when it arrived.
    """
    engine = llm.engine
    if len(output_lens) != len(prompts) or (arrivals is not None and len(arrivals) != len(prompts)):
        raise ValueError(f"need one output length (and arrival) per prompt, got {len(prompts)} prompts, "
                         f"{len(output_lens)} lengths" + ("" if arrivals is None else f", {len(arrivals)} arrivals"))
    engine.reset_prefix_cache()  # a repeat must not find the previous run's prompts cached
    params = greedy_params(output_lens)
    offsets = arrivals if arrivals is not None else [0.0] * len(prompts)
    ids: list[str] = []
    finished = {}
    start = time.perf_counter()
    try:
        while len(ids) < len(prompts) or engine.has_unfinished_requests():
            now = time.perf_counter()
            while len(ids) < len(prompts) and start + offsets[len(ids)] <= now:
                i = len(ids)
                ids.append(engine.add_request(prompts[i], params[i], arrival_time=start + offsets[i]))
            if engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
            elif len(ids) < len(prompts):  # idle until the next arrival
                time.sleep(max(0.0, start + offsets[len(ids)] - time.perf_counter()))
    except BaseException:
        for request_id in ids:
            if engine.has_request(request_id):
                engine.abort(request_id)
        raise
    seconds = time.perf_counter() - start
    outs = [finished[i] for i in ids]
    return EngineRun([list(o.token_ids) for o in outs], seconds, [o.metrics for o in outs])


def run_engine(model_dir: Path, prompts: list[list[int]], output_len: int | list[int], **engine_kwargs):
    """Greedy tokens per request and the wall time of the whole batch (one run, fresh engine)."""
    lens = output_len if isinstance(output_len, list) else [output_len] * len(prompts)
    llm = build_engine(model_dir, **engine_kwargs)
    try:
        run = run_engine_once(llm, prompts, lens)
    finally:
        llm.shutdown()
    return run.tokens, run.seconds


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
def run_hf_static(model, prompts: list[list[int]], output_len: int | list[int], batch_size: int,
                  device: torch.device | str = "cpu"):
    """transformers ``generate`` on left-padded static batches (inputs built on ``device``, the
    model's); also returns its top-2 logits per step.

    With one output length per request, each batch runs until its longest request is done
    (that is static batching) and every request's tokens are cut to its own length.
    """
    lens = output_len if isinstance(output_len, list) else [output_len] * len(prompts)
    tokens, scores = [], []
    model.generate(torch.tensor([prompts[0][:8]], device=device), max_new_tokens=2, do_sample=False)  # warm-up
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, batch_lens = prompts[i:i + batch_size], lens[i:i + batch_size]
        width, steps = max(len(p) for p in batch), max(batch_lens)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False,
                             return_dict_in_generate=True, output_scores=True)
        new = out.sequences[:, width:]
        step_scores = torch.stack(out.scores, dim=1)  # (B, steps, vocab)
        for row, n in enumerate(batch_lens):
            tokens.append(new[row, :n].tolist())
            scores.append(step_scores[row, :n].topk(2, dim=-1).values.float().cpu())  # (n, 2)
    return tokens, time.perf_counter() - start, scores


def static_computed_tokens(output_lens: list[int], batch_size: int) -> int:
    """Output tokens static batching computes: every request of a batch runs to the batch's longest."""
    return sum(max(output_lens[i:i + batch_size]) * len(output_lens[i:i + batch_size])
               for i in range(0, len(output_lens), batch_size))


@torch.no_grad()  # not inference_mode: the manager's own thread updates tensors made here (see below)
def run_hf_continuous(model, prompts: list[list[int]], output_lens: list[int], time_limit_s: float | None = None,
                      cb_config: dict | None = None) -> dict:
    """transformers' continuous batching: the manager behind ``generate_batch``, one
    ``max_new_tokens`` per request, timed from the first request added to the last finished.

    Its setup (building the manager, its static buffers and paged cache, which
    ``generate_batch`` redoes on every call and which took ~30 s on a 2-core CPU even for a
    tiny model with its default cache size) and a short warm-up request are timed apart as
    ``setup_seconds``, as the engine's construction and warm-up are: a server pays them once.
    ``cb_config_for`` sizes the cache for a workload. Stops after
    ``time_limit_s`` (None: no limit), cancelling what is left.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                              max_generated_length=max(output_lens), num_requests=len(prompts))
    except ImportError:  # an internal module: without hints transformers picks its defaults
        hints = None
    config = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0)
    done = {}
    setup_start = time.perf_counter()
    # The warm-up captures CUDA graphs at the largest batch; on the CPU it would only run
    # one huge dummy forward (tens of seconds), so it is skipped there.
    with model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=ContinuousBatchingConfig(**(cb_config or {})),
            block=True, timeout=5, workload_hints=hints, warmup=model.device.type == "cuda") as manager:
        attn_implementation = model.config._attn_implementation  # what the manager switched to
        # One short warm-up request: the manager builds its batch processor (and allocates
        # and fills its paged cache) in its own thread when the first request comes, so
        # without this that work would land in the timed window.
        warmup_id = manager.add_request(prompts[0][:8], max_new_tokens=2, eos_token_id=-1)
        while True:
            result = manager.get_result(timeout=0.5)
            if result is not None and result.request_id == warmup_id and result.is_finished():
                break
            if result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped during its warm-up request")
        start = time.perf_counter()
        setup_seconds = start - setup_start
        deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(prompts, output_lens)]
        while len(done) < len(ids) and (deadline is None or time.monotonic() < deadline):
            result = manager.get_result(timeout=0.5)
            if result is not None and result.is_finished():
                done[result.request_id] = list(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped unexpectedly")
        seconds = time.perf_counter() - start
        for request_id in ids:
            if request_id not in done:
                manager.cancel_request(request_id)
    tokens = [done.get(i) for i in ids]
    # EOS is off, so a finished request has exactly the tokens it asked for. Fewer means the
    # manager's generation loop failed (it logs the error and finishes the requests empty):
    # with torch 2.11, tensors made under inference_mode in this thread and updated in the
    # manager's thread did exactly that. Never count such a run as a measurement.
    short = sum(1 for t, n in zip(tokens, output_lens) if t is not None and len(t) != n)
    if short:
        raise RuntimeError(f"transformers' continuous batching finished {short} of {len(done)} requests with a "
                           f"different number of tokens than asked (EOS is off): its generation loop failed, "
                           f"see its log above")
    return {"tokens": tokens, "seconds": seconds, "setup_seconds": setup_seconds, "complete": len(done) == len(ids),
            "attn_implementation": attn_implementation,
            "output_tokens": sum(len(t) for t in tokens if t is not None), "finished_requests": len(done)}


def cb_config_for(prompts: list[list[int]], output_lens: list[int], max_batch_tokens: int) -> dict:
    """transformers' continuous-batching settings for a workload: the engine's token budget
    per step, and pages enough to hold every request at once (it never needs more). Left to
    its defaults it sizes its cache to 90% of free memory: on a CPU, of the machine's RAM."""
    return {"page_size": CB_PAGE_SIZE, "max_batch_tokens": max_batch_tokens,
            "num_blocks": sum(math.ceil((len(p) + n) / CB_PAGE_SIZE) for p, n in zip(prompts, output_lens))}


def single_stream_decode(model_dir: Path, hf_model, prompt: list[int], n: int, repeats: int = 5,
                         peers: dict | None = None, bandwidth_gbs: float | None = None, **engine_kwargs) -> dict:
    """Decode speed of one request alone, the engine against transformers (``decode_rates``).

    ``hf_model``: transformers' model, or None (``--skip-hf``: ``hf_tok_s`` and ``ratio``
    are None). ``peers``: other engines' ``run(k)`` (vLLM's, ``VllmPeer.decoder``), timed in
    the same alternation; each adds ``<name>_tok_s`` and ``ratio_over_<name>`` (the
    engine's over it). ``bandwidth_gbs``: the machine's copy bandwidth; then
    ``weight_traffic_share`` says how much of it the engine's decode uses to read its
    weights (every weight once per token: the single stream's roofline, chapter 6).
    """
    from nanoengine import LLM

    llm = LLM(model_dir, enable_prefix_caching=False, **engine_kwargs)
    systems = {"nanoengine": engine_decoder(llm, prompt)}
    if hf_model is not None:
        device = hf_model.device

        @torch.inference_mode()
        def hf(k: int) -> None:
            hf_model.generate(torch.tensor([prompt], device=device), max_new_tokens=k, min_new_tokens=k,
                              do_sample=False)
            if device.type == "cuda":  # generate returns before the GPU is done
                torch.cuda.synchronize(device)

        systems["hf"] = hf
    peers = peers or {}
    rates = decode_rates({**systems, **peers}, n, repeats)
    weight_bytes = llm.memory_report().weight_bytes
    llm.shutdown()

    def over(name: str) -> float | None:
        return rates["nanoengine"] / rates[name] if rates["nanoengine"] and rates.get(name) else None

    result = {"nanoengine_tok_s": rates["nanoengine"], "hf_tok_s": rates.get("hf"),
              "ratio": over("hf"), "tokens": n, "prompt_tokens": len(prompt),
              "repeats": repeats, "method": "(n - 1) / (median time to n tokens - median time to 1 token)",
              "weight_bytes": weight_bytes}
    if bandwidth_gbs and rates["nanoengine"]:
        result.update(memory_bandwidth_gbs=bandwidth_gbs,
                      weight_traffic_share=weight_bytes * rates["nanoengine"] / (bandwidth_gbs * 1e9))
    for name in peers:
        result.update({f"{name}_tok_s": rates[name], f"ratio_over_{name}": over(name)})
    return result


def describe_single_stream(single: dict, peers: dict) -> str:
    """The bench's line for ``single_stream_decode``'s result."""
    if single["nanoengine_tok_s"] is None:
        return "single stream decode: too fast to time against this machine's noise; use more --single-stream-tokens"
    others = [("transformers", single["hf_tok_s"], single["ratio"])] if single["hf_tok_s"] is not None else []
    others += [(name, single[name + "_tok_s"], single["ratio_over_" + name]) for name in peers]
    text = f"single stream decode (medians of {single['repeats']}): nanoengine {single['nanoengine_tok_s']:.1f} tok/s"
    text += "".join(f", {name} {rate:.1f} tok/s ({ratio:.2f}x)" for name, rate, ratio in others
                    if rate is not None and ratio is not None)
    if "weight_traffic_share" in single:
        from nanobench.peer_report import weight_traffic_text

        text += "; " + weight_traffic_text(single["weight_traffic_share"], single["memory_bandwidth_gbs"])
    return text


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
    alternating with the others (``in_turn``) so slow spells of a noisy machine hit all, and the
    medians are used. None: too fast to time against the machine's noise.
    """
    times = {(name, k): [] for name in systems for k in (1, n)}
    for run in systems.values():
        run(2)  # warm-up
    for turn in range(repeats):
        for name in in_turn(systems, turn):
            for k in (1, n):
                start = time.perf_counter()
                systems[name](k)
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
    timing is the course's one helper (``nanobench.timing``); the fastest run of
    each shape is used, as this command always has.
    """
    peak = measure_peak(model_gemm_shapes(config), tokens, repeats=repeats, warmup=1, device=device, dtype=dtype,
                        paths=("F.linear", "engine"))
    return max(m.best_flops_per_s for m in peak.measurements) / 1e9


def workload_flops(config: ModelConfig, prompts: list[list[int]], output_len: int | list[int]) -> float:
    """Model FLOPs to serve the workload: 2 x weights per token, LM head per sampled
    token, and attention scores/values over each token's context (``output_len``: one
    for all requests, or one per request)."""
    lens = output_len if isinstance(output_len, list) else [output_len] * len(prompts)
    layer_params = config.num_parameters() - config.vocab_size * config.hidden_size * (
        1 if config.tie_word_embeddings else 2) - config.hidden_size
    q_width = config.num_attention_heads * config.head_dim
    total = 0.0
    for p, output_len in zip(prompts, lens):
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


def measure_roofline(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> dict:
    """The machine's roofline for this run: GEMM peak on the model's shapes and copy bandwidth."""
    peak = measure_gemm_peak(config, device=device, dtype=dtype)
    bandwidth = measure_memory_bandwidth(device=str(device)).bytes_per_s / 1e9
    return {"gemm_peak_gflops": peak, "memory_bandwidth_gbs": bandwidth, "ridge_flops_per_byte": peak / bandwidth,
            "dtype": str(dtype).removeprefix("torch."), "bandwidth_method": "median of a 256 MB float32 copy "
            "(read + write counted)", "peak_method": "best matmul GFLOP/s on the model's weight shapes, 1,024 rows"}


def system_record(seconds: list[float], output_tokens: int) -> dict:
    """One system's timed runs: median seconds and tok/s, with the spread of the runs."""
    rates = [output_tokens / s for s in seconds]
    return {"seconds": statistics.median(seconds), "output_tokens_per_s": statistics.median(rates),
            "seconds_spread": spread(seconds), "tokens_per_s_spread": spread(rates), "repeats": len(seconds)}


def describe(name: str, record: dict) -> str:
    rate = record["tokens_per_s_spread"]
    return (f"{name:<28}{rate['median']:8.1f} tok/s  (median of {record['repeats']}, runs "
            f"{rate['min']:.1f}-{rate['max']:.1f}; {record['seconds']:.1f} s)")


def describe_latency(latency: dict) -> str:
    parts = []
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        if latency[key]:
            parts.append(f"{key.removesuffix('_ms').upper()} p50 {latency[key]['p50']:.0f} ms / "
                         f"p99 {latency[key]['p99']:.0f} ms")
    return ", ".join(parts)


def run_online(llm, prompts, output_lens, rates: list[float], seed: int) -> list[dict]:
    """The engine serving the workload as Poisson arrivals at each rate (requests/s)."""
    rows = []
    for rate in rates:
        arrivals = poisson_arrivals(len(prompts), rate, seed)
        run = run_engine_once(llm, prompts, output_lens, arrivals)
        useful = sum(output_lens)
        rows.append({"rate_requests_per_s": rate, "seconds": run.seconds,
                     "output_tokens_per_s": useful / run.seconds,
                     "achieved_requests_per_s": len(prompts) / run.seconds,
                     "arrival_span_s": arrivals[-1], **latency_summary(run.metrics)})
        print(f"online {rate:g} req/s: {useful / run.seconds:.1f} tok/s; {describe_latency(rows[-1])}")
    return rows


def run_batch_sweep(model_dir: Path, prompts, output_lens, sizes: list[int], repeats: int,
                    **engine_kwargs) -> list[dict]:
    """The engine with at most B sequences per step, for each B: throughput and decode latency."""
    rows = []
    for size in sizes:
        llm = build_engine(model_dir, max_num_seqs=size, **engine_kwargs)
        try:
            runs = [run_engine_once(llm, prompts, output_lens) for _ in range(repeats)]
        finally:
            llm.shutdown()
        record = system_record([r.seconds for r in runs], sum(output_lens))
        rows.append({"max_num_seqs": size, **record,
                     **latency_summary([m for r in runs for m in r.metrics])})
        print(f"max_num_seqs {size:>4}: {record['output_tokens_per_s']:.1f} tok/s; "
              f"{describe_latency(rows[-1])}")
    return rows


def race_vllm_server(peer, model_dir: Path, prompts, output_lens, args: argparse.Namespace) -> dict:
    """``--vs-vllm --online-rates``: the engine's server and vLLM's, each started here, the
    same arrivals through the same client (``server_race``); TTFT and ITL p50/p90 per rate."""
    from nanobench.server_race import engine_server, latency_table, race_servers, vllm_server

    peer.close()  # vLLM's offline process gives its cores and memory to the servers
    settings = peer.settings
    servers = [engine_server(model_dir, settings.dtype, settings.max_num_batched_tokens, settings.max_num_seqs,
                             settings.max_model_len, settings.seed), vllm_server(settings)]
    race = race_servers(servers, prompts, output_lens, args.online_rates, args.seed)
    table = latency_table(race)
    def ms(value) -> str:
        return "-" if value is None else f"{value:.0f}"

    for row in table:
        print(f"online {row['rate_requests_per_s']:g} req/s, {row['server']} server: TTFT p50 {ms(row['ttft_p50_ms'])} "
              f"/ p90 {ms(row['ttft_p90_ms'])} ms, ITL p50 {ms(row['itl_p50_ms'])} / p90 {ms(row['itl_p90_ms'])} ms, "
              f"{row['output_tokens_per_s']:.1f} tok/s, {row['failed']} failed"
              f"{', ran first' if row['ran_first'] else ''}")
    return {"servers": race, "latency": table,
            "client": "openai.AsyncOpenAI, streaming /v1/completions (nanobench/online_client.py)"}


# ---------------------------------------------------------------------- main
def run_from_args(args: argparse.Namespace) -> dict:
    from nanoengine.config import EngineConfig
    from nanoengine.loader.weights import resolve_model_source

    check_arguments(args)
    cpu_platform.wait_for_all_huge_pages()  # a benchmark wants the engines' full speed, every run
    if getattr(args, "vs_llamacpp", False):
        from nanobench.llamacpp_peer import race_llamacpp

        return race_llamacpp(args)
    if args.speculative:
        from nanobench.speculative import run_speculative

        return run_speculative(args)
    if getattr(args, "structured", False):
        from nanobench.structured import run_structured

        return run_structured(args)
    if args.overhead:
        from nanobench.overhead import run_overhead

        return run_overhead(args.overhead_requests, args.overhead_steps, args.out, getattr(args, "command_line", None))
    if getattr(args, "server", None):
        from nanobench.online_client import run_server_bench

        return run_server_bench(args)
    # Resolved once, the engine's way, for every system: transformers runs where the engine does.
    resolved = EngineConfig(device=args.device, dtype=args.dtype,
                            max_num_batched_tokens=args.max_num_batched_tokens)
    device, dtype = resolved.torch_device, resolved.torch_dtype
    dtype_name = str(dtype).removeprefix("torch.")
    engine_kwargs = dict(device=args.device, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    load_at_start = load_average()
    model_dir = resolve_model_source(args.model)
    config = ModelConfig.from_pretrained(model_dir)
    prompts = make_workload(args.num_requests, args.min_prompt, args.max_prompt, args.seed,
                            vocab_limit=min(10000, config.vocab_size))
    min_out = args.output_len if args.min_output_len is None else args.min_output_len
    output_lens = make_output_lens(args.num_requests, min_out, args.output_len, args.seed)
    total_out = sum(output_lens)
    lengths = f"{args.output_len}" if min_out == args.output_len else f"{min_out}-{args.output_len}"
    print(f"workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} random ids, "
          f"{lengths} output tokens each, greedy, EOS ignored; model {model_dir.name}; {args.repeats} repeats")
    print(f"every system on {device.type} in {dtype_name}")
    peer = None
    if getattr(args, "vs_vllm", False):
        from nanobench.vllm_peer import start_peer

        if device.type != "cpu":
            raise ValueError(f"--vs-vllm compares with vLLM's CPU build, but the engine resolved to {device.type}")
        peer = start_peer(args, model_dir, prompts, output_lens, dtype_name, resolved.max_num_seqs)
    try:
        roof = measure_roofline(config, device, dtype)
        peak = roof["gemm_peak_gflops"]
        print(f"roofline: {dtype_name} GEMM peak on the model's shapes {peak:.1f} GFLOP/s, memory bandwidth "
              f"{roof['memory_bandwidth_gbs']:.1f} GB/s, ridge at {roof['ridge_flops_per_byte']:.1f} FLOP/byte")

        llm = build_engine(model_dir, **engine_kwargs)
        # transformers' continuous batching gets the engine's token budget and pages enough for
        # every request at once (it never needs more): by default it sizes its cache to 90% of
        # free memory (on a CPU, of the machine's RAM) and spends tens of seconds filling it.
        cb_config = cb_config_for(prompts, output_lens, args.max_num_batched_tokens)
        hf = None
        if not args.skip_hf:
            hf = load_hf(model_dir, device=device, dtype=dtype)
            hf_where = {"device": hf.device.type, "dtype": str(hf.dtype).removeprefix("torch.")}
        runs: dict[str, list] = {"nanoengine": [], "vllm": [], "hf_static": [], "hf_generate_batch": []}
        compared = min(getattr(args, "vllm_compare_prompts", 0), len(prompts))
        systems = {"nanoengine": lambda: run_engine_once(llm, prompts, output_lens)}
        if peer is not None:
            systems["vllm"] = lambda: peer.run(prompts, output_lens, keep_tokens=compared)
        if hf is not None:
            systems["hf_static"] = lambda: run_hf_static(hf, prompts, output_lens, args.hf_batch_size,
                                                         device=hf.device)
            if not args.skip_generate_batch:
                systems["hf_generate_batch"] = lambda: run_hf_continuous(hf, prompts, output_lens,
                                                                         cb_config=cb_config)
        for turn in range(args.repeats):
            for name in in_turn(systems, turn):
                runs[name].append(systems[name]())

        engine_runs = runs["nanoengine"]
        engine_tokens = engine_runs[0].tokens
        flops = workload_flops(config, prompts, output_lens)
        record = system_record([r.seconds for r in engine_runs], total_out)
        achieved = flops / record["seconds"] / 1e9
        record.update({"achieved_gflops": achieved, "fraction_of_gemm_peak": achieved / peak,
                       "deterministic_across_repeats": all(r.tokens == engine_tokens for r in engine_runs),
                       "latency": latency_summary([m for r in engine_runs for m in r.metrics])})
        results: dict = {"device": device.type, "dtype": dtype_name, "systems": {"nanoengine": record},
                         "round_order": [in_turn(systems, turn) for turn in range(args.repeats)]}
        print(describe("nanoengine", record) + f"; {achieved:.1f} GFLOP/s = {achieved / peak:.0%} of the GEMM peak")
        print(f"  engine latency (all repeats): {describe_latency(record['latency'])}")
        if peer is not None:
            from nanobench.vllm_peer import peer_results

            results["vllm"] = peer_results(peer, runs["vllm"], record, engine_tokens[:compared], total_out)

        if hf is not None:
            hf_tokens, _, hf_top2 = runs["hf_static"][0]
            check = compare_greedy(engine_tokens, hf_tokens, hf_top2, args.tie_tolerance)
            static = system_record([r[1] for r in runs["hf_static"]], total_out)
            static.update({"batch_size": args.hf_batch_size, **hf_where, "greedy_check": check,
                           "computed_output_tokens": static_computed_tokens(output_lens, args.hf_batch_size)})
            results["systems"]["hf_static"] = static
            print(describe(f"transformers static ({args.hf_batch_size})", static) +
                  f"; greedy tokens identical for {check['identical']}/{check['total']} requests, "
                  f"{check['near_tie_divergences']} near-tie divergences, {len(check['unexplained'])} unexplained")
            if runs["hf_generate_batch"]:
                cb_runs = runs["hf_generate_batch"]
                cb_check = compare_greedy(engine_tokens, cb_runs[0]["tokens"], hf_top2, args.tie_tolerance)
                batch = system_record([r["seconds"] for r in cb_runs], total_out)
                batch.update({**hf_where, "greedy_check": cb_check, "setup_seconds": spread([r["setup_seconds"] for r in cb_runs]),
                              "attn_implementation": cb_runs[0]["attn_implementation"], "config": cb_config})
                results["systems"]["hf_generate_batch"] = batch
                print(describe("transformers generate_batch", batch) +
                      f"; identical for {cb_check['identical']}/{cb_check['total']} requests")
            ratios = {name: record["output_tokens_per_s"] / r["output_tokens_per_s"]
                      for name, r in results["systems"].items() if name != "nanoengine"}
            results["ratios_engine_over"] = ratios
            print("engine / transformers (medians): " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))

        if args.online_rates:
            results["online"] = run_online(llm, prompts, output_lens, args.online_rates, args.seed)
        if getattr(args, "server_saturation", False):
            from nanobench.server_race import describe_saturation, server_saturation

            results["server_saturation"] = server_saturation(llm, model_dir, prompts, output_lens, args.repeats,
                                                             args.seed)
            print(describe_saturation(results["server_saturation"]))
        llm.shutdown()
        if args.batch_sizes:
            results["batch_sweep"] = run_batch_sweep(model_dir, prompts, output_lens, args.batch_sizes, args.repeats,
                                                     **engine_kwargs)
        if args.compile:
            from nanobench.benchmark_compile import compare_compile

            results["compile"] = compare_compile(model_dir, prompts, args.output_len, args.compile_repeats,
                                                 args.single_stream_tokens, **engine_kwargs)
        if args.single_stream_tokens and (hf is not None or peer is not None):
            peers = {"vllm": peer.decoder(prompts[0][:32])} if peer is not None else {}
            single = single_stream_decode(model_dir, hf, prompts[0][:32], args.single_stream_tokens,
                                          peers=peers, bandwidth_gbs=roof["memory_bandwidth_gbs"],
                                          device=args.device, dtype=args.dtype)
            results["single_stream_decode"] = single
            print(describe_single_stream(single, peers))

        if peer is not None and args.online_rates:
            results["online_servers"] = race_vllm_server(peer, model_dir, prompts, output_lens, args)
        if getattr(args, "profile", False):
            from nanobench.step_profile import profile_bench

            if peer is not None:
                peer.close()  # the profile's vLLM runs in a runner of its own (its engine core in-process)
            results["profile"] = profile_bench(args, model_dir, prompts, output_lens, dtype_name,
                                               resolved.max_num_seqs, engine_kwargs)

        results.update({
            "workload": {"num_requests": args.num_requests, "prompt_len": [args.min_prompt, args.max_prompt],
                         "output_len": args.output_len, "output_len_range": [min_out, args.output_len],
                         "output_tokens": total_out, "seed": args.seed, "greedy": True, "ignore_eos": True,
                         "prompt_tokens": sum(len(p) for p in prompts), "repeats": args.repeats},
            "gemm_peak_gflops": peak, "gemm_peak_dtype": dtype_name, "roofline": roof, "model": model_dir.name,
            "load_average": {"start": load_at_start, "end": load_average()},
            "environment": environment(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": getattr(args, "command_line", None) or " ".join(sys.argv),
            "format": "results/README.md",
        })
        today = datetime.date.today().isoformat()
        out = Path(args.out) if args.out else Path("results") / (
            f"bench-vllm-{device.type}-{today}-{dtype_name}.json" if peer is not None
            else f"bench-{device.type}-{today}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        print(f"results written to {out}")
        return results
    finally:
        if peer is not None:
            peer.close()
