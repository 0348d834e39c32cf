"""Profile identity in one store: the key rules, finding crossed rows, settling them, moving a session
between two stores, and renaming or purging a profile."""

import json

from hermes_state import SessionDB
from hermes_state_profile_repair import profile_key_prefix, session_key_profile
from test_support import StoreTestCase

DB = SessionDB

TOPIC_TABLES = """
CREATE TABLE IF NOT EXISTS telegram_dm_topic_mode (profile_name TEXT, chat_id TEXT, enabled INTEGER);
CREATE TABLE IF NOT EXISTS telegram_dm_topic_bindings (profile_name TEXT, chat_id TEXT, thread_id TEXT,
    session_key TEXT, session_id TEXT);
CREATE TABLE IF NOT EXISTS delivery_obligations (id INTEGER PRIMARY KEY, session_key TEXT, adapter_profile TEXT,
    state TEXT, updated_at REAL);
"""


class ProfileStoreTestCase(StoreTestCase):

    def setUp(self):
        super().setUp()
        self.db.close()
        self.db = DB(self.path)
        self.addCleanup(self.db.close)

    def sql(self, statement, params=()):
        conn = self.raw(self.path)
        conn.executescript(statement) if params is None else conn.execute(statement, params)
        conn.commit()

    def rows(self, sql, params=()):
        return [tuple(row) for row in self.raw(self.path).execute(sql, params)]

    def keyed(self, session_id, key, profile=None, parent=None, **kwargs):
        self.db.create_session(session_id, "telegram", session_key=key, profile_name=profile,
                               parent_session_id=parent, **kwargs)


class KeyRules(ProfileStoreTestCase):

    def test_a_key_names_its_profile_main_being_the_default(self):
        cases = {"agent:main:telegram:dm:1": "default", "agent:main~:x:y": "main", "agent:work:x:y": "work",
                 "agent:work": None, "agent::x:y": None, "room:1:2": None, None: None, 7: None}
        for key, profile in cases.items():
            self.assertEqual(session_key_profile(key), profile, key)
        for profile in ("default", "main", "work", None):
            self.assertEqual(session_key_profile(profile_key_prefix(profile) + "x:y"), profile or "default")


class Finding(ProfileStoreTestCase):

    def test_mislabelled_foreign_and_crossed_parent_rows(self):
        self.keyed("ok", "agent:work:tg:dm:1", "work")
        self.keyed("unlabelled", "agent:work:tg:dm:2")
        self.keyed("wrong", "agent:work:tg:dm:3", "default")
        self.keyed("other", "agent:main:tg:dm:4", "default")
        self.keyed("crossed", "agent:work:tg:dm:5", "work", parent="other")
        self.db.create_session("cli", "cli", profile_name="nobody")
        found = self.db.find_crossed_profile_sessions("work")
        self.assertEqual(found["mislabelled"], [{"id": "wrong", "session_key": "agent:work:tg:dm:3",
                                                 "profile_name": "default", "key_profile": "work"}])
        self.assertEqual(found["foreign"], [{"id": "other", "session_key": "agent:main:tg:dm:4",
                                             "key_profile": "default", "message_count": 0}])
        self.assertEqual(found["crossed_parents"], [{"id": "crossed", "key_profile": "work",
                                                     "parent_session_id": "other", "parent_profile": "default"}])

    def test_chat_evidence_and_message_counts(self):
        self.db.create_session("a", "telegram", session_key="agent:work:tg:dm:1", chat_id="1")
        self.db.create_session("b", "telegram", session_key="agent:main:tg:dm:1", chat_id="1")
        self.db.create_session("c", "slack", session_key="agent:ops:tg:dm:1", chat_id="1")
        self.assertEqual(self.db.key_profiles_for_chat("telegram", 1), {"work", "default"})
        self.db.append_message("a", "user", "x")
        self.db.append_message("a", "user", "y")
        self.assertEqual((self.db.count_messages_all("a"), self.db.count_messages_all("b")), (2, 0))


