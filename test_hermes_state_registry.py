"""hermes_state_registry: one shared SessionDB per store file, reference counted, on real stores
and real threads."""

import os
import shutil
import sqlite3
import threading
import time
import unittest

import hermes_state_registry as registry
from hermes_constants import reset_hermes_home_override, set_hermes_home_override
from hermes_state import SessionDB
from test_support import TempDirTestCase, fork


class RegistryTestCase(TempDirTestCase):

    def setUp(self):
        super().setUp()
        self.addCleanup(registry.close_all)  # whatever a failing test left lent
        self.path = self.tmp / "state.db"


class Sharing(RegistryTestCase):

    def test_two_acquires_of_one_path_share_one_handle_and_count_two_references(self):
        first = registry.acquire(self.path)
        second = registry.acquire(str(self.tmp / "." / "state.db"))  # the same file, spelt otherwise
        self.assertIs(first, second)
        self.assertTrue(first._shared_registry_owned)
        self.assertEqual(registry.stats(),
                         {"live_generations": 1, "retired_generations": 0, "total_refcounts": 2})
        other = registry.acquire(self.tmp / "other.db")
        self.assertIsNot(other, first)
        self.assertEqual(registry.stats()["live_generations"], 2)

    def test_close_of_a_borrowed_handle_gives_back_one_reference_and_keeps_it_open(self):
        gateway, agent = registry.acquire(self.path), registry.acquire(self.path)
        gateway.create_session("s", "cli")
        agent.close()  # a legacy close() call site: returns its reference, closes nothing
        self.assertIsNotNone(gateway._conn)
        self.assertEqual(gateway.get_session("s")["source"], "cli")
        self.assertEqual(registry.stats()["total_refcounts"], 1)
        gateway.close()  # the last reference closes it for real
        self.assertIsNone(gateway._conn)
        self.assertFalse(gateway._shared_registry_owned)
        self.assertEqual(registry.stats()["live_generations"], 0)
        again = registry.acquire(self.path)
        self.assertIsNot(again, gateway)  # a fresh handle, not the closed one
        self.assertEqual(again.get_session("s")["source"], "cli")

    def test_with_block_on_an_acquired_handle_releases_it(self):
        holder = registry.acquire(self.path)
        with registry.acquire(self.path) as db:
            db.create_session("s", "cli")
        self.assertIsNotNone(holder._conn)
        self.assertEqual(registry.stats()["total_refcounts"], 1)

    def test_release_or_close_closes_a_handle_the_registry_did_not_lend(self):
        own = SessionDB(self.path)
        shared = registry.acquire(self.path)
        self.assertFalse(registry.release(own))
        registry.release_or_close(own)
        self.assertIsNone(own._conn)
        self.assertIsNotNone(shared._conn)  # a bare SessionDB on the same file is not the shared one
        registry.release_or_close(shared)
        self.assertIsNone(shared._conn)
        registry.release_or_close(None)  # a caller's cleanup with nothing opened

    def test_acquire_without_a_path_takes_the_homes_store(self):
        token = set_hermes_home_override(self.tmp / "home")
        self.addCleanup(reset_hermes_home_override, token)
        db = registry.acquire()
        self.assertEqual(db.db_path, (self.tmp / "home" / "state.db").resolve())
        self.assertIs(registry.acquire(self.tmp / "home" / "state.db"), db)

    def test_a_failed_open_keeps_nothing_and_the_next_acquire_tries_again(self):
        self.path.mkdir()  # a folder where the store should be: SessionDB() fails
        with self.assertRaises((sqlite3.Error, OSError)):
            registry.acquire(self.path)
        self.assertEqual(registry.stats()["live_generations"], 0)
        self.path.rmdir()
        self.assertIsNotNone(registry.acquire(self.path)._conn)


class Replacement(RegistryTestCase):

    def test_a_replaced_file_retires_the_old_handle_for_its_holders_and_lends_a_new_one(self):
        old = registry.acquire(self.path)
        old.create_session("old", "cli")
        spare = self.tmp / "spare.db"
        with SessionDB(spare) as other:
            other.create_session("new", "cli")
        for suffix in ("", "-wal", "-shm"):  # a recovery swap: the old files aside, another in
            if os.path.exists(f"{self.path}{suffix}"):
                os.rename(f"{self.path}{suffix}", f"{self.tmp / 'aside.db'}{suffix}")
        os.rename(spare, self.path)
        new = registry.acquire(self.path)
        self.assertIsNot(new, old)
        self.assertEqual(new.get_session("new")["source"], "cli")
        self.assertEqual(registry.stats(),
                         {"live_generations": 1, "retired_generations": 1, "total_refcounts": 1})
        self.assertIsNotNone(old._conn)  # its holder still works on what it opened
        old.close()
        self.assertIsNone(old._conn)
        self.assertEqual(registry.stats()["retired_generations"], 0)
        self.assertIsNotNone(new._conn)


