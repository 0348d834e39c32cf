"""The Python environments `make compat` runs hermes-agent in, kept in a cache outside the repo.

Owns: making, checking and describing, for each side (0.20.1.2 and 0.22.2.post1), the reference venv
(hermes-agent installed from PyPI, unmodified: `ref-0.20.1.2`, and for 0.22 its `release-` venv) and
the swap venv (`swap-<version>`: the same pinned install with every `hermes_state*.py` of the release
removed, 5 for 0.20 and 33 for 0.22), the venvs of the other releases the store round trips share a
store with (`release-<version>`: 0.22 and 0.19, unmodified, each from its own pinned requirements
file), and the per-run overlay folder holding this checkout's `hermes_state*.py` (or those of
`$COMPAT_MODULES_FROM`, another checkout). Must not touch: the repo's
product modules (it only copies them), anything in the cache besides its own folders.

Why an overlay instead of copying into the swap venv's site-packages: helpers and CI may run
`make compat` from several checkouts at once on one machine; each run puts its own copies in a fresh
temp folder first on PYTHONPATH, so runs never see each other's modules. With the release's own
state modules deleted from the swap venv, a module we lack fails to import instead of silently
falling back to the reference's. hermes-agent's own `hermes_constants.py` stays (DROP-IN.md): ours
is never copied.

The cache is `$HERMES_COMPAT_CACHE`, else `~/.cache/hermes_state_compat`. A venv is rebuilt when its
stamp (requirements hash, Python version, kind) does not match; building holds a file lock, so two
runs never build the same venv at once.
"""

import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
REQUIREMENTS = os.path.join(HERE, "requirements.txt")
REFERENCE_VERSION = "0.20.1.2"
# The releases `make compat` runs on their own state layer and on ours (a side each): version -> the
# pinned requirements, the program's name and how many `hermes_state*.py` the release ships. The swap
# venv of a side has exactly that many removed; a count that differs means the pin moved.
SIDES = {
    REFERENCE_VERSION: {"requirements": REQUIREMENTS, "program": "hermesx", "state_modules": 5},
    "0.22.2.post1": {"requirements": os.path.join(HERE, "requirements-0.22.txt"), "program": "hermes",
                     "state_modules": 33},
}
# The other releases that share stores with ours: version -> its pinned requirements (the reference
# itself runs from the `ref` venv). 0.22's `release` venv is also its side's `ref` venv: both are the
# unmodified pinned install.
OTHER_RELEASES = {
    "0.22.2.post1": SIDES["0.22.2.post1"]["requirements"],
    "0.19.0": os.path.join(HERE, "requirements-0.19.txt"),
}
SUPPORTED_PYTHONS = ((3, 11), (3, 12), (3, 13))  # hermes-agent 0.20.1.2 requires >=3.11,<3.14


