"""Compression and resume with hermes-agent's contract: lineage, where a resume lands, caps, compaction, publication."""

import inspect
import json
import os
import sqlite3
import subprocess
import sys
import time

import hermes_state
import hermes_state_compression
from hermes_state_errors import (
    CompressionSessionBusyError, SessionCompressionInProgressError, SessionExportTooLargeError,
    SessionResumeTooLargeError, SessionRowError,
)
from test_support import REPO, StoreTestCase, backdate


class CompressionTestCase(StoreTestCase):

    def sql(self, statement, params=()):
        self.db._execute_write(lambda conn: conn.execute(statement, params))

    def rows(self, statement, params=()):
        return [dict(row) for row in self.raw(self.path).execute(statement, params)]

    def messages(self, session_id):
        return self.rows("SELECT * FROM messages WHERE session_id = ? ORDER BY id", (session_id,))

    def chain(self, *ids, start=1, messages=None):
        """Sessions ids[0] <- ids[1] <- ..., each but the last ended by compression, started in order;
        `messages` ({id: [(role, content), ...]}) are appended before a session is ended."""
        for i, session_id in enumerate(ids):
            self.db.create_session(session_id, "cli", parent_session_id=ids[i - 1] if i else None)
            backdate(self.db, session_id, start + i)
            for role, content in (messages or {}).get(session_id, ()):
                self.db.append_message(session_id, role, content)
            if i < len(ids) - 1:
                self.db.end_session(session_id, "compression")


class Lineage(CompressionTestCase):

    def test_the_tip_prefers_a_compressed_child_then_a_live_one_then_the_latest_active(self):
        self.chain("a", "b")
        self.db.create_session("stale", "cli", parent_session_id="a")
        self.db.end_session("stale", "ws_orphan_reap")
        self.db.append_message("stale", "user", "newest of all")
        self.assertEqual(self.db.get_compression_tip("a"), "b")
        self.db.end_session("b", "user_exit")
        self.assertEqual(self.db.get_compression_tip("a"), "stale")
        self.db.reopen_session("b")
        self.db.end_session("b", "compression")
        self.db.create_session("c", "cli", parent_session_id="b")
        self.assertEqual(self.db.get_compression_tip("a"), "c")
        # The chain forward from any member, through that same tip.
        self.assertEqual(self.db.get_compression_chain("a"), ["a", "b", "c"])
        self.assertEqual(self.db.get_compression_chain("b"), ["b", "c"])
        self.assertEqual(self.db.get_compression_chain("stale"), ["stale"])

    def test_the_tip_never_follows_a_fork_and_an_unknown_id_is_its_own_tip(self):
        self.chain("a", "b")
        forks = (("br", {"_branched_from": "b"}, "cli"), ("dl", {"_delegate_from": "x"}, "cli"), ("tl", None, "tool"))
        for session_id, config, source in forks:
            self.db.create_session(session_id, source, parent_session_id="a", model_config=config)
            self.sql("UPDATE sessions SET last_activity_at = 1e12 WHERE id = ?", (session_id,))
        self.assertEqual(self.db.get_compression_tip("a"), "b")
        self.assertEqual(self.db.get_compression_tip("ghost"), "ghost")
        self.assertIsNone(self.db.get_compression_tip(None))

    def test_the_lineage_runs_root_to_tip_through_the_oldest_continuation(self):
        self.chain("a", "b", "c")
        self.db.create_session("later", "cli", parent_session_id="b")
        for member in ("a", "b", "c"):
            self.assertEqual(self.db.get_compression_lineage(member), ["a", "b", "c"])
        self.assertEqual(self.db.get_compression_lineage("later"), ["later"])
        self.assertEqual(self.db.get_compression_lineage("ghost"), [])

    def test_a_delegates_own_continuation_stays_in_its_lineage(self):
        self.db.create_session("parent", "cli")
        self.db.create_session("dl", "cli", parent_session_id="parent", model_config={"_delegate_from": "parent"})
        self.db.end_session("dl", "compression")
        self.db.create_session("dl2", "cli", parent_session_id="dl", model_config={"_delegate_from": "parent"})
        self.assertEqual(self.db.get_compression_lineage("dl"), ["dl"])
        self.assertEqual(self.db.get_compression_lineage("dl2"), ["dl", "dl2"])

    def test_the_conversation_root_follows_every_kind_of_parent(self):
        self.chain("a", "b")
        self.db.create_session("br", "cli", parent_session_id="b", model_config={"_branched_from": "b"})
        self.assertEqual(self.db.get_conversation_root("br"), "a")
        self.assertEqual(self.db.get_conversation_root("ghost"), "ghost")
        self.sql("UPDATE sessions SET parent_session_id = 'b' WHERE id = 'a'")  # a loop ends the walk
        self.assertIn(self.db.get_conversation_root("br"), ("a", "b"))


