"""The doctor and repair helpers hermes-agent imports from hermes_state, on real damaged stores."""

import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
import unittest
from pathlib import Path

import hermes_state
import hermes_state_repair
from hermes_state import SessionDB
from hermes_state_common import DEFERRED_INDEX_SQL, DEFERRED_INDEXES, SCHEMA_SQL
from hermes_state_dbfile import collect_state_db_stats, count_db_holders
from hermes_state_repair import _backup_db_file, _db_opens_cleanly, repair_state_db_schema
from hermes_state_holders import open_descriptors
from test_support import HAS_FTS5, REPO, TempDirTestCase, require

# A schema entry to duplicate: our word index's, or where SQLite has no FTS5 (no such table) a plain table's.
DUPLICATED = "messages_fts" if HAS_FTS5 else "state_meta"

HAS_PROC = os.path.isdir("/proc/self/fd")


class DoctorTestCase(TempDirTestCase):

    def store(self, name="state.db", messages=30):
        path = self.tmp / name
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            for i in range(messages):
                db.append_message("s", "user", f"hello world message {i}")
        return path

    def damage(self, path, *statements):
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA writable_schema=ON")
        for sql in statements:
            conn.execute(sql)
        conn.commit()
        conn.close()

    def break_word_index(self, path):
        """Damage the word index's structure record so that FTS5 refuses it. SQLite 3.53 reads a zeroed
        record as an empty index (no damage at all), so a record of no valid length is written there."""
        self.damage(path, "UPDATE messages_fts_data SET block = X'0000' WHERE id = 10")
        if _db_opens_cleanly(path) is None:
            self.damage(path, "UPDATE messages_fts_data SET block = X'00000000ffff' WHERE id = 10")

    def message_count(self, path):
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
        finally:
            conn.close()

    def backups(self):
        return sorted(p.name for p in self.tmp.iterdir() if ".malformed-backup-" in p.name)

    def damaged_store(self):
        """A store whose schema does not parse (a duplicate entry), which dedup_schema repairs."""
        path = self.store()
        self.damage(path, f"INSERT INTO sqlite_master SELECT * FROM sqlite_master WHERE name = '{DUPLICATED}'")
        return path

    def start_repair(self, path, lock_wait, file_size_limit=None):
        """Another process running repair_state_db_schema(path); its report is its one line of output."""
        code = textwrap.dedent("""
            import json, resource, signal, sys
            sys.path.insert(0, sys.argv[1])
            import hermes_state_repair
            hermes_state_repair.REPAIR_LOCK_WAIT = float(sys.argv[3])
            if sys.argv[4] != "none":  # files may not grow past this: the disk is full, as the copy sees it
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[4]), resource.RLIM_INFINITY))
            print(json.dumps(hermes_state_repair.repair_state_db_schema(sys.argv[2])), flush=True)
        """)
        args = [sys.executable, "-c", code, str(REPO), str(path), str(lock_wait), str(file_size_limit or "none")]
        child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.addCleanup(lambda: child.poll() is None and (child.kill(), child.wait(10)))
        return child

    def report_of(self, child):
        out, err = child.communicate(timeout=60)
        self.assertEqual(child.returncode, 0, err)
        return json.loads(out)

    def hold_repair_lock(self, path):
        """Another process holding `<path>.repair.lock` until the returned function is called."""
        code = textwrap.dedent("""
            import fcntl, os, sys
            fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            print("held", flush=True)
            sys.stdin.readline()
        """)
        return self.held_by_another_process(code, f"{path}.repair.lock")


class Runtime(unittest.TestCase):

    def test_deferred_index_sql_is_one_script_of_the_same_indexes(self):
        conn = sqlite3.connect(":memory:")
        self.addCleanup(conn.close)
        conn.executescript(SCHEMA_SQL)
        conn.executescript(DEFERRED_INDEX_SQL)
        names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        self.assertTrue(set(DEFERRED_INDEXES) <= names)


