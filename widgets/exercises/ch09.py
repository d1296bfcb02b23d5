"""Exercise checks of chapter 9 (tensor parallelism): split an MLP, pick a size, count bytes.

Each check takes what the learner wrote or chose and judges what it *does* with the
engine's own pieces, never the text of the code:

* ``check_mlp_split`` (9.1): the learner's ``shard_mlp(gate, up, down, rank, tp)`` cuts a
  real layer of the loaded model into ``EX1_TP`` shares; the check runs every rank's share
  on real hidden states and compares the sum of the partial outputs (what an all-reduce
  would leave on every rank) with the unsplit layer's own output;
* ``check_tp_size`` (9.2): a ``tensor_parallel_size`` and a number of data-parallel replicas for
  Llama-3-70B in bf16 on ``EX2_GPUS`` GPUs of ``EX2_GPU_GB`` GB, each of which must keep at least
  ``EX2_KV_GB`` GB for its KV cache after its share of the weights: the size must pass the
  validation the engine runs before it starts any worker (``check_tensor_parallel_size``), fit,
  be the smallest that fits (a larger one only adds collectives), and the replicas must use as
  many of the GPUs as whole replicas can;
* ``check_crossover_batch`` (9.3): the largest decode batch of Llama-3-8B in bf16 at
  ``tensor_parallel_size=4`` over PCIe whose ring all-reduce bytes take no longer than each
  GPU's read of its weights: the all-reduces counted from the engine's own module tree for
  that shape (built on PyTorch's "meta" device: shapes, no memory), plus the embedding's.

``row_parallel_bytes`` is the counting rule the chapter, the live quiz question and 9.3
share. Section 9's readings (``read_*``) and the GPU results' provenance (``gpu_results``) close
the module.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.layers.linear import RowParallelLinear
from translations import tr
from widgets.exercises import CheckResult, todo, verdict, whole

EX1_TP = 4  # exercise 9.1: ranks to split the MLP over (1536 / 4 = 384 features each)
EX1_LAYER = 15  # exercise 9.1: which decoder layer of the loaded model
EX1_PROMPT = "Tensor parallelism splits every weight matrix over several devices."
EX2_MODEL = "Llama-3-70B"  # exercise 9.2
EX2_GPUS = 12  # GPUs on hand
EX2_GPU_GB = 80  # memory of each (an H100 SXM: NVIDIA H100 datasheet)
EX2_KV_GB = 20  # at least this much of each GPU left for the KV cache
EX2_DTYPE_BYTES = 2  # bf16
EX3_MODEL = "Llama-3-8B"  # exercise 9.3
EX3_TP = 4
EX3_DTYPE = torch.bfloat16
HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3 (NVIDIA H100 datasheet), as in the chapter's section 9
NVLINK_BYTES_PER_S = 450e9  # H100 SXM, NVLink 4: 900 GB/s per GPU counts both directions, 450 each way (datasheet)
PCIE_BYTES_PER_S = 64e9  # PCIe Gen5 x16, each way (same datasheet)


# ------------------------------------------------------------------ shared rule
def row_parallel_bytes(model: nn.Module, num_tokens: int, dtype_bytes: int) -> tuple[int, int]:
    """(number of row-parallel layers, bytes their all-reduces carry for ``num_tokens`` tokens).

    Every ``RowParallelLinear`` ends in one all-reduce of a (tokens, output features) tensor
    of partial sums: each rank contributes that whole tensor, whatever the rank count.
    """
    rows = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    return len(rows), sum(num_tokens * m.weight.shape[0] * dtype_bytes for m in rows)


def _model_of(llm):
    """The model of a one-process ``LLM`` or ``LLMEngine`` (the learner passes ``llm``)."""
    engine = getattr(llm, "engine", llm)
    runner = getattr(engine, "runner", None)
    return getattr(runner, "model", None), engine


# ------------------------------------------------------------------ exercise 9.1
def hidden_states(engine, model, layer: int, prompt: str = EX1_PROMPT) -> torch.Tensor:
    """Real inputs for ``layer``'s MLP: the prompt's token embeddings, RMS-normalised by that
    layer's own post-attention norm. -> (T, hidden)."""
    ids = torch.tensor(engine.tokenize_prompt(prompt)[1], device=model.model.embed_tokens.weight.device)
    with torch.no_grad():
        embedded = model.model.embed_tokens(ids)  # (T, hidden)
        return model.model.layers[layer].post_attention_layernorm(embedded)


