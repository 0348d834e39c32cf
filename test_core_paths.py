"""Paths of the core store module that only go wrong when something else goes wrong first.

A write that gives up on another process's lock, a store closed while its caller
holds the lock, a process forked with the store open, a move onto a name that is
taken, a connection that cannot be made: each must leave this process's locks
and registries as they were, or the next write hangs or the next check lies.
Everything here is real: other processes hold the real lock file, os.fork()
forks, the failing connect is a connection factory; nothing of the store is
mocked.
"""

import os
import select
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import unittest
from pathlib import Path

import hermes_state
import hermes_state_lockguard
from hermes_state import SessionDB, StoreLockedError, restore_home
from test_support import REPO, TempDirTestCase, fork, require

POSIX_ONLY = "needs fcntl.flock and os.fork (POSIX)"
DEADLINE = 20.0  # seconds a healthy step gets before the test calls it hung; a pass takes far less
CHILD_BUDGET = 5.0  # a forked child's write budget: well inside DEADLINE, so its refusal reaches the parent

# Holds or probes `<store>.lock` with flock, as another process's WriterFileLock does, one command a line.
LOCK_FILE_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
for line in sys.stdin:
    command = line.strip()
    if command == "take":
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
    elif command == "let go":
        fcntl.flock(fd, fcntl.LOCK_UN)
        print("free", flush=True)
    elif command == "try":
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("refused", flush=True)
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            print("granted", flush=True)
"""


class LockFileHolder:
    """Another process with its own descriptor of a store's lock file."""

    def __init__(self, store_path):
        self.proc = subprocess.Popen([sys.executable, "-c", LOCK_FILE_HOLDER, str(store_path) + ".lock"],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def stop(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=DEADLINE)
        self.proc.stdout.close()


def in_thread(call):
    """call() in another thread of this process; its result or exception, or "hung" past DEADLINE."""
    outcome = ["hung"]

    def run():
        try:
            outcome[0] = call()
        except BaseException as exc:
            outcome[0] = exc
    worker = threading.Thread(target=run, daemon=True)  # daemon: a hung one must not keep the run alive
    worker.start()
    worker.join(DEADLINE)
    return outcome[0]


def read_line(fd, deadline):
    """One line from pipe `fd`, or what came before `deadline` or the writer's end."""
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            break
        chunk = os.read(fd, 1)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


class Forked:
    """A child made by os.fork() that runs `body(say, wait_for_go)` and exits with 0, or 1 on any error.

    `say(text)` sends the parent one line; `wait_for_go()` blocks until the parent calls `go()`. The child never
    returns into the test runner: it leaves through os._exit whatever happens."""

    def __init__(self, body):
        to_parent, from_child = os.pipe()[::-1]
        to_child_read, to_child_write = os.pipe()
        pid = fork()
        if pid == 0:
            code = 1
            try:
                os.close(from_child)
                os.close(to_child_write)
                body(lambda text: os.write(to_parent, (text + "\n").encode()),
                     lambda: os.read(to_child_read, 1))
                code = 0
            except BaseException as exc:
                os.write(to_parent, f"error {type(exc).__name__}: {exc}\n".encode())
            finally:
                os._exit(code)
        os.close(to_parent)
        os.close(to_child_read)
        self.pid, self._from_child, self._to_child = pid, from_child, to_child_write

    def hear(self):
        return read_line(self._from_child, time.monotonic() + DEADLINE)

    def go(self):
        os.write(self._to_child, b"g")

    def exit_code(self):
        """The child's exit code once it ends, or "hung" (and the child killed) past DEADLINE."""
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.pid = None
                # Python 3.8 has no os.waitstatus_to_exitcode.
                return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
            time.sleep(0.01)
        self.close()
        return "hung"

    def close(self):
        """Kill a child still running (a failed test must not leave it holding the runner's output open)."""
        if self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.pid = None
        for fd in (self._from_child, self._to_child):
            try:
                os.close(fd)
            except OSError:
                pass  # closed by an earlier call


@unittest.skipIf(sys.platform == "win32" or not hasattr(os, "fork"), POSIX_ONLY)
class SetAsideInAForkedChild(TempDirTestCase):

    def test_a_child_forked_while_a_thread_held_the_set_aside_guard_can_still_set_a_store_aside(self):
        # The guard once lived in hermes_state_lockguard' fork reset, which rebound a name there while
        # set_aside took hermes_state's own lock: the child waited for a thread it does not have.
        path = self.tmp / "state.db"
        path.write_bytes(b"not a store")
        held, release = threading.Event(), threading.Event()

        def hold():
            with hermes_state._set_aside_guard:
                held.set()
                release.wait(DEADLINE)
        holder = threading.Thread(target=hold)
        holder.start()
        self.addCleanup(holder.join)
        self.addCleanup(release.set)
        self.assertTrue(held.wait(DEADLINE))
        child = Forked(lambda say, _go: say(str(hermes_state.set_aside(path, "damaged"))))
        self.addCleanup(child.close)
        backup = child.hear()
        self.assertEqual(child.exit_code(), 0, backup)
        self.assertTrue(Path(backup).is_file(), backup)
        self.assertFalse(path.exists())


@unittest.skipIf(sys.platform == "win32" or not hasattr(os, "fork"), POSIX_ONLY)
class ACallerLockThatGivesUp(TempDirTestCase):

    def test_a_caller_refused_the_lock_file_leaves_no_thread_lock_behind_so_later_writes_go_through(self):
        path = self.tmp / "state.db"
        db = SessionDB(path, write_budget=0.3)
        self.addCleanup(db.close)
        holder = LockFileHolder(path)
        self.addCleanup(holder.stop)
        self.assertEqual(holder.ask("take"), "held")
        with self.assertRaises(StoreLockedError):
            with db._lock:
                self.fail("the caller got the lock while another process held state.db.lock")
        self.assertEqual(holder.ask("let go"), "free")

        def write_as_hermes_agent_does():
            db.create_session("after", "cli")
            with db._lock:
                db._conn.execute("UPDATE sessions SET title = 'by the caller' WHERE id = 'after'")
            return "written"
        # Another thread: the RLock is reentrant, so only another thread sees one the refusal left held.
        self.assertEqual(in_thread(write_as_hermes_agent_does), "written")
        self.assertEqual(db.get_session("after")["title"], "by the caller")


@unittest.skipIf(sys.platform == "win32" or not hasattr(os, "fork"), POSIX_ONLY)
class ClosingInsideTheCallerLock(TempDirTestCase):

    def test_closing_a_store_inside_its_caller_lock_lets_the_lock_file_go_for_other_processes_and_stores(self):
        path = self.tmp / "state.db"
        first = SessionDB(path)
        self.addCleanup(first.close)
        # A second store on the file shares the lock file's descriptor, which then stays open after the close.
        second = SessionDB(path, write_budget=0.5)
        self.addCleanup(second.close)
        holder = LockFileHolder(path)
        self.addCleanup(holder.stop)
        with first._lock:
            self.assertEqual(holder.ask("try"), "refused")
            first.close()
        self.assertEqual(holder.ask("try"), "granted")
        self.assertEqual(in_thread(lambda: second.create_session("after", "cli")), "after")


@unittest.skipIf(sys.platform == "win32" or not hasattr(os, "fork"), POSIX_ONLY)
class AForkedChild(TempDirTestCase):

    def setUp(self):
        super().setUp()
        self.path = self.tmp / "state.db"
        self.db = SessionDB(self.path, write_budget=0.3)
        self.addCleanup(self.db.close)
        self.db.create_session("parent", "cli")

    def fork(self, body):
        child = Forked(body)
        self.addCleanup(child.close)
        return child

    def test_a_child_forked_while_the_parent_holds_the_lock_waits_for_it_then_opens_and_writes_the_store(self):
        path = self.path

        def child_body(say, wait_for_go):
            try:
                SessionDB(path, write_budget=0.3)
            except StoreLockedError:
                say("refused while the parent holds the lock")
            else:
                say("opened while the parent holds the lock")
            wait_for_go()
            with SessionDB(path, write_budget=CHILD_BUDGET) as db:
                db.create_session("child", "cli")
            say("wrote")

        with self.db._lock:
            child = self.fork(child_body)
            self.assertEqual(child.hear(), "refused while the parent holds the lock")
        child.go()
        self.assertEqual(child.hear(), "wrote")
        self.assertEqual(child.exit_code(), 0)
        self.assertIsNotNone(self.db.get_session("child"))
        self.db.create_session("parent again", "cli")

    def test_a_child_holding_the_lock_keeps_its_parent_out_though_it_inherited_the_parents_lock_descriptor(self):
        path = self.path

        def child_body(say, wait_for_go):
            with SessionDB(path, write_budget=CHILD_BUDGET) as db:
                with db._lock:
                    say("holding")
                    wait_for_go()
                db.create_session("child", "cli")
            say("done")

        child = self.fork(child_body)
        self.assertEqual(child.hear(), "holding")
        with self.assertRaises(StoreLockedError):
            self.db.create_session("during", "cli")
        child.go()
        self.assertEqual(child.hear(), "done")
        self.assertEqual(child.exit_code(), 0)
        self.db.create_session("after", "cli")
        self.assertEqual([self.db.get_session(s) is not None for s in ("child", "during", "after")],
                         [True, False, True])

    def test_a_child_holds_none_of_its_parents_connections_so_it_may_open_the_store_file_itself(self):
        # POSIX locks are per process: a plain descriptor the parent closed would drop its SQLite locks, one the
        # child closes drops none (the child has none). The child's quarantine checks read the header so.
        def opened():
            return hermes_state._raw_store_access(self.path, os.O_RDONLY, lambda fd: "opened")
        self.assertIsNone(opened())
        child = self.fork(lambda say, wait_for_go: say(str(opened())))
        self.assertEqual(child.hear(), "opened")
        self.assertEqual(child.exit_code(), 0)

    def test_a_child_forked_while_the_lock_file_registry_is_busy_can_still_open_and_write_the_store(self):
        path = self.path

        def child_body(say, wait_for_go):
            with SessionDB(path, write_budget=CHILD_BUDGET) as db:
                db.create_session("child", "cli")
            say("wrote")

        # As if another thread were attaching a lock file at the fork: the child has no such thread to free it.
        with hermes_state_lockguard._lock_files_guard:
            child = self.fork(child_body)
        self.assertEqual(child.hear(), "wrote")
        self.assertEqual(child.exit_code(), 0)
        self.assertIsNotNone(self.db.get_session("child"))


def backup_archive(tmp):
    """An archive of a small home whose store holds session "s"."""
    home = tmp / "source-home"
    with SessionDB(home / "state.db") as db:
        db.create_session("s", "cli")
        return Path(db.backup(tmp / "home.zip")["archive"])


@unittest.skipIf(sys.platform == "win32", "a symlink needs privileges on Windows")
class AMoveOntoATakenName(TempDirTestCase):

    def test_a_move_onto_a_taken_name_refuses_and_moves_nothing(self):
        source, target = self.tmp / "source", self.tmp / "target"
        source.write_text("mine")
        target.write_text("theirs")
        with self.assertRaises(FileExistsError):
            hermes_state._move_without_replacing(source, target)
        self.assertEqual((source.read_text(), target.read_text()), ("mine", "theirs"))

    def test_a_restore_onto_a_dangling_state_db_link_moves_the_link_aside_and_never_follows_it(self):
        archive = backup_archive(self.tmp)
        home = self.tmp / "home"
        home.mkdir()
        elsewhere = self.tmp / "elsewhere" / "state.db"
        link = home / "state.db"
        link.symlink_to(elsewhere)
        restored = restore_home(archive, link)
        kept = Path(restored["moved_aside"][0])
        self.assertEqual((kept.parent, kept.is_symlink(), os.readlink(kept)), (home, True, str(elsewhere)))
        self.assertFalse(link.is_symlink())
        self.assertFalse(elsewhere.parent.exists())
        with SessionDB(link) as db:
            self.assertIsNotNone(db.get_session("s"))


class AConnectionThatCannotBeMade(TempDirTestCase):

    def test_a_failing_connect_at_open_leaves_the_store_counted_as_not_held(self):
        path = self.tmp / "state.db"

        def refusing_connect(database, *args, **kwargs):
            if database != ":memory:":  # the capability probes may connect; the store may not
                raise sqlite3.OperationalError("unable to open database file")
            return sqlite3.connect(database, *args, **kwargs)

        with self.assertRaisesRegex(sqlite3.OperationalError, "unable to open"):
            SessionDB(path, connection_factory=refusing_connect)
        self.assertTrue(path.exists())  # made before the connect, so the registry counted it
        # A restore refuses while this process holds a connection to the store: none must be counted.
        restored = restore_home(backup_archive(self.tmp), path)
        self.assertEqual(restored["restored"], ["state.db"])
        with SessionDB(path) as db:
            self.assertIsNotNone(db.get_session("s"))


class ASchemaChangedBehindAnOpenStore(TempDirTestCase):
    """An open store keeps what it learnt of the schema (the search indexes there) only while the
    schema cookie stays: another program's change is seen at the next call."""

    def test_a_search_index_dropped_by_another_program_is_seen_without_a_failed_query(self):
        path = self.tmp / "state.db"
        with SessionDB(path) as db:
            db.create_session("s", "cli")
            db.append_message("s", "user", "the quokka parser")
            self.assertEqual(len(db.search_messages("quokka")), 1)
            require(self, "fts5", "it drops our FTS5 word index")
            stale = "SELECT key FROM state_meta WHERE key LIKE 'hs_search_stale%'"
            before = [tuple(mark) for mark in db._read_all(stale)]  # (no trigram: marked at the open)
            other = sqlite3.connect(str(path))
            triggers = [name for (name,) in other.execute(
                "SELECT name FROM sqlite_master WHERE type = 'trigger'"
                " AND name LIKE 'messages_fts%'")]
            for name in triggers:
                other.execute(f"DROP TRIGGER {name}")
            other.execute("DROP TABLE messages_fts")
            other.commit()
            other.close()
            self.assertEqual([hit["session_id"] for hit in db.search_messages("quokka")], ["s"])
            # A query on the dropped table would have failed and marked the index stale.
            self.assertEqual([tuple(mark) for mark in db._read_all(stale)], before)


if __name__ == "__main__":
    unittest.main()
