"""Chapter helpers: show the engine's own source, and name the machine a number came from.

Every code excerpt in the notebooks comes through ``show_source`` (the code that actually
runs, read from the installed package, never a pasted copy), and every measurement is
printed next to ``machine_description()``.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import platform
from pathlib import Path

import torch


def source_of(obj) -> tuple[str, str, int]:
    """(source text, path relative to the repository, first line number) of ``obj``."""
    lines, first = inspect.getsourcelines(obj)
    path = Path(inspect.getsourcefile(obj)).resolve()
    root = Path(__file__).resolve().parent.parent
    try:
        shown = str(path.relative_to(root))
    except ValueError:
        shown = str(path)
    return "".join(lines), shown, first


def show_source(obj, title: str | None = None):
    """Display ``obj``'s source (a function, class, method or module) with its location.

    Returns an IPython HTML object, syntax-highlighted when pygments is available.
    """
    from IPython.display import HTML

    text, path, first = source_of(obj)
    # The digest lets tests/test_notebooks.py check a saved listing against today's source.
    digest = hashlib.sha256(text.encode()).hexdigest()
    header = f"<div class='ne-source' data-path='{path}' data-first-line='{first}' " \
             f"data-lines='{text.count(chr(10))}' data-sha256='{digest}' " \
             f"style='font-family:monospace;color:#555'>{title + ' — ' if title else ''}{path}, line {first}</div>"
    try:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer

        body = highlight(text, PythonLexer(), HtmlFormatter(noclasses=True, linenos="inline",
                                                           linenostart=first))
    except ImportError:  # plain text is still the real source
        import html

        body = f"<pre>{html.escape(text)}</pre>"
    return HTML(header + body)


def machine_description() -> str:
    """A one-line description of where a measurement ran: CPU or GPU, threads, torch."""
    if torch.cuda.is_available():
        device = f"GPU {torch.cuda.get_device_name(0)}"
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        device = f"CPU {name}, {os.cpu_count()} cores"
    return f"{device}; torch {torch.__version__} using {torch.get_num_threads()} threads"
