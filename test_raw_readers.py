"""Programs that read state.db with plain SQL: on a store our SessionDB wrote, `messages_fts` and
`messages_fts_trigram` answer as on the store hermes-agent 0.22 wrote from the same calls
(fixtures/hermes_v31_raw_readers.db.gz, made by fixtures/raw_readers_calls.py)."""

import importlib.util
import shutil
import sqlite3

from hermes_state import SessionDB
from hermes_state_common import SEARCH_OBJECTS, SEARCH_TRIGGERS, same_ddl
from hermes_state_fts import SessionSearchIndexMixin
from test_support import FIXTURES, TempDirTestCase, fixture_path, require

_SPEC = importlib.util.spec_from_file_location(
    "raw_readers_calls", FIXTURES / "raw_readers_calls.py")
CALLS = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(CALLS)

WORD_TERMS = ["segfault", "parser", "pytest", "head", "lorem", "tailneedle", "terminal",
              "web_search", "fts5", '"node.js"', "pars*", "segfault NOT parser",
              "segfault OR report", "tool_name:terminal", "tool_calls:bm25", "content:delegate",
              '"NULL deref"', "会话"]
TRIGRAM_TERMS = ["数据库迁移", "会话", "segfault", "parser", "ログを見", "迁移 schema", "terminal",
                 "pytest"]
# What raw readers run: matches, ranks, bm25 and snippets, joins to messages and sessions.
QUERIES = [
    "SELECT rowid FROM {t} WHERE {t} MATCH :q ORDER BY rowid",
    "SELECT rowid, round(rank, 9) FROM {t} WHERE {t} MATCH :q ORDER BY rank, rowid",
    "SELECT rowid, round(bm25({t}), 9), round(bm25({t}, 2.0, 1.0), 9) FROM {t}"
    " WHERE {t} MATCH :q ORDER BY rowid",
    "SELECT rowid, snippet({t}, 0, '>>>', '<<<', '...', 8), highlight({t}, 0, '[', ']')"
    " FROM {t} WHERE {t} MATCH :q ORDER BY rowid",
    "SELECT m.id, m.session_id, m.role, s.source FROM {t} JOIN messages AS m ON m.id = {t}.rowid"
    " JOIN sessions AS s ON s.id = m.session_id WHERE {t} MATCH :q ORDER BY rank, m.id",
    "SELECT count(*) FROM messages WHERE id IN (SELECT rowid FROM {t} WHERE {t} MATCH :q)",
]
WHOLE_TABLE = [
    "SELECT * FROM {t} ORDER BY rowid",  # the view each reads its columns from
    "SELECT rowid, length(content) FROM {t} ORDER BY rowid",
    "SELECT count(*) FROM {t}_docsize",
]


