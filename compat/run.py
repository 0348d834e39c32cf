"""`make compat`: run hermes-agent 0.20.1.2 and 0.22.2.post1 each on its own state layer and on ours,
compare, report; pass stores between ours and the releases 0.19, 0.20 and 0.22.

Owns: the order of the run (venvs, overlay, API scenarios, in-process checks, end-to-end run, store
round trips (`releases.py`), JSONL exports passed each way (`xport.py`)), the comparison of the
reference's record with ours, the deliberate-differences list, and the report: one PASS/FAIL line
per scenario, the differences under each failure, a line per side, and a closing `N passed, N failed`
line over every side run; the exit code is non-zero on any failure. Must not touch: the repo's
product modules (they are copied, never edited), any network but 127.0.0.1 during the end-to-end
run.

Usage: python3 compat/run.py [--only api|inprocess|e2e|releases|xport|fuzz] [--side 0.20|0.22] [--details N]
Environment: HERMES_COMPAT_CACHE (venv cache), COMPAT_PYTHON (the CPython that builds the venvs),
COMPAT_KEEP=1 (keep the e2e temp homes), COMPAT_MODULES_FROM=DIR (run another checkout's state modules
on the swap side), COMPAT_OUR_CONSTANTS=1 (diagnostic only, see docs/testing.md).
"""

import argparse
import difflib
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import normalise  # noqa: E402  (the folder is a tool box, not a package)
import releases  # noqa: E402
import venvs  # noqa: E402
import xport  # noqa: E402

OUT = os.path.join(HERE, "out")
DELIBERATE = os.path.join(HERE, "deliberate.txt")
E2E_TIMEOUT = 1800  # from when run.py starts waiting; e2e.py's own budget stops it first
API_TIMEOUT = 300
INPROCESS_TIMEOUT = 900


# ---- deliberate differences -------------------------------------------------------------------------

def load_deliberate(path=DELIBERATE):
    """Return [(glob, reason)] from the deliberate-differences file; an entry without a reason is an error."""
    entries = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            pattern, sep, reason = line.rpartition(" | ")
            if not sep or not pattern.strip() or not reason.strip():
                raise SystemExit("compat: %s line %d: want '<glob> | <reason>'" % (path, number))
            entries.append((pattern.strip(), reason.strip()))
    return entries


def excuse(difference, entries, used):
    for pattern, reason in entries:
        if fnmatch.fnmatchcase(difference, pattern):
            used.add(pattern)
            return reason
    return None


# ---- comparing values -------------------------------------------------------------------------------