class ResumeTarget(CompressionTestCase):

    def test_an_empty_head_resumes_at_the_continuation_holding_the_transcript(self):
        self.db.create_session("head", "cli")
        self.db.create_session("child", "cli", parent_session_id="head")
        self.db.append_message("child", "user", "the transcript")
        self.assertEqual(self.db.resolve_resume_session_id("head"), "child")
        self.assertEqual(self.db.resolve_resume_session_id("ghost"), "ghost")
        self.assertEqual(self.db.resolve_resume_session_id(""), "")

    def test_a_compressed_parent_with_its_own_messages_resumes_at_the_tip(self):
        self.chain("a", "b", messages={"a": [("user", "before compression")], "b": [("user", "after compression")]})
        self.assertEqual(self.db.resolve_resume_session_id("a"), "b")

    def test_forks_and_resets_never_capture_a_resume(self):
        self.db.create_session("gw", "telegram", session_key="K")
        self.db.append_message("gw", "user", "first conversation")
        for session_id, config, source, key in (("br", {"_branched_from": "gw"}, "cli", None),
                                                ("dl", {"_delegate_from": "gw"}, "cli", None),
                                                ("rs", {"_reset_from": "gw"}, "cli", None),
                                                ("tl", None, "tool", None), ("legacy", None, "telegram", "K")):
            self.db.create_session(session_id, source, parent_session_id="gw", model_config=config, session_key=key)
            self.db.append_message(session_id, "user", "elsewhere")
        self.db.end_session("gw", "idle")
        self.assertEqual(self.db.resolve_resume_session_id("gw"), "gw")
        self.db.create_session("cont", "telegram", parent_session_id="gw", session_key="other")
        self.db.append_message("cont", "user", "continued")
        self.assertEqual(self.db.resolve_resume_session_id("gw"), "cont")


class SearchSessions(CompressionTestCase):

    def setUp(self):
        super().setUp()
        for session_id, source, cwd, root in (("old", "cli", "/repo/src", None), ("git", "cli", "/elsewhere", "/repo"),
                                              ("tg", "telegram", "/repo", None), ("sib", "cli", "/repoX", None),
                                              ("lit", "cli", "/rep_o", None)):
            self.db.create_session(session_id, source, cwd=cwd, git_repo_root=root, system_prompt=f"p-{session_id}")
        for i, session_id in enumerate(("old", "git", "tg", "sib", "lit")):
            backdate(self.db, session_id, 100 + i)
        self.db.append_message("old", "user", "recent", timestamp=500)
        self.sql("UPDATE sessions SET last_activity_at = 400 WHERE id = 'sib'")

    def ids(self, **kwargs):
        return [row["id"] for row in self.db.search_sessions(**kwargs)]

    def test_sessions_come_most_recently_active_first_with_their_prompt(self):
        rows = self.db.search_sessions()
        self.assertEqual([(row["id"], row["last_active"]) for row in rows],
                         [("old", 500), ("sib", 400), ("lit", 104), ("tg", 102), ("git", 101)])
        self.assertEqual(rows[0]["system_prompt"], "p-old")
        self.assertNotIn("resolved_prompt", rows[0])
        self.assertEqual(self.ids(source="cli", limit=2, offset=1), ["sib", "lit"])
        self.assertEqual(len(self.ids(limit=-1)), 5)
        # 0.22's `hermes -c` asks for the CLI family's sources at once.
        self.assertEqual(self.ids(source=["telegram", "cli"], limit=3), ["old", "sib", "lit"])
        self.assertEqual(self.ids(source=("telegram",)), ["tg"])

    def test_a_workspace_is_a_git_root_or_a_cwd_at_or_under_it(self):
        self.assertEqual(self.ids(workspace_key="/repo/"), ["old", "tg", "git"])
        self.assertEqual(self.ids(workspace_key="/rep_o"), ["lit"])
        self.assertEqual(hermes_state.workspace_key({"git_repo_root": " /r ", "cwd": "/x"}), "/r")
        self.assertEqual(hermes_state.workspace_key({"cwd": "/x"}), "/x")
        self.assertIsNone(hermes_state.workspace_key({"cwd": "  "}))


