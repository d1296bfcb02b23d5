"""Tests for the build-it-yourself track ``labs/nano-vllm`` (snapshots v00-v09).

Two kinds of checks:

- every snapshot runs as a script (``python .../run.py``), exits 0 and prints a trace
  that shows its new idea at work;
- every snapshot is imported by file path and its contract is checked on real
  behaviour: the engine API (v02), batched decodes (v04), consistent block tables and
  blocks returned (v05), the runner contract (v06), prefix reuse with ref counts (v07),
  seeded sampling (v08), a real ``torch.nn.Module`` behind the runner (v09). The toy
  versions must also all produce exactly the tokens of v00's naive loop: each step
  changes how the work is done, never the result.

Snapshot folders are not packages (their modules import each other by plain name, as
scripts do), so ``load`` puts one folder on ``sys.path`` at a time and removes its
modules from ``sys.modules`` afterwards, so that versions never see each other's files.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "labs" / "nano-vllm"
VERSIONS = LAB / "versions"
SIBLING_MODULES = ("toy_model", "sequence", "llm_engine", "scheduler", "block_manager", "model_runner",
                   "sampler", "sampling_params", "tiny_transformer", "run")

V = {
    "v00": "v00_naive_loop",
    "v01": "v01_request_state",
    "v02": "v02_engine_step",
    "v03": "v03_prefill_decode",
    "v04": "v04_continuous_batching",
    "v05": "v05_paged_kv",
    "v06": "v06_model_runner",
    "v07": "v07_prefix_cache",
    "v08": "v08_sampling_params",
    "v09": "v09_tiny_transformer",
}

SYSTEM_PROMPT = [21, 22, 23, 24, 25, 26, 27, 28]
PROMPTS = [[5, 9, 13, 2, 8], [7, 7, 1], [3, 14, 15, 9, 2, 6, 5], [11, 4],
           SYSTEM_PROMPT + [1, 2, 3], SYSTEM_PROMPT + [9, 9]]
MAX_TOKENS = 6


def load(version: str, *module_names: str) -> SimpleNamespace:
    """Import modules of one snapshot by file path, isolated from every other snapshot."""
    folder = VERSIONS / V[version]
    saved = {name: sys.modules.pop(name) for name in SIBLING_MODULES if name in sys.modules}
    sys.path.insert(0, str(folder))
    dont_write_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # keep folders clean
    try:
        loaded = {}
        for name in module_names:
            if name not in sys.modules:  # not already imported as another module's dependency
                spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
            loaded[name] = sys.modules[name]
        return SimpleNamespace(**loaded)
    finally:
        sys.dont_write_bytecode = dont_write_bytecode
        sys.path.remove(str(folder))
        for name in SIBLING_MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def reference(prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """v00's naive loop: the ground truth every toy version must reproduce."""
    return load("v00", "run").run.generate(prompt, max_tokens)


def run_to_end(engine) -> list:
    steps = []
    while not engine.is_finished():
        steps.append(engine.step())
        assert len(steps) < 1000, "engine did not finish"
    return steps


# ---------------------------------------------------------------------------- scripts

TRACE_MARKERS = {
    "v00": [r"re-read\s+7 tokens", r"a KV cache would have computed only"],
    "v01": [r"Sequence\(id=0, .*finished=True\)"],
    "v02": [r"WAITING", r"\d:RUNNING", r"seq 2 FINISHED"],
    "v03": [r"PREFILL seq 0: 5 token\(s\) in", r"DECODE  seq 0: 1 token\(s\) in",
            r"features computed with the cache: 14; v00's naive loop would compute 44"],
    "v04": [r"DECODE  batch=\[\d+(, \d+)+\]", r"PREFILL batch=\[3\]"],
    "v05": [r"block_table: seq0=\[0, 1\]", r"PREEMPTED seq \d", r"blocks \[[\d, ]+\] returned",
            r"all requests finished; free blocks: 6/6"],
    "v06": [r"slot_mapping = \[", r"prepare_decode  seqs=\[0, 1\]", r"cu_seqlens_q = \[0, 5, 8\]"],
    "v07": [r"prefix hit: 8 tokens cached", r"ref_count: block0=2 block1=2",
            r"prefix hits: [1-9]\d* of", r"all zero: True"],
    "v08": [r"same seed -> same output: True", r"different seed -> different output: True",
            r"top_k=1 equals greedy: True"],
    "v09": [r"TinyTransformer\(torch\.nn\.Module\)", r"top logits \[", r"KV written to slots",
            r"greedy outputs match a no-cache forward pass of the same model: True",
            r"same seed -> same output: True"],
}


