"""Titles: sanitising, uniqueness, who set them, and lookups by title."""

from hermes_state import SessionDB
from test_support import StoreTestCase, backdate


class SanitizeTitle(StoreTestCase):

    def test_invisible_and_control_characters_go_and_whitespace_collapses(self):
        cases = {
            "  Fix\tthe\n build  ": "Fix the build",
            "a\u200bb\u200fc\ufeffd": "abcd",
            "left\u202eright\u2066iso\u2069": "leftrightiso",
            "\x00bell\x07del\x7f": "belldel",
            "line\u2028para\u2029end": "lineparaend",
            "obj\ufffcnote\ufff9": "objnote",
            "no\u00a0break\u3000wide": "no break wide",
            "lone \ud800 surrogate": "lone \ufffd surrogate",
            "数据库迁移": "数据库迁移",
        }
        for raw, clean in cases.items():
            with self.subTest(raw=raw):
                self.assertEqual(SessionDB.sanitize_title(raw), clean)

    def test_nothing_left_means_no_title(self):
        for raw in (None, "", "   ", "\u200b\u200c", "\x00\t\n", 0):
            with self.subTest(raw=raw):
                self.assertIsNone(self.db.sanitize_title(raw))

    def test_the_limit_counts_the_cleaned_title(self):
        self.assertEqual(SessionDB.MAX_TITLE_LENGTH, 100)
        self.assertEqual(SessionDB.sanitize_title("  " + "t" * 100 + "\u200b "), "t" * 100)
        with self.assertRaisesRegex(ValueError, r"^Title too long \(101 chars, max 100\)$"):
            SessionDB.sanitize_title("t" * 101)

    def test_a_title_that_is_not_text_is_a_typeerror(self):
        for raw in (5, b"bytes", ["x"]):
            with self.subTest(raw=raw), self.assertRaises(TypeError):
                SessionDB.sanitize_title(raw)


