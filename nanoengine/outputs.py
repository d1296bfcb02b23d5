"""What the engine hands back: frozen, typed results (chapters 2 and 11).

``RequestOutput`` mirrors vLLM's, so vLLM's quickstart (``output.outputs[0].text``) runs
unchanged: one ``CompletionOutput`` per completion (``SamplingParams(n=...)``), and shortcuts
(``text``, ``token_ids``, ``finish_reason`` ...) to ``outputs[0]``. The latencies chapters 6
and 11 measure (TTFT, TPOT, inter-token) come from ``RequestMetrics``, the engine's own stamps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestMetrics:
    """Wall-clock timestamps (``time.perf_counter`` seconds) of one request.

    With ``n > 1`` they cover all completions: the first token is the earliest of any,
    the finish the last, and ``token_times`` holds every completion's tokens in time order.
    """

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_output_tokens: int
    token_times: tuple[float, ...] = ()  # when each output token was sampled

    @property
    def inter_token_latencies(self) -> tuple[float, ...]:
        """Gaps between consecutive output tokens (seconds); what a streaming reader feels."""
        return tuple(b - a for a, b in zip(self.token_times, self.token_times[1:]))

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

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
class CompletionOutput:
    """One completion of a request (vLLM's name and fields): all of it so far, or only what is new
    for a ``RequestOutputKind.DELTA`` request (then ``text == delta``)."""

    index: int  # 0 .. n-1
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "length", "stop", "abort" or "error"; None while running
    stop_reason: str | int | None = None  # the stop string or token id that matched
    logprobs: tuple[tuple[TokenLogprob, ...], ...] | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (with logprobs on)
    delta: str = ""  # text added since the previous output of this request
    error: str | None = None  # finish_reason "error": what went wrong (the exception, as text)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """The state of one request as returned by ``LLM.generate`` or ``LLMEngine.step``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool  # every completion has finished
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: RequestMetrics

    # Shortcuts to the first completion, the only one unless SamplingParams.n > 1.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> tuple[tuple[TokenLogprob, ...], ...] | None:
        return self.outputs[0].logprobs

    @property
    def delta(self) -> str:
        return self.outputs[0].delta
