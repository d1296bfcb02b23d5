"""What the course's JupyterLab does when a notebook is saved: keep live widget views out.

A simulator is a live object in the kernel. JupyterLab saves a notebook with each widget's
output as a reference to that object (``application/vnd.jupyter.widget-view+json``: a
model id). After a restart the kernel holds no such object, and every simulator cell shows
"Error displaying widget: model not found", with no hint of what to do. So, before the file
is written, each such output is replaced by one line that says what to do (run the cell),
and any saved widget state is dropped (it would be stale, and multi-megabyte). The view on
screen is not touched: only the file changes.

``jupyter/config/jupyter_server_config.py`` installs ``strip_widget_views`` as the server's
``pre_save_hook``; tests/course/test_course_jupyter_config.py tests it. Standard library only: the
Jupyter server imports it, and it must not pull in torch.
"""

from __future__ import annotations

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
RERUN_NOTE = ("▶ Run this cell to bring the simulator back (a live widget is not saved with the notebook: "
              "it needs its running kernel).")


def rerun_note_output() -> dict:
    """The output that takes the place of a saved widget view."""
    return {"output_type": "display_data", "metadata": {}, "data": {"text/plain": RERUN_NOTE}}


def strip_widget_views_from_notebook(nb: dict) -> int:
    """Replace widget-view outputs in ``nb`` (an nbformat 4 dict, changed in place) by one
    rerun note per cell, and drop saved widget state. Returns the number of views removed."""
    removed = 0
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        cell.get("metadata", {}).pop("widgets", None)
        kept, noted = [], False
        for output in cell.get("outputs", []):
            if WIDGET_VIEW in output.get("data", {}):
                removed += 1
                if not noted:
                    kept.append(rerun_note_output())
                    noted = True
            else:
                kept.append(output)
        if "outputs" in cell:
            cell["outputs"] = kept
    return removed


def strip_widget_views(model: dict, **_) -> None:
    """A Jupyter server ``pre_save_hook``: called with the contents model before a save."""
    if model.get("type") == "notebook" and isinstance(model.get("content"), dict):
        strip_widget_views_from_notebook(model["content"])
