"""A stand-in for ``nanobench/llamacpp_runner.py`` that speaks its protocol without llama.cpp.

The tests run it with the course's own Python, so the suite exercises the driver
(``nanobench/llamacpp_peer.py``), ``bench --vs-llamacpp`` and the runners' shared protocol
(``nanobench/runner_protocol.py``, which this stand-in serves through, as the real runner
does) on machines without ``.venv-llamacpp``. Its "generated" tokens are a fixed function of
the prompt (``fake_tokens``), so a test knows what to expect. ``FAKE_LLAMACPP_MODE`` makes
it misbehave on purpose:

* ``fail-load``: answer an error instead of ``ready``;
* ``die-on-run``: exit without answering the first generation;
* ``short``: produce one token fewer than asked.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "nanobench"))  # runner_protocol, as the runner finds it


def fake_tokens(prompt: list[int], n: int) -> list[int]:
    return [(sum(prompt) + 3 * j) % 500 for j in range(n)]


def generate(command: dict) -> dict:
    if os.environ.get("FAKE_LLAMACPP_MODE") == "die-on-run":
        os._exit(3)
    start = time.perf_counter()
    count = command["max_tokens"] - (1 if os.environ.get("FAKE_LLAMACPP_MODE") == "short" else 0)
    tokens, times = fake_tokens(command["prompt"], count), []
    for _ in tokens:
        time.sleep(0.001)  # a token takes time
        times.append(time.perf_counter() - start)
    return {"event": "result", "tokens": tokens, "token_times": times, "seconds": times[-1] if times else 0.0}


def start(config: dict) -> tuple[dict, dict]:
    print("a log line a real llama.cpp would print", file=sys.stderr)
    if os.environ.get("FAKE_LLAMACPP_MODE") == "fail-load":
        raise ValueError("cannot load " + config["model_path"])
    settings = {**config, "model_size_bytes": 1000, "model_parameters": 250, "model_description": "fake 1M F32",
                "flash_attn": False, "load_mode": "mmap", "n_threads_batch": config["n_threads"]}
    ready = {"event": "ready", "llama_cpp_python_version": "0.0-fake", "numpy_version": "0", "python": "3",
             "load_seconds": 0.01, "system_info": "CPU : FAKE = 1", "settings": settings}
    return ready, {"generate": generate}


if __name__ == "__main__":
    from runner_protocol import serve

    sys.exit(serve(sys.argv[1:], "fake_llamacpp_runner.py", start))
