"""What `import hermes_state` loads, and what an open of a settled store does.

Not timings (those are `make bench`'s): the modules an import brings in, seen from a fresh
interpreter, and the connections and write locks an open takes, seen through a connection factory.
What only the command line, the server, redaction, backup or an async caller needs is loaded when
they run.
"""

import json
import sqlite3
import subprocess
import sys
import threading
import unittest

from hermes_state import SessionDB
from hermes_state_common import host_release, installed_version
from test_support import REPO, TempDirTestCase

# A fresh interpreter without site (whose .pth files may load anything): the modules
# `import hermes_state` added, and whether the redaction table has been compiled.
IMPORT_PROBE = """
import json, sys
before = set(sys.modules)
import hermes_state
redact = sys.modules.get("hermes_state_redact")
print(json.dumps({
    "loaded": sorted(set(sys.modules) - before),
    "redaction_compiled": bool(redact and redact.compiled_patterns.cache_info().currsize),
    "async_door": hermes_state.AsyncSessionDB.__name__,
    "host_release": sys.modules["hermes_state_common"].host_release(),
    "metadata_loaded": "importlib.metadata" in sys.modules,
}))
"""
# Loaded by what needs them: the server and AsyncSessionDB's calls (asyncio, ssl), backup and
# restore (zipfile).
NOT_AT_IMPORT = ("asyncio", "ssl", "zipfile", "hermes_state_server", "hermes_state_archive")
# Loaded where the code that needs them runs (issue 38, each a few ms of start-up): dataclasses'
# inspect, ast and dis (two records made at first use), hashlib's OpenSSL, uuid's platform, socket
# (a lock holder's host name), base64, secrets, tempfile, random, the redaction table's module.
# (glob too, but 3.13's pathlib loads it.)
LOADED_WHEN_USED = ("dataclasses", "inspect", "ast", "dis", "hashlib", "_hashlib", "uuid",
                    "platform", "socket", "base64", "secrets", "tempfile", "random",
                    "hermes_state_redact")


def probe_import(first=""):
    """IMPORT_PROBE's answer, `first` run before the import (and its modules counted)."""
    code = first + IMPORT_PROBE.replace("before = set(sys.modules)", "before = set()") \
        if first else IMPORT_PROBE
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise AssertionError(done.stderr)
    return json.loads(done.stdout.splitlines()[0])


class ImportLoadsOnlyWhatTheStoreNeeds(unittest.TestCase):

    def test_import_hermes_state_loads_no_asyncio_ssl_zipfile_and_compiles_no_redaction(self):
        found = probe_import()
        self.assertIn("sqlite3", found["loaded"])  # the probe sees what the import loads
        for name in NOT_AT_IMPORT + LOADED_WHEN_USED:
            self.assertNotIn(name, found["loaded"])
        self.assertFalse(found["redaction_compiled"])
        self.assertEqual(found["async_door"], "AsyncSessionDB")
        # Which hermes-agent hosts us (none here) is known without importlib.metadata.
        self.assertIsNone(found["host_release"])
        self.assertFalse(found["metadata_loaded"])

    def test_the_records_made_at_first_use_are_dataclasses_as_0_22_s(self):
        # hermes-agent 0.22's StorageFailure (frozen) and RewindOutcome, importable by name.
        from dataclasses import FrozenInstanceError, fields, is_dataclass

        from hermes_state_rewind import RewindOutcome
        from hermes_state_user_copy import StorageFailure, describe_storage_failure
        failure = describe_storage_failure("database is locked")
        self.assertIs(type(failure), StorageFailure)
        self.assertTrue(is_dataclass(failure))
        self.assertEqual([f.name for f in fields(StorageFailure)],
                         ["cause", "code", "gloss", "action"])
        with self.assertRaises(FrozenInstanceError):
            failure.cause = "x"
        self.assertEqual(repr(RewindOutcome([], {}, "hi", 1, 1)), "RewindOutcome(prefix=[],"
                         " live_view={}, live_text='hi', rewound_count=1, turns_undone=1)")
        self.assertEqual(RewindOutcome.__module__, "hermes_state_rewind")
        import hermes_state_rewind
        with self.assertRaises(AttributeError):
            hermes_state_rewind.NoSuchName

    def test_the_probe_sees_a_module_and_a_table_loaded_after_the_import(self):
        found = probe_import("import asyncio, hermes_state_redact\n"
                             "hermes_state_redact.redact_text('x')\n")
        self.assertIn("asyncio", found["loaded"])
        self.assertTrue(found["redaction_compiled"])


class TheHostReleaseIsReadWithoutImportlibMetadata(TempDirTestCase):

    def site_with(self, folder, version_line):
        site = self.tmp / "site"
        (site / folder).mkdir(parents=True)
        name = "PKG-INFO" if folder.endswith(".egg-info") else "METADATA"
        (site / folder / name).write_text(
            f"Metadata-Version: 2.1\nName: hermes-agent\n{version_line}\n", encoding="utf-8")
        sys.path.insert(0, str(site))
        self.addCleanup(sys.path.remove, str(site))
        host_release.cache_clear()
        self.addCleanup(host_release.cache_clear)

    def test_a_wheels_version_is_its_dist_info_folders(self):
        self.site_with("Hermes_Agent-0.20.1.2.dist-info", "Version: 0.20.1.2")
        self.assertEqual(installed_version("hermes-agent"), "0.20.1.2")
        self.assertEqual(host_release(), (0, 20))

    def test_an_egg_info_is_read_by_importlib_metadata(self):
        self.site_with("hermes_agent.egg-info", "Version: 0.22.2")
        self.assertEqual(installed_version("hermes-agent"), "0.22.2")
        self.assertEqual(host_release(), (0, 22))

    def test_no_install_is_none(self):
        self.assertIsNone(installed_version("hermes-agent-that-nobody-made"))


