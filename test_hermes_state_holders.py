"""Which other processes hold a store open: real stores held by real processes, read off /proc."""

import json
import os
import sqlite3
import subprocess
import sys
import unittest
from unittest import mock

from hermes_state_holders import (
    _PYTHON_LONG_OPTIONS_WITH_OPERANDS, _PYTHON_SHORT_OPTIONS_WITH_OPERANDS, _looks_like_hermes,
    _serves_another_home, canonical_sqlite_path, describe_holder_pid, foreign_state_db_holders,
    held_store_refusal, read_only_db_uri,
)
from hermes_constants import reset_hermes_home_override, set_hermes_home_override
from test_support import REPO, TempDirTestCase

LINUX_PROC = sys.platform.startswith("linux") and os.path.isdir("/proc/self/fd")

# Opens the store argv[1] in WAL mode and reads it (so its -wal and -shm are open too), prints
# "held", and keeps it open until its stdin closes.
HOLD_STORE_OPEN = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1])
conn.execute("PRAGMA journal_mode=WAL")
conn.execute("CREATE TABLE IF NOT EXISTS t (x)")
conn.execute("INSERT INTO t VALUES (1)")
conn.commit()
conn.execute("SELECT COUNT(*) FROM t").fetchone()
print("held", flush=True)
sys.stdin.readline()
"""


class HolderTestCase(TempDirTestCase):

    def hold_open(self, path):
        """Another process holding `path` open in WAL mode; returns (its pid, release)."""
        release = self.held_by_another_process(HOLD_STORE_OPEN, path)
        return release.pid, release


class ReadOnlyUri(TempDirTestCase):

    def test_it_opens_the_store_read_only(self):
        path = self.tmp / "state.db"
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE t (x)")
            conn.execute("INSERT INTO t VALUES (7)")
        conn.close()
        reader = sqlite3.connect(read_only_db_uri(path), uri=True)
        self.addCleanup(reader.close)
        self.assertEqual(reader.execute("SELECT x FROM t").fetchone(), (7,))
        with self.assertRaisesRegex(sqlite3.OperationalError, "readonly"):
            reader.execute("INSERT INTO t VALUES (8)")

    def test_a_missing_store_is_never_created(self):
        path = self.tmp / "missing.db"
        with self.assertRaises(sqlite3.OperationalError):
            sqlite3.connect(read_only_db_uri(path), uri=True)
        self.assertFalse(path.exists())

    def test_question_marks_hashes_and_spaces_in_the_path_name_the_right_file(self):
        folder = self.tmp / "odd ?home#1"
        folder.mkdir()
        path = folder / "state.db"
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE t (x)")
        conn.close()
        reader = sqlite3.connect(read_only_db_uri(path), uri=True)
        self.addCleanup(reader.close)
        self.assertEqual(reader.execute("SELECT name FROM sqlite_master").fetchone(), ("t",))
        self.assertEqual(sorted(os.listdir(self.tmp)), ["odd ?home#1"])  # nothing made beside it


@unittest.skipUnless(LINUX_PROC, "holders are read from /proc on Linux")
class ForeignHolders(HolderTestCase):

    def test_a_process_holding_the_store_is_found_with_its_files_and_described(self):
        path = self.tmp / "state.db"
        pid, release = self.hold_open(path)
        found = foreign_state_db_holders(path)
        self.assertEqual({p for p, _ in found}, {pid})
        self.assertEqual({os.path.basename(target) for _, target in found},
                         {"state.db", "state.db-wal", "state.db-shm"})
        # The program's base name and its arguments, one line, whitespace collapsed, 80 at most.
        command = " ".join([os.path.basename(sys.executable), "-c"] + HOLD_STORE_OPEN.split())
        self.assertEqual(describe_holder_pid(pid), f"PID {pid} ({command[:80]})")
        release()
        self.assertEqual(foreign_state_db_holders(path), [])

    def test_this_process_is_never_its_own_foreign_holder(self):
        path = self.tmp / "state.db"
        conn = sqlite3.connect(path)
        self.addCleanup(conn.close)
        conn.execute("CREATE TABLE t (x)")
        self.assertEqual(foreign_state_db_holders(path), [])

    def test_a_holder_of_a_deleted_wal_generation_is_still_found(self):
        path = self.tmp / "state.db"
        pid, _ = self.hold_open(path)
        os.unlink(f"{path}-wal")
        os.unlink(f"{path}-shm")
        targets = {target for p, target in foreign_state_db_holders(path) if p == pid}
        self.assertIn(f"{os.path.realpath(path)}-wal (deleted)", targets)

    def test_a_symlinked_home_does_not_hide_a_holder(self):
        real = self.tmp / "real"
        real.mkdir()
        link = self.tmp / "home"
        link.symlink_to(real)
        pid, _ = self.hold_open(real / "state.db")
        self.assertIn(pid, {p for p, _ in foreign_state_db_holders(link / "state.db")})

    def test_another_store_held_is_not_this_one(self):
        self.hold_open(self.tmp / "other.db")
        (self.tmp / "state.db").touch()
        self.assertEqual(foreign_state_db_holders(self.tmp / "state.db"), [])

    def test_held_store_refusal_names_the_holder_and_the_override(self):
        path = self.tmp / "state.db"
        pid, release = self.hold_open(path)
        text = held_store_refusal(path, command="optimize-storage")
        lines = text.splitlines()
        self.assertEqual(lines[0],
                         f"Refusing `hermes sessions optimize-storage`: another process is using {path}.")
        self.assertEqual(lines[1], f"  {describe_holder_pid(pid)}: state.db, state.db-shm, state.db-wal")
        self.assertIn("Override with --force if you accept the risk.", lines)
        self.assertTrue(lines[-1].startswith("Recovery guide: https://"))
        self.assertIn("Stop them first (`hermes gateway stop`, quit the Desktop app, pause cron),"
                      " then re-run.", lines)
        without = held_store_refusal(path, command="vacuum", force_hint=None)
        self.assertNotIn("Override", without)
        token = set_hermes_home_override(self.tmp / "root" / "profiles" / "work")
        try:
            self.assertIn("`hermes -p work gateway stop`", held_store_refusal(path, command="prune"))
        finally:
            reset_hermes_home_override(token)
        release()
        self.assertIsNone(held_store_refusal(path, command="optimize-storage"))


# Lists, as the unprivileged user `nobody` (who cannot read root's /proc/<pid>/fd), the holders of
# the store argv[2], with the repo at argv[1]; prints them as JSON.
SCAN_AS_NOBODY = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from hermes_state_holders import foreign_state_db_holders
os.setgid(65534)
os.setuid(65534)
print(json.dumps(foreign_state_db_holders(sys.argv[2])))
"""


