"""The pure SQL helpers of hermes_state_common."""

import json
import os
import sqlite3
import unittest

from hermes_state_common import (
    QUEUED_PROMPT_METADATA_KEY, SCHEMA_SQL, _BOUNDARY_END_REASONS, _RESET_CHILD_SQL, _id_chunks, _json_or, _placeholders,
    _sql_json_extract, chunked, escape_like, is_automatic_end_reason, prefix_bounds, quote_identifier,
    stat_db_file_identity,
)
from test_support import TempDirTestCase


class Helpers(unittest.TestCase):

    def setUp(self):
        self.conn = sqlite3.connect(":memory:")
        self.addCleanup(self.conn.close)

    def test_quote_identifier_survives_hostile_names(self):
        name = 'we"ird; DROP TABLE x; --'
        self.conn.execute(f"CREATE TABLE {quote_identifier(name)} (a)")
        self.assertEqual(self.conn.execute("SELECT name FROM sqlite_master").fetchone()[0], name)

    def test_escape_like_matches_wildcards_literally(self):
        self.conn.execute("CREATE TABLE t (v)")
        self.conn.executemany("INSERT INTO t VALUES (?)", [("100%",), ("100x",), ("a_b",), ("axb",), ("a\\b",)])
        def like(text):
            return [r[0] for r in self.conn.execute(
                "SELECT v FROM t WHERE v LIKE ? ESCAPE '\\' ORDER BY v", (f"%{escape_like(text)}%",))]
        self.assertEqual(like("0%"), ["100%"])
        self.assertEqual(like("a_"), ["a_b"])
        self.assertEqual(like("a\\"), ["a\\b"])

    def test_prefix_bounds_are_exact_and_case_sensitive(self):
        self.conn.execute("CREATE TABLE t (v TEXT PRIMARY KEY)")
        self.conn.executemany("INSERT INTO t VALUES (?)", [(v,) for v in ("ab", "abc", "ab\U0010fffe", "Ab", "ac", "a")])
        rows = self.conn.execute("SELECT v FROM t WHERE v >= ? AND v < ? ORDER BY v", prefix_bounds("ab"))
        self.assertEqual([r[0] for r in rows], ["ab", "abc", "ab\U0010fffe"])

    def test_chunked_keeps_order_and_size(self):
        self.assertEqual(list(chunked(range(5), 2)), [[0, 1], [2, 3], [4]])
        self.assertEqual(list(chunked([], 2)), [])