class ResumeCaps(CompressionTestCase):

    def setUp(self):
        super().setUp()
        self.chain("a", "b", messages={sid: [("user", f"{sid}{i}") for i in range(count)]
                                       for sid, count in (("a", 3), ("b", 2))})

    def test_the_resume_cap_counts_the_whole_lineage(self):
        self.assertEqual(self.db.get_resume_message_count("b"), 5)
        self.assertEqual(self.db.assert_resume_safe("b", max_messages=5), 5)
        with self.assertRaises(SessionResumeTooLargeError) as caught:
            self.db.assert_resume_safe("b", max_messages=3)
        self.assertEqual((caught.exception.message_count, caught.exception.limit), (4, 3))
        self.assertEqual(self.db.assert_resume_safe("b", max_messages=0), 0)
        self.assertEqual(self.db.assert_resume_safe("b"), 5)
        with self.assertRaisesRegex(ValueError, "max_messages"):
            self.db.assert_resume_safe("b", max_messages=-1)

    def test_a_tip_only_resume_counts_the_tips_own_active_rows(self):
        self.assertEqual(self.db.assert_resume_safe("b", max_messages=2, tip_only=True), 2)
        with self.assertRaisesRegex(SessionResumeTooLargeError, "in its tip segment") as caught:
            self.db.assert_resume_safe("b", max_messages=1, tip_only=True)
        self.assertEqual(caught.exception.message_count, 2)
        with self.assertRaisesRegex(SessionResumeTooLargeError, "across its lineage"):
            self.db.assert_resume_safe("b", max_messages=2)

    def test_the_export_cap_counts_one_session(self):
        self.assertEqual(self.db.assert_export_safe("b", max_messages=2), 2)
        with self.assertRaises(SessionExportTooLargeError) as caught:
            self.db.assert_export_safe("a", max_messages=2)
        self.assertEqual((caught.exception.session_id, caught.exception.message_count), ("a", 3))
        self.assertEqual(self.db.assert_export_safe("a", max_messages=0), 0)
        self.assertEqual(self.db.assert_export_safe("ghost"), 0)

    def test_the_caps_come_from_hermes_agents_config_when_it_is_there(self):
        self.assertEqual((hermes_state.resolved_max_resume_messages(), hermes_state.resolved_max_export_messages()),
                         (hermes_state.MAX_SAFE_RESUME_MESSAGES, hermes_state.MAX_SAFE_EXPORT_MESSAGES))
        package = self.tmp / "agent" / "hermes_cli"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "config.py").write_text(
            "def load_config_readonly():\n"
            "    return {'sessions': {'max_resume_messages': 0, 'max_export_messages': 'junk'}}\n")
        script = ("import hermes_state as h; "
                  "print(h.resolved_max_resume_messages(), h.resolved_max_export_messages())")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                             env={"PYTHONPATH": os.pathsep.join((str(REPO), str(package.parent))),
                                  "HERMES_HOME": str(self.tmp)}).stdout
        self.assertEqual(out.split(), ["0", str(hermes_state.MAX_SAFE_EXPORT_MESSAGES)])


class ResumeConversations(CompressionTestCase):

    def test_the_model_sees_the_tip_and_the_display_the_whole_lineage(self):
        self.chain("a", "b", messages={"a": [("user", "old question"), ("assistant", "old answer")],
                                       "b": [("user", "new question")]})
        model, display = self.db.get_resume_conversations("b")
        self.assertEqual([m["content"] for m in model], ["new question"])
        self.assertEqual([m["content"] for m in display], ["old question", "old answer", "new question"])
        self.assertTrue(all("_row_id" in m for m in model + display))


