"""The model runner: the worker side of a step (chapters 2, 3 and 6).

It owns the model and the KV cache, one preallocated tensor::

    kv_cache: (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)

The scheduler's decision becomes a ``BatchPlan`` (``plan_batch``: short lists, and the
block tables and slots gathered from the engine's persistent ``BlockTables``), then
tensors on the model's device (``prepare_inputs``):

* ``input_ids`` / ``positions``: the tokens to compute, decodes first then prefill chunks,
* ``slot_mapping``: where each token's K/V goes (``block_table[pos // B] * B + pos % B``),
* block tables and context lengths: where each sequence's earlier K/V already is,
* ``logits_indices``: the rows whose logits are needed, one per sequence that reaches
  its last token this step (a mid-prompt chunk samples nothing); a parallel-sampling
  request whose siblings wait for its prompt repeats its row once per sibling.

``execute_model`` runs the forward pass, computes logits for those rows only and samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from nanoengine import kernels
from nanoengine.kernels import cpu_gemm
from nanoengine.engine.block_table import BlockTables
from nanoengine.engine.compilation import CompileReport, compile_runner
from nanoengine.engine.host_memory import keep_freed_memory
from nanoengine.engine.request import Request
from nanoengine.engine.scheduler import SchedulerOutput
from nanoengine.events import BatchRow
from nanoengine.layers.attention import AttentionMetadata
from nanoengine.layers.sampler import Sampler, SampleResult
from nanoengine.models.config import ModelConfig


# Logits computed and sampled at once on a CPU: under glibc's 32 MiB mmap threshold, and
# large enough that the LM head's GEMM is not slowed (measured with SmolLM2's 49,152 x 576
# head on a 2-core VM, 2026-12-01: 256 rows in chunks of 170 as fast as in one call; chunks
# of 42 rows 1.36x slower, since each call streams the whole 113 MB weight again).
LOGITS_CHUNK_BYTES = 30 * 1024 * 1024


@dataclass
class BatchPlan:
    """One step's batch: what ``prepare_inputs`` puts on the model's device.

    Plain data (lists and CPU tensors) so it can also be sent to tensor-parallel worker
    processes. The block tables and the slot mapping are tensors gathered from the
    engine's persistent ``BlockTables``; everything else is a short list.
    """

    input_ids: list[int]
    positions: list[int]
    slot_mapping: torch.Tensor | list[int]  # (T,) int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | list[list[int]]  # (decodes, blocks) int32, -1 past a table's end
    decode_context_lens: list[int]
    prefill_block_tables: torch.Tensor | list[list[int]]  # (prefills, blocks) int32
    prefill_cu_seqlens_q: list[int]
    prefill_context_lens: list[int]
    logits_indices: list[int]
    request_ids: list[str]  # the scheduled requests in model order (decodes, then prefills)
    query_start_loc: list[int]  # request i's tokens are rows query_start_loc[i]:query_start_loc[i+1]

    def rows(self) -> tuple[BatchRow, ...]:
        """Per request: its positions, slots and block table (for the ``BatchPrepared`` event)."""
        tables = _as_lists(self.decode_block_tables) + _as_lists(self.prefill_block_tables)
        slots = _as_lists(self.slot_mapping)
        sampling_rows = set(self.logits_indices)
        starts, ends = self.query_start_loc[:-1], self.query_start_loc[1:]
        return tuple(
            BatchRow(request_id, i >= self.num_decode_tokens, tuple(self.positions[a:b]),
                     tuple(slots[a:b]), tuple(t for t in tables[i] if t >= 0), b - 1 in sampling_rows)
            for i, (request_id, a, b) in enumerate(zip(self.request_ids, starts, ends)))


def _as_lists(values) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # (S,) rows of the flat batch to compute logits for

    @classmethod
    def from_plan(cls, plan: BatchPlan, device: torch.device) -> "ModelInput":
        def ints(values, dtype=torch.int32):
            if isinstance(values, torch.Tensor):
                return values.to(device=device, dtype=dtype)
            return torch.tensor(values, dtype=dtype, device=device)

        meta = AttentionMetadata(
            slot_mapping=ints(plan.slot_mapping, torch.long),
            num_decode_tokens=plan.num_decode_tokens,
            decode_block_tables=_table(plan.decode_block_tables, device),
            decode_context_lens=ints(plan.decode_context_lens),
            prefill_block_tables=_table(plan.prefill_block_tables, device),
            prefill_cu_seqlens_q=ints(plan.prefill_cu_seqlens_q),
            prefill_context_lens=ints(plan.prefill_context_lens))
        return cls(ints(plan.input_ids, torch.long), ints(plan.positions, torch.long), meta,
                   ints(plan.logits_indices, torch.long))


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (also for oneDNN's opaque packed tensors: same element count)."""
    return tensor.numel() * tensor.element_size()


