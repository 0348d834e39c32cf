"""The store's locks: the cross-process writer lock and the registry of our own connections.

Owns `state.db.lock` (the lock every writer of ours takes for a write, a checkpoint and an open
that creates or repairs; the OS releases it when a process dies), the thread-side `CallerLock`
behind `SessionDB._lock`, the per-process count of our connections to each store file (what a
close and a restore ask before they touch the file), and the one raw access to a store file we
allow. Never opens the live store or its sidecars except through SQLite or `_raw_store_access`
(FIELD-INCIDENTS 71418: closing any descriptor of a file drops every POSIX lock this process holds
on it); never composes SessionDB. Kept apart from hermes_state.py because it is one concern that
the backup, restore and repair code beside SessionDB all lean on.
"""

import logging
import os
import sqlite3
import sys
import threading
import time
import types
from pathlib import Path

from hermes_state_common import FILE_MODE, SIDECAR_SUFFIXES
from hermes_state_errors import StoreLockedError

logger = logging.getLogger("hermes_state")

WRITE_BUDGET_SECONDS = 20.0
# Polling of the cross-process writer lock. Every hand-over between processes costs the new holder
# a reload of its page cache, so waiters poll every 1-4 ms and a busy writer keeps short bursts:
# measured 0.90-0.97 of one process's throughput with four, against 0.85-0.89 when polling every
# 0.2-2 ms.
FILE_LOCK_POLL = (0.001, 0.004)
WRITER_BUSY_TIMEOUT = 0.1


def _set_busy_timeout(conn, seconds):
    conn.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")


# -- cross-process writer lock --------------------------------------------------------------------

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
    """An exclusive lock on `<store>.lock` for every process using the store; the OS drops it when
    one dies.

    A process's WriterFileLocks on one file share one descriptor, closed with the last of them:
    where flock is emulated with fcntl locks (NFS, some Unixes), closing a second descriptor would
    drop the first one's lock. A thread lock orders the process's own users. Reentrant for its
    owner (callers serialise their threads).
    """

    def __init__(self, path):
        self.path = Path(path)
        self._file = _attach_lock_file(self.path)
        self._depth = 0

    def acquire(self, deadline):
        """Take the lock, polling until time.monotonic() reaches `deadline`; False if it does."""
        if self._depth:
            self._depth += 1
            return True
        if not self._file.turn.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        while not _try_lock_fd(self._file.fd):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._file.turn.release()
                return False
            import random  # here, not at import: only a wait for the lock needs it
            time.sleep(min(remaining, random.uniform(*FILE_LOCK_POLL)))
        self._depth = 1
        return True

    def release(self):
        self._depth -= 1
        if self._depth == 0:
            _unlock_fd(self._file.fd)
            self._file.turn.release()

    def close(self):
        if self._depth:
            self._depth = 1
            self.release()
        shared = self._file
        with _lock_files_guard:
            shared.users -= 1
            if shared.users == 0:
                if _lock_files.get(shared.key) is shared:  # a forked child forgot it already
                    del _lock_files[shared.key]
                os.close(shared.fd)


# (st_dev, st_ino) -> one descriptor of that lock file for the process, and whose turn it is
_lock_files = {}
_lock_files_guard = threading.Lock()


def _attach_lock_file(path):
    with _lock_files_guard:
        shared = _lock_files.get(_file_key(path))
        if shared is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
            stat = os.fstat(fd)
            key = (stat.st_dev, stat.st_ino)
            shared = _lock_files[key] = types.SimpleNamespace(
                fd=fd, key=key, users=0, turn=threading.Lock())
        shared.users += 1
        return shared


def _take_store_lock(db_path, budget, refusal):
    """`db_path`'s WriterFileLock, held; StoreLockedError(refusal), holding nothing, after `budget`
    s."""
    lock = WriterFileLock(str(db_path) + ".lock")
    if not lock.acquire(time.monotonic() + budget):
        lock.close()
        raise StoreLockedError(refusal)
    return lock


# -- locks we never break: our connections per file, and the one raw access ----------------------
# On POSIX, closing any descriptor of a file drops every fcntl lock this process holds on it, the
# locks of SQLite's own connections included (sqlite.org/howtocorrupt.html, 2.2). So the store and
# its sidecars are opened by SQLite alone, except by _raw_store_access while this process holds no
# connection of ours to the file (it holds the registry's lock from the check to the close, so that
# none can open meanwhile).

