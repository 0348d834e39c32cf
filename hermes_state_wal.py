"""Journal mode and file checks for hermes-agent's other SQLite databases.

hermes-agent opens kanban.db, the cron, response and memory stores and its own tables in state.db
with plain sqlite3 connections and asks here for their journal mode (`apply_wal_with_fallback`),
tuning pragmas (`apply_database_pragmas`) and whether their files are writable
(`preflight_db_writability`). Those connections never take our writer lock, so with SQLite's
WAL-reset bug a file not yet in WAL stays out of it; one in WAL is never switched back, as other
processes may hold it open (docs/journal-policy.md). Owns no table and no connection: sets pragmas
on the connection it is handed, and only stats and chmods files (never opens one, see "Locks we
never break"). SessionDB's own policy is in hermes_state. Also owns the facts `hermes doctor`
prints about the SQLite runtime (its WAL-reset bug, its source id, how to get a fixed one) and
whether a folder is on a cross-VM filesystem, where WAL is refused.
"""

import contextlib
import logging
import os
import re
import sqlite3
import stat
import sys
import threading
import time
from pathlib import Path

from hermes_constants import get_hermes_home
from hermes_state_common import (
    _WAL_INCOMPAT_MARKERS, hermes_agent_config, hermes_agent_config_section,
    sqlite_has_wal_reset_bug,
)
from hermes_state_errors import WalUnsupportedError
from hermes_state_repair import _write_barriers, apply_synchronous_setting

logger = logging.getLogger("hermes_state")

# A checkpoint truncates the WAL back to this, so one huge transaction does not leave a WAL of its
# size on disk for good.
WAL_SIZE_LIMIT_BYTES = 64 * 1024 * 1024
# The `database:` keys of hermes-agent's config.yaml applied as integer pragmas.
CONFIG_PRAGMAS = (
    "cache_size", "mmap_size", "temp_store", "wal_autocheckpoint", "journal_size_limit")
# A mode read that fails with a disk I/O error is retried: on some virtual disks it is transient.
MODE_READ_TRIES = 4
MODE_RETRY_PAUSE = 0.05
# Filesystems a container runtime (Docker Desktop, OrbStack, Podman, Lima) uses to share host
# folders with its VM: the -shm file's shared memory is not coherent across the VM boundary, and
# the damage WAL then takes is silent (zero-filled pages), so WAL is refused there before it
# starts (hermes-agent 0.22's _CROSS_VM_FSTYPES).
CROSS_VM_FSTYPES = frozenset({"virtiofs", "fuse.virtiofs", "9p", "9p2000", "9p2000.l", "9p2000.u"})

_warned = set()
_warned_lock = threading.Lock()
# resolved folder -> on a cross-VM filesystem; kept, as kanban.db opens a connection per operation
_cross_vm_folders = {}


def resolve_journal_mode():
    """'wal' or 'delete': HERMES_STATE_JOURNAL when set, else `database.journal_mode` of
    hermes-agent's config.yaml when hermes-agent is installed, else 'wal'."""
    raw = os.environ.get("HERMES_STATE_JOURNAL", "").strip().lower() or str(
        hermes_agent_config_section("database").get("journal_mode", "wal")).strip().lower()
    return raw if raw in ("wal", "delete") else "wal"