class ArchiveAndCompact(CompressionTestCase):

    def setUp(self):
        super().setUp()
        self.db.create_session("s", "cli", model_config={"keep": 1, "drop": 2})
        self.db.append_message("s", "user", "question")
        self.db.append_message("s", "assistant", "calling", tool_calls=[{"id": "t1"}])
        self.watermark = self.db.get_active_message_watermark("s")
        self.db.append_message("s", "user", "arrived during the summary", tool_calls=[{"id": "t2"}, {"id": "t3"}])

    def test_old_turns_are_kept_as_compacted_and_the_late_one_follows_the_summary(self):
        compacted = [{"role": "user", "content": "summary"},
                     {"role": "assistant", "content": [{"type": "text", "text": "parts"}], "tool_calls": [{"id": "z"}]}]
        count = self.db.archive_and_compact("s", compacted, model_config_patch={"drop": None, "new": "v"},
                                            watermark=self.watermark)
        self.assertEqual(count, 3)
        rows = self.messages("s")
        # The late row lives on as its copy; its original is rewound, so search finds it once.
        self.assertEqual([(r["content"], r["active"], r["compacted"]) for r in rows], [
            ("question", 0, 1), ("calling", 0, 1), ("arrived during the summary", 0, 0),
            ("summary", 1, 0), ('\x00json:[{"type": "text", "text": "parts"}]', 1, 0),
            ("arrived during the summary", 1, 0)])
        self.assertEqual(rows[-1]["tool_calls"], rows[2]["tool_calls"])
        session = self.db.get_session("s")
        self.assertEqual((session["message_count"], session["tool_call_count"]), (3, 3))
        self.assertEqual(json.loads(session["model_config"]), {"keep": 1, "new": "v"})
        self.assertEqual([m["_row_id"] for m in compacted], [rows[3]["id"], rows[4]["id"]])
        self.assertEqual(self.db.get_active_message_watermark("s"), rows[-1]["id"])

    def test_message_dicts_are_stored_as_hermes_agents_compactor_hands_them_over(self):
        self.db.archive_and_compact("s", [
            {"content": "no role", "reasoning": "not an assistant", "message_id": "pm1", "observed": True,
             "timestamp": "bad", "display_metadata": '{"k": 1}', "display_kind": "note", "api_content": "sent"},
            {"role": "assistant", "content": "a\ud800b", "reasoning": "why", "reasoning_details": [{"x": 1}],
             "codex_message_items": '[{"already": "json"}]', "tool_calls": '[{"id": "q"}]', "timestamp": 5,
             "display_metadata": "[1]"},
            {"role": "user", "content": "stamped after the previous one"}])
        first, second, third = self.messages("s")[-3:]
        self.assertEqual((first["role"], first["reasoning"], first["platform_message_id"], first["observed"]),
                         ("unknown", None, "pm1", 1))
        self.assertEqual((first["display_metadata"], first["display_kind"], first["api_content"]),
                         ('{"k": 1}', "note", "sent"))
        self.assertEqual((second["content"], second["reasoning"], second["reasoning_details"]),
                         ("a\ufffdb", "why", '[{"x": 1}]'))
        self.assertEqual((second["codex_message_items"], second["tool_calls"], second["display_metadata"]),
                         ('[{"already": "json"}]', '[{"id": "q"}]', None))
        self.assertAlmostEqual(first["timestamp"], time.time(), delta=60)
        self.assertEqual(second["timestamp"], 5.0)
        self.assertGreater(third["timestamp"], first["timestamp"])

    def test_a_lost_lock_or_an_unknown_session_writes_nothing(self):
        before = self.messages("s")
        with self.assertRaises(SessionCompressionInProgressError):
            self.db.archive_and_compact("s", [{"role": "user", "content": "x"}], lock_holder="me")
        self.db.try_acquire_compression_lock("s", "other")
        with self.assertRaises(SessionCompressionInProgressError):
            self.db.archive_and_compact("s", [{"role": "user", "content": "x"}], lock_holder="me")
        with self.assertRaises(sqlite3.IntegrityError):
            self.db.archive_and_compact("ghost", [{"role": "user", "content": "x"}])
        with self.assertRaises(SessionRowError):
            self.db.archive_and_compact("ghost", [], model_config_patch={})
        self.assertEqual(self.db.archive_and_compact("ghost", []), 0)
        for bad in (dict(compacted_messages=None), dict(compacted_messages=["x"])):
            with self.assertRaises(TypeError):
                self.db.archive_and_compact("s", **bad)
        with self.assertRaises(AttributeError):
            self.db.archive_and_compact("s", [], model_config_patch=[1])
        with self.assertRaises(ValueError):
            self.db.archive_and_compact("s", [], watermark="x")
        self.assertEqual(self.messages("s"), before)
        self.assertEqual(self.db.archive_and_compact("s", [{"role": "user", "content": "x"}], lock_holder="other"), 1)


