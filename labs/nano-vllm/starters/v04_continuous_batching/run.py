"""v04 - watch continuous batching: several decodes per step, refills mid-flight (card 8).

Four requests with different budgets, at most three running at once. Watch for:
- a PREFILL step that admits several requests together;
- DECODE steps whose batch lists several sequences (one token each);
- when a request finishes, the waiting one is admitted on the very next step, while the
  others keep decoding - no one waits for the whole batch to end.

Run:  python labs/nano-vllm/versions/v04_continuous_batching/run.py
"""

from llm_engine import LLMEngine


def main() -> None:
    engine = LLMEngine(max_num_seqs=3, max_num_batched_tokens=64)
    requests = [([5, 9, 13, 2, 8], 6), ([7, 7, 1], 2), ([3, 14, 15, 9, 2, 6, 5], 5), ([11, 4], 3)]
    for prompt, max_tokens in requests:
        engine.add_request(prompt, max_tokens)
    print("v04 continuous batching: max_num_seqs=3, four requests")
    step = 0
    while not engine.is_finished():
        out = engine.step()
        kind = "PREFILL" if out.is_prefill else "DECODE "
        tokens = " ".join(f"seq{sid}+{tok}" for sid, tok in out.new_tokens)
        waiting = [seq.seq_id for seq in engine.scheduler.waiting]
        print(f"step {step:2d} {kind} batch={list(out.scheduled_seq_ids)} "
              f"({out.num_input_tokens} tokens in) -> {tokens:28s} waiting={waiting}")
        for done in out.finished:
            print(f"        seq {done.seq_id} FINISHED -> {list(done.completion_token_ids)}")
        step += 1


if __name__ == "__main__":
    main()
