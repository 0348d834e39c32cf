"""Gateway coordination through the store: routing entries, turn leases, handoffs
between the CLI and a gateway, and the repairs of gateway sessions."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import unittest

from hermes_state import SessionDB
from hermes_state_errors import SessionTurnLeaseLostError
from test_support import REPO, StoreTestCase, backdate

# Each process opens the store, says it is ready, waits for the go file, then claims.
CLAIMER = """
import os, sys, time
from hermes_state import SessionDB
db = SessionDB(sys.argv[1])
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.001)
print("won" if db.claim_handoff("s") else "lost", flush=True)
db.close()
"""


# Each process opens the store, says it is ready, waits for the go file, then tries the lease.
LEASE_TAKER = """
import os, sys, time
from hermes_state import SessionDB
db = SessionDB(sys.argv[1])
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.001)
holder = f"pid={os.getpid()}:turn=1"
print("won" if db.try_acquire_session_turn_lease("tip", holder) else "lost", flush=True)
db.close()
"""

# Takes the lease and holds it until stdin closes, then releases it (or is killed first).
LEASE_HOLDER = """
import os, sys
from hermes_state import SessionDB
db = SessionDB(sys.argv[1])
holder = f"pid={os.getpid()}:turn=1"
print("held" if db.try_acquire_session_turn_lease("s", holder, ttl_seconds=600) else "refused", flush=True)
sys.stdin.read()
db.release_session_turn_lease("s", holder)
db.close()
"""


def stop(proc):
    """Kill a helper process if it still runs, and close its pipes."""
    proc.kill()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe and not pipe.closed:
            pipe.close()
    proc.wait()


def dead_pid():
    """The id of a process that has exited (and been reaped)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    return int(child.stdout)



def race_four_processes(test, script):
    """Start four processes on test.path; once all say "ready", let them race; exactly one says "won"."""
    barrier = test.tmp / "go"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(test.path), str(barrier)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for proc in procs:
        test.assertEqual(proc.stdout.readline().strip(), "ready")
    barrier.touch()
    results = [proc.communicate(timeout=60) for proc in procs]
    test.assertEqual(sorted(out.strip() for out, _err in results), ["lost", "lost", "lost", "won"],
                     [err for _out, err in results])

