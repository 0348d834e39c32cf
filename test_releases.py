"""One store, several programs, without the programs: hermes-agent 0.19, 0.20 and 0.22 played from facts.

Each release's own search index (tables, views, triggers) is read off a store that release wrote
(fixtures/) and applied to ours as its open does on a store without its index (all three build and
fill theirs then); its writes are plain SQL inserts, which fire its triggers and ours alike.
`make compat` runs the same round trips with the real releases (compat/releases.py). Our previous
release's stores (layout 2 under hermes-agent's names), as written and as 0.20 and 0.22 left them,
are fixtures too.
"""

import re
import sqlite3

from hermes_state import SessionDB
from hermes_state_common import SEARCH_TRIGGERS
from test_support import HAS_FTS5, HAS_TRIGRAM, V22_DB, V26_DB, TempDirTestCase, dump_hash, fixture_path, \
    require, tracing_factory, write_statements

V31_DB = "hermes_v31_store.db"
RELEASES = {"0.19": V22_DB, "0.20": V26_DB, "0.22": V31_DB}
# What each release stamps in its own key once its index is built.
RELEASE_STAMPS = {"0.19": None, "0.20": "1", "0.22": "3"}
LAYOUT2 = ("hermes_state_layout2.db", "hermes_state_layout2_after_v20.db", "hermes_state_layout2_after_v22.db")
CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+")
TEXTS = ("请检查会话历史和数据库迁移", "好的，会话已保存", "deploy the service to staging", "迁移 schema 完成",
         "日本語のテキスト検索", "한국어 검색 테스트", "索引 rebuild 会")


def release_index_ddl(release):
    """The release's own search index objects (views, virtual tables, triggers), in creation order; where
    SQLite has no trigram tokenizer, without its trigram index (the release's open gives that one up), and
    without FTS5 none at all."""
    conn = sqlite3.connect(f"file:{fixture_path(RELEASES[release])}?mode=ro", uri=True)
    try:
        return [sql for kind, sql in conn.execute(
            "SELECT type, sql FROM sqlite_master WHERE name LIKE 'messages_fts%' ORDER BY rowid")
            if (kind != "table" or sql.startswith("CREATE VIRTUAL")) and (HAS_TRIGRAM or "trigram" not in sql)
            and HAS_FTS5]
    finally:
        conn.close()


def connect(path):
    return sqlite3.connect(path, isolation_level=None, timeout=10)


def open_as(release, path):
    """What the release's open does to a store without its index: create it, fill it, stamp it."""
    conn = connect(path)
    try:
        present = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        for sql in release_index_ddl(release):
            name = sql.split()[3] if sql.startswith("CREATE VIRTUAL") else sql.split()[2]
            if name in present:
                continue
            conn.execute(sql)
            if sql.startswith("CREATE VIRTUAL") and "content=" in sql:
                conn.execute(f"INSERT INTO {name}({name}) VALUES ('rebuild')")
            elif sql.startswith("CREATE VIRTUAL"):  # 0.19's inline index keeps its own copy of the text
                conn.execute(f"INSERT INTO {name}(rowid, content) SELECT id, COALESCE(content, '') || ' ' || "
                             "COALESCE(tool_name, '') || ' ' || COALESCE(tool_calls, '') FROM messages")
        if RELEASE_STAMPS[release]:
            conn.execute("INSERT OR REPLACE INTO state_meta (key, value) VALUES ('fts_storage_version', ?)",
                         (RELEASE_STAMPS[release],))
    finally:
        conn.close()


