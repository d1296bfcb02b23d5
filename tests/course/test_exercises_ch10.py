"""Chapter 10's exercise checks (widgets.exercises.ch10): placeholders and bad values are
"not yet", the byte formulas count what a tiled loop moves, and the checks judge effects."""

from __future__ import annotations

import math

import pytest
import torch

from widgets.exercises import ch10


def tiled_attention(q, k, v, block_q, block_k):
    """The chapter's online-softmax loop (a test copy): (n, d) -> ((n, d), bytes moved)."""
    n, d = q.shape
    out, moved, size = torch.empty_like(q), 0, q.element_size()
    for i in range(0, n, block_q):
        q_tile = q[i:i + block_q]
        moved += q_tile.numel() * size
        m = torch.full((len(q_tile),), -math.inf)
        l = torch.zeros(len(q_tile))
        acc = torch.zeros(len(q_tile), d)
        for j in range(0, n, block_k):
            k_tile, v_tile = k[j:j + block_k], v[j:j + block_k]
            moved += (k_tile.numel() + v_tile.numel()) * size
            s = q_tile @ k_tile.T * d ** -0.5
            m_new = torch.maximum(m, s.max(dim=1).values)
            alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
            l = l * alpha + p.sum(dim=1)
            acc = acc * alpha[:, None] + p @ v_tile
            m = m_new
        out[i:i + block_q] = acc / l[:, None]
        moved += acc.numel() * size
    return out, moved


@pytest.mark.slow
@pytest.mark.parametrize("value", [..., None, "4", 2.5, True, -1, 10**6])
def test_placeholders_and_bad_values_are_not_yet(value) -> None:
    for result in (ch10.check_tile_size(tiled_attention, value, 16), ch10.check_tile_size(tiled_attention, 128, value),
                   ch10.check_fusion(value if value is not ... else ...)):
        assert not result.right and str(result).startswith(f"Exercise {result.exercise}: not yet. Hint: ")
    if not isinstance(value, str):
        for result in (ch10.check_dtype(value, 1000.0), ch10.check_dtype("bfloat16", value)):
            assert not result.right and "not yet. Hint:" in str(result)


