"""`make test-runtimes`: the suite on real SQLite builds, each a `libsqlite3.so.0` that CPython's
own `_sqlite3` loads through `LD_LIBRARY_PATH`.

Owns: fetching SQLite's amalgamation from the npm registry's `better-sqlite3` tarballs (pinned by
version and sha256), building each runtime with gcc into a cache outside the clone, running
`make test` on each runtime (and the oldest CPython on the oldest SQLite), the store carried across
runtimes (`carry.py`), and the report: one line per runtime, then the total; non-zero exit on any
failure or crash. Must not touch: the product modules and tests (it only runs them), any network
but the npm registry (through `npm pack`, on first use only).

Usage: python3 runtimes/run.py [--only NAME[,NAME...]] [--jobs N] [--build-only]
Environment: HERMES_RUNTIMES_CACHE (default ~/.cache/hermes_state_runtimes).
"""

import argparse
import concurrent.futures
import contextlib
import fcntl
import glob
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CACHE = os.environ.get("HERMES_RUNTIMES_CACHE") or \
    os.path.expanduser("~/.cache/hermes_state_runtimes")

# The tarballs as the npm registry serves them; a changed tarball is refused, never built.
SOURCES = {
    "3.53.2": {
        "package": "better-sqlite3@12.11.1",
        "sha256": "ebf0ed75a7a59dbcb3b24bbd014ef49d9f15bc328e4adcbf516f2a8fadfa2835",
        "inner": None,  # deps/sqlite3/sqlite3.c in the tarball itself
    },
    "3.31.1": {
        "package": "better-sqlite3@7.0.0",
        "sha256": "47e9b65aa697626114d7e2f0d8a1e9423a41fcf16ee07dbf742195109dd5cf87",
        "inner": "package/deps/sqlite3.tar.gz",  # the amalgamation is one more tarball down
    },
}

# What a distribution's build carries (Debian's and Ubuntu's flags, less what nothing here reads).
COMMON = ["-DSQLITE_ENABLE_COLUMN_METADATA", "-DSQLITE_ENABLE_DBSTAT_VTAB",
          "-DSQLITE_ENABLE_UNLOCK_NOTIFY", "-DSQLITE_SECURE_DELETE", "-DSQLITE_ENABLE_RTREE",
          "-DSQLITE_MAX_VARIABLE_NUMBER=250000", "-DSQLITE_THREADSAFE=1",
          # configure's builds define it; without it SQLite's busy handler sleeps whole seconds
          "-DHAVE_USLEEP=1"]

RUNTIMES = [
    {"name": "3.53.2 fts5", "version": "3.53.2", "fts5": True,
     "defines": COMMON + ["-DSQLITE_ENABLE_FTS3", "-DSQLITE_ENABLE_FTS4", "-DSQLITE_ENABLE_FTS5"]},
    {"name": "3.53.2 no-fts5", "version": "3.53.2", "fts5": False,
     "defines": COMMON + ["-DSQLITE_ENABLE_FTS3", "-DSQLITE_ENABLE_FTS4"]},
    # Before the trigram tokenizer (3.34); JSON1 was not built in yet (3.38), and CPython 3.11's
    # _sqlite3 calls sqlite3_deserialize, an opt-in before 3.36.
    {"name": "3.31.1 fts5", "version": "3.31.1", "fts5": True,
     "defines": COMMON + ["-DSQLITE_ENABLE_FTS3", "-DSQLITE_ENABLE_FTS4", "-DSQLITE_ENABLE_FTS5",
                          "-DSQLITE_ENABLE_JSON1", "-DSQLITE_ENABLE_DESERIALIZE"]},
]
BUILD_FLAGS = ["-O2", "-fPIC", "-shared", "-DNDEBUG", "-Wl,-soname,libsqlite3.so.0"]
LIBS = ["-lpthread", "-ldl", "-lm"]
SUITE_TIMEOUT = 1800
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped")


def log(message):
    print("runtimes: " + message, flush=True)


def slug(name):
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