class PublishCompressionChild(CompressionTestCase):

    def setUp(self):
        super().setUp()
        self.db.create_session("p", "telegram", cwd="/repo", git_repo_root="/repo", profile_name="work",
                               user_id="U", session_key="SK", chat_id="C", display_name="D", system_prompt="old")
        self.db.append_message("p", "user", "summarised")
        self.low = self.db.get_active_message_watermark("p")
        self.db.append_message("p", "user", "foreign", tool_calls=[{"id": 1}])
        self.high = self.db.get_active_message_watermark("p")
        self.db.append_message("p", "user", "our own flush")
        self.db.try_acquire_compression_lock("p", "L")

    def publish(self, **overrides):
        arguments = dict(parent_session_id="p", child_session_id="c", source="cli", compression_lock_holder="L",
                         messages=[{"role": "user", "content": "handoff"}])
        arguments.update(overrides)
        return self.db.publish_compression_child(**arguments)

    def test_the_parent_ends_and_the_child_starts_with_the_handoff_and_the_foreign_tail(self):
        self.assertIsNone(self.publish(model="m", model_config={"a": 1}, system_prompt="new", watermark=self.low,
                                       watermark_ceiling=self.high))
        parent, child = self.db.get_session("p"), self.db.get_session("c")
        self.assertEqual(parent["end_reason"], "compression")
        self.assertEqual([m["content"] for m in self.messages("c")], ["handoff", "foreign"])
        self.assertEqual((child["message_count"], child["tool_call_count"], child["system_prompt"]), (2, 1, "new"))
        self.assertEqual([child[k] for k in ("cwd", "git_repo_root", "profile_name", "user_id", "session_key",
                                             "chat_id", "display_name", "model_config")],
                         ["/repo", "/repo", "work", "U", "SK", "C", "D", '{"a": 1}'])
        self.assertEqual(self.db.get_compression_tip("p"), "c")
        self.assertEqual(self.db.get_compression_lineage("c"), ["p", "c"])

    def test_a_lost_lease_or_a_bad_parent_publishes_nothing(self):
        cases = [(CompressionSessionBusyError, dict(compression_lock_holder="X")),
                 (CompressionSessionBusyError, dict(compression_lock_holder=None)),
                 (RuntimeError, dict(messages=[])),
                 (RuntimeError, dict(parent_session_id="ghost", require_compression_lease=False)),
                 (sqlite3.IntegrityError, dict(child_session_id="p")),
                 (sqlite3.IntegrityError, dict(child_session_id=None)),
                 (AttributeError, dict(messages=["not a dict"]))]
        for error, overrides in cases:
            with self.subTest(overrides=overrides), self.assertRaises(error):
                self.publish(**overrides)
        self.assertIsNone(self.db.get_session("p")["ended_at"])
        self.assertEqual([r["id"] for r in self.rows("SELECT id FROM sessions")], ["p"])
        self.publish(require_compression_lease=False, compression_lock_holder=None)
        with self.assertRaisesRegex(RuntimeError, "already ended"):
            self.publish(child_session_id="c2", require_compression_lease=False)

    def test_a_lease_refresh_at_publication_revives_the_holders_expired_lease_only(self):
        self.sql("UPDATE compression_locks SET expires_at = ? WHERE session_id = 'p'", (time.time() - 5,))
        with self.assertRaises(CompressionSessionBusyError):
            self.publish()
        with self.assertRaises(CompressionSessionBusyError):
            self.publish(compression_lock_holder="X", require_lease_refresh=True)
        self.publish(require_lease_refresh=True, lease_ttl_seconds=60)
        expires = self.rows("SELECT expires_at FROM compression_locks WHERE session_id = 'p'")[0]["expires_at"]
        self.assertAlmostEqual(expires, time.time() + 60, delta=10)
        self.assertEqual(self.db.get_session("p")["end_reason"], "compression")

    def test_the_child_takes_the_conversations_keys_and_a_cleanup_end_is_no_boundary(self):
        self.sql("UPDATE sessions SET model_config = ? WHERE id = 'p'",
                 (json.dumps({"onboarding_run": {"step": 2}, "usage_anchor": 7}),))
        self.db.end_session("p", "tui_shutdown")
        self.publish(model_config={"a": 1})
        self.assertEqual(json.loads(self.db.get_session("c")["model_config"]),
                         {"onboarding_run": {"step": 2}, "a": 1})
        self.assertEqual(hermes_state_compression._CONVERSATION_MODEL_CONFIG_KEYS, ("onboarding_run",))
        self.assertEqual(self.db.get_session("p")["end_reason"], "compression")

    def test_a_conversation_key_is_updated_at_the_tip_and_found_by_its_name(self):
        self.publish()
        self.assertEqual(self.db.update_conversation_model_config_value("p", "onboarding_run",
                                                                        lambda now: {"n": (now or {}).get("n", 0) + 1}),
                         "c")
        self.db.update_conversation_model_config_value("c", "onboarding_run", lambda now: {"n": now["n"] + 1})
        self.assertEqual(json.loads(self.db.get_session("c")["model_config"]), {"onboarding_run": {"n": 2}})
        self.assertIsNone(self.db.get_session("p")["model_config"])
        self.db.create_session("other", "cli", model_config={"onboarding_run_x": 1, "z": "onboarding_run"})
        self.assertEqual(self.db.session_ids_with_model_config_key("onboarding_run"), ["c"])
        self.db.update_conversation_model_config_value("c", "onboarding_run", lambda now: None)
        self.assertEqual(self.db.session_ids_with_model_config_key("onboarding_run"), [])
        self.assertIsNone(self.db.update_conversation_model_config_value("ghost", "k", lambda now: 1))

    def test_a_compression_child_continues_a_parent_compression_ended(self):
        self.publish()
        child = self.db.get_session("c")
        self.assertTrue(self.db._is_compression_child_row(child))
        self.assertFalse(self.db._is_compression_child_row(self.db.get_session("p")))
        for marker in ("_branched_from", "_delegate_from", "_reset_from"):
            self.assertFalse(self.db._is_compression_child_row(dict(child, model_config={marker: "p"})))
        self.assertTrue(self.db._is_compression_child_row(dict(child, model_config={"_reset_from": "elsewhere"})))
        self.assertFalse(self.db._is_compression_child_row(dict(child, source="tool")))
        self.assertFalse(self.db._is_compression_child_row({"parent_session_id": "ghost"}))


