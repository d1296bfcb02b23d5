"""The model runner (chapters 3 and 6): the batch plan, its event, and what memory it holds."""

from __future__ import annotations

import pytest
import torch

from nanoengine import LLMEngine, SamplingParams
from nanoengine.engine.model_runner import BatchPlan, plan_batch
from nanoengine.engine.request import Request
from nanoengine.engine.scheduler import SchedulerOutput
from nanoengine.events import BatchPrepared
from nanoengine.kernels import cpu_gemm
from nanoengine.loader.weights import random_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest


def engine(**config) -> LLMEngine:
    options = dict(device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64)
    return LLMEngine.from_model(random_model("tiny-llama-eos", std=0.08), None, **{**options, **config})


def test_plan_puts_decodes_first_and_maps_every_position_to_its_slot():
    decoding = Request("d", [5, 6, 7, 8, 9], SamplingParams())
    decoding.block_ids, decoding.num_computed_tokens = [7, 2], 4
    prefilling = Request("p", [1, 2, 3, 4, 5, 6], SamplingParams())
    prefilling.block_ids = [3, 0]
    sibling = Request("1_p", [1, 2, 3, 4, 5, 6], SamplingParams(), parent_id="p", index=1)
    prefilling.forks = [sibling]
    out = SchedulerOutput()
    out.add(prefilling, 6)
    out.add(decoding, 1)
    plan, sampled = plan_batch(out, block_size=4)
    assert plan.request_ids == ["d", "p"] and plan.num_decode_tokens == 1
    assert plan.positions == [4, 0, 1, 2, 3, 4, 5]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert plan.slot_mapping.tolist() == [2 * 4 + 0, 12, 13, 14, 15, 0, 1]
    assert plan.decode_block_tables.tolist() == [[7, 2]] and plan.prefill_block_tables.tolist() == [[3, 0]]
    assert plan.decode_context_lens == [5] and plan.prefill_context_lens == [6]
    assert plan.query_start_loc == [0, 1, 7]
    # The waiting sibling samples from the same logits row as the request it forks from.
    assert plan.logits_indices == [0, 6, 6] and sampled == [decoding, prefilling, sibling]
    rows = plan.rows()
    assert [(r.request_id, r.is_prefill, r.samples) for r in rows] == [("d", False, True), ("p", True, True)]
    assert rows[1].positions == (0, 1, 2, 3, 4, 5) and rows[1].slot_mapping == (12, 13, 14, 15, 0, 1)
    assert rows[1].block_table == (3, 0)


def test_batch_event_matches_the_slot_formula_and_costs_nothing_unobserved(monkeypatch):
    built = []
    original = BatchPlan.rows
    monkeypatch.setattr(BatchPlan, "rows", lambda plan: built.append(1) or original(plan))
    e = engine()
    e.add_request(list(range(20, 30)), SamplingParams(max_tokens=3))
    e.step()
    assert not built and not any(isinstance(ev, BatchPrepared) for ev in e.events.history)
    seen = []
    e.events.subscribe(lambda ev: seen.append(ev) if isinstance(ev, BatchPrepared) else None)
    while e.has_unfinished_requests():
        e.step()
    assert len(built) == len(seen) == 2 and not any(isinstance(ev, BatchPrepared) for ev in e.events.history)
    for event in seen:
        for row in event.rows:
            assert row.slot_mapping == tuple(row.block_table[p // 4] * 4 + p % 4 for p in row.positions)
    assert seen[0].rows[0].positions == (10,) and not seen[0].rows[0].is_prefill


def test_memory_report_adds_up():
    e = engine(num_kv_blocks=32)
    report = e.memory_report()
    net = e.runner.model
    assert report.weight_bytes == sum(p.numel() * p.element_size() for p in net.parameters())
    assert report.kv_cache_bytes == report.kv_bytes_per_block * report.num_kv_blocks == e.snapshot().kv_cache_bytes
    assert report.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32
    assert report.kv_capacity_tokens == 32 * 4 and report.dtype == "float32"
    packed = cpu_gemm.packing_available()
    assert (report.packed_weight_bytes > 0) == packed
    assert report.total_bytes == report.weight_bytes + report.packed_weight_bytes + report.kv_cache_bytes



def test_a_batch_bigger_than_one_logits_chunk_samples_every_row_as_one_chunk_would():
    # tiny-llama-eos has hidden size 64, so CPU logits come in chunks of at most 64 rows.
    eng = engine(max_num_seqs=100, num_kv_blocks=512, block_size=16, max_num_batched_tokens=1024)
    runner = eng.runner
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5)] for i in range(100)]
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=1, logprobs=1))
    sched = eng.scheduler.schedule()
    plan, sampled = plan_batch(sched, eng.config.block_size)
    model_input = runner.prepare_inputs(plan)
    chunks = [(rows, logits.clone()) for rows, logits in runner.logits_chunks(model_input)]
    assert [rows.stop - rows.start for rows, _ in chunks] == [64, 36]
    whole = runner.run_model(runner.prepare_inputs(plan))  # the same K/V are written again: same values
    assert torch.equal(torch.cat([logits for _, logits in chunks]), whole)
    result = runner.execute_model(plan, sampled)
    assert [result.sampled[r.request_id] for r in sampled] == whole.argmax(dim=-1).tolist()
    assert len(result.logprobs) == 100 and result.sample_time > 0 and result.model_time > 0