class HealthProbe(DoctorTestCase):

    def test_a_healthy_store_opens_cleanly_and_the_probe_leaves_no_row(self):
        path = self.store()
        self.assertIsNone(_db_opens_cleanly(path))
        conn = sqlite3.connect(path)
        self.addCleanup(conn.close)
        self.assertEqual(conn.execute("SELECT COUNT(*) FROM sessions").fetchone()[0], 1)

    def test_a_missing_store_is_reported_and_not_created(self):
        self.assertIsNotNone(_db_opens_cleanly(self.tmp / "missing.db"))
        self.assertFalse((self.tmp / "missing.db").exists())

    def test_duplicate_schema_and_broken_search_index_are_reported(self):
        dup = self.store("dup.db")
        self.damage(dup, "INSERT INTO sqlite_master SELECT * FROM sqlite_master WHERE name = 'state_meta'")
        self.assertIn("malformed database schema", _db_opens_cleanly(dup))
        if HAS_FTS5:  # (no search index to break without it)
            fts = self.store("fts.db")
            self.break_word_index(fts)
            self.assertIsNotNone(_db_opens_cleanly(fts))
        junk = self.tmp / "junk.db"
        junk.write_bytes(b"not a database" * 100)
        self.assertIn("not a database", _db_opens_cleanly(junk))


class Repair(DoctorTestCase):

    def test_a_healthy_store_is_left_alone(self):
        path = self.store()
        self.assertEqual(repair_state_db_schema(path),
                         {"repaired": True, "strategy": "already_healthy", "backup_path": None, "error": None})
        self.assertEqual(self.backups(), [])
        self.assertIn("does not exist", repair_state_db_schema(self.tmp / "nope.db")["error"])

    def test_duplicate_schema_entries_go_after_a_private_backup_of_the_damage(self):
        path = self.store()
        self.damage(path, f"INSERT INTO sqlite_master SELECT * FROM sqlite_master WHERE name = '{DUPLICATED}'")
        with self.assertLogs("hermes_state", "WARNING"):
            report = repair_state_db_schema(path)
        self.assertEqual((report["repaired"], report["strategy"], report["error"]), (True, "dedup_schema", None))
        self.assertEqual([os.path.basename(report["backup_path"])], self.backups())
        if os.name == "posix":
            self.assertEqual(stat.S_IMODE(os.stat(report["backup_path"]).st_mode), 0o600)
        self.assertIn("malformed database schema", _db_opens_cleanly(report["backup_path"]))
        self.assertEqual(self.message_count(path), 30)
        with SessionDB(path) as db:
            self.assertEqual(len(db.search_messages("hello", limit=100)), 30)

    def test_a_search_index_that_rejects_writes_is_rebuilt_in_place(self):
        require(self, "fts5", "it breaks an FTS5 index")
        path = self.store()
        self.break_word_index(path)
        with self.assertLogs("hermes_state", "WARNING"):
            report = repair_state_db_schema(path, backup=False)
        self.assertEqual((report["strategy"], report["backup_path"]), ("rebuild_fts", None))
        with SessionDB(path) as db:
            db.append_message("s", "user", "hello after repair")
            self.assertEqual(len(db.search_messages("hello", limit=100)), 31)

    def test_an_unparsable_search_table_is_dropped_and_built_again_at_the_next_open(self):
        require(self, "fts5", "it breaks an FTS5 table's DDL")
        path = self.store()
        self.damage(path, "UPDATE sqlite_master SET sql = 'CREATE VIRTUAL TABLE messages_fts USING fts5(' "
                          "WHERE name = 'messages_fts'")
        with self.assertLogs("hermes_state", "WARNING") as logs:
            report = repair_state_db_schema(path)
        self.assertEqual((report["repaired"], report["strategy"]), (True, "drop_fts_rebuild"))
        self.assertEqual(len(logs.records), 4)  # each strategy tried, least destructive first
        self.assertEqual(self.message_count(path), 30)
        with SessionDB(path) as db:
            self.assertEqual(len(db.search_messages("world", limit=100)), 30)
            self.assertEqual(db.fts_layout(), "current")

    def test_a_file_sqlite_cannot_read_is_kept_byte_for_byte_and_reported(self):
        path = self.tmp / "state.db"
        path.write_bytes(b"garbage" * 1000)
        with self.assertLogs("hermes_state", "WARNING"):
            report = repair_state_db_schema(path)
        self.assertFalse(report["repaired"])
        self.assertIn("not a database", report["error"])
        self.assertEqual(Path(report["backup_path"]).read_bytes(), b"garbage" * 1000)
        self.assertEqual(path.read_bytes(), b"garbage" * 1000)


