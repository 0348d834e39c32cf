"""The terminal stays ours: a store's text reaches a person's terminal with its control
characters escaped (issue 36). Run through a real pseudo-terminal, as a person would."""

import os
import pty
import re
import select
import subprocess
import sys
import time

from hermes_state import SessionDB
from test_support import REPO, TempDirTestCase

# What a hostile transcript would plant: retitle the window, clear the screen, write the clipboard
# (OSC 52), a C1 CSI, DEL, a bell, and a carriage return that overwrites the start of its line.
HOSTILE = "cli\x1b]0;PWNED\x07\x1b[2J\x1b]52;c;ZXZpbA==\x07\x9b31m\x7f\rok"
# Bytes no output of ours may carry to a terminal: ESC, BEL, DEL, C1 (as UTF-8: C2 80-9F).
FORBIDDEN = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\xc2[\x80-\x9f]")


class TerminalOutput(TempDirTestCase):

    def setUp(self):
        super().setUp()
        self.db = str(self.tmp / "state.db")
        with SessionDB(self.db) as db:
            db.create_session("evil-1", HOSTILE, model=HOSTILE, system_prompt="s")
            db.set_session_title("evil-1", "title\x1b[8mhidden")
            db.append_message("evil-1", "user", "find nightly " + HOSTILE)
            db.append_message("evil-1", "assistant", None, tool_calls=[{
                "id": "c1", "type": "function",
                "function": {"name": "term\x1b]0;x\x07inal", "arguments": HOSTILE}}])
            db.append_message("evil-1", "tool", "out " + HOSTILE, tool_call_id="c1",
                              tool_name="term\x9bx")
            db.end_session("evil-1", "done")

    def run_on_pty(self, *args, answer=None):
        """(exit status, every byte the command wrote to its terminal, stdout and stderr)."""
        leader, follower = pty.openpty()
        env = dict(os.environ, HERMES_HOME=str(self.tmp / "home"), PYTHONPATH=str(REPO))
        child = subprocess.Popen([sys.executable, "-m", "hermes_state", "--db", self.db, *args],
                                 stdin=follower, stdout=follower, stderr=follower, env=env,
                                 cwd=self.tmp)
        os.close(follower)
        seen, deadline = b"", time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the child closed its side
                    break
                if not chunk:
                    break
                seen += chunk
                if answer is not None and seen.rstrip().endswith(b"[y/N]"):
                    os.write(leader, answer + b"\n")
                    answer = None
            elif child.poll() is not None:
                break
        os.close(leader)
        return child.wait(timeout=60), seen

    def assert_clean(self, seen):
        # The terminal turns each "\n" into "\r\n" (onlcr); any other "\r" is ours, and forbidden.
        self.assertNotRegex(seen.replace(b"\r\n", b"\n"), b"\r")
        self.assertIsNone(FORBIDDEN.search(seen), seen)

    def test_list_show_search_stats_escape_every_control_character(self):
        for args in (("list",), ("show", "evil-1"), ("search", "nightly"), ("stats",),
                     ("search", "out", "--role", "tool")):
            with self.subTest(args=args):
                status, seen = self.run_on_pty(*args)
                self.assertEqual(status, 0, seen)
                self.assert_clean(seen)
        status, seen = self.run_on_pty("show", "evil-1")
        # Escaped, not dropped: the person sees what the store holds.
        self.assertIn(rb"cli\x1b]0;PWNED\x07", seen)
        self.assertIn(rb"term\x9bx", seen)

    def test_the_delete_confirmation_hides_no_row(self):
        status, seen = self.run_on_pty("delete", "evil-1", answer=b"n")
        self.assertEqual(status, 1, seen)
        self.assert_clean(seen)
        self.assertIn(b"evil-1", seen)
        self.assertIn(b"nothing was changed", seen)

    def test_json_stays_data(self):
        # --json is data: JSON escapes C0 itself, and a reader gets the exact text back.
        done = subprocess.run([sys.executable, "-m", "hermes_state", "--db", self.db, "list",
                               "--json"], capture_output=True, text=True, cwd=self.tmp,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("\\u001b]0;PWNED\\u0007", done.stdout)
