"""The OpenAI wire format: what a client sends, what the server answers (chapter 12).

A body is parsed *strictly* into ``CompletionRequest`` or ``ChatCompletionRequest``: an unknown
field, a wrong type or a body that is not JSON is a 400 naming the field before anything reaches
the engine; the values are then checked by the engine's own ``SamplingParams`` (its ``ValueError``
is a 400 too). The names are OpenAI's plus vLLM's extras (``top_k``, ``ignore_eos``,
``structured_outputs``...: the ``openai`` client's ``extra_body``). Fields OpenAI defines but this
engine cannot honour (penalties, ``echo``, ``tools``...) admit only their neutral value, the one
that changes nothing, and refuse any other saying what is allowed (``_NEUTRAL_ONLY``) rather than
ignore it: langchain and litellm send the neutral values by default.

The endpoints differ in two OpenAI conventions: logprobs (``completion_logprobs``: parallel lists;
``chat_logprobs``: one record per token) and the default ``max_tokens`` (16 for a completion; for
a chat, as vLLM, the rest of the context window: ``fit_to_context``). Every error has
``error_body``'s shape, which the ``openai`` client raises as ``openai.BadRequestError`` and friends.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from nanoengine.outputs import TokenLogprob
from nanoengine.sampling_params import SamplingParams, StructuredOutputsParams


def _integral(value):
    """A JSON number that is a whole number (``5.0``) as the integer it is: ``4`` and ``4.0`` are
    one value to JSON, JSON Schema's ``integer`` accepts both, and so does vLLM. Anything else
    unchanged, for the strict integer check that follows to accept or refuse (``Int``)."""
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise ValueError(f"must be an integer (a whole number such as 4 or 4.0), got {value!r}")
    return value


Int = Annotated[int, BeforeValidator(_integral)]  # an integer field: 4 and 4.0, not 4.5, "4" or true
Zero = Annotated[float, Field(ge=0, le=0)]  # a penalty this engine does not apply: only 0 changes nothing


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object (the ``openai`` client reads ``message`` into its exception)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ProtocolError(Exception):
    """A request the server refuses: its HTTP status and the fields of ``error_body``."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def engine_unavailable(why: object) -> ProtocolError:
    """The 503 of an engine that has stopped (``why``: an ``EngineDeadError`` or a message)."""
    return ProtocolError(str(why), status=503, type="server_error", code="engine_unavailable")


# What a field must be, for messages about a value that matched none of its types.
_EXPECTED = {
    "prompt": "a string, a list of token ids, or a list of strings or of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a list of {\"role\": ..., \"content\": ...} objects",
}


# Fields OpenAI defines that this engine does not implement, whose schema admits only the
# value that changes nothing (the default); what a refused value gets told.
_NEUTRAL_ONLY = {
    "presence_penalty": "0: this server applies no penalties",
    "frequency_penalty": "0: this server applies no penalties",
    "logit_bias": "{}: this server biases no tokens",
    "echo": "false: this server does not repeat the prompt",
    "suffix": "none (leave it out): this server inserts no text",
    "tools": "empty: this server has no tool calling",
    "tool_choice": '"none" or "auto" (with no tools, the model calls none): this server has no tool calling',
    "store": "false: this server stores no completions",
    "service_tier": '"auto" or "default": this server has one tier',
    "modalities": '["text"]: this server generates text only',
}