def write_as_release(path, tag):
    """A release's turn: a session and messages written with plain SQL (its triggers and ours fire)."""
    conn = connect(path)
    try:
        conn.execute("INSERT INTO sessions (id, source, started_at) VALUES (?, 'cli', 1)", (tag,))
        for i, text in enumerate(TEXTS):
            conn.execute("INSERT INTO messages (session_id, role, content, timestamp, active) VALUES (?, ?, ?, ?, 1)",
                         (tag, "user" if i % 2 else "assistant", f"{text} {tag}", i))
        conn.execute("INSERT INTO messages (session_id, role, content, tool_name, timestamp, active) "
                     "VALUES (?, 'tool', ?, 'terminal', 9, 1)", (tag, "x" * 3000 + " 会话"))
        conn.execute("UPDATE messages SET content = content || ' edited' WHERE session_id = ? AND role = 'user'",
                     (tag,))
    finally:
        conn.close()


def write_as_ours(path, tag):
    with SessionDB(path) as db:
        db.create_session(tag, "cli")
        for i, text in enumerate(TEXTS):
            db.append_message(tag, "user" if i % 2 else "assistant", f"{text} {tag}")
        db.append_message(tag, "tool", "y" * 3000 + " 会话", tool_name="terminal")


class StoresSharedWithReleases(TempDirTestCase):

    def assert_whole(self, path, messages):
        """Every row there, every FTS5 index consistent, our CJK search complete."""
        conn = connect(path)
        try:
            self.assertEqual(conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0], messages)
            self.assertEqual(conn.execute("PRAGMA integrity_check").fetchone()[0], "ok")
            tables = [row[0] for row in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND sql LIKE 'CREATE VIRTUAL%'"
                + ("" if HAS_TRIGRAM else " AND sql NOT LIKE '%trigram%'"))]  # (one this SQLite cannot open)
            self.assertEqual("messages_fts" in tables, HAS_FTS5)
            for table in tables:
                try:
                    conn.execute(f"INSERT INTO {table}({table}) VALUES ('integrity-check')")
                except sqlite3.DatabaseError as exc:
                    self.fail(f"{table}: {exc}")
            rows = conn.execute("SELECT id, content FROM messages WHERE role <> 'tool' AND active = 1").fetchall()
        finally:
            conn.close()
        terms = {run[i:i + n] for _id, content in rows for run in CJK.findall(content or "")
                 for n in (1, 2, 3, 4) for i in range(len(run) - n + 1)}
        with SessionDB(path, read_only=True) as db:
            self.assertEqual(db.fts_layout(), "current" if HAS_FTS5 else "none")
            for term in sorted(terms):
                found = {hit["id"] for hit in db.search_messages(term, limit=1000)}
                self.assertEqual(found, {i for i, content in rows if term in content}, term)
            self.assertEqual(db.doctor()["trigger_damage"], [])

    def round_trip(self, release):
        path = self.tmp / "state.db"
        write_as_ours(path, "ours-1")
        open_as(release, path)
        write_as_release(path, "theirs-1")
        self.assert_whole(path, 16)
        write_as_ours(path, "ours-2")
        open_as(release, path)
        write_as_release(path, "theirs-2")
        self.assert_whole(path, 32)
        return path

    def test_a_store_we_made_goes_through_0_22_and_back_and_each_keeps_writing(self):
        path = self.round_trip("0.22")
        conn = connect(path)
        self.addCleanup(conn.close)
        self.assertEqual(conn.execute("SELECT value FROM state_meta WHERE key = 'fts_storage_version'").fetchone(),
                         ("3",))  # 0.22's stamp, left as it wrote it
        if HAS_FTS5:  # (without it 0.22 makes no index)
            self.assertEqual(conn.execute("SELECT COUNT(*) FROM messages_fts").fetchone()[0], 32)

    def test_a_store_we_made_goes_through_0_20_and_back_and_each_keeps_writing(self):
        self.round_trip("0.20")

    def test_a_store_we_made_goes_through_0_19_and_back_and_each_keeps_writing(self):
        self.round_trip("0.19")

    def test_a_store_each_release_made_takes_our_writes_and_then_theirs(self):
        for release, fixture in RELEASES.items():
            with self.subTest(release=release):
                path = self.copy_fixture(fixture)
                write_as_ours(path, "ours")
                write_as_release(path, "theirs")
                conn = connect(path)
                try:
                    for table in ("messages_fts", "messages_fts_trigram")[:2 if HAS_TRIGRAM else int(HAS_FTS5)]:
                        conn.execute(f"INSERT INTO {table}({table}) VALUES ('integrity-check')")
                    count = conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
                    # 0.19's inline index serves as it is (as 0.22 keeps it); 0.20's moved to layout 3 with
                    # our CJK index beside it; 0.22's is layout 3, ours added beside.
                    ours = conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE name LIKE 'hs\\_fts\\_%' "
                                        "ESCAPE '\\'").fetchone()[0]
                    self.assertEqual(bool(ours), release != "0.19" and HAS_FTS5)
                finally:
                    conn.close()
                with SessionDB(path) as db:
                    # (0.22's own index is layout 3, which is ours: no FTS5 needed to say so)
                    self.assertEqual(db.fts_layout(), "legacy" if release == "0.19" else
                                     "current" if HAS_FTS5 or release == "0.22" else "external")
                    self.assertEqual(len({h["id"] for h in db.search_messages("会话", limit=1000)}),
                                     3 + 2 * 2)  # the fixture's three, and ours and theirs (not the tool rows)
                    self.assertEqual(db.message_count(), count)

    def test_hermes_agents_cjk_triggers_are_dropped_as_it_drops_them_and_its_table_kept(self):
        require(self, "fts5", "it makes an FTS5 table")
        path = self.tmp / "state.db"
        write_as_ours(path, "ours")
        conn = connect(path)
        conn.execute("CREATE VIRTUAL TABLE messages_fts_cjk USING fts5(content, content='messages', "
                     "content_rowid='id')")
        for op, when in (("insert", "AFTER INSERT"), ("delete", "AFTER DELETE"), ("update", "AFTER UPDATE")):
            conn.execute(f"CREATE TRIGGER messages_fts_cjk_{op} {when} ON messages BEGIN SELECT 1; END")
        conn.close()
        with SessionDB(path) as db:  # its tokenizer is loaded by its own connections only
            self.assertEqual(db.get_meta("fts_cjk_stale"), "1")
            db.append_message("ours", "user", "after")
        conn = connect(path)
        self.addCleanup(conn.close)
        names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        self.assertIn("messages_fts_cjk", names)
        self.assertFalse({f"messages_fts_cjk_{op}" for op in ("insert", "delete", "update")} & names)


