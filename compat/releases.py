"""Store round trips between ours and the real hermes-agent releases 0.19.0, 0.20.1.2 and 0.22.2.post1.

Owns: the scenarios (a store passes from one program to the next, each opening it as it does and
writing), running each step in that program's Python (`release_worker.py`), and judging the records:
every append succeeds, every row stays, FTS5 integrity-check holds on every index, our CJK search is
complete, no program changes a message_uid a row has, and after the last step every row has one. Also hermes-agent's own `sessions optimize-storage --yes` on our modules (the swap venv) on
copies of the 0.19 and 0.20 fixture stores. Must not touch: anything outside its temp folders.

The same round trips run without the releases in test_releases.py; this is the evidence they are real.
"""

import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import venvs  # noqa: E402  (the folder is a tool box, not a package)

WORKER = os.path.join(HERE, "release_worker.py")
FIXTURES = os.path.join(venvs.REPO, "fixtures")
STEP_TIMEOUT = 120
ROWS_PER_WRITE = 8  # release_worker.TEXTS and one tool row
# name: (the store it starts from: None for a new one or a fixture, then the steps (program, action)).
SCENARIOS = {
    "ours-0.22-ours-0.22": (None, [("ours", "write"), ("0.22", "write"), ("ours", "write"), ("ours", "check"),
                                   ("0.22", "write"), ("ours", "check")]),
    "ours-0.20-ours-0.20": (None, [("ours", "write"), ("0.20", "write"), ("ours", "write"), ("ours", "check"),
                                   ("0.20", "write"), ("ours", "check")]),
    "ours-0.19-ours-0.19": (None, [("ours", "write"), ("0.19", "read"), ("ours", "write"), ("0.19", "read"),
                                   ("0.19", "write"), ("ours", "check")]),
    "0.22-ours-0.22": (None, [("0.22", "write"), ("ours", "write"), ("ours", "check"), ("0.22", "write"),
                              ("ours", "check")]),
    "0.20-ours-0.20": (None, [("0.20", "write"), ("ours", "write"), ("ours", "check"), ("0.20", "write"),
                              ("ours", "check")]),
    "0.19-ours-0.19": (None, [("0.19", "write"), ("ours", "write"), ("0.19", "read"), ("0.19", "write"),
                              ("ours", "check")]),
    "v31-fixture-ours-0.22": ("hermes_v31_store.db", [("ours", "write"), ("0.22", "write"), ("ours", "check")]),
    "our-layout2-ours-0.22-ours": ("hermes_state_layout2.db", [("ours", "write"), ("0.22", "write"),
                                                               ("ours", "write"), ("ours", "check")]),
    "our-layout2-after-0.22-ours-0.22": ("hermes_state_layout2_after_v22.db", [
        ("ours", "write"), ("0.22", "write"), ("ours", "check")]),
}
OPTIMIZE_FIXTURES = ("hermes_v22_legacy_fts.db", "hermes_v26_split.db")


def unpack(fixture, folder):
    target = os.path.join(folder, "state.db")
    with gzip.open(os.path.join(FIXTURES, fixture + ".gz"), "rb") as source, open(target, "wb") as out:
        shutil.copyfileobj(source, out)
    return target


def count_messages(store):
    import sqlite3
    if not os.path.exists(store):
        return 0
    conn = sqlite3.connect(store)
    try:
        return conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
    finally:
        conn.close()


def message_uids(store):
    """{message id: message_uid} ({} before the store has the column)."""
    import sqlite3
    if not os.path.exists(store):
        return {}
    conn = sqlite3.connect(store)
    try:
        return dict(conn.execute("SELECT id, message_uid FROM messages"))
    except sqlite3.OperationalError:
        return {}
    finally:
        conn.close()


