"""End-to-end run of hermes-agent's CLI against the fake model server, for one venv (ref or swap).

Owns: the scripted sequences of `hermesx` commands (a fresh home; copies of the 0.19 and 0.20 fixture
stores as a home's state.db; a 0.20 store with a damaged schema), the temp HERMES_HOMEs they run in
(with the homes a backup is imported into), and the normalised record of each step (exit code,
stdout, stderr, exported files, the requests the model server received, the stored rows of the
step's home after it), written as JSON for `run.py` to compare. Must not touch: anything outside its
temp folder; the fixture files (it copies them); any network but 127.0.0.1 (`run.py` starts it in a
private network namespace when it can).

Usage: python3 e2e.py --kind ref|swap --venv PATH [--overlay DIR] --out FILE
Environment: COMPAT_E2E_SEQUENCES=fresh,v22,v26,v26-damaged runs only those sequences (while working
on one; `make compat` runs all).
"""

import argparse
import glob
import gzip
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_llm  # noqa: E402  (the folder is a tool box, not a package)
import normalise  # noqa: E402
import venvs  # noqa: E402

HOSTCHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostcheck")

# A step of the reference takes seconds; these bound a hang in ours so `make compat` still reports.
# Both sides' four runs share the machine with the rest of `make compat`: the bounds leave room for a
# loaded one (a 0.22 turn took 30 s with eight jobs on two cores), they are no targets.
STEP_TIMEOUT = 120
RUN_BUDGET = 1500
# The fake server titles a session "Title " + its first four words (see fake_llm.plan_reply); 0.22 keeps
# its instant title, the opening message's first line (CONFIG_22 says why).
TITLE_OF_TOOL_TURN = {"0.20.1.2": "Title Please TOOL read file", "0.22.2.post1": "Please TOOL:read_file notes.txt"}


def q(prompt):
    return ["chat", "-Q", "-q", prompt]


COMPRESSION = """\
compression:
  enabled: true
  threshold_tokens: 150
  protect_first_n: 1
  protect_last_n: 2
"""

# A step: (name, argv with {placeholders}, options). Options: "capture": name to keep the printed session
# id under; "config": text appended to config.yaml first; "files": a path (file or folder) whose content
# is compared; "home": run in another HERMES_HOME of the run (made at first use with our config.yaml, or
# empty with "bare", e.g. to import a backup); "stdin": what to answer a prompt (stdin is empty
# otherwise); "capture_as": name to keep the id of an imported session under.
STEPS = [
    ("turn-plain", q("Say hello to banana"), {"capture": "A"}),
    ("turn-tool-read_file", q("Please TOOL:read_file notes.txt"), {"capture": "B"}),
    ("oneshot-z", ["-z", "Oneshot about apples"], {}),
    ("resume-id", ["chat", "-Q", "--resume", "{A}", "-q", "Tell me more about banana"], {}),
    ("continue-latest", ["chat", "-Q", "--continue", "-q", "Continue with cherries"], {}),
    ("continue-title", ["chat", "-Q", "-c", "{tool_title}", "-q", "Back to the notes"], {}),
    ("turn-session_search", q("Find it TOOL:session_search banana"), {"capture": "C"}),
    ("sessions-list", ["sessions", "list"], {}),
    ("sessions-stats", ["sessions", "stats"], {}),
    ("sessions-export-jsonl", ["sessions", "export", "-", "--session-id", "{A}"], {}),
    ("sessions-export-md", ["sessions", "export", "--format", "md", "--session-id", "{B}", "{root}/export-md"],
     {"files": "{root}/export-md"}),
    ("sessions-rename", ["sessions", "rename", "{B}", "Renamed", "notes", "session"], {}),
    ("continue-renamed", ["chat", "-Q", "-c", "Renamed notes session", "-q", "Renamed works"], {}),
    ("sessions-list-renamed", ["sessions", "list"], {}),
    # Only ended sessions are archived or pruned: the -z session is the one a one-shot ends.
    ("sessions-archive", ["sessions", "archive", "--title", "Oneshot", "--yes"], {}),
    ("sessions-list-archived", ["sessions", "list"], {}),
    ("sessions-delete", ["sessions", "delete", "{C}", "--yes"], {}),
    ("sessions-prune-dry-run", ["sessions", "prune", "--title", "Oneshot", "--include-archived", "--dry-run"],
     {}),
    ("sessions-prune", ["sessions", "prune", "--title", "Oneshot", "--include-archived", "--yes"], {}),
    ("sessions-optimize", ["sessions", "optimize"], {}),
    ("sessions-stats-final", ["sessions", "stats"], {}),
    ("insights", ["insights"], {}),
    ("doctor", ["doctor"], {}),
    ("compress-big-read", ["chat", "-Q", "--resume", "{A}", "-q", "Read it TOOL:read_file big.txt"], {}),
    # From here on config.yaml also holds COMPRESSION: every turn starts over the tiny threshold.
    ("compress-resume", ["chat", "-Q", "--resume", "{A}", "-q", "Now a compressed turn"], {"config": COMPRESSION}),
    ("compress-continue", ["chat", "-Q", "--continue", "-q", "After the compression"], {}),
    # The summary model fails (see fake_llm): the cooldown it leaves must hold in the next process.
    ("compress-fail", ["chat", "-Q", "--resume", "{B}", "-q", "NOSUMMARY for this one"], {}),
    ("compress-cooldown", ["chat", "-Q", "--resume", "{B}", "-q", "Still cooling down"], {}),
]