class HermesAgentsNames(unittest.TestCase):
    """The names 0.22's callers import from hermes_state_common, with 0.22's meaning."""

    def setUp(self):
        self.conn = sqlite3.connect(":memory:")
        self.addCleanup(self.conn.close)

    def test_id_chunks_and_placeholders_bind_a_whole_in_list(self):
        self.assertEqual([len(chunk) for chunk in _id_chunks(range(1801))], [900, 900, 1])
        self.assertEqual(list(_id_chunks(iter("abc"), 2)), [["a", "b"], ["c"]])
        self.assertEqual(list(chunked(range(501))), [list(range(500)), [500]])
        self.conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY)")
        self.conn.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(2000)])
        found = [row[0] for chunk in _id_chunks(range(0, 2000, 2)) for row in self.conn.execute(
            f"SELECT id FROM t WHERE id IN ({_placeholders(chunk)}) ORDER BY id", chunk)]
        self.assertEqual(found, list(range(0, 2000, 2)))
        self.assertEqual(_placeholders(3), _placeholders(["a", "b", "c"]))
        self.assertEqual(_placeholders(3).count("?"), 3)
        self.assertEqual(_placeholders(()), "")

    def test_json_extract_reads_bad_json_as_nothing(self):
        self.conn.execute("CREATE TABLE s (model_config TEXT)")
        self.conn.executemany("INSERT INTO s VALUES (?)",
                              [('{"_reset_from": "p1"}',), ("not json",), (None,), ('{"a": 1}',), ('[1, 2]',)])
        with self.assertRaises(sqlite3.OperationalError):
            self.conn.execute("SELECT json_extract(model_config, '$._reset_from') FROM s").fetchall()
        got = [row[0] for row in self.conn.execute(
            f"SELECT {_sql_json_extract('model_config', '$._reset_from')} FROM s ORDER BY rowid")]
        self.assertEqual(got, ["p1", None, None, None, None])
        # A quote in the path is bound as text, not SQL.
        self.conn.execute("""INSERT INTO s VALUES ('{"a''b": 7}')""")
        expression = _sql_json_extract("model_config", "$.\"a'b\"")
        self.assertEqual(self.conn.execute(f"SELECT {expression} FROM s WHERE rowid = 6").fetchone()[0], 7)

    def test_reset_child_sql_tells_a_reset_from_other_children(self):
        self.conn.executescript(SCHEMA_SQL)
        rows = [  # id, parent, end_reason, session_key, model_config
            ("root", None, "session_reset", "k1", None),
            ("marked", "other", None, "zz", json.dumps({"_reset_from": "other"})),
            ("legacy", "root", None, "k1", None),
            ("other-key", "root", None, "k2", None),
            ("no-key", "blank", None, "", None),
            ("blank", None, "session_reset", "", None),
            ("compressed", "squeezed", None, "k3", "garbage{"),
            ("squeezed", None, "compression", "k3", None),
        ]
        self.conn.executemany("INSERT INTO sessions (id, source, started_at, parent_session_id, end_reason,"
                              " session_key, model_config) VALUES (?, 'cli', 1, ?, ?, ?, ?)", rows)
        got = {row[0] for row in self.conn.execute(
            f"SELECT s.id FROM sessions AS s WHERE {_RESET_CHILD_SQL.format(a='s')}")}
        self.assertEqual(got, {"marked", "legacy"})

    def test_json_or_logs_what_it_could_not_read(self):
        self.assertEqual(_json_or('["u1", "u2"]', [], "unused"), ["u1", "u2"])
        self.assertEqual(_json_or("null", {}, "unused"), None)
        for raw in ("[u1", None, b"\xff"):
            with self.assertLogs("hermes_state", "WARNING") as logs:
                self.assertEqual(_json_or(raw, [], "uid list unreadable"), [])
            self.assertEqual([record.getMessage() for record in logs.records], ["uid list unreadable"])

    def test_end_reason_sets(self):
        self.assertEqual(_BOUNDARY_END_REASONS, {"session_reset", "session_switch", "idle", "daily", "suspended",
                                                 "resume_pending_expired", "new_session"})
        for reason in ("agent_close", "ws_orphan_reap", "superseded_by_resume", "startup_orphan_reap",
                       "tui_shutdown", "ws_disconnect", "idle_timeout", "lru_evict"):
            self.assertTrue(is_automatic_end_reason(reason), reason)
        for reason in ("session_reset", "new_session", "compression", "user_exit", "", None, 1, ["agent_close"]):
            self.assertFalse(is_automatic_end_reason(reason), reason)
        self.assertEqual(QUEUED_PROMPT_METADATA_KEY, "_queued_prompt")


class FileIdentity(TempDirTestCase):

    def test_a_replaced_store_has_another_identity(self):
        path = self.tmp / "state.db"
        sqlite3.connect(path).close()
        first = stat_db_file_identity(path)
        st = os.stat(path)
        self.assertEqual(first, (st.st_dev, st.st_ino))
        self.assertEqual(stat_db_file_identity(str(path)), first)
        replacement = self.tmp / "new.db"
        sqlite3.connect(replacement).close()
        os.replace(replacement, path)
        self.assertNotIn(stat_db_file_identity(path), (None, first))
        self.assertIsNone(stat_db_file_identity(self.tmp / "missing.db"))
