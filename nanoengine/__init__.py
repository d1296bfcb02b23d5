"""nanoengine: a small, real, readable paged-KV LLM inference engine.

The public API mirrors vLLM's: ``LLM``, ``SamplingParams``, ``RequestOutput``, and
``LLMEngine`` for step-by-step control. See docs/ARCHITECTURE.md for the map.
"""

from typing import TYPE_CHECKING

# The public names load on first use (PEP 562), so importing a torch-free module of the
# package, such as ``nanobench.timing`` whose ``prepare_environment()`` must run
# before torch loads OpenMP, does not import torch. ``from nanoengine import LLM`` works
# as before.
_PUBLIC = {
    "EngineConfig": "nanoengine.config",
    "LLMEngine": "nanoengine.engine.llm_engine",
    "EngineSnapshot": "nanoengine.engine.snapshots",
    "MemoryReport": "nanoengine.engine.snapshots",
    "RequestSnapshot": "nanoengine.engine.snapshots",
    "LLM": "nanoengine.llm",
    "CompletionOutput": "nanoengine.outputs",
    "RequestMetrics": "nanoengine.outputs",
    "RequestOutput": "nanoengine.outputs",
    "SamplingParams": "nanoengine.sampling_params",
    "RequestOutputKind": "nanoengine.sampling_params",
    # The default-model helpers load lazily too, so `python -m nanoengine.default_model`
    # does not import its own module twice.
    "default_model_dir": "nanoengine.default_model",
    "DEFAULT_MODEL_NAME": "nanoengine.default_model",
}

if TYPE_CHECKING:
    from nanoengine.config import EngineConfig
    from nanoengine.engine.llm_engine import LLMEngine
    from nanoengine.engine.snapshots import EngineSnapshot, MemoryReport, RequestSnapshot
    from nanoengine.llm import LLM
    from nanoengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from nanoengine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "RequestMetrics",
           "EngineConfig", "EngineSnapshot", "RequestSnapshot", "MemoryReport", "default_model_dir",
           "DEFAULT_MODEL_NAME"]
__version__ = "0.2.0"


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'nanoengine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
