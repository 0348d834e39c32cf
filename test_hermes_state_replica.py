"""Read replicas without Litestream: every way `--replica` / `SessionDB.open_replica` refuses.

The reads themselves, over the real extension and a live replica, are `make replicate-test`'s; here
each refusal runs in a real process of a real Python (this one, or another found on the machine)
and must be one line on stderr, exit 1 (2 for a usage error), and leave no file behind.
"""

import contextlib
import os
import subprocess
import sys
import unittest

from hermes_state_replica import _python_that_loads_extensions
from test_support import REPO, TempDirTestCase

CAN_LOAD = ("import sqlite3, sys; "
            "sys.exit(0 if hasattr(sqlite3.Connection, 'enable_load_extension') else 1)")
HAS_WHEEL = ("import importlib.util, sys; "
             "sys.exit(0 if importlib.util.find_spec('litestream_vfs') else 1)")
VFS_ENV = "HERMES_STATE_LITESTREAM_VFS"


def loads_extensions(python):
    return subprocess.run([python, "-s", "-c", CAN_LOAD], timeout=30).returncode == 0


def python_that_loads_extensions():
    """This Python if it loads extensions, else another one on the machine, else None."""
    return sys.executable if loads_extensions(sys.executable) else _python_that_loads_extensions()


class ReplicaRefusals(TempDirTestCase):

    def run_cli(self, *args, python=sys.executable, **env):
        """`python -s -m hermes_state ARGS` in the temp folder, the home inside it, no user site."""
        environ = {key: value for key, value in os.environ.items() if key != VFS_ENV}
        environ.update(HERMES_HOME=str(self.tmp / "home"), PYTHONPATH=str(REPO), **env)
        return subprocess.run([python, "-s", "-m", "hermes_state", *args], capture_output=True,
                              text=True, env=environ, cwd=self.tmp, timeout=120)

    def assert_one_line_error(self, result, *fragments, code=1):
        self.assertEqual(result.returncode, code, result.stderr)
        self.assertEqual(result.stdout, "")
        lines = result.stderr.strip().splitlines()
        self.assertNotIn("Traceback", result.stderr)
        # A usage error is argparse's usage (wrapped to the terminal's width), then the error.
        if code == 1:
            self.assertEqual(len(lines), 1, result.stderr)
        else:
            self.assertTrue(lines[0].startswith("usage: "), result.stderr)
            self.assertEqual([line for line in lines if ": error: " in line], lines[-1:])
        for fragment in fragments:
            self.assertIn(fragment, lines[-1])

    def assert_nothing_written(self):
        self.assertEqual(sorted(p.name for p in self.tmp.iterdir()), [], "a refusal left files")

    def test_a_write_command_or_db_with_replica_is_a_usage_error(self):
        writes = [["delete", "s1"], ["import", "x.jsonl"], ["prune", "--older-than", "3"],
                  ["optimize"], ["optimize-storage", "--yes"], ["backup", "out.zip"],
                  ["restore", "a.zip"], ["doctor"], ["demo"]]
        for command in writes:
            with self.subTest(command=command[0]):
                result = self.run_cli("--replica", "s3://bucket/state", *command)
                self.assert_one_line_error(result, "--replica", f"{command[0]} runs on the primary",
                                           code=2)
        result = self.run_cli("--db", str(self.tmp / "state.db"), "list",
                              "--replica", "s3://bucket/state")
        self.assert_one_line_error(result, "without --db", code=2)
        self.assert_nothing_written()

    def test_not_a_url_and_a_file_replica_without_litestream_files_are_refused(self):
        result = self.run_cli("--replica", "state.db", "list")
        self.assert_one_line_error(result, "'state.db': not a replica URL")
        empty = self.tmp / "empty-replica"
        empty.mkdir()
        result = self.run_cli("search", "zebra", "--replica", empty.as_uri())
        self.assert_one_line_error(result, f"replica {empty.as_uri()} holds no database",
                                   "no ltx/ folder")
        self.assertEqual(sorted(p.name for p in self.tmp.iterdir()), ["empty-replica"])
        self.assertEqual(list(empty.iterdir()), [])

    def test_a_python_that_cannot_load_extensions_is_named_with_one_that_can(self):
        if loads_extensions(sys.executable):
            self.skipTest(f"{sys.executable} loads extensions: no Python here to be refused")
        result = self.run_cli("--replica", "s3://bucket/state", "stats")
        self.assert_one_line_error(result, f"{sys.executable} cannot read a replica",
                                   "--enable-loadable-sqlite-extensions")
        other = _python_that_loads_extensions()
        if other is None:
            self.assertIn("use a Python built with them", result.stderr)
        else:
            self.assertIn(f"run it with {other}, which can", result.stderr)
            self.assertTrue(loads_extensions(other), f"{other} was named but cannot load them")
        self.assert_nothing_written()

    def test_a_python_without_the_extension_is_told_to_install_it(self):
        python = python_that_loads_extensions()
        if python is None:
            self.skipTest("no Python on this machine loads SQLite extensions")
        if subprocess.run([python, "-s", "-c", HAS_WHEEL], timeout=30).returncode == 0:
            self.skipTest(f"{python} has litestream-vfs installed: it is not missing there")
        result = self.run_cli("--replica", "s3://bucket/state", "list", python=python)
        self.assert_one_line_error(result, f"which {python} does not have",
                                   "pip install litestream-vfs")
        result = self.run_cli("--replica", "s3://bucket/state", "list", python=python,
                              **{VFS_ENV: str(self.tmp / "no-such.so")})
        self.assert_one_line_error(result, f"{VFS_ENV}={self.tmp / 'no-such.so'}: no such file")
        self.assert_nothing_written()

    def test_a_library_that_is_no_extension_is_refused_by_name(self):
        python = python_that_loads_extensions()
        if python is None:
            self.skipTest("no Python on this machine loads SQLite extensions")
        not_an_extension = self.tmp / "not-an-extension.so"
        not_an_extension.write_bytes(b"\x7fELF but not really")
        result = self.run_cli("--replica", "s3://bucket/state", "list", python=python,
                              **{VFS_ENV: str(not_an_extension)})
        self.assert_one_line_error(result, f"{python} could not load {not_an_extension}")
        self.assertEqual(sorted(p.name for p in self.tmp.iterdir()), ["not-an-extension.so"])


