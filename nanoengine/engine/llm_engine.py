"""The engine core: requests in, one step at a time, outputs out (chapter 2).

``step()`` is the whole engine loop in three moves::

    schedule  -> which requests, how many tokens each (CPU control plane)
    execute   -> prepare tensors, run the model, sample (the worker / data plane)
    update    -> append tokens, detect stops, free finished requests, build outputs

Everything a reader or a simulator wants to watch is available without touching internal
state: ``snapshot()`` returns frozen records of the queues and blocks, and ``events``
publishes what happened (queued, scheduled, preempted, finished, blocks allocated, freed,
cached, evicted, prefix hits, step timings).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoengine.config import EngineConfig
from nanoengine.engine.block_manager import BlockManager, BlockSnapshot
from nanoengine.engine.detokenizer import IncrementalDetokenizer
from nanoengine.engine.model_runner import ModelRunner, kv_cache_num_blocks
from nanoengine.engine.request import Request, RequestStatus
from nanoengine.engine.scheduler import Scheduler, SchedulerOutput
from nanoengine.events import EventBus, RequestQueued, StepFinished
from nanoengine.models.config import ModelConfig
from nanoengine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from nanoengine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestSnapshot:
    request_id: str
    status: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_tokens: int
    max_tokens: int
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    num_preemptions: int


@dataclass(frozen=True)
class EngineSnapshot:
    """A frozen picture of the engine between two steps."""

    step: int
    waiting: tuple[RequestSnapshot, ...]
    running: tuple[RequestSnapshot, ...]
    blocks: tuple[BlockSnapshot, ...]
    block_size: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_cache_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class LLMEngine:
    """Add requests, call ``step`` until done. ``LLM`` wraps this for batch use."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, runner: ModelRunner, tokenizer) -> None:
        self.config = config
        self.model_config = model_config
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.events = EventBus()
        self.block_manager = BlockManager(runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching, self.events)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.enable_chunked_prefill,
                                   config.scheduling_policy, self.events)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._next_id = 0  # automatic request ids are "0", "1", ...
        self._probe_ids = itertools.count()  # next_token_logits' private requests
        self.step_count = 0
        self._stepping = False  # inside step(): an abort must wait until the batch is done
        self._deferred_aborts: list[str] = []

    # ------------------------------------------------------------ creation
    @classmethod
    def from_pretrained(cls, model: str | Path | None = None, **kwargs) -> "LLMEngine":
        """Load ``model`` (None = default SmolLM2-135M-Instruct, a HF dir or a .gguf)."""
        from nanoengine.loader.weights import load_model, load_model_config, load_tokenizer, resolve_model_source

        config = EngineConfig.from_kwargs(**kwargs)
        source = resolve_model_source(model)
        model_config = load_model_config(source)
        max_model_len = check_max_model_len(config, model_config)
        if config.tensor_parallel_size > 1:
            from nanoengine.distributed.tp_runner import TensorParallelRunner

            runner = TensorParallelRunner(source, model_config, config, max_model_len)
        else:
            device, dtype = config.torch_device, config.torch_dtype
            num_blocks = check_kv_blocks(config, model_config, max_model_len)
            net = load_model(source, model_config, device, dtype, max_position=max_model_len)
            runner = ModelRunner(net, model_config, num_blocks, config.block_size, device, dtype, config.seed,
                                 cuda_graph_max_batch=0 if config.enforce_eager else min(config.max_num_seqs, 512),
                                 max_model_len=max_model_len, compile=config.compile)
        return cls(config, model_config, runner, load_tokenizer(source))

    @classmethod
    def from_model(cls, net: torch.nn.Module, tokenizer=None, **kwargs) -> "LLMEngine":
        """An engine around an already-built model (random weights in tests and chapters)."""
        config = EngineConfig.from_kwargs(**kwargs)
        model_config = net.config
        max_model_len = check_max_model_len(config, model_config)
        num_blocks = check_kv_blocks(config, model_config, max_model_len)
        runner = ModelRunner(net, model_config, num_blocks, config.block_size, config.torch_device,
                             config.torch_dtype, config.seed,
                             cuda_graph_max_batch=0 if config.enforce_eager else min(config.max_num_seqs, 512),
                             max_model_len=max_model_len, compile=config.compile)
        return cls(config, model_config, runner, tokenizer)

    # ------------------------------------------------------------- requests
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id. Checks everything before changing anything."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        request = self.make_request(prompt, params, request_id)
        if request_id is None:
            self._next_id += 1
        self.requests[request.request_id] = request
        self._detokenizers[request.request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        self.scheduler.add_request(request)
        self.events.emit(RequestQueued(self.step_count, request.request_id, request.num_prompt_tokens))
        return request.request_id

    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None) -> Request:
        """Validate and tokenize one request without queueing it."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {params!r:.80} ({type(params).__name__})")
        if request_id is None:  # the next free number; only add_request consumes it
            while str(self._next_id) in self.requests:
                self._next_id += 1
            request_id = str(self._next_id)
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        elif request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        text, token_ids = self.tokenize_prompt(prompt)
        for t in params.stop_token_ids:
            if t >= self.model_config.vocab_size:
                raise ValueError(f"stop_token_ids holds {t}, outside the vocabulary [0, {self.model_config.vocab_size})")
        return Request(request_id, token_ids, params, prompt=text, eos_token_ids=self.eos_token_ids,
                       device=self.runner.device)

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids), checked against the vocabulary and max_model_len."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass the prompt as a list of token ids")
            if not prompt:
                raise ValueError("prompt is empty: give at least one character or token id")
            text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)):
            text, token_ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        else:
            raise TypeError(f"prompt must be a string or a list of token ids, got {prompt!r:.80} "
                            f"({type(prompt).__name__})")
        if not token_ids:
            raise ValueError("prompt is empty: it has no tokens")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}; "
                             f"shorten it or raise max_model_len")
        return text, token_ids

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output.

        Called by an event observer during ``step()``, the request is in the batch being
        run, so it ends when that step does (the step returns its final output) and this
        returns None.
        """
        request = self.requests.get(request_id) if isinstance(request_id, str) else None
        if request is None:
            raise ValueError(f"unknown request id {request_id!r}: no unfinished request has it "
                             f"(unfinished: {sorted(self.requests)[:10]})")
        if self._stepping:
            self._deferred_aborts.append(request_id)
            return None
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return self._finish_output(request, "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ----------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute, update. Returns outputs of requests that progressed.

        Aborts requested by observers during the step are applied once it is over; their
        final outputs come last.
        """
        self._stepping = True
        try:
            outputs = self._step()
        finally:
            self._stepping = False
        aborted, self._deferred_aborts = dict.fromkeys(self._deferred_aborts), []
        return outputs + [self.abort(request_id) for request_id in aborted if request_id in self.requests]

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.block_manager.step = self.scheduler.step = self.step_count
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        if sched.is_empty:
            return []
        num_prefill, num_decode = sched.num_prefill_tokens, sched.num_decode_tokens
        for request, _ in sched.scheduled:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = t1
        result = self.runner.execute_model(sched)
        produced = self.scheduler.update_from_output(sched, result.sampled)
        outputs = [self._output(request, result.logprobs.get(request.request_id)) for request in produced]
        total = time.perf_counter() - t0
        self.events.emit(StepFinished(self.step_count, num_prefill, num_decode, len(sched.scheduled),
                                      len(sched.preempted), sched.token_budget, t1 - t0, result.prepare_time,
                                      result.model_time, result.sample_time, total))
        self.step_count += 1
        return outputs

    def _output(self, request: Request, logprobs) -> RequestOutput:
        now = time.perf_counter()
        if request.first_token_time is None:
            request.first_token_time = now
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        detok = self._detokenizers[request.request_id]
        delta = detok.update([request.output_token_ids[-1]], request.is_finished)
        if detok.stop_hit is not None and not request.is_finished:
            request.stop_reason = detok.stop_hit
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        if request.is_finished:
            return self._finish_output(request, delta)
        return self._make_output(request, delta)

    def _finish_output(self, request: Request, delta: str) -> RequestOutput:
        """Final output of a finished request: flush held-back text, forget the request."""
        request.finished_time = time.perf_counter()
        del self.requests[request.request_id]
        detok = self._detokenizers.pop(request.request_id)
        delta += detok.update([], True)
        return self._make_output(request, delta, detok)

    def _make_output(self, request: Request, delta: str, detok: IncrementalDetokenizer | None = None) -> RequestOutput:
        detok = detok or self._detokenizers[request.request_id]
        logprobs = None
        if request.sampling_params.logprobs is not None:
            logprobs = tuple(self._token_logprobs(tok, lp) for tok, lp in zip(request.output_token_ids,
                                                                              request.output_logprobs))
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=tuple(request.prompt_token_ids), text=detok.text,
            token_ids=tuple(request.output_token_ids), finished=request.is_finished,
            finish_reason=request.status.finish_reason, num_cached_tokens=request.num_cached_tokens,
            metrics=RequestMetrics(request.arrival_time, request.first_scheduled_time, request.first_token_time,
                                   request.finished_time, request.num_output_tokens),
            logprobs=logprobs, stop_reason=request.stop_reason, delta=delta)

    def _token_logprobs(self, token_id: int, entry) -> tuple[TokenLogprob, ...]:
        sampled_lp, top = entry
        pairs = [(token_id, sampled_lp)] + [p for p in top if p[0] != token_id]
        return tuple(TokenLogprob(t, lp, self.decode([t])) for t, lp in pairs)

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def next_token_logits(self, prompt: str | list[int]) -> torch.Tensor:
        """The model's raw logits (vocab,) for the token after ``prompt`` (chapter 8).

        Runs one prefill through the real paged cache using free blocks, then frees them;
        queued and running requests are untouched. Its full blocks stay in the prefix
        cache, so asking again for the same prompt is cheap.
        """
        _, token_ids = self.tokenize_prompt(prompt)
        probe = Request(f"probe-{next(self._probe_ids)}", token_ids, SamplingParams(temperature=0.0, max_tokens=1),
                        device=self.runner.device)
        computed, num_cached = self.block_manager.get_computed_blocks(probe)
        num_new = len(token_ids) - num_cached
        if not self.block_manager.allocate_slots(probe, num_new, computed):
            raise RuntimeError(f"not enough free KV blocks to score a {len(token_ids)}-token prompt "
                               f"({self.block_manager.num_free_blocks} free); finish or abort some requests")
        probe.num_computed_tokens = num_cached
        try:
            logits = self.runner.compute_logits(SchedulerOutput([(probe, num_new)], [], num_new))[0]
            probe.num_computed_tokens = len(token_ids)
            self.block_manager.cache_full_blocks(probe)
        finally:
            self.block_manager.free(probe)
        return logits

    # ------------------------------------------------------------ observing
    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            step=self.step_count,
            waiting=tuple(_request_snapshot(r) for r in self.scheduler.waiting),
            running=tuple(_request_snapshot(r) for r in self.scheduler.running),
            blocks=self.block_manager.snapshot(), block_size=self.config.block_size,
            num_free_blocks=self.block_manager.num_free_blocks,
            num_cached_blocks=self.block_manager.num_cached_blocks,
            kv_cache_bytes=self.runner.kv_cache_bytes, max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens, max_model_len=self.max_model_len,
            prefix_cache_queries=self.block_manager.prefix_queries,
            prefix_cache_hits=self.block_manager.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions)

    def check_invariants(self) -> None:
        """Raise if block bookkeeping is inconsistent (tests call this after every step)."""
        self.block_manager.check_invariants(self.scheduler.running)
        for request in self.scheduler.waiting:
            if request.block_ids:
                raise AssertionError(f"waiting request {request.request_id} holds blocks {request.block_ids}")

    def shutdown(self) -> None:
        """Release worker processes (tensor parallelism); a no-op for a single process."""
        close = getattr(self.runner, "shutdown", None)
        if close is not None:
            close()


def _request_snapshot(r: Request) -> RequestSnapshot:
    return RequestSnapshot(r.request_id, r.status.value, r.num_prompt_tokens, r.num_output_tokens,
                           r.num_computed_tokens, r.num_tokens, r.sampling_params.max_tokens,
                           tuple(r.block_ids), r.num_cached_tokens, r.num_preemptions)


def check_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The effective max_model_len, refused if the model or the token budget cannot serve it."""
    limit = model_config.max_position_embeddings
    max_model_len = config.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings ({limit})")
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ValueError(f"without chunked prefill a whole prompt must fit one step: max_num_batched_tokens "
                         f"({config.max_num_batched_tokens}) must be >= max_model_len ({max_model_len})")
    return max_model_len


def check_kv_blocks(config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> int:
    """Number of KV blocks, refused if the pool cannot hold even one maximal request."""
    num_blocks = config.num_kv_blocks or kv_cache_num_blocks(
        model_config, config.block_size, config.torch_dtype, config.kv_cache_memory_gb * 2**30,
        config.tensor_parallel_size)
    needed = -(-max_model_len // config.block_size)
    if num_blocks < needed:
        raise ValueError(f"the KV cache ({num_blocks} blocks of {config.block_size} tokens) cannot hold one request "
                         f"of max_model_len={max_model_len} tokens ({needed} blocks): raise num_kv_blocks / "
                         f"kv_cache_memory_gb or lower max_model_len")
    return num_blocks
