"""The input processor (issue 25 §1.5 and §2): tokenize once the way the tokenizer says, check once.

A tokenizer that adds a BOS token is built here with the ``tokenizers`` library (a word
vocabulary and a post-processor that puts ``<s>`` first), as Llama-3's and TinyLlama's do.
"""

from __future__ import annotations

import pytest

from nanoengine import LLMEngine, SamplingParams
from nanoengine.engine.input_processor import InputProcessor, ProcessedPrompt
from nanoengine.loader.weights import random_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest

WORDS = ["[UNK]", "<s>", "</s>", "hello", "world", "user", "assistant", ":", "the", "end"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")


@pytest.fixture(scope="module")
def bos_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    fast.chat_template = CHAT_TEMPLATE
    assert fast.encode("hello world") == [1, 3, 4]  # the tokenizer itself adds BOS
    return fast


@pytest.fixture(scope="module")
def bos_engine(bos_tokenizer) -> LLMEngine:
    return LLMEngine.from_model(random_model("tiny-llama", std=0.08, vocab_size=16), bos_tokenizer, device="cpu", block_size=4,
                                num_kv_blocks=32, max_model_len=32, max_num_seqs=4)


def test_a_text_prompt_gets_the_bos_its_tokenizer_adds(bos_engine):
    processed = bos_engine.input_processor.process("hello world", SamplingParams(max_tokens=2))
    assert processed.prompt_token_ids == (1, 3, 4) and processed.prompt == "hello world"
    assert bos_engine.tokenize_prompt("hello world") == ("hello world", [1, 3, 4])
    request_id = bos_engine.add_request("hello world", SamplingParams(max_tokens=2))
    assert bos_engine.requests[request_id].prompt_token_ids == [1, 3, 4]
    bos_engine.abort(request_id)


def test_a_chat_prompt_has_the_templates_bos_once(bos_engine):
    messages = [{"role": "user", "content": "hello"}]
    processed = bos_engine.input_processor.process(messages, SamplingParams(max_tokens=2))
    assert processed.prompt == "<s>user : hello assistant :"
    assert processed.prompt_token_ids == (1, 5, 7, 3, 6, 7)  # not (1, 1, ...)
    request_id = bos_engine.add_request(messages, SamplingParams(max_tokens=2))  # the engine takes messages too
    assert bos_engine.requests[request_id].prompt_token_ids == list(processed.prompt_token_ids)
    bos_engine.abort(request_id)


def test_token_id_prompts_are_taken_as_given(bos_engine):
    processed = bos_engine.input_processor.process_tokens([3, 4], SamplingParams(), prompt="hello world")
    assert processed == ProcessedPrompt("hello world", (3, 4), SamplingParams())
    assert bos_engine.input_processor.process([3, 4]).prompt_token_ids == (3, 4)


def test_smollm2s_tokenizer_adds_no_special_tokens(tiny_llama_tok_dir):
    """SmolLM2's text prompts tokenize exactly as before the tokenizer was followed."""
    from nanoengine.loader.weights import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama_tok_dir)
    processor = InputProcessor(tokenizer, vocab_size=49152, max_model_len=512, max_num_seqs=4)
    for text in ("Hello", "The capital of France is", " leading space", "<|im_start|>user\nhi"):
        assert processor.tokenize(text)[1] == tokenizer.encode(text, add_special_tokens=False)


def test_a_processed_prompt_is_queued_without_tokenizing_again(bos_engine, monkeypatch):
    processed = bos_engine.input_processor.process("hello the end", SamplingParams(max_tokens=2))
    calls = []
    monkeypatch.setattr(bos_engine.tokenizer, "encode", lambda *a, **k: calls.append(a) or [3])
    request_id = bos_engine.add_request(processed)
    assert not calls and bos_engine.requests[request_id].prompt_token_ids == [1, 3, 8, 9]
    bos_engine.abort(request_id)


@pytest.mark.parametrize("call, exc, fragments", [
    pytest.param(lambda p: p.process([3, 99]), ValueError, ("[0, ", "99"), id="token outside vocab"),
    pytest.param(lambda p: p.process([3] * 40), ValueError, ("40 tokens", "max_model_len is 32"), id="too long"),
    pytest.param(lambda p: p.process("hello", SamplingParams(n=5)), ValueError, ("n=5", "max_num_seqs is 4"),
                 id="n above max_num_seqs"),
    pytest.param(lambda p: p.process([{"role": "user"}]), ValueError, ("messages must be",), id="bad message"),
    pytest.param(lambda p: p.process_tokens("hello"), TypeError, ("list of integers",), id="tokens as text"),
    pytest.param(lambda p: p.process("hello", {"n": 1}), TypeError, ("SamplingParams",), id="params dict"),
])
def test_bad_prompts_are_refused_by_name(bos_engine, call, exc, fragments):
    with pytest.raises(exc) as info:
        call(bos_engine.input_processor)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    assert not bos_engine.requests
