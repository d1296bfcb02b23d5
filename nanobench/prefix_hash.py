"""What the cryptographic prefix-cache digest costs (chapter 7), measured against a prefill.

The block manager names every full KV block by SHA-256 over its parent's digest and its
token ids (``engine/block_manager.py``), where it once used Python's 64-bit ``hash``.
A digest is computed once per block of a prompt, so the question is how its cost compares
with computing the prompt. This measures, on the default model and one long prompt
(8,000 tokens by default; SmolLM2 reads 8,192 at most):

* the time to chain the digests of all the prompt's full blocks (median of repeats), with
  SHA-256 and, for comparison, with Python's ``hash`` of a tuple;
* the prefill of the same prompt through the engine (median of repeats, prefix cache reset
  before each run, one output token);

and writes both, and their ratio, to a results file that names the machine, the engine
revision, the date and the command.

    python -m nanobench.prefix_hash                 # 8,000 tokens
    python -m nanobench.prefix_hash --tokens 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

from nanoengine.engine.block_manager import hash_block


def chain_digests(tokens: list[int], block_size: int, digest=hash_block) -> list:
    """The chained digest of every full block of ``tokens`` (what a prefix lookup computes)."""
    parent, chain = None, []
    for i in range(len(tokens) // block_size):
        parent = digest(parent, tokens[i * block_size:(i + 1) * block_size])
        chain.append(parent)
    return chain


def python_hash(parent, tokens) -> int:
    """The engine's old block name: Python's 64-bit hash of a tuple (collisions can be built)."""
    return hash((parent, tuple(tokens)))


def _median_seconds(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def measure(num_tokens: int, repeats: int, prefill_repeats: int, block_size: int = 16, seed: int = 0) -> dict:
    from nanoengine import LLM, SamplingParams

    rng = random.Random(seed)
    tokens = [rng.randrange(100, 10000) for _ in range(num_tokens)]
    sha, sha_runs = _median_seconds(lambda: chain_digests(tokens, block_size), repeats)
    builtin, builtin_runs = _median_seconds(lambda: chain_digests(tokens, block_size, python_hash), repeats)
    max_model_len = num_tokens + 8
    llm = LLM(block_size=block_size, max_model_len=max_model_len, max_num_batched_tokens=2048,
              num_kv_blocks=-(-max_model_len // block_size) + 8)
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([tokens[:64]], params)  # warm-up

    def prefill() -> None:
        llm.reset_prefix_cache()
        llm.generate([tokens], params)

    prefill_s, prefill_runs = _median_seconds(prefill, prefill_repeats)
    llm.shutdown()
    return {
        "prompt_tokens": num_tokens, "block_size": block_size, "blocks_hashed": num_tokens // block_size,
        "sha256_chain_seconds": {"median": sha, "runs": sha_runs},
        "python_hash_chain_seconds": {"median": builtin, "runs": builtin_runs},
        "prefill_seconds": {"median": prefill_s, "runs": prefill_runs},
        "sha256_share_of_prefill": sha / prefill_s,
        "sha256_over_python_hash": sha / builtin,
    }


def main(argv: list[str] | None = None) -> int:
    from nanobench.benchmark import environment

    p = argparse.ArgumentParser(prog="python -m nanobench.prefix_hash", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8000, help="prompt length (default 8000)")
    p.add_argument("--repeats", type=int, default=21, help="timings of the digest chain (median taken)")
    p.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills (median taken)")
    p.add_argument("--out", default=None, help="results JSON (default: results/prefix-hash-cost-<date>.json)")
    args = p.parse_args(argv)
    for name in ("tokens", "repeats", "prefill_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    result = measure(args.tokens, args.repeats, args.prefill_repeats)
    now = datetime.datetime.now(datetime.timezone.utc)
    result.update(date=now.isoformat(timespec="seconds"), environment=environment(),
                  command="python -m nanobench.prefix_hash " + " ".join(sys.argv[1:] if argv is None else argv))
    out = Path(args.out) if args.out else Path("results") / f"prefix-hash-cost-{now.date()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{args.tokens} tokens, {result['blocks_hashed']} blocks: SHA-256 chain "
          f"{result['sha256_chain_seconds']['median'] * 1e3:.2f} ms (Python hash "
          f"{result['python_hash_chain_seconds']['median'] * 1e3:.2f} ms), prefill "
          f"{result['prefill_seconds']['median']:.2f} s -> SHA-256 is {result['sha256_share_of_prefill']:.2e} "
          f"of the prefill; written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