class ExplicitCloseReopen(CompressionTestCase):

    def test_a_deliberate_close_is_cleared_for_a_host_still_routed_to_it(self):
        self.db.create_session("s", "tui")
        self.db.end_session("s", "tui_close")
        with self.assertLogs("hermes_state", "WARNING") as logs:
            self.assertEqual(self.db.reopen_if_explicitly_closed("s", provenance="a prompt arrived"), "tui_close")
        self.assertIn("a prompt arrived", logs.output[0])
        self.assertIsNone(self.db.get_session("s")["ended_at"])
        self.assertIsNone(self.db.reopen_if_explicitly_closed("s", provenance="again"))
        self.assertIsNone(self.db.reopen_if_explicitly_closed("", provenance="x"))
        self.assertIsNone(self.db.reopen_if_explicitly_closed("ghost", provenance="x"))

    def test_cleanup_ends_boundaries_compression_and_continued_sessions_stay_ended(self):
        for sid, reason in (("auto", "ws_disconnect"), ("reset", "session_reset"), ("new", "new_session"),
                            ("comp", "compression")):
            self.db.create_session(sid, "tui")
            self.db.end_session(sid, reason)
            self.assertIsNone(self.db.reopen_if_explicitly_closed(sid, provenance="x"), reason)
            self.assertEqual(self.db.get_session(sid)["end_reason"], reason)
        self.db.create_session("parent", "tui")
        self.db.create_session("branch", "tui", parent_session_id="parent", model_config={"_branched_from": "parent"})
        self.db.end_session("parent", "cli_close")
        with self.assertLogs("hermes_state", "WARNING"):
            self.assertEqual(self.db.reopen_if_explicitly_closed("parent", provenance="x"), "cli_close")
        self.db.end_session("parent", "cli_close")
        self.db.create_session("next", "tui", parent_session_id="parent")
        self.assertIsNone(self.db.reopen_if_explicitly_closed("parent", provenance="x"))


