"""In-process checks of hermes-agent's own callers of the state layer, run in one venv's Python.

Owns: driving, in a temp HERMES_HOME, the gateway's `SessionStore` (create, transcript append and
read, reset, routing reload by a second store on the same home), the ACP adapter's `SessionManager`
(store, restore in a fresh manager, list), `mcp_serve`'s index and transcript read, and the
`session_search` tool, and on 0.22 its shared SessionDB registry (`hermes_state_registry`) as its
callers borrow it; recording per step the return value or exception and the stored rows in the
record shape of `api_worker.py`, so `run.py` compares them the same way. Also the import walk: every
module of the installed hermes-agent (the packages and root modules of its top_level.txt) imported
one by one. COMPAT_RELEASE (set by run.py) names the side. Must not touch: anything outside its temp
folders; it compares nothing (`run.py` runs it in the reference venv and in the swap venv).

Usage: python inprocess.py OUT.json                 (all scenarios, each in its own child process)
       python inprocess.py --scenario NAME OUT.json (one scenario, in this process)
       python inprocess.py --imports OUT.json       (the import walk)
Session ids (the gateway's `YYYYMMDD_HHMMSS_<8 hex>`, ACP's uuids) become G1, G2, ... in order of
first sight in the record, since run.py's normaliser knows only the CLI's id shape.
"""

import json
import logging
import os
import pathlib
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from api_worker import describe_exception, dump_rows, jsonable  # noqa: E402  (same folder)

