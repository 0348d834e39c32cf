"""`install` and `uninstall` on real hermes-agent installs: `make compat`'s cached venvs of 0.19,
0.20 and 0.22, each copied to a temp folder first (hermes-agent's own files copied or hard-linked,
its dependencies symlinked), so the cache is never changed.

The refusals and `--check` run in `make test` (they stop before the host's python is asked
anything). The installs, whose verification imports every module of hermes-agent that imports the
state layer (25 to 60 s for 0.22 on a busy 2-core machine), run with HERMES_STATE_INSTALL_TESTS=1:
`make test-install`.
"""

import contextlib
import glob
import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import unittest

from test_support import REPO

CACHE = os.environ.get("HERMES_COMPAT_CACHE") or os.path.expanduser("~/.cache/hermes_state_compat")
VENVS = {"0.19": "release-0.19.0", "0.20": "ref-0.20.1.2", "0.22": "release-0.22.2.post1"}
FULL = os.environ.get("HERMES_STATE_INSTALL_TESTS") == "1"
FULL_REASON = "the installs verify with hermes-agent's python (minutes): make test-install"


def venv_of(release):
    venv = os.path.join(CACHE, VENVS[release])
    if not glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "hermes_state.py")):
        raise unittest.SkipTest(f"no hermes-agent {release} venv in {CACHE}: run `make compat` "
                                "once (it builds them from PyPI)")
    return venv


def make_host(venv, dest):
    """A venv at `dest` running the hermes-agent of `venv`; returns its site-packages.

    hermes-agent resolves its own path (realpath) to find its root, so its own packages are real
    folders here (files hard-linked: nothing writes into them in place); its dependencies are
    symlinks; its root files and __pycache__ are copies, which install and uninstall change.
    """
    os.makedirs(os.path.join(dest, "bin"))
    shutil.copy2(os.path.join(venv, "pyvenv.cfg"), dest)
    for path in glob.glob(os.path.join(venv, "bin", "*")):
        target = os.path.join(dest, "bin", os.path.basename(path))
        if os.path.islink(path):
            os.symlink(os.readlink(path), target)
        elif os.path.basename(path).startswith("hermes"):
            with open(path, encoding="utf-8") as source, open(target, "w", encoding="utf-8") as out:
                out.write(source.read().replace(venv, dest))
            os.chmod(target, 0o755)
    site = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages"))[0]
    copy = os.path.join(dest, os.path.relpath(site, venv))
    os.makedirs(copy)
    own = set()
    for listing in glob.glob(os.path.join(site, "hermes_agent*.dist-info", "top_level.txt")):
        with open(listing, encoding="utf-8") as handle:
            own = set(handle.read().split())
    for name in os.listdir(site):
        source, target = os.path.join(site, name), os.path.join(copy, name)
        if os.path.isfile(source) and not os.path.islink(source):
            shutil.copy2(source, target)
        elif name == "__pycache__":
            shutil.copytree(source, target)
        elif name in own or name.startswith("hermes_agent"):
            shutil.copytree(source, target, symlinks=True, copy_function=os.link)
        else:
            os.symlink(source, target)
    return copy


def snapshot(root):
    """{relative path: (sha256, link target or inode, mode, mtime_ns)} of every file under `root`.

    A file hard-linked from the cache is compared by inode: install and uninstall only ever
    rename files into place, so a file they changed has a new one.
    """
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            if os.path.islink(path):
                found[os.path.relpath(path, root)] = (os.readlink(path), info.st_mode, 0)
                continue
            if info.st_nlink > 1:  # hard-linked from the cache: replaced means a new inode
                found[os.path.relpath(path, root)] = (info.st_ino, info.st_mode, info.st_mtime_ns)
                continue
            with open(path, "rb") as handle:
                digest = hashlib.sha256(handle.read()).hexdigest()
            found[os.path.relpath(path, root)] = (digest, info.st_mode, info.st_mtime_ns)
    return found


