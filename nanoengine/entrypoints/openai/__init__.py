"""An OpenAI-compatible HTTP server on the engine: ``python -m nanoengine serve`` (chapter 12).

One concept per module, in the order a request meets them:

* ``cli_args``: the ``serve`` command's flags, checked before the model loads;
* ``api_server``: the FastAPI app (routes, API key, errors in OpenAI's shape) and uvicorn;
* ``protocol``: the wire format: request models and their validation, response and chunk
  shapes, the error body;
* ``serving``: one HTTP request through the engine: validate, submit, stream server-sent
  events or collect one response, abort on disconnect;
* ``async_engine``: the bridge between asyncio and the engine: one thread owns the
  ``LLMEngine`` and steps it while requests arrive;
* ``engine_core``: the same interface with the engine in a process of its own, which
  ``serve`` runs by default (as vLLM v1 does);
* ``metrics``: the Prometheus text behind ``GET /metrics``.

vLLM's ``vllm/entrypoints/openai/`` has the same split (``api_server.py``, ``protocol.py``,
``serving_completion.py``, ``serving_chat.py``, ``cli_args.py``), much larger.
"""
