"""Chapter 6's exercise checks and helpers (widgets.exercises.ch06): placeholders and bad values
are "not yet", the cost model counts what it says, and the checks judge what the engine did.

The cost-model tests use the default model's shapes only (no weights). The experiment
tests run the real default model once or twice on a short prompt: they check structure
(which step carried which tokens), never timings.
"""

from __future__ import annotations

import types

import pytest

from nanobench.timing import model_gemm_shapes, roofline
from nanoengine.models.presets import PRESETS
from widgets.exercises import ch06
from widgets.step_cost_explorer import StepCostFit

SMOL = PRESETS["SmolLM2-135M"]


@pytest.mark.parametrize("value", [..., None, "4", 2.5, True, -1, 10**6])
def test_placeholders_and_bad_values_are_not_yet(value) -> None:
    roof = roofline(100e9, 10e9)
    for result in (ch06.check_decode_batch(value, roof, None), ch06.check_token_budget(value, None),
                   ch06.check_policy("fcfs", value), ch06.check_policy(value, 512)):
        assert not result.right and str(result).startswith(f"Exercise {result.exercise}: not yet. Hint: ")


def test_step_cost_counts_two_flops_per_weight_per_token_and_reads_weights_once() -> None:
    h, v, layers = SMOL.hidden_size, SMOL.vocab_size, SMOL.num_hidden_layers
    weights = sum(o * i for o, i in model_gemm_shapes(SMOL)) + h * SMOL.num_attention_heads * SMOL.head_dim
    one, _ = ch06.step_cost(SMOL, [(1, 1)])
    attention = 2 * 2 * SMOL.num_attention_heads * SMOL.head_dim * layers
    assert one == 2 * (weights * layers + v * h) + attention
    # batching decodes: FLOPs grow with the batch, the weight bytes do not
    f8, m8 = ch06.step_cost(SMOL, [(1, 1)] * 8)
    f1, m1 = ch06.step_cost(SMOL, [(1, 1)])
    assert f8 == pytest.approx(8 * f1) and m8 < 2 * m1
    # bfloat16 halves the bytes, not the FLOPs
    assert ch06.step_cost(SMOL, [(1, 1)], dtype_bytes=2)[0] == f1
    assert ch06.step_cost(SMOL, [(1, 1)], dtype_bytes=2)[1] == pytest.approx(m1 / 2, rel=0.01)


def test_prefill_is_far_more_intense_than_decode() -> None:
    assert ch06.intensity(SMOL, [(1, 1)]) == pytest.approx(0.5, rel=0.05)  # 2 FLOPs per 4-byte weight
    assert ch06.intensity(SMOL, [(512, 512)]) > 100 * ch06.intensity(SMOL, [(1, 512)])


@pytest.mark.parametrize("ridge", [1.0, 7.5, 20.0, 30.0])
@pytest.mark.parametrize("context", [16, 128])
def test_ridge_batch_is_the_smallest_batch_reaching_the_ridge(ridge, context) -> None:
    b = ch06.ridge_batch(SMOL, ridge, context)
    assert b is not None
    assert ch06.decode_intensity(SMOL, b, context) >= ridge
    assert b == 1 or ch06.decode_intensity(SMOL, b - 1, context) < ridge


def test_ridge_batch_is_none_when_kv_reads_cap_the_intensity() -> None:
    # an H100's ridge (989 TFLOP/s dense BF16 over 3.35 TB/s) with long contexts: KV bytes grow with the batch
    assert ch06.ridge_batch(PRESETS["Llama-3-8B"], 989e12 / 3.35e12, 4096, dtype_bytes=2) is None
    assert ch06.ridge_batch(PRESETS["Llama-3-8B"], 989e12 / 3.35e12, 16, dtype_bytes=2) is not None


def test_exercise_6_1_judges_the_batch_against_the_ridge_without_an_engine_for_wrong_answers() -> None:
    roof = roofline(150e9, 10e9)
    best = ch06.ridge_batch(SMOL, roof.ridge_point)
    # wrong answers are judged from the cost model alone (no engine is touched)
    engine = types.SimpleNamespace(model_config=SMOL)  # no methods: a step would fail loudly
    assert not ch06.check_decode_batch(best - 1, roof, engine).right
    assert not ch06.check_decode_batch(best + 1, roof, engine).right


@pytest.fixture(scope="module")
def short_runs():
    """The arrival experiment on a 300-token prompt: budget 64 fcfs, and prefill_first."""
    return {policy: ch06.run_arrival(64, policy, prompt_tokens=300, num_decoders=2, decode_tokens=6, arrive_after=1)
            for policy in ("fcfs", "prefill_first")}


@pytest.mark.slow
def test_chunked_fcfs_gives_decodes_a_token_in_every_prefill_step(short_runs) -> None:
    run = short_runs["fcfs"]
    chunks = [run.steps[i].num_prefill_tokens for i in run.prefill_steps]
    assert sum(chunks) == 300 and max(chunks) == 64 - 2  # the 2 decodes come first
    assert run.stalled_steps == 0 and run.largest_step_tokens <= 64
    assert len(run.decoder_itls) == 2 * 5 and all(x > 0 for x in run.decoder_itls)
    assert run.long_ttft > 0