class OurNames(TempDirTestCase):

    def test_no_table_trigger_view_or_key_of_our_index_is_a_name_a_release_uses(self):
        theirs, their_keys, schema = set(), set(), set()
        for release, fixture in RELEASES.items():
            conn = sqlite3.connect(f"file:{fixture_path(fixture)}?mode=ro", uri=True)
            theirs |= {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
            their_keys |= {row[0] for row in conn.execute("SELECT key FROM state_meta")}
            if release in ("0.20", "0.22"):  # the references' schemas: tables and indexes we share on purpose
                schema |= {row[0] for row in conn.execute(
                    "SELECT name FROM sqlite_master WHERE name NOT LIKE 'messages_fts%'")}
            conn.close()
        path = self.tmp / "state.db"
        write_as_ours(path, "ours")
        with SessionDB(path) as db:
            db.set_meta("hs_search_stale_word", "1")  # every key our index writes, once
        conn = connect(path)
        # hermes-agent's index (layout 3) and its stamp are the store's own, under its names on purpose.
        ours = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")
                if not row[0].startswith("messages_fts")} - schema
        keys = {row[0] for row in conn.execute("SELECT key FROM state_meta")} - {"fts_storage_version"}
        conn.close()
        # hs_session_* and hs_listing_*: the listing aids (issue 27), tables and their triggers.
        ours_prefixes = ("hs_fts_", "hs_trigram_", "hs_idx_", "hs_session_", "hs_listing_")
        self.assertTrue(ours and all(name.startswith(ours_prefixes) for name in ours), ours)
        self.assertFalse(ours & theirs)
        # Beside ours, only schema 31's keys of who the store is and how far its uid backfill got,
        # as 0.22 writes them (the index's keys are hermes-agent's own: never ours).
        shared = {"store_instance_id", "store_created_at_utc", "db_file_generation",
                  "message_uid_backfill"}
        self.assertLessEqual(shared, their_keys)
        self.assertEqual({k for k in keys if not k.startswith(("hs_search_", "hs_listing_"))},
                         shared)
        self.assertFalse((keys - shared) & their_keys)
        # hermes-agent's own prefixes: its index objects, its demoted tables, its index keys.
        self.assertFalse([n for n in ours | keys if n.startswith(("messages_fts", "fts_v22_trash_", "fts_"))])


