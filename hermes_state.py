"""SessionDB: an AI agent's sessions and messages in one SQLite file.

Owns the connections (one writer, a pool of readers), the journal policy,
the write path (BEGIN IMMEDIATE with retry and jitter inside a time budget),
self-repair of damaged files at open, close, the meta methods, whole-home
backup and restore, and the class statement that composes the mixins.
`python -m hermes_state` runs the command line in hermes_state_cli.

The public API lives in the concern mixins (sessions, messages, titles,
usage, gateway, maintenance, search, schema, portability); each imports only
hermes_state_common, hermes_state_schema's helpers and the standard library.
This module never holds session or message logic of its own.
"""

import asyncio
import atexit
import contextvars
import functools
import hashlib
import json
import logging
import os
import queue
import random
import sqlite3
import sys
import tempfile
import threading
import time
import weakref
import zipfile
from collections import namedtuple
from pathlib import Path

from hermes_constants import STATE_DB_FILENAME, get_default_db_path
from hermes_state_common import (
    CHECKPOINT_PASSIVE_SQL,
    DEFERRED_INDEX_SQL,
    JOURNAL_MODE_SQL,
    QUICK_CHECK_SQL,
    SELECT_META_PREFIX_SQL,
    SELECT_META_SQL,
    SET_AUTOCHECKPOINT_SQL,
    SET_JOURNAL_MODE_SQL,
    SYNCHRONOUS_NORMAL_SQL,
    _BARE_BILLING_PROVIDERS,
    prefix_bounds,
    require_text,
    sqlite_has_wal_reset_bug,
)
from hermes_state_doctor import (
    _backup_db_file,
    _db_opens_cleanly,
    _wal_reset_repair_hint,
    collect_state_db_stats,
    count_db_holders,
    is_sqlite_wal_reset_vulnerable,
    repair_state_db_schema,
    sqlite_source_id,
)
from hermes_state_gateway import SessionGatewayMixin
from hermes_state_maintenance import SessionMaintenanceMixin
from hermes_state_messages import SessionMessagesMixin
from hermes_state_portability import SessionPortabilityMixin
from hermes_state_schema import SessionSchemaMixin, is_lock_error, write_meta
from hermes_state_search import SessionSearchMixin, runtime_capabilities
from hermes_state_sessions import SessionSessionsMixin
from hermes_state_telegram import SessionTelegramMixin
from hermes_state_titles import SessionTitlesMixin
from hermes_state_usage import SessionUsageMixin, TokenQueue, apply_token_batch

logger = logging.getLogger("hermes_state")

SQLITE_HEADER = b"SQLite format 3\x00"
SIDECAR_SUFFIXES = ("-wal", "-shm", "-journal")
FILE_MODE = 0o600

WRITE_BUDGET_SECONDS = 20.0
# Jitter of the whole-callback retry: short sleeps while contention is likely
# brief, longer ones once it has lasted; random so that writers spread out.
EARLY_RETRY_WINDOW = 2.0
EARLY_JITTER = (0.02, 0.15)
LATE_JITTER = (0.25, 1.0)
# Polling of the cross-process writer lock. Every hand-over between processes
# costs the new holder a reload of its page cache, so waiters poll every 1-4 ms
# and a busy writer keeps short bursts: measured 0.90-0.97 of one process's
# throughput with four, against 0.85-0.89 when polling every 0.2-2 ms.
FILE_LOCK_POLL = (0.001, 0.004)
WRITER_BUSY_TIMEOUT = 0.1
# With automatic checkpoints off, a PASSIVE checkpoint runs under the writer
# lock every this many commits of one connection.
CHECKPOINT_EVERY_COMMITS = 500


class StoreLockedError(sqlite3.OperationalError):
    """The store stayed locked by another writer for the whole write budget."""


# ---------------------------------------------------------------------------
# Journal policy
# ---------------------------------------------------------------------------

JournalPolicy = namedtuple("JournalPolicy", "mode writer_lock autocheckpoint reason")


