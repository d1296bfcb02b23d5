"""The HTTP server: FastAPI routes on the async engine, run by uvicorn (chapter 12).

    python -m nanoengine serve                       # http://127.0.0.1:8000/v1
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8}'

The routes are ``vllm serve``'s (``build_app``; ``GET /openapi.json`` describes them): OpenAI's
``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, then ``/health``, ``/metrics``
(Prometheus) and ``/reset_prefix_cache``. Every error, 404s and a missing API key included, has
OpenAI's shape (``protocol.error_body``) and a status ``_ERROR_MEANINGS`` explains: a bad request
is a 400, never FastAPI's 422. The engine stops only on a fault of its own (a bug a request's
data reached fails that request alone, a 500: ``LLMEngine._outputs``); the command-line server
(``run_server``) then exits with status 1, as vLLM's does, for a supervisor to start a fresh
one; a server in a thread (``serve_in_background``: notebooks, tests) answers 503 until stopped.

The server listens on 127.0.0.1 unless told otherwise, so that a course machine does not offer
its model to the network by accident. An API key (``ApiKeyMiddleware``) and deadlines for slow
clients' headers (``_HeadTimeoutH11``) and bodies (``OpenAIServing.read_body``) guard the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import operator
import secrets
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanoengine.backends import cpu_platform
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.entrypoints.openai.async_engine import AsyncLLMEngine, EngineDeadError, checked_max_waiting
from nanoengine.entrypoints.openai.cli_args import (DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_HOST,
                                                    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, check_limits,
                                                    engine_kwargs)
from nanoengine.entrypoints.openai.engine_core import EngineCoreClient
from nanoengine.entrypoints.openai.metrics import ServerMetrics
from nanoengine.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, ErrorResponse,
                                                    ProtocolError, engine_unavailable, error_body)
from nanoengine.entrypoints.openai.serving import ClientGone, OpenAIServing

logger = logging.getLogger("nanoengine.serve")
logger.addHandler(logging.NullHandler())


def build_app(engine: LLMEngine | EngineCoreClient, served_model_name: str, api_key: str | None = None,
              max_queue: int | None = DEFAULT_MAX_QUEUE, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              body_timeout: float = DEFAULT_BODY_TIMEOUT, header_timeout: float = DEFAULT_HEADER_TIMEOUT) -> FastAPI:
    """The FastAPI app serving ``engine``: an ``LLMEngine`` is stepped by an ``AsyncLLMEngine`` thread,
    an ``EngineCoreClient`` (``serve``'s) is driven as it is. Either starts and stops with the app
    (uvicorn's lifespan) and is ``app.state.engine`` (``.call(fn)`` runs ``fn(engine)`` safely)."""
    if not isinstance(served_model_name, str) or not served_model_name:
        raise ValueError(f"served_model_name must be a non-empty string, got {served_model_name!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be None (no key) or a non-empty string")
    check_limits(max_body_bytes, header_timeout, body_timeout)
    metrics = ServerMetrics(served_model_name)

    def engine_died() -> None:  # on the event loop, once: a step failed and the engine stopped
        stop_serving = getattr(app.state, "stop_serving", None)  # set by run_server: the command line's server
        if stop_serving is not None:
            logger.error("the engine has stopped (%r): the server exits", async_engine.error)
            stop_serving()

    max_waiting = checked_max_waiting(max_queue)
    async_engine = engine if isinstance(engine, EngineCoreClient) else AsyncLLMEngine(engine)
    async_engine.max_waiting, async_engine.on_finished = max_waiting, metrics.observe_finished
    async_engine.on_dead = engine_died
    fingerprint = system_fingerprint(async_engine, served_model_name)
    serving = OpenAIServing(async_engine, served_model_name, metrics, max_body_bytes=max_body_bytes,
                            body_timeout=body_timeout, system_fingerprint=fingerprint)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            async_engine.shutdown()
            serving.shutdown()

    app = FastAPI(title="nanoengine", summary="An OpenAI-compatible server on nanoengine", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.model_name = async_engine, metrics, served_model_name
    app.state.header_timeout = header_timeout
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(ProtocolError)
    async def refused(_: Request, exc: ProtocolError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:  # before a response started
        return await refused(request, engine_unavailable(exc))

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:  # nobody reads it; no traceback in the log
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:  # 404, 405
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", code=str(exc.status_code)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.post("/v1/completions", responses=_errors(400, 401, 408, 413, 429, 500, 503),
              summary="Continue a prompt (or several); stream: true for server-sent events")
    async def completions(raw: Request) -> Response:
        return await serving.completions(raw)

    @app.post("/v1/chat/completions", responses=_errors(400, 401, 408, 413, 429, 500, 503),
              summary="The assistant's reply to a conversation; stream: true for server-sent events")
    async def chat_completions(raw: Request) -> Response:
        return await serving.chat(raw)

    def model_card() -> dict:
        return {"id": served_model_name, "object": "model", "created": _STARTED, "owned_by": "nanoengine",
                "root": served_model_name, "max_model_len": serving.max_model_len}

    @app.get("/v1/models", responses=_errors(401))
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses=_errors(401, 404))
    async def model(model_id: str) -> dict:
        if model_id != served_model_name:
            raise ProtocolError(f"the model {model_id!r} does not exist: this server serves {served_model_name!r}",
                                status=404, param="model", code="model_not_found")
        return model_card()

    @app.get("/health", responses=_errors(503))
    async def health() -> Response:
        if not async_engine.is_running:
            why = f": {async_engine.error!r}" if async_engine.error else ""
            return JSONResponse(engine_unavailable(f"the engine has stopped{why}").body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.post("/reset_prefix_cache", responses=_errors(503))
    async def reset_prefix_cache() -> dict:  # benchmarks: a run must not be served from the previous one
        reset = operator.methodcaller("reset_prefix_cache")  # not a lambda: the engine-core process unpickles it
        return {"dropped_blocks": await asyncio.wrap_future(async_engine.call(reset))}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format 0.0.4"}})
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(async_engine.stats),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    app.openapi = lambda: _openapi(app)
    return app


_ERROR_MEANINGS = {400: "a bad request: the message names the field and what is allowed",
                   401: "no valid API key (Authorization: Bearer <key>)", 404: "no such model or route",
                   408: "the request body did not arrive within --body-timeout seconds",
                   413: "the request body is larger than --max-body-bytes",
                   429: "more than --max-queue requests wait for the engine; retry later (Retry-After)",
                   500: "the engine could not finish this request (a bug its data reached); it serves the others on",
                   503: "the engine has stopped"}


def _errors(*statuses: int) -> dict:
    """The error responses of a route, for ``/openapi.json``: all in OpenAI's shape."""
    return {status: {"model": ErrorResponse, "description": _ERROR_MEANINGS[status]} for status in statuses}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, plus the request bodies of the two POST routes: they read the raw body
    themselves (for a 400 in OpenAI's shape, not FastAPI's 422), so FastAPI cannot see them."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        post = schema["paths"][path]["post"]
        post["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        post["responses"]["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    app.openapi_schema = schema
    return schema


def system_fingerprint(engine: "AsyncLLMEngine | EngineCoreClient", served_model_name: str) -> str:
    """OpenAI's ``system_fingerprint``: names the configuration that produced a response
    (the model, the engine's settings), so that a client can tell when it changed."""
    config = f"{served_model_name}|{engine.config!r}|{engine.max_model_len}|{engine.num_blocks}"
    return "fp_" + hashlib.sha256(config.encode()).hexdigest()[:10]


_STARTED = int(time.time())


class ApiKeyMiddleware:
    """Refuse (401) every request to ``/v1/...`` whose ``Authorization`` header is not
    ``Bearer <key>``; other paths (health, metrics, schema: open to probes and scrapers) and
    CORS preflights pass, as in vLLM's ``AuthenticationMiddleware``. Plain ASGI: Starlette's
    ``BaseHTTPMiddleware`` wraps streamed responses and gets in the way of disconnect detection."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and (path == "/v1" or path.startswith("/v1/")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):  # constant time: timing leaks nothing
                response = JSONResponse(error_body("a valid API key is required: send 'Authorization: Bearer <key>'",
                                                   "invalid_request_error", code="invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one. Bound before the
    model loads, so a taken port is reported at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port "
                         f"(or --host)") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class _HeadTimeoutH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus a deadline for each request's headers.

    uvicorn closes a silent keep-alive connection, but one that sends a byte of its headers now
    and then (the "slowloris" attack) holds it open for ever. Here a timer starts when the
    connection opens and when a response completes; if no whole request head has arrived when
    it fires, the client gets a 408 and the connection closes. ``_uvicorn`` sets ``head_timeout``."""

    head_timeout: float = DEFAULT_HEADER_TIMEOUT
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # closed already, or a request is being served: its head arrived
        body = json.dumps(error_body(f"the request headers did not arrive within {self.head_timeout:g} s",
                                     code="request_timeout")).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def _uvicorn(app: FastAPI, log_level: str, access_log: bool) -> uvicorn.Server:
    head_timeout = float(getattr(app.state, "header_timeout", DEFAULT_HEADER_TIMEOUT))
    http = type("HeadTimeoutH11", (_HeadTimeoutH11,), {"head_timeout": head_timeout})
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                                         timeout_graceful_shutdown=5, timeout_keep_alive=5, http=http))


def run_server(app: FastAPI, sock: socket.socket, log_level: str = "info") -> None:
    """Serve ``app`` on ``sock`` in this thread until Ctrl-C, or until the engine stops
    (the command line's path; ``serve_from_args`` then exits with status 1)."""
    server = _uvicorn(app, log_level, access_log=True)
    app.state.stop_serving = lambda: setattr(server, "should_exit", True)
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])