class SetTitle(StoreTestCase):

    def setUp(self):
        super().setUp()
        for session_id in ("a", "b"):
            self.db.create_session(session_id, "cli")

    def titles(self):
        return [tuple(r) for r in self.raw(self.path).execute("SELECT id, title, title_source FROM sessions ORDER BY id")]

    def test_set_session_title_stores_the_sanitised_title_as_the_users(self):
        self.assertTrue(self.db.set_session_title("a", " My\u200b   title "))
        self.assertEqual(self.db.get_session_title("a"), "My title")
        self.assertEqual(self.db.get_session_title_source("a"), SessionDB.TITLE_SOURCE_USER)
        self.assertFalse(self.db.set_session_title("missing", "x"))
        self.assertIsNone(self.db.get_session_title("missing"))

    def test_a_blank_title_clears_title_and_source(self):
        self.db.set_session_title("a", "Something")
        self.assertTrue(self.db.set_session_title("a", " \u200b "))
        self.assertEqual(self.titles()[0], ("a", None, None))
        self.assertIsNone(self.db.get_session_title_source("a"))

    def test_a_title_in_use_raises_the_reference_error_and_writes_nothing(self):
        self.db.set_session_title("a", "Shared")
        self.db.set_session_title("b", "Mine")
        with self.assertRaisesRegex(ValueError, r"^Title 'Shared' is already in use by session a$"):
            self.db.set_session_title("b", "  Shared ")
        with self.assertRaisesRegex(ValueError, "Title too long"):
            self.db.set_session_title("b", "x" * 101)
        with self.assertRaises(TypeError):
            self.db.set_session_title("b", 42)
        self.assertEqual(self.titles(), [("a", "Shared", "user"), ("b", "Mine", "user")])

    def test_automatic_titles_only_replace_titles_of_lower_authority(self):
        self.assertTrue(self.db.set_auto_title("a", "derived words", source="derived"))
        self.assertEqual(self.db.get_session_title_source("a"), "derived")
        self.assertTrue(self.db.set_auto_title("a", "Model title", source="llm"))
        self.assertFalse(self.db.set_auto_title("a", "Second model title", source="llm"))
        self.assertFalse(self.db.set_auto_title("a", "derived again", source="derived"))
        self.db.set_session_title("b", "Typed by me")
        self.assertFalse(self.db.set_auto_title_if_empty("b", "Model title 2"))
        self.assertFalse(self.db.set_auto_title("missing", "x", source="llm"))
        self.assertEqual(self.titles(), [("a", "Model title", "llm"), ("b", "Typed by me", "user")])
        with self.assertRaisesRegex(ValueError, "invalid automatic title source: 'user'"):
            self.db.set_auto_title("a", "x", source="user")

    def test_a_title_older_than_provenance_counts_as_the_users(self):
        self.raw(self.path).execute("UPDATE sessions SET title = 'legacy' WHERE id = 'a'").connection.commit()
        self.assertIsNone(self.db.get_session_title_source("a"))
        self.assertFalse(self.db.set_auto_title_if_empty("a", "generated"))
        self.assertTrue(self.db.set_auto_title_if_empty("b", "generated"))
        self.assertEqual(self.db.get_session_title_source("b"), "llm")

    def test_the_source_can_be_carried_over_without_touching_the_title(self):
        self.db.set_session_title("a", "Carried")
        self.assertTrue(self.db.set_session_title_source("a", "llm"))
        self.assertEqual((self.db.get_session_title("a"), self.db.get_session_title_source("a")), ("Carried", "llm"))
        self.assertFalse(self.db.set_session_title_source("b", "llm"))  # untitled
        self.assertFalse(self.db.set_session_title_source("missing", "llm"))
        with self.assertRaisesRegex(ValueError, "invalid title source: 'robot'"):
            self.db.set_session_title_source("a", "robot")
        self.assertEqual(self.db.get_session_title_source("a"), "llm")

    def test_a_compression_continuation_takes_the_title_from_its_ancestor(self):
        self.db.set_session_title("a", "Long chat")
        self.db.end_session("a", "compression")
        self.db.create_session("a2", "cli", parent_session_id="a")
        self.db.end_session("a2", "compression")
        self.db.create_session("a3", "cli", parent_session_id="a2")
        self.assertTrue(self.db.set_session_title("a3", "Long chat"))
        self.assertEqual([t[:2] for t in self.titles()], [("a", None), ("a2", None), ("a3", "Long chat"), ("b", None)])
        self.db.create_session("branch", "cli", parent_session_id="b")
        self.db.set_session_title("b", "Parent not compressed")
        with self.assertRaisesRegex(ValueError, "already in use by session b"):
            self.db.set_session_title("branch", "Parent not compressed")


class TitleLookups(StoreTestCase):

    def setUp(self):
        super().setUp()
        for number, (session_id, title) in enumerate([("p1", "proj"), ("p2", "proj #2"), ("p10", "proj #10"),
                                                      ("wild", "pro_j"), ("pct", "50% off")]):
            self.db.create_session(session_id, "cli")
            backdate(self.db, session_id, 1000.0 + number)
            self.db.set_session_title(session_id, title)

    def test_resolve_prefers_the_newest_numbered_continuation(self):
        self.assertEqual(self.db.resolve_session_by_title("proj"), "p10")
        self.assertEqual(self.db.resolve_session_by_title("proj #2"), "p2")
        self.assertEqual(self.db.resolve_session_by_title("pro_j"), "wild")
        self.assertEqual(self.db.resolve_session_by_title("50% off"), "pct")
        self.assertIsNone(self.db.resolve_session_by_title("pr%"))  # wildcards match literally
        self.assertIsNone(self.db.resolve_session_by_title("nothing"))

    def test_the_next_title_in_a_lineage_counts_past_the_highest_number(self):
        self.assertEqual(self.db.get_next_title_in_lineage("proj"), "proj #11")
        self.assertEqual(self.db.get_next_title_in_lineage("proj #2"), "proj #11")
        self.assertEqual(self.db.get_next_title_in_lineage("pro_j"), "pro_j #2")
        self.assertEqual(self.db.get_next_title_in_lineage("fresh #4"), "fresh")
        self.assertEqual(self.db.get_next_title_in_lineage("fresh"), "fresh")

    def test_get_session_by_title_matches_the_stored_title_exactly(self):
        session = self.db.get_session_by_title("proj #2")
        self.assertEqual((session["id"], session["title"], session["title_source"]), ("p2", "proj #2", "user"))
        self.assertEqual(session, self.db.get_session("p2"))
        self.assertIsNone(self.db.get_session_by_title(" proj #2 "))
        self.assertIsNone(self.db.get_session_by_title("PROJ"))


