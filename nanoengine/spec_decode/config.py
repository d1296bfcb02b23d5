"""``SpeculativeConfig``: how a request's tokens are proposed and how many (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram",)
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default when neither lookup length is given (its source calls it untuned)


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "ngram" (prompt lookup; the only one: it needs no draft model).
    num_speculative_tokens: k, the most tokens proposed per step (>= 1).
    prompt_lookup_max / prompt_lookup_min: the longest and shortest suffix n-gram looked up (1 <= min <= max).
    Give one and the other takes its value; give neither and both are 5.
    num_speculative_tokens_per_batch_size: optional, vLLM 0.32's dynamic speculative decoding:
    ``[(first, last, k), ...]``, inclusive ranges of batch sizes (requests scheduled in a step) and the k to
    draft for the next step at those sizes (0: none; never more than ``num_speculative_tokens``). The first
    range starts at 1; ranges are sorted and do not overlap; a size between two ranges or past the last takes
    the k of the range before it. Extra verify rows are nearly free at batch 1 and real work at larger batches
    (chapter 13 measures both), so a schedule can speculate only where it pays.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is not supported; allowed: {METHODS}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        for name, value in (("num_speculative_tokens", self.num_speculative_tokens), ("prompt_lookup_min", low),
                            ("prompt_lookup_max", high)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        if self.num_speculative_tokens_per_batch_size is not None:
            object.__setattr__(self, "num_speculative_tokens_per_batch_size",
                               _checked_schedule(self.num_speculative_tokens_per_batch_size))

    def tokens_for_batch(self, batch_size: int) -> int:
        """k for a step that scheduled ``batch_size`` requests: the schedule's, else ``num_speculative_tokens``."""
        schedule = self.num_speculative_tokens_per_batch_size
        if not schedule:
            return self.num_speculative_tokens
        k = schedule[0][2]
        for first, _, range_k in schedule:  # the last range starting at or below the size
            if first > batch_size:
                break
            k = range_k
        return min(k, self.num_speculative_tokens)


def _checked_schedule(schedule) -> tuple[tuple[int, int, int], ...]:
    """``num_speculative_tokens_per_batch_size`` as a sorted tuple of (first, last, k), checked as vLLM does."""
    name = "speculative_config num_speculative_tokens_per_batch_size"
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError(f"{name} must be a non-empty list of [first, last, k] entries, got {schedule!r}")
    entries = []
    for entry in schedule:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3 \
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry):
            raise ValueError(f"{name}: each entry must be three integers [first, last, k], got {entry!r}")
        first, last, k = entry
        if first < 1 or last < first or k < 0:
            raise ValueError(f"{name}: entry {list(entry)} needs 1 <= first <= last and k >= 0")
        entries.append((first, last, k))
    entries.sort()
    if entries[0][0] != 1:
        raise ValueError(f"{name}: the first range must start at batch size 1, got {list(entries[0])}")
    for before, after in zip(entries, entries[1:]):
        if after[0] <= before[1]:
            raise ValueError(f"{name}: ranges {list(before)} and {list(after)} overlap")
    return tuple(entries)
