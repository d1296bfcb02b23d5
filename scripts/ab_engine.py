"""Engine-only throughput of the checkout it runs from, for A/B runs of two revisions (results/README.md).

    cd <a worktree of revision A> && PYTHONPATH=$PWD python /path/to/scripts/ab_engine.py A
    cd <a worktree of revision B> && PYTHONPATH=$PWD python /path/to/scripts/ab_engine.py B
    (alternate A, B, A, B in one session; compare medians of the same round)

The default model (DTYPE=float32 or bfloat16); 24 requests of 32-256 random prompt tokens (seed 0)
and 64 greedy output tokens each, batched; then one 32-token prompt alone for 128 tokens. Prints
the medians over REPEATS rounds (default 3) and a hash of all greedy tokens, which must be equal
across revisions that claim to compute the same thing.
"""

import hashlib
import json
import os
import statistics
import sys
import time

import torch

from nanoengine import LLM, SamplingParams


def measure(llm: LLM, repeats: int) -> tuple[dict[str, list[float]], str]:
    """The workload on ``llm``: tokens/s per round, batched and single, and the greedy tokens' hash."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (int(torch.randint(32, 257, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(24)]
    batched = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    single = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:4], batched, use_tqdm=False)  # warm-up
    rates = {"batch": [], "single": []}
    tokens = None
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, batched, use_tqdm=False)
        rates["batch"].append(24 * 64 / (time.perf_counter() - start))
        start = time.perf_counter()
        alone = llm.generate([prompts[0][:32]], single, use_tqdm=False)
        rates["single"].append(128 / (time.perf_counter() - start))
        tokens = [o.outputs[0].token_ids for o in outs] + [alone[0].outputs[0].token_ids]
    return rates, hashlib.sha1(str(tokens).encode()).hexdigest()[:10]


if __name__ == "__main__":
    rates, digest = measure(LLM(dtype=os.environ.get("DTYPE", "float32")), int(os.environ.get("REPEATS", 3)))
    print(json.dumps({k: round(statistics.median(v), 1) for k, v in rates.items()}), "tokens", digest, sys.argv[1:])