def parse_request(model: type[BaseModel], body: bytes) -> BaseModel:
    """``body`` (raw JSON bytes) as ``model``, or a ``ProtocolError`` naming what was wrong."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _explain(exc) from None


def _explain(exc: ValidationError) -> ProtocolError:
    first = exc.errors()[0]
    kind, loc = first["type"], [str(part) for part in first["loc"]]
    if kind == "json_invalid":
        return ProtocolError(f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    if not loc:
        return ProtocolError(f"the request body must be a JSON object: {first['msg']}", code="invalid_body")
    field = loc[0]
    if kind == "extra_forbidden":
        return ProtocolError(f"unknown or unsupported field {'.'.join(loc)!r}", param=field, code="unknown_field")
    if kind == "missing":
        return ProtocolError(f"{'.'.join(loc)} is required", param=field, code="missing_field")
    if field in _NEUTRAL_ONLY:
        given = json.dumps(first.get("input"))
        path = ".".join([field] + [part for part in loc[1:] if part.isidentifier() and part != "function-after"])
        return ProtocolError(f"{path} {given:.80} is not supported by this server; allowed: {_NEUTRAL_ONLY[field]}",
                             param=field, code="unsupported")
    alternatives = {tuple(e["loc"][:1]) for e in exc.errors()}
    if field in _EXPECTED and len(exc.errors()) > 1 and len(alternatives) == 1:
        return ProtocolError(f"{field} must be {_EXPECTED[field]}", param=field, code="invalid_type")
    # pydantic names the union member it tried ("str", "list[int]"); the reader wants the field's path
    where = ".".join(part for part in loc if "[" not in part and "function-" not in part
                     and part not in ("str", "int", "float", "bool"))
    if kind == "value_error":  # _integral's message already says what was given
        return ProtocolError(f"{where} {first['ctx']['error']}", param=field, code="invalid_type")
    return ProtocolError(f"{where}: {first['msg']}, got {first.get('input')!r:.80}", param=field,
                         code="invalid_type")


def value_error(exc: ValueError, request: BaseModel) -> ProtocolError:
    """A ``ValueError`` from ``SamplingParams`` or the engine as a 400, with ``param`` when its message
    starts with one of the request's field names ("top_p must be ...", "n=9 completions ...")."""
    message = str(exc)
    first = message.split(" ", 1)[0].split("=", 1)[0].strip(":,")
    param = first if first in type(request).model_fields else None
    return ProtocolError(message, param=param)


class _Strict(BaseModel):
    # Strict: "5" is not 5 and true is not 1; unknown fields are refused, not dropped.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False  # one last chunk with the request's token counts


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``: a named schema (``strict`` is accepted; the
    output always follows the schema here)."""

    model_config = ConfigDict(populate_by_name=True)  # pydantic merges it with _Strict's
    name: str
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: "text" (no constraint), "json_object" or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ProtocolError('response_format needs json_schema exactly when its type is "json_schema"',
                                param="response_format")
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return StructuredOutputsParams(json_object=True) if self.type == "json_object" else None


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs`` request field: exactly one of its constraints."""

    json_schema: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingRequest(_Strict):
    """The fields both endpoints share: the model, sampling, stopping, streaming."""

    model: str | None = None  # None: the served model (vLLM allows leaving it out)
    n: Int = 1
    temperature: float | None = None  # None: 1.0, OpenAI's default
    top_p: float | None = None
    top_k: Int | None = None  # vLLM's extra
    min_p: float | None = None  # vLLM's extra
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None  # vLLM's extra
    ignore_eos: bool = False  # vLLM's extra: benchmarks generate exactly max_tokens
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id OpenAI accepts; recorded nowhere here
    # Features this server does not have: the schema admits only the neutral value (``_NEUTRAL_ONLY``).
    presence_penalty: Zero = 0.0
    frequency_penalty: Zero = 0.0
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = None
    # Structured output (chapter 14): OpenAI's field, or vLLM's; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        """Refuse what the schema alone cannot: combinations of fields, an empty list."""
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options is only allowed with stream: true", param="stream_options")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams; its checks raise ValueError naming the bad field."""
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}
        return SamplingParams(**{k: v for k, v in optional.items() if v is not None}, max_tokens=max_tokens,
                              seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, logprobs=logprobs, n=self.n,
                              structured_outputs=self.constraint())

    def constraint(self) -> StructuredOutputsParams | None:
        """The output's constraint from ``response_format`` or ``structured_outputs`` (None: free text)."""
        from_format = self.response_format.constraint() if self.response_format is not None else None
        if self.structured_outputs is None:
            return from_format
        if from_format is not None:
            raise ProtocolError("give response_format or structured_outputs, not both", param="structured_outputs")
        given = self.structured_outputs
        return StructuredOutputsParams(json=given.json_schema, regex=given.regex, choice=given.choice,
                                       grammar=given.grammar, json_object=given.json_object)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: continue one prompt, or each of a list of prompts."""

    prompt: str | list[Int] | list[str] | list[list[Int]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None  # the top N tokens per position
    best_of: Int | None = None
    echo: Literal[False] = False  # neutral only, as the penalties
    suffix: None = None  # neutral only: any suffix, even "", would ask for text inserted

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise ProtocolError(f"best_of must equal n ({self.n}) here: the server returns every completion it "
                                f"samples", param="best_of", code="unsupported")
        self.prompts()  # refuses an empty list

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: one string or token-id list, or several."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ProtocolError("prompt is empty", param="prompt", code="invalid_value")
        return list(prompt)

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(16 if self.max_tokens is None else self.max_tokens, self.logprobs)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: the next assistant message of a conversation."""

    messages: list[ChatMessage]
    max_tokens: Int | None = None  # None: the rest of the context window
    max_completion_tokens: Int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: Int | None = None
    # Features this server does not have: the schema admits only the neutral value (``_NEUTRAL_ONLY``).
    tools: Annotated[list[dict], Field(max_length=0)] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None  # with no tools there is nothing to call in parallel
    store: Literal[False] | None = None
    metadata: dict[str, str] | None = None  # OpenAI keeps it with stored completions; nothing is stored here
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise ProtocolError("messages must hold at least one message", param="messages", code="invalid_value")
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ProtocolError(f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs}",
                                param="top_logprobs")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ProtocolError("max_tokens and max_completion_tokens differ; give one", param="max_tokens")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        """With the placeholder max_tokens=1 when none was asked for: ``fit_to_context``
        sets it to the rest of the context once the prompt's length is known."""
        requested = self.requested_max_tokens
        return self.sampling_params(1 if requested is None else requested,
                                    (self.top_logprobs or 0) if self.logprobs else None)