class LineageAdoption(CompressionTestCase):

    def setUp(self):
        super().setUp()
        if "include_inactive" not in inspect.signature(hermes_state.SessionDB.export_session_lineage).parameters:
            self.skipTest("export_session_lineage(include_inactive=) is the portability module's (issue 33)")
        self.donor = hermes_state.SessionDB(self.tmp / "donor.db")
        self.addCleanup(self.donor.close)
        self.donor.create_session("a", "telegram")
        self.donor.append_message("a", "user", "old turn")
        self.donor.archive_and_compact("a", [{"role": "user", "content": "summary"}])
        self.donor.create_session("b", "telegram", parent_session_id="a")
        self.donor.end_session("a", "compression")
        self.donor.append_message("b", "user", "latest")

    def test_the_whole_lineage_moves_with_its_archived_rows_and_the_donor_is_retired(self):
        result = self.db.adopt_session_lineage_from(self.donor, "b")
        self.assertEqual((result["adopted"], result["donor_retired"]), (True, True))
        self.assertEqual([m["content"] for m in self.db.get_messages("a", include_inactive=True)],
                         ["old turn", "summary"])
        self.assertEqual(self.db.get_compression_lineage("b"), ["a", "b"])
        for sid in ("a", "b"):
            donor = self.donor.get_session(sid)
            self.assertEqual((donor["end_reason"], donor["archived"]), ("adopted_by_profile", 1))
        again = self.db.adopt_session_lineage_from(self.donor, "b", retire_donor=False)
        self.assertEqual((again["adopted"], again["imported"]), (True, 0), "already here: skipped")
        self.assertFalse(self.db.adopt_session_lineage_from(self.donor, "ghost")["adopted"])

    def test_a_donor_that_kept_growing_is_not_retired(self):
        self.db.adopt_session_lineage_from(self.donor, "b", retire_donor=False)
        self.donor.append_message("b", "user", "written after the first adoption")
        result = self.db.adopt_session_lineage_from(self.donor, "b")
        self.assertEqual((result["adopted"], result["donor_retired"]), (True, False))
        self.assertIsNone(self.donor.get_session("b")["end_reason"])


class OrphanedContinuations(CompressionTestCase):

    def test_only_week_old_unused_continuations_with_a_handoff_are_ended(self):
        self.chain("p", "old")
        for session_id in ("new", "empty", "used"):
            self.db.create_session(session_id, "cli", parent_session_id="p")
        for session_id in ("old", "new", "used"):
            self.db.append_message(session_id, "user", "handoff")
        for session_id in ("old", "empty", "used"):
            backdate(self.db, session_id, time.time() - 8 * 86400)
        self.sql("UPDATE sessions SET api_call_count = 1 WHERE id = 'used'")
        self.assertEqual(self.db.finalize_orphaned_compression_sessions(), 1)
        self.assertEqual({r["id"]: r["end_reason"] for r in self.rows("SELECT id, end_reason FROM sessions")},
                         {"p": "compression", "old": "orphaned_compression", "new": None, "empty": None, "used": None})
        self.assertEqual(self.db.finalize_orphaned_compression_sessions(), 0)


