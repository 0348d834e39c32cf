"""SessionDB: an AI agent's sessions and messages in one SQLite file.

Owns the connections (one writer, and the `_conn`/`_lock` pair hermes-agent runs its own SQL
through; the readers are hermes_state_readpool's, the journal policy and checkpoints
hermes_state_wal's), the write path (BEGIN IMMEDIATE, retried with jitter within a budget),
self-repair of damaged files at open, close and the reopen of a writable handle used after it,
the meta methods, whole-home backup and restore, the module-level names hermes-agent imports from
here, and the class statement composing the mixins.
Holds no session or message logic. Never opens the store or its sidecars except through SQLite
(docs/design.md, "Locks we never break").
"""

if __name__ == "__main__":
    # `python -m hermes_state` runs this file as __main__, and the CLI imports it again as
    # `hermes_state`. Handing over before anything below runs keeps one copy of the module (and of
    # its per-process lock registries) in the process, as llm's four-line __main__.py does.
    import sys

    from hermes_state_cli import main

    sys.exit(main())

import atexit
import contextlib
import contextvars
import errno
import functools
import itertools
import json
import logging
import os
import queue
import sqlite3
import stat
import sys
import threading
import time
import weakref
from pathlib import Path

from hermes_constants import get_hermes_home
from hermes_state_common import (
    FILE_MODE, INSERT_META_SQL, SEARCH_OBJECTS, SEARCH_TRIGGERS, SELECT_META_SQL, SIDECAR_SUFFIXES,
    LazyModule, escape_like,
)
from hermes_state_errors import is_capability_gap
from hermes_state_guard import _set_last_init_error, get_last_init_error
from hermes_state_health import note_store_failure
from hermes_state_user_copy import SESSION_DB_UNAVAILABLE, open_failure_sentence
from hermes_state_compression import SessionCompressionMixin
from hermes_state_coverage import SessionCoverageMixin
from hermes_state_gateway import SessionGatewayMixin
# StoreLockedError and WRITE_BUDGET_SECONDS are imported from here by callers, as before the split.
from hermes_state_lockguard import (  # noqa: F401
    CallerLock, _connections_held, _hold, _raw_store_access, _release, _take_store_lock,
    _use_read_only, WRITE_BUDGET_SECONDS, WRITER_BUSY_TIMEOUT,
)
from hermes_state_errors import StoreLockedError
from hermes_state_maintenance import SessionMaintenanceMixin
from hermes_state_messages import SessionMessagesMixin
from hermes_state_portability import SessionPortabilityMixin
from hermes_state_profile_repair import SessionProfileRepairMixin
from hermes_state_rewind import SessionRewindMixin
from hermes_state_readpool import SessionReadPoolMixin, _file_signature
from hermes_state_schema import (
    SessionSchemaMixin, is_lock_error, pause_between_chunks, runtime_capabilities,
)
from hermes_state_search import SessionSearchMixin
from hermes_state_fts import SessionSearchIndexMixin
from hermes_state_sessions import SessionSessionsMixin
from hermes_state_telegram import SessionTelegramMixin
from hermes_state_titles import SessionTitlesMixin
from hermes_state_usage import SessionUsageMixin, TokenQueue, apply_token_batch

# Names hermes-agent imports from this module although they live in another.
from hermes_state_repair import (  # noqa: F401
    _backup_db_file, _db_opens_cleanly, repair_state_db_schema,
)
from hermes_state_dbfile import (  # noqa: F401
    _connect_tracked_db, collect_state_db_stats, count_db_holders,
)
from hermes_state_common import (  # noqa: F401
    _BARE_BILLING_PROVIDERS, DEFERRED_INDEX_SQL, FTS_STORAGE_VERSION, _WAL_INCOMPAT_MARKERS,
    resolved_max_export_messages, resolved_max_resume_messages, SCHEMA_VERSION, workspace_key,
)
from hermes_state_errors import (  # noqa: F401
    classify_persistence_error, CompressionSessionBusyError, CompressionSessionClosedError,
    is_disk_full_error, is_malformed_db_error, is_malformed_schema_error, MAX_SAFE_EXPORT_MESSAGES,
    MAX_SAFE_RESUME_MESSAGES, PERSISTENCE_ERROR_CAUSES, SessionCompressionInProgressError,
    SessionExportTooLargeError, SessionResumeTooLargeError, SessionTurnLeaseLostError,
    StateDbCorruptError, StateDbReplacedError,
)
from hermes_state_maintenance import (  # noqa: F401
    SESSION_STATUS_COMPLETE, SESSION_STATUS_EMPTY, SESSION_STATUS_ERROR, SESSION_STATUS_INTERRUPTED,
    classify_session_status,
)
# choose_journal_policy and CHECKPOINT_EVERY_COMMITS are imported from here, as before their move.
from hermes_state_wal import (  # noqa: F401
    CHECKPOINT_EVERY_COMMITS, BackgroundCheckpointer, SessionJournalMixin, _path_on_cross_vm_fs,
    _wal_reset_repair_hint, apply_database_pragmas, apply_wal_with_fallback,
    choose_journal_policy, is_sqlite_wal_reset_vulnerable, preflight_db_writability,
    resolve_journal_mode, sqlite_source_id,
)
from hermes_state_errors import WalUnsupportedError

logger = logging.getLogger("hermes_state")
tempfile = LazyModule("tempfile")  # (backup and restore only)

STATE_DB_FILENAME = "state.db"
# hermes-agent's names for the default store: the path as the home was at import, and the function
# that follows a home changed since (or a re-pointed constant).
DEFAULT_DB_PATH = get_hermes_home() / STATE_DB_FILENAME
_IMPORTED_DEFAULT_DB_PATH = DEFAULT_DB_PATH


