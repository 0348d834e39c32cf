"""SessionDB's public API on real temporary stores."""

import json
import os
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from unittest import mock

import hermes_state
import hermes_state_usage
from hermes_constants import reset_hermes_home_override, set_hermes_home_override
from hermes_state import SessionDB
from hermes_state_gateway import lock_holder_name
from hermes_state_common import TITLE_MAX_LENGTH
from test_support import StoreTestCase, TempDirTestCase, backdate


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
            with SessionDB(self.tmp / "state.db", journal="wal") as db:
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

    def test_a_writable_store_used_after_close_opens_again_loudly(self):
        # hermes-agent 0.22: a worker whose session teardown closed the store still lands its write.
        db = SessionDB(self.tmp / "state.db")
        db.create_session("s", "cli")
        db.close()
        db.close()
        self.assertIsNone(db._conn)
        with self.assertLogs("hermes_state", "WARNING") as logs:
            self.assertEqual(db.get_session("s")["source"], "cli")
        self.assertIn("used after close()", logs.output[0])
        db.create_session("t", "cli")
        self.assertIsNotNone(db._conn)
        db.close()
        self.assertIsNone(db._conn)
        with SessionDB(self.tmp / "state.db") as other:
            self.assertEqual(other.session_count(), 2)

    def test_a_closed_read_only_store_refuses_work(self):
        SessionDB(self.tmp / "state.db").close()
        db = SessionDB(self.tmp / "state.db", read_only=True)
        db.close()
        with self.assertRaisesRegex(sqlite3.ProgrammingError, "closed"):
            db.get_session("s")

    def test_a_closed_store_whose_file_is_gone_is_not_made_again(self):
        db = SessionDB(self.tmp / "state.db")
        db.close()
        for name in ("state.db", "state.db-wal", "state.db-shm"):
            if (self.tmp / name).exists():
                (self.tmp / name).unlink()
        with self.assertRaisesRegex(sqlite3.ProgrammingError, "the store is gone"):
            db.create_session("s", "cli")
        self.assertFalse((self.tmp / "state.db").exists())

    def test_close_waits_for_a_write_another_thread_has_begun(self):
        db = SessionDB(self.tmp / "state.db")
        db.create_session("s", "cli")
        inside, finish, order = threading.Event(), threading.Event(), []

        def slow_write(conn):
            inside.set()
            finish.wait(10)
            conn.execute("UPDATE sessions SET title = 'late' WHERE id = 's'")
            order.append("write")

        writer = threading.Thread(target=db._execute_write, args=(slow_write,))
        writer.start()
        inside.wait(10)
        closer = threading.Thread(target=lambda: (db.close(), order.append("close")))
        closer.start()
        time.sleep(0.2)
        finish.set()
        writer.join(10)
        closer.join(10)
        self.assertEqual(order, ["write", "close"])
        with SessionDB(self.tmp / "state.db") as other:
            self.assertEqual(other.get_session("s")["title"], "late")


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
        self.assertEqual(self.db.get_session("t")["source"], "unknown")

    def test_bad_session_input_names_the_field(self):
        cases = [
            (dict(session_id="", source="cli"), "session_id"),
            (dict(session_id="x" * 300, source="cli"), "session_id is 300 characters; the limit is 256"),
            (dict(session_id="s", source=None), "source"),
            (dict(session_id="s", source="cli", model_config={"x": {1}}), "model_config is not JSON-serialisable"),
            (dict(session_id="s", source="cli", parent_session_id="ghost"), "parent_session_id 'ghost'"),
        ]
        for kwargs, message in cases:
            with self.subTest(kwargs=list(kwargs)), self.assertRaisesRegex(ValueError, message):
                self.db.create_session(**kwargs)
        for kwargs in (dict(message_count=5), dict(colour="red"), dict(title="t")):
            with self.subTest(kwargs=list(kwargs)), self.assertRaises(TypeError):
                self.db.create_session("s", "cli", **kwargs)
        self.assertEqual(self.db.session_count(), 0)

    def test_titles_are_unique_normalised_and_clearable(self):
        self.db.create_session("a", "cli")
        self.db.set_session_title("a", "  Fix   the build ")
        self.db.create_session("b", "cli")
        self.assertEqual(self.db.get_session_title("a"), "Fix the build")
        self.assertEqual(self.db.get_session_by_title("Fix the build")["id"], "a")
        with self.assertRaisesRegex(ValueError, "Title 'Fix the build' is already in use by session a"):
            self.db.set_session_title("b", "Fix the build")
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
        self.assertIsNone(self.db.resolve_session_id("A"))  # ambiguous: "a_b" and "aXb"
        self.assertEqual(self.db.resolve_session_id("A_"), "a_b")  # ASCII case ignored, as hermes-agent's LIKE

    def test_end_reopen_archive_pin(self):
        self.db.create_session("s", "cli")
        self.db.end_session("s", "user_exit")
        self.assertEqual(self.db.get_session("s")["end_reason"], "user_exit")
        self.assertIsNotNone(self.db.get_session("s")["ended_at"])
        self.db.reopen_session("s")
        self.assertIsNone(self.db.get_session("s")["ended_at"])
        self.assertTrue(self.db.set_session_archived("s", True))
        self.assertTrue(self.db.set_session_pinned("s", True))
        self.assertEqual(self.db.list_sessions_rich(), [])
        listed = self.db.list_sessions_rich(include_archived=True)
        self.assertEqual([(s["id"], s["pinned"]) for s in listed], [("s", 1)])
        self.db.end_session("missing", "x")
        self.assertIsNone(self.db.get_session("missing"))

    def test_token_counts_are_queued_and_exact_when_read(self):
        self.db.create_session("s", "cli")
        self.db.queue_token_counts("s", input_tokens=10, output_tokens=2, model="m1")
        self.db.queue_token_counts("s", input_tokens=5, cache_read_tokens=7, model="m1")
        self.db.queue_token_counts("s", output_tokens=1, model="m2", api_call_count=1)
        self.assertEqual(self.session_row("s")["input_tokens"], 0)  # still queued
        session = self.db.get_session("s")
        self.assertEqual((session["input_tokens"], session["output_tokens"], session["cache_read_tokens"],
                          session["api_call_count"]), (15, 3, 7, 1))
        usage = {r["model"]: (r["input_tokens"], r["output_tokens"]) for r in
                 self.raw(self.path).execute("SELECT * FROM session_model_usage")}
        self.assertEqual(usage, {"m1": (15, 2), "m2": (0, 1)})
        with self.assertRaisesRegex(ValueError, "output_tokens must be a number, not 'three'"):
            self.db.update_token_counts("s", output_tokens="three")

    def test_queued_token_counts_ride_with_the_next_write_and_close(self):
        self.db.create_session("s", "cli")
        self.db.queue_token_counts("s", input_tokens=4)
        self.db.append_message("s", "user", "hi")
        self.assertEqual(self.session_row("s")["input_tokens"], 4)
        self.db.queue_token_counts("s", input_tokens=6)
        self.db.close()
        self.assertEqual(self.session_row("s")["input_tokens"], 10)

    def test_a_queue_older_than_its_age_limit_is_applied_by_the_next_queued_call(self):
        self.db.create_session("s", "cli")
        with mock.patch.object(hermes_state_usage, "TOKEN_QUEUE_MAX_AGE", 0.05):
            self.db.queue_token_counts("s", input_tokens=2)
            self.assertEqual(self.session_row("s")["input_tokens"], 0)
            time.sleep(0.1)
            self.db.queue_token_counts("s", input_tokens=3)
            self.assertEqual(self.session_row("s")["input_tokens"], 5)

    def test_token_counts_survive_a_normal_interpreter_exit(self):
        self.db.create_session("s", "cli")
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from hermes_state import SessionDB; "
                "db = SessionDB(sys.argv[2]); db.queue_token_counts('s', input_tokens=41, output_tokens=1)")
        subprocess.run([sys.executable, "-c", code, os.getcwd(), str(self.path)], check=True, timeout=60)
        self.assertEqual(self.db.get_session("s")["input_tokens"], 41)

    def test_list_sessions_rich_previews_and_filters(self):
        self.db.create_session("a", "cli")
        self.db.create_session("b", "telegram")
        backdate(self.db, "a", 1)
        backdate(self.db, "b", 2)
        self.db.append_message("a", "assistant", "not a preview", timestamp=5)
        self.db.append_message("a", "user", "x" * 300, timestamp=9)
        listed = self.db.list_sessions_rich()
        self.assertEqual([s["id"] for s in listed], ["b", "a"])
        self.assertEqual(listed[1]["preview"], "x" * 60 + "...")
        self.assertEqual(listed[1]["last_active"], 9)
        self.assertEqual(listed[0]["last_active"], 2)
        self.assertEqual([s["id"] for s in self.db.list_sessions_rich(source="cli")], ["a"])
        self.assertEqual([s["id"] for s in self.db.list_sessions_rich(exclude_sources=["cli"])], ["b"])
        self.assertEqual([s["id"] for s in self.db.list_sessions_rich(limit=1, offset=1)], ["a"])
        self.assertEqual(self.db.session_count(source="telegram"), 1)