@pytest.mark.parametrize("version", sorted(V))
def test_snapshot_runs_and_traces_its_idea(version: str) -> None:
    script = VERSIONS / V[version] / "run.py"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    for marker in TRACE_MARKERS[version]:
        assert re.search(marker, result.stdout), f"{version} trace lacks {marker!r}:\n{result.stdout}"


# ------------------------------------------------------------------- snapshot layout

@pytest.mark.parametrize("version", sorted(V))
def test_every_snapshot_has_notes_with_the_diff_command(version: str) -> None:
    notes = (VERSIONS / V[version] / "NOTES.md").read_text()
    index = int(version[1:])
    if index > 0:
        previous = V[f"v{index - 1:02d}"]
        command = (f"diff -ru -x __pycache__ labs/nano-vllm/versions/{previous} "
                   f"labs/nano-vllm/versions/{V[version]}")
        assert command in notes


def test_unchanged_files_are_byte_identical_to_the_version_named_in_their_header() -> None:
    """Snapshot convention: a module's docstring starts with the version that last changed it."""
    checked = 0
    for path in sorted(VERSIONS.glob("v*/*.py")):
        match = re.match(r'"""(v\d\d) - ', path.read_text())
        assert match, f"{path} must start with a docstring naming its version"
        origin = V[match.group(1)]
        assert match.group(1) <= path.parent.name[:3], f"{path} names a later version"
        if origin != path.parent.name:
            assert path.read_bytes() == (VERSIONS / origin / path.name).read_bytes(), path
            checked += 1
    assert checked >= 10


def test_readme_and_mapping_exist_and_link() -> None:
    readme = (LAB / "README.md").read_text()
    for folder in V.values():
        assert folder in readme
    assert "versions/v10_mapping/MAPPING.md" in readme and "versions/v10_mapping/CODE_MAP.md" in readme
    mapping = (VERSIONS / "v10_mapping" / "MAPPING.md").read_text()
    code_map = (VERSIONS / "v10_mapping" / "CODE_MAP.md").read_text()
    for folder in V.values():
        assert folder in mapping
    for original in ("nanovllm/engine/scheduler.py", "nanovllm/engine/block_manager.py",
                     "nanovllm/engine/model_runner.py", "nanovllm/layers/attention.py"):
        assert original in mapping and original in code_map
    assert "nanoengine/engine/block_manager.py" in code_map


# ----------------------------------------------------------------------- v00 - v03

def test_v00_naive_loop_stops_on_eos_or_budget() -> None:
    run = load("v00", "run").run
    completion = run.generate([5, 9, 13, 2, 8], max_tokens=10)
    assert completion == [40, 12, 37, 0]  # stops at EOS (0) before the budget
    assert len(run.generate([7, 7, 1], max_tokens=10)) == 10
    assert run.toy_next_token([5, 9, 13, 2, 8]) == 40


def test_v01_sequence_bundles_request_state() -> None:
    mods = load("v01", "sequence", "run")
    seq = mods.sequence.Sequence(0, [5, 9], max_tokens=2)
    assert (seq.num_tokens, seq.last_token, seq.completion_token_ids) == (2, 9, [])
    seq.append_token(3)
    seq.append_token(4)
    assert seq.prompt_token_ids == [5, 9] and seq.completion_token_ids == [3, 4] and seq.is_finished
    with pytest.raises(RuntimeError):
        seq.append_token(5)
    with pytest.raises(ValueError):
        mods.sequence.Sequence(1, [], max_tokens=2)
    assert mods.run.generate(PROMPTS, MAX_TOKENS) == [reference(p) for p in PROMPTS]


