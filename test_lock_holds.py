"""No operation of ours holds the write lock for long: each big one works in chunks,
one short transaction each, resumable when cut short (issue 17). Chunks are made
small here and counted from the statements SQLite ran; the 1M-message figures
come from the bench, never from a timed test."""

import os
import subprocess
import sqlite3
import sys
import threading
import unittest
from unittest import mock

import hermes_state_fts
from hermes_state import SessionDB
from test_hermes_state_schema import OLD_SESSIONS
from hermes_state_schema import INDEXES_BUILT_AFTER_THE_PASS
from test_support import (HAS_FTS5, INDEX_TABLES, REPO, V22_DB, V26_DB, TempDirTestCase, require,
                          tracing_factory, write_statements)


def transactions(statements):
    """The statements of each write transaction, in order."""
    found, current = [], None
    for statement in statements:
        verb = statement.strip().upper()
        if verb.startswith("BEGIN"):
            current = []
        elif verb in ("COMMIT", "ROLLBACK") and current is not None:
            found.append(current)
            current = None
        elif current is not None:
            current.append(statement)
    return found


def touching(statements, prefix):
    """The transactions that ran a statement starting with `prefix`."""
    return [t for t in transactions(statements) if any(s.lstrip().startswith(prefix) for s in t)]


def merging(statements):
    """The transactions that ran an FTS5 'merge' command."""
    return [t for t in transactions(statements) if any("'merge'" in s for s in t)]


class LockHoldTestCase(TempDirTestCase):

    def setUp(self):
        super().setUp()
        self.path = self.tmp / "state.db"
        self.statements = []
        self.db = SessionDB(self.path, connection_factory=tracing_factory(self.statements))
        self.addCleanup(self.db.close)

    def session_with(self, session_id, count, content="hello there"):
        self.db.create_session(session_id, "cli")
        self.db.append_messages_batch(session_id, [{"role": "user", "content": f"{content} {i}"}
                                                   for i in range(count)])
        self.db.end_session(session_id, "user_exit")

    def count(self, sql, params=()):
        conn = self.raw(self.path)
        return conn.execute(sql, params).fetchone()[0]