@pytest.mark.slow
def test_prefill_first_leaves_decodes_out_of_every_prefill_step(short_runs) -> None:
    run = short_runs["prefill_first"]
    assert [run.steps[i].num_prefill_tokens for i in run.prefill_steps] == [64] * 4 + [300 - 4 * 64]
    assert run.stalled_steps == len(run.prefill_steps) == 5


FIT = StepCostFit(0.080, 0.001, 0.002)  # 80 ms a step + 1 ms per prefill token + 2 ms per decode token


def test_exercise_6_2_accepts_the_largest_budget_the_fit_allows() -> None:
    # 2 x (80 + 8) ms = 176 ms allows 80 + 8 + chunk x 1 ms: a chunk of 88 tokens, plus the 4 decodes
    assert ch06.largest_budget(FIT) == 92
    assert ch06.check_token_budget(92, FIT).right
    for wrong in (88, 93, 91, 172):  # the decodes forgotten; one over; one under; 2 x 88 + 4 (twice the chunk)
        result = ch06.check_token_budget(wrong, FIT)
        assert not result.right and "92" not in str(result)
    assert "run section 6 first" in str(ch06.check_token_budget(92, None))


def test_exercise_6_2_with_an_attention_term_judges_the_last_and_dearest_chunk() -> None:
    # 0.1 us per attention pair: a chunk late in the 1,500-token prompt attends over ~1,400 tokens
    fit = StepCostFit(0.080, 0.001, 0.002, per_attention_pair=1e-7)
    best = ch06.largest_budget(fit)
    assert 5 < best < 92  # attention makes every chunk dearer than the line alone says
    assert ch06.longest_chunk_step(fit, best) <= 2 * fit.step_time(0, 4) < ch06.longest_chunk_step(fit, best + 1)
    assert ch06.check_token_budget(best, fit).right
    # two plausible wrong answers: the line without its attention term (92), and the budget
    # whose *first* chunk (no context yet) takes twice a decode step
    first_only = max(b for b in range(5, 200) if fit.step_time(b - 4, 4) <= 2 * fit.step_time(0, 4))
    assert first_only != best
    for wrong in (92, first_only, best - 1):
        result = ch06.check_token_budget(wrong, fit)
        assert not result.right and str(best) not in str(result).split("budget ", 1)[1].split(":", 1)[1]


def test_arrival_run_names_its_worst_gap_and_does_not_call_it_a_p99() -> None:
    run = ch06.ArrivalRun(512, "fcfs", (), (), (), (0.1, 0.1, 0.9), (1, 2, 3), 1.0)
    assert run.itl_max == 0.9 and "worst 900 ms (of 3 gaps)" in run.describe() and "p99" not in run.describe()


@pytest.mark.slow
def test_exercise_6_3_needs_fcfs_and_a_budget_between_the_two_limits() -> None:
    # the real default model (check_policy runs the chapter's 1,500-token arrival); structure only
    assert ch06.check_policy("fcfs", 390).right  # 4 chunks of at most 386, 4 decodes in each
    assert not ch06.check_policy("prefill_first", 390).right  # the decodes wait in every prefill step
    default = ch06.check_policy("fcfs", 2048)  # the chapter's default configuration: one step of 1,504 tokens
    assert not default.right and "more than 400 tokens" in str(default)


def test_token_cost_reading_follows_its_numbers() -> None:
    assert "far cheaper" in ch06.read_token_costs(0.00146, 0.032)
    assert "cheaper than a decode step (1.5x" in ch06.read_token_costs(0.02, 0.03)
    assert "about what a decode step did" in ch06.read_token_costs(0.03, 0.03)
    assert "cost more than a decode step" in ch06.read_token_costs(0.05, 0.03)


def _run(gap, ttft):
    return types.SimpleNamespace(itl_max=gap, long_ttft=ttft)


def test_chunking_readings_follow_their_numbers() -> None:
    saved = {(256, "fcfs"): _run(0.397, 1.966), (512, "fcfs"): _run(0.745, 1.892), (2048, "fcfs"): _run(1.708, 1.701),
             (2048, "prefill_first"): _run(1.813, 1.739)}
    lines = ch06.read_chunking(saved)
    assert "worst gap grows with the budget" in lines[0]
    assert "budget 256: the long prompt's TTFT is 16% longer" in lines[1] and "11% longer" in lines[2]
    assert "prefill_first, budget 2048: the decoders' worst gap is 6% longer than fcfs at 2048" in lines[3]
    other = {(256, "fcfs"): _run(0.8, 1.60), (512, "fcfs"): _run(0.7, 1.69), (2048, "fcfs"): _run(1.7, 1.70),
             (2048, "prefill_first"): _run(1.72, 1.7)}
    lines = ch06.read_chunking(other)
    assert "does not grow steadily" in lines[0]
    assert "6% shorter than unchunked (noise" in lines[1] and "about the same as unchunked (within 5%)" in lines[2]
    assert "worst gap is about the same as fcfs at 2048" in lines[3]