def choose_journal_policy(version=sqlite3.sqlite_version_info, override=None):
    """The journal mode for this runtime, and why (see README, "Journal policy")."""
    override = (override if override is not None else os.environ.get("HERMES_STATE_JOURNAL", "")).strip().lower()
    label = "SQLite " + ".".join(map(str, version[:3]))
    if override == "delete":
        return JournalPolicy("delete", True, None, "HERMES_STATE_JOURNAL=delete: rollback journal")
    if override not in ("", "wal"):
        raise ValueError(f"HERMES_STATE_JOURNAL must be 'wal' or 'delete', not {override!r}")
    if sqlite_has_wal_reset_bug(version):
        return JournalPolicy("wal", True, 0, f"{label} has the WAL-reset race (3.7.0-3.51.2): WAL with "
                                             "every write and checkpoint under state.db.lock, "
                                             "automatic checkpoints off")
    return JournalPolicy("wal", False, None, f"{label} is free of the WAL-reset race: plain WAL")


# ---------------------------------------------------------------------------
# Cross-process writer lock
# ---------------------------------------------------------------------------

if sys.platform == "win32":
    import msvcrt

    def _try_lock_fd(fd):
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False

    def _unlock_fd(fd):
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def _try_lock_fd(fd):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _unlock_fd(fd):
        fcntl.flock(fd, fcntl.LOCK_UN)


class WriterFileLock:
    """An exclusive lock on `<store>.lock` shared by every process using the store.

    Reentrant for its owner (callers serialise their threads first); the OS
    drops it when the process dies, so a killed writer never leaves it held.
    """

    def __init__(self, path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        self._depth = 0

    def acquire(self, deadline):
        """Take the lock, polling until time.monotonic() reaches `deadline`; False if it does."""
        if self._depth:
            self._depth += 1
            return True
        while not _try_lock_fd(self._fd):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(remaining, random.uniform(*FILE_LOCK_POLL)))
        self._depth = 1
        return True

    def release(self):
        self._depth -= 1
        if self._depth == 0:
            _unlock_fd(self._fd)

    def close(self):
        os.close(self._fd)


# ---------------------------------------------------------------------------
# Self-repair of damaged files
# ---------------------------------------------------------------------------


def damage_reason(path):
    """'empty', 'zeroed' or 'notsqlite' for a file SQLite cannot use as a store; None if healthy."""
    with open(path, "rb") as handle:
        header = handle.read(len(SQLITE_HEADER))
    if not header:
        return "empty"
    if header == SQLITE_HEADER:
        return None
    if not header.strip(b"\x00"):
        return "zeroed"
    return "notsqlite"


def set_aside(path, reason):
    """Rename a damaged store and its sidecars to `<name>.<reason>-<time>-<pid>.bak[-wal|-shm]`.

    Sidecars keep their suffix on the backup's name, so opening the .bak file
    with SQLite still finds its own WAL. Returns the backup path. Deletes nothing.
    """
    path = Path(path)
    backup = path.with_name(f"{path.name}.{reason}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.bak")
    for suffix in ("",) + SIDECAR_SUFFIXES:
        source = Path(str(path) + suffix)
        if source.exists():
            target = Path(str(backup) + suffix)
            os.replace(source, target)
            os.chmod(target, FILE_MODE)
    return backup