def check_mlp_split(shard_mlp, llm) -> CheckResult:
    """9.1: the ranks' partial outputs must add up to the unsplit MLP's output."""
    if todo(shard_mlp) or not callable(shard_mlp):
        return verdict("9.1", False, "", tr("define shard_mlp in the scaffold cell (replace each ... marked TODO) "
                                            "and pass the function itself, then run the cell again."))
    model, engine = _model_of(llm)
    if model is None:
        return verdict("9.1", False, "", tr("pass the chapter's one-process engine, llm = LLM(...), as the second "
                                            "argument."))
    mlp = model.model.layers[EX1_LAYER].mlp
    inter = mlp.down_proj.weight.shape[1]
    gate, up = mlp.gate_up_proj.weight.split(inter, dim=0)  # (I, H) each
    down = mlp.down_proj.weight  # (H, I)
    share = inter // EX1_TP
    x = hidden_states(engine, model, EX1_LAYER)  # (T, H)
    partials = []
    with torch.no_grad():
        for rank in range(EX1_TP):
            try:
                parts = shard_mlp(gate, up, down, rank, EX1_TP)
            except Exception as exc:  # the learner's code: say what went wrong, as a hint
                return verdict("9.1", False, "", tr("shard_mlp(..., rank={rank}, tp={tp}) raised {kind}: {error}",
                                                    rank=rank, tp=EX1_TP, kind=type(exc).__name__, error=exc))
            if not isinstance(parts, tuple) or len(parts) != 3 or any(todo(p) for p in parts):
                return verdict("9.1", False, "", tr("shard_mlp must return (gate_r, up_r, down_r), three tensors; "
                                                    "replace every ... marked TODO."))
            gate_r, up_r, down_r = parts
            want = [(share, gate.shape[1]), (share, up.shape[1]), (down.shape[0], share)]
            got = [tuple(getattr(p, "shape", ())) for p in parts]
            if got != want:
                return verdict("9.1", False, "", tr("rank {rank}'s shares have shapes {got}; with {inter} "
                                                    "intermediate features over {tp} ranks each rank holds {share}: "
                                                    "gate and up rows {rows}, down columns {columns}.",
                                                    rank=rank, got=got, inter=inter, tp=EX1_TP, share=share,
                                                    rows=want[0], columns=want[2]))
            h = F.silu(x @ gate_r.T) * (x @ up_r.T)  # (T, I/tp): this rank's slice, no communication
            partials.append(h @ down_r.T)  # (T, H): a partial sum of the whole output
        full = mlp(x)  # the unsplit layer, as the engine runs it
    summed = torch.stack(partials).sum(0)  # what an all-reduce leaves on every rank
    err = (summed - full).abs().max().item()
    scale = full.abs().max().item()
    right = err <= 1e-4 * max(1.0, scale)
    seen = tr("Layer {layer}'s MLP over {tp} ranks ({share} of {inter} features each), {tokens} real tokens",
              layer=EX1_LAYER, tp=EX1_TP, share=share, inter=inter, tokens=x.shape[0])
    return verdict("9.1", right,
                   tr("{seen}: the summed partial outputs equal the unsplit layer's output up to float rounding (the "
                      "sum is taken in another order). Gate and up are cut by rows (column-parallel), down by the "
                      "same columns (row-parallel), so SiLU-and-multiply stays local.", seen=seen),
                   tr("{seen}: the summed partial outputs differ from the unsplit layer by up to {err:.1e}, far from "
                      "rounding. Rank r must take the same intermediate features r*{share} to (r+1)*{share} in all "
                      "three: rows of gate and up, columns of down.", seen=seen, err=err, share=share))


# ------------------------------------------------------------------ exercise 9.2
def weight_gb_per_rank(shape, tp_size: int, dtype_bytes: int = EX2_DTYPE_BYTES) -> float:
    """GB of weights one of ``tp_size`` ranks holds: every split matrix's share (the norms, copied to
    every rank, are a few MB and left out)."""
    return shape.num_parameters() * dtype_bytes / tp_size / 1e9


