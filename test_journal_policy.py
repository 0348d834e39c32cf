"""SessionDB's journal policy, as hermes-agent 0.22 chooses it (docs/journal-policy.md).

A rollback journal where the SQLite has the WAL-reset race and on cross-VM filesystems, WAL elsewhere; a
store found in WAL where it is not wanted is switched only by an open that holds it alone; in WAL our
checkpoints (every CHECKPOINT_EVERY_COMMITS commits, once the writer goes quiet, at close) keep the main
file as current as an idle writer's commits, for readers of the main file alone (immutable=1, a copy of
state.db). Real files, real processes; run it under `make test-runtimes`' builds for the other side.
"""

import gc
import os
import shutil
import sqlite3
import time
import weakref
from unittest import mock

import hermes_state_lockguard
import hermes_state_wal
from hermes_state import SessionDB, choose_journal_policy
from hermes_state_common import sqlite_has_wal_reset_bug
from hermes_state_wal import CHECKPOINT_EVERY_COMMITS, IDLE_CHECKPOINT_DELAY
from test_support import TempDirTestCase

AFFECTED, FIXED = (3, 40, 1), (3, 53, 2)
HAS_BUG = sqlite_has_wal_reset_bug()

# Opens the store in WAL like a plugin or a fork would, reads once (which holds the file), and keeps it open.
HOLD_OPEN = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("SELECT count(*) FROM sessions").fetchone()
print("held", flush=True)
sys.stdin.read()
conn.close()
"""


def header_mode(path):
    """The journal mode the file's header says (bytes 18-19: 1 rollback journal, 2 WAL)."""
    with open(path, "rb") as handle:
        return {b"\x01\x01": "delete", b"\x02\x02": "wal"}[handle.read(20)[18:20]]


def immutable_sessions(path):
    """Session ids a reader of the main file alone sees (immutable=1: no lock, no -wal)."""
    conn = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
    try:
        return sorted(row[0] for row in conn.execute("SELECT id FROM sessions"))
    finally:
        conn.close()


def make_wal_store(path, sessions=("old",)):
    with SessionDB(path, journal="wal") as db:
        for session_id in sessions:
            db.create_session(session_id, "cli")
            db.append_message(session_id, "user", f"kept in {session_id}")


class ChoosingThePolicy(TempDirTestCase):

    def test_a_runtime_with_the_wal_reset_race_gets_a_rollback_journal_and_a_fixed_one_wal(self):
        affected, fixed = choose_journal_policy(AFFECTED, "", ""), choose_journal_policy(FIXED, "", "")
        self.assertEqual((affected.mode, affected.checkpoint), ("delete", "none"))
        self.assertIn("WAL-reset race", affected.reason)
        self.assertEqual((fixed.mode, fixed.autocheckpoint, fixed.checkpoint), ("wal", None, "automatic"))

    def test_an_asked_for_wal_on_an_affected_runtime_keeps_every_checkpoint_under_our_lock(self):
        policy = choose_journal_policy(AFFECTED, " WAL ", "")
        self.assertEqual((policy.mode, policy.autocheckpoint, policy.checkpoint), ("wal", 0, "locked"))
        self.assertIn("HERMES_STATE_JOURNAL=wal", policy.reason)

    def test_a_cross_vm_filesystem_gets_a_rollback_journal_even_when_wal_is_asked_for(self):
        for version in (AFFECTED, FIXED):
            for override in ("", "wal", "delete"):
                policy = choose_journal_policy(version, override, "", cross_vm=True)
                self.assertEqual((policy.mode, policy.checkpoint), ("delete", "none"))
        self.assertIn("cross-VM", choose_journal_policy(FIXED, "wal", "", cross_vm=True).reason)

    def test_external_checkpoints_on_a_cross_vm_filesystem_are_refused_naming_why(self):
        with self.assertRaisesRegex(ValueError, "HERMES_STATE_CHECKPOINT=external keeps WAL; .*cross-VM"):
            choose_journal_policy(FIXED, "", "external", cross_vm=True)

    def test_an_unknown_journal_is_refused_naming_the_variable(self):
        with self.assertRaisesRegex(ValueError, "HERMES_STATE_JOURNAL must be 'wal' or 'delete', not 'memory'"):
            choose_journal_policy(FIXED, "memory", "")

    def test_every_commit_is_synced_before_it_is_acknowledged_in_either_journal(self):
        # make test-faults' power cuts: WAL at NORMAL lost every commit since the last checkpoint, a
        # rollback journal at FULL its last commit (the -journal's unlink was not synced).
        for journal, level in (("delete", 3), ("wal", 2)):
            with SessionDB(self.tmp / f"{journal}.db", journal=journal) as db:
                self.assertEqual(db._writer.execute("PRAGMA synchronous").fetchone()[0], level, journal)

    def test_the_journal_is_read_from_the_environment_and_the_argument_wins(self):
        with mock.patch.dict(os.environ, {"HERMES_STATE_JOURNAL": "delete"}):
            with SessionDB(self.tmp / "env.db") as db:
                self.assertEqual(db.policy.mode, "delete")
            with SessionDB(self.tmp / "arg.db", journal="wal") as db:
                self.assertEqual(db.policy.mode, "wal")


