"""The state of one request as it moves through the engine (chapters 2 and 5).

A request owns its token ids (prompt, then generated tokens), a ``num_computed_tokens``
counter that says how many of them already have KV in the cache, and a block table that
says where that KV lives. There is no separate "prefill" or "decode" phase: a step simply
computes ``num_tokens - num_computed_tokens`` more tokens (or a chunk of them), which is
the whole prompt at first and one token per step afterwards (vLLM v1's formulation).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import torch

from nanoengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoengine.structured_output import StructuredOutputRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after losing its blocks; will be recomputed
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # a step raised on this request's data (``Request.error`` says what)

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# Asked several times per request per step: one dictionary, built once.
_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}


class Request:
    """One generation request: tokens, progress, KV location, sampling state, timings."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 prompt: str | None = None, eos_token_ids: tuple[int, ...] = (), arrival_time: float | None = None,
                 device: torch.device | str = "cpu", parent_id: str | None = None, index: int = 0) -> None:
        self.request_id = request_id
        # The user request: its n completions are n requests, "{index}_{parent_id}" (equal ids when n=1).
        self.parent_id = request_id if parent_id is None else parent_id
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)  # prompt + output, what the KV covers
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []  # the block table: logical block i -> physical block
        self.block_hashes: list[bytes] = []  # chained digests of its full, computed blocks
        self.token_block_digests: list[bytes] = []  # of its full blocks of tokens (``BlockManager.token_digests``)
        self.block_serials: list[int | None] = []  # which cached content each of them is (prefix cache)
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        # n > 1 with the prefix cache off: the completion that computed this sibling's prompt and how
        # many of its full blocks to share at admission (``Scheduler.computed_blocks``); else None.
        self.fork_source: tuple[Request, int] | None = None
        # Speculative decoding (chapter 13): tokens the proposer guessed after the last one,
        # checked by the next step; never part of ``all_token_ids`` until accepted.
        self.spec_token_ids: list[int] = []
        # Structured output (chapter 14): its constraint and, once compiled, its grammar; else None.
        self.structured_output: StructuredOutputRequest | None = None
        self.num_preemptions = 0
        self.stop_reason: str | int | None = None
        self.error: str | None = None  # why a step could not go on with it (FINISHED_ERROR)
        self.output_logprobs: list[tuple] = []
        # A seeded request draws from its own generator, so its samples do not depend on
        # what else is in the batch (chapter 8).
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(sampling_params.seed)
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.output_token_times: list[float] = []  # when each output token was sampled
        self.finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose KV is not in the cache yet (the whole prompt at first, then 1)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def waits_for_grammar(self) -> bool:
        """Its constraint is still compiling: the scheduler passes over it (vLLM's WAITING_FOR_FSM)."""
        return self.structured_output is not None and self.structured_output.grammar is None

    @property
    def first_token_time(self) -> float | None:
        return self.output_token_times[0] if self.output_token_times else None

    def append_output_token(self, token_id: int, now: float | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.output_token_times.append(time.perf_counter() if now is None else now)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed "
                f"{self.num_computed_tokens}/{self.num_tokens}, blocks {self.block_ids})")