@pytest.mark.parametrize("n, d, bq, bk", [(64, 8, 16, 8), (100, 16, 32, 24), (37, 4, 37, 5)])
def test_the_byte_formula_counts_what_the_loop_moves(n, d, bq, bk) -> None:
    q, k, v = ch10.attention_inputs(n, d)
    out, moved = tiled_attention(q, k, v, bq, bk)
    assert moved == ch10.tiled_attention_bytes(n, d, bq)
    torch.testing.assert_close(out, ch10.naive_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_naive_bytes_grow_with_the_square_of_the_length() -> None:
    assert ch10.naive_attention_bytes(2048, 64) - ch10.naive_attention_bytes(1024, 64) > \
        3 * (ch10.naive_attention_bytes(1024, 64) - ch10.naive_attention_bytes(512, 64))


@pytest.mark.slow
def test_tile_size_check_needs_fit_traffic_and_equality() -> None:
    assert ch10.check_tile_size(tiled_attention, 128, 16).right  # the worked solution
    assert not ch10.check_tile_size(tiled_attention, 64, 64).right  # too many bytes
    assert not ch10.check_tile_size(tiled_attention, 128, 64).right  # does not fit
    assert not ch10.check_tile_size(tiled_attention, 128, 8).right  # fits, but smaller than a tensor-core fragment
    assert not ch10.check_tile_size(tiled_attention, 128, 24).right  # not a power of two
    wrong = lambda q, k, v, bq, bk: (tiled_attention(q, k, v, bq, bk)[0] * 1.01, 0)  # noqa: E731
    assert not ch10.check_tile_size(wrong, 128, 16).right


def test_tile_size_check_rejects_a_function_that_does_not_tile() -> None:
    naive = lambda q, k, v, bq, bk: ch10.naive_attention(q, k, v)  # noqa: E731  # right numbers, no tiles

    def query_tiles_only(q, k, v, bq, bk):  # tiles the queries, but each tile sees all keys at once
        out = torch.empty_like(q)
        for i in range(0, len(q), bq):
            out[i:i + bq] = torch.softmax(q[i:i + bq] @ k.T * q.shape[1] ** -0.5, dim=-1) @ v
        return out

    for fn in (naive, query_tiles_only):
        result = ch10.check_tile_size(fn, 128, 16)
        assert not result.right and "did not work in those tiles" in " ".join(str(result).split())


def test_product_shapes_records_every_matrix_product() -> None:
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    _, shapes = ch10.product_shapes(lambda: (a @ b, torch.einsum("ij,jk->ik", a, b), a.sum()))
    assert shapes[0] == (4, 5) and len(shapes) == 2


def test_operator_calls_counts_passes_not_views() -> None:
    x = torch.randn(8, 6)
    assert ch10.operator_calls(lambda: x.chunk(2, dim=-1)) == []
    assert ch10.operator_calls(lambda: torch.nn.functional.silu(x[:, :3]) * x[:, 3:]) == ["aten::silu", "aten::mul"]
    assert ch10.operator_calls(lambda: x.float()) == []  # already float32: nothing happens
    assert ch10.operator_calls(lambda: x.double()) == ["aten::to"]  # a real cast is a pass over the data


def test_fusion_check_rejects_an_unfused_or_wrong_function() -> None:
    from nanoengine.layers.activation import silu_and_mul

    assert not ch10.check_fusion(silu_and_mul).right
    assert not ch10.check_fusion(lambda x: x[:, :x.shape[1] // 2]).right


@pytest.mark.slow  # builds the real model in two dtypes
def test_dtype_check_needs_the_measured_activation_and_a_dtype_with_range(default_llm) -> None:
    largest = float(ch10.largest_hidden_state(default_llm).abs().max())
    assert largest > 256  # SmolLM2 has hidden states whose square overflows float16 (256² > 65,504)
    assert ch10.check_dtype("bfloat16", largest).right  # the worked solution
    overflow = ch10.check_dtype("float16", largest)  # half the bytes, same tokens, but the square overflows
    assert not overflow.right and "overflows this dtype" in " ".join(str(overflow).split())
    assert not ch10.check_dtype("float32", largest).right  # right range, but not half the bytes
    assert not ch10.check_dtype("bfloat16", largest / 2).right  # a guess, not the measurement
    assert not ch10.check_dtype("bfloat16", 65504.0).right  # float16's largest value is not the model's


# ------------------------------------------------------------------ the chapter's readings
def test_compare_times_both_sides() -> None:
    assert "(slower)" in ch10.compare_times(1.45, "compiled", "eager")
    assert "(faster)" in ch10.compare_times(0.5, "compiled", "eager")
    assert "about the same" in ch10.compare_times(1.05, "compiled", "eager")
    assert "about the same" in ch10.compare_times(0.95, "compiled", "eager")


def test_fusion_reading_says_what_the_ratios_say() -> None:
    slow = ch10.fusion_reading({1: 2.72, 256: 1.45})  # the numbers: compiled never caught up
    assert "even at 256 rows compiling did not pay" in slow and "fell from 2.72 to 1.45" in slow
    assert "catches up" not in slow
    fast = ch10.fusion_reading({1: 2.72, 256: 0.8})
    assert "at 256 rows compiling paid" in fast and "did not pay" not in fast
    level = ch10.fusion_reading({1: 1.0, 256: 1.02})
    assert "level" in level and "barely changed" in level
    rising = ch10.fusion_reading({1: 1.0, 256: 1.3})
    assert "rose from 1.00 to 1.30" in rising


def test_speedup_reading_band() -> None:
    assert "no measurable difference" in ch10.speedup_reading(0.97, "workload")
    assert "no measurable difference" in ch10.speedup_reading(1.02, "workload")
    assert "a speed-up" in ch10.speedup_reading(1.2, "workload")
    assert "a slow-down" in ch10.speedup_reading(0.8, "workload")


def test_dispatch_reading_both_sides() -> None:
    small = ch10.dispatch_reading(overhead_s=0.010, step_s=0.0514, matmul_s=0.0295, operators_s=0.035)
    assert "most of it" in small and "the smaller part" in small
    big = ch10.dispatch_reading(overhead_s=0.040, step_s=0.050, matmul_s=0.010, operators_s=0.035)
    assert "less than half" in big and "dispatch-bound" in big


def test_precision_reading_every_band() -> None:
    # the numbers: 0.51 -> 0.31 ms at 1 row, 4.72 -> 2.34 ms at 256 rows
    text = ch10.precision_reading({(1, "float32"): 0.51e-3, (1, "bfloat16"): 0.31e-3,
                                   (256, "float32"): 4.72e-3, (256, "bfloat16"): 2.34e-3})
    assert "at 1 row(s) bfloat16 took 0.61x float32's time (faster, by less than half)" in text
    assert "at 256 row(s) bfloat16 took 0.50x float32's time (about halved, from faster bfloat16 arithmetic" in text
    assert "not faster" not in text
    amx = ch10.precision_reading({(1, "float32"): 0.5, (1, "bfloat16"): 0.26, (256, "float32"): 5.0,
                                  (256, "bfloat16"): 0.95})  # 0.19x at 256 rows: AMX's bfloat16 products
    assert "at 1 row(s) bfloat16 took 0.52x float32's time (about halved, as the bytes did)" in amx
    assert "took 0.19x float32's time (far more than the halved bytes explain" in amx
    same = ch10.precision_reading({(1, "float32"): 1.0, (1, "bfloat16"): 1.05})
    assert "bfloat16 was not faster" in same
    slower = ch10.precision_reading({(1, "float32"): 1.0, (1, "bfloat16"): 3.0})
    assert "slower" in slower


def test_bytes_reading() -> None:
    assert "halves them exactly" in ch10.bytes_reading("KV", 46080, 23040)
    assert "some tensors stay in float32" in ch10.bytes_reading("weights", 1000, 510)


def test_parity_reading() -> None:
    agreed = {"total": 8, "identical": 8, "near_tie_divergences": 0, "unexplained": []}
    ties = {"total": 8, "identical": 0, "near_tie_divergences": 8, "unexplained": []}
    odd = {"total": 8, "identical": 6, "near_tie_divergences": 1, "unexplained": ["x"]}
    text = ch10.parity_reading({"float32": agreed, "bfloat16": ties})
    assert "float32 the engine and transformers agreed token for token" in text
    assert "bfloat16 8 of 8 outputs parted, every one at a near tie" in text
    assert "1 of them not at a near tie" in ch10.parity_reading({"bfloat16": odd})


def test_agreement_reading() -> None:
    assert "agree within 15%" in ch10.agreement_reading(0.024, 0.023, "a", "b")
    assert "do not agree" in ch10.agreement_reading(0.0514, 0.023, "a", "b")
