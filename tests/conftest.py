"""Shared fixtures: tiny random checkpoints saved by Hugging Face transformers.

Saving with transformers' own ``save_pretrained`` means the engine's loader is tested on
real checkpoint layouts, and the same directory serves as the parity reference.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0,
                  rms_norm_eps=1e-5, tie_word_embeddings=True)


def _save_tiny(path: Path, arch: str, with_tokenizer: bool) -> Path:
    import transformers

    torch.manual_seed(0)
    vocab = 49152 if with_tokenizer else 512
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, eos_token_id=2, bos_token_id=1, **TINY_LLAMA)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=32, max_position_embeddings=1024, rope_theta=1e6,
                                          rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=2)
        model = transformers.Qwen3ForCausalLM(config)
    # Real checkpoints are not N(0, 0.02) noise; larger weights give peaked, varied
    # next-token distributions, so greedy tests are not decided by near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.eval().save_pretrained(path)
    if with_tokenizer:
        from nanoengine import default_model_dir

        src = default_model_dir()
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (src / name).exists():
                shutil.copy(src / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama with vocab 512 and no tokenizer (token-id prompts)."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama", with_tokenizer=False)


@pytest.fixture(scope="session")
def tiny_llama_tok_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer (vocab 49152), for text tests."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama-tok"), "llama", with_tokenizer=True)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", with_tokenizer=False)


@pytest.fixture(scope="session")
def default_llm():
    """The real default model (SmolLM2-135M-Instruct), loaded once per test session."""
    from nanoengine import LLM

    return LLM()


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a whole test module (``pytestmark = pytest.mark.usefixtures``).

    Tiny models do microseconds of work per op; OpenMP hand-offs between threads cost far
    more on a busy 2-core box (30x in the scheduler fuzz). Set here, not through the
    widgets' ``single_thread``, so the engine's tests import no widgets; pytest runs the
    line after ``yield`` even when a test fails, so the previous count always comes back.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def build_tiny_llm(tiny_llama_tok_dir):
    """A maker of LLMs on the tiny Llama with SmolLM2's tokenizer, random weights built in
    memory (fast: nothing is loaded from disk after the first call).

    ``build_tiny_llm(config, with_tokenizer=True)`` goes through ``LLMEngine.from_model``;
    ``LLM(...)`` itself is covered by test_engine and test_bad_input's constructor cases.
    """
    from nanoengine import LLM, LLMEngine
    from nanoengine.backends import select_backend
    from nanoengine.loader.weights import build_model, init_random_weights, load_model_config, load_tokenizer

    model_config = load_model_config(tiny_llama_tok_dir)
    tokenizer = load_tokenizer(tiny_llama_tok_dir)

    def make(config: dict, with_tokenizer: bool = True) -> LLM:
        backend = select_backend("cpu", dtype=torch.float32)  # built for the engine's backend
        net = build_model(model_config, torch.device("cpu"), torch.float32, backend=backend)
        init_random_weights(net, seed=0, std=0.08)
        return LLM.from_engine(LLMEngine.from_model(net, tokenizer if with_tokenizer else None, **config))

    return make


@pytest.fixture(scope="session")
def build_site():
    """scripts/build_site.py as a module, imported once per session (for test_site_build and
    the browser's test_site). It is registered in ``sys.modules`` before it runs because its
    dataclasses look their own module up while they are made."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "build_site.py"
    spec = importlib.util.spec_from_file_location("build_site", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_site"] = module
    spec.loader.exec_module(module)
    return module
