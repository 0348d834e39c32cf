"""Locks we never break, set-aside names that never collide, restores that stay safe.

On POSIX, closing any descriptor of a file drops every fcntl lock the process
holds on it, SQLite's own included. These tests hold real SQLite locks in this
process, let another process try to take them, and check that nothing we do
in between (opening a second SessionDB, doctor, stats, backup) lets it in.
They also cover what restore must never do: overwrite a kept copy, fill the
disk, widen a file's mode, or answer a damaged archive with a traceback.
"""

import ast
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

from hermes_state import SessionDB, StoreLockedError, damage_reason, restore_home, set_aside
from hermes_state_common import claim_file_beside
from test_support import REPO, TempDirTestCase

# Asks for SQLite's write lock on every line it reads and says whether it got it.
WRITE_LOCK_PROBE = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=0, isolation_level=None)
for _ in sys.stdin:
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError:
        print("refused", flush=True)
    else:
        conn.execute("ROLLBACK")
        print("granted", flush=True)
"""

OPEN_WRITE_CLOSE = """
import sys
from hermes_state import SessionDB
with SessionDB(sys.argv[1]) as db:
    db.create_session("other", "cli")
    db.append_message("other", "user", "written by another process")
"""


class OtherProcess:
    """A second interpreter that tries SQLite's write lock each time it is asked."""

    def __init__(self, path):
        self.proc = subprocess.Popen([sys.executable, "-c", WRITE_LOCK_PROBE, str(path)], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def try_write_lock(self):
        self.proc.stdin.write("try\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def stop(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


class LocksWeNeverBreak(TempDirTestCase):

    def make_store(self, **options):
        path = self.tmp / "state.db"
        with SessionDB(path, **options) as db:
            db.create_session("s", "cli")
            db.append_message("s", "user", "hello")
        return path

    def other_process(self, path):
        other = OtherProcess(path)
        self.addCleanup(other.stop)
        return other

    def assert_refused_after_each(self, other, steps):
        answers = []
        for name, step in steps:
            step()
            answers.append((name, other.try_write_lock()))
        self.assertEqual(answers, [(name, "refused") for name, _ in steps])

    def test_a_write_transaction_keeps_its_lock_while_this_process_opens_and_inspects_the_store(self):
        path = self.make_store(journal="delete")
        holder = sqlite3.connect(str(path), timeout=0, isolation_level=None)
        self.addCleanup(holder.close)
        holder.execute("BEGIN IMMEDIATE")
        other = self.other_process(path)
        self.assertEqual(other.try_write_lock(), "refused")
        looks = []

        def writable_open():
            # The open's structural pass needs the write lock the holder has: it waits, then gives up.
            with self.assertRaises(StoreLockedError):
                SessionDB(path, journal="delete", write_budget=0.3)

        self.assert_refused_after_each(other, [
            ("writable open", writable_open),
            ("read-only open", lambda: looks.append(SessionDB(path, read_only=True))),
            ("doctor", lambda: self.assertTrue(looks[0].doctor()["ok"])),
            ("stats", lambda: self.assertEqual(looks[0].stats()["sessions"], 1)),
            ("backup", lambda: looks[0].backup(self.tmp / "home.zip")),
            ("close", lambda: looks[0].close()),
        ])
        holder.execute("ROLLBACK")
        self.assertEqual(other.try_write_lock(), "granted")

    def test_a_sessiondb_in_a_write_keeps_its_lock_while_a_second_one_waits_and_gives_up(self):
        path = self.make_store(journal="delete")
        first = SessionDB(path, journal="delete")
        self.addCleanup(first.close)
        inside, leave = threading.Event(), threading.Event()
        writer = threading.Thread(target=first._execute_write,
                                  args=(lambda conn: (inside.set(), leave.wait(30)),))
        writer.start()
        self.addCleanup(writer.join)
        self.addCleanup(leave.set)
        self.assertTrue(inside.wait(10))
        other = self.other_process(path)

        def second_open():
            with self.assertRaises(StoreLockedError):
                SessionDB(path, journal="delete", write_budget=0.3)

        def read_only_look():
            with SessionDB(path, read_only=True) as look:
                self.assertTrue(look.doctor()["ok"])
                self.assertEqual(look.stats()["sessions"], 1)

        self.assert_refused_after_each(other, [
            ("second open", second_open),
            ("read-only look", read_only_look),
            ("doctor", first.doctor),
            ("stats", first.stats),
            ("backup", lambda: first.backup(self.tmp / "home.zip")),
        ])
        leave.set()
        writer.join()
        self.assertEqual(other.try_write_lock(), "granted")

    def test_a_second_open_keeps_the_wal_of_the_first_when_another_process_comes_and_goes(self):
        path = self.make_store()
        first = SessionDB(path, journal="wal")
        self.addCleanup(first.close)
        first.append_message("s", "user", "before the second open")
        second = SessionDB(path, journal="wal")
        self.addCleanup(second.close)
        visitor = subprocess.run([sys.executable, "-c", OPEN_WRITE_CLOSE, str(path)], cwd=REPO,
                                 capture_output=True, text=True, timeout=60)
        self.assertEqual(visitor.returncode, 0, visitor.stderr)
        self.assertTrue(Path(str(path) + "-wal").exists(), "the WAL was deleted under our connections")
        self.assertTrue(Path(str(path) + "-shm").exists(), "the shm was deleted under our connections")
        for i in range(30):
            (first if i % 2 else second).append_message("s", "user", f"after {i}")
        first.close()
        second.close()
        with SessionDB(path) as db:
            self.assertEqual(db.message_count("s"), 32)
            self.assertEqual(db.message_count("other"), 1)
            self.assertEqual(db.doctor()["integrity_check"], ["ok"])

    def test_a_backup_snapshots_other_sqlite_files_of_the_home_without_breaking_their_locks(self):
        path = self.make_store()
        projects = self.tmp / "projects.db"
        holder = sqlite3.connect(str(projects), timeout=0, isolation_level=None)
        self.addCleanup(holder.close)
        holder.execute("PRAGMA journal_mode=WAL")
        holder.execute("CREATE TABLE projects (name TEXT)")
        holder.execute("INSERT INTO projects VALUES ('committed')")
        holder.execute("BEGIN IMMEDIATE")
        holder.execute("INSERT INTO projects VALUES ('not yet')")
        other = self.other_process(projects)
        with SessionDB(path) as db:
            self.assert_refused_after_each(other, [("backup", lambda: db.backup(self.tmp / "home.zip"))])
        with zipfile.ZipFile(self.tmp / "home.zip") as archive:
            names = archive.namelist()
            (self.tmp / "copy.db").write_bytes(archive.read("projects.db"))
        self.assertNotIn("projects.db-wal", names)
        self.assertNotIn("projects.db-shm", names)
        copy = sqlite3.connect(str(self.tmp / "copy.db"))
        self.addCleanup(copy.close)
        self.assertEqual(copy.execute("SELECT name FROM projects").fetchall(), [("committed",)])

    def test_a_store_this_process_holds_is_never_read_raw_even_when_sqlite_rejects_it(self):
        path = self.make_store()
        with SessionDB(path) as db:
            self.assertIsNone(damage_reason(path))
            with open(path, "r+b") as damage:  # the test breaks the file (and its own locks) on purpose
                damage.write(bytes(path.stat().st_size))
            # Zeroed, but only a raw read could tell: SQLite's "not a database" is all we may know.
            self.assertEqual(damage_reason(path), "notsqlite")
            self.assertEqual(db.repairs, [])
        self.assertEqual(damage_reason(path), "zeroed")


# Every plain open in the product, and why it never touches a live store or
# its sidecars. A new one fails this list until someone writes down why it is safe.
RAW_OPENS = {
    ("hermes_state_lockguard", "_raw_store_access"): "the one raw access to a store file: refuses while this "
                                           "process holds a SQLite connection to it",
    ("hermes_state_lockguard", "_attach_lock_file"): "state.db.lock, one descriptor per process",
    ("hermes_state_archive", "sha256_file"): "backup members (never the store or a sidecar) and restore scratch",
    ("hermes_constants", "_in_container"): "/proc files, never a store",
    ("hermes_state_cli", "_read_jsonl"): "the jsonl file being imported",
    ("hermes_state_cli", "main"): "os.devnull",
    ("hermes_state_server", "ApiHandler.ops_export"): "the archive in a scratch folder",
    ("hermes_state_server", "ApiHandler.ops_import"): "the uploaded archive in a scratch folder",
    ("hermes_state_repair", "_backup_db_file"): "copies byte for byte only a file SQLite cannot read, and only "
                                                "while /proc/self/fd shows no descriptor of ours on it or a sidecar",
    ("hermes_state_repair", "_exclusive"): "state.db.repair.lock, which only repairs lock",
    ("hermes_state_holders", "_proc_argv"): "/proc/<pid>/cmdline, never a store",
    ("hermes_state_lockowners", "state_db_write_lock_holders"): "/proc/locks, never a store",
    ("hermes_state_wal", "_path_on_cross_vm_fs"): "/proc/self/mountinfo, never a store",
    ("hermes_state_install", "_read"): "hermes-agent's modules, metadata and #! scripts, our manifest "
                                       "and journal: never a store",
    ("hermes_state_install", "_copy"): "state modules into and out of the backup, never a store",
    ("hermes_state_install", "_fsync"): "a copied module or the folder holding the modules",
    ("hermes_state_install", "_write_json"): "the install's manifest in its backup folder",
    ("hermes_state_install", "_append_line"): "the install's journal in its backup folder",
    ("hermes_state_common", "claim_file_beside"): "creates a new file (O_EXCL) for a backup or a VACUUM INTO "
                                                 "copy, never opens one that exists",
}
RAW_OPENERS = {"open", "read_bytes", "read_text", "write_bytes", "write_text", "copy", "copy2",
               "copyfile", "copyfileobj", "mmap"}


def raw_opens(module_path):
    """(module, function) for every call that opens a file without SQLite."""
    found = set()

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, scope + [child.name])
                continue
            if isinstance(child, ast.Call):
                func = child.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name in RAW_OPENERS:
                    found.add((module_path.stem, ".".join(scope) or "<module>"))
            visit(child, scope)

    visit(ast.parse(module_path.read_text(encoding="utf-8")), [])
    return found


class TheRuleInTheSource(TempDirTestCase):

    def test_no_plain_open_outside_the_listed_places(self):
        found = set()
        for module in sorted(REPO.glob("hermes_*.py")):
            found |= raw_opens(module)
        unlisted = sorted(found - set(RAW_OPENS))
        self.assertEqual(unlisted, [], "a plain open() a live store could reach; read 'Locks we never "
                                       "break' in docs/design.md, then route it through _raw_store_access "
                                       "or list it in RAW_OPENS with the reason it is safe")
        self.assertEqual(sorted(set(RAW_OPENS) - found), [], "RAW_OPENS lists places that open nothing")

    def test_the_design_notes_state_the_rule(self):
        design = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
        self.assertTrue("\n## Locks we never break\n" in design, "docs/design.md has no 'Locks we never break'")


class SetAsideNames(TempDirTestCase):

    def test_a_set_aside_never_replaces_a_kept_file(self):
        path = self.tmp / "state.db"
        stamps = {time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() + d)) for d in range(3)}
        kept = {}
        for stamp in stamps:
            for suffix in ("", "-wal"):
                name = self.tmp / f"state.db.zeroed-{stamp}-{os.getpid()}.bak{suffix}"
                name.write_bytes(f"kept earlier {stamp}{suffix}".encode())
                kept[name] = name.read_bytes()
        for round_ in range(3):
            path.write_bytes(bytes(4096))
            Path(str(path) + "-wal").write_bytes(f"wal {round_}".encode())
            backup = set_aside(path, "zeroed")
            self.assertNotIn(backup, kept)
            self.assertEqual(Path(str(backup) + "-wal").read_bytes(), f"wal {round_}".encode())
            kept[backup] = backup.read_bytes()
        for name, content in kept.items():
            self.assertEqual(name.read_bytes(), content, name)
        self.assertFalse(path.exists())

    def test_a_copy_beside_the_store_claims_a_new_private_name_each_time(self):
        path = self.tmp / "state.db"
        stamp = time.strftime("%Y%m%d_%H%M%S")
        taken = self.tmp / f"state.db.copy-{stamp}"
        taken.write_bytes(b"kept earlier")
        claimed = [claim_file_beside(path, "copy") for _ in range(3)]
        self.assertEqual(len(set(claimed) | {taken}), 4)
        self.assertEqual(taken.read_bytes(), b"kept earlier")
        for name in claimed:
            self.assertEqual((name.stat().st_size, name.stat().st_mode & 0o777), (0, 0o600))


