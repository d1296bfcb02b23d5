"""Measuring tools: the benchmark, the GPU check, the load report, the prefix-hash cost.

Each is a command (``python -m nanoengine bench``, ``./course gpu-check``,
``python -m nanoengine.measure.load_report``, ``python -m nanoengine.measure.prefix_hash``)
that writes a results file naming the machine, the engine revision, the date and the
command that produced it. The engine never imports this package.
"""
