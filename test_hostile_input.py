"""Hostile input against the public surfaces: import, the write methods, the command line and restore.

Each test feeds one input a careless or hostile caller could send and checks the project rule: a clean
ValueError naming the field and the limit, nothing half-written, nothing stored but what was given.
"""

import math
import os
import subprocess
import sys
import time
import unittest
from pathlib import Path

from hermes_state import SessionDB, restore_home
from test_support import REPO, StoreTestCase, TempDirTestCase


class NonFiniteNumbers(StoreTestCase):
    """NaN and Infinity: SQLite stores NaN as NULL, and JSON has neither (import refuses both)."""

    def setUp(self):
        super().setUp()
        self.db.create_session("s", "cli")

    def test_a_non_finite_token_count_or_cost_is_refused_naming_the_field_and_the_totals_stay(self):
        self.db.update_token_counts("s", input_tokens=10)
        for kwargs in (dict(input_tokens=math.nan, absolute=True), dict(input_tokens=math.inf),
                       dict(estimated_cost_usd=math.inf)):
            with self.subTest(kwargs=kwargs), self.assertRaisesRegex(ValueError, next(iter(kwargs))):
                self.db.update_token_counts("s", **kwargs)
        row = self.raw(self.path).execute("SELECT input_tokens, estimated_cost_usd FROM sessions").fetchone()
        self.assertEqual(tuple(row), (10, 0.0))

    def test_a_message_the_store_accepted_comes_back_through_its_own_export_and_import(self):
        try:
            self.db.append_message("s", "assistant", "x", tool_calls=[{"id": "c", "function": {
                "name": "f", "arguments": math.nan}}])
        except ValueError as exc:  # refusing it up front, naming the field, is as good
            self.assertIn("tool_calls", str(exc))
            return
        other = SessionDB(db_path=self.tmp / "other.db")
        self.addCleanup(other.close)
        result = other.import_sessions([self.db.export_session("s")])
        self.assertTrue(result["ok"], result["errors"])

    def test_a_nan_content_is_refused_or_kept_never_stored_as_null(self):
        try:
            self.db.append_message("s", "user", math.nan)
        except ValueError as exc:
            self.assertIn("content", str(exc))
            return
        content = self.db.get_messages("s")[0]["content"]
        self.assertTrue(isinstance(content, float) and math.isnan(content), content)


class IntegersPastSqlite(StoreTestCase):
    """An integer past 64 bits is a ValueError naming its field, as update_token_counts and import say it."""

    def setUp(self):
        super().setUp()
        self.db.create_session("s", "cli")

    def test_a_message_integer_past_64_bits_is_a_value_error_naming_the_field_and_writes_nothing(self):
        calls = {"token_count": lambda: self.db.append_message("s", "user", "x", token_count=1 << 70),
                 "content": lambda: self.db.append_messages_batch(
                     "s", [{"role": "user", "content": "ok"}] * 499 + [{"role": "user", "content": 1 << 70}])}
        for field, call in calls.items():
            with self.subTest(field=field), self.assertRaisesRegex(ValueError, field):
                call()
        self.assertEqual(self.db.get_messages("s"), [])

    def test_a_timestamp_that_is_nan_or_infinite_is_the_time_of_the_write(self):
        before = time.time()
        for stamp in (math.nan, math.inf, "nan", 1 << 2000):
            self.db.append_message("s", "user", f"at {stamp!r:.20}", timestamp=stamp)
        self.db.append_messages_batch("s", [{"role": "user", "content": "batch", "timestamp": -math.inf}])
        stamps = [m["timestamp"] for m in self.db.get_messages("s")]
        self.assertEqual(len(stamps), 5)
        self.assertTrue(all(before <= stamp <= time.time() for stamp in stamps), stamps)

    def test_a_session_field_sqlite_cannot_keep_is_refused_naming_it_and_writes_nothing(self):
        from hermes_state_errors import SessionRowError
        for kwargs, field in ((dict(user_id=1 << 70), "user_id"), (dict(model=math.nan), "model"),
                              (dict(source=["x"]), "source")):
            with self.subTest(field=field), \
                    self.assertRaisesRegex(SessionRowError, f"^{field} .*no session was written"):
                self.db.create_session("t", **{"source": "cli", **kwargs})
        self.assertIsNone(self.db.get_session("t"))

    def test_a_batch_of_something_other_than_message_dicts_says_so_and_writes_nothing(self):
        for batch in ({"role": "user", "content": "a dict, not a list of them"}, "text", [{"role": "user"}, 5]):
            with self.subTest(batch=batch), self.assertRaisesRegex(AttributeError, "^a message must be a dict"):
                self.db.append_messages_batch("s", batch)
        self.assertEqual(self.db.get_messages("s"), [])


class CommandLineLimits(TempDirTestCase):

    def test_search_with_a_limit_past_64_bits_prints_a_clean_error_not_a_traceback(self):
        path = self.tmp / "state.db"
        SessionDB(db_path=path).close()
        run = subprocess.run([sys.executable, "-m", "hermes_state", "--db", str(path), "search", "hello",
                              "--limit", str(1 << 70)], cwd=REPO, capture_output=True, text=True, timeout=60)
        self.assertEqual(run.returncode, 2)  # a usage error: argparse checks the range
        self.assertNotIn("Traceback", run.stderr)
        self.assertRegex(run.stderr, r"error: argument -n/--limit: \d+ is out of range")


class RestoreOntoAChangedHome(TempDirTestCase):

    def test_a_folder_of_the_archive_that_is_now_a_file_is_moved_aside_and_the_folder_restored(self):
        # The backup was taken when notes/ was a folder; in the home it is now a file.
        source = self.tmp / "source" / "state.db"
        source.parent.mkdir()
        (source.parent / "notes").mkdir()
        (source.parent / "notes" / "a.txt").write_text("archived")
        with SessionDB(db_path=source) as db:
            db.create_session("from-backup", "cli")
            db.backup(self.tmp / "b.zip")
        home = self.tmp / "home"
        home.mkdir()
        with SessionDB(db_path=home / "state.db") as db:
            db.create_session("current", "cli")
        (home / "notes").write_text("a file now")
        restored = restore_home(self.tmp / "b.zip", home / "state.db", force=True)
        self.assertEqual((home / "notes" / "a.txt").read_text(), "archived")
        kept = [Path(path) for path in restored["moved_aside"] if Path(path).name == "notes"]
        self.assertEqual([path.read_text() for path in kept], ["a file now"])
        with SessionDB(db_path=home / "state.db") as db:
            self.assertIsNotNone(db.get_session("from-backup"))

    def test_a_folder_of_the_archive_that_is_now_a_link_is_moved_aside_never_followed_out_of_the_home(self):
        source = self.tmp / "source" / "state.db"
        (source.parent / "notes").mkdir(parents=True)
        (source.parent / "notes" / "a.txt").write_text("archived")
        with SessionDB(db_path=source) as db:
            db.backup(self.tmp / "b.zip")
        home, outside = self.tmp / "home", self.tmp / "outside"
        home.mkdir()
        outside.mkdir()
        (home / "notes").symlink_to(outside, target_is_directory=True)
        restored = restore_home(self.tmp / "b.zip", home / "state.db")
        self.assertEqual(list(outside.iterdir()), [])
        self.assertEqual(((home / "notes").is_symlink(), (home / "notes" / "a.txt").read_text()), (False, "archived"))
        kept = [Path(path) for path in restored["moved_aside"] if Path(path).name == "notes"]
        self.assertEqual([os.readlink(path) for path in kept], [str(outside)])


if __name__ == "__main__":
    unittest.main()
