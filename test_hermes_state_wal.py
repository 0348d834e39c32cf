"""The journal mode and file checks hermes-agent asks for its other databases
(kanban, cron, response store, its own tables inside state.db)."""

import json
import os
import sqlite3
import subprocess
import sys
import tempfile
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
        with SessionDB(path, journal="wal") as db:
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


    def test_a_new_database_on_a_cross_vm_mount_gets_a_rollback_journal_or_a_refusal(self):
        conn = self.connect()
        with mock.patch.dict(hermes_state_wal._cross_vm_folders, {os.path.realpath(self.tmp): True}), \
                runtime(False), journal(""):
            with self.assertRaisesRegex(WalUnsupportedError, "cross-VM filesystem"):
                apply_wal_with_fallback(conn, require_wal=True)
            with self.assertLogs("hermes_state", "WARNING") as logs:
                self.assertEqual(apply_wal_with_fallback(conn, db_label="kanban.db"), "delete")
            self.assertIn("cross-VM filesystem", logs.output[0])
        self.assertEqual(self.mode_on_disk(), "delete")

    def test_a_wal_database_on_a_cross_vm_mount_stays_wal_and_the_operator_is_told(self):
        self.wal_database()
        conn = self.connect()
        with mock.patch.dict(hermes_state_wal._cross_vm_folders, {os.path.realpath(self.tmp): True}), \
                runtime(False), journal(""):
            with self.assertLogs("hermes_state", "ERROR") as logs:
                self.assertEqual(apply_wal_with_fallback(conn), "wal")
            self.assertIn("set-journal-mode delete", logs.output[0])
        self.assertEqual(self.mode_on_disk(), "wal")

    def test_the_no_wait_switch_fails_at_once_while_another_connection_holds_the_file(self):
        self.wal_database()
        switcher = self.connect(timeout=5, isolation_level=None)
        with self.assertRaisesRegex(sqlite3.OperationalError, "locked"):
            hermes_state_wal._set_journal_mode_no_wait(switcher, "DELETE")
        self.assertEqual(switcher.execute("PRAGMA busy_timeout").fetchone(), (5000,))
        self.assertEqual(self.mode_on_disk(), "wal")

    def test_the_no_wait_switch_changes_a_file_no_one_else_holds(self):
        conn = self.wal_database()
        conn.close()
        alone = self.connect(isolation_level=None)
        self.assertEqual(hermes_state_wal._set_journal_mode_no_wait(alone, "DELETE"), "delete")
        alone.close()
        self.assertEqual(self.mode_on_disk(), "delete")


class CrossVmMounts(unittest.TestCase):

    # proc(5)'s mountinfo lines: a bind mount of a host folder through virtiofs (its mount point
    # with an escaped space), a 9p one, and the root.
    SAMPLE = (
        "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        "36 22 0:45 /Users/me /home/me/shared\\040folder rw,nosuid master:7 - virtiofs mount0 rw\n"
        "37 22 0:46 / /mnt/host rw - 9p hostshare rw,trans=virtio\n"
        "38 37 0:47 / /mnt/host/inner rw - tmpfs tmpfs rw\n"
        "39 22 0:48 / /mnt/fuse rw shared:9 master:3 - fuse.virtiofs share rw\n"
        "malformed line\n"
    )

    def test_the_longest_mount_point_above_a_folder_gives_its_filesystem(self):
        fstype = hermes_state_wal._mount_fstype
        self.assertEqual(fstype("/home/me/shared folder/.hermes", self.SAMPLE), "virtiofs")
        self.assertEqual(fstype("/home/me/shared", self.SAMPLE), "ext4")
        self.assertEqual(fstype("/mnt/host/a", self.SAMPLE), "9p")
        self.assertEqual(fstype("/mnt/host/inner/a", self.SAMPLE), "tmpfs")
        self.assertEqual(fstype("/mnt/hostile", self.SAMPLE), "ext4")
        self.assertEqual(fstype("/mnt/fuse", self.SAMPLE), "fuse.virtiofs")
        self.assertEqual(fstype("/x", ""), "")
        cross = {"virtiofs", "9p", "fuse.virtiofs"}
        self.assertTrue(cross <= hermes_state_wal.CROSS_VM_FSTYPES)
        self.assertFalse({"ext4", "tmpfs", "nfs", "overlay"} & hermes_state_wal.CROSS_VM_FSTYPES)

    @unittest.skipUnless(os.path.exists("/proc/self/mountinfo"), "mounts are read from /proc")
    def test_this_machine_s_folders_by_its_own_mount_table(self):
        # /proc/mounts is a second view of the same table: its longest matching mount point's type.
        with open("/proc/mounts", encoding="utf-8") as handle:
            mounts = [line.split() for line in handle if len(line.split()) >= 3]
        for folder in (os.path.realpath(REPO), os.path.realpath(tempfile.gettempdir()), "/"):
            points = [(len(p), t) for _, p, t, *_ in mounts
                      if folder == p or folder.startswith(p.rstrip("/") + "/")]
            expected = max(points)[1].lower()
            with open("/proc/self/mountinfo", encoding="utf-8") as handle:
                self.assertEqual(hermes_state_wal._mount_fstype(folder, handle.read()), expected)
            on_cross_vm = hermes_state_wal._path_on_cross_vm_fs(os.path.join(folder, "state.db"))
            self.assertIs(on_cross_vm, expected in hermes_state_wal.CROSS_VM_FSTYPES, folder)


class Runtime(unittest.TestCase):

    def test_wal_reset_exposure_by_version(self):
        cases = {(3, 7, 0): True, (3, 6, 23): False, (3, 45, 1): True, (3, 44, 6): False, (3, 50, 7): False,
                 (3, 51, 2): True, (3, 51, 3): False, (3, 51): True, (4, 0, 0): False}
        for version, vulnerable in cases.items():
            self.assertIs(hermes_state_wal.is_sqlite_wal_reset_vulnerable(version), vulnerable, version)
        self.assertIs(hermes_state_wal.is_sqlite_wal_reset_vulnerable(),
                      hermes_state_wal.is_sqlite_wal_reset_vulnerable(sqlite3.sqlite_version_info))

    def test_source_id_and_repair_hint_are_text(self):
        conn = sqlite3.connect(":memory:")
        self.addCleanup(conn.close)
        self.assertEqual(hermes_state_wal.sqlite_source_id(),
                         conn.execute("SELECT sqlite_source_id()").fetchone()[0])
        self.assertIn("SQLite 3.51.3", hermes_state_wal._wal_reset_repair_hint())


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
