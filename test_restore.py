"""A restore is all or nothing (issue 36, points 2 and 6): real backups, edited into hostile zip
files, restored with `restore --force` through the command line over a home that has a store.

Every refusal comes before anything moves and is one sentence that says nothing was restored; a
swap that fails part-way (a file the kernel will not let anyone move, `chattr +i`) is undone, and
the home is byte for byte what it was. The same through the HTTP API is in
test_hermes_state_server.py.
"""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

from hermes_state import SessionDB, restore_home
from hermes_state_archive import BACKUP_MANIFEST, name_problem
from test_support import REPO, TempDirTestCase


def home_state(home):
    """{relative path: (kind, mode, sha256 or link target)} of everything under `home`."""
    found = {}
    for path in sorted(Path(home).rglob("*")):
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            found[path.relative_to(home).as_posix()] = ("link", os.readlink(path))
        elif stat.S_ISDIR(info.st_mode):
            found[path.relative_to(home).as_posix()] = ("dir", stat.S_IMODE(info.st_mode))
        else:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            found[path.relative_to(home).as_posix()] = ("file", stat.S_IMODE(info.st_mode), digest)
    return found


def rebuild(source, target, extra=(), drop=(), listed=None):
    """A copy of the backup `source` with `extra` entries ((ZipInfo or name, bytes), each listed
    in the manifest with its true SHA-256 unless `listed` says which names to list) and without
    the members named in `drop`."""
    with zipfile.ZipFile(source) as archive:
        manifest = json.loads(archive.read(BACKUP_MANIFEST))
        members = [(info, archive.read(info)) for info in archive.infolist()
                   if info.filename not in drop and info.filename != BACKUP_MANIFEST]
    manifest["files"] = [entry for entry in manifest["files"] if entry["name"] not in drop]
    for info, data in extra:
        name = info.filename if isinstance(info, zipfile.ZipInfo) else info
        if listed is None or name in listed:
            manifest["files"].append({"name": name, "bytes": len(data),
                                      "sha256": hashlib.sha256(data).hexdigest()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate names we write on purpose
        with zipfile.ZipFile(target, "w") as archive:
            for info, data in members + list(extra):
                archive.writestr(info, data)
            archive.writestr(BACKUP_MANIFEST, json.dumps(manifest))
    return target


def special_member(name, kind, data):
    info = zipfile.ZipInfo(name)
    info.create_system = 3
    info.external_attr = (kind | 0o777) << 16
    return info, data


class RestoreCase(TempDirTestCase):

    def setUp(self):
        super().setUp()
        self.home = self.tmp / "home"
        with SessionDB(self.home / "state.db") as db:
            db.create_session("mine", "cli")
            db.append_message("mine", "user", "the store a failed restore must keep")
            (self.home / "notes.txt").write_text("my notes")
            (self.home / "sub").mkdir()
            (self.home / "sub" / "notes.txt").write_text("sub notes")
            self.backup = Path(db.backup(self.tmp / "good.zip")["archive"])
        with SessionDB(self.home / "state.db") as db:
            db.append_message("mine", "user", "written after the backup")
        # What a restore would replace differs from the archive, so a half-done swap shows.
        (self.home / "notes.txt").write_text("my newer notes")
        with zipfile.ZipFile(self.backup) as archive:
            self.store_bytes = archive.read("state.db")

    def restore(self, archive):
        env = dict(os.environ, HERMES_HOME=str(self.home), PYTHONPATH=str(REPO))
        return subprocess.run([sys.executable, "-m", "hermes_state", "restore", "--force",
                               str(archive)], capture_output=True, text=True, env=env,
                              cwd=self.tmp, timeout=120)

    def assert_refused_and_untouched(self, archive, said):
        before = home_state(self.home)
        result = self.restore(archive)
        self.assertEqual(result.returncode, 1, result.stdout)
        lines = result.stderr.splitlines()
        self.assertEqual(len([line for line in lines if line.startswith("error:")]), 1, lines)
        error = next(line for line in lines if line.startswith("error:"))
        self.assertIn(said, error)
        self.assertTrue(error.endswith("nothing was restored"), error)
        self.assertNotIn("Errno", error)
        self.assertNotIn("Traceback", result.stderr)
        self.assertEqual(home_state(self.home), before)
        with SessionDB(self.home / "state.db", read_only=True) as db:
            self.assertEqual(db.message_count("mine"), 2)


class HostileArchives(RestoreCase):

    def test_each_hostile_member_is_refused_before_anything_moves(self):
        notes = b"sub notes"
        rows = [
            # (case, extra members, dropped members, what the error says)
            ("./state.db beside state.db, the same bytes, listed",
             [("./state.db", self.store_bytes)], (), "unsafe file names ['./state.db']"),
            ("sub//notes.txt beside sub/notes.txt",
             [("sub//notes.txt", notes)], (), "unsafe file names ['sub//notes.txt']"),
            ("a '.' part", [("sub/./x.txt", b"x")], (), "unsafe file names"),
            ("a '..' part", [("sub/../escape.txt", b"x")], (), "unsafe file names"),
            ("a trailing '..'", [("sub/..", b"x")], (), "unsafe file names"),
            ("an absolute path", [("/tmp/escape.txt", b"x")], (), "unsafe file names"),
            ("a sidecar of the store", [("state.db-wal", b"x")], (), "unsafe file names"),
            ("the same name twice", [("notes.txt", b"one"), ("notes.txt", b"two")], (),
             "it names a file more than once ['notes.txt']"),
            ("the store twice", [("state.db", self.store_bytes)], (),
             "it names a file more than once ['state.db']"),
            ("a folder entry", [("sub/", b"")], (), "'sub/' is a folder entry"),
            ("a symbolic link", [special_member("link.txt", stat.S_IFLNK, b"/etc/passwd")], (),
             "'link.txt' is a symbolic link"),
            ("a fifo", [special_member("pipe", stat.S_IFIFO, b"")], (),
             "'pipe' is not a regular file"),
            ("no store", [], ("state.db",), "its files do not match its manifest, or it has no "
             "state.db"),
        ]
        for case, extra, drop, said in rows:
            with self.subTest(case):
                archive = rebuild(self.backup, self.tmp / "hostile.zip", extra, drop)
                self.assert_refused_and_untouched(archive, said)

    def test_a_manifest_naming_a_file_twice_is_refused(self):
        archive = self.tmp / "twice.zip"
        rebuild(self.backup, archive)
        with zipfile.ZipFile(archive) as source:
            manifest = json.loads(source.read(BACKUP_MANIFEST))
            members = {name: source.read(name) for name in source.namelist()}
        manifest["files"].append(dict(manifest["files"][-1]))
        members[BACKUP_MANIFEST] = json.dumps(manifest).encode()
        with zipfile.ZipFile(archive, "w") as target:
            for name, data in members.items():
                target.writestr(name, data)
        self.assert_refused_and_untouched(archive, "it names a file more than once")

    def test_the_rule_for_names(self):
        for name in ("state.db", "sub/notes.txt", "a b/c.d", "会话/记录.txt", ".hidden/x"):
            self.assertIsNone(name_problem(name), name)
        for name in ("", ".", "..", "./x", "x/.", "a//b", "a/", "/a", "a/../b", "C:x", "x/./y"):
            self.assertIsNotNone(name_problem(name), name)

    def test_a_colon_in_a_name_round_trips_and_a_drive_name_is_refused_by_backup(self):
        (self.home / "notes:2024.txt").write_text("colon")
        with SessionDB(self.home / "state.db", read_only=True) as db:
            archive = Path(db.backup(self.tmp / "colon.zip")["archive"])
        (self.home / "notes:2024.txt").unlink()
        self.assertEqual(self.restore(archive).returncode, 0)
        self.assertEqual((self.home / "notes:2024.txt").read_text(), "colon")
        (self.home / "C:x").write_text("a Windows drive's relative path")
        with SessionDB(self.home / "state.db", read_only=True) as db:
            with self.assertRaisesRegex(ValueError, r"a restore cannot put back 'C:x' \(an "
                                                    r"absolute path\); nothing was written"):
                db.backup(self.tmp / "drive.zip")
        self.assertFalse((self.tmp / "drive.zip").exists())

    def test_a_good_backup_still_restores_and_keeps_the_replaced_files(self):
        result = self.restore(self.backup)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual((self.home / "notes.txt").read_text(), "my notes")
        kept = [p for p in self.home.glob(".pre-restore-*/notes.txt")]
        self.assertEqual([p.read_text() for p in kept], ["my newer notes"])
        with SessionDB(self.home / "state.db", read_only=True) as db:
            self.assertEqual(db.message_count("mine"), 1)


class FailedSwap(RestoreCase):
    """A swap that fails part-way: `chattr +i` makes a file or folder of the home one that even
    root cannot rename or add to, so the failure comes after the store has been set aside."""

    def immutable(self, path):
        if not shutil.which("chattr") or os.name != "posix":
            self.skipTest("chattr is not here: no way to make a move fail for real")
        result = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if result.returncode:
            self.skipTest(f"chattr +i is refused here ({result.stderr.strip()}): this file "
                          "system or this user cannot make a file immutable")
        self.addCleanup(subprocess.run, ["chattr", "-i", str(path)], capture_output=True)

    def assert_put_back(self, archive):
        before = home_state(self.home)
        result = self.restore(archive)
        self.assertEqual(result.returncode, 1, result.stdout)
        error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        self.assertEqual(len(error), 1, result.stderr)
        self.assertIn("restore failed part-way", error[0])
        self.assertTrue(error[0].endswith("every file was put back as it was, nothing was "
                                          "restored"), error[0])
        self.assertEqual(home_state(self.home), before)
        with SessionDB(self.home / "state.db", read_only=True) as db:
            self.assertEqual(db.message_count("mine"), 2)

    def test_a_file_that_cannot_be_moved_aside_undoes_the_swap(self):
        self.immutable(self.home / "notes.txt")
        self.assert_put_back(self.backup)

    def test_a_folder_that_takes_no_new_file_undoes_the_swap(self):
        extra = [("sub/new.txt", b"new")]
        archive = rebuild(self.backup, self.tmp / "new-file.zip", extra)
        self.immutable(self.home / "sub")
        self.assert_put_back(archive)

    def test_the_api_raises_oserror_and_leaves_the_store(self):
        self.immutable(self.home / "notes.txt")
        before = home_state(self.home)
        with self.assertRaisesRegex(OSError, r"^restore failed part-way in .*\(\[Errno 1\] "
                                             r".*nothing was restored$"):
            restore_home(self.backup, self.home / "state.db", force=True)
        self.assertEqual(home_state(self.home), before)


class NothingCreated(TempDirTestCase):

    def test_a_refused_restore_into_a_new_home_leaves_no_folder(self):
        source = self.tmp / "source"
        with SessionDB(source / "state.db") as db:
            db.create_session("s", "cli")
            backup = Path(db.backup(self.tmp / "b.zip")["archive"])
        hostile = rebuild(backup, self.tmp / "bad.zip", [("notes.txt", b"x")], listed=())
        damaged = rebuild(backup, self.tmp / "damaged.zip", drop=("state.db",),
                          extra=[("state.db", b"not a database")])
        for archive, said in ((hostile, "do not match its manifest"),
                              (damaged, "not a SQLite database")):
            with self.subTest(archive.name):
                target = self.tmp / "new" / "deeper" / "state.db"
                with self.assertRaisesRegex(ValueError, said + ".*nothing was restored$"):
                    restore_home(archive, target)
                self.assertFalse((self.tmp / "new").exists())
