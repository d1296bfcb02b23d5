"""``LLM``: the user-facing API (chapter 2's top layer), shaped like vLLM's.

    llm = LLM()                                   # default SmolLM2-135M-Instruct on the CPU
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20))
    for delta in llm.stream("Tell me a story", SamplingParams(max_tokens=50)):
        print(delta, end="")

Every output comes through one ``OutputRouter`` (``llm.router``), which steps the engine
and keeps each request's outputs for its reader, so a ``generate`` run while a stream is
open, or two streams read in turn, lose nothing; a request added directly with
``llm.engine.add_request`` keeps its outputs there too (``llm.router.wait(request_id)``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator, Sequence

from nanoengine.engine.input_processor import Message, is_conversation
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.engine.output_router import OutputRouter
from nanoengine.outputs import RequestOutput
from nanoengine.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int] | list[Message]  # text, token ids, or a chat conversation


class LLM:
    """Offline batch inference over an ``LLMEngine`` (available as ``llm.engine``)."""

    def __init__(self, model: str | Path | None = None, **config) -> None:
        self.engine = LLMEngine.from_pretrained(model, **config)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """An ``LLM`` over an engine built by hand (``LLMEngine.from_model``), loading nothing."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    @property
    def router(self) -> OutputRouter:
        """The one reader of ``engine.step()``: it keeps each request's outputs for its reader."""
        router = self.__dict__.get("_router")
        if router is None or router.engine is not self.engine:  # made on first use, for this engine
            router = self.__dict__["_router"] = OutputRouter(self.engine)
        return router

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order.

        A prompt is text, token ids or a chat conversation (see ``chat``). A request that a
        bug in the engine could not finish comes back finished with ``finish_reason``
        "error" and the exception in its completions' ``error``; the others are unaffected.
        """
        prompts = _as_prompt_list(prompts)
        # Only final outputs are read here, so the engine makes text only once a request ends.
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                  for p in _as_params_list(sampling_params, len(prompts))]
        processor = self.engine.input_processor  # tokenize and check everything before queueing anything
        processed = [processor.process(prompt, p) for prompt, p in zip(prompts, params)]
        ids = [self.engine.add_request(p) for p in processed]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or several) and generate."""
        expected = "a non-empty list of {'role': str, 'content': str} dicts (or a list of such lists)"
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages must be {expected}, got {messages!r}")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        for c in conversations:  # a conversation, not text or token ids, whatever generate() would take
            if not isinstance(c, (list, tuple)) or not c or not isinstance(c[0], dict):
                raise ValueError(f"messages must be {expected}, got {c!r:.200}")
        return self.generate(conversations, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message]) -> str:
        """The conversation as the model's chat template renders it (the text ``chat`` tokenizes)."""
        return self.engine.input_processor.apply_chat_template(messages)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one request (text, token ids or a conversation) as they are produced.

        Closing the generator early aborts the request and frees its blocks. If the engine finishes the
        request with an error (``finish_reason`` "error"), it raises ``RuntimeError`` after the text before it.
        """
        if sampling_params is not None and getattr(sampling_params, "n", 1) != 1:
            raise ValueError(f"stream() yields one completion's text, got SamplingParams(n={sampling_params.n}); "
                             f"use generate() for n > 1")
        params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(params, SamplingParams):  # only the new text is read: outputs hold only that
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        request_id = self.engine.add_request(prompt, params)
        self.router.watch(request_id)
        finished = False
        try:
            while not finished:
                out = self.router.next_output(request_id)  # steps the engine when nothing is queued
                if out is None:  # engine.abort() ended it between steps
                    break
                finished = out.finished
                if out.delta:
                    yield out.delta
                if out.finish_reason == "error":
                    raise RuntimeError(f"the engine could not finish this request: {out.outputs[0].error}")
        finally:
            if not finished and self.engine.has_request(request_id):
                self.engine.abort(request_id)  # deferred if this runs inside a step (a dropped stream)
            self.router.release(request_id)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step (through the router) until every request of ``ids`` has its final output."""
        pending, results = set(ids), {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        try:
            while pending:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"requests {sorted(pending)[:5]} ended without a final output here: "
                                       f"something called engine.abort() on them and took it")
                for out in self.router.step():
                    if out.finished and out.request_id in pending:
                        self.router.release(out.request_id)  # read here: its queue is not needed
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in pending:  # leave no half-finished request holding blocks
                if self.engine.has_request(request_id):
                    self.engine.abort(request_id)
                self.router.release(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def get_metrics(self) -> list:
        """The engine's counters and gauges now, as ``nanoengine.metrics`` records (vLLM's ``get_metrics``)."""
        from nanoengine.metrics import engine_metrics

        return engine_metrics(self.engine)

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's free blocks (see ``LLMEngine.reset_prefix_cache``)."""
        return self.engine.reset_prefix_cache()

    def memory_report(self):
        """Bytes of weights, packed copies and KV cache (see ``LLMEngine.memory_report``)."""
        return self.engine.memory_report()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str) or is_conversation(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a string, a list of token ids, or a non-empty list of those; "
                         f"got {prompts!r}")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if not isinstance(params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {params!r}")
    params = list(params)
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {p!r:.80} "
                            f"({type(p).__name__}) in the list")
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one, or one per prompt")
    return params
