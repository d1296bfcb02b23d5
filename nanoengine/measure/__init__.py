"""Measuring tools: the benchmark, the GPU check, the load report, the prefix-hash cost, timing,
and the README's results report.

``benchmark`` (``python -m nanoengine bench``), ``benchmark_compile`` (its ``--compile``
A/B), ``gpu_check`` (``./course gpu-check``) and ``prefix_hash``
(``python -m nanoengine.measure.prefix_hash``) write results files under ``results/`` that
name the machine, the engine revision, the date and the command (``results/README.md``);
``load_report`` (``python -m nanoengine.measure.load_report``) prints its figures and backs
``tests/engine/test_load.py``; ``timing`` is the one measuring helper the chapters use;
``results_report`` (``python -m nanoengine.measure.results_report``) builds the README's
"Results" table and plot from the results files. The engine never imports this package.
"""
