"""v07 checks - the prefix cache: chained block hashes, shared blocks, ref counts (card 11)."""

from lab_harness import MAX_TOKENS, PROMPTS, SYSTEM_PROMPT, check_transcript, reference, run_to_end


def test_block_hashes_are_chained(lab) -> None:
    """compute_hash is deterministic, never -1, and depends on the parent block's hash.

    Hint: feed the parent hash into the hash before the tokens, so equal tokens after a
    different prefix get a different hash; keep the result in [0, 2**63).
    """
    compute_hash = lab.load("block_manager").block_manager.compute_hash
    block = [1, 2, 3, 4]
    assert compute_hash(block, -1) == compute_hash(list(block), -1)
    parent = compute_hash([5, 6, 7, 8], -1)
    assert compute_hash(block, parent) != compute_hash(block, -1)
    assert compute_hash([1, 2, 3, 5], -1) != compute_hash(block, -1)
    assert all(0 <= h < 2 ** 63 for h in (parent, compute_hash(block, parent)))


def test_prefix_blocks_are_reused_and_ref_counts_return_to_zero(lab) -> None:
    """Two requests with one system prompt share its blocks (ref_count 2); all counts end at 0.

    Hint: allocate looks up each full block (not the one with the last token) while nothing
    has missed; a hit is _share_block + num_prefix_hits + num_cached_tokens; deallocate
    decrements and frees at zero but keeps the hash, so a later request can still hit.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(num_blocks=12, block_size=4)
    bm = engine.block_manager
    a = engine.add_request(SYSTEM_PROMPT + [1, 2, 3], MAX_TOKENS)
    b = engine.add_request(SYSTEM_PROMPT + [9, 9], MAX_TOKENS)
    first = engine.step()
    assert first.is_prefill
    table_a, table_b = first.block_tables[a], first.block_tables[b]
    assert table_a[:2] == table_b[:2] and table_a[2] != table_b[2], (table_a, table_b)
    assert [bm.blocks[x].ref_count for x in table_b[:2]] == [2, 2]
    assert bm.num_prefix_hits == 2
    rows = first.model_input.cu_seqlens_q
    assert rows[2] - rows[1] == 2, "seq b must compute only its own two tokens"
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
    c = engine.add_request(SYSTEM_PROMPT + [4, 4, 4, 4, 5], MAX_TOKENS)  # after both finished
    hits_before = bm.num_prefix_hits
    outputs.update({r.seq_id: list(r.completion_token_ids) for s in run_to_end(engine) for r in s.finished})
    assert bm.num_prefix_hits - hits_before == 2, "freed blocks keep their hash and can be hit"
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert outputs[a] == reference(SYSTEM_PROMPT + [1, 2, 3])
    assert outputs[b] == reference(SYSTEM_PROMPT + [9, 9])
    assert outputs[c] == reference(SYSTEM_PROMPT + [4, 4, 4, 4, 5])


def test_whole_prompt_cached_still_computes_the_last_token(lab) -> None:
    """Even when every block is cached, the block holding the last prompt token is computed.

    Hint: only look up block i when (i + 1) * block_size < len(seq); prepare_prefill starts
    each sequence at seq.num_cached_tokens.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(num_blocks=12, block_size=4)
    engine.generate([SYSTEM_PROMPT], 1)
    engine.add_request(SYSTEM_PROMPT, 1)
    out = engine.step()
    assert out.model_input.input_ids == tuple(SYSTEM_PROMPT[4:]), out.model_input
    assert out.model_input.context_lens == (len(SYSTEM_PROMPT),)
    assert out.new_tokens[0][1] == reference(SYSTEM_PROMPT, 1)[0]


def test_a_block_filled_by_decoding_is_published(lab) -> None:
    """A block filled by generated tokens gets its hash, so a later request can hit it.

    Hint: in may_append, when len(seq) % block_size == 0 the token being written completes
    a block: _register it with the previous block's hash as parent.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(num_blocks=12, block_size=4)
    bm = engine.block_manager
    prompt = [7, 7, 1, 5, 3, 2]  # 6 tokens: block 0 full, block 1 filled by decoding
    completion = engine.generate([prompt], 4)[0]
    assert len(completion) == 4
    hits_before = bm.num_prefix_hits
    engine.generate([prompt + completion + [1]], 1)
    assert bm.num_prefix_hits - hits_before == 2, "blocks 0 and 1 (filled while decoding) should hit"


def test_prefix_cache_survives_preemption_in_a_tight_pool(lab) -> None:
    """Prefix sharing and preemption together: outputs are exact and ref counts end at 0.

    Hint: deallocate must handle shared blocks (decrement, free only at zero) and reset
    seq.num_cached_tokens, because a preempted request is looked up again on readmission.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(num_blocks=7, block_size=2, max_num_seqs=4)
    prompts = [SYSTEM_PROMPT[:5] + [i] for i in (1, 2, 3)] + [SYSTEM_PROMPT[:4]]
    seq_ids = [engine.add_request(p, MAX_TOKENS) for p in prompts]
    steps = run_to_end(engine)
    assert sum(len(s.preempted_seq_ids) for s in steps) > 0
    assert engine.block_manager.num_prefix_hits > 0
    assert all(block.ref_count == 0 for block in engine.block_manager.blocks)
    outputs = {r.seq_id: list(r.completion_token_ids) for s in steps for r in s.finished}
    assert [outputs[i] for i in seq_ids] == [reference(p) for p in prompts]


def test_generate_reproduces_the_naive_loop(lab) -> None:
    """generate returns v00's tokens for every prompt: a cache hit saves work, never changes tokens.

    Hint: a hit must also compare the stored token ids (hash collisions), and the chain must
    pass through every full block.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine()
    assert engine.generate(PROMPTS, MAX_TOKENS) == [reference(p) for p in PROMPTS]


def test_run_prints_the_expected_transcript(lab) -> None:
    """run.py prints exactly versions/v07_prefix_cache/expected_output.txt.

    Hint: block ids depend on the free queue: fresh blocks from the left, freed ones to the right.
    """
    check_transcript(lab)