def check_tp_size(tp_size, replicas) -> CheckResult:
    """9.2: the smallest tensor_parallel_size the engine accepts whose weight share leaves EX2_KV_GB
    per GPU, and as many data-parallel replicas of it as EX2_GPUS GPUs hold."""
    from nanoengine.distributed.tp_runner import allowed_tensor_parallel_sizes, check_tensor_parallel_size
    from nanoengine.models.presets import PRESETS

    if todo(tp_size) or todo(replicas):
        return verdict("9.2", False, "", tr("replace both ... (a tensor_parallel_size and a number of replicas, "
                                            "whole numbers from 1 to {gpus}), then run the cell again.",
                                            gpus=EX2_GPUS))
    n, r = whole(tp_size, 1, EX2_GPUS), whole(replicas, 1, EX2_GPUS)
    if n is None or r is None:
        return verdict("9.2", False, "", tr("tensor_parallel_size and replicas must be whole numbers from 1 to "
                                            "{gpus} (one rank per GPU), got {tp!r} and {replicas!r}.",
                                            gpus=EX2_GPUS, tp=tp_size, replicas=replicas))
    shape = PRESETS[EX2_MODEL]
    try:
        check_tensor_parallel_size(shape, n, torch.device("cpu"))
    except ValueError as err:
        return verdict("9.2", False, "", tr("The engine refuses tensor_parallel_size={n}: {error}", n=n, error=err))
    if n * r > EX2_GPUS:
        return verdict("9.2", False, "", tr("{r} replica(s) of {n} GPUs need {needed} GPUs; there are {gpus}.",
                                            r=r, n=n, needed=n * r, gpus=EX2_GPUS))
    share = weight_gb_per_rank(shape, n)
    free = EX2_GPU_GB - share
    seen = tr("tensor_parallel_size={n}: {share:.1f} GB of weights per GPU, {free:.1f} GB left for the KV cache "
              "(at least {kv} wanted); {r} replica(s) use {used} of {gpus} GPUs",
              n=n, share=share, free=free, kv=EX2_KV_GB, r=r, used=n * r, gpus=EX2_GPUS)
    if free < EX2_KV_GB:
        return verdict("9.2", False, "", tr("{seen}: too little room for the KV cache. Only a larger size lowers "
                                            "each GPU's share of the weights.", seen=seen))
    fitting = [s_ for s_ in allowed_tensor_parallel_sizes(shape)
               if s_ <= EX2_GPUS and EX2_GPU_GB - weight_gb_per_rank(shape, s_) >= EX2_KV_GB]
    if n != min(fitting):
        return verdict("9.2", False, "", tr("{seen}. It fits, but so does a smaller size the engine accepts: every "
                                            "rank beyond what memory needs adds a share of 2 x layers collectives "
                                            "per step and leaves fewer GPUs for replicas.", seen=seen))
    if r != EX2_GPUS // n:
        return verdict("9.2", False, "", tr("{seen}: GPUs that could hold another whole replica stay idle.",
                                            seen=seen))
    return verdict("9.2", True,
                   tr("{seen}. Memory sets the smallest tensor_parallel_size; more throughput then comes from "
                      "replicas, which serve their own requests and exchange nothing, while a larger "
                      "tensor-parallel group would pay more collectives per step for KV room it does not need.",
                      seen=seen), "")


# ------------------------------------------------------------------ exercise 9.3
@functools.lru_cache(maxsize=2)
def model_on_meta(name: str = EX3_MODEL, tp_size: int = EX3_TP) -> nn.Module:
    """The engine's module tree of preset ``name`` for one of ``tp_size`` ranks, on the meta device
    (every parameter has its shape and dtype but no memory: building it takes a moment)."""
    from nanoengine.distributed.parallel_state import TPGroup
    from nanoengine.loader.weights import build_model
    from nanoengine.models.presets import PRESETS

    return build_model(PRESETS[name], torch.device("meta"), EX3_DTYPE, max_position=16, tp=TPGroup(0, tp_size, None))


def crossover_batch(*, ring: bool = True, per_layer: int | None = None, embedding: bool = True,
                    split_weights: bool = True, link: float = PCIE_BYTES_PER_S, dtype_bytes: int | None = None) -> int:
    """9.3: the largest decode batch whose ring all-reduce bytes, sent by one GPU each way at ``link``,
    take no longer than that GPU's read of its share of the weights at ``HBM_BYTES_PER_S``.

    The defaults are the right counting; each keyword turns one step of it into a plausible mistake
    (no ring factor, one all-reduce per layer, no embedding all-reduce, the whole model's weights,
    another link, another dtype), so the check can name what a wrong answer left out.
    """
    from nanoengine.models.presets import PRESETS

    shape = PRESETS[EX3_MODEL]
    dtype_bytes = EX3_DTYPE.itemsize if dtype_bytes is None else dtype_bytes
    rows, _ = row_parallel_bytes(model_on_meta(), 1, dtype_bytes)  # o_proj and down_proj of every layer
    if per_layer is not None:
        rows = per_layer * shape.num_hidden_layers
    collectives = rows + (1 if embedding else 0)  # the vocabulary-split embedding adds up its slices
    factor = 2 * (EX3_TP - 1) / EX3_TP if ring else 1.0
    sent_per_token = factor * collectives * shape.hidden_size * dtype_bytes  # bytes each GPU sends, each way
    weights = shape.num_parameters() * dtype_bytes / (EX3_TP if split_weights else 1)
    read_s = weights / HBM_BYTES_PER_S
    return math.floor(read_s / (sent_per_token / link) + 1e-9)


