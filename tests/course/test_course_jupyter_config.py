"""The course's Jupyter configuration (jupyter/): what `./course lab` gives every learner.

The browser test (tests/browser/test_jupyterlab.py) checks the same settings in a live
JupyterLab; these tests check the files themselves, in milliseconds.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
from traitlets.config import Config

REPO = Path(__file__).resolve().parents[2]
JUPYTER = REPO / "jupyter"


def load_hooks():
    spec = importlib.util.spec_from_file_location("course_hooks_under_test", JUPYTER / "course_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_server_config() -> Config:
    """Run jupyter_server_config.py as Jupyter's config loader does."""
    path = JUPYTER / "config" / "jupyter_server_config.py"
    config = Config()
    namespace = {"get_config": lambda: config, "c": config, "__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 (our own config file)
    return config


def notebook_with_widgets(hooks) -> dict:
    view = {"model_id": "0a1b", "version_major": 2, "version_minor": 0}
    return {
        "metadata": {"kernelspec": {"name": "python3"}, "widgets": {"application/vnd.jupyter.widget-state+json": {}}},
        "nbformat": 4, "nbformat_minor": 5,
        "cells": [
            {"cell_type": "markdown", "metadata": {}, "source": "# title"},
            {"cell_type": "code", "metadata": {}, "execution_count": 3, "source": "playground", "outputs": [
                {"output_type": "stream", "name": "stdout", "text": "loaded in 3.1 s\n"},
                {"output_type": "execute_result", "execution_count": 3, "metadata": {},
                 "data": {"text/plain": "SamplingPlayground(children=(...))", hooks.WIDGET_VIEW: view}},
                {"output_type": "display_data", "metadata": {},
                 "data": {"text/plain": "VBox()", hooks.WIDGET_VIEW: dict(view, model_id="2c3d")}}]},
            {"cell_type": "code", "metadata": {}, "execution_count": 4, "source": "1 + 1", "outputs": [
                {"output_type": "execute_result", "execution_count": 4, "metadata": {},
                 "data": {"text/plain": "2"}}]},
        ],
    }


def test_a_saved_notebook_keeps_no_widget_views_but_says_how_to_bring_them_back() -> None:
    hooks = load_hooks()
    nb = notebook_with_widgets(hooks)
    model = {"type": "notebook", "path": "demo.ipynb", "content": nb}
    hooks.strip_widget_views(model=model, path="demo.ipynb", contents_manager=None)
    assert hooks.WIDGET_VIEW not in json.dumps(nb) and "widgets" not in nb["metadata"]
    outputs = nb["cells"][1]["outputs"]
    assert outputs[0]["output_type"] == "stream"  # other outputs are kept
    assert outputs[1:] == [hooks.rerun_note_output()]  # one line per cell, however many views it had
    assert "Run this cell to bring the simulator back" in outputs[1]["data"]["text/plain"]
    assert nb["cells"][2]["outputs"][0]["data"] == {"text/plain": "2"}
    saved = copy.deepcopy(nb)
    hooks.strip_widget_views(model=model, path="demo.ipynb", contents_manager=None)
    assert nb == saved  # saving again changes nothing


def test_files_other_than_notebooks_are_left_alone() -> None:
    hooks = load_hooks()
    model = {"type": "file", "format": "text", "content": "application/vnd.jupyter.widget-view+json"}
    hooks.strip_widget_views(model=copy.deepcopy(model), path="notes.txt", contents_manager=None)
    before = copy.deepcopy(model)
    hooks.strip_widget_views(model=model, path="notes.txt", contents_manager=None)
    assert model == before


def test_the_server_config_installs_the_hook_the_settings_and_localhost() -> None:
    config = load_server_config()
    hook = config.ContentsManager.pre_save_hook
    assert callable(hook) and hook.__name__ == "strip_widget_views"
    assert config.ServerApp.ip == "127.0.0.1"
    assert Path(config.LabApp.app_settings_dir) == JUPYTER / "lab-settings"
    assert (Path(config.LabApp.app_settings_dir) / "overrides.json").is_file()


def test_applying_the_config_again_as_the_server_does_warns_nothing() -> None:
    """The server hands its configuration to the contents manager twice; traitlets warned
    "Overriding existing pre_save_hook" at every launch for the same hook (course v5)."""
    import warnings

    from jupyter_server.services.contents.manager import ContentsManager

    config = load_server_config()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        load_server_config()  # the config file's filter in place, as in the server's process
        manager = ContentsManager(config=config)
        manager.update_config(config)
    assert manager.pre_save_hook.__name__ == "strip_widget_views"
    assert not [w for w in caught if "pre_save_hook" in str(w.message)], [str(w.message) for w in caught]


def test_course_lab_points_jupyter_at_the_course_config_and_binds_localhost() -> None:
    script = (REPO / "course").read_text()
    lab = script[script.index("  lab)"):script.index("  test)")]
    assert 'export JUPYTER_CONFIG_PATH="$PWD/jupyter/config' in lab
    assert "--ip=127.0.0.1" in lab
    # the URL JupyterLab prints (it starts with --no-browser) opens the index, not a launcher
    assert "--LabApp.default_url=/lab/tree/$index" in lab
    assert "index=notebooks/README.md" in lab and (REPO / "notebooks" / "README.md").is_file()
    # --lang ko opens the Korean edition's index
    assert "ko) index=notebooks/ko/README.md" in lab and (REPO / "notebooks" / "ko" / "README.md").is_file()


def _schema(plugin: str) -> dict:
    """The installed JupyterLab's settings schema for ``plugin`` ('@scope/package:name')."""
    from jupyter_core.paths import jupyter_path
    from jupyterlab.commands import get_app_dir

    package, name = plugin.split(":")
    candidates = [Path(get_app_dir()) / "schemas" / package / f"{name}.json"]
    candidates += [Path(p) / package / "schemas" / package / f"{name}.json" for p in jupyter_path("labextensions")]
    path = next((p for p in candidates if p.is_file()), None)
    assert path is not None, f"no settings schema for {plugin} in {candidates}"
    return json.loads(path.read_text())


@pytest.mark.slow
def test_lab_overrides_name_real_settings_open_markdown_rendered_and_mute_the_news() -> None:
    overrides = json.loads((JUPYTER / "lab-settings" / "overrides.json").read_text())
    for plugin, values in overrides.items():  # a misspelt plugin or setting would be ignored silently
        properties = _schema(plugin)["properties"]
        assert set(values) <= set(properties), (plugin, set(values) - set(properties))
    assert overrides["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]["markdown"] == "Markdown Preview"
    assert overrides["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
    assert overrides["@jupyter-widgets/jupyterlab-manager:plugin"]["saveState"] is False
