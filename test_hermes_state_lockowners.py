"""Who holds a store's write lock, read off /proc/locks while real processes hold real locks."""

import os
import sqlite3
import sys
import textwrap
import unittest

from hermes_state_lockowners import (
    log_write_lock_holders, parse_proc_locks, state_db_write_lock_holders,
)
from test_support import REPO, TempDirTestCase

HAS_PROC_LOCKS = sys.platform.startswith("linux") and os.path.exists("/proc/locks")

# Takes SQLite's write lock on the store argv[1] (journal mode argv[2]), prints "held", keeps it
# until its stdin closes.
HOLD_WRITE = textwrap.dedent("""
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("PRAGMA journal_mode=" + sys.argv[2])
    conn.execute("CREATE TABLE IF NOT EXISTS t (x)")
    conn.execute("BEGIN IMMEDIATE")
    print("held", flush=True)
    sys.stdin.readline()
""")
# Holds our writer lock on the store argv[2] (its `<store>.lock`), with the repo at argv[1].
HOLD_OUR_WRITER_LOCK = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from hermes_state_lockguard import WriterFileLock
    lock = WriterFileLock(sys.argv[2] + ".lock")
    assert lock.acquire(time.monotonic() + 10)
    print("held", flush=True)
    sys.stdin.readline()
""")


class Parsing(unittest.TestCase):

    SAMPLE = textwrap.dedent("""\
        1: POSIX  ADVISORY  WRITE 4242 fe:00:2147124 120 120
        2: POSIX  ADVISORY  READ 4242 fe:00:2147124 123 123
        3: POSIX  ADVISORY  WRITE 77 fe:00:2147136 1073741825 1073741825
        3: -> POSIX  ADVISORY  WRITE 78 fe:00:2147136 1073741825 1073741825
        4: OFDLCK ADVISORY  WRITE -1 fe:00:2147124 128 128
        5: FLOCK  ADVISORY  WRITE 90 fe:00:2147777 0 EOF
        6: POSIX  ADVISORY  WRITE 91 fe:00:9999999 120 120
        7: POSIX  ADVISORY  WRITE 92 fe:00:2147136 1073741826 1073742335
        8: POSIX  ADVISORY  WRITE 93 fe:00:2147124 125 125
        9: POSIX  ADVISORY  WRITE x fe:00:2147124 120 120
        garbage
    """)

    def test_write_locks_on_the_store_s_files_are_named_by_kind(self):
        dev = os.makedev(0xfe, 0x00)
        inodes = {(dev, 2147124): "-shm", (dev, 2147136): "", (dev, 2147777): ".lock"}
        self.assertEqual(parse_proc_locks(self.SAMPLE, inodes), [
            (4242, "WAL write", "-shm"),
            (77, "RESERVED", ""),
            (-1, "shm dead-man switch", "-shm"),
            (90, "hermes_state writer", ".lock"),
            (92, "SHARED range", ""),
            (93, "WAL read slot 2", "-shm"),
        ])

    def test_nothing_watched_nothing_found(self):
        self.assertEqual(parse_proc_locks(self.SAMPLE, {}), [])


@unittest.skipUnless(HAS_PROC_LOCKS, "lock owners are read from /proc/locks on Linux")
class LiveLocks(TempDirTestCase):

    def hold(self, code, *args):
        release = self.held_by_another_process(code, *args)
        return release.pid, release

    def test_a_wal_writer_is_named_as_the_holder_of_the_wal_write_lock(self):
        path = self.tmp / "state.db"
        pid, release = self.hold(HOLD_WRITE, path, "WAL")
        self.assertEqual(state_db_write_lock_holders(path),
                         [f"PID {pid} holds WAL write lock on state.db-shm"])
        release()
        self.assertEqual(state_db_write_lock_holders(path), [])

    def test_a_rollback_journal_writer_is_named_as_the_holder_of_reserved(self):
        path = self.tmp / "state.db"
        pid, _ = self.hold(HOLD_WRITE, path, "DELETE")
        self.assertIn(f"PID {pid} holds RESERVED lock on state.db", state_db_write_lock_holders(path))

    def test_a_process_holding_our_writer_lock_is_named(self):
        path = self.tmp / "state.db"
        sqlite3.connect(path).close()
        pid, _ = self.hold(HOLD_OUR_WRITER_LOCK, REPO, path)
        self.assertEqual(state_db_write_lock_holders(path),
                         [f"PID {pid} holds hermes_state writer lock on state.db.lock"])

    def test_the_warning_names_the_holders_or_says_none_was_left(self):
        path = self.tmp / "state.db"
        with self.assertLogs("hermes_state", "WARNING") as logs:
            log_write_lock_holders(path, 20.0)
        self.assertEqual(logs.records[0].getMessage(), "state.db write lock unavailable for 20s: no"
                         " write lock held at the deadline (released just before)")
        pid, _ = self.hold(HOLD_WRITE, path, "WAL")
        with self.assertLogs("hermes_state", "WARNING") as logs:
            log_write_lock_holders(path, 5)
        self.assertIn(f"PID {pid} holds WAL write lock", logs.records[0].getMessage())


if __name__ == "__main__":
    unittest.main()
