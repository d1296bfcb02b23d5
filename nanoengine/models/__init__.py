"""Model architectures the engine can run, looked up by the checkpoint's architecture name."""

from nanoengine.models.config import ModelConfig
from nanoengine.models.llama import LlamaForCausalLM
from nanoengine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM}

__all__ = ["ModelConfig", "LlamaForCausalLM", "Qwen3ForCausalLM", "MODEL_CLASSES"]
