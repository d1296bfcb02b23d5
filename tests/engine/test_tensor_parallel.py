"""Tensor parallelism for real: worker processes over torch.distributed (gloo) on the CPU.

Mirrors ``nanoengine/distributed/tp_runner.py`` and ``worker.py``. Every test here starts
real worker processes (a few seconds each: a fresh interpreter imports torch), so engines
are shared where a test does not need its own.

What must hold:

* TP=N gives the tokens (and text) TP=1 gives: greedy exactly, and a seeded sampled
  request too, because sampling stays in the driver with the request's own generator.
* A size that does not divide the heads, KV heads, vocabulary or MLP is refused before
  any process starts, with a message listing the allowed sizes.
* Two TP engines live in one process; neither sees the other's rendezvous.
* Shutdown, garbage collection, a worker that raises, one that dies and one that hangs
  all end with a clear ``RuntimeError`` (for failures) and no worker process left.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import time

import psutil
import pytest

from nanoengine import LLM, SamplingParams
from nanoengine.distributed.tp_runner import WorkerGroup, allowed_tensor_parallel_sizes
from nanoengine.engine.model_runner import BatchPlan
from nanoengine.models.presets import PRESETS

pytestmark = pytest.mark.slow  # every test starts worker processes

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=100, seed=1234, max_tokens=12, ignore_eos=True,
                        logprobs=2)
SMALL = dict(max_model_len=256, num_kv_blocks=64, block_size=8, max_num_batched_tokens=48)


def _token_prompts(n: int, seed: int, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 70))] for _ in range(n)]


def _alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still run (a reaped process no longer exists)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _children() -> set[int]:
    """Child processes of this test process, except multiprocessing's resource tracker
    (one per interpreter, started by the first "spawn" and shared by everything)."""
    kids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                kids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return kids


def _assert_stopped(runner, children_before: set[int]) -> None:
    assert _alive(runner.worker_pids) == []
    assert not runner._workers.tmpdir.exists(), "the rendezvous folder must be removed"
    assert _children() <= children_before, "no new child process may remain"


@pytest.fixture(scope="module")
def tp2_llama(tiny_llama_tok_dir):
    """A TP=2 engine on a tiny random Llama (4 heads, 2 KV heads) with a real tokenizer."""
    llm = LLM(tiny_llama_tok_dir, tensor_parallel_size=2, **SMALL)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tp1_llama(tiny_llama_tok_dir):
    return LLM(tiny_llama_tok_dir, **SMALL)


# ------------------------------------------------------------------ equality
@pytest.mark.slow
def test_tp2_matches_tp1_greedy_and_seeded(tp1_llama, tp2_llama):
    """Same text and tokens at TP=2 as at TP=1, with chunked prefill and prefix hits in play."""
    shared = "Once upon a time, in a land far away, there lived a"
    prompts = [shared + " king", shared + " dragon", "Hello", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14"]
    ref = tp1_llama.generate(prompts, GREEDY)
    out = tp2_llama.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert [o.text for o in out] == [o.text for o in ref]

    ref_seeded = tp1_llama.generate(prompts[:2], SEEDED)
    out_seeded = tp2_llama.generate(prompts[:2], SEEDED)  # the prompts' blocks are cached by now
    assert [o.token_ids for o in out_seeded] == [o.token_ids for o in ref_seeded]
    assert all(o.num_cached_tokens for o in out_seeded), "the second run should hit the prefix cache"
    for a, b in zip(out_seeded, ref_seeded):
        for lps_a, lps_b in zip(a.logprobs, b.logprobs):
            assert [lp.token_id for lp in lps_a] == [lp.token_id for lp in lps_b]
            assert [lp.logprob for lp in lps_a] == pytest.approx([lp.logprob for lp in lps_b], abs=1e-4)


def test_tp2_reports_the_whole_kv_cache_and_its_timings(tp1_llama, tp2_llama):
    runner = tp2_llama.engine.runner
    assert runner.kv_cache_bytes == tp1_llama.engine.runner.kv_cache_bytes  # the ranks' halves add up
    assert [rank["kv_cache_bytes"] for rank in runner.rank_memory] == [runner.kv_cache_bytes // 2] * 2
    report, alone = tp2_llama.memory_report(), tp1_llama.memory_report()
    assert report.kv_cache_bytes == alone.kv_cache_bytes == report.kv_bytes_per_block * report.num_kv_blocks
    assert report.weight_bytes >= alone.weight_bytes  # each rank also holds its own copy of the norms
    assert runner.num_blocks == 64 and runner.block_size == 8 and runner.device.type == "cpu"
    logits = tp2_llama.engine.next_token_logits("Hello there")
    assert logits.shape == (tp2_llama.engine.model_config.vocab_size,)
    ref = tp1_llama.engine.next_token_logits("Hello there")
    assert (logits - ref).abs().max() < 1e-4


@pytest.mark.slow
def test_tp3_matches_tp1_on_the_default_model(default_llm):
    """The default model at TP=3 gives TP=1's greedy text.

    The issue asked CI for ``tensor_parallel_size=2`` on the default model, which cannot
    work: SmolLM2-135M has 9 query heads and 3 KV heads, and a head never spans two ranks,
    so 2 does not divide it (``test_tp2_is_refused_on_the_default_model``). The allowed
    sizes are 1 and 3 (heads 9, KV heads 3, vocabulary 49152, MLP 1536), so the default
    model runs at TP=3, and TP=2 is checked on a tiny Llama with 4 heads and 2 KV heads.
    """
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    ref = default_llm.generate(prompts, params)
    before = _children()
    llm = LLM(tensor_parallel_size=3, max_model_len=256, num_kv_blocks=32)  # a small KV pool per rank
    try:
        out = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    assert [o.text for o in out] == [o.text for o in ref]
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    _assert_stopped(llm.engine.runner, before)


# ---------------------------------------------------------------- validation
def test_tp2_is_refused_on_the_default_model():
    before = _children()
    with pytest.raises(ValueError) as err:
        LLM(tensor_parallel_size=2)
    message = str(err.value)
    assert "tensor_parallel_size=2" in message
    assert "attention heads (9)" in message and "KV heads (3)" in message
    assert "[1, 3]" in message
    assert _children() == before, "nothing may be spawned for a refused size"


def test_allowed_sizes_are_the_common_divisors():
    assert allowed_tensor_parallel_sizes(PRESETS["SmolLM2-135M"]) == [1, 3]
    assert allowed_tensor_parallel_sizes(PRESETS["Qwen3-0.6B"]) == [1, 2, 4, 8]
    assert allowed_tensor_parallel_sizes(PRESETS["Llama-3-8B"]) == [1, 2, 4, 8]


# ------------------------------------------------------- processes and failure
@pytest.mark.slow
def test_two_engines_at_once_and_a_hung_worker_times_out(tp1_llama, tp2_llama, tiny_qwen3_dir):
    """A second TP engine (Qwen3, q/k norms sharded too) runs beside the first; when one of
    its workers stops answering, only that engine fails, within its time limit."""
    prompts = _token_prompts(3, seed=1)
    ref = LLM(tiny_qwen3_dir, **SMALL).generate(prompts, GREEDY)
    before = _children()
    other = LLM(tiny_qwen3_dir, tensor_parallel_size=2, **SMALL)
    runner = other.engine.runner
    assert set(runner.worker_pids).isdisjoint(tp2_llama.engine.runner.worker_pids)
    assert [o.token_ids for o in other.generate(prompts, GREEDY)] == [o.token_ids for o in ref]

    runner.step_timeout_s = 2.0
    os.kill(runner.worker_pids[1], signal.SIGSTOP)  # alive, but never answers again
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 .*time limit"):
        other.generate(prompts[:1], GREEDY)
    # A hang guard, generous for a busy machine (10x the limit): the message above shows the limit ended the call.
    assert time.monotonic() - start < 10 * runner.step_timeout_s
    _assert_stopped(runner, before)
    assert not other.engine.has_unfinished_requests()  # generate aborted its own requests
    with pytest.raises(RuntimeError, match="shut down"):
        other.generate(prompts[:1], GREEDY)

    text_prompts = ["Hello", "Good morning"]
    assert [o.token_ids for o in tp2_llama.generate(text_prompts, GREEDY)] == \
        [o.token_ids for o in tp1_llama.generate(text_prompts, GREEDY)]


@pytest.mark.slow
def test_a_killed_worker_is_named_and_the_rest_are_stopped(tiny_llama_dir):
    before = _children()
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **SMALL)
    runner = llm.engine.runner
    llm.generate([[1, 2, 3]], GREEDY)
    os.kill(runner.worker_pids[1], signal.SIGKILL)
    with pytest.raises(RuntimeError) as err:
        llm.generate(_token_prompts(2, seed=2), GREEDY)
    assert f"rank 1 (pid {runner.worker_pids[1]}) died" in str(err.value)
    assert "SIGKILL" in str(err.value)
    _assert_stopped(runner, before)


@pytest.mark.slow
def test_a_forgotten_engine_stops_its_workers_when_collected(tiny_llama_dir):
    before = _children()
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **SMALL)
    pids, tmpdir = llm.engine.runner.worker_pids, llm.engine.runner._workers.tmpdir
    assert len(_alive(pids)) == 2
    del llm
    gc.collect()
    assert _alive(pids) == []
    assert not tmpdir.exists()
    assert _children() <= before


@pytest.mark.slow
def test_a_worker_that_stops_reading_cannot_block_the_driver():
    """A plan bigger than a pipe's buffer, to a worker that never reads: a time limit, not a hang."""
    import multiprocessing

    group = WorkerGroup(1)
    ours, theirs = multiprocessing.Pipe()
    group.conns, group.pids = [ours], [0]  # a "worker" that is alive (no process to die) and never reads
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 did not take a message within 1 s"):
        group.broadcast(("execute", 1, {"input_ids": list(range(200_000))}), timeout_s=1.0)
    assert time.monotonic() - start < 10  # a hang guard, 10x the limit: the message above shows the limit fired
    assert group.closed and not group.tmpdir.exists()
    theirs.close()


def test_a_worker_that_raises_sends_its_traceback(tp2_llama):
    """A plan whose KV slots lie outside the cache makes every rank raise IndexError."""
    runner = tp2_llama.engine.runner
    before = _children() - set(runner.worker_pids)
    outside = runner.num_blocks * runner.block_size
    bad = BatchPlan(input_ids=[1, 2], positions=[0, 1], slot_mapping=[outside, outside + 1], num_decode_tokens=0,
                    decode_block_tables=[], decode_context_lens=[], prefill_block_tables=[[0]],
                    prefill_cu_seqlens_q=[0, 2], prefill_context_lens=[2], logits_indices=[1],
                    request_ids=["bad"], query_start_loc=[0, 2])
    with pytest.raises(RuntimeError) as err:
        runner.run_plan(bad)
    message = str(err.value)
    assert "raised IndexError" in message and "--- rank" in message
    assert "index_copy_" in message and "attention.py" in message  # the traceback reaches the layer's store-KV
    _assert_stopped(runner, before)
    tp2_llama.shutdown()  # a second shutdown is a no-op
