"""Where the Hermes home is, and the well-known paths inside it.

Owns hermes-agent's home-location family with its behaviour: the home (a per-context override,
then HERMES_HOME, then the platform default), the profile root and the named profiles under it
(`<root>/profiles/<name>`, a deleted one tombstoned in `<root>/profiles/.deleted/<name>`), the
process's own home and the pin an embedding host puts on it, legacy-or-new subfolders, the display
form, the subprocess HOME policy. Creates a folder only in `mkdir_under_hermes_home` (and chmods
one in `secure_parent_dir`); never touches a database. Holds only names hermes-agent's own
hermes_constants.py also has, so both run side by side.
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


def _expand(path):
    """A home as written (HERMES_HOME, an override, a pin) with `$VARS` and `~` expanded."""
    return Path(os.path.expanduser(os.path.expandvars(str(path))))


def _platform_default_home():
    # HERMES_DATA_DIR_SUFFIX is appended to the folder name as it is (`~/.hermes-dev`).
    name = "hermes" if sys.platform == "win32" else ".hermes"
    name += os.environ.get("HERMES_DATA_DIR_SUFFIX", "")
    if sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA", "").strip()
        return (Path(local) if local else Path.home() / "AppData" / "Local") / name
    return Path.home() / name


def sudo_invoker_default_home():
    """`~/.hermes` of the user who ran `sudo` when this process is root under it, else None: sudo
    drops HERMES_HOME and sets HOME to root's, yet the profiles operated on are that user's."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    user = os.environ.get("SUDO_USER", "").strip()
    if not user or user == "root":
        return None
    import pwd
    try:
        return Path(pwd.getpwnam(user).pw_dir) / ".hermes"
    except KeyError:  # a user the passwd file does not know (a chroot, a container)
        return None


def get_process_hermes_home():
    """The home the process was launched with: HERMES_HOME, else the platform default (no
    override)."""
    env = os.environ.get("HERMES_HOME", "").strip()
    return _expand(env) if env else _platform_default_home()


def get_hermes_home():
    """The home folder: the context override, else HERMES_HOME, else the platform default."""
    override = get_hermes_home_override()
    return _expand(override) if override else get_process_hermes_home()


# The home an embedding host serves as the process's own profile while it mirrors each turn's
# profile into HERMES_HOME for older readers; None: the process's own is HERMES_HOME's.
_pinned_process_home = None


def pin_process_hermes_home(path):
    """Name the home this process serves as its own profile (None clears the pin), for deciding
    whether a task runs for another, routed profile. Process-wide, and apart from
    get_process_hermes_home, which keeps following HERMES_HOME."""
    global _pinned_process_home
    _pinned_process_home = None if path is None else str(path)


def process_hermes_home_is_pinned():
    """True while a pin_process_hermes_home pin is set."""
    return _pinned_process_home is not None


def get_routing_process_hermes_home():
    """The process's own home for routed-profile decisions: the pinned home, else
    get_process_hermes_home()."""
    pinned = _pinned_process_home
    return _expand(pinned) if pinned else get_process_hermes_home()


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


def get_default_hermes_root(*, home=None):
    """The folder holding every profile, for `home` (default: HERMES_HOME): the platform default
    when the home is unset or under it; `<root>` when it is `<root>/profiles/<name>` elsewhere (a
    container); else the home itself."""
    native = _platform_default_home()
    given = (str(home) if home is not None else os.environ.get("HERMES_HOME", "")).strip()
    if not given:
        return native
    path = _expand(given)
    try:
        path.resolve().relative_to(native.resolve())
        return native
    except ValueError:
        return path.parent.parent if path.parent.name == "profiles" else path


# -- Named profiles: <root>/profiles/<name> ---------------------------------------
# Files only a real home holds: a folder that merely has a `profiles` part in its path lacks them.
_HOME_MARKERS = ("config.yaml", ".env", "state.db")
# Beside the profiles, not in them: a stray mkdir or rmtree of a profile cannot erase its tombstone.
_DELETED_DIR = ".deleted"


def _is_profiles_root(profiles):
    """True when the folder `profiles` is surely `<a Hermes home>/profiles`: the classic
    `.hermes` root, a root holding a home's files, a tombstone folder (only a profile deletion
    makes one), or the profile root of this process."""
    root = profiles.parent
    if root.name == ".hermes":
        return True
    with contextlib.suppress(OSError):
        if (profiles / _DELETED_DIR).is_dir() or any((root / m).exists() for m in _HOME_MARKERS):
            return True
    try:
        return root.resolve(strict=False) == get_default_hermes_root().resolve(strict=False)
    except OSError:
        return False


def named_profile_home(path):
    """The `<root>/profiles/<name>` folder that `path` is or lies in, else None (also for a name
    starting with a dot, and inside a default `.hermes` home)."""
    current = Path(path)
    for candidate in (current, *current.parents):
        if candidate.parent.name == "profiles" and not candidate.name.startswith(".") \
                and _is_profiles_root(candidate.parent):
            return candidate
        if candidate.name == ".hermes":
            return None
    return None


def profile_name_for_home(path):
    """The profile owning the home `path`: "default" for the profile root itself, a named
    profile's name, else None (also for an empty path)."""
    if path is None or not str(path).strip():
        return None
    given = Path(path).expanduser()
    try:
        root = get_default_hermes_root()
        for candidate in (given, given.resolve(strict=False)):
            if candidate in (root, root.resolve(strict=False)):
                return "default"
            named = named_profile_home(candidate)
            if named is not None:
                return named.name
            # A home its owner already resolved names its profile by shape, markers or not.
            if candidate.parent.name == "profiles" and not candidate.name.startswith("."):
                return candidate.name
    except (OSError, RuntimeError, ValueError):
        return None
    return None


def assert_named_profile_home_live(path):
    """Raise FileNotFoundError when `path` lies in a named profile that is missing or deleted."""
    home = named_profile_home(path)
    if home is not None and ((home.parent / _DELETED_DIR / home.name).exists()
                             or not home.exists()):
        raise FileNotFoundError(f"Named profile home does not exist: {home}. "
                                "Create the profile explicitly before using it.")


def mkdir_under_hermes_home(path):
    """Create the folder `path` (and its parents) and return it as a Path; a path in a missing or
    deleted named profile raises FileNotFoundError instead of bringing the profile back."""
    target = Path(path)
    assert_named_profile_home_live(target)
    target.mkdir(parents=True, exist_ok=True)
    return target


def profile_cli_selector():
    """`-p <name> ` (trailing space) for the current home's named profile, so that a `hermes ...`
    command shown to the user reaches the same store; "" for the default profile or a home
    outside the profile tree."""
    name = profile_name_for_home(get_hermes_home())
    return f"-p {name} " if name and name != "default" else ""


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


def display_hermes_home(home=None):
    """A home (default: the current one) for messages to people: `~/...` with forward slashes
    when it is under the user's home folder."""
    home = get_hermes_home() if home is None else Path(home)
    try:
        return "~/" + home.relative_to(Path.home()).as_posix()
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
