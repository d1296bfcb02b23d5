"""The engine against llama.cpp on one stream, read from a ``bench --vs-llamacpp`` results file (chapter 11).

``python -m nanoengine bench --vs-llamacpp`` decodes the same prompt ids with the engine and
with llama.cpp (``nanobench/llamacpp_peer.py``), in alternating rounds, from GGUF files that
hold the engine's own weights, and writes ``results/bench-llamacpp-<device>-<date>-<dtype>.json``
(``results/README.md`` describes every field). This module turns the newest file of each
dtype into what a reader asks: where, when and how it ran; each system's decode rate, first
token and share of the machine's copy bandwidth; whether the greedy tokens agree; and a
reading computed from those numbers, never typed: who decodes faster at the same precision,
and whether llama.cpp's 8-bit weights (Q8_0) turned fewer bytes into more tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from nanobench.provenance import command_today

RESULTS_GLOB = "bench-llamacpp-*.json"
HOW_TO_MEASURE = ("./course llamacpp-setup, then python -m nanoengine bench --vs-llamacpp --dtype float32 "
                  "--output-len 128 --llamacpp-q8-0 (and --dtype bfloat16)")
LABELS = {"nanoengine": "nanoengine", "llamacpp": "llama.cpp, same precision", "llamacpp_q8_0": "llama.cpp, Q8_0"}
LEVEL = 0.10  # ratios within 10% of 1 read as level: these rounds vary by more than 5% on a shared 2-core VM


def newest_files(results_dir: Path) -> list[dict]:
    """The newest results file of each dtype (float32 first), each as its JSON with a ``file`` key."""
    newest: dict[str, dict] = {}
    for path in sorted(Path(results_dir).glob(RESULTS_GLOB)):
        data = json.loads(path.read_text())
        data["file"] = path.name
        held = newest.get(data["dtype"])
        if held is None or (data["date"], data["file"]) > (held["date"], held["file"]):
            newest[data["dtype"]] = data
    return sorted(newest.values(), key=lambda d: (d["dtype"] != "float32", d["dtype"]))


def _side(ratio: float, faster: str, slower: str) -> str:
    if abs(ratio - 1) <= LEVEL:
        return f"level ({ratio:.2f}x)"
    return f"{faster if ratio > 1 else slower} ({ratio:.2f}x)"


def describe(data: dict) -> str:
    """Every figure of one file, with its provenance, as lines of text."""
    env, work = data["environment"], data["workload"]
    lines = [f"{data['file']}: {data['date'][:16].replace('T', ' ')} UTC, {env['cpu_model']}, {env['cpu_count']} cores, "
             f"engine revision {env['nanoengine_revision']}",
             f"    command: {command_today(data['command'])}",
             f"    one stream: {work['prompt_tokens']} prompt tokens, {work['output_tokens']} generated, greedy, "
             f"{work['repeats']} alternating rounds; copy bandwidth {data['memory_bandwidth_gbs']:.1f} GB/s"]
    for name, record in data["systems"].items():
        decode, ttft = record["decode_tok_s"], record["ttft_ms"]
        weights = record.get("gguf", {}).get("weights", record.get("dtype", data["dtype"]))
        lines.append(f"    {LABELS.get(name, name):<27} {weights:>8} weights {record['weight_bytes'] / 1e6:5.0f} MB: "
                     f"decode {decode['median']:6.1f} tok/s (runs {decode['min']:.0f}-{decode['max']:.0f}), "
                     f"first token {ttft['median']:4.0f} ms, weights read at {record['weight_traffic_share']:.0%} "
                     f"of the copy bandwidth")
        agreement = record.get("greedy_agreement")
        if agreement:
            where = agreement.get("earliest_divergence")
            lines.append(f"        greedy tokens against the engine's: {agreement['tokens_agreeing']}/"
                         f"{agreement['tokens_compared']} agree" + ("" if where is None else f", parting at position "
                                                                     f"{where}"))
    return "\n".join(lines)


def reading(data: dict) -> str:
    """Where each engine wins on this file's machine, and why, from the file's own numbers: one
    line each (starting with a newline) for decode at the same precision, the first token and Q8_0."""
    systems = data["systems"]
    engine, peer = systems["nanoengine"], systems["llamacpp"]
    ratio = engine["decode_tok_s"]["median"] / peer["decode_tok_s"]["median"]
    shares = engine["weight_traffic_share"], peer["weight_traffic_share"]
    bound = ("both read their weights at {:.0%} and {:.0%} of the copy bandwidth, the ceiling of one stream, so "
             "at the same bytes neither can pull far ahead".format(*shares) if min(shares) >= 0.7 else
             "at least one reads its weights well below the copy bandwidth ({:.0%} and {:.0%}): something other "
             "than the bytes limits it".format(*shares))
    ttft = engine["ttft_ms"]["median"] / peer["ttft_ms"]["median"]
    parts = [f"at the same precision ({data['dtype']}), decode {_side(ratio, 'the engine faster', 'llama.cpp faster')}:"
             f" {bound}",
             f"first token, which times the prompt's forward pass: "
             f"{_side(1 / ttft, 'the engine sooner', 'llama.cpp sooner')}"]
    q8 = systems.get("llamacpp_q8_0")
    if q8:
        fewer = peer["weight_bytes"] / q8["weight_bytes"]
        gain = q8["decode_tok_s"]["median"] / peer["decode_tok_s"]["median"]
        if gain >= 0.75 * fewer:
            why = "the stream is bound by the bytes it reads, so fewer bytes are more tokens"
        elif gain > 1 + LEVEL:
            why = (f"less than the bytes alone would give, as its weights are read at only "
                   f"{q8['weight_traffic_share']:.0%} of the copy bandwidth: unpacking the 8-bit blocks (compute) "
                   "limits it here before memory does")
        else:
            why = (f"unpacking the 8-bit blocks cost what the bytes saved (its weights read at "
                   f"{q8['weight_traffic_share']:.0%} of the copy bandwidth)")
        parts.append(f"llama.cpp's Q8_0 reads {fewer:.1f}x fewer bytes than the same-precision file and decodes "
                     f"{gain:.2f}x as fast: {why}")
    return "".join(f"\n  - {part}" for part in parts)


def report(results_dir: Path) -> str:
    """The newest file of each dtype, described and read; or how to measure one when there is none."""
    files = newest_files(results_dir)
    if not files:
        return f"no bench --vs-llamacpp results in {results_dir}: {HOW_TO_MEASURE}"
    return "\n".join(f"{describe(data)}\nreading ({data['environment']['cpu_model']}, {data['dtype']}):{reading(data)}"
                     for data in files)
