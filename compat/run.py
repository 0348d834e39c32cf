"""`make compat`: run hermes-agent 0.20.1.2 on its own state layer and on ours, compare, report; pass
stores between ours and the releases 0.19, 0.20 and 0.22.

Owns: the order of the run (venvs, overlay, API scenarios, in-process checks, end-to-end run, store
round trips (`releases.py`), JSONL exports passed each way (`xport.py`)), the comparison of the
reference's record with ours, the deliberate-differences list, and the report: one PASS/FAIL line
per scenario, the differences under each failure, and a closing `N passed, N failed` line; the exit
code is non-zero on any failure. Must not touch: the repo's product modules (they are copied, never
edited), any network but 127.0.0.1 during the end-to-end run.

Usage: python3 compat/run.py [--only api|inprocess|e2e|releases|xport|fuzz] [--details N]
Environment: HERMES_COMPAT_CACHE (venv cache), COMPAT_PYTHON (the CPython that builds the venvs),
COMPAT_KEEP=1 (keep the e2e temp homes), COMPAT_OUR_CONSTANTS=1 (diagnostic only, see docs/testing.md).
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
E2E_TIMEOUT = 900
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

def run_inprocess(kind, venv, overlay, self_check, mode):
    """Start inprocess.py in one venv (`mode` '' for the scenarios, '--imports' for the import walk);
    return (Popen, out_file, log_file)."""
    name = "inprocess%s-%s" % (mode.replace("--", "-"), kind)
    out_file, log_file = os.path.join(OUT, name + ".json"), os.path.join(OUT, name + ".log")
    env = venvs.target_env("ref" if self_check else kind, overlay)
    log = open(log_file, "w")
    cmd = [venvs.venv_python(venv), os.path.join(HERE, "inprocess.py")] + ([mode] if mode else []) + [out_file]
    return subprocess.Popen(cmd, env=env, cwd=OUT, stdin=subprocess.DEVNULL, stdout=log, stderr=log), out_file, log_file


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


def compare_imports(ref, ours):
    """Return (differences, notes): a module the reference imports and ours does not is a difference; a
    module failing on both (an optional dependency hermes-agent lacks here) is a note."""
    if "died" in ours:
        return ["the import walk died in ours: " + ours["died"]], []
    diffs, notes = [], []
    for name, why in sorted(ref["modules"].items()):
        if name not in ours["modules"]:
            diffs.append("%s: not walked in ours" % name)
        elif why is None and ours["modules"][name] is not None:
            diffs.append("%s: ref imports it, ours fails: %s" % (name, ours["modules"][name]))
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


def compare_e2e_step(ref, ours, seen_rows):
    out = []
    ref_crash, our_crash = crash(ref["stderr"] + ref["stdout"]), crash(ours["stderr"] + ours["stdout"])
    if our_crash != ref_crash:
        # First, so the cause shows above the traceback's lines.
        out.append("crash: ref %s, ours %s" % (ref_crash or "none", our_crash or "none"))
    if ref["exit"] != ours["exit"]:
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


def run_api_worker(kind, venv, overlay, self_check):
    """Return the API record of one venv, or {'died': why} when its worker crashed or hung."""
    out_file, log_file = os.path.join(OUT, "api-%s.json" % kind), os.path.join(OUT, "api-%s.log" % kind)
    env = venvs.target_env("ref" if self_check else kind, overlay)
    with open(log_file, "w") as log:
        try:
            status = subprocess.run([venvs.venv_python(venv), os.path.join(HERE, "api_worker.py"), out_file],
                                    env=env, cwd=OUT, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    timeout=API_TIMEOUT).returncode
        except subprocess.TimeoutExpired:
            return {"died": "the API worker ran over %d s (a hang?)" % API_TIMEOUT}
    if status != 0 or not os.path.exists(out_file):
        with open(log_file) as fh:
            last = (fh.read().strip().splitlines() or [""])[-1]
        return {"died": "the API worker exited %s: %s" % (status, last)}
    with open(out_file) as fh:
        return json.load(fh)


def run_e2e(kind, venv, overlay, out_file, log_file):
    """Start e2e.py for one venv (in a private network namespace when possible); return the Popen."""
    cmd = [sys.executable, os.path.join(HERE, "e2e.py"), "--kind", kind, "--venv", venv, "--out", out_file]
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

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("api", "inprocess", "e2e", "releases", "xport", "fuzz"))
    parser.add_argument("--details", type=int, default=12, help="differences printed per failed scenario")
    parser.add_argument("--self-check", action="store_true",
                        help="run the reference on both sides: any difference is noise in the harness itself")
    args = parser.parse_args(argv)
    started = time.monotonic()
    deliberate = load_deliberate()
    python = venvs.find_python()
    ref_venv = venvs.ensure_venv("ref", python)
    swap_venv = venvs.ensure_venv("swap", python)
    setup_seconds = time.monotonic() - started
    if args.self_check:
        swap_venv = ref_venv
    overlay = venvs.make_overlay()
    paths = {venvs.site_packages(ref_venv): "<site>", venvs.site_packages(swap_venv): "<site>", overlay: "<site>"}
    diagnostic = os.environ.get("COMPAT_OUR_CONSTANTS") == "1"
    if diagnostic:
        shutil.copy2(os.path.join(venvs.REPO, "hermes_constants.py"), overlay)
        # hermes-agent's CLI puts its own folder first on sys.path, so there its hermes_constants wins anyway.
        args.only = "api"
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    results = []  # (scenario, [differences])
    import_notes = []
    try:
        timings = {}
        if args.only in (None, "api"):
            t0 = time.monotonic()
            ref_api = run_api_worker("ref", ref_venv, overlay, args.self_check)
            our_api = run_api_worker("swap", swap_venv, overlay, args.self_check)
            if "died" in ref_api:
                raise SystemExit("compat: the API scenarios failed on the reference itself: " + ref_api["died"])
            ours_by_name = {s["name"]: s for s in our_api.get("scenarios", [])}
            for scenario in ref_api["scenarios"]:
                ours = ours_by_name.get(scenario["name"])
                if ours is None:
                    diffs = ["not run in ours: " + normalise.Normaliser(paths).text(our_api.get("died", "missing"))]
                else:
                    diffs = compare_api_scenario(scenario, ours, paths)
                results.append(("api/" + scenario["name"], diffs))
            timings["api"] = time.monotonic() - t0
        if args.only in (None, "inprocess"):
            t0 = time.monotonic()
            started = {(kind, mode): run_inprocess(kind, venv, overlay, args.self_check, mode)
                       for mode in ("", "--imports") for kind, venv in (("ref", ref_venv), ("swap", swap_venv))}
            done = finish_inprocess(started)
            for mode in ("", "--imports"):
                if "died" in done[("ref", mode)]:
                    raise SystemExit("compat: the in-process checks failed on the reference itself: "
                                     + done[("ref", mode)]["died"])
            ours_by_name = {s["name"]: s for s in done[("swap", "")].get("scenarios", [])}
            for scenario in done[("ref", "")]["scenarios"]:
                ours = ours_by_name.get(scenario["name"])
                diffs = (compare_api_scenario(scenario, ours, paths) if ours is not None else
                         ["not run in ours: " + done[("swap", "")].get("died", "missing")])
                results.append(("inprocess/" + scenario["name"], diffs))
            diffs, import_notes = compare_imports(done[("ref", "--imports")], done[("swap", "--imports")])
            results.append(("inprocess/import-every-module", diffs))
            timings["inprocess"] = time.monotonic() - t0
        if args.only in (None, "e2e"):
            t0 = time.monotonic()
            procs = {kind: run_e2e(kind, venv, overlay if kind == "swap" and not args.self_check else None,
                                   os.path.join(OUT, "e2e-%s.json" % kind), os.path.join(OUT, "e2e-%s.log" % kind))
                     for kind, venv in (("ref", ref_venv), ("swap", swap_venv))}
            for kind, proc in procs.items():
                venvs.wait_or_kill(proc, E2E_TIMEOUT)
                if proc.returncode != 0:
                    with open(os.path.join(OUT, "e2e-%s.log" % kind)) as fh:
                        tail = fh.read()[-3000:]
                    raise SystemExit("compat: the e2e run on %s failed (exit %s):\n%s" % (kind, proc.returncode, tail))
            with open(os.path.join(OUT, "e2e-ref.json")) as fh:
                ref_e2e = json.load(fh)
            with open(os.path.join(OUT, "e2e-swap.json")) as fh:
                our_e2e = json.load(fh)
            seen_rows = {}  # per HERMES_HOME of the run: a home's stored rows are its own
            for ref_step, our_step in zip(ref_e2e["steps"], our_e2e["steps"]):
                results.append(("e2e/" + ref_step["name"], compare_e2e_step(
                    ref_step, our_step, seen_rows.setdefault(ref_step.get("home", ""), set()))))
            timings["e2e"] = time.monotonic() - t0
        if args.only in (None, "releases") and not args.self_check:
            t0 = time.monotonic()
            results.extend(releases.run_all(python, overlay))
            timings["releases"] = time.monotonic() - t0
        if args.only in (None, "xport"):
            t0 = time.monotonic()
            results.extend(xport.run_all(ref_venv, swap_venv, None if args.self_check else overlay))
            timings["xport"] = time.monotonic() - t0
        if args.only == "fuzz":  # not in the default run yet: see docs/testing.md, "Randomized and adversarial tests"
            t0 = time.monotonic()
            import fuzz
            results.extend(fuzz.run_all(ref_venv, swap_venv, None if args.self_check else overlay))
            timings["fuzz"] = time.monotonic() - t0
    finally:
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
        lines.append("%-*s  %s%s" % (width, name, "FAIL" if open_diffs else "PASS", note))
        if open_diffs:
            report.append((name, open_diffs))
    full = [l for l in lines]
    for name, open_diffs in report:
        full.append("")
        full.append("%s: %d difference(s)" % (name, len(open_diffs)))
        full.extend("  " + d for d in open_diffs)
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
    stale = [p for p, _ in deliberate if p not in used]
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
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed or diagnostic else 0


if __name__ == "__main__":
    sys.exit(main())