def check_crossover_batch(batch) -> CheckResult:
    """9.3: the largest decode batch of Llama-3-8B at tensor_parallel_size=4 over PCIe whose
    all-reduce bytes take no longer than the weight read."""
    if todo(batch):
        return verdict("9.3", False, "", tr("replace ... with a number of sequences (a whole number), then run the "
                                            "cell again."))
    b = whole(batch, 1, 10**6)
    if b is None:
        return verdict("9.3", False, "", tr("batch is a whole number of sequences, at least 1, got {value!r}.",
                                            value=batch))
    right = crossover_batch()
    if b == right:
        return verdict("9.3", True,
                       tr("{right} sequences. The weight read is fixed per step while the all-reduce bytes grow with "
                          "every sequence, so past {right} sequences per step PCIe, not HBM, sets the pace of a "
                          "decode step (before any latency). Over NVLink the same crossing comes about {times:.0f} "
                          "times later: that is why tensor parallelism stays inside an NVLink server.",
                          right=right, times=NVLINK_BYTES_PER_S / PCIE_BYTES_PER_S), "")
    mistakes = [
        (crossover_batch(ring=False), tr("your count leaves out what a ring all-reduce sends per GPU: more than the "
                                         "tensor itself (section 4)")),
        (crossover_batch(per_layer=1), tr("your count has one all-reduce per decoder layer; attention and the MLP "
                                          "each end in one")),
        (crossover_batch(embedding=False), tr("your count leaves out one all-reduce the step runs besides the "
                                              "decoder layers' (section 8)")),
        (crossover_batch(split_weights=False), tr("each GPU reads only its share of the weights, not the whole "
                                                  "model")),
        (crossover_batch(link=NVLINK_BYTES_PER_S), tr("these GPUs are joined by PCIe only, not NVLink")),
    ]
    for value, why in mistakes:
        if b == value and value != right:
            return verdict("9.3", False, "", tr("{b} sequences is not it: {why}.", b=b, why=why))
    if b > right:
        return verdict("9.3", False, "", tr("{b} sequences is too many: at that batch the bytes already take longer "
                                            "than the read. Write the step's two costs as functions of the batch and "
                                            "find where they cross.", b=b))
    return verdict("9.3", False, "", tr("{b} sequences is too few: a larger batch still sends its bytes within the "
                                        "read. Write the step's two costs as functions of the batch and find where "
                                        "they cross.", b=b))


__all__ = ["EX2_GPUS", "EX2_GPU_GB", "EX2_KV_GB", "check_crossover_batch", "check_mlp_split", "check_tp_size", "gpu_results",
           "read_allreduce_share", "read_allreduce_size", "read_cores", "read_ranks", "read_tp_step",
           "crossover_batch", "hidden_states", "model_on_meta", "row_parallel_bytes", "weight_gb_per_rank"]


# ------------------------------------------------------------------ section 9's readings
# Each turns the numbers a cell measured into the sentence it prints, so the sentence says the
# opposite when the numbers do (tests/course/test_exercises_ch09.py feeds each both sides).

def read_tp_step(one_s: float, split_s: float, ranks: int) -> str:
    """The decode step at ``tensor_parallel_size=ranks`` against one process."""
    ratio = split_s / one_s
    fields = dict(ranks=ranks, ratio=ratio, delta=1e3 * (split_s - one_s))
    if ratio > 1.05:
        return tr("tensor_parallel_size={ranks} took {ratio:.1f}x as long per decode step as one process "
                  "({delta:+.1f} ms): slower on this machine", **fields)
    if ratio < 0.95:
        return tr("tensor_parallel_size={ranks} took {ratio:.1f}x as long per decode step as one process "
                  "({delta:+.1f} ms): faster on this machine", **fields)
    return tr("tensor_parallel_size={ranks} took {ratio:.1f}x as long per decode step as one process "
              "({delta:+.1f} ms): about as fast on this machine", **fields)


