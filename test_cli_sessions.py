"""The session-management commands hermes-agent users type (`rename`, `archive`, `unarchive`,
`pin`, `unpin`, `pinned`), run as a subprocess on a real store."""

import contextlib
import json
import os
import sqlite3
import stat
import subprocess
import sys

from hermes_state import SessionDB
from test_support import REPO, TempDirTestCase, backdate


class StoreOfThree(TempDirTestCase):
    """Three ended sessions (cli, cron, cron), inactive since 1970."""

    def setUp(self):
        super().setUp()
        self.db = self.tmp / "state.db"
        with SessionDB(self.db) as db:
            for sid, source in (("alpha-1", "cli"), ("beta-2", "cron"), ("gamma-3", "cron")):
                db.create_session(sid, source)
                db.append_message(sid, "user", f"hello from {sid}")
                db.end_session(sid, "done")
                backdate(db, sid, 1_000_000)  # long inactive: started and last written then
            db._execute_write(lambda conn: conn.execute("UPDATE messages SET timestamp = 1000000"))

    def run_cli(self, *args):
        env = dict(os.environ, HERMES_HOME=str(self.tmp / "home"), PYTHONPATH=str(REPO))
        return subprocess.run([sys.executable, "-m", "hermes_state", "--db", str(self.db),
                               *args], capture_output=True, text=True, env=env, cwd=self.tmp,
                              timeout=120, stdin=subprocess.DEVNULL)

    def flags(self, sid):
        with contextlib.closing(sqlite3.connect(self.db)) as conn:
            return conn.execute("SELECT title, archived, pinned FROM sessions WHERE id = ?",
                                (sid,)).fetchone()


class SessionCommands(StoreOfThree):

    def test_rename_sets_the_title_and_refuses_what_hermes_agent_refuses(self):
        done = self.run_cli("rename", "alpha", "Release", "checklist")
        self.assertEqual((done.returncode, done.stdout), (0, "renamed alpha-1 to Release checklist\n"),
                         done.stderr)
        self.assertEqual(self.flags("alpha-1")[0], "Release checklist")
        for title, said in (("  ", "title: empty"), ("two\nlines", "title: holds a control"),
                            ("x" * 101, "100")):
            with self.subTest(title=title[:10]):
                refused = self.run_cli("rename", "beta-2", title)
                self.assertEqual(refused.returncode, 1)
                self.assertIn(said, refused.stderr)
                self.assertEqual(len(refused.stderr.strip().splitlines()), 1, refused.stderr)
                self.assertIsNone(self.flags("beta-2")[0])
        taken = self.run_cli("rename", "beta-2", "Release checklist")  # another session holds it
        self.assertEqual(taken.returncode, 1)
        self.assertIsNone(self.flags("beta-2")[0])

    def test_pin_unpin_pinned(self):
        self.assertEqual(self.run_cli("pin", "alpha-1", "gamma").returncode, 0)
        self.assertEqual((self.flags("alpha-1")[2], self.flags("gamma-3")[2]), (1, 1))
        listed = json.loads(self.run_cli("pinned", "--json").stdout)
        self.assertEqual(sorted(row["id"] for row in listed), ["alpha-1", "gamma-3"])
        self.assertEqual(self.run_cli("unpin", "gamma-3").stdout, "unpinned gamma-3\n")
        self.assertEqual([row["id"] for row in json.loads(self.run_cli("pinned", "--json").stdout)],
                         ["alpha-1"])
        # An unknown id sets nothing, not even the ids before it.
        failed = self.run_cli("pin", "beta-2", "nosuch")
        self.assertEqual(failed.returncode, 1)
        self.assertIn("no session matches 'nosuch'", failed.stderr)
        self.assertEqual(self.flags("beta-2")[2], 0)

    def test_archive_by_id_and_in_bulk_passes_over_pinned_sessions(self):
        self.assertEqual(self.run_cli("archive", "alpha-1").stdout, "archived alpha-1\n")
        self.assertEqual(self.flags("alpha-1")[1], 1)
        self.assertEqual(self.run_cli("unarchive", "alpha-1").stdout, "unarchived alpha-1\n")
        self.assertEqual(self.flags("alpha-1")[1], 0)
        self.run_cli("pin", "gamma-3")
        unasked = self.run_cli("archive", "--older-than", "1")  # no terminal, no --yes: refused
        self.assertEqual(unasked.returncode, 1)
        self.assertIn("pass --yes", unasked.stderr)
        self.assertNotIn("--dry-run", unasked.stderr)  # archive has none to offer
        self.assertEqual([self.flags(s)[1] for s in ("alpha-1", "beta-2", "gamma-3")], [0, 0, 0])
        bulk = self.run_cli("archive", "--older-than", "1", "--source", "cron", "--yes")
        self.assertEqual((bulk.returncode, bulk.stdout), (0, "archived beta-2\n"), bulk.stderr)
        self.assertEqual([self.flags(s)[1] for s in ("alpha-1", "beta-2", "gamma-3")], [0, 1, 0])
        both = self.run_cli("archive", "alpha-1", "--older-than", "1")
        self.assertEqual(both.returncode, 1)
        self.assertIn("not both", both.stderr)
        alone = self.run_cli("archive", "--source", "cron")
        self.assertEqual(alone.returncode, 1)


