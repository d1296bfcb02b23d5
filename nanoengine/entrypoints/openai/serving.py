"""One HTTP request through the engine: completions and chat (chapter 12).

``OpenAIServing.completions`` and ``.chat`` both read and validate the body (``read_body``,
``protocol``: a bad request never reaches the engine), prepare the prompts on the tokenizer
thread (``_prepare``), submit one engine request per prompt (``EngineClient.add_requests``; a
full queue is a 429), then stream server-sent events or collect the final outputs into one
JSON response, asking the engine only for what each reads (``RequestOutputKind.DELTA`` or
``FINAL_ONLY``) and aborting if the client goes away first.

One tokenizer thread, as vLLM's ``OpenAIServing`` has one tokenizer worker: tokenizing is linear
in the text, so a huge prompt would stall every request in flight on the engine thread and
every connection on the event loop, while the fast tokenizer releases the GIL as it encodes. A
request waits behind a long text at most as long as the longest text that can still fit takes
(``_too_long`` refuses longer ones untokenized). Choices are numbered as OpenAI's: with several
prompts and ``n`` completions each, ``prompt_index * n + completion_index``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from nanoengine.entrypoints.openai import protocol
from nanoengine.entrypoints.openai.async_engine import (EngineClient, EngineDeadError, Prompt, QueueFullError,
                                                        RequestStream)
from nanoengine.entrypoints.openai.metrics import ServerMetrics
from nanoengine.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, ProtocolError,
                                                    fit_to_context, parse_request)
from nanoengine.outputs import CompletionOutput, RequestOutput
from nanoengine.sampling_params import RequestOutputKind

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client closed the connection before its request body arrived: nobody to answer."""