def _default_db_path():
    """`<hermes home>/state.db` as of now; DEFAULT_DB_PATH instead if someone re-pointed it."""
    re_pointed = DEFAULT_DB_PATH != _IMPORTED_DEFAULT_DB_PATH
    return DEFAULT_DB_PATH if re_pointed else get_hermes_home() / STATE_DB_FILENAME


def format_session_db_unavailable(prefix=SESSION_DB_UNAVAILABLE, *, details=False):
    """The sentence a user reads when SessionDB() failed, with why the last open of this process
    failed when one did: hermes_state_user_copy.open_failure_sentence, in the words of the
    hermes-agent release hosting us (`details` adds the raw cause on a second line)."""
    return open_failure_sentence(get_last_init_error(), prefix, details=details)


def divert_session_transcript_jsonl(session_id, messages):
    """Append `messages` as JSON lines to <home>/sessions/<session_id>.jsonl (created 0600) and
    return that path; None when there is no session id or nothing to write.

    Where hermes-agent keeps a turn's messages that a replaced or damaged store refused. A message
    that is a dict is written as it is, any other as {"content": str(message)}; None is skipped.
    ValueError for a session id that is not a plain file name, writing nothing."""
    session_id = str(session_id or "").strip()
    if not session_id or not messages:
        return None
    if session_id in (".", "..") or any(sep in session_id for sep in ("/", "\\", "\x00")):
        raise ValueError(f"session_id {session_id!r} cannot name a file in sessions/")
    folder = get_hermes_home() / "sessions"
    _private_dirs(folder)
    path = folder / f"{session_id}.jsonl"
    lines = "".join(
        json.dumps(m if isinstance(m, dict) else {"content": str(m)}, ensure_ascii=False,
                   default=str) + "\n"
        for m in messages if m is not None).encode("utf-8")

    def append(fd):
        view = memoryview(lines)
        while view:
            view = view[os.write(fd, view):]
        return True
    # Our one raw open: refused only where we hold a SQLite connection, which a .jsonl never is.
    if not _raw_store_access(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, append):
        raise ValueError(f"{path} is open as a database here; nothing was written")
    return path


def _create_private_file(path):
    """Create `path` empty and 0600 when it is missing; an existing file is left as it is."""
    try:  # O_EXCL opens no file that exists (nor a link), so it drops no lock of ours
        if _raw_store_access(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, lambda fd: True):
            os.chmod(path, FILE_MODE)  # whatever the umask took
    except FileExistsError:
        pass


def _secure_state_db_files(db_path, *, create_main=False):
    """Take group and other access from the store and its sidecars, creating a missing store file
    0600 with `create_main`; None.

    Existing files are changed with chmod, never opened (closing a descriptor would drop this
    process's locks on them), and only lose bits: a read-only file stays read-only. Links and
    anything but a regular file are left alone. No-op on Windows."""
    if os.name == "nt":
        return
    db_path = Path(db_path)
    if create_main:
        _create_private_file(db_path)
    for path in [db_path] + [Path(f"{db_path}{suffix}") for suffix in SIDECAR_SUFFIXES]:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISREG(mode) and stat.S_IMODE(mode) & ~FILE_MODE:
            os.chmod(path, stat.S_IMODE(mode) & FILE_MODE)


SQLITE_HEADER = b"SQLite format 3\x00"

# The whole-callback retry sleeps briefly while contention is likely brief, longer once it has
# lasted; random so that writers spread out.
EARLY_RETRY_WINDOW = 2.0
EARLY_JITTER = (0.02, 0.15)
LATE_JITTER = (0.25, 1.0)
QUARANTINE_LOCK_WAIT = 5.0  # quarantine_zeroed_state_db gives up then, as hermes-agent's does


# -- self-repair of damaged files ------------------------------------------------------------------

def damage_reason(path, probe_bytes=len(SQLITE_HEADER)):
    """'empty', 'zeroed' or 'notsqlite' for a file SQLite cannot use as a store; None if healthy.

    SQLite judges, `immutable=1`: it reads the first page only, takes no lock and makes no -shm
    beside a stray WAL, and its descriptor's close waits while our other connections hold locks on
    the file. Only when it says "not a database" and this process holds no connection to the file is
    the header read, to tell a zeroed file (its first `probe_bytes`, at least the header, all NUL);
    otherwise the answer is 'notsqlite'.
    """
    if os.stat(path).st_size == 0:
        return "empty"
    try:
        if _use_read_only(path, lambda conn: conn.execute("PRAGMA schema_version").fetchone(),
                          "&immutable=1"):
            return None
    except sqlite3.DatabaseError:
        # Unreadable or malformed is not this kind of damage: the writable open meets it.
        return None
    length = max(probe_bytes, len(SQLITE_HEADER))
    header = _raw_store_access(path, os.O_RDONLY, lambda fd: os.read(fd, length))
    return "zeroed" if header and not header.strip(b"\x00") else "notsqlite"


_set_aside_guard = threading.Lock()


def _new_set_aside_guard():
    """A forked child gets a free guard: a thread of the parent may have held it at the fork."""
    global _set_aside_guard
    _set_aside_guard = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_set_aside_guard)