class Lineage(StoreTestCase):

    def test_compression_chain_in_both_directions(self):
        self.db.create_session("a", "cli")
        self.db.end_session("a", "compression")
        self.db.create_session("b", "cli", parent_session_id="a")
        self.db.end_session("b", "compression")
        self.db.create_session("c", "cli", parent_session_id="b")
        self.db.create_session("branch", "cli", parent_session_id="c")  # c did not compress
        for member in "abc":
            self.assertEqual(self.db.get_compression_lineage(member), ["a", "b", "c"])
        self.assertEqual(self.db.get_compression_tip("a"), "c")
        self.assertEqual(self.db.get_compression_lineage("branch"), ["branch"])
        self.assertEqual(self.db.get_compression_lineage("ghost"), [])
        self.assertEqual(self.db.get_compression_tip("ghost"), "ghost")

    def test_a_cycle_in_parent_links_does_not_loop(self):
        self.db.create_session("x", "cli")
        self.db.create_session("y", "cli", parent_session_id="x")
        self.db._execute_write(lambda conn: conn.execute("UPDATE sessions SET parent_session_id = 'y' WHERE id = 'x'"))
        self.db.end_session("x", "compression")
        self.db.end_session("y", "compression")
        self.assertEqual(sorted(self.db.get_compression_lineage("x")), ["x", "y"])


