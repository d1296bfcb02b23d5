"""``StructuredOutputsConfig``: which grammar library the engine uses (vLLM's names, chapter 14)."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("guidance",)  # llguidance (``structured_output/guidance.py``); "auto" picks it too


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """backend: "guidance" (llguidance) or "auto" (the same: the one library the engine ships).
    disable_any_whitespace: JSON without optional whitespace (``{"a":1}``); by default any
    whitespace JSON allows may appear between tokens, as in vLLM. A small model may then
    loop on newlines; this closes that door.
    """

    backend: str = "auto"
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.backend not in ("auto", *BACKENDS):
            raise ValueError(f"structured_outputs_config backend={self.backend!r} is not available; "
                             f"allowed: {('auto', *BACKENDS)}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs_config disable_any_whitespace must be True or False, "
                             f"got {self.disable_any_whitespace!r}")
