"""Telegram DM topic mode: opt-in tables, bindings, and reads that never create anything."""

import sqlite3

from test_support import StoreTestCase

TABLES = ("telegram_dm_topic_mode", "telegram_dm_topic_bindings")


class TopicMode(StoreTestCase):

    def tables(self):
        names = {row[0] for row in self.raw(self.path).execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return [name for name in TABLES if name in names]

    def test_reads_answer_empty_and_create_nothing_before_the_opt_in(self):
        self.assertFalse(self.db.is_telegram_topic_mode_enabled(chat_id="1", user_id="2"))
        self.assertIsNone(self.db.get_telegram_topic_binding(chat_id="1", thread_id="9"))
        self.assertIsNone(self.db.get_telegram_topic_binding_by_session(session_id="s"))
        self.assertFalse(self.db.is_telegram_session_linked_to_topic(session_id="s"))
        self.assertEqual(self.db.list_telegram_topic_bindings_for_chat(chat_id="1"), [])
        self.assertEqual(self.db.delete_telegram_topic_binding(chat_id="1", thread_id="9"), 0)
        self.db.disable_telegram_topic_mode(chat_id="1")
        self.assertEqual(self.tables(), [])

    def test_enable_creates_the_tables_and_turns_the_chat_on(self):
        self.db.enable_telegram_topic_mode(chat_id=1, user_id=2, has_topics_enabled=True)
        self.assertEqual(self.tables(), list(TABLES))
        self.assertTrue(self.db.is_telegram_topic_mode_enabled(chat_id="1", user_id="2"))
        self.assertFalse(self.db.is_telegram_topic_mode_enabled(chat_id="1", user_id="3"))
        row = self.raw(self.path).execute("SELECT * FROM telegram_dm_topic_mode").fetchone()
        self.assertEqual((row["chat_id"], row["has_topics_enabled"], row["allows_users_to_create_topics"]),
                         ("1", 1, None))
        self.assertEqual(self.db.get_meta("telegram_dm_topic_schema_version"), "3")
        self.assertEqual(row["profile_name"], "default")

    def test_a_session_binds_to_one_thread_only(self):
        for sid in ("s1", "s2"):
            self.db.create_session(sid, "telegram")
        self.db.bind_telegram_topic(chat_id=1, thread_id=10, user_id=2, session_key="k1", session_id="s1")
        self.db.bind_telegram_topic(chat_id=1, thread_id=10, user_id=2, session_key="k1b", session_id="s1")
        with self.assertRaisesRegex(ValueError, "already linked to another Telegram topic"):
            self.db.bind_telegram_topic(chat_id=1, thread_id=11, user_id=2, session_key="k", session_id="s1")
        self.db.bind_telegram_topic(chat_id=1, thread_id=11, user_id=2, session_key="k2", session_id="s2")
        binding = self.db.get_telegram_topic_binding(chat_id="1", thread_id="10")
        self.assertEqual((binding["session_id"], binding["session_key"], binding["managed_mode"]), ("s1", "k1b", "auto"))
        self.assertEqual(self.db.get_telegram_topic_binding_by_session(session_id="s2")["thread_id"], "11")
        self.assertTrue(self.db.is_telegram_session_linked_to_topic(session_id="s1"))
        self.assertEqual(len(self.db.list_telegram_topic_bindings_for_chat(chat_id=1)), 2)

    def test_unlinked_sessions_are_the_users_telegram_rows_without_a_topic_newest_first(self):
        for sid, source, user in (("old", "telegram", "2"), ("new", "telegram", "2"), ("cli", "cli", "2"),
                                  ("other", "telegram", "3")):
            self.db.create_session(sid, source, user_id=user)
        self.db.append_message("old", "user", "first\nturn", timestamp=5)
        self.db.append_message("new", "user", "later", timestamp=9)
        unlinked = self.db.list_unlinked_telegram_sessions_for_user
        rows = unlinked(chat_id="1", user_id=2)
        self.assertEqual([(r["id"], r["preview"], r["last_active"]) for r in rows], [("new", "later", 9),
                                                                                     ("old", "first turn", 5)])
        self.assertEqual(self.tables(), [])
        self.db.bind_telegram_topic(chat_id=1, thread_id=10, user_id=2, session_key="k", session_id="new")
        self.assertEqual([r["id"] for r in unlinked(chat_id="1", user_id="2", limit=5)], ["old"])
        self.assertEqual(unlinked(chat_id="1", user_id="2", limit=0), [])

    def test_deleting_the_last_binding_turns_the_chat_off(self):
        self.db.create_session("s1", "telegram")
        self.db.create_session("s2", "telegram")
        self.db.enable_telegram_topic_mode(chat_id="1", user_id="2")
        self.db.bind_telegram_topic(chat_id=1, thread_id=10, user_id=2, session_key="k", session_id="s1")
        self.db.bind_telegram_topic(chat_id=1, thread_id=11, user_id=2, session_key="k", session_id="s2")
        self.assertEqual(self.db.delete_telegram_topic_binding(chat_id=1, thread_id=10), 1)
        self.assertTrue(self.db.is_telegram_topic_mode_enabled(chat_id="1", user_id="2"))
        self.assertEqual(self.db.delete_telegram_topic_binding(chat_id=1, thread_id=11), 1)
        self.assertFalse(self.db.is_telegram_topic_mode_enabled(chat_id="1", user_id="2"))

    def test_disable_clears_bindings_unless_asked_to_keep_them(self):
        self.db.create_session("s1", "telegram")
        self.db.enable_telegram_topic_mode(chat_id="1", user_id="2")
        self.db.bind_telegram_topic(chat_id=1, thread_id=10, user_id=2, session_key="k", session_id="s1")
        self.db.disable_telegram_topic_mode(chat_id="1", clear_bindings=False)
        self.assertFalse(self.db.is_telegram_topic_mode_enabled(chat_id="1", user_id="2"))
        self.assertTrue(self.db.is_telegram_session_linked_to_topic(session_id="s1"))
        self.db.disable_telegram_topic_mode(chat_id="1")
        self.assertFalse(self.db.is_telegram_session_linked_to_topic(session_id="s1"))

    def test_an_early_bindings_table_gets_its_cascade_and_keeps_its_rows(self):
        self.db.create_session("s1", "telegram")
        conn = self.raw(self.path)
        conn.execute("""CREATE TABLE telegram_dm_topic_bindings (chat_id TEXT NOT NULL, thread_id TEXT NOT NULL,
            user_id TEXT NOT NULL, session_key TEXT NOT NULL, session_id TEXT NOT NULL REFERENCES sessions(id),
            managed_mode TEXT NOT NULL DEFAULT 'auto', linked_at REAL NOT NULL, updated_at REAL NOT NULL,
            PRIMARY KEY (chat_id, thread_id))""")
        conn.execute("INSERT INTO telegram_dm_topic_bindings VALUES ('1', '10', '2', 'k', 's1', 'auto', 1, 1)")
        conn.execute("INSERT INTO telegram_dm_topic_bindings VALUES ('1', '12', '2', 'k', 'gone', 'auto', 1, 1)")
        conn.commit()
        self.db.apply_telegram_topic_migration()
        keys = conn.execute("PRAGMA foreign_key_list(telegram_dm_topic_bindings)").fetchall()
        self.assertEqual([key[6] for key in keys], ["CASCADE"])
        binding = self.db.get_telegram_topic_binding(chat_id="1", thread_id="10")
        self.assertEqual((binding["session_id"], binding["profile_name"]), ("s1", "default"))
        self.assertIsNone(self.db.get_telegram_topic_binding(chat_id="1", thread_id="12"))
        with self.assertRaises(sqlite3.IntegrityError):
            conn.execute("INSERT INTO telegram_dm_topic_bindings VALUES ('default', '1', '11', '2', 'k', 's1', 'auto', 1, 1)")


class TopicProfiles(StoreTestCase):
    """Bots of several profiles share one store: each profile's topic rows are its own."""

    def setUp(self):
        super().setUp()
        for sid, profile in (("a", None), ("b", "work"), ("c", "")):
            self.db.create_session(sid, "telegram", user_id="2", profile_name=profile)

    def test_one_profiles_mode_and_bindings_do_not_leak_into_another(self):
        self.db.enable_telegram_topic_mode(chat_id="1", user_id="2", profile_name="work")
        self.assertTrue(self.db.is_telegram_topic_mode_enabled(chat_id="1", user_id="2", profile_name="work"))
        self.assertFalse(self.db.is_telegram_topic_mode_enabled(chat_id="1", user_id="2"))
        self.db.bind_telegram_topic(chat_id=1, thread_id=10, user_id=2, session_key="k", session_id="a",
                                    profile_name="work")
        self.db.bind_telegram_topic(chat_id=1, thread_id=10, user_id=2, session_key="k", session_id="b")
        work = self.db.get_telegram_topic_binding(chat_id="1", thread_id="10", profile_name="work")
        default = self.db.get_telegram_topic_binding(chat_id="1", thread_id="10", profile_name="  ")
        self.assertEqual((work["session_id"], default["session_id"]), ("a", "b"))
        self.assertEqual([r["session_id"] for r in self.db.list_telegram_topic_bindings_for_chat(
            chat_id=1, profile_name="work")], ["a"])
        with self.assertRaisesRegex(ValueError, "already linked"):
            self.db.bind_telegram_topic(chat_id=1, thread_id=10, user_id=2, session_key="k", session_id="a")
        self.db.disable_telegram_topic_mode(chat_id=1)
        self.assertTrue(self.db.is_telegram_topic_mode_enabled(chat_id="1", user_id="2", profile_name="work"))
        self.assertIsNotNone(self.db.get_telegram_topic_binding(chat_id="1", thread_id="10", profile_name="work"))
        self.assertEqual(self.db.delete_telegram_topic_binding(chat_id=1, thread_id=10), 0)
        self.assertEqual(self.db.delete_telegram_topic_binding(chat_id=1, thread_id=10, profile_name="work"), 1)
        self.assertFalse(self.db.is_telegram_topic_mode_enabled(chat_id="1", user_id="2", profile_name="work"))

    def test_unlinked_sessions_are_the_profiles_own(self):
        self.db.bind_telegram_topic(chat_id=1, thread_id=10, user_id=2, session_key="k", session_id="c")
        unlinked = self.db.list_unlinked_telegram_sessions_for_user
        self.assertEqual([r["id"] for r in unlinked(chat_id="1", user_id="2")], ["a"])
        self.assertEqual([r["id"] for r in unlinked(chat_id="1", user_id="2", profile_name="work")], ["b"])

    def test_a_read_migrates_tables_an_upgrade_left_without_profiles(self):
        conn = self.raw(self.path)
        conn.execute("""CREATE TABLE telegram_dm_topic_mode (chat_id TEXT PRIMARY KEY, user_id TEXT NOT NULL,
            enabled INTEGER NOT NULL DEFAULT 1, activated_at REAL NOT NULL, updated_at REAL NOT NULL,
            has_topics_enabled INTEGER, allows_users_to_create_topics INTEGER, capability_checked_at REAL,
            intro_message_id TEXT, pinned_message_id TEXT)""")
        conn.execute("INSERT INTO telegram_dm_topic_mode (chat_id, user_id, activated_at, updated_at)"
                     " VALUES ('1', '2', 1, 1)")
        conn.commit()
        self.assertTrue(self.db.is_telegram_topic_mode_enabled(chat_id="1", user_id="2"))
        self.assertEqual(conn.execute("SELECT profile_name FROM telegram_dm_topic_mode").fetchall()[0][0], "default")
        self.assertEqual(self.db.get_meta("telegram_dm_topic_schema_version"), "3")

    def test_repair_moves_default_rows_to_the_profile_their_key_names(self):
        self.db.enable_telegram_topic_mode(chat_id="1", user_id="2")
        self.db.enable_telegram_topic_mode(chat_id="5", user_id="2")
        self.db.enable_telegram_topic_mode(chat_id="5", user_id="2", profile_name="main")
        self.db.bind_telegram_topic(chat_id=1, thread_id=10, user_id=2, session_key="agent:work:tg:1",
                                    session_id="a")
        self.db.bind_telegram_topic(chat_id=5, thread_id=10, user_id=2, session_key="agent:main~:tg:5",
                                    session_id="b")
        self.db.bind_telegram_topic(chat_id=1, thread_id=11, user_id=2, session_key="agent:main:tg:1",
                                    session_id="c")
        found = self.db.find_profile_less_telegram_topic_rows()
        self.assertEqual(found, [
            {"chat_id": "1", "thread_id": "10", "session_key": "agent:work:tg:1", "key_profile": "work"},
            {"chat_id": "5", "thread_id": "10", "session_key": "agent:main~:tg:5", "key_profile": "main"}])
        counts = self.db.relabel_telegram_topic_rows(found)
        self.assertEqual(counts, {"bindings_relabelled": 2, "bindings_duplicates_removed": 0,
                                  "mode_rows_relabelled": 1})
        self.assertEqual(self.db.get_telegram_topic_binding(chat_id=1, thread_id=10, profile_name="work")["session_id"],
                         "a")
        self.assertTrue(self.db.is_telegram_topic_mode_enabled(chat_id="1", user_id="2", profile_name="work"))
        self.assertTrue(self.db.is_telegram_topic_mode_enabled(chat_id="5", user_id="2"))
        self.assertEqual(self.db.find_profile_less_telegram_topic_rows(), [])
        self.assertEqual(self.db.relabel_telegram_topic_rows([]), dict.fromkeys(counts, 0))

    def test_repair_drops_a_default_row_the_profile_already_holds(self):
        self.db.bind_telegram_topic(chat_id=1, thread_id=10, user_id=2, session_key="agent:work:x", session_id="a",
                                    profile_name="work")
        self.db.bind_telegram_topic(chat_id=1, thread_id=10, user_id=2, session_key="agent:work:x", session_id="b")
        counts = self.db.relabel_telegram_topic_rows(self.db.find_profile_less_telegram_topic_rows())
        self.assertEqual(counts["bindings_duplicates_removed"], 1)
        self.assertIsNone(self.db.get_telegram_topic_binding(chat_id=1, thread_id=10))
