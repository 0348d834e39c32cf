"""Journal mode and file checks for hermes-agent's other SQLite databases.

hermes-agent opens kanban.db, the cron, response and memory stores and its own tables in state.db
with plain sqlite3 connections and asks here for their journal mode (`apply_wal_with_fallback`),
tuning pragmas (`apply_database_pragmas`) and whether their files are writable
(`preflight_db_writability`). Those connections never take our writer lock, so with SQLite's
WAL-reset bug a file not yet in WAL stays out of it; one in WAL is never switched back, as other
processes may hold it open (docs/journal-policy.md). Owns no table and no connection: sets pragmas
on the connection it is handed, and only stats and chmods files (never opens one, see "Locks we
never break"). SessionDB's own policy is in hermes_state.
"""

import contextlib
import logging
import os
import sqlite3
import stat
import sys
import threading
import time
from pathlib import Path

from hermes_constants import get_hermes_home
from hermes_state_common import (
    _WAL_INCOMPAT_MARKERS, hermes_agent_config_section, sqlite_has_wal_reset_bug,
)
from hermes_state_errors import WalUnsupportedError

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

_warned = set()
_warned_lock = threading.Lock()


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
    current = _current_mode(conn)
    if current == "wal":
        return _tune_wal(conn)
    asked_delete, has_bug = resolve_journal_mode() == "delete", sqlite_has_wal_reset_bug()
    if has_bug or asked_delete:
        return _rollback_journal(conn, current, db_label if has_bug else None, verify=asked_delete)
    try:
        mode = _journal_mode(conn, "WAL") or ""
    except sqlite3.OperationalError as exc:
        if not any(marker in str(exc).lower() for marker in _WAL_INCOMPAT_MARKERS) \
                or _current_mode(conn) in ("wal", None):
            raise
        if require_wal:
            raise WalUnsupportedError(str(exc)) from exc
        _warn_once(db_label, logging.ERROR,
                   f"WAL is not supported on this filesystem ({exc}); using a rollback "
                   "journal, which works there but lets a write block readers")
        _set_mode_no_wait(conn, "DELETE")
        return "delete"
    if mode == "wal":
        return _tune_wal(conn)
    # Some network filesystems refuse WAL without an error and keep the old mode.
    if require_wal:
        raise WalUnsupportedError(f"journal_mode=WAL was refused (the mode stayed {mode!r})")
    _warn_once(db_label, logging.ERROR,
               f"WAL was refused without an error (the mode stayed {mode!r})")
    return mode or "delete"


def apply_database_pragmas(conn, *, db_label="state.db"):
    """Apply CONFIG_PRAGMAS from the `database:` section of hermes-agent's config.yaml, skipping
    missing config, bad values and refused pragmas; returns None."""
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


def _set_mode_no_wait(conn, mode):
    """PRAGMA journal_mode=<mode> with busy_timeout 0, so another connection holding the file makes
    it fail at once instead of slipping between its transactions; returns the mode set ('' for
    none)."""
    previous = conn.execute("PRAGMA busy_timeout").fetchone()[0]
    conn.execute("PRAGMA busy_timeout=0")
    try:
        return _journal_mode(conn, mode, tries=1) or ""
    finally:
        conn.execute(f"PRAGMA busy_timeout={int(previous)}")


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
        mode = _set_mode_no_wait(conn, "DELETE")
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
    statements = [f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}"]
    if sys.platform == "darwin":
        statements += ["PRAGMA checkpoint_fullfsync=1", "PRAGMA synchronous=FULL"]
    for statement in statements:
        try:
            conn.execute(statement)
        except sqlite3.OperationalError as exc:
            logger.debug("%s not applied: %s", statement, exc)
    return "wal"


def _warn_reset_bug(db_label, action):
    if db_label is not None:
        _warn_once(db_label, logging.WARNING,
                   f"SQLite {sqlite3.sqlite_version} has the WAL-reset bug"
                   " (https://sqlite.org/wal.html#walresetbug; fixed in 3.51.3, 3.50.7 and 3.44.6),"
                   f" and this connection does not take hermes_state's writer lock: {action}")


def _warn_once(db_label, level, text):
    """Log `text` once per process, label and level: a database opened per operation must not
    flood logs."""
    with _warned_lock:
        if (db_label, level) in _warned:
            return
        _warned.add((db_label, level))
    logger.log(level, "%s: %s", db_label, text)


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
