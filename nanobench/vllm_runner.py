"""vLLM's side of ``bench --vs-vllm``: a long-lived process that loads ``vllm.LLM`` once and
times workloads sent to it as JSON lines.

This file is *executed* by ``.venv-vllm/bin/python`` (made by ``./course vllm-setup``), never
imported by the course: that virtualenv has vLLM and its own torch but not nanoengine, so
the script uses vLLM, the standard library and ``step_profile`` beside it (standard library
at import; its profiling functions need only torch). ``nanobench/vllm_peer.py`` drives it.

Why a process that stays up rather than one per run: loading vLLM's CPU build takes about
a minute and a half on two cores (it compiles the model with torch's inductor), and the
benchmark alternates systems run by run (engine, vLLM, transformers, engine, ...) so that
a slow spell of a shared machine hits every system alike. Loading once and taking
commands keeps both.

The protocol, one JSON object per line:

* start: ``python vllm_runner.py '<config JSON>'`` with ``model`` (a Hugging Face
  directory), ``dtype``, ``max_model_len``, ``max_num_batched_tokens``, ``max_num_seqs``,
  ``seed`` and ``enforce_eager``, and optionally ``speculative_config`` (passed to ``vllm.LLM``
  as it is: vLLM's speculative decoding, e.g. prompt lookup). After loading and one short warm-up request it answers
  ``{"event": "ready", "vllm_version": ..., "settings": ..., "environment": ...,
  "set_by_vllm": ...}`` (the variables as the runner was started, then those vLLM set itself).
* ``{"command": "run", "prompts": [[ids], ...], "max_tokens": [n, ...], "keep_tokens": k}``:
  one timed greedy run (EOS ignored, the prefix cache emptied first, as the engine's runs
  do; with ``"structured_outputs": [{"json": schema} or null, ...]`` a prompt with a
  constraint runs under it and stops where its grammar ends, vLLM's structured output) answered by ``{"event": "result", "seconds": ..., "output_tokens": ...,
  "output_tokens_per_s": ..., "tokens": [...]}`` with the generated ids of the first
  ``k`` prompts.
* ``{"command": "profile", "prompts": [[ids], ...], "max_tokens": [n, ...]}``: the prompts
  once to warm up, then once under ``torch.profiler`` with every engine step in a range,
  answered by ``{"event": "profile", ...}`` with ``step_profile.summarize``'s figures
  (steps, median ms per step, each category's share), ``output_tokens`` and
  ``engine_core_client``. Only a runner whose engine core is in its own process can: one
  started with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``
  (``VllmSettings(profile=True)``); another answers an error saying so. vLLM's ``generate``
  calls its ``LLMEngine.step()`` until no request is left, so the steps counted are those
  calls that ran the model.
* ``{"command": "quit"}``: exit 0 (so does the end of stdin).

Anything wrong is answered by ``{"event": "error", "message": ...}``; a command that fails
leaves the process ready for the next. The answers travel on the process's original
standard output, which is kept apart for them before vLLM is imported: everything vLLM
and its libraries print (logs, progress bars, compiler output) is sent to standard error,
so a stray print can never corrupt the protocol (``runner_protocol.serve``, shared with
``llamacpp_runner.py``).
"""

from __future__ import annotations

import os
import platform
import sys
import time

REQUIRED_CONFIG = ("model", "dtype", "max_model_len", "max_num_batched_tokens", "max_num_seqs", "seed",
                   "enforce_eager")
#: The environment variables that shape vLLM's CPU run; each is reported with its value.
REPORTED_ENV_PREFIXES = ("VLLM_", "OMP_", "KMP_", "LD_PRELOAD", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                         "TORCHINDUCTOR_")


def check_config(config: dict) -> None:
    missing = [key for key in REQUIRED_CONFIG if key not in config]
    if missing:
        raise ValueError(f"the runner's config lacks {', '.join(missing)} (needs {', '.join(REQUIRED_CONFIG)})")
    if config["dtype"] not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {config['dtype']!r}")


def reported_environment() -> dict:
    return {key: value for key, value in sorted(os.environ.items()) if key.startswith(REPORTED_ENV_PREFIXES)}


