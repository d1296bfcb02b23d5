"""How speculation fared: the counters vLLM reports, kept by the engine (chapter 13), with vLLM's names
(``vllm/v1/spec_decode/metrics.py``; its Prometheus counters ``vllm:spec_decode_num_drafts`` and friends)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Running totals since the engine started; ``observe`` adds one verify pass of one request."""

    num_spec_tokens: int = 0  # k, the most drafts per step (0: the engine does not speculate)
    num_drafts: int = 0  # verify passes of a request that had drafts (one per request per step)
    num_draft_tokens: int = 0  # drafted tokens checked
    num_accepted_tokens: int = 0  # drafted tokens the model agreed with
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # of those, at draft position 0 .. k-1

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, draft_token_ids: Sequence[int], emitted: Sequence[int]) -> None:
        """One request checked ``draft_token_ids`` and emitted ``emitted`` (its accepted drafts, then one more)."""
        accepted = len(emitted) - 1
        if not 0 <= accepted <= len(draft_token_ids):
            raise ValueError(f"{len(emitted)} tokens emitted for {len(draft_token_ids)} drafts: "
                             f"expected between 1 and {len(draft_token_ids) + 1}")
        self.num_drafts += 1
        self.num_draft_tokens += len(draft_token_ids)
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None before any draft was checked."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verify pass, 1 + accepted / drafts (the token after the accepted run is emitted
        too): the speedup over plain decoding when a verify pass costs what a decode step does; None before any."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length}
