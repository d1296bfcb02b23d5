"""``LLM``: the user-facing API (chapter 2's top layer), shaped like vLLM's.

    llm = LLM()                                   # default SmolLM2-135M-Instruct on the CPU
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20))
    for delta in llm.stream("Tell me a story", SamplingParams(max_tokens=50)):
        print(delta, end="")

``generate`` checks every prompt before queueing any, so one bad prompt leaves the engine
untouched; if it is interrupted, it aborts its own requests so no blocks stay held.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator, Sequence

from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.outputs import RequestOutput
from nanoengine.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Offline batch inference over an ``LLMEngine`` (available as ``llm.engine``)."""

    def __init__(self, model: str | Path | None = None, **config) -> None:
        self.engine = LLMEngine.from_pretrained(model, **config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order."""
        prompts = _as_prompt_list(prompts)
        # Only final outputs are read here, so the engine makes text only once a request ends.
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) if isinstance(p, SamplingParams)
                  else p for p in _as_params_list(sampling_params, len(prompts))]
        for prompt, p in zip(prompts, params):  # validate everything before queueing anything
            self.engine.make_request(prompt, p, None)
        ids = [self.engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or several) and generate."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts "
                             f"(or a list of such lists), got {messages!r}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.apply_chat_template(c) for c in conversations], sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message]) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts, "
                             f"got {messages!r}")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one request as its tokens are produced.

        Other queued requests keep making progress while this one streams. Closing the
        generator early aborts the request and frees its blocks. A stream is one text, so
        ``n`` must be 1 (use ``generate`` for several completions).
        """
        if sampling_params is not None and getattr(sampling_params, "n", 1) != 1:
            raise ValueError(f"stream() yields one completion's text, got SamplingParams(n={sampling_params.n}); "
                             f"use generate() for n > 1")
        params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(params, SamplingParams):  # only the new text is read: outputs hold only that
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        request_id = self.engine.add_request(prompt, params)
        finished = False
        try:
            while not finished and self.engine.has_request(request_id):  # engine.abort() may end it
                for out in self.engine.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        if out.delta:
                            yield out.delta
        finally:
            if not finished and self.engine.has_request(request_id):
                self.engine.abort(request_id)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending, results = set(ids), {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in pending:  # leave no half-finished request holding blocks
                if self.engine.has_request(request_id):
                    self.engine.abort(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

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
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a string, a list of token ids, or a non-empty list of those; got {prompts!r}")
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {params!r}")
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one, or one per prompt")
    return params