class BackgroundServer:
    """The server running in a thread of this process (notebooks and tests); a ``with`` block stops it.

    ``url`` is the server's root, ``base_url`` what the ``openai`` client takes; ``engine`` is
    the ``AsyncLLMEngine`` (``engine.call(fn)`` looks at the engine while it serves)."""

    def __init__(self, app: FastAPI, sock: socket.socket, log_level: str = "warning") -> None:
        self.app = app
        self.engine: AsyncLLMEngine = app.state.engine
        self.model_name: str = app.state.model_name
        host, port = sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        self.base_url = self.url + "/v1"
        self._server = _uvicorn(app, log_level, access_log=False)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="nanoengine-http", daemon=True)

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server stopped during start-up (see the log above)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting requests, end open ones (within 5 s), stop the engine thread."""
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the server did not stop within {timeout} s")

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_in_background(engine: LLMEngine, served_model_name: str, host: str = DEFAULT_HOST, port: int = 0,
                        api_key: str | None = None, max_queue: int | None = DEFAULT_MAX_QUEUE,
                        log_level: str = "warning", **limits) -> BackgroundServer:
    """Serve ``engine`` from a thread of this process, once it accepts requests; ``port=0`` takes
    a free port (read it from ``.url``). While it runs, the engine belongs to the server's engine
    thread: do not call its methods from elsewhere. ``limits``: ``build_app``'s request limits."""
    app = build_app(engine, served_model_name, api_key=api_key, max_queue=max_queue, **limits)
    return BackgroundServer(app, bind_socket(host, port), log_level).start()