def short(value, width=90):
    text = json.dumps(value, sort_keys=True, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def deep_diff(ref, ours, path="", limit=4):
    """Return up to `limit` lines 'path: ref X, ours Y' where two JSON values differ."""
    if ref == ours:
        return []
    if isinstance(ref, dict) and isinstance(ours, dict):
        out = []
        for key in sorted(set(ref) | set(ours), key=str):
            if key not in ours:
                out.append("%s.%s: missing in ours (ref %s)" % (path, key, short(ref[key], 60)))
            elif key not in ref:
                out.append("%s.%s: only in ours (%s)" % (path, key, short(ours[key], 60)))
            else:
                out.extend(deep_diff(ref[key], ours[key], "%s.%s" % (path, key), limit))
            if len(out) >= limit:
                break
        return out[:limit]
    if isinstance(ref, list) and isinstance(ours, list):
        out = []
        for index in range(max(len(ref), len(ours))):
            if index >= len(ours):
                out.append("%s[%d]: missing in ours (ref has %d items, ours %d)" % (path, index, len(ref), len(ours)))
                break
            if index >= len(ref):
                out.append("%s[%d]: extra in ours (ref has %d items, ours %d)" % (path, index, len(ref), len(ours)))
                break
            out.extend(deep_diff(ref[index], ours[index], "%s[%d]" % (path, index), limit))
            if len(out) >= limit:
                break
        return out[:limit]
    if isinstance(ref, str) and isinstance(ours, str) and max(len(ref), len(ours)) > 90:
        same = len(os.path.commonprefix([ref, ours]))
        start = max(0, same - 20)
        return ["%s: differ from char %d: ref %s, ours %s" % (
            path or "value", same, short("..." + ref[start:start + 70]), short("..." + ours[start:start + 70]))]
    return ["%s: ref %s, ours %s" % (path or "value", short(ref), short(ours))]


def table_diffs(ref_rows, our_rows, table):
    """Return (key, line) differences of one stored table given as lists of row dicts (or an error dict).

    The key names the cell (or the table, or its row count) without the values, so a caller reporting
    each key once shows where a difference appeared, not every later step it carried into.
    """
    if not isinstance(ref_rows, list):
        if not isinstance(our_rows, list):
            return []
        return [(table, "%s: ref %s, ours has the table" % (table, short(ref_rows)))]
    if not isinstance(our_rows, list):
        return [(table, "%s: ref has %d rows, ours %s" % (table, len(ref_rows), short(our_rows)))]
    out = []
    if ref_rows and our_rows:
        for column in sorted(set(ref_rows[0]) - set(our_rows[0])):
            out.append((table + "." + column, "%s.%s: column missing in ours" % (table, column)))
    if len(ref_rows) != len(our_rows):
        out.append((table + ":count", "%s: ref %d rows, ours %d" % (table, len(ref_rows), len(our_rows))))
    for index, (ref, ours) in enumerate(zip(ref_rows, our_rows)):
        for column in ref:
            if column in ours and ref[column] != ours[column]:
                out.append(("%s[%d].%s" % (table, index, column), "%s[%d].%s: ref %s, ours %s" % (
                    table, index, column, short(ref[column], 70), short(ours[column], 70))))
    return out


def text_diffs(ref_lines, our_lines):
    """Return '-ref line' / '+ours line' differences of two normalised texts."""
    out = []
    for line in difflib.ndiff(ref_lines, our_lines):
        if line.startswith("- "):
            out.append("-ref " + line[2:])
        elif line.startswith("+ "):
            out.append("+ours " + line[2:])
    return out


# ---- the API scenarios ------------------------------------------------------------------------------

def rows_as_dicts(dumped, norm):
    out = {}
    for table, content in sorted(dumped.items()):
        if isinstance(content, dict) and "rows" in content:
            out[table] = [{k: norm.value(v) for k, v in zip(content["columns"], row)} for row in content["rows"]]
        else:
            out[table] = content
    return out


def compare_api_scenario(ref, ours, paths):
    """Return the difference lines (without prefix) of one API scenario; `paths` maps folders to placeholders."""
    ref_norm = normalise.Normaliser(dict(paths, **{ref["root"]: "<root>"}))
    our_norm = normalise.Normaliser(dict(paths, **{ours["root"]: "<root>"}))
    if ref.get("setup"):
        return ["setup: the reference itself failed: %s" % short(ref["setup"])]
    if ours.get("setup"):
        return ["setup: ours raised %s: %s" % (ours["setup"]["raises"][0], our_norm.text(ours["setup"]["message"])[:200])]
    out = []
    seen_rows = set()
    for number, ref_step in enumerate(ref["steps"], 1):
        label = "%02d %s" % (number, ref_step["call"].split("(")[0])
        if number > len(ours["steps"]):
            out.append("%s: not run in ours" % label)
            continue
        our_step = ours["steps"][number - 1]
        if "raises" in ref_step:
            if "raises" not in our_step:
                out.append("%s/outcome: ref raises %s, ours returns %s" % (
                    label, ref_step["raises"][0], short(our_norm.value(our_step.get("returns")), 60)))
            elif ref_step["raises"][0] not in our_step["raises"]:
                out.append("%s/outcome: ref raises %s, ours %s (not a subclass): %s" % (
                    label, ref_step["raises"][0], our_step["raises"][0], our_step["message"][:120]))
        elif "raises" in our_step:
            out.append("%s/outcome: ref returns %s, ours raises %s: %s" % (
                label, short(ref_norm.value(ref_step.get("returns")), 60), our_step["raises"][0],
                our_step["message"][:120]))
        else:
            for line in deep_diff(ref_norm.value(ref_step.get("returns")), our_norm.value(our_step.get("returns"))):
                out.append("%s/returns%s" % (label, line if line.startswith(("[", ".")) else ": " + line))
        ref_rows = rows_as_dicts(ref_step["rows"], ref_norm)
        our_rows = rows_as_dicts(our_step["rows"], our_norm)
        for table in sorted(ref_rows):
            for key, line in table_diffs(ref_rows[table], our_rows.get(table, {"error": "no table"}), table):
                # A difference carried over from an earlier step is reported once, where it appeared.
                if key not in seen_rows:
                    seen_rows.add(key)
                    out.append("%s/rows/%s" % (label, line))
    return out


# ---- the in-process checks --------------------------------------------------------------------------

def run_inprocess(kind, venv, overlay, self_check, mode, out=OUT, release=venvs.REFERENCE_VERSION):
    """Start inprocess.py in one venv (`mode` '' for the scenarios, '--imports' for the import walk);
    return (Popen, out_file, log_file)."""
    name = "inprocess%s-%s" % (mode.replace("--", "-"), kind)
    out_file, log_file = os.path.join(out, name + ".json"), os.path.join(out, name + ".log")
    env = venvs.target_env("ref" if self_check else kind, overlay)
    env["COMPAT_RELEASE"] = release
    log = open(log_file, "w")
    cmd = [venvs.venv_python(venv), os.path.join(HERE, "inprocess.py")] + ([mode] if mode else []) + [out_file]
    return subprocess.Popen(cmd, env=env, cwd=out, stdin=subprocess.DEVNULL, stdout=log, stderr=log), out_file, log_file


def finish_inprocess(started):
    """Wait for the started inprocess.py runs; return {(kind, mode): record or {'died': why}}."""
    out = {}
    for key, (proc, out_file, log_file) in started.items():
        venvs.wait_or_kill(proc, INPROCESS_TIMEOUT)
        if proc.returncode != 0 or not os.path.exists(out_file):
            with open(log_file) as fh:
                last = (fh.read().strip().splitlines() or [""])[-1]
            out[key] = {"died": "inprocess.py exited %s: %s" % (proc.returncode, last)}
        else:
            with open(out_file) as fh:
                out[key] = json.load(fh)
    return out


def compare_imports(ref, ours, paths=None):
    """Return (differences, notes): a module the reference imports and ours does not is a difference; a
    module failing on both (an optional dependency hermes-agent lacks here) is a note."""
    if "died" in ours:
        return ["the import walk died in ours: " + ours["died"]], []
    diffs, notes = [], []
    norm = normalise.Normaliser(paths)
    for name, why in sorted(ref["modules"].items()):
        if name not in ours["modules"]:
            diffs.append("%s: not walked in ours" % name)
        elif why is None and ours["modules"][name] is not None:
            diffs.append("%s: ref imports it, ours fails: %s" % (name, norm.text(ours["modules"][name])))
        elif why is not None:
            notes.append("%s: fails on both (ref: %s)" % (name, why))
    return diffs, notes


# ---- the end-to-end run -----------------------------------------------------------------------------

CRASH_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")


def crash(lines):
    """Return the last exception line of a Python traceback in `lines`, or None."""
    if not any(line.startswith("Traceback (most recent call last)") for line in lines):
        return None
    found = [line for line in lines if CRASH_LINE.match(line)]
    return found[-1] if found else "a traceback without an exception line"


def died_by_signal(exit_code):
    return isinstance(exit_code, int) and exit_code < 0


def compare_e2e_step(ref, ours, seen_rows):
    # The 0.20 host check is no comparison: a message dict handed back with message_uid fails on either side.
    out = ["host-check: %s: %s" % (side, line) for side, record in (("ref", ref), ("ours", ours))
           for line in record.get("hostcheck", [])]
    ref_crash, our_crash = crash(ref["stderr"] + ref["stdout"]), crash(ours["stderr"] + ours["stdout"])
    if our_crash != ref_crash:
        # First, so the cause shows above the traceback's lines.
        out.append("crash: ref %s, ours %s" % (ref_crash or "none", our_crash or "none"))
    # 0.22 on its own modules now and then dies by SIGSEGV as it exits, its output whole (seen once
    # in ~10 CI-like runs, in a turn): a signal of the reference's is its failure, not a difference.
    if ref["exit"] != ours["exit"] and not (died_by_signal(ref["exit"]) and ours["exit"] == 0):
        out.append("exit: ref %s, ours %s" % (ref["exit"], ours["exit"]))
    for stream in ("stdout", "stderr"):
        out.extend("%s: %s" % (stream, line) for line in text_diffs(ref[stream], ours[stream]))
    for line in deep_diff(ref["requests"], ours["requests"], limit=6):
        out.append("requests" + (line if line.startswith(("[", ".")) else ": " + line))
    for name in sorted(set(ref.get("files", {})) | set(ours.get("files", {}))):
        ref_file, our_file = ref.get("files", {}).get(name), ours.get("files", {}).get(name)
        if ref_file is None or our_file is None:
            out.append("files/%s: %s" % (name, "only in ours" if ref_file is None else "missing in ours"))
        else:
            out.extend("files/%s: %s" % (name, line) for line in text_diffs(ref_file, our_file))
    ref_store, our_store = ref["store"], ours["store"]
    for table in ("sessions", "messages", "session_model_usage"):
        for key, line in table_diffs(ref_store.get(table, []), our_store.get(table, {"error": "no store"}), table):
            if key not in seen_rows:
                seen_rows.add(key)
                out.append("store/" + line)
    return out


def start_api_worker(kind, venv, overlay, self_check, out=OUT, release=venvs.REFERENCE_VERSION):
    """Start api_worker.py in one venv; return (Popen, out_file, log_file)."""
    out_file, log_file = os.path.join(out, "api-%s.json" % kind), os.path.join(out, "api-%s.log" % kind)
    env = venvs.target_env("ref" if self_check else kind, overlay)
    cmd = [venvs.venv_python(venv), os.path.join(HERE, "api_worker.py"), out_file]
    if release != venvs.REFERENCE_VERSION:
        cmd += ["--release", release]
    log = open(log_file, "w")
    return subprocess.Popen(cmd, env=env, cwd=out, stdin=subprocess.DEVNULL, stdout=log, stderr=log), out_file, log_file


def finish_api_worker(started):
    """Return the API record of a started worker, or {'died': why} when it crashed or hung."""
    proc, out_file, log_file = started
    status = venvs.wait_or_kill(proc, API_TIMEOUT)
    if status < 0:
        return {"died": "the API worker ran over %d s (a hang?)" % API_TIMEOUT}
    if status != 0 or not os.path.exists(out_file):
        with open(log_file) as fh:
            last = (fh.read().strip().splitlines() or [""])[-1]
        return {"died": "the API worker exited %s: %s" % (status, last)}
    with open(out_file) as fh:
        return json.load(fh)


def run_e2e(kind, venv, overlay, out_file, log_file, release=venvs.REFERENCE_VERSION):
    """Start e2e.py for one venv (in a private network namespace when possible); return the Popen."""
    cmd = [sys.executable, os.path.join(HERE, "e2e.py"), "--kind", kind, "--venv", venv, "--out", out_file,
           "--release", release]
    if overlay:
        cmd += ["--overlay", overlay]
    if shutil.which("unshare") and shutil.which("ip") and subprocess.run(
            ["unshare", "-n", "true"], capture_output=True).returncode == 0:
        inner = " ".join("'%s'" % part.replace("'", "'\\''") for part in cmd)
        cmd = ["unshare", "-n", "sh", "-c", "ip link set lo up && exec " + inner]
    else:
        print("compat: no private network namespace here (needs root and unshare): hermes-agent may reach "
              "the network during the e2e run", file=sys.stderr)
    log = open(log_file, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


# ---- report -----------------------------------------------------------------------------------------

V22 = "0.22.2.post1"


def side_prefix(release):
    """Return the prefix of a side's scenario names: none for 0.20 (as before there were two), '0.22/'."""
    return "" if release == venvs.REFERENCE_VERSION else release[:4] + "/"


def side_of(name):
    """Return the release a scenario name belongs to."""
    return next((r for r in venvs.SIDES if side_prefix(r) and name.startswith(side_prefix(r))),
                venvs.REFERENCE_VERSION)


def side_out(release):
    """Return (and make) the folder of a side's raw records: compat/out for 0.20, compat/out/0.22."""
    folder = os.path.join(OUT, side_prefix(release).rstrip("/"))
    os.makedirs(folder, exist_ok=True)
    return folder


def compare_api_records(ref_api, our_api, paths, prefix, kind="api"):
    """Return [(scenario, differences)] of two API-shaped records (the API worker's, inprocess.py's)."""
    out = []
    ours_by_name = {s["name"]: s for s in our_api.get("scenarios", [])}
    for scenario in ref_api["scenarios"]:
        ours = ours_by_name.get(scenario["name"])
        if ours is None:
            diffs = ["not run in ours: " + normalise.Normaliser(paths).text(our_api.get("died", "missing"))]
        else:
            diffs = compare_api_scenario(scenario, ours, paths)
        out.append(("%s%s/%s" % (prefix, kind, scenario["name"]), diffs))
    return out


# Lines by which hermes-agent reports its own failure without a traceback: 0.22's FTS5 write probe
# (an FTS5 'flush' command SQLite 3.40.1 rejects) and its read-only commands on a store it has not
# migrated yet.
REFERENCE_FAILURE_LINES = re.compile(r"fts5 write probe failed|session database needs migration")


def reference_failures(ref_e2e):
    """Return {step name: crash line} of the e2e steps where the reference itself failed."""
    out = {}
    for step in ref_e2e["steps"]:
        lines = step["stderr"] + step["stdout"]
        line = crash(lines) or next((l for l in lines if REFERENCE_FAILURE_LINES.search(l)), None)
        if died_by_signal(step["exit"]):
            line = line or "killed by signal %d" % -step["exit"]
        if line or step["exit"] == "timeout":
            out[step["name"]] = line or "timeout"
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("api", "inprocess", "e2e", "releases", "xport", "fuzz"))
    parser.add_argument("--side", choices=("0.20", "0.22"),
                        help="run one release's side only (releases and xport belong to the 0.20 side)")
    parser.add_argument("--details", type=int, default=12, help="differences printed per failed scenario")
    parser.add_argument("--self-check", action="store_true",
                        help="run the reference on both sides: any difference is noise in the harness itself")
    args = parser.parse_args(argv)
    started = time.monotonic()
    deliberate = load_deliberate()
    python = venvs.find_python()
    sides = [release for release in venvs.SIDES if not args.side or release.startswith(args.side + ".")]
    pairs = {}  # release -> (ref venv, swap venv)
    for release in sides:
        ref_venv = venvs.ensure_venv("ref", python, version=release)
        swap_venv = venvs.ensure_venv("swap", python, version=release)
        pairs[release] = (ref_venv, ref_venv if args.self_check else swap_venv)
    setup_seconds = time.monotonic() - started
    overlay = venvs.make_overlay()
    paths = {overlay: "<site>"}
    for ref_venv, swap_venv in pairs.values():
        paths.update({venvs.site_packages(ref_venv): "<site>", venvs.site_packages(swap_venv): "<site>"})
    diagnostic = os.environ.get("COMPAT_OUR_CONSTANTS") == "1"
    if diagnostic:
        shutil.copy2(os.path.join(venvs.REPO, "hermes_constants.py"), overlay)
        # hermes-agent's CLI puts its own folder first on sys.path, so there its hermes_constants wins anyway.
        args.only = "api"
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    results = []  # (scenario, [differences])
    import_notes = []
    ref_failures = {}  # scenario -> the reference's own crash line
    timings = {}
    e2e_procs = {}
    try:
        # The end-to-end runs take longest and wait on their model server between steps: they start
        # first and run beside the rest.
        if args.only in (None, "e2e"):
            e2e_started = time.monotonic()
            for release, (ref_venv, swap_venv) in pairs.items():
                for kind, venv in (("ref", ref_venv), ("swap", swap_venv)):
                    files = [os.path.join(side_out(release), "e2e-%s.%s" % (kind, ext)) for ext in ("json", "log")]
                    e2e_procs[(release, kind)] = run_e2e(
                        kind, venv, overlay if kind == "swap" and not args.self_check else None,
                        files[0], files[1], release)
        if args.only in (None, "api"):
            t0 = time.monotonic()
            started_api = {(release, kind): start_api_worker(kind, venv, overlay, args.self_check,
                                                             side_out(release), release)
                           for release, pair in pairs.items() for kind, venv in zip(("ref", "swap"), pair)}
            for release in pairs:
                ref_api = finish_api_worker(started_api[(release, "ref")])
                our_api = finish_api_worker(started_api[(release, "swap")])
                if "died" in ref_api:
                    raise SystemExit("compat: the API scenarios failed on the reference %s itself: %s"
                                     % (release, ref_api["died"]))
                results.extend(compare_api_records(ref_api, our_api, paths, side_prefix(release)))
            timings["api"] = time.monotonic() - t0
        if args.only in (None, "inprocess"):
            t0 = time.monotonic()
            for release, pair in pairs.items():
                started_in = {(kind, mode): run_inprocess(kind, venv, overlay, args.self_check, mode,
                                                          side_out(release), release)
                              for mode in ("", "--imports") for kind, venv in zip(("ref", "swap"), pair)}
                done = finish_inprocess(started_in)
                for mode in ("", "--imports"):
                    if "died" in done[("ref", mode)]:
                        raise SystemExit("compat: the in-process checks failed on the reference %s itself: %s"
                                         % (release, done[("ref", mode)]["died"]))
                prefix = side_prefix(release)
                results.extend(compare_api_records(done[("ref", "")], done[("swap", "")], paths, prefix,
                                                   "inprocess"))
                diffs, notes = compare_imports(done[("ref", "--imports")], done[("swap", "--imports")], paths)
                results.append((prefix + "inprocess/import-every-module", diffs))
                import_notes.extend(prefix + note for note in notes)
            timings["inprocess"] = time.monotonic() - t0
        if args.only in (None, "releases") and not args.self_check and venvs.REFERENCE_VERSION in pairs:
            t0 = time.monotonic()
            results.extend(releases.run_all(python, overlay))
            timings["releases"] = time.monotonic() - t0
        if args.only in (None, "xport") and venvs.REFERENCE_VERSION in pairs:
            t0 = time.monotonic()
            ref_venv, swap_venv = pairs[venvs.REFERENCE_VERSION]
            results.extend(xport.run_all(ref_venv, swap_venv, None if args.self_check else overlay))
            timings["xport"] = time.monotonic() - t0
        if args.only == "fuzz" and venvs.REFERENCE_VERSION in pairs:
            # not in the default run yet: see docs/testing.md, "Randomized and adversarial tests"
            t0 = time.monotonic()
            import fuzz
            ref_venv, swap_venv = pairs[venvs.REFERENCE_VERSION]
            results.extend(fuzz.run_all(ref_venv, swap_venv, None if args.self_check else overlay))
            timings["fuzz"] = time.monotonic() - t0
        for release in pairs if e2e_procs else ():
            for kind in ("ref", "swap"):
                proc = e2e_procs[(release, kind)]
                venvs.wait_or_kill(proc, E2E_TIMEOUT)
                if proc.returncode != 0:
                    with open(os.path.join(side_out(release), "e2e-%s.log" % kind)) as fh:
                        tail = fh.read()[-3000:]
                    raise SystemExit("compat: the e2e run of %s on %s failed (exit %s):\n%s"
                                     % (release, kind, proc.returncode, tail))
            records = {}
            for kind in ("ref", "swap"):
                with open(os.path.join(side_out(release), "e2e-%s.json" % kind)) as fh:
                    records[kind] = json.load(fh)
            prefix = side_prefix(release)
            seen_rows = {}  # per HERMES_HOME of the run: a home's stored rows are its own
            failing = reference_failures(records["ref"])
            for ref_step, our_step in zip(records["ref"]["steps"], records["swap"]["steps"]):
                name = prefix + "e2e/" + ref_step["name"]
                if ref_step["name"] in failing:
                    ref_failures[name] = failing[ref_step["name"]]
                results.append((name, compare_e2e_step(
                    ref_step, our_step, seen_rows.setdefault(ref_step.get("home", ""), set()))))
        if e2e_procs:
            timings["e2e"] = time.monotonic() - e2e_started
    finally:
        for proc in e2e_procs.values():
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(overlay, ignore_errors=True)

    used = set()
    report = []
    passed = failed = 0
    width = max(len(name) for name, _ in results) if results else 10
    lines = []
    for name, diffs in results:
        open_diffs = [d for d in diffs if excuse("%s/%s" % (name, d), deliberate, used) is None]
        excused = len(diffs) - len(open_diffs)
        if open_diffs:
            failed += 1
        else:
            passed += 1
        note = " (%d deliberate)" % excused if excused else ""
        if name in ref_failures:
            note += " (the reference itself fails: %s)" % ref_failures[name][:120]
        lines.append("%-*s  %s%s" % (width, name, "FAIL" if open_diffs else "PASS", note))
        if open_diffs:
            report.append((name, open_diffs))
    full = [l for l in lines]
    for name, open_diffs in report:
        full.append("")
        full.append("%s: %d difference(s)" % (name, len(open_diffs)))
        full.extend("  " + d for d in open_diffs)
    if ref_failures:
        full.append("")
        full.append("%d end-to-end step(s) where the reference itself fails:" % len(ref_failures))
        full.extend("  %s: %s" % item for item in sorted(ref_failures.items()))
    if import_notes:
        full.append("")
        full.append("inprocess/import-every-module: %d module(s) fail on the reference too:" % len(import_notes))
        full.extend("  " + n for n in import_notes)
    with open(os.path.join(OUT, "report.txt"), "w") as fh:
        fh.write("\n".join(full) + "\n")

    print("scenario".ljust(width) + "  result")
    print("\n".join(lines))
    for name, open_diffs in report:
        print("\n%s: %d difference(s)%s" % (name, len(open_diffs),
                                           "" if len(open_diffs) <= args.details else ", first %d" % args.details))
        for line in open_diffs[:args.details]:
            print("  " + (line if len(line) <= 220 else line[:217] + "..."))
    if import_notes:
        print("\ncompat: %d hermes-agent module(s) fail to import on the reference too (listed in the report):"
              % len(import_notes))
        for note in import_notes[:args.details]:
            print("  " + (note if len(note) <= 220 else note[:217] + "..."))
    stale = [p for p, _ in deliberate if p not in used] if not (args.only or args.side) else []
    if stale:
        print("\ncompat: deliberate entries that matched nothing (remove them when the gap is closed):")
        for pattern in stale:
            print("  " + pattern)
    print("\ncompat: venvs %.0f s, %s; full report in %s" % (
        setup_seconds, ", ".join("%s %.0f s" % kv for kv in timings.items()), os.path.relpath(
            os.path.join(OUT, "report.txt"))))
    if args.self_check:
        print("compat: SELF-CHECK: the reference ran on both sides; a difference is the harness's own noise")
    if diagnostic:
        print("compat: DIAGNOSTIC RUN: our hermes_constants.py was copied too; this is not the drop-in test")
    if ref_failures:
        print("compat: %d end-to-end step(s) where the reference itself fails (marked above, listed in the report)"
              % len(ref_failures))
    failed_names = {name for name, _ in report}
    # Every side gates the run: 0.22's since every step it passes on its own modules passes on ours
    # (a step it fails on its own is excused line by line in the deliberate list).
    passed = failed = 0
    for release in pairs:
        mine = [name for name, _ in results if side_of(name) == release]
        bad = sum(1 for name in mine if name in failed_names)
        print("compat: %s side: %d passed, %d failed" % (release, len(mine) - bad, bad))
        passed, failed = passed + len(mine) - bad, failed + bad
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed or diagnostic else 0


if __name__ == "__main__":
    sys.exit(main())
