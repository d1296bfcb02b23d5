"""v02 - watch the request lifecycle through ``LLMEngine.step`` (card 6).

Three requests are added up front; each ``step`` prints who is RUNNING, who is still
WAITING, the token that came out, and which request became FINISHED.

Run:  python labs/nano-vllm/versions/v02_engine_step/run.py
"""

from llm_engine import LLMEngine


def main() -> None:
    engine = LLMEngine()
    prompts = [[5, 9, 13, 2, 8], [7, 7, 1], [11, 4]]
    for prompt in prompts:
        seq_id = engine.add_request(prompt, max_tokens=3)
        print(f"add_request -> seq {seq_id} WAITING  prompt={prompt}")
    step = 0
    while not engine.is_finished():
        out = engine.step()
        running = " ".join(f"{s.seq_id}:{s.status.name}" for s in engine.running) or "-"
        waiting = " ".join(f"{s.seq_id}:{s.status.name}" for s in engine.waiting) or "-"
        tokens = " ".join(f"seq{sid}+{tok}" for sid, tok in out.new_tokens)
        print(f"step {step:2d} | ran {list(out.scheduled_seq_ids)} | {tokens:8s}"
              f" | running: {running:10s} | waiting: {waiting}")
        for done in out.finished:
            print(f"         seq {done.seq_id} FINISHED -> {list(done.completion_token_ids)}")
        step += 1
    print("generate() does the same loop:", LLMEngine().generate(prompts, max_tokens=3))


if __name__ == "__main__":
    main()
