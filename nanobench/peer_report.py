"""The engine against vLLM's CPU build, read from a ``bench --vs-vllm`` results file (chapter 11).

``python -m nanoengine bench --vs-vllm`` races the engine, vLLM and transformers in
alternating rounds on the same requests and writes ``results/bench-vllm-<device>-<date>-<dtype>.json``
(``nanobench/vllm_peer.py`` drives vLLM; ``results/README.md`` describes every field). This
module turns such a file into what a reader asks first: where and when it ran, at which
revision and with which command; each system's throughput; the engine's ratio over vLLM
and over transformers, batched and for a single stream; and whether the two engines
produced the same greedy tokens (a speed figure about different tokens is not about the
same work).

Chapter 11 prints it with ``report`` (the newest file of each dtype), or runs a small live
comparison through the benchmark's own code with ``live_comparison`` when vLLM's
virtualenv exists (``./course vllm-setup``). Nothing here measures: every figure comes
from the file, or from the run that ``live_comparison`` starts.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nanobench.provenance import command_today

PEER_GLOB = "bench-vllm-*.json"
HOW_TO_MEASURE = ("./course vllm-setup, then python -m nanoengine bench --vs-vllm --dtype float32 "
                  "(and --dtype bfloat16)")
TRANSFORMERS_LABELS = {"hf_static": "transformers static batching", "hf_generate_batch": "transformers generate_batch"}
# vLLM's ``CompilationMode`` (vllm/config/compilation.py), as its runner records it in
# ``settings.runner.resolved.compilation_mode``; its CPU platform turns the default into
# one Dynamo trace compiled by Inductor (vllm/platforms/cpu.py).
COMPILATION_MODES = {"0": "no torch.compile", "1": "stock torch.compile", "2": "one Dynamo trace compiled by Inductor",
                     "3": "vLLM's piecewise Inductor compile"}


@dataclass(frozen=True)
class PeerComparison:
    """One ``bench --vs-vllm`` run: provenance, throughputs, ratios and the greedy agreement."""

    file: str
    date: str  # when the file was written (ISO 8601, UTC)
    machine: str
    revision: str  # the engine's git commit (``+modified`` with local changes)
    command: str
    dtype: str
    workload: str
    engine_tok_s: float
    vllm_tok_s: float
    transformers_tok_s: dict  # transformers system -> tok/s, same rounds
    ratio_over_vllm: float  # engine tok/s over vLLM's (medians)
    ratios_over_transformers: dict
    single_stream: dict | None  # tok/s of nanoengine, vllm, transformers (one request decoding alone;
    # a system's figure is None where its decode was too fast to time against the machine's noise)
    agreement: dict  # vllm_peer.greedy_agreement's fields
    vllm_version: str
    vllm_settings: dict  # threads_bind, preloads, kvcache_space_gib, compilation, block_size, ...
    vllm_load_seconds: float | None = None  # loading (and compiling) vLLM, never timed as generation

    @property
    def vllm_label(self) -> str:
        """vLLM's version and settings in a few words, e.g. ``vLLM 0.32.0, float32, compiled, threads 0-1``."""
        s = self.vllm_settings
        preloaded = [name for name, path in s.get("preloads", {}).items() if path]
        return (f"vLLM {self.vllm_version}, {self.dtype}, {'eager' if s.get('enforce_eager') else 'compiled'}, "
                f"threads bound to {s.get('threads_bind', '?')}, "
                + (" + ".join(preloaded) + " preloaded" if preloaded else "no preloads"))


def machine_of(data: dict) -> str:
    """The machine a results file names: its GPU, or its CPU model and cores."""
    env = data.get("environment", {})
    return env.get("gpu") or f"{env.get('cpu_model') or env.get('processor', 'CPU')}, {env.get('cpu_count')} cores"


