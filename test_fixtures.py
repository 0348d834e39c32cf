"""Real hermes-agent stores (schema 22 legacy FTS, schema 26 split) open with nothing lost."""

import json
import sqlite3

from hermes_state import SessionDB
from hermes_state_common import SCHEMA_VERSION
from hermes_state_schema import _BROAD_UPDATE, _INDEXED_COLUMNS_UPDATE
from test_support import (
    FIXTURE_DBS, HAS_FTS5, HAS_TRIGRAM, V22_DB, TempDirTestCase, dump_hash, schema_snapshot, tracing_factory,
    write_statements,
)

CHAINS = [[f"bench_{i:06d}", f"bench_{i + 1:06d}"] for i in (0, 5, 10, 15)]
FTS_OBJECTS_SQL = ("SELECT type, name, sql FROM sqlite_master "
                   "WHERE name LIKE 'messages_fts%' ORDER BY type, name")
HERMES_FTS_META_SQL = "SELECT key, value FROM state_meta WHERE key LIKE 'fts%' ORDER BY key"


def raw_sessions(conn):
    """Sessions as raw sqlite3 reads them, with the system prompt of either generation."""
    columns = [row[1] for row in conn.execute("PRAGMA table_info(sessions)")]
    sessions = {}
    for row in conn.execute("SELECT * FROM sessions"):
        session = dict(row)
        if "system_prompt_hash" in columns and session["system_prompt_hash"]:
            session["system_prompt"] = conn.execute(
                "SELECT prompt FROM system_prompts WHERE hash = ?", (session["system_prompt_hash"],)
            ).fetchone()[0]
        sessions[session["id"]] = session
    return sessions


def raw_active_messages(conn):
    return [dict(row) for row in conn.execute("SELECT * FROM messages WHERE active = 1 ORDER BY id")]


