"""The command line on stores it must not change: read commands on hermes-agent's stores, a
missing path, a file that is not a store, and a store the user may only read (run as an
unprivileged user)."""

import hashlib
import http.client
import json
import os
import shutil
import socket
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

from hermes_state import SessionDB, choose_journal_policy
from test_support import REPO, V22_DB, V26_DB, TempDirTestCase, fixture_path

V31_DB = "hermes_v31_store.db"
READS = (("stats",), ("doctor",), ("list",), ("search", "会话"),
         ("show", "bench_000001", "--lineage"), ("export", "OUT"))
WRITES = (("import", "EXPORT"), ("delete", "bench_000001", "--yes"),
          ("prune", "--older-than", "1", "--yes"), ("optimize",), ("optimize-storage", "--yes"))


def folder_state(folder):
    """{name: sha256} of every file in `folder`."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).iterdir())}


# Root runs the CLI as user nobody: it loads the modules first (this Python may live where nobody
# cannot read, as pyenv's under /root does; textwrap is what argparse's help loads late,
# importlib.metadata what the first read loads to learn the host release, and the rest what the
# store loads where it uses it: an export's upgraded copy stamps a uuid in a temporary folder),
# then drops to nobody before the command touches any file.
AS_NOBODY = ("import os, sys\n"
             "import hermes_state_cli, hermes_state_server, textwrap, importlib.metadata\n"
             "import base64, hashlib, random, tempfile, uuid\n"
             "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
             "sys.exit(hermes_state_cli.main(sys.argv[1:]))\n")


def resolve(args, out):
    """`args` with OUT and EXPORT replaced by an output path and hermes-agent's jsonl export."""
    export = fixture_path("hermes_v26_export.jsonl")
    return [out if a == "OUT" else export if a == "EXPORT" else a for a in args]


class CliTestCase(TempDirTestCase):
    unprivileged = False

    def run_cli(self, *args, stdin=None):
        env = dict(os.environ, HERMES_HOME=str(self.tmp / "home"), PYTHONPATH=str(REPO))
        start = ["-c", AS_NOBODY] if self.unprivileged else ["-m", "hermes_state"]
        return subprocess.run([sys.executable, *start, *map(str, args)], capture_output=True,
                              text=True, env=env, cwd=self.tmp, timeout=120, input=stdin)

    def each_read(self, name, path):
        """Run every read command on the store `path`, each in a subTest that first checks exit 0;
        yields each result for the caller's own checks (exports go to <name>-<command>.jsonl)."""
        for args in READS:
            with self.subTest(store=name, command=args[0]):
                out = self.tmp / f"{name}-{args[0]}.jsonl"
                result = self.run_cli("--db", path, *resolve(args, out))
                self.assertEqual(result.returncode, 0, result.stderr)
                yield result