def set_aside(path, reason):
    """Rename a damaged store and its sidecars to
    `<name>.<reason>-<time>-<pid>[-<n>].bak[-wal|-shm]`; returns the backup path. Deletes nothing
    and renames onto no existing file (`-<n>` counts up past taken names); sidecars keep their
    suffix, so SQLite opening the .bak finds its WAL."""
    path = Path(path)
    suffixes = ("",) + SIDECAR_SUFFIXES
    stem = f"{path.name}.{reason}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    with _set_aside_guard:
        for n in itertools.count(1):
            backup = path.with_name(stem + (f"-{n}" if n > 1 else "") + ".bak")
            if not any(os.path.lexists(str(backup) + suffix) for suffix in suffixes):
                break
        for suffix in suffixes:
            source = Path(str(path) + suffix)
            if os.path.lexists(source):  # a dangling link too: it is moved, never followed
                target = Path(str(backup) + suffix)
                _move_without_replacing(source, target)
                if not target.is_symlink():  # (a link's file lives elsewhere: not ours to change)
                    os.chmod(target, FILE_MODE)
    return backup


def _move_without_replacing(source, target):
    """Rename `source` to `target`; FileExistsError, moving nothing, when `target` exists."""
    try:
        os.link(source, target, follow_symlinks=False)
    except FileExistsError:
        raise
    except (OSError, NotImplementedError):
        # No hard link possible here (a directory, FAT, some network file systems). POSIX rename
        # replaces silently, so look first; Windows refuses by itself.
        if os.path.lexists(target):
            raise FileExistsError(
                errno.EEXIST, "refusing to replace an existing file", str(target)) from None
        os.rename(source, target)
        return
    try:
        os.unlink(source)
    except BaseException:
        if os.path.lexists(source):  # (an immutable folder refuses the unlink): it stays, whole
            os.unlink(target)
        raise


def is_zeroed_state_db(path, *, probe_bytes=100, force=False):
    """True when `path` is a zeroed store (damage_reason 'zeroed': SQLite cannot read it and its
    first `probe_bytes` are all NUL); False for a missing, empty, healthy or otherwise damaged file.

    hermes-agent's name. Like its own, it reads no byte while this process holds a connection to
    the file (False then); `force`, its way past that, is accepted and changes nothing: ours never
    reads a file it holds open (docs/design.md, "Locks we never break")."""
    try:
        return damage_reason(path, probe_bytes) == "zeroed"
    except OSError:
        return False


def quarantine_zeroed_state_db(path):
    """Move a zeroed store and its sidecars aside as an open does (set_aside, to
    `<name>.zeroed-<time>-<pid>.bak`) and return the new path; None when it is missing or not
    zeroed, or the lock or the move failed (logged).

    Checked again under the store's writer lock, which an open holds while it repairs the file, so
    two processes never both move it, nor one a store another has just created in its place."""
    path = Path(path)
    if not is_zeroed_state_db(path):
        return None
    try:
        lock = _take_store_lock(path, QUARANTINE_LOCK_WAIT, f"{path} stayed locked")
    except (OSError, StoreLockedError) as exc:
        logger.error("zeroed store %s left in place: its writer lock was not taken (%s)", path, exc)
        return None
    try:
        return set_aside(path, "zeroed") if is_zeroed_state_db(path) else None
    except OSError as exc:
        logger.error("zeroed store %s left in place: %s", path, exc)
        return None
    finally:
        lock.release()
        lock.close()


# -- hermes-agent's CJK tokenizer extension, which ours needs not ------------------------------
# hermes-agent indexes CJK text with a tokenizer it loads from a shared library when one is
# installed; ours keeps a CJK side index of plain FTS5 (docs/differences.md), and these names
# answer for it: its tables and its triggers, as an open creates them.
FTS_CJK_TABLE_SQL = "".join(f"{ddl};\n" for ddl in SEARCH_OBJECTS["cjk"].values())
FTS_CJK_TRIGGER_SQL = "".join(f"{ddl};\n" for ddl in SEARCH_TRIGGERS["cjk"].values())


def fts5_cjk_so_path():
    """Where hermes-agent looks for its CJK tokenizer: HERMES_FTS5_CJK_SO, else
    <home>/lib/libfts5_cjk.so. Ours never loads it."""
    configured = os.environ.get("HERMES_FTS5_CJK_SO")
    if configured:
        return Path(configured).expanduser()
    return get_hermes_home() / "lib" / "libfts5_cjk.so"


def load_fts5_cjk_extension(conn):
    """False, loading nothing into `conn`: no extension is needed here, as ours indexes CJK terms
    of every length without one (hermes-agent's False, "search as without the extension", finds
    them all here)."""
    return False


