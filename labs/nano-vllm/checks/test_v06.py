"""v06 checks - the model runner boundary: flat batches and slot mappings (card 10)."""

import inspect

from lab_harness import MAX_TOKENS, PROMPTS, check_transcript, reference, run_to_end


def _seqs(lab, tables: list[list[int]], prompts: list[list[int]]):
    Sequence = lab.load("sequence").sequence.Sequence
    seqs = []
    for i, (table, prompt) in enumerate(zip(tables, prompts)):
        seq = Sequence(i, prompt, max_tokens=4, block_size=4)
        seq.block_table = list(table)
        seqs.append(seq)
    return seqs


def test_runner_keeps_the_contract(lab) -> None:
    """ModelRunner has prepare_prefill(seqs), prepare_decode(seqs) and run(seqs, is_prefill).

    Hint: the runner's interface is the contract between scheduling and model execution; later
    versions build on exactly these names and signatures.
    """
    runner_cls = lab.load("model_runner").model_runner.ModelRunner
    assert list(inspect.signature(runner_cls.prepare_prefill).parameters) == ["self", "seqs"]
    assert list(inspect.signature(runner_cls.prepare_decode).parameters) == ["self", "seqs"]
    assert list(inspect.signature(runner_cls.run).parameters) == ["self", "seqs", "is_prefill"]


def test_prepare_prefill_flattens_every_token(lab) -> None:
    """prepare_prefill lists every token of every sequence with its position and slot.

    Hint: the model sees one flat batch: the sequences' tokens back to back, positions
    restarting per sequence, each token's cache slot found through its page table, and offsets
    saying where each sequence's rows begin.
    """
    runner = lab.load("model_runner").model_runner.ModelRunner(num_blocks=8, block_size=4)
    seqs = _seqs(lab, [[2, 5], [0]], [[5, 9, 13, 2, 8], [7, 7, 1]])
    inp = runner.prepare_prefill(seqs)
    assert inp.is_prefill
    assert inp.input_ids == (5, 9, 13, 2, 8, 7, 7, 1)
    assert inp.positions == (0, 1, 2, 3, 4, 0, 1, 2)
    assert inp.slot_mapping == (8, 9, 10, 11, 20, 0, 1, 2)
    assert inp.cu_seqlens_q == (0, 5, 8)
    assert inp.context_lens == (5, 3)
    assert inp.block_tables == ((2, 5), (0,))


def test_prepare_decode_has_one_row_per_sequence(lab) -> None:
    """prepare_decode lists only each sequence's last token, at position len(seq) - 1.

    Hint: a decode gives each sequence exactly one row, its newest token at its last position.
    """
    runner = lab.load("model_runner").model_runner.ModelRunner(num_blocks=8, block_size=4)
    seqs = _seqs(lab, [[2, 5], [0]], [[5, 9, 13, 2, 8, 40], [7, 7, 1, 3]])
    inp = runner.prepare_decode(seqs)
    assert not inp.is_prefill
    assert inp.input_ids == (40, 3)
    assert inp.positions == (5, 3)
    assert inp.slot_mapping == (21, 3)
    assert inp.cu_seqlens_q == (0, 1, 2)
    assert inp.context_lens == (6, 4)
    assert inp.block_tables == ((2, 5), (0,))


def test_model_input_slots_follow_the_block_tables(lab) -> None:
    """Through a whole run, every slot the model writes is the one the block table names.

    Hint: the model writes each row's state to the slot it was given, then reads each sequence's
    whole context back through its page table, never through row order.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine(num_blocks=12, block_size=4)
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
        outputs.update({r.seq_id: list(r.completion_token_ids) for r in out.finished})
    assert [outputs[i] for i in seq_ids] == [reference(p) for p in PROMPTS[:4]]


def test_generate_reproduces_the_naive_loop(lab) -> None:
    """generate returns v00's tokens for every prompt.

    Hint: if the prepare_* checks pass, the model reads a context other than the one it wrote:
    check how it gathers each sequence's features.
    """
    engine = lab.load("llm_engine").llm_engine.LLMEngine()
    assert engine.generate(PROMPTS, MAX_TOKENS) == [reference(p) for p in PROMPTS]


def test_run_prints_the_expected_transcript(lab) -> None:
    """run.py prints exactly versions/v06_model_runner/expected_output.txt.

    Hint: run `python run.py` in your copy and diff its output with expected_output.txt; the
    first differing line tells you which step went another way.
    """
    check_transcript(lab)
