"""The pure SQL helpers of hermes_state_common."""

import sqlite3
import unittest

from hermes_state_common import (
    chunked, escape_like, prefix_bounds, quote_identifier,
)


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
