"""A stand-in for ``nanobench/vllm_runner.py`` that speaks its protocol without vLLM.

The tests run it with the course's own Python, so the suite exercises the driver
(``nanobench/vllm_peer.py``) and ``bench --vs-vllm`` on machines without ``.venv-vllm``.
Its "generated" tokens are a fixed function of the prompt (``fake_tokens``), so a test
knows what to expect. ``FAKE_VLLM_MODE`` makes it misbehave on purpose:

* ``fail-load``: answer an error instead of ``ready``;
* ``die-on-run``: exit without answering the first run;
* ``short``: produce one token fewer than asked for each prompt;
* ``noise``: print a line that is not JSON on the protocol channel, then go on.
"""

from __future__ import annotations

import json
import os
import sys
import time


def fake_tokens(prompt: list[int], n: int) -> list[int]:
    return [(sum(prompt) + 7 * j) % 500 for j in range(n)]


def fake_profile(command: dict) -> dict:
    """The ``profile`` answer: one step per token of the longest request, fixed shares; an
    error, as the real runner gives, unless the driver put the engine core in this process."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return {"event": "error", "message": "ValueError: profile needs VLLM_ENABLE_V1_MULTIPROCESSING=0"}
    shares = {"gemm": 0.5, "attention": 0.1, "other_ops": 0.2, "sampling": 0.05, "host": 0.15}
    step_ms = 2.0 * len(command["prompts"])
    return {"event": "profile", "steps": max(command["max_tokens"]), "idle_steps": 0,
            "step_ms": {"median": step_ms, "mean": step_ms},
            "categories": {c: {"median_ms": share * step_ms, "share": share} for c, share in shares.items()},
            "other_threads_ms": 0.0, "output_tokens": sum(command["max_tokens"]), "engine_core_client": "InprocClient"}


def main(argv: list[str]) -> int:
    channel = sys.stdout
    mode = os.environ.get("FAKE_VLLM_MODE", "")
    config = json.loads(argv[0])
    print("a log line a real vLLM would print", file=sys.stderr)
    if mode == "fail-load":
        channel.write(json.dumps({"event": "error", "message": "ValueError: cannot load " + config["model"]}) + "\n")
        return 1
    if mode == "noise":
        channel.write("INFO this is not JSON\n")
    env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "LD_PRELOAD", "HF_HUB_OFFLINE"))}
    channel.write(json.dumps({"event": "ready", "vllm_version": "0.0-fake", "torch_version": "0.0-fake",
                              "python": "3", "load_seconds": 0.01, "torch_threads": 1,
                              "settings": {**config, "resolved": {"dtype": config["dtype"]}},
                              "environment": env}) + "\n")
    channel.flush()
    for line in sys.stdin:
        command = json.loads(line)
        if command["command"] == "quit":
            return 0
        if command["command"] == "profile":
            channel.write(json.dumps(fake_profile(command)) + "\n")
            channel.flush()
            continue
        if command["command"] != "run":
            channel.write(json.dumps({"event": "error", "message": f"unknown command {command['command']!r}"}) + "\n")
            channel.flush()
            continue
        if mode == "die-on-run":
            return 3
        start = time.perf_counter()
        cut = 1 if mode == "short" else 0
        tokens = [fake_tokens(p, n - cut) for p, n in zip(command["prompts"], command["max_tokens"])]
        time.sleep(0.001 * len(command["prompts"]))  # a run takes time
        seconds = time.perf_counter() - start
        produced = sum(len(t) for t in tokens)
        channel.write(json.dumps({"event": "result", "seconds": seconds, "output_tokens": produced,
                                  "output_tokens_per_s": produced / seconds,
                                  "tokens": tokens[:command.get("keep_tokens", 0)]}) + "\n")
        channel.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