def apply_wal_with_fallback(conn, *, db_label="state.db", require_wal=False):
    """Set the journal mode of `conn`'s database; returns the mode now in force ('wal' or 'delete').

    WAL stays WAL. A runtime with the WAL-reset bug, or an operator asking for 'delete', gets a
    rollback journal; else WAL, or where the filesystem refuses it a rollback journal (logged once
    per `db_label`) or, with `require_wal`, WalUnsupportedError. A mode that cannot be read, or a
    file another connection holds, is left as it is. Raises sqlite3.OperationalError when an
    asked-for 'delete' cannot be verified, and for errors other than a refusal of WAL."""
    current, db_file = _current_mode(conn), _database_file(conn)
    cross_vm = bool(db_file) and _path_on_cross_vm_fs(db_file)
    if current == "wal":
        if cross_vm:  # never switched back under other processes; only the operator can
            _warn_once((db_label, db_file), "cross-vm-wal", logging.ERROR,
                       f"{db_file} is a WAL database on a cross-VM filesystem (virtiofs/9p), where"
                       " WAL can corrupt it silently; stop every Hermes process using it and run"
                       " `hermes sessions set-journal-mode delete`, or move it to a native volume")
        return _tune_wal(conn)
    asked_delete, has_bug = resolve_journal_mode() == "delete", sqlite_has_wal_reset_bug()
    if has_bug or asked_delete:
        return _rollback_journal(conn, current, db_label if has_bug else None, verify=asked_delete)
    if cross_vm:
        if require_wal:
            raise WalUnsupportedError("journal_mode=WAL refused: the database is on a cross-VM"
                                      " filesystem (virtiofs/9p), where WAL corrupts silently")
        _warn_once(db_label, "cross-vm", logging.WARNING,
                   "the database folder is on a cross-VM filesystem (virtiofs/9p: a Docker Desktop,"
                   " OrbStack or Podman bind mount), where WAL can corrupt it silently; using a"
                   " rollback journal. A native volume gets WAL back")
        return _set_journal_mode_no_wait(conn, "DELETE") or "delete"
    try:
        mode = _journal_mode(conn, "WAL") or ""
    except sqlite3.OperationalError as exc:
        if not any(marker in str(exc).lower() for marker in _WAL_INCOMPAT_MARKERS) \
                or _current_mode(conn) in ("wal", None):
            raise
        if require_wal:
            raise WalUnsupportedError(str(exc)) from exc
        _warn_once(db_label, "wal-refused", logging.ERROR,
                   f"WAL is not supported on this filesystem ({exc}); using a rollback "
                   "journal, which works there but lets a write block readers")
        _set_journal_mode_no_wait(conn, "DELETE")
        return "delete"
    if mode == "wal":
        return _tune_wal(conn)
    # Some network filesystems refuse WAL without an error and keep the old mode.
    if require_wal:
        raise WalUnsupportedError(f"journal_mode=WAL was refused (the mode stayed {mode!r})")
    _warn_once(db_label, "wal-refused", logging.ERROR,
               f"WAL was refused without an error (the mode stayed {mode!r})")
    return mode or "delete"


def apply_database_pragmas(conn, *, db_label="state.db"):
    """Apply CONFIG_PRAGMAS and then `synchronous` (a level name or 0-3, never below FULL on
    macOS) from the `database:` section of hermes-agent's config.yaml, skipping missing config,
    bad values and refused pragmas; returns None."""
    config = hermes_agent_config_section("database")
    for name in CONFIG_PRAGMAS:
        raw = config.get(name)
        if raw is None:
            continue
        try:
            conn.execute(f"PRAGMA {name}={int(str(raw).strip())}")
        except ValueError:
            logger.warning("%s: database.%s=%r is not an integer; ignored", db_label, name, raw)
        except sqlite3.Error as exc:
            logger.warning("%s: PRAGMA %s not applied: %s", db_label, name, exc)
    if config.get("synchronous") is not None:  # last: the sizes cannot change durability
        apply_synchronous_setting(conn, config["synchronous"], db_label=db_label)


def preflight_db_writability(db_path, *, db_label="state.db"):
    """Make the database, its -wal and -shm and their folder readable and writable before a
    connection opens; returns None (`:memory:` and `file:` URIs are skipped).

    Inside the hermes home a file gets `chmod u+rw` (a folder u+rwx); anything else, or a chmod that
    does not help, raises sqlite3.OperationalError naming the file and the fix. Never deletes or
    truncates a file (a -wal holds committed data)."""
    raw = str(db_path)
    if raw == ":memory:" or raw.startswith("file:"):
        return
    path = Path(raw)
    try:
        home = Path(get_hermes_home()).resolve()
    except Exception:  # no home: nothing is ours to repair
        home = None
    if path.parent.is_dir():
        _ensure_writable(path.parent, home, db_label, folder=True)
    for suffix in ("", "-wal", "-shm"):
        candidate = path.with_name(path.name + suffix)
        if candidate.is_file():
            _ensure_writable(candidate, home, db_label, folder=False)


