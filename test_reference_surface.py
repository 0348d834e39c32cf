"""The rest of hermes-agent 0.20.1.2's public surface (issue 28): the names its plugins, scripts and tests
reach, each checked for what it does on a real store, and the landmarks a reader of the seed looks for.

Where the reference keeps a mechanism ours replaced (its CJK tokenizer extension, its inline index), the
names answer for our layout: these tests hold them to that answer.
"""

import contextlib
import gzip
import os
import sqlite3
import subprocess
import sys
import time
import unittest
from pathlib import Path

import hermes_state
import hermes_state_common
from hermes_state import SessionDB, StoreLockedError
from hermes_state_common import SCHEMA_SQL, SEARCH_OBJECTS, SEARCH_TRIGGERS
from test_support import (
    HAS_FTS5, HAS_TRIGRAM, HOLD_SQLITE_LOCK, REPO, V22_DB, V26_DB, StoreTestCase, TempDirTestCase, require,
    tracing_factory, without_fts5, write_statements,
)

MARKER_SQL = "SELECT value FROM state_meta WHERE key = 'fts_optimize_available'"
HOLD_WRITER_LOCK = """
import sys
from hermes_state_lockguard import WriterFileLock
lock = WriterFileLock(sys.argv[1] + ".lock")
assert lock.acquire(__import__("time").monotonic() + 5)
print("held", flush=True)
sys.stdin.read()
"""


