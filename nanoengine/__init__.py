"""nanoengine: a small, real, readable paged-KV LLM inference engine.

The public API mirrors vLLM's: ``LLM``, ``SamplingParams``, ``RequestOutput``, and
``LLMEngine`` for step-by-step control. See docs/ARCHITECTURE.md for the map.
"""

from nanoengine.config import EngineConfig
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.engine.snapshots import EngineSnapshot, MemoryReport, RequestSnapshot
from nanoengine.llm import LLM
from nanoengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanoengine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics",
           "EngineConfig", "EngineSnapshot", "RequestSnapshot", "MemoryReport", "default_model_dir",
           "DEFAULT_MODEL_NAME"]
__version__ = "0.2.0"


def __getattr__(name: str):
    # The default-model helpers load lazily, so `python -m nanoengine.default_model` does
    # not import its own module twice.
    if name in ("default_model_dir", "DEFAULT_MODEL_NAME"):
        from nanoengine import default_model

        return getattr(default_model, name)
    raise AttributeError(f"module 'nanoengine' has no attribute {name!r}")
