"""Import boundaries, checked in fresh interpreters: what each entry point pulls in.

* ``python -m nanoengine --help`` answers without torch or the benchmark (it only needs
  argparse), so it is instant;
* the engine (``nanoengine.engine``, layers, models, loader, ``llm``) never imports
  ``nanobench``: measuring depends on the engine, not the other way round. The
  check runs a whole engine, a step observer included, since an import inside a function
  would only show when that function runs;
* and, read from the sources (every import statement, at any depth, and every
  ``importlib.import_module``/``__import__`` of a literal name), no module under
  ``nanoengine/`` names ``nanobench``, except the command line's ``bench``
  (``nanoengine/__main__.py``), which imports it inside the function that runs it;
* ``from nanobench import prepare_environment`` (a chapter's first cell) imports no torch.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_help_imports_neither_torch_nor_the_benchmark():
    loaded = _run(
        "import json, sys, contextlib, io\n"
        "from nanoengine.__main__ import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert 'generate' in out.getvalue() and 'bench' in out.getvalue()\n"
        "print(json.dumps(sorted(m for m in sys.modules if m in ('torch', 'transformers', 'fastapi') "
        "or m.startswith('nanobench'))))\n")
    assert loaded == []


@pytest.mark.slow
def test_the_engine_never_imports_measure():
    loaded = _run(
        "import json, sys\n"
        "import nanoengine.llm, nanoengine.engine.llm_engine, nanoengine.backends.cpu\n"
        "import nanoengine.backends.compilation, nanoengine.backends.cuda_graphs, nanoengine.loader.weights\n"
        "import nanoengine.distributed.tp_runner, nanoengine.distributed.worker, nanoengine.models\n"
        "from nanoengine import LLMEngine, SamplingParams\n"
        "from nanoengine.events import StepFinished\n"
        "from nanoengine.loader.weights import random_model\n"
        "engine = LLMEngine.from_model(random_model('tiny-llama-eos'), None, device='cpu', num_kv_blocks=16,\n"
        "                              block_size=4, max_model_len=32)\n"
        "steps = []\n"
        "engine.events.subscribe(steps.append, StepFinished)\n"
        "engine.events.keep_history(100)\n"
        "engine.add_request([5, 9, 200], SamplingParams(max_tokens=3, ignore_eos=True))\n"
        "while engine.has_unfinished_requests():\n"
        "    engine.step()\n"
        "engine.snapshot(); engine.memory_report(); engine.next_token_logits([5, 9])\n"
        "assert steps, 'the engine did not step'\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('nanobench'))))\n")
    assert loaded == []


# ------------------------------------------------------------- nanobench stays outside
CLI = Path("nanoengine/__main__.py")  # the one module allowed to import nanobench, and only lazily


def _nanobench_imports(tree: ast.AST) -> list[tuple[int, str, bool]]:
    """(line, what is imported, at module level?) for every import of nanobench in ``tree``."""
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module"
                   or getattr(node.func, "id", None) in ("import_module", "__import__"))):
            names = [node.args[0].value]
        found.extend((node.lineno, name, top) for name in names if name.split(".")[0] == "nanobench")
        nested = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, top and not nested)

    visit(tree, True)
    return found


def test_no_engine_module_imports_nanobench():
    modules = sorted((ROOT / "nanoengine").rglob("*.py"))
    assert len(modules) > 30 and not (ROOT / "nanoengine" / "measure").exists()
    offenders, cli_imports = [], []
    for path in modules:
        relative = path.relative_to(ROOT)
        imports = _nanobench_imports(ast.parse(path.read_text(), filename=str(relative)))
        if relative == CLI:
            cli_imports = imports
        else:
            offenders += [f"{relative}:{line} imports {name}" for line, name, _ in imports]
    assert not offenders, "the engine must not import nanobench:\n" + "\n".join(offenders)
    # the CLI's bench: lazily, inside the functions that run it, so --help and the rest never load it
    assert cli_imports and all(not top for _, _, top in cli_imports), cli_imports


def test_the_scan_sees_every_kind_of_import():
    code = ("import nanobench\nfrom nanobench.timing import measure\nimport os, nanobench.benchmark as b\n"
            "def f():\n    from nanobench import benchmark\n    importlib.import_module('nanobench.gpu_check')\n"
            "    __import__('nanobench')\n"
            "from nanoengine import LLM\nfrom . import nanobench_like\nimport nanobenchmark\n")
    assert [(line, top) for line, _, top in _nanobench_imports(ast.parse(code))] == [
        (1, True), (2, True), (3, True), (5, False), (6, False), (7, False)]


def test_nanobench_surface_imports_no_torch():
    loaded = _run(
        "import json, sys\n"
        "from nanobench import prepare_environment, machine_description, measure\n"
        "prepare_environment()\n"
        "import nanobench\n"
        "assert {'measure', 'prepare_environment', 'make_workload'} <= set(nanobench.__all__)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m in ('torch', 'plotly', 'nanobench.benchmark'))))\n")
    assert loaded == []