def cache_root():
    """Return the cache folder (created if missing)."""
    root = os.environ.get("HERMES_COMPAT_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "hermes_state_compat")
    os.makedirs(root, exist_ok=True)
    return root


def _python_version(python):
    try:
        out = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    major, minor = out.stdout.strip().split(".")
    return int(major), int(minor)


def find_python():
    """Return the path of a CPython hermes-agent supports: $COMPAT_PYTHON, python3, then pyenv's."""
    candidates = []
    if os.environ.get("COMPAT_PYTHON"):
        candidates.append(os.environ["COMPAT_PYTHON"])
    candidates.append(sys.executable)
    candidates.append(shutil.which("python3") or "python3")
    pyenv_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    for major, minor in SUPPORTED_PYTHONS:
        candidates.extend(sorted(glob.glob(os.path.join(pyenv_root, "versions", "%d.%d.*" % (major, minor),
                                                         "bin", "python3")), reverse=True))
    for python in candidates:
        if _python_version(python) in SUPPORTED_PYTHONS:
            return os.path.realpath(python) if os.path.exists(python) else python
    raise SystemExit("compat: no CPython 3.11-3.13 found (set COMPAT_PYTHON)")


def _stamp(kind, python, requirements=REQUIREMENTS):
    with open(requirements, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()[:16]
    version = "%d.%d" % _python_version(python)
    return "kind=%s requirements=%s python=%s\n" % (kind, digest, version)


def venv_python(path):
    return os.path.join(path, "bin", "python")


def site_packages(path):
    """Return the site-packages folder of the venv at `path`."""
    found = glob.glob(os.path.join(path, "lib", "python3.*", "site-packages"))
    if len(found) != 1:
        raise SystemExit("compat: cannot find site-packages in %s" % path)
    return found[0]


def _pip_install(path, log, requirements=REQUIREMENTS):
    cmd = [venv_python(path), "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
           "-r", requirements]
    with open(log, "w") as out:
        status = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if status != 0:
        with open(log) as fh:
            tail = "".join(fh.readlines()[-20:])
        raise SystemExit("compat: pip install failed (log %s):\n%s" % (log, tail))


def host_state_modules(path):
    """Return the `hermes_state*.py` the venv at `path` holds in site-packages (its host's state layer)."""
    return sorted(glob.glob(os.path.join(site_packages(path), "hermes_state*.py")))


def _remove_reference_state(path, version):
    site = site_packages(path)
    found = host_state_modules(path)
    if len(found) != SIDES[version]["state_modules"]:
        raise SystemExit("compat: %s ships %d hermes_state*.py, not the %d expected (did the pin move?)"
                         % (version, len(found), SIDES[version]["state_modules"]))
    for target in found:
        os.remove(target)
        stem = os.path.basename(target)[:-3]
        for cached in glob.glob(os.path.join(site, "__pycache__", stem + ".*.pyc")):
            os.remove(cached)


def ensure_venv(kind, python, say=print, version=REFERENCE_VERSION):
    """Return the path of the `kind` ('ref', 'swap' or 'release' of `version`) venv, building it first
    when missing or stale."""
    root = cache_root()
    if kind == "ref" and version != REFERENCE_VERSION:
        kind = "release"  # the same unmodified install: one venv serves both
    requirements = OTHER_RELEASES[version] if kind == "release" else SIDES[version]["requirements"]
    path = os.path.join(root, "%s-%s" % (kind, version))
    name = os.path.basename(path)
    stamp_file = os.path.join(path, ".compat-stamp")
    want = _stamp(kind, python, requirements)
    with open(os.path.join(root, ".lock-" + name), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(stamp_file) as fh:
                if fh.read() == want:
                    if kind == "swap" and host_state_modules(path):
                        raise SystemExit("compat: %s holds hermes_state*.py again: remove the folder to rebuild"
                                         % path)
                    return path
        except OSError:
            pass
        started = time.monotonic()
        say("compat: building the %s venv in %s (first use; a minute or two)" % (kind, path))
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run([python, "-m", "venv", path], check=True)
        _pip_install(path, os.path.join(root, "pip-%s.log" % name), requirements)
        if kind == "swap":
            _remove_reference_state(path, version)
        with open(stamp_file, "w") as fh:
            fh.write(want)
        say("compat: %s venv ready in %.0f s" % (kind, time.monotonic() - started))
    return path


def wait_or_kill(proc, timeout):
    """Wait for `proc`, killing it once `timeout` seconds have passed; return its exit code."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def modules_source():
    """Return the checkout whose state modules the swap side runs: this one, or $COMPAT_MODULES_FROM (another
    worktree's root, to try the harness on newer modules without merging them)."""
    return os.path.abspath(os.environ.get("COMPAT_MODULES_FROM") or REPO)


def our_state_modules(repo=None):
    """Return the checkout's product state modules (hermes_state*.py, tests excluded), sorted."""
    return sorted(glob.glob(os.path.join(repo or modules_source(), "hermes_state*.py")))


def make_overlay(repo=None):
    """Return a new temp folder holding copies of the checkout's hermes_state*.py (caller removes it)."""
    overlay = tempfile.mkdtemp(prefix="hermes-compat-overlay-")
    for module in our_state_modules(repo):
        shutil.copy2(module, overlay)
    return overlay


def target_env(kind, overlay, base=None):
    """Return the environment for running `kind`'s Python: the overlay first on the path for 'swap'."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    env["PYTHONNOUSERSITE"] = "1"
    if kind == "swap" and overlay:
        env["PYTHONPATH"] = overlay
    return env


if __name__ == "__main__":
    chosen = find_python()
    for side in SIDES:
        for which in ("ref", "swap"):
            print(ensure_venv(which, chosen, version=side))
    for release in OTHER_RELEASES:
        print(ensure_venv("release", chosen, version=release))
