"""Ways into the engine from outside this Python process (chapter 12).

``entrypoints.openai`` serves the engine over HTTP with OpenAI's API, as ``vllm serve``
does, so any OpenAI client can talk to it. The engine never imports this package: it is a
client of ``LLMEngine``'s public methods like ``LLM`` is.
"""