@unittest.skipUnless(LINUX_PROC and hasattr(os, "geteuid") and os.geteuid() == 0,
                     "needs root, to scan as another user")
class ProcessesTheScanCannotInspect(HolderTestCase):

    def scan_as_nobody(self, path):
        os.chmod(self.tmp, 0o755)  # the store's folder, so that nobody can stat the store
        result = subprocess.run([sys.executable, "-c", SCAN_AS_NOBODY, str(REPO), str(path)],
                                capture_output=True, text=True, timeout=60, check=True)
        return json.loads(result.stdout)

    def run_as(self, script_name, path, *args):
        """A holder of `path` (given to it outside its command line) whose command line is
        `python <tmp>/<script_name> <args>`."""
        script = self.tmp / script_name
        script.write_text("import os, sys\nsys.argv[1:] = [os.environ['STORE']]\n" + HOLD_STORE_OPEN)
        holder = subprocess.Popen([sys.executable, str(script), *map(str, args)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=dict(os.environ, STORE=str(path)))
        self.addCleanup(lambda: holder.poll() is None and (holder.stdin.close(), holder.wait(30),
                                                           holder.stdout.close()))
        self.assertEqual(holder.stdout.readline().strip(), "held")
        return holder.pid

    def test_a_hermes_process_it_cannot_inspect_is_a_suspect_and_anything_else_is_not(self):
        path = self.tmp / "state.db"
        suspect = self.run_as("run_agent.py", path)
        self.run_as("tool.py", path)  # not hermes-agent: its descriptors would not be ours to guess
        found = self.scan_as_nobody(path)
        self.assertEqual([pid for pid, _ in found], [suspect])
        self.assertTrue(found[0][1].startswith("uninspectable holder: "), found)

    def test_a_hermes_process_of_another_home_is_not_a_suspect_unless_it_names_this_store(self):
        path = self.tmp / "state.db"
        self.run_as("run_agent.py", path, "--hermes-home", "/srv/another/.hermes")
        self.assertEqual(self.scan_as_nobody(path), [])
        naming = self.run_as("run_agent.py", path, "--hermes-home", "/srv/another/.hermes", path)
        self.assertEqual([pid for pid, _ in self.scan_as_nobody(path)], [naming])

class WhereTheScanCannotRun(TempDirTestCase):

    def test_without_proc_every_store_counts_as_held_by_an_unknown_process(self):
        path = self.tmp / "state.db"
        path.touch()
        with mock.patch.object(sys, "platform", "darwin"):
            self.assertEqual(foreign_state_db_holders(path),
                             [(-1, "open-file scan unavailable on this platform")])
            text = held_store_refusal(path, command="optimize-storage")
        self.assertIn("cannot prove the database is quiet (holder scan incomplete: open-file scan"
                      " unavailable on this platform)", text)


class Describing(unittest.TestCase):

    def test_a_pid_without_a_command_line_says_so(self):
        self.assertEqual(describe_holder_pid(2 ** 30), f"PID {2 ** 30} (command line unavailable)")

    @unittest.skipUnless(LINUX_PROC, "command lines are read from /proc on Linux")
    def test_this_process_is_described_by_its_program_and_arguments(self):
        described = describe_holder_pid(os.getpid())
        self.assertTrue(described.startswith(f"PID {os.getpid()} ({os.path.basename(sys.argv[0])}")
                        or described.startswith(f"PID {os.getpid()} (python"), described)
        self.assertLessEqual(len(described), len(f"PID {os.getpid()} ()") + 80)

    def test_deleted_targets_compare_as_their_path(self):
        self.assertEqual(canonical_sqlite_path("/a/state.db-wal (deleted)"),
                         canonical_sqlite_path("/a/./state.db-wal"))


class RecognisingHermes(unittest.TestCase):
    """Which processes the scan must not dismiss when it cannot read their descriptors."""

    def test_hermes_programs_and_python_running_its_module_or_script(self):
        for argv in (["/usr/local/bin/hermes", "gateway", "run"], ["hermes-acp"],
                     ["/usr/bin/python3.11", "-m", "hermes_cli.main", "chat"],
                     ["python3", "-X", "utf8", "-W", "ignore", "-m", "hermes_cli.main"],
                     ["python3", "-Xutf8", "-mhermes_cli.main"],
                     ["python", "--check-hash-based-pycs", "never", "/opt/h/run_agent.py"],
                     ["pypy3", "-u", "/opt/hermes/hermes_cli/main.py"]):
            self.assertTrue(_looks_like_hermes(argv), argv)

    def test_other_programs_and_inline_code_are_not_hermes(self):
        for argv in (["python3", "-c", "import hermes_cli.main"], ["python3", "-m", "http.server"],
                     ["python3", "-X", "hermes_cli/main.py", "x.py"], ["/bin/bash"],
                     ["python3-config"], ["python3", "--", "tool.py"]):
            self.assertFalse(_looks_like_hermes(argv), argv)
        self.assertEqual((_PYTHON_SHORT_OPTIONS_WITH_OPERANDS, _PYTHON_LONG_OPTIONS_WITH_OPERANDS),
                         ({"Q", "W", "X"}, {"--check-hash-based-pycs", "--jit"}))

    def test_a_process_of_another_home_is_told_apart_and_an_ambiguous_one_is_not(self):
        store = "/home/a/.hermes/state.db"
        self.assertTrue(_serves_another_home(["hermes", "--hermes-home", "/home/b/.hermes"], store))
        self.assertTrue(_serves_another_home(["env", "HERMES_HOME=/srv/h2", "hermes"], store))
        self.assertTrue(_serves_another_home(["hermes", "--db=/home/b/.hermes/state.db"], store))
        self.assertFalse(_serves_another_home(["hermes", "--hermes-home=/home/a/.hermes"], store))
        self.assertFalse(_serves_another_home(["hermes", "--hermes-home=/srv/b", f"--db={store}-wal"],
                                              store))
        self.assertFalse(_serves_another_home(["/home/b/.hermes/venv/bin/hermes", "gateway"], store))
        self.assertFalse(_serves_another_home(["hermes", "/home/b/.hermes/x", "/home/a/.hermes/y"],
                                              store))


if __name__ == "__main__":
    unittest.main()
