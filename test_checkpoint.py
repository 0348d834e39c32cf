"""The checkpoint policy: who checkpoints the WAL (we, SQLite, or a replicator such as Litestream).

Under HERMES_STATE_CHECKPOINT=external (or SessionDB(checkpoint="external")) the store keeps WAL and
none of our connections checkpoints: not every N commits, not automatically, not after VACUUM, and on
Python 3.12+ not on the last close either. Real files, real processes; `make replicate-test` runs the
real Litestream against the same policy.
"""

import json
import os
import sqlite3
import subprocess
import sys
import time
from unittest import mock

from hermes_state import CHECKPOINT_EVERY_COMMITS, SessionDB, choose_journal_policy
from hermes_state_common import sqlite_has_wal_reset_bug
from test_support import REPO, TempDirTestCase, tracing_factory

AFFECTED, FIXED = (3, 40, 1), (3, 51, 3)
HAS_NO_CKPT_ON_CLOSE = hasattr(sqlite3, "SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE")

HOLD_WRITE_LOCK = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
conn.execute("CREATE TABLE IF NOT EXISTS _litestream_lock (id INTEGER)")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("COMMIT")
"""


def wal_bytes(path):
    wal = f"{path}-wal"
    return os.path.getsize(wal) if os.path.exists(wal) else 0


class ChoosingTheCheckpointMode(TempDirTestCase):

    def test_external_keeps_wal_and_turns_every_checkpoint_of_ours_off_on_any_runtime(self):
        for version in (AFFECTED, FIXED):
            policy = choose_journal_policy(version, "", "external")
            self.assertEqual((policy.mode, policy.autocheckpoint, policy.checkpoint), ("wal", 0, "external"))
            self.assertIn("HERMES_STATE_CHECKPOINT=external", policy.reason)

    def test_the_default_and_auto_leave_the_journal_policy_as_it_was(self):
        for wanted in ("", "auto", " AUTO "):
            self.assertEqual(choose_journal_policy(AFFECTED, "", wanted).checkpoint, "none")
            self.assertEqual(choose_journal_policy(AFFECTED, "wal", wanted).checkpoint, "locked")
            self.assertEqual(choose_journal_policy(FIXED, "", wanted).checkpoint, "automatic")
        self.assertEqual(choose_journal_policy(AFFECTED, "delete", "").checkpoint, "none")

    def test_an_unknown_mode_and_external_with_a_rollback_journal_are_refused_naming_the_variable(self):
        with self.assertRaisesRegex(ValueError, "HERMES_STATE_CHECKPOINT must be 'auto' or 'external', not 'off'"):
            choose_journal_policy(AFFECTED, "", "off")
        with self.assertRaisesRegex(ValueError, "HERMES_STATE_CHECKPOINT=external keeps WAL"):
            choose_journal_policy(AFFECTED, "delete", "external")

    def test_a_refused_mode_creates_no_store(self):
        with self.assertRaises(ValueError):
            SessionDB(self.tmp / "state.db", checkpoint="sometimes")
        self.assertEqual(list(self.tmp.iterdir()), [])

    def test_the_mode_is_read_from_the_environment(self):
        with mock.patch.dict(os.environ, {"HERMES_STATE_CHECKPOINT": " External "}):
            with SessionDB(self.tmp / "state.db") as db:
                self.assertEqual(db.policy.checkpoint, "external")
        with mock.patch.dict(os.environ, {"HERMES_STATE_CHECKPOINT": "external"}):
            with SessionDB(self.tmp / "state.db", checkpoint="auto") as db:
                self.assertNotEqual(db.policy.checkpoint, "external", "the argument wins over the environment")


class ExternalMeansNoCheckpointOfOurs(TempDirTestCase):

    def test_many_commits_run_no_checkpoint_and_the_wal_keeps_every_frame(self):
        statements = []
        path = self.tmp / "state.db"
        with SessionDB(path, connection_factory=tracing_factory(statements), checkpoint="external") as db:
            self.assertEqual(db._writer.execute("PRAGMA wal_autocheckpoint").fetchone()[0], 0)
            db.create_session("s", "cli")
            sizes = []
            for i in range(2 * CHECKPOINT_EVERY_COMMITS + 100):
                db.append_message("s", "user", f"message {i}")
                if i % 100 == 99:
                    sizes.append(wal_bytes(path))
            self.assertEqual(sorted(set(sizes)), sizes, "the WAL was reset, so something checkpointed it")
        self.assertEqual([s for s in statements if "wal_checkpoint" in s], [])

    def test_our_wal_policies_checkpoint_where_external_does_not(self):
        statements = []
        with mock.patch("hermes_state_wal.IDLE_CHECKPOINT_DELAY", 3600), \
                SessionDB(self.tmp / "state.db", connection_factory=tracing_factory(statements), journal="wal") as db:
            db.create_session("s", "cli")
            for i in range(CHECKPOINT_EVERY_COMMITS):
                db.append_message("s", "user", f"message {i}")
        # One after the open's schema, one at the cadence, one at close for the commits since (a gateway may
        # keep the store open).
        self.assertEqual(sum("wal_checkpoint(PASSIVE)" in s for s in statements), 3)

    def test_vacuum_leaves_the_wal_to_the_replicator_and_loses_nothing(self):
        path = self.tmp / "state.db"
        with SessionDB(path, checkpoint="external") as db:
            db.create_session("s", "cli")
            db.append_messages_batch("s", [{"role": "user", "content": f"row {i} " * 50} for i in range(300)])
            db.delete_session("s")
            db.create_session("t", "cli")
            db.append_message("t", "user", "kept after vacuum")
            db.vacuum()
            self.assertGreater(wal_bytes(path), 0)
            self.assertEqual([m["content"] for m in db.get_messages("t")], ["kept after vacuum"])
            self.assertEqual(db.doctor()["integrity_check"], ["ok"])

    def test_vacuum_truncates_the_wal_when_we_own_the_checkpoints(self):
        path = self.tmp / "state.db"
        with SessionDB(path, journal="wal") as db:
            db.create_session("s", "cli")
            db.append_message("s", "user", "x")
            db.vacuum()
            self.assertEqual(wal_bytes(path), 0)

    def test_the_last_close_leaves_the_wal_in_place_for_the_replicator(self):
        if not HAS_NO_CKPT_ON_CLOSE:
            self.skipTest("Python before 3.12 cannot turn off the checkpoint of the last close")
        path = self.tmp / "state.db"
        with SessionDB(path, checkpoint="external") as db:
            db.create_session("s", "cli")
            db.append_message("s", "user", "still in the WAL")
        self.assertGreater(wal_bytes(path), 0)
        with SessionDB(path, read_only=True) as db:
            self.assertEqual([m["content"] for m in db.get_messages("s")], ["still in the WAL"])

    def test_the_last_close_checkpoints_when_we_own_the_checkpoints(self):
        path = self.tmp / "state.db"
        with SessionDB(path, journal="wal") as db:
            db.create_session("s", "cli")
            db.append_message("s", "user", "x")
        self.assertFalse(os.path.exists(f"{path}-wal"))


class BesideAReplicator(TempDirTestCase):

    def test_a_write_waits_out_a_replicator_holding_the_write_lock_for_a_second_and_a_half(self):
        path = self.tmp / "state.db"
        with SessionDB(path, checkpoint="external") as db:
            db.create_session("s", "cli")
            with subprocess.Popen([sys.executable, "-c", HOLD_WRITE_LOCK, str(path), "1.5"], cwd=REPO,
                                  text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as holder:
                self.assertEqual(holder.stdout.readline().strip(), "locked")
                start = time.monotonic()
                db.append_message("s", "user", "after the replicator")
                self.assertGreater(time.monotonic() - start, 1.0)
                _out, err = holder.communicate(timeout=30)
            self.assertEqual(holder.returncode, 0, err)
            self.assertEqual(db.message_count("s"), 1)

    def test_doctor_hints_at_external_when_our_checkpoints_would_race_litestreams_writes(self):
        if not sqlite_has_wal_reset_bug():
            self.skipTest("this SQLite is fixed: our checkpoints cannot race Litestream's writes")
        path = self.tmp / "state.db"
        SessionDB(path, journal="wal").close()
        raw = sqlite3.connect(path)
        raw.execute("CREATE TABLE _litestream_seq (id INTEGER PRIMARY KEY, seq INTEGER)")
        raw.commit()
        raw.close()
        with SessionDB(path, journal="wal") as db:
            self.assertRegex(db.doctor()["checkpoint_mode"],
                             "^locked; this store carries Litestream's tables: .* set HERMES_STATE_CHECKPOINT=external")
        with SessionDB(path, checkpoint="external") as db:
            self.assertEqual(db.doctor()["checkpoint_mode"], "external")


class DoctorShowsTheMode(TempDirTestCase):

    def test_doctor_reports_the_checkpoint_mode_beside_the_journal_mode(self):
        with SessionDB(self.tmp / "ext.db", checkpoint="external") as db:
            report = db.doctor()
            self.assertEqual((report["journal_mode"], report["checkpoint_mode"]), ("wal", "external"))
        with SessionDB(self.tmp / "del.db", journal="delete") as db:
            self.assertEqual(db.doctor()["checkpoint_mode"], "none")
        with SessionDB(self.tmp / "own.db") as db:
            expected = ("delete", "none") if sqlite_has_wal_reset_bug() else ("wal", "automatic")
            report = db.doctor()
            self.assertEqual((report["journal_mode"], report["checkpoint_mode"]), expected)
        with SessionDB(self.tmp / "wal.db", journal="wal") as db:
            expected = "locked" if sqlite_has_wal_reset_bug() else "automatic"
            self.assertEqual(db.doctor()["checkpoint_mode"], expected)

    def test_the_doctor_command_prints_the_mode_set_in_the_environment(self):
        path = self.tmp / "state.db"
        SessionDB(path).close()  # doctor reads a store; it creates none
        env = dict(os.environ, HERMES_STATE_CHECKPOINT="external")
        result = subprocess.run([sys.executable, "-m", "hermes_state", "--db", str(path), "doctor", "--json"],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(json.loads(result.stdout)["checkpoint_mode"], "external")