def backup_of(tmp, files, modes=None):
    """A backup archive of a home holding `files` (name -> bytes) and a small store."""
    home = tmp / "source-home"
    home.mkdir()
    for name, data in files.items():
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_bytes(data)
        if modes and name in modes:
            os.chmod(home / name, modes[name])
    with SessionDB(home / "state.db") as db:
        db.create_session("s", "cli")
        db.append_message("s", "user", "from the backup")
        db.backup(tmp / "home.zip")
    return tmp / "home.zip"


class RestoreSafety(TempDirTestCase):

    def run_cli(self, *args):
        env = dict(os.environ, HERMES_HOME=str(self.tmp / "cli-home"), PYTHONPATH=str(REPO))
        return subprocess.run([sys.executable, "-m", "hermes_state", *args], capture_output=True, text=True,
                              env=env, cwd=self.tmp, timeout=120)

    def test_two_forced_restores_in_the_same_second_keep_every_replaced_file(self):
        archive = backup_of(self.tmp, {"config.yaml": b"model: backup\n"})
        home = self.tmp / "home"
        restore_home(archive, home / "state.db")
        # Names a restore in this second (or the next two) would pick today are taken already.
        decoys = {}
        for delta in range(3):
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() + delta))
            decoys[home / f"state.db.pre-restore-{stamp}-{os.getpid()}.bak"] = b"an earlier kept store"
            decoys[home / f".pre-restore-{stamp}" / "config.yaml"] = b"an earlier kept config"
        for name, data in decoys.items():
            name.parent.mkdir(exist_ok=True)
            name.write_bytes(data)
        moved = []
        for round_ in range(2):
            (home / "config.yaml").write_bytes(f"model: live {round_}\n".encode())
            with SessionDB(home / "state.db") as db:
                db.create_session(f"live{round_}", "cli")
            moved += restore_home(archive, home / "state.db", force=True)["moved_aside"]
        self.assertEqual(len(moved), 4)
        self.assertEqual(len(set(moved)), 4)
        for name, data in decoys.items():
            self.assertEqual(name.read_bytes(), data, name)
        configs = sorted(Path(p).read_bytes() for p in moved if p.endswith("config.yaml"))
        self.assertEqual(configs, [b"model: live 0\n", b"model: live 1\n"])
        stores = [p for p in moved if p.endswith(".bak")]
        for round_, store in enumerate(stores):
            conn = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
            self.addCleanup(conn.close)
            self.assertEqual(conn.execute("SELECT count(*) FROM sessions WHERE id = ?",
                                          (f"live{round_}",)).fetchone()[0], 1)

    def test_restore_refuses_an_archive_that_unpacks_past_the_free_space_before_writing_anything(self):
        archive = backup_of(self.tmp, {"notes.txt": b"x" * 1000})
        # The central directory now claims a petabyte; zipfile would stop at that size while
        # unpacking, so the claimed sizes are what a restore must check before it starts.
        with zipfile.ZipFile(archive, "a") as claim:
            claim.getinfo("notes.txt").file_size = 1 << 50
            claim.comment = b"sizes rewritten"
        home = self.tmp / "target"
        with self.assertRaisesRegex(ValueError, r"backup refused: it unpacks to \d+ bytes.* free"):
            restore_home(archive, home / "state.db")
        self.assertFalse(home.exists())

    def test_restore_refuses_an_archive_that_unpacks_to_far_more_than_its_size(self):
        archive = self.tmp / "zeros.zip"
        zeros = bytes(1 << 20)
        digest = hashlib.sha256()
        with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as out:
            with out.open("blob.bin", "w") as member:
                for _ in range(80):
                    member.write(zeros)
                    digest.update(zeros)
            with zipfile.ZipFile(backup_of(self.tmp, {})) as good:
                out.writestr("state.db", good.read("state.db"))
                manifest = json.loads(good.read("hermes_backup.json"))
        manifest["files"].append({"name": "blob.bin", "bytes": 80 << 20, "sha256": digest.hexdigest()})
        with zipfile.ZipFile(archive, "a") as out:
            out.writestr("hermes_backup.json", json.dumps(manifest))
        self.assertLess(archive.stat().st_size, 1 << 20)
        home = self.tmp / "target"
        with self.assertRaisesRegex(ValueError, r"backup refused: it unpacks to \d+ bytes, more than 100 times"):
            restore_home(archive, home / "state.db")
        self.assertFalse(home.exists())

    def test_restore_keeps_each_mode_never_wider_and_creates_a_private_home(self):
        if os.name != "posix":
            self.skipTest("POSIX modes")
        modes = {".env": 0o600, "bin/run.sh": 0o750, "notes.txt": 0o644, "shared.txt": 0o666}
        archive = backup_of(self.tmp, {name: b"x" for name in modes}, modes)
        home = self.tmp / "new-home"
        restore_home(archive, home / "state.db")
        self.assertEqual(os.stat(home).st_mode & 0o777, 0o700)
        self.assertEqual(os.stat(home / "bin").st_mode & 0o777, 0o700)
        self.assertEqual(os.stat(home / "state.db").st_mode & 0o777, 0o600)
        got = {name: os.stat(home / name).st_mode & 0o777 for name in modes}
        self.assertEqual(got, {".env": 0o600, "bin/run.sh": 0o750, "notes.txt": 0o644, "shared.txt": 0o644})

    def damaged_archives(self):
        archive = backup_of(self.tmp, {"notes.txt": b"some notes " * 100})
        data = bytearray(archive.read_bytes())
        with zipfile.ZipFile(archive) as read:
            info = read.getinfo("notes.txt")
        name_length = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little")
        extra_length = int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
        start = info.header_offset + 30 + name_length + extra_length
        bad_stream = bytearray(data)
        bad_stream[start] = 0xFF  # deflate block type 3 does not exist: zlib.error
        bad_header = bytearray(data)
        bad_header[info.header_offset:info.header_offset + 4] = b"XXXX"  # BadZipFile
        cases = {}
        for name, content in (("bad-stream.zip", bad_stream), ("bad-header.zip", bad_header)):
            cases[name] = self.tmp / name
            cases[name].write_bytes(bytes(content))
        return cases

    def test_a_damaged_archive_is_a_clean_error_in_the_api_and_the_cli(self):
        for name, archive in self.damaged_archives().items():
            with self.subTest(name):
                home = self.tmp / ("api-" + name)
                with self.assertRaisesRegex(ValueError, "backup refused: .* is damaged"):
                    restore_home(archive, home / "state.db")
                self.assertFalse((home / "state.db").exists())
                result = self.run_cli("--db", str(self.tmp / ("cli-" + name) / "state.db"), "restore", str(archive))
                self.assertEqual(result.returncode, 1, result.stderr)
                self.assertRegex(result.stderr, r"(?m)^error: restore refused: .* is damaged")
                self.assertNotIn("Traceback", result.stderr)

    def test_restore_refuses_while_this_process_has_the_store_open(self):
        archive = backup_of(self.tmp, {})
        home = self.tmp / "home"
        restore_home(archive, home / "state.db")
        with SessionDB(home / "state.db") as db:
            db.create_session("live", "cli")
            with self.assertRaisesRegex(RuntimeError, "this process has .* open"):
                restore_home(archive, home / "state.db", force=True)
            self.assertEqual(db.session_count(), 2)
        self.assertEqual([p.name for p in home.iterdir() if "pre-restore" in p.name], [])


class DoctorOnATruncatedStore(TempDirTestCase):

    def test_doctor_prints_its_report_with_the_open_error(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            db.append_messages_batch("s", [{"role": "user", "content": "hello " * 200}] * 200)
        os.truncate(path, path.stat().st_size // 2)
        env = dict(os.environ, HERMES_HOME=str(self.tmp / "home"), PYTHONPATH=str(REPO))
        result = subprocess.run([sys.executable, "-m", "hermes_state", "--db", str(path), "doctor", "--json"],
                                capture_output=True, text=True, env=env, cwd=self.tmp, timeout=120)
        self.assertEqual(result.returncode, 1, result.stderr)
        report = json.loads(result.stdout)
        self.assertFalse(report["ok"])
        self.assertIn("malformed", report["open_error"])
        self.assertEqual(report["db_path"], str(path))
        self.assertEqual(sorted(p.name for p in self.tmp.iterdir() if ".bak" in p.name), [])