def _journal_mode(conn, mode="", tries=3):
    """What PRAGMA journal_mode[=<mode>] answers, lower case, None for nothing. A disk I/O error
    (transient on some disks) is tried again, `tries` tries in all; other errors raise."""
    for attempt in range(tries):
        try:
            row = conn.execute("PRAGMA journal_mode" + (f"={mode}" if mode else "")).fetchone()
            break
        except sqlite3.OperationalError as exc:
            if "disk i/o error" not in str(exc).lower() or attempt == tries - 1:
                raise
            time.sleep(MODE_RETRY_PAUSE)
    value = row[0] if row else None
    value = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    return None if value is None else str(value).strip().lower()


def _current_mode(conn):
    """The database's journal mode, lower case; None when it cannot be read."""
    try:
        return _journal_mode(conn, tries=MODE_READ_TRIES)
    except sqlite3.OperationalError:
        return None


def _set_journal_mode_no_wait(conn, mode):
    """PRAGMA journal_mode=<mode> with busy_timeout 0, so another connection holding the file makes
    it fail at once (sqlite3.OperationalError 'database is locked': not owned alone, leave the mode
    alone) instead of slipping between its transactions; returns the mode set ('' for none).
    hermes-agent's `sessions set-journal-mode` switches a store with it."""
    previous = conn.execute("PRAGMA busy_timeout").fetchone()[0]
    conn.execute("PRAGMA busy_timeout=0")
    try:
        return _journal_mode(conn, mode, tries=1) or ""
    finally:
        with contextlib.suppress(sqlite3.OperationalError):
            conn.execute(f"PRAGMA busy_timeout={int(previous)}")


def _database_file(conn):
    """The file of `conn`'s main database; '' for an in-memory or temporary one."""
    try:
        row = conn.execute("PRAGMA database_list").fetchone()
    except sqlite3.Error:
        return ""
    return str(row[2]) if row and row[2] else ""


# -- the SQLite runtime and the filesystem, as `hermes doctor` reports them -----------------------

def is_sqlite_wal_reset_vulnerable(version_info=None):
    """True if this SQLite (or `version_info`, e.g. (3, 45, 1)) has the WAL-reset bug (3.7.0 to
    3.51.2; fixed in 3.51.3 and the 3.50.7 / 3.44.6 backports)."""
    if version_info is None:
        version_info = sqlite3.sqlite_version_info
    parts = [int(p) for p in version_info][:3]
    return sqlite_has_wal_reset_bug(tuple(parts + [0] * (3 - len(parts))))


def sqlite_source_id():
    """SQLite's `sqlite_source_id()`, the build date and check-in of the library in use; '' if it
    cannot be asked."""
    try:
        with contextlib.closing(sqlite3.connect(":memory:")) as conn:
            row = conn.execute("SELECT sqlite_source_id()").fetchone()
    except sqlite3.Error:
        return ""
    return str(row[0]) if row and row[0] is not None else ""


def _wal_reset_repair_hint():
    """How to get a SQLite without the WAL-reset bug, for hermes-agent's kind of install if it
    is one."""
    config = hermes_agent_config()
    try:
        method = config.detect_install_method(config.get_project_root())
        command = config.recommended_update_command_for_method(method)
    except Exception:  # outside hermes-agent (config is None) or an older one without these
        return ("install a Python build bundled with SQLite 3.51.3+ (or backports 3.50.7 / 3.44.6) "
                "and restart Hermes")
    if method in ("git", "unknown"):
        return f"Hermes-managed installs can repair the embedded runtime with `{command}`"
    if method == "docker":
        return f"update the container image with `{command}`"
    return command


def _path_on_cross_vm_fs(path):
    """True if the folder of `path` is on a cross-VM filesystem (CROSS_VM_FSTYPES), by
    /proc/self/mountinfo; False elsewhere or when the mount table cannot be read. Kept per
    folder."""
    try:
        folder = os.path.dirname(os.path.realpath(path)) or "/"
    except (OSError, ValueError):
        return False
    if folder not in _cross_vm_folders:
        if not sys.platform.startswith("linux"):
            return False
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as handle:
                mounts = handle.read()
        except OSError:
            return False
        _cross_vm_folders[folder] = _mount_fstype(folder, mounts) in CROSS_VM_FSTYPES
    return _cross_vm_folders[folder]