class Settling(ProfileStoreTestCase):

    def test_relabel_takes_the_profile_from_the_key_read_in_the_write(self):
        self.keyed("wrong", "agent:work:tg:dm:3", "default")
        self.keyed("right", "agent:work:tg:dm:4", "work")
        self.db.create_session("plain", "cli", profile_name="x")
        self.assertEqual(self.db.relabel_sessions_to_key_profile(["wrong", "right", "plain", "nope"]), 1)
        self.assertEqual(self.db.get_session("wrong")["profile_name"], "work")
        self.assertEqual(self.db.relabel_sessions_to_key_profile([]), 0)

    def test_sever_clears_only_parents_of_another_profile(self):
        self.keyed("p_main", "agent:main:tg:dm:1")
        self.keyed("p_work", "agent:work:tg:dm:2")
        self.keyed("crossed", "agent:work:tg:dm:3", parent="p_main")
        self.keyed("same", "agent:work:tg:dm:4", parent="p_work")
        self.assertEqual(self.db.sever_crossed_parents(["crossed", "same"]), 1)
        self.assertIsNone(self.db.get_session("crossed")["parent_session_id"])
        self.assertEqual(self.db.get_session("same")["parent_session_id"], "p_work")
        self.assertEqual(self.db.get_session("crossed")["profile_name"], None)

    def test_legacy_main_keys_move_to_the_profile(self):
        self.keyed("legacy", "agent:main:tg:dm:1")
        self.keyed("done", "agent:work:tg:dm:2")
        self.assertEqual(self.db.rekey_legacy_main_sessions(["legacy", "done"], "work"), 1)
        row = self.db.get_session("legacy")
        self.assertEqual((row["session_key"], row["profile_name"]), ("agent:work:tg:dm:1", "work"))
        self.keyed("legacy2", "agent:main:tg:dm:5")
        self.db.rekey_legacy_main_sessions(["legacy2"], "main")
        self.assertEqual(self.db.get_session("legacy2")["session_key"], "agent:main~:tg:dm:5")

    def test_routing_rows_are_adopted_only_where_absent_and_deleted_by_key(self):
        self.db.save_gateway_routing_entry("agent:work:a", '{"x": 1}')
        added = self.db.insert_gateway_routing_rows_if_absent(
            [("", "agent:work:a", '{"x": 2}', 1.0), ("", "agent:work:b", '{"x": 3}', 2.0)])
        self.assertEqual(added, 1)
        rows = self.db.list_gateway_routing_rows()
        self.assertEqual([(r["session_key"], r["entry_json"]) for r in rows],
                         [("agent:work:a", '{"x": 1}'), ("agent:work:b", '{"x": 3}')])
        self.assertEqual(self.db.delete_gateway_routing_rows([("", "agent:work:a"), ("", "nope")]), 1)
        self.assertEqual(self.db.delete_gateway_routing_rows([]), 0)

    def test_topic_bindings_labelled_default_take_their_keys_profile(self):
        self.assertEqual(self.db.find_profile_less_telegram_topic_rows(), [])  # no profile column here
        self.sql("DROP TABLE IF EXISTS telegram_dm_topic_bindings; DROP TABLE IF EXISTS telegram_dm_topic_mode;"
                 + TOPIC_TABLES, None)
        self.sql("INSERT INTO telegram_dm_topic_bindings VALUES ('default', '1', '10', 'agent:work:x:1', 's1'),"
                 " ('default', '1', '11', 'agent:work:x:2', 's2'), ('work', '1', '11', 'agent:work:x:2', 's2'),"
                 " ('default', '2', '12', 'agent:main:x:3', 's3')")
        self.sql("INSERT INTO telegram_dm_topic_mode VALUES ('default', '1', 1)")
        found = self.db.find_profile_less_telegram_topic_rows()
        self.assertEqual([(r["thread_id"], r["key_profile"]) for r in found], [("10", "work"), ("11", "work")])
        counts = self.db.relabel_telegram_topic_rows(found)
        self.assertEqual(counts, {"bindings_relabelled": 1, "bindings_duplicates_removed": 1,
                                  "mode_rows_relabelled": 1})
        self.assertEqual(sorted(self.rows("SELECT profile_name, thread_id FROM telegram_dm_topic_bindings")),
                         [("default", "12"), ("work", "10"), ("work", "11")])
        self.assertEqual(self.rows("SELECT profile_name FROM telegram_dm_topic_mode"), [("work",)])


