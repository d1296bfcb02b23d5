"""The model's shape, read from a Hugging Face ``config.json`` (chapters 1 and 3).

Only what the engine needs: sizes, head counts, RoPE and norm settings, special tokens.
``kv_bytes_per_token`` is the number chapter 3 checks against the allocated KV tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# Each supported architecture and its ``model_type`` in a Hugging Face config.json.
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"supported: {SUPPORTED_ARCHITECTURES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")

    @property
    def uses_qk_norm(self) -> bool:
        """Qwen3 normalises each query and key head before RoPE."""
        return self.architecture == "Qwen3ForCausalLM"

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V, every layer, every KV head: the memory one token costs in the cache."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def num_parameters(self) -> int:
        """Weights of the model (embedding counted once when tied to the LM head)."""
        h, heads, kv, d = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attention = h * heads * d * 2 + h * kv * d * 2  # q, o and k, v projections
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        norms = 2 * h + (2 * d if self.uses_qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * (attention + mlp + norms) + embed + h

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        archs = (d.get("architectures") or [arch for arch, kind in MODEL_TYPES.items() if kind == d.get("model_type")]
                 or ["(none)"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        heads = d["num_attention_heads"]
        return cls(
            architecture=archs[0], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads, vocab_size=d["vocab_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=d.get("rope_scaling"), max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids)

    def to_dict(self) -> dict:
        """A Hugging Face ``config.json`` for this shape (the inverse of ``from_dict``)."""
        eos = list(self.eos_token_ids)
        return {
            "architectures": [self.architecture], "model_type": MODEL_TYPES[self.architecture],
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "hidden_act": "silu"}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a model directory needs a Hugging Face config.json")
        return cls.from_dict(json.loads(path.read_text()))