def store_steps(first, second, lineage):
    """Return the session-management steps run on a home that already holds sessions.

    `first` and `second` are ids of ended sessions (`first` titled), `lineage` the id of a session that
    ended in compression and has a child; the names carry no prefix (the caller adds one).
    """
    return [
        ("sessions-list", ["sessions", "list"], {}),
        ("sessions-list-source", ["sessions", "list", "--source", "telegram"], {}),
        ("sessions-list-source-cli", ["sessions", "list", "--source", "cli", "--limit", "5"], {}),
        ("sessions-stats", ["sessions", "stats"], {}),
        ("sessions-export-all", ["sessions", "export", "{root}/{seq}-all.jsonl"], {"files": "{root}/{seq}-all.jsonl"}),
        ("sessions-export-source", ["sessions", "export", "{root}/{seq}-telegram.jsonl", "--source", "telegram"],
         {"files": "{root}/{seq}-telegram.jsonl"}),
        ("sessions-export-id-jsonl", ["sessions", "export", "-", "--session-id", first], {}),
        ("sessions-export-id-md", ["sessions", "export", "--format", "md", "--session-id", first,
                                   "{root}/{seq}-md"], {"files": "{root}/{seq}-md"}),
        ("sessions-export-id-html", ["sessions", "export", "--format", "html", "--session-id", lineage,
                                     "{root}/{seq}-one.html"], {"files": "{root}/{seq}-one.html"}),
        ("sessions-rename", ["sessions", "rename", second, "Renamed", "by", "compat"], {}),
        ("sessions-delete", ["sessions", "delete", first, "--yes"], {}),
        ("sessions-archive-dry-run", ["sessions", "archive", "--source", "telegram", "--dry-run"], {}),
        ("sessions-archive", ["sessions", "archive", "--source", "telegram", "--yes"], {}),
        ("sessions-list-archived", ["sessions", "list", "--limit", "50"], {}),
        ("sessions-prune-dry-run", ["sessions", "prune", "--end-reason", "compression", "--include-archived",
                                   "--dry-run"], {}),
        ("sessions-prune", ["sessions", "prune", "--end-reason", "compression", "--include-archived", "--yes"],
         {}),
        ("sessions-stats-pruned", ["sessions", "stats"], {}),
        ("sessions-optimize", ["sessions", "optimize"], {}),
        ("sessions-optimize-storage", ["sessions", "optimize-storage", "--yes"], {}),
        ("sessions-repair-check", ["sessions", "repair", "--check-only"], {}),
        ("sessions-repair", ["sessions", "repair"], {}),
        ("sessions-clean-markers-dry-run", ["sessions", "clean-markers", "--dry-run"], {}),
        ("sessions-clean-markers", ["sessions", "clean-markers"], {}),
        ("sessions-clean-markers-again", ["sessions", "clean-markers", "--no-backup"], {}),
        ("sessions-repair-routing", ["sessions", "repair-routing"], {}),
        ("sessions-repair-routing-gap", ["sessions", "repair-routing", "--max-gap-seconds", "0.01"], {}),
        ("sessions-repair-routing-apply", ["sessions", "repair-routing", "--max-gap-seconds", "0.01", "--apply"],
         {"stdin": "y\n"}),
        ("sessions-repair-routing-after", ["sessions", "repair-routing"], {}),
        ("insights", ["insights", "--days", "3650"], {}),
        ("doctor", ["doctor"], {}),
        ("status", ["status"], {}),
        ("backup", ["backup", "-o", "{root}/{seq}-backup.zip"], {}),
        ("import-fresh-home", ["import", "{root}/{seq}-backup.zip"], {"home": "{seq}-imported", "bare": True}),
        ("imported-sessions-list", ["sessions", "list", "--limit", "50"], {"home": "{seq}-imported", "bare": True}),
        ("imported-sessions-stats", ["sessions", "stats"], {"home": "{seq}-imported", "bare": True}),
    ]


