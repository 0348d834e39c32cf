"""Search side: index generations on disk, capability probes, optimize breadcrumbs."""

import sqlite3

from hermes_state import SessionDB
from hermes_state_search import fts_layout_of, sqlite_supports_fts5, sqlite_supports_trigram
from test_support import V22_DB, V26_DB, TempDirTestCase


def without_fts5(*args, **kwargs):
    """A runtime whose SQLite was built without FTS5, as SQLite itself reports it."""
    class NoFts5(sqlite3.Connection):
        def execute(self, sql, *rest):
            if "fts5" in sql.lower():
                raise sqlite3.OperationalError("no such module: fts5")
            return super().execute(sql, *rest)
    return sqlite3.connect(*args, factory=NoFts5, **kwargs)


def without_trigram(*args, **kwargs):
    class NoTrigram(sqlite3.Connection):
        def execute(self, sql, *rest):
            if "trigram" in sql.lower():
                raise sqlite3.OperationalError("no such tokenizer: trigram")
            return super().execute(sql, *rest)
    return sqlite3.connect(*args, factory=NoTrigram, **kwargs)


class Layouts(TempDirTestCase):

    def test_probes_see_the_runtime(self):
        self.assertTrue(sqlite_supports_fts5())
        self.assertTrue(sqlite_supports_trigram())
        self.assertFalse(sqlite_supports_fts5(without_fts5))
        self.assertTrue(sqlite_supports_fts5(without_trigram))
        self.assertFalse(sqlite_supports_trigram(without_trigram))

    def test_generation_is_read_from_the_ddl(self):
        self.assertEqual(fts_layout_of(None), "none")
        self.assertEqual(fts_layout_of("CREATE VIRTUAL TABLE messages_fts USING fts5(content)"), "legacy")
        self.assertEqual(fts_layout_of("CREATE VIRTUAL TABLE messages_fts USING fts5(content, tool_name, "
                                       "tool_calls, content='messages', content_rowid='id')"), "external")

    def test_only_a_legacy_store_is_flagged_for_optimize(self):
        for name, layout, flagged in ((V22_DB, "legacy", True), (V26_DB, "external", False)):
            with self.subTest(fixture=name), SessionDB(self.copy_fixture(name)) as db:
                self.assertEqual(db.fts_layout(), layout)
                self.assertIs(db.fts_optimize_available(), flagged)
