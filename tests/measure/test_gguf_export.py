"""``nanobench.gguf_export``: the engine's weights written as a llama.cpp GGUF, read back unchanged.

The fast tests build a tiny llama GGUF of their own (a random model's tensors with the
metadata llama.cpp needs), export a state dict with its metadata and read the result with
the engine's own loader (``nanoengine.loader.gguf``): float32 must come back bit for bit,
bfloat16 as the engine's own rounding, Q8_0 within its quantization step. The slow test
does the same with the default model's cached files.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader, GGUFWriter, LlamaFileType

from nanobench.gguf_export import GGUF_FORMATS, gguf_tensor_name, permute_rotary, write_engine_gguf
from nanoengine.loader.gguf import load_gguf_state_dict, read_gguf_metadata, unpermute_rotary

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, VOCAB = 64, 4, 2, 2, 96, 40


def tiny_state_dict() -> dict[str, torch.Tensor]:
    """A random two-layer Llama's tensors, Hugging Face names (tied embeddings: no lm_head)."""
    generator = torch.Generator().manual_seed(0)
    head_dim = HIDDEN // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes.update({
            f"model.layers.{i}.input_layernorm.weight": (HIDDEN,),
            f"model.layers.{i}.self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
            f"model.layers.{i}.self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            f"model.layers.{i}.self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            f"model.layers.{i}.self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
            f"model.layers.{i}.post_attention_layernorm.weight": (HIDDEN,),
            f"model.layers.{i}.mlp.gate_proj.weight": (FFN, HIDDEN),
            f"model.layers.{i}.mlp.up_proj.weight": (FFN, HIDDEN),
            f"model.layers.{i}.mlp.down_proj.weight": (HIDDEN, FFN),
        })
    return {name: torch.randn(shape, generator=generator) * 0.1 for name, shape in shapes.items()}


@pytest.fixture(scope="module")
def source_gguf(tmp_path_factory):
    """A tiny llama GGUF in llama.cpp's layout (q/k rows permuted), F32, with a token list
    and a chat template: the metadata the exporter copies."""
    path = tmp_path_factory.mktemp("gguf-source") / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(int(LlamaFileType.ALL_F32))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_chat_template("{{ messages }}")
    for name, weight in tiny_state_dict().items():
        if ".q_proj." in name:
            weight = permute_rotary(weight, HEADS)
        elif ".k_proj." in name:
            weight = permute_rotary(weight, KV_HEADS)
        writer.add_tensor(gguf_tensor_name(name), weight.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_permute_rotary_is_the_exact_inverse_of_the_loaders_unpermute():
    weight = torch.randn(6 * 8, 5)
    assert torch.equal(unpermute_rotary(permute_rotary(weight, 6), 6), weight)
    assert torch.equal(permute_rotary(unpermute_rotary(weight, 6), 6), weight)
    assert not torch.equal(permute_rotary(weight, 6), weight)  # it does move rows
    # llama.cpp's order: each head's two halves interleaved, a_0 b_0 a_1 b_1 ...
    head = torch.arange(8.0).reshape(8, 1)
    assert permute_rotary(head, 1).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    with pytest.raises(ValueError, match="heads of even size"):
        permute_rotary(torch.randn(6, 2), 2)


def test_tensor_names_are_llamacpps():
    assert gguf_tensor_name("model.layers.3.self_attn.q_proj.weight") == "blk.3.attn_q.weight"
    assert gguf_tensor_name("model.layers.0.mlp.down_proj.weight") == "blk.0.ffn_down.weight"
    assert gguf_tensor_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_tensor_name("lm_head.weight") == "output.weight"
    with pytest.raises(ValueError, match="no llama.cpp name"):
        gguf_tensor_name("model.layers.0.self_attn.rotary_emb.inv_freq")


@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
def test_round_trip_gives_the_engines_weights_exactly(source_gguf, tmp_path, fmt):
    state = tiny_state_dict()
    out = write_engine_gguf(state, source_gguf, tmp_path / f"tiny.{fmt}.gguf", fmt)
    back = load_gguf_state_dict(out, progress=False)
    assert back.keys() == state.keys()
    engine_dtype = GGUF_FORMATS[fmt].engine_dtype
    for name, weight in state.items():
        # what the engine computes with at this dtype, read back as float32 by its loader
        assert torch.equal(back[name], weight.to(engine_dtype).float()), name
    # the metadata is the source's, but for the file type
    source_meta, meta = read_gguf_metadata(source_gguf), read_gguf_metadata(out)
    assert meta["general.file_type"] == int(LlamaFileType[GGUF_FORMATS[fmt].file_type])
    assert {k: v for k, v in meta.items() if k != "general.file_type"} == \
        {k: v for k, v in source_meta.items() if k != "general.file_type"}
    types = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == GGUF_FORMATS[fmt].matrix_type
    assert types["blk.0.attn_norm.weight"] == "F32"  # 1-D tensors stay F32, llama.cpp's habit


def test_q8_0_is_the_float32_weights_within_one_quantization_step(source_gguf, tmp_path):
    state = tiny_state_dict()
    out = write_engine_gguf(state, source_gguf, tmp_path / "tiny.q8_0.gguf", "q8_0")
    back = load_gguf_state_dict(out, progress=False)
    for name, weight in state.items():
        if weight.dim() == 1:
            assert torch.equal(back[name], weight), name
        else:  # each block of 32 has scale max|w| / 127: rounding moves a value by half a step, and
            # the scale's own float16 rounding (2^-11 relative, up to 127 steps) adds under 0.07 of one
            step = weight.abs().reshape(weight.shape[0], -1, 32).amax(-1, keepdim=True) / 127
            error = (back[name] - weight).abs().reshape(step.shape[0], -1, 32)
            assert (error <= step * 0.57).all(), name
            assert not torch.equal(back[name], weight)


def test_bad_input_is_refused_with_what_is_allowed(source_gguf, tmp_path):
    state = tiny_state_dict()
    with pytest.raises(ValueError, match="choose one of float32, bfloat16, q8_0"):
        write_engine_gguf(state, source_gguf, tmp_path / "x.gguf", "float16")
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match="does not match"):
        write_engine_gguf(state, source_gguf, tmp_path / "x.gguf", "float32")
    assert not list(tmp_path.iterdir())  # nothing half-written is left


@pytest.mark.slow  # reads and writes the default model's 540 MB of float32 weights
def test_default_model_float32_file_holds_the_engines_weights():
    from safetensors.torch import load_file

    from nanobench.gguf_export import default_model_gguf
    from nanoengine import default_model_dir

    engine = load_file(str(default_model_dir() / "model.safetensors"))
    back = load_gguf_state_dict(default_model_gguf("float32"), progress=False)
    assert back.keys() == engine.keys()
    assert all(torch.equal(back[name], engine[name]) for name in engine)
