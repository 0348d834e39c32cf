"""Runs the API scenarios of `api_scenarios.py` against whichever `hermes_state` this Python imports.

Owns: calling each scenario step on a fresh SessionDB in a temp folder and recording, per step, the
return value (as JSON) or the exception (class names along its MRO, message), and the stored rows
after the step. Must not touch: anything outside its temp folder. It compares nothing: `run.py` runs
it once in the reference venv and once in the swap venv and compares the two records.

Usage: python api_worker.py OUT.json [--release 0.22.2.post1]   (prints nothing on success; a scenario
that cannot start is recorded as such, so one missing name never hides the rest). With `--release`,
the scenarios of that release's own names (`api_scenarios_22.py`) run instead of 0.20's.
"""

import dataclasses
import datetime
import importlib
import json
import os
import pathlib
import shutil
import sqlite3
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import api_scenarios  # noqa: E402  (same folder)
import api_scenarios_22  # noqa: E402

# Taken before any hermes module runs: 0.22 points tempfile at a scratch folder inside HERMES_HOME, which
# goes with each scenario's temp folder.
TMP = tempfile.gettempdir()
TABLES = (("sessions", "started_at, id"), ("messages", "id"), ("session_model_usage", "rowid"))


def jsonable(value, depth=0):
    """Return `value` as plain JSON data; what JSON cannot hold becomes a tagged text."""
    if depth > 20:
        return "<too deep>"
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else repr(value)
    if isinstance(value, sqlite3.Row):
        return {k: jsonable(value[k], depth + 1) for k in value.keys()}
    if isinstance(value, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return {"<set>": sorted(jsonable(v, depth + 1) for v in value)}
    if isinstance(value, bytes):
        return {"<bytes>": bytes_text(value)}
    if isinstance(value, BaseException):
        return {"<exception>": describe_exception(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # 0.22 returns a few records as dataclasses (RewindOutcome, StorageFailure): compared field by field.
        return {"<%s>" % type(value).__name__: jsonable(
            {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, depth + 1)}
    if isinstance(value, (pathlib.PurePath, datetime.date)):
        return {"<%s>" % type(value).__name__: str(value)}
    return {"<object>": type(value).__name__}


def bytes_text(value):
    """Return a blob as its text when it is UTF-8, else as hex (0.22's `display_identity` is a random
    digest per message: the normaliser's hash rule then reads it as <hash>)."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.hex()


def resolve(arg, saved):
    """Replace '@name' / '@name.key.0' references and {'$exc': [...]} constructors in a step's arguments."""
    if isinstance(arg, str) and arg.startswith("@"):
        name, *path = arg[1:].split(".")
        if name not in saved:
            raise LookupError("@%s: the step that saves it did not return" % name)
        value = saved[name]
        for key in path:
            value = value[int(key)] if isinstance(value, (list, tuple)) else value[key]
        return value
    if isinstance(arg, dict) and set(arg) == {"$exc"}:
        module, _, cls = arg["$exc"][0].rpartition(".")
        return getattr(__import__(module or "builtins"), cls)(*arg["$exc"][1:])
    if isinstance(arg, dict) and set(arg) == {"$path"}:
        return pathlib.Path(saved["<root>"]) / arg["$path"]
    if isinstance(arg, dict) and set(arg) == {"$class"}:
        module, _, cls = arg["$class"].rpartition(".")
        return getattr(importlib.import_module(module), cls)
    if isinstance(arg, dict) and set(arg) == {"$datetime"}:
        return datetime.datetime.fromisoformat(arg["$datetime"])
    if isinstance(arg, dict):
        return {k: resolve(v, saved) for k, v in arg.items()}
    if isinstance(arg, list):
        return [resolve(v, saved) for v in arg]
    return arg


def dump_rows(db_file):
    """Return {table: {columns, rows}} read from a copy of the store, or {table: {error}}."""
    scratch = tempfile.mkdtemp(prefix="hermes-compat-rows-", dir=TMP)
    out = {}
    try:
        for suffix in ("", "-wal", "-shm", "-journal"):
            try:  # a sidecar may go between a look and a copy (the reference commits from a thread)
                shutil.copy2(db_file + suffix, os.path.join(scratch, "copy.db" + suffix))
            except FileNotFoundError:
                pass
        if not os.path.exists(os.path.join(scratch, "copy.db")):
            return {"<no store file>": True}
        conn = sqlite3.connect(os.path.join(scratch, "copy.db"))
        try:
            for table, order in TABLES:
                try:
                    cur = conn.execute("SELECT * FROM %s ORDER BY %s" % (table, order))
                    out[table] = {"columns": [d[0] for d in cur.description],
                                  "rows": [jsonable(list(r)) for r in cur.fetchall()]}
                except sqlite3.Error as exc:
                    out[table] = {"error": "%s: %s" % (type(exc).__name__, exc)}
        finally:
            conn.close()
    except sqlite3.Error as exc:
        out["<error>"] = "%s: %s" % (type(exc).__name__, exc)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def describe_exception(exc):
    return {"raises": [c.__qualname__ for c in type(exc).__mro__ if c is not object],
            "message": str(exc)[:300]}


def run_step(step, db, modules, saved):
    kind = step.get("on", "db")
    if kind == "db":
        target = db
    elif kind.startswith("@"):
        target = resolve(kind, saved)  # a method of an object an earlier step returned (a registry's SessionDB)
    else:
        # Imported at the step, so a module ours lacks fails that step, not the scenario.
        target = modules.get(kind) or importlib.import_module(kind)
    obj = getattr(target, step["call"])
    if step.get("attr"):
        return obj
    args = resolve(step.get("args", []), saved)
    kwargs = resolve(step.get("kwargs", {}), saved)
    return obj(*args, **kwargs)


def run_scenario(name, steps):
    root = tempfile.mkdtemp(prefix="hermes-compat-api-", dir=TMP)
    os.environ["HERMES_HOME"] = os.path.join(root, "home")
    os.makedirs(os.environ["HERMES_HOME"])
    db_file = os.path.join(root, "state.db")
    record = {"name": name, "root": root, "steps": []}
    saved = {"<root>": root}
    db = None
    try:
        modules = {}
        for module in ("hermes_state", "hermes_state_common"):
            modules[module] = __import__(module)
        db = modules["hermes_state"].SessionDB(db_path=pathlib.Path(db_file))
        modules["SessionDB"] = modules["hermes_state"].SessionDB
    except Exception as exc:  # the scenario cannot start: record why and stop
        record["setup"] = describe_exception(exc)
        shutil.rmtree(root, ignore_errors=True)
        return record
    for step in steps:
        entry = {"call": api_scenarios.describe(step)}
        try:
            value = run_step(step, db, modules, saved)
            entry["returns"] = jsonable(value) if not step.get("shape") else {
                "<shape>": type(value).__name__, "len": len(value) if hasattr(value, "__len__") else None}
            if step.get("save"):
                saved[step["save"]] = value
        except Exception as exc:
            entry.update(describe_exception(exc))
        entry["rows"] = dump_rows(db_file)
        record["steps"].append(entry)
    try:
        db.close()
    except Exception as exc:
        record["close"] = describe_exception(exc)
    shutil.rmtree(root, ignore_errors=True)
    return record


def main(argv):
    results = []
    release = argv[argv.index("--release") + 1] if "--release" in argv else None
    scenarios = {None: api_scenarios.SCENARIOS, "0.22.2.post1": api_scenarios_22.SCENARIOS}[release]
    for name, steps in scenarios:
        results.append(run_scenario(name, steps))
    with open(argv[0], "w") as fh:
        json.dump({"python": sys.version.split()[0], "scenarios": results}, fh, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
