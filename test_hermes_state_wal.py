"""The journal mode and file checks hermes-agent asks for its other databases
(kanban, cron, response store, its own tables inside state.db)."""

import json
import os
import sqlite3
import subprocess
import sys
import unittest
from pathlib import Path
from unittest import mock

import hermes_state
import hermes_state_wal
from hermes_state_wal import apply_wal_with_fallback
from hermes_state_errors import WalUnsupportedError
from test_support import REPO, StoreTestCase, TempDirTestCase

# Opens a WAL database, commits a row it keeps in the WAL (no checkpoint), says so,
# waits for a line on stdin, commits another row and exits.
WAL_WRITER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA wal_autocheckpoint=0")
conn.execute("INSERT INTO t VALUES ('from the other process')")
print("written", flush=True)
sys.stdin.readline()
conn.execute("INSERT INTO t VALUES ('after the other opener')")
conn.close()
"""


def runtime(has_bug):
    """Run as on a SQLite with (True) or without (False) the WAL-reset bug."""
    return mock.patch.object(hermes_state_wal, "sqlite_has_wal_reset_bug", lambda *args: has_bug)


def journal(operator_choice=""):
    """The operator's journal choice (HERMES_STATE_JOURNAL); '' for none."""
    return mock.patch.dict(os.environ, {"HERMES_STATE_JOURNAL": operator_choice})


