"""Chapter 9's exercise checks (widgets.exercises.ch09): placeholders and bad values are
"not yet", each check accepts the right answer only, and the counting rule matches the
engine's module tree."""

from __future__ import annotations

import pytest

from nanoengine import LLMEngine
from nanoengine.loader.weights import random_model
from widgets.exercises import ch09


@pytest.fixture(scope="module")
def tiny():
    """A random tiny Llama with layer 15 (the exercise's layer) and a width 4 divides: mechanics only."""
    from transformers import AutoTokenizer

    from nanoengine import default_model_dir

    net = random_model("tiny-llama-eos", seed=0, num_hidden_layers=16, vocab_size=49152)
    return LLMEngine.from_model(net, tokenizer=AutoTokenizer.from_pretrained(str(default_model_dir())),
                                device="cpu", num_kv_blocks=8, block_size=4, max_model_len=32)


def _right_split(gate, up, down, rank, tp):
    n = gate.shape[0] // tp
    part = slice(rank * n, (rank + 1) * n)
    return gate[part], up[part], down[:, part]


@pytest.mark.parametrize("check", [ch09.check_allreduce_bytes, lambda v: ch09.check_tp_size(v, 3),
                                   lambda v: ch09.check_tp_size(4, v)])
@pytest.mark.parametrize("value", [..., None, "4", 2.5, True, -1, 10**12])
def test_placeholders_and_bad_values_are_not_yet(check, value) -> None:
    result = check(value)
    assert not result.right and str(result).startswith(f"Exercise {result.exercise}: not yet. Hint: ")


@pytest.mark.slow
def test_the_mlp_split_accepts_a_consistent_split_only(tiny) -> None:
    assert ch09.check_mlp_split(_right_split, tiny).right
    assert ch09.check_mlp_split(_right_split, type("LLMish", (), {"engine": tiny})()).right  # an LLM wraps it

    def scaffold(gate, up, down, rank, tp):
        return ..., ..., ...

    def wrong_down(gate, up, down, rank, tp):
        g, u, _ = _right_split(gate, up, down, rank, tp)
        return g, u, down[:, :g.shape[0]]  # always rank 0's columns

    def whole(gate, up, down, rank, tp):
        return gate, up, down

    def raises(gate, up, down, rank, tp):
        raise IndexError("oops")

    for bad in (..., None, scaffold, wrong_down, whole, raises):
        result = ch09.check_mlp_split(bad, tiny)
        assert not result.right and "not yet" in str(result), bad
    assert not ch09.check_mlp_split(_right_split, None).right


def test_the_layout_is_the_smallest_size_that_fits_then_replicas() -> None:
    from nanoengine.models.presets import PRESETS

    shape = PRESETS["Llama-3-70B"]
    assert ch09.EX2_GPU_GB - ch09.weight_gb_per_rank(shape, 2) < ch09.EX2_KV_GB  # 2 ranks: no KV room
    assert ch09.EX2_GPU_GB - ch09.weight_gb_per_rank(shape, 4) >= ch09.EX2_KV_GB
    assert ch09.check_tp_size(4, 3).right  # the worked solution: 3 replicas of 4 GPUs
    wrong = {(8, 1): "smaller size", (4, 2): "idle", (2, 6): "too little room", (3, 4): "refuses",
             (8, 2): "there are", (1, 12): "too little room"}
    for (tp, replicas), reason in wrong.items():
        result = ch09.check_tp_size(tp, replicas)
        assert not result.right and reason in " ".join(str(result).split()), (tp, replicas, str(result))


def test_the_bytes_are_counted_from_the_engines_llama70b() -> None:
    count, expected = ch09.row_parallel_bytes(ch09.llama70b_on_meta(), ch09.EX3_TOKENS, 2)
    assert count == 2 * 80 and expected == 16 * 8192 * 2 * 2 * 80
    assert all(p.device.type == "meta" for p in ch09.llama70b_on_meta().parameters())
    assert ch09.check_allreduce_bytes(expected).right
    for wrong in (expected // 16, expected // 2, expected * 2, expected // 8, expected + 1):
        assert not ch09.check_allreduce_bytes(wrong).right


def test_row_parallel_bytes_counts_o_proj_and_down_proj() -> None:
    net = random_model("tiny-llama")  # 2 layers, hidden 32
    assert ch09.row_parallel_bytes(net, num_tokens=5, dtype_bytes=4) == (4, 4 * 5 * 32 * 4)