class CommandLineReads(CliTestCase):

    def test_read_commands_leave_hermes_agent_stores_byte_for_byte(self):
        for name in (V22_DB, V26_DB, V31_DB):
            folder = self.tmp / name.split(".")[0]
            folder.mkdir()
            path = folder / "state.db"
            shutil.copyfile(fixture_path(name), path)
            before = folder_state(folder)
            for result in self.each_read(name, path):
                self.assertNotIn("Traceback", result.stderr)
                after = folder_state(folder)
                # SQLite's reader makes an empty -wal and its -shm index beside a WAL store;
                # nothing else.
                self.assertEqual({k: v for k, v in after.items() if k in before}, before)
                self.assertLessEqual(set(after) - set(before), {"state.db-wal", "state.db-shm"})
                if "state.db-wal" in after:
                    self.assertEqual((folder / "state.db-wal").stat().st_size, 0)
            export = self.tmp / f"{name}-export.jsonl"
            self.assertEqual(len(export.read_text(encoding="utf-8").splitlines()), 20, name)

    def test_stats_and_doctor_say_what_the_agents_open_would_change(self):
        path = self.copy_fixture(V22_DB)
        stats = json.loads(self.run_cli("--db", path, "stats", "--json").stdout)
        self.assertTrue(any(change.startswith("upgrade its schema from version 22")
                            for change in stats["agent_open_would"]), stats["agent_open_would"])
        doctor = self.run_cli("--db", path, "doctor")
        self.assertEqual(doctor.returncode, 0, doctor.stderr)
        verdict = doctor.stdout.splitlines()[0]
        expected = (f"ok: {path} is healthy (quick_check; --full also runs integrity_check); the "
                    "agent's next open will upgrade")
        self.assertTrue(verdict.startswith(expected), verdict)
        with SessionDB(path):
            pass
        again = json.loads(self.run_cli("--db", path, "stats", "--json").stdout)
        self.assertEqual(again["agent_open_would"], [])

    def test_a_missing_store_is_exit_1_and_nothing_is_made(self):
        for where in ("--db", "home"):
            for args in READS + WRITES[1:] + (("serve", "--port", "1"),):
                with self.subTest(where=where, command=args[0]):
                    prefix = ("--db", self.tmp / "mistyped" / "x.db") if where == "--db" else ()
                    result = self.run_cli(*prefix, *resolve(args, self.tmp / "out.jsonl"))
                    missing = (self.tmp / "mistyped" / "x.db" if where == "--db"
                               else self.tmp / "home" / "state.db")
                    self.assertEqual((result.returncode, result.stdout), (1, ""), result.stderr)
                    self.assertEqual(result.stderr, f"error: no store at {missing}\n")
                    self.assertEqual(sorted(p.name for p in self.tmp.iterdir()), [])

    def test_a_file_that_is_not_a_store_is_refused_and_left_as_it_was(self):
        contents = {"notes.txt": "my notes, not a database\n".encode() * 40,
                    "noise.db": os.urandom(8192), "zeroes.db": bytes(4096), "empty.db": b""}
        for name, content in contents.items():
            path = self.tmp / name
            path.write_bytes(content)
            for args in READS + WRITES:
                with self.subTest(file=name, command=args[0]):
                    result = self.run_cli("--db", path, *resolve(args, self.tmp / "out.jsonl"))
                    self.assertEqual((result.returncode, result.stdout), (1, ""), result.stderr)
                    self.assertIn(f"error: {path} is not a SQLite store", result.stderr)
                    self.assertEqual(path.read_bytes(), content)
                    made = list(contents)[:list(contents).index(name) + 1]
                    self.assertEqual(sorted(p.name for p in self.tmp.iterdir()), sorted(made))

    def test_import_into_a_missing_store_creates_it(self):
        path = self.tmp / "new" / "state.db"
        result = self.run_cli("--db", path, "import", "-",
                              stdin=fixture_path("hermes_v26_export.jsonl").read_text("utf-8"))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout, "imported 20, skipped 0, detached 0\n")

    def test_a_failed_import_into_an_empty_home_creates_nothing(self):
        home = self.tmp / "empty-home"
        home.mkdir()
        (self.tmp / "notes.txt").write_text("not json\n")
        for source, said in ((self.tmp / "missing.jsonl", "cannot read"),
                             (self.tmp / "notes.txt", "notes.txt:1: not JSON")):
            with self.subTest(source=source.name):
                result = self.run_cli("--db", home / "state.db", "import", source)
                self.assertEqual(result.returncode, 1, result.stderr)
                self.assertIn(said, result.stderr)
                self.assertEqual(sorted(p.name for p in home.iterdir()), [])


