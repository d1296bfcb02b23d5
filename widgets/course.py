"""Chapter helpers: show the engine's own source, and name the machine a number came from.

Every code excerpt in the notebooks comes through ``show_source`` (the code that actually
runs, read from the installed package, never a pasted copy), and every measurement is
printed next to ``machine_description()`` (which lives in ``nanobench.timing``, with
``measure``, the helper every timing goes through; it is re-exported here).
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

from nanobench import machine_description  # re-exported: it lives next to the timing helper


def source_of(obj) -> tuple[str, str, int]:
    """(source text, path relative to the repository, first line number) of ``obj``.

    A decorated function (``@torch.inference_mode()``, ``functools.wraps``) is shown as written,
    from its own file: ``getsourcelines`` unwraps it, ``getsourcefile`` would not.
    """
    obj = inspect.unwrap(obj) if callable(obj) else obj
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
    # The digest lets tests/course/test_notebooks.py check a saved listing against today's source.
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


__all__ = ["machine_description", "show_source", "source_of"]