def _create_private_file(path):
    """Create an empty file readable by its owner only (SQLite gives -wal/-shm the same mode)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        return
    os.close(fd)
    os.chmod(path, FILE_MODE)


class SessionDB(SessionSessionsMixin, SessionMessagesMixin, SessionTitlesMixin, SessionUsageMixin,
                SessionGatewayMixin, SessionTelegramMixin, SessionMaintenanceMixin, SessionSearchMixin,
                SessionSchemaMixin, SessionPortabilityMixin):
    """The agent's state store. Thread-safe; open one per process.

    `SessionDB(db_path=None, read_only=False)`: `db_path` defaults to
    `<hermes home>/state.db`. A read-only open runs no DDL and no repair.
    `connection_factory` replaces `sqlite3.connect` (tests use it to simulate
    runtimes without FTS5); `write_budget` is how long a write waits for a
    busy store before StoreLockedError.
    """

    def __init__(self, db_path=None, read_only=False, *, connection_factory=None,
                 write_budget=WRITE_BUDGET_SECONDS, journal=None):
        self.db_path = Path(db_path) if db_path is not None else get_default_db_path()
        self.read_only = read_only
        self.write_budget = float(write_budget)
        self.policy = choose_journal_policy(override=journal)
        self.repairs = []
        self._connect = connection_factory or sqlite3.connect
        self._idle_readers = queue.SimpleQueue()
        self._readers = []
        self._readers_lock = threading.Lock()
        self._write_lock = threading.RLock()
        self._writer = None
        self._file_lock = None
        self._commits = 0
        self.fts_caps = runtime_capabilities(self._connect)
        self._tokens = TokenQueue()
        self._closed = False
        if read_only:
            self._open_read_only()
        else:
            self._open_writable()
        self._atexit = _make_atexit_close(self)
        atexit.register(self._atexit)

    # -- opening and closing -------------------------------------------------

    def _open_read_only(self):
        if not self.db_path.exists():
            raise FileNotFoundError(f"no state store at {self.db_path}")
        self.stale_schema = self._stale_schema_report()
        if self.stale_schema:
            logger.info("store %s predates this release (%s); a writable open upgrades it",
                        self.db_path, "; ".join(self.stale_schema))

    def _open_writable(self):
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._file_lock = WriterFileLock(str(self.db_path) + ".lock")
        # Creating, repairing and upgrading the file happen under the writer lock,
        # so two processes opening a new store never see each other's half-made file.
        if not self._file_lock.acquire(time.monotonic() + self.write_budget):
            self._file_lock.close()
            raise StoreLockedError(f"state store {self.db_path} stayed locked for {self.write_budget:.0f}s "
                                   "while opening; nothing was written")
        try:
            self._repair_damaged_file()
            _create_private_file(self.db_path)
            self._writer = self._new_connection(str(self.db_path), uri=False,
                                                timeout=WRITER_BUSY_TIMEOUT)
            self._apply_journal_policy()
            self._init_schema()
            self._init_search()
        except BaseException:
            self._file_lock.release()
            self._close_connections()
            raise
        self._file_lock.release()
        self.stale_schema = []

    def _repair_damaged_file(self):
        if not self.db_path.exists():
            return
        reason = damage_reason(self.db_path)
        if reason is None:
            return
        backup = set_aside(self.db_path, reason)
        message = f"state store {self.db_path} was {reason}; kept it as {backup} and created a fresh store"
        self.repairs.append(message)
        logger.warning(message)

    def _new_connection(self, target, *, uri, timeout):
        conn = self._connect(target, uri=uri, timeout=timeout, isolation_level=None,
                             check_same_thread=False)
        conn.row_factory = sqlite3.Row
        return conn

    def _apply_journal_policy(self):
        conn = self._writer
        mode = conn.execute(JOURNAL_MODE_SQL).fetchone()[0].lower()
        if mode != self.policy.mode:
            mode = conn.execute(SET_JOURNAL_MODE_SQL.format(mode=self.policy.mode)).fetchone()[0].lower()
            if mode != self.policy.mode:
                logger.warning("journal mode of %s stays %s (wanted %s: another connection holds it)",
                               self.db_path, mode, self.policy.mode)
        conn.execute(SYNCHRONOUS_NORMAL_SQL)
        if self.policy.autocheckpoint is not None:
            conn.execute(SET_AUTOCHECKPOINT_SQL.format(pages=self.policy.autocheckpoint))

    def close(self):
        """Apply queued token counts, then close every connection. Safe to call twice."""
        if self._closed:
            return
        try:
            if self._writer is not None:
                self.flush_token_counts(timeout=self.write_budget)
        finally:
            self._closed = True
            atexit.unregister(self._atexit)
            self._close_connections()

    def _close_connections(self):
        # The last connection to close checkpoints the WAL; under the writer
        # lock that checkpoint cannot race another process's write.
        locked = self._file_lock is not None and self._file_lock.acquire(time.monotonic() + self.write_budget)
        try:
            with self._readers_lock:
                readers, self._readers = self._readers, []
            for conn in readers:
                conn.close()
            if self._writer is not None:
                self._writer.close()
                self._writer = None
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

    # -- the write path ------------------------------------------------------

    def _execute_write(self, fn, *, transaction=True):
        """Run `fn(conn)` in one BEGIN IMMEDIATE transaction and return its result.

        Rolls back on any error. On "database is locked"/"busy" the whole
        callback is retried after a random pause (20-150 ms for the first 2 s,
        then 250 ms-1 s) until `write_budget` runs out, then StoreLockedError.
        Queued token counts ride along in the same transaction. With
        `transaction=False` (VACUUM cannot run in one) only the locks are taken.
        """
        self._check_open()
        start = time.monotonic()
        deadline = start + self.write_budget
        if not self._write_lock.acquire(timeout=self.write_budget):
            raise self._locked_error(start, "another thread of this process kept writing")
        # Without a transaction (VACUUM) there is nothing for queued counts to ride in.
        batch = self._tokens.take() if transaction else []
        try:
            while True:
                try:
                    return self._write_once(fn, batch, deadline, transaction)
                except sqlite3.OperationalError as exc:
                    if isinstance(exc, StoreLockedError) or not is_lock_error(exc):
                        raise
                    elapsed = time.monotonic() - start
                    pause = random.uniform(*(EARLY_JITTER if elapsed < EARLY_RETRY_WINDOW else LATE_JITTER))
                    if elapsed + pause >= self.write_budget:
                        raise self._locked_error(start, str(exc)) from exc
                    time.sleep(pause)
        except BaseException:
            self._tokens.put_back(batch)
            raise
        finally:
            self._write_lock.release()

    def _write_once(self, fn, batch, deadline, transaction):
        use_file_lock = self.policy.writer_lock and self._file_lock is not None
        if use_file_lock and not self._file_lock.acquire(deadline):
            raise self._locked_error(deadline - self.write_budget, "another process held state.db.lock")
        try:
            if not transaction:
                return fn(self._writer)
            return self._in_transaction(self._writer, fn, batch)
        finally:
            if use_file_lock:
                self._file_lock.release()

    def _in_transaction(self, conn, fn, batch):
        conn.execute("BEGIN IMMEDIATE")
        changes = conn.total_changes
        try:
            apply_token_batch(conn, batch)
            result = fn(conn)
            self._maintain_search(conn, conn.total_changes - changes)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self._after_commit(conn)
        return result

    def _after_commit(self, conn):
        """Checkpoint now and then. The data is committed: nothing here may raise into
        the retry loop, which would run the callback a second time."""
        self._commits += 1
        if self.policy.autocheckpoint == 0 and self._commits % CHECKPOINT_EVERY_COMMITS == 0:
            try:
                conn.execute(CHECKPOINT_PASSIVE_SQL)
            except sqlite3.Error as exc:
                logger.info("checkpoint of %s deferred to the next one: %s", self.db_path, exc)

    def _locked_error(self, start, cause):
        waited = time.monotonic() - start
        return StoreLockedError(
            f"state store {self.db_path} was locked for {waited:.1f}s (budget {self.write_budget:.1f}s): "
            f"{cause}; no data was written")

    def _check_open(self):
        if self._closed:
            raise sqlite3.ProgrammingError("SessionDB is closed")
        if self.read_only:
            raise PermissionError(f"state store {self.db_path} was opened read-only")

    # -- the read path -------------------------------------------------------

    def _read_all(self, sql, params=()):
        """Run a read on a pooled read connection: reads never queue behind the writer."""
        conn = self._borrow_reader()
        try:
            return conn.execute(sql, params).fetchall()
        finally:
            self._idle_readers.put(conn)

    def _read_one(self, sql, params=()):
        rows = self._read_all(sql, params)
        return rows[0] if rows else None

    def _borrow_reader(self):
        if self._closed:
            raise sqlite3.ProgrammingError("SessionDB is closed")
        try:
            return self._idle_readers.get_nowait()
        except queue.Empty:
            pass
        # mode=ro: a read connection can never write, nor checkpoint on close.
        conn = self._new_connection(self.db_path.resolve().as_uri() + "?mode=ro", uri=True,
                                    timeout=self.write_budget)
        with self._readers_lock:
            self._readers.append(conn)
        return conn

    def _read_value(self, sql, params=()):
        row = self._read_one(sql, params)
        return None if row is None else row[0]

    def _update_rows(self, sql, params):
        """One-statement write; returns the number of rows it changed."""
        return self._execute_write(lambda conn: conn.execute(sql, params).rowcount)

    # -- state_meta ------------------------------------------------------------

    def get_meta(self, key):
        return self._read_value(SELECT_META_SQL, (key,))

    def set_meta(self, key, value):
        """Store `value` as text under `key`; None removes the key."""
        require_text("key", key)
        self._execute_write(lambda conn: write_meta(conn, key, value))

    def list_meta_prefix(self, prefix):
        """{key: value} for every key starting with `prefix` (case-sensitive)."""
        return {key: value for key, value in self._read_all(SELECT_META_PREFIX_SQL, prefix_bounds(prefix))}

    # -- backup ----------------------------------------------------------------

    def backup(self, out_path):
        """Write a zip of the whole home: the store as a consistent snapshot taken with
        SQLite's backup API (never a copy of a live file), plus every other file of
        the home, plus a manifest with each file's SHA-256. Created 0600."""
        out_path = Path(out_path).resolve()
        home = self.db_path.parent
        with tempfile.TemporaryDirectory(prefix="hermes-backup-") as scratch:
            snapshot = Path(scratch) / STATE_DB_FILENAME
            target = sqlite3.connect(snapshot)
            source = self._borrow_reader()
            try:
                source.backup(target)
                target.execute(SET_JOURNAL_MODE_SQL.format(mode="DELETE"))  # one self-contained file
            finally:
                self._idle_readers.put(source)
                target.close()
            members = [(snapshot, STATE_DB_FILENAME)] + [
                (path, path.relative_to(home).as_posix()) for path in _home_files(home, self.db_path, out_path)]
            return _write_backup_zip(out_path, members)


