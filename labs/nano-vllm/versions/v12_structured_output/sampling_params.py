"""v12 - ``SamplingParams``: how each request wants its next token chosen, and what it must look like (cards 12, 17).

Until v07 the toy model *was* the decision: it returned a token id. Real models return
a score (logit) for every vocabulary entry, and each request decides how to turn scores
into a token. That choice belongs to the request, not the engine, so it travels with the
request as a small frozen dataclass, validated once when it is made:

- ``temperature``: divide the logits by it before the softmax. Below 1 sharpens the
  distribution, above 1 flattens it; ``0`` means greedy (always the top logit).
- ``top_k``: keep only the ``k`` highest logits (``-1`` keeps all). ``top_k=1`` is greedy.
- ``seed``: if set, the request draws from its *own* random generator seeded with it, so
  the same request gives the same tokens whatever else shares its batch.
- ``max_tokens`` / ``ignore_eos``: the stopping rule, moved here from ``add_request``.

Compared with nano-vLLM's ``sampling_params.py`` (temperature, max_tokens, ignore_eos;
temperature must be > 0 there): greedy, ``top_k`` and ``seed`` are additions, taken
from vLLM.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    choice: tuple[str, ...] | None = None
    regex: str | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be None or a non-negative int, got {self.seed}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))  # a list is accepted, stored frozen
        if self.choice is not None and self.regex is not None:
            raise ValueError("give at most one constraint: choice or regex, not both")
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise ValueError(f"choice must list at least one non-empty string, got {self.choice!r}")
        if self.is_constrained and self.ignore_eos:
            raise ValueError("a constrained request ends on EOS once its text matches; ignore_eos must be False")

    @property
    def is_constrained(self) -> bool:
        return self.choice is not None or self.regex is not None
