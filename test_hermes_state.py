"""SessionDB's public API on real temporary stores."""

import json
import os
import sqlite3
import stat
import subprocess
import sys
import time
from unittest import mock

import hermes_state
from hermes_constants import reset_hermes_home_override, set_hermes_home_override
from hermes_state import SessionDB, lock_holder_name
from hermes_state_common import TITLE_MAX_LENGTH
from test_support import StoreTestCase, TempDirTestCase

CALL = [{"id": "call_1", "type": "function", "function": {"name": "terminal", "arguments": "{}"}}]


class Opening(TempDirTestCase):

    def test_default_path_is_resolved_at_construction(self):
        token = set_hermes_home_override(self.tmp / "home")
        try:
            with SessionDB() as db:
                self.assertEqual(db.db_path, self.tmp / "home" / "state.db")
        finally:
            reset_hermes_home_override(token)
        self.assertTrue((self.tmp / "home" / "state.db").exists())

    def test_store_files_are_private(self):
        if os.name != "posix":
            self.skipTest("file modes are POSIX")
        old_umask = os.umask(0o022)
        try:
            with SessionDB(self.tmp / "state.db") as db:
                db.create_session("s", "cli")
                names = ["state.db", "state.db-wal", "state.db-shm", "state.db.lock"]
                for name in names:
                    mode = stat.S_IMODE(os.stat(self.tmp / name).st_mode)
                    self.assertEqual(mode, 0o600, name)
        finally:
            os.umask(old_umask)

    def test_read_only_open_of_a_missing_store_says_so(self):
        with self.assertRaisesRegex(FileNotFoundError, "no state store"):
            SessionDB(self.tmp / "missing.db", read_only=True)
        self.assertFalse((self.tmp / "missing.db").exists())

    def test_closed_store_refuses_work(self):
        db = SessionDB(self.tmp / "state.db")
        db.close()
        db.close()
        with self.assertRaises(sqlite3.ProgrammingError):
            db.create_session("s", "cli")
        with self.assertRaises(sqlite3.ProgrammingError):
            db.get_session("s")


