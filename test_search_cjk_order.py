"""CJK searches by time: the walk from the newest ids with the CJK bounds gives the plain sort's page, and
layout 1 stores get the bounds in chunks."""

import random
import re
import sqlite3
from unittest import mock

import hermes_state_fts
from hermes_state import SessionDB
from hermes_state_common import SEARCH_LAYOUT_VERSION, SEARCH_TRIGGERS
from test_support import HAS_FTS5, TempDirTestCase, require, tracing_factory, without_fts5, without_trigram

WORDS = ("数据库", "索引", "会话", "备份")
FLOOR_RE = re.compile(r"hs_fts_cjk\.rowid >= (\d+)")
# Layout 1's CJK insert and update triggers: ours raising no bound and blind to the time.
LAYOUT_1_TRIGGERS = {name: "\n".join(line for line in SEARCH_TRIGGERS["cjk"][name].split("\n")
                                     if "hs_fts_cjk_bounds" not in line and "ON CONFLICT" not in line).replace(
    "\nAFTER UPDATE OF content, role, timestamp", " AFTER UPDATE OF content, role").replace(" OR old.timestamp IS NOT new.timestamp)\n AND", ") AND")
    for name in ("hs_fts_cjk_insert", "hs_fts_cjk_update")}
CASES = [("库", {}), ("索引", {"limit": 7, "offset": 3}), ("会话", {"limit": 50}), ("备", {"offset": 40}),
         ("库", {"source_filter": ["import"]}), ("索引", {"role_filter": ["assistant"]}),
         ("会话", {"exclude_sources": ["cli"], "limit": 5}), ("库 索引", {}), ("份", {"include_inactive": True})]


