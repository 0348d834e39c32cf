"""hermes_state_health: the per-process note that a store is damaged, written by SessionDB and by
hermes-agent's readiness probe, on real damaged files."""

import sqlite3
import time

import hermes_state_health as health
from hermes_state import SessionDB
from hermes_state_health import (
    STORAGE_CORRUPT, STORAGE_OK, is_structural_corruption_error, mark_storage_corrupt,
    note_storage_error, reset_storage_state, storage_corrupt_reason, storage_state,
)
from test_support import TempDirTestCase, require


def damage_messages_table(path):
    """Overwrite the root page of the messages table: reading messages then fails as damaged."""
    conn = sqlite3.connect(path)
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'messages'").fetchone()[0]
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    conn.close()
    with open(path, "r+b") as handle:
        handle.seek((root - 1) * page_size)
        handle.write(b"\xff" * page_size)


class HealthTestCase(TempDirTestCase):

    def setUp(self):
        super().setUp()
        reset_storage_state()
        self.addCleanup(reset_storage_state)
        self.path = self.tmp / "state.db"


class Notes(HealthTestCase):

    def test_only_structural_damage_is_noted(self):
        damaged = sqlite3.DatabaseError("database disk image is malformed")
        self.assertTrue(is_structural_corruption_error(damaged))
        self.assertTrue(is_structural_corruption_error(sqlite3.DatabaseError("file is not a database")))
        for harmless in (sqlite3.DatabaseError("malformed database schema (x) - near 'y'"),
                         sqlite3.DatabaseError("fts5: corruption found in messages_fts"),
                         sqlite3.OperationalError("database is locked"),
                         ValueError("database disk image is malformed"), None):
            with self.subTest(error=harmless):
                self.assertFalse(is_structural_corruption_error(harmless))
                self.assertFalse(note_storage_error(self.path, harmless))
        self.assertEqual(storage_state(self.path), STORAGE_OK)
        self.assertIsNone(storage_corrupt_reason(self.path))
        self.assertTrue(note_storage_error(self.path, damaged))
        self.assertEqual(storage_state(self.path), STORAGE_CORRUPT)
        self.assertEqual((STORAGE_OK, STORAGE_CORRUPT), ("ok", "corrupt"))

    def test_a_note_keeps_the_first_reason_for_any_spelling_of_the_path_until_reset(self):
        with self.assertLogs("hermes_state", "ERROR") as logs:
            mark_storage_corrupt(self.path, "first")
            mark_storage_corrupt(self.tmp / "." / "state.db", "second")
        self.assertEqual(len(logs.records), 1)  # logged once, with what to do
        self.assertIn("sessions recover --source", logs.output[0])
        self.assertEqual(storage_corrupt_reason(str(self.path)), "first")
        self.assertEqual(storage_state(self.tmp / "other.db"), STORAGE_OK)
        with self.assertLogs("hermes_state", "ERROR"):
            mark_storage_corrupt(self.tmp / "other.db", "x")
        reset_storage_state(self.path)
        self.assertEqual(storage_state(self.path), STORAGE_OK)
        self.assertEqual(storage_state(self.tmp / "other.db"), STORAGE_CORRUPT)
        reset_storage_state()
        self.assertEqual(health._corrupt, {})


class SessionDBNotes(HealthTestCase):

    def make_damaged_store(self):
        with SessionDB(self.path) as db:
            db.create_session("s", "cli")
            for i in range(200):
                db.append_message("s", "user", f"message {i} " * 20)
        damage_messages_table(self.path)

    def test_a_read_that_meets_damage_notes_the_store_corrupt(self):
        self.make_damaged_store()
        with SessionDB(self.path, read_only=True) as db:
            self.assertEqual(storage_state(self.path), STORAGE_OK)
            with self.assertLogs("hermes_state", "ERROR"), self.assertRaises(sqlite3.DatabaseError):
                db.get_messages("s")
        self.assertEqual(storage_state(self.path), STORAGE_CORRUPT)
        self.assertIn("malformed", storage_corrupt_reason(self.path))

    def test_a_write_that_meets_damage_notes_the_store_corrupt(self):
        # WAL: the TRUNCATE checkpoint below is what makes the writer read the damaged page again.
        with SessionDB(self.path, journal="wal") as db:
            db.create_session("s", "cli")
            for i in range(200):
                db.append_message("s", "user", f"message {i} " * 20)
            other = sqlite3.connect(self.path, isolation_level=None)
            self.addCleanup(other.close)
            # Every page in the main file: again while our checkpointer thread's own checkpoint holds it off.
            while other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]:
                time.sleep(0.01)
            damage_messages_table(self.path)
            other.execute("UPDATE state_meta SET value = value")  # the writer drops its page cache
            with self.assertLogs("hermes_state", "ERROR"), self.assertRaises(sqlite3.DatabaseError):
                db.append_message("s", "user", "one more")
        self.assertEqual(storage_state(self.path), STORAGE_CORRUPT)

    def test_an_open_that_meets_damage_notes_the_store_corrupt(self):
        # The open reads the damaged messages pages only to index them.
        require(self, "fts5", "without an index to fill, the open never reads the damaged pages")
        self.make_damaged_store()
        with self.assertLogs("hermes_state", "ERROR"), self.assertRaises(sqlite3.DatabaseError):
            SessionDB(self.path)
        self.assertEqual(storage_state(self.path), STORAGE_CORRUPT)

    def test_a_busy_store_is_not_damage(self):
        with SessionDB(self.path, write_budget=0.2) as db:
            db.create_session("s", "cli")
            blocker = sqlite3.connect(self.path, isolation_level=None)
            self.addCleanup(blocker.close)
            blocker.execute("BEGIN IMMEDIATE")
            with self.assertRaises(sqlite3.OperationalError):
                db.create_session("t", "cli")
            blocker.execute("ROLLBACK")
        self.assertEqual(storage_state(self.path), STORAGE_OK)