class UnprivilegedReads(CliTestCase):
    """A 0444 store in a 0555 folder, read by a user who owns neither (root drops to nobody in the
    child)."""

    def setUp(self):
        super().setUp()
        if os.name != "posix":
            self.skipTest("POSIX permissions")
        if os.geteuid() == 0:
            self.unprivileged = True
            probe = self.run_cli("--help")
            if probe.returncode:
                self.skipTest("cannot run the command line as user nobody: "
                              f"{probe.stderr[-200:]!r}")
        else:
            self.unprivileged = False  # already a user the folder's modes apply to
        os.chmod(self.tmp, 0o777)  # nobody writes its exports here

    def read_only_folder(self, name):
        folder = self.tmp / name
        folder.mkdir()
        shutil.copyfile(fixture_path(name), folder / "state.db")
        os.chmod(folder / "state.db", 0o444)
        os.chmod(folder, 0o555)
        self.addCleanup(os.chmod, folder, 0o755)
        return folder

    def test_read_commands_on_a_store_the_user_may_only_read(self):
        for name in (V22_DB, V31_DB):  # a WAL store and a rollback-journal one
            folder = self.read_only_folder(name)
            path = folder / "state.db"
            before = folder_state(folder)
            for _result in self.each_read(name, path):
                self.assertEqual(folder_state(folder), before)
            self.assertEqual(len((self.tmp / f"{name}-export.jsonl").read_text().splitlines()), 20)
            listed = json.loads(self.run_cli("--db", path, "list", "--all", "-n", "0", "--json").stdout)
            self.assertEqual(len(listed), 20)
            # Read through immutable=1, SQLite calls any file's journal 'delete': the header says.
            stats = json.loads(self.run_cli("--db", path, "stats", "--json").stdout)
            on_disk = "wal" if path.read_bytes()[18:20] == b"\x02\x02" else "delete"
            self.assertEqual(any("switch its journal" in change
                                 for change in stats["agent_open_would"]),
                             on_disk != choose_journal_policy().mode, stats)

    def test_writes_fail_with_one_line_naming_the_store(self):
        folder = self.read_only_folder(V31_DB)
        result = self.run_cli("--db", folder / "state.db", "delete", "bench_000001", "--yes")
        self.assertEqual(result.returncode, 1)
        self.assertNotIn("Traceback", result.stderr)
        self.assertIn(str(folder / "state.db"), result.stderr)
        self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)

    def test_a_wal_with_no_shm_in_a_read_only_folder_is_refused_not_misread(self):
        src = self.tmp / "src"
        src.mkdir()
        conn = sqlite3.connect(src / "state.db")
        conn.execute("PRAGMA journal_mode=wal")
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute("CREATE TABLE sessions (id TEXT)")
        conn.execute("INSERT INTO sessions VALUES ('only-in-the-wal')")
        conn.commit()
        folder = self.tmp / "ro"
        folder.mkdir()
        shutil.copyfile(src / "state.db", folder / "state.db")
        shutil.copyfile(src / "state.db-wal", folder / "state.db-wal")
        conn.close()
        for p in folder.iterdir():
            os.chmod(p, 0o444)
        os.chmod(folder, 0o555)
        self.addCleanup(os.chmod, folder, 0o755)
        result = self.run_cli("--db", folder / "state.db", "stats")
        self.assertEqual((result.returncode, result.stdout), (1, ""))
        self.assertIn("its -wal has no -shm beside it", result.stderr)
        self.assertEqual(sorted(p.name for p in folder.iterdir()), ["state.db", "state.db-wal"])
        self.assertEqual(stat.S_IMODE(folder.stat().st_mode), 0o555)


# Root forks a reader that becomes user nobody, opens `path` read-only and counts the messages
# each time it reads a line on stdin, printing the count (or the error) and whether it reads the
# store as immutable.
READER_AS_NOBODY = ("import os, sys, pathlib\n"
                    "from hermes_state import SessionDB\n"
                    # what a read imports late (3.13's as_uri imports urllib), while it still can
                    "pathlib.Path(sys.argv[1]).resolve().as_uri()\n"
                    "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
                    "db = SessionDB(sys.argv[1], read_only=True)\n"
                    "for _ in sys.stdin:\n"
                    "    try:\n"
                    "        n = db._read_value('SELECT COUNT(*) FROM messages')\n"
                    "    except Exception as exc:\n"
                    "        n = f'{type(exc).__name__}: {exc}'\n"
                    "    print(n, bool(db._reader_flags), flush=True)\n")