class TurnLeases(StoreTestCase):

    def lease(self):
        return [tuple(row) for row in self.raw(self.path).execute(
            "SELECT conversation_id, holder, expires_at - acquired_at FROM session_turn_leases")]

    def test_one_holder_at_a_time_until_it_releases(self):
        self.db.create_session("s", "cli")
        self.assertTrue(self.db.try_acquire_session_turn_lease("s", "a"))
        self.assertFalse(self.db.try_acquire_session_turn_lease("s", "b"))
        self.assertTrue(self.db.try_acquire_session_turn_lease("s", "a"), "holding it already is holding it")
        self.assertIsNone(self.db.release_session_turn_lease("s", "b"), "another holder's release is a no-op")
        self.assertFalse(self.db.try_acquire_session_turn_lease("s", "b"))
        self.db.release_session_turn_lease("s", "a")
        self.db.release_session_turn_lease("s", "a")
        self.assertTrue(self.db.try_acquire_session_turn_lease("s", "b"))

    def test_refresh_extends_only_the_holders_lease(self):
        self.db.create_session("s", "cli")
        self.db.try_acquire_session_turn_lease("s", "a", ttl_seconds=10)
        self.assertTrue(self.db.try_acquire_session_turn_lease("s", "a", ttl_seconds=99))
        self.assertAlmostEqual(self.lease()[0][2], 10, delta=0.5, msg="re-acquiring does not extend it")
        self.assertTrue(self.db.refresh_session_turn_lease("s", "a", ttl_seconds=50))
        self.assertAlmostEqual(self.lease()[0][2], 50, delta=0.5)
        self.assertFalse(self.db.refresh_session_turn_lease("s", "b"))
        self.db.release_session_turn_lease("s", "a")
        self.assertFalse(self.db.refresh_session_turn_lease("s", "a"))

    def test_the_lease_belongs_to_the_compression_root_and_a_branch_has_its_own(self):
        self.db.create_session("root", "cli")
        self.db.end_session("root", "compression")
        self.db.create_session("tip", "cli", parent_session_id="root")
        self.db.create_session("branch", "cli", parent_session_id="tip", model_config={"_branched_from": "tip"})
        self.assertTrue(self.db.try_acquire_session_turn_lease("tip", "a"))
        self.assertFalse(self.db.try_acquire_session_turn_lease("root", "b"))
        self.assertTrue(self.db.refresh_session_turn_lease("root", "a"))
        self.assertTrue(self.db.try_acquire_session_turn_lease("branch", "b"))
        self.assertEqual(sorted(row[:2] for row in self.lease()), [("branch", "b"), ("root", "a")])
        self.db.release_session_turn_lease("root", "a")
        self.assertEqual([row[:2] for row in self.lease()], [("branch", "b")])

    def test_an_expired_lease_or_a_dead_holders_lease_is_taken_over(self):
        self.assertTrue(self.db.try_acquire_session_turn_lease("s", "pid=1:turn=1", ttl_seconds=0))
        time.sleep(0.15)  # the ttl counts as at least 0.1 s
        self.assertTrue(self.db.try_acquire_session_turn_lease("s", f"pid={dead_pid()}:turn=2", ttl_seconds=600))
        self.assertTrue(self.db.try_acquire_session_turn_lease("s", "c"), "its process has exited")
        mine = f"pid={os.getpid()}:turn=3"
        self.assertTrue(self.db.try_acquire_session_turn_lease("t", mine))
        self.assertFalse(self.db.try_acquire_session_turn_lease("t", "d"), "this process is never presumed dead")

    def test_no_id_or_holder_is_no_lease_and_a_bad_ttl_raises_before_writing(self):
        self.db.create_session("s", "cli")
        for session_id, holder in (("", "a"), (None, "a"), ("s", ""), ("s", None)):
            self.assertFalse(self.db.try_acquire_session_turn_lease(session_id, holder))
            self.assertFalse(self.db.refresh_session_turn_lease(session_id, holder))
            self.assertIsNone(self.db.release_session_turn_lease(session_id, holder))
        with self.assertRaises(ValueError):
            self.db.try_acquire_session_turn_lease("s", "a", ttl_seconds="soon")
        with self.assertRaises(TypeError):
            self.db.acquire_session_turn_lease("s", "a", ttl_seconds=None)
        self.assertEqual(self.lease(), [])

    def test_acquire_waits_with_notices_until_the_lease_is_free_or_time_is_up(self):
        self.db.try_acquire_session_turn_lease("s", "a")
        notices, start = [], time.monotonic()
        self.assertFalse(self.db.acquire_session_turn_lease(
            "s", "b", wait_seconds=0.5, poll_interval_seconds=0.1, wait_notice_interval_seconds=0.2,
            on_wait=notices.append))
        self.assertGreaterEqual(time.monotonic() - start, 0.5)
        self.assertEqual([round(n, 1) for n in notices], [0.0, 0.2, 0.4])
        self.assertTrue(self.db.acquire_session_turn_lease("free", "b", wait_seconds=0))
        self.assertFalse(self.db.acquire_session_turn_lease("s", "b", wait_seconds=0))

    def test_acquire_stops_when_asked_and_survives_failing_callbacks(self):
        self.db.try_acquire_session_turn_lease("s", "a")
        start = time.monotonic()
        self.assertFalse(self.db.acquire_session_turn_lease("s", "b", should_abort=lambda: True))
        self.assertFalse(self.db.acquire_session_turn_lease("s", "b", wait_seconds=0.05,
                                                           should_abort=lambda: 1 / 0, on_wait=lambda _: 1 / 0))
        self.assertLess(time.monotonic() - start, 5)

    def test_acquire_keeps_waiting_through_a_store_locked_past_the_write_budget(self):
        impatient = SessionDB(self.path, write_budget=0.2)
        self.addCleanup(impatient.close)
        blocker = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self.addCleanup(blocker.close)
        blocker.execute("BEGIN IMMEDIATE")
        unlock = threading.Timer(0.8, blocker.execute, ("COMMIT",))
        unlock.start()
        self.addCleanup(unlock.cancel)
        started = time.monotonic()
        self.assertTrue(impatient.acquire_session_turn_lease("s", "a", wait_seconds=30, poll_interval_seconds=0.05))
        self.assertGreaterEqual(time.monotonic() - started, 0.7)

    def test_a_store_busy_past_the_patience_calls_on_contended_not_on_wait(self):
        blocker = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self.addCleanup(blocker.close)
        blocker.execute("BEGIN IMMEDIATE")
        unlock = threading.Timer(0.6, blocker.execute, ("COMMIT",))
        unlock.start()
        self.addCleanup(unlock.cancel)
        contended, notices = [], []
        self.assertTrue(self.db.acquire_session_turn_lease(
            "s", "a", wait_seconds=30, poll_interval_seconds=0.05, acquire_patience_s=0.1,
            on_wait=notices.append, on_contended=lambda: contended.append(1)))
        self.assertGreaterEqual(len(contended), 1)
        self.assertEqual(notices, [], "a busy store is no other holder")
        self.assertEqual(self.lease()[0][:2], ("s", "a"))
        # A failing callback is logged, not raised; a held lease is a wait, not contention.
        self.assertFalse(self.db.acquire_session_turn_lease(
            "s", "b", wait_seconds=0.1, poll_interval_seconds=0.02, on_contended=lambda: 1 / 0,
            on_wait=notices.append))
        self.assertEqual(len(notices), 1)

    def test_a_refresh_waits_for_a_busy_store_only_as_long_as_its_patience(self):
        self.assertTrue(self.db.try_acquire_session_turn_lease("s", "a", ttl_seconds=10))
        blocker = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self.addCleanup(blocker.close)
        blocker.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with self.assertRaises(sqlite3.OperationalError):
            self.db.refresh_session_turn_lease("s", "a", ttl_seconds=100, patience_s=0.2)
        self.assertLess(time.monotonic() - started, 3)
        blocker.execute("COMMIT")
        self.assertTrue(self.db.refresh_session_turn_lease("s", "a", ttl_seconds=100, patience_s=1))
        self.assertGreater(self.lease()[0][2], 90)

    def test_a_write_of_a_holder_whose_lease_was_taken_over_is_refused(self):
        self.db.create_session("s", "cli")
        self.db.try_acquire_session_turn_lease("s", "a", ttl_seconds=0)
        self.db.append_message("s", "user", "first turn", turn_lease_holder="a")
        time.sleep(0.15)
        self.assertTrue(self.db.try_acquire_session_turn_lease("s", "b"))
        with self.assertRaises(SessionTurnLeaseLostError):
            self.db.append_message("s", "assistant", "late reply", turn_lease_holder="a")
        self.assertEqual([m["content"] for m in self.db.get_messages("s")], ["first turn"])

    def test_of_four_processes_taking_one_turn_lease_exactly_one_wins(self):
        self.db.create_session("root", "cli")
        self.db.end_session("root", "compression")
        self.db.create_session("tip", "cli", parent_session_id="root")
        race_four_processes(self, LEASE_TAKER)
        self.assertEqual([row[0] for row in self.lease()], ["root"])

    def holder_process(self):
        proc = subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, str(self.path)], cwd=REPO, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.addCleanup(stop, proc)
        self.assertEqual(proc.stdout.readline().strip(), "held")
        return proc

    def test_a_waiting_process_gets_the_lease_when_the_holding_process_releases_it(self):
        proc = self.holder_process()
        self.assertFalse(self.db.try_acquire_session_turn_lease("s", "waiter"))
        started, waits = time.monotonic(), []
        release = time.monotonic() + 0.5

        def on_wait(elapsed):
            waits.append(elapsed)

        def release_when_due():
            if time.monotonic() >= release and proc.stdin and not proc.stdin.closed:
                proc.stdin.close()
            return False

        self.assertTrue(self.db.acquire_session_turn_lease("s", "waiter", wait_seconds=30, poll_interval_seconds=0.05,
                                                           on_wait=on_wait, should_abort=release_when_due))
        self.assertGreaterEqual(time.monotonic() - started, 0.5)
        self.assertTrue(waits)
        self.assertEqual(proc.wait(timeout=30), 0)

    @unittest.skipIf(sys.platform == "win32", "SIGKILL")
    def test_a_killed_holders_lease_is_taken_at_once_not_after_its_ttl(self):
        proc = self.holder_process()
        self.assertFalse(self.db.try_acquire_session_turn_lease("s", "next"))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self.assertTrue(self.db.try_acquire_session_turn_lease("s", "next"))

    def test_a_holder_stamped_by_another_pid_namespace_waits_for_its_expiry(self):
        # Its pid means another process there: probing it here could end a live turn.
        foreign = f"pid={dead_pid()}:pidns=1:turn=x"
        self.assertTrue(self.db.try_acquire_session_turn_lease("s", foreign, ttl_seconds=600))
        self.assertFalse(self.db.try_acquire_session_turn_lease("s", "next"))
        from hermes_state_pidns import holder_namespace_token
        if holder_namespace_token():  # ours: stamped with this namespace, so probed
            local = f"pid={dead_pid()}{holder_namespace_token()}:turn=y"
            self.assertTrue(self.db.try_acquire_compression_lock("t", local, ttl_seconds=600))
            self.assertTrue(self.db.try_acquire_compression_lock("t", "next"))

    def test_a_compression_lock_of_a_dead_pid_holder_is_taken_over(self):
        self.assertTrue(self.db.try_acquire_compression_lock("s", f"pid={dead_pid()}:compress", ttl_seconds=600))
        self.assertTrue(self.db.try_acquire_compression_lock("s", "pid=1:compress"))
        self.assertFalse(self.db.try_acquire_compression_lock("s", "another"))


