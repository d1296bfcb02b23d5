"""Speculative decoding measured: the engine with and without prompt lookup (chapter 13).

``python -m nanoengine bench --speculative`` runs two workloads on the default model, each
as a single stream (one request at a time: the memory-bound case speculation is for) and
as a batch of all its requests together:

* **friendly**: tasks whose answer copies its prompt: repeat a paragraph, correct a few
  words of it, continue a code listing with a renamed variable, quote a passage. Prompt
  lookup finds long runs of the answer in the prompt.
* **open**: open questions (a story, an explanation, a list of ideas): the answer
  rarely repeats anything, so few drafts are found and fewer accepted.

Each is run by two engines built in the same process, one plain and one with
``speculative_config`` (``--spec-tokens`` k, lookup lengths ``--spec-lookup-min`` to
``--spec-lookup-max``), in alternating rounds (``--repeats``), greedy, through the chat
template, each request up to ``--spec-output-len`` tokens (EOS ends it, so both engines
emit exactly the same tokens; the run checks they do). The results file records tok/s of
every run, medians, the speedup, the acceptance rate and the mean acceptance length
(tokens per verify pass), with the machine, the date and the command.

With ``--vs-vllm`` the single-stream rows race vLLM's CPU build too (``./course vllm-setup``):
two vLLM processes, one plain and one with the same prompt-lookup ``speculative_config``
(vLLM's own keys; its CPU runner verifies drafts with native kernels), take turns with the
engine's two in every round (``race_vllm``). All four get the same token ids (the engine's
chat template) and the same number of tokens per prompt, EOS ignored: the length the
engine's plain greedy answer has, measured first. The batched rows are left out there (the
plain run of ``--speculative`` has them).

The prose and code in the prompts were written for this benchmark.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

from nanobench.benchmark import environment, load_average
from nanobench.timing import in_turn, measure_memory_bandwidth

PARAGRAPH = (
    "A paged key-value cache stores the keys and values of every token in fixed-size blocks. "
    "A block table maps each sequence's logical blocks to physical ones, so a sequence grows one block "
    "at a time and never needs a contiguous region. When a request finishes, its blocks return to a free "
    "list, and blocks whose contents are identical across requests can be shared through a prefix cache."
)
CODE = '''def mean_and_spread(values):
    total = 0.0
    for value in values:
        total += value
    mean = total / len(values)
    spread = 0.0
    for value in values:
        spread += (value - mean) ** 2
    return mean, (spread / len(values)) ** 0.5
'''
FRIENDLY = (
    f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    f"Rewrite this paragraph, changing only 'tokens' to 'words' and keeping everything else the same:\n\n{PARAGRAPH}",
    f"Rename the variable `total` to `running_sum` in this function and print the whole function:\n\n{CODE}",
    f"Quote the second sentence of this paragraph, then the whole paragraph again:\n\n{PARAGRAPH}",
)
OPEN = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a weekend trip in the mountains.",
    "Describe how bread rises, step by step.",
)
WORKLOADS = {"friendly": FRIENDLY, "open": OPEN}


def run_speculative(args) -> dict:
    """Both workloads, single stream and batched, plain against speculative, alternating rounds."""
    from nanoengine import LLM, SamplingParams

    spec_config = {"method": "ngram", "num_speculative_tokens": args.spec_tokens,
                   "prompt_lookup_max": args.spec_lookup_max, "prompt_lookup_min": args.spec_lookup_min}
    if getattr(args, "spec_tokens_per_batch_size", None) is not None:
        spec_config["num_speculative_tokens_per_batch_size"] = args.spec_tokens_per_batch_size
    options = dict(device=args.device, dtype=args.dtype, model=args.model)
    load_at_start = load_average()
    plain = LLM(**options)
    spec = LLM(**options, speculative_config=spec_config)
    params = SamplingParams(temperature=0.0, max_tokens=args.spec_output_len)
    bandwidth = measure_memory_bandwidth().bytes_per_s / 1e9
    weight_bytes = plain.memory_report().weight_bytes
    schedule = spec_config.get("num_speculative_tokens_per_batch_size")
    by_batch = f", k by batch size {schedule}" if schedule else ""
    print(f"speculative decoding: ngram k={args.spec_tokens}, lookup {args.spec_lookup_min}-{args.spec_lookup_max}"
          f"{by_batch}; "
          f"greedy, up to {args.spec_output_len} tokens; {args.repeats} alternating rounds; "
          f"memory bandwidth {bandwidth:.1f} GB/s")
    if getattr(args, "vs_vllm", False):
        return _write(args, plain, spec_config, bandwidth, weight_bytes, load_at_start,
                      race_vllm(args, plain, spec, spec_config))
    rows = []
    for workload, prompts in WORKLOADS.items():
        for mode, batch in (("single stream", 1), ("batch", len(prompts))):
            row = race_speculative(plain, spec, prompts, params, batch=batch, repeats=args.repeats)
            row.update(workload=workload, mode=mode, num_prompts=len(prompts))
            if mode == "single stream":  # weights read per step, as a share of the copy bandwidth
                row["plain_weight_traffic_share"] = weight_bytes * row["plain_tok_s"] / (bandwidth * 1e9)
            rows.append(row)
            print(f"{workload:<9} {mode:<13} plain {row['plain_tok_s']:7.1f} tok/s  speculative "
                  f"{row['spec_tok_s']:7.1f} tok/s  x{row['speedup']:.2f}  acceptance "
                  f"{_fmt(row['acceptance_rate'])}  tokens/verify {_fmt(row['mean_acceptance_length'])}  "
                  f"identical {row['identical']}")
    return _write(args, plain, spec_config, bandwidth, weight_bytes, load_at_start, rows)


def _write(args, plain, spec_config: dict, bandwidth: float, weight_bytes: int, load_at_start, rows: list) -> dict:
    """The results file: the rows, with the machine, the date and the command."""
    results = {
        "kind": "speculative decoding", "model": plain.engine.model_config.architecture,
        "speculative_config": spec_config, "output_len": args.spec_output_len, "repeats": args.repeats,
        "dtype": str(plain.engine.config.torch_dtype).removeprefix("torch."),
        "memory_bandwidth_gbs": bandwidth, "weight_bytes": weight_bytes, "rows": rows,
        "load_average": {"start": load_at_start, "end": load_average()}, "environment": environment(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": getattr(args, "command_line", None), "format": "results/README.md",
    }
    device = plain.engine.config.torch_device.type
    name = "bench-speculative-vllm" if getattr(args, "vs_vllm", False) else "bench-speculative"
    path = Path(args.out) if args.out else \
        Path("results") / f"{name}-{device}-{datetime.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"results written to {path}")
    return results


def race_speculative(plain, spec, prompts: Sequence[str | list[int]], params, *, batch: int, repeats: int,
                     each_round: Callable[[], None] | None = None, keep_tokens: bool = False) -> dict:
    """Plain against speculative decoding on the same prompts: the measurement of ``bench
    --speculative`` and of chapter 13 (sections 6 and 7).

    ``plain`` and ``spec`` are ``LLM``s of the same model, ``spec`` built with a
    ``speculative_config``. A prompt that is text is one user message through the chat
    template; one that is token ids goes in as it is (``race_vllm`` templates its prompts
    once, so vLLM gets the same ids). ``params`` is one ``SamplingParams`` for all or one per
    prompt. Prompts are sent ``batch`` at a time: 1 is a single stream (one request at a
    time, the memory-bound case speculation is for), ``len(prompts)`` one batch of them all.
    The engines take turns, ``repeats`` runs each, so a slow spell of the machine falls on
    both; every run starts from an empty prefix cache, so no run reuses an earlier one's
    prompt blocks. ``each_round``, when given, is called after both engines' turn in every
    round: other systems take their turn there (``race_vllm``'s vLLM peers).

    Returns a dict (a row of the results file, ``results/README.md``): ``plain_seconds`` and
    ``spec_seconds`` of every run; ``output_tokens`` (of the last run), ``plain_tok_s`` and
    ``spec_tok_s`` (those tokens over the median run) and ``speedup`` (their ratio);
    ``num_drafts``, ``num_draft_tokens`` and ``num_accepted_tokens`` during these runs (from
    ``spec``'s ``spec_decode_stats``), ``acceptance_rate`` and ``mean_acceptance_length``
    (tokens per verify pass), None without a draft; and ``identical``: both engines emitted
    the same tokens, as they must with greedy ``params``. With ``keep_tokens``, ``tokens``
    has each engine's generated ids per prompt (of the last run): ``{"plain": [...],
    "spec": [...]}``.
    """
    times = {"plain": [], "spec": []}
    outputs = {}
    stats = spec.engine.spec_decode_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    requests = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(requests)
    if len(per_prompt) != len(requests):
        raise ValueError(f"need one SamplingParams for all prompts or one per prompt, got {len(per_prompt)} "
                         f"for {len(requests)} prompts")
    tokens = None
    engines = {"plain": plain, "spec": spec}
    for turn in range(repeats):
        for name in in_turn(engines, turn):
            llm = engines[name]
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outs = [o for i in range(0, len(requests), batch)
                    for o in llm.generate(requests[i:i + batch], per_prompt[i:i + batch], use_tqdm=False)]
            times[name].append(time.perf_counter() - start)
            outputs[name] = [list(o.outputs[0].token_ids) for o in outs]
            tokens = sum(len(t) for t in outputs[name])
        if each_round is not None:
            each_round()
    drafts, drafted, accepted = (now - was for now, was in zip(
        (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), before))
    plain_tok_s = tokens / statistics.median(times["plain"])
    spec_tok_s = tokens / statistics.median(times["spec"])
    row = {"output_tokens": tokens, "plain_seconds": times["plain"], "spec_seconds": times["spec"],
           "plain_tok_s": plain_tok_s, "spec_tok_s": spec_tok_s, "speedup": spec_tok_s / plain_tok_s,
           "num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
           "acceptance_rate": accepted / drafted if drafted else None,
           "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
           "identical": outputs["plain"] == outputs["spec"]}
    if keep_tokens:
        row["tokens"] = outputs
    return row


def race_vllm(args, plain, spec, spec_config: dict) -> list[dict]:
    """Single stream, both workloads: the engine plain and speculative against vLLM's CPU build
    plain and speculative (the same ``spec_config``), taking turns in every round.

    Each prompt goes through the engine's chat template to token ids; the engine's plain
    greedy answer (EOS ends it) fixes how many tokens every system then generates for it,
    EOS ignored, so all four produce the same count of tokens of the same answer. Returns one
    row per workload: each system's seconds per round and tok/s over the median, the ratios
    of the engine over vLLM, and whose greedy tokens agree.
    """
    from nanoengine import SamplingParams
    from nanoengine.loader.weights import resolve_model_source
    from nanobench.vllm_peer import greedy_agreement, start_peer

    workloads = {}
    for workload, texts in WORKLOADS.items():
        ids = [plain.engine.tokenize_prompt(plain.apply_chat_template([{"role": "user", "content": t}]))[1]
               for t in texts]
        answers = plain.generate(ids, SamplingParams(temperature=0.0, max_tokens=args.spec_output_len),
                                 use_tqdm=False)
        workloads[workload] = (ids, [len(a.outputs[0].token_ids) for a in answers])
    all_ids = [p for ids, _ in workloads.values() for p in ids]
    all_lens = [n for _, lens in workloads.values() for n in lens]
    config = plain.engine.config
    peers = {}
    try:
        for name, speculative, label in (("vllm_plain", None, "vLLM plain"),
                                         ("vllm_spec", spec_config, "vLLM speculative")):
            # One after the other (side by side took longer); loading is never timed.
            peers[name] = start_peer(
                args, resolve_model_source(args.model), all_ids, all_lens,
                str(config.torch_dtype).removeprefix("torch."), config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                spare_tokens=spec_config["num_speculative_tokens"] + 1, speculative_config=speculative, label=label)
        ready = {name: peer.wait_ready() for name, peer in peers.items()}
        rows = []
        for workload, (ids, lens) in workloads.items():
            row = _race_four(plain, spec, peers, ids, lens, args.repeats)
            row.update(workload=workload, mode="single stream", num_prompts=len(ids),
                       vllm_version=ready["vllm_plain"]["vllm_version"],
                       vllm_settings={name: peer.settings.described() for name, peer in peers.items()})
            row["greedy_agreement"] = {name: greedy_agreement(row["tokens"]["engine_plain"], row["tokens"][name])
                                       for name in ("engine_spec", "vllm_plain", "vllm_spec")}
            del row["tokens"]  # the agreement says what they show
            rows.append(row)
            tok_s = row["tok_s"]
            print(f"{workload:<9} single stream  engine {tok_s['engine_plain']:6.1f} -> {tok_s['engine_spec']:6.1f} "
                  f"tok/s  vLLM {tok_s['vllm_plain']:6.1f} -> {tok_s['vllm_spec']:6.1f} tok/s  engine/vLLM "
                  f"plain {row['engine_over_vllm_plain']:.2f}x, speculative {row['engine_over_vllm_spec']:.2f}x")
        return rows
    finally:
        for peer in peers.values():
            peer.close()


def _race_four(plain, spec, peers: dict, ids: list[list[int]], lens: list[int], repeats: int) -> dict:
    """``repeats`` rounds of four systems, one prompt at a time; EOS ignored, ``lens`` tokens each.

    The engine's two take their turn through ``race_speculative``, the vLLM peers theirs
    right after, in the same round."""
    from nanoengine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    seconds = {name: [] for name in peers}
    tokens = {}

    def vllm_turn() -> None:
        for name, peer in peers.items():
            runs = [peer.run([p], [n], keep_tokens=1) for p, n in zip(ids, lens)]
            seconds[name].append(sum(r["seconds"] for r in runs))
            tokens[name] = [r["tokens"][0] for r in runs]

    engines = race_speculative(plain, spec, ids, params, batch=1, repeats=repeats, each_round=vllm_turn,
                               keep_tokens=True)
    seconds = {"engine_plain": engines["plain_seconds"], "engine_spec": engines["spec_seconds"], **seconds}
    tokens = {"engine_plain": engines["tokens"]["plain"], "engine_spec": engines["tokens"]["spec"], **tokens}
    total = sum(lens)
    short = {name: [len(t) for t in toks] for name, toks in tokens.items() if [len(t) for t in toks] != lens}
    if short:
        raise RuntimeError(f"some system produced other token counts than {lens} (EOS ignored): {short}")
    tok_s = {name: total / statistics.median(s) for name, s in seconds.items()}
    return {"output_tokens": total, "seconds": seconds, "tok_s": tok_s, "tokens": tokens,
            "speedup_engine": tok_s["engine_spec"] / tok_s["engine_plain"],
            "speedup_vllm": tok_s["vllm_spec"] / tok_s["vllm_plain"],
            "engine_over_vllm_plain": tok_s["engine_plain"] / tok_s["vllm_plain"],
            "engine_over_vllm_spec": tok_s["engine_spec"] / tok_s["vllm_spec"],
            "engine_spec_over_vllm_plain": tok_s["engine_spec"] / tok_s["vllm_plain"]}


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"