def judge_uids(step, before, after, final):
    """Schema 31's identity across a step: no program changes a uid a row has; after our last
    step every row has one, no two the same."""
    out = []
    changed = sorted(key for key, uid in before.items() if uid and after.get(key) != uid)
    if changed:
        out.append("%s: changed or lost the message_uid of rows %s" % (step, changed[:10]))
    if final:
        missing = sorted(key for key, uid in after.items() if not uid)
        if missing or not after:
            out.append("%s: rows without a message_uid: %s" % (step, missing[:10] or "every row"))
        if len(set(after.values())) != len(after):
            out.append("%s: two rows share a message_uid" % step)
    return out


class Programs:
    """The Python (and environment) each program's steps run in."""

    def __init__(self, python, home):
        self.pythons = {"ours": sys.executable,
                        "0.20": venvs.venv_python(venvs.ensure_venv("ref", python))}
        for version in venvs.OTHER_RELEASES:
            short = ".".join(version.split(".")[:2])
            self.pythons[short] = venvs.venv_python(venvs.ensure_venv("release", python, version=version))
        self.home = home

    def env(self, program):
        env = venvs.target_env("ref", None)
        env.update({"HERMES_HOME": self.home, "HOME": self.home, "TZ": "UTC"})
        if program == "ours":
            env["PYTHONPATH"] = venvs.REPO
        return env

    def run(self, program, action, store, tag):
        try:
            done = subprocess.run([self.pythons[program], WORKER, action, store, tag], env=self.env(program),
                                  cwd=os.path.dirname(store), capture_output=True, text=True, timeout=STEP_TIMEOUT)
        except subprocess.TimeoutExpired:
            return {"died": "no answer within %d s" % STEP_TIMEOUT}
        lines = done.stdout.strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (IndexError, ValueError):
            return {"died": "exit %s: %s" % (done.returncode, (done.stderr.strip().splitlines() or [""])[-1])}


def judge(step, record, expected, layout):
    """The problems of one step's record (empty when it did what it should); `layout` is the search
    index the store should have: 'current' (ours) where ours made it or moved it to ours."""
    if "died" in record:
        return ["%s: %s" % (step, record["died"])]
    out = []
    if "appends" in record and (record["appends"] != record["wanted"] or record["read_back"] != record["wanted"]):
        out.append("%s: %d of %d appends, %d read back: %s" % (
            step, record["appends"], record["wanted"], record["read_back"], "; ".join(record["errors"])))
    if record.get("unequal"):
        out.append("%s: sessions read back short (stored, read): %s" % (step, record["unequal"]))
    if "integrity" in record:
        if record["integrity"] != "ok" or record["fts_failed"]:
            out.append("%s: integrity %s, FTS5 integrity-check failed on %s" % (
                step, record["integrity"], record["fts_failed"]))
        if record["cjk_incomplete"] or not record["cjk_terms"]:
            out.append("%s: our CJK search misses rows for %s (of %d terms)" % (
                step, record["cjk_incomplete"], record["cjk_terms"]))
        if (layout and record["layout"] != layout) or record["trigger_damage"]:
            out.append("%s: layout %s, trigger damage %s" % (step, record["layout"], record["trigger_damage"]))
    if record.get("messages") is not None and record["messages"] != expected:
        out.append("%s: %d messages stored, want %d" % (step, record["messages"], expected))
    return out