# The fixture stores (fixtures/README.md): 20 ended sessions bench_000000..19; every third from 0 is
# telegram, the rest cli; 0, 5, 10, 15 ended in compression and have a child; 0, 7, 14 have titles
# (`seed_fixture` below adds marker rows and a gateway identity before the first step).
FIXTURE_STEPS = store_steps("bench_000007", "bench_000002", "bench_000005")


def seed_fixture(db_path):
    """Give a fixture store what `clean-markers` and `repair-routing` act on: assistant turns with tool
    calls whose text is a bare marker (`[memory]`, left by releases before hermes-agent's #78148 fix)
    beside one bracketed text that is no marker; one telegram session with its gateway identity and,
    right after it, one without (what `repair-routing --apply` adopts)."""
    conn = sqlite3.connect(db_path)
    try:
        conn.execute("UPDATE sessions SET session_key = 'agent:main:telegram:dm:42', chat_id = '42', "
                     "chat_type = 'dm', user_id = '42', display_name = 'Compat' WHERE id = 'bench_000003'")
        # The next session, as telegram without an identity: within 0.01 s of bench_000003 it alone claims it.
        conn.execute("UPDATE sessions SET source = 'telegram' WHERE id = 'bench_000004'")
        for session_id, content in (("bench_000002", "[memory]"), ("bench_000008", " [read_file] "),
                                    ("bench_000003", "[session_search]"), ("bench_000013", "[two words]")):
            conn.execute("UPDATE messages SET content = ? WHERE id = (SELECT min(id) FROM messages WHERE "
                         "session_id = ? AND role = 'assistant' AND tool_calls IS NOT NULL AND tool_calls != '')",
                         (content, session_id))
        conn.commit()
    finally:
        conn.close()


def duplicate_schema_entry(db_path):
    """Damage a store as field reports show it: `table messages_fts already exists` (sqlite_master holds
    the index's row twice), which makes every open fail until `sessions repair` removes the copy."""
    conn = sqlite3.connect(db_path)
    try:
        conn.execute("PRAGMA writable_schema=ON")
        conn.execute("INSERT INTO sqlite_master SELECT * FROM sqlite_master WHERE name = 'messages_fts'")
        conn.commit()
    finally:
        conn.close()


