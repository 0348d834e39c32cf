"""Prune, archive and delete; the reports and one-shot fixes of the maintenance mixin."""

import os
import sqlite3
import stat
import time

from hermes_state import SessionDB
from test_support import INDEX_TABLES, StoreTestCase

DAY = 86400
CALL = [{"id": "c1", "type": "function", "function": {"name": "memory", "arguments": "{}"}}]
CREATE_KEYWORDS = {"model", "model_config", "system_prompt", "user_id", "chat_id", "chat_type", "parent_session_id",
                   "cwd", "git_repo_root"}


class MaintenanceTestCase(StoreTestCase):

    def sql(self, statement, params=()):
        conn = self.raw(self.path)
        conn.execute(statement, params)
        conn.commit()

    def count(self, table, where="1", params=()):
        return self.raw(self.path).execute(f"SELECT COUNT(*) FROM {table} WHERE {where}", params).fetchone()[0]

    def session(self, session_id, *, days_ago=0, ended=True, message_days_ago=None, source="cli", **fields):
        """A session started `days_ago`, ended unless told otherwise, with one user message if asked.
        Columns create_session does not take (hermes-agent's keywords) are written directly."""
        self.db.create_session(session_id, source, **{k: v for k, v in fields.items() if k in CREATE_KEYWORDS})
        fields = {k: v for k, v in fields.items() if k not in CREATE_KEYWORDS}
        fields["started_at"] = time.time() - days_ago * DAY
        self.sql(f"UPDATE sessions SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?",
                 (*fields.values(), session_id))
        if message_days_ago is not None:
            self.db.append_message(session_id, "user", "hi")
            self.sql("UPDATE messages SET timestamp = ? WHERE session_id = ?",
                     (time.time() - message_days_ago * DAY, session_id))
        if ended:
            self.db.end_session(session_id, "user_exit")

    def ids(self, rows):
        return [row["id"] for row in rows]

    def transcripts(self, folder, *session_ids):
        """Every file hermes-agent keeps per session, and two it does not own."""
        folder.mkdir(exist_ok=True)
        for sid in session_ids:
            for name in transcript_names(sid):
                (folder / name).write_text("x")
        return folder


def transcript_names(sid):
    return (f"{sid}.json", f"{sid}.jsonl", f"request_dump_{sid}_1.json", f"request_dump_{sid}_2.json",
            f"request_dump_{sid}_1.txt", f"{sid}.json.bak")


class SelectingForPrune(MaintenanceTestCase):

    def test_candidates_are_ended_sessions_inactive_that_long_least_recent_first(self):
        self.session("old", days_ago=100, message_days_ago=95)
        self.session("old_but_talking", days_ago=100, message_days_ago=1)
        self.session("old_silent", days_ago=120)
        self.session("old_open", days_ago=100, ended=False)
        self.session("new", days_ago=1)
        rows = self.db.list_prune_candidates(90)
        self.assertEqual(self.ids(rows), ["old_silent", "old"])
        self.assertEqual(set(rows[0]), {"id", "source", "title", "model", "started_at", "last_active", "ended_at",
                                        "message_count", "archived"})
        self.assertEqual(self.db.count_open_prune_matches(90), 1)
        self.assertEqual(self.ids(self.db.list_prune_candidates(started_before=time.time() - 99 * DAY)),
                         ["old_silent", "old", "old_but_talking"])
        self.assertEqual(len(self.db.list_prune_candidates()), 5 - 1)
        self.assertEqual(len(self.db.list_prune_candidates(-1)), 4)

    def test_each_filter_narrows_the_selection(self):
        self.session("a", source="telegram", title="Fix 50% of_it", model="anthropic/Claude-X", cwd="/w/my_proj/sub",
                     billing_provider="OpenRouter", git_branch="feat/Login", user_id="u1", chat_id="c1",
                     chat_type="dm", end_reason=None, input_tokens=70, output_tokens=30, estimated_cost_usd=0.5,
                     tool_call_count=3)
        self.session("b", cwd="/w/myXproj", title="Fix 50 percent", model="gpt", git_branch="main")
        self.db.set_session_archived("b", True)
        cases = {
            "source": ("telegram", ["a"]), "title_like": ("50%", ["a"]), "model_like": ("claude", ["a"]),
            "provider": ("openrouter", ["a"]), "cwd_prefix": ("/w/my_proj/", ["a"]), "branch_like": ("LOGIN", ["a"]),
            "user_id": ("u1", ["a"]), "chat_id": ("c1", ["a"]), "chat_type": ("dm", ["a"]),
            "end_reason": ("user_exit", ["a", "b"]), "min_tokens": (100, ["a"]), "max_tokens": (99, ["b"]),
            "min_cost": (0.5, ["a"]), "max_cost": (0.1, ["b"]), "min_tool_calls": (3, ["a"]),
            "max_tool_calls": (2, ["b"]), "archived": (True, ["b"]), "min_messages": (0, ["a", "b"]),
            "max_messages": (-1, []),
        }
        for name, (value, expected) in cases.items():
            self.assertEqual(sorted(self.ids(self.db.list_prune_candidates(**{name: value}))), expected, name)
        self.assertEqual(sorted(self.ids(self.db.list_prune_candidates(archived=None))), ["a", "b"])
        with self.assertRaisesRegex(TypeError, "bogus"):
            self.db.list_prune_candidates(bogus=1)


