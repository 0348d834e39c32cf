"""Which other processes hold a store's files open, and how to name them to an operator.

Owns the read-only open URI of a store, the scan of /proc/<pid>/fd for other processes holding the
store or its -wal/-shm (a deleted generation included), the one-line description of a holder pid
from its command line, and the refusal text maintenance commands print while the store is held.
hermes-agent imports these from here (`hermes doctor`, `hermes sessions optimize-storage` and
`set-journal-mode`, backups). The scan fails closed: a process it cannot inspect that looks like
hermes-agent, or a scan that cannot run at all (no /proc: macOS, Windows), is reported as an
unknown holder (pid -1), never as "no holder". Reads /proc and stats files only: never opens a
store file, so it cannot drop this process's locks on it; never composes SessionDB.
"""

import errno
import logging
import os
import sys
from pathlib import Path

from hermes_constants import get_hermes_home
from hermes_state_errors import STORAGE_RECOVERY_DOCS_URL

logger = logging.getLogger("hermes_state")

# Python's command-line options that take the next argument as their operand (so that argument is
# not the script): hermes-agent's gateway status check reads these two sets from here.
_PYTHON_SHORT_OPTIONS_WITH_OPERANDS = frozenset({"Q", "W", "X"})
_PYTHON_LONG_OPTIONS_WITH_OPERANDS = frozenset({"--check-hash-based-pycs", "--jit"})
# What a hermes-agent process runs, for telling its uninspectable processes from anyone else's.
_HERMES_PROGRAMS = frozenset({"hermes", "hermes-agent", "hermes-acp"})
_HERMES_MODULES = frozenset({"acp_adapter", "hermes_cli.main"})
_HERMES_SCRIPTS = ("hermes_cli/main.py", "run_agent.py")
_STORE_FILE_NAMES = ("state.db", "state.db-wal", "state.db-shm")
_DELETED = " (deleted)"  # what Linux appends to the fd target of an unlinked file


def read_only_db_uri(db_path):
    """The `file:` URI that opens `db_path` read-only (never creating it); `?` and `#` in the path
    are percent-encoded, where a hand-made `file:{path}?mode=ro` would cut the path there."""
    return Path(db_path).resolve().as_uri() + "?mode=ro"


def _store_family(path):
    return (path, path + "-wal", path + "-shm")


def canonical_sqlite_path(path):
    """A /proc fd target or a path, absolute and case-normalised, without Linux's " (deleted)"."""
    path = str(path)
    if path.endswith(_DELETED):
        path = path[:-len(_DELETED)]
    return os.path.normcase(os.path.abspath(path))


# -- naming a process -------------------------------------------------------------------------

def _proc_argv(pid):
    """Process `pid`'s arguments from /proc/<pid>/cmdline; None if unreadable or empty (a kernel
    thread, a zombie, or no /proc)."""
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as handle:
            raw = handle.read()
    except (OSError, ValueError):
        return None
    argv = raw.decode("utf-8", "replace").split("\x00")
    if argv and argv[-1] == "":
        argv.pop()
    return argv or None


def describe_holder_pid(pid):
    """'PID 123 (hermes gateway run)': the program's base name and its arguments, whitespace
    collapsed, at most 80 characters; '(command line unavailable)' when it cannot be read."""
    argv = _proc_argv(pid)
    if argv:
        who = " ".join(" ".join([os.path.basename(argv[0])] + argv[1:]).split())[:80]
    else:
        who = "command line unavailable"
    return f"PID {pid} ({who})"