def objects_of(path, names):
    """{name: sql} of these schema objects of the store at `path`."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute(f"SELECT name, sql FROM sqlite_master WHERE name IN ({', '.join('?' * len(names))})",
                            list(names)).fetchall()
    return dict(rows)


def bare_store(path, *scripts):
    """A store made by SCHEMA_SQL and `scripts` only, as another program would leave it."""
    with sqlite3.connect(path) as conn:
        conn.executescript(SCHEMA_SQL)
        for script in scripts:
            conn.executescript(script)
    conn.close()


class SessionStatuses(unittest.TestCase):

    def test_the_status_names_have_hermes_agents_values(self):
        self.assertEqual((hermes_state.SESSION_STATUS_COMPLETE, hermes_state.SESSION_STATUS_INTERRUPTED,
                          hermes_state.SESSION_STATUS_ERROR, hermes_state.SESSION_STATUS_EMPTY),
                         ("complete", "interrupted", "error", "empty"))

    def test_classify_session_status_reads_the_last_messages_shape(self):
        classify = hermes_state.classify_session_status
        self.assertEqual(classify("assistant", False, "stop"), "complete")
        self.assertEqual(classify("assistant", True, "tool_calls"), "interrupted")
        self.assertEqual(classify(" User ", False, None), "interrupted")
        self.assertEqual(classify("tool", False, None), "interrupted")
        self.assertEqual(classify("assistant", False, " Content_Filter "), "error")
        self.assertEqual(classify("user", True, "agent_error"), "error")  # an error finish wins
        self.assertEqual(classify(None, False, None), "complete")
        self.assertEqual(classify("system", True, "length"), "complete")


class ZeroedStores(TempDirTestCase):

    def zeroed(self, name="state.db", size=4096):
        path = self.tmp / name
        path.write_bytes(b"\x00" * size)
        return path

    def test_is_zeroed_state_db_tells_a_zeroed_file_from_every_other(self):
        self.assertTrue(hermes_state.is_zeroed_state_db(self.zeroed()))
        self.assertFalse(hermes_state.is_zeroed_state_db(self.tmp / "missing.db"))
        empty = self.tmp / "empty.db"
        empty.write_bytes(b"")
        self.assertFalse(hermes_state.is_zeroed_state_db(empty))
        text = self.tmp / "text.db"
        text.write_bytes(b"not a database at all" * 10)
        self.assertFalse(hermes_state.is_zeroed_state_db(text))
        SessionDB(self.tmp / "healthy.db").close()
        self.assertFalse(hermes_state.is_zeroed_state_db(self.tmp / "healthy.db"))

    def test_the_probe_length_decides_for_a_file_zeroed_only_at_its_start(self):
        path = self.tmp / "partly.db"
        path.write_bytes(b"\x00" * 32 + b"junk" * 100)
        self.assertFalse(hermes_state.is_zeroed_state_db(path))  # its first 100 bytes are not all NUL
        self.assertTrue(hermes_state.is_zeroed_state_db(path, probe_bytes=32))
        self.assertTrue(hermes_state.is_zeroed_state_db(path, probe_bytes=16, force=True))

    def test_quarantine_moves_a_zeroed_store_and_its_sidecars_aside_keeping_their_bytes(self):
        path = self.zeroed()
        for suffix, data in (("-wal", b"wal bytes"), ("-shm", b"shm bytes")):
            Path(str(path) + suffix).write_bytes(data)
        moved = hermes_state.quarantine_zeroed_state_db(path)
        self.assertRegex(moved.name, r"^state\.db\.zeroed-\d{8}-\d{6}-\d+\.bak$")
        self.assertFalse(path.exists())
        self.assertEqual(moved.read_bytes(), b"\x00" * 4096)
        self.assertEqual(Path(str(moved) + "-wal").read_bytes(), b"wal bytes")
        self.assertEqual(Path(str(moved) + "-shm").read_bytes(), b"shm bytes")
        self.assertFalse(os.path.exists(str(path) + "-wal"))
        with SessionDB(path) as db:  # a fresh store opens in its place
            self.assertEqual(db.list_sessions_rich(), [])

    def test_quarantine_leaves_anything_but_a_zeroed_store_alone(self):
        self.assertIsNone(hermes_state.quarantine_zeroed_state_db(self.tmp / "missing.db"))
        healthy = self.tmp / "healthy.db"
        with SessionDB(healthy) as db:
            db.create_session("s", "cli")
        before = healthy.read_bytes()
        self.assertIsNone(hermes_state.quarantine_zeroed_state_db(healthy))
        self.assertEqual(healthy.read_bytes(), before)

    def test_quarantine_waits_for_the_writer_lock_and_leaves_the_file_if_it_stays_held(self):
        path = self.zeroed()
        self.held_by_another_process(HOLD_WRITER_LOCK, path)
        wait, hermes_state.QUARANTINE_LOCK_WAIT = hermes_state.QUARANTINE_LOCK_WAIT, 0.3
        self.addCleanup(setattr, hermes_state, "QUARANTINE_LOCK_WAIT", wait)
        with self.assertLogs("hermes_state", "ERROR") as logs:
            self.assertIsNone(hermes_state.quarantine_zeroed_state_db(path))
        self.assertIn("left in place", logs.output[0])
        self.assertEqual(path.read_bytes(), b"\x00" * 4096)


class TheCjkExtensionIsNotNeeded(StoreTestCase):

    def test_fts5_cjk_so_path_is_where_hermes_agent_looks(self):
        old = os.environ.pop("HERMES_FTS5_CJK_SO", None)
        self.addCleanup(lambda: os.environ.__setitem__("HERMES_FTS5_CJK_SO", old) if old is not None
                        else os.environ.pop("HERMES_FTS5_CJK_SO", None))
        self.assertEqual(hermes_state.fts5_cjk_so_path(), hermes_state.get_hermes_home() / "lib" / "libfts5_cjk.so")
        os.environ["HERMES_FTS5_CJK_SO"] = "~/ext/cjk.so"
        self.assertEqual(hermes_state.fts5_cjk_so_path(), Path("~/ext/cjk.so").expanduser())

    def test_nothing_is_loaded_and_cjk_terms_of_every_length_are_found_without_it(self):
        conn = self.raw(self.path)
        self.assertFalse(hermes_state.load_fts5_cjk_extension(conn))
        self.db.create_session("s", "cli")
        found = self.db.append_message("s", "user", "我在学习中文")
        self.db.append_message("s", "user", "nothing here")
        for term in ("中", "中文", "学习中"):
            self.assertEqual([hit["id"] for hit in self.db.search_messages(term)], [found], term)

    def test_the_cjk_ddl_names_are_our_side_index_as_an_open_makes_it(self):
        require(self, "fts5", "the side index is an FTS5 table")
        names = list(SEARCH_OBJECTS["cjk"]) + list(SEARCH_TRIGGERS["cjk"])
        made_by_open = objects_of(self.path, names)
        bare = self.tmp / "bare.db"
        bare_store(bare, hermes_state.FTS_CJK_TABLE_SQL, hermes_state.FTS_CJK_TRIGGER_SQL)
        self.assertEqual(objects_of(bare, names), made_by_open)
        self.assertEqual(set(objects_of(bare, names)), set(names))
        self.assertNotIn("cjk_unicode61", hermes_state.FTS_CJK_TABLE_SQL)


class IndexDdlNames(StoreTestCase):

    def test_fts_sql_and_fts_trigram_sql_make_our_word_and_trigram_indexes_as_an_open_does(self):
        require(self, "fts5", "the scripts make FTS5 tables")
        for index, script in (("word", hermes_state_common.FTS_SQL), ("trigram", hermes_state_common.FTS_TRIGRAM_SQL)):
            if index == "trigram" and not HAS_TRIGRAM:
                with self.subTest(index=index):
                    require(self, "trigram", "FTS_TRIGRAM_SQL makes a trigram table")
                continue
            names = list(SEARCH_OBJECTS[index]) + list(SEARCH_TRIGGERS[index])
            bare = self.tmp / f"{index}.db"
            bare_store(bare, script)
            self.assertEqual(objects_of(bare, names), objects_of(self.path, names), index)
            self.assertEqual(len(objects_of(bare, names)), len(names))

    def test_legacy_fts_sql_is_hermes_agent_019s_inline_index_as_its_stores_hold_it(self):
        # The fixture's own 0.19 index and one the LEGACY_* scripts keep hold the same text for every row.
        require(self, "trigram", "the fixture's 0.19 index and LEGACY_FTS_TRIGRAM_SQL are trigram tables")
        fixture = self.copy_fixture(V22_DB)
        raw = self.raw(fixture)
        rows = raw.execute("SELECT * FROM messages ORDER BY id").fetchall()
        bare = self.tmp / "legacy.db"
        bare_store(bare, hermes_state_common.LEGACY_FTS_SQL, hermes_state_common.LEGACY_FTS_TRIGRAM_SQL)
        conn = self.raw(bare)
        sessions = raw.execute("SELECT * FROM sessions").fetchall()
        columns = [c[1] for c in conn.execute("PRAGMA table_info(sessions)")]
        for row in sessions:
            keys = [k for k in row.keys() if k in columns]
            conn.execute(f"INSERT INTO sessions ({', '.join(keys)}) VALUES ({', '.join('?' * len(keys))})",
                         [row[k] for k in keys])
        message_columns = [c[1] for c in conn.execute("PRAGMA table_info(messages)")]
        for row in rows:
            keys = [k for k in row.keys() if k in message_columns]
            conn.execute(f"INSERT INTO messages ({', '.join(keys)}) VALUES ({', '.join('?' * len(keys))})",
                         [row[k] for k in keys])
        conn.commit()
        for table in ("messages_fts", "messages_fts_trigram"):
            ours = conn.execute(f"SELECT id, c0 FROM {table}_content ORDER BY id").fetchall()
            theirs = raw.execute(f"SELECT id, c0 FROM {table}_content ORDER BY id").fetchall()
            self.assertEqual([tuple(r) for r in ours], [tuple(r) for r in theirs], table)
            self.assertEqual(len(ours), len(rows))

    def test_a_store_with_the_legacy_index_is_searched_through_it_and_flagged(self):
        require(self, "fts5", "the legacy index is an FTS5 table")
        bare = self.tmp / "legacy.db"
        # (Without the trigram tokenizer hermes-agent makes its word index alone.)
        bare_store(bare, hermes_state_common.LEGACY_FTS_SQL,
                   *[hermes_state_common.LEGACY_FTS_TRIGRAM_SQL] if HAS_TRIGRAM else [])
        with SessionDB(bare) as db:
            self.assertEqual(db.fts_layout(), "legacy")
            db.create_session("s", "cli")
            found = db.append_message("s", "user", "a zebra crossing")
            self.assertEqual([hit["id"] for hit in db.search_messages("zebra")], [found])
            self.assertEqual(db.get_meta("fts_optimize_available"), "1")
        self.assertEqual(self.raw(bare).execute(
            "SELECT rowid FROM messages_fts WHERE messages_fts MATCH 'zebra'").fetchall()[0][0], found)

    def test_the_stale_keys_are_the_ones_hermes_agent_reads(self):
        self.assertEqual((hermes_state_common.FTS_STALE_KEY, hermes_state_common.FTS_CJK_STALE_KEY),
                         ("fts_stale", "fts_cjk_stale"))
        require(self, "fts5", "the rest makes hermes-agent's FTS5 index")
        # hermes-agent's index marked stale under that key is not searched: ours is built instead.
        bare = self.tmp / "stale.db"
        bare_store(bare, hermes_state_common.LEGACY_FTS_SQL,
                   f"INSERT INTO state_meta (key, value) VALUES ('{hermes_state_common.FTS_STALE_KEY}', '1')")
        with SessionDB(bare) as db:
            self.assertEqual(db.fts_layout(), "current")


class SanitizedQuery(StoreTestCase):

    def setUp(self):
        super().setUp()
        self.db.create_session("s", "cli")
        for text in ("hello world", "hello there", "goodbye world", "an exact phrase here", "c++ build (fast)"):
            self.db.append_message("s", "user", text)

    def test_the_sanitised_query_is_the_match_our_word_index_answers_as_search_does(self):
        require(self, "fts5", "it runs the expression as a MATCH on our FTS5 word index")
        conn = self.raw(self.path)
        for query in ("hello world", "hello OR goodbye", '"exact phrase"', "hello NOT world", "c++ (fast)",
                      "wor*", "hello AND AND there"):
            expression = SessionDB._sanitize_fts5_query(query)
            ids = sorted(r[0] for r in conn.execute(
                "SELECT rowid FROM messages_fts WHERE messages_fts MATCH ?", (expression,)))
            self.assertEqual(ids, sorted(hit["id"] for hit in self.db.search_messages(query)), query)
            self.assertTrue(ids, query)

    def test_nothing_searchable_gives_an_empty_expression(self):
        for query in ("", "   ", "***", "AND", "()", None):
            self.assertEqual(self.db._sanitize_fts5_query(query), "", query)

    def test_a_query_is_cut_at_hermes_agents_limit(self):
        self.assertEqual(hermes_state_common.MAX_FTS5_QUERY_CHARS, 2048)
        self.assertIn('"zebra"', SessionDB._sanitize_fts5_query("q" * 2000 + " zebra"))
        self.assertNotIn("zebra", SessionDB._sanitize_fts5_query("q" * 2047 + " zebra"))


class LayoutProbesAndTheOptimizeFlag(TempDirTestCase):

    def test_the_layout_probes_answer_for_each_kind_of_store(self):
        with SessionDB(self.copy_fixture(V22_DB)) as db:
            self.assertTrue(db._db_has_legacy_inline_fts(db._conn))
            self.assertTrue(db._db_has_legacy_inline_fts(db._conn.cursor()))
            self.assertEqual(db._sqlite_supports_fts5(db._conn.cursor()), HAS_FTS5)
        for store in (self.copy_fixture(V26_DB), self.tmp / "fresh.db"):
            with SessionDB(store) as db:
                self.assertFalse(db._db_has_legacy_inline_fts(db._conn), store)
        with SessionDB(self.tmp / "nofts.db", connection_factory=without_fts5) as db:
            self.assertFalse(db._sqlite_supports_fts5())

    def test_the_flag_is_written_in_the_opens_migration_and_agrees_with_fts_optimize_available(self):
        path = self.copy_fixture(V22_DB)
        self.assertIsNone(self.raw(path).execute(MARKER_SQL).fetchone())
        statements = []
        with SessionDB(path, connection_factory=tracing_factory(statements)) as db:
            if not HAS_FTS5:  # hermes-agent flags nothing without FTS5; optimize-storage refuses
                self.assertIsNone(db.get_meta("fts_optimize_available"))
                self.assertFalse(db.fts_optimize_available())
                refused = db.optimize_fts_storage(vacuum=False)
                self.assertEqual(refused["reason"], "fts5_unavailable")
                return
            self.assertEqual(db.get_meta("fts_optimize_available"), "1")
            self.assertTrue(db.fts_optimize_available())
        transactions, current = [], None
        for statement in statements:
            if statement.startswith("BEGIN"):
                current = []
            elif statement.startswith(("COMMIT", "ROLLBACK")) and current is not None:
                transactions.append(current)
                current = None
            elif current is not None:
                current.append(statement)
        flagged = [t for t in transactions if any("fts_optimize_available" in s for s in t)]
        self.assertEqual(len(flagged), 1)
        self.assertTrue(any("schema_version" in s and s.startswith(("INSERT", "UPDATE")) for s in flagged[0]))
        statements.clear()
        with SessionDB(path, connection_factory=tracing_factory(statements)):
            pass
        self.assertEqual(write_statements(statements), [])  # settled: the next open writes nothing
        with SessionDB(path) as db:
            self.assertEqual(db.optimize_fts_storage(vacuum=False)["ok"], True)
            self.assertIsNone(db.get_meta("fts_optimize_available"))
            self.assertFalse(db.fts_optimize_available())
        with SessionDB(path) as db:
            self.assertIsNone(db.get_meta("fts_optimize_available"))

    def test_no_flag_where_hermes_agent_writes_none(self):
        for store, factory in ((self.copy_fixture(V26_DB), None), (self.tmp / "fresh.db", None),
                               (self.copy_fixture(V22_DB), without_fts5)):
            with SessionDB(store, connection_factory=factory) as db:
                self.assertIsNone(db.get_meta("fts_optimize_available"), store)


class TranscriptHelpers(StoreTestCase):

    def test_clear_messages_deletes_every_row_and_zeroes_the_counts(self):
        self.db.create_session("s", "cli")
        self.db.create_session("other", "cli")
        first = self.db.append_message("s", "user", "keep searching zebra")
        self.db.append_message("s", "assistant", None, tool_calls=[{"id": "c1", "function": {"name": "t"}}])
        self.db.append_message("s", "user", "later zebra")
        self.db.rewind_to_message("s", first)
        kept = self.db.append_message("other", "user", "the other zebra")
        self.assertIsNone(self.db.clear_messages("s"))
        row = self.session_row("s")
        self.assertEqual((row["message_count"], row["tool_call_count"]), (0, 0))
        conn = self.raw(self.path)
        self.assertEqual(conn.execute("SELECT COUNT(*) FROM messages WHERE session_id = 's'").fetchone()[0], 0)
        self.assertEqual([hit["id"] for hit in self.db.search_messages("zebra")], [kept])
        self.assertEqual(self.session_row("other")["message_count"], 1)
        self.db.clear_messages("unknown")  # nothing to clear: no error, nothing written
        self.assertIsNone(self.db.get_session("unknown"))

    def test_has_archived_messages_sees_rewound_rows_only(self):
        self.db.create_session("s", "cli")
        self.assertFalse(self.db.has_archived_messages("s"))
        target = self.db.append_message("s", "user", "one")
        self.db.append_message("s", "assistant", "two")
        self.assertFalse(self.db.has_archived_messages("s"))
        self.db.rewind_to_message("s", target)
        self.assertTrue(self.db.has_archived_messages("s"))
        self.assertFalse(self.db.has_archived_messages("unknown"))
        self.db.restore_rewound("s", target)
        self.assertFalse(self.db.has_archived_messages("s"))

    def test_get_first_assistant_text_is_the_earliest_reply_with_text(self):
        self.db.create_session("s", "cli")
        self.assertEqual(self.db.get_first_assistant_text("s"), "")
        self.db.append_message("s", "user", "question", timestamp=10.0)
        self.db.append_message("s", "assistant", None, timestamp=11.0)  # no content: skipped
        self.db.append_message("s", "assistant", "the later reply", timestamp=30.0)
        self.db.append_message("s", "assistant", "the first reply", timestamp=20.0)
        self.db.append_message("s", "assistant", "same time, later id", timestamp=20.0)
        self.assertEqual(self.db.get_first_assistant_text("s"), "the first reply")
        self.db.create_session("parts", "cli")
        self.db.append_message("parts", "assistant", [{"type": "text", "text": "a list"}])
        self.assertEqual(self.db.get_first_assistant_text("parts"), "")
        self.assertEqual(self.db.get_first_assistant_text("unknown"), "")


class SessionActivity(StoreTestCase):

    def test_the_snapshot_of_a_touched_session(self):
        self.db.create_session("s", "cli")
        stamp = time.time() - 5
        self.db.touch_session_activity("s", stamp, description="  compacting  ", provenance="agent.compression")
        snapshot = self.db.get_session_activity("s")
        self.assertEqual(set(snapshot), {"last_activity_at", "last_activity_description", "last_activity_provenance",
                                         "seconds_since_activity", "last_activity_ts", "last_activity_desc",
                                         "description", "provenance"})
        self.assertEqual(snapshot["last_activity_at"], stamp)
        self.assertEqual(snapshot["last_activity_ts"], stamp)
        self.assertEqual((snapshot["last_activity_description"], snapshot["last_activity_desc"],
                          snapshot["description"]), ("compacting",) * 3)
        self.assertEqual((snapshot["last_activity_provenance"], snapshot["provenance"]), ("agent.compression",) * 2)
        self.assertAlmostEqual(snapshot["seconds_since_activity"], 5.0, delta=2.0)

    def test_a_session_never_touched_and_values_another_writer_stored(self):
        self.db.create_session("s", "cli")
        self.assertEqual(self.db.get_session_activity("s"), {
            "last_activity_at": None, "last_activity_description": "", "last_activity_provenance": "unknown",
            "seconds_since_activity": None, "last_activity_ts": None, "last_activity_desc": "",
            "description": "", "provenance": "unknown"})
        conn = self.raw(self.path)
        conn.execute("UPDATE sessions SET last_activity_at = 100, last_activity_description = ?,"
                     " last_activity_provenance = 'somewhere' WHERE id = 's'", ("x" * 300,))
        conn.commit()
        snapshot = self.db.get_session_activity("s")
        self.assertEqual(snapshot["last_activity_description"], "x" * 119 + "\u2026")
        self.assertEqual(snapshot["provenance"], "unknown")
        self.assertEqual(snapshot["last_activity_at"], 100.0)
        self.assertIsNone(self.db.get_session_activity("unknown"))
        self.assertIsNone(self.db.get_session_activity(""))


class LiveCompressionChild(StoreTestCase):

    def compressed(self, parent="p"):
        self.db.create_session(parent, "cli")
        self.db.end_session(parent, "compression")
        return parent

    def test_the_one_live_continuation_is_returned_as_get_session_returns_it(self):
        parent = self.compressed()
        self.db.create_session("c", "cli", parent_session_id=parent, system_prompt="the prompt",
                               model_config={"_delegate_from": "elsewhere"})  # inherited: still a continuation
        self.db.create_session("branch", "cli", parent_session_id=parent, model_config={"_branched_from": parent})
        self.db.create_session("tool", "tool", parent_session_id=parent)
        found = self.db.find_live_compression_child(parent)
        self.assertEqual(found, self.db.get_session("c"))
        self.assertEqual(found["system_prompt"], "the prompt")

    def test_none_when_ambiguous_ended_or_not_a_compression(self):
        parent = self.compressed()
        self.assertIsNone(self.db.find_live_compression_child(parent))  # no child
        self.db.create_session("c1", "cli", parent_session_id=parent)
        self.db.create_session("c2", "cli", parent_session_id=parent)
        self.assertIsNone(self.db.find_live_compression_child(parent))  # two: ambiguous
        self.db.end_session("c2", "user_exit")
        self.assertEqual(self.db.find_live_compression_child(parent)["id"], "c1")
        self.db.create_session("open", "cli")
        self.db.create_session("open-child", "cli", parent_session_id="open")
        self.assertIsNone(self.db.find_live_compression_child("open"))
        self.db.end_session("open", "user_exit")
        self.assertIsNone(self.db.find_live_compression_child("open"))
        self.assertIsNone(self.db.find_live_compression_child(""))
        self.assertIsNone(self.db.find_live_compression_child("unknown"))


class CjkRebuildNames(TempDirTestCase):

    def test_a_fresh_store_has_no_cjk_work(self):
        with SessionDB(self.tmp / "state.db") as db:
            self.assertIsNone(db.fts_cjk_rebuild_status())
            self.assertFalse(db.fts_cjk_rebuild_step())
            db.create_session("s", "cli")
            db.append_message("s", "user", "中文")  # queued for our CJK index: no rebuild, as in hermes-agent
            self.assertIsNone(db.fts_cjk_rebuild_status())
            self.assertFalse(db.fts_cjk_rebuild_step())

    def test_the_cjk_side_index_fills_with_the_shared_backfill(self):
        require(self, "fts5", "optimize-storage's first step builds our FTS5 index (refused here)")
        path = self.copy_fixture(V22_DB)
        with SessionDB(path) as db:
            found = db.append_message("bench_000003", "user", "我在学习犇文")
            self.assertIsNone(db.fts_cjk_rebuild_status())  # hermes-agent's index: no CJK index of ours
            db._execute_write(db._begin_optimize)  # optimize-storage's first step: ours, to be backfilled
            status = db.fts_cjk_rebuild_status()
            self.assertEqual(status, db.fts_rebuild_status())
            self.assertTrue(status["pending"])
            steps = 0
            while db.fts_cjk_rebuild_step():
                steps += 1
                self.assertLess(steps, 10_000)
            self.assertIsNone(db.fts_cjk_rebuild_status())
            self.assertEqual([hit["id"] for hit in db.search_messages("犇")], [found])
            self.assertEqual(db.fts_layout(), "current")


class WritePatience(TempDirTestCase):

    def test_the_budgets_keep_hermes_agents_relation(self):
        self.assertGreaterEqual(SessionDB._WRITE_PATIENCE_S, 10)
        self.assertGreaterEqual(SessionDB._TRANSCRIPT_WRITE_PATIENCE_S, 30)
        self.assertEqual(SessionDB._TRANSCRIPT_WRITE_PATIENCE_S, 3 * SessionDB._WRITE_PATIENCE_S)
        with SessionDB(self.tmp / "state.db") as db:
            self.assertEqual(db.write_budget, SessionDB._WRITE_PATIENCE_S)
        with SessionDB(self.tmp / "state.db", write_budget=2) as db:
            self.assertEqual((db.write_budget, db._transcript_patience()), (2.0, 2.0))

    def test_a_transcript_write_outwaits_a_lock_a_routine_write_gives_up_on(self):
        class Patient(SessionDB):
            _WRITE_PATIENCE_S = 0.5
            _TRANSCRIPT_WRITE_PATIENCE_S = 20.0

        path = self.tmp / "state.db"
        with Patient(path) as db:
            db.create_session("s", "cli")
            holder = subprocess.Popen([sys.executable, "-c", HOLD_SQLITE_LOCK, str(path), "2.5"],
                                      stdout=subprocess.PIPE, text=True, cwd=REPO)
            self.addCleanup(holder.wait)
            self.assertEqual(holder.stdout.readline().strip(), "held")
            holder.stdout.close()
            start = time.monotonic()
            with self.assertRaises(StoreLockedError):
                db.set_meta("routine", "1")
            self.assertLess(time.monotonic() - start, 2.0)
            message_id = db.append_message("s", "user", "written once the lock is let go")
            self.assertGreater(time.monotonic() - start, 2.0)
            db.create_session("t", "cli")  # a new session row is a transcript write too
        with SessionDB(path) as db:
            self.assertEqual(db.get_messages("s")[0]["id"], message_id)
            self.assertIsNone(db.get_meta("routine"))


if __name__ == "__main__":
    unittest.main()
