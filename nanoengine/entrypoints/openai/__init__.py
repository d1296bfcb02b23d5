"""An OpenAI-compatible HTTP server on the engine: ``python -m nanoengine serve`` (chapter 12).

One concept per module, in the order a request meets them: ``cli_args`` (the ``serve`` flags,
checked before the model loads), ``api_server`` (the FastAPI app, its routes and errors, and
uvicorn), ``protocol`` (the wire format), ``serving`` (one HTTP request through the engine),
``async_engine`` (the engine stepped on a thread, driven from asyncio) or ``engine_core`` (the
same in a process of its own, which ``serve`` runs by default, as vLLM v1 does), and
``metrics`` (``GET /metrics``). vLLM's ``vllm/entrypoints/openai/`` has the same split, much larger.
"""