class Deleting(MaintenanceTestCase):

    def test_a_delete_takes_what_hermes_agents_foreign_keys_take_and_frees_children(self):
        self.db.create_session("p", "cli", system_prompt="only p's")
        self.db.create_session("q", "cli", system_prompt="shared")
        self.db.create_session("r", "cli", system_prompt="shared")
        self.db.create_session("child", "cli", parent_session_id="p")
        self.db.append_message("p", "user", "x")
        self.db.update_token_counts("p", input_tokens=1, model="m")
        self.assertTrue(self.db.try_acquire_compression_lock("p", "h"))
        self.db.bind_telegram_topic(chat_id="1", thread_id="2", user_id="u", session_key="k", session_id="p")
        self.assertEqual(self.count("telegram_dm_topic_bindings"), 1)
        self.assertTrue(self.db.delete_session("p"))
        self.assertFalse(self.db.delete_session("p"))
        self.assertTrue(self.db.delete_session("q"))
        for table in ("messages", "session_model_usage", "telegram_dm_topic_bindings"):
            self.assertEqual(self.count(table), 0, table)
        self.assertEqual(self.count("compression_locks"), 1)  # hermes-agent keeps it too: no foreign key
        self.assertEqual(self.count("system_prompts"), 1)  # r still uses "shared"
        self.assertIsNone(self.db.get_session("child")["parent_session_id"])

    def test_delegates_go_with_their_parent_and_branches_stay(self):
        self.db.create_session("p", "cli")
        self.db.create_session("d1", "cli", parent_session_id="p", model_config={"_delegate_from": "p"})
        self.db.create_session("d2", "cli", model_config={"_delegate_from": "d1"})
        self.db.create_session("d3", "cli", parent_session_id="d2", model_config={"_delegate_from": None, "x": 1})
        self.db.create_session("marked", "cli", parent_session_id="d1", model_config={"_delegate_from": "elsewhere"})
        self.db.create_session("branch", "cli", parent_session_id="p", model_config={"_branched_from": "p"})
        self.db.append_message("d2", "user", "work")
        self.assertEqual(self.db.get_session_delete_targets("p"), ["p", "d1", "d2", "marked"])
        self.assertEqual(self.db.get_session_delete_targets("nope"), [])
        self.assertFalse(self.db.delete_session("p", expected_delete_ids=["p", "d1", "d2"]))
        self.assertIsNotNone(self.db.get_session("d2"))
        self.assertTrue(self.db.delete_session("p", expected_delete_ids=["marked", "d2", "d1", "p"]))
        left = {row["id"]: row["parent_session_id"] for row in self.raw(self.path).execute("SELECT * FROM sessions")}
        self.assertEqual(left, {"d3": None, "branch": None})
        self.assertEqual(self.count("messages"), 0)

    def test_transcript_files_go_exactly_as_hermes_agent_removes_them(self):
        self.db.create_session("p", "cli")
        self.db.create_session("d", "cli", model_config={"_delegate_from": "p"})
        self.db.create_session("a[1]*", "cli")
        folder = self.transcripts(self.tmp / "sessions", "p", "d", "other", "a[1]*", "a1x")
        (folder / "request_dump_p_dir.json").mkdir()
        self.assertTrue(self.db.delete_session("p", sessions_dir=folder))
        self.assertEqual(self.db.delete_sessions(["a[1]*"], sessions_dir=str(folder)), 1)
        removed = {"p", "d", "a[1]*"}
        expected = ["request_dump_p_dir.json"] + [
            name for sid in ("p", "d", "other", "a[1]*", "a1x") for name in transcript_names(sid)
            if sid not in removed or name.endswith((".txt", ".bak"))]
        self.assertEqual(sorted(os.listdir(folder)), sorted(expected))

    def test_an_id_reaching_outside_the_sessions_folder_removes_nothing_there(self):
        self.db.create_session("../outside", "cli")
        (self.tmp / "outside.json").write_text("keep")
        (self.tmp / "sessions").mkdir()
        self.assertTrue(self.db.delete_session("../outside", sessions_dir=self.tmp / "sessions"))
        self.assertTrue((self.tmp / "outside.json").exists())

    def test_bulk_delete_counts_the_given_ids_that_existed(self):
        for sid in ("a", "b", "c"):
            self.db.create_session(sid, "cli")
        self.db.create_session("d", "cli", model_config={"_delegate_from": "a"})
        self.assertEqual(self.db.delete_sessions(["a", "a", "b", None, 7, "", "nope"]), 2)
        self.assertEqual(self.db.delete_sessions([]), 0)
        self.assertEqual([r["id"] for r in self.raw(self.path).execute("SELECT id FROM sessions")], ["c"])

    def test_delete_if_empty_spares_titles_messages_and_parents(self):
        for sid in ("titled", "talked", "parent", "empty"):
            self.db.create_session(sid, "cli")
        self.db.set_session_title("titled", "Kept")
        self.db.append_message("talked", "user", "x")
        self.db.create_session("kid", "cli", parent_session_id="parent")
        self.db.update_token_counts("empty", input_tokens=2, model="m")
        for sid in ("titled", "talked", "parent"):
            self.assertFalse(self.db.delete_session_if_empty(sid), sid)
        self.assertTrue(self.db.delete_session_if_empty("empty"))
        self.assertFalse(self.db.delete_session_if_empty("empty"))
        self.assertEqual(self.count("session_model_usage"), 0)

    def test_empty_sessions_are_ended_unarchived_and_without_messages(self):
        self.session("empty")
        self.session("open_empty", ended=False)
        self.session("archived_empty")
        self.db.set_session_archived("archived_empty", True)
        self.session("talked", message_days_ago=0)
        self.db.create_session("kid", "cli", parent_session_id="empty")
        self.assertEqual(self.db.count_empty_sessions(), 1)
        folder = self.transcripts(self.tmp / "sessions", "empty")
        self.assertEqual(self.db.delete_empty_sessions(sessions_dir=folder), 1)
        self.assertEqual(self.db.count_empty_sessions(), 0)
        self.assertFalse((folder / "empty.json").exists())
        self.assertIsNone(self.db.get_session("kid")["parent_session_id"])

    def test_ghost_prune_takes_old_untitled_empty_ended_tui_sessions_only(self):
        self.session("ghost", source="tui", days_ago=2)
        self.session("young", source="tui", days_ago=0.5)
        self.session("open", source="tui", days_ago=2, ended=False)
        self.session("titled", source="tui", days_ago=2)
        self.db.set_session_title("titled", "T")
        self.session("talked", source="tui", days_ago=2, message_days_ago=2)
        self.session("cli", days_ago=2)
        self.assertEqual(self.db.prune_empty_ghost_sessions(), 1)
        self.assertIsNone(self.db.get_session("ghost"))
        self.assertEqual(self.db.prune_empty_ghost_sessions(), 0)

    def test_ghost_prune_refuses_like_hermes_agent_when_a_ghost_has_children(self):
        self.session("ghost", source="tui", days_ago=2)
        self.session("other_ghost", source="tui", days_ago=2)
        self.db.create_session("kid", "cli", parent_session_id="ghost")
        with self.assertRaisesRegex(sqlite3.IntegrityError, "FOREIGN KEY"):
            self.db.prune_empty_ghost_sessions()
        self.assertIsNotNone(self.db.get_session("other_ghost"))