class Sessions(StoreTestCase):

    def test_create_and_get_resolve_the_system_prompt(self):
        self.db.create_session("s1", "cli", model="m", model_config={"temperature": 0.2},
                               system_prompt="be brief", cwd="/repo", user_id="u")
        self.db.create_session("s2", "cli", system_prompt="be brief")
        session = self.db.get_session("s1")
        self.assertEqual((session["model"], session["cwd"], session["user_id"]), ("m", "/repo", "u"))
        self.assertEqual(json.loads(session["model_config"]), {"temperature": 0.2})
        self.assertEqual(session["system_prompt"], "be brief")
        self.assertIsNone(self.session_row("s1")["system_prompt"])
        self.assertEqual(self.raw(self.path).execute("SELECT COUNT(*) FROM system_prompts").fetchone()[0], 1)
        self.assertIsNone(self.db.get_session("nope"))

    def test_create_is_idempotent_and_ensure_creates_once(self):
        self.db.create_session("s", "cli", model="first")
        self.db.create_session("s", "telegram", model="second")
        self.assertEqual(self.db.get_session("s")["model"], "first")
        self.assertEqual(self.db.ensure_session("t"), "t")
        self.assertEqual(self.db.get_session("t")["source"], "cli")

    def test_bad_session_input_names_the_field(self):
        cases = [
            (dict(session_id="", source="cli"), "session_id"),
            (dict(session_id="x" * 300, source="cli"), "session_id is 300 characters; the limit is 256"),
            (dict(session_id="s", source=None), "source"),
            (dict(session_id="s", source="cli", model_config="[1, 2]"), "model_config must be a JSON object"),
            (dict(session_id="s", source="cli", model_config="{oops"), "model_config"),
            (dict(session_id="s", source="cli", message_count=5), "protected session field 'message_count'"),
            (dict(session_id="s", source="cli", colour="red"), "unknown or protected session field 'colour'"),
            (dict(session_id="s", source="cli", title="t" * (TITLE_MAX_LENGTH + 1)),
             f"the limit is {TITLE_MAX_LENGTH}"),
        ]
        for kwargs, message in cases:
            with self.subTest(kwargs=list(kwargs)), self.assertRaisesRegex(ValueError, message):
                self.db.create_session(**kwargs)
        self.assertEqual(self.db.session_count(), 0)

    def test_titles_are_unique_normalised_and_clearable(self):
        self.db.create_session("a", "cli", title="  Fix   the build ")
        self.db.create_session("b", "cli")
        self.assertEqual(self.db.get_session_title("a"), "Fix the build")
        self.assertEqual(self.db.get_session_by_title("Fix the build")["id"], "a")
        with self.assertRaisesRegex(ValueError, "already used by session a"):
            self.db.set_session_title("b", "Fix the build")
        with self.assertRaisesRegex(ValueError, "already used"):
            self.db.create_session("c", "cli", title="Fix the build")
        self.assertIsNone(self.db.get_session("c"))
        self.assertTrue(self.db.set_session_title("a", ""))
        self.assertIsNone(self.db.get_session_title("a"))
        self.assertTrue(self.db.set_session_title("b", "Fix the build"))
        self.assertFalse(self.db.set_session_title("zzz", "other"))

    def test_resolve_session_id_by_exact_id_or_unique_prefix(self):
        for session_id in ("20260101_abc", "20260101_abd", "20260202_x", "a_b", "aXb"):
            self.db.create_session(session_id, "cli")
        self.assertEqual(self.db.resolve_session_id("20260202"), "20260202_x")
        self.assertEqual(self.db.resolve_session_id("20260101_abc"), "20260101_abc")
        self.assertIsNone(self.db.resolve_session_id("20260101_ab"))  # ambiguous
        self.assertIsNone(self.db.resolve_session_id("nothing"))
        self.assertEqual(self.db.resolve_session_id("a_"), "a_b")  # "_" is not a wildcard
        self.assertIsNone(self.db.resolve_session_id("A"))  # case-sensitive

    def test_end_reopen_archive_pin(self):
        self.db.create_session("s", "cli")
        self.assertTrue(self.db.end_session("s", "user_exit"))
        self.assertEqual(self.db.get_session("s")["end_reason"], "user_exit")
        self.assertIsNotNone(self.db.get_session("s")["ended_at"])
        self.assertTrue(self.db.reopen_session("s"))
        self.assertIsNone(self.db.get_session("s")["ended_at"])
        self.assertTrue(self.db.set_session_archived("s"))
        self.assertTrue(self.db.set_session_pinned("s"))
        self.assertEqual(self.db.list_sessions_rich(), [])
        listed = self.db.list_sessions_rich(include_archived=True)
        self.assertEqual([(s["id"], s["pinned"]) for s in listed], [("s", 1)])
        self.assertFalse(self.db.end_session("missing", "x"))

    def test_token_counts_are_queued_and_exact_when_read(self):
        self.db.create_session("s", "cli")
        self.db.update_token_counts("s", input_tokens=10, output_tokens=2, model="m1")
        self.db.update_token_counts("s", input_tokens=5, cache_read_tokens=7, model="m1")
        self.db.update_token_counts("s", output_tokens=1, model="m2", api_call_count=1)
        self.assertEqual(self.session_row("s")["input_tokens"], 0)  # still queued
        session = self.db.get_session("s")
        self.assertEqual((session["input_tokens"], session["output_tokens"], session["cache_read_tokens"],
                          session["api_call_count"]), (15, 3, 7, 1))
        usage = {r["model"]: (r["input_tokens"], r["output_tokens"]) for r in
                 self.raw(self.path).execute("SELECT * FROM session_model_usage")}
        self.assertEqual(usage, {"m1": (15, 2), "m2": (0, 1)})
        with self.assertRaisesRegex(ValueError, "input_tokens must be an integer >= 0"):
            self.db.update_token_counts("s", input_tokens=-1)
        with self.assertRaisesRegex(ValueError, "output_tokens"):
            self.db.update_token_counts("s", output_tokens="3")

    def test_queued_token_counts_ride_with_the_next_write_and_close(self):
        self.db.create_session("s", "cli")
        self.db.update_token_counts("s", input_tokens=4)
        self.db.append_message("s", "user", "hi")
        self.assertEqual(self.session_row("s")["input_tokens"], 4)
        self.db.update_token_counts("s", input_tokens=6)
        self.db.close()
        self.assertEqual(self.session_row("s")["input_tokens"], 10)

    def test_a_queue_older_than_its_age_limit_is_applied_by_the_next_update(self):
        self.db.create_session("s", "cli")
        with mock.patch.object(hermes_state, "TOKEN_QUEUE_MAX_AGE", 0.05):
            self.db.update_token_counts("s", input_tokens=2)
            self.assertEqual(self.session_row("s")["input_tokens"], 0)
            time.sleep(0.1)
            self.db.update_token_counts("s", input_tokens=3)
            self.assertEqual(self.session_row("s")["input_tokens"], 5)

    def test_token_counts_survive_a_normal_interpreter_exit(self):
        self.db.create_session("s", "cli")
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from hermes_state import SessionDB; "
                "db = SessionDB(sys.argv[2]); db.update_token_counts('s', input_tokens=41, output_tokens=1)")
        subprocess.run([sys.executable, "-c", code, os.getcwd(), str(self.path)], check=True, timeout=60)
        self.assertEqual(self.db.get_session("s")["input_tokens"], 41)

    def test_delete_session_takes_everything_with_it_and_frees_children(self):
        self.db.create_session("p", "cli")
        self.db.create_session("c", "cli", parent_session_id="p")
        self.db.append_message("p", "user", "x")
        self.db.update_token_counts("p", input_tokens=1, model="m")
        self.assertTrue(self.db.try_acquire_compression_lock("p", "h"))
        self.assertTrue(self.db.delete_session("p"))
        self.assertFalse(self.db.delete_session("p"))
        conn = self.raw(self.path)
        for table in ("messages", "session_model_usage", "compression_locks"):
            self.assertEqual(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0], 0, table)
        self.assertIsNone(self.db.get_session("c")["parent_session_id"])

    def test_prune_deletes_only_old_ended_sessions(self):
        day = 86400
        import time
        now = time.time()
        self.db.create_session("old_ended", "cli", started_at=now - 100 * day)
        self.db.end_session("old_ended", "user_exit")
        self.db.create_session("old_open", "cli", started_at=now - 100 * day)
        self.db.create_session("old_other", "telegram", started_at=now - 100 * day)
        self.db.end_session("old_other", "user_exit")
        self.db.create_session("new_ended", "cli")
        self.db.end_session("new_ended", "user_exit")
        self.assertEqual(sorted(self.db.prunable_session_ids(90)), ["old_ended", "old_other"])
        self.assertEqual(self.db.prune_sessions(90, source="cli"), 1)
        self.assertEqual(self.db.prune_sessions(90), 1)
        self.assertEqual(sorted(s["id"] for s in self.db.list_sessions_rich()), ["new_ended", "old_open"])
        with self.assertRaisesRegex(ValueError, "older_than_days"):
            self.db.prune_sessions(-1)

    def test_list_sessions_rich_previews_and_filters(self):
        self.db.create_session("a", "cli", started_at=1)
        self.db.create_session("b", "telegram", started_at=2)
        self.db.append_message("a", "assistant", "not a preview", timestamp=5)
        self.db.append_message("a", "user", "x" * 300, timestamp=9)
        listed = self.db.list_sessions_rich()
        self.assertEqual([s["id"] for s in listed], ["b", "a"])
        self.assertEqual(listed[1]["preview"], "x" * 80)
        self.assertEqual(listed[1]["last_active"], 9)
        self.assertEqual(listed[0]["last_active"], 2)
        self.assertEqual([s["id"] for s in self.db.list_sessions_rich(source="cli")], ["a"])
        self.assertEqual([s["id"] for s in self.db.list_sessions_rich(exclude_sources=["cli"])], ["b"])
        self.assertEqual([s["id"] for s in self.db.list_sessions_rich(limit=1, offset=1)], ["a"])
        self.assertEqual(self.db.session_count(source="telegram"), 1)
        with self.assertRaisesRegex(ValueError, "limit is 20000; the limit is 10000"):
            self.db.list_sessions_rich(limit=20000)


