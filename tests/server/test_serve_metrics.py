"""GET /metrics text (nanoengine.entrypoints.openai.metrics): a valid Prometheus 0.0.4 page whose
numbers are the engine's counters and the finished requests' latencies."""

from __future__ import annotations

import re

import pytest

from nanoengine import SamplingParams
from nanoengine.entrypoints.openai.metrics import TTFT_BUCKETS, Histogram, ServerMetrics
from nanoengine.metrics import Counter, EngineStats, Gauge, Vector
from nanoengine.outputs import CompletionOutput, RequestMetrics, RequestOutput

STATS = EngineStats(num_running=3, num_waiting=2, num_kv_blocks=100, num_free_kv_blocks=75, prefix_cache_queries=40,
                    prefix_cache_hits=10, num_preemptions=1, num_steps=9)
SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$')


def parse(text: str) -> tuple[dict[str, tuple[str, str]], list[tuple[str, dict, float]]]:
    """{family: (type, help)} and every sample, checking the format line by line."""
    families, samples, current = {}, [], None
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, help_text = line[7:].split(" ", 1)
            families[name] = ("", help_text)
            current = name
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert name == current and kind in ("counter", "gauge", "histogram"), line
            families[name] = (kind, families[name][1])
        else:
            match = SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name = match["name"]
            histogram = families[current][0] == "histogram"
            assert name == current or histogram and re.sub(r"_(bucket|sum|count)$", "", name) == current, \
                f"{name} outside its family {current}"
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match["labels"] or ""))
            samples.append((name, labels, float(match["value"])))
    return families, samples


