"""Where the Hermes home is.

Owns the answer to "which folder holds state.db": a per-context override, the
HERMES_HOME environment variable, then the platform default. It never creates
the folder and never touches a database; SessionDB does that.
"""

import contextvars
import os
import sys
from pathlib import Path

STATE_DB_FILENAME = "state.db"

# A ContextVar, not os.environ: a test or a multi-profile server can point one
# thread or task at another home without changing it for everybody else.
_home_override = contextvars.ContextVar("hermes_home_override", default=None)


def set_hermes_home_override(path):
    """Use `path` as the home in the current context; returns a token for reset."""
    return _home_override.set(Path(path))


def reset_hermes_home_override(token):
    """Undo the `set_hermes_home_override` call that returned `token`."""
    _home_override.reset(token)


def _default_home():
    if sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA", "").strip()
        base = Path(local) if local else Path.home() / "AppData" / "Local"
        return base / "hermes"
    return Path.home() / ".hermes"


def get_hermes_home():
    """The home folder: the context override, else HERMES_HOME, else the platform default."""
    override = _home_override.get()
    if override is not None:
        return override
    env = os.environ.get("HERMES_HOME", "").strip()
    if env:
        return Path(env).expanduser()
    return _default_home()


def get_default_db_path():
    """`<home>/state.db`, resolved now (not at import) so overrides apply."""
    return get_hermes_home() / STATE_DB_FILENAME
