"""The PID namespace stamp on lock and lease holders, against this machine's /proc."""

import os
import subprocess
import sys
import unittest
from unittest import mock

import hermes_state_pidns
from hermes_state_pidns import (
    holder_namespace_token, holder_pid_checkable, persistent_record_pidns_checkable,
    pid_namespace_id,
)
from test_support import REPO

HAS_PIDNS = sys.platform.startswith("linux") and os.path.exists("/proc/self/ns/pid")


@unittest.skipUnless(HAS_PIDNS, "PID namespaces are Linux's")
class OnLinux(unittest.TestCase):

    def test_the_namespace_is_the_inode_of_proc_self_ns_pid(self):
        self.assertEqual(pid_namespace_id(), str(os.stat("/proc/self/ns/pid").st_ino))
        self.assertEqual(holder_namespace_token(), f":pidns={os.stat('/proc/self/ns/pid').st_ino}")

    def test_a_child_process_stamps_the_same_namespace(self):
        code = "import sys; sys.path.insert(0, sys.argv[1]); import hermes_state_pidns as p;" \
               " print(p.holder_namespace_token())"
        child = subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True,
                               text=True, timeout=60, check=True)
        self.assertEqual(child.stdout.strip(), holder_namespace_token())

    def test_only_a_holder_stamped_with_our_namespace_may_be_probed(self):
        ours = f"pid={os.getpid()}{holder_namespace_token()}:turn=t1"
        self.assertTrue(holder_pid_checkable(ours))
        self.assertTrue(holder_pid_checkable(f"pid=1{holder_namespace_token()}"))
        self.assertFalse(holder_pid_checkable(f"pid={os.getpid()}:pidns=1:turn=t1"))
        self.assertFalse(holder_pid_checkable(f"pid={os.getpid()}:turn=t1"))  # unstamped: its TTL
        self.assertFalse(holder_pid_checkable(f"pid=1:xpidns={pid_namespace_id()}"))
        self.assertFalse(holder_pid_checkable(""))

    def test_a_record_without_expiry_is_probed_unless_stamped_elsewhere(self):
        self.assertTrue(persistent_record_pidns_checkable(None))
        self.assertTrue(persistent_record_pidns_checkable(pid_namespace_id()))
        self.assertFalse(persistent_record_pidns_checkable("1"))


class WithoutNamespaces(unittest.TestCase):

    def test_another_platform_stamps_nothing_and_probes_every_pid(self):
        with mock.patch.object(sys, "platform", "darwin"), \
                mock.patch.object(hermes_state_pidns, "_resolved", []):
            self.assertIsNone(pid_namespace_id())
            self.assertEqual(holder_namespace_token(), "")
            self.assertTrue(holder_pid_checkable("pid=12:turn=t1"))
            self.assertTrue(holder_pid_checkable("pid=12:pidns=99:turn=t1"))


if __name__ == "__main__":
    unittest.main()
