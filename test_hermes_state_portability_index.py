"""Portability: an import's rows are in every search index of ours when import_sessions returns."""

import shutil
import sqlite3

from hermes_state import SessionDB
from test_support import INDEX_TABLES, RANKED_TABLES, StoreTestCase, require

PAYLOAD_MESSAGES = [
    {"role": "user", "content": "the quokka parser fails 漢字 twice", "timestamp": 1.0},
    {"role": "assistant", "content": "Running the tests.", "timestamp": 2.0,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "terminal", "arguments": "{}"}}]},
    # Longer than the prefix of a tool row the word index keeps.
    {"role": "tool", "content": "narwhal output " + "x " * 1500 + "tail", "tool_name": "terminal",
     "tool_call_id": "c1", "timestamp": 3.0},
    {"role": "assistant", "content": "長い日本語の文章を検索する axolotl", "timestamp": 4.0},
    {"role": "user", "content": "a rewound pangolin 猫", "timestamp": 5.0, "active": 0},
    {"role": "user", "content": ["wombat in a list", {"type": "text", "text": "ibis"}], "timestamp": 6.0},
]
# (query, role filter or None): each finds exactly one message of a session.
QUERIES = [("quokka", None), ("漢字", None), ("narwhal", ["tool"]), ("日本語", None), ("axolotl", None),
           ("wombat", None)]


def payload(count):
    return [{"id": f"imp{n}", "source": "cli", "started_at": float(n),
             "messages": [dict(m, content=f"{m['content']} s{n}" if isinstance(m["content"], str) else m["content"])
                          for m in PAYLOAD_MESSAGES]} for n in range(count)]


def index_contents(path):
    """What each index of ours holds, by message id: the word and trigram indexes' sizes per
    row and totals (a row indexed twice counts twice there, unseen by FTS5's integrity-check),
    and the CJK index's terms per row with the ids still queued for it; only the indexes this
    SQLite keeps (INDEX_TABLES)."""
    conn = sqlite3.connect(path)
    try:
        contents = {index: conn.execute(f"SELECT id, sz FROM {table}_docsize ORDER BY id").fetchall()
                    for index, table in INDEX_TABLES.items() if index != "cjk"}
        contents["totals"] = [conn.execute(f"SELECT block FROM {table}_data WHERE id = 1").fetchone()
                              for table in RANKED_TABLES]
        if "cjk" in INDEX_TABLES:
            contents["cjk"] = sorted(conn.execute("SELECT rowid, terms FROM hs_fts_cjk").fetchall() + [
                (id_, None) for (id_,) in conn.execute("SELECT id FROM hs_fts_cjk_queue")])
        contents["marks"] = conn.execute(
            "SELECT key, value FROM state_meta WHERE key IN ('hs_search_high_water', 'hs_search_progress',"
            " 'fts_rebuild_high_water', 'fts_rebuild_progress') ORDER BY key").fetchall()
        return contents
    finally:
        conn.close()


def indexed_row_total(path, table):
    """The row count FTS5 keeps for `table` (the first varint of its averages record)."""
    conn = sqlite3.connect(path)
    try:
        block, total = conn.execute(f"SELECT block FROM {table}_data WHERE id = 1").fetchone()[0], 0
    finally:
        conn.close()
    for byte in block[:8]:
        total = total << 7 | byte & 0x7F
        if byte < 0x80:
            return total
    raise AssertionError("varint too long for this test")


def integrity_check(path):
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for table in INDEX_TABLES.values():
            conn.execute(f"INSERT INTO {table}({table}) VALUES ('integrity-check')")
    finally:
        conn.close()


