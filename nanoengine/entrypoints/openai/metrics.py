"""``GET /metrics``: the server's numbers in Prometheus' text format (chapter 12).

Each family has ``# HELP`` (what it means) and ``# TYPE`` (``counter``: only goes up; ``gauge``:
a value now; ``histogram``: counts of observations at or below each bucket bound ``le``, plus
their ``_sum`` and ``_count``, from which a dashboard estimates percentiles)::

    # HELP nanoengine:num_requests_running Sequences in the running queue.
    # TYPE nanoengine:num_requests_running gauge
    nanoengine:num_requests_running{model_name="SmolLM2-135M-Instruct"} 3

The names are vLLM's (``vllm:kv_cache_usage_perc``...) with this engine's prefix, so a vLLM
dashboard needs only the prefix changed. Written by hand: the format is a few lines of text, and
a client library would hide exactly what this module is here to show. Gauges come from the
``EngineStats`` of the latest step; latencies from each request's final ``RequestOutput`` (TTFT
from its arrival, queueing included). A request with ``n > 1`` completions has one interleaved
token record, so it adds its TTFT but no inter-token gaps.
"""

from __future__ import annotations

import bisect
import threading

from nanoengine.engine.request import RequestStatus
from nanoengine.metrics import PREFIX, EngineStats
from nanoengine.outputs import RequestOutput

# vLLM's bucket bounds (seconds): fine below a second, coarse up to minutes.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = tuple(status.finish_reason for status in RequestStatus if status.finished)  # stop, length, abort, error


def _labels(labels: dict[str, str]) -> str:
    """``{k="v",...}`` with backslashes, quotes and newlines escaped as the format requires."""
    if not labels:
        return ""
    escape = {ord("\\"): "\\\\", ord('"'): '\\"', ord("\n"): "\\n"}
    return "{" + ",".join(f'{k}="{v.translate(escape)}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def family(name: str, kind: str, help_text: str, samples: list[tuple[str, dict[str, str], float]]) -> list[str]:
    """One metric family: its HELP and TYPE lines, then ``name{labels} value`` per sample
    (``samples``: (suffix such as "_bucket" or "", labels, value)). A counter's name ends in
    ``_total``, in its HELP and TYPE lines too (the 0.0.4 text format names the samples)."""
    lines = [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]
    lines += [f"{PREFIX}{name}{suffix}{_labels(labels)} {_number(value)}" for suffix, labels, value in samples]
    return lines


class Histogram:
    """Counts of observations per bucket (cumulative when rendered), their sum and count."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def samples(self, labels: dict[str, str]) -> list[tuple[str, dict[str, str], float]]:
        out, running = [], 0
        for bound, count in zip(self.bounds + (float("inf"),), self.counts):
            running += count
            out.append(("_bucket", {**labels, "le": "+Inf" if bound == float("inf") else repr(bound)}, running))
        return out + [("_sum", labels, self.sum), ("_count", labels, running)]


class ServerMetrics:
    """Counters and histograms of one server. ``observe_finished`` runs on the engine
    thread and ``render`` on the event loop, so a lock keeps a scrape consistent."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.rejected = 0  # 429: the waiting queue was full

    def observe_finished(self, out: RequestOutput) -> None:
        """Record one request's final output (every completion has finished or was aborted)."""
        m = out.metrics
        with self._lock:
            for completion in out.outputs:
                reason = completion.finish_reason or "abort"
                self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += len(out.prompt_token_ids)
            self.generation_tokens += m.num_output_tokens
            if m.ttft is not None:
                self.ttft.observe(m.ttft)
            if len(out.outputs) == 1:
                for gap in m.inter_token_latencies:
                    self.itl.observe(gap)
            if m.e2e_latency is not None:
                self.e2e.observe(m.e2e_latency)

    def observe_rejected(self) -> None:
        with self._lock:
            self.rejected += 1

    def render(self, stats: EngineStats) -> str:
        """The whole page (Prometheus text format 0.0.4)."""
        labels = self.labels
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits

        def one(name: str, kind: str, help_text: str, value: float) -> list[str]:  # a family of one sample
            return family(name, kind, help_text, [("", labels, value)])

        with self._lock:
            lines = [
                *one("num_requests_running", "gauge", "Sequences in the running queue.", stats.num_running),
                *one("num_requests_waiting", "gauge", "Sequences waiting to be admitted (new or preempted).",
                     stats.num_waiting),
                *one("kv_cache_blocks_used", "gauge", "KV-cache blocks held by requests.", stats.num_used_kv_blocks),
                *one("kv_cache_blocks", "gauge", "KV-cache blocks in the pool.", stats.num_kv_blocks),
                *one("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (1 = full).",
                     stats.num_used_kv_blocks / max(stats.num_kv_blocks, 1)),
                *one("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", queries),
                *one("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", hits),
                *one("prefix_cache_hit_rate", "gauge", "Prefix-cache hits / queries since start (0 before any).",
                     hits / queries if queries else 0.0),
                *one("num_preemptions_total", "counter", "Requests preempted (blocks freed, recomputed later).",
                     stats.num_preemptions),
                *one("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens),
                *one("generation_tokens_total", "counter", "Tokens generated by finished requests.",
                     self.generation_tokens),
                *family("request_success_total", "counter", "Completions finished, by reason.",
                        [("", {**labels, "finished_reason": r}, n) for r, n in self.finished.items()]),
                *one("request_rejected_total", "counter", "Requests refused with 429: the waiting queue was full.",
                     self.rejected),
                *family("time_to_first_token_seconds", "histogram", "Arrival to first token (queueing included).",
                        self.ttft.samples(labels)),
                *family("inter_token_latency_seconds", "histogram", "Gaps between consecutive tokens of a request.",
                        self.itl.samples(labels)),
                *family("e2e_request_latency_seconds", "histogram", "Arrival to the last token.",
                        self.e2e.samples(labels)),
            ]
        spec = stats.spec_decode
        if spec is not None:  # vLLM's names: vllm:spec_decode_num_drafts and the rest
            lines += [
                *one("spec_decode_num_drafts_total", "counter", "Verify passes of a request with drafts.",
                     spec["num_drafts"]),
                *one("spec_decode_num_draft_tokens_total", "counter", "Drafted tokens checked.",
                     spec["num_draft_tokens"]),
                *one("spec_decode_num_accepted_tokens_total", "counter", "Drafted tokens accepted.",
                     spec["num_accepted_tokens"]),
                *family("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                        "Drafted tokens accepted, by position in the draft.",
                        [("", {**labels, "position": str(i)}, n)
                         for i, n in enumerate(spec["num_accepted_tokens_per_pos"])]),
            ]
        return "\n".join(lines) + "\n"