def run_cli(*args, cwd=REPO, prefix=(), python=sys.executable):
    return subprocess.run(list(prefix) + [python, "-m", "hermes_state"] + list(args),
                          cwd=cwd, capture_output=True, text=True, timeout=900)


def python_for(prefix):
    """An interpreter the user of `prefix` can start: ours, else the system's, else None.

    pyenv's shared builds find libpython through a runpath under root's home, which another user
    cannot read; our modules need only the standard library, so any CPython 3.8+ will do.
    """
    for python in (sys.executable, shutil.which("python3", path="/usr/bin:/bin")):
        if python and subprocess.run(
                list(prefix) + [python, "-c", "import sys; assert sys.version_info >= (3, 8)"],
                capture_output=True, timeout=60).returncode == 0:
            return python
    return None


# Run install in a child that SIGKILLs itself right after its Nth call of os.replace (a backup or
# module put in place) or os.unlink (a host file removed) inside the host: killed between two files.
KILLED_INSTALL = r"""
import os, signal, sys
import hermes_state_install as install
calls = {"n": 0}
def killing(real):
    def call(*args, **kwargs):
        real(*args, **kwargs)
        if str(args[0]).startswith(sys.argv[1]):
            calls["n"] += 1
            if calls["n"] == int(sys.argv[2]):
                os.kill(os.getpid(), signal.SIGKILL)
    return call
os.replace, os.unlink = killing(os.replace), killing(os.unlink)
install.install(install.locate(sys.argv[1]))
"""


class HostTestCase(unittest.TestCase):
    """A fresh copy of the release's venv for each test."""
    release = "0.22"

    def setUp(self):
        self.cache = venv_of(self.release)
        self.tmp = tempfile.mkdtemp(prefix="hermes-install-test-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.venv = os.path.join(self.tmp, "venv")
        self.site = make_host(self.cache, self.venv)
        self.before = snapshot(self.venv)

    def assertUnchanged(self):
        self.assertEqual(snapshot(self.venv), self.before)

    def assertRefused(self, run, *words):
        self.assertEqual(run.returncode, 1, run.stdout + run.stderr)
        lines = run.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, run.stderr)
        for word in words:
            self.assertIn(word, lines[0])
        self.assertUnchanged()


