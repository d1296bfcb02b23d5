"""The engine core and its worker: requests in, one step at a time, tokens out (chapters 2-8).

The control plane decides what each step computes (``llm_engine``, ``scheduler``,
``block_manager``, ``request``, the input and output processors); ``model_runner`` is the data
plane that computes it.
"""