if __name__ == "__main__":
    unittest.main()


class TornReads(TempDirTestCase):
    """A replica connection that meets "malformed" reads once more on a fresh connection: the
    VFS can hand one read pages of two replica states. Here the first connection each reader
    opens reads a copy whose messages table has a garbage page, as such a read would see it."""

    def test_a_read_that_meets_a_torn_page_set_is_read_again_on_a_fresh_connection(self):
        import shutil
        import sqlite3

        from hermes_state import SessionDB
        from hermes_state_replica import FollowingConnection
        good = self.tmp / "good.db"
        with SessionDB(good, journal="delete") as db:
            db.create_session("s", "cli")
            db.append_messages_batch("s", [{"role": "user", "content": f"m{i} " * 20}
                                           for i in range(300)])
        torn = self.tmp / "torn.db"
        shutil.copyfile(good, torn)
        with contextlib.closing(sqlite3.connect(good)) as conn:
            root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'messages'"
                                ).fetchone()[0]
            page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        with open(torn, "r+b") as handle:
            handle.seek((root - 1) * page_size)
            handle.write(b"\x0d" + b"\xff" * 50)
        opened = []

        def factory(target, **kwargs):
            if target == ":memory:":
                return sqlite3.connect(target, **kwargs)
            kwargs["uri"] = True

            def open_connection():
                path = torn if not opened else good
                opened.append(path)
                return sqlite3.connect(path.as_uri() + "?mode=ro", **kwargs)
            return FollowingConnection(open_connection)

        with SessionDB(good, read_only=True, connection_factory=factory) as db:
            with self.assertLogs("hermes_state", "INFO") as logs:
                self.assertEqual(len(db.get_messages("s")), 300)
        self.assertEqual(opened[:2], [torn, good])
        self.assertIn("torn page set", "\n".join(logs.output))

    def test_a_bare_sql_logic_error_reopens_and_a_named_fault_does_not(self):
        import sqlite3

        from hermes_state_replica import FollowingConnection
        opened = []

        def open_connection():
            opened.append(sqlite3.connect(":memory:"))
            return opened[-1]
        conn = FollowingConnection(open_connection)
        self.addCleanup(lambda: [c.close() for c in opened])
        with self.assertLogs("hermes_state", "INFO"):  # (the VFS's read failing with no word)
            self.assertTrue(conn.reopen_after(sqlite3.OperationalError("SQL logic error")))
        self.assertEqual(len(opened), 2)
        with self.assertRaises(sqlite3.OperationalError) as bad_sql:
            conn.execute("SELECT * FROM nosuch")
        self.assertFalse(conn.reopen_after(bad_sql.exception))  # bad SQL names its fault
        self.assertEqual(len(opened), 2)
