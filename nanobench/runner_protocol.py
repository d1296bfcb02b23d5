"""The runner's side of a peer's JSON-lines protocol (``peer_process`` is the driver's side).

A runner script (``vllm_runner.py``, ``llamacpp_runner.py``) is executed by its peer's own
virtualenv, which has neither torch nor nanoengine: so this module uses the standard library
only, and a runner imports it as a sibling file (``from runner_protocol import serve``: a
script's own directory is on its import path), not through the ``nanobench`` package.

:func:`serve` is the whole life of a runner: read the config given as the one argument, load
the engine, answer ``ready``, then answer one command per line until ``quit`` or the end of
stdin. Anything wrong is answered by ``{"event": "error", "message": ...}``; a command that
fails leaves the runner ready for the next. The answers travel on a copy of the process's
original standard output, taken before the engine loads: everything the engine and its
libraries print (logs, progress bars, compiler output, a C library's own ``printf``) goes
to standard error, so a stray print can never corrupt the protocol.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

#: ``load(config) -> (ready message, {command name: handler(command) -> answer})``.
Loader = Callable[[dict], "tuple[dict, dict[str, Callable[[dict], dict]]]"]


def take_stdout_for_protocol():
    """The protocol's channel: a copy of file descriptor 1, with fd 1 itself pointed at stderr.

    Redirecting the descriptor (not just ``sys.stdout``) also catches output from C
    extensions and from worker processes the engine starts, which inherit fd 1.
    """
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def answer(channel, message: dict) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def error_answer(exc: BaseException) -> dict:
    return {"event": "error", "message": f"{type(exc).__name__}: {exc}"}


def serve(argv: list[str], script: str, load: Loader) -> int:
    """Run a runner: ``argv`` is its command line after the script (one config JSON)."""
    channel = take_stdout_for_protocol()
    try:
        if len(argv) != 1:
            raise ValueError(f"usage: {script} '<config JSON>'")
        ready, commands = load(json.loads(argv[0]))
        answer(channel, ready)
    except Exception as exc:  # the driver reads this and shows the log's tail
        answer(channel, error_answer(exc))
        return 1
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            command = json.loads(line)
            if command.get("command") == "quit":
                break
            if command.get("command") not in commands:
                raise ValueError(f"unknown command {command.get('command')!r} "
                                 f"(allowed: {', '.join(commands)}, quit)")
            answer(channel, commands[command["command"]](command))
        except Exception as exc:
            answer(channel, error_answer(exc))
    return 0
