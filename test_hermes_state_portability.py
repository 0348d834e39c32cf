"""Portability: exports, the validated import, renderers, redaction, backup and restore."""

import copy
import hashlib
import json
import os
import random
import re
import sqlite3
import subprocess
import sys
import zipfile

from hermes_state import SessionDB, restore_home
from hermes_state_portability import markdown_document, markdown_file_name, redact, redact_text, write_export
from test_support import REPO, V26_DB, StoreTestCase, TempDirTestCase, dump_hash, fixture_path

EXPORTS = ("hermes_v22_export.jsonl", "hermes_v26_export.jsonl")
# One import_sessions call takes at most this many sessions; the CLI imports a longer file whole,
# and the tests cross this boundary on purpose.
IMPORT_CHUNK = SessionDB._IMPORT_MAX_SESSIONS
RUNTIME = {"session_key": "agent:main:telegram:dm:42", "chat_id": "42", "user_id": "u1", "handoff_state": "pending",
           "rewind_count": 7, "pinned": 1, "last_activity_at": 123.0, "compression_fallback_streak": 3,
           "compression_failure_cooldown_until": 999.0}


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

    def test_export_session_has_every_column_and_decoded_active_messages(self):
        export = self.db.export_session("bench_000003")
        columns = {r[1] for r in self.db._read_all("PRAGMA table_info(sessions)")}
        self.assertTrue(columns <= set(export))
        self.assertEqual(export["system_prompt"], "You are a helpful agent. 你是一个助手。")
        self.assertEqual(len(export["messages"]), 16)
        self.assertEqual([m["id"] for m in export["messages"]], sorted(m["id"] for m in export["messages"]))
        calls = [m["tool_calls"] for m in export["messages"] if m["tool_calls"]]
        self.assertEqual(len(calls), 4)
        self.assertIsInstance(calls[0], list)
        self.assertEqual(export["last_active"], export["messages"][-1]["timestamp"])
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
            self.assertEqual(export["tool_call_count"], 8)
            self.assertEqual(export["messages"][:16], export["segments"][0]["messages"])
        self.assertIsNone(self.db.export_session_lineage("ghost"))

    def test_export_all_streams_oldest_first_and_filters_by_source(self):
        stream = self.db.export_all()
        self.assertEqual(next(stream)["id"], "bench_000000")
        self.assertEqual(len(list(stream)), 19)
        telegram = [e["id"] for e in self.db.export_all(source="telegram")]
        self.assertEqual(telegram, [f"bench_{i:06d}" for i in (0, 3, 6, 9, 12, 15, 18)])