DAMAGED_STEPS = [
    ("sessions-repair-check", ["sessions", "repair", "--check-only"], {}),
    ("sessions-repair", ["sessions", "repair"], {}),
    ("sessions-repair-again", ["sessions", "repair"], {}),
    ("sessions-list", ["sessions", "list", "--limit", "50"], {}),
    ("sessions-stats", ["sessions", "stats"], {}),
]
# 0.22's own `sessions` subcommands (hermes_cli/subcommands/sessions.py of 0.22.2.post1), on the fresh
# home after the common steps: A is the opening plain turn, B the tool turn (renamed "Renamed notes session").
V22_STEPS = [
    ("sessions-pin", ["sessions", "pin", "{A}", "{B}"], {}),
    ("sessions-pinned", ["sessions", "pinned"], {}),
    ("sessions-pinned-json", ["sessions", "pinned", "--json"], {}),
    ("sessions-list-pinned", ["sessions", "list"], {}),
    ("sessions-prune-pinned-dry-run", ["sessions", "prune", "--source", "cli", "--dry-run"], {}),
    ("sessions-prune-include-pinned-dry-run",
     ["sessions", "prune", "--source", "cli", "--include-pinned", "--dry-run"], {}),
    ("sessions-unpin", ["sessions", "unpin", "{B}"], {}),
    ("sessions-pinned-after-unpin", ["sessions", "pinned"], {}),
    ("sessions-list-workspace", ["sessions", "list", "--workspace", "work"], {}),
    ("sessions-list-workspace-none", ["sessions", "list", "--workspace", "no-such-project"], {}),
    ("sessions-export-qmd", ["sessions", "export", "--format", "qmd", "--session-id", "{A}", "{root}/export-qmd"],
     {"files": "{root}/export-qmd"}),
    ("sessions-export-qmd-lineage", ["sessions", "export", "--format", "qmd", "--lineage", "logical",
                                     "--session-id", "{A}", "{root}/export-qmd-lineage"],
     {"files": "{root}/export-qmd-lineage"}),
    ("sessions-export-trace", ["sessions", "export", "--format", "trace", "--session-id", "{A}",
                               "{root}/a-trace.jsonl"], {"files": "{root}/a-trace.jsonl"}),
    ("sessions-export-user-prompts", ["sessions", "export", "-", "--only", "user-prompts", "--session-id", "{A}"],
     {}),
    ("sessions-repair-prompts", ["sessions", "repair-prompts"], {}),
    ("sessions-repair-prompts-json", ["sessions", "repair-prompts", "--json"], {}),
    ("sessions-repair-profiles", ["sessions", "repair-profiles"], {}),
    ("sessions-repair-profiles-json", ["sessions", "repair-profiles", "--json"], {}),
    ("sessions-retitle-skills", ["sessions", "retitle-skills"], {}),
    ("sessions-recover-inspect", ["sessions", "recover", "--source", "{home}/state.db", "--inspect-only"], {}),
    ("sessions-set-journal-mode-delete", ["sessions", "set-journal-mode", "delete"], {}),
    ("sessions-stats-delete-mode", ["sessions", "stats"], {}),
    ("sessions-set-journal-mode-wal", ["sessions", "set-journal-mode", "wal"], {}),
    ("turn-after-journal-modes", ["chat", "-Q", "--resume", "{A}", "-q", "Still here after the modes"], {}),
    ("sessions-prune-never-active-dry-run", ["sessions", "prune", "--never-active", "--dry-run"], {}),
]
# (prefix of the step names, fixture file or None for a fresh home, steps, what to do to the store first)
FRESH_TAIL = [
        ("sessions-list-source", ["sessions", "list", "--source", "cli"], {}),
        ("sessions-export-all", ["sessions", "export", "{root}/fresh-all.jsonl"], {"files": "{root}/fresh-all.jsonl"}),
        ("sessions-export-source", ["sessions", "export", "{root}/fresh-cli.jsonl", "--source", "cli"],
         {"files": "{root}/fresh-cli.jsonl"}),
        ("sessions-export-id-jsonl-file", ["sessions", "export", "{root}/fresh-a.jsonl", "--session-id", "{A}"],
         {"files": "{root}/fresh-a.jsonl"}),
        ("sessions-export-id-html", ["sessions", "export", "--format", "html", "--session-id", "{A}",
                                     "{root}/fresh-a.html"], {"files": "{root}/fresh-a.html"}),
        ("sessions-repair", ["sessions", "repair"], {}),
        ("sessions-clean-markers", ["sessions", "clean-markers", "--no-backup"], {}),
        ("sessions-repair-routing", ["sessions", "repair-routing"], {}),
        ("status", ["status"], {}),
        ("backup", ["backup", "-o", "{root}/fresh-backup.zip"], {}),
        ("import-fresh-home", ["import", "{root}/fresh-backup.zip"], {"home": "fresh-imported", "bare": True}),
        ("imported-sessions-list", ["sessions", "list"], {"home": "fresh-imported", "bare": True}),
        # Conversations of other agents' CLIs (files written by run() below) into a home of their own.
        ("sessions-import-claude", ["sessions", "import", "--from", "claude", "{root}/work/claude-session.jsonl"],
         {"home": "foreign", "capture_as": "I"}),
        ("sessions-import-codex", ["sessions", "import", "--from", "codex", "{root}/work/rollout-compat.jsonl"],
         {"home": "foreign"}),
        ("resume-imported", ["chat", "-Q", "--resume", "{I}", "-q", "Carry on from the import"], {"home": "foreign"}),
        ("foreign-sessions-list", ["sessions", "list"], {"home": "foreign"}),
]
SEQUENCES = [
    ("", None, STEPS + FRESH_TAIL, None),
    ("v22/", "hermes_v22_legacy_fts.db.gz", FIXTURE_STEPS, seed_fixture),
    ("v26/", "hermes_v26_split.db.gz", FIXTURE_STEPS, seed_fixture),
    ("v26-damaged/", "hermes_v26_split.db.gz", DAMAGED_STEPS, duplicate_schema_entry),
]