class Routing(StoreTestCase):

    def test_routing_takes_hermes_agents_names_and_skips_what_it_skips(self):
        self.db.save_gateway_routing_entry("k1", '{"session_id": "s1"}', scope="/sessions")
        self.db.save_gateway_routing_entry("", "{}", scope="/sessions")
        self.db.save_gateway_routing_entry("k2", "", scope="/sessions")
        self.assertEqual(self.db.load_gateway_routing_entries(scope="/sessions"), {"k1": '{"session_id": "s1"}'})
        self.db.replace_gateway_routing_entries({"a": "1", "": "2", "b": ""}, scope="/other")
        self.assertEqual(self.db.load_gateway_routing_entries(scope="/other"), {"a": "1"})
        self.assertIsNone(self.db.delete_gateway_routing_entries(session_keys=["k1", "unknown"], scope="/sessions"))
        self.assertIsNone(self.db.delete_gateway_routing_entries(session_keys=[]))
        self.assertEqual(self.db.load_gateway_routing_entries(scope="/sessions"), {})
        self.assertEqual(self.db.load_gateway_routing_entries(scope="/other"), {"a": "1"})

    def test_the_entry_routing_to_a_session_is_found_in_any_scope(self):
        self.db.save_gateway_routing_entry("k1", '{"session_id": "s1", "n": 1}', scope="/a")
        self.db.save_gateway_routing_entry("k2", "not json", scope="/b")
        self.db.save_gateway_routing_entry("k3", '{"session_id": "s2"}', scope="/b")
        self.assertEqual(self.db.gateway_routing_entry_for_session("s2"), {"session_id": "s2"})
        self.assertEqual(self.db.gateway_routing_entry_for_session("s1")["n"], 1)
        self.assertIsNone(self.db.gateway_routing_entry_for_session("s3"))

    def test_rows_moved_in_keep_a_row_already_here_and_deletes_count_what_existed(self):
        self.db.save_gateway_routing_entry("k1", '{"session_id": "here"}', scope="/a")
        added = self.db.insert_gateway_routing_rows_if_absent([
            ("/a", "k1", '{"session_id": "moved"}', 5.0), ("/a", "k2", '{"session_id": "s2"}', 6.0)])
        self.assertEqual(added, 1)
        rows = self.db.list_gateway_routing_rows()
        self.assertEqual([(r["scope"], r["session_key"], json.loads(r["entry_json"])["session_id"]) for r in rows],
                         [("/a", "k1", "here"), ("/a", "k2", "s2")])
        self.assertEqual(rows[1]["updated_at"], 6.0)
        self.assertEqual(self.db.delete_gateway_routing_rows([("/a", "k2"), ("/a", "nope"), ("/b", "k1")]), 1)
        self.assertEqual([r["session_key"] for r in self.db.list_gateway_routing_rows()], ["k1"])
        self.assertEqual(self.db.insert_gateway_routing_rows_if_absent([]), 0)
        self.assertEqual(self.db.delete_gateway_routing_rows([]), 0)

    def test_backend_heartbeats_are_upserted_then_cleared(self):
        conn = self.raw(self.path)
        self.assertFalse(self.db.clear_backend_heartbeat("gw@host:1"))
        self.db.register_backend_heartbeat(backend_id="gw@host:1", pid=1, started_at=10.0, last_heartbeat=11.0,
                                           profile="work", host="host")
        self.db.register_backend_heartbeat(backend_id="gw@host:1", pid=2, started_at=12.0)
        self.db.register_backend_heartbeat(backend_id="", pid=3, started_at=1.0)
        rows = conn.execute("SELECT backend_id, pid, started_at, profile, host FROM gateway_heartbeats").fetchall()
        self.assertEqual([tuple(r) for r in rows], [("gw@host:1", 2, 12.0, "", "")])
        self.assertGreater(conn.execute("SELECT last_heartbeat FROM gateway_heartbeats").fetchone()[0], 1e9)
        ddl = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'gateway_heartbeats'").fetchone()[0]
        self.assertTrue(ddl.startswith("CREATE TABLE gateway_heartbeats (\n    backend_id TEXT PRIMARY KEY,"))
        self.assertTrue(self.db.clear_backend_heartbeat("gw@host:1"))
        self.assertFalse(self.db.clear_backend_heartbeat("gw@host:1"))

    def test_stale_heartbeats_are_pruned_and_live_ones_listed_newest_first(self):
        now = time.time()
        for backend, beat in (("dead", now - 600), ("old", now - 90), ("live", now)):
            self.db.register_backend_heartbeat(backend_id=backend, pid=7, started_at=1.0,
                                               last_heartbeat=beat, host="h")
        self.assertEqual(self.db.prune_stale_heartbeats(max_age_seconds=0), [])
        self.assertEqual(self.db.prune_stale_heartbeats(max_age_seconds=300), ["dead"])
        listed = self.db.list_backend_heartbeats()
        self.assertEqual([row["backend_id"] for row in listed], ["live", "old"])
        self.assertEqual(set(listed[0]), {"backend_id", "pid", "started_at", "last_heartbeat",
                                          "profile", "host"})

    def test_a_reset_counts_a_conversation_boundary_for_its_peer_once(self):
        self.assertIsNone(self.db.latest_conversation_boundary("k", "telegram"))
        for n, reason in enumerate(("session_reset", "compression", "idle", "session_reset")):
            self.db.create_session(f"s{n}", "telegram", session_key="k")
            self.db.end_session(f"s{n}", reason)
            self.db.end_session(f"s{n}", "session_reset")  # already ended: no boundary
        self.assertEqual(self.db.latest_conversation_boundary("k", "telegram"), 3)
        self.db.create_session("p", "telegram", session_key="k")
        self.assertTrue(self.db.promote_to_session_reset("p"))
        self.assertEqual(self.db.latest_conversation_boundary("k", "telegram"), 4)
        self.db.delete_session("s0")  # a prune never hands a generation out again
        self.assertEqual(self.db.latest_conversation_boundary("k", "telegram"), 4)
        self.assertIsNone(self.db.latest_conversation_boundary("k", "discord"))
        self.assertIsNone(self.db.latest_conversation_boundary("", "telegram"))


