"""Course tests' shared hygiene: every module's widgets are closed when it ends.

ipywidgets keeps every widget it creates in a process-wide registry until ``close()``
(a notebook's frontend may still show it). A widget test's view observes its engine, so
an unclosed view keeps that engine alive, and with it every request the test left
mid-run: a gc probe after the course's fast tier found 83 ``Request`` objects held this
way, all freed by ``Widget.close_all()``. That is the tests' doing, not an engine leak:
the engine drops a request's state when its final output is built.
"""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(scope="module", autouse=True)
def close_widgets_after_each_module():
    yield
    ipywidgets = sys.modules.get("ipywidgets")  # only if the module used widgets: no import otherwise
    if ipywidgets is not None:
        ipywidgets.Widget.close_all()