class Moving(ProfileStoreTestCase):

    def test_a_session_moves_whole_and_only_once(self):
        self.keyed("parent", "agent:main:tg:dm:1")
        self.keyed("s", "agent:work:tg:dm:2", "default", parent="parent", system_prompt="be brief")
        self.db.set_session_title("s", "Trip")
        self.db.append_message("s", "user", "hello")
        self.db.append_message("s", "assistant", "hi")
        self.db.update_token_counts("s", input_tokens=5, model="m")
        payload = self.db.export_session_for_move("s")
        self.assertEqual((payload["system_prompt"], len(payload["messages"]), len(payload["usage"])),
                         ("be brief", 2, 1))
        self.assertIsNone(self.db.export_session_for_move("nope"))
        target = DB(self.tmp / "work.db")
        self.addCleanup(target.close)
        target.create_session("x", "cli")
        target.set_session_title("x", "Trip")
        payload = json.loads(json.dumps(payload))  # it crosses as plain data
        self.assertEqual(target.import_moved_session(payload, profile_name="work"), "imported")
        self.assertEqual(target.import_moved_session(payload, profile_name="work"), "present")
        moved = target.get_session("s")
        self.assertEqual((moved["profile_name"], moved["parent_session_id"], moved["system_prompt"]),
                         ("work", None, "be brief"))
        self.assertEqual(moved["title"], "Trip (s)")
        self.assertEqual([m["content"] for m in target.get_messages("s")], ["hello", "hi"])
        identity = "SELECT message_uid, display_identity FROM messages WHERE session_id = 's' ORDER BY id"
        # The same messages (uids) with the display identities they had, worked out again there.
        self.assertEqual([tuple(r) for r in self.raw(target.db_path).execute(identity)],
                         [tuple(r) for r in self.raw(self.db.db_path).execute(identity)])
        self.assertEqual(target.count_messages_all("s"), self.db.count_messages_all("s"))
        self.assertEqual(len(target.search_messages("hello")), 1)
        self.assertTrue(self.db.delete_moved_session("s"))
        self.assertFalse(self.db.delete_moved_session("s"))
        self.assertEqual(self.rows("SELECT COUNT(*) FROM messages"), [(0,)])
        self.assertIsNotNone(self.db.get_session("parent"))