def read_comparison(data: dict, file: str) -> PeerComparison:
    """The comparison in one results dict (as ``bench --vs-vllm`` writes it); ``file`` names it.

    A file without a ``vllm`` section (a plain ``bench`` run) or without transformers is
    refused with a ValueError that says so: it is not an engine-against-vLLM race.
    """
    vllm = data.get("vllm")
    systems = data.get("systems", {})
    if not isinstance(vllm, dict) or "nanoengine" not in systems:
        raise ValueError(f"{file} has no engine-against-vLLM race (no 'vllm' section or no 'nanoengine' system): "
                         f"only files written by `python -m nanoengine bench --vs-vllm` have one")
    missing = [key for key in ("output_tokens_per_s", "ratio_engine_over_vllm", "greedy_agreement", "version")
               if key not in vllm]
    if missing:
        raise ValueError(f"{file}'s 'vllm' section lacks {missing}: it is incomplete (see results/README.md)")
    engine = systems["nanoengine"]["output_tokens_per_s"]
    transformers = {name: systems[name]["output_tokens_per_s"] for name in TRANSFORMERS_LABELS if name in systems}
    single = data.get("single_stream_decode")
    single_stream = None
    if single and single.get("nanoengine_tok_s"):
        single_stream = {"nanoengine": single["nanoengine_tok_s"], "vllm": single["vllm_tok_s"],
                         # transformers decoded alone only where it was loaded (no --skip-hf)
                         "transformers_ran": bool(transformers) or single.get("hf_tok_s") is not None,
                         "transformers": single.get("hf_tok_s"), "tokens": single.get("tokens"),
                         "weight_traffic_share": single.get("weight_traffic_share"),
                         "memory_bandwidth_gbs": single.get("memory_bandwidth_gbs")}
    settings = dict(vllm.get("settings", {}))
    resolved = settings.get("runner", {}).get("resolved", {})
    settings.update({key: resolved[key] for key in ("block_size", "enable_chunked_prefill", "enable_prefix_caching")
                     if key in resolved})
    if "compilation_mode" in resolved:
        mode = str(resolved["compilation_mode"])
        settings["compilation"] = COMPILATION_MODES.get(mode, f"compilation mode {mode}")
    workload = data.get("workload", {})
    out = workload.get("output_len_range") or [workload.get("output_len")] * 2
    prompt = workload.get("prompt_len") or ["?", "?"]
    return PeerComparison(
        file=file, date=str(data.get("date", "")), machine=machine_of(data),
        revision=str(data.get("environment", {}).get("nanoengine_revision", "unknown")),
        command=str(data.get("command", "")), dtype=str(data.get("dtype") or settings.get("dtype", "")),
        workload=(f"{workload.get('num_requests')} requests, prompts {prompt[0]}-{prompt[1]} tokens, "
                  + (f"{out[0]}" if out[0] == out[1] else f"{out[0]}-{out[1]}") + " output tokens each, greedy"),
        engine_tok_s=engine, vllm_tok_s=vllm["output_tokens_per_s"], transformers_tok_s=transformers,
        ratio_over_vllm=vllm["ratio_engine_over_vllm"],
        ratios_over_transformers={name: engine / tok_s for name, tok_s in transformers.items()},
        single_stream=single_stream, agreement=vllm["greedy_agreement"], vllm_version=str(vllm["version"]),
        vllm_settings=settings, vllm_load_seconds=vllm.get("load_seconds"))


def read_file(path: Path) -> PeerComparison:
    """The comparison in one results file (a ValueError names the file if it holds none)."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a JSON results file ({exc})") from None
    return read_comparison(data, Path(path).name)


def newest_comparisons(results_dir: Path) -> list[PeerComparison]:
    """The newest ``bench-vllm-*.json`` of each dtype and workload in ``results_dir`` (float32
    first, then the newest workload first); [] if none. A file on the mid-size shape does not
    hide the newest one on the bench workload: they answer different questions."""
    newest: dict[tuple[str, str], PeerComparison] = {}
    for path in sorted(Path(results_dir).glob(PEER_GLOB)):
        comparison = read_file(path)
        key = (comparison.dtype, comparison.workload)
        held = newest.get(key)
        if held is None or (comparison.date, comparison.file) > (held.date, held.file):
            newest[key] = comparison
    by_date = sorted(newest.values(), key=lambda c: (c.date, c.file), reverse=True)
    return sorted(by_date, key=lambda c: (c.dtype != "float32", c.dtype))  # stable: newest first within a dtype


def weight_traffic_text(share: float, bandwidth_gbs: float) -> str:
    """How much of the copy bandwidth a single stream's weight reads use, in words (the bench and the report)."""
    return f"the engine reads its weights at {share:.0%} of the {bandwidth_gbs:.1f} GB/s copy bandwidth"


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x"


