"""The model runner: the worker side of a step (chapters 2, 3 and 6).

It owns the model and the KV cache, one preallocated tensor::

    kv_cache: (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)

The scheduler's decision becomes a ``BatchPlan`` (``plan_batch``: short lists, and the
block tables and slots gathered from the engine's persistent ``BlockTables``), then
tensors on the model's device (``prepare_inputs``):

* ``input_ids`` / ``positions``: the tokens to compute, decodes first then prefill chunks
  (a decode that checks k drafted tokens is k+1 decode rows, chapter 13),
* ``slot_mapping``: where each token's K/V goes (``block_table[pos // B] * B + pos % B``),
* block tables and context lengths: where each sequence's earlier K/V already is,
* ``logits_indices``: the rows whose logits are needed, one per sequence that reaches
  its last token this step (a mid-prompt chunk samples nothing), and one more per draft.

``execute_model`` then reads as the step does: forward pass, logits for those rows only, the
grammar bitmask over them (structured output), sample (or keep the drafts the model agrees
with: ``sample_requests``). Everything that depends on the hardware (the attention kernels and
their metadata, the GEMM weights' layout, a compiled or graphed forward, logits in chunks) is
the runner's device backend, picked once (``nanoengine.backends``; ``CpuBackend`` on a CPU).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import nn

from nanoengine.backends import Backend, select_backend
from nanoengine.layers.kernels import REFERENCE, LayerKernels, building_with
from nanoengine.backends.compilation import CompileReport
from nanoengine.engine.block_table import BlockTables
from nanoengine.engine.profiler import NO_PROFILER, StepProfiler
from nanoengine.engine.request import Request
from nanoengine.engine.scheduler import SchedulerOutput
from nanoengine.events import BatchRow
from nanoengine.layers.attention import AttentionMetadata
from nanoengine.layers.sampler import Sampler, SampleResult
from nanoengine.models.config import ModelConfig
from nanoengine.sampling_params import SamplingParams
from nanoengine.spec_decode.rejection import accept_drafts, accept_greedy
from nanoengine.structured_output.backend import apply_token_bitmask


@dataclass
class BatchPlan:
    """One step's batch: what ``prepare_inputs`` puts on the model's device. Plain data (short lists,
    and CPU tensors gathered from ``BlockTables``) so it can also be sent to tensor-parallel workers."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: torch.Tensor | list[int]  # (T,) int64
    num_decode_tokens: int  # decode rows: one per decoding request, plus one per draft it checks
    decode_block_tables: torch.Tensor | list[list[int]]  # (decode rows, blocks) int32, -1 past a table's end
    decode_context_lens: list[int]  # per decode row: the tokens it attends to, itself included
    prefill_block_tables: torch.Tensor | list[list[int]]  # (prefills, blocks) int32
    prefill_cu_seqlens_q: list[int]
    prefill_context_lens: list[int]
    logits_indices: list[int]
    request_ids: list[str]  # the scheduled requests in model order (decodes, then prefills)
    query_start_loc: list[int]  # request i's tokens are rows query_start_loc[i]:query_start_loc[i+1]
    num_decode_requests: int = 0  # the first this many of ``request_ids`` decode
    # Per request that samples (``logits_indices`` order): the drafts it checks. Its
    # logits rows are its last token's and one per draft. Empty: nobody speculates.
    sampled_drafts: list[tuple[int, ...]] = field(default_factory=list)

    @classmethod
    def dummy(cls, num_tokens: int, block_size: int | None = None) -> "BatchPlan":
        """A warm-up prefill of ``num_tokens`` tokens that writes no KV (slot -1) and reads block 0 only.
        With ``block_size``, its K/V go to the cache's first blocks as a prompt's would (before any request
        holds a block), so the backend runs it the way it runs requests."""
        n = num_tokens
        slots, table = [-1] * n, [0] * n
        if block_size is not None:
            slots, table = list(range(n)), list(range(-(-n // block_size)))
        return cls(input_ids=[0] * n, positions=[0] * n, slot_mapping=slots, num_decode_tokens=0,
                   decode_block_tables=[], decode_context_lens=[], prefill_block_tables=[table],
                   prefill_cu_seqlens_q=[0, n], prefill_context_lens=[n], logits_indices=list(range(n)),
                   request_ids=["warm-up"], query_start_loc=[0, n])

    def rows(self) -> tuple[BatchRow, ...]:
        """Per request: its positions, slots and block table (for the ``BatchPrepared`` event)."""
        decode_tables, prefill_tables = _as_lists(self.decode_block_tables), _as_lists(self.prefill_block_tables)
        slots = _as_lists(self.slot_mapping)
        sampling_rows = set(self.logits_indices)
        starts, ends = self.query_start_loc[:-1], self.query_start_loc[1:]
        decoding = self.num_decode_requests

        def table(i: int, first_row: int) -> tuple[int, ...]:  # a decode request's rows share its table
            row = decode_tables[first_row] if i < decoding else prefill_tables[i - decoding]
            return tuple(t for t in row if t >= 0)

        return tuple(
            BatchRow(request_id, i >= decoding, tuple(self.positions[a:b]), tuple(slots[a:b]), table(i, a),
                     b - 1 in sampling_rows)
            for i, (request_id, a, b) in enumerate(zip(self.request_ids, starts, ends)))


def _as_lists(values) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn_metadata: AttentionMetadata  # built by the device backend (``Backend.build_metadata``)
    logits_indices: torch.Tensor  # (S,) rows of the flat batch to compute logits for


def plan_batch(out: SchedulerOutput, block_size: int,
               block_tables: BlockTables | None = None) -> tuple[BatchPlan, list[Request]]:
    """Flatten the scheduled requests into one batch: decodes first, then prefill chunks.

    Returns the plan and the requests that sample this step, in the order of
    ``logits_indices`` (a request checking k drafts owns k+1 consecutive entries there).
    A decode with drafts is one decode row per token: row i attends to the cache up to
    its own position (context length ``start + 1 + i``), which is exactly causal
    attention over the drafts, and each row runs through the same kernels as a plain
    decode, so the rows' logits are the ones plain decoding would compute.
    ``block_tables``: the engine's persistent ``BlockTables`` (a temporary one without), from
    which every token's slot is gathered, ``table[row, pos // B] * B + pos % B``.
    """
    decodes = [s for s in out.scheduled if not s.is_prefill]
    prefills = [s for s in out.scheduled if s.is_prefill]
    ordered = decodes + prefills
    if block_tables is None:
        most = max((len(s.request.block_ids) for s in ordered), default=1)
        block_tables = BlockTables(max(most, 1), capacity=max(len(ordered), 1))
    rows = block_tables.rows(ordered)
    input_ids, positions, logits_indices, sampled, drafts = [], [], [], [], []
    counts, cu_seqlens, query_start = [], [0], [0]
    decode_rows, decode_context_lens = [], []
    for scheduled, row in zip(ordered, rows):
        request, span = scheduled.request, scheduled.positions
        if scheduled.draft_token_ids:  # its last token, then the guesses after it
            input_ids.append(request.all_token_ids[span.start])
            input_ids.extend(scheduled.draft_token_ids)
        else:
            input_ids.extend(request.all_token_ids[span.start:span.stop])
        positions.extend(span)
        counts.append(scheduled.num_tokens)
        query_start.append(len(input_ids))
        if scheduled.is_prefill:
            cu_seqlens.append(cu_seqlens[-1] + scheduled.num_tokens)
        else:
            decode_rows.extend([row] * scheduled.num_tokens)
            decode_context_lens.extend(range(span.start + 1, span.stop + 1))
        if scheduled.samples:  # the last known token: its logits give the next; each draft's check it
            logits_indices.extend(range(len(input_ids) - 1 - scheduled.num_draft_tokens, len(input_ids)))
            sampled.append(request)
            drafts.append(scheduled.draft_token_ids)
    # Every token's slot from the persistent table: one gather, no per-token Python.
    pos = torch.tensor(positions, dtype=torch.long)
    token_rows = torch.tensor(rows, dtype=torch.long).repeat_interleave(torch.tensor(counts, dtype=torch.long)) \
        if len(ordered) != len(positions) else torch.tensor(rows, dtype=torch.long)
    slots = block_tables.table[token_rows, pos // block_size].long() * block_size + pos % block_size
    num_decodes = len(decodes)

    def width(group) -> int:
        return max((len(s.request.block_ids) for s in group), default=0)

    plan = BatchPlan(
        input_ids=input_ids, positions=positions, slot_mapping=slots, num_decode_tokens=len(decode_rows),
        decode_block_tables=block_tables.gather(decode_rows, width(decodes)),
        decode_context_lens=decode_context_lens,
        prefill_block_tables=block_tables.gather(rows[num_decodes:], width(prefills)),
        prefill_cu_seqlens_q=cu_seqlens,
        prefill_context_lens=[s.num_computed_tokens + s.num_tokens for s in prefills],
        logits_indices=logits_indices,
        request_ids=[s.request.request_id for s in ordered], query_start_loc=query_start,
        num_decode_requests=num_decodes, sampled_drafts=drafts if any(drafts) else [])
    return plan, sampled


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Each sampling request's new tokens: one, or, after checking k drafts, 1 to k+1. A request whose
    sampling raised (``SamplingRunner.sample_contained``) has none, its error in ``failed`` instead."""

    sampled: dict[str, list[int]]  # request id -> new tokens
    logprobs: dict[str, list[tuple]]  # request id -> per new token (its logprob, top-N pairs)
    failed: dict[str, Exception] = field(default_factory=dict)  # request id -> what its sampling raised

    @classmethod
    def of(cls, requests: list[Request], tokens: list[list[int] | None], logprobs: list[list | None],
           failed: dict[str, Exception] | None = None) -> "ModelRunnerOutput":
        ids = [r.request_id for r in requests]
        return cls(sampled={i: t for i, t in zip(ids, tokens) if t is not None},
                   logprobs={i: lp for i, lp in zip(ids, logprobs) if lp is not None}, failed=failed or {})


def request_chunks(row_counts: list[int], rows_per_chunk: int):
    """Split requests owning ``row_counts`` consecutive logits rows into chunks of about
    ``rows_per_chunk`` rows, never splitting a request. Yields (rows slice, requests slice)."""
    first_row = first = 0
    rows = 0
    for i, count in enumerate(row_counts):
        rows += count
        if rows >= rows_per_chunk or i == len(row_counts) - 1:
            yield slice(first_row, first_row + rows), slice(first, i + 1)
            first_row, first, rows = first_row + rows, i + 1, 0


class SamplingRunner:
    """What every runner shares: prepare the step, run the model, sample. ``ModelRunner`` runs the model
    in this process, ``TensorParallelRunner`` in worker processes; both sample here, with each request's
    own generator, so seeded requests give the same tokens whatever the runner."""

    compilation: CompileReport = CompileReport.not_requested()  # what compile=True did (backends.compilation)

    def __init__(self, model_config: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 seed: int, kernels: LayerKernels = REFERENCE) -> None:
        self.model_config = model_config
        self.num_blocks = num_blocks  # per rank under tensor parallelism: the same block ids on every rank
        self.block_size = block_size
        self.device = device  # where the sampler and the generators run
        with building_with(kernels):  # the backend's sampling kernel, if it has one
            self.sampler = Sampler()
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def prepare_inputs(self, plan: BatchPlan) -> object:
        """This step's model input, built from the plan."""
        raise NotImplementedError

    def run_model(self, prepared) -> torch.Tensor:
        """Run the model on a prepared step. -> (num sampled, vocab) float32 logits."""
        raise NotImplementedError

    def logits_chunks(self, prepared, row_counts: list[int], profiler: StepProfiler = NO_PROFILER):
        """Yield (rows slice, requests slice, logits) of the rows to sample, in chunks of whole requests
        (``row_counts``: each sampling request's logits rows). Here, one chunk: ``run_model``'s."""
        with profiler.phase("model"):
            logits = self.run_model(prepared)
            self.wait_if_profiled(profiler)
        yield slice(None), slice(None), logits

    def wait_if_profiled(self, profiler: StepProfiler) -> None:
        """In a profiled step, wait for the device, so that ``model`` holds a GPU's time and not just
        its launches (sampling would wait for it anyway)."""
        if profiler.enabled:
            self.synchronize()

    def memory_usage(self) -> dict[str, int]:
        """Bytes of weights, packed weight copies and KV cache (all ranks together)."""
        raise NotImplementedError

    def compute_logits(self, plan: BatchPlan) -> torch.Tensor:
        """Logits of every planned request that reaches its last token, without sampling."""
        return self.run_model(self.prepare_inputs(plan))

    @torch.inference_mode()
    def execute_model(self, plan: BatchPlan, sampled: list[Request], profiler: StepProfiler = NO_PROFILER,
                      grammar_bitmask: torch.Tensor | None = None) -> ModelRunnerOutput:
        """One planned step: inputs, forward pass, then logits and sampling, chunk by chunk (``logits_chunks``).

        ``sampled`` are the requests that sample, in the order of ``plan.logits_indices``.
        ``grammar_bitmask``: one packed row per logits row (structured output, chapter 14), applied
        to the logits before anything samples from them. Each part runs in its ``profiler`` phase.
        """
        with profiler.phase("prepare"):
            prepared = self.prepare_inputs(plan)
        drafts = plan.sampled_drafts or [()] * len(sampled)
        token_ids, logprobs, failed = [], [], {}
        for rows, requests, logits in self.logits_chunks(prepared, [1 + len(d) for d in drafts], profiler):
            with profiler.phase("sample"):
                if grammar_bitmask is not None:  # structured output: forbidden tokens' logits to -inf
                    apply_token_bitmask(logits, grammar_bitmask[rows])
                chunk_tokens, chunk_logprobs, chunk_failed = self.sample_contained(logits, sampled[requests],
                                                                                   drafts[requests])
            del logits  # freed before the next chunk is computed, so its memory is reused
            token_ids += chunk_tokens
            logprobs += chunk_logprobs
            failed.update(chunk_failed)
        return ModelRunnerOutput.of(sampled, token_ids, logprobs, failed)

    def synchronize(self) -> None:
        """Wait until the device has finished the work launched so far, for a profiled step's
        phases (``execute_model``): a no-op here, the device backend's wait in ``ModelRunner``."""

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        if not requests:
            return SampleResult([], [])
        return self.sampler(logits, [r.sampling_params for r in requests], [r.generator for r in requests],
                            self.generator)

    def sample_contained(self, logits: torch.Tensor, requests: list[Request], drafts: list[tuple[int, ...]]):
        """``sample_requests``, with a fault kept to the request whose settings caused it. -> (tokens, logprobs, failed)

        If the batch raises, every request samples again alone, with the generators restored (a seeded
        request draws what it would have drawn): one that raises again gets its error in ``failed``, the
        others their tokens. A fault no single request reproduces, or that every request of several
        reproduces, is the engine's own and is raised.
        """
        sampled = [r for r in requests if not r.sampling_params.greedy]  # greedy rows draw nothing
        candidates = (self.generator, *(r.generator for r in sampled)) if sampled else ()
        generators = {id(g): g for g in candidates if g is not None}
        saved = [(g, g.get_state()) for g in generators.values()]
        try:
            return *self.sample_requests(logits, requests, drafts), {}
        except Exception as batch_error:
            for generator, state in saved:
                generator.set_state(state)
            starts = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))
            tokens: list = [None] * len(requests)
            logprobs: list = [None] * len(requests)
            failed: dict[str, Exception] = {}
            for i, request in enumerate(requests):
                try:
                    alone = self.sample_requests(logits[starts[i]:starts[i + 1]], [request], [drafts[i]])
                except Exception as exc:
                    failed[request.request_id] = exc
                else:
                    tokens[i], logprobs[i] = alone[0][0], alone[1][0]
            if not failed or (len(failed) == len(requests) > 1):
                raise batch_error
            return tokens, logprobs, failed

    def sample_requests(self, logits: torch.Tensor, requests: list[Request], drafts: list[tuple[int, ...]]):
        """Each request's new tokens from its logits rows. -> (tokens, logprobs) per request.

        A request that checked k drafts owns k+1 rows and keeps the drafts the model agrees with, then
        one token of the model's own (``spec_decode.rejection``): plain sampling's distribution.
        """
        if not any(drafts):
            result = self.sample(logits, requests)
            return ([[t] for t in result.token_ids],
                    [None if lp is None else [lp] for lp in result.logprobs])
        starts = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))
        plain = [i for i, d in enumerate(drafts) if not d]
        tokens: list = [None] * len(requests)
        logprobs: list = [None] * len(requests)
        if plain:
            rows = torch.tensor([starts[i] for i in plain], device=logits.device)
            result = self.sample(logits.index_select(0, rows), [requests[i] for i in plain])
            for i, token, lp in zip(plain, result.token_ids, result.logprobs):
                tokens[i], logprobs[i] = [token], None if lp is None else [lp]
        for i, request_drafts in enumerate(drafts):
            if not request_drafts:
                continue
            request, rows = requests[i], logits[starts[i]:starts[i + 1]].float()
            params = request.sampling_params
            if params.greedy:
                emitted = accept_greedy(rows.max(dim=-1).indices.tolist(), request_drafts)
            else:
                probs = self.sampler.distribution(rows, [params] * rows.shape[0])
                emitted = accept_drafts(probs, request_drafts, request.generator or self.generator)
            tokens[i] = emitted
            if params.logprobs is not None:
                logprobs[i] = self.sampler.token_logprobs(rows[:len(emitted)], [params] * len(emitted), emitted)
        return tokens, logprobs


