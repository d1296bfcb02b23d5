"""Command line: ``python -m nanobench [options]``, the benchmark (the engine against transformers).

The same command as ``python -m nanoengine bench``, with the same options
(``nanobench/benchmark.py`` explains them):

    python -m nanobench                                   # default workload, writes results JSON
    python -m nanobench --num-requests 4 --output-len 8   # a quick look
    python -m nanobench --vs-vllm --dtype bfloat16        # with vLLM's CPU build (./course vllm-setup)
    python -m nanobench --vs-vllm --profile --skip-hf     # and where each engine spends its step
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from nanobench.benchmark import add_arguments, run_from_args  # imports torch

    words = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m nanobench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(words)
    args.command_line = " ".join(["python -m nanobench", *words])  # recorded in the results
    try:
        run_from_args(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:  # as python -m nanoengine bench answers them
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
