"""Journal modes: SessionDB's policy and checkpoints, and hermes-agent's other SQLite databases.

SessionDB's journal follows hermes-agent 0.22's rule (`choose_journal_policy`,
docs/journal-policy.md): a rollback journal on a SQLite with the WAL-reset race and on a cross-VM
filesystem, WAL elsewhere; `SessionJournalMixin` applies it at open, switching a store out of WAL
only when no other connection holds it, and runs our checkpoints (after commits, on the
`BackgroundCheckpointer` thread once the writer is quiet, at open and close) so the main file alone
is current. It never opens a connection of its own but the checkpointer's, and takes our locks
only as the write path does.

hermes-agent opens kanban.db, the cron, response and memory stores and its own tables in state.db
with plain sqlite3 connections and asks here for their journal mode (`apply_wal_with_fallback`),
tuning pragmas (`apply_database_pragmas`) and whether their files are writable
(`preflight_db_writability`). Those connections never take our writer lock, so with SQLite's
WAL-reset bug a file not yet in WAL stays out of it; one in WAL is never switched back, as other
processes may hold it open (docs/journal-policy.md). For them it owns no table and no connection:
sets pragmas on the connection it is handed, and only stats and chmods files (never opens one, see
"Locks we never break"). Also owns the facts `hermes doctor`
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
import weakref
from collections import namedtuple
from pathlib import Path

from hermes_constants import get_hermes_home
from hermes_state_common import (
    _WAL_INCOMPAT_MARKERS, JOURNAL_MODE_SQL, hermes_agent_config, hermes_agent_config_section,
    sqlite_has_wal_reset_bug,
)
from hermes_state_errors import WalUnsupportedError
from hermes_state_lockguard import WRITER_BUSY_TIMEOUT, _release, _set_busy_timeout
from hermes_state_repair import _write_barriers, apply_synchronous_setting
from hermes_state_schema import is_lock_error

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

# What a store on such a filesystem is told once per process (SessionDB's open, and a connection
# hermes-agent hands apply_wal_with_fallback): hermes-agent 0.22's refusal, in our words.
CROSS_VM_REFUSAL = (
    "the database folder is on a cross-VM filesystem (virtiofs/9p, as Docker Desktop, OrbStack and"
    " Podman share host folders), where WAL's shared memory is not coherent across the VM boundary"
    " and can corrupt the database silently; journal_mode=DELETE is used instead. Move the"
    " database to a native volume (e.g. a named Docker volume) to get WAL back")
# What a filesystem that refuses WAL (NFS, SMB/CIFS, some FUSE) gets instead, logged once.
WAL_REFUSED = ("WAL is not supported on this filesystem ({}); falling back to journal_mode=DELETE,"
               " a rollback journal that works on NFS/SMB/FUSE but lets a write block readers")

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
        _warn_once(db_label, "cross-vm", logging.WARNING, CROSS_VM_REFUSAL)
        return _set_journal_mode_no_wait(conn, "DELETE") or "delete"
    try:
        mode = _journal_mode(conn, "WAL") or ""
    except sqlite3.OperationalError as exc:
        if not any(marker in str(exc).lower() for marker in _WAL_INCOMPAT_MARKERS) \
                or _current_mode(conn) in ("wal", None):
            raise
        if require_wal:
            raise WalUnsupportedError(str(exc)) from exc
        _warn_once(db_label, "wal-refused", logging.ERROR, WAL_REFUSED.format(exc))
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


# -- SessionDB's journal policy and checkpoints ----------------------------------------------------

# In WAL, a PASSIVE checkpoint of ours runs every this many commits of one connection (hermes-agent
# 0.22's _CHECKPOINT_EVERY_N_WRITES), after any transaction that changed this many rows (each copies
# one chunk's pages, and close finds little left: 1.4 s after an unchunked 1M prune), once the
# writer has been quiet for IDLE_CHECKPOINT_DELAY s, after the open and at close: a reader of the
# main file alone (immutable=1, a copy of state.db without its -wal) then sees every commit of an
# idle writer. The checkpointer thread retires after CHECKPOINTER_RETIRE_AFTER s with nothing to do.
CHECKPOINT_EVERY_COMMITS = 50
CHECKPOINT_AFTER_CHANGES = 1000
IDLE_CHECKPOINT_DELAY = 1.0
CHECKPOINTER_RETIRE_AFTER = 30.0

def writer_synchronous(mode):
    """The `PRAGMA synchronous` level of SessionDB's writer in journal `mode`: FULL in WAL, EXTRA
    in a rollback journal. Chosen by `make test-faults`' power cuts (docs/faults.md): in WAL,
    NORMAL syncs the WAL only at a checkpoint, and a cut lost up to 182 calls the API had
    acknowledged, FULL none; in a rollback journal the commit is the -journal's unlink, which
    FULL leaves unsynced (a cut lost the last commit in 46 of 100 cuts) and EXTRA syncs with its
    folder (none lost). NORMAL would risk the file itself there (sqlite.org/pragma.html). The
    price, per transcript write on this disk (faults/sync_cost.py): see docs/faults.md."""
    return "FULL" if mode == "wal" else "EXTRA"


# Every write of ours takes state.db.lock on every policy (one discipline on every runtime:
# SessionDB._lock serialises hermes-agent's SQL across processes only if our own writes queue on
# that lock too); the policy picks the journal and who checkpoints.
JournalPolicy = namedtuple("JournalPolicy", "mode autocheckpoint reason checkpoint")
_CROSS_VM = "a cross-VM filesystem (virtiofs/9p), where WAL corrupts silently"


def choose_journal_policy(version=sqlite3.sqlite_version_info, override=None, checkpoint=None,
                          cross_vm=False):
    """The journal mode, who checkpoints and why (docs/journal-policy.md), as hermes-agent 0.22
    chooses: a rollback journal on a runtime with the WAL-reset bug and on a cross-VM filesystem
    (`cross_vm`), else WAL. Who checkpoints is "locked" (only we, under state.db.lock), "automatic"
    (SQLite, and we under the lock), "external" (a replicator, never we) or "none" (rollback
    journal). ValueError names the variable for a bad or impossible override."""
    env = os.environ.get
    if override is None:
        override = env("HERMES_STATE_JOURNAL", "")
    if checkpoint is None:
        checkpoint = env("HERMES_STATE_CHECKPOINT", "")
    override, wanted = override.strip().lower(), checkpoint.strip().lower()
    if wanted not in ("", "auto", "external"):
        raise ValueError(f"HERMES_STATE_CHECKPOINT must be 'auto' or 'external', not {wanted!r}")
    if override not in ("", "wal", "delete"):
        raise ValueError(f"HERMES_STATE_JOURNAL must be 'wal' or 'delete', not {override!r}")
    label = "SQLite " + ".".join(map(str, version[:3]))
    if wanted == "external" and (override == "delete" or cross_vm):
        raise ValueError("HERMES_STATE_CHECKPOINT=external keeps WAL; it cannot go with "
                         + ("HERMES_STATE_JOURNAL=delete" if override == "delete" else
                            f"a store on {_CROSS_VM}"))
    if override == "delete":
        return JournalPolicy(
            "delete", None, "HERMES_STATE_JOURNAL=delete: rollback journal", "none")
    if cross_vm:  # an asked-for WAL too, as hermes-agent 0.22 refuses it there
        return JournalPolicy("delete", None, f"the store is on {_CROSS_VM}: rollback journal",
                             "none")
    if wanted == "external":  # the race's fix is in the checkpointer (docs/across-machines.md)
        return JournalPolicy(
            "wal", 0,
            f"HERMES_STATE_CHECKPOINT=external ({label}): WAL, automatic checkpoints off, "
            "none of ours: the replicator runs them",
            "external")
    if sqlite_has_wal_reset_bug(version) and override != "wal":
        return JournalPolicy(
            "delete", None,
            f"{label} has the WAL-reset race (3.7.0-3.51.2): rollback journal, as hermes-agent",
            "none")
    return _wal_policy(version, "HERMES_STATE_JOURNAL=wal: " if override else "")


def _wal_policy(version, why=""):
    """WAL on `version`'s SQLite: on one with the WAL-reset race only our checkpoints, each under
    state.db.lock; elsewhere SQLite's automatic ones too. `why` opens the reason."""
    label = "SQLite " + ".".join(map(str, version[:3]))
    if sqlite_has_wal_reset_bug(version):
        return JournalPolicy(
            "wal", 0,
            f"{why}{label} has the WAL-reset race (3.7.0-3.51.2): WAL with every write and "
            "checkpoint under state.db.lock, automatic checkpoints off",
            "locked")
    return JournalPolicy(
        "wal", None,
        f"{why}{label} is free of the WAL-reset race: WAL with every write under state.db.lock, "
        "automatic checkpoints and ours",
        "automatic")