def run_scenario(programs, name, start, steps):
    folder = tempfile.mkdtemp(prefix="hermes-compat-rt-")
    try:
        store = unpack(start, folder) if start else os.path.join(folder, "state.db")
        expected = count_messages(store)
        # Ours builds its index where a store has none (or ours of old); on a release's store it uses theirs.
        layout = "current" if (start or "").startswith("hermes_state_") or (not start and steps[0][0] == "ours") \
            else None
        problems, uids = [], message_uids(store)
        for number, (program, action) in enumerate(steps, 1):
            step = "%d %s %s" % (number, program, action)
            record = programs.run(program, action, store, "%s-%d" % (program, number))
            if action == "write":
                expected += ROWS_PER_WRITE
            record["messages"] = count_messages(store)
            problems += judge(step, record, expected, layout)
            now = message_uids(store)
            problems += judge_uids(step, uids, now, final=number == len(steps))
            uids = now
        return problems
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_export_round_trip(programs, release):
    """A history ours wrote, exported by ours, imported and exported again by `release`, and
    imported by ours: every message keeps its message_uid the whole way."""
    folder = tempfile.mkdtemp(prefix="hermes-compat-xuid-")
    try:
        stores = [os.path.join(folder, "%s.db" % name) for name in ("a", "b", "c")]
        files = [os.path.join(folder, "%s.jsonl" % name) for name in ("a", "b")]
        steps = [("ours", "write", stores[0], "first"), ("ours", "write", stores[0], "second"),
                 ("ours", "export", stores[0], files[0]), (release, "import", stores[1], files[0]),
                 (release, "export", stores[1], files[1]), ("ours", "import", stores[2], files[1])]
        problems, seen = [], []
        for number, (program, action, store, tag) in enumerate(steps, 1):
            step = "%d %s %s" % (number, program, action)
            record = programs.run(program, action, store, tag)
            if "died" in record or record.get("ok") is False:
                problems.append("%s: %s" % (step, record.get("died") or record))
            elif "uids" in record:
                seen.append((step, record["uids"]))
        if not problems:
            first_step, first = seen[0]
            if not first or not all(uid for _, uids in first for uid in uids):
                problems.append("%s: messages without a message_uid: %s" % (first_step, first))
            problems += ["%s: the uids differ from %s's: %s" % (step, first_step, uids)
                         for step, uids in seen[1:] if uids != first]
        return problems
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_optimize(programs, python, overlay, fixture):
    """hermes-agent 0.20's own `sessions optimize-storage --yes` on our modules, to the end."""
    folder = tempfile.mkdtemp(prefix="hermes-compat-optimize-")
    try:
        store = unpack(fixture, folder)
        before = count_messages(store)
        swap = venvs.ensure_venv("swap", python)
        env = venvs.target_env("swap", overlay)
        env.update({"HERMES_HOME": folder, "HOME": folder, "TZ": "UTC", "TERM": "dumb", "NO_COLOR": "1"})
        done = subprocess.run([os.path.join(swap, "bin", "hermesx"), "sessions", "optimize-storage", "--yes"],
                              env=env, cwd=folder, capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL)
        problems = []
        # (a 0.20 store's index is layout 3 once our open moved it: then there is nothing to do)
        finished = "Search index optimized" in done.stdout or "nothing to do" in done.stdout
        if done.returncode != 0 or not finished or "Error" in done.stdout:
            tail = (done.stdout.strip().splitlines() + done.stderr.strip().splitlines())[-3:]
            problems.append("exit %s: %s" % (done.returncode, " | ".join(tail)))
        record = programs.run("ours", "check", store, "check")
        record["messages"] = count_messages(store)
        return problems + judge("after", record, before, "current")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_all(python, overlay):
    """[(scenario name, [problems])] of every round trip and optimize-storage run."""
    home = tempfile.mkdtemp(prefix="hermes-compat-rt-home-")
    try:
        programs = Programs(python, home)
        results = [("releases/" + name, run_scenario(programs, name, start, steps))
                   for name, (start, steps) in SCENARIOS.items()]
        results.append(("releases/export-uids-ours-0.22-ours",
                        run_export_round_trip(programs, "0.22")))
        for fixture in OPTIMIZE_FIXTURES:
            results.append(("releases/optimize-storage-" + fixture.split("_")[1],
                            run_optimize(programs, python, overlay, fixture)))
        return results
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    overlay = venvs.make_overlay()
    try:
        for scenario, problems in run_all(venvs.find_python(), overlay):
            print("%-45s %s" % (scenario, "FAIL" if problems else "PASS"))
            for line in problems:
                print("  " + line)
    finally:
        shutil.rmtree(overlay, ignore_errors=True)