class SessionDB(SessionSessionsMixin, SessionCompressionMixin, SessionCoverageMixin,
                SessionMessagesMixin, SessionRewindMixin, SessionTitlesMixin, SessionUsageMixin,
                SessionGatewayMixin, SessionTelegramMixin, SessionMaintenanceMixin,
                SessionSearchMixin, SessionSearchIndexMixin, SessionSchemaMixin,
                SessionPortabilityMixin, SessionReadPoolMixin, SessionProfileRepairMixin,
                SessionJournalMixin):
    """The agent's state store. Thread-safe; open one per process.

    `db_path` defaults to `<hermes home>/state.db`; a read-only open runs no DDL and no repair.
    `connection_factory` replaces `sqlite3.connect`; `write_budget` is how long any write waits for
    a busy store before StoreLockedError (default: the patience below); `journal` and `checkpoint`
    override HERMES_STATE_JOURNAL and _CHECKPOINT.
    """

    # How long a write waits for a busy store, hermes-agent's names and values: a transcript write
    # (an agent turn's messages, a new session row), whose failure aborts the turn, three times a
    # routine one. Read at each write, so a caller may set them on the class; an explicit
    # `write_budget` bounds every write.
    _WRITE_PATIENCE_S = WRITE_BUDGET_SECONDS
    _TRANSCRIPT_WRITE_PATIENCE_S = 3 * WRITE_BUDGET_SECONDS
    # URI parameters after mode=ro of every read connection (see _open_read_only).
    _reader_flags = ""
    # hermes_state_registry's release() while it lends this handle: close() gives back a reference.
    _registry_release = None

    def __init__(self, db_path=None, read_only=False, *, connection_factory=None,
                 write_budget=None, journal=None, checkpoint=None):
        self.db_path = Path(db_path) if db_path is not None else _default_db_path()
        self.read_only = read_only
        self._write_budget = None if write_budget is None else float(write_budget)
        self.repairs = []
        self._connect = connection_factory or sqlite3.connect
        self._idle_readers, self._idle_index_readers = queue.SimpleQueue(), queue.SimpleQueue()
        self._readers, self._held_keys, self._immutable_readers = [], [], set()
        self._readers_lock = threading.Lock()
        self._write_lock = threading.RLock()
        self._lock = CallerLock(self)
        self._writer = self._direct_reader = self._file_lock = None
        self._commits = 0
        # A commit since the writer's last whole checkpoint; the thread checkpointing off the write
        # path, and on a SQLite free of the WAL-reset race the connection it checkpoints with.
        self._uncheckpointed, self._checkpoint_conn = False, None
        self._checkpointer = BackgroundCheckpointer(self)
        self._cjk_drained = False  # an index step drained CJK rows in this transaction
        self.fts_caps = runtime_capabilities(self._connect)
        self._tokens = TokenQueue()
        self._closed = False
        self._opening = True  # the open's reads go through the writer (_borrow_reader)
        try:
            self.policy = choose_journal_policy(
                override=journal, checkpoint=checkpoint,
                cross_vm=_path_on_cross_vm_fs(str(self.db_path)))
            if read_only:
                self._open_read_only()
            else:
                self._open_writable()
        except Exception as exc:
            # A failed open keeps no connection: one left counted would stop this process reading
            # any file that later gets its inode (damage_reason would call a zeroed file notsqlite).
            self._close_connections()
            # hermes-agent tells the user why from this.
            _set_last_init_error(f"{type(exc).__name__}: {exc}")
            note_store_failure(self.db_path, exc)
            raise
        finally:
            self._opening = False
        ref = weakref.ref(self)  # not self: the exit hook must not keep the store alive
        # ref() is None once the store is gone. At exit a lent handle closes too.
        self._atexit = lambda: getattr(ref(), "_close_now", lambda: None)()
        atexit.register(self._atexit)

    # -- opening and closing -------------------------------------------------

    def _open_read_only(self):
        # A replica (open_replica) is no local file: its connection factory reads it via the VFS.
        local = getattr(self._connect, "replica_url", None) is None
        if local and not self.db_path.exists():
            raise FileNotFoundError(f"no state store at {self.db_path}")
        real = self.db_path.resolve()  # a link's -wal and -shm are beside its target
        if local and not os.access(real.parent, os.W_OK) and not any(_file_signature(real)[-1]):
            # SQLite cannot read a WAL store with mode=ro where it may not create the -shm. With no
            # journal or WAL beside it the file is the whole store, and no writer of this user can
            # start one in this folder: SQLite may read it as immutable, taking no lock. Another
            # user or mount may still write it; _borrow_reader stops reading it so once it changes.
            self._reader_flags = "&immutable=1"
            self._immutable_as_seen = (real, _file_signature(real))
        try:
            tables = self._read_value("SELECT count(*) FROM sqlite_master")
        except sqlite3.DatabaseError as exc:
            # A crash's unfinished write (a hot -journal, a WAL to recover) needs a write to undo or
            # replay it, which mode=ro may not do; other damage still opens, for doctor.
            if local and "readonly database" in str(exc) and any(
                    os.path.isfile(f"{real}{s}") and os.path.getsize(f"{real}{s}")
                    for s in ("-journal", "-wal")):
                raise sqlite3.OperationalError(
                    f"state store {self.db_path} holds an unfinished write a crash left (in its "
                    "-journal or -wal) that only a writable open can recover; open it read-write "
                    "once, then read it") from exc
            tables = None
        if local and tables == 0:  # a new store cut off before its tables reached the disk
            raise FileNotFoundError(f"no state store at {self.db_path} yet: the file holds no "
                                    "tables (a writable open creates them)")
        try:
            self.stale_schema = self._stale_schema_report()
        except sqlite3.DatabaseError as exc:
            # A look, not a repair: a file too damaged to probe still opens, so doctor can
            # report on it.
            self.stale_schema = [f"could not run: {exc}"]
        if self.stale_schema:
            logger.info("store %s predates this release (%s); a writable open upgrades it",
                        self.db_path, "; ".join(self.stale_schema))

    def _open_writable(self):
        _private_dirs(self.db_path.parent)
        # Creating, repairing and upgrading run under the writer lock: no opener sees a
        # half-made store.
        self._file_lock = _take_store_lock(
            self.db_path, self.write_budget,
            f"state store {self.db_path} stayed locked for {self.write_budget:.0f}s while opening; "
            "nothing was written")
        try:
            try:
                self._prepare_file()
                self._writer = self._new_connection(
                    str(self.db_path), uri=False, timeout=WRITER_BUSY_TIMEOUT)
                self._apply_journal_policy()
                indexes_left = self._init_schema()
                backfill = self._init_search()
                if self._checkpoints_ours():  # the schema in the main file, not only the WAL
                    self._checkpoint(self._writer)
            finally:
                self._file_lock.release()
            # Resumable data work: each chunk takes the writer lock for itself (issue 17).
            self._migrate_data(indexes_left)
            self._finish_abandoned_sweeps()  # messages a delete that died left (a read when none)
            while backfill and self.fts_rebuild_step():
                pause_between_chunks()
        except BaseException as exc:
            self._close_connections()
            from hermes_state_health import disk_fault  # only a failed open needs it
            clearer = disk_fault(self.db_path, exc, writing=True)
            if clearer is None:
                raise
            raise clearer from exc
        self.stale_schema = []

    def _prepare_file(self):
        """Set a damaged store aside; create a missing one owner-only (SQLite makes -wal and
        -shm so too)."""
        reason = damage_reason(self.db_path) if self.db_path.exists() else None
        if reason is not None:
            backup = set_aside(self.db_path, reason)
            message = (f"state store {self.db_path} was {reason}; kept it as {backup} "
                       "and created a fresh store")
            self.repairs.append(message)
            logger.warning(message)
            # hermes-agent opens an empty file as is, but reports a zeroed one.
            if reason != "empty":
                _set_last_init_error(message)
        # Not _secure_state_db_files: an owner who made the store readable to another user (who
        # reads it as immutable) keeps it so when the agent starts.
        _create_private_file(self.db_path)

    def _new_connection(self, target, *, uri, timeout):
        """A connection to the store, counted in the registry until _close_connections closes it."""
        key = _hold(self.db_path)
        try:
            conn = self._connect(target, uri=uri, timeout=timeout, isolation_level=None,
                                 check_same_thread=False)
        except BaseException:
            _release(key)
            raise
        self._held_keys.append(key)
        conn.row_factory = sqlite3.Row
        return conn

    @property
    def _shared_registry_owned(self):
        """True while hermes_state_registry lends this handle; hermes-agent's caches drop a handle
        once the registry has closed it (False)."""
        return self._registry_release is not None

    def close(self):
        """Apply queued token counts, then close every connection; safe to call twice. A handle
        hermes_state_registry lent gives back one reference instead, the last one closing it. A
        writable handle used after close() opens its writer again (_check_open)."""
        release = self._registry_release
        if release is not None:
            release(self)
            return
        self._close_now()

    def _close_now(self):
        if self._closed:
            return
        try:
            if self._writer is not None:
                self.flush_token_counts(timeout=self.write_budget)
        finally:
            # A write of another thread finishes first (within the budget: an exit must not hang
            # on a thread that never lets go).
            writing = self._write_lock.acquire(timeout=self.write_budget)
            try:
                self._closed = True
                atexit.unregister(self._atexit)
                self._close_connections()
            finally:
                if writing:
                    self._write_lock.release()

    def _reopen(self):
        """Open the writer again on a writable handle used after close(), as hermes-agent 0.22 does
        for a worker whose session teardown closed the store under it: loudly, and without
        reconciling the schema again. ProgrammingError when the store file is gone (a new empty
        file would have no tables). The caller holds _write_lock."""
        if not self.db_path.exists():
            raise sqlite3.ProgrammingError(
                f"SessionDB for {self.db_path} was closed and the store is gone; nothing was done")
        logger.warning("state store %s was used after close(); opening its writer again",
                       self.db_path)
        self._file_lock = _take_store_lock(
            self.db_path, self.write_budget,
            f"state store {self.db_path} stayed locked for {self.write_budget:.0f}s while opening "
            "it again; nothing was written")
        try:
            try:
                self._writer = self._new_connection(
                    str(self.db_path), uri=False, timeout=WRITER_BUSY_TIMEOUT)
                self._apply_journal_policy()
            finally:
                self._file_lock.release()
        except BaseException:
            self._close_connections()
            raise
        self._closed = False
        atexit.register(self._atexit)

    def _foreign_state_db_holders(self):
        """[(pid, description)] of the other processes holding the store or its sidecars open;
        hermes-agent's gateway skips a search-index rebuild while any does."""
        from hermes_state_holders import foreign_state_db_holders
        return foreign_state_db_holders(self.db_path)

    def _close_connections(self):
        # The last connection to close checkpoints the WAL (not with an external policy on Python
        # 3.12+), under SQLite's exclusive lock and ours. Beside a long-lived one (a gateway) it is
        # not the last: a store we wrote to since our last whole checkpoint gets a PASSIVE one here
        # (as hermes-agent 0.22's close), else short-lived writers (cron, the CLI) would leave
        # their commits in the WAL for as long as the gateway runs.
        locked = (self._file_lock is not None
                  and self._file_lock.acquire(time.monotonic() + self.write_budget))
        try:
            self._checkpointer.stop(self.write_budget)
            if self._checkpoint_conn is not None:
                self._checkpoint_conn.close()
                self._checkpoint_conn = None
            if locked and self._uncheckpointed and self._writer is not None:
                self._checkpoint(self._writer)
            with self._readers_lock:
                readers, self._readers = self._readers, []
            for conn in readers:
                conn.close()
            self._drain_idle_readers()  # a reopened handle must not borrow a closed reader
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            for key in self._held_keys:
                _release(key)
            self._held_keys = []
        finally:
            if locked:
                self._file_lock.release()
            if self._file_lock is not None:
                self._file_lock.close()
                self._file_lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    @property
    def _conn(self):
        """The connection hermes-agent runs its own SQL on (the writer, or a read-only open's own
        reader; rows are sqlite3.Row); None once closed. Hold `self._lock` around any write
        through it."""
        if self._closed:
            return None
        if not self.read_only:
            return self._writer
        with self._write_lock:
            if self._direct_reader is None:
                self._direct_reader = self._borrow_reader()
            return self._direct_reader

    # -- the write path ------------------------------------------------------

    def _execute_write(self, fn, patience_s=None, *, transaction=True):
        """Run `fn(conn)` in one BEGIN IMMEDIATE transaction and return its result.

        Rolls back on any error. On "database is locked"/"busy" the whole callback is retried after
        a random pause until `patience_s` (default `write_budget`) runs out, then StoreLockedError.
        Queued token counts ride along. `transaction=False` (VACUUM cannot run in one) takes only
        the locks. `fn` must not commit.
        """
        budget = self.write_budget if patience_s is None else float(patience_s)
        start = time.monotonic()
        if not self._write_lock.acquire(timeout=budget):
            raise self._locked_error(start, "another thread of this process kept writing", budget)
        try:  # under _write_lock: close() cannot run between this check and the write
            self._check_open()
        except BaseException:
            self._write_lock.release()
            raise
        # Queued counts ride in the transaction (VACUUM has none); take() locks, and most
        # writes find none.
        batch = self._tokens.take() if transaction and self._tokens else []

        def attempt(call, queued):
            return self._retry_on_lock(
                lambda: self._write_once(call, queued, start, budget, transaction), start, budget)
        try:
            try:
                return attempt(fn, batch)
            except sqlite3.OperationalError as exc:
                if not transaction or not is_capability_gap(exc):
                    raise
                # A fuller runtime opened the store since ours and put back index triggers this one
                # cannot run (no FTS5, no tokenizer): set them aside as our open does, then write
                # once more.
                attempt(self._apply_search_schema, [])
                return attempt(fn, batch)
            except sqlite3.DatabaseError as exc:
                # Exactly DatabaseError: SQLite found something corrupt. A write never fails for
                # our own index: one FTS5 cannot open is set aside (a transaction of its own), then
                # the write goes once more.
                if not transaction or type(exc) is not sqlite3.DatabaseError \
                        or not attempt(self._set_aside_unreadable_indexes, []):
                    raise
                return attempt(fn, batch)
        except BaseException as exc:
            self._tokens.put_back(batch)
            # Damage: readiness and listings say so. A full, read-only or failing disk: raises
            # what the disk did instead.
            note_store_failure(self.db_path, exc, writing=True)
            raise
        finally:
            self._write_lock.release()

    def _retry_on_lock(self, call, start, budget):
        """call() again after a random pause while it fails on "locked"/"busy"; StoreLockedError
        once the wait begun at `start` would pass `budget`. A busy timeout is not enough: SQLite
        answers BUSY at once, skipping it, where waiting could deadlock (this connection reading,
        another holding RESERVED)."""
        while True:
            try:
                return call()
            except sqlite3.OperationalError as exc:
                if isinstance(exc, StoreLockedError) or not is_lock_error(exc):
                    raise
                elapsed = time.monotonic() - start
                jitter = EARLY_JITTER if elapsed < EARLY_RETRY_WINDOW else LATE_JITTER
                import random  # here, not at import: only a write that met a lock waits
                pause = random.uniform(*jitter)
                if elapsed + pause >= budget:
                    raise self._locked_error(start, str(exc), budget) from exc
                time.sleep(pause)

    def _take_file_lock(self, start, budget):
        """True once state.db.lock is held (False: a closed store holds no lock file);
        StoreLockedError if another process holds it past `start` + `budget`."""
        use_file_lock = self._file_lock is not None
        if use_file_lock and not self._file_lock.acquire(start + budget):
            raise self._locked_error(start, "another process held state.db.lock", budget)
        return use_file_lock

    def _write_once(self, fn, batch, start, budget, transaction):
        locked = self._take_file_lock(start, budget)
        try:
            if transaction:
                return self._in_transaction(self._writer, fn, batch)
            return fn(self._writer)
        finally:
            if locked:
                self._file_lock.release()

    def _in_transaction(self, conn, fn, batch):
        conn.execute("BEGIN IMMEDIATE")
        changes = conn.total_changes
        try:
            if batch:
                apply_token_batch(conn, batch)
            result = fn(conn)
            self._maintain_search(conn, conn.total_changes - changes)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self._after_commit(conn, conn.total_changes - changes)
        return result

    def _locked_error(self, start, cause, budget=None):
        budget = self.write_budget if budget is None else budget
        waited = time.monotonic() - start
        return StoreLockedError(f"state store {self.db_path} was locked for {waited:.1f}s "
                                f"(budget {budget:.1f}s): {cause}; no data was written")

    def _check_open(self, writing=True):
        """Refuse work on a closed read-only handle (ProgrammingError); reopen a closed writable
        one. PermissionError for a write on a read-only handle."""
        if self._closed and self.read_only:
            raise sqlite3.ProgrammingError("SessionDB is closed")
        if self._closed:
            with self._write_lock:
                if self._closed:
                    self._reopen()
        if writing and self.read_only:
            raise PermissionError(f"state store {self.db_path} was opened read-only")

    def _update_rows(self, sql, params):
        """One-statement write; returns the number of rows it changed."""
        return self._execute_write(lambda conn: conn.execute(sql, params).rowcount)

    # -- state_meta ------------------------------------------------------------

    def get_meta(self, key):
        """The text stored under `key` in state_meta; None when the key is absent."""
        return self._read_value(SELECT_META_SQL, (key,))

    def set_meta(self, key, value, *, cursor=None):
        """Store `value` under `key` in state_meta (None stores NULL); returns None. Inside an
        open write (an `_execute_write` callback) pass its connection as `cursor` to write in
        that transaction."""
        def write(conn):
            # Update in place, else insert: the row keeps its place, and an old state_meta without a
            # primary key gets no duplicate.
            updated = conn.execute(
                "UPDATE state_meta SET value = ? WHERE key = ?", (value, key)).rowcount
            if not updated:
                conn.execute(INSERT_META_SQL, (key, value))

        if cursor is not None:
            write(cursor)
        else:
            self._execute_write(write)

    def list_meta_prefix(self, prefix):
        """[(key, value)] of the state_meta keys starting with `prefix` (ASCII letters in any case,
        as LIKE matches), in stored order; [] for an empty prefix."""
        if not prefix:
            return []
        rows = self._read_all("SELECT key, value FROM state_meta WHERE key LIKE ? ESCAPE '\\'",
                              (escape_like(prefix) + "%",))
        return [(row[0], row[1]) for row in rows]

    def backup(self, out_path):
        """Write a zip of the whole home, created 0600; returns {"archive", "files"}.

        The store and the home's other SQLite files go in as snapshots taken with SQLite's backup
        API, never as copies of live files, and without sidecars; then every other file, and a
        manifest of SHA-256s (hermes_state_archive).
        """
        from hermes_state_archive import home_files, may_be_sqlite, snapshot, write_backup_zip
        from hermes_state_health import disk_full_error
        # Not resolved: a link at OUT is replaced by the archive, never followed to its target.
        out_path = Path(os.path.abspath(out_path))
        home = self.db_path.parent
        with tempfile.TemporaryDirectory(prefix="hermes-backup-") as scratch:
            store = Path(scratch) / STATE_DB_FILENAME
            try:  # the snapshots fill the scratch folder's disk, the archive OUT's
                members = [(self._with_reader(lambda conn: snapshot(conn, store)),
                            STATE_DB_FILENAME)]
                for path in home_files(home, self.db_path, out_path):
                    target = Path(scratch) / f"{len(members)}.db"
                    # None: no database, so a plain copy is safe.
                    copy = may_be_sqlite(path) and _use_read_only(
                        path, lambda conn: snapshot(conn, target))
                    members.append((copy or path, path.relative_to(home).as_posix()))
            except (OSError, sqlite3.Error) as exc:
                if not is_disk_full_error(exc):
                    raise
                raise disk_full_error(scratch, f"the snapshots for backup {out_path}") from exc
            try:
                return write_backup_zip(out_path, members)
            except OSError as exc:
                if not is_disk_full_error(exc):
                    raise
                raise disk_full_error(out_path.parent, f"backup {out_path}") from exc

    # -- write patience ----------------------------------------------------------

    @property
    def write_budget(self):
        """Seconds a routine write waits for a busy store: the constructor's `write_budget`, else
        _WRITE_PATIENCE_S."""
        return self._WRITE_PATIENCE_S if self._write_budget is None else self._write_budget

    def _transcript_patience(self):
        """Seconds a transcript write waits: the constructor's `write_budget`, else
        _TRANSCRIPT_WRITE_PATIENCE_S."""
        if self._write_budget is None:
            return self._TRANSCRIPT_WRITE_PATIENCE_S
        return self._write_budget

    @classmethod
    def open_replica(cls, url, *, open_timeout=None):
        """A read-only SessionDB over the Litestream replica at `url` (s3://, file://, ...), read
        live through Litestream's VFS (`pip install litestream-vfs`); see hermes_state_replica."""
        from hermes_state_replica import OPEN_TIMEOUT_SECONDS, ReplicaConnector
        timeout = OPEN_TIMEOUT_SECONDS if open_timeout is None else open_timeout
        connector = ReplicaConnector(url, timeout)
        return cls(url, read_only=True, connection_factory=connector)

    def _with_fresh_reader(self, use):
        """`use(conn)` on a read connection of its own, closed after: every statement is prepared on
        the schema as it is now. A pooled reader's cached EXPLAIN runs the program it was prepared
        with (EXPLAIN never reads the schema cookie) and, once that reader has reloaded a schema
        another connection changed, lists objects SQLite has freed: a stale answer, or SIGSEGV
        (docs/runtimes.md)."""
        self._check_open(writing=False)
        key = _hold(self.db_path)
        try:
            conn = self._connect(self.db_path.resolve().as_uri() + "?mode=ro" + self._reader_flags,
                                 uri=True,
                                 timeout=self.write_budget, isolation_level=None,
                                 check_same_thread=False)
        except BaseException:
            _release(key)
            raise
        try:
            return use(conn)
        finally:
            conn.close()
            _release(key)


