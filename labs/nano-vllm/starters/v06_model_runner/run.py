"""v06 - watch the flat batch the ModelRunner hands to the model (card 10).

Same engine behaviour as v05; what is new is the boundary. Each step prints the
``ModelInput`` the runner prepared: the tokens riding the step, their positions, the
``slot_mapping`` telling the model where to write each token's KV, and per sequence the
row range it owns (``cu_seqlens_q``) and how much context it reads.

Run:  python labs/nano-vllm/versions/v06_model_runner/run.py
"""

from llm_engine import LLMEngine


def main() -> None:
    engine = LLMEngine(num_blocks=8, block_size=4, max_num_seqs=2)
    requests = [([5, 9, 13, 2, 8], 3), ([7, 7, 1], 2), ([11, 4], 2)]
    for prompt, max_tokens in requests:
        engine.add_request(prompt, max_tokens)
    print("v06 model runner: scheduler -> ModelRunner.prepare_* -> model.forward")
    step = 0
    while not engine.is_finished():
        out = engine.step()
        inp = out.model_input
        kind = "prepare_prefill" if inp.is_prefill else "prepare_decode "
        print(f"step {step} {kind} seqs={list(out.scheduled_seq_ids)}")
        print(f"    input_ids    = {list(inp.input_ids)}")
        print(f"    positions    = {list(inp.positions)}")
        print(f"    slot_mapping = {list(inp.slot_mapping)}")
        print(f"    cu_seqlens_q = {list(inp.cu_seqlens_q)}  context_lens = {list(inp.context_lens)}"
              f"  block_tables = {[list(t) for t in inp.block_tables]}")
        print(f"    run -> {['seq%d+%d' % pair for pair in out.new_tokens]}")
        for done in out.finished:
            print(f"    seq {done.seq_id} FINISHED -> {list(done.completion_token_ids)}")
        step += 1


if __name__ == "__main__":
    main()
