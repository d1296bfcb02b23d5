"""The engine core: requests in, one step at a time, outputs out (chapter 2).

``step()`` is the whole engine loop in three moves::

    schedule  -> which requests, how many tokens each (CPU control plane)
    execute   -> plan the batch, prepare tensors, run the model, sample (the worker / data plane)
    update    -> append tokens, detect stops, free finished requests, build outputs

This module only wires the engine core together: ``input_processor`` checks prompts,
``parallel_sampling`` fans a request out into its ``n`` completions, ``scheduler`` decides,
``block_manager`` keeps the KV blocks, ``model_runner`` computes, ``output_processor`` makes
outputs (an ``OutputRouter`` hands them out when several readers share the engine: a server).
``snapshot()``, ``memory_report()`` (frozen records) and ``events`` let a reader watch it.
"""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from typing import Callable

import torch

from nanoengine.config import EngineConfig, resolve_max_model_len, resolve_num_kv_blocks
from nanoengine.engine import parallel_sampling
from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.block_table import BlockTables
from nanoengine.backends import Backend, select_backend
from nanoengine.engine.input_processor import InputProcessor, ProcessedPrompt, PromptInput
from nanoengine.engine.model_runner import ModelRunner, SamplingRunner, plan_batch
from nanoengine.engine.output_processor import LiveRequests, OutputProcessor, RequestState
from nanoengine.engine.profiler import StepProfiler
from nanoengine.engine.request import Request, RequestStatus
from nanoengine.engine.scheduler import Scheduler, SchedulerOutput
from nanoengine.engine.snapshots import EngineSnapshot, MemoryReport, RequestSnapshot
from nanoengine.events import BatchPrepared, EventBus, RequestQueued, StepFinished
from nanoengine.models.config import ModelConfig
from nanoengine.outputs import RequestOutput
from nanoengine.sampling_params import SamplingParams
from nanoengine.spec_decode.metrics import SpecDecodeStats
from nanoengine.spec_decode.ngram_proposer import NgramProposer
from nanoengine.structured_output import StructuredOutputManager

RunnerFactory = Callable[[int, int], SamplingRunner]  # (max_model_len, num_kv_blocks) -> runner