class SmallPromises(StoreOfThree):

    def test_version_names_release_schema_sqlite_and_python(self):
        done = self.run_cli("--version")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertRegex(done.stdout, r"^hermes_state \d{4}\.\d+\.\d+ \(schema \d+, SQLite "
                                      r"[\d.]+, Python [\d.]+\)\n$")

    def test_json_beside_another_format_is_a_usage_error(self):
        for command in (("list",), ("search", "hello")):
            with self.subTest(command=command[0]):
                done = self.run_cli(*command, "--json", "--format", "csv")
                self.assertEqual((done.returncode, done.stdout), (2, ""))
                self.assertIn("--json prints JSON and --format csv prints csv", done.stderr)
                same = self.run_cli(*command, "--json", "--format", "json")
                self.assertEqual(same.returncode, 0, same.stderr)

    def test_backup_replaces_an_existing_file_only_with_force(self):
        out = self.tmp / "home.zip"
        out.write_bytes(b"keep me")
        refused = self.run_cli("backup", str(out))
        self.assertEqual(refused.returncode, 1)
        self.assertIn("exists; pass --force", refused.stderr)
        self.assertEqual(out.read_bytes(), b"keep me")
        forced = self.run_cli("backup", str(out), "--force")
        self.assertEqual(forced.returncode, 0, forced.stderr)
        self.assertEqual(out.read_bytes()[:2], b"PK")

    def test_backup_never_follows_a_link_nor_keeps_a_files_mode(self):
        planted = self.tmp / "bashrc"
        planted.write_text("export PATH=/usr/bin\n")
        link = self.tmp / "linked.zip"
        link.symlink_to(planted)
        loose = self.tmp / "loose.zip"
        loose.write_bytes(b"old")
        os.chmod(loose, 0o644)
        for out in (link, loose):
            with self.subTest(out=out.name):
                done = self.run_cli("backup", str(out), "--force")
                self.assertEqual(done.returncode, 0, done.stderr)
                self.assertFalse(out.is_symlink())
                self.assertEqual(stat.S_IMODE(os.lstat(out).st_mode), 0o600)
                self.assertEqual(out.read_bytes()[:2], b"PK")
        self.assertEqual(planted.read_text(), "export PATH=/usr/bin\n")
        self.assertEqual(sorted(p.name for p in self.tmp.iterdir() if p.name.endswith(".part")), [])

    def test_folders_we_create_are_0700_whatever_the_umask(self):
        home = self.tmp / "a" / "b" / "home"
        code = ("import os, sys; os.umask(0); sys.path.insert(0, sys.argv[1]);"
                "from hermes_state import SessionDB; SessionDB(sys.argv[2]).close()")
        subprocess.run([sys.executable, "-c", code, str(REPO), str(home / "state.db")], check=True,
                       timeout=60)
        for folder in (self.tmp / "a", self.tmp / "a" / "b", home):
            self.assertEqual(stat.S_IMODE(os.stat(folder).st_mode), 0o700, folder)