class RoutingMetaLocks(StoreTestCase):

    def test_gateway_routing_by_scope(self):
        self.db.save_gateway_routing_entry("k1", '{"a": 1}')
        self.db.save_gateway_routing_entry("k1", {"a": 2})
        self.db.save_gateway_routing_entry("k1", "{}", scope="team")
        self.assertEqual(self.db.load_gateway_routing_entries(), {"k1": '{"a": 2}'})
        self.db.replace_gateway_routing_entries({f"k{i}": "{}" for i in range(1200)})
        self.assertEqual(len(self.db.load_gateway_routing_entries()), 1200)
        self.assertIsNone(self.db.delete_gateway_routing_entries([f"k{i}" for i in range(1100)]))
        self.assertEqual(len(self.db.load_gateway_routing_entries()), 100)
        self.assertEqual(self.db.load_gateway_routing_entries(scope="team"), {"k1": "{}"})

    def test_meta(self):
        self.db.set_meta("app_a", "1")
        self.db.set_meta("app_b", 2)
        self.db.set_meta("appXc", "3")
        self.db.set_meta("other", "x")
        self.assertEqual(self.db.get_meta("app_b"), "2")
        self.assertEqual(self.db.list_meta_prefix("app_"), [("app_a", "1"), ("app_b", "2")])
        self.db.set_meta("app_a", None)
        self.assertIsNone(self.db.get_meta("app_a"))
        self.assertEqual(self.db.list_meta_prefix("APP_"), [("app_a", None), ("app_b", "2")])
        self.assertEqual(self.db.list_meta_prefix(""), [])

    def test_set_meta_on_an_open_writes_cursor_joins_that_transaction(self):
        def write(conn, fail):
            cursor = conn.execute("SELECT 1")
            self.db.set_meta("gate", "1" if not fail else "2", cursor=cursor)
            if fail:
                raise RuntimeError("roll back")

        with self.assertRaises(RuntimeError):
            self.db._execute_write(lambda conn: write(conn, True))
        self.assertIsNone(self.db.get_meta("gate"))
        self.db._execute_write(lambda conn: write(conn, False))
        self.db._execute_write(lambda conn: self.db.set_meta("other", "x", cursor=conn))
        self.assertEqual((self.db.get_meta("gate"), self.db.get_meta("other")), ("1", "x"))

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
        self.assertIsNone(self.db.release_compression_lock("s", "one"))  # not the holder: nothing happens
        self.assertEqual(self.db.get_compression_lock_holder("s"), "two")
        self.assertIsNone(self.db.release_compression_lock("s", "two"))
        self.assertIsNone(self.db.get_compression_lock_holder("s"))
        # As in hermes-agent: a ttl of 0 or less makes a lock that has already expired,
        # and an empty id is never locked.
        self.assertTrue(self.db.try_acquire_compression_lock("s", "x", ttl_seconds=-1))
        self.assertTrue(self.db.try_acquire_compression_lock("s", "y"))
        self.assertFalse(self.db.try_acquire_compression_lock("", "z"))

    def test_a_dead_holder_process_loses_its_lock(self):
        child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                               capture_output=True, text=True, check=True)
        dead = lock_holder_name().split(":")
        dead[1] = child.stdout.strip()
        dead_holder = ":".join(dead)
        self.assertTrue(self.db.try_acquire_compression_lock("s", dead_holder, ttl_seconds=600))
        self.assertTrue(self.db.try_acquire_compression_lock("s", lock_holder_name()))
        self.assertFalse(self.db.try_acquire_compression_lock("s", "somebody-else"))


