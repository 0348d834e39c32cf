"""Home resolution: context override, HERMES_HOME, platform defaults."""

import os
import tempfile
import threading
import unittest
from pathlib import Path
from unittest import mock

from hermes_constants import (
    apply_subprocess_home_env, display_hermes_home, get_config_path,
    get_default_hermes_root, get_hermes_dir, get_hermes_home, get_hermes_home_override, get_process_hermes_home,
    get_real_home, get_subprocess_home, hermes_home_key, reset_hermes_home_override, secure_parent_dir,
    set_hermes_home_override,
)


class HermesHome(unittest.TestCase):

    def test_environment_variable_is_stripped_and_used(self):
        with mock.patch.dict(os.environ, {"HERMES_HOME": "  /srv/agent  "}):
            self.assertEqual(get_hermes_home(), Path("/srv/agent"))
            self.assertEqual(get_config_path(), Path("/srv/agent/config.yaml"))

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


class HomeFamily(unittest.TestCase):
    """The rest of hermes-agent's home-location names, with its behaviour."""

    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="hermes-home-")
        self.addCleanup(self._tmp.cleanup)
        self.tmp = Path(self._tmp.name)

    def test_process_home_ignores_the_context_override(self):
        with mock.patch.dict(os.environ, {"HERMES_HOME": "/from/env"}):
            token = set_hermes_home_override("/from/override")
            try:
                self.assertEqual(get_hermes_home_override(), "/from/override")
                self.assertEqual(get_process_hermes_home(), Path("/from/env"))
                self.assertEqual(get_config_path(), Path("/from/override/config.yaml"))
            finally:
                reset_hermes_home_override(token)
            token = set_hermes_home_override(None)
            self.assertIsNone(get_hermes_home_override())
            reset_hermes_home_override(token)

    def test_profile_root_is_the_parent_of_profiles_outside_the_default_home(self):
        with mock.patch.dict(os.environ, {"HERMES_HOME": "/opt/data/profiles/coder"}):
            self.assertEqual(get_default_hermes_root(), Path("/opt/data"))
        with mock.patch.dict(os.environ, {"HERMES_HOME": "/opt/data"}):
            self.assertEqual(get_default_hermes_root(), Path("/opt/data"))
        with mock.patch.dict(os.environ, {"HERMES_HOME": str(Path.home() / ".hermes/profiles/x")}):
            self.assertEqual(get_default_hermes_root(), Path.home() / ".hermes")

    def test_a_legacy_folder_is_used_only_when_it_holds_something(self):
        self.assertEqual(get_hermes_dir("cache/images", "image_cache", home=self.tmp),
                         self.tmp / "cache/images")
        (self.tmp / "image_cache").mkdir()
        self.assertEqual(get_hermes_dir("cache/images", "image_cache", home=self.tmp),
                         self.tmp / "cache/images")
        (self.tmp / "image_cache" / "a.png").write_bytes(b"x")
        self.assertEqual(get_hermes_dir("cache/images", "image_cache", home=self.tmp),
                         self.tmp / "image_cache")

    def test_display_form_and_key(self):
        with mock.patch.dict(os.environ, {"HERMES_HOME": str(Path.home() / ".hermes")}):
            self.assertEqual(display_hermes_home(), "~/.hermes")
        with mock.patch.dict(os.environ, {"HERMES_HOME": "/opt/custom"}):
            self.assertEqual(display_hermes_home(), "/opt/custom")
        self.assertEqual(hermes_home_key(self.tmp / "a" / ".." / "b"), os.path.normcase(str(self.tmp.resolve() / "b")))

    def test_secure_parent_dir_tightens_deep_folders_only(self):
        folder = self.tmp / "deep"
        folder.mkdir(mode=0o755)
        secure_parent_dir(folder / "file")
        self.assertEqual(folder.stat().st_mode & 0o777, 0o700)
        with mock.patch("os.chmod") as chmod:
            secure_parent_dir(Path("/usr/file"))
            chmod.assert_not_called()

    def test_subprocess_home_in_the_default_auto_mode(self):
        # A container keeps tool state in the profile home; a host keeps the user's HOME, and a HOME that
        # already points at the profile home goes back to the real one.
        profile_home = self.tmp / "home"
        profile_home.mkdir()
        env = {"HERMES_HOME": str(self.tmp), "HERMES_REAL_HOME": "/home/real"}
        with mock.patch("hermes_constants._in_container", return_value=True):
            self.assertEqual(get_subprocess_home(dict(env, HOME="/home/real")), str(profile_home))
        with mock.patch("hermes_constants._in_container", return_value=False):
            self.assertIsNone(get_subprocess_home(dict(env, HOME="/home/real")))
            self.assertIsNone(get_subprocess_home(dict(env, HOME="/somewhere/else")))
            self.assertEqual(get_subprocess_home(dict(env, HOME=str(profile_home))), "/home/real")
            self.assertEqual(get_subprocess_home(dict(env, HOME=str(profile_home), TERMINAL_HOME_MODE="unknown")),
                             "/home/real")

    def test_subprocess_home_follows_the_policy(self):
        profile_home = self.tmp / "home"
        profile_home.mkdir()
        env = {"HERMES_HOME": str(self.tmp), "HOME": str(profile_home), "HERMES_REAL_HOME": "/home/real"}
        self.assertEqual(get_subprocess_home(dict(env, TERMINAL_HOME_MODE="profile")), str(profile_home))
        self.assertEqual(get_subprocess_home(dict(env, TERMINAL_HOME_MODE="real")), "/home/real")
        self.assertEqual(get_subprocess_home(dict(env, TERMINAL_HOME_MODE="real", HOME="/home/real")), None)
        applied = dict(env, TERMINAL_HOME_MODE="host")
        apply_subprocess_home_env(applied)
        self.assertEqual((applied["HOME"], applied["HERMES_REAL_HOME"]), ("/home/real", "/home/real"))
        self.assertEqual(get_real_home(env), "/home/real")