def sequences(release):
    """Return the sequences one release runs: 0.22 adds its own session commands to the fresh home."""
    if release == venvs.REFERENCE_VERSION:
        return SEQUENCES
    return [("", None, STEPS + V22_STEPS + FRESH_TAIL, None)] + SEQUENCES[1:]


FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")

CONFIG = """\
model:
  default: {model}
  provider: custom
  base_url: http://127.0.0.1:{port}/v1
  api_key: sk-compat-fake
security:
  allow_lazy_installs: false
  tirith_enabled: false
agent:
  # Its toolchain line lands in the system prompt only when a timed probe wins a race.
  environment_probe: false
model_catalog:
  enabled: false
models_dev:
  url: http://127.0.0.1:{port}/models-dev.json
"""
# 0.22 only. With a self-hosted provider (`custom`) 0.22 asks for the model title after the turn's
# reply, from a thread a one-shot process does not wait for: whether the title lands is a race, and
# the next turns re-ask while it has not. Its instant title (the opening line, stored as `derived`)
# is deterministic. The keyless web-search probe picks a backend by timing: off, doctor names the
# default one on both sides.
CONFIG_22 = """\
auxiliary:
  title_generation:
    model_upgrade_enabled: false
web:
  keyless_fallback: false
"""


def _dump_table(conn, table, order):
    try:
        cur = conn.execute("SELECT * FROM %s ORDER BY %s" % (table, order))
    except sqlite3.Error as exc:
        return {"error": type(exc).__name__ + ": " + str(exc)}
    names = [d[0] for d in cur.description]
    return {"columns": names, "rows": [list(r) for r in cur.fetchall()]}