class OpenAIServing:
    """The endpoints' logic over one engine serving one model under one name; ``shutdown`` stops
    the tokenizer thread."""

    def __init__(self, engine: EngineClient, model_name: str, metrics: ServerMetrics, max_body_bytes: int,
                 body_timeout: float, system_fingerprint: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.system_fingerprint = system_fingerprint
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        # The rules every entry shares (tokenizing, the chat template, the parameters this engine
        # serves); it reads no engine state, so the tokenizer thread may call it during a step.
        self.input_processor = engine.input_processor
        self._max_token_bytes: int | None | bool = False  # False: not computed yet (the tokenizer thread does)
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoengine-tokenizer")

    def shutdown(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def completions(self, raw: Request) -> Response:
        arrival = time.perf_counter()
        request, params = await self._read_request(raw, CompletionRequest)
        prompts = request.prompts()
        texts = any(isinstance(p, str) for p in prompts)
        if texts and self.tokenizer is None:
            raise ProtocolError("this model has no tokenizer: send the prompt as token ids", param="prompt")
        # Text gets the tokenizer's special tokens (a BOS where the model expects one), as
        # vLLM's CompletionRequest.add_special_tokens defaults to True.
        prepared = await self._prepare(lambda: [self._tokenize(p) for p in prompts], params, request.max_tokens,
                                       request, on_thread=texts)
        return await self._respond(raw, request, "cmpl", prepared, arrival, "text_completion", _completion_choices)

    async def chat(self, raw: Request) -> Response:
        arrival = time.perf_counter()
        request, params = await self._read_request(raw, ChatCompletionRequest)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ProtocolError("this model has no chat template; use /v1/completions", param="messages",
                                code="no_chat_template")
        # The rendered conversation already holds the template's special tokens (its BOS too):
        # none are added, as vLLM's ChatCompletionRequest.add_special_tokens defaults to False.
        prepared = await self._prepare(lambda: [self._tokenize(self._render_chat(request), rendered_chat=True)],
                                       params, request.requested_max_tokens, request)
        # A streamed reply opens every choice with the role, sent with the first output as vLLM
        # sends it (serving_chat.py), so a client that times the first event measures the real TTFT.
        opening = [protocol.choice(i, {"delta": {"role": "assistant", "content": ""}}) for i in range(request.n)]
        return await self._respond(raw, request, "chatcmpl", prepared, arrival, "chat.completion", _chat_choices,
                                   opening)

    async def _respond(self, raw: Request, request, id_prefix: str, prepared: list[tuple[list[int], object]],
                       arrival: float, kind: str, choices: Callable[["_Context", RequestOutput], list[dict]],
                       opening: list[dict] | None = None) -> Response:
        """Submit, then stream the ``choices`` of each output as events (``opening`` first), or
        collect the final outputs into one ``kind`` response."""
        stream = await self._submit(f"{id_prefix}-{uuid.uuid4().hex}", prepared, arrival, request)
        ctx = _Context(stream, request)
        if request.stream:
            chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
            return EventStreamResponse(self._events(ctx, chunk_kind, opening or [], choices), headers=SSE_HEADERS)
        finals = await _collect_unless_disconnected(stream, raw)
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        _raise_if_failed(finals)
        return JSONResponse(self._body(ctx, kind, [choice for out in finals for choice in choices(ctx, out)],
                                       _usage(finals)))

    def _body(self, ctx: "_Context", kind: str, choices: list[dict], usage: dict | None = None) -> dict:
        """A whole response or one streamed chunk of ``ctx``'s."""
        return protocol.response(kind, ctx.response_id, ctx.created, self.model_name, choices, usage,
                                 self.system_fingerprint)

    async def read_body(self, raw: Request) -> bytes:
        """The request body: at most ``max_body_bytes`` (413), all of it within ``body_timeout``
        seconds (408: else a client that trickles its body, a "slow POST", holds a connection
        for ever); ``ClientGone`` if the client disconnects first.

        A body too large is still read and dropped up to four times the limit, so that the
        client, busy sending it, can read the 413; past that the connection closes at once."""
        limit = self.max_body_bytes
        declared = raw.headers.get("content-length", "")
        too_large = ProtocolError(f"the request body is larger than this server's limit of {limit} bytes "
                                  f"(--max-body-bytes); send a smaller request", status=413,
                                  code="request_too_large")
        if declared.isdigit() and int(declared) > 4 * limit:
            raise too_large
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                async for chunk in raw.stream():
                    size += len(chunk)
                    if size <= limit:
                        chunks.append(chunk)
                    elif size > 4 * limit:
                        break
        except TimeoutError:
            raise ProtocolError(f"the request body did not arrive within {self.body_timeout:g} s "
                                f"(--body-timeout)", status=408, code="request_timeout") from None
        except ClientDisconnect:
            raise ClientGone() from None
        if size > limit:
            raise too_large
        return b"".join(chunks)

    async def _read_request(self, raw: Request, model: type[CompletionRequest | ChatCompletionRequest]):
        """The body parsed as ``model`` and validated, with its SamplingParams, which the engine's
        own checks pass (n against max_num_seqs, stop token ids, ...) before any work."""
        request = parse_request(model, await self.read_body(raw))
        if request.model is not None and request.model != self.model_name:
            raise ProtocolError(f"the model {request.model!r} does not exist: this server serves "
                                f"{self.model_name!r} (GET /v1/models lists it)", param="model",
                                code="model_not_found")
        request.check_supported()
        try:
            params = self.input_processor.check_params(request.to_sampling_params())
        except ValueError as exc:
            raise protocol.value_error(exc, request) from None
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        return request, dataclasses.replace(params, output_kind=kind)

    async def _prepare(self, tokenize: Callable[[], list[list[int]]], params, requested_max_tokens: int | None,
                       request, on_thread: bool = True) -> list[tuple[list[int], object]]:
        """Each prompt's token ids and its SamplingParams with ``max_tokens`` fitted to the context
        window, on the tokenizer thread unless not ``on_thread`` (token ids need no tokenizer and
        should not queue behind a long text); a 400 for a prompt empty, too long or with no room."""
        def prepare() -> list[tuple[list[int], object]]:
            prepared = []
            for token_ids in tokenize():
                try:
                    self.input_processor.check_length(token_ids)
                except ValueError as exc:
                    code = "context_length_exceeded" if token_ids else "invalid_value"
                    raise ProtocolError(str(exc), param="prompt", code=code) from None
                try:
                    fitted = fit_to_context(params, requested_max_tokens, len(token_ids), self.max_model_len)
                except ValueError as exc:
                    raise protocol.value_error(exc, request) from None
                prepared.append((token_ids, fitted))
            return prepared

        if not on_thread:
            return prepare()
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, prepare)

    def _tokenize(self, prompt: Prompt, rendered_chat: bool = False) -> list[int]:
        """Token ids of one prompt, on the tokenizer thread (token-id prompts pass through: the
        engine checks their range)."""
        if not isinstance(prompt, str):
            return list(prompt)
        if not prompt:
            raise ProtocolError("prompt is empty: give at least one character or token id", param="prompt",
                                code="invalid_value")
        if self._max_token_bytes is False:  # once, here: reading the vocabulary takes a moment
            self._max_token_bytes = _max_token_bytes(self.tokenizer)
        at_least = _too_long(prompt, self._max_token_bytes, self.max_model_len)
        if at_least is not None:
            raise ProtocolError(f"prompt is {len(prompt.encode())} bytes of text, at least {at_least} tokens, but "
                                f"max_model_len is {self.max_model_len}; shorten it", param="prompt",
                                code="context_length_exceeded")
        return self.input_processor.encode(prompt, rendered_chat)

    def _render_chat(self, request: ChatCompletionRequest) -> str:
        """The conversation through the model's chat template, as ``LLM.chat`` renders it (on the
        tokenizer thread: rendering is linear in the messages' length)."""
        try:
            return self.input_processor.apply_chat_template(request.conversation())
        except Exception as exc:  # a template may refuse a conversation (e.g. roles out of order)
            raise ProtocolError(f"the chat template refused these messages: {exc}", param="messages") from None

    async def _submit(self, response_id: str, prepared: list[tuple[list[int], object]], arrival: float,
                      request) -> RequestStream:
        """One engine request per prompt ("<response id>-<prompt index>"), all or none."""
        try:
            return await self.engine.add_requests(
                [(f"{response_id}-{i}", token_ids, params) for i, (token_ids, params) in enumerate(prepared)],
                arrival)
        except QueueFullError as exc:
            self.metrics.observe_rejected()
            raise ProtocolError(str(exc), status=429, type="rate_limit_error", code="queue_full") from None
        except ValueError as exc:  # the engine's checks: token ids outside the vocabulary...
            raise protocol.value_error(exc, request) from None

    async def _events(self, ctx: "_Context", kind: str, opening: list[dict],
                      choices: Callable[["_Context", RequestOutput], list[dict]]) -> AsyncIterator[str]:
        """The server-sent events of one streamed response; ``opening`` goes out with the first output.

        A client that disconnects cancels this generator's task (``asyncio.CancelledError`` at
        ``await``) or closes it (``EventStreamResponse``); ``finally`` aborts what has not finished."""
        def chunk(parts: list[dict], usage: dict | None = None) -> str:
            return protocol.sse(self._body(ctx, kind, parts, usage))

        try:
            async for out in ctx.stream:
                if opening:
                    yield chunk(opening)
                    opening = []
                if out.finished:
                    ctx.finals.append(out)
                parts = choices(ctx, out)
                if parts:
                    yield chunk(parts)
                if out.finished:
                    _raise_if_failed([out])
            if ctx.request.include_usage:
                yield chunk([], _usage(ctx.finals))
            yield protocol.DONE
        except EngineDeadError as exc:  # the response has started: the error travels as an event
            yield protocol.sse(protocol.engine_unavailable(exc).body())
        except ProtocolError as exc:  # one of this response's requests ended in an error (_raise_if_failed)
            yield protocol.sse(exc.body())
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
    """One response: its stream, its request, and what each completion has sent so far (every
    output holds only what is new: a stream's deltas, or a plain response's final outputs)."""

    def __init__(self, stream: RequestStream, request) -> None:
        self.stream = stream
        self.request = request
        self.response_id = stream.request_ids[0].rsplit("-", 1)[0]
        self.created = int(time.time())  # Unix seconds
        self.prompt_index = {request_id: i for i, request_id in enumerate(stream.request_ids)}
        self.sent_text: dict[tuple[str, int], int] = {}  # (request id, completion index) -> characters sent
        self.done: set[tuple[str, int]] = set()  # completions whose finish_reason was sent
        self.finals: list[RequestOutput] = []

    def choice_index(self, out: RequestOutput, c: CompletionOutput) -> int:
        return self.prompt_index[out.request_id] * self.request.n + c.index

    def text_offset(self, out: RequestOutput, c: CompletionOutput) -> int:
        """Where this chunk's text starts in the completion (after ``new_parts`` counted it)."""
        return self.sent_text.get((out.request_id, c.index), 0) - len(c.text)

    def new_parts(self, out: RequestOutput):
        """The completions of this output with something to send: new text, new tokens
        with logprobs, or their finish (sent once: a finished completion of an ``n > 1``
        request stays in the outputs until its siblings finish). Of a final output: all."""
        for c in out.outputs:
            key = (out.request_id, c.index)
            if key in self.done:
                continue
            self.sent_text[key] = self.sent_text.get(key, 0) + len(c.text)
            if c.finish_reason is not None:
                self.done.add(key)
            if c.text or c.logprobs or c.finish_reason is not None:
                yield c


# The choices of one output (``_Context.new_parts``): a streamed delta's, or a final output's.
def _completion_choices(ctx: _Context, out: RequestOutput) -> list[dict]:
    return [protocol.choice(ctx.choice_index(out, c), {"text": c.text},
                            protocol.completion_logprobs(c.logprobs, ctx.text_offset(out, c)), c.finish_reason,
                            c.stop_reason)
            for c in ctx.new_parts(out)]


def _chat_choices(ctx: _Context, out: RequestOutput) -> list[dict]:
    def content(text: str) -> dict:
        if ctx.request.stream:
            return {"delta": {"content": text} if text else {}}
        return {"message": {"role": "assistant", "content": text}}

    return [protocol.choice(c.index, content(c.text), protocol.chat_logprobs(c.logprobs, ctx.request.top_logprobs or 0),
                            c.finish_reason, c.stop_reason)
            for c in ctx.new_parts(out)]


def _raise_if_failed(finals: list[RequestOutput]) -> None:
    """A 500, as vLLM's, if the engine finished one of these requests with an error (a step raised
    on its data: ``LLMEngine._outputs``; the engine serves on); the message says what was raised."""
    for out in finals:
        for c in out.outputs:
            if c.finish_reason == "error":
                raise ProtocolError(f"the engine could not finish this request: {c.error}", status=500,
                                    type="server_error", code="request_failed")


def _usage(finals: list[RequestOutput]) -> dict:
    """Prompt tokens once per prompt, completion tokens over every completion (counted by
    the request's metrics: a streamed final output holds only its last delta's tokens),
    cached tokens as the engine counted them per prompt (``num_cached_tokens``)."""
    return protocol.usage(sum(len(o.prompt_token_ids) for o in finals),
                          sum(o.metrics.num_output_tokens for o in finals),
                          sum(o.num_cached_tokens for o in finals))


def _max_token_bytes(tokenizer) -> int | None:
    """An upper bound on the UTF-8 bytes of text one token can stand for, or None when this
    tokenizer offers none.

    A token's string in the vocabulary is at least as long in UTF-8 as the text it encodes
    (byte-level BPE writes each byte as a character of one or two bytes, SentencePiece a space
    as "▁", three bytes, and a raw byte as "<0x41>"), as long as every byte of the text ends up
    in some token: so only for a BPE model with no normalizer (one may shrink the text), no
    pre-tokenizer that drops text (whitespace splitters, a split that removes its delimiter),
    and a token for every character (byte-level, byte fallback, or an unknown token per
    character: fused, a run of unknown characters would be one token; without one, dropped)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if type(model).__name__ != "BPE" or backend.normalizer is not None:
        return None

    def keeps_every_byte(node) -> bool:
        if node is None:
            return True
        if node.get("type") == "Sequence":
            return all(keeps_every_byte(child) for child in node.get("pretokenizers", []))
        return node.get("type") in ("ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts") \
            and node.get("behavior") != "Removed"

    pre = None if backend.pre_tokenizer is None else json.loads(backend.pre_tokenizer.__getstate__())
    if not keeps_every_byte(pre):
        return None
    byte_level = '"ByteLevel"' in json.dumps(pre)
    if not (byte_level or model.byte_fallback or (model.unk_token is not None and not model.fuse_unk)):
        return None
    return max((len(token.encode("utf-8")) for token in tokenizer.get_vocab()), default=None)


def _too_long(text: str, max_token_bytes: int | None, max_model_len: int) -> int | None:
    """The fewest tokens ``text`` can have, when that alone exceeds ``max_model_len``;
    else None (it has to be tokenized to know). A 10 MB prompt is refused in
    microseconds instead of after the seconds its tokenizing takes."""
    if max_token_bytes is None or len(text) <= max_model_len:  # a character is at least one byte
        return None
    at_least = -(-len(text.encode("utf-8")) // max_token_bytes)
    return at_least if at_least > max_model_len else None


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
    return None if gone else work.result()  # an EngineDeadError is answered 503 (api_server)
