"""The HTTP server: FastAPI routes on the async engine, run by uvicorn (chapter 12).

    python -m nanoengine serve                       # http://127.0.0.1:8000/v1
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8}'

Routes (OpenAI's, as ``vllm serve`` has them):

=========================  =============================================================
``POST /v1/completions``   continue a prompt (or several); ``stream: true`` for SSE
``POST /v1/chat/completions``  the assistant's reply to a conversation; SSE as above
``GET /v1/models``         the one model served, under ``--served-model-name``
``GET /health``            200 while the engine thread runs, 503 once it has stopped
``GET /metrics``           Prometheus text: queues, KV blocks, prefix cache, latencies
``POST /reset_prefix_cache``  forget cached prompt blocks (vLLM's development endpoint;
                           ``bench --server`` calls it before each rate)
=========================  =============================================================

Every error, including 404s and a missing API key, has OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request (never a 422,
and never a crash: a bad request is refused before it reaches the engine), 401 without
the key, 429 when more than ``max_queue`` requests wait for the engine, 503 once the
engine has stopped.

The server listens on 127.0.0.1 unless told otherwise: a course machine should not offer
its model to the network by accident. With ``api_key`` set, every request must carry
``Authorization: Bearer <key>`` (``openai.OpenAI(api_key=...)`` sends it).

``serve_in_background`` runs the same server in a thread of the current process, on a free
port: the chapter's notebook and the tests use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.entrypoints.openai.async_engine import AsyncLLMEngine, EngineDeadError
from nanoengine.entrypoints.openai.cli_args import DEFAULT_HOST, DEFAULT_MAX_QUEUE, engine_kwargs
from nanoengine.entrypoints.openai.metrics import ServerMetrics
from nanoengine.entrypoints.openai.protocol import ProtocolError, error_body
from nanoengine.entrypoints.openai.serving import OpenAIServing

def build_app(engine: LLMEngine, served_model_name: str, api_key: str | None = None,
              max_queue: int | None = DEFAULT_MAX_QUEUE) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``served_model_name``.

    The engine thread starts when the app starts (uvicorn's lifespan) and stops when it
    stops; in between, only that thread touches ``engine``. ``app.state.engine`` is the
    ``AsyncLLMEngine`` (``app.state.engine.call(fn)`` runs ``fn(engine)`` safely).
    """
    if not isinstance(served_model_name, str) or not served_model_name:
        raise ValueError(f"served_model_name must be a non-empty string, got {served_model_name!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be None (no key) or a non-empty string")
    metrics = ServerMetrics(served_model_name)
    async_engine = AsyncLLMEngine(engine, max_waiting=max_queue, on_finished=metrics.observe_finished)
    serving = OpenAIServing(async_engine, served_model_name, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="nanoengine", summary="An OpenAI-compatible server on nanoengine", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.model_name = async_engine, metrics, served_model_name
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(ProtocolError)
    async def refused(_: Request, exc: ProtocolError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:  # 404, 405
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", code=str(exc.status_code)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await serving.completions(raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await serving.chat(raw)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": _STARTED,
                                            "owned_by": "nanoengine", "root": served_model_name,
                                            "max_model_len": serving.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return JSONResponse(error_body("the engine has stopped" + (f": {async_engine.error!r}" if
                                           async_engine.error else ""), "server_error", code="engine_unavailable"),
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:  # benchmarks: a run must not be served from the previous one
        try:
            dropped = await asyncio.wrap_future(async_engine.call(lambda engine: engine.reset_prefix_cache()))
        except EngineDeadError as exc:
            raise ProtocolError(str(exc), status=503, type="server_error", code="engine_unavailable") from None
        return {"dropped_blocks": dropped}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(async_engine.stats),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


_STARTED = int(time.time())


class ApiKeyMiddleware:
    """Refuse (401) every HTTP request whose ``Authorization`` header is not ``Bearer <key>``.

    A plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which wraps streamed
    responses and gets in the way of disconnect detection). ``secrets.compare_digest``
    compares in constant time, so response timing does not leak the key.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = JSONResponse(error_body("a valid API key is required: send 'Authorization: Bearer <key>'",
                                                   "invalid_request_error", code="invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ----------------------------------------------------------------- running it
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


def _uvicorn(app: FastAPI, log_level: str, access_log: bool) -> uvicorn.Server:
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=5, timeout_keep_alive=5)
    return uvicorn.Server(config)


def run_server(app: FastAPI, sock: socket.socket, log_level: str = "info") -> None:
    """Serve ``app`` on ``sock`` in this thread until Ctrl-C (the command line's path)."""
    with contextlib.suppress(KeyboardInterrupt):
        _uvicorn(app, log_level, access_log=True).run(sockets=[sock])


class BackgroundServer:
    """The server running in a thread of this process (notebooks and tests).

    ``url`` is the server's root, ``base_url`` what the ``openai`` client takes; ``engine`` is
    the ``AsyncLLMEngine`` (use ``engine.call(fn)`` to look at the engine while it serves).
    ``stop()`` shuts down uvicorn and the engine thread; a ``with`` block calls it.
    """

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
                        log_level: str = "warning") -> BackgroundServer:
    """Serve ``engine`` under ``served_model_name`` from a thread of this process; returns
    once it accepts requests.

    ``port=0`` takes a free port (read it from ``.url``). While it runs, the engine belongs
    to the server's engine thread: do not call its methods from elsewhere.
    """
    app = build_app(engine, served_model_name, api_key=api_key, max_queue=max_queue)
    return BackgroundServer(app, bind_socket(host, port), log_level).start()


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
        engine = LLMEngine.from_pretrained(source, **engine_kwargs(args))
        app = build_app(engine, name, api_key=args.api_key, max_queue=args.max_queue)
        host, port = sock.getsockname()[:2]
        print(f"serving {name!r} at http://{host}:{port}/v1 (max_model_len {engine.max_model_len}, "
              f"{engine.runner.num_blocks} KV blocks); Ctrl-C stops", flush=True)
        if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"warning: listening on {args.host} without --api-key: anyone who can reach this machine can "
                  f"use the model", flush=True)
        run_server(app, sock, args.log_level)
    finally:
        sock.close()
        if engine is not None:
            engine.shutdown()


logging.getLogger("nanoengine.serve").addHandler(logging.NullHandler())