@contextlib.contextmanager
def cache_lock():
    """One builder at a time across processes: a second run waits, then finds the stamps."""
    os.makedirs(CACHE, exist_ok=True)
    with open(os.path.join(CACHE, "build.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_amalgamation(version):
    """The path of sqlite3.c for `version`: fetched and checked once, then read from the cache."""
    source = SOURCES[version]
    folder = os.path.join(CACHE, "src", version)
    target = os.path.join(folder, "sqlite3.c")
    stamp = os.path.join(folder, "stamp")
    if os.path.exists(target) and os.path.exists(stamp):
        with open(stamp) as fh:
            if fh.read().strip() == source["sha256"]:
                return target
    if shutil.which("npm") is None:
        raise SystemExit("runtimes: npm is needed once to fetch %s (SQLite %s)"
                         % (source["package"], version))
    with tempfile.TemporaryDirectory(dir=CACHE) as scratch:
        log("fetching %s (SQLite %s) with npm pack" % (source["package"], version))
        done = subprocess.run(["npm", "pack", source["package"], "--pack-destination", scratch],
                              cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        tarballs = glob.glob(os.path.join(scratch, "*.tgz"))
        if done.returncode != 0 or len(tarballs) != 1:
            raise SystemExit("runtimes: npm pack %s failed:\n%s"
                             % (source["package"], done.stdout[-2000:]))
        got = sha256_of(tarballs[0])
        if got != source["sha256"]:
            raise SystemExit("runtimes: %s has sha256 %s, pinned %s: refusing to build it"
                             % (source["package"], got, source["sha256"]))
        with tarfile.open(tarballs[0]) as outer:
            if source["inner"] is None:
                data = outer.extractfile("package/deps/sqlite3/sqlite3.c").read()
            else:
                inner = io.BytesIO(outer.extractfile(source["inner"]).read())
                with tarfile.open(fileobj=inner) as nested:
                    member = [m for m in nested.getmembers()
                              if m.name.endswith("sqlite3.c")][0]
                    data = nested.extractfile(member).read()
        if ('#define SQLITE_VERSION        "%s"' % version).encode() not in data:
            raise SystemExit("runtimes: %s does not carry SQLite %s" % (source["package"], version))
        os.makedirs(folder, exist_ok=True)
        with open(target + ".part", "wb") as fh:
            fh.write(data)
        os.replace(target + ".part", target)
        with open(stamp, "w") as fh:
            fh.write(source["sha256"] + "\n")
    return target


def build(runtime):
    """Return the folder holding the runtime's libsqlite3.so.0, built once per version and flags."""
    folder = os.path.join(CACHE, "lib", slug(runtime["name"]))
    library = os.path.join(folder, "libsqlite3.so.0")
    recipe = {"sha256": SOURCES[runtime["version"]]["sha256"], "defines": runtime["defines"],
              "flags": BUILD_FLAGS}
    stamp = os.path.join(folder, "stamp.json")
    if os.path.exists(library) and os.path.exists(stamp):
        with open(stamp) as fh:
            if json.load(fh) == recipe:
                return folder
    source = fetch_amalgamation(runtime["version"])
    os.makedirs(folder, exist_ok=True)
    log("building SQLite %s with gcc (%s)" % (runtime["name"], " ".join(runtime["defines"])))
    started = time.monotonic()
    command = ["gcc"] + BUILD_FLAGS + runtime["defines"] + [source, "-o", library + ".part"] + LIBS
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise SystemExit("runtimes: gcc failed for %s:\n%s"
                         % (runtime["name"], done.stdout[-3000:]))
    os.replace(library + ".part", library)
    with open(stamp, "w") as fh:
        json.dump(recipe, fh)
    log("built %s in %.0f s" % (runtime["name"], time.monotonic() - started))
    return folder


def pyenv_python(version_prefix):
    """The pyenv CPython whose version starts with `version_prefix` (e.g. "3.8."), or None."""
    root = subprocess.run(["pyenv", "root"], stdout=subprocess.PIPE, text=True).stdout.strip() \
        if shutil.which("pyenv") else ""
    found = sorted(glob.glob(os.path.join(root, "versions", version_prefix + "*", "bin",
                                          "python")))
    return found[-1] if root and found else None


PROBE = r"""
import json, sqlite3, _sqlite3
con = sqlite3.connect(":memory:")
options = [row[0] for row in con.execute("PRAGMA compile_options")]
print(json.dumps({"version": sqlite3.sqlite_version, "module": _sqlite3.__file__,
                  "options": options}))
"""


def check_runtime(python, runtime, folder, env):
    """Fail loudly unless this CPython's _sqlite3 loads this build, dynamically, at the wanted
    version and with FTS5 as wanted."""
    done = subprocess.run([python, "-c", PROBE], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise SystemExit("runtimes: %s cannot import sqlite3 on %s:\n%s"
                         % (python, runtime["name"], done.stdout))
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    linked = subprocess.run(["ldd", probe["module"]], env=env, stdout=subprocess.PIPE,
                            text=True).stdout
    wanted = os.path.join(folder, "libsqlite3.so.0")
    if "libsqlite3.so.0 => " + wanted not in linked:
        raise SystemExit("runtimes: %s does not load %s dynamically (ldd says:\n%s)"
                         % (probe["module"], wanted, linked))
    if probe["version"] != runtime["version"]:
        raise SystemExit("runtimes: %s reports SQLite %s, wanted %s"
                         % (python, probe["version"], runtime["version"]))
    if ("ENABLE_FTS5" in probe["options"]) != runtime["fts5"]:
        raise SystemExit("runtimes: %s: compile_options disagree on FTS5 (wanted %s)"
                         % (runtime["name"], runtime["fts5"]))


def runtime_env(folder):
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = folder + (":" + env["LD_LIBRARY_PATH"]
                                       if env.get("LD_LIBRARY_PATH") else "")
    env["PYTHONFAULTHANDLER"] = "1"  # a crash prints the Python stack of every thread into the log
    return env


def died_by(text):
    """The signal a crashed suite died of, from make's 'Error 139' (128 + signal) line, or None."""
    match = re.search(r"\] Error (\d+)\s*$", text, re.M)
    if match and int(match.group(1)) > 128:
        number = int(match.group(1)) - 128
        try:
            return signal.Signals(number).name
        except ValueError:
            return "signal %d" % number
    return None


def run_suite(label, python, folder):
    """`make test` on one runtime; returns (label, passed, failed, skipped, detail lines)."""
    env = runtime_env(folder)
    logs = os.path.join(CACHE, "logs")
    os.makedirs(logs, exist_ok=True)
    log_path = os.path.join(logs, slug(label) + ".log")
    started = time.monotonic()
    with open(log_path, "w") as fh:
        try:
            done = subprocess.run(["make", "--no-print-directory", "test", "PYTHON=" + python],
                                  cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                  timeout=SUITE_TIMEOUT)
            status = done.returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    lines = [line for line in text.splitlines() if SUMMARY.match(line)]
    match = SUMMARY.match(lines[-1]) if lines else None
    passed, failed, skipped = (int(g) for g in match.groups()) if match else (0, 1, 0)
    detail = ["%s (log %s, %.0f s)" % ("ok" if status == 0 else "FAILED", log_path,
                                       time.monotonic() - started)]
    crash = died_by(text)
    if status == "timeout":
        detail.append("timed out after %d s" % SUITE_TIMEOUT)
        failed = max(failed, 1)
    elif crash:
        detail.append("the suite died of %s" % crash)
        fault = re.search(r"^Fatal Python error.*?(?=^\S|\Z)", text, re.M | re.S)
        if fault:
            detail.extend(fault.group(0).strip().splitlines()[:30])
        failed = max(failed, 1)
    elif status != 0:
        failed = max(failed, 1)
    detail.extend(line for line in text.splitlines() if re.match(r"^(FAIL|ERROR): ", line))
    return label, passed, failed, skipped, detail


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated run labels (see the summary lines)")
    parser.add_argument("--jobs", type=int, default=2, help="suites at once (default 2)")
    parser.add_argument("--build-only", action="store_true")
    args = parser.parse_args()
    started = time.monotonic()

    with cache_lock():
        folders = {runtime["name"]: build(runtime) for runtime in RUNTIMES}
    if args.build_only:
        return 0

    default_python = shutil.which("python3")
    oldest = pyenv_python("3.8.")
    runs = [("runtime " + runtime["name"], default_python, runtime) for runtime in RUNTIMES]
    if oldest is None:
        raise SystemExit("runtimes: pyenv's CPython 3.8 is needed for the oldest pair "
                         "(pyenv install 3.8)")
    runs.append(("runtime 3.31.1 fts5 python 3.8", oldest, RUNTIMES[2]))
    if args.only:
        wanted = {name.strip() for name in args.only.split(",")}
        runs = [run for run in runs if run[0] in wanted or run[0][len("runtime "):] in wanted]
    for label, python, runtime in runs:
        folder = folders[runtime["name"]]
        check_runtime(python, runtime, folder, runtime_env(folder))

    sys.path.insert(0, HERE)
    import carry  # noqa: E402  (the folder is a tool box, not a package)

    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_suite, label, python, folders[runtime["name"]]): label
                   for label, python, runtime in runs}
        for future in concurrent.futures.as_completed(futures):
            results[futures[future]] = future.result()
    if not args.only or "carry" in (args.only or ""):
        results["carry"] = carry.run(default_python, folders, runtime_env)

    order = [run[0] for run in runs] + (["carry"] if "carry" in results else [])
    totals = [0, 0, 0]
    for label in order:
        name, passed, failed, skipped, detail = results[label]
        for line in detail:
            print("  " + line)
        print("%s: %d passed, %d failed, %d skipped" % (name, passed, failed, skipped))
        totals = [totals[0] + passed, totals[1] + failed, totals[2] + skipped]
    print("%d passed, %d failed, %d skipped (%.0f s)" % (totals[0], totals[1], totals[2],
                                                         time.monotonic() - started))
    return 1 if totals[1] else 0


if __name__ == "__main__":
    sys.exit(main())