class TitleConflicts(StoreTestCase):
    """The one uniqueness rule (_resolve_title_conflict), as renames and 0.22's API server use it."""

    def test_an_abandoned_empty_chat_gives_its_title_up_and_a_live_one_does_not(self):
        self.db.create_session("ghost", "cli")
        self.db.set_session_title("ghost", "Plan")
        self.db.end_session("ghost", "user_exit")
        self.db.create_session("live", "cli")
        self.db.set_session_title("live", "Talk")
        self.db.append_message("live", "user", "x")
        self.db.end_session("live", "user_exit")
        self.db.create_session("new", "cli")
        self.assertTrue(self.db.set_session_title("new", "Plan"))
        self.assertEqual(self.db.get_session_title("ghost"), None)
        self.assertEqual(self.db.get_session_title_source("ghost"), None)
        with self.assertRaisesRegex(ValueError, "already in use by session live"):
            self.db.set_session_title("new", "Talk")

    def test_a_hidden_or_open_empty_session_keeps_its_title(self):
        for sid in ("hidden", "open"):
            self.db.create_session(sid, "cli")
            self.db.set_session_title(sid, sid.title())
        self.db.end_session("hidden", "user_exit")
        self.db.set_session_hidden("hidden", True)
        self.db.create_session("new", "cli")
        for title in ("Hidden", "Open"):
            with self.assertRaises(ValueError):
                self.db.set_session_title("new", title)

    def test_a_retired_bot_chat_releases_its_name(self):
        self.db.create_session("old_bot", "api_server")
        self.db.set_session_title("old_bot", "Bot Chat")
        self.db.append_message("old_bot", "user", "hello")
        self.db.set_session_hidden("old_bot", True)
        self.db.create_session("new_bot", "api_server")
        with self.assertRaises(ValueError):
            self.db.set_session_title("new_bot", "Bot Chat")
        self.db.set_session_archived("old_bot", True)
        self.assertTrue(self.db.set_session_title("new_bot", "Bot Chat"))
        self.assertIsNone(self.db.get_session_title("old_bot"))

    def test_the_api_servers_insert_then_check_in_one_write(self):
        self.db.create_session("held", "cli")
        self.db.set_session_title("held", "Taken")
        self.db.append_message("held", "user", "x")

        def create(conn, session_id, title):
            conn.execute("INSERT INTO sessions (id, source, started_at) VALUES (?, 'api_server', 0)", (session_id,))
            try:
                self.db._resolve_title_conflict(conn, session_id, self.db.sanitize_title(title))
            except ValueError as exc:
                conn.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
                return str(exc)
            conn.execute("UPDATE sessions SET title = ? WHERE id = ?", (title, session_id))
            return None
        self.assertIn("already in use", self.db._execute_write(lambda conn: create(conn, "a", "Taken")))
        self.assertIsNone(self.db.get_session("a"))
        self.assertIsNone(self.db._execute_write(lambda conn: create(conn, "b", "Free")))
        self.assertEqual(self.db.get_session_title("b"), "Free")