class GatewaySessions(StoreTestCase):

    def make(self, session_id, source="telegram", **columns):
        self.db.create_session(session_id, source)
        if columns:
            sets = ", ".join(f"{name} = ?" for name in columns)
            with self.raw(self.path) as conn:
                conn.execute(f"UPDATE sessions SET {sets} WHERE id = ?", (*columns.values(), session_id))

    def message(self, session_id, timestamp):
        with self.raw(self.path) as conn:
            conn.execute("INSERT INTO messages (session_id, role, content, timestamp, active)"
                         " VALUES (?, 'user', 'hi', ?, 1)", (session_id, timestamp))

    def row(self, session_id, *columns):
        return tuple(self.raw(self.path).execute(f"SELECT {', '.join(columns)} FROM sessions WHERE id = ?",
                                                 (session_id,)).fetchone())

    def test_a_reset_ends_open_and_accidentally_ended_sessions_only(self):
        for sid in ("open", "closed", "reaped", "compressed", "idle"):
            self.make(sid)
        self.db.end_session("closed", "agent_close")
        self.db.end_session("reaped", "ws_orphan_reap")
        self.db.end_session("compressed", "compression")
        self.assertEqual([self.db.promote_to_session_reset(sid) for sid in ("open", "closed", "reaped", "compressed")],
                         [True, True, True, False])
        self.assertTrue(self.db.promote_to_session_reset("idle", reason="idle"))
        self.assertFalse(self.db.promote_to_session_reset("idle"), "an explicit end stays")
        self.assertFalse(self.db.promote_to_session_reset("unknown"))
        self.assertFalse(self.db.promote_to_session_reset(""))
        self.assertEqual(self.row("closed", "end_reason"), ("session_reset",))
        self.assertEqual(self.row("compressed", "end_reason"), ("compression",))
        self.assertEqual(self.row("idle", "end_reason"), ("idle",))

    def test_never_active_keyed_sessions_are_listed_and_pruned_with_their_routing(self):
        old = time.time() - 10 * 86400
        self.make("idle", session_key="k1", started_at=old, chat_id="c", chat_type="dm", user_id="u")
        self.make("pinned", session_key="k2", started_at=old, pinned=1)
        self.make("recent", session_key="k3", started_at=time.time() - 86400)
        self.make("titled", session_key="k4", started_at=old, title="kept")
        self.make("talked", session_key="k5", started_at=old)
        self.message("talked", old)
        self.make("unkeyed", started_at=old)
        listed = self.db.list_never_active_keyed_sessions(older_than_days=7)
        self.assertEqual(listed, [{"id": "idle", "session_key": "k1", "source": "telegram", "chat_id": "c",
                                   "chat_type": "dm", "user_id": "u", "started_at": old}])
        self.assertEqual([r["id"] for r in self.db.list_never_active_keyed_sessions(older_than_days="0.5")],
                         ["idle", "recent"])
        self.db.save_gateway_routing_entry("k1", json.dumps({"session_id": "idle"}), scope="/a")
        self.db.save_gateway_routing_entry("k1", json.dumps({"session_id": "idle"}), scope="/b")
        self.db.save_gateway_routing_entry("k5", json.dumps({"session_id": "talked"}), scope="/a")
        self.db.save_gateway_routing_entry("junk", "not json", scope="/a")
        self.assertEqual(self.db.prune_never_active_keyed_sessions(older_than_days=7), (1, 2))
        self.assertIsNone(self.db.get_session("idle"))
        self.assertEqual(self.db.load_gateway_routing_entries(scope="/a"),
                         {"k5": json.dumps({"session_id": "talked"}), "junk": "not json"})
        self.assertEqual(self.db.prune_never_active_keyed_sessions(older_than_days=7), (0, 0))

    def orphans(self, **kwargs):
        return {r["orphan_id"]: (r["donor_id"], r["evidence"], r["adoptable"], r["reason"])
                for r in self.db.find_orphaned_gateway_sessions(**kwargs)}

    def test_orphans_are_matched_to_the_one_keyed_session_they_continue(self):
        t = time.time() - 5000
        self.make("donor", session_key="kd", user_id="u", started_at=t, chat_id="c", chat_type="dm")
        self.message("donor", t + 10)
        self.make("orphan", user_id="u", started_at=t + 60)
        self.message("orphan", t + 100)
        self.make("child", source="discord", started_at=t + 65, parent_session_id="other")
        self.make("other", source="discord", session_key="ko", started_at=t - 4000)
        self.make("lost", source="slack", started_at=t + 70)
        self.make("branch", started_at=t + 70, model_config='{"_branched_from": "donor"}')
        self.make("tool", source="tool", started_at=t + 70)
        for sid in ("child", "lost", "branch", "tool"):
            self.message(sid, t + 100)
        found = self.db.find_orphaned_gateway_sessions()
        self.assertEqual([r["orphan_id"] for r in found], ["orphan", "child", "lost"])
        self.assertEqual(found[0], {"orphan_id": "orphan", "source": "telegram", "message_count": 1,
                                    "started_at": t + 60, "last_active": t + 100, "donor_id": "donor",
                                    "session_key": "kd", "evidence": "contiguity", "adoptable": True, "reason": ""})
        self.assertEqual(self.orphans()["child"], ("other", "lineage", True, ""))
        self.assertFalse(self.orphans()["lost"][2])
        self.assertIn("within 900s", self.orphans()["lost"][3])
        self.assertIn("within 1s", self.orphans(max_gap_s=1)["orphan"][3])

    def test_an_orphan_with_two_candidates_or_a_contested_donor_is_not_adoptable(self):
        t = time.time() - 5000
        for sid in ("d1", "d2"):
            self.make(sid, session_key=sid, started_at=t)
        self.make("o1", started_at=t + 30)
        self.message("o1", t + 100)
        self.assertIn("more than one keyed predecessor", self.orphans()["o1"][3])
        self.make("o2", started_at=t + 40, parent_session_id="d1")
        self.message("o2", t + 100)
        self.db.end_session("d2", "session_reset")
        with self.raw(self.path) as conn:
            conn.execute("UPDATE sessions SET session_key = NULL WHERE id = 'd2'")
        found = self.orphans()
        self.assertEqual([found["o1"][0], found["o2"][0]], ["d1", "d1"])
        self.assertFalse(found["o1"][2] or found["o2"][2])
        self.assertIn("claims this predecessor", found["o1"][3])

    def test_adoption_stamps_the_donors_identity_and_retires_the_donor(self):
        self.make("donor", session_key="kd", chat_id="c", chat_type="dm", user_id="u", origin_json='{"o": 1}',
                  display_name="D")
        self.make("orphan", user_id="own")
        self.make("elsewhere", source="discord")
        for args in (("orphan", "orphan"), ("", "donor"), ("unknown", "donor"), ("donor", "orphan"),
                     ("elsewhere", "donor")):
            self.assertFalse(self.db.adopt_orphaned_gateway_session(*args), args)
        self.assertTrue(self.db.adopt_orphaned_gateway_session("orphan", "donor"))
        self.assertEqual(self.row("orphan", "session_key", "chat_id", "chat_type", "user_id", "origin_json",
                                  "display_name", "parent_session_id"),
                         ("kd", "c", "dm", "own", '{"o": 1}', "D", "donor"))
        self.assertEqual(self.row("donor", "end_reason"), ("superseded_by_repair",))
        self.assertFalse(self.db.adopt_orphaned_gateway_session("orphan", "donor"), "already keyed")

    def test_a_runtime_lock_merges_into_model_config_and_clears_the_cached_prompt(self):
        self.db.create_session("s", "api", model="m0", model_config={"_branched_from": "x"}, system_prompt="P")
        self.db.update_session_runtime_lock("s", model="m1", provider="p", model_options={"t": 1},
                                            route_source="ui", confirmed=1)
        model, config, prompt, digest = self.row("s", "model", "model_config", "system_prompt", "system_prompt_hash")
        config = json.loads(config)
        self.assertEqual((model, prompt, digest), ("m1", None, None))
        self.assertEqual(config["_branched_from"], "x")
        self.assertEqual({k: v for k, v in config["browser_model_lock"].items() if k != "updated_at"},
                         {"provider": "p", "model": "m1", "model_options": {"t": 1}, "route_source": "ui",
                          "confirmed": True})
        self.assertEqual(self.raw(self.path).execute("SELECT COUNT(*) FROM system_prompts").fetchone()[0], 0)
        self.db.update_session_runtime_lock("s")
        self.assertEqual(self.row("s", "model"), ("m1",), "no model keeps the model")
        self.assertIsNone(self.db.update_session_runtime_lock("unknown", model="m"))
        self.assertIsNone(self.db.get_session("unknown"))
        with self.assertRaises(TypeError):
            self.db.update_session_runtime_lock("s", model="m2", model_options={"x": object()})
        self.assertEqual(self.row("s", "model"), ("m1",))

    def test_the_gateway_runtime_of_a_row_prefers_the_recorded_route(self):
        runtime = SessionDB.session_gateway_runtime
        route = {"provider": "p", "base_url": "u", "api_mode": None}
        cases = [
            (None, {}), ({}, {}), ({"model_config": "not json"}, {}),
            ({"model_config": json.dumps({"gateway_runtime": route, "provider": "top"})},
             {"provider": "p", "base_url": "u"}),
            ({"model_config": {"provider": "top", "api_mode": "chat", "base_url": ""}},
             {"provider": "top", "api_mode": "chat"}),
            ({"model_config": None, "billing_provider": " openrouter "}, {"provider": "openrouter"}),
            ({"billing_provider": "Auto"}, {}),
            ({"model_config": json.dumps({"gateway_runtime": {"base_url": "b", "x": None}}),
              "billing_provider": "custom"}, {"base_url": "b"}),
        ]
        for meta, expected in cases:
            self.assertEqual(runtime(meta), expected, meta)
        self.assertEqual(self.db.session_gateway_runtime({"billing_provider": "x"}), {"provider": "x"})


