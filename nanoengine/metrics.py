"""The engine's counters, read in one place (chapters 12 and 13).

``EngineStats.of(engine)`` reads them: queues, KV blocks, prefix cache, preemptions, speculative
decoding. ``LLM.get_metrics()`` (``engine_metrics``) returns them in-process as the three kinds of
records of vLLM's ``LLM.get_metrics()`` (``vllm/v1/metrics/reader.py``), under the ``/metrics`` page's
names: a ``Counter`` only goes up, a ``Gauge`` is a value now, a ``Vector`` is a counter per position
(speculative decoding's acceptances by draft position). The server's ``/metrics`` page
(``entrypoints/openai/metrics.py``) renders the latest ``EngineStats`` the engine thread published.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanoengine.engine.llm_engine import LLMEngine

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


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters at one moment, read between two steps by the thread that steps the engine:
    the numbers agree with one another, and readers on other threads only see a complete, frozen record."""

    num_running: int  # sequences (completions) in the running queue
    num_waiting: int  # sequences waiting for admission (new or preempted)
    num_kv_blocks: int
    num_free_kv_blocks: int  # including free blocks that still hold a cached prefix
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache since start
    prefix_cache_hits: int  # of which found
    num_preemptions: int
    num_steps: int
    spec_decode: dict | None = None  # ``SpecDecodeStats.as_dict()`` when the engine speculates

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineStats:
        """The counters ``snapshot()`` reports, without copying every block (cheap per step)."""
        scheduler, blocks = engine.scheduler, engine.block_manager
        return cls(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                   num_kv_blocks=engine.runner.num_blocks, num_free_kv_blocks=blocks.num_free_blocks,
                   prefix_cache_queries=scheduler.prefix_queries, prefix_cache_hits=scheduler.prefix_hits,
                   num_preemptions=scheduler.num_preemptions, num_steps=engine.step_count,
                   spec_decode=engine.spec_decode_stats.as_dict() if engine.proposer is not None else None)

    @property
    def num_used_kv_blocks(self) -> int:
        return self.num_kv_blocks - self.num_free_kv_blocks


def engine_metrics(engine: LLMEngine) -> list[Metric]:
    """The engine's metrics now, as records: queues, KV blocks, prefix cache, preemptions, speculation."""
    stats = EngineStats.of(engine)
    metrics: list[Metric] = [
        Gauge(PREFIX + "num_requests_running", stats.num_running),
        Gauge(PREFIX + "num_requests_waiting", stats.num_waiting),
        Gauge(PREFIX + "kv_cache_usage_perc", stats.num_used_kv_blocks / stats.num_kv_blocks),
        Counter(PREFIX + "prefix_cache_queries", stats.prefix_cache_queries),
        Counter(PREFIX + "prefix_cache_hits", stats.prefix_cache_hits),
        Counter(PREFIX + "num_preemptions", stats.num_preemptions),
    ]
    spec = stats.spec_decode
    if spec is not None:
        metrics += [Counter(PREFIX + "spec_decode_num_drafts", spec["num_drafts"]),
                    Counter(PREFIX + "spec_decode_num_draft_tokens", spec["num_draft_tokens"]),
                    Counter(PREFIX + "spec_decode_num_accepted_tokens", spec["num_accepted_tokens"]),
                    Vector(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                           tuple(spec["num_accepted_tokens_per_pos"]))]
    return metrics