def value(samples, name, **labels) -> float:
    found = [v for n, l, v in samples if n == name and all(l.get(k) == w for k, w in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def finished(ttft: float, gaps: list[float], reasons=("length",)) -> RequestOutput:
    times = [10.0 + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    metrics = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.0, first_token_time=times[0],
                             finished_time=times[-1], num_output_tokens=len(times) * len(reasons),
                             token_times=tuple(times))
    outputs = tuple(CompletionOutput(i, "x", tuple(range(len(times))), r) for i, r in enumerate(reasons))
    return RequestOutput("r", None, (1, 2, 3, 4), outputs, True, 0, metrics)


def test_the_page_is_valid_prometheus_text_with_the_engines_numbers():
    metrics = ServerMetrics('tiny "model"')
    metrics.observe_finished(finished(0.05, [0.02, 0.03]))
    metrics.observe_finished(finished(3.0, [0.5], reasons=("stop", "abort")))  # n=2: TTFT only
    metrics.observe_rejected()
    families, samples = parse(metrics.render(STATS))
    assert all(kind for kind, _ in families.values()), families
    assert {n for n, (k, _) in families.items() if k == "counter"} == {n for n in families if n.endswith("_total")}
    labels = {"model_name": 'tiny \\"model\\"'}
    assert value(samples, "nanoengine:num_requests_running", **labels) == 3
    assert value(samples, "nanoengine:num_requests_waiting") == 2
    assert value(samples, "nanoengine:kv_cache_blocks_used") == 25 and value(samples, "nanoengine:kv_cache_blocks") == 100
    assert value(samples, "nanoengine:kv_cache_usage_perc") == pytest.approx(0.25)
    assert value(samples, "nanoengine:prefix_cache_hit_rate") == pytest.approx(0.25)
    assert value(samples, "nanoengine:prefix_cache_queries_total") == 40
    assert value(samples, "nanoengine:request_success_total", finished_reason="length") == 1
    assert value(samples, "nanoengine:request_success_total", finished_reason="abort") == 1
    assert value(samples, "nanoengine:request_rejected_total") == 1
    assert value(samples, "nanoengine:prompt_tokens_total") == 8
    assert value(samples, "nanoengine:time_to_first_token_seconds_count") == 2
    assert value(samples, "nanoengine:time_to_first_token_seconds_sum") == pytest.approx(3.05)
    assert value(samples, "nanoengine:time_to_first_token_seconds_bucket", le="0.06") == 1
    assert value(samples, "nanoengine:time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert value(samples, "nanoengine:inter_token_latency_seconds_count") == 2  # the n=2 request adds none
    assert value(samples, "nanoengine:inter_token_latency_seconds_bucket", le="0.025") == 1


def test_histogram_buckets_are_cumulative_and_inclusive():
    h = Histogram(TTFT_BUCKETS)
    for v in (0.001, 0.0011, 0.5, 0.5, 9999.0):
        h.observe(v)
    samples = h.samples({})
    buckets = [(labels["le"], v) for suffix, labels, v in samples if suffix == "_bucket"]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and buckets[-1] == ("+Inf", 5) and h.count == 5
    assert dict(buckets)["0.001"] == 1 and dict(buckets)["0.5"] == 4 and dict(buckets)["2560.0"] == 4
    assert ("_sum", {}, pytest.approx(10000.0021)) in [(s, l, v) for s, l, v in samples if s == "_sum"]


def test_an_empty_server_renders_zeros():
    _, samples = parse(ServerMetrics("m").render(EngineStats(0, 0, 8, 8, 0, 0, 0, 0)))
    assert value(samples, "nanoengine:prefix_cache_hit_rate") == 0.0
    assert value(samples, "nanoengine:time_to_first_token_seconds_count") == 0


def test_speculative_decoding_counters_appear_under_vllms_names_when_the_engine_speculates():
    spec = {"num_spec_tokens": 3, "num_drafts": 10, "num_draft_tokens": 27, "num_accepted_tokens": 14,
            "num_accepted_tokens_per_pos": [8, 4, 2]}
    families, samples = parse(ServerMetrics("m").render(EngineStats(0, 0, 8, 8, 0, 0, 0, 0, spec_decode=spec)))
    assert families["nanoengine:spec_decode_num_drafts_total"][0] == "counter"
    assert value(samples, "nanoengine:spec_decode_num_drafts_total") == 10
    assert value(samples, "nanoengine:spec_decode_num_draft_tokens_total") == 27
    assert value(samples, "nanoengine:spec_decode_num_accepted_tokens_total") == 14
    assert [value(samples, "nanoengine:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(3)] == [8, 4, 2]
    families, _ = parse(ServerMetrics("m").render(STATS))  # an engine without speculation has none
    assert not any("spec_decode" in name for name in families)


def test_get_metrics_and_the_metrics_page_read_the_same_counters(build_tiny_llm):
    """``LLM.get_metrics()`` and ``/metrics`` are both built on ``EngineStats``: mid-run, with
    preemptions, prefix hits and drafts, every record has its sample on the page, same value."""
    llm = build_tiny_llm({"num_kv_blocks": 20, "block_size": 4, "max_model_len": 64, "speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}})
    engine = llm.engine
    for i in range(6):  # 20 blocks of 4 tokens: too few for all six, so some are preempted
        phrase = [100 + 7 * i + j for j in range(5)]
        engine.add_request([7, 8, 9, 10, 11, 12, 13, 14] + phrase * 4,
                           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))

    def every_counter_moved(stats: EngineStats) -> bool:
        return bool(stats.num_running and stats.num_preemptions and stats.prefix_cache_hits
                    and stats.spec_decode["num_accepted_tokens"])

    while not every_counter_moved(EngineStats.of(engine)):
        assert engine.has_unfinished_requests(), "the run ended before every counter moved"
        engine.step()
    records = llm.get_metrics()
    _, samples = parse(ServerMetrics("m").render(EngineStats.of(engine)))
    for record in records:
        if isinstance(record, Gauge):
            assert value(samples, record.name) == record.value, record  # repr(float) round-trips
        elif isinstance(record, Counter):
            assert value(samples, record.name + "_total") == record.value, record
        else:
            assert isinstance(record, Vector)
            assert [value(samples, record.name + "_total", position=str(i))
                    for i in range(len(record.values))] == list(record.values)
    assert len(records) == 10  # six for every engine, four for speculative decoding
