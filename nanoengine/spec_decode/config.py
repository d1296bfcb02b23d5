"""``SpeculativeConfig``: how a request's tokens are proposed and how many (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
# vLLM's defaults when neither lookup length is given (its source calls them untuned).
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "ngram" (prompt lookup; the only one: it needs no draft model).
    num_speculative_tokens: k, the most tokens proposed per step (>= 1).
    prompt_lookup_max / prompt_lookup_min: the longest and shortest suffix n-gram looked up
    (1 <= min <= max). Give one and the other takes its value; give neither and both are 5.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is not supported; allowed: {METHODS}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer >= 1, got {k!r}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | "SpeculativeConfig") -> "SpeculativeConfig":
        """From ``LLM(speculative_config={...})`` or ``--speculative-config JSON``; unknown keys are refused."""
        if isinstance(values, SpeculativeConfig):
            return values
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(values).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; allowed: {sorted(known)}")
        return cls(**values)