def _table(tables, device: torch.device) -> torch.Tensor:
    """(num_seqs, max_blocks) int32 on ``device``; from lists, rows are padded with -1 (never read by the kernels)."""
    if isinstance(tables, torch.Tensor):
        return tables.to(device=device, dtype=torch.int32)
    width = max((len(t) for t in tables), default=0)
    rows = [t + [-1] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(tables), width)


def plan_batch(out: SchedulerOutput, block_size: int,
               block_tables: BlockTables | None = None) -> tuple[BatchPlan, list[Request]]:
    """Flatten the scheduled requests into one batch: decodes first, then prefill chunks.

    Returns the plan and the requests that sample this step, in the order of
    ``logits_indices`` (forked siblings right after the request whose logits they share).
    ``block_tables`` is the engine's persistent ``BlockTables``: only blocks gained since
    the last step are copied into it, and the slot of every token is computed from it with
    tensor arithmetic, ``table[row, pos // B] * B + pos % B``. Without one (tests, tools),
    a temporary one is used.
    """
    decodes = [s for s in out.scheduled if not s.is_prefill]
    prefills = [s for s in out.scheduled if s.is_prefill]
    ordered = decodes + prefills
    if block_tables is None:
        most = max((len(s.request.block_ids) for s in ordered), default=1)
        block_tables = BlockTables(max(most, 1), capacity=max(len(ordered), 1))
    rows = block_tables.rows([s.request for s in ordered])
    input_ids, positions, logits_indices, sampled = [], [], [], []
    counts, cu_seqlens, query_start = [], [0], [0]
    for scheduled in ordered:
        request, span = scheduled.request, scheduled.positions
        if scheduled.num_tokens == 1:
            input_ids.append(request.all_token_ids[span.start])
            positions.append(span.start)
        else:
            input_ids.extend(request.all_token_ids[span.start:span.stop])
            positions.extend(span)
        counts.append(scheduled.num_tokens)
        query_start.append(len(input_ids))
        if scheduled.is_prefill:
            cu_seqlens.append(cu_seqlens[-1] + scheduled.num_tokens)
        if scheduled.samples:  # the last known token: its logits give the next
            for requester in [request] + request.forks:
                logits_indices.append(len(input_ids) - 1)
                sampled.append(requester)
    # Every token's slot from the persistent table: one gather, no per-token Python.
    pos = torch.tensor(positions, dtype=torch.long)
    token_rows = torch.tensor(rows, dtype=torch.long).repeat_interleave(torch.tensor(counts, dtype=torch.long)) \
        if len(ordered) != len(positions) else torch.tensor(rows, dtype=torch.long)
    slots = block_tables.table[token_rows, pos // block_size].long() * block_size + pos % block_size
    num_decodes = len(decodes)

    def width(group) -> int:
        return max((len(s.request.block_ids) for s in group), default=0)

    plan = BatchPlan(
        input_ids=input_ids, positions=positions, slot_mapping=slots, num_decode_tokens=num_decodes,
        decode_block_tables=block_tables.gather(rows[:num_decodes], width(decodes)),
        decode_context_lens=[s.num_computed_tokens + 1 for s in decodes],
        prefill_block_tables=block_tables.gather(rows[num_decodes:], width(prefills)),
        prefill_cu_seqlens_q=cu_seqlens,
        prefill_context_lens=[s.num_computed_tokens + s.num_tokens for s in prefills],
        logits_indices=logits_indices,
        request_ids=[s.request.request_id for s in ordered], query_start_loc=query_start)
    return plan, sampled


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled: dict[str, int]  # request id -> new token
    logprobs: dict[str, tuple]  # request id -> (token logprob, top-N pairs)
    prepare_time: float
    model_time: float
    sample_time: float


class SamplingRunner:
    """What every runner shares: prepare the step, run the model, sample, with timings.

    ``ModelRunner`` runs the model in this process; ``TensorParallelRunner`` sends the step
    to worker processes. Both sample here, with each request's own generator, so seeded
    requests give the same tokens whatever the runner.
    """

    sampler: Sampler
    generator: torch.Generator
    compilation: CompileReport = CompileReport.not_requested()  # what compile=True did (engine.compilation)

    def prepare_inputs(self, plan: BatchPlan) -> object:
        """This step's model input, built from the plan."""
        raise NotImplementedError

    def run_model(self, prepared) -> torch.Tensor:
        """Run the model on a prepared step. -> (num sampled, vocab) float32 logits."""
        raise NotImplementedError

    def memory_usage(self) -> dict[str, int]:
        """Bytes of weights, packed weight copies and KV cache (all ranks together)."""
        raise NotImplementedError

    def compute_logits(self, plan: BatchPlan) -> torch.Tensor:
        """Logits of every planned request that reaches its last token, without sampling."""
        return self.run_model(self.prepare_inputs(plan))

    def execute_model(self, plan: BatchPlan, sampled: list[Request]) -> ModelRunnerOutput:
        """Prepare, run and sample one planned step; ``sampled`` are the requests in logits order.

        The logits come in chunks of rows (``logits_chunks``) and each chunk is sampled
        before the next is computed, so a big batch never holds all of its (rows, vocab)
        logits at once.
        """
        t0 = time.perf_counter()
        prepared = self.prepare_inputs(plan)
        t1 = time.perf_counter()
        model_time = sample_time = 0.0
        token_ids, logprobs = [], []
        chunks = self.logits_chunks(prepared)
        while True:
            start = time.perf_counter()
            rows, logits = next(chunks, (None, None))
            if logits is not None and logits.is_cuda:  # kernels run asynchronously: wait, so model_time is the GPU's
                torch.cuda.synchronize(logits.device)
            middle = time.perf_counter()
            model_time += middle - start
            if logits is None:
                break
            result = self.sample(logits, sampled[rows])
            del logits  # the chunk's memory is reused by the next one
            token_ids += result.token_ids
            logprobs += result.logprobs
            sample_time += time.perf_counter() - middle
        ids = [r.request_id for r in sampled]
        return ModelRunnerOutput(
            sampled=dict(zip(ids, token_ids)),
            logprobs={i: lp for i, lp in zip(ids, logprobs) if lp is not None},
            prepare_time=t1 - t0, model_time=model_time, sample_time=sample_time)

    def logits_chunks(self, prepared):
        """Yield (rows, logits of those rows) covering every row to sample, in order.

        One chunk here; ``ModelRunner`` splits a big CPU batch (see ``LOGITS_CHUNK_BYTES``).
        """
        logits = self.run_model(prepared)
        yield slice(0, logits.shape[0]), logits

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
        packable = [module for module in model.modules() if hasattr(module, "pack_weight")]
        self.packed_weights = sum(module.pack_weight() for module in packable)
        self.packed_weight_bytes = sum(_nbytes(m.weight) for m in packable if m.packed_weight is not None)
        cpu_gemm.tune_single_row(packable)  # one row: packed or plain, whichever this CPU runs faster
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
        return _nbytes(self.kv_cache)

    def memory_usage(self) -> dict[str, int]:
        weights = sum(_nbytes(t) for t in self.model.parameters())  # tied embeddings counted once
        return {"weight_bytes": weights, "packed_weight_bytes": self.packed_weight_bytes,
                "kv_cache_bytes": self.kv_cache_bytes}

    # -------------------------------------------------------------- inputs
    def prepare_inputs(self, plan: BatchPlan) -> ModelInput:
        """The step's tensors on this runner's device."""
        return ModelInput.from_plan(plan, self.device)

    # ----------------------------------------------------------- execution
    @torch.inference_mode()
    def run_model(self, model_input: ModelInput) -> torch.Tensor:
        """Forward pass and logits of the rows to sample. -> (S, vocab) float32."""
        return self.model.compute_logits(self.sampled_hidden(model_input)).float()

    @torch.inference_mode()
    def sampled_hidden(self, model_input: ModelInput) -> torch.Tensor:
        """Forward pass; the final hidden states of the rows to sample. -> (S, hidden)."""
        meta = model_input.attn_metadata
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(meta):
            hidden = self.cuda_graphs.run(model_input.input_ids, model_input.positions, meta)
        else:
            hidden = self.model(model_input.input_ids, model_input.positions, meta)
        return hidden[model_input.logits_indices]

    def logits_chunks(self, model_input: ModelInput):
        """The forward pass, then the logits in chunks of rows of at most ``LOGITS_CHUNK_BYTES``.

        On a CPU, 256 rows of a 49,152-token vocabulary are 50 MB of float32 logits: more
        than glibc's largest heap block (32 MiB, ``engine.host_memory``), so every step would
        map fresh pages (faulted in by the LM head) and unmap them when freed: measured on
        the overhead benchmark's 256 rows, a decode step took 35 ms in one chunk and 15 ms
        in chunks. Chunks stay in the reused heap.
        A GPU's caching allocator has no such cost: one chunk there.
        """
        with torch.inference_mode():
            hidden = self.sampled_hidden(model_input)
        if hidden.is_cuda and hidden.shape[0] == 0:  # no logits to wait on: wait for the forward pass itself
            torch.cuda.synchronize(hidden.device)
        # A chunk's logits are at most as many values as the head's weight (rows <= hidden
        # size), so each GEMM call writes no more than it reads: small heads get small chunks
        # that stay in cache for the sampler, big heads are not streamed once per few rows.
        rows_per_chunk = max(1, hidden.shape[0] if hidden.is_cuda else
                             min(hidden.shape[1], LOGITS_CHUNK_BYTES // (4 * self.model_config.vocab_size)))
        for start in range(0, hidden.shape[0], rows_per_chunk):
            with torch.inference_mode():
                logits = self.model.compute_logits(hidden[start:start + rows_per_chunk]).float()
            yield slice(start, start + logits.shape[0]), logits
            del logits

