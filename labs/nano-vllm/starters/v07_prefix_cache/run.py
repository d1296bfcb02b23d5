"""v07 - watch requests with a shared prefix reuse each other's KV blocks (card 11).

Three requests start with the same 8-token "system prompt" (two full blocks of 4).
- seq 0 and seq 1 are admitted in the same step: seq 0 computes the prefix and
  publishes its two blocks; seq 1 finds them (2 prefix hits), computes only its own
  tokens, and the two shared blocks get ``ref_count`` 2.
- seq 2 arrives after both have finished. Their blocks are back in the free queue, but
  still hold their hashes and KV, so seq 2 hits them too and takes them back.
At the end every ref count is back to 0.

Run:  python labs/nano-vllm/versions/v07_prefix_cache/run.py
"""

from llm_engine import LLMEngine

SYSTEM_PROMPT = [21, 22, 23, 24, 25, 26, 27, 28]


def run_until_idle(engine: LLMEngine, step: int) -> int:
    bm = engine.block_manager
    while not engine.is_finished():
        out = engine.step()
        inp = out.model_input
        kind = "PREFILL" if out.is_prefill else "DECODE "
        print(f"step {step:2d} {kind} batch={list(out.scheduled_seq_ids)} "
              f"-> {['seq%d+%d' % pair for pair in out.new_tokens]}")
        if out.is_prefill:
            for i, seq_id in enumerate(out.scheduled_seq_ids):
                table = out.block_tables[seq_id]
                computed = inp.cu_seqlens_q[i + 1] - inp.cu_seqlens_q[i]
                cached = out.context_lens[seq_id] - computed
                print(f"        seq {seq_id}: block_table={list(table)}  prefix hit: {cached} tokens "
                      f"cached, {computed} computed")
            shared = sorted({b for table in out.block_tables.values() for b in table})
            print("        ref_count: " + " ".join(f"block{b}={bm.blocks[b].ref_count}" for b in shared))
        for done in out.finished:
            print(f"        seq {done.seq_id} FINISHED -> {list(done.completion_token_ids)}")
        step += 1
    return step


def main() -> None:
    engine = LLMEngine(num_blocks=12, block_size=4, max_num_seqs=4)
    bm = engine.block_manager
    print(f"v07 prefix cache: block_size=4, shared system prompt of {len(SYSTEM_PROMPT)} tokens")
    engine.add_request(SYSTEM_PROMPT + [1, 2, 3], max_tokens=3)
    engine.add_request(SYSTEM_PROMPT + [9, 9], max_tokens=3)
    step = run_until_idle(engine, 0)
    print(f"        after both finished: free blocks {bm.num_free_blocks}/{bm.num_blocks}, "
          f"cached hashes kept: {len(bm.hash_to_block_id)}")
    engine.add_request(SYSTEM_PROMPT + [4, 4, 4, 4, 5], max_tokens=3)
    run_until_idle(engine, step)
    print(f"prefix hits: {bm.num_prefix_hits} of {bm.num_prefix_queries} full blocks looked up")
    print(f"ref counts after all requests finished: {sorted({b.ref_count for b in bm.blocks})}"
          f" (all zero: {all(b.ref_count == 0 for b in bm.blocks)})")


if __name__ == "__main__":
    main()