def _mount_fstype(folder, mountinfo):
    """The filesystem type of the mount holding `folder` (the longest mount point above it) in
    /proc/self/mountinfo text `mountinfo`, lower case; '' if none matches."""
    best, fstype = -1, ""
    for line in mountinfo.splitlines():
        # proc(5): id parent maj:min root mount-point options [optional fields...] - type source ...
        fields, _, tail = line.partition(" - ")
        fields = fields.split()
        if len(fields) < 5 or not tail.split():
            continue
        # Spaces and the like in a mount point are octal escapes ("\040").
        point = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[4])
        inside = folder == point or folder.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, fstype = len(point), tail.split()[0].lower()
    return fstype


def _rollback_journal(conn, current, bug_label, verify):
    """A rollback journal, unless the mode cannot be read (reported as WAL, which it may be) or
    another connection holds the file: the mode then stays, or with `verify` (the operator asked) it
    raises. `bug_label` names the database in the WAL-reset-bug warning; None warns not."""
    if current is None:
        if verify:
            raise sqlite3.OperationalError(
                "journal_mode=delete was asked for but the current mode cannot be read (the"
                " database is locked; another process may hold it in WAL); the journal mode was"
                " left as it is")
        _warn_reset_bug(bug_label, "its journal mode cannot be read, so it is left as it is")
        return "wal"
    try:
        mode = _set_journal_mode_no_wait(conn, "DELETE")
    except sqlite3.OperationalError as exc:
        if verify:
            raise
        if "locked" in str(exc).lower() or "busy" in str(exc).lower():
            _warn_reset_bug(bug_label,
                            "another connection holds it, so its journal mode is left as it is")
            return current
        mode = "delete"
    if verify and mode != "delete":
        raise sqlite3.OperationalError(
            f"journal_mode=delete was asked for but SQLite set {mode or 'nothing'!r}")
    _warn_reset_bug(bug_label, "it uses a rollback journal instead of WAL")
    return "delete"


def _tune_wal(conn):
    """'wal', after a bounded WAL and on macOS real write barriers (its fsync does not order writes
    unless asked to), best effort."""
    try:
        conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
    except sqlite3.OperationalError as exc:
        logger.debug("journal_size_limit not applied: %s", exc)
    _write_barriers(conn)
    return "wal"


def _warn_reset_bug(db_label, action):
    if db_label is not None:
        _warn_once(db_label, "reset-bug", logging.WARNING,
                   f"SQLite {sqlite3.sqlite_version} has the WAL-reset bug"
                   " (https://sqlite.org/wal.html#walresetbug; fixed in 3.51.3, 3.50.7 and 3.44.6),"
                   f" and this connection does not take hermes_state's writer lock: {action}")


def _warn_once(key, kind, level, text):
    """Log `text` once per process for `key` (a database label, or (label, path)) and `kind`: a
    database opened per operation must not flood logs."""
    with _warned_lock:
        if (key, kind) in _warned:
            return
        _warned.add((key, kind))
    logger.log(level, "%s: %s", key[0] if isinstance(key, tuple) else key, text)


def _ensure_writable(path, home, db_label, folder):
    if os.access(path, os.R_OK | os.W_OK):
        return
    if home is not None and _inside(path, home):
        with contextlib.suppress(OSError):
            os.chmod(path, path.stat().st_mode | stat.S_IRUSR | stat.S_IWUSR
                     | (stat.S_IXUSR if folder else 0))
        if os.access(path, os.R_OK | os.W_OK):
            logger.info("%s: made %s readable and writable for its owner", db_label, path)
            return
    keep_wal = (" Keep the -wal file: it holds committed data that goes into the database once it"
                " is writable." if path.name.endswith("-wal") else "")
    raise sqlite3.OperationalError(
        f"{db_label} is not writable: the {'folder' if folder else 'file'} {path} is read-only for"
        f" this user. Fix it with: chmod {'u+rwx' if folder else 'u+rw'} '{path}' (a file of"
        f" another user may need sudo or chown).{keep_wal}")


def _inside(path, home):
    with contextlib.suppress(OSError, ValueError):
        resolved = path.resolve()
        return resolved == home or home in resolved.parents
    return False
