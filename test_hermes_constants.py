"""Home resolution: context override, HERMES_HOME, platform defaults."""

import os
import threading
import unittest
from pathlib import Path
from unittest import mock

from hermes_constants import (
    get_default_db_path, get_hermes_home, reset_hermes_home_override, set_hermes_home_override,
)


class HermesHome(unittest.TestCase):

    def test_environment_variable_is_stripped_and_used(self):
        with mock.patch.dict(os.environ, {"HERMES_HOME": "  /srv/agent  "}):
            self.assertEqual(get_hermes_home(), Path("/srv/agent"))
            self.assertEqual(get_default_db_path(), Path("/srv/agent/state.db"))

    def test_blank_environment_variable_falls_back_to_the_default(self):
        with mock.patch.dict(os.environ, {"HERMES_HOME": "   "}), mock.patch("sys.platform", "linux"):
            self.assertEqual(get_hermes_home(), Path.home() / ".hermes")

    def test_windows_default_uses_localappdata(self):
        env = {"HERMES_HOME": "", "LOCALAPPDATA": r"C:\Users\a\AppData\Local"}
        with mock.patch.dict(os.environ, env), mock.patch("sys.platform", "win32"):
            self.assertEqual(get_hermes_home(), Path(r"C:\Users\a\AppData\Local") / "hermes")
        with mock.patch.dict(os.environ, {"HERMES_HOME": "", "LOCALAPPDATA": ""}), \
                mock.patch("sys.platform", "win32"):
            self.assertEqual(get_hermes_home(), Path.home() / "AppData" / "Local" / "hermes")

    def test_override_wins_and_is_local_to_the_context(self):
        seen_elsewhere = []
        with mock.patch.dict(os.environ, {"HERMES_HOME": "/from/env"}):
            token = set_hermes_home_override("/from/override")
            try:
                self.assertEqual(get_hermes_home(), Path("/from/override"))
                self.assertNotIn("/from/override", os.environ.get("HERMES_HOME", ""))
                other = threading.Thread(target=lambda: seen_elsewhere.append(get_hermes_home()))
                other.start()
                other.join()
            finally:
                reset_hermes_home_override(token)
            self.assertEqual(get_hermes_home(), Path("/from/env"))
        self.assertEqual(seen_elsewhere, [Path("/from/env")])
