"""Sphinx configuration of the course's website (scripts/build_site.py stages the pages next
to this file and builds them; docs/SITE.md explains the choices).

MyST-NB reads the notebooks with their saved outputs and never runs them
(``nb_execution_mode = "off"``): every number on the site is the one the notebook recorded,
with the machine and date the build script adds to each page.
"""

project = "nanoengine: how LLM inference engines work"
author = "the nanoengine course"
copyright = "the nanoengine course"
extensions = ["myst_nb"]
root_doc = "index"
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

# notebooks: saved outputs only, stderr shown as in JupyterLab, streams merged per cell
nb_execution_mode = "off"
nb_output_stderr = "show"
nb_merge_streams = True
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3  # [text](#a-heading) links in the index and the notes resolve

html_theme = "sphinx_book_theme"
html_title = "nanoengine course"
html_static_path = ["_static"]
html_css_files = ["course.css"]
html_favicon = "_static/favicon.svg"  # without one, browsers ask for /favicon.ico and get a 404
# the theme reads its light/dark mode from here; left empty it logs an error on every page
html_context = {"default_mode": "light"}
# the page's download button offers its source (the notebook, with its saved outputs)
html_copy_source = True
html_show_sourcelink = False
html_theme_options = {
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "show_toc_level": 2,
    "use_download_button": True,
    "show_prev_next": True,
    "navigation_with_keys": False,
}
html_last_updated_fmt = None
pygments_style = "default"


def _plotly_where_needed(app, pagename, templatename, context, doctree):
    """plotly.js (from the plotly package, ~5 MB) only on pages that draw a figure."""
    if "ne-plotly" in context.get("body", ""):
        app.add_js_file("plotly.min.js", priority=400)


LANGUAGE_NAMES = {"en": "English", "ko": "한국어"}


def _language_switch(app, pagename, templatename, context, doctree):
    """A link, at the top of every page, to the same page in each other language: English is
    the site's root and a translation its folder (``ko/``), with the same page paths."""
    here = app.config.language or "en"
    languages = [lang for lang in app.config.ne_languages.split(",") if lang]
    if len(languages) < 2 or "body" not in context:
        return
    up = "../" * pagename.count("/") + ("../" if here != "en" else "")
    links = [f"<a href='{up}{'' if lang == 'en' else lang + '/'}{pagename}.html' hreflang='{lang}' lang='{lang}'>"
             f"{LANGUAGE_NAMES.get(lang, lang)}</a>" for lang in languages if lang != here]
    context["body"] = f"<p class='ne-language-switch'>{' · '.join(links)}</p>" + context["body"]


def setup(app):
    app.add_config_value("ne_languages", "en", "html")
    app.connect("html-page-context", _plotly_where_needed)
    app.connect("html-page-context", _language_switch)