class GatewayPeers(GatewaySessions):
    """The names the gateway reaches through getattr: a name missing here turns recovery off silently."""

    def peer(self, session_id, key, **columns):
        fields = dict(source="telegram", user_id="u", chat_id="100", chat_type="dm", thread_id=None)
        fields.update(columns)
        self.db.record_gateway_session_peer(session_id, session_key=key, **fields)

    def test_recording_a_peer_sets_the_identity_keeps_a_name_not_given_and_creates_a_missing_row(self):
        self.make("s")
        self.peer("s", "k", display_name="Ann", origin_json='{"o": 1}')
        self.peer("s", "k", user_id=None, chat_id="101")
        self.assertEqual(self.row("s", "session_key", "user_id", "chat_id", "display_name", "origin_json"),
                         ("k", None, "101", "Ann", '{"o": 1}'))
        self.peer("lost", "k2", display_name="Bob")
        self.assertEqual(self.row("lost", "source", "session_key", "chat_id", "display_name"),
                         ("telegram", "k2", "100", "Bob"))
        self.assertIsNotNone(self.row("lost", "started_at")[0])
        self.peer("", "k3")
        self.peer("nokey", "")
        self.assertIsNone(self.db.get_session("nokey"))

    def test_the_transport_profile_is_kept_and_a_peer_row_takes_its_source(self):
        self.make("s")
        self.peer("s", "k", transport_profile="work")
        self.peer("s", "k")
        self.assertEqual(self.row("s", "transport_profile", "created_source"), ("work", "telegram"))
        self.peer("s", "k", transport_profile="home")
        self.peer("lost", "k2", transport_profile="work")
        self.assertEqual(self.row("s", "transport_profile"), ("home",))
        self.assertEqual(self.row("lost", "transport_profile", "created_source"), ("work", "telegram"))

    def test_the_gateway_input_owner_is_found_on_accepted_user_rows_only(self):
        self.make("s")
        owner = {"gateway_input_owner": "run-1"}
        self.db.append_message("s", "assistant", "a", display_metadata={"gateway_input_owner": "run-2"})
        self.db.append_message("s", "user", "seen", observed=True, display_metadata={"gateway_input_owner": "run-3"})
        self.db.append_message("s", "user", "hi", display_metadata=owner)
        self.assertTrue(self.db.has_gateway_input_owner("s", "run-1"))
        self.assertFalse(self.db.has_gateway_input_owner("s", "run-2"))
        self.assertFalse(self.db.has_gateway_input_owner("s", "run-3"))
        self.assertFalse(self.db.has_gateway_input_owner("other", "run-1"))
        self.db.archive_and_compact("s", [{"role": "user", "content": "summary"}])
        self.assertTrue(self.db.has_gateway_input_owner("s", "run-1"), "a compacted row still counts")

    def test_recording_with_ancestors_keys_the_compression_parents_but_not_a_branch_or_a_missing_row(self):
        self.make("root")
        self.db.end_session("root", "compression")
        self.make("mid", parent_session_id="root")
        self.db.end_session("mid", "compression")
        self.make("tip", parent_session_id="mid")
        self.make("branch", parent_session_id="tip", model_config='{"_branched_from": "tip"}')
        self.peer("tip", "k", include_compression_ancestors=True)
        self.assertEqual([self.row(sid, "session_key")[0] for sid in ("root", "mid", "tip")], ["k", "k", "k"])
        self.db.end_session("tip", "compression")
        self.peer("branch", "k2", include_compression_ancestors=True)
        self.assertEqual(self.row("tip", "session_key"), ("k",))
        self.peer("ghost", "k3", include_compression_ancestors=True)
        self.assertIsNone(self.db.get_session("ghost"))

    def test_the_latest_recoverable_row_of_a_key_prefers_messages_and_stops_at_a_later_reset(self):
        self.make("empty", session_key="k", started_at=time.time())
        self.make("talked", session_key="k", started_at=time.time() - 60)
        self.message("talked", time.time() - 50)
        self.make("other", source="slack", session_key="k")
        found = self.db.find_latest_gateway_session_for_peer(source="telegram", session_key="k")
        self.assertEqual((found["id"], found["_has_messages"]), ("talked", 1))
        self.db.end_session("talked", "agent_close")
        self.assertEqual(self.db.find_latest_gateway_session_for_peer(source="telegram", session_key="k")["id"],
                         "talked")
        with self.raw(self.path) as conn:
            conn.execute("UPDATE sessions SET end_reason = 'compression' WHERE id = 'talked'")
        self.assertEqual(self.db.find_latest_gateway_session_for_peer(source="telegram", session_key="k")["id"],
                         "empty", "a deliberate end is not recovered")
        self.make("reset", session_key="k")
        self.db.end_session("reset", "session_reset")
        self.assertIsNone(self.db.find_latest_gateway_session_for_peer(source="telegram", session_key="k"))
        self.assertIsNone(self.db.find_latest_gateway_session_for_peer(source="telegram", session_key=None))

    def test_without_a_keyed_row_the_whole_peer_with_messages_is_recovered(self):
        self.make("quiet", session_key="old", user_id="u", chat_id="100", chat_type="dm")
        self.make("chat", session_key="old", user_id="u", chat_id="100", chat_type="dm", thread_id="t")
        self.message("chat", time.time())
        peer = dict(source="telegram", session_key="new", user_id="u", chat_id="100", chat_type="dm")
        self.assertIsNone(self.db.find_latest_gateway_session_for_peer(**peer))
        self.assertEqual(self.db.find_latest_gateway_session_for_peer(thread_id="t", **peer)["id"], "chat")
        self.assertIsNone(self.db.find_latest_gateway_session_for_peer(
            source="telegram", session_key="new", user_id="u", chat_id="100", thread_id="t"),
            "without chat_type only the key is looked up")

    def test_a_session_is_found_by_origin_unless_another_user_makes_it_ambiguous(self):
        self.make("ann", session_key="k1", user_id="ann", chat_id="100", started_at=1000.0)
        self.make("unkeyed", user_id="ann", chat_id="100")
        self.make("ended", session_key="k0", user_id="ann", chat_id="100")
        self.db.end_session("ended", "idle")
        self.assertEqual(self.db.find_session_by_origin(platform="TELEGRAM", chat_id=100), "ann")
        self.assertEqual(self.db.find_session_by_origin(platform="telegram", chat_id="100", user_id="bob"), "ann")
        self.make("bob", session_key="k2", user_id="bob", chat_id="100", thread_id="t", started_at=2000.0)
        self.assertEqual(self.db.find_session_by_origin(platform="telegram", chat_id="100", user_id="ann"), "ann")
        self.assertIsNone(self.db.find_session_by_origin(platform="telegram", chat_id="100", user_id="eve"))
        self.assertIsNone(self.db.find_session_by_origin(platform="telegram", chat_id="100"))
        self.assertEqual(self.db.find_session_by_origin(platform="telegram", chat_id="100", thread_id="t"), "bob")
        self.assertIsNone(self.db.find_session_by_origin(platform="telegram", chat_id=""))
        self.assertIsNone(self.db.find_session_by_origin(platform="", chat_id="100"))

    def test_the_hygiene_failure_streak_counts_per_chat_until_reset(self):
        self.assertEqual([self.db.increment_hygiene_failure_streak(k) for k in ("a", "a", "b", "a")], [1, 2, 1, 3])
        self.assertIsNone(self.db.reset_hygiene_failure_streak("a"))
        self.assertEqual(self.db.increment_hygiene_failure_streak("a"), 1)
        self.assertEqual(self.db.increment_hygiene_failure_streak(""), 1)
        self.db.reset_hygiene_failure_streak("")
        rows = self.raw(self.path).execute("SELECT * FROM gateway_hygiene_state ORDER BY session_key").fetchall()
        self.assertEqual([tuple(r) for r in rows], [("a", 1), ("b", 1)])