def _python_target(argv):
    """('module', name) or ('script', path) that a python command line runs; None for `-c` or
    none."""
    index = 1
    while index < len(argv):
        arg = argv[index]
        if arg == "--":
            return ("script", argv[index + 1]) if index + 1 < len(argv) else None
        if arg in _PYTHON_LONG_OPTIONS_WITH_OPERANDS:
            index += 2
        elif arg.startswith("--"):
            index += 1
        elif arg.startswith("-") and arg != "-":
            step = 1
            for position, letter in enumerate(arg[1:], start=2):
                rest = arg[position:]
                if letter == "c":
                    return None
                if letter == "m":
                    name = rest or (argv[index + 1] if index + 1 < len(argv) else None)
                    return None if name is None else ("module", name)
                if letter in _PYTHON_SHORT_OPTIONS_WITH_OPERANDS:
                    step = 1 if rest else 2
                    break
            index += step
        else:
            return ("script", arg)
    return None


def _looks_like_hermes(argv):
    """True if a command line runs hermes-agent: its programs, or python on its module or script."""
    program = os.path.basename(argv[0]).lower()
    program = program[:-4] if program.endswith(".exe") else program
    if program in _HERMES_PROGRAMS:
        return True
    flavour = next((p for p in ("python", "pypy") if program.startswith(p)), None)
    if flavour is None or not all(c.isdigit() or c == "." for c in program[len(flavour):]):
        return False
    target = _python_target(argv)
    if target is None:
        return False
    kind, value = target
    value = value.lower().replace("\\", "/")
    if kind == "module":
        return value in _HERMES_MODULES
    return any(value == script or value.endswith("/" + script) for script in _HERMES_SCRIPTS)


def _serves_another_home(argv, db_path):
    """True when a command line proves its process works on another hermes home than the one
    holding `db_path`: it does not name this store, and its --hermes-home / HERMES_HOME= names
    another home, or its path arguments name another home or store and none names this one.
    Anything less stays a suspect."""
    store = os.path.normcase(os.path.abspath(db_path))
    home = os.path.dirname(store)
    paths = [os.path.normcase(os.path.normpath(value)) for value in (
        token.split("=", 1)[1] if token.startswith("-") and "=" in token else token
        for token in argv[1:]) if value.startswith("/")]  # argv[0] locates the install, not a home
    if any(path in _store_family(store) for path in paths):
        return False  # it names this very store
    chosen = None
    for index, token in enumerate(argv):
        if token == "--hermes-home" and index + 1 < len(argv):
            chosen = argv[index + 1]
        elif token.startswith(("--hermes-home=", "HERMES_HOME=")):
            chosen = token.split("=", 1)[1]
    if chosen:
        return os.path.normcase(os.path.normpath(chosen)) != home
    other = False
    for path in paths:
        if path == home or path.startswith(home + os.sep):
            return False
        other = other or "/.hermes" in path or os.path.basename(path) in _STORE_FILE_NAMES
    return other


# -- the scan -------------------------------------------------------------------------------------