# -- whole-home restore (the "ops import"; session import is another entry point) -----------------
# The archive's format and checks are hermes_state_archive's, imported when a backup or restore
# runs; this part holds the lock, checks the unpacked store and swaps the files in.


def restore_home(archive_path, db_path=None, *, force=False, write_budget=WRITE_BUDGET_SECONDS):
    """Put a whole backup of the home back; returns {"restored", "moved_aside", "db_path"}.

    FileExistsError over an existing store unless `force`; even then nothing is deleted: the old
    store is set aside as `state.db.pre-restore-<time>-<pid>[-<n>].bak`, other replaced files go to
    a new `.pre-restore-<time>[-<n>]/`. ValueError, before anything moves, for an archive that is
    damaged, not ours, names a file twice or not in its normal form, holds a link or a folder
    entry, is too big for the disk or RESTORE_MAX_RATIO, or fails its SHA-256s or SQLite's check.
    OSError when the swap fails part-way: every move is undone first, so the home is as it was.
    Files keep their archived mode minus group/world write. RuntimeError while this process has
    the store open (the swap would happen under its connections).
    """
    from hermes_state_archive import (
        DAMAGED_ARCHIVE, check_archive, open_archive, refused, unpack_verified,
    )
    db_path = Path(db_path) if db_path is not None else _default_db_path()
    home = db_path.parent
    if _connections_held(db_path):
        raise RuntimeError(
            f"restore refused: this process has {db_path} open; close every SessionDB on it "
            "first; nothing was restored")
    created = []
    try:
        with open_archive(archive_path) as archive:
            files = check_archive(archive, archive_path, home, STATE_DB_FILENAME)
            # After the archive's check: a file that is no backup is said so, --force or not.
            if db_path.exists() and db_path.stat().st_size and not force:
                raise FileExistsError(
                    f"{db_path} exists; restore replaces a whole home only with --force (the "
                    "current store is then kept as a .bak file); nothing was restored")
            created = _private_dirs(home)  # a new home and its missing parents are created 0700
            with tempfile.TemporaryDirectory(prefix=".restore-", dir=home) as scratch:
                unpack_verified(archive, files, Path(scratch))
                _check_unpacked_store(Path(scratch) / STATE_DB_FILENAME, refused)
                # Only the swap waits for writers: a refusal leaves no lock file in a new home.
                refusal = (f"state store {db_path} is being written; "
                           f"restore waited {write_budget:.0f}s")
                lock = _take_store_lock(db_path, write_budget, refusal)
                try:
                    return _swap_in(Path(scratch), files, db_path)
                finally:
                    lock.release()
                    lock.close()
    except BaseException as exc:
        for folder in reversed(created):  # a restore that failed leaves no new folder either
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        if isinstance(exc, DAMAGED_ARCHIVE):
            raise refused(f"{archive_path} is damaged ({exc})") from None
        raise