# ---------------------------------------------------------------------------
# Whole-home backup and restore (the "ops import"; session import is another entry point)
# ---------------------------------------------------------------------------

BACKUP_MANIFEST = "hermes_backup.json"
BACKUP_MAX_BYTES = 64 * 1024 ** 3


def _store_files(db_path):
    """The store and everything SQLite or this library keeps beside it."""
    return {Path(str(db_path) + suffix) for suffix in ("",) + SIDECAR_SUFFIXES + (".lock",)}


def _home_files(home, db_path, out_path):
    """Every regular file of the home except the live store, its sidecars and the archive itself."""
    skip = _store_files(db_path) | {out_path}
    for path in sorted(home.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.resolve() not in skip and path not in skip:
            yield path


def _sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_backup_zip(out_path, members):
    manifest = {"format": "hermes_state backup v1", "created_at": time.time(), "files": []}
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "wb") as raw, zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, name in members:
            archive.write(path, name)
            manifest["files"].append({"name": name, "bytes": path.stat().st_size, "sha256": _sha256_file(path)})
        archive.writestr(BACKUP_MANIFEST, json.dumps(manifest, indent=2))
    return {"archive": str(out_path), "files": [f["name"] for f in manifest["files"]]}


def _safe_member_name(name):
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts and ":" not in parts[0] \
        and not name.startswith(("/", "\\"))