_held_files = {}  # (st_dev, st_ino) -> our open SQLite connections to that file
_held_files_guard = threading.RLock()


def _file_key(path):
    """(st_dev, st_ino) of `path`, or None when there is no such file."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_dev, stat.st_ino)


def _hold(path):
    """Count one more connection of ours to `path`, before it opens; returns what _release takes."""
    key = _file_key(path)
    if key is not None:
        with _held_files_guard:
            _held_files[key] = _held_files.get(key, 0) + 1
    return key


def _release(key):
    with _held_files_guard:
        left = _held_files.pop(key, 0) - 1
        if left > 0:
            _held_files[key] = left


def _store_of(path):
    """The store a sidecar path belongs to; a path that is no sidecar, unchanged."""
    path = str(path)
    return next((path[:-len(suffix)] for suffix in SIDECAR_SUFFIXES if path.endswith(suffix)), path)


def _connections_held(path):
    """How many SQLite connections this process holds to `path` (a store or one of its sidecars)."""
    with _held_files_guard:
        return sum(_held_files.get(_file_key(p), 0) for p in {str(path), _store_of(path)})


def _forget_after_fork():
    """A forked child holds none of its parent's fcntl locks, connections or lock-file turns."""
    global _held_files_guard, _lock_files_guard
    _held_files.clear()
    _lock_files.clear()
    _held_files_guard, _lock_files_guard = threading.RLock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _raw_store_access(path, flags, use):
    """`use(fd)` on a plain descriptor of a store file, closed before returning; None, opening
    nothing, while this process holds a SQLite connection to the file or its store. The product's
    only such open."""
    with _held_files_guard:
        if _connections_held(path):
            return None
        fd = os.open(path, flags | getattr(os, "O_BINARY", 0), FILE_MODE)
        try:
            return use(fd)
        finally:
            os.close(fd)


def _use_read_only(path, use, flags=""):
    """`use(conn)` on a read-only SQLite connection to `path`, counted as ours until closed; None
    when SQLite says the file is not a database (SQLITE_NOTADB; older ones: "encrypted or is not a
    database")."""
    key = _hold(path)
    try:
        conn = sqlite3.connect(Path(path).resolve().as_uri() + "?mode=ro" + flags, uri=True,
                               timeout=WRITE_BUDGET_SECONDS)
        try:
            return use(conn)
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        if "not a database" not in str(exc):
            raise
        return None
    finally:
        _release(key)


class CallerLock:
    """`SessionDB._lock`: what hermes-agent holds around SQL it runs on `SessionDB._conn`.

    Takes the write path's RLock (our own methods may run inside it) and state.db.lock, which every
    write of ours takes on every journal policy, so a caller's statements never interleave with
    another process's write or checkpoint (a read-modify-write loses nothing, a caller's BEGIN meets
    no "database is locked"). While held, the writer waits out a busy store for the whole budget
    (the caller has no retry loop); a transaction the caller left open is rolled back when the
    outermost hold ends.
    """

    def __init__(self, db):
        self._db = db
        self._depth = 0
        self._held_file_lock = self._open_before = False

    def acquire(self, blocking=True, timeout=-1):
        """Take the lock; False if `timeout` (or not `blocking`) ran out. StoreLockedError if the
        other processes' lock stays held for the write budget."""
        db = self._db
        if not db._write_lock.acquire(blocking, timeout):
            return False
        try:
            if self._depth == 0 and db._writer is not None:
                self._held_file_lock = db._take_file_lock(time.monotonic(), db.write_budget)
                self._open_before = db._writer.in_transaction
                _set_busy_timeout(db._writer, db.write_budget)
            self._depth += 1
        except BaseException:
            db._write_lock.release()
            raise
        return True

    def release(self):
        db, writer = self._db, self._db._writer
        try:
            if self._depth == 1 and writer is not None:
                try:
                    if writer.in_transaction and not self._open_before:
                        logger.warning("a caller left a transaction open on %s; rolled it back",
                                       db.db_path)
                        writer.execute("ROLLBACK")
                    _set_busy_timeout(writer, WRITER_BUSY_TIMEOUT)
                finally:
                    if self._held_file_lock:
                        self._held_file_lock = False
                        db._file_lock.release()
        finally:
            self._depth -= 1
            db._write_lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc_info):
        self.release()