class ClosingMany(RegistryTestCase):

    def test_close_all_under_closes_only_the_stores_in_that_folder(self):
        inside = registry.acquire(self.tmp / "profiles" / "work" / "state.db")
        registry.acquire(self.tmp / "profiles" / "work" / "state.db")  # held twice: closed anyway
        neighbour = registry.acquire(self.tmp / "profiles" / "workshop" / "state.db")
        outside = registry.acquire(self.path)
        self.assertEqual(registry.close_all_under(self.tmp / "profiles" / "work"), 1)
        self.assertIsNone(inside._conn)
        self.assertFalse(inside._shared_registry_owned)
        self.assertIsNotNone(neighbour._conn)  # a sibling whose name starts the same
        self.assertIsNotNone(outside._conn)
        shutil.rmtree(self.tmp / "profiles" / "work")  # what a profile delete does next
        self.assertEqual(registry.close_all_under(self.tmp / "profiles" / "nothing-open"), 0)
        inside.close()  # the holder's own close afterwards is harmless
        self.assertEqual(registry.close_all(), 2)
        self.assertIsNone(outside._conn)
        self.assertEqual(registry.close_all(), 0)

    def test_a_holder_using_a_handle_close_all_closed_finds_it_reopening(self):
        db = registry.acquire(self.path)
        registry.close_all()
        with self.assertLogs("hermes_state", "WARNING"):
            db.create_session("s", "cli")
        self.assertEqual(db.get_session("s")["source"], "cli")
        db.close()  # no longer lent: a plain close
        self.assertIsNone(db._conn)

    def test_borrowed_handles_stay_open_through_the_block_though_their_owner_lets_go(self):
        owner = registry.acquire(self.path)
        with registry.borrow_live_shared_session_dbs() as dbs:
            self.assertEqual(dbs, [owner])
            self.assertEqual(registry.live_shared_session_dbs(), [owner])
            owner.close()  # the only real holder leaves mid-maintenance
            owner.create_session("s", "cli")  # still open: the block holds a reference
            self.assertEqual(registry.stats()["total_refcounts"], 1)
        self.assertIsNone(owner._conn)
        self.assertEqual(registry.live_shared_session_dbs(), [])

    def test_a_borrow_block_that_raises_gives_its_references_back(self):
        owner = registry.acquire(self.path)
        with self.assertRaises(RuntimeError):
            with registry.borrow_live_shared_session_dbs():
                raise RuntimeError("maintenance failed")
        self.assertEqual(registry.stats()["total_refcounts"], 1)
        self.assertIsNotNone(owner._conn)


class Threads(RegistryTestCase):

    def test_threads_racing_acquire_and_release_open_one_handle_and_leave_none(self):
        opened, seen, errors = [], set(), []
        real_init = SessionDB.__init__

        def counting_init(db, *args, **kwargs):
            opened.append(1)
            real_init(db, *args, **kwargs)

        SessionDB.__init__ = counting_init
        self.addCleanup(setattr, SessionDB, "__init__", real_init)
        start = threading.Barrier(8)

        def worker(n):
            try:
                start.wait()
                for i in range(25):
                    db = registry.acquire(self.path)
                    seen.add(id(db))
                    db.create_session(f"t{n}-{i}", "cli")
                    registry.release_or_close(db)
            except Exception as exc:  # reported below: a thread's failure must fail the test
                errors.append(exc)

        holder = registry.acquire(self.path)  # keeps one handle alive through the race
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        self.assertEqual(errors, [])
        self.assertEqual(len(opened), 1)
        self.assertEqual(seen, {id(holder)})
        self.assertEqual(registry.stats()["total_refcounts"], 1)
        self.assertEqual(holder.session_count(), 200)
        holder.close()
        self.assertEqual(registry.stats()["live_generations"], 0)

    def test_threads_that_open_and_close_the_last_reference_never_share_a_closed_handle(self):
        errors = []

        def worker(n):
            try:
                for i in range(15):
                    with registry.acquire(self.path) as db:
                        db.create_session(f"c{n}-{i}", "cli")
                        self.assertIsNotNone(db.get_session(f"c{n}-{i}"))
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        self.assertEqual(errors, [])
        self.assertEqual(registry.stats()["live_generations"], 0)
        with SessionDB(self.path) as db:
            self.assertEqual(db.session_count(), 90)


class Fork(RegistryTestCase):

    @unittest.skipUnless(hasattr(os, "fork"), "os.fork")
    def test_a_child_forked_while_another_thread_held_the_registry_starts_clean(self):
        parent = registry.acquire(self.tmp / "state.db")
        held, release = threading.Event(), threading.Event()

        def hold():
            with registry._changed:
                held.set()
                release.wait(30)
        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(30)
        pid = fork()
        if pid == 0:  # the child: must neither hang on the lock nor lend the parent's handle
            try:
                child = registry.acquire(self.tmp / "state.db")
                os._exit(0 if child is not parent and registry.stats()["total_refcounts"] == 1 else 2)
            except BaseException:
                os._exit(3)
        release.set()
        holder.join(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            self.fail("the forked child hung on the registry's lock")
        self.assertEqual(os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode")
                         else status >> 8, 0)
        registry.release_or_close(parent)