# How often CPython asks the GIL's holder to hand it over (default 5 ms), set by ``serve
# --engine-thread`` only: there the engine thread and the event loop both run Python, and a ready
# token can wait most of an interval for the loop; 1 ms measured better (results/README.md).
GIL_SWITCH_INTERVAL_S = 0.001


def serve_from_args(args) -> None:
    """``python -m nanoengine serve`` once ``cli_args.check_arguments`` has passed: take the
    port, load the model, serve until Ctrl-C."""
    from nanoengine.default_model import DEFAULT_MODEL_NAME
    from nanoengine.loader.weights import resolve_model_source

    source = resolve_model_source(args.model)  # FileNotFoundError names a missing path
    name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else
                                      Path(args.model).stem if source.suffix == ".gguf" else source.name)
    sock = bind_socket(args.host, args.port)
    engine = None
    try:
        print(f"loading {name} from {source}", flush=True)
        build = functools.partial(LLMEngine.from_pretrained, source, **engine_kwargs(args))
        with cpu_platform.serving(engine_in_own_process=not args.engine_thread):  # the host's settings for a server
            if args.engine_thread:
                # loaded on a thread that ends, so that the engine thread's OpenMP team is the only one (async_engine)
                engine = cpu_platform.build_on_a_passing_thread(build)
            else:
                engine = EngineCoreClient(build)  # loaded and stepped by the main thread of a process of its own
        app = build_app(engine, name, api_key=args.api_key, max_queue=args.max_queue,
                        max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                        header_timeout=args.header_timeout)
        facts = app.state.engine
        host, port = sock.getsockname()[:2]
        print(f"serving {name!r} at http://{host}:{port}/v1 (max_model_len {facts.max_model_len}, "
              f"{facts.num_blocks} KV blocks, the engine "
              f"{'on a thread' if args.engine_thread else 'in a process of its own'}); Ctrl-C stops", flush=True)
        if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"warning: listening on {args.host} without --api-key: anyone who can reach this machine can "
                  f"use the model", flush=True)
        if args.engine_thread:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        run_server(app, sock, args.log_level)
    finally:
        sock.close()
        if engine is not None:
            engine.shutdown()
    if app.state.engine.error is not None:  # for a supervisor (systemd, Kubernetes) to start a fresh one
        print(f"the engine failed and stopped ({app.state.engine.error!r}); exiting with status 1", file=sys.stderr,
              flush=True)
        raise SystemExit(1)
