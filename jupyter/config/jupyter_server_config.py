# The course's Jupyter settings. `./course lab` (and the browser test) put this folder on
# JUPYTER_CONFIG_PATH, so a fresh clone gets them; your own ~/.jupyter still wins.
#
# * Saved notebooks keep no live widget views: each becomes a one-line "run this cell to bring
#   the simulator back" (jupyter/course_hooks.py), so reopening a notebook after a restart
#   shows what to do instead of "Error displaying widget: model not found".
# * JupyterLab reads the course's settings overrides from jupyter/lab-settings/overrides.json:
#   Markdown files (the course index) open rendered, with working links; no Jupyter news
#   pop-up; widget state is not saved.
# * The server listens on 127.0.0.1 only.
import importlib.util
import warnings
from pathlib import Path

_here = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("nanoengine_course_hooks", _here.parent / "course_hooks.py")
_hooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_hooks)

c = get_config()  # noqa: F821 (defined by Jupyter's config loader)
c.ContentsManager.pre_save_hook = _hooks.strip_widget_views
# The server applies its configuration to the contents manager twice, and traitlets warns each
# time a hook replaces one, even the same hook ("Overriding existing pre_save_hook
# (strip_widget_views) with a new one (strip_widget_views)"). Only that case is silenced: a
# different hook replacing this one still warns.
warnings.filterwarnings("ignore", message=r"Overriding existing pre_save_hook \(strip_widget_views\) "
                        r"with a new one \(strip_widget_views\)")
c.LabApp.app_settings_dir = str(_here.parent / "lab-settings")
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"
c.ServerApp.ip = "127.0.0.1"
