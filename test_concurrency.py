"""Many processes and threads on one store, locks held too long, writers killed, damaged files."""

import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from unittest import mock

from hermes_state import (
    CHECKPOINT_EVERY_COMMITS, SessionDB, StoreLockedError, choose_journal_policy,
)
from hermes_state_common import sqlite_has_wal_reset_bug
from test_support import HOLD_SQLITE_LOCK, REPO, WRITE_VERBS, TempDirTestCase, tracing_factory

CALL = [{"id": "c", "type": "function", "function": {"name": "terminal", "arguments": "{}"}}]
APPENDS = 300


def _append_worker(path, worker):
    """Append APPENDS messages to this worker's own session and APPENDS to the shared one."""
    with SessionDB(path) as db:
        db.create_session(f"own{worker}", "cli")
        db.create_session("shared", "cli")
        for i in range(APPENDS):
            calls = CALL if i % 3 == 0 else None
            db.append_message(f"own{worker}", "assistant", f"w{worker} m{i}", tool_calls=calls)
            db.append_message("shared", "assistant", f"w{worker} s{i}", tool_calls=calls)


CALLER_BUMPS = 100


def _caller_worker(path, worker, errors, start):
    """As hermes-agent does: its own read-modify-write SQL on `_conn` under `_lock`, between our writes."""
    with SessionDB(path) as db:
        db.create_session(f"caller{worker}", "cli")
        start.wait(60)  # all at once: processes that barely overlap would prove nothing
        for i in range(CALLER_BUMPS):
            try:
                with db._lock:
                    conn = db._conn
                    conn.execute("BEGIN")
                    row = conn.execute("SELECT value FROM state_meta WHERE key = 'bumps'").fetchone()
                    conn.execute("INSERT OR REPLACE INTO state_meta (key, value) VALUES ('bumps', ?)",
                                 (str(int(row[0] if row else 0) + 1),))
                    conn.execute("COMMIT")
            except sqlite3.Error as exc:
                errors.put(f"worker {worker} bump {i}: {exc}")
            db.append_message(f"caller{worker}", "user", f"w{worker} m{i}")


def run_python(code, *args):
    """Start `code` in a fresh interpreter that can import the product."""
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


HOLD_WRITER_FILE_LOCK = """
import sys, time
from hermes_state_lockguard import WriterFileLock
lock = WriterFileLock(sys.argv[1] + ".lock")
assert lock.acquire(time.monotonic() + 5)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""

APPEND_UNTIL_KILLED = """
import sys
from hermes_state import SessionDB
db = SessionDB(sys.argv[1])
db.create_session("victim", "cli")
i = 0
while True:
    calls = [{"id": "c", "type": "function", "function": {"name": "t", "arguments": "{}"}}] if i % 2 else None
    if i % 10 == 0:
        db.append_messages_batch("victim", [{"role": "user", "content": "b" * 3000}] * 5)
    else:
        db.append_message("victim", "assistant", "x" * 5000, tool_calls=calls)
    print(i, flush=True)
    i += 1