class GuardedAndChainDeletes(MaintenanceTestCase):
    """hermes-agent 0.22's delete keywords: live write guards, whole compression chains, and the
    transcript an export read."""

    def chain(self):
        """root -> mid -> tip by compression, a stale sibling continuation of root, a branch of
        mid and a delegate run under tip."""
        self.db.create_session("root", "cli")
        self.db.end_session("root", "compression")
        self.db.create_session("mid", "cli", parent_session_id="root")
        self.db.create_session("stale", "cli", parent_session_id="root")
        self.db.end_session("mid", "compression")
        self.db.create_session("tip", "cli", parent_session_id="mid")
        self.db.create_session("branch", "cli", parent_session_id="mid", model_config={"_branched_from": "mid"})
        self.db.create_session("run", "cli", parent_session_id="tip", model_config={"_delegate_from": "tip"})

    def left(self):
        return sorted(row[0] for row in self.raw(self.path).execute("SELECT id FROM sessions"))

    def test_a_live_turn_lease_or_compression_lock_refuses_only_when_asked(self):
        from hermes_state_errors import SessionActiveWriteGuardError
        for sid in ("leased", "locked", "free"):
            self.db.create_session(sid, "cli")
        self.db.create_session("run", "cli", parent_session_id="free", model_config={"_delegate_from": "free"})
        self.assertTrue(self.db.try_acquire_session_turn_lease("leased", "turn", ttl_seconds=60))
        self.assertTrue(self.db.try_acquire_compression_lock("locked", "compressor", ttl_seconds=60))
        self.assertTrue(self.db.try_acquire_session_turn_lease("run", "sub", ttl_seconds=60))
        for sid in ("leased", "locked", "free"):
            with self.assertRaisesRegex(SessionActiveWriteGuardError, "active turn lease or compression lock"):
                self.db.delete_session(sid, exclude_active_write_guards=True)
        self.assertEqual(self.left(), ["free", "leased", "locked", "run"])
        self.assertTrue(self.db.delete_session("leased"))  # no guard check unless asked, as in 0.22

    def test_an_expired_guard_is_reclaimed_and_deletes(self):
        self.db.create_session("s", "cli")
        self.assertTrue(self.db.try_acquire_session_turn_lease("s", "gone", ttl_seconds=0.1))
        time.sleep(0.2)
        self.assertTrue(self.db.delete_session("s", exclude_active_write_guards=True))
        self.assertEqual(self.count("session_turn_leases"), 0)

    def test_bulk_delete_skips_guarded_ids_and_reports_them(self):
        for sid in ("a", "b", "c"):
            self.db.create_session(sid, "cli")
        self.assertTrue(self.db.try_acquire_compression_lock("b", "h", ttl_seconds=60))
        skipped = []
        self.assertEqual(self.db.delete_sessions(["a", "b", "nope"], exclude_active_write_guards=True,
                                                 skipped_ids=skipped), 1)
        self.assertEqual((skipped, self.left()), (["b"], ["b", "c"]))
        self.assertEqual(self.db.delete_sessions(["b"], exclude_active_write_guards=True), 0)

    def test_the_compression_chain_goes_whole_and_forks_stay(self):
        self.chain()
        self.assertTrue(self.db.delete_session("tip", include_compression_chain=True))
        self.assertEqual(self.left(), ["branch"])
        self.assertIsNone(self.db.get_session("branch")["parent_session_id"])

    def test_a_guard_anywhere_on_the_chain_keeps_the_selected_row(self):
        self.chain()
        self.assertTrue(self.db.try_acquire_compression_lock("root", "h", ttl_seconds=60))
        skipped = []
        self.assertEqual(self.db.delete_sessions(["tip"], exclude_active_write_guards=True, skipped_ids=skipped,
                                                 include_compression_chain=True), 0)
        self.assertEqual(skipped, ["tip"])
        self.assertEqual(self.db.delete_sessions(["tip"], include_compression_chain=True), 1)  # counts the given id
        self.assertEqual(self.left(), ["branch"])

    def test_without_the_chain_only_the_row_goes(self):
        self.chain()
        self.assertTrue(self.db.delete_session("tip"))
        self.assertEqual(self.left(), ["branch", "mid", "root", "stale"])

    def test_the_transcript_an_export_read_fences_the_delete(self):
        self.db.create_session("s", "cli")
        self.db.append_message("s", "user", "keep me?")
        snapshot = {"s": self.db.get_messages("s", include_compacted=True)}
        self.db.append_message("s", "assistant", "written after the export")
        self.assertFalse(self.db.delete_session("s", expected_display_messages=snapshot))
        self.assertFalse(self.db.delete_session("s", expected_display_messages={"nope": []}))
        self.assertEqual(self.left(), ["s"])
        snapshot = {"s": self.db.get_messages("s", include_compacted=True)}
        self.assertTrue(self.db.delete_session("s", expected_display_messages=snapshot))