class AsyncDoor(StoreTestCase):

    def test_async_session_db_awaits_methods_in_a_thread_and_passes_attributes_through(self):
        import asyncio
        from hermes_state import AsyncSessionDB
        door = AsyncSessionDB(self.db)

        async def run():
            await door.create_session("a", "gateway")
            await door.append_message("a", "user", "hi")
            return await door.get_messages("a")

        messages = asyncio.run(run())
        self.assertEqual([m["content"] for m in messages], ["hi"])
        self.assertEqual(door.db_path, self.db.db_path)


class ModuleNames(TempDirTestCase):
    """Module-level names hermes-agent 0.22 imports from hermes_state."""

    def test_divert_appends_a_refused_turn_to_the_sessions_jsonl(self):
        token = set_hermes_home_override(self.tmp / "home")
        self.addCleanup(reset_hermes_home_override, token)
        messages = [{"role": "user", "content": "héllo", "timestamp": 1.5}, None, "plain"]
        path = hermes_state.divert_session_transcript_jsonl("s1", messages)
        self.assertEqual(path, self.tmp / "home" / "sessions" / "s1.jsonl")
        hermes_state.divert_session_transcript_jsonl("s1", [{"role": "assistant", "at": path}])
        lines = path.read_text(encoding="utf-8").splitlines()
        self.assertEqual([json.loads(line) for line in lines],
                         [{"role": "user", "content": "héllo", "timestamp": 1.5},
                          {"content": "plain"}, {"role": "assistant", "at": str(path)}])
        self.assertIn("héllo", lines[0])  # as written, not \\u-escaped
        if os.name == "posix":
            self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        self.assertIsNone(hermes_state.divert_session_transcript_jsonl("", messages))
        self.assertIsNone(hermes_state.divert_session_transcript_jsonl("s2", []))
        self.assertFalse((self.tmp / "home" / "sessions" / "s2.jsonl").exists())
        for bad in ("../escape", "a/b", ".."):
            with self.subTest(session_id=bad), self.assertRaisesRegex(ValueError, "session_id"):
                hermes_state.divert_session_transcript_jsonl(bad, messages)
        self.assertEqual(sorted(p.name for p in (self.tmp / "home").rglob("*.jsonl")), ["s1.jsonl"])

    def test_a_tracked_connection_keeps_our_raw_reads_off_its_file_until_it_closes(self):
        path = self.tmp / "kanban.db"
        sqlite3.connect(path).close()
        read_header = lambda: hermes_state._raw_store_access(path, os.O_RDONLY, lambda fd: True)
        conn = hermes_state._connect_tracked_db(path.as_uri() + "?mode=ro", tracking_path=path,
                                                uri=True, timeout=0.05)
        self.assertEqual(conn.execute("SELECT 1").fetchone()[0], 1)
        self.assertIsNone(read_header())  # refused: closing its descriptor would drop our locks
        conn.close()
        conn.close()
        self.assertTrue(read_header())
        with self.assertRaises(sqlite3.OperationalError):
            hermes_state._connect_tracked_db(self.tmp / "no" / "such.db")
        self.assertEqual(hermes_state._connections_held(path), 0)

    def test_securing_store_files_takes_group_and_other_access_and_never_adds(self):
        if os.name != "posix":
            self.skipTest("file modes are POSIX")
        db_path = self.tmp / "state.db"
        old_umask = os.umask(0o022)
        self.addCleanup(os.umask, old_umask)
        hermes_state._secure_state_db_files(db_path)
        self.assertFalse(db_path.exists())
        hermes_state._secure_state_db_files(db_path, create_main=True)
        self.assertEqual(stat.S_IMODE(os.stat(db_path).st_mode), 0o600)
        os.chmod(db_path, 0o644)
        (self.tmp / "state.db-wal").write_bytes(b"")
        os.chmod(self.tmp / "state.db-wal", 0o444)
        (self.tmp / "elsewhere").write_bytes(b"")
        os.chmod(self.tmp / "elsewhere", 0o644)
        os.symlink(self.tmp / "elsewhere", self.tmp / "state.db-shm")
        hermes_state._secure_state_db_files(db_path, create_main=True)
        modes = {name: stat.S_IMODE(os.stat(self.tmp / name).st_mode)
                 for name in ("state.db", "state.db-wal", "elsewhere")}
        self.assertEqual(modes, {"state.db": 0o600, "state.db-wal": 0o400, "elsewhere": 0o644})

    def test_a_writable_open_keeps_the_mode_an_owner_chose_for_an_existing_store(self):
        # hermes-agent 0.22 tightens it to 0600 at every open; ours leaves a store its owner shares
        # with another user's reader as it is (test_cli_readonly.ImmutableReads).
        if os.name != "posix":
            self.skipTest("file modes are POSIX")
        db_path = self.tmp / "state.db"
        SessionDB(db_path).close()
        self.assertEqual(stat.S_IMODE(os.stat(db_path).st_mode), 0o600)
        os.chmod(db_path, 0o644)
        SessionDB(db_path).close()
        self.assertEqual(list(self.tmp.glob("*.bak")), [])
        self.assertEqual(stat.S_IMODE(os.stat(db_path).st_mode), 0o644)

    def test_foreign_holders_are_the_other_processes_holding_the_store(self):
        try:
            import hermes_state_holders  # noqa: F401
        except ImportError:
            self.skipTest("hermes_state_holders (its own branch) is not here yet")
        with SessionDB(self.tmp / "state.db") as db:
            self.assertEqual(db._foreign_state_db_holders(), [])  # this process is not foreign
            code = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]);"
                    "c.execute('SELECT 1 FROM sessions').fetchall(); print('held', flush=True);"
                    "sys.stdin.read()")
            release = self.held_by_another_process(code, db.db_path)
            holders = db._foreign_state_db_holders()
            self.assertTrue(holders and all(isinstance(pid, int) and isinstance(text, str)
                                            for pid, text in holders))
            release()

    def test_hermes_state_re_exports_the_error_classes_0_22_callers_catch_there(self):
        import hermes_state_errors
        for name in ("StateDbCorruptError", "StateDbReplacedError", "is_malformed_schema_error"):
            with self.subTest(name=name):
                self.assertIs(getattr(hermes_state, name), getattr(hermes_state_errors, name))
