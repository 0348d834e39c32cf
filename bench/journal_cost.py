"""What the journal costs: append, conversation load and listing, per journal and release.

`python3 bench/journal_cost.py` runs bench.py's own jobs (job_append, job_conversation, job_listing,
and the builds before them) in worker subprocesses for each side, the sides taking turns for
ROUNDS rounds (a slow spell of a loaded machine hits them all), and prints the medians as the
markdown table docs/journal-policy.md quotes. Sides: ours with the runtime's default journal, ours
with HERMES_STATE_JOURNAL=wal, and hermes-agent 0.20.1.2 and 0.22.2.post1 running their own state
layer from the venvs `make compat` caches (each picks its own journal: a rollback journal on an
SQLite with the WAL-reset race). `JOURNAL_BENCH_BEFORE=<checkout>` adds ours from another checkout
(the release before a change). Run it under another SQLite with LD_LIBRARY_PATH.

Owns only its table; the jobs and the workload are bench.py's. Must not touch the product modules
(it only runs them) and the compat venvs (it only runs their python).
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
import bench  # noqa: E402  (the jobs and workload, read from this folder)

ROUNDS = int(os.environ.get("JOURNAL_BENCH_ROUNDS", "3"))
# JOURNAL_BENCH_ONLY=append times the appends alone (an A/B of small differences wants many rounds);
# JOURNAL_BENCH_SIDES=ours,before,0.22 (words in the labels) runs only those sides.
ONLY_APPEND = os.environ.get("JOURNAL_BENCH_ONLY") == "append"
WANTED_SIDES = [word for word in os.environ.get("JOURNAL_BENCH_SIDES", "").split(",") if word]
STORE_MESSAGES = 4_000  # the store the appends go into
APPEND_COUNT = 400  # one message a transaction, as an agent appends a turn
LISTING_SESSIONS = 10_000
LISTED = ("list_sessions_rich(limit=50)", "session_count()")
COMPAT = Path(os.environ.get("HERMES_COMPAT_CACHE") or Path.home() / ".cache" / "hermes_state_compat")
RELEASES = (("hermes-agent 0.20.1.2", "ref-0.20.1.2"), ("hermes-agent 0.22.2.post1", "release-0.22.2.post1"))


def sides():
    """[(label, argv prefix, extra env, checkout or None)] of every side that can run here."""
    out = [("ours, default journal", [sys.executable, str(BENCH / "bench.py")], {}, REPO),
           ("ours, HERMES_STATE_JOURNAL=wal", [sys.executable, str(BENCH / "bench.py")],
            {"HERMES_STATE_JOURNAL": "wal"}, REPO)]
    before = os.environ.get("JOURNAL_BENCH_BEFORE")
    if before:
        out.append((f"ours before ({Path(before).name})", [sys.executable, str(BENCH / "bench.py")], {},
                    Path(before).resolve()))
    for label, venv in RELEASES:
        python = COMPAT / venv / "bin" / "python"
        if python.exists():
            out.append((label, [str(python), "-P", str(BENCH / "bench.py")], {}, None))
    return [side for side in out if not WANTED_SIDES or any(word in side[0] for word in WANTED_SIDES)]


def run(side, home, job, **args):
    """One bench.py worker of `job` on `side`; its result dict."""
    label, argv, extra, checkout = side
    env = dict(os.environ, HERMES_HOME=home, PYTHONDONTWRITEBYTECODE="1", **extra)
    env.pop("PYTHONPATH", None)
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout)
    done = subprocess.run(argv + ["--worker", json.dumps(dict(args, job=job))], cwd=home, env=env,
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{label} {job} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    module = Path(result.pop("module")).resolve().parent
    if (checkout is not None) != (module == checkout):
        raise RuntimeError(f"{label} imported {module}")
    return result


def journal_of(path):
    with open(path, "rb") as handle:
        return {b"\x01\x01": "rollback", b"\x02\x02": "WAL"}.get(handle.read(20)[18:20], "?")


def main():
    folder = Path(tempfile.mkdtemp(prefix="journal-bench-"))
    try:
        table = measure(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    import sqlite3
    print(f"SQLite {sqlite3.sqlite_version}, Python {sys.version.split()[0]}, median of {ROUNDS} rounds")
    if ONLY_APPEND:
        print("| side | journal | append msg/s | each round |\n|---|---|---:|---|")
    else:
        print("| side | journal | append msg/s | conversation 2,000 ms | conversation 20,000 ms | "
              + " | ".join(f"{name} ms" for name in LISTED) + " |")
        print("|---|---|---:|---:|---:|" + "---:|" * len(LISTED))
    for label, row in table.items():
        cells = [f"{statistics.median(row['append']):,.0f}"]
        if ONLY_APPEND:
            print(f"| {label} | {row['journal']} | {cells[0]} | " + ", ".join(
                f"{rate:,.0f}" for rate in row["append"]) + " |")
            continue
        cells += [f"{statistics.median(row[size]):.1f}" for size in ("2000", "20000")]
        cells += [f"{statistics.median(row[name]):.2f}" for name in LISTED]
        print(f"| {label} | {row['journal']} | " + " | ".join(cells) + " |")


def measure(folder):
    table = {}
    prepared = []
    for number, side in enumerate(sides()):
        home = folder / f"home-{number}"
        home.mkdir()
        base, talk, listing = (str(home / name) for name in ("base.db", "talk.db", "listing.db"))
        run(side, str(home), "build", path=base, messages=STORE_MESSAGES)
        if not ONLY_APPEND:
            run(side, str(home), "conversations", path=talk)
            run(side, str(home), "sessions", path=listing, count=LISTING_SESSIONS)
        table[side[0]] = {"journal": journal_of(base), "append": [], "2000": [], "20000": [],
                          **{name: [] for name in LISTED}}
        prepared.append((side, str(home), base, talk, listing))
    for round_number in range(ROUNDS):
        for side, home, base, talk, listing in prepared:
            row = table[side[0]]
            copy = f"{home}/append-{round_number}.db"
            shutil.copyfile(base, copy)  # closed: no -wal or journal beside it
            row["append"].append(run(side, home, "append", path=copy, count=APPEND_COUNT)["rate"])
            if ONLY_APPEND:
                continue
            for size, figure in run(side, home, "conversation", path=talk, runs=5).items():
                row[size].append(figure["ms"])
            listed = run(side, home, "listing", path=listing, runs=5)
            for name in LISTED:
                row[name].append(listed[name]["ms"])
    return table


if __name__ == "__main__":
    main()