class Messages(StoreTestCase):

    def setUp(self):
        super().setUp()
        self.db.create_session("s", "cli")

    def test_append_keeps_counts_exact_and_decodes_tool_calls(self):
        first = self.db.append_message("s", "user", "hello")
        self.db.append_message("s", "assistant", "calling", tool_calls=CALL + CALL, reasoning="think",
                               finish_reason="tool_calls", token_count=12)
        self.db.append_message("s", "tool", "ok", tool_name="terminal", tool_call_id="call_1")
        row = self.session_row("s")
        self.assertEqual((row["message_count"], row["tool_call_count"]), (3, 2))
        messages = self.db.get_messages("s")
        self.assertEqual(messages[0]["id"], first)
        self.assertEqual(messages[1]["tool_calls"], CALL + CALL)
        self.assertEqual(messages[1]["reasoning"], "think")
        raw = self.raw(self.path).execute("SELECT tool_calls FROM messages WHERE id = ?", (first + 1,))
        self.assertEqual(json.loads(raw.fetchone()[0]), CALL + CALL)
        self.assertEqual(self.db.get_messages_as_conversation("s"), [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "calling", "tool_calls": CALL + CALL},
            {"role": "tool", "content": "ok", "tool_call_id": "call_1"},
        ])

    def test_bad_message_input_writes_nothing(self):
        cases = [
            (dict(role=""), "role must be a non-empty string"),
            (dict(role="user", content=5), "content must be a string or None"),
            (dict(role="user", token_count=-3), "token_count must be an integer >= 0"),
            (dict(role="user", tool_calls=object()), "tool_calls is not JSON-serialisable"),
            (dict(role="user", tool_calls="{bad json"), "tool_calls must be JSON text"),
            (dict(role="user", timestamp="yesterday"), "timestamp must be a number"),
        ]
        for kwargs, message in cases:
            with self.subTest(kwargs=kwargs), self.assertRaisesRegex(ValueError, message):
                self.db.append_message("s", **kwargs)
        with self.assertRaisesRegex(ValueError, "unknown session_id 'ghost'"):
            self.db.append_message("ghost", "user", "lost?")
        self.assertEqual(self.raw(self.path).execute("SELECT COUNT(*) FROM messages").fetchone()[0], 0)

    def test_batch_is_all_or_nothing(self):
        with self.assertRaisesRegex(ValueError, r"messages\[1\]: role"):
            self.db.append_messages_batch("s", [{"role": "user", "content": "a"}, {"content": "no role"}])
        self.assertEqual(self.db.message_count("s"), 0)
        count = self.db.append_messages_batch("s", [{"role": "user", "content": "a"},
                                                    {"role": "assistant", "tool_calls": CALL}])
        self.assertEqual(count, 2)
        row = self.session_row("s")
        self.assertEqual((row["message_count"], row["tool_call_count"]), (2, 1))
        with self.assertRaisesRegex(ValueError, "unknown message field 'colour'"):
            self.db.append_messages_batch("s", [{"role": "user", "colour": "red"}])

    def test_get_messages_paging_and_after_id(self):
        ids = [self.db.append_message("s", "user", f"m{i}") for i in range(5)]
        self.assertEqual([m["content"] for m in self.db.get_messages("s", limit=2, offset=1)], ["m1", "m2"])
        self.assertEqual([m["content"] for m in self.db.get_messages("s", after_id=ids[2])], ["m3", "m4"])
        self.assertEqual(self.db.message_count(), 5)

    def test_message_count_counts_what_history_shows(self):
        ids = [self.db.append_message("s", "user", f"m{i}") for i in range(4)]
        self.db.rewind_to_message("s", ids[0])
        self.assertEqual((self.db.message_count("s"), self.db.message_count()), (1, 1))
        self.db.restore_rewound("s")
        self.assertEqual((self.db.message_count("s"), self.db.message_count()), (4, 4))

    def test_rewind_and_restore(self):
        ids = [self.db.append_message("s", "user" if i % 2 == 0 else "assistant", f"m{i}",
                                      tool_calls=CALL if i == 3 else None) for i in range(5)]
        self.assertEqual(self.db.rewind_to_message("s", ids[1]), 3)
        self.assertEqual([m["content"] for m in self.db.get_messages("s")], ["m0", "m1"])
        self.assertEqual(len(self.db.get_messages("s", include_inactive=True)), 5)
        row = self.session_row("s")
        self.assertEqual((row["message_count"], row["tool_call_count"], row["rewind_count"]), (2, 0, 1))
        self.assertEqual(self.db.restore_rewound("s"), 3)
        row = self.session_row("s")
        self.assertEqual((row["message_count"], row["tool_call_count"]), (5, 1))
        self.db.create_session("other", "cli")
        with self.assertRaisesRegex(ValueError, "is not in session 'other'"):
            self.db.rewind_to_message("other", ids[0])


