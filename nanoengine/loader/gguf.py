"""Read a llama.cpp GGUF file into a Hugging Face config, state dict and tokenizer.

GGUF is llama.cpp's single-file format: typed key/value metadata (architecture, sizes, the whole
tokenizer, the chat template) followed by tensors that are usually quantized (Q4_1: each block of 32
weights as 4-bit integers plus a float16 scale and minimum). The course's default model comes as one
(``nanoengine.default_model``); dequantized, it gives the weights llama.cpp computes with, not the originals.

The one real quirk: llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k``;
:func:`unpermute_rotary` undoes it at load time, so model code stays clean. Get it wrong and the model
still runs but writes gibberish: ``tests/engine/test_default_model.py`` generates text with transformers.
Only ``general.architecture == "llama"`` (Llama 1/2/3, Mistral, SmolLM2) is supported; anything else
raises a ``ValueError`` that names it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["SUPPORTED_ARCHITECTURES", "read_gguf_metadata", "read_gguf_config", "iter_gguf_weights",
           "load_gguf_state_dict", "unpermute_rotary", "gguf_tokenizer_files"]

PathLike = str | os.PathLike

#: GGUF ``general.architecture`` values this loader understands.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama",)

# GGUF tensor-name stems -> Hugging Face Llama names, global and per layer (``blk.3.attn_q.weight`` ->
# ``model.layers.3.self_attn.q_proj.weight``); the suffix (".weight" / ".bias") is carried over unchanged.
_GLOBAL_TENSORS: dict[str, str] = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def _open(path: PathLike | GGUFReader) -> GGUFReader:
    """Open ``path`` with GGUFReader (a memory map: cheap, tensors are read lazily)."""
    if isinstance(path, GGUFReader):
        return path
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {os.fspath(path)!r}")
    return GGUFReader(path)


def read_gguf_metadata(path: PathLike | GGUFReader) -> dict[str, Any]:
    """Every metadata key (``general.architecture``, ``llama.block_count``, ``tokenizer.ggml.tokens`` ...)
    as a plain Python value; the ``GGUF.*`` pseudo-keys of the file header are skipped."""
    reader = _open(path)
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _f32(value: float) -> float:
    """GGUF stores floats as float32; print them the way a human wrote them (1e-05)."""
    return float(str(np.float32(value)))


def read_gguf_config(path: PathLike | GGUFReader) -> dict[str, Any]:
    """A Hugging Face ``LlamaForCausalLM`` config dict built from the GGUF metadata. GGUFReader indexes every
    metadata item when it opens a file (seconds for SmolLM2's 100k tokenizer strings), so a caller that
    needs config, weights and tokenizer opens one and passes it to each."""
    reader = _open(path)
    meta = read_gguf_metadata(reader)
    tensor_names = {t.name for t in reader.tensors}
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        where = os.fspath(path) if isinstance(path, (str, os.PathLike)) else "the GGUF file"
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {where}: this loader supports only "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} (LlamaForCausalLM)")

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ValueError(f"GGUF metadata is missing required key {full!r}")
        return meta[full]

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // n_heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings (rope.dimension_count={rope_dim} != head_dim={head_dim}) "
                         "are not supported by LlamaForCausalLM")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("this GGUF carries rope_freqs.weight (Llama-3.1-style RoPE scaling), which this "
                         "loader does not convert")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = int(meta.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    if vocab_size <= 0:
        raise ValueError("GGUF metadata has neither a vocab_size nor tokenizer.ggml.tokens")

    rope_scaling = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(need("rope.scaling.factor"))}
    elif scaling_type != "none":
        raise ValueError(f"unsupported RoPE scaling type {scaling_type!r} (supported: none, linear)")

    bos, eos, pad = (meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "padding"))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")), "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0)), "rope_scaling": rope_scaling,
        "max_position_embeddings": int(need("context_length")), "vocab_size": vocab_size,
        # No separate output matrix in the file means the LM head reuses the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names, "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "attention_dropout": 0.0, "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos), "pad_token_id": None if pad is None else int(pad),
        "torch_dtype": "float32", "use_cache": True,
    }


def unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of the rotary halves of attn_q / attn_k.

    The converter turned each head's rows ``[a_0 .. a_{h/2-1}, b_0 .. b_{h/2-1}]``
    (Hugging Face "rotate half" order: ``a_j`` rotates with ``b_j``) into
    ``[a_0, b_0, a_1, b_1, ...]`` (adjacent pairs). Viewing each head as
    ``(h/2, 2)`` and transposing to ``(2, h/2)`` restores the halves.
    ``n_heads`` is the number of query heads for q and of KV heads for k.
    """
    out_features, in_features = weight.shape[0], weight.shape[1:]
    if out_features % (2 * n_heads):
        raise ValueError(f"cannot un-permute a weight with {out_features} rows into {n_heads} heads of even size")
    half = out_features // n_heads // 2
    return (
        weight.reshape(n_heads, half, 2, *in_features)  # (nh, hd/2, 2, in) llama.cpp order
        .transpose(1, 2)  # (nh, 2, hd/2, in) rotate-half order
        .reshape(weight.shape)  # (nh*hd, in)
        .contiguous()
    )


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")


def _to_float32(tensor: Any) -> np.ndarray:
    """Dequantize one ReaderTensor to float32 numpy in HF order ``(out_features, in_features)``: GGUFReader's
    data is already a row-major ``(out, bytes_per_row)`` array, and ``dequantize`` expands bytes to elements."""
    data = dequantize(tensor.data, tensor.tensor_type)  # F32/F16 pass through as a cast
    expected = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims fastest-first
    data = np.asarray(data, dtype=np.float32).reshape(expected)
    # F32 tensors come back as read-only views of the memory-mapped file: copy those.
    return data if data.flags.writeable else data.copy()


def iter_gguf_weights(path: PathLike | GGUFReader) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` per tensor (q/k un-permuted), dequantized lazily: peak memory
    stays near one tensor plus what the caller keeps."""
    reader = _open(path)
    config = read_gguf_config(reader)
    n_heads, n_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        weight = torch.from_numpy(_to_float32(tensor))
        if ".self_attn.q_proj." in name:
            weight = unpermute_rotary(weight, n_heads)
        elif ".self_attn.k_proj." in name:
            weight = unpermute_rotary(weight, n_kv_heads)
        yield name, weight


def load_gguf_state_dict(path: PathLike | GGUFReader, progress: bool = True) -> dict[str, torch.Tensor]:
    """Dequantize a whole llama GGUF into ``LlamaForCausalLM.state_dict()``'s names and shapes, float32;
    ``lm_head.weight`` only when the file has its own output matrix (untied embeddings)."""
    reader = _open(path)
    return dict(tqdm(iter_gguf_weights(reader), total=len(reader.tensors), desc="dequantize GGUF", unit="tensor",
                     disable=not progress))


def _bpe_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Rebuild the byte-level BPE tokenizer stored in the GGUF metadata ``meta``.

    ``tokenizer.ggml.tokens`` (the vocabulary in id order, already in GPT-2's byte-to-unicode alphabet:
    ``Ġ`` for a space) and ``tokenizer.ggml.merges`` (the ranked merges) are what ``tokenizers.models.BPE``
    wants. Control tokens (e.g. ``<|im_start|>``) become special added tokens, never split. The
    pre-tokenizer follows ``tokenizer.ggml.pre``: ``smollm`` splits every digit before the GPT-2 regex.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') is supported")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("tokenizer.ggml.tokens contains duplicate tokens")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in ("smollm", "starcoder", "refact"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("default", "gpt2", "gpt-2"):
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: smollm, starcoder, refact, gpt2)")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens([AddedToken(tokens[i], special=(t == _TOKEN_TYPE_CONTROL), normalized=False)
                    for i, t in enumerate(types) if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)])
    return tok


def gguf_tokenizer_files(path: PathLike | GGUFReader) -> dict[str, Any]:
    """Return ``{"tokenizer.json": str, "tokenizer_config.json": dict, "special_tokens_map.json": dict}``;
    the config names the special tokens by their text (the GGUF stores ids), carries the chat template,
    and asks for the generic ``PreTrainedTokenizerFast``, which loads ``tokenizer.json`` as it is."""
    meta = read_gguf_metadata(path)
    tok = _bpe_tokenizer(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    id_keys = {f"{name}_token": f"tokenizer.ggml.{key}_token_id"
               for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    special = {name: tokens[int(meta[key])] for name, key in id_keys.items() if key in meta}
    extra = [tokens[i] for i, t in enumerate(types) if t == _TOKEN_TYPE_CONTROL and tokens[i] not in special.values()]
    arch = meta.get("general.architecture")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(meta.get(f"{arch}.context_length", 2048)),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        **special,
        "additional_special_tokens": extra,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return {"tokenizer.json": tok.to_str(pretty=False), "tokenizer_config.json": config,
            "special_tokens_map.json": {**special, "additional_special_tokens": extra}}