def test_v02_engine_exposes_add_request_step_generate() -> None:
    mods = load("v02", "llm_engine", "sequence")
    engine = mods.llm_engine.LLMEngine()
    for name in ("add_request", "step", "generate"):
        assert callable(getattr(engine, name))
    ids = [engine.add_request(p, 3) for p in PROMPTS[:3]]
    assert ids == [0, 1, 2]
    assert all(s.status == mods.sequence.SequenceStatus.WAITING for s in engine.waiting)
    out = engine.step()
    assert out.scheduled_seq_ids == (0,) and out.new_tokens == ((0, reference(PROMPTS[0])[0]),)
    assert engine.running[0].status == mods.sequence.SequenceStatus.RUNNING
    assert [s.seq_id for s in engine.waiting] == [1, 2]
    finished = [r for step in run_to_end(engine) for r in step.finished]
    assert [r.seq_id for r in finished] == [0, 1, 2]
    assert mods.llm_engine.LLMEngine().generate(PROMPTS, MAX_TOKENS) == [reference(p) for p in PROMPTS]


def test_v03_prefill_once_then_one_token_decodes() -> None:
    engine = load("v03", "llm_engine").llm_engine.LLMEngine()
    engine.add_request(PROMPTS[2], MAX_TOKENS)
    steps = run_to_end(engine)
    assert steps[0].is_prefill and steps[0].num_input_tokens == len(PROMPTS[2])
    assert all(not s.is_prefill and s.num_input_tokens == 1 for s in steps[1:])
    n, m = len(PROMPTS[2]), len(steps)
    assert engine.model.num_features_computed == n + m - 1  # each token's feature computed once
    assert [tok for s in steps for _, tok in s.new_tokens] == reference(PROMPTS[2])
    assert engine.model.kv_cache == {}  # freed on finish


# ----------------------------------------------------------------------- v04 - v05

def test_v04_batches_several_requests_decodes_in_one_step() -> None:
    engine = load("v04", "llm_engine").llm_engine.LLMEngine(max_num_seqs=3)
    seq_ids = [engine.add_request(p, MAX_TOKENS) for p in PROMPTS]
    steps = run_to_end(engine)
    decode_sizes = [len(s.scheduled_seq_ids) for s in steps if not s.is_prefill]
    assert max(decode_sizes) >= 2  # several requests' decodes in one step
    assert max(len(s.scheduled_seq_ids) for s in steps) <= 3  # max_num_seqs respected
    # continuous: a request is admitted (prefilled) while earlier ones are still decoding
    first_finish = next(i for i, s in enumerate(steps) if s.finished)
    assert any(s.is_prefill for s in steps[first_finish + 1:])
    outputs = {r.seq_id: list(r.completion_token_ids) for s in steps for r in s.finished}
    assert [outputs[i] for i in seq_ids] == [reference(p) for p in PROMPTS]


def _check_exclusive_ownership(engine) -> None:
    bm = engine.block_manager
    owned = [b for seq in engine.scheduler.running for b in seq.block_table]
    assert len(owned) == len(set(owned)), f"a block is owned twice: {owned}"
    assert set(owned).isdisjoint(bm.free_block_ids)
    assert set(owned) | set(bm.free_block_ids) == set(range(bm.num_blocks))
    assert all(not seq.block_table for seq in engine.scheduler.waiting)


def test_v05_block_tables_are_consistent_and_all_blocks_return() -> None:
    engine = load("v05", "llm_engine").llm_engine.LLMEngine(num_blocks=6, block_size=4, max_num_seqs=4)
    seq_ids = [engine.add_request(p, MAX_TOKENS) for p in PROMPTS]
    preempted = 0
    outputs = {}
    while not engine.is_finished():
        out = engine.step()
        preempted += len(out.preempted_seq_ids)
        tables = list(out.block_tables.values())
        flat = [b for t in tables for b in t]
        assert len(flat) == len(set(flat)), f"block owned twice in one step: {out.block_tables}"
        for seq_id, table in out.block_tables.items():
            assert len(table) == math.ceil(out.context_lens[seq_id] / 4)
        _check_exclusive_ownership(engine)
        outputs.update({r.seq_id: list(r.completion_token_ids) for r in out.finished})
    assert preempted > 0, "the small pool should force at least one preemption"
    assert engine.block_manager.num_free_blocks == 6 and not engine.block_manager.used_block_ids
    assert [outputs[i] for i in seq_ids] == [reference(p) for p in PROMPTS]  # recompute is exact