def _check_unpacked_store(store, refused):
    if damage_reason(store) is not None:
        raise refused("its state.db is not a SQLite database")
    verdict = _use_read_only(store, lambda conn: conn.execute("PRAGMA quick_check").fetchone()[0])
    if verdict != "ok":
        raise refused(f"its state.db fails quick_check ({verdict})")


def _private_dirs(path, top=None):
    """Create `path` and its missing parents (below `top`), each 0700 whatever the umask: a folder
    others may write lets them rename or replace the store in it. Returns the folders it made,
    outermost first."""
    missing, created = [], []
    path = Path(path)
    while path != top and path != path.parent and not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
            created.append(folder)
        except FileExistsError:
            pass
    return created


def _new_private_dir(parent, stem):
    """A new, empty 0700 folder `<stem>[-<n>]` in `parent`: never one that exists."""
    for n in itertools.count(1):
        folder = parent / (stem + (f"-{n}" if n > 1 else ""))
        try:
            os.mkdir(folder, 0o700)
            return folder
        except FileExistsError:
            pass


def _swap_in(scratch, files, db_path):
    """Move the unpacked files over the home, all or nothing: every rename and folder made is
    noted, and on any error undone newest first before the error goes on."""
    home, moved, undo, kept_dir = db_path.parent, [], [], None

    def move(source, target, top):
        undo.extend(("rmdir", folder) for folder in _private_dirs(target.parent, top))
        _move_without_replacing(source, target)
        undo.append(("move", target, source))

    def keep(path):  # what is in the way, moved as it is under .pre-restore-<time>/
        nonlocal kept_dir
        if kept_dir is None:
            kept_dir = _new_private_dir(home, f".pre-restore-{time.strftime('%Y%m%d-%H%M%S')}")
            undo.append(("rmdir", kept_dir))
        kept = kept_dir / path.relative_to(home)
        move(path, kept, kept_dir)
        moved.append(str(kept))

    try:
        # A folder of the archive that is now a file or a link (never followed out of the home)
        # goes first.
        folders = {folder for name in files for folder in (home / name).parents
                   if home in folder.parents}
        for folder in sorted(folders):
            if os.path.lexists(folder) and (folder.is_symlink() or not folder.is_dir()):
                keep(folder)
        if os.path.lexists(db_path):
            backup = set_aside(db_path, "pre-restore")
            undo.append(("store", backup, db_path))
            moved.append(str(backup))
        for name in files:
            target = db_path if name == STATE_DB_FILENAME else home / name
            if name != STATE_DB_FILENAME and os.path.lexists(target):
                keep(target)
            move(scratch / name, target, home)
        os.chmod(db_path, FILE_MODE)
    except BaseException as exc:
        stuck = _undo_swap(undo)
        if not isinstance(exc, Exception):
            raise
        if stuck:
            raise OSError(f"restore failed part-way in {home} ({exc}) and could not put back "
                          f"{', '.join(stuck)}; the old store is kept as a .pre-restore .bak "
                          "file") from exc
        raise OSError(f"restore failed part-way in {home} ({exc}); every file was put back as "
                      "it was, nothing was restored") from exc
    return {"restored": sorted(files), "moved_aside": moved, "db_path": str(db_path)}


