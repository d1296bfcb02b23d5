"""llama.cpp as a measured peer for one stream: ``python -m nanoengine bench --vs-llamacpp``.

vLLM is what a server runs; llama.cpp is what a CPU user runs to talk to one model, one
sequence at a time. Racing the engine against it asks a narrower question than the bench's
batched workload: how fast does one request decode, and how long until its first token?

What makes the race fair:

* **the same weights.** llama.cpp reads GGUF files; the course's default model ships as a
  4-bit Q4_1 GGUF that the engine dequantizes. ``nanobench.gguf_export`` writes the
  engine's own weights back as F32 or BF16 GGUF files (``./course llamacpp-setup`` makes
  them), and the race picks the one of the engine's ``--dtype``;
* **the same numbers in the KV cache**: llama.cpp's cache is float16 by default; the
  runner is started with a cache of the engine's dtype (``f32`` or ``bf16``);
* **the same prompt and work**: the same random prompt token ids (``--llamacpp-prompt-len``
  of them, drawn like the bench's prompts), ``--output-len`` greedy tokens, end of
  sequence ignored; the engine runs the request alone, as llama.cpp does;
* **the same cores**: llama.cpp gets as many threads as the engine's torch uses;
* **alternating rounds** (``--repeats``): engine, llama.cpp, engine, ..., medians reported,
  so a slow spell of a shared machine hits both.

Each generation is timed token by token, in each engine's own process: the time to first
token (the whole prompt in one forward pass, then the first pick) and the decode rate,
``(n - 1) / (time of the last token - time of the first)``. The weights are read once per
decode step, so ``weight bytes x decode tok/s`` over the machine's copy bandwidth (measured
in the same run) says how close each engine decodes to the memory roofline (chapter 6).

The greedy tokens are compared (``vllm_peer.greedy_agreement``). With the same weights in
float32 the two engines still add in different orders, so at a near-tie their argmax can
differ; where they do, the engine's own top-2 logit gap at that position is recorded
(``top2_logit_gap``): a small gap is a near-tie, a large one a bug.

``--llamacpp-q8-0`` adds a third row: llama.cpp on a Q8_0 file of the same weights (8-bit
blocks, quantized from float32). That is *not* the engine's precision: its tokens are
compared and reported, never required to match. It shows what a quantized format buys a
decoder whose speed is the bandwidth of reading its weights.

llama-cpp-python lives in its own virtualenv, ``.venv-llamacpp`` (a native build of
llama.cpp from PyPI's source distribution, for this machine's CPU); its runner,
``nanobench/llamacpp_runner.py``, is driven through ``peer_process.RunnerProcess``, as
vLLM's is.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from nanobench.peer_process import REPO_ROOT, PeerRunnerError, PeerSetupError, RunnerProcess, virtualenv_python
from nanobench.timing import in_turn

DEFAULT_VENV = REPO_ROOT / ".venv-llamacpp"
RUNNER = Path(__file__).with_name("llamacpp_runner.py")
SETUP_COMMAND = "./course llamacpp-setup"
DTYPES = ("float32", "bfloat16")  # the engine's CPU dtypes, each with a GGUF of its own
#: The KV cache element type llama.cpp gets for each engine dtype (the runner's names).
KV_CACHE_TYPES = {"float32": "f32", "bfloat16": "bf16"}
LOAD_TIMEOUT_S = 300.0
RUN_TIMEOUT_S = 900.0
CONTEXT_SPARE_TOKENS = 16  # llama.cpp's context: prompt + output + this


class LlamaCppSetupError(PeerSetupError):
    """llama.cpp's virtualenv is missing: ``./course llamacpp-setup`` makes it."""


class LlamaCppRunnerError(PeerRunnerError):
    """The llama.cpp runner answered an error, or stopped, or did not answer in time."""


def llamacpp_python(venv: Path | str = DEFAULT_VENV) -> Path:
    """The interpreter of llama.cpp's virtualenv, checked to exist (nothing is started)."""
    return virtualenv_python(venv, LlamaCppSetupError, "--vs-llamacpp needs llama-cpp-python's own virtualenv",
                             SETUP_COMMAND, "it builds llama-cpp-python from PyPI and writes the model's weights as "
                             "GGUF files")


