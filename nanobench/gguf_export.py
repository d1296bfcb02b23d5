"""Write the engine's own weights back into a llama.cpp GGUF file, at the engine's dtype.

A race between two engines is only fair when both compute with the same numbers. The
course's default model reaches us as a Q4_1 GGUF (``nanoengine.default_model``): the engine
dequantizes it once to float32 and computes with those float32 weights, or with them
rounded to bfloat16 (``--dtype bfloat16``). Handing llama.cpp the shipped Q4_1 file would
race a 4-bit engine against a 32-bit one. So this module goes the other way: it takes the
engine's state dict and writes a GGUF that llama.cpp loads, holding exactly those weights.

Three formats (:data:`GGUF_FORMATS`):

* ``float32``: every tensor F32, the engine's float32 weights bit for bit;
* ``bfloat16``: the matrices BF16, rounded by torch exactly as the engine rounds them
  (``tensor.to(torch.bfloat16)``); the 1-D norm weights stay F32, as llama.cpp's own
  converter keeps them, but hold the bfloat16-rounded values, so they are still the
  engine's numbers;
* ``q8_0``: the matrices in llama.cpp's Q8_0 (blocks of 32 int8 values with one float16
  scale each), quantized from the float32 weights by the ``gguf`` package. This is a
  *different precision* from anything the engine runs: it is there to show what a
  quantized format buys a memory-bound decoder, not as a like-for-like peer.

What the writer must get right:

* every metadata key of the shipped file is copied (the ``llama.*`` hyperparameters, the
  whole tokenizer, the chat template), except ``general.file_type``, which now names the
  new format;
* tensors get llama.cpp's names (``model.layers.3.self_attn.q_proj.weight`` ->
  ``blk.3.attn_q.weight``), the inverse of the loader's table;
* the rows of ``attn_q`` and ``attn_k`` are put back in llama.cpp's rotary order:
  :func:`permute_rotary` is the exact inverse of the loader's
  ``nanoengine.loader.gguf.unpermute_rotary``. Forget it and llama.cpp still runs, and
  writes gibberish.

The round trip is the test (``tests/measure/test_gguf_export.py``): a file written here and
read back by the engine's own loader gives the identical state dict.

:func:`default_model_gguf` converts the default model once per format and caches the file
next to the default model's own cache (``$NANOENGINE_CACHE``, else ``~/.cache/nanoengine``);
``./course llamacpp-setup`` makes them all. ``python -m nanobench.gguf_export`` prints
their paths, converting what is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["GGUF_FORMATS", "GgufFormat", "default_model_gguf", "default_model_gguf_dir", "gguf_tensor_name",
           "permute_rotary", "write_engine_gguf"]

#: Bump when the files written here change; a cache from another version is written anew.
EXPORT_VERSION = 1


@dataclass(frozen=True)
class GgufFormat:
    """One output format: how the matrices are stored and what the file says it is."""

    name: str  # the name used on the command line and in the results
    file_suffix: str  # SmolLM2-135M-Instruct.<suffix>.gguf, llama.cpp's naming habit
    matrix_type: str  # gguf.GGMLQuantizationType member for 2-D tensors (1-D ones are always F32)
    file_type: str  # gguf.LlamaFileType member, written as general.file_type
    engine_dtype: torch.dtype  # the engine dtype whose weights it holds (q8_0: quantized from float32)


GGUF_FORMATS: dict[str, GgufFormat] = {
    "float32": GgufFormat("float32", "F32", "F32", "ALL_F32", torch.float32),
    "bfloat16": GgufFormat("bfloat16", "BF16", "BF16", "MOSTLY_BF16", torch.bfloat16),
    "q8_0": GgufFormat("q8_0", "Q8_0", "Q8_0", "MOSTLY_Q8_0", torch.float32),
}


def _format(name: str) -> GgufFormat:
    if name not in GGUF_FORMATS:
        raise ValueError(f"unknown GGUF format {name!r}: choose one of {', '.join(GGUF_FORMATS)}")
    return GGUF_FORMATS[name]


# ------------------------------------------------------------------------------- Names and rows


def permute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Put attn_q / attn_k rows back in llama.cpp's rotary order: the inverse of ``unpermute_rotary``.

    Within each head the engine keeps Hugging Face's "rotate half" order
    ``[a_0 .. a_{h/2-1}, b_0 .. b_{h/2-1}]`` (``a_j`` rotates with ``b_j``); llama.cpp
    wants the pairs adjacent, ``[a_0, b_0, a_1, b_1, ...]``. Viewing each head as
    ``(2, h/2)`` and transposing to ``(h/2, 2)`` interleaves them. ``n_heads``: query
    heads for q, KV heads for k.
    """
    out_features, in_features = weight.shape[0], weight.shape[1:]
    if out_features % (2 * n_heads):
        raise ValueError(f"cannot permute a weight with {out_features} rows into {n_heads} heads of even size")
    half = out_features // n_heads // 2
    return (
        weight.reshape(n_heads, 2, half, *in_features)  # (nh, 2, hd/2, in) rotate-half order
        .transpose(1, 2)  # (nh, hd/2, 2, in) llama.cpp's adjacent pairs
        .reshape(weight.shape)
        .contiguous()
    )