class ImmutableReads(TempDirTestCase):
    """A store another user reads where it may not write is read as immutable only while nothing
    beside it changes: the owner's agent may start writing it at any time."""

    def setUp(self):
        super().setUp()
        if os.name != "posix" or os.geteuid() != 0:
            self.skipTest("needs root to read as user nobody beside a writing owner")
        os.chmod(self.tmp, 0o755)  # nobody may look in, not write

    def reader(self, path):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        child = subprocess.Popen([sys.executable, "-c", READER_AS_NOBODY, str(path)], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 stderr=subprocess.PIPE)
        for pipe in (child.stdout, child.stderr):
            self.addCleanup(pipe.close)
        self.addCleanup(child.wait, 30)
        self.addCleanup(child.stdin.close)

        def count():
            child.stdin.write("\n")
            child.stdin.flush()
            line = child.stdout.readline()
            self.assertTrue(line, child.stderr.read() if child.poll() is not None else "")
            return line.split(" ", 1)[0], child
        return count

    def store(self, folder, messages):
        folder.mkdir(mode=0o755)
        path = folder / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            db.append_messages_batch("s", [{"role": "user", "content": "x"}] * messages)
        os.chmod(path, 0o644)
        return path

    def test_a_reader_follows_the_owner_who_starts_writing_after_it_opened(self):
        path = self.store(self.tmp / "home", 200)
        self.assertEqual(sorted(p.name for p in path.parent.iterdir()), ["state.db", "state.db.lock"])
        count = self.reader(path)
        self.assertEqual(count()[0], "200")
        with SessionDB(path) as owner:  # the owner's agent starts: a -wal and -shm appear
            for _ in range(3):
                owner.append_messages_batch("s", [{"role": "user", "content": "y" * 3000}] * 40)
                for sidecar in path.parent.glob("state.db-*"):
                    os.chmod(sidecar, 0o644)
                owner._writer.execute("PRAGMA wal_checkpoint(PASSIVE)")
            self.assertEqual(count()[0], "320")
        self.assertEqual(count()[0], "320")

    def test_a_link_to_a_live_store_is_read_with_the_wal_beside_its_target(self):
        path = self.store(self.tmp / "live", 50)
        os.chmod(path.parent, 0o777)
        home = self.tmp / "home"
        home.mkdir(mode=0o755)
        (home / "state.db").symlink_to(path)
        with SessionDB(path) as owner:  # running: its newest commits are in the -wal only
            owner.append_messages_batch("s", [{"role": "user", "content": "y"}] * 50)
            for sidecar in path.parent.glob("state.db-*"):
                os.chmod(sidecar, 0o666)
            self.assertEqual(self.reader(home / "state.db")()[0], "100")

class ServeReadOnly(CliTestCase):

    def test_serve_reads_the_store_and_refuses_writes_unless_writable(self):
        folder = self.tmp / "store"
        folder.mkdir()
        path = folder / "state.db"
        shutil.copyfile(fixture_path(V26_DB), path)
        before = folder_state(folder)
        token = "t" * 40
        env = dict(os.environ, HERMES_HOME=str(self.tmp / "home"), PYTHONPATH=str(REPO),
                   HERMES_STATE_TOKEN=token)
        port = _free_port()
        server = subprocess.Popen([sys.executable, "-m", "hermes_state", "--db", str(path), "serve",
                                   "--port", str(port), "--json"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
        self.addCleanup(server.wait, 30)
        self.addCleanup(server.stderr.close)
        self.addCleanup(server.stdout.close)
        self.addCleanup(server.terminate)
        started = json.loads(server.stdout.readline())
        self.assertEqual((started["url"], started["read_only"]),
                         (f"http://127.0.0.1:{port}/", True))

        def call(method, route, body=None):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                conn.request(method, route, body=json.dumps(body) if body is not None else None,
                             headers={"Authorization": f"Bearer {token}",
                                      "Content-Type": "application/json"})
                response = conn.getresponse()
                return response.status, json.loads(response.read() or b"null")
            finally:
                conn.close()
        status, listed = call("GET", "/api/sessions?limit=50")
        self.assertEqual(status, 200)
        self.assertEqual(len(listed["sessions"]), 20)
        self.assertEqual(call("GET", "/api/search?q=parser")[0], 200)
        status, refused = call("POST", "/api/sessions/import",
                               {"sessions": [{"id": "x", "source": "cli"}]})
        self.assertEqual(status, 403)
        self.assertIn("serve --writable", refused["error"])
        server.terminate()
        server.wait(30)
        after = folder_state(folder)
        self.assertEqual({k: v for k, v in after.items() if k in before}, before)
        self.assertLessEqual(set(after) - set(before), {"state.db-wal", "state.db-shm"})


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