@dataclass(frozen=True)
class LlamaCppSettings:
    """How llama.cpp runs: which file, how many threads, what its KV cache holds."""

    model_path: str
    weights: str  # what the file holds: float32, bfloat16 (the engine's), q8_0, or "given" (--llamacpp-gguf)
    kv_cache_type: str  # f32 or bf16: the engine's dtype
    n_threads: int
    n_ctx: int
    n_batch: int = 512
    seed: int = 0
    venv: str = str(DEFAULT_VENV)

    def __post_init__(self) -> None:
        if self.kv_cache_type not in KV_CACHE_TYPES.values():
            raise ValueError(f"kv_cache_type must be one of {', '.join(KV_CACHE_TYPES.values())}, "
                             f"got {self.kv_cache_type!r}")
        for name in ("n_threads", "n_ctx", "n_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def runner_config(self) -> dict:
        return {"model_path": self.model_path, "n_threads": self.n_threads, "n_ctx": self.n_ctx,
                "n_batch": self.n_batch, "kv_cache_type": self.kv_cache_type, "seed": self.seed}

    def environment(self, base: dict | None = None) -> dict:
        """The runner's environment: the course's Python path and virtualenv removed, so it
        imports ``.venv-llamacpp``'s packages only."""
        env = dict(os.environ if base is None else base)
        for key in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(key, None)
        return env

    def described(self) -> dict:
        """The settings as the results file records them."""
        return {**self.runner_config(), "weights": self.weights, "venv": self.venv,
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset")}


class LlamaCppPeer(RunnerProcess):
    """One GGUF file loaded by llama-cpp-python in its runner process, generating on demand."""

    label = "llama.cpp"
    error_class = LlamaCppRunnerError
    log_prefix = "llamacpp-runner-"
    default_runner = RUNNER
    default_load_timeout_s = LOAD_TIMEOUT_S
    default_run_timeout_s = RUN_TIMEOUT_S
    settings: LlamaCppSettings

    def virtualenv_python(self, venv: Path | str) -> Path:
        return llamacpp_python(venv)

    def runner_environment(self) -> dict:
        return self.settings.environment()

    def generate(self, prompt: list[int], max_tokens: int) -> dict:
        """One timed greedy generation (EOS ignored): ``tokens``, ``token_times`` (seconds from
        the start of the call, one per token) and ``seconds``."""
        answer = self._ask({"command": "generate", "prompt": prompt, "max_tokens": max_tokens}, "result",
                           "a timed generation")
        if len(answer.get("tokens", [])) != max_tokens or len(answer.get("token_times", [])) != max_tokens:
            raise self._error(f"llama.cpp answered {len(answer.get('tokens', []))} tokens and "
                              f"{len(answer.get('token_times', []))} times, not the {max_tokens} asked for "
                              f"(EOS is ignored): not a measurement")
        return answer


# ----------------------------------------------------------------------------- arguments
def add_arguments(p: argparse.ArgumentParser) -> None:
    """``bench --vs-llamacpp``'s options (the bench's own ``--output-len``, ``--repeats``,
    ``--dtype``, ``--seed``, ``--model`` and ``--out`` apply too)."""
    p.add_argument("--vs-llamacpp", action="store_true",
                   help="instead: one stream, the engine against llama.cpp (llama-cpp-python, from its own "
                        "virtualenv made by ./course llamacpp-setup) on the same weights, prompt and tokens, "
                        "alternating rounds (nanobench/llamacpp_peer.py)")
    p.add_argument("--llamacpp-venv", default=None, help="with --vs-llamacpp: its virtualenv (default: .venv-llamacpp)")
    p.add_argument("--llamacpp-prompt-len", type=int, default=32,
                   help="with --vs-llamacpp: prompt tokens (random ids, seeded)")
    p.add_argument("--llamacpp-gguf", default=None, metavar="PATH",
                   help="with --vs-llamacpp: a GGUF holding --model's weights at the engine's dtype (default: the "
                        "default model's, written by ./course llamacpp-setup)")
    p.add_argument("--llamacpp-q8-0", action="store_true",
                   help="with --vs-llamacpp: also llama.cpp on a Q8_0 file of the same weights, a row of its own "
                        "(a different precision: its tokens are compared, not required to match)")


def check_arguments(args: argparse.Namespace) -> None:
    """``--vs-llamacpp``'s own checks, before anything loads; each error says what is allowed."""
    from nanobench.benchmark import check_cpu_peer

    check_cpu_peer(args, "--vs-llamacpp", "llama.cpp", DTYPES,
                   "the engine's CPU dtypes, each with a GGUF file of the same weights")
    if isinstance(args.llamacpp_prompt_len, bool) or not isinstance(args.llamacpp_prompt_len, int) \
            or args.llamacpp_prompt_len < 1:
        raise ValueError(f"llamacpp_prompt_len must be an integer >= 1, got {args.llamacpp_prompt_len!r}")
    if args.output_len < 2:
        raise ValueError(f"--vs-llamacpp times decoding after the first token: output_len must be >= 2, "
                         f"got {args.output_len}")
    others = [flag for flag, on in (("--vs-vllm", getattr(args, "vs_vllm", False)),
                                    ("--speculative", getattr(args, "speculative", False)),
                                    ("--overhead", args.overhead), ("--compile", args.compile),
                                    ("--profile", getattr(args, "profile", False)),
                                    ("--server", getattr(args, "server", None)),
                                    ("--server-saturation", getattr(args, "server_saturation", False)),
                                    ("--online-rates", args.online_rates), ("--batch-sizes", args.batch_sizes),
                                    ("--min-output-len", args.min_output_len is not None)) if on]
    if others:
        raise ValueError(f"--vs-llamacpp races one stream (llama-cpp-python serves one sequence at a time): leave "
                         f"out {', '.join(others)}")
    if args.llamacpp_gguf is not None:
        if not Path(args.llamacpp_gguf).is_file():
            raise FileNotFoundError(f"--llamacpp-gguf {args.llamacpp_gguf}: no such file")
        if args.llamacpp_q8_0:
            raise ValueError("--llamacpp-q8-0 writes the default model's weights as Q8_0; with --llamacpp-gguf "
                             "(another model's file) leave it out")
    elif args.model is not None:
        raise ValueError("--vs-llamacpp with --model needs --llamacpp-gguf: a GGUF file holding the same weights "
                         "(the default model's files are written by ./course llamacpp-setup)")
    llamacpp_python(args.llamacpp_venv or DEFAULT_VENV)  # LlamaCppSetupError naming ./course llamacpp-setup


# ------------------------------------------------------------------------------- timing
def stream_timing(token_times: list[float]) -> dict:
    """One generation's times (seconds from its start, one per token) -> TTFT and decode rate."""
    if len(token_times) < 2:
        raise ValueError(f"need at least two token times to time decoding, got {len(token_times)}")
    decode_seconds = token_times[-1] - token_times[0]
    return {"ttft_s": token_times[0], "decode_seconds": decode_seconds,
            "decode_tok_s": (len(token_times) - 1) / decode_seconds if decode_seconds > 0 else None}


def engine_generate(llm):
    """``generate(prompt, n)`` for the engine, answering as the llama.cpp runner does: the
    request alone in the engine (``benchmark.run_engine_once``), its tokens' times from its
    arrival (the engine's own per-token timestamps)."""
    from nanobench.benchmark import run_engine_once

    def generate(prompt: list[int], max_tokens: int) -> dict:
        run = run_engine_once(llm, [prompt], [max_tokens])
        metrics = run.metrics[0]
        return {"tokens": run.tokens[0], "token_times": [t - metrics.arrival_time for t in metrics.token_times],
                "seconds": run.seconds}

    return generate


def system_rounds(rounds: list[dict], output_tokens: int, weight_bytes: int, bandwidth_gbs: float) -> dict:
    """One system's rounds: TTFT and decode rate (medians with their spread), the whole
    generation's tok/s (``benchmark.system_record``), and the share of the copy bandwidth
    its decode spends reading the weights once per token."""
    from nanobench.benchmark import spread, system_record

    timings = [stream_timing(r["token_times"]) for r in rounds]
    rates = [t["decode_tok_s"] for t in timings]
    record = system_record([r["seconds"] for r in rounds], output_tokens)
    record.update({"ttft_ms": spread([t["ttft_s"] * 1000 for t in timings]),
                   "decode_tok_s": None if None in rates else spread(rates),
                   "weight_bytes": weight_bytes,
                   "tokens_identical_across_repeats": all(r["tokens"] == rounds[0]["tokens"] for r in rounds)})
    if record["decode_tok_s"] is not None:
        record["weight_traffic_share"] = weight_bytes * record["decode_tok_s"]["median"] / (bandwidth_gbs * 1e9)
    return record


def describe_system(name: str, record: dict) -> str:
    decode = record["decode_tok_s"]
    if decode is None:
        return f"{name:<30} decode too fast to time against this machine's noise: use a longer --output-len"
    return (f"{name:<30}{decode['median']:8.1f} tok/s decode (median of {record['repeats']}, runs "
            f"{decode['min']:.1f}-{decode['max']:.1f}), TTFT {record['ttft_ms']['median']:.0f} ms, weights read at "
            f"{record['weight_traffic_share']:.0%} of the copy bandwidth")


def near_tie_gap(llm, prompt: list[int], tokens: list[int], position: int | None) -> float | None:
    """The engine's top-2 logit gap at ``position`` of its greedy ``tokens`` (None: no divergence).

    Log-probabilities differ from logits by one shift per position, so the gap between the
    two best log-probabilities is the gap between the two best logits.
    """
    if position is None or position >= len(tokens):
        return None
    from nanoengine import SamplingParams

    out = llm.generate([prompt + tokens[:position]], SamplingParams(temperature=0.0, max_tokens=1, logprobs=2))
    best = sorted((c.logprob for c in out[0].outputs[0].logprobs[0]), reverse=True)
    return float(best[0] - best[1])


# --------------------------------------------------------------------------------- race
def llamacpp_files(args: argparse.Namespace, dtype_name: str) -> dict[str, tuple[str, Path]]:
    """The rows' GGUF files: ``{system name: (what its weights are, path)}``."""
    if args.llamacpp_gguf is not None:
        return {"llamacpp": ("given", Path(args.llamacpp_gguf))}
    from nanobench.gguf_export import default_model_gguf

    files = {"llamacpp": (dtype_name, default_model_gguf(dtype_name))}
    if args.llamacpp_q8_0:
        files["llamacpp_q8_0"] = ("q8_0", default_model_gguf("q8_0"))
    return files


def start_peers(args: argparse.Namespace, files: dict, kv_cache_type: str, n_threads: int,
                n_ctx: int) -> dict[str, LlamaCppPeer]:
    """A runner per file, started and loaded one after the other (loading is never timed)."""
    peers: dict[str, LlamaCppPeer] = {}
    try:
        for name, (weights, path) in files.items():
            settings = LlamaCppSettings(model_path=str(path), weights=weights, kv_cache_type=kv_cache_type,
                                        n_threads=n_threads, n_ctx=n_ctx, seed=args.seed,
                                        venv=str(args.llamacpp_venv or DEFAULT_VENV))
            peer = LlamaCppPeer(settings)
            peers[name] = peer
            ready = peer.wait_ready()
            print(f"{name}: llama-cpp-python {ready['llama_cpp_python_version']} loaded {path.name} in "
                  f"{ready['load_seconds']:.1f} s ({ready['settings'].get('model_description', '?')}; "
                  f"{n_threads} threads, KV cache {kv_cache_type}); its log: {peer.log_path}")
    except BaseException:
        for peer in peers.values():
            peer.close()
        raise
    return peers


def race_llamacpp(args: argparse.Namespace) -> dict:
    """``bench --vs-llamacpp``: the engine and llama.cpp on one stream, alternating rounds;
    writes the results file and returns its contents."""
    import torch

    from nanobench.benchmark import build_engine, environment, load_average, make_workload
    from nanobench.timing import measure_memory_bandwidth
    from nanobench.vllm_peer import describe_agreement, greedy_agreement
    from nanoengine.config import EngineConfig
    from nanoengine.loader.weights import resolve_model_source
    from nanoengine.models.config import ModelConfig

    load_at_start = load_average()
    resolved = EngineConfig(device=args.device, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    dtype_name = str(resolved.torch_dtype).removeprefix("torch.")
    model_dir = resolve_model_source(args.model)
    config = ModelConfig.from_pretrained(model_dir)
    prompt = make_workload(1, args.llamacpp_prompt_len, args.llamacpp_prompt_len, args.seed,
                           vocab_limit=min(10000, config.vocab_size))[0]
    n = args.output_len
    print(f"one stream: {len(prompt)} random prompt ids, {n} greedy tokens, EOS ignored; model {model_dir.name}; "
          f"{dtype_name}; {args.repeats} alternating rounds")
    files = llamacpp_files(args, dtype_name)
    bandwidth_gbs = measure_memory_bandwidth(device="cpu").bytes_per_s / 1e9
    llm = build_engine(model_dir, device=args.device, dtype=args.dtype,
                       max_num_batched_tokens=args.max_num_batched_tokens)
    n_threads = torch.get_num_threads()
    peers = {}
    try:
        peers = start_peers(args, files, KV_CACHE_TYPES[dtype_name], n_threads, len(prompt) + n + CONTEXT_SPARE_TOKENS)
        systems = {"nanoengine": engine_generate(llm), **{name: peer.generate for name, peer in peers.items()}}
        rounds: dict[str, list[dict]] = {name: [] for name in systems}
        for turn in range(args.repeats):
            for name in in_turn(systems, turn):
                rounds[name].append(systems[name](prompt, n))

        engine_tokens = rounds["nanoengine"][0]["tokens"]
        engine = system_rounds(rounds["nanoengine"], n, llm.memory_report().weight_bytes, bandwidth_gbs)
        engine.update({"threads": n_threads, "dtype": dtype_name})
        results: dict = {"device": "cpu", "dtype": dtype_name, "model": model_dir.name,
                         "systems": {"nanoengine": engine}, "ratios_engine_over": {}}
        print(describe_system("nanoengine", engine))
        for name, peer in peers.items():
            ready = peer.wait_ready()
            record = system_rounds(rounds[name], n, ready["settings"]["model_size_bytes"], bandwidth_gbs)
            agreement = greedy_agreement([engine_tokens], [rounds[name][0]["tokens"]])
            agreement["top2_logit_gap"] = near_tie_gap(llm, prompt, engine_tokens, agreement["first_divergence"][0])
            weights, path = files[name]
            record.update({"version": ready["llama_cpp_python_version"], "python": ready["python"],
                           "numpy": ready["numpy_version"], "load_seconds": ready["load_seconds"],
                           "system_info": ready["system_info"],
                           "settings": {**peer.settings.described(), "runner": ready["settings"]},
                           "gguf": {"file": path.name, "bytes": path.stat().st_size, "weights": weights,
                                    "same_precision_as_engine": weights in (dtype_name, "given")},
                           "greedy_agreement": agreement})
            results["systems"][name] = record
            if engine["decode_tok_s"] and record["decode_tok_s"]:
                results["ratios_engine_over"][name] = {
                    "decode": engine["decode_tok_s"]["median"] / record["decode_tok_s"]["median"],
                    "ttft": engine["ttft_ms"]["median"] / record["ttft_ms"]["median"]}
            label = name if record["gguf"]["same_precision_as_engine"] else f"{name} ({weights} weights)"
            gap = agreement["top2_logit_gap"]
            print(describe_system(label, record) + "; " + describe_agreement(agreement)
                  + ("" if gap is None else f"; the engine's top-2 logit gap there: {gap:.4f}"))
        for name, ratio in results["ratios_engine_over"].items():
            print(f"engine / {name} (medians): decode {ratio['decode']:.2f}x, TTFT {ratio['ttft']:.2f}x "
                  f"(below 1: the engine's first token comes sooner)")
    finally:
        for peer in peers.values():
            peer.close()
        llm.shutdown()

    results.update({
        "workload": {"streams": 1, "prompt_tokens": len(prompt), "output_tokens": n, "seed": args.seed,
                     "greedy": True, "ignore_eos": True, "repeats": args.repeats},
        "method": {"ttft": "start of the call to the first token (the prompt's forward pass and the first pick)",
                   "decode_tok_s": "(n - 1) / (time of the last token - time of the first), per round; medians",
                   "weight_traffic_share": "weight bytes x median decode tok/s / copy bandwidth"},
        "memory_bandwidth_gbs": bandwidth_gbs,
        "load_average": {"start": load_at_start, "end": load_average()},
        "environment": environment(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": getattr(args, "command_line", None) or " ".join(sys.argv),
        "format": "results/README.md",
    })
    out = Path(args.out) if args.out else Path("results") / (
        f"bench-llamacpp-cpu-{datetime.date.today().isoformat()}-{dtype_name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"results written to {out}")
    return results


__all__ = ["DEFAULT_VENV", "DTYPES", "KV_CACHE_TYPES", "LlamaCppPeer", "LlamaCppRunnerError", "LlamaCppSettings",
           "LlamaCppSetupError", "RUNNER", "SETUP_COMMAND", "add_arguments", "check_arguments", "llamacpp_python",
           "race_llamacpp", "stream_timing", "system_rounds"]