def test_v05_rejects_a_request_that_can_never_fit() -> None:
    engine = load("v05", "llm_engine").llm_engine.LLMEngine(num_blocks=2, block_size=4)
    with pytest.raises(ValueError):
        engine.add_request([1] * 7, max_tokens=5)  # 12 tokens need 3 blocks


# ----------------------------------------------------------------------- v06 - v07

@pytest.mark.parametrize("version", ["v06", "v07", "v08", "v09"])
def test_runner_contract_is_the_same_from_v06_to_v09(version: str) -> None:
    runner_cls = load(version, "model_runner").model_runner.ModelRunner
    assert list(inspect.signature(runner_cls.prepare_prefill).parameters) == ["self", "seqs"]
    assert list(inspect.signature(runner_cls.prepare_decode).parameters) == ["self", "seqs"]
    assert list(inspect.signature(runner_cls.run).parameters) == ["self", "seqs", "is_prefill"]


def test_v06_model_input_slots_follow_the_block_tables() -> None:
    engine = load("v06", "llm_engine").llm_engine.LLMEngine(num_blocks=12, block_size=4)
    seq_ids = [engine.add_request(p, MAX_TOKENS) for p in PROMPTS[:4]]
    outputs = {}
    for out in run_to_end(engine):
        inp = out.model_input
        assert len(inp.input_ids) == len(inp.positions) == len(inp.slot_mapping) == inp.cu_seqlens_q[-1]
        for i, table in enumerate(inp.block_tables):
            rows = range(inp.cu_seqlens_q[i], inp.cu_seqlens_q[i + 1])
            for r in rows:
                pos = inp.positions[r]
                assert inp.slot_mapping[r] == table[pos // 4] * 4 + pos % 4
            assert inp.context_lens[i] == inp.positions[rows[-1]] + 1
        if not inp.is_prefill:
            assert inp.cu_seqlens_q == tuple(range(len(inp.block_tables) + 1))
        outputs.update({r.seq_id: list(r.completion_token_ids) for r in out.finished})
    assert [outputs[i] for i in seq_ids] == [reference(p) for p in PROMPTS[:4]]


def test_v07_prefix_blocks_are_reused_and_ref_counts_return_to_zero() -> None:
    mods = load("v07", "llm_engine", "block_manager")
    engine = mods.llm_engine.LLMEngine(num_blocks=12, block_size=4)
    bm = engine.block_manager
    a = engine.add_request(SYSTEM_PROMPT + [1, 2, 3], MAX_TOKENS)
    b = engine.add_request(SYSTEM_PROMPT + [9, 9], MAX_TOKENS)
    first = engine.step()
    assert first.is_prefill
    table_a, table_b = first.block_tables[a], first.block_tables[b]
    assert table_a[:2] == table_b[:2] and table_a[2] != table_b[2]  # shared prefix, private tails
    assert [bm.blocks[x].ref_count for x in table_b[:2]] == [2, 2]
    assert bm.num_prefix_hits == 2
    rows = first.model_input.cu_seqlens_q
    assert rows[2] - rows[1] == 2  # seq b computed only its own two tokens
    outputs = {r.seq_id: list(r.completion_token_ids) for r in first.finished}
    while not engine.is_finished():
        owned = [x for seq in engine.scheduler.running for x in seq.block_table]
        for block in bm.blocks:
            assert block.ref_count == owned.count(block.block_id)
            assert (block.ref_count == 0) == (block.block_id in bm.free_block_ids)
        out = engine.step()
        outputs.update({r.seq_id: list(r.completion_token_ids) for r in out.finished})
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert bm.num_free_blocks == bm.num_blocks
    # a later request still hits the freed-but-cached prefix blocks
    c = engine.add_request(SYSTEM_PROMPT + [4, 4, 4, 4, 5], MAX_TOKENS)
    hits_before = bm.num_prefix_hits
    outputs.update({r.seq_id: list(r.completion_token_ids) for s in run_to_end(engine) for r in s.finished})
    assert bm.num_prefix_hits - hits_before == 2
    assert all(block.ref_count == 0 for block in bm.blocks)
    # caching changes the work, never the tokens
    assert outputs[a] == reference(SYSTEM_PROMPT + [1, 2, 3])
    assert outputs[b] == reference(SYSTEM_PROMPT + [9, 9])
    assert outputs[c] == reference(SYSTEM_PROMPT + [4, 4, 4, 4, 5])


def test_v07_prefix_cache_survives_preemption_in_a_tight_pool() -> None:
    engine = load("v07", "llm_engine").llm_engine.LLMEngine(num_blocks=7, block_size=2, max_num_seqs=4)
    prompts = [SYSTEM_PROMPT[:5] + [i] for i in (1, 2, 3)] + [SYSTEM_PROMPT[:4]]
    seq_ids = [engine.add_request(p, MAX_TOKENS) for p in prompts]
    steps = run_to_end(engine)
    assert sum(len(s.preempted_seq_ids) for s in steps) > 0
    assert engine.block_manager.num_prefix_hits > 0
    assert all(block.ref_count == 0 for block in engine.block_manager.blocks)
    outputs = {r.seq_id: list(r.completion_token_ids) for s in steps for r in s.finished}
    assert [outputs[i] for i in seq_ids] == [reference(p) for p in prompts]


def test_v07_block_hashes_are_chained() -> None:
    compute_hash = load("v07", "block_manager").block_manager.compute_hash
    block = [1, 2, 3, 4]
    assert compute_hash(block, -1) == compute_hash(block, -1)
    assert compute_hash(block, compute_hash([5, 6, 7, 8], -1)) != compute_hash(block, -1)


def test_v07_whole_prompt_cached_still_computes_the_last_token() -> None:
    engine = load("v07", "llm_engine").llm_engine.LLMEngine(num_blocks=12, block_size=4)
    engine.generate([SYSTEM_PROMPT], 1)
    engine.add_request(SYSTEM_PROMPT, 1)
    out = engine.step()
    assert out.model_input.input_ids == tuple(SYSTEM_PROMPT[4:])  # block 2 holds the last token
    assert out.new_tokens[0][1] == reference(SYSTEM_PROMPT, 1)[0]


# ----------------------------------------------------------------------------- v08

def test_v08_same_seed_same_output_whatever_the_batch() -> None:
    mods = load("v08", "llm_engine", "sampling_params")
    SamplingParams, LLMEngine = mods.sampling_params.SamplingParams, mods.llm_engine.LLMEngine
    seeded = SamplingParams(temperature=1.0, top_k=8, seed=7, max_tokens=10, ignore_eos=True)
    noisy = SamplingParams(temperature=1.5, max_tokens=10)
    alone = LLMEngine().generate([PROMPTS[2]], seeded)[0]
    again = LLMEngine().generate([PROMPTS[2]], seeded)[0]
    batched = LLMEngine().generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], [noisy, seeded, noisy])[1]
    assert alone == again == batched
    other = LLMEngine().generate([PROMPTS[2]], SamplingParams(temperature=1.0, top_k=8, seed=8,
                                                             max_tokens=10, ignore_eos=True))[0]
    assert other != alone
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    assert alone != reference(PROMPTS[2], 10)  # sampling really samples
    assert LLMEngine().generate(PROMPTS, greedy) == [reference(p) for p in PROMPTS]
    top1 = SamplingParams(temperature=2.0, top_k=1, seed=1, max_tokens=MAX_TOKENS)
    assert LLMEngine().generate(PROMPTS, top1) == [reference(p) for p in PROMPTS]


