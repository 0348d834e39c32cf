"""Home resolution: context override, HERMES_HOME, platform defaults."""

import os
import tempfile
import threading
import unittest
from pathlib import Path
from unittest import mock

import hermes_constants
from hermes_constants import (
    apply_subprocess_home_env, assert_named_profile_home_live, display_hermes_home, get_config_path,
    get_default_hermes_root, get_hermes_dir, get_hermes_home, get_hermes_home_override, get_process_hermes_home,
    get_real_home, get_routing_process_hermes_home, get_subprocess_home, hermes_home_key, mkdir_under_hermes_home,
    named_profile_home, pin_process_hermes_home, process_hermes_home_is_pinned, profile_cli_selector,
    profile_name_for_home, reset_hermes_home_override, secure_parent_dir, set_hermes_home_override,
    sudo_invoker_default_home,
)

# The public names hermes-agent 0.22.2.post1's own hermes_constants.py defines for the home location,
# copied from that file by hand: ours defines no public name outside them, so either file serves.
HERMES_AGENT_HOME_NAMES = {
    "set_hermes_home_override", "reset_hermes_home_override", "get_hermes_home_override",
    "sudo_invoker_default_home", "get_hermes_home", "hermes_home_key", "reset_hermes_home_key_cache",
    "get_process_hermes_home", "pin_process_hermes_home", "process_hermes_home_is_pinned",
    "get_routing_process_hermes_home", "get_default_hermes_root", "named_profile_home", "profile_name_for_home",
    "assert_named_profile_home_live", "mkdir_under_hermes_home", "get_hermes_dir", "display_hermes_home",
    "profile_cli_selector", "secure_parent_dir", "get_real_home", "get_subprocess_home",
    "apply_subprocess_home_env", "get_config_path", "get_env_path",
}


class HermesHome(unittest.TestCase):

    def test_every_public_name_is_one_hermes_agents_file_defines(self):
        ours = {name for name, value in vars(hermes_constants).items()
                if not name.startswith("_") and callable(value)
                and getattr(value, "__module__", None) == "hermes_constants"}
        self.assertEqual(ours - HERMES_AGENT_HOME_NAMES, set())

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