"""


class ManyWriters(TempDirTestCase):

    def test_four_processes_keep_every_row_and_exact_counts(self):
        path = str(self.tmp / "state.db")
        SessionDB(path).close()
        ctx = multiprocessing.get_context("spawn")
        workers = [ctx.Process(target=_append_worker, args=(path, w)) for w in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(120)
            self.assertEqual(worker.exitcode, 0)
        calls_per_session = len(range(0, APPENDS, 3))
        with SessionDB(path) as db:
            for w in range(4):
                session = db.get_session(f"own{w}")
                self.assertEqual((session["message_count"], session["tool_call_count"]),
                                 (APPENDS, calls_per_session))
                self.assertEqual([m["content"] for m in db.get_messages(f"own{w}")],
                                 [f"w{w} m{i}" for i in range(APPENDS)])
            shared = db.get_session("shared")
            self.assertEqual((shared["message_count"], shared["tool_call_count"]),
                             (4 * APPENDS, 4 * calls_per_session))
            self.assertEqual(db.message_count(), 8 * APPENDS)
        self.assertEqual(self.raw(path).execute("PRAGMA integrity_check").fetchone()[0], "ok")

    def test_a_callers_read_modify_write_under_lock_loses_nothing_beside_other_processes(self):
        # SessionDB._lock takes state.db.lock on every journal policy, and so does every write of ours: on a
        # fixed SQLite (automatic checkpoints) too, or a bump another process interleaves is lost and a
        # caller's BEGIN that reads then writes meets "database is locked" at once (the WAL snapshot rule).
        path = str(self.tmp / "state.db")
        SessionDB(path).close()
        ctx = multiprocessing.get_context("spawn")
        errors, start = ctx.Queue(), ctx.Barrier(3)
        workers = [ctx.Process(target=_caller_worker, args=(path, w, errors, start)) for w in range(3)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(120)
            self.assertEqual(worker.exitcode, 0)
        failed = []
        while not errors.empty():
            failed.append(errors.get())
        self.assertEqual(failed, [])
        with SessionDB(path) as db:
            self.assertEqual(db.get_meta("bumps"), str(3 * CALLER_BUMPS))
            self.assertEqual(db.message_count(), 3 * CALLER_BUMPS)

    def test_one_writer_and_three_reader_threads(self):
        # Neither side starves: a fixed number of appends ends while three threads keep reading
        # (a count, not a rate: how fast depends on the machine's load).
        for journal in ("wal", "delete"):
            with self.subTest(journal=journal):
                self.one_writer_and_three_reader_threads(journal, appends=60)

    def one_writer_and_three_reader_threads(self, journal, appends):
        db = SessionDB(self.tmp / f"{journal}.db", journal=journal)
        self.addCleanup(db.close)
        db.create_session("s", "cli")
        errors, stop, reads = [], threading.Event(), []

        def writer():
            try:
                for _ in range(appends):
                    db.append_message("s", "user", "hello " * 50)
                    db.update_token_counts("s", input_tokens=1)
            except Exception as exc:  # collected and asserted below
                errors.append(exc)
            finally:
                stop.set()

        def reader():
            last = rounds = 0
            try:
                while not stop.is_set() or not rounds:
                    count = len(db.get_messages("s"))
                    db.list_sessions_rich()
                    db.get_session("s")
                    if count < last:
                        errors.append(AssertionError(f"count went back from {last} to {count}"))
                    last, rounds = count, rounds + 1
            except Exception as exc:
                errors.append(exc)
            reads.append(rounds)

        threads = [threading.Thread(target=writer)]
        threads += [threading.Thread(target=reader) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        self.assertFalse(any(thread.is_alive() for thread in threads), "a thread never finished")
        self.assertEqual(errors, [])
        self.assertEqual(len(reads), 3)
        self.assertEqual(db.message_count("s"), appends)
        self.assertEqual(db.get_session("s")["input_tokens"], appends)


class LockedStore(TempDirTestCase):

    def setUp(self):
        super().setUp()
        self.path = self.tmp / "state.db"
        with SessionDB(self.path) as db:
            db.create_session("s", "cli")

    def hold(self, script, seconds):
        holder = run_python(script, self.path, seconds)
        self.addCleanup(holder.communicate)
        self.addCleanup(holder.kill)
        line = holder.stdout.readline().strip()
        if line != "held":
            self.fail(f"the lock holder did not start: {holder.stderr.read()}")
        return holder

    def test_a_write_lock_held_for_two_seconds_is_waited_out(self):
        with SessionDB(self.path) as db:
            self.hold(HOLD_SQLITE_LOCK, 2)
            start = time.monotonic()
            read_started = time.monotonic()
            self.assertEqual(db.get_session("s")["id"], "s")  # reads do not queue behind the writer
            self.assertLess(time.monotonic() - read_started, 0.5)
            db.append_message("s", "user", "after the wait")
            self.assertGreater(time.monotonic() - start, 1.5)
            self.assertEqual(db.message_count("s"), 1)

    def test_a_lock_held_past_the_budget_gives_a_clear_error_and_no_row(self):
        with SessionDB(self.path, write_budget=1.0) as db:
            self.hold(HOLD_SQLITE_LOCK, 4)
            with self.assertRaises(StoreLockedError) as caught:
                db.append_message("s", "user", "never written")
            message = str(caught.exception)
            self.assertRegex(message, r"was locked for \d+\.\ds \(budget 1\.0s\)")
            self.assertIn("no data was written", message)
            self.assertEqual(db.message_count("s"), 0)
            self.assertEqual(db.get_session("s")["message_count"], 0)

    def assert_fails_near_the_budget(self, script, budget, write):
        """A lock held far longer than the budget: StoreLockedError once the budget is spent, not later."""
        with SessionDB(self.path, write_budget=budget) as db:
            self.hold(script, 30)
            start = time.monotonic()
            with self.assertRaises(StoreLockedError):
                write(db)
            waited = time.monotonic() - start
            self.assertEqual(db.message_count("s"), 0)
        self.assertGreater(waited, 0.8 * budget)  # it did wait and retry
        self.assertLess(waited, budget + 4.0)  # and gave up at the budget, not when the holder let go

    def test_a_sqlite_lock_held_far_past_the_budget_fails_at_the_budget(self):
        self.assert_fails_near_the_budget(HOLD_SQLITE_LOCK, 1.0, lambda db: db.append_message("s", "user", "x"))

    def test_a_writer_lock_held_far_past_the_budget_fails_at_the_budget(self):
        self.assert_fails_near_the_budget(HOLD_WRITER_FILE_LOCK, 1.0, lambda db: db.append_message("s", "user", "x"))

    def test_a_hung_writer_holding_the_lock_file_gives_the_same_error(self):
        with SessionDB(self.path, write_budget=0.5) as db:
            self.hold(HOLD_WRITER_FILE_LOCK, 3)
            with self.assertRaisesRegex(StoreLockedError, "state.db.lock; no data was written"):
                db.set_meta("k", "v")
            self.assertIsNone(db.get_meta("k"))


class WritePath(TempDirTestCase):

    def test_every_write_runs_inside_begin_immediate(self):
        statements = []
        with SessionDB(self.tmp / "state.db", connection_factory=tracing_factory(statements)) as db:
            statements.clear()
            db.create_session("s", "cli")
            db.append_message("s", "user", "hello")
            db.append_messages_batch("s", [{"role": "assistant", "content": "hi"}])
            db.set_meta("k", "v")
            db.update_token_counts("s", input_tokens=3)
            db.get_session("s")
            db.import_sessions([{"id": "imported", "source": "cli", "messages": [{"role": "user", "content": "x"}]}])
            db.delete_session("imported")
        begins, open_transaction, outside = 0, False, []
        for statement in statements:
            verb = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else ""
            if verb == "BEGIN":
                self.assertEqual(statement.strip().upper(), "BEGIN IMMEDIATE")
                begins += 1
                open_transaction = True
            elif verb in ("COMMIT", "ROLLBACK"):
                open_transaction = False
            elif verb in WRITE_VERBS and not open_transaction:
                outside.append(statement)
        self.assertGreaterEqual(begins, 7)  # at least one per write call, the flush of get_session included
        self.assertEqual(outside, [])

    def test_a_failed_write_leaves_nothing_and_the_next_write_goes_through(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            with self.assertRaisesRegex(ValueError, "unknown session_id"):
                db.append_message("ghost", "user", "half written?")  # fails after its INSERT ran
            self.assertEqual(self.raw(path).execute("SELECT COUNT(*) FROM messages").fetchone()[0], 0)
            db.append_message("s", "user", "written")
            self.assertEqual([m["content"] for m in db.get_messages("s")], ["written"])
        self.assertEqual([r[0] for r in self.raw(path).execute("SELECT content FROM messages")], ["written"])

    def test_token_counts_queued_before_a_failed_write_are_kept(self):
        with SessionDB(self.tmp / "state.db") as db:
            db.create_session("s", "cli")
            db.queue_token_counts("s", input_tokens=7, model="m")
            with self.assertRaisesRegex(ValueError, "unknown session_id"):
                db.append_message("ghost", "user", "never written")
            self.assertEqual(db.get_session("s")["input_tokens"], 7)


class KilledWriter(TempDirTestCase):

    def test_sigkill_mid_work_leaves_a_clean_store_with_every_committed_row(self):
        path = self.tmp / "state.db"
        previous = 0
        for kill_after in (40, 300):
            writer = run_python(APPEND_UNTIL_KILLED, path)
            committed = -1
            for line in writer.stdout:
                committed = int(line)
                if committed >= kill_after:
                    break
            writer.send_signal(signal.SIGKILL if hasattr(signal, "SIGKILL") else signal.SIGTERM)
            # Steps it printed before the kill may still be in the pipe, or read ahead into the
            # reader's buffer (communicate reads the pipe past that buffer): the last of them counts.
            committed = ([committed] + [int(n) for n in writer.stdout.read().split()])[-1]
            writer.communicate()
            conn = sqlite3.connect(path)
            self.assertEqual(conn.execute("PRAGMA integrity_check").fetchone()[0], "ok")
            conn.close()
            with SessionDB(path) as db:
                rows = db.get_messages("victim")
                session = db.get_session("victim")
                self.assertEqual(session["message_count"], len(rows))
                self.assertEqual(session["tool_call_count"], sum(len(m["tool_calls"] or []) for m in rows))
                # Every reported step is there (5 rows every tenth step, else 1); at most
                # one more step committed between its print and the kill.
                reported = sum(5 if i % 10 == 0 else 1 for i in range(committed + 1))
                self.assertGreaterEqual(len(rows) - previous, reported)
                self.assertLessEqual(len(rows) - previous, reported + 5)
                previous = len(rows)


class DamagedFiles(TempDirTestCase):

    def open_damaged(self, content, reason, wal=None):
        path = self.tmp / "state.db"
        path.write_bytes(content)
        if wal is not None:
            (self.tmp / "state.db-wal").write_bytes(wal)
        with self.assertLogs("hermes_state", "WARNING") as logs:
            db = SessionDB(path)
        with db:
            db.create_session("fresh", "cli")
            self.assertEqual(len(db.repairs), 1)
        backups = sorted(p.name for p in self.tmp.iterdir() if ".bak" in p.name)
        self.assertRegex(backups[0], rf"^state\.db\.{reason}-\d{{8}}-\d{{6}}-{os.getpid()}\.bak$")
        self.assertIn(backups[0], "\n".join(logs.output))
        self.assertEqual((self.tmp / backups[0]).read_bytes(), content)
        if os.name == "posix":
            for name in backups:
                self.assertEqual(os.stat(self.tmp / name).st_mode & 0o777, 0o600, name)
        if wal is not None:
            self.assertEqual(backups[1], backups[0] + "-wal")
            self.assertEqual((self.tmp / backups[1]).read_bytes(), wal)
        return backups

    def test_zeroed_file(self):
        self.open_damaged(b"\x00" * 8192, "zeroed")

    def test_garbage_file_with_a_wal_sidecar(self):
        self.open_damaged(b"this is not a database, it is a shopping list\n" * 40, "notsqlite",
                          wal=b"stray wal bytes")

    def test_empty_file(self):
        self.open_damaged(b"", "empty")

    def test_a_healthy_store_is_never_renamed(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
        for _ in range(3):
            with SessionDB(path) as db:
                self.assertEqual(db.repairs, [])
                self.assertEqual(db.session_count(), 1)
        self.assertEqual([p.name for p in self.tmp.iterdir() if ".bak" in p.name], [])


class JournalPolicy(TempDirTestCase):

    def test_wal_reset_bug_versions(self):
        affected = [(3, 7, 0), (3, 40, 1), (3, 44, 5), (3, 50, 6), (3, 51, 2)]
        fixed = [(3, 6, 23), (3, 44, 6), (3, 44, 9), (3, 50, 7), (3, 51, 3), (3, 52, 0)]
        for version in affected:
            self.assertTrue(sqlite_has_wal_reset_bug(version), version)
        for version in fixed:
            self.assertFalse(sqlite_has_wal_reset_bug(version), version)

    def test_policy_choice_and_override(self):
        self.assertEqual(choose_journal_policy((3, 40, 1), "").mode, "delete")
        self.assertEqual(choose_journal_policy((3, 40, 1), "wal").autocheckpoint, 0)
        self.assertEqual(choose_journal_policy((3, 51, 3), "").autocheckpoint, None)
        self.assertEqual(choose_journal_policy((3, 51, 3), "delete").mode, "delete")
        with self.assertRaisesRegex(ValueError, "HERMES_STATE_JOURNAL must be 'wal' or 'delete'"):
            choose_journal_policy((3, 40, 1), "memory")

    def test_the_store_follows_the_policy(self):
        with SessionDB(self.tmp / "delete.db", journal="delete") as db:
            self.assertEqual(db.doctor()["journal_mode"], "delete")
        with SessionDB(self.tmp / "wal.db", journal="wal") as db:
            report = db.doctor()
            self.assertEqual(report["journal_mode"], "wal")
            self.assertEqual(report["journal_policy"], db.policy.reason)

    def test_switching_a_rollback_journal_store_to_wal_waits_for_its_readers(self):
        # hermes-agent's own store in DELETE mode, read by a poller when we first open it (issue 17's bench).
        with SessionDB(self.tmp / "state.db", journal="delete") as db:
            db.create_session("s", "cli")
            db.append_message("s", "user", "kept")
        reading, done = threading.Event(), threading.Event()

        def poller():
            conn = sqlite3.connect(str(self.tmp / "state.db"), isolation_level=None)
            conn.execute("BEGIN")
            conn.execute("SELECT count(*) FROM messages").fetchone()
            reading.set()
            time.sleep(0.5)  # five times the writer's own busy timeout
            conn.execute("COMMIT")
            conn.close()
            done.set()

        thread = threading.Thread(target=poller)
        thread.start()
        self.addCleanup(thread.join, 10)
        self.assertTrue(reading.wait(10))
        with SessionDB(self.tmp / "state.db", journal="wal") as db:
            self.assertTrue(done.is_set(), "the switch waited for the reader")
            self.assertEqual((db.doctor()["journal_mode"], db.message_count("s")), ("wal", 1))

    def test_switching_to_wal_outlasts_writers_of_the_rollback_journal_store(self):
        # A reader about to switch holds SHARED; a writer holding RESERVED makes SQLite answer BUSY at once
        # (waiting could deadlock), so the busy timeout alone does not help: the switch is retried.
        with SessionDB(self.tmp / "state.db", journal="delete") as db:
            db.create_session("s", "cli")
        stop = threading.Event()

        def writer():  # hermes-agent's own process, writing every few ms (as issue 17's bench probe does)
            conn = sqlite3.connect(str(self.tmp / "state.db"), isolation_level=None, timeout=5)
            while not stop.is_set():
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("UPDATE sessions SET title = NULL WHERE id = 's'")
                time.sleep(0.001)
                conn.execute("COMMIT")
                time.sleep(0.002)
            conn.close()

        thread = threading.Thread(target=writer)
        thread.start()
        try:
            time.sleep(0.05)
            with SessionDB(self.tmp / "state.db", journal="wal") as db:
                self.assertEqual(db.doctor()["journal_mode"], "wal")
        finally:
            stop.set()
            thread.join(10)

    def test_checkpoints_run_under_the_lock_when_automatic_ones_are_off(self):
        statements = []
        with mock.patch("hermes_state_wal.IDLE_CHECKPOINT_DELAY", 3600), \
                SessionDB(self.tmp / "state.db", connection_factory=tracing_factory(statements),
                          journal="wal") as db:
            if db.policy.autocheckpoint != 0:
                self.skipTest("this runtime keeps automatic checkpoints")
            self.assertEqual(db._writer.execute("PRAGMA wal_autocheckpoint").fetchone()[0], 0)
            db.create_session("s", "cli")
            db.append_messages_batch("s", [{"role": "user", "content": "x"}] * 3)
            for _ in range(2 * CHECKPOINT_EVERY_COMMITS):
                db.append_message("s", "user", "x")
        # One after the open's schema, two at the cadence, one at close for the commits since (a gateway may
        # keep the store open).
        self.assertEqual(sum("wal_checkpoint" in s for s in statements), 4)


class ReaderPool(TempDirTestCase):

    def test_short_lived_threads_reuse_pooled_readers(self):
        db = SessionDB(self.tmp / "state.db")
        self.addCleanup(db.close)
        db.create_session("s", "cli")
        for _ in range(50):
            thread = threading.Thread(target=db.get_session, args=("s",))
            thread.start()
            thread.join()
        readers = list(db._readers)
        self.assertEqual(len(readers), 1)
        db.close()
        with self.assertRaises(sqlite3.ProgrammingError):
            readers[0].execute("SELECT 1")


class CommittedMeansOnce(TempDirTestCase):

    def test_a_failing_checkpoint_after_commit_does_not_repeat_the_write(self):
        class CheckpointFails(sqlite3.Connection):
            def execute(self, sql, *args):
                if "wal_checkpoint(PASSIVE)" in sql:
                    raise sqlite3.OperationalError("database is locked")
                return super().execute(sql, *args)

        def connect(*args, **kwargs):
            return sqlite3.connect(*args, factory=CheckpointFails, **kwargs)

        with SessionDB(self.tmp / "state.db", connection_factory=connect, journal="wal") as db:
            if db.policy.autocheckpoint != 0:
                self.skipTest("this runtime keeps automatic checkpoints")
            db.create_session("s", "cli")
            for i in range(CHECKPOINT_EVERY_COMMITS + 10):
                db.append_message("s", "user", f"m{i}")
            self.assertEqual(db.message_count("s"), CHECKPOINT_EVERY_COMMITS + 10)
            self.assertEqual(db.get_session("s")["message_count"], CHECKPOINT_EVERY_COMMITS + 10)



class ThreadsOfOneProcess(TempDirTestCase):

    def test_a_thread_that_keeps_the_write_lock_past_the_budget_gives_the_clear_error(self):
        with SessionDB(self.tmp / "state.db", write_budget=0.3) as db:
            db.create_session("s", "cli")
            held, release = threading.Event(), threading.Event()

            def hog():
                with db._write_lock:
                    held.set()
                    release.wait(10)

            thread = threading.Thread(target=hog)
            thread.start()
            held.wait(5)
            try:
                with self.assertRaisesRegex(StoreLockedError, "another thread of this process kept writing; "
                                                              "no data was written"):
                    db.append_message("s", "user", "never written")
            finally:
                release.set()
                thread.join(10)
            self.assertEqual(db.message_count("s"), 0)


class JournalFromEnvironment(TempDirTestCase):

    def test_hermes_state_journal_is_read_from_the_environment(self):
        with mock.patch.dict(os.environ, {"HERMES_STATE_JOURNAL": " DELETE "}):
            with SessionDB(self.tmp / "state.db") as db:
                self.assertEqual(db.policy.mode, "delete")
                self.assertEqual(db.doctor()["journal_mode"], "delete")
        with mock.patch.dict(os.environ, {"HERMES_STATE_JOURNAL": "memory"}):
            with self.assertRaisesRegex(ValueError, "HERMES_STATE_JOURNAL must be 'wal' or 'delete'"):
                SessionDB(self.tmp / "other.db")