class RenameAndPurge(ProfileStoreTestCase):

    def setUp(self):
        super().setUp()
        self.sql(TOPIC_TABLES, None)
        self.keyed("s", "agent:old:tg:dm:1", "old", origin_json=json.dumps({"profile": "old", "x": 1}))
        self.keyed("t", "agent:oldest:tg:dm:1", "oldest")
        self.db.save_gateway_routing_entry(
            "agent:old:tg:dm:1", json.dumps({"session_key": "agent:old:tg:dm:1", "origin": {"profile": "old"}}))
        self.sql("INSERT INTO gateway_heartbeats (backend_id, pid, profile, started_at, last_heartbeat)"
                 " VALUES ('b', 1, 'old', 0, 0)")
        self.sql("INSERT INTO delivery_obligations (session_key, adapter_profile, state, updated_at) VALUES"
                 " ('agent:old:tg:dm:1', NULL, 'pending', 0), ('agent:old:tg:dm:1', NULL, 'delivered', 0)")
        self.sql("INSERT INTO telegram_dm_topic_bindings VALUES ('old', '1', '10', 'agent:old:x', 's')")
        self.sql("INSERT INTO telegram_dm_topic_mode VALUES ('old', '1', 1)")

    def test_rename_moves_every_trace_of_the_old_name(self):
        counts = self.db.rekey_profile_state("old", "new")
        self.assertEqual(counts["sessions_profile_name"], 1)
        self.assertEqual(counts["sessions_session_key"], 1)
        self.assertEqual(counts["gateway_routing"], 1)
        self.assertEqual(counts["sessions_origin_json"], 1)
        row = self.db.get_session("s")
        self.assertEqual((row["session_key"], row["profile_name"], json.loads(row["origin_json"])),
                         ("agent:new:tg:dm:1", "new", {"profile": "new", "x": 1}))
        self.assertEqual(self.db.get_session("t")["session_key"], "agent:oldest:tg:dm:1")
        entry = self.db.list_gateway_routing_rows()[0]
        self.assertEqual((entry["session_key"], json.loads(entry["entry_json"])),
                         ("agent:new:tg:dm:1", {"session_key": "agent:new:tg:dm:1", "origin": {"profile": "new"}}))
        self.assertEqual(self.rows("SELECT profile FROM gateway_heartbeats"), [("new",)])
        self.assertEqual(self.rows("SELECT session_key FROM delivery_obligations"), [("agent:new:tg:dm:1",)] * 2)
        self.assertEqual(self.rows("SELECT profile_name, session_key FROM telegram_dm_topic_bindings"),
                         [("new", "agent:new:x")])
        self.assertEqual(self.db.rekey_profile_state("new", "new"), {})
        self.assertEqual(self.db.rekey_profile_state(" ", "x"), {})

    def test_a_rename_onto_taken_keys_changes_nothing(self):
        self.db.save_gateway_routing_entry("agent:new:tg:dm:1", "{}")
        with self.assertRaisesRegex(ValueError, "routing collision"):
            self.db.rekey_profile_state("old", "new")
        self.assertEqual(self.db.get_session("s")["profile_name"], "old")
        self.db.delete_gateway_routing_rows([("", "agent:new:tg:dm:1")])
        self.sql("INSERT INTO telegram_dm_topic_mode VALUES ('new', '1', 0)")
        with self.assertRaisesRegex(ValueError, "collision in telegram_dm_topic_mode"):
            self.db.rekey_profile_state("old", "new")

    def test_purge_forgets_the_name_and_keeps_the_sessions(self):
        counts = self.db.purge_profile_state("old")
        self.assertEqual(counts, {"gateway_routing": 1, "gateway_heartbeats": 1, "delivery_obligations": 1,
                                  "telegram_dm_topic_mode": 1, "telegram_dm_topic_bindings": 1})
        self.assertEqual(sorted(self.rows("SELECT state FROM delivery_obligations")), [("abandoned",), ("delivered",)])
        self.assertEqual(self.db.get_session("s")["profile_name"], "old")
        self.assertEqual(self.db.purge_profile_state("old")["gateway_routing"], 0)
        self.assertEqual(self.db.purge_profile_state(""), {})

    def test_a_store_without_the_side_tables_is_renamed_and_purged_too(self):
        self.sql("DROP TABLE gateway_heartbeats; DROP TABLE delivery_obligations;"
                 " DROP TABLE telegram_dm_topic_mode; DROP TABLE telegram_dm_topic_bindings;", None)
        self.assertEqual(self.db.purge_profile_state("nobody"), {"gateway_routing": 0})
        counts = self.db.rekey_profile_state("old", "new")
        self.assertNotIn("gateway_heartbeats_profile", counts)
        self.assertEqual(self.db.get_session("s")["profile_name"], "new")


if __name__ == "__main__":
    import unittest
    unittest.main()
