"""``LLM``, the user-facing API (chapter 2): vLLM's quickstart runs unchanged on the real model."""

from __future__ import annotations

import pytest

from nanoengine import LLM, SamplingParams

pytestmark = pytest.mark.slow  # loads the default model


def test_vllm_quickstart_runs_unchanged(default_llm):
    # vLLM's offline-inference quickstart, with LLM() in place of LLM(model="facebook/opt-125m").
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    llm = default_llm
    outputs = llm.generate(prompts, sampling_params)
    printed = []
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        printed.append(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    assert [o.prompt for o in outputs] == prompts
    assert all(o.outputs[0].text and len(o.outputs[0].token_ids) <= 16 for o in outputs)
    assert len(printed) == 4


def test_four_completions_of_one_real_prompt_share_its_blocks(default_llm: LLM):
    engine = default_llm.engine
    prompt = default_llm.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    rid = engine.add_request(prompt, SamplingParams(n=4, temperature=0.9, seed=2, max_tokens=8))
    engine.step()  # completion 0 computes the prompt; its three siblings are queued
    engine.step()  # the siblings are admitted, sharing its full prompt blocks
    snap = engine.snapshot()
    mine = [r for r in snap.running if r.parent_id == rid]
    full_blocks = mine[0].num_prompt_tokens // snap.block_size
    assert len(mine) == 4 and full_blocks >= 1
    assert all(snap.blocks[b].ref_count == 4 for b in mine[0].block_ids[:full_blocks])
    final = None
    while engine.has_request(rid):
        final = next((o for o in engine.step() if o.request_id == rid and o.finished), final)
    assert final is not None and len(final.outputs) == 4 and all(c.text for c in final.outputs)