class BackgroundCheckpointer:
    """The thread that checkpoints a WAL store off the write path: once the writer has been quiet
    IDLE_CHECKPOINT_DELAY s, and when a commit asks (`committed(due=True)`). It holds the store
    weakly (an idle store still closes at exit and is collected), starts at a commit, and ends at
    stop(), once the store is gone, or after CHECKPOINTER_RETIRE_AFTER s with nothing to do."""

    def __init__(self, db):
        self._db = weakref.ref(db)
        self._cond = threading.Condition()
        self._thread = None
        self._last = 0.0
        self._pending = self._due = self._stopped = False

    def committed(self, due=False):
        """A commit happened (`due`: checkpoint now, not only once quiet)."""
        with self._cond:
            was_pending, self._pending, self._last = self._pending, True, time.monotonic()
            self._due = self._due or due
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"hermes_state checkpointer {id(self):x}", daemon=True)
                self._thread.start()
            elif due or not was_pending:  # not at every commit: the thread would wake at each
                self._cond.notify()

    def stop(self, timeout):
        """End the thread (waiting up to `timeout` s for a checkpoint under way); it may start
        again at the next commit (a store reopened after close)."""
        with self._cond:
            thread, self._stopped = self._thread, True
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._cond:
            self._pending = self._due = self._stopped = False

    def _run(self):
        while self._wait_for_work():
            db = self._db()
            if db is None:
                return
            done = db._background_checkpoint()
            del db  # not held while waiting
            if not done:  # a write, the lock held elsewhere, a reader in the way: look again
                with self._cond:
                    if not self._pending:
                        self._pending, self._last = True, time.monotonic()

    def _wait_for_work(self):
        """True when a checkpoint is due; False (the thread ends) when stopped or retired."""
        with self._cond:
            while not self._stopped:
                if self._due:
                    break
                if self._pending:
                    quiet_in = self._last + IDLE_CHECKPOINT_DELAY - time.monotonic()
                    if quiet_in <= 0:
                        break
                    self._cond.wait(quiet_in)
                elif not self._cond.wait(CHECKPOINTER_RETIRE_AFTER) and not self._pending:
                    break
            work = not self._stopped and (self._due or self._pending)
            self._due = self._pending = False
            if not work:
                self._thread = None
            return work