class Refusals(HostTestCase):
    """Each refusal: one line, exit 1, the host byte for byte as it was.

    One copy of the venv serves the class (a copy takes seconds on a busy machine); a test that
    changes a file of it puts the cache's file back when it ends.
    """

    @classmethod
    def setUpClass(cls):
        host = HostTestCase("setUp")
        host.setUp()
        cls.addClassCleanup(host.doCleanups)
        cls.cache, cls.tmp, cls.venv, cls.site, cls.before = (
            host.cache, host.tmp, host.venv, host.site, host.before)

    def setUp(self):
        self.assertUnchanged()

    def change(self, name, edit):
        """Apply `edit` to the host's file `name`; the cache's copy goes back after the test."""
        self.addCleanup(shutil.copy2, os.path.join(glob.glob(os.path.join(
            self.cache, "lib", "python3*", "site-packages"))[0], name), self.site)
        edit(os.path.join(self.site, name))
        self.before = snapshot(self.venv)

    def test_check_tells_the_release_and_changes_nothing(self):
        for path in (self.venv, self.site):
            run = run_cli("install", "--check", path)
            self.assertEqual(run.returncode, 0, run.stderr)
            self.assertIn(f"hermes-agent 0.22 at {os.path.realpath(self.site)}", run.stdout)
            self.assertIn("in place of its 33 state modules, keep its hermes_constants.py",
                          run.stdout)
        self.assertUnchanged()

    def test_check_without_path_finds_the_hermes_on_path(self):
        path = os.path.join(self.venv, "bin") + os.pathsep + os.environ.get("PATH", "")
        run = subprocess.run([sys.executable, "-m", "hermes_state", "install", "--check"],
                             cwd=REPO, capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PATH=path))
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertIn(f"hermes-agent 0.22 at {os.path.realpath(self.site)} (python "
                      f"{os.path.join(self.venv, 'bin', 'python')})", run.stdout)
        self.assertUnchanged()

    def test_a_hand_edited_state_module_is_named_and_refused(self):
        def edit(path):
            with open(path, "a") as handle:
                handle.write("# a local fix\n")
        self.change("hermes_state_search.py", edit)
        for args in (("install", self.venv), ("install", "--check", self.venv)):
            self.assertRefused(run_cli(*args), "hermes_state_search.py match no hermes-agent 0.22",
                               "nothing was changed")

    def test_an_unknown_release_is_refused_with_its_metadata_version(self):
        self.change("hermes_state_wal.py", os.unlink)
        self.assertRefused(run_cli("install", self.venv), "unknown hermes-agent release",
                           "metadata says 0.22.2.post1", "32 of them as in 0.22's 33")

    def test_a_path_that_is_not_hermes_agent_is_refused(self):
        self.change("run_agent.py", os.unlink)
        self.assertRefused(run_cli("install", self.site), "is not hermes-agent: no run_agent.py")
        self.assertRefused(run_cli("install", self.tmp), "is not hermes-agent")
        self.assertRefused(run_cli("install", str(REPO)), "is not hermes-agent")

    @unittest.skipUnless(hasattr(os, "geteuid"), "POSIX users")
    def test_a_read_only_site_packages_is_refused(self):
        path = self.venv
        if os.geteuid() == 0:  # root writes anywhere: run as nobody, who may only read the host
            os.chmod(self.tmp, 0o755)
            path = self.site  # the venv's python may live under root's home, closed to nobody
            prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            if shutil.which("setpriv") is None:
                self.skipTest("running as root without setpriv to drop to another user")
            python = python_for(prefix)
            if python is None:
                self.skipTest("no Python 3.8+ that user nobody can start")
            # CI's clone sits in a 0700 mktemp folder nobody cannot enter: run a copy of ours
            cwd = tempfile.mkdtemp(prefix="ours-", dir=self.tmp)
            self.addCleanup(shutil.rmtree, cwd, ignore_errors=True)
            os.chmod(cwd, 0o755)
            for module in glob.glob(os.path.join(REPO, "hermes_*.py")):
                shutil.copy(module, cwd)
        else:
            prefix, cwd, python = [], REPO, sys.executable
            self.addCleanup(os.chmod, self.site, os.stat(self.site).st_mode)
            os.chmod(self.site, 0o555)
        run = run_cli("install", path, cwd=cwd, prefix=prefix, python=python)
        self.assertRefused(run, "is read-only to this user; nothing was changed")

    def test_db_is_a_usage_mistake_for_install(self):
        self.assertRefused(run_cli("--db", "x.db", "install", self.venv), "not --db")

    def test_uninstall_with_nothing_installed_says_so_and_changes_nothing(self):
        run = run_cli("uninstall", self.venv)
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertIn("nothing to undo", run.stdout)
        self.assertUnchanged()


class KilledInstall(HostTestCase):
    release = "0.19"  # the fewest modules to import before the backup is written

    def setUp(self):
        if not FULL:
            self.skipTest(FULL_REASON)
        super().setUp()

    def test_an_install_killed_between_files_is_put_back_by_uninstall(self):
        # 1: the manifest written, the backup not yet in place; 2: the backup in place; 9: seven
        # of our modules placed; the last: all of ours placed and the host's compiled
        # hermes_state.cpython-*.pyc removed, the verification not begun.
        last = 2 + len(glob.glob(str(REPO / "hermes_state*.py"))) + len(glob.glob(
            os.path.join(self.site, "__pycache__", "hermes_state*.pyc")))
        self.assertGreater(last, 2 + 40)
        for step in (1, 2, 9, last):
            with self.subTest(step=step):
                run = subprocess.run([sys.executable, "-c", KILLED_INSTALL, self.venv, str(step)],
                                     cwd=REPO, capture_output=True, text=True, timeout=900)
                self.assertEqual(run.returncode, -signal.SIGKILL, run.stderr)
                if step > 1:
                    self.assertNotEqual(snapshot(self.venv), self.before)
                    again = run_cli("install", "--check", self.venv)
                    self.assertEqual(again.returncode, 1)
                    self.assertIn("stopped after", again.stderr)
                run = run_cli("uninstall", self.venv)
                self.assertEqual(run.returncode, 0, run.stderr)
                self.assertUnchanged()