def foreign_state_db_holders(db_path):
    """[(pid, what it holds)] for every other process with `db_path`, its -wal or -shm open (an
    unlinked generation of them included); [] when none. Fails closed: a suspect process that
    cannot be inspected is listed as (pid, 'uninspectable ...'), and a scan that fails or cannot
    run on this platform as (-1, the reason)."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc/self/fd"):
        return [(-1, "open-file scan unavailable on this platform")]
    # realpath: /proc shows the kernel's resolved path, so a symlinked home must not hide holders.
    base = os.path.realpath(os.fspath(db_path))
    watched = {canonical_sqlite_path(path) for path in _store_family(base)}
    holders, identities, store_dev = [], set(), None
    for path in _store_family(base):
        try:
            found = os.stat(path)
        except OSError as exc:
            if not _gone(exc):
                holders.append((-1, f"watched-file stat failed: {path}: {exc}"))
            continue
        identities.add((found.st_dev, found.st_ino))
        store_dev = found.st_dev if path == base else store_dev
    try:
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != os.getpid():
                holders += _holdings_of(int(name), db_path, watched, identities, store_dev)
    except Exception as exc:
        logger.warning("could not prove %s has no other holders: %s", base, exc)
        holders.append((-1, f"open-file scan failed: {exc}"))
    return holders


def _holdings_of(pid, db_path, watched, identities, store_dev):
    """What process `pid` holds of the watched files, from its /proc fd links."""
    try:
        descriptors = open_descriptors(pid)
    except OSError as exc:
        if _gone(exc):
            return []
        command = " ".join(_proc_argv(pid) or ())[:80]
        return _suspect(pid, db_path, f"uninspectable holder: {command}")
    found = []
    for link, target in descriptors:
        try:
            if isinstance(target, OSError):
                raise target
            stat = os.stat(link)
        except OSError as exc:
            if not _gone(exc):
                found += _suspect(pid, db_path, f"uninspectable descriptor: {link}: {exc}")
            continue
        named = canonical_sqlite_path(target) in watched
        if (stat.st_dev, stat.st_ino) in identities or (
                named and target.endswith(_DELETED) and stat.st_dev == store_dev):
            found.append((pid, target))
    return found


def open_descriptors(pid):
    """[(/proc/<pid>/fd/<n>, its target)] for process `pid` ('self' for this one); a target that
    cannot be read is the OSError instead. Raises OSError when the fd folder cannot be listed
    (another user's process; an exited one, where _gone(error) is true)."""
    folder = f"/proc/{pid}/fd"
    found = []
    for fd in os.listdir(folder):
        link = f"{folder}/{fd}"
        try:
            found.append((link, os.readlink(link)))
        except OSError as exc:
            if not _gone(exc):  # else closed meanwhile
                found.append((link, exc))
    return found


def _gone(exc):
    """True for the errors of a descriptor closed, or a process ended, while /proc was read."""
    return exc.errno in (errno.ENOENT, errno.ESRCH)


def _suspect(pid, db_path, what):
    """[(pid, what)] if `pid` runs hermes-agent for this store's home as far as its command line
    tells; [] for another program or another home."""
    argv = _proc_argv(pid)
    if argv and _looks_like_hermes(argv) and not _serves_another_home(argv, db_path):
        return [(pid, what)]
    return []


def held_store_refusal(db_path, *, command, force_hint="--force"):
    """The text `hermes sessions <command>` prints instead of rewriting a store other processes
    hold (each holder named, an incomplete scan said so, `force_hint` offered unless None or
    empty); None when no other process holds it."""
    holders = foreign_state_db_holders(db_path)
    if not holders:
        return None
    files, unknown = {}, []
    for pid, target in holders:
        if pid <= 0 or target.startswith("uninspectable"):
            unknown.append(target)
        else:
            name = Path(target[:-len(_DELETED)] if target.endswith(_DELETED) else target).name
            files.setdefault(pid, set()).add(name)
    lines = [f"Refusing `hermes sessions {command}`: another process is using {db_path}."]
    lines += [f"  {describe_holder_pid(pid)}: {', '.join(sorted(files[pid]))}"
              for pid in sorted(files)]
    if unknown:
        lines.append("  cannot prove the database is quiet (holder scan incomplete: "
                     f"{unknown[0][:120]})")
    lines += [
        "Rewriting the database under a live writer is how every agent ends up refusing turns with"
        " the retired state.db-wal error. Nothing is lost.",
        f"Stop them first (`hermes {_profile_selector()}gateway stop`, quit the Desktop app, pause"
        " cron), then re-run.",
    ]
    if force_hint:
        lines.append(f"Override with {force_hint} if you accept the risk.")
    lines.append(f"Recovery guide: {STORAGE_RECOVERY_DOCS_URL}")
    return "\n".join(lines)


def _profile_selector():
    """'-p <name> ' when this process runs a named profile's home (`<root>/profiles/<name>`, as
    hermes-agent 0.22's profile_cli_selector says it), so the advice names the right store; else
    ''."""
    try:
        home = Path(get_hermes_home())
    except Exception:  # no home to name: the plain command still works
        return ""
    named = home.parent.name == "profiles" and not home.name.startswith(".")
    return f"-p {home.name} " if named and home.name != "default" else ""