def fill(db, sessions=80, per_session=60, seed=5):
    """Sessions in time order (more blocks than a walk takes as late ones), then old ones imported after
    them (higher ids, earlier times), a few rewound rows, and a batch of equal times across a block edge."""
    rng = random.Random(seed)

    def messages(start):
        return [{"role": rng.choice(("user", "assistant", "tool")), "timestamp": start + i,
                 "content": f"step {i} " + "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 2)))}
                for i in range(per_session)]
    for number in range(sessions):
        db.create_session(f"s{number}", "cli")
        db.append_messages_batch(f"s{number}", messages(100_000 + 1000 * number))
    db.import_sessions([{"id": f"old{number}", "source": "import", "started_at": 500 + number,
                         "messages": messages(500 + 1000 * number)} for number in range(6)])
    db.create_session("same", "cli")
    db.append_messages_batch("same", [{"role": "user", "content": f"{i} 数据库索引", "timestamp": 100_500.0}
                                      for i in range(300)])
    db._update_rows("UPDATE messages SET active = 0 WHERE id % 17 = 0", ())
    while db.fts_rebuild_step():
        pass


def plain_page(conn, query, limit=20, offset=0, source_filter=None, role_filter=None, exclude_sources=None,
               include_inactive=False):
    """The page as a sort of every hit gives it: any term, newest first, equal times by ascending id."""
    where = " OR ".join("m.content LIKE ?" for _ in query.split())
    params = [f"%{term}%" for term in query.split()]
    for column, values, negate in (("s.source", source_filter, ""), ("m.role", role_filter, ""),
                                   ("s.source", exclude_sources, "NOT ")):
        if values:
            where = f"({where}) AND {column} {negate}IN ({', '.join('?' * len(values))})"
            params += values
    if not include_inactive:
        where = f"({where}) AND (m.active = 1 OR m.compacted = 1)"
    return [row[0] for row in conn.execute(
        f"SELECT m.id FROM messages AS m JOIN sessions AS s ON s.id = m.session_id WHERE m.role <> 'tool' AND "
        f"({where}) ORDER BY m.timestamp DESC, m.id ASC LIMIT ? OFFSET ?", params + [limit, offset])]


class PagesByTimeFromTheNewestIds(TempDirTestCase):

    def setUp(self):
        super().setUp()
        self.path = self.tmp / "state.db"
        with SessionDB(self.path) as db:
            fill(db)
        self.conn = self.raw(self.path)
        self.statements = []
        self.db = SessionDB(self.path, connection_factory=tracing_factory(self.statements))
        self.addCleanup(self.db.close)

    def floors(self):
        return [int(found) for s in self.statements for found in FLOOR_RE.findall(s)]

    def assert_plain_pages(self, db, walked=True):
        for query, kwargs in CASES:
            with self.subTest(query=query, **kwargs):
                del self.statements[:]
                hits = db.search_messages(query, fields=("id",), **kwargs)
                self.assertEqual([hit["id"] for hit in hits], plain_page(self.conn, query, **kwargs))
        # (without FTS5 there is no side index to walk: the fallback sorts every hit)
        self.assertEqual(bool(self.floors()) and max(self.floors()) > 0, walked and HAS_FTS5, self.floors())

    def test_pages_are_the_plain_sorts_with_imported_old_sessions_and_equal_times(self):
        self.assert_plain_pages(self.db)
        del self.statements[:]
        self.db.search_messages("据库", limit=20)
        if HAS_FTS5:
            self.assertGreater(min(self.floors()), 0)  # the page was cut from the newest ids alone

    def test_the_walk_reads_hits_in_the_index_order_with_no_sorter(self):
        require(self, "fts5", "the side index's walk")
        del self.statements[:]
        self.db.search_messages("库", source_filter=["cli"])
        walk = [s for s in self.statements if s.endswith("ORDER BY hs_fts_cjk.rowid DESC")]
        self.assertEqual(len(walk), 1, self.statements)
        plan = [row[3] for row in self.conn.execute("EXPLAIN QUERY PLAN " + walk[0])]
        self.assertFalse([detail for detail in plan if "TEMP B-TREE" in detail], plan)
        self.assertIn("VIRTUAL TABLE INDEX", plan[0])  # FTS5 is the outer loop

    def test_a_row_given_a_later_time_leads_the_page_once_drained_and_before(self):
        # The first session's: far below the page's floor, in a block only a raised bound brings in.
        old = self.conn.execute("SELECT min(id) FROM messages WHERE session_id = 's0' AND role = 'user' "
                                "AND active = 1 AND content LIKE '%索引%'").fetchone()[0]
        self.conn.execute("UPDATE messages SET timestamp = 1000000000 WHERE id = ?", (old,))
        self.conn.commit()
        self.assertEqual(self.db.search_messages("索引", fields=("id",))[0]["id"], old)  # queued: every hit sorted
        while self.db.fts_rebuild_step():
            pass
        self.assertEqual(self.db.search_messages("索引", fields=("id",))[0]["id"], old)
        self.assert_plain_pages(self.db)

    def test_a_row_an_older_release_drained_from_the_queue_has_its_bound(self):
        writer = sqlite3.connect(self.path)  # a low id, a late time, drained as layout 1 does it (no bounds)
        writer.execute("INSERT INTO messages (id, session_id, role, content, timestamp, active) "
                       "VALUES (-5, 's1', 'user', '索引', 1000000000, 1)")
        if HAS_FTS5:  # (without it no side index, no bound: the fallback must still put it first)
            writer.execute("INSERT OR REPLACE INTO hs_fts_cjk(rowid, terms) VALUES (-5, '索 引 索引')")
            writer.execute("DELETE FROM hs_fts_cjk_queue WHERE id = -5")
        writer.commit()
        writer.close()
        self.assertEqual(self.db.search_messages("索引", fields=("id",))[0]["id"], -5)
        self.assert_plain_pages(self.db)

    def test_while_the_bounds_are_filled_pages_sort_every_hit_and_the_next_open_finishes(self):
        require(self, "fts5", "the side index's bounds")
        self.conn.execute("DELETE FROM hs_fts_cjk_bounds")
        self.conn.execute("INSERT INTO state_meta(key, value) VALUES ('hs_search_cjk_bounds_progress', '0')")
        self.conn.commit()
        self.assert_plain_pages(self.db, walked=False)
        with SessionDB(self.path) as db:
            self.assertIsNone(db.get_meta("hs_search_cjk_bounds_progress"))
        self.assert_plain_pages(self.db)

    def test_a_runtime_without_trigram_walks_too(self):
        with SessionDB(self.path, connection_factory=without_trigram) as db:
            self.assert_plain_pages(db, walked=False)  # its trace is not ours: the pages alone
        self.assert_plain_pages(self.db)

    def test_an_english_append_never_touches_the_cjk_index(self):
        cjk_rows = ("SELECT (SELECT count(*) FROM hs_fts_cjk_queue),"
                    " (SELECT group_concat(newest) FROM hs_fts_cjk_bounds)")
        before = self.db._read_one(cjk_rows) if HAS_FTS5 else None
        del self.statements[:]
        self.db.append_message("s0", role="user", content="plain english words only")
        # (Python 3.8's trace also names a trigger whose WHEN clause then declines: "-- TRIGGER ...".)
        # Without FTS5 the append goes on and touches no index of ours at all.
        touched = "hs_fts_cjk" if HAS_FTS5 else "hs_fts"
        self.assertFalse([s for s in self.statements if touched in s and not s.startswith("--")],
                         self.statements)
        self.assertEqual(self.db.get_messages("s0")[-1]["content"], "plain english words only")
        if HAS_FTS5:
            self.assertEqual(tuple(self.db._read_one(cjk_rows)), tuple(before))


class LayoutOneStores(TempDirTestCase):

    def setUp(self):
        super().setUp()
        require(self, "fts5", "layout 1's side index, its bounds missing")
        self.path = self.tmp / "state.db"
        with SessionDB(self.path) as db:
            fill(db, sessions=10)
        self.conn = self.raw(self.path)
        self.conn.executescript("DROP TABLE hs_fts_cjk_bounds; DROP TRIGGER hs_fts_cjk_insert; "
                                "DROP TRIGGER hs_fts_cjk_update; UPDATE state_meta SET value = '1' "
                                "WHERE key = 'hs_search_layout';" + "".join(
                                    f"{sql};" for sql in LAYOUT_1_TRIGGERS.values()))
        self.conn.commit()
        self.words_before = self.conn.execute("SELECT count(*), sum(length(block)) FROM messages_fts_data").fetchone()

    def assert_layout_2(self, db):
        self.assertEqual(db.get_meta("hs_search_layout"), str(SEARCH_LAYOUT_VERSION))
        self.assertIsNone(db.get_meta("hs_search_cjk_bounds_progress"))
        for name in LAYOUT_1_TRIGGERS:
            sql = self.conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (name,)).fetchone()[0]
            self.assertEqual(sql, SEARCH_TRIGGERS["cjk"][name])
        self.assert_plain_pages(db)

    def assert_plain_pages(self, db):
        """Every CASES page `db` answers is the plain query's: every hit sorted by time."""
        for query, kwargs in CASES:
            hits = db.search_messages(query, fields=("id",), **kwargs)
            self.assertEqual([hit["id"] for hit in hits], plain_page(self.conn, query, **kwargs), (query, kwargs))

    def test_its_open_fills_the_bounds_in_chunks_without_rebuilding_an_index(self):
        statements = []
        last = self.conn.execute("SELECT max(id) FROM messages").fetchone()[0]
        with mock.patch.object(hermes_state_fts, "CJK_BOUNDS_CHUNK_IDS", 100), \
                SessionDB(self.path, connection_factory=tracing_factory(statements)) as db:
            fills = [s for s in statements if s.startswith("INSERT INTO hs_fts_cjk_bounds")]
            self.assertEqual(len(fills), -(-last // 100))
            self.assertFalse([s for s in statements if "INSERT INTO messages_fts" in s or "hs_retired_" in s])
            self.assert_layout_2(db)
        self.assertEqual(self.conn.execute("SELECT count(*), sum(length(block)) FROM messages_fts_data").fetchone(),
                         self.words_before)

    def test_bounds_a_layout_1_writer_left_stale_are_not_trusted_until_the_next_writable_open(self):
        self.conn.execute("CREATE TABLE hs_fts_cjk_bounds (block INTEGER PRIMARY KEY, newest)")  # empty: stale
        self.conn.commit()
        with SessionDB(self.path, read_only=True) as db:
            self.assert_plain_pages(db)
        with SessionDB(self.path) as db:
            self.assert_layout_2(db)

    def test_a_runtime_without_fts5_answers_and_a_later_one_with_it_fills_the_bounds(self):
        with SessionDB(self.path, connection_factory=without_fts5) as db:
            self.assert_plain_pages(db)
        with SessionDB(self.path) as db:
            self.assert_layout_2(db)
            self.assertGreater(self.conn.execute("SELECT count(*) FROM hs_fts_cjk_bounds").fetchone()[0], 0)


if __name__ == "__main__":
    import unittest
    unittest.main()