class ImportFixtures(StoreTestCase):

    def test_each_fixture_export_imports_whole_and_only_once(self):
        for name in EXPORTS:
            with self.subTest(export=name):
                db = SessionDB(self.tmp / f"{name}.db")
                self.addCleanup(db.close)
                payload = load_export(name)
                for entry in payload:  # a lying payload, and runtime state that must not come back
                    entry.update(RUNTIME, message_count=999, tool_call_count=999)
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
                self.assertEqual(db.load_gateway_routing_entries(), {})
                self.assertEqual(db.get_session("bench_000000")["input_tokens"], 123)
                self.assertEqual(len(db.search_messages("会话", limit=100)), 3)
                again = db.import_sessions(payload)
                self.assertEqual((again["imported"], again["skipped"]), (0, 20))
                self.assertEqual(len(again["skipped_ids"]), 20)
                self.assertEqual(db.message_count(), 320)

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

    def test_every_malformed_kind_rejects_the_batch(self):
        good = session("good")
        cases = [
            ("not an object", ["text"], "entry must be an object"),
            ("empty id", {"id": "", "messages": []}, "id must be a non-empty string"),
            ("messages not a list", dict(session("m"), messages="nope"), "messages must be a list"),
            ("message not an object", dict(session("m"), messages=[1]), r"messages\[0\] must be an object"),
            ("role missing", dict(session("m"), messages=[{"content": "x"}]), r"messages\[0\]\.role"),
            ("role empty", dict(session("m"), messages=[{"role": ""}]), r"messages\[0\]\.role"),
            ("text field", dict(session("m"), title=5), "title must be a string"),
            ("message text", dict(session("m"), messages=[{"role": "user", "content": ["x"]}]),
             r"messages\[0\]\.content must be a string"),
            ("model_config list", dict(session("m"), model_config=[1, 2]), "model_config must be a JSON object"),
            ("model_config text", dict(session("m"), model_config="not json"), "model_config must be a JSON object"),
            ("token_count text", dict(session("m"), messages=[{"role": "user", "token_count": "3"}]),
             r"token_count must be an integer"),
            ("token_count float", dict(session("m"), messages=[{"role": "user", "token_count": 1.5}]),
             r"token_count must be an integer"),
            ("token_count bool", dict(session("m"), messages=[{"role": "user", "token_count": True}]),
             r"token_count must be an integer"),
            ("not plain JSON", dict(session("m"), extra=object()), "not plain JSON"),
        ]
        for label, bad, message in cases:
            with self.subTest(label):
                errors = self.assert_rejected([good, bad], 1, message)
                self.assertFalse(any(e["index"] == 0 for e in errors))
        self.assert_rejected([session("d"), session("d")], 1, "duplicate id")
        all_errors = self.assert_rejected([["x"], {"id": ""}, session("ok"), dict(session("y"), title=1)], 0, "")
        self.assertEqual([e["index"] for e in all_errors], [0, 1, 3])
        self.assertEqual(all_errors[2]["session_id"], "y")

    def test_input_sqlite_or_json_would_refuse_is_a_clean_rejection(self):
        deep_text = '{"a":' * 100_000 + "1" + "}" * 100_000
        cases = [
            ("session integer past 64 bits", dict(session("m"), input_tokens=2 ** 64),
             "input_tokens does not fit in a 64-bit integer"),
            ("message integer past 64 bits",
             dict(session("m"), messages=[{"role": "user", "token_count": -2 ** 63 - 1}]),
             r"messages\[0\]\.token_count does not fit in a 64-bit integer"),
            ("deep model_config text", dict(session("m"), model_config=deep_text),
             "model_config nests lists and objects more than 100 levels deep"),
            ("deep tool_calls text", dict(session("m"), messages=[{"role": "assistant", "tool_calls": "[" * 100_000}]),
             r"messages\[0\]\.tool_calls nests lists and objects more than 100 levels deep"),
            ("deep display_metadata text", dict(session("m"), messages=[
                {"role": "assistant", "display_metadata": "[" * 150 + "]" * 150}]),
             r"messages\[0\]\.display_metadata nests lists and objects more than 100 levels deep"),
            ("deep tool_calls list", dict(session("m"), messages=[{"role": "assistant", "tool_calls": json.loads(
                "[" * 150 + "]" * 150)}]), "entry nests lists and objects more than 103 levels deep"),
            ("title past the cap", dict(session("m"), title="t" * 101), r"Title too long \(101 chars, max 100\)"),
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
        with self.assertRaisesRegex(ValueError, "sessions has 501 entries; the limit is 500"):
            self.db.import_sessions([session(f"s{i}") for i in range(501)])
        self.assert_rejected([session("big", messages=10_001)], 0, "messages has 10001 entries; the limit is 10000")
        self.assert_rejected([session(f"s{i}", messages=9_000) for i in range(6)], 5,
                             "passes 50000 messages")
        huge = dict(session("huge"), messages=[{"role": "user", "content": "x" * (5 * 1024 * 1024)}])
        self.assert_rejected([huge], 0, r"bytes as compact JSON; the limit is 5242880")
        wide = [dict(session(f"w{i}"), messages=[{"role": "user", "content": "y" * (4 * 1024 * 1024)}])
                for i in range(7)]
        self.assert_rejected(wide, 6, "passes 26214400 bytes")

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
        self.assertGreater(outcomes["rejected"], 1000, outcomes)


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

    def test_a_loop_of_three_or_more_sessions_loses_only_its_closing_link(self):
        for size in (3, 4, 7):
            with self.subTest(size=size):
                ids = [f"loop{size}-{i}" for i in range(size)]
                payload = [session(ids[i], ids[(i + 1) % size]) for i in range(size)]
                result = self.db.import_sessions(payload)
                self.assertEqual((result["ok"], result["imported"], result["detached"]), (True, size, 1))
                expected = {ids[i]: ids[i + 1] for i in range(size - 1)}
                expected[ids[-1]] = None  # the link that closes the loop is the one detached
                self.assertEqual(self.parents(ids), expected)
                self.assert_no_loop(ids)

    def test_a_two_cycle_keeps_the_link_attached_first(self):
        result = self.db.import_sessions([session("a", "b"), session("b", "a")])
        self.assertEqual(result["detached"], 1)
        self.assertEqual(self.parents("ab"), {"a": "b", "b": None})
        result = self.db.import_sessions([session("y", "x"), session("x", "y")])
        self.assertEqual(result["detached"], 1)
        self.assertEqual(self.parents("xy"), {"y": "x", "x": None})

    def test_a_chain_and_a_tree_attach_whole(self):
        payload = [session("root")] + [session(f"n{i}", "root" if i < 2 else f"n{i - 2}") for i in range(8)]
        result = self.db.import_sessions(payload)
        self.assertEqual((result["imported"], result["detached"]), (9, 0))
        self.assertEqual(self.db.get_session("n7")["parent_session_id"], "n5")
        self.assert_no_loop(["root"] + [f"n{i}" for i in range(8)])


class Renderers(StoreTestCase):

    def setUp(self):
        super().setUp()
        self.db.create_session("r1", "cli", model="m", system_prompt="be <careful>")
        self.db.set_session_title("r1", "<b>Render</b> me")
        self.db.append_message("r1", "user", "<script>alert('x')</script> & 会话")
        self.db.append_message("r1", "assistant", "calling", tool_calls=[{"id": "c1", "type": "function",
                               "function": {"name": "terminal", "arguments": "{\"command\": \"ls </tmp>\"}"}}])
        self.db.append_message("r1", "tool", "out " * 400, tool_name="terminal", tool_call_id="c1")

    def test_md_and_qmd_carry_a_verifiable_body_hash_and_a_manifest(self):
        for fmt in ("md", "qmd"):
            folder = self.tmp / fmt
            self.assertEqual(write_export(self.db.export_all(), fmt, str(folder)), 1)
            name = markdown_file_name("r1", fmt)
            self.assertRegex(name, rf"^r1-[0-9a-f]{{12}}\.{fmt}$")
            text = (folder / name).read_text(encoding="utf-8")
            self.assertTrue(text.startswith("---\nsession_id: \"r1\"\n"))
            self.assertIn(f'format: "{fmt}"', text)
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
                self.assertIn(f"from {session_id}", (folder / name).read_text(encoding="utf-8"))

    def test_md_and_qmd_escape_html_in_text_as_the_html_export_does(self):
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
                self.assertIn("&lt;script&gt;alert('x')&lt;/script&gt; &amp; 会话", mine)
                self.assertIn("# &lt;b&gt;Render&lt;/b&gt; me", mine)
                self.assertIn('title: "&lt;b&gt;Render&lt;/b&gt; me"', mine)
                self.assertIn('"arguments": "{\\"command\\": \\"ls </tmp>\\"}"', mine)  # a fence keeps code as code
                self.assertIn("# &lt;i&gt;title&lt;/i&gt;", odd)
                self.assertIn("&lt;style&gt;p{}&lt;/style&gt;", odd)
                self.assertIn("### Tool — &lt;t&gt; — ", odd)
                self.assertIn("&lt;/pre&gt;&lt;script&gt;1&lt;/script&gt;", odd)
                for raw in ("<script>", "<style>", "<i>", "<t>", "</pre>"):
                    self.assertNotIn(raw, odd)
                # The id keeps its characters inside code spans (where HTML is not rendered),
                # fenced by more backticks than it holds, its line breaks shown as spaces.
                span = "``x`<b>  <img src=x onerror=alert(1)>``"
                self.assertEqual(odd.count("<img"), odd.count(span))
                self.assertIn(f"Session ID: {span}", odd)

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
        self.assertIn('[{"type": "text", "text": "parts &lt;of&gt; a prompt"}]', text)
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
        deleted = self.run_cli("delete", "bench_000019")
        self.assertEqual((deleted.returncode, deleted.stdout), (0, "deleted bench_000019\n"))
        self.assertEqual(self.run_cli("delete", "bench_000019").returncode, 1)
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
        self.assertIn(f"error: session {IMPORT_CHUNK} (s{IMPORT_CHUNK:04d}): title must be a string", result.stderr)
        self.assertIn("the import was rejected; nothing was written", result.stderr)
        self.assertEqual(result.stdout, "")
        self.assertEqual(self.stored_sessions(), 0)

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
        self.assertIn("session 1: id must be a non-empty string", result.stderr)
        self.assertIn("session 2 (t): title must be a string", result.stderr)
        self.assertIn("nothing was written", result.stderr)
        self.assertEqual(json.loads(self.run_cli("stats", "--json").stdout)["sessions"], 0)
        bad.write_text(lines[0] + "\n{not json\n")
        broken = self.run_cli("import", str(bad))
        self.assertEqual(broken.returncode, 1)
        self.assertIn("bad.jsonl:2: not JSON", broken.stderr)

    def test_import_of_a_file_is_one_transaction_past_500_sessions(self):
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
        self.assertIn("nothing was written", refused.stderr)
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
        self.assertIn("session 1 (big): input_tokens does not fit in a 64-bit integer", result.stderr)
        self.assertIn("session 2 (deep): model_config nests lists and objects more than 100 levels deep",
                      result.stderr)
        self.assertEqual(json.loads(self.run_cli("stats", "--json").stdout)["sessions"], 0)
        bad.write_text("".join(json.dumps(entry) + "\n" for entry in (entries[0], *entries[3:])))
        titles = self.run_cli("import", str(bad))
        self.assertEqual((titles.returncode, titles.stdout), (0, "imported 3, skipped 0, detached 0\n"), titles.stderr)
        bad.write_text(json.dumps(session("x")) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
        deep = self.run_cli("import", str(bad))
        self.assertEqual(deep.returncode, 1)
        self.assertIn("bad.jsonl:2: JSON nested too deep to read", deep.stderr)
        self.assertNotIn("Traceback", deep.stderr)
