"""The model runner: the worker side of a step (chapters 2, 3 and 6).

It owns the model and the KV cache, one preallocated tensor::

    kv_cache: (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)

and turns the scheduler's decision into tensors (``prepare_inputs``):

* ``input_ids`` / ``positions``: the tokens to compute, decodes first then prefill chunks,
* ``slot_mapping``: where each token's K/V goes (``block_table[pos // B] * B + pos % B``),
* block tables and context lengths: where each sequence's earlier K/V already is,
* ``logits_indices``: the rows whose logits are needed, one per sequence that reaches
  its last token this step (a mid-prompt chunk samples nothing).

``execute_model`` runs the forward pass, computes logits for those rows only and samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from nanoengine import kernels
from nanoengine.engine.compilation import CompileReport, compile_runner
from nanoengine.engine.host_memory import keep_freed_memory
from nanoengine.engine.request import Request
from nanoengine.engine.scheduler import SchedulerOutput
from nanoengine.layers.attention import AttentionMetadata
from nanoengine.layers.sampler import Sampler, SampleResult
from nanoengine.models.config import ModelConfig


@dataclass
class BatchPlan:
    """One step's batch as plain Python lists: what ``prepare_inputs`` turns into tensors.

    Plain data so it can also be sent to tensor-parallel worker processes.
    """

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    num_decode_tokens: int
    decode_block_tables: list[list[int]]
    decode_context_lens: list[int]
    prefill_block_tables: list[list[int]]
    prefill_cu_seqlens_q: list[int]
    prefill_context_lens: list[int]
    logits_indices: list[int]


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # (S,) rows of the flat batch to compute logits for

    @classmethod
    def from_plan(cls, plan: BatchPlan, device: torch.device) -> "ModelInput":
        def ints(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, device=device)

        meta = AttentionMetadata(
            slot_mapping=ints(plan.slot_mapping, torch.long),
            num_decode_tokens=plan.num_decode_tokens,
            decode_block_tables=_padded(plan.decode_block_tables, device),
            decode_context_lens=ints(plan.decode_context_lens),
            prefill_block_tables=_padded(plan.prefill_block_tables, device),
            prefill_cu_seqlens_q=ints(plan.prefill_cu_seqlens_q),
            prefill_context_lens=ints(plan.prefill_context_lens))
        return cls(ints(plan.input_ids, torch.long), ints(plan.positions, torch.long), meta,
                   ints(plan.logits_indices, torch.long))


def _padded(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """(num_seqs, max_blocks) int32, rows padded with -1 (never read by the kernels)."""
    width = max((len(t) for t in tables), default=0)
    rows = [t + [-1] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(tables), width)


def plan_batch(out: SchedulerOutput, block_size: int) -> tuple[BatchPlan, list[Request]]:
    """Flatten the scheduled requests into one batch: decodes first, then prefill chunks.

    Returns the plan and the requests whose last token is in this step (they sample), in
    the order of ``logits_indices``.
    """
    decodes = [(r, n) for r, n in out.scheduled if n == 1 and r.num_computed_tokens > 0]
    prefills = [(r, n) for r, n in out.scheduled if not (n == 1 and r.num_computed_tokens > 0)]
    # A one-token chunk after cached tokens is a decode in all but name: one query at the
    # last position over the whole context, so it rides with the decodes.
    input_ids, positions, slots, logits_indices, sampled = [], [], [], [], []
    cu_seqlens = [0]
    for is_prefill, group in ((False, decodes), (True, prefills)):
        for request, num_new in group:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = request.block_ids
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            if is_prefill:
                cu_seqlens.append(cu_seqlens[-1] + num_new)
            if end == request.num_tokens:  # the last known token: its logits give the next
                logits_indices.append(len(input_ids) - 1)
                sampled.append(request)
    plan = BatchPlan(
        input_ids=input_ids, positions=positions, slot_mapping=slots, num_decode_tokens=len(decodes),
        decode_block_tables=[list(r.block_ids) for r, _ in decodes],
        decode_context_lens=[r.num_computed_tokens + 1 for r, _ in decodes],
        prefill_block_tables=[list(r.block_ids) for r, _ in prefills],
        prefill_cu_seqlens_q=cu_seqlens,
        prefill_context_lens=[r.num_computed_tokens + n for r, n in prefills],
        logits_indices=logits_indices)
    return plan, sampled


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled: dict[str, int]  # request id -> new token
    logprobs: dict[str, tuple]  # request id -> (token logprob, top-N pairs)
    prepare_time: float
    model_time: float
    sample_time: float


def kv_cache_num_blocks(model_config: ModelConfig, block_size: int, dtype: torch.dtype,
                        memory_bytes: float, tp_size: int = 1) -> int:
    """How many blocks fit in ``memory_bytes`` (per rank: each holds its share of KV heads)."""
    per_token = model_config.kv_bytes_per_token(torch.empty(0, dtype=dtype).element_size()) // tp_size
    return max(1, int(memory_bytes // (per_token * block_size)))


class SamplingRunner:
    """What every runner shares: prepare the step, run the model, sample, with timings.

    ``ModelRunner`` runs the model in this process; ``TensorParallelRunner`` sends the step
    to worker processes. Both sample here, with each request's own generator, so seeded
    requests give the same tokens whatever the runner.
    """

    sampler: Sampler
    generator: torch.Generator
    compilation: CompileReport = CompileReport.not_requested()  # what compile=True did (engine.compilation)

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[object, list[Request]]:
        """This step's model input, and the requests that sample (in logits order)."""
        raise NotImplementedError

    def run_model(self, prepared) -> torch.Tensor:
        """Run the model on a prepared step. -> (num sampled, vocab) float32 logits."""
        raise NotImplementedError

    def compute_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits of every scheduled request that reaches its last token, without sampling."""
        return self.run_model(self.prepare_inputs(out)[0])

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        prepared, sampled = self.prepare_inputs(out)
        t1 = time.perf_counter()
        logits = self.run_model(prepared)
        if logits.is_cuda:  # kernels run asynchronously: wait, so model_time is the GPU's time
            torch.cuda.synchronize(logits.device)
        t2 = time.perf_counter()
        result = self.sample(logits, sampled)
        t3 = time.perf_counter()
        ids = [r.request_id for r in sampled]
        return ModelRunnerOutput(
            sampled=dict(zip(ids, result.token_ids)),
            logprobs={i: lp for i, lp in zip(ids, result.logprobs) if lp is not None},
            prepare_time=t1 - t0, model_time=t2 - t1, sample_time=t3 - t2)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        if not requests:
            return SampleResult([], [])
        return self.sampler(logits, [r.sampling_params for r in requests], [r.generator for r in requests],
                            self.generator)


class ModelRunner(SamplingRunner):
    """Holds the model and the paged KV cache; prepares inputs, runs, samples."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, seed: int = 0, cuda_graph_max_batch: int = 0,
                 max_model_len: int | None = None, compile: bool = False) -> None:
        self.model = model
        self.model_config = model_config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        layers = model.attention_layers()
        if layers[0].k_cache is not None:
            raise ValueError("this model is already bound to another engine's KV cache; two engines sharing "
                             "one model object would overwrite each other's cache: build a model per engine")
        num_kv_heads = layers[0].num_kv_heads  # this rank's share under tensor parallelism
        self.kv_cache = torch.zeros(2, len(layers), num_blocks, block_size, num_kv_heads,
                                    model_config.head_dim, dtype=dtype, device=device)
        for i, attn in enumerate(layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        if device.type == "cpu":
            keep_freed_memory()  # reuse each step's temporaries instead of faulting them in again
        # On a CPU, reorder every GEMM weight once into oneDNN's blocked layout.
        self.packed_weights = sum(module.pack_weight() for module in model.modules()
                                  if hasattr(module, "pack_weight"))
        self.sampler = Sampler()
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.cuda_graphs = None
        # compile=True: torch.compile the fused elementwise ops and warm them up now, timed
        # (engine.compilation); before CUDA graphs, so those record the compiled kernels.
        self.compilation = CompileReport.not_requested()
        if compile:
            self.compilation = compile_runner(self)
        if cuda_graph_max_batch and device.type == "cuda" and kernels.triton_available():
            from nanoengine.engine.cuda_graphs import CudaGraphDecoder

            max_len = max_model_len or model_config.max_position_embeddings
            self.cuda_graphs = CudaGraphDecoder(model, cuda_graph_max_batch, -(-max_len // block_size), device)
            self.cuda_graphs.capture()

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    # -------------------------------------------------------------- inputs
    def prepare_inputs(self, out: SchedulerOutput) -> tuple[ModelInput, list[Request]]:
        """The step's tensors on this runner's device, and the requests that sample."""
        plan, sampled = plan_batch(out, self.block_size)
        return ModelInput.from_plan(plan, self.device), sampled

    # ----------------------------------------------------------- execution
    @torch.inference_mode()
    def run_model(self, model_input: ModelInput) -> torch.Tensor:
        """Forward pass and logits of the rows to sample. -> (S, vocab) float32."""
        meta = model_input.attn_metadata
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(meta):
            hidden = self.cuda_graphs.run(model_input.input_ids, model_input.positions, meta)
        else:
            hidden = self.model(model_input.input_ids, model_input.positions, meta)
        return self.model.compute_logits(hidden[model_input.logits_indices]).float()

