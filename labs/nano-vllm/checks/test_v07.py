"""v07 checks - the prefix cache: chained block hashes, shared blocks, ref counts (card 11)."""

from lab_harness import MAX_TOKENS, PROMPTS, SYSTEM_PROMPT, check_transcript, reference, run_to_end


def test_block_hashes_are_chained(lab) -> None:
    """compute_hash is deterministic, never -1, and depends on the parent block's hash.

    Hint: a block's hash must name the whole prefix that ends with it, not only its own tokens:
    the same tokens after a different prefix must get a different hash. It must also be
    repeatable, and able to serve as the next block's parent.
    """
    compute_hash = lab.load("block_manager").block_manager.compute_hash
    block = [1, 2, 3, 4]
    assert compute_hash(block, -1) == compute_hash(list(block), -1), (
        "compute_hash([1, 2, 3, 4], -1) gave two different values for the same input: a hash must "
        "be a pure function of the tokens and the parent (no randomness, no id() of the list)")
    parent = compute_hash([5, 6, 7, 8], -1)
    assert compute_hash(block, parent) != compute_hash(block, -1), (
        "compute_hash([1, 2, 3, 4], parent) equals compute_hash([1, 2, 3, 4], -1): the hash ignores "
        "the parent block's hash, so the same four tokens after a different prefix would be "
        "treated as the same KV")
    assert compute_hash([1, 2, 3, 5], -1) != compute_hash(block, -1), (
        "blocks [1, 2, 3, 4] and [1, 2, 3, 5] got the same hash: every token must go into the hash")
    for h in (parent, compute_hash(block, parent)):
        assert isinstance(h, int) and 0 <= h < 2 ** 63, (
            f"compute_hash returned {h!r}: it must be an int in [0, 2**63), so it is never the "
            "'no hash' marker -1 and fits 8 signed bytes when it becomes the next block's parent")


def test_prefix_blocks_are_reused_and_ref_counts_return_to_zero(lab) -> None:
    """Two requests with one system prompt share its blocks (ref_count 2); all counts end at 0.

    Hint: a shared block has one owner per request using it and is free only when nobody uses
    it; freeing must not forget what it holds, so a later request can still reuse it. Only a
    leading run of full blocks can be reused.
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


P, Q, R = [21, 22, 23, 24], [31, 32, 33, 34], [41, 42, 43, 44]  # three blocks' worth of tokens


def _blocks_of_first_step(engine, prompt: list[int]) -> tuple[tuple[int, ...], int]:
    """Add one request, run its prefill step; return its block table and how many tokens it computed."""
    seq_id = engine.add_request(prompt, 1)
    step = engine.step()
    assert step.is_prefill and seq_id in step.block_tables, "the new request should be prefilled alone"
    return step.block_tables[seq_id], step.num_input_tokens


def test_equal_tokens_after_a_different_prefix_are_not_shared(lab) -> None:
    """Block [R, Q] never reuses the block that holds Q's KV from [P, Q]: a hash names the whole prefix.

    Hint: a cached block stands for everything before it, not only its own tokens. Whatever
    key you look a block up by, and whatever key you publish it under (at admission and when
    decoding fills a block), must depend on the block before it.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(num_blocks=16, block_size=4)
    table_pq, _ = _blocks_of_first_step(engine, P + Q + [1])  # caches [P] and [P, Q]
    table_r, _ = _blocks_of_first_step(engine, R + [2])  # caches [R]
    table_rq, computed = _blocks_of_first_step(engine, R + Q + [3])
    assert table_rq[0] == table_r[0], (
        f"[R, Q, 3] should reuse the cached block of R ({table_r[0]}) as its block 0, "
        f"but its block table is {list(table_rq)}")
    assert table_rq[1] != table_pq[1], (
        f"[R, Q, 3] took block {table_pq[1]} as its block 1: that block holds Q's KV computed after "
        f"P (request [P, Q, 1] has block table {list(table_pq)}). In a real model K and V at a "
        "position depend on every earlier token, so this request would attend to the wrong keys; "
        "the toy model's outputs cannot show it. Its block 1 must be a miss.")
    assert computed == len(Q) + 1, f"[R, Q, 3] should compute Q and its last token (5 tokens), computed {computed}"
    table_q, computed = _blocks_of_first_step(engine, Q + [4])  # Q at position 0: no parent at all
    assert table_q[0] not in (table_pq[1], table_rq[1]), (
        f"[Q, 4] took block {table_q[0]} as its block 0, a block holding Q's KV at positions 4-7 "
        f"after another prefix (block tables {list(table_pq)} and {list(table_rq)}): a first block "
        "has parent -1, a second block has its first block's hash as parent, so they never match")
    assert computed == len(Q) + 1, f"[Q, 4] has nothing cached and should compute 5 tokens, computed {computed}"


def test_a_block_filled_by_decoding_is_chained_to_its_prefix(lab) -> None:
    """A block completed while decoding is published under its whole prefix, not under its tokens alone.

    Hint: when a decode fills a block, its parent is the hash of the block before it in the
    same request, exactly as at admission.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(num_blocks=16, block_size=4)
    prompt = P + [7, 7]  # block 1 = [7, 7, t1, t2] is filled by the first two generated tokens
    completion = engine.generate([prompt], 3)[0]
    filled = [7, 7] + completion[:2]
    assert len(completion) == 3, f"expected 3 generated tokens, got {completion}"
    bm = engine.block_manager
    decoded_blocks = {b.block_id for b in bm.blocks if b.token_ids == tuple(filled)}
    table, computed = _blocks_of_first_step(engine, filled + [5])  # the same 4 tokens at position 0
    assert table[0] not in decoded_blocks, (
        f"[{', '.join(map(str, filled))}, 5] reused block {table[0]} as its block 0, the block a decode "
        f"filled after the prefix {P}: that KV belongs to positions 4-7 after P, so the block must "
        "have been published with block 0's hash as its parent")
    assert computed == len(filled) + 1, f"nothing should hit; computed {computed} of {len(filled) + 1} tokens"


def test_whole_prompt_cached_still_computes_the_last_token(lab) -> None:
    """Even when every block is cached, the block holding the last prompt token is computed.

    Hint: the model must run on at least the last prompt token to produce the next one, so the
    block holding it is never taken from the cache, and the prefill starts after what was
    cached.
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

    Hint: a block filled by generated tokens holds finished KV just like a prompt block: publish
    it when the token that completes it is written, so a follow-up request (the next turn of a
    chat) can reuse it.
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

    Hint: an evicted request gives back only its own references to shared blocks, and forgets
    what it had found in the cache: it is looked up again when readmitted.
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

    Hint: a cache hit saves work but must never change tokens: a hash match is only a hit when
    the stored tokens match too, and every full block must carry the chain forward.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine()
    assert engine.generate(PROMPTS, MAX_TOKENS) == [reference(p) for p in PROMPTS]


def test_run_prints_the_expected_transcript(lab) -> None:
    """run.py prints exactly versions/v07_prefix_cache/expected_output.txt.

    Hint: block ids depend on the free queue's order (fresh blocks from one end, freed ones to
    the other) and on which blocks hit.
    """
    check_transcript(lab)