class FailedVerification(HostTestCase):
    release = "0.20"

    def setUp(self):
        if not FULL:
            self.skipTest(FULL_REASON)
        super().setUp()

    def test_a_host_that_no_longer_imports_is_put_back_and_the_failure_named(self):
        checkout = os.path.join(self.tmp, "checkout")
        os.makedirs(checkout)
        for path in glob.glob(str(REPO / "hermes_state*.py")):
            shutil.copy2(path, checkout)
        with open(os.path.join(checkout, "hermes_state_sessions.py"), "a") as handle:
            handle.write("\nraise ImportError('broken on purpose')\n")
        code = ("import sys, hermes_state_install as m\n"
                "try:\n    m.install(m.locate(sys.argv[1]))\n"
                "except m.InstallRefused as exc:\n    sys.exit(str(exc))\n")
        run = subprocess.run([sys.executable, "-c", code, self.venv], cwd=checkout,
                             capture_output=True, text=True, timeout=900)
        self.assertEqual(run.returncode, 1)
        self.assertIn("verification failed, the host was put back as it was", run.stderr)
        self.assertIn("broken on purpose", run.stderr)
        self.assertUnchanged()


class GitCheckout(HostTestCase):
    release = "0.19"

    def setUp(self):
        if not FULL:
            self.skipTest(FULL_REASON)
        super().setUp()

    def test_a_checkout_with_its_venv_inside_installs_and_uninstalls(self):
        # hermes-agent's own files at the root of a git work tree, its venv in `venv/` beside them
        checkout = os.path.join(self.tmp, "hermes-agent")
        with open(glob.glob(os.path.join(self.site, "hermes_agent*.dist-info",
                                         "top_level.txt"))[0], encoding="utf-8") as handle:
            own = handle.read().split()
        os.makedirs(checkout)
        for name in own:
            for source in glob.glob(os.path.join(self.site, name + ".py")):
                shutil.copy2(source, checkout)
            if os.path.isdir(os.path.join(self.site, name)):
                shutil.copytree(os.path.join(self.site, name), os.path.join(checkout, name),
                                copy_function=os.link)
        subprocess.run(["git", "init", "-q", checkout], check=True, timeout=60)
        os.rename(self.venv, os.path.join(checkout, "venv"))
        # hermes-agent's update check runs `git fetch` in its own work tree when imported.
        def files():
            return {name: facts for name, facts in snapshot(checkout).items()
                    if not name.startswith(".git" + os.sep)}
        before = files()
        run = run_cli("install", checkout)
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertIn(f"hermes-agent 0.19 at {checkout} (python {checkout}/venv/bin/python)",
                      run.stdout)
        self.assertIn("verified with its python", run.stdout)
        run = run_cli("uninstall", checkout)
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertEqual(files(), before)