class RawReadersTest(TempDirTestCase):

    def setUp(self):
        super().setUp()
        require(self, "trigram", "raw readers query both of hermes-agent's indexes")
        self.theirs = self.tmp / "theirs.db"
        shutil.copyfile(fixture_path("hermes_v31_raw_readers.db"), self.theirs)
        self.ours = self.tmp / "ours.db"
        with SessionDB(self.ours) as db:
            CALLS.write(db)
        SessionDB(self.ours).close()  # a second open, as the fixture had

    def both(self, sql, params=()):
        answers = []
        for path in (self.ours, self.theirs):
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            try:
                cursor = conn.execute(sql, params)
                answers.append(([d[0] for d in cursor.description], cursor.fetchall()))
            finally:
                conn.close()
        return answers

    def assert_same(self, sql, params=()):
        ours, theirs = self.both(sql, params)
        self.assertEqual(ours, theirs, f"{sql} {params}")
        return ours[1]

    def test_the_same_calls_give_the_same_message_rows(self):
        self.assert_same("SELECT id, session_id, role, content, tool_name, tool_calls FROM messages"
                         " ORDER BY id")

    def test_word_index_matches_ranks_and_snippets_are_hermes_agents(self):
        hits = 0
        for term in WORD_TERMS:
            for sql in QUERIES:
                hits += len(self.assert_same(sql.format(t="messages_fts"), {"q": term}))
        self.assertGreater(hits, 100)

    def test_trigram_index_matches_ranks_and_snippets_are_hermes_agents(self):
        hits = 0
        for term in TRIGRAM_TERMS:
            for sql in QUERIES:
                hits += len(self.assert_same(sql.format(t="messages_fts_trigram"), {"q": term}))
        self.assertGreater(hits, 50)

    def test_each_index_holds_the_rows_and_columns_hermes_agent_gives_it(self):
        for table in ("messages_fts", "messages_fts_trigram"):
            for sql in WHOLE_TABLE:
                self.assert_same(sql.format(t=table))
        # Tool output past 8,192 characters, cron, subagent and delegate sessions: as 0.22 leaves
        # them out.
        self.assertEqual(self.assert_same(
            "SELECT count(*) FROM messages_fts WHERE messages_fts MATCH 'tailneedle'"), [(0,)])
        sources = self.assert_same(
            "SELECT DISTINCT s.source FROM messages_fts_trigram AS t"
            " JOIN messages AS m ON m.id = t.rowid JOIN sessions AS s ON s.id = m.session_id"
            " ORDER BY 1")
        self.assertEqual(sources, [("cli",), ("telegram",)])

    def test_the_index_objects_and_keys_are_hermes_agents(self):
        ours, theirs = self.both("SELECT type, name, sql FROM sqlite_master"
                                 " WHERE name LIKE 'messages_fts%' ORDER BY name")
        self.assertEqual([row[:2] for row in ours[1]], [row[:2] for row in theirs[1]])
        for (_kind, name, sql), (_theirs_kind, _name, their_sql) in zip(ours[1], theirs[1]):
            self.assertTrue(same_ddl(sql, their_sql), name)
        wanted = {name: ddl for part in (SEARCH_OBJECTS, SEARCH_TRIGGERS)
                  for index in ("word", "trigram") for name, ddl in part[index].items()
                  if name.startswith("messages_fts")}
        self.assertEqual({name: same_ddl(sql, wanted[name]) for _kind, name, sql in theirs[1]
                          if name in wanted}, dict.fromkeys(wanted, True))
        self.assert_same("SELECT key, value FROM state_meta WHERE key LIKE 'fts%' ORDER BY key")

    def test_hermes_agent_0_22_finds_its_own_layout_with_nothing_to_redo(self):
        # What 0.22's open asks before it rebuilds, realigns or stamps (hermes_state_schema.py).
        conn = sqlite3.connect(f"file:{self.ours}?mode=ro", uri=True)
        self.addCleanup(conn.close)
        self.assertFalse(SessionSearchIndexMixin._db_needs_fts_storage_upgrade(conn))
        self.assertIn("messages_fts_src", conn.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'messages_fts'").fetchone()[0])
        self.assertEqual(conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE type = 'trigger' AND name IN"
            " ('messages_fts_insert', 'messages_fts_delete', 'messages_fts_update',"
            " 'messages_fts_trigram_insert', 'messages_fts_trigram_delete',"
            " 'messages_fts_trigram_update') AND sql LIKE '%AFTER %'").fetchone()[0], 6)
        self.assertEqual(conn.execute(
            "SELECT value FROM state_meta WHERE key = 'fts_storage_version'").fetchone()[0], "3")
        self.assertIsNone(conn.execute("SELECT 1 FROM state_meta WHERE key IN"
                                       " ('fts_rebuild_high_water', 'fts_stale')").fetchone())
        writer = sqlite3.connect(self.ours, isolation_level=None)
        self.addCleanup(writer.close)
        for table in ("messages_fts", "messages_fts_trigram"):  # 0.22's own probe of its index
            writer.execute(f"INSERT INTO {table}({table}, rank) VALUES ('integrity-check', 1)")

    def test_our_open_of_hermes_agents_store_keeps_its_index_and_adds_ours_beside(self):
        before = self.both("SELECT type, name, sql FROM sqlite_master ORDER BY name")[1][1]
        with SessionDB(self.theirs) as db:
            self.assertEqual(db.fts_layout(), "current")
            # (3 is a tool row, which CJK searches leave out; 9 a cron one, in 0.22's scan too)
            self.assertEqual({hit["id"] for hit in db.search_messages("会话")}, {1, 9})
        after = self.both("SELECT type, name, sql FROM sqlite_master ORDER BY name")[1][1]
        self.assertEqual([row for row in after if row[1].startswith("messages_fts")],
                         [row for row in before if row[1].startswith("messages_fts")])
        self.assertEqual(self.assert_same(
            "SELECT rowid, round(rank, 9) FROM messages_fts WHERE messages_fts MATCH 'parser'"
            " ORDER BY rank"), self.both(
            "SELECT rowid, round(rank, 9) FROM messages_fts WHERE messages_fts MATCH 'parser'"
            " ORDER BY rank")[0][1])
