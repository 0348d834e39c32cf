"""JSONL exports passed between hermes-agent 0.20.1.2's own state layer and ours, each way.

Owns: the export/import scenarios and judging them. Inputs: a history the reference writes through its
own API (`xport_worker.py make`: display_metadata dicts, user_id, reasoning, reasoning_content,
reasoning_details, codex items, tool calls, multimodal content, api_content, titles, costs, a
compression child, a delegated child, a rewound message, an archived and a pinned session); the same
history with its structured fields and numbers as text (`-as-text`) and with what the reference
degrades rather than refuses (`-degraded`); `refused`, one entry for each reason the reference
refuses one; the fixture exports of 0.20 (`hermes_v26_export.jsonl.gz`) and 0.19
(`hermes_v22_export.jsonl.gz`). Also the same history written through ours' API: its export against
the reference's (`ours-history-export`) and the reference importing each (`ours-history-into-ref`).
For each input:
- `<input>-into-ours`: ours imports it, exports again and imports it once more; the import's results
  (`ok`, counts, ids, every error's index, session id and text), every field of every exported line, the export's order
  and the stored `sessions` / `messages` rows (the reference's columns) must equal the reference's
  import of the same input; ours' streamed export (its own CLI's) must be export_all's, byte for byte.
- `<input>-ours-export-into-ref`: the reference imports ours' export and exports again; all of the
  above must equal the reference importing its own export (not run for an input the reference refuses).
A value the reference itself gives differently in two imports of the same input (a time it takes on
import) is left out, and only that. Must not touch: anything outside its temp folder.
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

WORKER = os.path.join(HERE, "xport_worker.py")
FIXTURE_EXPORTS = (("v26-fixture", "hermes_v26_export.jsonl.gz"), ("v22-fixture", "hermes_v22_export.jsonl.gz"))
STEP_TIMEOUT = 300
MISSING = "<missing>"


def flatten(value, path="", out=None):
    """Return {path: leaf} of a JSON value; a list of sessions or rows with ids is keyed by id."""
    out = {} if out is None else out
    if isinstance(value, dict):
        if not value:
            out[path] = {}
        for key, item in value.items():
            flatten(item, "%s.%s" % (path, key), out)
    elif isinstance(value, list):
        if not value:
            out[path] = []
        for index, item in enumerate(value):
            key = item.get("id") if isinstance(item, dict) and isinstance(item.get("id"), str) else index
            flatten(item, "%s[%s]" % (path, key), out)
    else:
        out[path] = value
    return out


def short(value, width=70):
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= width else text[:width - 3] + "..."


def comparable(record):
    """The parts of a worker record the scenarios compare, flattened: the import's result, the export's
    order and lines, the stored rows with the messages under their session (a store's insertion order
    follows its input's order, which the export order already covers)."""
    rows = record.get("rows")
    if isinstance(rows, dict) and isinstance(rows.get("messages"), list):
        by_session = {}
        for row in rows["messages"]:
            by_session.setdefault(str(row.get("session_id")), []).append(row)
        rows = dict(rows, messages=by_session)
    lines = record.get("lines")
    order = [line.get("id") for line in lines] if isinstance(lines, list) else None
    return flatten({"import": record.get("import"), "import_again": record.get("import_again"),
                    "export_order": order, "export": lines, "rows": rows})


def differences(want, got, volatile, want_name="ref"):
    """Lines 'path: <want_name> X, ours Y' for every compared leaf that differs; columns only ours
    stores are not the reference's fields and are not compared in the rows."""
    if "died" in got:
        return ["died: %s" % got["died"]]
    want_flat, got_flat = comparable(want), comparable(got)
    ref_columns = {path.rsplit(".", 1)[-1] for path in want_flat if path.startswith(".rows.")}
    out = []
    for path in sorted(set(want_flat) | set(got_flat)):
        if path in volatile:
            continue
        if path.startswith(".rows.") and path.rsplit(".", 1)[-1] not in ref_columns:
            continue
        a, b = want_flat.get(path, MISSING), got_flat.get(path, MISSING)
        if a != b:
            out.append("%s: %s %s, ours %s" % (path.lstrip("."), want_name, short(a), short(b)))
    return out


class Runner:
    """Runs xport_worker.py in the reference's or ours' Python, in one temp folder."""

    def __init__(self, ref_venv, swap_venv, overlay, folder):
        self.pythons = {"ref": venvs.venv_python(ref_venv), "ours": venvs.venv_python(swap_venv)}
        self.overlay, self.folder, self.count = overlay, folder, 0

    def run(self, program, action, *paths):
        """Return the worker's record; for a round trip also its export's lines under 'lines'."""
        env = venvs.target_env("swap" if program == "ours" else "ref", self.overlay)
        env.update({"HOME": self.folder, "TZ": "UTC"})
        try:
            done = subprocess.run([self.pythons[program], WORKER, action] + list(paths), env=env, cwd=self.folder,
                                  capture_output=True, text=True, timeout=STEP_TIMEOUT, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return {"died": "no answer within %d s" % STEP_TIMEOUT}
        try:
            record = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            return {"died": "exit %s: %s" % (done.returncode, (done.stderr.strip().splitlines() or [""])[-1])}
        if "died" not in record:
            with open(paths[-1], encoding="utf-8") as fh:
                record["lines"] = [json.loads(line) for line in fh]
        return record

    def roundtrip(self, program, source):
        self.count += 1
        out = os.path.join(self.folder, "%02d-%s.jsonl" % (self.count, program))
        return self.run(program, "roundtrip", source, out), out


def volatile_paths(first, second):
    """The compared paths whose values differ between two imports of one input by the same program."""
    a, b = comparable(first), comparable(second)
    return {path for path in set(a) | set(b) if a.get(path, MISSING) != b.get(path, MISSING)}


def same_file(first, second):
    try:
        with open(first, "rb") as a, open(second, "rb") as b:
            return a.read() == b.read()
    except OSError:
        return False


def run_input(runner, name, source):
    """[(scenario, [differences])] of one input, both ways."""
    ref_once, ref_export = runner.roundtrip("ref", source)
    if "died" in ref_once:
        return [("xport/%s" % name, ["the reference's import died: %s" % ref_once["died"]])]
    ref_twice, _ = runner.roundtrip("ref", source)
    volatile = volatile_paths(ref_once, ref_twice)
    ours, our_export = runner.roundtrip("ours", source)
    diffs = differences(ref_once, ours, volatile)
    if "died" not in ours and not same_file(our_export, our_export + ".stream"):
        diffs.append("ours' streamed export (its CLI's) differs from its export_all written as hermes-agent writes it")
    results = [("xport/%s-into-ours" % name, diffs)]
    if not (ref_once.get("import") or {}).get("ok"):
        return results  # the reference refused the input: there is no history to pass back
    if "died" in ours:
        return results + [("xport/%s-ours-export-into-ref" % name, ["ours' export is missing: ours died"])]
    ref_of_ref, _ = runner.roundtrip("ref", ref_export)
    ref_of_ours, _ = runner.roundtrip("ref", our_export)
    again, _ = runner.roundtrip("ref", ref_export)
    volatile |= volatile_paths(ref_of_ref, again)
    diffs = differences(ref_of_ref, ref_of_ours, volatile, want_name="ref of ref's export")
    results.append(("xport/%s-ours-export-into-ref" % name,
                    [d.replace(", ours ", ", ref of ours' export ", 1) for d in diffs]))
    return results


STRUCTURED = ("tool_calls", "reasoning_details", "codex_reasoning_items", "codex_message_items", "display_metadata")


def as_text(sessions):
    """The history with its structured fields as JSON text and its numbers as text, one message without
    its timestamp and one session without its start (the reference takes the time of the import), and
    `message_id` for `platform_message_id`: shapes the reference accepts."""
    for session in sessions:
        if isinstance(session.get("model_config"), dict):
            session["model_config"] = json.dumps(session["model_config"])
        for field in ("estimated_cost_usd", "input_tokens", "api_call_count"):
            if session.get(field) is not None:
                session[field] = str(session[field])
        for message in session["messages"]:
            for field in STRUCTURED:
                if message.get(field) is not None:
                    message[field] = json.dumps(message[field], ensure_ascii=False)
            if message.get("token_count") is not None:
                message["token_count"] = str(message["token_count"])
            if message.get("platform_message_id") is not None:
                message["message_id"] = message.pop("platform_message_id")
    sessions[0].pop("started_at")
    sessions[-1]["messages"][0].pop("timestamp")
    return sessions


def degraded(sessions):
    """The history with what the reference degrades instead of refusing: a parent missing from the
    import, a parent cycle, structured fields that are not JSON or not objects, flags and numbers
    of the wrong type, an unknown field."""
    by_id = {session["id"]: session for session in sessions}
    by_id["xp-sub"]["parent_session_id"] = "xp-not-here"
    by_id["xp-root"]["parent_session_id"] = "xp-child"
    by_id["xp-old"].update({"archived": "yes", "pinned": "no", "ended_at": "soon", "input_tokens": "many",
                            "favourite_colour": "teal"})
    messages = by_id["xp-root"]["messages"]
    messages[0]["display_metadata"] = "not json"
    messages[1].update({"reasoning_details": "not json {", "codex_reasoning_items": "[1, 2",
                        "tool_calls": "garbage", "observed": "yes", "timestamp": "noon"})
    messages[4]["display_metadata"] = ["a", "list"]
    messages[5].update({"display_metadata": "[1]", "api_content": 42, "display_kind": ["x"]})
    by_id["xp-tg"]["messages"][0]["reasoning"] = "a user's reasoning is not kept"
    return sessions


def refused(sessions):
    """Entries the reference refuses, each for one reason: every error text must be the reference's."""
    good = sessions[0]
    bad = [dict(good, id="r-config", model_config="[1]"), dict(good, id="r-config-text", model_config="{nope"),
           dict(good, id="r-title", title=5), dict(good, id="r-user", user_id=7),
           dict(good, id="r-role", messages=[{"content": "no role"}]),
           dict(good, id="r-count", messages=[{"role": "user", "content": "x", "token_count": "ten"}]),
           dict(good, id="r-tool-name", messages=[{"role": "tool", "content": "x", "tool_name": 3}]),
           dict(good, id="r-messages", messages={"role": "user"}),
           dict(good, id="r-message-type", messages=["text"]),
           dict(good, id="  "), "not an object", dict(good), dict(good, id="r-parent", parent_session_id=9)]
    return bad


VARIANTS = (("ref-history-as-text", as_text), ("ref-history-degraded", degraded), ("refused", refused))


def write_variant(history, folder, name, change):
    with open(history, encoding="utf-8") as fh:
        sessions = [json.loads(line) for line in fh]
    path = os.path.join(folder, name + ".jsonl")
    with open(path, "w", encoding="utf-8") as out:
        for entry in change(sessions):
            out.write(json.dumps(entry, ensure_ascii=False) + "\n")
    return path


def run_written_by_ours(runner, ref_history):
    """[(scenario, [differences])]: the same history written through ours' API and exported by ours,
    against the reference's; then the reference importing each. The times the programs take while
    writing are left out where two histories written by the reference differ too."""
    ours_history = os.path.join(runner.folder, "ours-history.jsonl")
    second = os.path.join(runner.folder, "ref-history-2.jsonl")
    ref_made, again, ours = (runner.run(program, "make", path) for program, path in (
        ("ref", ref_history), ("ref", second), ("ours", ours_history)))
    if "died" in ours:
        return [("xport/ours-history-export", ["ours could not write the history: " + ours["died"]])]
    results = [("xport/ours-history-export", differences(ref_made, ours, volatile_paths(ref_made, again)))]
    ref_of_ref, ref_of_ref_again, ref_of_ours = (runner.roundtrip("ref", path)[0] for path in (
        ref_history, second, ours_history))
    diffs = differences(ref_of_ref, ref_of_ours, volatile_paths(ref_of_ref, ref_of_ref_again),
                        want_name="ref of ref's export")
    results.append(("xport/ours-history-into-ref", [d.replace(", ours ", ", ref of ours' export ", 1) for d in diffs]))
    return results


def run_all(ref_venv, swap_venv, overlay):
    """[(scenario name, [differences])] of every input, both ways."""
    folder = tempfile.mkdtemp(prefix="hermes-compat-xport-")
    try:
        runner = Runner(ref_venv, swap_venv, overlay, folder)
        history = os.path.join(folder, "ref-history.jsonl")
        made = runner.run("ref", "make", history)
        if "died" in made:
            raise SystemExit("compat: the reference could not write the export history: %s" % made["died"])
        results = run_input(runner, "ref-history", history)
        for name, change in VARIANTS:
            results.extend(run_input(runner, name, write_variant(history, folder, name, change)))
        results.extend(run_written_by_ours(runner, os.path.join(folder, "ref-history-1.jsonl")))
        for name, fixture in FIXTURE_EXPORTS:
            source = os.path.join(folder, name + ".jsonl")
            with gzip.open(os.path.join(venvs.REPO, "fixtures", fixture), "rb") as fh, open(source, "wb") as out:
                shutil.copyfileobj(fh, out)
            results.extend(run_input(runner, name, source))
        return results
    finally:
        if os.environ.get("COMPAT_KEEP") != "1":
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    python = venvs.find_python()
    overlay = venvs.make_overlay()
    try:
        for scenario, problems in run_all(venvs.ensure_venv("ref", python), venvs.ensure_venv("swap", python), overlay):
            print("%-45s %s" % (scenario, "FAIL" if problems else "PASS"))
            for line in problems[:40]:
                print("  " + line)
    finally:
        shutil.rmtree(overlay, ignore_errors=True)