def read_allreduce_size(small, large) -> str:
    """Two all-reduce timings (``widgets.allreduce_timing.AllReduceTiming``) of different sizes:
    does the time follow the bytes (bandwidth) or stay put (a fixed cost per collective)?"""
    bytes_ratio, time_ratio = large.bytes / small.bytes, large.median / small.median
    fields = dict(bytes_ratio=bytes_ratio, time_ratio=time_ratio)
    if time_ratio < 2:
        return tr("{bytes_ratio:.0f}x the bytes took {time_ratio:.1f}x the time: the cost is per collective "
                  "(latency), not per byte", **fields)
    if time_ratio < bytes_ratio / 2:
        return tr("{bytes_ratio:.0f}x the bytes took {time_ratio:.1f}x the time: both a fixed cost per collective "
                  "and the bytes count", **fields)
    return tr("{bytes_ratio:.0f}x the bytes took {time_ratio:.1f}x the time: the bytes set the time (bandwidth)",
              **fields)


def read_ranks(two, three) -> str:
    """The same all-reduce over 2 and over 3 processes, against the ring's extra bytes (1.00x -> 1.33x)."""
    ring = (2 * (three.world_size - 1) / three.world_size) / (2 * (two.world_size - 1) / two.world_size)
    ratio = three.median / two.median
    fields = dict(three=three.world_size, two=two.world_size, ratio=ratio, ring=ring)
    if ratio > 1.5 * ring:
        return tr("over {three} processes the same all-reduce took {ratio:.1f}x as long as over {two}, where the "
                  "ring's extra bytes alone give {ring:.2f}x: far more, so most of that time is ranks waiting for "
                  "one another to be scheduled", **fields)
    return tr("over {three} processes the same all-reduce took {ratio:.1f}x as long as over {two}, where the ring's "
              "extra bytes alone give {ring:.2f}x: about what the ring's extra traffic explains", **fields)


def read_cores(ranks: int, cores: int) -> str:
    """Ranks against the machine's cores (the driver process comes on top)."""
    if ranks > cores:
        return tr("{ranks} ranks and the driver share {cores} cores: ranks outnumber the cores, so at an all-reduce "
                  "some rank is often not running and the others wait for it", ranks=ranks, cores=cores)
    if ranks == cores:
        return tr("{ranks} ranks on {cores} cores, plus the driver: a core each, and the driver takes turns with "
                  "them", ranks=ranks, cores=cores)
    return tr("{ranks} ranks on {cores} cores: each rank has a core of its own", ranks=ranks, cores=cores)


def read_allreduce_share(per_allreduce_s: float, count: int, overhead_s: float) -> str:
    """How much of the measured tensor-parallel overhead ``count`` all-reduces of the timed cost explain."""
    estimate = per_allreduce_s * count
    fields = dict(count=count, us=1e6 * per_allreduce_s, ms=1e3 * estimate)
    if overhead_s <= 0:
        return tr("{count} all-reduces per step x {us:.0f} µs = {ms:.1f} ms per step, yet the split step was not "
                  "slower here: nothing to explain", **fields)
    share = estimate / overhead_s
    fields.update(share=share, added=1e3 * overhead_s)
    if share >= 0.5:
        return tr("{count} all-reduces per step x {us:.0f} µs = {ms:.1f} ms per step, {share:.0%} of the {added:.1f} "
                  "ms the split added: the collectives alone account for most of it", **fields)
    return tr("{count} all-reduces per step x {us:.0f} µs = {ms:.1f} ms per step, {share:.0%} of the {added:.1f} ms "
              "the split added: they are part of it; the rest is the driver's round trip to the ranks and ranks "
              "waiting for a core", **fields)


def _find(tree, needle: str) -> list[str]:
    """Keys anywhere in a JSON tree whose name contains ``needle`` (a dotted path each)."""
    found = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            if needle in key.lower().replace("-", "_"):
                found.append(key)
            found += [f"{key}.{sub}" for sub in _find(value, needle)]
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            found += [f"{i}.{sub}" for sub in _find(value, needle)]
    return found


def gpu_results(results_dir) -> list[dict]:
    """Every ``gpu-*.json`` of ``results_dir`` with its provenance (hardware, date, revision,
    command) and the keys in it that hold an all-reduce figure (``all_reduce``/``allreduce``)."""
    import json
    from pathlib import Path

    from nanobench.provenance import command_today, revision_today

    rows = []
    for path in sorted(Path(results_dir).glob("gpu-*.json")):
        data = json.loads(path.read_text())
        env = data.get("environment", {})
        hardware = f"{env.get('gpu_count', 1)} x {env.get('gpu', 'unknown GPU')}, CPU {env.get('cpu_model', '?')}"
        revision = revision_today(env.get("nanoengine_revision") or data.get("source", "not recorded"))
        figures = _find(data, "all_reduce") + _find(data, "allreduce")
        rows.append({"file": path.name, "hardware": hardware, "date": data.get("date", "not recorded"),
                     "revision": revision, "command": command_today(data.get("command", "")) or "not recorded",
                     "allreduce": figures})
    return rows