def _read_backup_manifest(archive):
    """The archive's manifest, after checking every member is named safely and listed."""
    try:
        manifest = json.loads(archive.read(BACKUP_MANIFEST))
        files = {entry["name"]: entry for entry in manifest["files"]}
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"not a hermes_state backup: no readable {BACKUP_MANIFEST} ({exc})") from None
    names = set(archive.namelist()) - {BACKUP_MANIFEST}
    # A sidecar beside the restored store would be replayed by SQLite as its journal.
    sidecars = {STATE_DB_FILENAME + suffix for suffix in SIDECAR_SUFFIXES + (".lock",)}
    unsafe = [n for n in names | set(files) if not _safe_member_name(n) or n in sidecars]
    if unsafe:
        raise ValueError(f"backup refused: unsafe file names {sorted(unsafe)[:5]}")
    if names != set(files) or STATE_DB_FILENAME not in files:
        raise ValueError("backup refused: its files do not match its manifest, or it has no state.db")
    total = sum(archive.getinfo(name).file_size for name in names)
    if total > BACKUP_MAX_BYTES:
        raise ValueError(f"backup refused: it unpacks to {total} bytes; the limit is {BACKUP_MAX_BYTES}")
    return files


def restore_home(archive_path, db_path=None, *, force=False, write_budget=WRITE_BUDGET_SECONDS):
    """Put a whole backup of the home back: the store and every other file.

    Refuses to replace an existing store unless `force`; even then nothing is
    deleted: the old store is set aside as `state.db.pre-restore-<time>-<pid>.bak`
    and other replaced files move to `.pre-restore-<time>/`. Every file is checked
    against the manifest's SHA-256 and the store against SQLite before anything moves.
    """
    db_path = Path(db_path) if db_path is not None else get_default_db_path()
    home = db_path.parent
    if db_path.exists() and db_path.stat().st_size and not force:
        raise FileExistsError(f"{db_path} exists; restore replaces a whole home only with --force "
                              "(the current store is then kept as a .bak file)")
    home.mkdir(parents=True, exist_ok=True)
    lock = WriterFileLock(str(db_path) + ".lock")
    if not lock.acquire(time.monotonic() + write_budget):
        lock.close()
        raise StoreLockedError(f"state store {db_path} is being written; restore waited {write_budget:.0f}s")
    try:
        if not zipfile.is_zipfile(archive_path):
            raise ValueError(f"backup refused: {archive_path} is not a zip archive")
        with zipfile.ZipFile(archive_path) as archive, \
                tempfile.TemporaryDirectory(prefix=".restore-", dir=home) as scratch:
            files = _read_backup_manifest(archive)
            for name, entry in files.items():
                archive.extract(name, scratch)
                if _sha256_file(Path(scratch) / name) != entry["sha256"]:
                    raise ValueError(f"backup refused: {name} does not match its SHA-256")
            _check_restored_store(Path(scratch) / STATE_DB_FILENAME)
            return _swap_in(Path(scratch), files, db_path)
    finally:
        lock.release()
        lock.close()