class ProfileHomes(unittest.TestCase):
    """0.22's profile-home names: a root, its named profiles, their tombstones, the process's pin."""

    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="hermes-profiles-")
        self.addCleanup(self._tmp.cleanup)
        self.root = Path(self._tmp.name).resolve() / "data"
        (self.root / "profiles" / "coder").mkdir(parents=True)
        (self.root / "config.yaml").write_text("")
        self.coder = self.root / "profiles" / "coder"
        env = mock.patch.dict(os.environ, {"HERMES_HOME": str(self.root)})
        env.start()
        self.addCleanup(env.stop)

    def test_the_root_of_a_given_home(self):
        self.assertEqual(get_default_hermes_root(home=self.coder), self.root)
        self.assertEqual(get_default_hermes_root(home=str(self.root)), self.root)
        self.assertEqual(get_default_hermes_root(home="~/.hermes/profiles/x"), Path.home() / ".hermes")
        with mock.patch.dict(os.environ, {"HERMES_HOME": ""}):
            self.assertEqual(get_default_hermes_root(home="  "), Path.home() / ".hermes")

    def test_variables_and_tilde_in_a_home_are_expanded(self):
        with mock.patch.dict(os.environ, {"HERMES_HOME": "$HERMES_TEST_BASE/agent", "HERMES_TEST_BASE": "/srv"}):
            self.assertEqual(get_hermes_home(), Path("/srv/agent"))
            self.assertEqual(get_default_hermes_root(), Path("/srv/agent"))
        token = set_hermes_home_override("~/elsewhere")
        try:
            self.assertEqual(get_hermes_home(), Path.home() / "elsewhere")
        finally:
            reset_hermes_home_override(token)

    def test_the_data_dir_suffix_names_the_default_home(self):
        with mock.patch.dict(os.environ, {"HERMES_HOME": "", "HERMES_DATA_DIR_SUFFIX": "-dev"}), \
                mock.patch("sys.platform", "linux"):
            self.assertEqual(get_hermes_home(), Path.home() / ".hermes-dev")
            self.assertEqual(get_default_hermes_root(), Path.home() / ".hermes-dev")

    def test_display_form_of_a_given_home(self):
        self.assertEqual(display_hermes_home(Path.home() / ".hermes" / "profiles" / "coder"),
                         "~/.hermes/profiles/coder")
        self.assertEqual(display_hermes_home(home=self.coder), str(self.coder))

    def test_named_profile_home_needs_a_real_root(self):
        self.assertEqual(named_profile_home(self.coder / "cron" / "jobs.json"), self.coder)
        self.assertIsNone(named_profile_home(self.root / "profiles" / ".deleted" / "coder"))
        self.assertIsNone(named_profile_home(self.root / "notes"))
        # A path that merely has a `profiles` part, under no home, is not a profile.
        stray = Path(self._tmp.name).resolve() / "stuff" / "profiles" / "x"
        self.assertIsNone(named_profile_home(stray))
        (stray.parent / ".deleted").mkdir(parents=True)
        self.assertEqual(named_profile_home(stray), stray)
        self.assertIsNone(named_profile_home(Path.home() / ".hermes" / "skills" / "profiles" / "x" / ".hermes"))

    def test_profile_name_for_home(self):
        self.assertEqual(profile_name_for_home(self.root), "default")
        self.assertEqual(profile_name_for_home(str(self.coder)), "coder")
        self.assertEqual(profile_name_for_home(self.coder / "sub"), "coder")
        # A stored profile home names its profile by its shape, markers or not.
        self.assertEqual(profile_name_for_home("/elsewhere/profiles/ops"), "ops")
        for nothing in (None, "", "  ", "/elsewhere/plain", "/elsewhere/profiles/.hidden"):
            self.assertIsNone(profile_name_for_home(nothing), nothing)

    def test_cli_selector_names_the_current_named_profile(self):
        self.assertEqual(profile_cli_selector(), "")
        token = set_hermes_home_override(self.coder)
        try:
            self.assertEqual(profile_cli_selector(), "-p coder ")
        finally:
            reset_hermes_home_override(token)

    def test_a_missing_or_deleted_profile_is_never_brought_back(self):
        made = mkdir_under_hermes_home(self.coder / "cache" / "images")
        self.assertEqual(made, self.coder / "cache" / "images")
        self.assertTrue(made.is_dir())
        self.assertEqual(mkdir_under_hermes_home(str(self.root / "logs")), self.root / "logs")
        gone = self.root / "profiles" / "gone"
        with self.assertRaises(FileNotFoundError) as caught:
            mkdir_under_hermes_home(gone / "cache")
        self.assertEqual(str(caught.exception), f"Named profile home does not exist: {gone}. "
                                                "Create the profile explicitly before using it.")
        self.assertFalse(gone.exists())
        (self.root / "profiles" / ".deleted").mkdir()
        (self.root / "profiles" / ".deleted" / "coder").write_text("deleted\n")
        self.assertRaises(FileNotFoundError, assert_named_profile_home_live, self.coder / "x")
        self.assertRaises(FileNotFoundError, mkdir_under_hermes_home, self.coder / "new")
        self.assertFalse((self.coder / "new").exists())
        assert_named_profile_home_live(self.root / "anything")

    def test_a_pinned_home_decides_routing_and_nothing_else(self):
        self.addCleanup(pin_process_hermes_home, None)
        self.assertFalse(process_hermes_home_is_pinned())
        self.assertEqual(get_routing_process_hermes_home(), self.root)
        pin_process_hermes_home(self.coder)
        self.assertTrue(process_hermes_home_is_pinned())
        self.assertEqual(get_routing_process_hermes_home(), self.coder)
        self.assertEqual(get_process_hermes_home(), self.root)
        self.assertEqual(get_hermes_home(), self.root)
        pin_process_hermes_home(None)
        self.assertFalse(process_hermes_home_is_pinned())
        self.assertEqual(get_routing_process_hermes_home(), self.root)

    def test_sudo_invoker_home(self):
        import pwd
        other = next(entry for entry in pwd.getpwall() if entry.pw_name != "root")
        with mock.patch("os.geteuid", return_value=os.getuid() or 1000):
            self.assertIsNone(sudo_invoker_default_home())
        with mock.patch("os.geteuid", return_value=0):
            for user, expected in ((other.pw_name, Path(other.pw_dir) / ".hermes"), ("root", None), ("", None),
                                   ("no-such-user-here", None)):
                with mock.patch.dict(os.environ, {"SUDO_USER": user}):
                    self.assertEqual(sudo_invoker_default_home(), expected, user)