def fit_to_context(params: SamplingParams, requested: int | None, num_prompt_tokens: int,
                   max_model_len: int) -> SamplingParams:
    """``params`` with ``max_tokens`` fitted to the context window (``requested`` None: the rest of
    it), or a ValueError: the engine would silently cut the reply at ``max_model_len`` ("length")."""
    room = max_model_len - num_prompt_tokens
    if requested is None:
        if room < 1:
            raise ValueError(f"the prompt has {num_prompt_tokens} tokens and fills the model's context window "
                             f"(max_model_len {max_model_len}): no room to generate")
        return dataclasses.replace(params, max_tokens=room)
    if requested > room:
        raise ValueError(f"max_tokens ({requested}) plus the prompt's {num_prompt_tokens} tokens exceed the model's "
                         f"context window (max_model_len {max_model_len}); ask for at most {max(room, 0)}")
    return params


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's token counts; ``prompt_tokens_details.cached_tokens`` is how many prompt
    tokens were served from the prefix cache (their KV was not computed again)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(entries: tuple[tuple[TokenLogprob, ...], ...] | None, text_offset: int = 0) -> dict | None:
    """Completions-style logprobs of some tokens (each entry: the sampled token first, then
    the top N others, as ``CompletionOutput.logprobs`` holds them); None without logprobs."""
    if entries is None:
        return None
    tokens = [e[0].text for e in entries]
    offsets = list(itertools.accumulate(map(len, tokens), initial=text_offset))[:-1]  # where each token starts
    return {"tokens": tokens, "token_logprobs": [wire_logprob(e[0].logprob) for e in entries],
            "top_logprobs": [{c.text: wire_logprob(c.logprob) for c in e} for e in entries], "text_offset": offsets}


def wire_logprob(logprob: float) -> float:
    """A logprob as JSON can carry it: -inf (a token structured output forbids) as -9999.0, vLLM's value."""
    return max(logprob, -9999.0)


def chat_logprobs(entries: tuple[tuple[TokenLogprob, ...], ...] | None, top_n: int) -> dict | None:
    """Chat-style logprobs: one record per token with its ``top_n`` most likely candidates."""
    if entries is None:
        return None

    def record(c: TokenLogprob) -> dict:
        return {"token": c.text, "logprob": wire_logprob(c.logprob), "bytes": list(c.text.encode("utf-8"))}

    return {"content": [{**record(e[0]), "top_logprobs": [record(c) for c in
                                                          sorted(e, key=lambda c: -c.logprob)[:top_n]]}
                        for e in entries]}


def choice(index: int, content: dict, logprobs: dict | None = None, finish_reason: str | None = None,
           stop_reason: str | int | None = None) -> dict:
    """One choice of a response or of a streamed chunk. ``content``: ``{"text": ...}`` for a
    completion, ``{"message": {"role", "content"}}`` for a chat reply, ``{"delta": ...}`` for a
    chat chunk; the last piece of a choice carries its ``finish_reason`` and ``stop_reason``."""
    return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def response(kind: str, response_id: str, created: int, model: str, choices: list[dict],
             usage_: dict | None = None, system_fingerprint: str | None = None) -> dict:
    """A whole response or one chunk. ``kind``: "text_completion" (a completion's chunks too),
    "chat.completion" or "chat.completion.chunk"."""
    body = {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices,
            "system_fingerprint": system_fingerprint}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def sse(data: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line (``data: [DONE]`` ends a stream)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


DONE = sse("[DONE]")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the server answers (``error_body``), described for ``/openapi.json``."""

    error: ErrorDetail
