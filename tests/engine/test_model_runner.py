"""The model runner (chapters 3 and 6): the batch plan, its event, and what memory it holds."""

from __future__ import annotations

import pytest
import torch

from nanoengine import LLMEngine, SamplingParams
from nanoengine.backends import Backend, select_backend
from nanoengine.backends.cpu import CpuBackend
from nanoengine.engine.model_runner import BatchPlan, ModelRunner, plan_batch
from nanoengine.engine.profiler import StepProfiler
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
    assert plan.logits_indices == [0, 6] and sampled == [decoding, prefilling]
    rows = plan.rows()
    assert [(r.request_id, r.is_prefill, r.samples) for r in rows] == [("d", False, True), ("p", True, True)]
    assert rows[1].positions == (0, 1, 2, 3, 4, 5) and rows[1].slot_mapping == (12, 13, 14, 15, 0, 1)
    assert rows[1].block_table == (3, 0)


def test_batch_event_matches_the_slot_formula_and_costs_nothing_unobserved(monkeypatch):
    built = []
    original = BatchPlan.rows
    monkeypatch.setattr(BatchPlan, "rows", lambda plan: built.append(1) or original(plan))
    e = engine()
    e.events.keep_history()
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
    assert (report.weight_copy_bytes > 0) == packed
    assert report.weight_copies == ("GEMM weights prepacked in oneDNN's blocked layout" if packed else "")
    assert report.total_bytes == report.weight_bytes + report.weight_copy_bytes + report.kv_cache_bytes



def test_on_a_cpu_logits_come_in_chunks_and_every_row_is_sampled_as_one_chunk_would():
    # tiny-llama-eos has hidden size 64, so CPU logits come in chunks of at most 64 rows.
    eng = engine(max_num_seqs=100, num_kv_blocks=512, block_size=16, max_num_batched_tokens=1024)
    runner = eng.runner
    assert type(runner.backend) is CpuBackend and runner.backend.logits_rows_per_chunk(100, 49152, 64) == 64
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5)] for i in range(100)]
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=1, logprobs=1))
    sched = eng.scheduler.schedule(eng.step_count)
    plan, sampled = plan_batch(sched, eng.config.block_size)
    whole = runner.run_model(runner.prepare_inputs(plan))  # one LM-head call for all 100 rows
    hidden = runner.sampled_hidden(runner.prepare_inputs(plan))  # the same K/V are written again: same values
    assert torch.equal(torch.cat([runner.logits(hidden[:64]), runner.logits(hidden[64:])]), whole)
    calls, head = [], runner.logits
    runner.logits = lambda rows: calls.append(rows.shape[0]) or head(rows)
    profiler = StepProfiler()
    profiler.start(enabled=True)
    result = runner.execute_model(plan, sampled, profiler)
    times = profiler.finish()
    assert calls == [64, 36]
    assert [result.sampled[r.request_id] for r in sampled] == [[t] for t in whole.argmax(dim=-1).tolist()]
    assert len(result.logprobs) == 100
    assert times["prepare_time"] > 0 and times["model_time"] > 0 and times["sample_time"] > 0


def test_a_model_runs_only_on_a_backend_whose_kernels_it_was_built_with():
    net = random_model("tiny-llama-eos", std=0.08)  # the device's backend: the CPU's kernels
    with pytest.raises(ValueError, match="built with the 'cpu, .*' kernels and this engine's backend runs 'reference'"):
        ModelRunner(net, net.config, 16, 4, torch.device("cpu"), torch.float32, backend=Backend("cpu"))
    assert net.model.layers[0].self_attn.attn.k_cache is None  # refused before anything was bound


def test_the_backend_is_chosen_by_device_and_the_reference_one_runs_one_logits_call():
    assert type(select_backend("cpu")) is CpuBackend and type(select_backend(torch.device("cpu"))) is CpuBackend
    assert type(select_backend("meta")) is Backend  # any other device: the reference backend
    reference = Backend("cpu")
    net = random_model("tiny-llama-eos", std=0.08, backend=reference)
    generic = ModelRunner(net, net.config, 16, 4, torch.device("cpu"), torch.float32, backend=reference)
    assert generic.backend.num_prepared_weights == 0 and generic.memory_usage()["weight_copy_bytes"] == 0
    requests = [Request(f"r{i}", [5 + i, 9, 200, 31, 7], SamplingParams(temperature=0.0, max_tokens=1))
                for i in range(3)]
    batch = SchedulerOutput()
    for i, request in enumerate(requests):
        request.block_ids = [2 * i, 2 * i + 1]
        batch.add(request, 5)
    plan, sampled = plan_batch(batch, block_size=4)
    calls, head = [], generic.logits
    generic.logits = lambda rows: calls.append(rows.shape[0]) or head(rows)
    result = generic.execute_model(plan, sampled)
    assert calls == [3]  # forward, logits, sample: one LM-head call for the whole batch
    assert [result.sampled[r.request_id] for r in requests] == [[t] for t in generic.compute_logits(plan).argmax(-1).tolist()]