SCENARIO_TIMEOUT = 120
IMPORT_TIMEOUT = 60
IDS = re.compile(r"\b\d{8}_\d{6}_[0-9a-f]{8}\b|\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
RELEASE = os.environ.get("COMPAT_RELEASE", "0.20.1.2")  # the side run.py started this for


def top_level():
    """Return the packages and root modules of the installed hermes-agent (its top_level.txt, which still
    names the state modules the swap venv lost: the walk imports ours in their place)."""
    import importlib.metadata
    for dist in importlib.metadata.distributions():
        if (dist.metadata["Name"] or "").lower().replace("_", "-").startswith("hermes-agent"):
            return tuple(sorted(set((dist.read_text("top_level.txt") or "").split())))
    raise SystemExit("inprocess.py: no hermes-agent distribution installed here")


class Warnings(logging.Handler):
    """Collects hermes-agent's own warnings (not the state layer's, whose wording is ours to choose)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        if not record.name.startswith("hermes_state"):
            self.lines.append("%s %s: %s" % (record.levelname, record.name, record.getMessage()[:300]))


class Recorder:
    def __init__(self, name, root):
        self.record = {"name": name, "root": root, "steps": []}
        self.db_file = os.path.join(root, "home", "state.db")
        self.warnings = Warnings()
        logging.getLogger().addHandler(self.warnings)

    def step(self, call, fn):
        """Run fn(), record its return (or exception), its warnings and the rows after it; return the value."""
        entry, value = {"call": call}, None
        del self.warnings.lines[:]
        try:
            value = fn()
            entry["returns"] = jsonable(value)
        except Exception as exc:
            entry.update(describe_exception(exc))
        if self.warnings.lines:
            entry["returns"] = {"value": entry.get("returns"), "warnings": list(self.warnings.lines)}
        entry["rows"] = dump_rows(self.db_file)
        self.record["steps"].append(entry)
        return value


def label_ids(record):
    """Return `record` with every session id replaced by G1, G2, ... in order of first sight."""
    labels = {}

    def sub(match):
        return labels.setdefault(match.group(0), "G%d" % (len(labels) + 1))

    def walk(value):
        if isinstance(value, str):
            return IDS.sub(sub, value)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {walk(k): walk(value[k]) for k in sorted(value)}
        return value
    return walk(record)


# ---- the scenarios ----------------------------------------------------------------------------------

def _source(chat_id="100", user_id="u-1", chat_type="dm"):
    from gateway.config import Platform
    from gateway.session import SessionSource
    return SessionSource(platform=Platform.TELEGRAM, chat_id=chat_id, chat_type=chat_type, user_id=user_id,
                         user_name="Ann", chat_name="Ann's chat")


def _entry(entry):
    """The parts of a SessionEntry the gateway routes on."""
    if entry is None:
        return None
    return {"session_key": entry.session_key, "session_id": entry.session_id,
            "platform": getattr(entry.platform, "value", entry.platform), "chat_type": entry.chat_type}


def _store(root):
    from gateway.config import GatewayConfig
    from gateway.session import SessionStore
    return SessionStore(pathlib.Path(root, "home", "sessions"), GatewayConfig())


def gateway_session_store(rec, root):
    store = _store(root)
    first = rec.step("get_or_create_session(telegram dm)", lambda: _entry(store.get_or_create_session(_source())))
    sid, key = first["session_id"], first["session_key"]
    rec.step("get_or_create_session(same chat again)", lambda: _entry(store.get_or_create_session(_source())))
    rec.step("get_or_create_session(other chat)", lambda: _entry(store.get_or_create_session(_source("200", "u-2"))))
    for message in ({"role": "user", "content": "hello about banana"},
                    {"role": "assistant", "content": "banana answer", "finish_reason": "stop"},
                    {"role": "user", "content": "and apples?", "platform_message_id": "tg-7"}):
        rec.step("append_to_transcript(%s)" % message["role"], lambda m=message: store.append_to_transcript(sid, m))
    rec.step("load_transcript", lambda: store.load_transcript(sid))
    rec.step("has_platform_message_id", lambda: store.has_platform_message_id(sid, "tg-7"))
    rec.step("rewrite_transcript", lambda: store.rewrite_transcript(sid, [{"role": "user", "content": "only this"}]))
    rec.step("load_transcript after rewrite", lambda: store.load_transcript(sid))
    rec.step("reset_session", lambda: _entry(store.reset_session(key)))
    rec.step("load_transcript of the old id", lambda: store.load_transcript(sid))
    reloaded = _store(root)
    rec.step("new store: lookup_by_session_key", lambda: _entry(reloaded.lookup_by_session_key(key)))
    rec.step("new store: list_sessions", lambda: sorted(
        (_entry(e) for e in reloaded.list_sessions()), key=lambda e: e["session_key"]))
    rec.step("new store: get_or_create_session(same chat)",
             lambda: _entry(reloaded.get_or_create_session(_source())))
    new_sid = reloaded.lookup_by_session_key(key).session_id
    rec.step("new store: append_to_transcript", lambda: reloaded.append_to_transcript(
        new_sid, {"role": "user", "content": "after the reset"}))
    rec.step("new store: load_transcript", lambda: reloaded.load_transcript(new_sid))
    # Without sessions.json the mirror and a store that lost its routing find the chat's session in its row.
    index = pathlib.Path(root, "home", "sessions", "sessions.json")
    if index.exists():
        index.unlink()
    from gateway import mirror
    rec.step("mirror: _find_session_id", lambda: mirror._find_session_id("telegram", "100", user_id="u-1"))
    rec.step("mirror: mirror_to_session", lambda: mirror.mirror_to_session("telegram", "100", "sent", user_id="u-1"))
    conn = sqlite3.connect(rec.db_file)
    with conn:
        conn.execute("DELETE FROM gateway_routing")
    conn.close()
    if index.exists():
        index.unlink()
    lost = _store(root)
    rec.step("routing lost: get_or_create_session", lambda: _entry(lost.get_or_create_session(_source())))
    rec.step("routing lost: load_transcript", lambda: lost.load_transcript(lost.lookup_by_session_key(key).session_id))


class FakeAgent:
    """What the ACP manager reads off an agent; no model is ever called."""
    model = "model-a"
    provider = "custom"
    base_url = "http://127.0.0.1:9/v1"
    api_mode = None


def acp_sessions(rec, root):
    from acp_adapter.session import SessionManager
    cwd = os.path.join(root, "project")
    os.makedirs(cwd)
    manager = SessionManager(agent_factory=FakeAgent)
    state = rec.step("create_session", lambda: manager.create_session(cwd=cwd))
    sid = state.session_id
    state.history = [{"role": "user", "content": "what is in the project?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "read_file", "arguments": "{\"path\": \"a\"}"}}]},
                     {"role": "tool", "content": "file text", "tool_call_id": "call_1", "name": "read_file"},
                     {"role": "assistant", "content": "a file"}]
    rec.step("save_session", lambda: manager.save_session(sid))
    rec.step("list_sessions", lambda: manager.list_sessions())
    fresh = SessionManager(agent_factory=FakeAgent)
    rec.step("fresh manager: get_session (restore)", lambda: _acp_state(fresh.get_session(sid)))
    rec.step("fresh manager: list_sessions", lambda: fresh.list_sessions())
    rec.step("fresh manager: list_sessions(cwd)", lambda: fresh.list_sessions(cwd=cwd))
    restored = fresh.get_session(sid)
    restored.history.append({"role": "user", "content": "and now?"})
    rec.step("fresh manager: save_session", lambda: fresh.save_session(sid))
    rec.step("fresh manager: update_cwd", lambda: _acp_state(fresh.update_cwd(sid, root)))
    forked = rec.step("fresh manager: fork_session", lambda: _acp_state(fresh.fork_session(sid, cwd=cwd)))
    third = SessionManager(agent_factory=FakeAgent)
    rec.step("third manager: list_sessions", lambda: third.list_sessions())
    rec.step("third manager: remove_session(fork)", lambda: third.remove_session(forked["session_id"]))
    rec.step("third manager: get_session(missing)", lambda: _acp_state(third.get_session("no-such-session")))


def _acp_state(state):
    if state is None:
        return None
    return {"session_id": state.session_id, "cwd": state.cwd, "model": state.model, "history": state.history}


def mcp_serve_read(rec, root):
    import mcp_serve
    store = _store(root)
    entry = store.get_or_create_session(_source())
    store.append_to_transcript(entry.session_id, {"role": "user", "content": "hello from the chat"})
    store.append_to_transcript(entry.session_id, {"role": "assistant", "content": "hello back"})
    store.append_to_transcript(entry.session_id, {"role": "user", "content": [
        {"type": "text", "text": "a list content"}]})
    index = rec.step("_load_sessions_index", mcp_serve._load_sessions_index)
    rec.step("_load_session_messages", lambda: mcp_serve._load_session_messages(entry.session_id))
    rec.step("_load_session_messages(missing)", lambda: mcp_serve._load_session_messages("missing"))
    # messages_read's own reading: the tool object needs the optional `mcp` package, its steps do not.
    rec.step("messages_read's rows", lambda: [
        {"role": m.get("role"), "content": mcp_serve._extract_message_content(m), "id": m.get("id")}
        for m in mcp_serve._load_session_messages(index[entry.session_key]["session_id"])[0]])


def session_search_tool(rec, root):
    from hermes_state import SessionDB
    from tools.registry import registry
    db = SessionDB()
    rec.step("setup", lambda: [
        db.create_session("s-old", "cli", model="model-a"),
        db.append_message("s-old", "user", "tell me about bananas and their colour"),
        db.append_message("s-old", "assistant", "bananas are yellow when ripe"),
        db.set_session_title("s-old", "Banana talk"),
        db.create_session("s-new", "telegram", model="model-b"),
        db.append_message("s-new", "user", "apples or pears?"),
        db.append_message("s-new", "assistant", "pears, with a banana on the side"),
        db.create_session("s-current", "cli"),
        db.append_message("s-current", "user", "search my past sessions for banana"),
    ])
    search = __import__("tools.session_search_tool", fromlist=["session_search"]).session_search

    def call(**kwargs):
        return json.loads(search(db=db, current_session_id="s-current", **kwargs))
    rec.step("discover banana", lambda: call(query="banana"))
    rec.step("discover banana, full", lambda: call(query="banana", detail="full", limit=5))
    rec.step("discover by title", lambda: call(query="Banana talk"))
    rec.step("discover, role user", lambda: call(query="banana", role_filter="user"))
    rec.step("discover, recent", lambda: call(query="banana", sort="recent"))
    rec.step("browse", lambda: call())
    rec.step("read a session", lambda: call(session_id="s-old"))
    rec.step("scroll", lambda: call(session_id="s-new", around_message_id=4, window=1))
    rec.step("read missing", lambda: call(session_id="nope"))
    rec.step("no match", lambda: call(query="zucchini"))
    rec.step("registry dispatch", lambda: json.loads(registry.dispatch(
        "session_search", {"query": "pears"}, db=db, current_session_id="s-current")))
    rec.step("own store (db=None)", lambda: json.loads(search(query="bananas")))
    db.close()


def registry_in_process(rec, root):
    """0.22's shared SessionDB registry as its callers use it: the default store borrowed twice, the
    session_search tool borrowing it too (db=None), a live-handle sweep, closing everything under the
    home (what a profile switch does) and a handle used after that."""
    from hermes_state_registry import acquire, borrow_live_shared_session_dbs, close_all_under, release_or_close
    search = __import__("tools.session_search_tool", fromlist=["session_search"]).session_search
    db = rec.step("acquire()", acquire)
    second = acquire()
    rec.step("acquire() twice: one instance", lambda: db is second)
    rec.step("write through the shared handle", lambda: [
        db.create_session("reg-1", "cli", model="model-a"),
        db.append_message("reg-1", "user", "registry banana question"),
        db.append_message("reg-1", "assistant", "registry banana answer"),
    ])
    rec.step("session_search(db=None) borrows the same store", lambda: json.loads(search(query="banana")))
    rec.step("borrow_live_shared_session_dbs", lambda: _borrow_count(borrow_live_shared_session_dbs))
    rec.step("release_or_close once", lambda: release_or_close(second))
    rec.step("still open for the other borrower", lambda: db.message_count("reg-1"))
    rec.step("close_all_under(HERMES_HOME)", lambda: close_all_under(os.environ["HERMES_HOME"]))
    rec.step("the handle after the sweep", lambda: db.get_session("reg-1") is not None)
    rec.step("acquire() after the sweep: a new instance", lambda: acquire() is not db)
    rec.step("release_or_close of a swept handle", lambda: release_or_close(db))


def _borrow_count(borrow):
    with borrow() as dbs:
        return len(dbs)


SCENARIOS = {
    "gateway-session-store": gateway_session_store,
    "acp-sessions": acp_sessions,
    "mcp-serve-read": mcp_serve_read,
    "session-search-tool": session_search_tool,
}
if RELEASE != "0.20.1.2":
    SCENARIOS["registry-in-process"] = registry_in_process


def run_scenario(name):
    root = tempfile.mkdtemp(prefix="hermes-compat-inproc-")
    os.environ["HERMES_HOME"] = os.path.join(root, "home")
    os.makedirs(os.environ["HERMES_HOME"])
    os.chdir(root)
    rec = Recorder(name, root)
    try:
        # Which state layer ran: <site>/hermes_state.py on both sides, unless the swap fell back to another.
        rec.step("hermes_state.__file__", lambda: __import__("hermes_state").__file__)
        SCENARIOS[name](rec, root)
    except Exception as exc:  # a step the scenario needed failed: what ran so far is compared
        rec.record["steps"].append(dict(describe_exception(exc), call="<scenario stopped>", rows={}))
    record = label_ids(rec.record)
    record["root"] = root
    return record


def run_all(out_file):
    records = []
    for name in SCENARIOS:
        part = out_file + "." + name
        try:
            status = subprocess.run([sys.executable, os.path.abspath(__file__), "--scenario", name, part],
                                    timeout=SCENARIO_TIMEOUT, stdin=subprocess.DEVNULL).returncode
        except subprocess.TimeoutExpired:
            status = "a hang over %d s" % SCENARIO_TIMEOUT
        if status == 0 and os.path.exists(part):
            with open(part) as fh:
                records.append(json.load(fh))
        else:
            records.append({"name": name, "root": "", "setup": {"raises": ["WorkerDied"],
                                                              "message": "exit %s" % status}})
    with open(out_file, "w") as fh:
        json.dump({"python": sys.version.split()[0], "scenarios": records}, fh, indent=1, sort_keys=True)


# ---- the import walk --------------------------------------------------------------------------------

def hermes_modules():
    """Return the dotted names of every .py module of the installed hermes-agent, sorted; and the skipped."""
    import importlib.util
    found, skipped = set(), []
    for top in top_level():
        spec = importlib.util.find_spec(top)
        if spec is None or not spec.submodule_search_locations:
            # A root module, or one not here (a state module ours lacks): its import says which.
            found.add(top)
            continue
        base = list(spec.submodule_search_locations)[0]
        for folder, dirs, files in os.walk(base):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            rel = os.path.relpath(folder, base)
            parts = [top] + ([] if rel == "." else rel.split(os.sep))
            for name in sorted(f[:-3] for f in files if f.endswith(".py")):
                dotted = ".".join(parts + ([] if name == "__init__" else [name]))
                if "tests" in parts:
                    skipped.append((dotted, "a plugin's own test"))
                elif name == "__main__":
                    skipped.append((dotted, "a __main__ module runs its program"))
                else:
                    found.add(dotted)
    return sorted(found), skipped


def import_by_name(name):
    """Import a module by its dotted name; below a folder whose name is no identifier (a plugin), load
    that folder by path under a name of its own, as hermes-agent's plugin loader does."""
    import importlib
    import importlib.util
    import types
    parts = name.split(".")
    bad = next((i for i, part in enumerate(parts) if not part.isidentifier()), None)
    if bad is None:
        return importlib.import_module(name)
    folder = os.path.join(list(importlib.util.find_spec(parts[0]).submodule_search_locations)[0], *parts[1:bad + 1])
    alias = "hermes_compat_plugin_" + "_".join(re.sub(r"\W", "_", part) for part in parts[:bad + 1])
    if alias not in sys.modules:
        init = os.path.join(folder, "__init__.py")
        if not os.path.exists(init):
            sys.modules[alias] = types.ModuleType(alias)
            sys.modules[alias].__path__ = [folder]
        else:
            spec = importlib.util.spec_from_file_location(alias, init, submodule_search_locations=[folder])
            module = importlib.util.module_from_spec(spec)
            sys.modules[alias] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[alias]
                raise
    return importlib.import_module(".".join([alias] + parts[bad + 1:]))


def import_child(names):
    """Import each name in turn, printing 'ok NAME' or 'fail NAME CLASS: message' a line."""

    def timeout(*_):
        raise TimeoutError("import took over %d s" % IMPORT_TIMEOUT)
    signal.signal(signal.SIGALRM, timeout)
    for name in names:
        signal.alarm(IMPORT_TIMEOUT)
        try:
            import_by_name(name)
            line = "ok " + name
        except BaseException as exc:  # SystemExit and KeyboardInterrupt from a module count as failures too
            line = "fail %s %s: %s" % (name, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        signal.alarm(0)
        sys.__stdout__.write(line + "\n")
        sys.__stdout__.flush()


def run_imports(out_file):
    root = tempfile.mkdtemp(prefix="hermes-compat-imports-")
    env = dict(os.environ, HERMES_HOME=os.path.join(root, "home"))
    os.makedirs(env["HERMES_HOME"])
    names, skipped = hermes_modules()
    results, todo, started = {}, list(names), time.monotonic()
    while todo:
        # A module that kills or hangs its process fails alone; the walk goes on in a new child.
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--import-child"], cwd=root, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
        proc.stdin.write("\n".join(todo))
        proc.stdin.close()
        for line in proc.stdout:
            status, _, rest = line.rstrip("\n").partition(" ")
            name, _, why = rest.partition(" ")
            if status in ("ok", "fail") and name in todo:
                results[name] = why if status == "fail" else None
        proc.wait()
        todo = [n for n in todo if n not in results]
        if todo:
            results[todo.pop(0)] = "the import killed its process (exit %s)" % proc.returncode
    shutil.rmtree(root, ignore_errors=True)
    with open(out_file, "w") as fh:
        json.dump({"modules": results, "skipped": skipped, "seconds": round(time.monotonic() - started)}, fh,
                  indent=1, sort_keys=True)


def main(argv):
    if argv[:1] == ["--import-child"]:
        import_child(sys.stdin.read().split())
        return 0
    if argv[:1] == ["--imports"]:
        run_imports(argv[1])
        return 0
    if argv[:1] == ["--scenario"]:
        record = run_scenario(argv[1])
        with open(argv[2], "w") as fh:
            json.dump(record, fh, indent=1, sort_keys=True)
        shutil.rmtree(record["root"], ignore_errors=True)
        return 0
    run_all(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