def load(config: dict):
    """``vllm.LLM`` on the model directory, as the config says, warmed up by one short request."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=config["model"], tokenizer=config["model"], dtype=config["dtype"],
              max_model_len=config["max_model_len"], max_num_batched_tokens=config["max_num_batched_tokens"],
              max_num_seqs=config["max_num_seqs"], seed=config["seed"], enforce_eager=config["enforce_eager"],
              speculative_config=config.get("speculative_config"),
              **({"structured_outputs_config": config["structured_outputs_config"]}
                 if config.get("structured_outputs_config") else {}))
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}],
                 SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    return llm


def resolved_settings(llm, config: dict) -> dict:
    """What vLLM made of the config (its own resolved values where it exposes them)."""
    settings = {key: config[key] for key in REQUIRED_CONFIG}
    settings["speculative_config"] = config.get("speculative_config")
    try:
        vllm_config = llm.llm_engine.vllm_config
        settings["resolved"] = {
            "dtype": str(vllm_config.model_config.dtype).removeprefix("torch."),
            "max_model_len": vllm_config.model_config.max_model_len,
            "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
            "enable_chunked_prefill": vllm_config.scheduler_config.enable_chunked_prefill,
            "enable_prefix_caching": vllm_config.cache_config.enable_prefix_caching,
            "block_size": vllm_config.cache_config.block_size,
            "compilation_mode": str(vllm_config.compilation_config.mode),
        }
    except AttributeError as exc:  # another vLLM version keeps its config elsewhere
        settings["resolved"] = f"not readable from this vLLM version ({exc})"
    return settings


def greedy_requests(command: dict) -> tuple[list, list]:
    """The command's prompts as vLLM requests and their greedy parameters (EOS ignored)."""
    from vllm import SamplingParams

    prompts, max_tokens = command.get("prompts"), command.get("max_tokens")
    name = command.get("command")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) and p for p in prompts):
        raise ValueError(f"{name} needs 'prompts': a non-empty list of non-empty token-id lists")
    if not isinstance(max_tokens, list) or len(max_tokens) != len(prompts):
        raise ValueError(f"{name} needs 'max_tokens': one count per prompt ({len(prompts)}), got {max_tokens!r}")
    constraints = command.get("structured_outputs") or [None] * len(prompts)
    if not isinstance(constraints, list) or len(constraints) != len(prompts):
        raise ValueError(f"{name}: 'structured_outputs' needs one constraint (or null) per prompt")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) if c is None else
              SamplingParams(temperature=0.0, max_tokens=n, structured_outputs=structured_outputs(c))
              for n, c in zip(max_tokens, constraints)]
    return [{"prompt_token_ids": p} for p in prompts], params


def structured_outputs(constraint: dict):
    """vLLM's ``StructuredOutputsParams`` from its fields (``{"json": schema}``, ``{"regex": ...}``, ...)."""
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(**constraint)


def run_once(llm, command: dict) -> dict:
    """One timed greedy run of the command's prompts; the generated ids of the first ``keep_tokens``."""
    requests, params = greedy_requests(command)
    keep = command.get("keep_tokens", 0)
    llm.reset_prefix_cache()  # a repeat must not find the previous run's prompts cached
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    produced = sum(len(t) for t in tokens)
    return {"event": "result", "seconds": seconds, "output_tokens": produced,
            "output_tokens_per_s": produced / seconds, "tokens": tokens[:keep]}


def profile_once(llm, command: dict) -> dict:
    """The command's prompts under ``torch.profiler``, after one warm-up run (``step_profile``)."""
    import vllm.envs as envs
    from step_profile import profile_steps, summarize  # beside this file: the script's directory

    if envs.VLLM_ENABLE_V1_MULTIPROCESSING or not envs.VLLM_CUSTOM_SCOPES_FOR_PROFILING:
        raise ValueError("profile needs vLLM's engine core in this process and its profiler scopes: start the "
                         "runner with VLLM_ENABLE_V1_MULTIPROCESSING=0 and VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 "
                         "(VllmSettings(profile=True) does)")
    requests, params = greedy_requests(command)
    llm.generate(requests, params, use_tqdm=False)  # warm-up, not profiled
    llm.reset_prefix_cache()  # the profiled run computes its prompts, as the timed runs do
    steps, outputs = profile_steps(llm.llm_engine, lambda: llm.generate(requests, params, use_tqdm=False))
    produced = sum(len(out.outputs[0].token_ids) for out in outputs)
    if produced != sum(p.max_tokens for p in params):
        raise RuntimeError(f"the profiled run produced {produced} tokens, not the "
                           f"{sum(p.max_tokens for p in params)} requested (EOS is ignored)")
    return {"event": "profile", **summarize(steps), "output_tokens": produced,
            "engine_core_client": type(llm.llm_engine.engine_core).__name__}


COMMANDS = {"run": run_once, "profile": profile_once}


def start(config: dict) -> tuple[dict, dict]:
    """Load vLLM as the config says: the ``ready`` message and the commands it takes."""
    check_config(config)
    given = reported_environment()  # before vLLM adds its own variables
    started = time.perf_counter()
    llm = load(config)
    import torch
    import vllm

    ready = {"event": "ready", "vllm_version": vllm.__version__, "torch_version": torch.__version__,
             "python": platform.python_version(), "load_seconds": time.perf_counter() - started,
             "torch_threads": torch.get_num_threads(), "settings": resolved_settings(llm, config),
             "environment": given, "set_by_vllm": {
                 key: value for key, value in reported_environment().items() if given.get(key) != value}}
    return ready, {name: (lambda command, handle=handle: handle(llm, command)) for name, handle in COMMANDS.items()}


def main(argv: list[str]) -> int:
    from runner_protocol import serve  # beside this file: the script's directory

    return serve(argv, "vllm_runner.py", start)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