class RepairWhenTheBackupFails(DoctorTestCase):

    @unittest.skipUnless(hasattr(signal, "SIGXFSZ"), "needs POSIX file size limits")
    def test_a_backup_the_full_disk_refuses_aborts_the_repair_before_the_store_is_touched(self):
        path = self.damaged_store()
        before = path.read_bytes()
        # Half the store fits: SQLite's copy fails, then the byte copy fails part way.
        report = self.report_of(self.start_repair(path, 5, file_size_limit=len(before) // 2))
        self.assertEqual((report["repaired"], report["strategy"], report["backup_path"]), (False, None, None))
        self.assertTrue(report["error"].startswith("pre-repair backup refused; aborting schema repair"),
                        report["error"])
        self.assertIn("backup copy failed: [Errno 27] File too large", report["error"])
        self.assertEqual(path.read_bytes(), before)

    @unittest.skipUnless(hasattr(signal, "SIGXFSZ"), "needs POSIX file size limits")
    def test_a_backup_the_full_disk_refuses_leaves_no_half_written_copy_named_as_a_backup(self):
        """The report says no backup was made; a truncated file under a backup's name would say otherwise
        (and hold disk space that is short)."""
        path = self.damaged_store()
        report = self.report_of(self.start_repair(path, 5, file_size_limit=path.stat().st_size // 2))
        self.assertIsNone(report["backup_path"])
        self.assertEqual(self.backups(), [])

    def test_a_sidecar_that_cannot_be_copied_aborts_the_repair_and_says_why(self):
        path = self.tmp / "state.db"
        path.write_bytes(b"garbage" * 1000)
        (self.tmp / "state.db-wal").mkdir()  # where a file is expected: no copy, root or not
        report = repair_state_db_schema(path)
        self.assertEqual((report["repaired"], report["backup_path"]), (False, None))
        self.assertTrue(report["error"].startswith("pre-repair backup refused"), report["error"])
        self.assertIn("backup copy failed: [Errno 21] Is a directory", report["error"])
        self.assertEqual(path.read_bytes(), b"garbage" * 1000)


class RepairLock(DoctorTestCase):

    def wait_at_most(self, seconds):
        previous = hermes_state_repair.REPAIR_LOCK_WAIT
        hermes_state_repair.REPAIR_LOCK_WAIT = seconds
        self.addCleanup(setattr, hermes_state_repair, "REPAIR_LOCK_WAIT", previous)

    def test_a_damaged_store_is_left_alone_while_another_process_keeps_the_repair_lock(self):
        path = self.damaged_store()
        before = path.read_bytes()
        self.hold_repair_lock(path)
        self.wait_at_most(0.3)
        started = time.monotonic()
        report = repair_state_db_schema(path)
        self.assertGreaterEqual(time.monotonic() - started, 0.3)
        self.assertEqual((report["repaired"], report["strategy"], report["backup_path"]), (False, None, None))
        self.assertIn("another process holds the state.db repair lock", report["error"])
        self.assertEqual(path.read_bytes(), before)
        self.assertEqual(self.backups(), [])

    def test_a_store_healthy_after_another_process_kept_the_repair_lock_was_repaired_by_it(self):
        path = self.store()
        self.hold_repair_lock(path)
        self.wait_at_most(0.3)
        self.assertEqual(repair_state_db_schema(path), {"repaired": True, "strategy": "repaired_by_other_process",
                                                        "backup_path": None, "error": None})

    @unittest.skipUnless(HAS_PROC, "needs /proc to see that the other processes wait on the lock")
    def test_two_processes_repairing_at_once_wait_for_the_lock_and_repair_once(self):
        path = self.damaged_store()
        release = self.hold_repair_lock(path)
        repairs = [self.start_repair(path, 20) for _ in range(2)]
        lock_file = os.path.realpath(f"{path}.repair.lock")
        deadline = time.monotonic() + 30
        while not all(lock_file in {t for _, t in open_descriptors(child.pid)} for child in repairs):
            self.assertLess(time.monotonic(), deadline, "the repairs never reached the repair lock")
            self.assertTrue(all(child.poll() is None for child in repairs), "a repair ended without the lock")
            time.sleep(0.02)
        release()
        reports = sorted((self.report_of(child) for child in repairs), key=lambda r: str(r["strategy"]))
        self.assertEqual([(r["repaired"], r["strategy"]) for r in reports],
                         [(True, "already_healthy"), (True, "dedup_schema")])
        self.assertEqual(self.backups(), [os.path.basename(reports[1]["backup_path"])])
        self.assertIsNone(_db_opens_cleanly(path))
        self.assertEqual(self.message_count(path), 30)


class Backup(DoctorTestCase):

    def test_a_store_in_use_is_copied_by_sqlite_with_its_wal_content(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            db.append_message("s", "user", "only in the wal so far")
            copy, why = _backup_db_file(path)
            again, _ = _backup_db_file(path)
        self.assertIsNone(why)
        self.assertNotEqual(copy, again)
        self.assertEqual(self.message_count(copy), 1)
        self.assertFalse(os.path.exists(f"{copy}-wal"))

    @unittest.skipUnless(HAS_PROC, "needs /proc to see this process's descriptors")
    def test_an_unreadable_file_this_process_holds_is_not_copied_raw(self):
        path = self.tmp / "state.db"
        path.write_bytes(b"garbage" * 1000)
        held = sqlite3.connect(path)
        self.addCleanup(held.close)
        copy, why = _backup_db_file(path)
        self.assertIsNone(copy)
        self.assertIn("this process has it open", why)
        self.assertEqual(self.backups(), [])

    def test_doctor_reads_never_cancel_this_process_s_own_write_lock(self):
        """A descriptor closed on the store drops every POSIX lock of the process, SQLite's included."""
        path = self.store(messages=3)
        conn = sqlite3.connect(path, isolation_level=None)
        self.addCleanup(conn.close)
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute("BEGIN IMMEDIATE")
        self.assertIsNotNone(_backup_db_file(path)[0])
        self.assertEqual(collect_state_db_stats(path)["messages"], 3)
        count_db_holders(path)
        probe = textwrap.dedent("""
            import sqlite3, sys
            conn = sqlite3.connect(sys.argv[1], timeout=0, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                sys.exit("locked" if "locked" in str(exc) else str(exc))
            sys.exit("got the write lock")
        """)
        result = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=60)
        self.assertEqual(result.stderr.strip(), "locked")


class Reports(DoctorTestCase):

    def test_hermes_agent_finds_every_helper_on_hermes_state(self):
        for name in ("_backup_db_file", "_db_opens_cleanly", "_wal_reset_repair_hint", "collect_state_db_stats",
                     "count_db_holders", "is_sqlite_wal_reset_vulnerable", "repair_state_db_schema",
                     "sqlite_source_id", "DEFERRED_INDEX_SQL"):
            self.assertTrue(hasattr(hermes_state, name), name)


# Opens the store argv[1] (without reading it: its schema may not parse), prints "held", keeps it
# open until its stdin closes.
HOLD_FILE_OPEN = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1])
print("held", flush=True)
sys.stdin.readline()
"""
# Takes SQLite's write lock on the store argv[1] and keeps it until its stdin closes.
HOLD_WRITE_LOCK = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("held", flush=True)
sys.stdin.readline()
"""
# Exits with "locked" if the store argv[1] refuses a write at once, "wrote" if it takes one.
TRY_WRITE = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=0, isolation_level=None)
try:
    conn.execute("BEGIN IMMEDIATE")
except sqlite3.OperationalError as exc:
    sys.exit("locked" if "locked" in str(exc) else str(exc))
sys.exit("wrote")
"""


def another_process_writes(path):
    result = subprocess.run([sys.executable, "-c", TRY_WRITE, str(path)], capture_output=True,
                            text=True, timeout=60)
    return result.stderr.strip()


class LiveWriter(DoctorTestCase):

    def test_a_quiet_store_is_held_by_no_one(self):
        self.assertFalse(hermes_state_repair._live_writer_holds_db(self.store()))

    @unittest.skipUnless(HAS_PROC, "holders are read from /proc")
    def test_another_process_with_the_store_open_is_a_live_writer(self):
        path = self.store()
        release = self.held_by_another_process(HOLD_FILE_OPEN, path)
        self.assertTrue(hermes_state_repair._live_writer_holds_db(path))
        release()
        self.assertFalse(hermes_state_repair._live_writer_holds_db(path))

    def test_a_connection_of_this_process_that_holds_the_store_counts_too(self):
        path = self.store()
        # In WAL a connection holds the file between its transactions; a rollback journal's does not.
        with SessionDB(path, journal="wal") as db:
            db.create_session("t", "cli")
            self.assertTrue(hermes_state_repair._live_writer_holds_db(path))

    def test_a_file_sqlite_cannot_read_and_no_one_holds_is_free_for_repair(self):
        path = self.tmp / "state.db"
        path.write_bytes(b"garbage" * 1000)
        self.assertFalse(hermes_state_repair._live_writer_holds_db(path))

    @unittest.skipUnless(HAS_PROC, "holders are read from /proc")
    def test_a_repair_under_another_process_touches_nothing(self):
        path = self.damaged_store()
        before = path.read_bytes()
        self.held_by_another_process(HOLD_FILE_OPEN, path)
        with self.assertLogs("hermes_state", "ERROR"):
            report = repair_state_db_schema(path)
        self.assertEqual((report["repaired"], report["backup_path"]), (False, None))
        self.assertTrue(report["error"].startswith("a live writer still holds state.db"), report["error"])
        self.assertEqual(path.read_bytes(), before)
        self.assertEqual(self.backups(), [])


class ExclusiveGuard(DoctorTestCase):

    def test_while_the_guard_is_held_no_other_connection_can_write(self):
        path = self.store()
        with hermes_state_repair._exclusive_repair_db_guard(path) as (guard, error):
            self.assertIsNone(error)
            self.assertEqual(guard.execute("SELECT COUNT(*) FROM messages").fetchone(), (30,))
            self.assertEqual(another_process_writes(path), "locked")
            self.assertFalse(guard.in_transaction)
        self.assertEqual(another_process_writes(path), "wrote")

    def test_a_store_another_process_writes_to_is_not_taken(self):
        path = self.store()
        release = self.held_by_another_process(HOLD_WRITE_LOCK, path)
        with hermes_state_repair._exclusive_repair_db_guard(path) as (guard, error):
            self.assertIsNone(guard)
            self.assertIn("locked", str(error))
        release()

    def test_a_missing_store_is_not_created(self):
        with hermes_state_repair._exclusive_repair_db_guard(self.tmp / "none.db") as (guard, error):
            self.assertIsNone(guard)
            self.assertIsInstance(error, sqlite3.Error)
        self.assertFalse((self.tmp / "none.db").exists())


class RepairOnACopy(DoctorTestCase):

    def test_a_repair_that_fails_changes_nothing_and_leaves_no_scratch_copy(self):
        path = self.store()
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA journal_mode=DELETE")  # every page in the file itself
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'messages'").fetchone()[0]
        conn.close()
        with open(path, "r+b") as handle:  # the messages table's root page torn: nothing heals it
            handle.seek((root - 1) * page_size)
            handle.write(b"\xff" * 64)
        before = path.read_bytes()
        with self.assertLogs("hermes_state", "WARNING"):
            report = repair_state_db_schema(path)
        self.assertFalse(report["repaired"])
        self.assertEqual(path.read_bytes(), before)
        self.assertEqual(len(self.backups()), 1)
        self.assertFalse(any("repair-scratch" in name for name in os.listdir(self.tmp)))


class StructuralDamage(DoctorTestCase):

    def test_a_healthy_a_missing_and_a_search_index_damaged_store_are_not_structural(self):
        path = self.store()
        self.assertFalse(hermes_state_repair.state_db_has_structural_damage(path))
        self.assertFalse(hermes_state_repair.state_db_has_structural_damage(self.tmp / "none.db"))
        self.assertFalse((self.tmp / "none.db").exists())
        if HAS_FTS5:
            self.break_word_index(path)
            self.assertIsNotNone(_db_opens_cleanly(path))
            self.assertFalse(hermes_state_repair.state_db_has_structural_damage(path))

    def test_an_index_of_the_data_out_of_step_with_its_table_is_structural(self):
        path = self.store()
        self.damage(path, "UPDATE sqlite_master SET sql = 'CREATE INDEX idx_messages_session"
                          " ON messages(role, id)' WHERE name = 'idx_messages_session'")
        self.assertTrue(hermes_state_repair.state_db_has_structural_damage(path))

    def test_which_integrity_lines_name_the_data(self):
        structural = hermes_state_repair.integrity_damage_is_structural
        master = [(2, "table", "sessions"), (5, "table", "messages_fts_data"), (7, "table", "messages"),
                  (9, "table", "messages_fts_idx"), (0, "table", "messages_fts")]
        self.assertTrue(structural(["Tree 7 page 7 cell 0: invalid page number 99"], master))
        self.assertTrue(structural(["row 3 missing from index idx_messages_session"], master))
        self.assertTrue(structural(["Freelist: size is 3 but should be 4"], master))
        self.assertFalse(structural(["Tree 5 page 12: btreeInitPage() returns error code 11",
                                     "Tree 9 page 9 cell 2: 2nd reference to page 40"], master))
        self.assertFalse(structural(["row 3 missing from index messages_fts_idx",
                                     "Page 40 is never used", "Tree 77 page 3: unknown tree"], master))
        self.assertFalse(structural([], master))


class SmallContracts(unittest.TestCase):

    def test_schema_not_built_is_a_missing_table_or_column_only(self):
        not_built = hermes_state_repair._schema_not_built
        self.assertTrue(not_built(sqlite3.OperationalError("no such table: messages")))
        self.assertTrue(not_built(sqlite3.OperationalError("no such column: pinned")))
        self.assertFalse(not_built(sqlite3.OperationalError("database is locked")))
        self.assertFalse(not_built(sqlite3.DatabaseError("database disk image is malformed")))

    def test_durability_barriers_and_the_configured_synchronous_level(self):
        conn = sqlite3.connect(":memory:")
        self.addCleanup(conn.close)
        self.assertTrue(hermes_state_repair.apply_durability_barriers(conn))
        level = hermes_state_repair.synchronous_level
        self.assertEqual([level(v) for v in ("off", "Normal", "FULL", "extra", 3, "2", False)],
                         [0, 1, 2, 3, 3, 2, 0])
        self.assertEqual([level(v) for v in ("fast", 4, "-1", True, None)], [None] * 5)
        hermes_state_repair.apply_synchronous_setting(conn, "extra", db_label="kanban.db")
        self.assertEqual(conn.execute("PRAGMA synchronous").fetchone(), (3,))
        with self.assertLogs("hermes_state", "WARNING") as logs:
            hermes_state_repair.apply_synchronous_setting(conn, "fast", db_label="kanban.db")
        self.assertIn("kanban.db: database.synchronous='fast'", logs.output[0])
        self.assertEqual(conn.execute("PRAGMA synchronous").fetchone(), (3,))  # unchanged
