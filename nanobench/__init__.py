"""nanobench: measuring nanoengine. The benchmark, the GPU check, the load report, the
prefix-hash cost, the server's soak, timing, and the README's results report.

It lives beside the engine, not inside it: measuring depends on the engine, never the other
way round (no module of ``nanoengine`` imports this package; ``python -m nanoengine bench``
loads it only when that command runs, and ``tests/engine/test_imports.py`` checks both).

``benchmark`` (``python -m nanobench``, the same as ``python -m nanoengine bench``),
``benchmark_compile`` (its ``--compile`` A/B), ``gpu_check`` (``./course gpu-check``),
``prefix_hash`` (``python -m nanobench.prefix_hash``) and ``soak`` (``python -m nanobench.soak``:
the server's memory over an hour of mixed load) write results files under
``results/`` that name the machine, the engine revision, the date and the command
(``results/README.md``); ``load_report`` (``python -m nanobench.load_report``) prints its
figures and backs ``tests/engine/test_load.py``; ``timing`` is the one measuring helper the
chapters use; ``results_report`` (``python -m nanobench.results_report``) builds the README's
"Results" table and plot from the results files.

The engines the benchmark races against each live in a virtualenv of their own and answer
from a subprocess: vLLM (``vllm_peer`` drives ``vllm_runner``, ``bench --vs-vllm``) and
llama.cpp (``llamacpp_peer`` drives ``llamacpp_runner``, ``bench --vs-llamacpp``), both
through ``peer_process`` (the driver's side of their JSON-lines protocol) and
``runner_protocol`` (the runner's side); ``gguf_export`` writes the engine's own weights as
GGUF files, so that llama.cpp computes with the same numbers.

The names below are the surface the chapters and ``widgets/`` use; they load on first use
(PEP 562), so ``from nanobench import prepare_environment`` imports neither torch nor the
benchmark, and ``prepare_environment()`` can still choose OpenMP's wait policy before torch
loads. Everything else is reached through its module (``nanobench.benchmark`` ...).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_PUBLIC = {
    # timing: torch-free to import (torch and plotly load inside the functions that need them)
    "prepare_environment": "nanobench.timing",
    "machine_description": "nanobench.timing",
    "measure": "nanobench.timing",
    "Timing": "nanobench.timing",
    "measure_gemm_peak": "nanobench.timing",
    "measure_memory_bandwidth": "nanobench.timing",
    "model_gemm_shapes": "nanobench.timing",
    "Roofline": "nanobench.timing",
    "RooflinePoint": "nanobench.timing",
    "roofline": "nanobench.timing",
    "plot_roofline": "nanobench.timing",
    # the benchmark's workload (imports torch): chapter 11 and its exercise checks
    "make_workload": "nanobench.benchmark",
    "make_output_lens": "nanobench.benchmark",
    "static_computed_tokens": "nanobench.benchmark",
}

if TYPE_CHECKING:
    from nanobench.benchmark import make_output_lens, make_workload, static_computed_tokens
    from nanobench.timing import (Roofline, RooflinePoint, Timing, machine_description, measure, measure_gemm_peak,
                                  measure_memory_bandwidth, model_gemm_shapes, plot_roofline, prepare_environment,
                                  roofline)

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'nanobench' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