def test_v08_seeded_outputs_survive_preemption() -> None:
    mods = load("v08", "llm_engine", "sampling_params")
    params = [mods.sampling_params.SamplingParams(temperature=1.0, seed=i, max_tokens=8, ignore_eos=True)
              for i in range(4)]
    alone = [mods.llm_engine.LLMEngine(num_blocks=32).generate([p], [sp])[0]
             for p, sp in zip(PROMPTS[:4], params)]
    engine = mods.llm_engine.LLMEngine(num_blocks=6, block_size=4, max_num_seqs=4)
    seq_ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:4], params)]
    steps = run_to_end(engine)
    assert sum(len(s.preempted_seq_ids) for s in steps) > 0
    outputs = {r.seq_id: list(r.completion_token_ids) for s in steps for r in s.finished}
    assert [outputs[i] for i in seq_ids] == alone


def test_v08_sampling_params_are_validated() -> None:
    SamplingParams = load("v08", "sampling_params").sampling_params.SamplingParams
    for bad in (dict(temperature=-0.1), dict(top_k=0), dict(seed=-1), dict(max_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_v08_sampler_applies_temperature_and_top_k() -> None:
    import torch

    sampler = load("v08", "sampler").sampler.Sampler()
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]] * 3)  # (B=3, V=4)
    temperatures = torch.tensor([0.0, 1.0, 100.0])
    top_ks = torch.tensor([-1, 1, 2])
    for seed in range(20):
        gens = [None] + [torch.Generator().manual_seed(seed) for _ in range(2)]
        greedy, top1, top2 = sampler(logits, temperatures, top_ks, gens)
        assert greedy == 2 and top1 == 2 and top2 in (2, 3)