class SweepAndPins(MaintenanceTestCase):

    def test_orphan_sweep_ends_idle_open_rows_of_the_given_sources_only(self):
        self.session("tui_old", days_ago=2, ended=False, source="tui")
        self.session("tui_kept", days_ago=2, ended=False, source="tui")
        self.session("tui_pinned", days_ago=2, ended=False, source="tui", pinned=1)
        self.session("tui_talked", days_ago=2, ended=False, source="tui", message_days_ago=0)
        self.session("tui_fresh", days_ago=0, ended=False, source="tui")
        self.session("tg_old", days_ago=2, ended=False, source="telegram")
        self.session("tui_ended", days_ago=2, source="tui")
        swept = self.db.sweep_orphaned_sessions(max_idle_seconds=DAY, exclude_ids=("tui_kept",),
                                                exclude_pinned=True)
        self.assertEqual(swept, ["tui_old"])
        row = self.db.get_session("tui_old")
        self.assertEqual(row["end_reason"], "startup_orphan_reap")
        self.assertEqual(self.db.sweep_orphaned_sessions(max_idle_seconds=DAY, sources=()), [])
        self.assertEqual(self.db.sweep_orphaned_sessions(max_idle_seconds=0), [])
        self.assertEqual(sorted(self.db.sweep_orphaned_sessions(max_idle_seconds=DAY)), ["tui_kept", "tui_pinned"])
        self.assertEqual(self.db.get_session("tui_ended")["end_reason"], "user_exit")  # the first end wins

    def test_a_live_backend_heartbeat_owns_the_rows_it_could_have_started(self):
        self.session("old", days_ago=2, ended=False, source="tui")
        self.sql("INSERT INTO gateway_heartbeats (backend_id, pid, started_at, last_heartbeat)"
                 " VALUES ('b', 1, ?, ?)", (time.time() - 3 * DAY, time.time()))
        self.assertEqual(self.db.sweep_orphaned_sessions(max_idle_seconds=DAY), [])
        self.assertEqual(self.db.sweep_orphaned_sessions(max_idle_seconds=DAY, respect_gateway_heartbeats=False),
                         ["old"])

    def test_prune_spares_pinned_sessions_unless_asked_and_counts_them(self):
        self.session("old", days_ago=100)
        self.session("pinned", days_ago=100, pinned=1)
        self.assertEqual(self.db.count_prune_matches(90), 1)
        self.assertEqual(self.db.count_prune_matches(90, pinned_only=True), 1)
        self.assertEqual(self.db.count_prune_matches(90, source="tui", pinned_only=True), 0)
        self.assertEqual(self.ids(self.db.list_prune_candidates(90)), ["old"])
        self.assertEqual(self.db.prune_sessions(90), 1)
        self.assertEqual(self.db.prune_sessions(90, include_pinned=True), 1)
        self.assertEqual(self.count("sessions"), 0)
        with self.assertRaises(TypeError):
            self.db.count_prune_matches(90, nonsense=1)

    def test_prune_spares_a_guarded_session_when_asked(self):
        self.session("old", days_ago=100)
        self.assertTrue(self.db.try_acquire_compression_lock("old", "h", ttl_seconds=60))
        self.assertEqual(self.db.prune_sessions(90, exclude_active_write_guards=True), 0)
        self.assertEqual(self.db.prune_sessions(90), 1)


