"""v05 - watch block tables grow, and blocks come back when requests finish (card 9).

A pool of 6 blocks of 4 token slots is shared by four requests. Each step prints every
scheduled request's block table and how many tokens it holds; a finished request's
blocks go back to the free queue. The pool is small on purpose: at one point a running
request needs a new block while none is free, so the newest request is preempted
(its blocks returned) and recomputed later - with the same output.

Run:  python labs/nano-vllm/versions/v05_paged_kv/run.py
"""

from llm_engine import LLMEngine

NUM_BLOCKS = 6
BLOCK_SIZE = 4


def main() -> None:
    engine = LLMEngine(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=3)
    requests = [([5, 9, 13, 2, 8], 6), ([7, 7, 1], 3), ([3, 14, 15, 9, 2, 6, 5], 6), ([11, 4], 5)]
    for prompt, max_tokens in requests:
        engine.add_request(prompt, max_tokens)
    print(f"v05 paged KV: {NUM_BLOCKS} blocks x {BLOCK_SIZE} slots, max_num_seqs=3")
    step = 0
    while not engine.is_finished():
        out = engine.step()
        kind = "PREFILL" if out.is_prefill else "DECODE "
        tokens = " ".join(f"seq{sid}+{tok}" for sid, tok in out.new_tokens)
        print(f"step {step:2d} {kind} batch={list(out.scheduled_seq_ids)} -> {tokens}")
        for seq_id in out.preempted_seq_ids:
            print(f"        PREEMPTED seq {seq_id}: no free block for a running request;"
                  f" its blocks were returned, it will be recomputed")
        tables = "  ".join(f"seq{sid}={list(table)} ({out.context_lens[sid]} tok)"
                           for sid, table in out.block_tables.items())
        print(f"        block_table: {tables}")
        for done in out.finished:
            print(f"        seq {done.seq_id} FINISHED -> {list(done.completion_token_ids)};"
                  f" blocks {list(out.block_tables[done.seq_id])} returned")
        print(f"        free blocks: {engine.block_manager.num_free_blocks}/{NUM_BLOCKS}")
        step += 1
    print(f"all requests finished; free blocks: {engine.block_manager.num_free_blocks}/{NUM_BLOCKS}")


if __name__ == "__main__":
    main()
