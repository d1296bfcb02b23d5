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
* ``check_allreduce_bytes`` (9.3): the bytes the row-parallel all-reduces carry in one
  decode step of Llama-3-70B, counted from the engine's own module tree for that shape
  (built on PyTorch's "meta" device: shapes, no memory).

``row_parallel_bytes`` is the counting rule the chapter, the live quiz question and 9.3
share.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.layers.linear import RowParallelLinear
from widgets.exercises import CheckResult, todo, verdict, whole

EX1_TP = 4  # exercise 9.1: ranks to split the MLP over (1536 / 4 = 384 features each)
EX1_LAYER = 15  # exercise 9.1: which decoder layer of the loaded model
EX1_PROMPT = "Tensor parallelism splits every weight matrix over several devices."
EX2_MODEL = "Llama-3-70B"  # exercise 9.2
EX2_GPUS = 12  # GPUs on hand
EX2_GPU_GB = 80  # memory of each (an H100 SXM: NVIDIA H100 datasheet)
EX2_KV_GB = 20  # at least this much of each GPU left for the KV cache
EX2_DTYPE_BYTES = 2  # bf16
EX3_MODEL = "Llama-3-70B"  # exercise 9.3
EX3_TP = 8
EX3_TOKENS = 16  # one decode step of 16 sequences
EX3_DTYPE = torch.bfloat16
NVLINK_BYTES_PER_S = 450e9  # H100 SXM, NVLink 4: 900 GB/s per GPU counts both directions, 450 each way (datasheet)


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
        return verdict("9.1", False, "", "define shard_mlp in the scaffold cell (replace each ... marked TODO) and "
                                         "pass the function itself, then run the cell again.")
    model, engine = _model_of(llm)
    if model is None:
        return verdict("9.1", False, "", "pass the chapter's one-process engine, llm = LLM(...), as the second "
                                         "argument.")
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
                return verdict("9.1", False, "", f"shard_mlp(..., rank={rank}, tp={EX1_TP}) raised "
                                                 f"{type(exc).__name__}: {exc}")
            if not isinstance(parts, tuple) or len(parts) != 3 or any(todo(p) for p in parts):
                return verdict("9.1", False, "", "shard_mlp must return (gate_r, up_r, down_r), three tensors; "
                                                 "replace every ... marked TODO.")
            gate_r, up_r, down_r = parts
            want = [(share, gate.shape[1]), (share, up.shape[1]), (down.shape[0], share)]
            got = [tuple(getattr(p, "shape", ())) for p in parts]
            if got != want:
                return verdict("9.1", False, "", f"rank {rank}'s shares have shapes {got}; with {inter} "
                                                 f"intermediate features over {EX1_TP} ranks each rank holds "
                                                 f"{share}: gate and up rows {want[0]}, down columns {want[2]}.")
            h = F.silu(x @ gate_r.T) * (x @ up_r.T)  # (T, I/tp): this rank's slice, no communication
            partials.append(h @ down_r.T)  # (T, H): a partial sum of the whole output
        full = mlp(x)  # the unsplit layer, as the engine runs it
    summed = torch.stack(partials).sum(0)  # what an all-reduce leaves on every rank
    err = (summed - full).abs().max().item()
    scale = full.abs().max().item()
    right = err <= 1e-4 * max(1.0, scale)
    seen = f"Layer {EX1_LAYER}'s MLP over {EX1_TP} ranks ({share} of {inter} features each), {x.shape[0]} real tokens"
    return verdict("9.1", right,
                   f"{seen}: the summed partial outputs equal the unsplit layer's output up to float rounding (the "
                   f"sum is taken in another order). Gate and up are cut by rows (column-parallel), down by the same "
                   f"columns (row-parallel), so SiLU-and-multiply stays local.",
                   f"{seen}: the summed partial outputs differ from the unsplit layer by up to {err:.1e}, far from "
                   f"rounding. Rank r must take the same intermediate features r*{share} to (r+1)*{share} in all "
                   f"three: rows of gate and up, columns of down.")


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
        return verdict("9.2", False, "", f"replace both ... (a tensor_parallel_size and a number of replicas, whole "
                                         f"numbers from 1 to {EX2_GPUS}), then run the cell again.")
    n, r = whole(tp_size, 1, EX2_GPUS), whole(replicas, 1, EX2_GPUS)
    if n is None or r is None:
        return verdict("9.2", False, "", f"tensor_parallel_size and replicas must be whole numbers from 1 to "
                                         f"{EX2_GPUS} (one rank per GPU), got {tp_size!r} and {replicas!r}.")
    shape = PRESETS[EX2_MODEL]
    try:
        check_tensor_parallel_size(shape, n, torch.device("cpu"))
    except ValueError as err:
        return verdict("9.2", False, "", f"The engine refuses tensor_parallel_size={n}: {err}")
    if n * r > EX2_GPUS:
        return verdict("9.2", False, "", f"{r} replica(s) of {n} GPUs need {n * r} GPUs; there are {EX2_GPUS}.")
    share = weight_gb_per_rank(shape, n)
    free = EX2_GPU_GB - share
    seen = (f"tensor_parallel_size={n}: {share:.1f} GB of weights per GPU, {free:.1f} GB left for the KV cache "
            f"(at least {EX2_KV_GB} wanted); {r} replica(s) use {n * r} of {EX2_GPUS} GPUs")
    if free < EX2_KV_GB:
        return verdict("9.2", False, "", f"{seen}: too little room for the KV cache. Only a larger size lowers "
                                         f"each GPU's share of the weights.")
    fitting = [s_ for s_ in allowed_tensor_parallel_sizes(shape)
               if s_ <= EX2_GPUS and EX2_GPU_GB - weight_gb_per_rank(shape, s_) >= EX2_KV_GB]
    if n != min(fitting):
        return verdict("9.2", False, "", f"{seen}. It fits, but so does a smaller size the engine accepts: every "
                                         f"rank beyond what memory needs adds a share of 2 x layers collectives "
                                         f"per step and leaves fewer GPUs for replicas.")
    if r != EX2_GPUS // n:
        return verdict("9.2", False, "", f"{seen}: GPUs that could hold another whole replica stay idle.")
    return verdict("9.2", True,
                   f"{seen}. Memory sets the smallest tensor_parallel_size; more throughput then comes from "
                   f"replicas, which serve their own requests and exchange nothing, while a larger "
                   f"tensor-parallel group would pay more collectives per step for KV room it does not need.", "")


# ------------------------------------------------------------------ exercise 9.3
@functools.lru_cache(maxsize=1)
def llama70b_on_meta(tp_size: int = EX3_TP) -> nn.Module:
    """The engine's Llama-3-70B module tree for one of ``tp_size`` ranks, on the meta device
    (every parameter has its shape and dtype but no memory: building it takes a moment)."""
    from nanoengine.distributed.parallel_state import TPGroup
    from nanoengine.loader.weights import build_model
    from nanoengine.models.presets import PRESETS

    return build_model(PRESETS[EX3_MODEL], torch.device("meta"), EX3_DTYPE, max_position=16,
                       tp=TPGroup(0, tp_size, None))


def check_allreduce_bytes(allreduce_bytes) -> CheckResult:
    """9.3: bytes the row-parallel all-reduces carry in one decode step of 16 sequences."""
    if todo(allreduce_bytes):
        return verdict("9.3", False, "", "replace ... with a number of bytes (a whole number), then run the cell "
                                         "again.")
    if isinstance(allreduce_bytes, bool) or not isinstance(allreduce_bytes, (int, float)) or allreduce_bytes < 0:
        return verdict("9.3", False, "", f"allreduce_bytes must be a number of bytes, got {allreduce_bytes!r}.")
    count, expected = row_parallel_bytes(llama70b_on_meta(), EX3_TOKENS, EX3_DTYPE.itemsize)
    if allreduce_bytes == expected:
        ring = 2 * (EX3_TP - 1) / EX3_TP
        micro = 1e6 * ring * expected / NVLINK_BYTES_PER_S
        return verdict("9.3", True,
                       f"{count} row-parallel layers in the engine's Llama-3-70B (o_proj and down_proj of each "
                       f"layer) each all-reduce {EX3_TOKENS} x 8192 bf16 values: {expected:,} bytes per step. A ring "
                       f"all-reduce sends {ring:.2f} times that per GPU: about {micro:.0f} microseconds at NVLink's "
                       f"450 GB/s each way, before the {count} collectives' own latency, which at small batches "
                       f"costs more than the bytes (section 9).", "")
    mistakes = {
        expected // EX3_TOKENS: f"that is one token; the step has {EX3_TOKENS}, one per sequence",
        expected // 2: "that counts one all-reduce per layer; attention (o_proj) and the MLP (down_proj) have one each",
        expected * 2: "that uses 4-byte floats; bf16 takes 2 bytes",
        expected // EX3_TP: f"each rank contributes a full-width partial sum, not 1/{EX3_TP} of it",
        expected * 28672 // 8192: "that uses the MLP's intermediate width; down_proj's output is the hidden size",
        expected * 8: "that is bits, not bytes",
    }
    why = mistakes.get(int(allreduce_bytes), "recount")
    return verdict("9.3", False, "", f"{int(allreduce_bytes):,} bytes is not it: {why}. Count what one "
                                     f"row-parallel layer sends for one token, then how many such layers run.")


__all__ = ["EX2_GPUS", "EX2_GPU_GB", "EX2_KV_GB", "check_allreduce_bytes", "check_mlp_split", "check_tp_size",
           "hidden_states", "llama70b_on_meta", "row_parallel_bytes", "weight_gb_per_rank"]
