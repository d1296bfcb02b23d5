"""The demo notebook is committed clean: no outputs, no execution counts, no widget state.

(Running it is the browser test's job: tests/browser/test_jupyterlab.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "widgets_demo.ipynb"


def test_demo_notebook_carries_no_outputs_or_widget_state() -> None:
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    assert "widgets" not in nb.get("metadata", {})
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code
    for cell in code:
        assert cell.get("outputs") == [] and cell.get("execution_count") is None
        assert "widgets" not in cell.get("metadata", {})
    assert NOTEBOOK.stat().st_size < 50_000


def test_demo_notebook_uses_every_simulator() -> None:
    source = "".join("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"])
    for name in ("SamplingPlayground", "SchedulerStepper", "BlockAllocatorView", "MemoryEstimator", "TokenEditor",
                 "Quiz("):
        assert name in source, name
