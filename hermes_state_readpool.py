"""SessionDB's read path: a pool of read-only connections per handle, and when to stop trusting an
immutable read.

Owns how a read borrows a connection (reads never queue behind the writer: each runs on a pooled
`mode=ro` connection of its own), the separate pool searches read the index from, giving back,
draining, and the file signature that tells an immutable read its file changed. A read that meets
damage outside the search index is noted in hermes_state_health. Never writes, never opens a
writer, and never composes SessionDB. hermes-agent 0.22 keeps its read-connection budgets under
this name; ours bounds readers per handle by the threads that read at once, and needs none.

Relies on (SessionDB): `_check_open`, `_new_connection`, `_idle_readers`, `_idle_index_readers`,
`_readers`, `_readers_lock`, `_immutable_readers`, `_immutable_as_seen`, `_reader_flags`,
`write_budget`, `db_path`, and `_opening`, `_writer` and `_write_lock` for the open's reads
(and sets `_writer_busy_ms` while it lends the writer).
"""

import logging
import os
import queue
import sqlite3

from hermes_state_common import SIDECAR_SUFFIXES
from hermes_state_health import note_store_failure

logger = logging.getLogger("hermes_state")


def _file_signature(path):
    """What shows a store file changed, read without opening it: its inode, size and time, and
    which of its sidecars exist."""
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns,
            tuple(os.path.lexists(f"{path}{suffix}") for suffix in SIDECAR_SUFFIXES))


class SessionReadPoolMixin:
    """Pooled read connections of a SessionDB."""

    def _with_reader(self, use, pool=None):
        """`use(conn)` on a pooled read connection: reads never queue behind the writer. Searches
        read the index from their own `pool` (_idle_index_readers): its pages stay in those
        connections' caches instead of being pushed out by the rows every other read brings in (a
        phrase at 100k messages: 10.4 -> 9.9 ms)."""
        pool = self._idle_readers if pool is None else pool
        conn = self._borrow_reader(pool)
        try:
            return use(conn)
        except sqlite3.DatabaseError as exc:
            # A replica's connection (hermes_state_replica) may read once more on a fresh one.
            if not getattr(conn, "reopen_after", lambda error: False)(exc):
                note_store_failure(self.db_path, exc)
                raise
            return use(conn)
        finally:
            self._return_reader(conn, pool)

    def _read_all(self, sql, params=(), pool=None):
        return self._with_reader(lambda conn: conn.execute(sql, params).fetchall(), pool)

    def _read_one(self, sql, params=()):
        return next(iter(self._read_all(sql, params)), None)

    def _read_value(self, sql, params=()):
        return next((row[0] for row in self._read_all(sql, params)), None)

    def _borrow_reader(self, pool=None):
        self._check_open(writing=False)
        if self._opening and self._writer is not None:
            self._write_lock.acquire()  # (the background checkpointer may be running already)
            if not self._writer.in_transaction:
                # The open's own reads (its data gates, a sweep left to finish) go through the
                # writer: no other thread has the handle yet, and a reader made for them cost
                # every open a connection and a parse of the whole schema. Readers are made when
                # first used. Inside a transaction a read must not see its uncommitted rows.
                # Lent, it waits for a lock as a reader does: its own short wait is for writes,
                # which the write path retries (in a rollback journal a read waits for commits).
                self._writer_busy_ms = self._writer.execute("PRAGMA busy_timeout").fetchone()[0]
                self._writer.execute(f"PRAGMA busy_timeout = {int(self.write_budget * 1000)}")
                return self._writer
            self._write_lock.release()
        if self._reader_flags and _file_signature(self._immutable_as_seen[0]) != \
                self._immutable_as_seen[1]:
            self._stop_reading_immutable()
        try:
            return (self._idle_readers if pool is None else pool).get_nowait()
        except queue.Empty:
            pass
        # mode=ro: a read connection can never write, nor checkpoint on close.
        uri = self.db_path.resolve().as_uri() + "?mode=ro" + self._reader_flags
        conn = self._new_connection(uri, uri=True, timeout=self.write_budget)
        if self._reader_flags:
            self._immutable_readers.add(conn)
        with self._readers_lock:
            self._readers.append(conn)
        return conn

    def _return_reader(self, conn, pool=None):
        if conn is self._writer:  # lent by an open (_borrow_reader)
            try:
                conn.execute(f"PRAGMA busy_timeout = {self._writer_busy_ms}")
            finally:
                self._write_lock.release()
            return
        with self._readers_lock:
            if conn not in self._readers:
                return  # close() closed it while it was lent
        if self._reader_flags or conn not in self._immutable_readers:
            (self._idle_readers if pool is None else pool).put(conn)
        else:
            conn.close()  # an immutable reader of a file that has changed since

    def _stop_reading_immutable(self):
        """The file an immutable read trusts has changed (another user or mount wrote it): SQLite
        would read torn pages or miss its WAL, so every reader from now on reads it as any other."""
        logger.info("store %s changed while read as immutable; reading it normally", self.db_path)
        self._reader_flags = ""
        self._drain_idle_readers()

    def _drain_idle_readers(self):
        """Close and forget every idle reader of both pools."""
        for pool in (self._idle_readers, self._idle_index_readers):
            while True:
                try:
                    pool.get_nowait().close()
                except queue.Empty:
                    break