class PruneAndArchive(MaintenanceTestCase):

    def old_root_young_tip(self):
        """An old compressed-away segment whose continuation is still young, and an old chain."""
        self.session("root", days_ago=100, message_days_ago=100)
        self.session("tip", days_ago=1, message_days_ago=1, parent_session_id="root")
        self.session("old-root", days_ago=100, message_days_ago=100)
        self.session("old-tip", days_ago=90, message_days_ago=90, parent_session_id="old-root")
        self.sql("UPDATE sessions SET end_reason = 'compression' WHERE id IN ('root', 'old-root')")

    def candidates(self, **filters):
        return sorted(row["id"] for row in self.db.list_prune_candidates(30, **filters))

    def test_whole_lineages_keeps_an_ancestor_while_its_continuation_stays(self):
        # 0.22's prune: a compressed-away segment ages with its conversation.
        self.old_root_young_tip()
        self.assertEqual(self.candidates(), ["old-root", "old-tip", "root"])
        self.assertEqual(self.candidates(whole_lineages=True), ["old-root", "old-tip"])
        self.assertEqual(self.db.count_prune_matches(30, whole_lineages=True), 2)

    def test_lineage_tips_only_matches_a_chain_by_its_tip(self):
        # 0.22's bulk archive: an old ancestor never matches on its own age.
        self.old_root_young_tip()
        self.assertEqual(self.candidates(lineage_tips_only=True), ["old-tip"])
        self.assertEqual(self.db.archive_sessions(30, lineage_tips_only=True), 1)
        archived = self.raw(self.path).execute("SELECT id FROM sessions WHERE archived = 1")
        self.assertEqual({row[0] for row in archived}, {"old-root", "old-tip"})  # with its tip

    def test_prune_deletes_the_candidates_and_their_files(self):
        self.session("old", days_ago=100, message_days_ago=100)
        self.session("old_open", days_ago=100, ended=False)
        self.session("old_tg", days_ago=100, source="telegram")
        self.session("new", days_ago=1)
        self.db.create_session("kid", "cli", parent_session_id="old")
        folder = self.transcripts(self.tmp / "sessions", "old", "new")
        self.assertEqual(self.db.prune_sessions(90, source="cli", sessions_dir=folder), 1)
        self.assertEqual(self.db.prune_sessions(90), 1)
        self.assertEqual(sorted(r["id"] for r in self.raw(self.path).execute("SELECT id FROM sessions")),
                         ["kid", "new", "old_open"])
        self.assertFalse((folder / "old.jsonl").exists())
        self.assertTrue((folder / "new.jsonl").exists())
        self.assertEqual(self.count("messages"), 0)
        self.assertEqual(self.db.prune_sessions(-1), 1)  # hermes-agent reads a negative age as "all"

    def test_archive_sessions_hides_unarchived_matches_once(self):
        self.session("a", source="cron")
        self.session("b", source="cron")
        self.session("c")
        self.assertEqual(self.db.archive_sessions(source="cron"), 2)
        self.assertEqual(self.db.archive_sessions(source="cron"), 0)
        self.assertEqual([r["id"] for r in self.raw(self.path).execute("SELECT id FROM sessions WHERE archived = 1")],
                         ["a", "b"])

    def test_stale_archive_ages_on_the_freshest_activity_and_spares_pins_and_compressed_roots(self):
        for sid in ("idle", "heartbeat", "pinned", "root", "talked", "open"):
            self.session(sid, days_ago=10, ended=sid != "open")
        self.sql("UPDATE sessions SET last_activity_at = ? WHERE id = 'heartbeat'", (time.time() - DAY,))
        self.sql("UPDATE sessions SET pinned = 1 WHERE id = 'pinned'")
        self.sql("UPDATE sessions SET end_reason = 'compression' WHERE id = 'root'")
        self.db.append_message("talked", "user", "now")
        self.assertEqual(self.db.archive_stale_sessions(-1), 0)
        self.assertEqual(self.db.archive_stale_sessions(None), 0)
        self.assertEqual(self.db.archive_stale_sessions(5), 2)
        archived = [r["id"] for r in self.raw(self.path).execute("SELECT id FROM sessions WHERE archived = 1")]
        self.assertEqual(sorted(archived), ["idle", "open"])
        self.assertEqual(self.db.archive_stale_sessions(5, exclude_pinned=False), 1)

    def big_old_session(self, session_id):
        """An old ended session whose messages fill most of the file: pruning it frees most pages."""
        self.session(session_id, days_ago=100, message_days_ago=100)
        for _ in range(8):
            self.db.append_message(session_id, "assistant", os.urandom(30000).hex())
        self.sql("UPDATE messages SET timestamp = ? WHERE session_id = ?", (time.time() - 100 * DAY, session_id))

    def test_auto_prune_runs_once_per_interval_and_vacuums_only_after_a_prune_that_freed_pages(self):
        self.big_old_session("old")
        # The freed share of the file differs by SQLite build (0.21 on 3.31.1, 0.23-0.3 later):
        # a gate of 0.1 is met on each, and the gate's own value is tested below.
        first = self.db.maybe_auto_prune_and_vacuum(retention_days=90,
                                                    min_vacuum_freelist_ratio=0.1)
        self.assertGreater(first.pop("freelist_ratio"), 0.1)
        self.assertEqual(first, {"skipped": False, "pruned": 1, "closed": 0, "vacuumed": True})
        self.assertEqual(self.db.maybe_auto_prune_and_vacuum(),
                         {"skipped": True, "pruned": 0, "closed": 0, "vacuumed": False})
        self.big_old_session("old2")
        again = self.db.maybe_auto_prune_and_vacuum(min_interval_hours=0)
        self.assertEqual(again, {"skipped": False, "pruned": 1, "closed": 0, "vacuumed": False})  # < 30 days ago
        self.db.set_meta("last_auto_prune", "garbled")
        self.assertFalse(self.db.maybe_auto_prune_and_vacuum(vacuum=False)["skipped"])

    def test_auto_vacuum_waits_for_enough_free_pages(self):
        self.big_old_session("old")
        result = self.db.maybe_auto_prune_and_vacuum(min_vacuum_freelist_ratio=0.99)
        self.assertLess(result["freelist_ratio"], 0.99)
        self.assertEqual((result["pruned"], result["vacuumed"]), (1, False))
        self.assertIsNone(self.db.get_meta("last_vacuum"))

    def test_auto_prune_closes_stale_open_sessions_it_owns_and_spares_leased_ones(self):
        self.session("cron_old", days_ago=100, ended=False, source="cron")
        self.session("cron_leased", days_ago=100, ended=False, source="cron")
        self.session("tg_old", days_ago=100, ended=False, source="telegram")
        self.session("cron_new", days_ago=1, ended=False, source="cron")
        self.assertTrue(self.db.try_acquire_session_turn_lease("cron_leased", "me", ttl_seconds=60))
        result = self.db.maybe_auto_prune_and_vacuum(retention_days=90)
        self.assertEqual((result["pruned"], result["closed"]), (0, 1))
        ends = dict(self.raw(self.path).execute("SELECT id, end_reason FROM sessions").fetchall())
        self.assertEqual(ends, {"cron_old": "startup_orphan_reap", "cron_leased": None, "tg_old": None,
                                "cron_new": None})

    def test_a_negative_retention_skips_auto_prune(self):
        self.session("old", days_ago=100)
        with self.assertLogs("hermes_state", "WARNING"):
            self.assertTrue(self.db.maybe_auto_prune_and_vacuum(retention_days=-1)["skipped"])
        self.assertEqual(self.count("sessions"), 1)

    def test_auto_archive_runs_once_per_interval_and_never_raises(self):
        self.session("idle", days_ago=10)
        self.assertEqual(self.db.maybe_auto_archive(), {"skipped": False, "archived": 1})
        self.assertEqual(self.db.maybe_auto_archive(), {"skipped": True, "archived": 0})
        # A closed read-only handle cannot run them (a writable one reopens, as 0.22's does).
        closed = SessionDB(self.path, read_only=True)
        closed.close()
        with self.assertLogs("hermes_state", "WARNING"):
            self.assertIn("error", closed.maybe_auto_archive(min_interval_hours=0))
            self.assertIn("error", closed.maybe_auto_prune_and_vacuum(min_interval_hours=0))


