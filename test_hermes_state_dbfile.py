"""File-level facts of a store for doctor and backup: stats, holder counts and retired WAL
generations, on real stores held by real processes."""

import os
import sqlite3
import sys
import unittest

from hermes_state import SessionDB, choose_journal_policy
from hermes_state_dbfile import (
    RETIRED_GENERATION_DIR_SUFFIX, _connect_tracked_db, collect_state_db_stats, count_db_holders,
    iter_deleted_sqlite_sidecar_holders,
)
from hermes_state_holders import read_only_db_uri
from hermes_state_lockguard import _raw_store_access
from test_support import HAS_FTS5, HAS_TRIGRAM, TempDirTestCase

LINUX_PROC = sys.platform.startswith("linux") and os.path.isdir("/proc/self/fd")

# Opens the store argv[1] in WAL mode with a row in its WAL, prints "held", keeps it open until
# its stdin closes.
HOLD_WAL_OPEN = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1])
conn.execute("PRAGMA journal_mode=WAL")
conn.execute("PRAGMA wal_autocheckpoint=0")
conn.execute("CREATE TABLE IF NOT EXISTS t (x)")
conn.execute("INSERT INTO t VALUES (1)")
conn.commit()
print("held", flush=True)
sys.stdin.readline()
"""


class DbFileTestCase(TempDirTestCase):

    def store(self, messages=30):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            for i in range(messages):
                db.append_message("s", "user", f"hello world message {i}")
        return path

    def hold_open(self, path):
        release = self.held_by_another_process(HOLD_WAL_OPEN, path)
        return release.pid, release


class Stats(DbFileTestCase):

    def test_stats_snapshot_of_a_store_and_of_a_missing_one(self):
        path = self.store()
        stats = collect_state_db_stats(path)
        self.assertEqual((stats["messages"], stats["sessions"], stats["journal_mode"]),
                         (30, 1, choose_journal_policy().mode))
        self.assertEqual(stats["logical_size_bytes"], stats["page_count"] * stats["page_size"])
        # Our word and trigram indexes play the roles of hermes-agent's (where this SQLite keeps them); its
        # CJK index is not ours.
        self.assertEqual(stats["fts_tables"], {"messages_fts": HAS_FTS5, "messages_fts_trigram": HAS_TRIGRAM,
                                               "messages_fts_cjk": False})
        self.assertEqual((stats["fts_rebuild_pending"], stats["fts_rebuild_high_water"]), (False, None))
        self.assertIsNone(stats["fts_rebuild_deferral"])
        missing = collect_state_db_stats(self.tmp / "missing.db")
        self.assertEqual(set(missing), set(stats))
        self.assertEqual(missing["wal_size_bytes"], 0)
        self.assertIsNone(missing["sessions"])
        self.assertFalse((self.tmp / "missing.db").exists())

    def test_a_deferred_rebuild_hermes_agent_recorded_is_shown_and_a_bad_one_is_not(self):
        path = self.store(messages=1)
        conn = sqlite3.connect(path)
        conn.execute("INSERT INTO state_meta (key, value) VALUES ('fts_rebuild_deferral', ?)",
                     ('{"attempts": 3, "holder_pids": [42]}',))
        conn.commit()
        self.assertEqual(collect_state_db_stats(path)["fts_rebuild_deferral"],
                         {"attempts": 3, "holder_pids": [42]})
        conn.execute("UPDATE state_meta SET value = 'not json' WHERE key = 'fts_rebuild_deferral'")
        conn.commit()
        conn.close()
        self.assertIsNone(collect_state_db_stats(path)["fts_rebuild_deferral"])

    def test_hermes_agent_s_backup_leaves_out_folders_by_this_suffix(self):
        self.assertEqual(RETIRED_GENERATION_DIR_SUFFIX, ".retired-wal-")


class TrackedConnections(DbFileTestCase):

    def raw_read_runs(self, path):
        """True if a raw read of the store's header may run now (no connection of ours holds it)."""
        return _raw_store_access(path, os.O_RDONLY, lambda fd: os.read(fd, 16)) is not None

    def test_a_raw_open_waits_for_every_tracked_connection_to_close(self):
        path = self.store(messages=1)
        self.assertTrue(self.raw_read_runs(path))
        first = _connect_tracked_db(path)
        second = _connect_tracked_db(read_only_db_uri(path), tracking_path=path, uri=True)
        self.assertEqual(second.execute("SELECT COUNT(*) FROM messages").fetchone(), (1,))
        first.close()
        first.close()  # a second close releases nothing more
        self.assertFalse(self.raw_read_runs(path))
        second.close()
        self.assertTrue(self.raw_read_runs(path))

    def test_a_caller_s_connection_class_is_kept(self):
        class Rows(sqlite3.Connection):
            pass
        path = self.store(messages=1)
        conn = _connect_tracked_db(path, factory=Rows, timeout=1.0)
        self.assertIsInstance(conn, Rows)
        self.assertFalse(self.raw_read_runs(path))
        conn.close()
        self.assertTrue(self.raw_read_runs(path))

    def test_a_store_that_cannot_be_opened_leaves_nothing_counted(self):
        path = self.store(messages=1)
        with self.assertRaises(sqlite3.OperationalError):
            _connect_tracked_db(self.tmp / "no" / "such.db", tracking_path=path)
        self.assertTrue(self.raw_read_runs(path))


@unittest.skipUnless(LINUX_PROC, "holders are read from /proc on Linux")
class Holders(DbFileTestCase):

    def test_holders_are_counted_per_process_this_one_included(self):
        path = self.store()
        self.assertEqual(count_db_holders(path), 0)
        with SessionDB(path) as db:
            db.create_session("t", "cli")
            self.assertEqual(count_db_holders(path), 1)
            self.hold_open(path)
            self.assertEqual(count_db_holders(path), 2)

    def test_a_process_still_holding_a_deleted_wal_is_found_until_it_lets_go(self):
        path = self.tmp / "state.db"
        pid, release = self.hold_open(path)
        self.assertEqual(iter_deleted_sqlite_sidecar_holders(path), [])  # the live generation
        os.unlink(f"{path}-wal")
        os.unlink(f"{path}-shm")
        found = iter_deleted_sqlite_sidecar_holders(path)
        self.assertEqual(sorted(found), [(pid, f"{os.path.realpath(path)}-shm (deleted)"),
                                         (pid, f"{os.path.realpath(path)}-wal (deleted)")])
        release()
        self.assertEqual(iter_deleted_sqlite_sidecar_holders(path), [])

    def test_this_process_holding_a_wal_replaced_at_its_path_is_found_too(self):
        path = self.tmp / "state.db"
        conn = sqlite3.connect(path)
        self.addCleanup(conn.close)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (x)")
        conn.commit()
        os.unlink(f"{path}-wal")
        (self.tmp / "state.db-wal").write_bytes(b"")  # another generation now stands at the path
        self.assertIn((os.getpid(), f"{os.path.realpath(path)}-wal (deleted)"),
                      iter_deleted_sqlite_sidecar_holders(path))

if __name__ == "__main__":
    unittest.main()
