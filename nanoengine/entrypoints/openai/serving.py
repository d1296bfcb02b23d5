"""One HTTP request through the engine: completions and chat (chapter 12).

``OpenAIServing.completions`` and ``.chat`` do the same five things:

1. **validate** the body (``protocol``): JSON, fields, types, the model's name, ``n``
   against ``max_num_seqs``, sampling values through ``SamplingParams``. A bad request is
   refused here with 400 and never reaches the engine;
2. **submit** one engine request per prompt (``AsyncLLMEngine.add_requests``). The engine
   thread tokenizes, fits ``max_tokens`` to the context window and adds them; its
   ``ValueError`` (a prompt longer than ``max_model_len``...) is a 400 too, a full waiting
   queue a 429;
3. **stream** server-sent events, one chunk per completion per step that produced text,
   then ``data: [DONE]`` (``stream: true``), **or collect** the final outputs into one JSON
   response. The engine is asked for what each reads (``RequestOutputKind``): a stream
   only the new text and tokens of every step (``DELTA``), a plain response only the
   final outputs (``FINAL_ONLY``: no output objects and no text until a request ends);
4. **abort** the engine requests if the client goes away first: a streaming response's
   generator is cancelled by the server when the connection drops (its ``finally`` runs);
   a plain response races the collection against ``http.disconnect``;
5. count ``usage`` (prompt, completion and total tokens).

Choices are numbered as OpenAI numbers them: with several prompts and ``n`` completions
each, choice ``prompt_index * n + completion_index``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoengine.entrypoints.openai import protocol
from nanoengine.entrypoints.openai.async_engine import (AsyncLLMEngine, EngineDeadError, QueueFullError,
                                                        RequestStream)
from nanoengine.entrypoints.openai.metrics import ServerMetrics
from nanoengine.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, ProtocolError,
                                                    fit_to_context, parse_request)
from nanoengine.outputs import CompletionOutput, RequestOutput
from nanoengine.sampling_params import RequestOutputKind

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class OpenAIServing:
    """The endpoints' logic over one ``AsyncLLMEngine`` serving one model under one name."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        # Read once, before the engine thread starts: these never change while serving.
        self.max_model_len = engine.engine.max_model_len
        self.max_num_seqs = engine.engine.config.max_num_seqs
        self.tokenizer = engine.engine.tokenizer

    # ------------------------------------------------------------ endpoints
    async def completions(self, raw: Request) -> Response:
        arrival = time.perf_counter()
        request = parse_request(CompletionRequest, await raw.body())
        self._check(request)
        params = self._params(request)
        prompts = request.prompts()
        if any(isinstance(p, str) for p in prompts) and self.tokenizer is None:
            raise ProtocolError("this model has no tokenizer: send the prompt as token ids", param="prompt")
        stream = await self._submit(f"cmpl-{uuid.uuid4().hex}", prompts, params, request.max_tokens, arrival,
                                    request)
        context = _Context(stream, request, protocol.now())
        if request.stream:
            return EventStreamResponse(self._completion_events(context), headers=SSE_HEADERS)
        finals = await _collect_unless_disconnected(stream, raw)
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        choices = [protocol.completion_choice(
            context.choice_index(out, c), c.text, c.finish_reason, c.stop_reason,
            protocol.completion_logprobs(c.logprobs) if c.logprobs is not None else None)
            for out in finals for c in out.outputs]
        return JSONResponse(protocol.response("text_completion", context.response_id, context.created,
                                              self.model_name, choices, _usage(finals)))

    async def chat(self, raw: Request) -> Response:
        arrival = time.perf_counter()
        request = parse_request(ChatCompletionRequest, await raw.body())
        self._check(request)
        params = self._params(request)
        prompt = self._render_chat(request)
        stream = await self._submit(f"chatcmpl-{uuid.uuid4().hex}", [prompt], params,
                                    request.requested_max_tokens, arrival, request)
        context = _Context(stream, request, protocol.now())
        if request.stream:
            return EventStreamResponse(self._chat_events(context), headers=SSE_HEADERS)
        finals = await _collect_unless_disconnected(stream, raw)
        if finals is None:
            return Response(status_code=499)
        top_n = request.top_logprobs or 0
        choices = [protocol.chat_choice(c.index, c.text, c.finish_reason, c.stop_reason,
                                        protocol.chat_logprobs(c.logprobs, top_n) if c.logprobs is not None else None)
                   for c in finals[0].outputs]
        return JSONResponse(protocol.response("chat.completion", context.response_id, context.created,
                                              self.model_name, choices, _usage(finals)))

    # ---------------------------------------------------------- validation
    def _check(self, request: CompletionRequest | ChatCompletionRequest) -> None:
        if request.model is not None and request.model != self.model_name:
            raise ProtocolError(f"the model {request.model!r} does not exist: this server serves "
                                f"{self.model_name!r} (GET /v1/models lists it)", param="model",
                                code="model_not_found")
        request.check_supported()
        if isinstance(request.n, int) and request.n > self.max_num_seqs:
            raise ProtocolError(f"n={request.n} completions must run at once, but this server runs at most "
                                f"{self.max_num_seqs} sequences (max_num_seqs); ask for fewer", param="n",
                                code="invalid_value")

    def _params(self, request: CompletionRequest | ChatCompletionRequest):
        try:
            params = request.to_sampling_params()
        except ValueError as exc:
            raise protocol.value_error(exc, request) from None
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        return dataclasses.replace(params, output_kind=kind)

    def _render_chat(self, request: ChatCompletionRequest) -> str:
        """The conversation through the model's chat template, as ``LLM.chat`` renders it.

        Rendering is text only (Jinja over the messages); the tokens are counted on the
        engine thread, which owns the tokenizer's encoder."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ProtocolError("this model has no chat template; use /v1/completions", param="messages",
                                code="no_chat_template")
        try:
            return self.tokenizer.apply_chat_template(request.conversation(), tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as exc:  # a template may refuse a conversation (e.g. roles out of order)
            raise ProtocolError(f"the chat template refused these messages: {exc}", param="messages") from None

    async def _submit(self, response_id: str, prompts: list, params, requested_max_tokens: int | None,
                      arrival: float, request) -> RequestStream:
        """One engine request per prompt ("<response id>-<prompt index>"), all or none."""
        max_model_len = self.max_model_len

        def fitted(num_prompt_tokens: int):  # runs on the engine thread, once the prompt is tokenized
            return fit_to_context(params, requested_max_tokens, num_prompt_tokens, max_model_len)

        try:
            return await self.engine.add_requests(
                [(f"{response_id}-{i}", prompt, fitted) for i, prompt in enumerate(prompts)], arrival)
        except QueueFullError as exc:
            self.metrics.observe_rejected()
            raise ProtocolError(str(exc), status=429, type="rate_limit_error", code="queue_full") from None
        except EngineDeadError as exc:
            raise ProtocolError(str(exc), status=503, type="server_error", code="engine_unavailable") from None
        except ValueError as exc:  # the engine's checks: prompt too long, bad token ids, context overflow
            raise protocol.value_error(exc, request) from None

    # ----------------------------------------------------------- streaming
    def _completion_events(self, ctx: "_Context") -> AsyncIterator[str]:
        def choices(out: RequestOutput) -> list[dict]:
            return [protocol.completion_choice(
                ctx.choice_index(out, c), c.delta, c.finish_reason, c.stop_reason,
                None if c.logprobs is None else protocol.completion_logprobs(c.logprobs, ctx.text_offset(out, c)))
                for c in ctx.new_parts(out)]

        return self._events(ctx, "text_completion", [], choices)

    def _chat_events(self, ctx: "_Context") -> AsyncIterator[str]:
        top_n = ctx.request.top_logprobs or 0
        # OpenAI opens every choice with the role, before any text.
        opening = [protocol.chat_chunk_choice(i, {"role": "assistant", "content": ""}) for i in range(ctx.request.n)]

        def choices(out: RequestOutput) -> list[dict]:
            return [protocol.chat_chunk_choice(c.index, {"content": c.delta} if c.delta else {}, c.finish_reason,
                                               None if c.logprobs is None else protocol.chat_logprobs(c.logprobs, top_n))
                    for c in ctx.new_parts(out)]

        return self._events(ctx, "chat.completion.chunk", opening, choices)

    async def _events(self, ctx: "_Context", kind: str, opening: list[dict],
                      choices: Callable[[RequestOutput], list[dict]]) -> AsyncIterator[str]:
        """The server-sent events of one streamed response.

        If the client disconnects, the server cancels the task iterating this generator
        (``asyncio.CancelledError`` at ``await``) or closes it (``EventStreamResponse``);
        either way ``finally`` aborts whatever has not finished, and the engine frees its
        KV blocks between two steps.
        """
        def chunk(parts: list[dict], usage: dict | None = None) -> str:
            return protocol.sse(protocol.response(kind, ctx.response_id, ctx.created, self.model_name, parts, usage))

        try:
            if opening:
                yield chunk(opening)
            async for out in ctx.stream:
                if out.finished:
                    ctx.finals.append(out)
                parts = choices(out)
                if parts:
                    yield chunk(parts)
            if ctx.request.include_usage:
                yield chunk([], _usage(ctx.finals))
            yield protocol.DONE
        except EngineDeadError as exc:  # the response has started: the error travels as an event
            yield protocol.sse(protocol.error_body(str(exc), "server_error", code="engine_unavailable"))
        finally:
            ctx.stream.abort()


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that closes its generator however the response ends
    (finished, client gone, server stopping), so the generator's ``finally`` always runs now
    rather than whenever the garbage collector gets to it."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class _Context:
    """One response: its stream, its request, and what each completion has sent so far.

    The engine hands a streamed request's outputs as deltas (``RequestOutputKind.DELTA``):
    each completion's text, token ids and logprobs since its previous output."""

    def __init__(self, stream: RequestStream, request, created: int) -> None:
        self.stream = stream
        self.request = request
        self.response_id = stream.request_ids[0].rsplit("-", 1)[0]
        self.created = created
        self.prompt_index = {request_id: i for i, request_id in enumerate(stream.request_ids)}
        self.sent_text: dict[tuple[str, int], int] = {}  # (request id, completion index) -> characters sent
        self.done: set[tuple[str, int]] = set()  # completions whose finish_reason was sent
        self.finals: list[RequestOutput] = []

    def choice_index(self, out: RequestOutput, c: CompletionOutput) -> int:
        return self.prompt_index[out.request_id] * self.request.n + c.index

    def text_offset(self, out: RequestOutput, c: CompletionOutput) -> int:
        """Where this chunk's text starts in the completion (after ``new_parts`` counted it)."""
        return self.sent_text.get((out.request_id, c.index), 0) - len(c.delta)

    def new_parts(self, out: RequestOutput):
        """The completions of this (delta) output with something to send: new text, new
        tokens with logprobs, or their finish (sent once: a finished completion of an
        ``n > 1`` request stays in the outputs until its siblings finish)."""
        for c in out.outputs:
            key = (out.request_id, c.index)
            if key in self.done:
                continue
            self.sent_text[key] = self.sent_text.get(key, 0) + len(c.delta)
            if c.finish_reason is not None:
                self.done.add(key)
            if c.delta or c.logprobs or c.finish_reason is not None:
                yield c


def _usage(finals: list[RequestOutput]) -> dict:
    """Prompt tokens once per prompt, completion tokens over every completion (counted by
    the request's metrics: a streamed final output holds only its last delta's tokens)."""
    return protocol.usage(sum(len(o.prompt_token_ids) for o in finals),
                          sum(o.metrics.num_output_tokens for o in finals))


async def _collect_unless_disconnected(stream: RequestStream, raw: Request) -> list[RequestOutput] | None:
    """The final outputs of a non-streaming request, or None (and the request aborted) if
    the client disconnects first. The body has been read, so the next ASGI message the
    server can receive is ``http.disconnect``."""
    async def collect() -> list[RequestOutput]:
        return [out async for out in stream if out.finished]

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled
        watch.cancel()
        gone = not work.done()
        if gone:
            work.cancel()
            stream.abort()
    if gone:
        return None
    try:
        return work.result()
    except EngineDeadError as exc:
        raise ProtocolError(str(exc), status=503, type="server_error", code="engine_unavailable") from None
