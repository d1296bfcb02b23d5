"""``LLM.get_metrics()``: the engine's counters as records, read in-process (chapters 12 and 13).

vLLM's ``LLM.get_metrics()`` returns its Prometheus metrics as plain objects
(``vllm/v1/metrics/reader.py``: ``Counter``, ``Gauge``, ``Vector``), so a script can read
them without scraping a server. These are the same three kinds, under the names the
server's ``/metrics`` page uses (``entrypoints/openai/metrics.py``), with that page's
prefix: a ``Counter`` only goes up, a ``Gauge`` is a value now, a ``Vector`` is a
counter per position (speculative decoding's acceptances by draft position).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "nanoengine:"


@dataclass(frozen=True)
class Counter:
    name: str
    value: int


@dataclass(frozen=True)
class Gauge:
    name: str
    value: float


@dataclass(frozen=True)
class Vector:
    name: str
    values: tuple[int, ...]


Metric = Counter | Gauge | Vector


def engine_metrics(engine) -> list[Metric]:
    """The engine's metrics now: queues, KV blocks, prefix cache, preemptions, speculation."""
    scheduler, blocks = engine.scheduler, engine.block_manager
    used = blocks.num_used_blocks
    metrics: list[Metric] = [
        Gauge(PREFIX + "num_requests_running", len(scheduler.running)),
        Gauge(PREFIX + "num_requests_waiting", len(scheduler.waiting)),
        Gauge(PREFIX + "kv_cache_usage_perc", used / blocks.num_blocks),
        Counter(PREFIX + "prefix_cache_queries", scheduler.prefix_queries),
        Counter(PREFIX + "prefix_cache_hits", scheduler.prefix_hits),
        Counter(PREFIX + "num_preemptions", scheduler.num_preemptions),
    ]
    spec = engine.spec_decode_stats
    if spec.num_spec_tokens:
        metrics += [Counter(PREFIX + "spec_decode_num_drafts", spec.num_drafts),
                    Counter(PREFIX + "spec_decode_num_draft_tokens", spec.num_draft_tokens),
                    Counter(PREFIX + "spec_decode_num_accepted_tokens", spec.num_accepted_tokens),
                    Vector(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                           tuple(spec.num_accepted_tokens_per_pos))]
    return metrics