def describe(c: PeerComparison) -> str:
    """Every figure of one comparison, with its provenance, as lines of text."""
    lines = [f"{c.file}: {c.date[:16].replace('T', ' ')} UTC, {c.machine}, engine revision {c.revision}",
             f"    command: {command_today(c.command)}",
             f"    workload: {c.workload}; every system in {c.dtype}, alternating rounds",
             f"    {c.vllm_label}"
             + (f"; its model: {c.vllm_settings['compilation']}" if "compilation" in c.vllm_settings else "")
             + (f"; KV blocks of {c.vllm_settings['block_size']} tokens" if "block_size" in c.vllm_settings else "")
             + ("" if c.vllm_load_seconds is None else f"; loaded in {c.vllm_load_seconds:.0f} s (not timed)"),
             f"    throughput (medians): nanoengine {c.engine_tok_s:.1f} tok/s, vLLM {c.vllm_tok_s:.1f} tok/s"
             + "".join(f", {TRANSFORMERS_LABELS[name]} {tok_s:.1f} tok/s"
                       for name, tok_s in c.transformers_tok_s.items()),
             f"    engine / vLLM {_times(c.ratio_over_vllm)}"
             + "".join(f", engine / {TRANSFORMERS_LABELS[name]} {_times(r)}"
                       for name, r in c.ratios_over_transformers.items())]
    single = c.single_stream
    if single:
        others = {name: single[key] for name, key in (("vLLM", "vllm"), ("transformers", "transformers"))
                  if key != "transformers" or single.get("transformers_ran", True)}
        lines.append(f"    single stream ({single['tokens']} tokens decoded alone): "
                     f"nanoengine {single['nanoengine']:.1f}"
                     + "".join(f", {name} " + ("too fast to time" if tok_s is None else f"{tok_s:.1f}")
                               for name, tok_s in others.items()) + " tok/s"
                     + "".join(f"; engine / {name} {_times(single['nanoengine'] / tok_s)}"
                               for name, tok_s in others.items() if tok_s)
                     + ("" if single.get("weight_traffic_share") is None else
                        "; " + weight_traffic_text(single["weight_traffic_share"], single["memory_bandwidth_gbs"])))
    else:
        lines.append("    single stream: not measured in this file")
    a = c.agreement
    lines.append(f"    greedy tokens, engine against vLLM: {a['identical_prompts']}/{a['prompts_compared']} prompts "
                 f"identical, {a['tokens_agreeing']}/{a['tokens_compared']} tokens agree before a divergence"
                 + ("" if a.get("earliest_divergence") is None
                    else f" (earliest at position {a['earliest_divergence']})"))
    return "\n".join(lines)


def reading(c: PeerComparison) -> str:
    """One sentence that reads the comparison's own numbers (and says the opposite when they do)."""
    def who(ratio: float) -> str:
        if 0.95 <= ratio <= 1.05:
            return f"the two within 5% ({_times(ratio)})"
        return (f"the engine faster, {_times(ratio)}" if ratio > 1 else
                f"vLLM faster, {_times(1 / ratio)} the engine's throughput")
    text = f"reading ({c.machine}, {c.dtype}): batched, {who(c.ratio_over_vllm)}"
    if c.single_stream and c.single_stream["vllm"]:
        text += f"; single stream, {who(c.single_stream['nanoengine'] / c.single_stream['vllm'])}"
    a = c.agreement
    same = a["identical_prompts"] == a["prompts_compared"]
    return text + ("; the same greedy tokens, so both did the same work" if same else
                   "; the greedy tokens differ somewhere (the line above says where)")


def report(results_dir: Path) -> str:
    """The newest comparison of each dtype and workload in ``results_dir``, or what to run when there is none."""
    found = newest_comparisons(results_dir)
    if not found:
        return (f"no engine-against-vLLM results in {results_dir} yet (no {PEER_GLOB}): to measure one, run "
                f"{HOW_TO_MEASURE}")
    return "\n".join(describe(c) + "\n" + reading(c) for c in found)


PROFILE_COMMAND = "python -m nanobench --vs-vllm --profile --skip-hf (./course vllm-setup first)"


