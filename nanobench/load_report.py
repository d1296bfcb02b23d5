"""Load report: many random requests through a small KV cache on a tiny random model.

    python -m nanobench.load_report                       # 1,000 requests, prints the figures
    python -m nanobench.load_report --num-requests 5000 --threads 2

The workload mixes everything the engine supports: prompt lengths from 1 token to
max_model_len, shared prefixes (prefix-cache hits), greedy and sampled requests with
random temperature / top-k / top-p / min-p, seeds, stop token ids, EOS, logprobs, and a
few aborts mid-flight. The KV pool holds only a few maximal requests, so admission waits,
chunked prefill and preemption all happen. Requests arrive as earlier ones finish (at most
``--max-outstanding`` queued or running at once).

It prints steps/s, output tokens/s, the peak RSS and the RSS growth after warm-up (RSS is
sampled with psutil every ``--sample-every`` steps), and checks that every request
finished and no block leaked. ``tests/engine/test_load.py`` runs the same function with asserts.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import psutil
import torch

from nanoengine import LLMEngine, SamplingParams
from nanoengine.engine.detokenizer import IncrementalDetokenizer
from nanoengine.engine.request import Request
from nanoengine.loader.weights import random_model
from nanoengine.models.presets import TINY_PRESETS

TINY = TINY_PRESETS["tiny-llama-eos"]
VOCAB = TINY.vocab_size
ENGINE = dict(device="cpu", max_model_len=64, block_size=8, num_kv_blocks=24, max_num_seqs=16,
              max_num_batched_tokens=64, enable_chunked_prefill=True, enable_prefix_caching=True)


@dataclass
class LoadReport:
    num_requests: int
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    steps: int = 0
    seconds: float = 0.0
    output_tokens: int = 0
    preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    rss_samples: list[tuple[int, int]] = field(default_factory=list)  # (requests finished, RSS bytes)
    warmup_requests: int = 0
    free_blocks_at_end: int = 0
    num_blocks: int = 0
    live_requests_after: int = 0  # Request objects the run left alive (leak check: after minus before)
    live_detokenizers_after: int = 0
    event_history: int = 0  # events the bus still holds (bounded)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds

    @property
    def peak_rss_mb(self) -> float:
        return max(rss for _, rss in self.rss_samples) / 2**20

    @property
    def rss_growth_after_warmup_mb(self) -> float:
        """Median RSS of the last quarter of samples minus that of the first post-warm-up quarter."""
        after = [rss for done, rss in self.rss_samples if done >= self.warmup_requests]
        quarter = max(1, len(after) // 4)
        return (statistics.median(after[-quarter:]) - statistics.median(after[:quarter])) / 2**20

    def lines(self) -> list[str]:
        return [
            f"requests:       {self.num_requests} ({', '.join(f'{k}: {v}' for k, v in sorted(self.finished.items()))})",
            f"steps:          {self.steps} in {self.seconds:.1f} s = {self.steps_per_s:.1f} steps/s, "
            f"{self.output_tokens / self.seconds:.0f} output tokens/s",
            f"preemptions:    {self.preemptions}; prefix-cache hit tokens: {self.prefix_cache_hit_tokens}",
            f"peak RSS:       {self.peak_rss_mb:.1f} MiB; growth after {self.warmup_requests} warm-up requests: "
            f"{self.rss_growth_after_warmup_mb:+.2f} MiB ({len(self.rss_samples)} samples)",
            f"blocks at end:  {self.free_blocks_at_end}/{self.num_blocks} free; "
            f"Request objects alive after: {self.live_requests_after}, detokenizers: "
            f"{self.live_detokenizers_after}; events held by the bus: {self.event_history}",
        ]


def tiny_engine(**overrides) -> LLMEngine:
    net = random_model("tiny-llama-eos", std=0.08)
    return LLMEngine.from_model(net, None, **{**ENGINE, **overrides})


def random_request(rng: random.Random, prefixes: list[list[int]],
                   max_model_len: int) -> tuple[list[int], SamplingParams]:
    length = rng.randint(1, max_model_len)
    prompt = [rng.randrange(VOCAB) for _ in range(length)]
    if rng.random() < 0.4:  # a shared prefix: prefix-cache hits
        prefix = rng.choice(prefixes)
        prompt = (prefix + prompt)[:length]
    params = dict(max_tokens=rng.randint(1, 16), ignore_eos=rng.random() < 0.5,
                  stop_token_ids=[rng.randrange(VOCAB)] if rng.random() < 0.2 else [],
                  logprobs=rng.randint(0, 5) if rng.random() < 0.1 else None)
    if rng.random() < 0.5:
        return prompt, SamplingParams(temperature=0.0, **params)
    return prompt, SamplingParams(temperature=rng.choice([0.3, 0.7, 1.0, 1.5]), top_k=rng.choice([-1, 0, 5, 50]),
                                  top_p=rng.uniform(0.1, 1.0), min_p=rng.choice([0.0, 0.05, 0.2]),
                                  seed=rng.randrange(2**31) if rng.random() < 0.5 else None, **params)


def run_load(num_requests: int = 1000, seed: int = 0, max_outstanding: int = 48, abort_fraction: float = 0.05,
             sample_every: int = 10, warmup_fraction: float = 0.3, check_every: int = 1,
             **engine_overrides) -> LoadReport:
    """Push ``num_requests`` random requests through a fresh engine; measure and check."""
    rng = random.Random(seed)
    engine = tiny_engine(**engine_overrides)
    max_model_len = engine.max_model_len
    prefixes = [[rng.randrange(VOCAB) for _ in range(max_model_len)] for _ in range(8)]
    report = LoadReport(num_requests, warmup_requests=int(num_requests * warmup_fraction),
                        num_blocks=engine.block_manager.num_blocks)
    process = psutil.Process()
    added = done = 0
    to_abort: dict[str, int] = {}  # request id -> step at which to abort it
    gc.collect()
    # Requests and detokenizers that exist already (another engine in this process, a test's
    # fixture) are not this run's: the leak check counts what the run adds.
    requests_before, detokenizers_before = _count(Request), _count(IncrementalDetokenizer)
    start = time.perf_counter()
    while done < num_requests:
        while added < num_requests and len(engine.requests) < max_outstanding:
            prompt, params = random_request(rng, prefixes, max_model_len)
            rid = engine.add_request(prompt, params)
            added += 1
            if rng.random() < abort_fraction:
                to_abort[rid] = report.steps + rng.randint(0, 8)
        for rid, at in list(to_abort.items()):
            if at <= report.steps:
                del to_abort[rid]
                if engine.has_request(rid):  # a user request id (engine.requests holds completion ids)
                    out = engine.abort(rid)
                    report.finished[out.finish_reason] = report.finished.get(out.finish_reason, 0) + 1
                    done += 1
        for out in engine.step():
            if out.finished:
                report.finished[out.finish_reason] = report.finished.get(out.finish_reason, 0) + 1
                report.output_tokens += len(out.token_ids)
                done += 1
        report.steps += 1
        if check_every and report.steps % check_every == 0:
            engine.check_invariants()
        if report.steps % sample_every == 0:
            report.rss_samples.append((done, process.memory_info().rss))
    report.seconds = time.perf_counter() - start
    report.rss_samples.append((done, process.memory_info().rss))
    engine.check_invariants()
    snap = engine.snapshot()
    report.preemptions = snap.num_preemptions
    report.prefix_cache_hit_tokens = snap.prefix_cache_hits
    report.free_blocks_at_end = snap.num_free_blocks
    assert not engine.has_unfinished_requests() and not engine.requests, "requests left unfinished"
    gc.collect()
    report.live_requests_after = _count(Request) - requests_before
    report.live_detokenizers_after = _count(IncrementalDetokenizer) - detokenizers_before
    report.event_history = len(engine.events.history)
    return report


def _count(kind: type) -> int:
    """How many objects of exactly this type the garbage collector tracks now."""
    return sum(1 for obj in gc.get_objects() if type(obj) is kind)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-outstanding", type=int, default=48)
    parser.add_argument("--num-kv-blocks", type=int, default=ENGINE["num_kv_blocks"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for this tiny model)")
    parser.add_argument("--check-every", type=int, default=1, help="invariant check every N steps (0: never)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"tiny Llama (hidden {TINY.hidden_size}, {TINY.num_hidden_layers} layers, vocab {VOCAB}); engine "
          f"{ {**ENGINE, 'num_kv_blocks': args.num_kv_blocks} }; torch threads {args.threads}")
    report = run_load(args.num_requests, args.seed, args.max_outstanding, check_every=args.check_every,
                      num_kv_blocks=args.num_kv_blocks)
    print("\n".join(report.lines()))
    ok = report.free_blocks_at_end == report.num_blocks and sum(report.finished.values()) == args.num_requests
    print("OK: every request finished, no block leaked" if ok else "FAILED: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