class ModelRunner(SamplingRunner):
    """Holds the model and the paged KV cache; prepares inputs, runs, samples. The model must have been
    built with the device backend's kernels (``loader.build_model``); the backend prepares it once."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, seed: int = 0, backend: Backend | None = None) -> None:
        backend = backend if backend is not None else select_backend(device, dtype=dtype)
        super().__init__(model_config, num_blocks, block_size, device, seed, backend.kernels)
        self.model = model
        self.dtype = dtype
        self.backend = backend
        built_for = getattr(model, "kernels", REFERENCE)  # a model constructed outside build_model: the reference
        if built_for.name != self.backend.kernels.name:
            raise ValueError(f"this model was built with the {built_for.name!r} kernels and this engine's backend "
                             f"runs {self.backend.kernels.name!r}: build the model for the engine's backend "
                             f"(loader.build_model(..., backend=...))")
        layers = model.attention_layers()
        if layers[0].k_cache is not None:
            raise ValueError("this model is already bound to another engine's KV cache; two engines sharing "
                             "one model object would overwrite each other's cache: build a model per engine")
        # The metadata the backend builds is for the attention kernels the layers hold (vLLM's runner,
        # too, asks its layers for their attention backends): one object, whoever built the model.
        self.backend.attention = layers[0].impl
        num_kv_heads = layers[0].num_kv_heads  # this rank's share under tensor parallelism
        self.kv_cache = torch.zeros(2, len(layers), num_blocks, block_size, num_kv_heads,
                                    model_config.head_dim, dtype=dtype, device=device)
        for i, attn in enumerate(layers):
            attn.bind(self.kv_cache[0, i], self.kv_cache[1, i])
        self.backend.bind_kv_cache(block_size, dtype)
        self.backend.process_weights_after_loading(model)
        self.backend.prepare_forward(self)  # may compile (sets self.compilation) or capture graphs

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.nbytes

    def synchronize(self) -> None:
        self.backend.synchronize()

    def memory_usage(self) -> dict[str, int | str]:
        """Bytes of the weights, of the backend's copies of them (and what those are), of the KV cache."""
        weights = sum(t.nbytes for t in self.model.parameters())  # tied embeddings counted once
        return {"weight_bytes": weights, "weight_copy_bytes": self.backend.weight_copy_bytes,
                "weight_copies": self.backend.weight_copies if self.backend.weight_copy_bytes else "",
                "kv_cache_bytes": self.kv_cache_bytes}

    def prepare_inputs(self, plan: BatchPlan) -> ModelInput:
        """The step's tensors on this runner's device, the attention metadata built by the backend."""
        device = self.device
        return ModelInput(torch.tensor(plan.input_ids, dtype=torch.long, device=device),
                          torch.tensor(plan.positions, dtype=torch.long, device=device),
                          self.backend.build_metadata(plan),
                          torch.tensor(plan.logits_indices, dtype=torch.long, device=device))

    @torch.inference_mode()
    def run_model(self, model_input: ModelInput) -> torch.Tensor:
        """Forward pass and logits of the rows to sample. -> (S, vocab) float32."""
        return self.logits(self.sampled_hidden(model_input))

    @torch.inference_mode()
    def sampled_hidden(self, model_input: ModelInput) -> torch.Tensor:
        """Forward pass (as the backend runs it); the final hidden states of the rows to sample. -> (S, hidden)."""
        hidden = self.backend.forward(self.model, model_input.input_ids, model_input.positions,
                                      model_input.attn_metadata)
        return hidden[model_input.logits_indices]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on final hidden states. (S, hidden) -> (S, vocab) float32."""
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def logits_chunks(self, model_input: ModelInput, row_counts: list[int], profiler: StepProfiler = NO_PROFILER):
        """The forward pass, then the sampled rows' logits in the backend's chunks (one on a GPU), each
        dropped here once the caller asks for the next, so it is freed before the next is computed."""
        with profiler.phase("model"):
            hidden = self.sampled_hidden(model_input)
        config = self.model_config
        step = self.backend.logits_rows_per_chunk(hidden.shape[0], config.vocab_size, config.hidden_size)
        for rows, requests in request_chunks(row_counts, step):
            with profiler.phase("model"):
                logits = self.logits(hidden[rows])
                self.wait_if_profiled(profiler)
            yield rows, requests, logits
            del logits

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, write_kv: bool = False) -> None:
        """Run one dummy step of ``num_tokens`` tokens through the model and the sampler (with a generator
        of its own), so that compiling happens now and not during the first real steps. It writes no KV
        (``BatchPlan.dummy``) unless ``write_kv`` (a step with unwritten slots may run another way)."""
        if write_kv and num_tokens > self.num_blocks * self.block_size:
            raise ValueError(f"a warm-up step writing KV takes at most the cache's "
                             f"{self.num_blocks * self.block_size} slots, got {num_tokens} tokens")
        plan = BatchPlan.dummy(num_tokens, self.block_size if write_kv else None)
        logits = self.run_model(self.prepare_inputs(plan))
        params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.01)
        generator = torch.Generator(device=self.device).manual_seed(0)
        self.sampler(logits, [params] * num_tokens, [generator] * num_tokens)
