"""Gateway coordination through the store: handoffs between the CLI and a gateway."""

import subprocess
import sys

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
        barrier = self.tmp / "go"
        procs = [subprocess.Popen([sys.executable, "-c", CLAIMER, str(self.path), str(barrier)], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
        for proc in procs:
            self.assertEqual(proc.stdout.readline().strip(), "ready")
        barrier.touch()
        results = [proc.communicate(timeout=60) for proc in procs]
        self.assertEqual(sorted(out.strip() for out, _err in results), ["lost", "lost", "lost", "won"],
                         [err for _out, err in results])
        self.assertEqual(self.state()["state"], "running")