class Reports(MaintenanceTestCase):

    def test_lifecycle_status_comes_from_the_last_message(self):
        last = {"done": ("assistant", "ok", None, "stop"), "asked": ("user", "q", None, None),
                "calling": ("assistant", None, CALL, None), "tooled": ("tool", "out", None, None),
                "failed": ("assistant", "x", None, "Content_Filter")}
        for sid, (role, content, calls, finish) in last.items():
            self.db.create_session(sid, "cli")
            self.db.append_message(sid, "user", "first")
            self.db.append_message(sid, role, content, tool_calls=calls, finish_reason=finish)
        self.db.create_session("quiet", "cli")
        statuses = self.db.session_lifecycle_statuses(list(last) + ["quiet", "unknown", None])
        self.assertEqual(statuses, {"done": "complete", "asked": "interrupted", "calling": "interrupted",
                                    "tooled": "interrupted", "failed": "error", "quiet": "empty",
                                    "unknown": "empty"})
        self.assertEqual(self.db.session_lifecycle_statuses([]), {})

    def test_cron_runs_of_one_job_newest_first(self):
        for sid, days in (("cron_job1_a", 3), ("cron_job1_b", 1), ("cron_job10_a", 0), ("cron_job1_c", 2)):
            self.session(sid, source="cron", days_ago=days)
        self.session("cron_job1_cli", source="cli")
        runs = self.db.list_cron_job_runs("job1")
        self.assertEqual(self.ids(runs), ["cron_job1_b", "cron_job1_c", "cron_job1_a"])
        self.assertIn("last_active", runs[0])
        self.assertEqual(self.ids(self.db.list_cron_job_runs("job1", limit=1, offset=1)), ["cron_job1_c"])

    def test_pr_urls_and_skill_titles(self):
        self.db.create_session("s", "cli")
        self.db.set_session_title("s", "Skill title")
        self.db.append_message("s", "user", '[IMPORTANT: The user has invoked the "x" skill, body...]')
        self.db.append_message("s", "tool", "https://github.com/o/r/pull/7", tool_call_id="c1")
        self.db.append_message("s", "assistant", "see /pull/8")
        self.db.append_message("s", "tool", "created /pull/9", tool_call_id="c2")
        self.db.create_session("untitled", "cli")
        self.db.append_message("untitled", "user", "[IMPORTANT: The user has invoked the y")
        self.assertEqual(self.db.find_pr_url_messages(["s", "", "untitled"]),
                         [{"session_id": "s", "content": "https://github.com/o/r/pull/7"},
                          {"session_id": "s", "content": "created /pull/9"}])
        self.assertEqual(self.db.list_skill_scaffolded_sessions(),
                         [{"id": "s", "title": "Skill title",
                           "content": '[IMPORTANT: The user has invoked the "x" skill, body...]'}])

    def test_logical_size_is_page_accounting_and_none_once_closed(self):
        self.db.create_session("s", "cli")
        conn = self.raw(self.path)
        pages, size = conn.execute("PRAGMA page_count").fetchone()[0], conn.execute("PRAGMA page_size").fetchone()[0]
        self.assertEqual(self.db.logical_size_bytes(), pages * size)
        closed = SessionDB(self.path, read_only=True)
        closed.close()
        self.assertIsNone(closed.logical_size_bytes())

    def test_vacuum_reports_how_many_search_indexes_it_merged(self):
        self.db.create_session("s", "cli")
        self.db.append_message("s", "user", "words to index")
        # (the word index and the CJK one at least: none without FTS5)
        self.assertGreaterEqual(self.db.vacuum(), min(2, len(INDEX_TABLES)))


