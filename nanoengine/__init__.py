"""nanoengine: a small, real, readable paged-KV LLM inference engine.

The public API mirrors vLLM's: ``LLM``, ``SamplingParams``, ``RequestOutput``, and
``LLMEngine`` for step-by-step control. See docs/ARCHITECTURE.md for the map.
"""

import importlib
from typing import TYPE_CHECKING

# The public names load on first use (PEP 562): importing the package does not import torch, which
# ``nanobench.timing`` relies on (its ``prepare_environment()`` must run before torch loads OpenMP).
_MODULES = {
    "nanoengine.config": ("EngineConfig",),
    "nanoengine.engine.llm_engine": ("LLMEngine",),
    "nanoengine.engine.snapshots": ("EngineSnapshot", "MemoryReport", "RequestSnapshot"),
    "nanoengine.llm": ("LLM",),
    "nanoengine.outputs": ("CompletionOutput", "RequestMetrics", "RequestOutput"),
    "nanoengine.sampling_params": ("SamplingParams", "RequestOutputKind"),
    # Lazily too, so `python -m nanoengine.default_model` does not import its own module twice.
    "nanoengine.default_model": ("default_model_dir", "DEFAULT_MODEL_NAME"),
}
_PUBLIC = {name: module for module, names in _MODULES.items() for name in names}

if TYPE_CHECKING:
    from nanoengine.config import EngineConfig
    from nanoengine.engine.llm_engine import LLMEngine
    from nanoengine.engine.snapshots import EngineSnapshot, MemoryReport, RequestSnapshot
    from nanoengine.llm import LLM
    from nanoengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from nanoengine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "RequestMetrics", "EngineConfig", "EngineSnapshot", "RequestSnapshot", "MemoryReport", "default_model_dir",
           "DEFAULT_MODEL_NAME"]
__version__ = "0.2.0"


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'nanoengine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