def dump_store(db_path):
    """Return the stored rows that matter to hermes-agent's callers, raw (normalised later)."""
    if not os.path.exists(db_path):
        return {"missing": True}
    # A copy, so reading never takes a lock the next step would trip on.
    scratch = tempfile.mkdtemp(prefix="hermes-compat-dump-")
    try:
        for path in glob.glob(db_path + "*"):
            shutil.copy2(path, scratch)
        conn = sqlite3.connect(os.path.join(scratch, os.path.basename(db_path)))
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            out = {
                "sessions": _dump_table(conn, "sessions", "started_at, rowid"),
                "messages": _dump_table(conn, "messages", "id"),
            }
            if "session_model_usage" in tables:
                out["session_model_usage"] = _dump_table(conn, "session_model_usage",
                                                         "session_id, task, model, billing_base_url")
            else:
                out["session_model_usage"] = {"error": "no such table: session_model_usage"}
            prompts = {}
            if "system_prompts" in tables:
                prompts = dict(conn.execute("SELECT hash, prompt FROM system_prompts").fetchall())
            out["system_prompts_by_hash"] = prompts
            return out
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return {"error": type(exc).__name__ + ": " + str(exc)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def summarise_request(entry):
    """Return what the client sent in one chat request, reduced to what the state layer can change."""
    body = entry.get("body")
    if not isinstance(body, dict):
        return {"method": entry["method"], "path": entry["path"], "body": body}
    messages = []
    for m in body.get("messages") or []:
        item = {"role": m.get("role")}
        content = m.get("content")
        # Whole, so a difference in the system prompt shows where it starts.
        item["content"] = fake_llm._text(content)
        for key in ("tool_call_id", "name", "reasoning_content"):
            if m.get(key):
                item[key] = m[key]
        if m.get("tool_calls"):
            item["tool_calls"] = [(c.get("function") or {}).get("name") for c in m["tool_calls"]]
        messages.append(item)
    return {
        "method": "POST", "path": entry["path"], "stream": bool(body.get("stream")),
        "response_format": ((body.get("response_format") or {}).get("json_schema") or {}).get("name"),
        "tools": sorted((t.get("function") or {}).get("name") for t in body.get("tools") or []),
        "messages": messages,
    }


def read_new_requests(log_path, offset):
    with open(log_path, encoding="utf-8") as fh:
        fh.seek(offset)
        data = fh.read()
        end = fh.tell()
    return [json.loads(line) for line in data.splitlines() if line.strip()], end


def export_files(path):
    """Return {relative path: text} for what an export step wrote to `path` (one file or a folder)."""
    if os.path.isfile(path):
        candidates, base = [path], os.path.dirname(path)
    else:
        candidates, base = sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True)), path
    out = {}
    for name in candidates:
        if os.path.isfile(name):
            with open(name, encoding="utf-8", errors="replace") as fh:
                out[os.path.relpath(name, base)] = fh.read()
    return out


