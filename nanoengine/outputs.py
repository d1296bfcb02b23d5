"""What the engine hands back: frozen, typed results (chapters 2 and 11).

``RequestOutput`` mirrors vLLM's: the prompt, the generated text and token ids, why it
finished, how many prompt tokens came from the prefix cache, and the request's timing
metrics. TTFT (time to first token) and TPOT (time per output token after the first)
are the two latencies chapter 6 and chapter 11 measure.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestMetrics:
    """Wall-clock timestamps (``time.perf_counter`` seconds) of one request."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_output_tokens: int

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None with fewer than two tokens)."""
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True)
class TokenLogprob:
    """One candidate token at one position, with its log-probability."""

    token_id: int
    logprob: float
    text: str


@dataclass(frozen=True)
class RequestOutput:
    """The state of one request as returned by ``LLM.generate`` or ``LLMEngine.step``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "length", "stop" or "abort"; None while running
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: RequestMetrics
    logprobs: tuple[tuple[TokenLogprob, ...], ...] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that matched
    delta: str = ""  # text added since the previous output of this request