class OneShotFixes(MaintenanceTestCase):

    def test_repo_roots_fill_only_empty_ones(self):
        self.db.create_session("a", "cli", cwd="/w")
        self.db.create_session("b", "cli", cwd="/w", git_repo_root="/kept")
        self.db.create_session("c", "cli", cwd="/x")
        self.assertIsNone(self.db.backfill_repo_roots({"/w": "/root", "/x": "", "": "/y"}))
        roots = dict(self.raw(self.path).execute("SELECT id, git_repo_root FROM sessions").fetchall())
        self.assertEqual(roots, {"a": "/root", "b": "/kept", "c": None})

    def test_kanban_retag_moves_cli_rows_under_the_root_once(self):
        for sid, cwd, source in (("in", "/ws/b_1/t", "cli"), ("at", "/ws/b_1", "cli"), ("sibling", "/ws/b_1x", "cli"),
                                 ("like", "/ws/bx1/t", "cli"), ("tg", "/ws/b_1/t", "telegram")):
            self.db.create_session(sid, source, cwd=cwd)
        self.assertEqual(self.db.retag_kanban_worker_sessions("/ws/b_1/"), 2)
        self.db.create_session("later", "cli", cwd="/ws/b_1/z")
        self.assertEqual(self.db.retag_kanban_worker_sessions("/ws/b_1"), 0)
        self.assertEqual(self.db.retag_kanban_worker_sessions("/"), 0)
        sources = dict(self.raw(self.path).execute("SELECT id, source FROM sessions").fetchall())
        self.assertEqual(sources, {"in": "kanban", "at": "kanban", "sibling": "cli", "like": "cli", "tg": "telegram",
                                   "later": "cli"})

    def test_stale_markers_are_emptied_after_a_private_backup(self):
        self.db.create_session("s", "cli")
        stale = [self.db.append_message("s", "assistant", text, tool_calls=CALL) for text in ("[memory]", " [a.b-1] ")]
        kept = [self.db.append_message("s", "assistant", "[memory]"), self.db.append_message("s", "user", "[memory]"),
                self.db.append_message("s", "assistant", "[memory] and more", tool_calls=CALL)]
        dry = self.db.purge_stale_tool_call_markers(dry_run=True)
        self.assertEqual(dry, {"dry_run": True, "rows_affected": 2, "row_ids": stale, "backup_path": None})
        report = self.db.purge_stale_tool_call_markers()
        self.assertEqual((report["dry_run"], report["row_ids"]), (False, stale))
        backup = report["backup_path"]
        self.assertRegex(os.path.basename(backup), r"^state\.db\.pre-clean-markers-backup-\d{8}_\d{6}$")
        if os.name == "posix":
            self.assertEqual(stat.S_IMODE(os.stat(backup).st_mode), 0o600)
        old = sqlite3.connect(backup)
        self.addCleanup(old.close)
        self.assertEqual(old.execute("SELECT content FROM messages WHERE id = ?", (stale[0],)).fetchone()[0], "[memory]")
        rows = dict(self.raw(self.path).execute("SELECT id, content FROM messages").fetchall())
        self.assertEqual([rows[i] for i in stale], ["", ""])
        self.assertEqual([rows[i] for i in kept], ["[memory]", "[memory]", "[memory] and more"])
        self.assertEqual(self.db.purge_stale_tool_call_markers(),
                         {"dry_run": False, "rows_affected": 0, "row_ids": [], "backup_path": None})