class TheStoreOnThisRuntime(TempDirTestCase):

    def test_a_new_store_follows_the_runtime_and_an_immutable_reader_sees_every_session_of_an_idle_writer(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            for i in range(5):
                db.create_session(f"s{i}", "cli")
                db.append_message(f"s{i}", "user", "hello")
            self.assertEqual(header_mode(path), "delete" if HAS_BUG else "wal")
            if HAS_BUG:  # a rollback journal: every commit is in the main file when it returns
                self.assertFalse(os.path.exists(f"{path}-wal"))
                self.assertEqual(immutable_sessions(path), [f"s{i}" for i in range(5)])
            else:
                self.wait_for_idle_checkpoint(path, [f"s{i}" for i in range(5)])

    def test_in_wal_the_idle_checkpoint_brings_the_main_file_up_to_date_while_the_writer_stays_open(self):
        path = self.tmp / "state.db"
        with SessionDB(path, journal="wal") as db:
            db.create_session("first", "cli")
            self.wait_for_idle_checkpoint(path, ["first"])
            db.create_session("second", "cli")
            db.append_message("second", "user", "after the first idle checkpoint")
            self.wait_for_idle_checkpoint(path, ["first", "second"])
            self.assertTrue(os.path.exists(f"{path}-wal"), "the writer is still open, in WAL")
            copy = self.tmp / "copy.db"
            shutil.copyfile(path, copy)  # state.db alone, as a backup tool copies it
            self.assertEqual(immutable_sessions(copy), ["first", "second"])

    def wait_for_idle_checkpoint(self, path, expected):
        deadline = time.monotonic() + IDLE_CHECKPOINT_DELAY + 20  # a loaded machine delays the timer
        while immutable_sessions(path) != expected and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertEqual(immutable_sessions(path), expected)

    def test_without_the_idle_checkpoint_a_few_commits_stay_in_the_wal(self):
        # The control for the test above: the same writes, and the main file waits for a checkpoint.
        path = self.tmp / "state.db"
        with mock.patch("hermes_state_wal.IDLE_CHECKPOINT_DELAY", 3600), SessionDB(path, journal="wal") as db:
            db.create_session("first", "cli")
            time.sleep(0.5)
            self.assertEqual(immutable_sessions(path), [])

    def test_the_commit_cadence_checkpoints_a_busy_writer(self):
        # Idle never comes here; with the WAL-reset race the writer checkpoints at once, else the checkpointer
        # thread beside it.
        path = self.tmp / "state.db"
        with mock.patch("hermes_state_wal.IDLE_CHECKPOINT_DELAY", 3600), SessionDB(path, journal="wal") as db:
            db.create_session("s", "cli")
            for i in range(CHECKPOINT_EVERY_COMMITS - 1):  # with create_session, the 50th commit
                db.append_message("s", "user", f"m{i}")
            self.wait_for_idle_checkpoint(path, ["s"])

    def test_close_ends_the_checkpointer_thread(self):
        path = self.tmp / "state.db"
        db = SessionDB(path, journal="wal")
        db.create_session("s", "cli")
        thread = db._checkpointer._thread
        self.assertTrue(thread.is_alive())
        db.close()
        thread.join(5)
        self.assertFalse(thread.is_alive())
        self.assertEqual(immutable_sessions(path), ["s"])

    def test_the_checkpointer_thread_does_not_keep_a_dropped_store_alive(self):
        db = SessionDB(self.tmp / "state.db", journal="wal")
        db.create_session("s", "cli")
        thread, ref = db._checkpointer._thread, weakref.ref(db)
        # Dropped unclosed, it never gives back its count in our connection registry: given back here, or a
        # later test's file that reuses the inode (tmpfs does) would read as held.
        for key in db._held_keys:
            self.addCleanup(hermes_state_lockguard._release, key)
        del db
        gc.collect()
        self.assertIsNone(ref())
        thread.join(IDLE_CHECKPOINT_DELAY + 20)
        self.assertFalse(thread.is_alive())

    def test_a_rollback_journal_store_starts_no_checkpointer(self):
        with SessionDB(self.tmp / "state.db", journal="delete") as db:
            db.create_session("s", "cli")
            self.assertIsNone(db._checkpointer._thread)


class AStoreFoundInWal(TempDirTestCase):

    def setUp(self):
        super().setUp()
        if not HAS_BUG:
            self.skipTest("this SQLite is fixed: a WAL store stays WAL")
        self.path = self.tmp / "state.db"
        make_wal_store(self.path)
        self.assertEqual(header_mode(self.path), "wal")

    def test_an_open_that_holds_it_alone_switches_it_to_a_rollback_journal_losing_nothing(self):
        with SessionDB(self.path) as db:
            self.assertEqual(db.policy.mode, "delete")
            self.assertEqual([m["content"] for m in db.get_messages("old")], ["kept in old"])
            db.create_session("new", "cli")
        self.assertEqual(header_mode(self.path), "delete")
        self.assertFalse(os.path.exists(f"{self.path}-wal"))
        self.assertEqual(immutable_sessions(self.path), ["new", "old"])

    def test_it_stays_in_wal_with_our_locked_checkpoints_while_another_process_holds_it(self):
        release = self.held_by_another_process(HOLD_OPEN, self.path)
        with self.assertLogs("hermes_state", "WARNING") as logs:
            db = SessionDB(self.path)
        with db:
            self.assertEqual((db.policy.mode, db.policy.checkpoint), ("wal", "locked"))
            self.assertIn("another connection holds it", db.policy.reason)
            db.create_session("beside", "cli")
        self.assertIn("stays wal", "\n".join(logs.output))
        self.assertEqual(header_mode(self.path), "wal")
        release()
        with SessionDB(self.path) as db:  # alone now
            self.assertEqual(db.policy.mode, "delete")
        self.assertEqual(header_mode(self.path), "delete")
        self.assertEqual(immutable_sessions(self.path), ["beside", "old"])

    def test_an_asked_for_rollback_journal_does_not_wait_for_a_holder_either(self):
        self.held_by_another_process(HOLD_OPEN, self.path)
        start = time.monotonic()
        with self.assertLogs("hermes_state", "WARNING"), SessionDB(self.path, journal="delete") as db:
            self.assertEqual(db.policy.mode, "wal")
        self.assertLess(time.monotonic() - start, 5)


class OnACrossVmFilesystem(TempDirTestCase):

    def setUp(self):
        super().setUp()
        # What /proc/self/mountinfo would say of a virtiofs bind mount (the check is per folder).
        folder = os.path.dirname(os.path.realpath(self.tmp / "state.db"))
        self.addCleanup(hermes_state_wal._cross_vm_folders.pop, folder, None)
        make_wal_store(self.tmp / "state.db")
        hermes_state_wal._cross_vm_folders[folder] = True

    def test_wal_is_refused_and_a_store_in_wal_is_switched_by_an_open_alone(self):
        path = self.tmp / "state.db"
        with SessionDB(path, journal="wal") as db:
            self.assertEqual(db.policy.mode, "delete")
            self.assertIn("cross-VM", db.policy.reason)
        self.assertEqual(header_mode(path), "delete")
        with SessionDB(self.tmp / "new.db") as db:
            db.create_session("s", "cli")
        self.assertEqual(header_mode(self.tmp / "new.db"), "delete")

    def test_the_open_says_why_in_hermes_agents_terms_once(self):
        with self.assertLogs("hermes_state", "WARNING") as logs:
            SessionDB(self.tmp / "told.db", journal="wal").close()
            SessionDB(self.tmp / "told.db", journal="wal").close()
        told = [line for line in logs.output if "cross-VM filesystem" in line]
        self.assertEqual(len(told), 1, logs.output)
        for words in ("virtiofs/9p", "journal_mode=DELETE", "native volume", "told.db"):
            self.assertIn(words, told[0])

    def test_external_checkpoints_are_refused_before_any_file_is_touched(self):
        with self.assertRaisesRegex(ValueError, "cross-VM"):
            SessionDB(self.tmp / "other.db", checkpoint="external")
        self.assertFalse((self.tmp / "other.db").exists())


class RefusingConnection(sqlite3.Connection):
    """A filesystem without WAL's shared memory (NFS, SMB): SQLite's WAL switch fails there with
    one of these errors (make test-faults meets it on a real FUSE mount)."""
    refusal = "disk I/O error"

    def execute(self, sql, *args):
        if sql.strip().lower() == "pragma journal_mode=wal":
            raise sqlite3.OperationalError(self.refusal)
        return super().execute(sql, *args)


class OnAFilesystemThatRefusesWal(TempDirTestCase):

    def test_a_refused_wal_falls_back_to_a_rollback_journal_saying_so(self):
        for refusal in ("disk I/O error", "locking protocol"):
            RefusingConnection.refusal = refusal
            path = self.tmp / f"{refusal[:4]}.db"
            with self.assertLogs("hermes_state", "ERROR") as logs, SessionDB(
                    path, journal="wal",
                    connection_factory=lambda *a, **k: sqlite3.connect(
                        *a, factory=RefusingConnection, **k)) as db:
                db.create_session("s", "cli")
                self.assertEqual(db.policy.mode, "delete")
                self.assertEqual(db._writer.execute("PRAGMA synchronous").fetchone()[0], 3)
            self.assertIn(f"WAL is not supported on this filesystem ({refusal})", logs.output[0])
            self.assertIn(str(path), logs.output[0])
            self.assertEqual(header_mode(path), "delete")

    def test_another_error_of_the_switch_still_fails_the_open(self):
        RefusingConnection.refusal = "no such table: sessions"
        with self.assertRaisesRegex(sqlite3.OperationalError, "no such table"):
            SessionDB(self.tmp / "x.db", journal="wal",
                      connection_factory=lambda *a, **k: sqlite3.connect(
                          *a, factory=RefusingConnection, **k))


class OnAFixedRuntime(TempDirTestCase):

    def test_a_store_made_with_a_rollback_journal_moves_to_wal(self):
        if HAS_BUG:
            self.skipTest("this SQLite has the WAL-reset race: it keeps the rollback journal")
        path = self.tmp / "state.db"
        with SessionDB(path, journal="delete") as db:
            db.create_session("s", "cli")
        self.assertEqual(header_mode(path), "delete")
        with SessionDB(path) as db:
            self.assertEqual(db.policy.mode, "wal")
            self.assertEqual(db.get_session("s")["id"], "s")
        self.assertEqual(header_mode(path), "wal")