class CompressorGuards(CompressionTestCase):
    """The cooldown, fallback streak and ineffective count hermes-agent's compressor keeps per session."""

    def setUp(self):
        super().setUp()
        self.db.create_session("s", "cli")

    def test_a_running_cooldown_is_reported_and_a_passed_one_is_not(self):
        self.db.record_compression_failure_cooldown("s", time.time() + 600, "summary model failed")
        active = self.db.get_compression_failure_cooldown("s")
        self.assertEqual(active["error"], "summary model failed")
        self.assertAlmostEqual(active["remaining_seconds"], 600, delta=30)
        self.db.record_compression_failure_cooldown("s", 10.0)
        self.assertIsNone(self.db.get_compression_failure_cooldown("s"))
        self.assertEqual(self.db.get_compression_failure_cooldown_row("s"),
                         {"session_exists": True, "cooldown_until": 10.0, "error": None})
        self.db.clear_compression_failure_cooldown("s")
        self.assertEqual(self.rows("SELECT compression_failure_cooldown_until AS u, compression_failure_error AS e"
                                   " FROM sessions"), [{"u": None, "e": None}])

    def test_unknown_sessions_read_as_empty_and_a_failed_cooldown_write_is_only_logged(self):
        self.assertEqual(self.db.get_compression_failure_cooldown_row("gone"),
                         {"session_exists": False, "cooldown_until": None, "error": None})
        self.assertEqual((self.db.get_compression_fallback_streak("gone"), self.db.get_compression_ineffective_count("")),
                         (0, 0))
        with self.assertLogs("hermes_state", "WARNING"):
            self.assertIsNone(self.db.record_compression_failure_cooldown("s", {"not": "bindable"}))

    def test_a_snapshot_is_restored_exactly_or_the_restore_raises(self):
        self.db.record_compression_failure_cooldown("s", 50.0, "old")
        snapshot = self.db.get_compression_failure_cooldown_row("s")
        self.db.clear_compression_failure_cooldown("s")
        self.db.restore_compression_failure_cooldown_row("s", snapshot)
        self.assertEqual(self.db.get_compression_failure_cooldown_row("s"), snapshot)
        self.db.restore_compression_failure_cooldown_row("gone", {"session_exists": False})
        for session_id, snap in (("s", {"session_exists": False}), ("gone", {"session_exists": True})):
            with self.subTest(session_id=session_id), self.assertRaises(RuntimeError):
                self.db.restore_compression_failure_cooldown_row(session_id, snap)

    def test_the_overload_streak_counts_every_strike_of_concurrent_agents(self):
        self.assertEqual(self.db.get_compression_overload_streak("s"), 0)
        paths = [str(self.path)] * 4
        script = ("import sys; from hermes_state import SessionDB\n"
                  "db = SessionDB(sys.argv[1])\n"
                  "[db.increment_compression_overload_streak('s') for _ in range(25)]\ndb.close()")
        procs = [subprocess.Popen([sys.executable, "-c", script, p], cwd=REPO) for p in paths]
        self.assertEqual([proc.wait(120) for proc in procs], [0] * 4)
        self.assertEqual(self.db.get_compression_overload_streak("s"), 100)
        self.assertIsNone(self.db.increment_compression_overload_streak("gone"))
        self.db.set_compression_overload_streak("s", -2)
        self.assertEqual(self.db.get_compression_overload_streak("s"), 0)

    def test_the_recovery_deadline_is_stored_and_cleared_by_nothing_or_junk(self):
        self.assertEqual(self.db.get_compression_recovery_deadline("s"), 0.0)
        self.db.set_compression_recovery_deadline("s", 1800000000.5)
        with hermes_state.SessionDB(self.path) as other:  # another process's compressor reads it back
            self.assertEqual(other.get_compression_recovery_deadline("s"), 1800000000.5)
        for cleared in (0, None, "junk", -5):
            self.db.set_compression_recovery_deadline("s", 99.0)
            self.db.set_compression_recovery_deadline("s", cleared)
            self.assertEqual(self.rows("SELECT compression_recovery_deadline AS d FROM sessions"),
                             [{"d": None}], cleared)
        self.assertEqual(self.db.get_compression_recovery_deadline("gone"), 0.0)

    def test_the_streak_and_the_ineffective_count_are_stored_as_non_negative_integers(self):
        self.db.set_compression_fallback_streak("s", 3)
        self.db.set_compression_ineffective_count("s", 2.7)
        self.assertEqual((self.db.get_compression_fallback_streak("s"), self.db.get_compression_ineffective_count("s")),
                         (3, 2))
        self.db.set_compression_fallback_streak("s", -4)
        self.assertEqual(self.db.get_compression_fallback_streak("s"), 0)
        with self.assertRaises(ValueError):
            self.db.set_compression_ineffective_count("s", "x")
        self.assertEqual(self.db.get_compression_ineffective_count("s"), 2)
        self.sql("UPDATE sessions SET compression_fallback_streak = 'junk'")
        self.assertEqual(self.db.get_compression_fallback_streak("s"), 0)

    def test_an_orphaned_compression_parent_reopens_only_without_continuation_or_running_lease(self):
        for session_id in ("orphan", "forked", "continued", "leased", "stale"):
            self.db.create_session(session_id, "cli")
            self.db.end_session(session_id, "compression")
        self.db.create_session("branch", "cli", parent_session_id="forked", model_config={"_branched_from": "forked"})
        self.db.create_session("tool-child", "tool", parent_session_id="forked")
        self.db.create_session("live", "cli")
        self.db.create_session("next", "cli", parent_session_id="continued")
        self.db.end_session("next", "user_exit")
        self.sql("INSERT INTO compression_locks VALUES ('leased', 'h', 1, ?), ('stale', 'h', 1, 5)", (time.time() + 300,))
        reopened = {s: self.db.reopen_orphaned_compression_session(s)
                    for s in ("orphan", "forked", "continued", "leased", "stale", "live", "gone", "")}
        self.assertEqual(reopened, {"orphan": True, "forked": True, "continued": False, "leased": False,
                                    "stale": True, "live": False, "gone": False, "": False})
        self.assertEqual(self.rows("SELECT session_id FROM compression_locks"), [{"session_id": "leased"}])
        self.assertEqual(self.rows("SELECT id FROM sessions WHERE end_reason = 'compression' ORDER BY id"),
                         [{"id": "continued"}, {"id": "leased"}])