def newest_with(results_dir: Path, section: str) -> tuple[str, dict] | None:
    """The newest results file in ``results_dir`` with a ``section`` (a dict, e.g. ``profile``),
    by the date it records: ``(file name, its data)``, or None."""
    found = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not a JSON results file ({exc})") from None
        if isinstance(data, dict) and isinstance(data.get(section), dict):
            found.append((str(data.get("date", "")), path.name, data))
    if not found:
        return None
    _, name, data = max(found, key=lambda f: (f[0], f[1]))
    return name, data


def newest_profile(results_dir: Path) -> tuple[str, dict] | None:
    """The newest results file in ``results_dir`` with a ``profile`` section (``bench --profile``)."""
    return newest_with(results_dir, "profile")


def profile_table(results_dir: Path) -> str:
    """Where each engine spends its step, as the newest ``bench --profile`` file measured it
    (``nanobench/step_profile.py``): its provenance, then one row per engine and batch size,
    ms per step (median) and each category's share of the step time with its median ms;
    or, when no file has a profile, the command that measures one."""
    from nanobench.step_profile import table

    newest = newest_profile(results_dir)
    if newest is None:
        return f"no results file in {results_dir} has a profile yet: to measure one, run {PROFILE_COMMAND}"
    name, data = newest
    profile = data["profile"]
    rows = profile.get("rows")
    if not rows:
        raise ValueError(f"{name}'s 'profile' section has no rows: it is incomplete (see results/README.md)")
    vllm = profile.get("vllm")
    lines = [f"{name}: {str(data.get('date', ''))[:16].replace('T', ' ')} UTC, {machine_of(data)}, "
             f"engine revision {data.get('environment', {}).get('nanoengine_revision', 'unknown')}, "
             f"{data.get('dtype', '?')}",
             f"    command: {command_today(data.get('command', ''))}",
             f"    method: {profile.get('method', '?')}"]
    if vllm:
        lines.append(f"    vLLM {vllm.get('version')} with its engine core in the runner's process "
                     f"({vllm.get('engine_core_client')}), threads bound to "
                     f"{vllm.get('settings', {}).get('threads_bind', '?')}")
    lines.append(table(rows))
    return "\n".join(lines)


def live_comparison(dtype: str = "float32", num_requests: int = 8, max_prompt: int = 64, output_len: int = 16,
                    repeats: int = 2, single_stream_tokens: int = 16, model: str | None = None,
                    vllm_venv: str | None = None, out: Path | None = None) -> PeerComparison:
    """Run ``bench --vs-vllm`` on a small workload, through the benchmark's own code, and read it.

    The same parser and ``run_from_args`` as the command line, so the live run is the
    command's run at a smaller size (transformers' static batching included, its
    ``generate_batch`` left out for time). vLLM's load (it compiles the model) is not
    timed but takes a minute or more. The results go to ``out`` (default: a temporary
    directory, so ``results/`` and the README's table stay as they are).
    """
    from nanoengine.__main__ import build_parser
    from nanobench.benchmark import run_from_args

    if out is None:
        out = Path(tempfile.mkdtemp(prefix="bench-vllm-")) / f"bench-vllm-live-{dtype}.json"
    out = Path(out)
    argv = ["bench", "--vs-vllm", "--device", "cpu", "--dtype", dtype, "--num-requests", str(num_requests),
            "--min-prompt", str(min(32, max_prompt)), "--max-prompt", str(max_prompt), "--output-len", str(output_len),
            "--repeats", str(repeats), "--single-stream-tokens", str(single_stream_tokens), "--skip-generate-batch",
            "--vllm-compare-prompts", str(num_requests), "--out", str(out)]
    argv += ["--model", str(model)] if model is not None else []
    argv += ["--vllm-venv", str(vllm_venv)] if vllm_venv is not None else []
    args = build_parser(argv).parse_args(argv)
    args.command_line = "python -m nanoengine " + " ".join(argv)  # recorded in the results, as the CLI does
    return read_comparison(run_from_args(args), out.name)


__all__ = ["COMPILATION_MODES", "HOW_TO_MEASURE", "PEER_GLOB", "PROFILE_COMMAND", "PeerComparison", "describe",
           "live_comparison", "machine_of", "newest_comparisons", "newest_profile", "profile_table",
           "read_comparison", "read_file", "reading", "report"]