def _check_restored_store(path):
    if damage_reason(path) is not None:
        raise ValueError("backup refused: its state.db is not a SQLite database")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        verdict = conn.execute(QUICK_CHECK_SQL).fetchone()[0]
    finally:
        conn.close()
    if verdict != "ok":
        raise ValueError(f"backup refused: its state.db fails quick_check ({verdict})")


def _swap_in(scratch, files, db_path):
    home, moved, stamp = db_path.parent, [], time.strftime("%Y%m%d-%H%M%S")
    if db_path.exists():
        moved.append(str(set_aside(db_path, "pre-restore")))
    for name in files:
        target = db_path if name == STATE_DB_FILENAME else home / name
        if target.exists() and name != STATE_DB_FILENAME:
            kept = home / f".pre-restore-{stamp}" / name
            kept.parent.mkdir(parents=True, exist_ok=True)
            os.replace(target, kept)
            moved.append(str(kept))
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(scratch / name, target)
    os.chmod(db_path, FILE_MODE)
    return {"restored": sorted(files), "moved_aside": moved, "db_path": str(db_path)}


def _make_atexit_close(db):
    ref = weakref.ref(db)

    def close_at_exit():
        live = ref()
        if live is not None:
            live.close()

    return close_at_exit


class AsyncSessionDB:
    """A SessionDB for asyncio code: every method call runs in a worker thread
    and is awaited, so a busy store never blocks the event loop. Attributes that
    are not methods are returned as they are. No method returns a live cursor,
    so nothing crosses threads unsafely."""

    def __init__(self, db):
        self._db = db

    def __getattr__(self, name):
        attr = getattr(self._db, name)
        if not callable(attr):
            return attr

        async def in_thread(*args, **kwargs):
            # The caller's context (a per-task home override) goes along, as asyncio.to_thread does.
            call = functools.partial(contextvars.copy_context().run, attr, *args, **kwargs)
            return await asyncio.get_running_loop().run_in_executor(None, call)

        return in_thread


if __name__ == "__main__":
    from hermes_state_cli import main

    sys.exit(main())