def gguf_tensor_name(hf_name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight`` (the loader's table, inverted)."""
    # The loader's own tables, read backwards, so the two directions cannot drift apart.
    from nanoengine.loader.gguf import _GLOBAL_TENSORS, _LAYER_TENSORS

    stem, _, suffix = hf_name.rpartition(".")
    for gguf_stem, hf_stem in _GLOBAL_TENSORS.items():
        if stem == hf_stem:
            return f"{gguf_stem}.{suffix}"
    parts = stem.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        for gguf_stem, hf_stem in _LAYER_TENSORS.items():
            if parts[3] == hf_stem:
                return f"blk.{parts[2]}.{gguf_stem}.{suffix}"
    raise ValueError(f"no llama.cpp name for tensor {hf_name!r}: only Llama's tensors are written")


# ------------------------------------------------------------------------------------- Writing


def _tensor_data(weight: torch.Tensor, fmt: GgufFormat):
    """``(array, raw_type)`` for GGUFWriter.add_tensor: the bytes llama.cpp will read."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    values = weight.detach().to(torch.float32).cpu()
    if weight.dim() == 1 or fmt.matrix_type == "F32":
        # 1-D tensors stay F32 (llama.cpp's habit), holding the engine's values in its dtype.
        return values.to(fmt.engine_dtype).to(torch.float32).numpy(), None
    if fmt.matrix_type == "BF16":
        # torch rounds exactly as the engine's .to(torch.bfloat16) does; GGUF wants the raw bits.
        bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
        return bits, GGMLQuantizationType.BF16
    kind = GGMLQuantizationType[fmt.matrix_type]
    return quantize(values.numpy(), kind), kind


def write_engine_gguf(state_dict: dict[str, torch.Tensor], metadata_from: str | os.PathLike,
                      out_path: str | os.PathLike, fmt: str = "float32") -> Path:
    """Write ``state_dict`` (Hugging Face Llama names, the engine's weights) as a GGUF file.

    ``metadata_from``: a llama GGUF whose metadata (hyperparameters, tokenizer, chat
    template) describes these weights, e.g. the shipped Q4_1 file; every key is copied but
    ``general.file_type``. ``fmt``: a key of :data:`GGUF_FORMATS`. The tensors follow the
    source file's order; q/k rows are permuted back (:func:`permute_rotary`). The file is
    written under a temporary name and renamed into place, so a crash leaves no file that
    looks complete. Returns ``out_path``.
    """
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

    from nanoengine.loader.gguf import read_gguf_config

    fmt_info = _format(fmt)
    reader = GGUFReader(metadata_from)
    config = read_gguf_config(reader)  # also refuses a non-Llama file
    by_gguf_name = {gguf_tensor_name(name): name for name in state_dict}
    source_names = [t.name for t in reader.tensors]
    if set(source_names) != set(by_gguf_name):
        missing, extra = set(source_names) - set(by_gguf_name), set(by_gguf_name) - set(source_names)
        raise ValueError(f"the state dict does not match {os.fspath(metadata_from)}'s tensors: missing "
                         f"{sorted(missing)[:5]}, not in the file {sorted(extra)[:5]}")

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.tmp-", dir=out_path.parent)
    os.close(handle)
    try:
        arch = reader.fields["general.architecture"].contents()
        writer = GGUFWriter(tmp_name, arch)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
                continue
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), value_type, sub_type=sub_type)
        writer.add_file_type(int(LlamaFileType[fmt_info.file_type]))

        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        for gguf_name in source_names:
            weight = state_dict[by_gguf_name[gguf_name]]
            kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else None
            if kind in heads:
                weight = permute_rotary(weight, heads[kind])
            data, raw_type = _tensor_data(weight, fmt_info)
            writer.add_tensor(gguf_name, data, raw_dtype=raw_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        umask = os.umask(0)  # mkstemp made it private (0600): give it a cache file's usual mode
        os.umask(umask)
        os.chmod(tmp_name, 0o666 & ~umask)
        os.replace(tmp_name, out_path)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return out_path


# ---------------------------------------------------------------------- The default model's files


def default_model_gguf_dir() -> Path:
    """Where the default model's converted GGUFs are cached: beside its Hugging Face directory."""
    from nanoengine.default_model import default_model_dir

    model_dir = default_model_dir()
    return model_dir.with_name(f"{model_dir.name}-gguf-v{EXPORT_VERSION}")


def default_model_gguf(fmt: str = "float32", rebuild: bool = False) -> Path:
    """The default model's weights, as the engine computes with them, in a GGUF of format ``fmt``.

    Converted once (seconds; q8_0 longer) from the engine's cached ``model.safetensors``,
    with the shipped Q4_1 file's metadata, then reused.
    """
    from safetensors.torch import load_file

    from nanoengine.default_model import DEFAULT_MODEL_NAME, default_gguf_path, default_model_dir

    fmt_info = _format(fmt)
    path = default_model_gguf_dir() / f"{DEFAULT_MODEL_NAME}.{fmt_info.file_suffix}.gguf"
    if path.is_file() and not rebuild:
        return path
    print(f"nanobench: writing the engine's weights as {path} (once)", file=sys.stderr)
    state = load_file(str(default_model_dir() / "model.safetensors"))
    return write_engine_gguf(state, default_gguf_path(), path, fmt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanobench.gguf_export",
                                     description="Write the default model's weights, as the engine computes "
                                                 "with them, as llama.cpp GGUF files (once) and print their paths.")
    parser.add_argument("formats", nargs="*", metavar="FORMAT",
                        help=f"which files (default: all of {', '.join(GGUF_FORMATS)})")
    parser.add_argument("--rebuild", action="store_true", help="write them again even if cached")
    args = parser.parse_args(argv)
    unknown = [fmt for fmt in args.formats if fmt not in GGUF_FORMATS]
    if unknown:
        parser.error(f"unknown format {', '.join(unknown)}: choose from {', '.join(GGUF_FORMATS)}")
    for fmt in args.formats or list(GGUF_FORMATS):
        print(f"{fmt}: {default_model_gguf(fmt, rebuild=args.rebuild)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