class OurPreviousLayout(TempDirTestCase):

    def test_our_previous_layout_moves_to_our_own_names_as_written_and_as_0_20_and_0_22_left_it(self):
        for fixture in LAYOUT2:
            with self.subTest(fixture=fixture):
                path = self.copy_fixture(fixture)
                count = self.raw(path).execute("SELECT COUNT(*) FROM messages").fetchone()[0]
                if not HAS_FTS5:  # the move waits for FTS5; writes go on, the fallback answers
                    with SessionDB(path) as db:
                        # (0.22 rebuilt messages_fts there as its layout 3, which is ours)
                        self.assertEqual(db.fts_layout(), "current" if fixture.endswith("v22.db") else "previous")
                        new = db.append_message("prev_0", "user", "after the open 会话")
                        self.assertIn(new, {hit["id"] for hit in db.search_messages("会话", limit=1000)})
                    self.assertEqual(self.raw(path).execute("SELECT COUNT(*) FROM messages").fetchone()[0], count + 1)
                    continue
                with SessionDB(path) as db:
                    self.assertEqual(db.fts_layout(), "current")
                    db.append_message("prev_0", "user", "after the move 会话")
                conn = connect(path)
                names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
                meta = dict(conn.execute("SELECT key, value FROM state_meta"))
                conn.close()
                gone = {"messages_fts_projection", "messages_fts_trigram_projection", "messages_cjk_pending"}
                stuck = set()
                if not HAS_TRIGRAM:  # SQLite cannot rename it without its tokenizer: it stays, nothing writes it
                    stuck = {name for name in names if name.startswith("messages_fts_trigram")} - {
                        "messages_fts_trigram_src"}
                    self.assertIn("messages_fts_trigram", stuck)
                    self.assertFalse(any("messages_fts_trigram" in (sql or "") for (sql,) in self.raw(path).execute(
                        "SELECT sql FROM sqlite_master WHERE type = 'trigger'")))
                    names -= stuck
                self.assertFalse(gone & names)
                self.assertFalse([name for name in names if name.startswith("hs_retired_")])
                self.assertTrue(set(name for index, triggers in SEARCH_TRIGGERS.items() for name in triggers
                                    if HAS_TRIGRAM or index != "trigram") <= names)
                # Every store ends on hermes-agent's layout 3, its stamp written once it is whole.
                self.assertTrue({"messages_fts", "messages_fts_insert", "messages_fts_src"} <= names)
                self.assertEqual(meta["fts_storage_version"], "3")
                self.assertFalse([key for key in meta if key.startswith(("fts_rebuild_", "fts_stale"))])
                self.assert_moved_store_is_whole(path, count + 1)

    def assert_moved_store_is_whole(self, path, messages):
        StoresSharedWithReleases.assert_whole(self, path, messages)
        SessionDB(path).close()  # indexes the CJK row the append queued
        statements = []
        with SessionDB(path, connection_factory=tracing_factory(statements)):
            pass
        self.assertEqual(write_statements(statements), [])  # settled: the next open writes nothing
        content = dump_hash(path)
        SessionDB(path).close()
        self.assertEqual(dump_hash(path), content)
