"""Chapter 11's exercise checks (widgets.exercises.ch11): placeholders and bad values are
"not yet", the worked answers pass and plausible wrong answers fail."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from nanobench.benchmark import static_computed_tokens
from widgets.exercises import ch11
from widgets.throughput_explorer import OnlineRun


def test_the_workload_is_seeded() -> None:
    prompts, lens = ch11.chapter_workload()
    assert (prompts, lens) == ch11.chapter_workload()
    assert len(prompts) == len(lens) == ch11.NUM_REQUESTS
    assert all(ch11.MIN_PROMPT <= len(p) <= ch11.MAX_PROMPT for p in prompts)
    assert all(ch11.MIN_OUTPUT <= n <= ch11.MAX_OUTPUT for n in lens)


# ------------------------------------------------------------------ 11.1
@pytest.mark.parametrize("value", [..., None, "79", 2.5, True, -1])
def test_static_tokens_placeholders_and_bad_values_are_not_yet(value) -> None:
    assert not ch11.check_static_tokens(value).right


def test_static_tokens_right_and_plausible_wrong_answers() -> None:
    _, lens = ch11.chapter_workload()
    b = ch11.STATIC_BATCH
    batches = [lens[i:i + b] for i in range(0, len(lens), b)]
    right = sum(len(batch) * max(batch) for batch in batches)
    assert right == static_computed_tokens(lens, b) and right > sum(lens)
    assert ch11.check_static_tokens(right).right
    wrong = {sum(lens),  # the requested tokens
             len(lens) * max(lens),  # one batch of everything
             sum(b * max(batch) for batch in batches),  # the last, short batch padded to full size
             b * max(lens) * len(batches)}  # every batch run to the longest request overall
    for value in wrong - {right}:
        result = ch11.check_static_tokens(value)
        assert not result.right and str(right) not in str(result), value


# ------------------------------------------------------------------ 11.2
@pytest.mark.parametrize("value", [..., None, "4", 2.5, True, -1, 10**6])
def test_max_num_seqs_placeholders_and_bad_values_are_not_yet(value) -> None:
    result = ch11.check_max_num_seqs(value)
    assert not result.right and str(result).startswith("Exercise 11.2: not yet. Hint: ")


def test_steps_fall_to_the_longest_request_once_every_request_has_a_slot() -> None:
    _, lens = ch11.chapter_workload()
    assert ch11.steps_to_serve(1) == sum(lens)  # one at a time: one step per token
    assert ch11.steps_to_serve(ch11.NUM_REQUESTS) == max(lens)  # all at once: the longest decides
    assert ch11.steps_to_serve(len(ch11.SLOT_LENS), ch11.SLOT_LENS) == max(ch11.SLOT_LENS)


@pytest.mark.slow
def test_exercise_11_2_accepts_exactly_the_smallest_size() -> None:
    sizes = range(1, len(ch11.SLOT_LENS) + 3)
    steps = {b: ch11.steps_to_serve(b, ch11.SLOT_LENS) for b in sizes}
    fewest = min(steps.values())
    smallest = min(b for b, s in steps.items() if s == fewest)
    assert smallest < len(ch11.SLOT_LENS)  # the answer is not "one slot per request"
    assert ch11.check_max_num_seqs(smallest).right
    # plausible wrong answers: one slot per request, one too few, one per long request
    for wrong in {len(ch11.SLOT_LENS), smallest - 1, sum(n == max(ch11.SLOT_LENS) for n in ch11.SLOT_LENS)}:
        assert not ch11.check_max_num_seqs(wrong).right, wrong


# ------------------------------------------------------------------ 11.3
RUN = OnlineRun(8.0, 2.0, 60, tuple((t, 0.09) for t in (0.212, 0.180, 0.305, 0.251, 0.199, 0.4417, 0.233, 0.276)))


@pytest.mark.parametrize("value", [..., None, "442", 0, -5, True, 441.5])
def test_ttft_slo_placeholders_and_bad_values_are_not_yet(value) -> None:
    assert not ch11.check_ttft_slo(RUN, value).right


def test_ttft_slo_right_and_plausible_wrong_answers() -> None:
    ttfts_ms = np.array([t for t, _ in RUN.latencies]) * 1e3
    right = ch11.needed_ms([t for t, _ in RUN.latencies])
    assert right == math.ceil(ttfts_ms.max()) == 442  # 90% of 8 requests is all 8
    assert ch11.check_ttft_slo(RUN, right).right and ch11.check_ttft_slo(RUN, float(right)).right
    wrong = [round(float(np.percentile(ttfts_ms, 99))), round(float(np.percentile(ttfts_ms, 90))),
             round(float(np.median(ttfts_ms))), right + 10]
    for value in wrong:
        result = ch11.check_ttft_slo(RUN, value)
        assert not result.right and str(right) not in str(result), value


def test_ttft_slo_with_more_requests_needs_the_kth_not_the_slowest() -> None:
    ttfts = [0.1 + 0.01 * i for i in range(20)]  # 90% of 20 is 18: the slowest two may miss
    run = OnlineRun(1.0, 1.0, 20, tuple((t, None) for t in ttfts))
    assert ch11.needed_ms(ttfts) == 270
    assert ch11.check_ttft_slo(run, 270).right
    assert not ch11.check_ttft_slo(run, 290).right and not ch11.check_ttft_slo(run, 269).right


# ------------------------------------------------------------------ the chapter's readings: both sides
def _row(size=None, tok_s=50.0, ttft=100.0, tpot=40.0, rate=None):
    row = {"output_tokens_per_s": tok_s, "ttft_ms": {"p50": ttft}, "tpot_ms": {"p50": tpot}}
    if size is not None:
        row["max_num_seqs"] = size
    if rate is not None:
        row["rate_requests_per_s"] = rate
    return row


def test_the_batch_sweep_reading_names_the_sweeps_own_sizes_and_follows_the_tpot() -> None:
    weights = ch11.read_batch_sweep([_row(2, 46.6, tpot=39), _row(4, 77.2, tpot=43), _row(8, 116.8, tpot=38)])
    assert "max_num_seqs 8 against 2 (4x" in weights and "max_num_seqs 1" not in weights
    assert "bound by reading the weights" in weights
    arithmetic = ch11.read_batch_sweep([_row(2, 46.6, tpot=39), _row(8, 50.0, tpot=39 * 3.5)])
    assert "arithmetic" in arithmetic and "reading the weights" not in arithmetic
    # the threshold: TPOT grown halfway to the batch ratio (4x -> 2.5x)
    assert "reading the weights" in ch11.read_batch_sweep([_row(2, tpot=10), _row(8, tpot=24.9)])
    assert "arithmetic" in ch11.read_batch_sweep([_row(2, tpot=10), _row(8, tpot=25.1)])
    assert "8 against 1" in ch11.read_batch_sweep([_row(1), _row(8)])


def test_the_first_call_reading() -> None:
    assert "cold cost of its own" in ch11.read_first_call(1.3, 1.0)
    assert "sat in the build" in ch11.read_first_call(1.1, 1.0)


def test_the_oversized_cache_reading() -> None:
    assert "longer" in ch11.read_oversized_cache(9.5, 1.8, 1.6, 1.9) and "fell within" in \
        ch11.read_oversized_cache(9.5, 1.8, 1.6, 1.9)
    assert "shorter" in ch11.read_oversized_cache(0.9, 3.0, 1.6, 1.9) and "outside" in \
        ch11.read_oversized_cache(0.9, 3.0, 1.6, 1.9)


def test_the_online_reading_says_which_way_ttft_moved() -> None:
    rows = [_row(rate=6.5, ttft=97, tpot=54, tok_s=45), _row(rate=52, ttft=165, tpot=53, tok_s=87.8)]
    text = ch11.read_online(rows, 109.3)
    assert "TTFT p50 97 -> 165 ms climbed" in text and "TPOT p50 54 -> 53 ms stayed within 25%" in text
    assert "80% of the offline figure" in text
    level = ch11.read_online([_row(rate=1, ttft=75), _row(rate=30, ttft=78)], 100)
    assert "TTFT p50 75 -> 78 ms stayed within 25%" in level
    assert "fell" in ch11.read_online([_row(rate=1, ttft=100), _row(rate=30, ttft=70)], 100)


def test_the_goodput_reading() -> None:
    assert "served too late" in ch11.read_goodput(26.0, 52.0)
    assert "held up to the highest" in ch11.read_goodput(52.0, 52.0)
    assert "below every measured rate" in ch11.read_goodput(None, 52.0)


def test_the_ridge_side_and_control_plane_readings() -> None:
    assert ch11.ridge_side(1.5, 4.0, 14.1) == "left of the ridge"
    assert ch11.ridge_side(71, 71, 14.1) == "right of the ridge"
    assert ch11.ridge_side(5, 20, 14.1) == "on both sides of the ridge"
    assert "model step decides" in ch11.read_control_plane(0.022)
    assert "real share" in ch11.read_control_plane(0.15)


def test_step_settings_names_batch_context_dtype_threads_and_mode() -> None:
    import torch

    from nanoengine.config import EngineConfig

    text = ch11.step_settings(EngineConfig(device="cpu", enforce_eager=True), batch="1 sequence",
                              context="13-token prompt", threads=1)
    assert text == "settings: 1 sequence, 13-token prompt, float32 on cpu, 1 CPU thread(s) per process, eager"
    on_cuda = types.SimpleNamespace(torch_device=torch.device("cuda"), torch_dtype=torch.bfloat16, compile=True,
                                    enforce_eager=False)  # compile=True is CUDA's: a config this CPU could not build
    assert ch11.step_settings(on_cuda, batch="b", context="c", threads=1).endswith(
        "bfloat16 on cuda, 1 CPU thread(s) per process, eager with compiled fused ops, CUDA graphs")
    assert ch11.step_settings(EngineConfig(device="cpu"), batch="b", context="c").endswith(
        "eager (one native call per decoder layer where the layers fuse)")
    engine = types.SimpleNamespace(config=EngineConfig(device="cpu"), forward_mode="eager, as the engine says")
    assert ch11.step_settings(engine, batch="b", context="c").endswith(", eager, as the engine says")  # the engine's own