class Lineage(StoreTestCase):

    def test_compression_chain_in_both_directions(self):
        self.db.create_session("a", "cli", started_at=1)
        self.db.end_session("a", "compression")
        self.db.create_session("b", "cli", parent_session_id="a", started_at=2)
        self.db.end_session("b", "compression")
        self.db.create_session("c", "cli", parent_session_id="b", started_at=3)
        self.db.create_session("branch", "cli", parent_session_id="c", started_at=4)  # c did not compress
        for member in "abc":
            self.assertEqual(self.db.get_compression_lineage(member), ["a", "b", "c"])
        self.assertEqual(self.db.get_compression_tip("a"), "c")
        self.assertEqual(self.db.get_compression_lineage("branch"), ["branch"])
        self.assertEqual(self.db.get_compression_lineage("ghost"), [])
        self.assertIsNone(self.db.get_compression_tip("ghost"))

    def test_a_cycle_in_parent_links_does_not_loop(self):
        self.db.create_session("x", "cli", parent_session_id="y", end_reason="compression")
        self.db.create_session("y", "cli", parent_session_id="x", end_reason="compression")
        self.assertEqual(sorted(self.db.get_compression_lineage("x")), ["x", "y"])


class RoutingMetaLocks(StoreTestCase):

    def test_gateway_routing_by_scope(self):
        self.db.save_gateway_routing_entry("k1", '{"a": 1}')
        self.db.save_gateway_routing_entry("k1", {"a": 2})
        self.db.save_gateway_routing_entry("k1", "{}", scope="team")
        self.assertEqual(self.db.load_gateway_routing_entries(), {"k1": '{"a": 2}'})
        self.db.replace_gateway_routing_entries({f"k{i}": "{}" for i in range(1200)})
        self.assertEqual(len(self.db.load_gateway_routing_entries()), 1200)
        self.assertEqual(self.db.delete_gateway_routing_entries([f"k{i}" for i in range(1100)]), 1100)
        self.assertEqual(len(self.db.load_gateway_routing_entries()), 100)
        self.assertEqual(self.db.load_gateway_routing_entries(scope="team"), {"k1": "{}"})
        with self.assertRaisesRegex(ValueError, "session_key"):
            self.db.save_gateway_routing_entry("", "{}")

    def test_meta(self):
        self.db.set_meta("app_a", "1")
        self.db.set_meta("app_b", 2)
        self.db.set_meta("appXc", "3")
        self.db.set_meta("other", "x")
        self.assertEqual(self.db.get_meta("app_b"), "2")
        self.assertEqual(self.db.list_meta_prefix("app_"), {"app_a": "1", "app_b": "2"})
        self.db.set_meta("app_a", None)
        self.assertIsNone(self.db.get_meta("app_a"))

    def test_compression_lock_takeover_rules(self):
        self.assertTrue(self.db.try_acquire_compression_lock("s", "one"))
        self.assertFalse(self.db.try_acquire_compression_lock("s", "two"))
        self.assertTrue(self.db.try_acquire_compression_lock("s", "one"))
        self.assertEqual(self.db.get_compression_lock_holder("s"), "one")
        self.assertTrue(self.db.refresh_compression_lock("s", "one", ttl_seconds=0.01))
        self.assertFalse(self.db.refresh_compression_lock("s", "two"))
        import time
        time.sleep(0.05)
        self.assertIsNone(self.db.get_compression_lock_holder("s"))
        self.assertTrue(self.db.try_acquire_compression_lock("s", "two"))  # expired: taken over
        self.assertFalse(self.db.release_compression_lock("s", "one"))
        self.assertTrue(self.db.release_compression_lock("s", "two"))
        with self.assertRaisesRegex(ValueError, "ttl_seconds"):
            self.db.try_acquire_compression_lock("s", "x", ttl_seconds=0)

    def test_a_dead_holder_process_loses_its_lock(self):
        child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                               capture_output=True, text=True, check=True)
        dead = lock_holder_name().split(":")
        dead[1] = child.stdout.strip()
        dead_holder = ":".join(dead)
        self.assertTrue(self.db.try_acquire_compression_lock("s", dead_holder, ttl_seconds=600))
        self.assertTrue(self.db.try_acquire_compression_lock("s", lock_holder_name()))
        self.assertFalse(self.db.try_acquire_compression_lock("s", "somebody-else"))