def _undo_swap(undo):
    """Undo _swap_in's steps, newest first; returns the paths it could not put back."""
    stuck = []
    for step in reversed(undo):
        try:
            if step[0] == "rmdir":
                os.rmdir(step[1])
            elif step[0] == "move":
                _move_without_replacing(step[1], step[2])
            else:  # the old store and its sidecars, back from their .bak names
                for suffix in ("",) + SIDECAR_SUFFIXES:
                    if os.path.lexists(f"{step[1]}{suffix}"):
                        _move_without_replacing(Path(f"{step[1]}{suffix}"),
                                                Path(f"{step[2]}{suffix}"))
        except OSError:
            if step[0] != "rmdir":
                stuck.append(str(step[2]))
    return stuck


class AsyncSessionDB:
    """A SessionDB for asyncio code: each method call runs in a worker thread and is awaited;
    other attributes are returned as they are. No method returns a live cursor, so nothing
    crosses threads."""

    def __init__(self, db):
        self._db = db

    def __getattr__(self, name):
        attr = getattr(self._db, name)
        if not callable(attr):
            return attr

        async def in_thread(*args, **kwargs):
            # Imported here, where a running loop has loaded it: at the top it was half of
            # `import hermes_state` for every caller, most never async.
            import asyncio

            # The caller's context (a per-task home override) goes along, as asyncio.to_thread does.
            call = functools.partial(contextvars.copy_context().run, attr, *args, **kwargs)
            return await asyncio.get_running_loop().run_in_executor(None, call)

        return in_thread