# ----------------------------------------------------------------------------- v09

def test_v09_samples_a_real_transformer_behind_the_runner_contract() -> None:
    import torch

    mods = load("v09", "llm_engine", "sampling_params", "model_runner", "sequence")
    engine = mods.llm_engine.LLMEngine(num_blocks=16, block_size=4)
    runner = engine.model_runner
    assert isinstance(runner.model, torch.nn.Module)
    assert sum(p.numel() for p in runner.model.parameters()) > 1000
    assert isinstance(runner, mods.model_runner.ModelRunner)
    greedy = mods.sampling_params.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [SYSTEM_PROMPT + [1, 2, 3], SYSTEM_PROMPT + [9, 9], [11, 4, 7]]
    seq_ids = [engine.add_request(p, greedy) for p in prompts]
    outputs = {}
    while not engine.is_finished():
        out = engine.step()
        logits = runner.last_logits
        assert logits.shape == (len(out.scheduled_seq_ids), 64)
        # the tokens are the argmax of the model's real logits
        assert [tok for _, tok in out.new_tokens] == logits.argmax(dim=-1).tolist()
        outputs.update({r.seq_id: list(r.completion_token_ids) for r in out.finished})
    assert engine.block_manager.num_prefix_hits >= 2
    # paged, batched, prefix-shared decoding == recomputing the same model with no cache
    model = runner.model
    with torch.inference_mode():
        for seq_id, prompt in zip(seq_ids, prompts):
            tokens = list(prompt)
            for _ in range(4):
                tokens.append(int(model.reference_logits(tokens)[-1].argmax()))
            assert outputs[seq_id] == tokens[len(prompt):]
            full = model.reference_logits(prompt + outputs[seq_id][:-1])
            seq = mods.sequence.Sequence(99, prompt + outputs[seq_id][:-1], greedy, 4)
            fresh = mods.model_runner.ModelRunner(4, 4, engine.model_config)
            seq.block_table = [3, 0, 2, 1][:seq.num_blocks]  # any non-contiguous pages work
            fresh.run([seq], is_prefill=True)
            assert torch.allclose(fresh.last_logits[0], full[-1], atol=1e-5)


def test_v09_seeded_sampling_is_reproducible() -> None:
    mods = load("v09", "llm_engine", "sampling_params")
    params = mods.sampling_params.SamplingParams(temperature=0.8, top_k=10, seed=1, max_tokens=6,
                                                 ignore_eos=True)
    one = mods.llm_engine.LLMEngine().generate([[11, 4, 7]], params)[0]
    two = mods.llm_engine.LLMEngine().generate([[5, 9], [11, 4, 7]], [params, params])[1]
    assert one == two


def test_v09_does_not_import_nanoengine() -> None:
    for path in (VERSIONS / V["v09"]).glob("*.py"):
        assert "nanoengine" not in path.read_text(), path
    before = {name for name in sys.modules if name.startswith("nanoengine")}
    load("v09", "llm_engine", "run")
    assert {name for name in sys.modules if name.startswith("nanoengine")} == before


# ------------------------------------------------------------------ across versions

@pytest.mark.parametrize("version", ["v02", "v03", "v04", "v05", "v06", "v07"])
def test_every_toy_engine_reproduces_the_naive_loop(version: str) -> None:
    engine = load(version, "llm_engine").llm_engine.LLMEngine()
    assert engine.generate(PROMPTS, MAX_TOKENS) == [reference(p) for p in PROMPTS]