class FixtureStoresOpen(TempDirTestCase):

    def snapshot(self, path):
        conn = self.raw(path)
        facts = {
            "sessions": raw_sessions(conn),
            "messages": raw_active_messages(conn),
            "routing": [tuple(r) for r in conn.execute("SELECT * FROM gateway_routing ORDER BY session_key")],
            "fts": [tuple(r) for r in conn.execute(FTS_OBJECTS_SQL)],
            "fts_meta": [tuple(r) for r in conn.execute(HERMES_FTS_META_SQL)],
        }
        conn.close()
        return facts

    def assert_nothing_lost(self, db, before):
        sessions = {s["id"]: s for s in db.list_sessions_rich(limit=100, include_archived=True, include_children=True)}
        self.assertEqual(sorted(sessions), sorted(before["sessions"]))
        self.assertEqual(len(sessions), 20)
        for session_id, raw in before["sessions"].items():
            got = db.get_session(session_id)
            for key in ("title", "source", "model", "parent_session_id", "end_reason", "input_tokens",
                        "output_tokens", "message_count", "tool_call_count", "started_at", "system_prompt"):
                self.assertEqual(got[key], raw[key], f"{session_id}.{key}")
            self.assertEqual(sessions[session_id]["system_prompt"], raw["system_prompt"])
        self.assertEqual(db.get_session("bench_000000")["input_tokens"], 123)
        self.assertEqual(db.get_session("bench_000000")["output_tokens"], 45)
        self.assertEqual(db.get_session_title("bench_000007"), "会话 7 title")
        got_messages = [m for s in sorted(before["sessions"]) for m in db.get_messages(s)]
        got_messages.sort(key=lambda m: m["id"])
        self.assertEqual(len(got_messages), 320)
        for raw, got in zip(before["messages"], got_messages):
            expected = dict(raw)
            if expected["tool_calls"] is not None:
                expected["tool_calls"] = json.loads(expected["tool_calls"])
            self.assertEqual({k: got[k] for k in expected}, expected)
        self.assertEqual(db.load_gateway_routing_entries(),
                         {key: entry for _scope, key, entry, _ts in before["routing"]})
        for chain in CHAINS:
            for member in chain:
                self.assertEqual(db.get_compression_lineage(member), chain)
        self.assertEqual(db.get_compression_lineage("bench_000002"), ["bench_000002"])

    def test_each_fixture_opens_writable_with_nothing_lost(self):
        for name in FIXTURE_DBS:
            with self.subTest(fixture=name):
                path = self.copy_fixture(name)
                before = self.snapshot(path)
                held = self.raw(path).execute("SELECT MAX(version) FROM schema_version").fetchone()[0]
                with SessionDB(path) as db:
                    self.assert_nothing_lost(db, before)
                    # (without FTS5 the version is held back where it was)
                    self.assertEqual(db.schema_version(), SCHEMA_VERSION if HAS_FTS5 else held)
                # A second open sees the same store.
                with SessionDB(path) as db:
                    self.assert_nothing_lost(db, before)

    def test_each_fixture_opens_read_only_without_changing_a_byte(self):
        for name in FIXTURE_DBS:
            with self.subTest(fixture=name):
                path = self.copy_fixture(name)
                before = self.snapshot(path)
                original = path.read_bytes()
                schema = schema_snapshot(path)
                with SessionDB(path, read_only=True) as db:
                    self.assert_nothing_lost(db, before)
                    with self.assertRaises(PermissionError):
                        db.set_meta("x", "1")
                self.assertEqual(path.read_bytes(), original)
                self.assertEqual(schema_snapshot(path), schema)

    def test_legacy_inline_index_is_untouched_and_flagged(self):
        path = self.copy_fixture(V22_DB)
        before = self.snapshot(path)
        with SessionDB(path) as db:
            self.assertEqual(db.fts_layout(), "legacy")
            self.assertEqual(db.fts_optimize_available(), HAS_FTS5)
            message_id = db.append_message("bench_000003", "user", "zebra-unique-word after the upgrade")
            self.assertEqual([hit["id"] for hit in db.search_messages("zebra")], [message_id])
        conn = self.raw(path)
        # hermes-agent's index is its own: every object and key as it left them, but for its broad
        # update triggers, which fire on the columns they index only (as 0.22 leaves them), and its
        # trigram triggers where SQLite has no trigram tokenizer: dropped, as it drops them itself.
        # Without FTS5, all of its triggers.
        kept = [o[:2] + (_BROAD_UPDATE.sub(_INDEXED_COLUMNS_UPDATE, o[2]) if o[0] == "trigger" else o[2],)
                + o[3:] for o in before["fts"]
                if (HAS_TRIGRAM or not (o[0] == "trigger" and "trigram" in o[1]))
                and (HAS_FTS5 or o[0] != "trigger")]
        if not HAS_TRIGRAM:
            self.assertLess(len(kept), len(before["fts"]))  # the fixture has trigram triggers to drop
        self.assertEqual([tuple(r) for r in conn.execute(FTS_OBJECTS_SQL)], kept)
        # Only the flag hermes-agent's own open writes on such a store is added (where FTS5 can read it).
        marker = [("fts_optimize_available", "1")] if HAS_FTS5 else []
        self.assertEqual([tuple(r) for r in conn.execute(HERMES_FTS_META_SQL)],
                         sorted(before["fts_meta"] + marker))
        self.assertEqual(conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE name LIKE 'hs\\_fts\\_%' ESCAPE '\\'"
                                      ).fetchone()[0], 0)
        if not HAS_FTS5:  # its tables are kept, unread: this SQLite cannot open them
            return
        self.assertEqual(conn.execute("SELECT COUNT(*) FROM messages_fts").fetchone()[0], 321)
        if HAS_TRIGRAM:  # (else its table is kept, unread: this SQLite cannot open it)
            self.assertEqual(conn.execute("SELECT COUNT(*) FROM messages_fts_trigram").fetchone()[0], 321)
        hits = conn.execute("SELECT rowid FROM messages_fts WHERE messages_fts MATCH 'zebra'").fetchall()
        self.assertEqual([r[0] for r in hits], [message_id])
        self.assertEqual(conn.execute("PRAGMA integrity_check").fetchone()[0], "ok")

    def test_legacy_inline_system_prompts_move_into_system_prompts(self):
        path = self.copy_fixture(V22_DB)
        prompt = [tuple(r) for r in self.raw(path).execute("SELECT DISTINCT system_prompt FROM sessions")]
        self.assertEqual(len(prompt), 1)
        with SessionDB(path) as db:
            self.assertEqual(db.get_session("bench_000011")["system_prompt"], prompt[0][0])
        conn = self.raw(path)
        self.assertEqual(conn.execute("SELECT COUNT(*) FROM sessions WHERE system_prompt IS NOT NULL")
                         .fetchone()[0], 0)
        self.assertEqual([tuple(r) for r in conn.execute("SELECT prompt FROM system_prompts")], prompt)

    def test_second_open_performs_no_writes(self):
        for name in FIXTURE_DBS:
            with self.subTest(fixture=name):
                path = self.copy_fixture(name)
                SessionDB(path).close()
                content = dump_hash(path)
                file_bytes = path.read_bytes()
                statements = []
                with SessionDB(path, connection_factory=tracing_factory(statements)) as db:
                    self.assertEqual(db.message_count(), 320)
                self.assertTrue(statements, "the trace saw nothing: the test would prove nothing")
                self.assertEqual(write_statements(statements), [])
                self.assertEqual(dump_hash(path), content)
                self.assertEqual(path.read_bytes(), file_bytes)

    def test_fixture_stores_stay_writable_through_their_own_triggers(self):
        for name in FIXTURE_DBS:
            with self.subTest(fixture=name):
                path = self.copy_fixture(name)
                with SessionDB(path) as db:
                    db.append_message("bench_000019", "assistant", "a new turn", tool_calls=[
                        {"id": "c1", "type": "function", "function": {"name": "terminal", "arguments": "{}"}}])
                    self.assertEqual(db.get_session("bench_000019")["message_count"], 17)
                    self.assertEqual(db.get_session("bench_000019")["tool_call_count"], 5)
                    self.assertTrue(db.delete_session("bench_000002"))
                conn = self.raw(path)
                self.assertEqual(conn.execute("PRAGMA integrity_check").fetchone()[0], "ok")
                self.assertEqual(conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0], 305)
                try:
                    if HAS_FTS5:  # (without it, hermes-agent's index is not written and cannot be read)
                        conn.execute("INSERT INTO messages_fts(messages_fts) VALUES ('integrity-check')")
                except sqlite3.DatabaseError as exc:
                    self.fail(f"{name}: FTS integrity-check failed after writes: {exc}")