class DeletesInChunks(LockHoldTestCase):

    def test_a_big_session_is_deleted_a_chunk_of_messages_per_transaction(self):
        self.session_with("big", 10)
        self.session_with("other", 2)
        self.db.DELETE_CHUNK_ROWS = 3
        self.statements.clear()
        self.assertTrue(self.db.delete_session("big"))
        self.assertEqual(4, len(touching(self.statements, "DELETE FROM messages")))  # 3 + 3 + 3 + 1
        self.assertEqual(0, self.count("SELECT COUNT(*) FROM messages WHERE session_id = 'big'"))
        self.assertEqual(2, self.count("SELECT COUNT(*) FROM messages WHERE session_id = 'other'"))
        self.assertEqual({"other"}, {hit["session_id"] for hit in self.db.search_messages("hello")})
        self.assertEqual([], self.db.list_meta_prefix("hs_sweep_messages:"))

    def test_prune_and_bulk_delete_chunk_their_messages_too(self):
        for name in ("a", "b", "c"):
            self.session_with(name, 4)
        self.db.DELETE_CHUNK_ROWS = 5
        self.statements.clear()
        self.assertEqual(2, self.db.delete_sessions(["a", "b"]))
        self.assertEqual(2, len(touching(self.statements, "DELETE FROM messages")))  # 5 + 3
        conn = self.raw(self.path)
        with conn:
            conn.execute("UPDATE messages SET timestamp = 0")
        self.statements.clear()
        self.assertEqual(1, self.db.prune_sessions(older_than_days=1))
        self.assertEqual(1, len(touching(self.statements, "DELETE FROM messages")))
        self.assertEqual(0, self.count("SELECT COUNT(*) FROM messages"))

    def test_the_session_row_goes_first_so_no_reader_sees_it_half_deleted(self):
        self.session_with("big", 6)
        self.db.DELETE_CHUNK_ROWS = 2
        self.statements.clear()
        self.db.delete_session("big")
        first = transactions(self.statements)[0]
        touching_first = [s for s in first if s.lstrip().startswith("DELETE FROM sessions")]
        self.assertTrue(touching_first)
        self.assertFalse([s for s in first if s.lstrip().startswith("DELETE FROM messages")])

    def interrupted_delete(self, session_id):
        """What a delete cut short after its first transaction leaves: the row gone, its messages still there."""
        self.db._execute_write(lambda conn: self.db._delete_sessions_in(conn, [session_id]))

    def test_a_sweep_cut_short_is_finished_by_the_next_delete_and_spares_messages_written_since(self):
        self.session_with("gone", 5)
        self.session_with("later", 1)
        self.interrupted_delete("gone")
        conn = self.raw(self.path)
        with conn:  # the id made again by a writer without our code (hermes-agent itself)
            conn.execute("INSERT INTO sessions (id, source, started_at) VALUES ('gone', 'cli', 1)")
            conn.execute("INSERT INTO messages (session_id, role, content, timestamp) VALUES ('gone', 'user',"
                         " 'new life', 1)")
        self.db.delete_session("later")
        self.assertEqual(["new life"], [m["content"] for m in self.db.get_messages("gone")])
        self.assertEqual([], self.db.list_meta_prefix("hs_sweep_messages:"))

    def test_a_session_made_again_under_an_id_still_being_swept_shows_only_its_own_messages(self):
        self.session_with("gone", 5)
        self.interrupted_delete("gone")
        self.db.create_session("gone", "cli")
        self.db.append_message("gone", "user", "new life")
        self.assertEqual(["new life"], [m["content"] for m in self.db.get_messages("gone")])
        self.assertEqual(1, self.db.message_count("gone"))
        self.assertEqual([], self.db.list_meta_prefix("hs_sweep_messages:"))

    def test_a_session_imported_under_an_id_still_being_swept_brings_only_its_own_messages(self):
        self.session_with("gone", 5)
        exported = self.db.export_session("gone")
        exported["messages"] = exported["messages"][:2]
        self.interrupted_delete("gone")
        self.assertEqual(1, self.db.import_sessions([exported])["imported"])
        self.assertEqual(2, len(self.db.get_messages("gone")))
        self.assertEqual([], self.db.list_meta_prefix("hs_sweep_messages:"))

    def test_the_next_open_finishes_the_sweep_of_a_process_killed_between_its_chunks(self):
        self.session_with("gone", 5)
        self.session_with("kept", 2)
        self.db.close()
        script = (
            "import os, sys\n"
            "from hermes_state import SessionDB\n"
            "class Dying(SessionDB):\n"
            "    DELETE_CHUNK_ROWS = 2\n"
            "    chunks = 0\n"
            "    def _sweep_chunk(self, conn, prefix):\n"
            "        if self.chunks:\n"
            "            os._exit(3)  # killed inside the second chunk's transaction\n"
            "        self.chunks += 1\n"
            "        return super()._sweep_chunk(conn, prefix)\n"
            "Dying(sys.argv[1]).delete_session('gone')\n")
        done = subprocess.run([sys.executable, "-c", script, str(self.path)], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        self.assertEqual(3, done.returncode, done.stderr)
        self.assertEqual(3, self.count("SELECT COUNT(*) FROM messages WHERE session_id = 'gone'"))
        statements = []

        class SmallChunks(SessionDB):
            DELETE_CHUNK_ROWS = 2
            SWEEP_ALIVE_SECONDS = 0  # opened long after the death

        with SmallChunks(self.path, connection_factory=tracing_factory(statements)) as db:
            self.assertEqual([], db.get_messages("gone"))
            self.assertEqual(0, db.message_count("gone"))
            self.assertEqual(2, db.message_count("kept"))
            self.assertEqual([], db.list_meta_prefix("hs_sweep_messages:"))
        self.assertEqual(2, len(touching(statements, "DELETE FROM messages")))  # 2 + 1

    def test_an_open_leaves_a_sweep_still_going_on_to_its_process_and_writes_nothing(self):
        self.session_with("gone", 5)
        self.interrupted_delete("gone")  # as a live process leaves it between two of its chunks
        self.db.close()
        monitor = self.raw(self.path)
        version = monitor.execute("PRAGMA data_version").fetchone()[0]
        with SessionDB(self.path) as db:
            self.assertEqual(version, monitor.execute("PRAGMA data_version").fetchone()[0])
            self.assertEqual(5, db.message_count("gone"))
            db.delete_sessions([])  # any delete still finishes it
            self.assertEqual(0, db.message_count("gone"))

    def test_a_second_delete_of_an_id_is_swept_whole_on_an_old_state_meta_without_a_primary_key(self):
        self.db.close()
        self.path.unlink()
        conn = self.raw(self.path)
        conn.execute("CREATE TABLE state_meta (key TEXT, value TEXT)")  # as some old stores have it
        conn.commit()
        self.db = SessionDB(self.path)
        self.addCleanup(self.db.close)
        self.session_with("twice", 1)
        self.interrupted_delete("twice")
        with conn:  # made again by a writer without our code, then deleted again
            conn.execute("INSERT INTO sessions (id, source, started_at, ended_at) VALUES ('twice', 'cli', 1, 2)")
            conn.executemany("INSERT INTO messages (session_id, role, content, timestamp) VALUES ('twice', 'user',"
                             " ?, 1)", [(f"again {i}",) for i in range(5)])
        self.db.DELETE_CHUNK_ROWS = 3
        self.assertTrue(self.db.delete_session("twice"))
        self.assertEqual(0, self.count("SELECT COUNT(*) FROM messages WHERE session_id = 'twice'"))
        self.assertEqual(0, self.count("SELECT COUNT(*) FROM state_meta WHERE key LIKE 'hs_sweep_messages:%'"))

    def test_deleting_sessions_without_messages_takes_one_transaction_and_marks_nothing(self):
        for name in ("a", "b"):
            self.db.create_session(name, "cli")
            self.db.end_session(name, "user_exit")
        self.statements.clear()
        self.assertEqual(2, self.db.delete_empty_sessions())
        self.assertEqual(1, len(transactions(self.statements)))
        self.assertFalse([s for s in write_statements(self.statements) if "hs_sweep_messages" in s])
        self.statements.clear()
        self.assertEqual(0, self.db.prune_sessions(older_than_days=1))  # nothing to delete, nothing to sweep
        self.assertEqual(1, len(transactions(self.statements)))


class IndexMergesInSteps(LockHoldTestCase):

    def test_optimize_merges_each_index_a_few_pages_per_transaction_until_nothing_is_left(self):
        require(self, "fts5", "FTS5 merges")
        for i in range(40):  # one append a transaction: a segment each in every index
            self.db.create_session(f"s{i}", "cli")
            self.db.append_message(f"s{i}", "user", f"parser failing tests {i} 会话 " + "word " * 200)
        before = [hit["id"] for hit in self.db.search_messages("parser")]
        self.db.MERGE_STEP_PAGES = 1
        self.statements.clear()
        self.assertEqual(len(INDEX_TABLES), self.db.optimize_fts())
        merges = merging(self.statements)
        self.assertGreater(len(merges), 2 * len(INDEX_TABLES))  # more than two steps an index
        self.assertTrue(all(len([s for s in t if "'merge'" in s]) == 1 for t in merges))
        self.statements.clear()
        self.db.optimize_fts()
        self.assertEqual(len(INDEX_TABLES), len(merging(self.statements)))  # one look each: nothing left
        self.assertEqual(before, [hit["id"] for hit in self.db.search_messages("parser")])
        conn = self.raw(self.path)
        for table in INDEX_TABLES.values():
            conn.execute(f"INSERT INTO {table}({table}) VALUES ('integrity-check')")


    def test_a_live_writer_neither_keeps_optimize_merging_nor_breaks_an_index(self):
        require(self, "fts5", "FTS5 merges")
        # A segment lands in every index between two merge steps. Regrouping all
        # segments each step added a level to the structure record every time, and
        # FTS5 called the index corrupt past 2,000 levels (~1,000 steps): every write
        # and the merge itself failed with "database disk image is malformed".
        for i in range(40):
            self.db.create_session(f"s{i}", "cli")
            self.db.append_message(f"s{i}", "user", f"parser failing tests {i} 会话 " + "word " * 200)
        errors, written, stop = [], [], threading.Event()

        def writer():
            with SessionDB(self.path) as live:
                while not stop.is_set():
                    try:
                        written.append(live.append_message("s0", "user", "kiwi written live 猕猴桃"))
                    except Exception as exc:
                        errors.append(exc)
                        return

        thread = threading.Thread(target=writer)
        thread.start()
        try:
            self.db.MERGE_STEP_PAGES = 1
            self.statements.clear()
            self.assertEqual(len(INDEX_TABLES), self.db.optimize_fts())
        finally:
            stop.set()
            thread.join()
        self.assertEqual([], errors)
        self.assertLess(len(merging(self.statements)), 600)
        conn = self.raw(self.path)
        for table in INDEX_TABLES.values():
            conn.execute(f"INSERT INTO {table}({table}) VALUES ('integrity-check')")
        self.assertEqual(sorted(written), sorted(hit["id"] for hit in self.db.search_messages("kiwi", limit=10 ** 6)))


    def test_an_index_fts5_can_no_longer_open_is_set_aside_and_refilled_at_the_next_open(self):
        require(self, "fts5", "an FTS5 index broken")
        # What the old merge loop left behind: a new segment before every negative
        # 'merge' until FTS5 found its structure record corrupt (over 2,000 levels).
        # Its trigger then failed every write to messages, until the write path set it aside.
        self.db.create_session("s", "cli")
        raw = self.raw(self.path)
        raw.isolation_level = None
        written = []
        with self.assertLogs("hermes_state", "WARNING") as logs:
            for i in range(3000):
                written.append(self.db.append_message("s", "user", f"kiwi {i}"))
                try:
                    raw.execute("INSERT INTO messages_fts(messages_fts, rank) VALUES ('merge', -1)")
                except sqlite3.DatabaseError as exc:  # (constructor: once it was set aside, DDL)
                    self.assertRegex(str(exc), "malformed|vtable constructor failed")
                    break
            if not any("messages_fts" in line for line in logs.output):
                # SQLite 3.53 keeps that index readable: its structure record broken by hand instead
                self.assertGreaterEqual(sqlite3.sqlite_version_info, (3, 44))
                raw.execute("UPDATE messages_fts_data SET block = X'00000000ffff' WHERE id = 10")
            written.append(self.db.append_message("s", "user", "kiwi kept"))  # not refused
        self.assertIn("messages_fts", "\n".join(logs.output))
        self.assertNotIn("word", self.db.search_health()["searchable_by_index"])
        self.assertEqual(sorted(written), sorted(hit["id"] for hit in self.db.search_messages("kiwi", limit=10 ** 6)))
        self.db.close()
        with SessionDB(self.path) as db:
            written.append(db.append_message("s", "user", "kiwi after"))
            self.assertIn("word", db.search_health()["searchable_by_index"])
            self.assertEqual(sorted(written), sorted(hit["id"] for hit in db.search_messages("kiwi", limit=10 ** 6)))
        for table in INDEX_TABLES.values():
            raw.execute(f"INSERT INTO {table}({table}) VALUES ('integrity-check')")
        self.assertEqual([], raw.execute("SELECT name FROM sqlite_master WHERE name LIKE 'hs_retired%'").fetchall())

    def test_an_index_whose_structure_record_fts5_refuses_is_set_aside_by_the_open_itself(self):
        require(self, "fts5", "an FTS5 index broken")
        # SQLite 3.53 reads that record at a table's first query, not when it connects it: the
        # open's probe must query it, or the store keeps an index every write trips over.
        self.db.create_session("s", "cli")
        written = [self.db.append_message("s", "user", f"kiwi {i}") for i in range(20)]
        self.db.close()
        with self.raw(self.path) as raw:
            raw.execute("UPDATE messages_fts_data SET block = X'00000000ffff' WHERE id = 10")
        with self.assertLogs("hermes_state", "WARNING") as logs, SessionDB(self.path) as db:
            self.assertIn("messages_fts", "\n".join(logs.output))  # at the open, before any write
            self.assertIn("word", db.search_health()["searchable_by_index"])  # refilled by that open
            written.append(db.append_message("s", "user", "kiwi after"))
            self.assertEqual(sorted(written), sorted(hit["id"] for hit in db.search_messages("kiwi", limit=100)))
        raw = self.raw(self.path)
        for table in INDEX_TABLES.values():
            raw.execute(f"INSERT INTO {table}({table}) VALUES ('integrity-check')")
        self.assertEqual([], raw.execute("SELECT name FROM sqlite_master WHERE name LIKE 'hs_retired%'").fetchall())


class CheckpointsStaySmall(LockHoldTestCase):

    def test_a_big_transaction_is_checkpointed_right_after_so_close_has_little_left(self):
        if self.db.policy.checkpoint != "locked":
            self.skipTest("SQLite checkpoints this runtime's WAL itself")
        self.db.create_session("s", "cli")
        self.statements.clear()
        self.db.append_message("s", "user", "one small write")
        self.assertFalse([s for s in self.statements if "wal_checkpoint" in s])
        self.statements.clear()
        self.db.append_messages_batch("s", [{"role": "user", "content": f"bulk {i}"} for i in range(400)])
        commit = self.statements.index("COMMIT")
        self.assertIn("PRAGMA wal_checkpoint(PASSIVE)", self.statements[commit:])


class RepairsAtOpen(LockHoldTestCase):

    def test_a_stale_index_is_refilled_in_backfill_chunks_and_the_old_one_dropped_in_chunks(self):
        self.session_with("s", 30, content="parser 会话")
        self.db.close()
        conn = self.raw(self.path)
        with conn:
            conn.execute("INSERT OR REPLACE INTO state_meta (key, value) VALUES ('hs_search_stale_word', '1')")
        statements = []
        with SessionDB(self.path, connection_factory=tracing_factory(statements)) as db:
            self.assertEqual(30, len(db.search_messages("parser", limit=50)))
            self.assertEqual(30, len(db.search_messages("会话", limit=50)))
            self.assertIsNone(db.fts_rebuild_status())
        whole_index = [s for s in statements if "'rebuild'" in s or "'delete-all'" in s
                       or s.strip().startswith("DELETE FROM hs_fts_cjk ")]
        self.assertEqual([], whole_index)
        names = [row[0] for row in conn.execute("SELECT name FROM sqlite_master")]
        if not HAS_FTS5:  # no index to refill: the fallback answered above, and none was made
            self.assertEqual([], [name for name in names if name.startswith("hs_fts")])
            return
        self.assertTrue(touching(statements, "DELETE FROM \"hs_retired_messages_fts_data\""))
        self.assertFalse([name for name in names if name.startswith("hs_retired_")])
        for table in INDEX_TABLES.values():
            conn.execute(f"INSERT INTO {table}({table}) VALUES ('integrity-check')")

    @unittest.skipIf(sys.platform == "win32", "flock")
    def test_an_open_lets_other_processes_write_between_its_backfill_chunks(self):
        require(self, "fts5", "an index's backfill")
        import fcntl
        self.session_with("s", 2500)  # three backfill chunks of 1,000 ids
        self.db.close()
        conn = self.raw(self.path)
        with conn:
            conn.execute("INSERT OR REPLACE INTO state_meta (key, value) VALUES ('hs_search_stale_word', '1')")
        free_between_chunks = []

        class Watched(SessionDB):
            def fts_rebuild_step(self):
                more = super().fts_rebuild_step()
                fd = os.open(str(self.db_path) + ".lock", os.O_RDWR)
                try:  # a descriptor of its own: what another process's lock attempt meets
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    free_between_chunks.append(True)
                except BlockingIOError:
                    free_between_chunks.append(False)
                finally:
                    os.close(fd)
                return more

        Watched(self.path).close()
        self.assertGreaterEqual(len(free_between_chunks), 3)
        self.assertTrue(all(free_between_chunks))


class Opening(LockHoldTestCase):

    def test_opening_a_current_store_writes_nothing_and_scans_no_table(self):
        self.session_with("s", 5)
        self.db.close()
        statements = []

        class Planned(sqlite3.Connection):
            def execute(self, sql, *args):
                # sqlite_master and an empty CJK queue cost nothing; a scan of sessions or messages would.
                if sql.lstrip().upper().startswith("SELECT") and "sqlite_master" not in sql \
                        and "hs_fts_cjk_queue" not in sql:
                    plan = super().execute("EXPLAIN QUERY PLAN " + sql, *args).fetchall()
                    # (An FTS5 table looked up by rowid, "INDEX 0:=": the open reads its structure.)
                    scans = [r[3] for r in plan if r[3].startswith("SCAN") and " USING " not in r[3]
                             and not r[3].endswith("VIRTUAL TABLE INDEX 0:=")]
                    statements.extend(f"{scan}: {sql}" for scan in scans)
                return super().execute(sql, *args)

        monitor = self.raw(self.path)
        version = monitor.execute("PRAGMA data_version").fetchone()[0]
        db = SessionDB(self.path, connection_factory=lambda *a, **k: sqlite3.connect(*a, factory=Planned, **k))
        self.assertEqual(version, monitor.execute("PRAGMA data_version").fetchone()[0])
        db.close()
        self.assertEqual([], statements)


class NoLongHoldUnannounced(LockHoldTestCase):

    def test_automatic_maintenance_never_vacuums_a_big_store_and_says_what_will(self):
        self.session_with("old", 3)
        conn = self.raw(self.path)
        with conn:
            conn.execute("UPDATE sessions SET started_at = 0")
            conn.execute("UPDATE messages SET timestamp = 0")
        self.db.AUTO_VACUUM_MAX_BYTES = 1  # any store is big
        self.statements.clear()
        with self.assertLogs("hermes_state", "INFO") as logs:
            result = self.db.maybe_auto_prune_and_vacuum(retention_days=90)
        self.assertEqual({"skipped": False, "pruned": 1, "closed": 0, "vacuumed": False}, result)
        self.assertFalse([s for s in self.statements if s.strip().upper().startswith("VACUUM")])
        self.assertTrue(any("optimize-storage" in line for line in logs.output))

    def test_an_explicit_vacuum_says_before_it_starts_that_it_holds_the_write_lock(self):
        self.db.create_session("s", "cli")
        with self.assertLogs("hermes_state", "INFO") as logs:
            self.db.vacuum()
        said = [line for line in logs.output if "holds the write lock" in line]
        self.assertTrue(said)

    def test_optimize_storage_says_before_its_vacuum_that_it_holds_the_write_lock(self):
        self.db.create_session("s", "cli")
        self.db.close()
        done = subprocess.run([sys.executable, "-m", "hermes_state", "--db", str(self.path), "optimize-storage",
                               "--yes"], capture_output=True, text=True, cwd=REPO, timeout=120)
        if not HAS_FTS5:  # refused before anything is held, in one line
            self.assertEqual((done.returncode, done.stderr), (1, "error: optimize-storage refused: fts5_unavailable\n"))
            return
        self.assertEqual(0, done.returncode, done.stderr)
        lines = done.stderr.splitlines()
        said = [i for i, line in enumerate(lines) if "holds the write lock" in line]
        self.assertTrue(said, lines)
        done_at = next(i for i, line in enumerate(lines) if line.startswith("optimize-storage: done"))
        self.assertLess(said[0], done_at)


class ImportInChunks(LockHoldTestCase):

    def test_an_import_writes_whole_sessions_a_chunk_per_transaction_and_parents_last(self):
        for name in ("a", "b", "c"):
            self.session_with(name, 3)
        self.db.create_session("child", "cli", parent_session_id="a")
        exported = [self.db.export_session(name) for name in ("a", "b", "c", "child")]
        self.db.delete_sessions(["a", "b", "c", "child"])
        self.db.IMPORT_CHUNK_SECONDS = 0  # a transaction stops after its first session
        self.statements.clear()
        result = self.db.import_sessions(exported)
        self.assertEqual((4, 0, 0), (result["imported"], result["skipped"], result["detached"]))
        self.assertEqual(3, len(touching(self.statements, "INSERT INTO messages ")))  # a | b | c | child (none)
        self.assertEqual(5, len([t for t in transactions(self.statements) if t]))  # and the links
        self.assertEqual("a", self.db.get_session("child")["parent_session_id"])
        again = self.db.import_sessions(exported)  # what a rerun after an interruption does
        self.assertEqual((0, 4), (again["imported"], again["skipped"]))


    def test_a_rerun_attaches_the_parent_link_a_run_cut_short_had_not_attached_yet(self):
        self.session_with("p", 2)
        self.db.create_session("c", "cli", parent_session_id="p")
        exported = [self.db.export_session("c"), self.db.export_session("p")]  # newest first, as exports are
        self.db.delete_sessions(["c", "p"])
        self.db.IMPORT_CHUNK_SECONDS = 0
        # What a process killed after the first transaction leaves: the child stored, its link not yet.
        self.db._execute_write(lambda conn: self.db._write_import(conn, exported[:1]))
        self.assertIsNone(self.db.get_session("c")["parent_session_id"])
        again = self.db.import_sessions(exported)
        self.assertEqual((1, 1, 0), (again["imported"], again["skipped"], again["detached"]))
        self.assertEqual("p", self.db.get_session("c")["parent_session_id"])


class CjkQueueInBatches(LockHoldTestCase):

    def test_a_foreign_writers_cjk_backlog_is_indexed_at_most_500_rows_a_transaction(self):
        self.db.create_session("s", "cli")
        self.db.close()
        conn = self.raw(self.path)
        with conn:  # a writer without our Python code: its triggers only queue the rows
            conn.executemany("INSERT INTO messages (session_id, role, content, timestamp, active)"
                             " VALUES ('s', 'user', ?, 1, 1)", [(f"会话 {i}",) for i in range(1200)])
        statements = []
        with SessionDB(self.path, connection_factory=tracing_factory(statements)) as db:
            while db.fts_rebuild_step():
                pass
            self.assertEqual(1200, len(db.search_messages("会话", limit=2000)))
        upserts = [len([s for s in t if s.startswith("INSERT OR REPLACE INTO hs_fts_cjk")])
                   for t in transactions(statements)]
        if not HAS_FTS5:  # no side index, no queue: the fallback found every row above
            self.assertEqual([], [s for s in statements if "hs_fts_cjk" in s])
            return
        self.assertEqual(1200, sum(upserts))
        self.assertLessEqual(max(upserts), 500)
        self.assertEqual(0, conn.execute("SELECT COUNT(*) FROM hs_fts_cjk_queue").fetchone()[0])


class DataRepairsInChunks(LockHoldTestCase):

    def test_messages_an_old_reconciler_left_hidden_are_shown_again_a_chunk_per_transaction(self):
        self.db.close()
        self.path.unlink()
        conn = self.raw(self.path)  # an old store: active added without NOT NULL DEFAULT 1
        conn.executescript(OLD_SESSIONS + "ALTER TABLE messages ADD COLUMN active INTEGER;"
                           "INSERT INTO sessions (id, source, started_at) VALUES ('s', 'cli', 1);")
        with conn:
            conn.executemany("INSERT INTO messages (session_id, role, content, timestamp) VALUES ('s', 'user', ?, 1)",
                             [(f"m{i}",) for i in range(7)])
        statements = []

        class SmallChunks(SessionDB):
            NULL_ACTIVE_CHUNK_ROWS = 3

        with SmallChunks(self.path, connection_factory=tracing_factory(statements)) as db:
            self.assertEqual(7, len(db.get_messages("s")))
        self.assertEqual(3, len(touching(statements, "UPDATE messages SET active = 1")))  # 3 + 3 + 1
        self.assertEqual(0, conn.execute("SELECT COUNT(*) FROM messages WHERE active IS NULL").fetchone()[0])

    def test_schema_31s_message_indexes_are_built_after_the_schema_pass_a_transaction_each(self):
        # At 1M messages each build takes up to 0.8 s; the four inside the pass held the lock 2.2 s.
        statements = []
        with SessionDB(self.copy_fixture(V26_DB),
                       connection_factory=tracing_factory(statements)) as db:
            self.assertTrue(db.get_messages(db.list_sessions_rich(limit=1)[0]["id"]))
        written = transactions(statements)
        # (the pass adds schema 31's columns; without FTS5 it keeps the schema version)
        schema_pass = next(number for number, statements in enumerate(written)
                           if any(s.startswith("ALTER TABLE") for s in statements))
        for name in INDEXES_BUILT_AFTER_THE_PASS:
            builds = [(number, statements) for number, statements in enumerate(written)
                      if any(f"EXISTS {name} ON" in s for s in statements)]
            self.assertEqual(1, len(builds), name)
            number, alone = builds[0]
            self.assertGreater(number, schema_pass, name)
            self.assertEqual(1, len(alone), name)

    def test_an_open_cut_short_before_them_leaves_them_to_the_next_open(self):
        self.session_with("s", 3)
        self.db.close()
        with self.raw(self.path) as conn:  # as a kill after the pass leaves the store
            for name in INDEXES_BUILT_AFTER_THE_PASS:
                conn.execute(f"DROP INDEX {name}")
        SessionDB(self.path).close()
        names = {row[0] for row in self.raw(self.path).execute(
            "SELECT name FROM sqlite_master WHERE type = 'index'")}
        self.assertLessEqual(set(INDEXES_BUILT_AFTER_THE_PASS), names)

    def test_a_new_store_builds_them_in_its_one_schema_pass(self):
        self.assertFalse([t for t in transactions(self.statements)
                          if len(t) == 1 and "CREATE INDEX" in t[0]])
        names = {row[0] for row in self.raw(self.path).execute(
            "SELECT name FROM sqlite_master WHERE type = 'index'")}
        self.assertLessEqual(set(INDEXES_BUILT_AFTER_THE_PASS), names)


class OptimizeStorageCheckpoints(LockHoldTestCase):

    def test_optimize_storage_checkpoints_between_its_chunks(self):
        # Each teardown chunk changes too few rows for a commit's own checkpoint: without one of
        # optimize-storage's own every OPTIMIZE_CHECKPOINT_STEPS steps, the WAL held the whole
        # teardown (880 MB at 1M messages) until one long checkpoint.
        if self.db.policy.checkpoint != "locked":
            self.skipTest("SQLite checkpoints this runtime's WAL itself")
        if not HAS_FTS5:
            self.skipTest("optimize-storage is refused without FTS5 (OptimizeStorage checks it)")
        path = self.copy_fixture(V22_DB)
        statements = []
        with mock.patch.object(hermes_state_fts, "DROP_CHUNK_ROWS", 5), \
                SessionDB(path, connection_factory=tracing_factory(statements)) as db:
            statements.clear()
            self.assertEqual({"ok": True, "vacuumed": None}, db.optimize_fts_storage(vacuum=False))
        since, longest = 0, 0
        for statement in statements:
            if "wal_checkpoint" in statement:
                since = 0
            elif statement.lstrip().upper().startswith("BEGIN"):
                since += 1
                longest = max(longest, since)
        steps = hermes_state_fts.OPTIMIZE_CHECKPOINT_STEPS
        self.assertGreater(len(touching(statements, "DELETE FROM \"hs_retired")), 4 * steps)
        # (+1: the transaction that sets hermes-agent's index aside)
        self.assertLessEqual(longest, steps + 1)
