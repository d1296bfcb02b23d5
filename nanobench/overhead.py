"""Host overhead per engine step, with the model's compute taken out (chapters 2 and 10).

A GPU finishes a decode step of a small model in well under a millisecond (the H200 check
measured 0.73 ms for 64 rows of a Qwen3-0.6B shape), so whatever the engine does *around*
the forward pass on the CPU decides its speed: scheduling, block bookkeeping, building the
step's tensors, sampling, appending tokens, detokenizing. This benchmark measures exactly
that part, on any machine, GPU or not:

* the engine runs a tiny random model (2 layers of width 32) whose forward pass costs
  almost nothing, with the real tokenizer and the real vocabulary (49,152 tokens for
  SmolLM2), because sampling and detokenization scale with those;
* ``N`` requests (1, 64, 256 by default) are admitted and prefilled, then ``--overhead-steps``
  decode steps of ``N`` rows each are timed by the engine's own timers
  (``StepFinished``: schedule, block manager, input preparation, model, sampling, update,
  detokenization);
* four times: greedy and sampling at temperature 0.8 with top-k 50 and top-p 0.95, both
  read as ``LLM.generate`` reads them (final outputs only, so text is made only when a
  request ends), and greedy read as a stream, twice: with cumulative outputs (everything
  so far, every step) and with deltas (only the new text and tokens, as ``LLM.stream``
  and the server's streaming responses read them).

The figure of merit is ``host_ms``, the median over steps of the step's wall time minus
its model time. Medians are reported per phase (so they need not add up exactly).

    python -m nanoengine bench --overhead
    python -m nanoengine bench --overhead --overhead-requests 256 --overhead-steps 50
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch

from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.events import StepFinished
from nanoengine.loader.weights import load_tokenizer, random_model, resolve_model_source
from nanobench.benchmark import environment, load_average
from nanobench.timing import median_ms
from nanoengine.models.config import ModelConfig
from nanoengine.sampling_params import RequestOutputKind, SamplingParams

# StepFinished fields, in step order, and the names the report gives them.
PHASES = {"schedule_time": "schedule", "block_manager_time": "block manager", "prepare_time": "prepare inputs",
          "sample_time": "sample", "update_time": "update outputs", "detokenize_time": "detokenize"}
GREEDY = {"temperature": 0.0}
TOP_K_TOP_P = {"temperature": 0.8, "top_k": 50, "top_p": 0.95}
# (label, sampling parameters, what each step hands out): the cases measured, each at every N.
CASES = (("greedy", GREEDY, "FINAL_ONLY"), ("top-k/top-p", TOP_K_TOP_P, "FINAL_ONLY"),
         ("greedy, streamed", GREEDY, "CUMULATIVE"), ("greedy, deltas", GREEDY, "DELTA"))
PROMPT_TOKENS = 128
WARM_UP_STEPS = 3


def overhead_engine(num_requests: int, tokenizer, vocab_size: int, max_model_len: int):
    """An engine around a tiny random model with the real vocabulary: compute near zero."""
    net = random_model("tiny-llama", vocab_size=vocab_size, max_position_embeddings=max_model_len)
    blocks_per_request = -(-max_model_len // 16)
    return LLMEngine.from_model(net, tokenizer, max_num_seqs=num_requests, max_model_len=max_model_len,
                                max_num_batched_tokens=max(2048, num_requests * PROMPT_TOKENS),
                                num_kv_blocks=num_requests * blocks_per_request + 1, seed=0)


def measure_overhead(engine, num_requests: int, sampling: dict, steps: int, seed: int = 0,
                     output_kind: str = "FINAL_ONLY") -> dict:
    """Admit ``num_requests`` requests, then time ``steps`` decode steps of all of them.

    ``output_kind`` (a ``RequestOutputKind`` name): ``FINAL_ONLY`` reports a request only
    at its end, as ``LLM.generate`` reads them; ``CUMULATIVE`` and ``DELTA`` report every
    request (with its text) every step, as a stream does.
    """
    generator = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    kind = RequestOutputKind[output_kind]
    params = SamplingParams(max_tokens=WARM_UP_STEPS + steps + 8, ignore_eos=True, seed=None, output_kind=kind,
                            **sampling)
    ids = [engine.add_request(torch.randint(5, vocab, (PROMPT_TOKENS,), generator=generator).tolist(), params)
           for _ in range(num_requests)]
    seen: list[StepFinished] = []
    unsubscribe = engine.events.subscribe(seen.append, StepFinished)
    try:
        while not seen or seen[-1].num_decode_tokens < num_requests:  # admission and prefill
            engine.step()
        for _ in range(WARM_UP_STEPS):
            engine.step()
        seen.clear()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    finally:
        unsubscribe()
        for request_id in ids:
            if engine.has_request(request_id):
                engine.abort(request_id)
    if any(e.num_decode_tokens != num_requests or e.num_prefill_tokens for e in seen):
        raise RuntimeError(f"a timed step was not a pure decode of {num_requests} rows: {seen}")

    return {
        "num_requests": num_requests, "steps": steps,
        "host_ms": median_ms([e.host_time for e in seen]),
        "host_ms_per_request": median_ms([e.host_time for e in seen]) / num_requests,
        "phases_ms": {name: median_ms([getattr(e, field, 0.0) for e in seen]) for field, name in PHASES.items()},
        "model_ms": median_ms([e.model_time for e in seen]),
        "step_ms": median_ms([e.total_time for e in seen]),
        "wall_ms_per_step": 1e3 * wall / steps,
    }


def run_overhead(request_counts: list[int], steps: int, out: str | None = None, command: str | None = None) -> dict:
    """Every (sampling, N) pair; prints a table and writes a results file."""
    source = resolve_model_source(None)
    tokenizer = load_tokenizer(source)
    vocab = ModelConfig.from_pretrained(source).vocab_size
    load_at_start = load_average()
    print(f"host overhead per decode step: tiny random model, vocabulary {vocab:,} with {source.name}'s tokenizer, "
          f"{PROMPT_TOKENS}-token prompts, {steps} timed steps (medians, ms)")
    header = f"{'case':<17} {'N':>4} {'host':>8} " + " ".join(f"{n:>14}" for n in PHASES.values()) + \
        f" {'model':>8}"
    print(header)
    rows = []
    for name, sampling, output_kind in CASES:
        for n in request_counts:
            engine = overhead_engine(n, tokenizer, vocab, max_model_len=PROMPT_TOKENS + steps + 64)
            row = {"sampling": name, "sampling_params": sampling, "streamed": output_kind != "FINAL_ONLY",
                   "output_kind": output_kind, **measure_overhead(engine, n, sampling, steps, output_kind=output_kind)}
            rows.append(row)
            print(f"{name:<17} {n:>4} {row['host_ms']:>8.2f} " +
                  " ".join(f"{v:>14.2f}" for v in row["phases_ms"].values()) + f" {row['model_ms']:>8.2f}")
    results = {
        "kind": "host overhead per step",
        "model": f"random tiny-llama (2 layers, hidden 32), vocabulary {vocab}", "tokenizer": source.name,
        "prompt_tokens": PROMPT_TOKENS, "rows": rows,
        "load_average": {"start": load_at_start, "end": load_average()}, "environment": environment(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command, "format": "results/README.md",
    }
    path = Path(out) if out else Path("results") / f"overhead-cpu-{datetime.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"results written to {path}")
    return results
