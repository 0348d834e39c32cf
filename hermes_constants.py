"""Where the Hermes home is, and the well-known paths inside it.

Owns hermes-agent's home-location family with its behaviour: the home (a per-context override,
then HERMES_HOME, then the platform default), the profile root, legacy-or-new subfolders, the
display form, the subprocess HOME policy. Never creates a folder (bar `secure_parent_dir`'s chmod)
nor touches a database. Holds only names hermes-agent's own hermes_constants.py also has, so both
run side by side.
"""

import contextlib
import contextvars
import os
import stat
import sys
from pathlib import Path

# A ContextVar, not os.environ: a test or a multi-profile server can point one thread or task at
# another home without changing it for everybody else.
_home_override = contextvars.ContextVar("hermes_home_override", default=None)


def set_hermes_home_override(path):
    """Use `path` as the home in the current context (None clears it); returns a token for reset."""
    return _home_override.set(None if path is None else str(path))


def reset_hermes_home_override(token):
    """Undo the `set_hermes_home_override` call that returned `token`."""
    _home_override.reset(token)


def get_hermes_home_override():
    """The current context's override as text, or None when there is none."""
    return _home_override.get() or None


def _platform_default_home():
    if sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA", "").strip()
        return (Path(local) if local else Path.home() / "AppData" / "Local") / "hermes"
    return Path.home() / ".hermes"


def get_process_hermes_home():
    """The home the process was launched with: HERMES_HOME, else the platform default (no
    override)."""
    env = os.environ.get("HERMES_HOME", "").strip()
    return Path(env) if env else _platform_default_home()


def get_hermes_home():
    """The home folder: the context override, else HERMES_HOME, else the platform default."""
    override = get_hermes_home_override()
    return Path(override) if override else get_process_hermes_home()


def get_config_path():
    """`<home>/config.yaml`."""
    return get_hermes_home() / "config.yaml"


def get_env_path():
    """`<home>/.env`."""
    return get_hermes_home() / ".env"


def hermes_home_key(path=None):
    """A stable text key for a home (default: the current one): absolute, resolved, case-folded
    where the OS folds."""
    candidate = Path(path) if path is not None else get_hermes_home()
    return os.path.normcase(str(candidate.expanduser().resolve(strict=False)))


def get_default_hermes_root():
    """The folder holding every profile: the platform default when HERMES_HOME is unset or under
    it; `<root>` when HERMES_HOME is `<root>/profiles/<name>` elsewhere (a container); else
    HERMES_HOME."""
    native, env = _platform_default_home(), os.environ.get("HERMES_HOME", "")
    if not env:
        return native
    env_path = Path(env)
    try:
        env_path.resolve().relative_to(native.resolve())
        return native
    except ValueError:
        return env_path.parent.parent if env_path.parent.name == "profiles" else env_path


def _has_content(path):
    """False for a missing path, a dangling link or an empty folder; True otherwise, also when it
    cannot be inspected (legacy data is never orphaned on a guess)."""
    try:
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            mode = path.stat().st_mode
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        return not stat.S_ISDIR(mode) or next(path.iterdir(), None) is not None
    except OSError:
        return True


def get_hermes_dir(new_subpath, old_name, *, home=None):
    """`<home>/<old_name>` when that legacy path holds something, else `<home>/<new_subpath>`."""
    home = home or get_hermes_home()
    return home / old_name if _has_content(home / old_name) else home / new_subpath


def display_hermes_home():
    """The home for messages to people: `~/...` when it is under the user's home folder."""
    home = get_hermes_home()
    try:
        return "~/" + str(home.relative_to(Path.home()))
    except ValueError:
        return str(home)


def secure_parent_dir(path):
    """chmod 0700 the folder holding `path`, unless it is `/` or a top-level folder; errors
    ignored."""
    parent = Path(path).parent.resolve()
    if len(parent.parts) >= 3:
        with contextlib.suppress(OSError):
            os.chmod(parent, 0o700)


# -- HOME for the programs the agent starts -----------------------------------------

def _same_path(a, b):
    def norm(p):
        p = (p or "").strip()
        return os.path.normcase(os.path.abspath(os.path.expanduser(p))) if p else ""
    return bool(a and b) and norm(a) == norm(b)


def _profile_home(env):
    """`<HERMES_HOME>/home` when that folder exists, else None."""
    home = get_hermes_home_override() or (env or {}).get("HERMES_HOME") or os.getenv("HERMES_HOME")
    candidate = os.path.join(home, "home") if home else None
    return candidate if candidate and os.path.isdir(candidate) else None


def _env(env, name):
    return str(env.get(name) or os.getenv(name, "")).strip()


def get_real_home(env=None):
    """The OS user's own home folder, never the profile's `<HERMES_HOME>/home`; "/tmp" when none
    is found."""
    env = env or {}
    candidates = [_env(env, "HERMES_REAL_HOME"), _env(env, "HOME")]
    with contextlib.suppress(ImportError, KeyError, OSError):
        import pwd
        candidates.append(pwd.getpwuid(os.getuid()).pw_dir.strip())
    candidates.append(_env(env, "USERPROFILE"))
    drive, tail = _env(env, "HOMEDRIVE"), _env(env, "HOMEPATH")
    if drive and tail:
        candidates.append(
            drive + tail if tail.startswith(("\\", "/")) else os.path.join(drive, tail))
    expanded = os.path.expanduser("~")
    candidates.append("" if expanded == "~" else expanded)
    profile = _profile_home(env)
    return next((c for c in candidates if c and not _same_path(c, profile)), "/tmp")


def _in_container():
    if os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv") \
            or os.environ.get("KUBERNETES_SERVICE_HOST"):
        return True
    markers = ("docker", "podman", "/lxc/", "kubepods", "containerd", "crio")
    for proc_file in ("/proc/1/cgroup", "/proc/self/mountinfo"):
        with contextlib.suppress(OSError), \
                open(proc_file, encoding="utf-8", errors="replace") as handle:
            if any(marker in handle.read() for marker in markers):
                return True
    return False


def get_subprocess_home(env=None):
    """The HOME a child process should get, or None to leave HOME alone.

    TERMINAL_HOME_MODE picks it: `profile` is `<HERMES_HOME>/home`, `real` the OS user's home;
    `auto` (default) the profile home in a container, and the real home when HOME already points
    at the profile home."""
    env = env or {}
    mode = (_env(env, "TERMINAL_HOME_MODE") or "auto").lower()
    mode = {
        "isolated": "profile", "profile_home": "profile", "profile-home": "profile",
        "host": "real", "user": "real", "real_home": "real", "real-home": "real",
    }.get(mode, mode)
    profile = _profile_home(env)
    if mode == "profile":
        return profile
    real, current = get_real_home(env), _env(env, "HOME")
    if mode != "real":
        if profile and _in_container():
            return profile
        if not _same_path(current, profile):
            return None
    return None if _same_path(real, current) else real


def apply_subprocess_home_env(env):
    """Set HERMES_REAL_HOME and, when the policy says so, HOME in the dict `env`."""
    real = get_real_home(env)
    if real:
        env["HERMES_REAL_HOME"] = real
    home = get_subprocess_home(env)
    if home:
        env["HOME"] = home