class ImportedRowsAreIndexed(StoreTestCase):

    def import_ok(self, sessions):
        result = self.db.import_sessions(sessions)
        self.assertTrue(result["ok"], result)
        return result

    def rebuilt_contents(self):
        """The indexes as a rebuild from the stored messages makes them, on a copy of the store."""
        copy = self.tmp / "rebuilt.db"
        self.db.close()
        shutil.copyfile(self.path, copy)
        wal = self.path.with_name(self.path.name + "-wal")
        if wal.exists():  # another connection of the test kept it from being checkpointed away
            shutil.copyfile(wal, copy.with_name(copy.name + "-wal"))
        with SessionDB(copy) as db:
            db.rebuild_fts()
        return index_contents(copy)

    def assert_each_query_finds_each_session(self, sessions, others=()):
        for query, roles in QUERIES:
            with self.subTest(query=query):
                hits = self.db.search_messages(query, role_filter=roles, limit=100)
                found = {hit["session_id"] for hit in hits} - set(others)
                self.assertEqual(sorted(found), sorted(s["id"] for s in sessions))

    def test_every_index_holds_an_imported_row_exactly_as_a_rebuild_puts_it(self):
        for sessions in (payload(1), payload(30)):  # below and above a bulk write's CJK drain
            with self.subTest(sessions=len(sessions)):
                self.db.close()
                self.path.unlink()
                self.db = SessionDB(self.path)
                self.import_ok(sessions)
                self.assert_each_query_finds_each_session(sessions)
                imported = index_contents(self.path)
                self.assertTrue(all(imported[index] for index in INDEX_TABLES))
                self.assertEqual(imported["marks"], [])
                integrity_check(self.path)
                rebuilt = self.rebuilt_contents()
                if "cjk" in INDEX_TABLES:  # a CJK row is indexed or still queued (searches read the queue too)
                    rebuilt_terms = dict(rebuilt["cjk"])
                    self.assertEqual([id_ for id_, _ in imported["cjk"]], sorted(rebuilt_terms))
                    for id_, terms in imported["cjk"]:
                        self.assertIn(terms, (None, rebuilt_terms[id_]))
                for index in [index for index in INDEX_TABLES if index != "cjk"] + ["totals"]:
                    self.assertEqual(imported[index], rebuilt[index], index)

    def test_another_writer_after_an_import_still_indexes_its_rows(self):
        self.import_ok(payload(3))
        with SessionDB(self.path) as other:
            other.create_session("later", "cli")
            other.append_message("later", role="user", content="the okapi arrives 鹿 later")
            for query in ("okapi", "鹿"):
                self.assertEqual([hit["session_id"] for hit in other.search_messages(query)], ["later"])
        integrity_check(self.path)

    def test_an_import_leaves_every_trigger_as_it_found_it(self):
        def triggers():
            return self.raw(self.path).execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger' "
                                               "ORDER BY name").fetchall()
        before = triggers()
        self.assertEqual("messages_fts_insert" in dict(before), "word" in INDEX_TABLES)
        self.import_ok(payload(3))
        self.assertEqual(triggers(), before)

    def test_an_import_during_a_backfill_leaves_its_rows_to_the_triggers(self):
        require(self, "fts5", "a backfill of an index")
        self.db.create_session("old", "cli")
        self.db.append_message("old", role="user", content="an older quokka 漢字")
        conn = self.raw(self.path)
        last = conn.execute("SELECT MAX(id) FROM messages").fetchone()[0]
        with conn:  # as an open that starts a backfill leaves it: old rows pending, new ones indexed
            for table in RANKED_TABLES:
                conn.execute(f"INSERT INTO {table}({table}) VALUES ('delete-all')")
            conn.execute("DELETE FROM hs_fts_cjk")
            conn.execute("DELETE FROM hs_fts_cjk_queue")
            marks = [(pair + "_high_water", str(last)) for pair in ("fts_rebuild", "hs_search")] + [
                (pair + "_progress", "0") for pair in ("fts_rebuild", "hs_search")]
            conn.executemany("INSERT OR REPLACE INTO state_meta(key, value) VALUES (?, ?)", marks)
        sessions = payload(2)
        self.import_ok(sessions)
        during = index_contents(self.path)
        self.assertEqual(during["marks"], sorted(marks))
        self.assertTrue(during["word"])
        self.assertTrue(all(id_ > last for index in INDEX_TABLES for id_, _ in during[index]))
        self.assert_each_query_finds_each_session(sessions, others=["old"])
        while self.db.fts_rebuild_step():
            pass
        integrity_check(self.path)
        self.assertEqual(index_contents(self.path)["word"], self.rebuilt_contents()["word"])

    def test_an_insert_trigger_someone_changed_indexes_the_import_itself(self):
        conn = self.raw(self.path)
        require(self, "fts5", "it replaces our word trigger")
        # Another program's version of our word trigger, which also counts the rows it saw; it indexes
        # the text our view gives (SQLite 3.31's integrity-check compares the index with that view).
        with conn:
            conn.execute("CREATE TABLE seen (id INTEGER)")
            conn.execute("DROP TRIGGER messages_fts_insert")
            conn.execute("CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN "
                         "INSERT INTO messages_fts(rowid, content, tool_name, tool_calls) "
                         "SELECT id, content, tool_name, tool_calls FROM messages_fts_src WHERE id = new.id; "
                         "INSERT INTO seen VALUES (new.id); END")
        self.import_ok(payload(2))
        self.assertEqual(conn.execute("SELECT COUNT(*) FROM seen").fetchone()[0], 2 * len(PAYLOAD_MESSAGES))
        self.assertEqual(indexed_row_total(self.path, "messages_fts"), 2 * len(PAYLOAD_MESSAGES))  # each once
        self.assertEqual(index_contents(self.path)["marks"], [])
        integrity_check(self.path)

    def test_a_failed_import_leaves_neither_rows_nor_the_held_back_triggers(self):
        conn = self.raw(self.path)
        with conn:
            conn.execute("CREATE TRIGGER refuse_walrus BEFORE INSERT ON messages WHEN new.content LIKE '%walrus%' "
                         "BEGIN SELECT RAISE(ABORT, 'no walrus here'); END")
        sessions = payload(2)
        sessions[1]["messages"].append({"role": "user", "content": "a walrus", "timestamp": 9.0})
        with self.assertRaises(sqlite3.IntegrityError):
            self.db.import_sessions(sessions)
        self.assertEqual(conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0], 0)
        self.assertEqual(index_contents(self.path)["marks"], [])
        self.db.create_session("later", "cli")
        self.db.append_message("later", role="user", content="the okapi arrives")
        self.assertEqual([hit["session_id"] for hit in self.db.search_messages("okapi")], ["later"])


class ImportCache(StoreTestCase):

    def cache_size(self):
        return self.db._execute_write(lambda conn: conn.execute("PRAGMA cache_size").fetchone()[0])

    def test_an_import_gives_the_writer_its_own_page_cache_size_back(self):
        for size in (None, -100_000):  # SQLite's default, then a larger one of the owner's (kept as it is)
            if size is not None:
                self.db._execute_write(lambda conn: conn.execute(f"PRAGMA cache_size = {size}"))
            before = self.cache_size()
            self.assertTrue(self.db.import_sessions(payload(2) if size is None else payload(3)[2:])["ok"])
            self.assertEqual(self.cache_size(), before)
