"""Loading a model: build the module tree, then fill it from a checkpoint (chapter 2).

Three sources give the same ``(name, tensor)`` stream in Hugging Face naming: a directory of
``*.safetensors`` files, a GGUF file (``loader.gguf``), or random values for tests and
mechanics-only chapters. ``load_weights`` routes each tensor to its parameter, through the
parameter's ``weight_loader`` when it is packed (qkv, gate_up) or split over tensor-parallel
ranks, and fails loudly on a missing or unexpected tensor instead of running with garbage.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from nanoengine.backends import select_backend
from nanoengine.default_model import default_model_dir
from nanoengine.distributed.parallel_state import TPGroup
from nanoengine.layers.kernels import building_with
from nanoengine.models import MODEL_CLASSES, ModelConfig
from nanoengine.models.presets import PRESETS, TINY_PRESETS


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every ``*.safetensors`` file in ``model_dir``."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into ``model``'s parameters, checking every one is filled."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    shards_expected = Counter(packed_name for packed_name, _ in packed.values())
    filled: Counter[str] = Counter()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # tied: the embedding matrix already is the head
        target, shard_id = name, None
        for fragment, (packed_name, shard) in packed.items():
            if f".{fragment}." in name:
                target, shard_id = name.replace(f".{fragment}.", f".{packed_name}."), shard
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        tensor = tensor.to(device=param.device, dtype=param.dtype)
        if loader is None:
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter {tuple(param.shape)}")
            param.data.copy_(tensor)
        else:
            loader(param, tensor, shard_id)
        filled[target] += 1
    # A packed parameter (``...qkv_proj.weight``) is filled once per shard, any other once.
    missing = [pname for pname in params if filled[pname] < shards_expected.get(pname.split(".")[-2], 1)]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} parameter(s), e.g. {missing[:5]}")


def init_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random weights: N(0, std) matrices, unit norms (tests, mechanics)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
            param.data.copy_(values.to(param.dtype))


def random_model(preset: str | ModelConfig = "tiny-llama", seed: int = 0, std: float = 0.02,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, backend=None,
                 **overrides) -> nn.Module:
    """A model with deterministic random weights: the one factory for tests, widgets and scripts.

    ``preset`` names a shape in ``models.presets`` or is a ``ModelConfig``; ``overrides`` replace config
    fields (e.g. ``vocab_size=512``). A larger ``std`` (0.08) gives peaked next-token distributions, so
    greedy tests are not decided by near-ties. ``backend``: as in ``build_model``.
    """
    if isinstance(preset, str):
        known = {**PRESETS, **TINY_PRESETS}
        if preset not in known:
            raise ValueError(f"unknown model preset {preset!r}; known: {sorted(known)}")
        preset = known[preset]
    config = dataclasses.replace(preset, **overrides)
    model = build_model(config, torch.device(device), dtype, backend=backend)
    init_random_weights(model, seed=seed, std=std)
    return model


def save_pretrained(model: nn.Module, path: str | Path) -> Path:
    """Write ``model`` as a Hugging Face directory (``config.json`` + ``model.safetensors``).

    The inverse of loading: packed parameters are cut back into the checkpoint's tensors (``qkv_proj``
    -> ``q_proj``, ``k_proj``, ``v_proj``; ``gate_up_proj`` -> ``gate_proj``, ``up_proj``). Chapter 9 gives a
    ``random_model`` a directory with it, since tensor-parallel workers load their shards from a
    checkpoint, not from a module in the driver. Only a model built for one rank can be saved.
    """
    from safetensors.torch import save_file

    from nanoengine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    unpacked = {packed: [] for packed, _ in model.packed_modules.values()}
    for fragment, (packed, _) in model.packed_modules.items():
        unpacked[packed].append(fragment)  # in shard order: q, k, v and gate, up
    tensors = {}
    for name, param in model.named_parameters():  # a tied LM head is the embedding matrix: listed once
        module_name, _, pname = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, QKVParallelLinear):
            sizes = [module.num_heads * module.head_dim] + [module.num_kv_heads * module.head_dim] * 2
        elif isinstance(module, MergedColumnParallelLinear):
            sizes = [size // module.tp.size for size in module.output_sizes]
        else:
            tensors[name] = param.detach().cpu().contiguous()
            continue
        if module.tp.size != 1:
            raise ValueError("save_pretrained needs a model built for one rank (tensor_parallel_size 1)")
        parent, _, packed = module_name.rpartition(".")
        for fragment, part in zip(unpacked[packed], param.detach().cpu().split(sizes, dim=0)):
            tensors[f"{parent}.{fragment}.{pname}"] = part.contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
    return path


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                max_position: int | None = None, tp: TPGroup = TPGroup.single(), backend=None) -> nn.Module:
    """The module tree for ``config`` on ``device``, parameters in ``dtype``, unfilled.

    Every layer takes its kernels from ``backend`` (None: the device's default) as it is
    constructed (``layers.kernels``), and the backend places the parameters before anything fills
    them. The model keeps the kernels as ``model.kernels``, which an engine's backend must match.
    """
    backend = backend if backend is not None else select_backend(device, dtype=dtype)
    cls = MODEL_CLASSES[config.architecture]
    with building_with(backend.kernels), torch.device(device):
        model = cls(config, max_position, tp)
    for param in model.parameters():  # buffers (RoPE tables) stay float32
        param.data = param.data.to(dtype)
    backend.place_weights(model)
    model.kernels = backend.kernels
    return model.eval()


def resolve_model_source(model: str | Path | None) -> Path:
    """``None`` -> the default model's directory; otherwise an existing dir or .gguf file."""
    if model is None:
        return default_model_dir()
    expected = "model must be None (the default SmolLM2-135M-Instruct), a Hugging Face directory or a .gguf file"
    if not isinstance(model, (str, Path)) or not str(model):
        raise ValueError(f"{expected}, got {model!r}")
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json (expected a Hugging Face directory)")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ValueError(f"{expected}; {str(model)!r} is neither (no model hub is used)")


def load_model_config(source: Path) -> ModelConfig:
    if source.suffix == ".gguf":
        from nanoengine.loader.gguf import read_gguf_config

        return ModelConfig.from_dict(read_gguf_config(source))
    return ModelConfig.from_pretrained(source)


def load_model(source: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype,
               max_position: int | None = None, tp: TPGroup = TPGroup.single(), backend=None) -> nn.Module:
    """Build the model for ``config`` (with ``backend``'s kernels) and fill it from ``source`` (dir or .gguf)."""
    model = build_model(config, device, dtype, max_position, tp, backend)
    if source.suffix == ".gguf":
        from nanoengine.loader.gguf import load_gguf_state_dict

        load_weights(model, load_gguf_state_dict(source).items())
    else:
        load_weights(model, iter_safetensors(source))
    return model


def load_tokenizer(source: Path):
    """The Hugging Face tokenizer stored with the model, or None if there is none."""
    from transformers import AutoTokenizer

    if source.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    if not any((source / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    return AutoTokenizer.from_pretrained(str(source))
