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


@pytest.mark.parametrize("check", [ch09.check_crossover_batch, lambda v: ch09.check_tp_size(v, 3),
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


def test_the_crossover_batch_is_counted_from_the_engines_llama8b() -> None:
    from nanoengine.models.presets import PRESETS

    shape = PRESETS["Llama-3-8B"]
    count, _ = ch09.row_parallel_bytes(ch09.model_on_meta(), 1, 2)
    assert count == 2 * shape.num_hidden_layers and all(p.device.type == "meta" for p in ch09.model_on_meta().parameters())
    # by hand: 2 x 32 + 1 all-reduces, ring 2(4-1)/4, 4096 hidden, bf16; a quarter of the weights at HBM speed
    sent = 1.5 * 65 * 4096 * 2 / 64e9
    read = shape.num_parameters() * 2 / 4 / 3.35e12
    assert ch09.crossover_batch() == int(read // sent) == 96
    assert ch09.check_crossover_batch(96).right


@pytest.mark.parametrize("wrong, reason", [(144, "ring"), (189, "one all-reduce per decoder layer"),
                                           (97, "leaves out one all-reduce"), (384, "its share"),
                                           (675, "PCIe only"), (95, "too few"), (100, "too many")])
def test_the_crossover_batch_rejects_plausible_mistakes_and_says_what_is_wrong(wrong, reason) -> None:
    result = ch09.check_crossover_batch(wrong)
    assert not result.right and reason in " ".join(str(result).split()), str(result)
    assert "96" not in str(result)  # the feedback does not give the answer away


def test_row_parallel_bytes_counts_o_proj_and_down_proj() -> None:
    net = random_model("tiny-llama")  # 2 layers, hidden 32
    assert ch09.row_parallel_bytes(net, num_tokens=5, dtype_bytes=4) == (4, 4 * 5 * 32 * 4)


# ------------------------------------------------------------------ section 9's readings: both sides
class _T:
    def __init__(self, median, nbytes=2304, world_size=2):
        self.median, self.bytes, self.world_size = median, nbytes, world_size


def test_the_tp_step_reading_follows_the_ratio() -> None:
    assert "8.0x" in ch09.read_tp_step(0.0408, 0.327, 3) and "slower" in ch09.read_tp_step(0.0408, 0.327, 3)
    assert "faster" in ch09.read_tp_step(0.040, 0.020, 8)
    assert "about as fast" in ch09.read_tp_step(0.040, 0.041, 2)


def test_the_allreduce_size_reading_separates_latency_from_bytes() -> None:
    assert "latency" in ch09.read_allreduce_size(_T(896e-6), _T(814e-6, 64 * 2304))
    assert "bandwidth" in ch09.read_allreduce_size(_T(10e-6), _T(600e-6, 64 * 2304))
    assert "both" in ch09.read_allreduce_size(_T(100e-6), _T(1000e-6, 64 * 2304))


def test_the_ranks_and_cores_readings() -> None:
    assert "waiting for one another" in ch09.read_ranks(_T(0.9e-3), _T(7.2e-3, world_size=3))
    assert "ring's extra traffic" in ch09.read_ranks(_T(0.9e-3), _T(1.2e-3, world_size=3))
    assert "outnumber" in ch09.read_cores(3, 2)
    assert "a core each" in ch09.read_cores(2, 2)
    assert "of its own" in ch09.read_cores(2, 16)


def test_the_allreduce_share_reading() -> None:
    assert "most of it" in ch09.read_allreduce_share(7e-3, 61, 0.287)
    assert "part of it" in ch09.read_allreduce_share(0.9e-3, 61, 0.287)
    assert "nothing to explain" in ch09.read_allreduce_share(0.9e-3, 61, -0.001)


def test_gpu_results_give_provenance_and_find_no_allreduce_figure_where_there_is_none(tmp_path) -> None:
    import json

    from nanobench.results_report import ROOT

    rows = ch09.gpu_results(ROOT / "results")
    assert rows and all(r["hardware"] and r["date"] and r["revision"] and r["command"] for r in rows)
    (tmp_path / "gpu-x.json").write_text(json.dumps({"date": "d", "command": "c", "environment": {
        "gpu": "H100", "gpu_count": 8}, "checks": {"nccl": {"all_reduce_us": 12.0}}}))
    (row,) = ch09.gpu_results(tmp_path)
    assert row["allreduce"] == ["checks.nccl.all_reduce_us"] and row["hardware"].startswith("8 x H100")
