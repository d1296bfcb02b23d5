"""Import boundaries, checked in fresh interpreters: what each entry point pulls in.

* ``python -m nanoengine --help`` answers without torch or the benchmark (it only needs
  argparse), so it is instant;
* the engine (``nanoengine.engine``, layers, models, loader, ``llm``) never imports
  ``nanoengine.measure``: measuring depends on the engine, not the other way round. The
  check runs a whole engine, a step observer included, since an import inside a function
  would only show when that function runs.
"""

from __future__ import annotations

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
        "or m.startswith('nanoengine.measure'))))\n")
    assert loaded == []


@pytest.mark.slow
def test_the_engine_never_imports_measure():
    loaded = _run(
        "import json, sys\n"
        "import nanoengine.llm, nanoengine.engine.llm_engine, nanoengine.backends.cpu\n"
        "import nanoengine.engine.compilation, nanoengine.engine.cuda_graphs, nanoengine.loader.weights\n"
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
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('nanoengine.measure'))))\n")
    assert loaded == []