class InstallVerifyUninstall(unittest.TestCase):
    """Each release: install, the agent's own command on our modules, twice is a no-op, uninstall
    gives back every file byte for byte."""

    def setUp(self):
        if not FULL:
            self.skipTest(FULL_REASON)

    def check_release(self, release, modules):
        host = HostTestCase("run")
        host.release = release
        host.setUp()
        self.addCleanup(host.doCleanups)
        constants = host.before[os.path.relpath(os.path.join(host.site, "hermes_constants.py"),
                                                host.venv)]
        run = run_cli("install", host.venv)
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertIn(f"in place of its {modules}", run.stdout)
        ours = sorted(os.path.basename(p) for p in glob.glob(str(REPO / "hermes_state*.py")))
        placed = sorted(os.path.basename(p)
                        for p in glob.glob(os.path.join(host.site, "hermes_state*.py")))
        self.assertEqual(placed, ours)
        for name in ours:
            with open(os.path.join(host.site, name), "rb") as a, open(REPO / name, "rb") as b:
                self.assertEqual(a.read(), b.read(), name)
        after = snapshot(host.venv)
        self.assertEqual(after[os.path.relpath(os.path.join(host.site, "hermes_constants.py"),
                                               host.venv)], constants)
        # A session written by the installed modules, listed by the agent's own command.
        home = os.path.join(host.tmp, "home")
        os.makedirs(home)
        env = dict(os.environ, HERMES_HOME=home)
        written = subprocess.run(
            [os.path.join(host.venv, "bin", "python"), "-c",
             "import hermes_state as s; print(s.__file__); db = s.SessionDB(); "
             "db.create_session('20261203_installed', source='cli'); "
             "db.append_message('20261203_installed', role='user', content='hello'); db.close()"],
            cwd=home, capture_output=True, text=True, env=env, timeout=300)
        self.assertEqual(written.returncode, 0, written.stderr)
        self.assertEqual(written.stdout.strip(), os.path.join(host.site, "hermes_state.py"))
        program = glob.glob(os.path.join(host.venv, "bin", "hermes")) or \
            glob.glob(os.path.join(host.venv, "bin", "hermesx"))
        # An agent turn on our modules, against make compat's fake model server and its config.
        sys.path.insert(0, str(REPO / "compat"))
        self.addCleanup(sys.path.remove, str(REPO / "compat"))
        import e2e
        import fake_llm
        server = fake_llm.start()
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        with open(os.path.join(home, "config.yaml"), "w", encoding="utf-8") as handle:
            handle.write(e2e.CONFIG.format(model=fake_llm.MODEL, port=server.server_address[1])
                         + (e2e.CONFIG_22 if release != "0.20" else ""))
        turn = subprocess.run([program[0]] + e2e.q("Hello from the installed agent"), cwd=home,
                              capture_output=True, text=True, env=env, timeout=600)
        self.assertEqual(turn.returncode, 0, turn.stderr)
        self.assertIn("Reply to: Hello from the installed agent", turn.stdout)
        listed = subprocess.run([program[0], "sessions", "list"], capture_output=True, text=True,
                                env=env, timeout=300)
        self.assertEqual(listed.returncode, 0, listed.stderr)
        with contextlib.closing(sqlite3.connect(os.path.join(home, "state.db"))) as conn:
            ids = [row[0] for row in conn.execute("SELECT id FROM sessions ORDER BY id")]
            said = conn.execute("SELECT role, content FROM messages WHERE session_id != ? ORDER BY"
                                " id", ("20261203_installed",)).fetchall()
        self.assertEqual(len(ids), 2)
        self.assertEqual([role for role, _text in said], ["user", "assistant"])
        self.assertIn("Reply to: Hello from the installed agent", said[1][1])
        for session_id in ids:
            self.assertIn(session_id, listed.stdout)
        again = run_cli("install", host.venv)
        self.assertEqual((again.returncode, again.stdout.split(":")[0]),
                         (0, f"already installed in hermes-agent {release} at {host.site}"))
        run = run_cli("uninstall", host.venv)
        self.assertEqual(run.returncode, 0, run.stderr)
        host.assertUnchanged()

    def test_hermes_agent_0_19(self):
        self.check_release("0.19", 1)

    def test_hermes_agent_0_20(self):
        self.check_release("0.20", 5)

    def test_hermes_agent_0_22(self):
        self.check_release("0.22", 33)


if __name__ == "__main__":
    unittest.main()