def run_hermes(argv, cwd, env, stdin=None):
    """Return (exit code or 'timeout', stdout, stderr) of one command; a hang is killed with its children."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(stdin, timeout=STEP_TIMEOUT)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return "timeout", stdout, stderr


def write_foreign_sessions(folder):
    """Write a Claude Code session and a Codex CLI rollout (their JSONL shapes) for `sessions import`."""
    claude = [
        {"type": "summary", "summary": "Banana notes from Claude"},
        {"type": "user", "cwd": folder, "sessionId": "claude-compat-1",
         "message": {"role": "user", "content": "<system-reminder>not typed</system-reminder>"}},
        {"type": "user", "cwd": folder, "sessionId": "claude-compat-1",
         "message": {"role": "user", "content": "Summarise the banana notes please"}},
        {"type": "assistant", "message": {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hidden"}, {"type": "text", "text": "Reading them."},
            {"type": "tool_use", "name": "Read", "input": {"file_path": "notes.txt"}}]}},
        {"type": "user", "message": {"role": "user", "content": [{"type": "tool_result", "content": "x"}]}},
        {"type": "assistant", "message": {"role": "assistant", "content": "They are about bananas."}},
        {"type": "user", "isSidechain": True, "message": {"role": "user", "content": "side chain"}},
    ]
    codex = [
        {"type": "session_meta", "payload": {"id": "codex-compat-1", "cwd": folder}},
        {"type": "response_item", "payload": {"type": "message", "role": "developer",
                                              "content": [{"type": "input_text", "text": "rules"}]}},
        {"type": "response_item", "payload": {"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": "Count the cherries"}]}},
        {"type": "response_item", "payload": {"type": "function_call", "name": "shell"}},
        {"type": "response_item", "payload": {"type": "message", "role": "assistant",
                                              "content": [{"type": "output_text", "text": "Twelve cherries."}]}},
    ]
    for name, lines in (("claude-session.jsonl", claude), ("rollout-compat.jsonl", codex)):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(line) + "\n" for line in lines)


def make_home(home, port, fixture=None, release=venvs.REFERENCE_VERSION):
    """Make a HERMES_HOME with our config.yaml and, when given, a copy of a fixture store as its state.db."""
    os.makedirs(home)
    with open(os.path.join(home, "config.yaml"), "w") as fh:
        fh.write(CONFIG.format(model=fake_llm.MODEL, port=port))
        if release != venvs.REFERENCE_VERSION:
            fh.write(CONFIG_22)
    if fixture:
        with gzip.open(os.path.join(FIXTURES, fixture), "rb") as source, \
                open(os.path.join(home, "state.db"), "wb") as out:
            shutil.copyfileobj(source, out)


def host_check(hostcheck_log, requests, turn):
    """Return the 0.20 host check's findings of one step: message dicts the state layer gave a
    `message_uid` (compat/hostcheck/sitecustomize.py) and requests that carried one to the model;
    for an agent turn (`turn`), also a check that never armed."""
    found = set()
    if os.path.exists(hostcheck_log + ".armed"):
        os.remove(hostcheck_log + ".armed")
    elif turn:
        found.add("the host check never armed: no SessionDB was watched in this turn")
    if os.path.exists(hostcheck_log):
        with open(hostcheck_log, encoding="utf-8") as fh:
            found.update(line.strip() for line in fh if line.strip())
        os.remove(hostcheck_log)
    for entry in requests:
        body = entry.get("body") if isinstance(entry.get("body"), dict) else {}
        if any(isinstance(m, dict) and "message_uid" in m for m in body.get("messages") or []):
            found.add("a chat request sent message_uid to the model")
    return sorted(found)


def run(kind, venv, overlay, out_path, release=venvs.REFERENCE_VERSION):
    root = tempfile.mkdtemp(prefix="hermes-compat-e2e-%s-" % kind)
    user_home, work = (os.path.join(root, n) for n in ("user", "work"))
    for folder in (user_home, work):
        os.makedirs(folder)
    with open(os.path.join(work, "notes.txt"), "w") as fh:
        fh.write("hello notes about banana\n")
    with open(os.path.join(work, "big.txt"), "w") as fh:
        fh.writelines("line %d of the big file about bananas, cherries and other fruit\n" % n for n in range(400))
    write_foreign_sessions(work)
    log_path = os.path.join(root, "requests.jsonl")
    # 0.22 asks for no model title (CONFIG_22): its opening turns have none to wait for.
    server = fake_llm.start(log_path, title_gate=release == venvs.REFERENCE_VERSION)
    port = server.server_address[1]

    base_env = venvs.target_env(kind, overlay)
    hostcheck_log = os.path.join(root, "hostcheck.log")
    if release == venvs.REFERENCE_VERSION:
        # The host check: on both sides, after the overlay (it holds no hermes_state module of its own).
        base_env["PYTHONPATH"] = os.pathsep.join(p for p in (base_env.get("PYTHONPATH"), HOSTCHECK) if p)
    base_env.update({
        "HOME": user_home, "HERMES_DISABLE_LAZY_INSTALLS": "1",
        "TERM": "dumb", "NO_COLOR": "1", "COLUMNS": "160", "LINES": "50", "PYTHONUNBUFFERED": "1",
        "TZ": "UTC",
    })
    for key in list(base_env):
        # Keys that would send hermes-agent to a real provider or change its mode.
        if key.endswith("_API_KEY") or key.startswith(("HERMES_", "OPENAI_", "ANTHROPIC_", "OPENROUTER_")):
            if key != "HERMES_DISABLE_LAZY_INSTALLS":
                base_env.pop(key)
    if release == venvs.REFERENCE_VERSION:
        base_env["COMPAT_HOSTCHECK_LOG"] = hostcheck_log
    hermes = os.path.join(venv, "bin", venvs.SIDES[release]["program"])
    norm = normalise.Normaliser({
        root: "<root>", venvs.site_packages(venv): "<site>", overlay or "\0": "<site>", venv: "<venv>",
    }, port)
    steps = []
    offset = 0
    run_started = time.monotonic()
    wanted = [w for w in os.environ.get("COMPAT_E2E_SEQUENCES", "").split(",") if w]
    for prefix, fixture, sequence, prepare in sequences(release):
        seq = prefix.rstrip("/") or "fresh"
        if wanted and seq not in wanted:
            continue
        main_home = os.path.join(root, "home" if seq == "fresh" else seq + "-home")
        make_home(main_home, port, fixture, release)
        if prepare:
            prepare(os.path.join(main_home, "state.db"))
        captured = {"root": root, "seq": seq, "home": main_home, "tool_title": TITLE_OF_TOOL_TURN[release]}
        for name, template, options in sequence:
            home = main_home
            if options.get("home"):
                home = os.path.join(root, options["home"].format(**captured))
                if not os.path.isdir(home):
                    if options.get("bare"):
                        os.makedirs(home)
                    else:
                        make_home(home, port, release=release)
            if options.get("config"):
                with open(os.path.join(home, "config.yaml"), "a") as fh:
                    fh.write(options["config"])
            env = dict(base_env, HERMES_HOME=home)
            missing = [m for m in re.findall(r"\{(\w+)\}", " ".join(template)) if m not in captured]
            argv = template if missing else [part.format(**captured) for part in template]
            started = time.monotonic()
            if missing:
                rc, stdout, stderr = "not run", "", "compat: no session id captured for %s" % ", ".join(missing)
            elif started - run_started > RUN_BUDGET:
                rc, stdout, stderr = "not run", "", "compat: the e2e time budget (%d s) is spent" % RUN_BUDGET
            else:
                rc, stdout, stderr = run_hermes([hermes] + argv, work, env, options.get("stdin"))
            seconds = time.monotonic() - started
            # hermes-agent prints "session_id: ID" on stderr; the id comes from its CLI, not the state layer.
            printed = re.findall(r"session_id:\s*(\S+)", stdout + "\n" + stderr)
            if options.get("capture") and printed:
                captured[options["capture"]] = printed[-1]
            imported = re.findall(r"Imported .* session as (\S+)", stdout)
            if options.get("capture_as") and imported:
                captured[options["capture_as"]] = imported[-1]
                printed.extend(imported)
            for sid in printed:
                norm.label_session(sid)
            requests, offset = read_new_requests(log_path, offset)
            store = dump_store(os.path.join(home, "state.db"))
            norm.label_sessions_from_store(store)
            record = {
                "name": prefix + name,
                "home": os.path.relpath(home, root),
                "argv": norm.text(" ".join(argv)),
                "exit": rc,
                "seconds": round(seconds, 1),
                "stdout": norm.lines_json(stdout),
                "stderr": norm.lines(stderr),
                # Model-list probes (GET) come from background threads in varying number: not compared.
                "requests": sorted((norm.value(summarise_request(r)) for r in requests if r["method"] != "GET"),
                                   key=lambda r: json.dumps(r, sort_keys=True)),
                "store": norm.store(store),
            }
            if release == venvs.REFERENCE_VERSION:
                record["hostcheck"] = [norm.text(line) for line in host_check(
                    hostcheck_log, requests, rc != "not run" and argv[0] in ("chat", "-z"))]
            if options.get("files"):
                record["files"] = {norm.text(k): norm.lines_json(v) if k.endswith(".jsonl") else norm.lines(v)
                                   for k, v in export_files(options["files"].format(**captured)).items()}
            steps.append(record)
            print("e2e %s: %-36s exit %-7s %5.1f s" % (kind, prefix + name, rc, seconds), file=sys.stderr, flush=True)
    server.shutdown()
    with open(out_path, "w") as fh:
        json.dump({"kind": kind, "steps": steps}, fh, indent=1, sort_keys=True)
    if os.environ.get("COMPAT_KEEP"):
        print("e2e %s: kept %s" % (kind, root), file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("ref", "swap"), required=True)
    parser.add_argument("--venv", required=True)
    parser.add_argument("--overlay")
    parser.add_argument("--out", required=True)
    parser.add_argument("--release", choices=sorted(venvs.SIDES), default=venvs.REFERENCE_VERSION)
    args = parser.parse_args(argv)
    run(args.kind, args.venv, args.overlay, args.out, args.release)
    return 0


if __name__ == "__main__":
    sys.exit(main())
