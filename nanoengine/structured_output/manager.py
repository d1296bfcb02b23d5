"""The engine's side of structured output: compile off the step, one bitmask per step (chapter 14).

As vLLM's ``StructuredOutputManager`` (``vllm/v1/structured_output/__init__.py``): ``validate`` refuses a
constraint the library cannot compile before the request is queued (a server answers 400 with the library's
reason); ``request_for`` compiles it on a worker thread, and the scheduler passes over the request
(``Request.waits_for_grammar``) until ``collect``, at the start of a step, hands it its grammar, so one slow
grammar holds up nobody else. ``grammar_bitmask`` fills the step's packed int32 rows, which the runner applies
to the logits before the sampler; after the step the scheduler advances each grammar with the tokens its request
really got, and the proposer cuts the next step's drafts to the prefix the grammar accepts.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import TYPE_CHECKING

import torch

from nanoengine.sampling_params import SamplingParams
from nanoengine.structured_output.backend import (StructuredOutputBackend, StructuredOutputGrammar,
                                                  allocate_token_bitmask)
from nanoengine.structured_output.config import StructuredOutputsConfig

if TYPE_CHECKING:
    from nanoengine.engine.request import Request
    from nanoengine.engine.scheduler import Scheduler

MAX_REMEMBERED = 1024  # constraints known to compile, kept so that a batch of equal ones is checked once
WAIT_S = 0.05  # the longest an otherwise idle step waits for a compile (``collect``)


class StructuredOutputRequest:
    """One request's constraint and, once compiled, its grammar (vLLM's ``StructuredOutputRequest``)."""

    def __init__(self, compiling: concurrent.futures.Future) -> None:
        self.compiling = compiling
        self.grammar: StructuredOutputGrammar | None = None  # set by ``StructuredOutputManager.collect``


class StructuredOutputManager:
    """Compiles requests' constraints on a thread and builds each step's bitmask."""

    def __init__(self, config: StructuredOutputsConfig, tokenizer, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._backend: StructuredOutputBackend | None = None
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.pending: list[Request] = []  # requests whose grammar has not been collected yet
        self.valid: set[tuple] = set()  # (kind, spec) of constraints that compiled

    def __getstate__(self) -> dict:
        """What a copy in another process needs (a server's front end, to ``validate`` before sending a request
        to an engine core of its own): the settings, not the threads, the grammars or the library's state."""
        return {"config": self.config, "tokenizer": self.tokenizer, "vocab_size": self.vocab_size,
                "eos_token_ids": self.eos_token_ids}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @property
    def backend(self) -> StructuredOutputBackend:
        """The grammar library, set up for the tokenizer at the first constrained request."""
        with self._lock:  # a server checks requests on its own thread while the engine steps
            if self._backend is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs needs the model's tokenizer (the grammar is over its "
                                     "tokens' text), and this engine has none: build it with a tokenizer")
                from nanoengine.structured_output.guidance import GuidanceBackend

                self._backend = GuidanceBackend(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                whitespace_flexible=not self.config.disable_any_whitespace)
        return self._backend

    def validate(self, params: SamplingParams) -> None:
        """Raise ``ValueError`` if the request's constraint cannot compile (``InputProcessor.check_params``
        asks, before anything is queued). A constraint that passed is remembered, not checked again."""
        constraint = params.structured_outputs
        if constraint is not None and (constraint.kind, constraint.spec) not in self.valid:
            self.backend.validate(constraint.kind, constraint.spec)
            if len(self.valid) >= MAX_REMEMBERED:
                self.valid.clear()
            self.valid.add((constraint.kind, constraint.spec))

    def request_for(self, request: Request) -> None:
        """Start compiling ``request``'s constraint, if it has one; it waits until ``collect`` sees it done."""
        constraint = request.sampling_params.structured_outputs
        if constraint is None:
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                   thread_name_prefix="nanoengine-grammar")
        compiling = self._executor.submit(self.backend.compile_grammar, constraint.kind, constraint.spec)
        request.structured_output = StructuredOutputRequest(compiling)
        self.pending.append(request)

    def collect(self, scheduler: Scheduler) -> dict[str, Exception]:
        """At the start of a step: give each request whose grammar has compiled its grammar; the ids of those
        whose compile failed, with the error.

        When nothing else can run (nothing running, every waiting request waiting for its grammar), first
        wait until one compile has finished, for at most ``WAIT_S`` (rather than spin through empty steps,
        or keep the caller from seeing an abort while a large grammar compiles). Requests that finished
        meanwhile (aborted) are dropped.
        """
        if not self.pending:
            return {}
        if not scheduler.running and all(r.waits_for_grammar for r in scheduler.waiting):
            concurrent.futures.wait([r.structured_output.compiling for r in self.pending], timeout=WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        failed, still = {}, []
        for request in self.pending:
            compiling = request.structured_output.compiling
            if request.is_finished:
                compiling.cancel()
            elif not compiling.done():
                still.append(request)
            elif compiling.exception() is not None:
                failed[request.request_id] = compiling.exception()
            else:
                request.structured_output.grammar = compiling.result()
        self.pending = still
        return failed

    def grammar_bitmask(self, requests: list[Request], drafts: list[tuple[int, ...]]) -> torch.Tensor | None:
        """The step's packed bitmask, one row per logits row that samples; None if nobody is constrained.

        ``requests`` sample this step in ``plan.logits_indices`` order; ``drafts`` the drafts each
        checks (empty: nobody speculates).
        """
        if self._backend is None or not any(r.structured_output is not None for r in requests):
            return None  # no request was ever constrained, or none of this step's is
        drafts = drafts or [()] * len(requests)
        bitmask = allocate_token_bitmask(len(requests) + sum(map(len, drafts)), self.backend.vocab_size)
        row = 0
        for request, request_drafts in zip(requests, drafts):
            if request.structured_output is not None:
                fill_rows(request, request_drafts, bitmask, row)
            row += 1 + len(request_drafts)
        return bitmask

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def fill_rows(request: Request, drafts: tuple[int, ...], bitmask: torch.Tensor, row: int) -> None:
    """Rows ``row .. row + len(drafts)``: the mask after each prefix of ``drafts``, the grammar left as it was."""
    grammar = request.structured_output.grammar
    accepted = 0
    try:
        for i in range(len(drafts) + 1):
            grammar.fill_bitmask(bitmask, row + i)
            if i < len(drafts):
                if not grammar.accept_tokens(request.request_id, [drafts[i]]):
                    raise RuntimeError(f"request {request.request_id}: draft token {drafts[i]} at draft position {i} "
                                       f"is not allowed by its grammar; the proposer cuts drafts to what it accepts "
                                       f"(NgramProposer.propose_drafts), so this is an engine bug")
                accepted += 1
    finally:
        grammar.rollback(accepted)