class LLMEngine:
    """Add requests, call ``step`` until done. ``LLM`` wraps this for batch use."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, runner: SamplingRunner, tokenizer) -> None:
        self.config = config
        self.model_config = model_config
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = resolve_max_model_len(config, model_config)
        self.events = EventBus()
        self.profiler = StepProfiler()  # where each step's time goes, for StepFinished observers
        self.block_manager = BlockManager(runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching, self.events, profiler=self.profiler)
        # Speculative decoding (chapter 13): who proposes drafts, and how they fared (the scheduler counts).
        spec = config.speculative_config
        self.proposer = NgramProposer(spec, self.max_model_len) if spec is not None else None
        self.spec_decode_stats = SpecDecodeStats(spec.num_speculative_tokens if spec is not None else 0)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.enable_chunked_prefill,
                                   config.scheduling_policy, self.events, self.spec_decode_stats)
        # Structured output (chapter 14): constraints compiled on a thread, one bitmask per step.
        self.structured_output = StructuredOutputManager(config.structured_outputs_config, tokenizer,
                                                         model_config.vocab_size, self.eos_token_ids)
        self.input_processor = InputProcessor(tokenizer, model_config.vocab_size, self.max_model_len,
                                              config.max_num_seqs, self.structured_output.validate)
        self.output_processor = OutputProcessor(tokenizer, profiler=self.profiler)
        # n > 1: siblings held back until the prompt is computed; they fork it when there is no prefix cache
        self.parents = parallel_sampling.ParentRequests(config.block_size, fork=not config.enable_prefix_caching)
        self.block_tables = BlockTables(-(-self.max_model_len // config.block_size),
                                        capacity=config.max_num_seqs + 1)
        self._next_id = 0  # automatic request ids are "0", "1", ...
        self._probe_ids = itertools.count()  # next_token_logits' private requests
        self.step_count = 0
        self._stepping = False  # inside step(): an abort must wait until the batch is done
        self._deferred_aborts: list[str] = []

    @classmethod
    def from_pretrained(cls, model: str | Path | None = None, **kwargs) -> "LLMEngine":
        """Load ``model`` (None = default SmolLM2-135M-Instruct, a HF dir or a .gguf)."""
        from nanoengine.loader.weights import load_model, load_model_config, load_tokenizer, resolve_model_source

        config = EngineConfig.from_kwargs(**kwargs)
        source = resolve_model_source(model)
        model_config = load_model_config(source)

        def make_runner(max_model_len: int, num_blocks: int) -> SamplingRunner:
            if config.tensor_parallel_size > 1:
                from nanoengine.distributed.tp_runner import TensorParallelRunner

                return TensorParallelRunner(source, model_config, config, max_model_len, num_blocks)
            backend = _backend(config, max_model_len)  # first: the layers take their kernels from it
            net = load_model(source, model_config, config.torch_device, config.torch_dtype, max_position=max_model_len,
                             backend=backend)
            return _local_runner(net, config, max_model_len, num_blocks, backend)

        return cls._build(config, model_config, make_runner, load_tokenizer(source))

    @classmethod
    def from_model(cls, net: torch.nn.Module, tokenizer=None, **kwargs) -> "LLMEngine":
        """An engine around an already-built model (random weights in tests and chapters)."""
        config = EngineConfig.from_kwargs(**kwargs)
        if config.tensor_parallel_size != 1:
            raise ValueError("from_model runs the model in this process, so tensor_parallel_size must be 1; "
                             "use LLMEngine.from_pretrained(path, tensor_parallel_size=N) to split a checkpoint")
        return cls._build(config, net.config, lambda max_len, blocks: _local_runner(net, config, max_len, blocks),
                          tokenizer)

    @classmethod
    def _build(cls, config: EngineConfig, model_config: ModelConfig, make_runner: RunnerFactory,
               tokenizer) -> "LLMEngine":
        """Both constructors: resolve the limits first (nothing allocated yet), then the runner."""
        max_model_len = resolve_max_model_len(config, model_config)
        num_blocks = resolve_num_kv_blocks(config, model_config, max_model_len)
        return cls(config, model_config, make_runner(max_model_len, num_blocks), tokenizer)

    def add_request(self, prompt: PromptInput | ProcessedPrompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; returns its id. Checks everything before changing anything.

        ``prompt`` is text, token ids, a chat conversation (a list of ``{'role', 'content'}`` messages), or
        a ``ProcessedPrompt`` that ``input_processor`` already checked (then ``sampling_params`` may be
        omitted). ``arrival_time`` (a ``time.perf_counter()`` value, not in the future) dates a replayed
        trace's request from when it arrived rather than when it was added; TTFT is measured from it.
        """
        processed = self.input_processor.process(prompt, sampling_params)
        params = processed.sampling_params
        automatic = request_id is None
        if automatic:  # the next free number (consumed only once the request is queued)
            while self._id_taken(str(self._next_id), params.n):
                self._next_id += 1
            request_id = str(self._next_id)
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        elif self._id_taken(request_id, params.n):
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        arrival_time = self._check_arrival_time(arrival_time)
        if automatic:
            self._next_id += 1

        def make(child_id: str, child_params: SamplingParams, index: int) -> Request:
            request = Request(child_id, processed.prompt_token_ids, child_params, prompt=processed.prompt,
                              eos_token_ids=self.eos_token_ids, arrival_time=arrival_time,
                              device=self.runner.device, parent_id=request_id, index=index)
            self.structured_output.request_for(request)  # its grammar starts compiling (a thread)
            return request

        parent = parallel_sampling.ParentRequest(request_id, params, make)
        self.output_processor.add_request(RequestState(request_id, processed.prompt, parent.children, self.tokenizer))
        self.parents.add(parent)
        self._queue(parent.first)
        return request_id

    def _queue(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self.events.emit(RequestQueued(self.step_count, request.request_id, request.num_prompt_tokens))

    def _id_taken(self, request_id: str, n: int) -> bool:
        """Whether ``request_id`` (or one of its completions' ids) names an unfinished request."""
        in_use = self.output_processor.id_in_use
        return in_use(request_id) or (n > 1 and any(in_use(i) for i in parallel_sampling.completion_ids(request_id, n)))

    @staticmethod
    def _check_arrival_time(arrival_time: float | None) -> float:
        now = time.perf_counter()
        if arrival_time is None:
            return now
        if isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float)) \
                or not math.isfinite(arrival_time) or arrival_time > now:
            raise ValueError(f"arrival_time must be a finite time.perf_counter() value not in the future "
                             f"(now {now:.3f}), got {arrival_time!r}")
        return float(arrival_time)

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids), checked against the vocabulary and max_model_len."""
        return self.input_processor.tokenize(prompt)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    @property
    def forward_mode(self) -> str:
        """How a step runs the model, in the backend's words (``Backend.forward_mode``; "eager" under tensor
        parallelism). A step with a forward hook runs the layers' Python forward whatever this says."""
        backend = getattr(self.runner, "backend", None)
        return backend.forward_mode() if backend is not None else "eager"

    @property
    def requests(self) -> LiveRequests:
        """Unfinished requests by id, a live read-only mapping (``LiveRequests``): a completion each
        when n > 1, siblings not yet queued included."""
        return LiveRequests(self.output_processor.completions_by_id)

    def has_request(self, request_id: str) -> bool:
        """True while the request ``add_request`` returned this id for is unfinished."""
        return request_id in self.output_processor.states

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request (all its completions) now and free its blocks; returns its final output. Called
        by an event observer during ``step()``, it returns None: the request ends with the step, which returns that."""
        state = self.output_processor.states.get(request_id) if isinstance(request_id, str) else None
        if state is None:
            raise ValueError(f"unknown request id {request_id!r}: no unfinished request has it "
                             f"(unfinished: {sorted(self.output_processor.states)[:10]})")
        if self._stepping:
            self._deferred_aborts.append(request_id)
            return None
        return self._finish_all(state, RequestStatus.FINISHED_ABORTED)

    def _finish_all(self, state: RequestState, status: RequestStatus, error: str | None = None) -> RequestOutput:
        """End every unfinished completion of a user request with ``status``; its final output."""
        self.parents.forget(state.completions[0].request_id)  # held-back siblings are never queued
        for request in state.completions:
            if not request.is_finished:
                request.error = error
                self.scheduler.finish_request(request, status)
        return self.output_processor.make_output(state)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block digest of a free block (blocks in use keep theirs); how many were dropped.
        Between benchmark runs: a later run cannot be served by an earlier one's prompts."""
        return self.block_manager.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        """One iteration (``_step``); returns the outputs of the requests that progressed. An abort asked for
        during it (by an event observer, or a stream closed meanwhile) is applied after it, its output last."""
        self._stepping = True
        try:
            outputs = self._step()
        finally:
            self._stepping = False
        aborted, self._deferred_aborts = dict.fromkeys(self._deferred_aborts), []
        return outputs + [self.abort(request_id) for request_id in aborted if self.has_request(request_id)]

    def _step(self) -> list[RequestOutput]:
        """Schedule -> execute -> update -> outputs, as vLLM v1's engine core steps."""
        self.profiler.start(enabled=self.events.wants(StepFinished))  # a step nobody watches reads no clock
        with self.profiler.phase("schedule"):
            faults = self.structured_output.collect(self.scheduler)  # requests whose grammar did not compile
            sched = self.scheduler.schedule(self.step_count)
        if sched.is_empty:
            return self._outputs([], faults)
        with self.profiler.phase("prepare"):
            plan, sampled = plan_batch(sched, self.config.block_size, self.block_tables)
            bitmask = self.structured_output.grammar_bitmask(sampled, plan.sampled_drafts)
        if self.events.wants(BatchPrepared, keep=False):  # a copy of every index list: only for someone watching
            self.events.emit(BatchPrepared(self.step_count, plan.rows()), keep=False)
        result = self.runner.execute_model(plan, sampled, self.profiler, bitmask)
        with self.profiler.phase("update"):
            produced = self.scheduler.update_from_output(sched, result, self.output_processor)
            self.parents.after_update(produced, self._queue)  # n > 1: siblings queued once the prompt is computed
            if self.proposer is not None:
                self.proposer.propose_drafts(produced, len(sched.scheduled))
            outputs = self._outputs(produced, {**result.failed, **faults})
        if self.profiler.enabled:
            self.events.emit(StepFinished.of(self.step_count, sched, self.profiler.finish()))
        self.step_count += 1
        return outputs

    def _outputs(self, produced: list[Request], faults: dict[str, Exception]) -> list[RequestOutput]:
        """One per user request that progressed; then each a completion of which raised in this step (grammar, sampling,
        text, output) ends with finish_reason "error", the others go on (a fault of the forward pass is raised)."""
        outputs = self.output_processor.make_outputs(produced, faults)  # adds the requests whose output failed
        return outputs + [self._finish_all(state, RequestStatus.FINISHED_ERROR, error)
                          for state, error in self.output_processor.failed(faults, self.step_count)]

    def decode(self, token_ids: list[int]) -> str:
        """Token ids to text, special tokens included (for showing single tokens)."""
        return self.output_processor.decode(token_ids)

    def next_token_logits(self, prompt: str | list[int]) -> torch.Tensor:
        """The model's raw logits (vocab,) for the token after ``prompt`` (chapter 8).

        Runs one prefill through the real paged cache using free blocks, then frees them;
        queued and running requests are untouched. Its full blocks stay in the prefix
        cache, so asking again for the same prompt is cheap.
        """
        _, token_ids = self.tokenize_prompt(prompt)
        probe = Request(f"probe-{next(self._probe_ids)}", token_ids, SamplingParams(temperature=0.0, max_tokens=1),
                        device=self.runner.device)
        computed, num_cached, _ = self.scheduler.computed_blocks(probe)  # the prefix cache, asked as admission asks it
        num_new = len(token_ids) - num_cached
        if not self.block_manager.allocate_slots(probe, num_new, computed):
            raise RuntimeError(f"not enough free KV blocks to score a {len(token_ids)}-token prompt "
                               f"({self.block_manager.num_free_blocks} free); finish or abort some requests")
        probe.num_computed_tokens = num_cached
        try:
            batch = SchedulerOutput()
            batch.add(probe, num_new)
            logits = self.runner.compute_logits(plan_batch(batch, self.config.block_size, self.block_tables)[0])[0]
            probe.num_computed_tokens = len(token_ids)
            self.block_manager.cache_full_blocks(probe)
        finally:
            self.block_manager.free(probe)
        return logits

    def snapshot(self) -> EngineSnapshot:
        bm, spec = self.block_manager, self.spec_decode_stats
        return EngineSnapshot(
            step=self.step_count,
            waiting=tuple(RequestSnapshot.of(r) for r in self.scheduler.waiting),
            running=tuple(RequestSnapshot.of(r) for r in self.scheduler.running),
            blocks=bm.snapshot(), block_size=self.config.block_size,
            num_free_blocks=bm.num_free_blocks, num_cached_blocks=bm.num_cached_blocks,
            kv_cache_bytes=self.runner.kv_cache_bytes, max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens, max_model_len=self.max_model_len,
            prefix_cache_queries=self.scheduler.prefix_queries, prefix_cache_hits=self.scheduler.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, num_evictions=bm.num_evictions,
            scheduling_policy=self.config.scheduling_policy, num_speculative_tokens=spec.num_spec_tokens,
            spec_decode_num_drafts=spec.num_drafts, spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens)

    def memory_report(self) -> MemoryReport:
        """Bytes of weights (and any copies the backend made of them) and of the KV cache, and the KV sizes."""
        usage = self.runner.memory_usage()
        dtype = self.config.torch_dtype
        return MemoryReport(
            weight_bytes=usage["weight_bytes"], weight_copy_bytes=usage["weight_copy_bytes"],
            weight_copies=usage["weight_copies"],
            kv_cache_bytes=usage["kv_cache_bytes"], num_kv_blocks=self.runner.num_blocks,
            block_size=self.config.block_size,
            kv_bytes_per_token=self.model_config.kv_bytes_per_token(torch.empty(0, dtype=dtype).element_size()),
            dtype=str(dtype).removeprefix("torch."), tensor_parallel_size=self.config.tensor_parallel_size)

    def check_invariants(self) -> None:
        """Raise if block bookkeeping is inconsistent (tests call this after every step)."""
        self.block_manager.check_invariants(self.scheduler.running)
        self.block_tables.check_rows(self.scheduler.running)
        for request in self.scheduler.waiting:
            if request.block_ids:
                raise AssertionError(f"waiting request {request.request_id} holds blocks {request.block_ids}")

    def shutdown(self) -> None:
        """Release worker processes (tensor parallelism); a no-op for a single process."""
        self.structured_output.shutdown()
        close = getattr(self.runner, "shutdown", None)
        if close is not None:
            close()


def _backend(config: EngineConfig, max_model_len: int) -> Backend:
    """The backend for the engine's device and dtype, chosen once (``EngineConfig`` says what its options do)."""
    return select_backend(config.torch_device, dtype=config.torch_dtype, compile=config.compile,
                          enforce_eager=config.enforce_eager, max_model_len=max_model_len,
                          cuda_graph_max_batch=0 if config.enforce_eager else min(config.max_num_seqs, 512))


def _local_runner(net: torch.nn.Module, config: EngineConfig, max_model_len: int, num_blocks: int,
                  backend: Backend | None = None) -> ModelRunner:
    """A runner with the model in this process, on ``backend`` (the engine's, when not given)."""
    backend = backend if backend is not None else _backend(config, max_model_len)
    return ModelRunner(net, net.config, num_blocks, config.block_size, config.torch_device, config.torch_dtype,
                       config.seed, backend=backend)