# The command line's `list` in a fresh interpreter: its exit status and every module it loaded.
CLI_PROBE = """
import io, json, sys
import hermes_state_cli
code = hermes_state_cli.main(sys.argv[1:], out=io.StringIO())
print(json.dumps({"code": code, "loaded": sorted(sys.modules)}))
"""


class TheCommandLineLoadsWhatItsCommandNeeds(TempDirTestCase):

    def test_list_loads_no_install_module(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s1", "cli")
        done = subprocess.run([sys.executable, "-S", "-c", CLI_PROBE, "list", "--db", str(path)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        found = json.loads(done.stdout.splitlines()[-1])
        self.assertEqual(found["code"], 0, done.stderr)
        self.assertIn("hermes_state_cli", found["loaded"])
        self.assertNotIn("hermes_state_install", found["loaded"])

    def test_a_command_line_makes_the_parser_of_its_command_only(self):
        from hermes_state_cli import build_parser
        from hermes_state_display import ParserPlan
        parser = build_parser()
        self.assertEqual(parser.parse_args(["list", "-n", "5"]).limit, 5)
        commands = next(a for a in parser._actions if a.dest == "command").choices
        self.assertEqual([name for name, sub in dict.items(commands)
                          if not isinstance(sub, ParserPlan)], ["list"])
        self.assertEqual(len(commands), 23)  # every command is still there to list and to name
        self.assertIn("--check", commands["install"].format_help())  # made when looked up


def counting_factory(opened):
    """sqlite3.connect, noting each target and the statements run on it."""
    def connect(target, *args, **kwargs):
        conn = sqlite3.connect(target, *args, **kwargs)
        statements = []
        opened.append((str(target), statements))
        conn.set_trace_callback(statements.append)
        return conn
    return connect


class OpeningASettledStore(TempDirTestCase):

    def open_and_close(self, path):
        opened = []
        SessionDB(path, connection_factory=counting_factory(opened)).close()
        return [(target, statements) for target, statements in opened
                if target != ":memory:"]  # (a custom factory's FTS5 probes)

    def test_an_open_makes_no_reader_and_takes_the_write_lock_for_its_two_passes_only(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s1", "cli")
            db.append_message("s1", "user", "hello")
        opened = self.open_and_close(path)
        self.assertEqual([target for target, _ in opened], [str(path)])  # the writer only
        statements = opened[0][1]
        self.assertEqual(statements.count("BEGIN IMMEDIATE"), 2)  # the schema and search passes
        self.assertFalse([s for s in statements
                          if s.split()[0].upper() in ("INSERT", "UPDATE", "DELETE", "CREATE")])

    def test_the_first_read_after_the_open_makes_a_reader(self):
        path = self.tmp / "state.db"
        SessionDB(path).close()
        opened = []
        with SessionDB(path, connection_factory=counting_factory(opened)) as db:
            before = [target for target, _ in opened if target != ":memory:"]
            self.assertIsNone(db.get_session("nobody"))
            after = [target for target, _ in opened if target != ":memory:"]
        self.assertEqual(len(before), 1)
        self.assertEqual(len(after), 2)
        self.assertIn("mode=ro", after[1])

    def test_a_store_with_display_rows_to_give_still_gets_them_at_open(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s1", "cli")
            db.append_message("s1", "user", "hello")
        raw = sqlite3.connect(path, isolation_level=None)
        raw.execute("UPDATE messages SET display_order = NULL, display_identity = NULL")
        raw.close()
        SessionDB(path).close()
        raw = sqlite3.connect(path)
        missing = raw.execute("SELECT COUNT(*) FROM messages WHERE display_order IS NULL"
                              " OR display_identity IS NULL").fetchone()[0]
        raw.close()
        self.assertEqual(missing, 0)

    def test_a_read_of_the_open_waits_for_another_program_s_commit_as_any_read_does(self):
        # In a rollback journal a read waits while another connection commits. The open's reads
        # borrow the writer, whose own wait is 0.1 s (writes are retried): lent, it must wait as
        # long as a reader. Here another program takes the lock just as the open's first read
        # after its two write passes starts, and holds it for half a second.
        path = self.tmp / "state.db"
        with SessionDB(path, journal="delete") as db:
            db.create_session("s1", "cli")
        other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.addCleanup(other.close)
        seen, held = {"COMMIT": 0}, threading.Event()

        def trace(statement):
            seen["COMMIT"] += statement == "COMMIT"
            if seen["COMMIT"] >= 2 and statement.startswith("SELECT") and not held.is_set():
                held.set()
                other.execute("BEGIN EXCLUSIVE")
                threading.Timer(0.5, other.execute, ("COMMIT",)).start()

        def connect(target, *args, **kwargs):
            conn = sqlite3.connect(target, *args, **kwargs)
            if target == str(path):
                conn.set_trace_callback(trace)
            return conn
        with SessionDB(path, journal="delete", connection_factory=connect) as db:
            self.assertTrue(held.is_set())
            self.assertEqual(db.get_session("s1")["id"], "s1")


if __name__ == "__main__":
    unittest.main()