class Handoffs(StoreTestCase):

    def state(self):
        return self.db.get_handoff_state("s")

    def test_a_handoff_goes_pending_running_completed(self):
        self.db.create_session("s", "cli")
        self.assertEqual(self.state(), {"state": None, "platform": None, "error": None})
        self.assertTrue(self.db.request_handoff("s", "telegram"))
        self.assertFalse(self.db.request_handoff("s", "discord"), "a handoff in flight is not replaced")
        self.assertEqual([row["id"] for row in self.db.list_pending_handoffs()], ["s"])
        self.assertTrue(self.db.claim_handoff("s"))
        self.assertFalse(self.db.claim_handoff("s"))
        self.assertEqual(self.db.list_pending_handoffs(), [])
        self.db.complete_handoff("s")
        self.assertEqual(self.state(), {"state": "completed", "platform": "telegram", "error": None})
        self.assertTrue(self.db.request_handoff("s", "discord"), "a finished handoff can be requested again")

    def test_a_failed_handoff_keeps_the_first_500_characters_of_its_error(self):
        self.db.create_session("s", "cli")
        self.db.request_handoff("s", "telegram")
        self.db.fail_handoff("s", "x" * 600)
        self.assertEqual(self.state()["state"], "failed")
        self.assertEqual(len(self.state()["error"]), 500)
        self.assertTrue(self.db.request_handoff("s", "telegram"))
        self.assertIsNone(self.state()["error"])

    def test_a_waiter_fails_only_a_handoff_no_gateway_has_claimed(self):
        self.db.create_session("s", "cli")
        self.assertFalse(self.db.has_pending_handoffs())
        self.db.request_handoff("s", "telegram")
        self.assertTrue(self.db.has_pending_handoffs())
        self.db.claim_handoff("s")
        self.assertFalse(self.db.has_pending_handoffs())
        self.assertFalse(self.db.fail_handoff("s", "timed out", only_states=("pending",)))
        self.assertEqual(self.state()["state"], "running")
        self.assertTrue(self.db.fail_handoff("s", "gateway died"))
        self.assertEqual(self.state(), {"state": "failed", "platform": "telegram", "error": "gateway died"})
        self.db.request_handoff("s", "telegram")
        self.assertTrue(self.db.fail_handoff("s", "timed out", only_states=["pending", "running"]))
        self.assertFalse(self.db.fail_handoff("nope", "x"))

    def test_unknown_sessions(self):
        self.assertIsNone(self.db.get_handoff_state("nope"))
        self.assertFalse(self.db.request_handoff("nope", "telegram"))
        self.assertFalse(self.db.claim_handoff("nope"))

    def test_pending_handoffs_are_listed_oldest_first_with_their_prompt(self):
        self.db.create_session("new", "cli", system_prompt="be brief")
        self.db.create_session("old", "cli")
        backdate(self.db, "new", 200.0)
        backdate(self.db, "old", 100.0)
        for sid in ("new", "old"):
            self.db.request_handoff(sid, "slack")
        rows = self.db.list_pending_handoffs()
        self.assertEqual([row["id"] for row in rows], ["old", "new"])
        self.assertEqual(rows[1]["system_prompt"], "be brief")

    def test_of_four_processes_claiming_one_handoff_exactly_one_wins(self):
        self.db.create_session("s", "cli")
        self.db.request_handoff("s", "telegram")
        race_four_processes(self, CLAIMER)
        self.assertEqual(self.state()["state"], "running")