class JournalModeOfOtherDatabases(TempDirTestCase):

    def setUp(self):
        super().setUp()
        patcher = mock.patch.object(hermes_state_wal, "_warned", set())  # each test sees its first warnings
        patcher.start()
        self.addCleanup(patcher.stop)

    def connect(self, name="kanban.db", **kwargs):
        conn = sqlite3.connect(str(self.tmp / name), **kwargs)
        self.addCleanup(conn.close)
        return conn

    def mode_on_disk(self, name="kanban.db"):
        conn = sqlite3.connect(str(self.tmp / name))
        try:
            return conn.execute("PRAGMA journal_mode").fetchone()[0]
        finally:
            conn.close()

    def wal_database(self, name="kanban.db"):
        conn = self.connect(name)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (x TEXT)")
        conn.commit()
        return conn

    def test_a_new_database_stays_out_of_wal_on_a_runtime_with_the_reset_bug(self):
        with runtime(True), journal(), self.assertLogs("hermes_state", "WARNING") as logs:
            self.assertEqual(apply_wal_with_fallback(self.connect(), db_label="kanban.db"), "delete")
            self.assertEqual(apply_wal_with_fallback(self.connect(), db_label="kanban.db"), "delete")
        self.assertEqual(len(logs.output), 1, "warned once per database")
        self.assertIn("WAL-reset bug", logs.output[0])
        self.assertEqual(self.mode_on_disk(), "delete")

    def test_a_new_database_gets_wal_on_a_fixed_runtime_unless_the_operator_chose_delete(self):
        with runtime(False), journal():
            self.assertEqual(apply_wal_with_fallback(self.connect("a.db")), "wal")
        with runtime(False), journal("delete"):
            self.assertEqual(apply_wal_with_fallback(self.connect("b.db")), "delete")
        self.assertEqual((self.mode_on_disk("a.db"), self.mode_on_disk("b.db")), ("wal", "delete"))

    def test_a_wal_database_another_process_holds_is_never_switched_back(self):
        self.wal_database()
        writer = subprocess.Popen([sys.executable, "-c", WAL_WRITER, str(self.tmp / "kanban.db")], cwd=REPO,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.addCleanup(writer.kill)
        self.assertEqual(writer.stdout.readline().strip(), "written")
        for has_bug in (True, False):
            for choice in ("", "delete"):
                with self.subTest(bug=has_bug, choice=choice), runtime(has_bug), journal(choice):
                    self.assertEqual(apply_wal_with_fallback(self.connect(timeout=0)), "wal")
        writer.communicate("go\n", timeout=30)
        self.assertEqual(writer.returncode, 0)
        self.assertEqual(self.mode_on_disk(), "wal")
        rows = [row[0] for row in self.connect().execute("SELECT x FROM t ORDER BY rowid")]
        self.assertEqual(rows, ["from the other process", "after the other opener"])

    def test_a_mode_that_cannot_be_read_is_left_as_it_is(self):
        holder = self.connect(isolation_level=None)
        holder.execute("CREATE TABLE t (x)")
        holder.execute("BEGIN EXCLUSIVE")
        holder.execute("INSERT INTO t VALUES (1)")
        with runtime(True), journal(), self.assertLogs("hermes_state", "WARNING") as logs:
            self.assertEqual(apply_wal_with_fallback(self.connect(timeout=0)), "wal")
        self.assertIn("left as it is", logs.output[0])
        with runtime(True), journal("delete"), self.assertRaisesRegex(sqlite3.OperationalError, "cannot be read"):
            apply_wal_with_fallback(self.connect(timeout=0))
        with runtime(False), journal(), self.assertRaisesRegex(sqlite3.OperationalError, "locked"):
            apply_wal_with_fallback(self.connect(timeout=0))
        holder.execute("COMMIT")
        self.assertEqual(self.mode_on_disk(), "delete")

    def test_a_filesystem_that_silently_refuses_wal_falls_back_or_raises_when_wal_is_required(self):
        def refuse_wal(action, name, value, *_):
            quiet = action == sqlite3.SQLITE_PRAGMA and name == "journal_mode" and (value or "").lower() == "wal"
            return sqlite3.SQLITE_IGNORE if quiet else sqlite3.SQLITE_OK

        conn = self.connect()
        conn.set_authorizer(refuse_wal)
        with runtime(False), journal():
            with self.assertLogs("hermes_state", "ERROR") as logs:
                self.assertEqual(apply_wal_with_fallback(conn, db_label="nfs.db"), "delete")
                self.assertEqual(apply_wal_with_fallback(conn, db_label="nfs.db"), "delete")
            self.assertEqual(len(logs.output), 1, "logged once per database")
            with self.assertRaises(WalUnsupportedError) as raised:
                apply_wal_with_fallback(conn, require_wal=True)
        self.assertIsInstance(raised.exception, sqlite3.OperationalError)

    def test_hermes_agents_tables_inside_our_store_leave_it_in_wal(self):
        from hermes_state import SessionDB
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            ledger = sqlite3.connect(str(path), timeout=10)
            self.addCleanup(ledger.close)
            for has_bug in (True, False):
                with runtime(has_bug), journal():
                    self.assertEqual(apply_wal_with_fallback(ledger, db_label="state.db (delivery_ledger)"), "wal")
            ledger.execute("CREATE TABLE IF NOT EXISTS delivery_obligations (obligation_id TEXT PRIMARY KEY)")
            ledger.commit()
            db.append_message("s", "user", "still writing")
        self.assertEqual(self.mode_on_disk("state.db"), "wal")

    def test_the_operator_choice_comes_from_the_environment_and_is_wal_or_delete(self):
        for value, expected in (("delete", "delete"), ("DELETE ", "delete"), ("wal", "wal"), ("memory", "wal"),
                                ("", "wal")):
            with journal(value):
                self.assertEqual(hermes_state_wal.resolve_journal_mode(), expected, value)

    def test_hermes_state_exports_the_names_hermes_agent_imports(self):
        for name in ("apply_wal_with_fallback", "_WAL_INCOMPAT_MARKERS", "WalUnsupportedError",
                     "preflight_db_writability", "apply_database_pragmas", "resolve_journal_mode"):
            self.assertIs(getattr(hermes_state, name), getattr(hermes_state_wal, name), name)
        self.assertEqual(hermes_state._WAL_INCOMPAT_MARKERS, ("locking protocol", "not authorized", "disk i/o error"))

    def test_pragmas_without_hermes_agents_config_change_nothing(self):
        conn = self.connect()
        before = conn.execute("PRAGMA cache_size").fetchone()
        self.assertIsNone(hermes_state_wal.apply_database_pragmas(conn))
        self.assertEqual(conn.execute("PRAGMA cache_size").fetchone(), before)


# Runs the preflight checks in a child process (as `nobody` when the tests run as
# root, whom file modes do not stop) and prints what happened as JSON. The home
# is read when the check runs, so HERMES_HOME set before the import is enough.
PREFLIGHT = """
import json, os, sqlite3, sys
from pathlib import Path
home, other = sys.argv[1], sys.argv[2]
os.environ["HERMES_HOME"] = home
from hermes_state import preflight_db_writability
if hasattr(os, "geteuid") and os.geteuid() == 0:  # after the imports: the interpreter may live under /root
    os.setgid(65534)
    os.setuid(65534)

def store(folder, name):
    path = Path(folder) / name
    conn = sqlite3.connect(str(path))
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    Path(str(path) + "-wal").write_bytes(b"")
    for target in (path, Path(str(path) + "-wal")):
        os.chmod(target, 0o444)
    return path

def attempt(path, **kwargs):
    try:
        preflight_db_writability(path, **kwargs)
        return None
    except sqlite3.OperationalError as exc:
        return str(exc)

def mode(path):
    return oct(os.stat(path).st_mode & 0o777)

result = {}
inside = store(home, "kanban.db")
result["inside"] = [attempt(inside), mode(inside), mode(str(inside) + "-wal")]
outside = store(other, "kanban.db")
result["outside"] = [attempt(outside, db_label="kanban.db (x)"), mode(outside)]
os.chmod(outside, 0o644)
result["outside_wal"] = [attempt(outside), os.path.exists(str(outside) + "-wal")]
folder = Path(home) / "cron"
folder.mkdir()
os.chmod(folder, 0o555)
result["folder"] = [attempt(folder / "jobs.db"), mode(folder)]
result["skipped"] = [attempt(":memory:"), attempt("file:x.db?mode=memory"), attempt(Path(other) / "none" / "x.db")]
print(json.dumps(result))
"""


@unittest.skipIf(sys.platform == "win32", "POSIX file modes")
class Preflight(TempDirTestCase):

    def test_read_only_files_are_repaired_inside_the_home_and_named_outside_it(self):
        home, other = self.tmp / "home", self.tmp / "other"
        for folder in (self.tmp, home, other):
            folder.mkdir(exist_ok=True)
            os.chmod(folder, 0o777)
        done = subprocess.run([sys.executable, "-c", PREFLIGHT, str(home), str(other)], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 0, done.stderr)
        result = json.loads(done.stdout)
        self.assertEqual(result["inside"], [None, "0o644", "0o644"])
        error, mode = result["outside"]
        self.assertEqual(mode, "0o444", "a file outside the home is never changed")
        self.assertIn(f"kanban.db (x) is not writable: the file {other / 'kanban.db'}", error)
        self.assertIn(f"chmod u+rw '{other / 'kanban.db'}'", error)
        error, wal_kept = result["outside_wal"]
        self.assertIn("Keep the -wal file", error)
        self.assertTrue(wal_kept)
        self.assertEqual(result["folder"], [None, "0o755"])
        self.assertEqual(result["skipped"], [None, None, None])


class PreflightOfOurStore(StoreTestCase):

    def test_a_writable_store_passes_untouched(self):
        before = os.stat(self.path).st_mode
        self.assertIsNone(hermes_state_wal.preflight_db_writability(Path(self.path)))
        self.assertIsNone(hermes_state_wal.preflight_db_writability(str(self.path)))
        self.assertEqual(os.stat(self.path).st_mode, before)


if __name__ == "__main__":
    unittest.main()