class SessionJournalMixin:
    """SessionDB's journal mode and checkpoints: applies `self.policy` (choose_journal_policy) at
    open, checkpoints after commits (`_after_commit`, the write path's), and on the checkpointer
    thread. Relies on SessionDB's `_writer`, `_file_lock`, `_write_lock`, `_closed`, `_commits`,
    `_uncheckpointed`, `_checkpoint_conn`, `_checkpointer`, `db_path`, `write_budget`,
    `_retry_on_lock`, `_connect`, `_new_connection`, `_held_keys` and `_read_one`."""

    def _apply_journal_policy(self):
        """Put the store in the policy's journal mode, or say why it stays and adopt the policy of
        the mode it keeps."""
        conn = self._writer

        def read_mode():
            # A read first: in WAL it holds the shared lock a switch out of WAL must get past. In a
            # rollback journal it waits out other writers' commits, as a write would.
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return conn.execute(JOURNAL_MODE_SQL).fetchone()[0].lower()
        mode = self._retry_on_lock(read_mode, time.monotonic(), self.write_budget)
        if mode == "wal" and self.policy.mode != "wal":
            # Leaving WAL needs every other connection to the file gone (SQLite refuses it while
            # one is open, as it would lose its view of the WAL): try once, never wait one out
            # (hermes-agent 0.22's _set_journal_mode_no_wait; it leaves a WAL store as it is).
            try:
                mode = _set_journal_mode_no_wait(conn, self.policy.mode) or mode
            except sqlite3.OperationalError as exc:
                if not is_lock_error(exc):
                    raise
            if mode == "wal":
                self.policy = _wal_policy(
                    sqlite3.sqlite_version_info,
                    "the store is in WAL and another connection holds it (an open that finds it"
                    f" alone switches it to {self.policy.mode}): ")
                logger.warning("journal mode of %s stays wal: %s", self.db_path,
                               self.policy.reason)
        elif mode != self.policy.mode:
            # The switch into WAL needs every reader of a rollback-journal store gone: wait for
            # them as a write waits.
            _set_busy_timeout(conn, self.write_budget)
            try:
                switch = f"PRAGMA journal_mode={self.policy.mode}"
                mode = self._retry_on_lock(
                    lambda: conn.execute(switch).fetchone()[0].lower(), time.monotonic(),
                    self.write_budget)
                if mode == "wal":  # WAL's shared memory is mapped at the first read
                    conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            except sqlite3.OperationalError as exc:
                # NFS, SMB and some FUSE filesystems fail WAL's shared memory or locks.
                if self.policy.mode != "wal" or not any(
                        marker in str(exc).lower() for marker in _WAL_INCOMPAT_MARKERS):
                    raise
                if mode == "wal":
                    conn = self._writer = self._out_of_unusable_wal(conn)
                    mode = "delete"
                else:
                    mode = _set_journal_mode_no_wait(conn, "DELETE") or mode
                refused = WAL_REFUSED.format(exc)
            else:
                refused = WAL_REFUSED.format(f"the journal stayed {mode}")
            finally:
                _set_busy_timeout(conn, WRITER_BUSY_TIMEOUT)
            if mode != self.policy.mode:  # a filesystem that refuses WAL keeps its journal
                self.policy = JournalPolicy(mode, None, refused, "none")
                _warn_once((str(self.db_path),), "wal-refused", logging.ERROR, refused)
        if mode != "wal" and _path_on_cross_vm_fs(str(self.db_path)):
            _warn_once((str(self.db_path),), "cross-vm", logging.WARNING, CROSS_VM_REFUSAL)
        conn.execute(f"PRAGMA synchronous={writer_synchronous(mode)}")
        if self.policy.autocheckpoint is not None:
            conn.execute(f"PRAGMA wal_autocheckpoint={self.policy.autocheckpoint}")
        if (self.policy.checkpoint == "external"
                and hasattr(sqlite3, "SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE")):
            # Python 3.12+: our last close leaves the WAL to the replicator as well, instead of
            # checkpointing it and making Litestream take a new snapshot.
            conn.setconfig(sqlite3.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, True)

    def _out_of_unusable_wal(self, conn):
        """A new writer, the store switched back out of a WAL whose shared memory this filesystem
        cannot map: `conn` is closed (its failed WAL read holds a lock), and a connection in
        exclusive locking mode, which keeps the WAL index in its own memory, switches it."""
        conn.close()
        _release(self._held_keys.pop())
        fix = self._connect(str(self.db_path), uri=False, timeout=WRITER_BUSY_TIMEOUT,
                            isolation_level=None, check_same_thread=False)
        try:
            fix.execute("PRAGMA locking_mode=EXCLUSIVE")
            fix.execute("PRAGMA journal_mode=DELETE").fetchone()
        finally:
            fix.close()
        return self._new_connection(str(self.db_path), uri=False, timeout=WRITER_BUSY_TIMEOUT)

    def _checkpoint_mode(self):
        # doctor's line: our checkpoints on an affected SQLite would race Litestream's unlocked
        # writes (a hint only: a restored copy carries its tables too).
        litestream = "SELECT 1 FROM sqlite_master WHERE name = '_litestream_seq'"  # its table
        if self.policy.checkpoint == "locked" and self._read_one(litestream):
            return ("locked; this store carries Litestream's tables: while Litestream replicates "
                    "it, set HERMES_STATE_CHECKPOINT=external")
        return self.policy.checkpoint

    def _after_commit(self, conn, changes):
        """Checkpoint now and then, after a big transaction, and once the writer goes quiet. The
        data is committed: nothing here may raise into the retry loop, which would run the
        callback a second time."""
        self._commits += 1
        if not self._checkpoints_ours():
            return
        self._uncheckpointed = True
        due = self._commits % CHECKPOINT_EVERY_COMMITS == 0 or changes >= CHECKPOINT_AFTER_CHANGES
        # With the WAL-reset race only the writer checkpoints, under our lock (held here); else the
        # checkpointer thread does it beside our writes (it measured 20-30% of a one-message
        # append here, 3.53.2 on a loaded 2-core machine).
        locked_now = due and self.policy.checkpoint == "locked"
        if locked_now:
            self._checkpoint(conn)
        self._checkpointer.committed(due=due and not locked_now)

    def _checkpoints_ours(self):
        """True if we checkpoint this store (in WAL, no replicator doing it)."""
        return self.policy.checkpoint in ("locked", "automatic")

    def _checkpoint(self, conn):
        """A PASSIVE checkpoint; True if it copied the whole WAL. On the writer it runs under
        state.db.lock. A failure waits for the next one."""
        try:
            busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as exc:
            logger.info("checkpoint of %s deferred to the next one: %s", self.db_path, exc)
            return False
        whole = not busy and copied == frames
        if whole and conn is self._writer:
            self._uncheckpointed = False
        return whole

    def _background_checkpoint(self):
        """The checkpointer thread's checkpoint; False when it should look again later. On a SQLite
        free of the WAL-reset race it runs on a connection of its own, beside our writes (the fix
        is in the checkpointer); with the race, on the writer under both our locks, taken only if
        free now."""
        if self.policy.checkpoint == "automatic":
            if self._closed:
                return True
            if self._checkpoint_conn is None:
                try:
                    self._checkpoint_conn = self._new_connection(
                        str(self.db_path), uri=False, timeout=WRITER_BUSY_TIMEOUT)
                except sqlite3.Error as exc:  # the thread must not die of it: the next look
                    logger.info("checkpoint of %s deferred: %s", self.db_path, exc)
                    return False
            return self._checkpoint(self._checkpoint_conn)
        if not self._write_lock.acquire(blocking=False):
            return False
        try:
            if self._closed or self._writer is None:
                return True
            if self._file_lock is None or not self._file_lock.acquire(time.monotonic()):
                return False
            try:
                return self._checkpoint(self._writer)
            finally:
                self._file_lock.release()
        finally:
            self._write_lock.release()
