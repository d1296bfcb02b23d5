"""pytest glue for the lab checks: every check takes a ``lab`` (see ``lab_harness.Lab``).

By default ``lab`` is the finished snapshot of the module's version; point it at any other
copy with the environment variable ``NANO_VLLM_LAB_DIR``::

    NANO_VLLM_LAB_DIR=labs/nano-vllm/work/v05_paged_kv python -m pytest labs/nano-vllm/checks/test_v05.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lab_harness import VERSIONS, V, Lab  # noqa: E402


@pytest.fixture
def lab(request) -> Lab:
    version = request.module.__name__.rsplit("_", 1)[-1]  # test_v05 -> v05
    folder = os.environ.get("NANO_VLLM_LAB_DIR") or VERSIONS / V[version]
    return Lab(folder, version)
