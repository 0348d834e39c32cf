"""One step of the export/import round trips, done by whichever `hermes_state` this Python imports: the
reference's own (the ref venv) or ours (the swap venv with the overlay first on the path).

Owns: writing the rich history through the state layer's own API, and importing a JSONL export into a
fresh store then exporting it again, each reported as one JSON line on stdout. Must not touch: anything
but the files it is given and its temp folder. It compares nothing: `xport.py` runs it in each program's
Python and compares the records.

Usage: python xport_worker.py make OUT.jsonl          write the history, export it as JSONL
       python xport_worker.py roundtrip IN.jsonl OUT.jsonl
                                                       import IN into a fresh store, export it to OUT,
                                                       import IN again (every id is skipped); ours
                                                       also streams its CLI's export to OUT.stream
The JSONL is written as hermes-agent's `hermes sessions export` writes it: one
`json.dumps(session, ensure_ascii=False)` line per entry of `export_all()`, in its order.
"""

import json
import os
import pathlib
import shutil
import sqlite3
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from api_worker import jsonable  # noqa: E402  (same folder)

# The columns the round trips compare in the stored rows (the reference's, present in both schemas).
TABLES = (("sessions", "id"), ("messages", "id"))

REASONING_DETAILS = [{"type": "reasoning.text", "text": "check the service first", "signature": "sig-1",
                      "format": "anthropic-claude-v1", "index": 0}]
CODEX_REASONING = [{"type": "reasoning", "id": "rs_01", "encrypted_content": "gAAAA-enc",
                    "summary": [{"type": "summary_text", "text": "plan"}]}]
CODEX_MESSAGES = [{"type": "message", "id": "msg_01", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": "Reading it now", "annotations": []}]}]
TOOL_CALLS = [{"id": "call_1", "type": "function",
               "function": {"name": "read_file", "arguments": "{\"path\": \"deploy.yaml\"}"}},
              {"id": "call_2", "type": "function",
               "function": {"name": "terminal", "arguments": "{\"command\": \"ls\"}"}}]
IMAGE = [{"type": "text", "text": "what does this chart say? 图表"},
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}}]


def open_db(store):
    from hermes_state import SessionDB
    return SessionDB(db_path=pathlib.Path(store))


def write_jsonl(db, out):
    sessions = db.export_all(source=None)
    with open(out, "w", encoding="utf-8") as fh:
        for session in sessions:
            fh.write(json.dumps(session, ensure_ascii=False) + "\n")
    return len(sessions)


def make_history(db):
    """Write sessions rich in the fields an export must carry, through the state layer's API."""
    db.create_session("xp-root", "cli", model="anthropic/claude-x",
                      model_config={"temperature": 0.2, "max_tokens": 900},
                      system_prompt="You are terse. 简洁。", user_id="u-42", cwd="/work/deploy")
    db.append_message("xp-root", "user", "deploy the service to staging", display_kind="user",
                      display_metadata={"attachments": [{"name": "deploy.yaml", "bytes": 312}], "ui": {"pinned": True}},
                      platform_message_id="tg-101", timestamp=1764470000.25)
    db.append_message("xp-root", "assistant", "Reading the manifest first.", tool_calls=TOOL_CALLS,
                      finish_reason="tool_calls", token_count=57, reasoning="the manifest decides",
                      reasoning_content="Let me look at deploy.yaml.", reasoning_details=REASONING_DETAILS,
                      codex_reasoning_items=CODEX_REASONING, codex_message_items=CODEX_MESSAGES,
                      timestamp=1764470001.5)
    db.append_message("xp-root", "tool", "replicas: 2\nimage: svc:1.4", tool_name="read_file", tool_call_id="call_1",
                      effect_disposition="read_only", timestamp=1764470002)
    db.append_message("xp-root", "tool", "deploy.yaml  README.md", tool_name="terminal", tool_call_id="call_2",
                      timestamp=1764470003)
    db.append_message("xp-root", "user", IMAGE, timestamp=1764470004,
                      display_metadata={"source": "paste", "images": 1})
    db.append_message("xp-root", "assistant", "Two replicas of svc:1.4.", api_content="Two replicas of svc:1.4. [memo]",
                      display_kind="assistant", display_metadata={"model_label": "Claude X", "latency_ms": 812.5},
                      finish_reason="stop", token_count=9, timestamp=1764470005)
    oops = db.append_message("xp-root", "user", "no wait, production", timestamp=1764470006)
    db.append_message("xp-root", "assistant", "Deploying to production.", timestamp=1764470007)
    db.rewind_to_message("xp-root", oops)
    db.update_token_counts("xp-root", input_tokens=1200, output_tokens=340, model="anthropic/claude-x",
                           cache_read_tokens=800, cache_write_tokens=64, reasoning_tokens=120,
                           estimated_cost_usd=0.0123, actual_cost_usd=0.011, cost_status="actual",
                           cost_source="provider", pricing_version="2026-11", billing_provider="openrouter",
                           billing_base_url="https://openrouter.ai/api/v1", billing_mode="metered",
                           api_call_count=3)
    db.set_session_title("xp-root", "Deploy plan ✓")
    # Compression: the parent closes, its child carries the handoff.
    db.publish_compression_child(
        parent_session_id="xp-root", child_session_id="xp-child", source="cli",
        messages=[{"role": "user", "content": "[summary] staging has svc:1.4 with two replicas"},
                  {"role": "assistant", "content": "Continuing from the summary.", "reasoning": "resume",
                   "reasoning_details": REASONING_DETAILS}],
        model="anthropic/claude-x", model_config={"temperature": 0.2}, system_prompt="You are terse. 简洁。",
        cwd="/work/deploy", require_compression_lease=False)
    db.set_session_title("xp-child", "Deploy plan ✓ #2")
    db.append_message("xp-child", "user", "scale to three", timestamp=1764470100)
    db.append_message("xp-child", "assistant", "Scaled.", reasoning_content="edit replicas", finish_reason="stop",
                      codex_reasoning_items=CODEX_REASONING, timestamp=1764470101)
    # A delegated child, a gateway chat of another user, an ended and an archived session.
    db.create_session("xp-sub", "subagent", model="openai/gpt-y", parent_session_id="xp-child", user_id="u-42")
    db.append_message("xp-sub", "user", "list the pods")
    db.append_message("xp-sub", "assistant", "3 pods running", reasoning="kubectl said so",
                      display_metadata={"delegated": True})
    db.end_session("xp-sub", "completed")
    db.create_session("xp-tg", "telegram", model="openai/gpt-y", user_id="tg-777",
                      session_key="agent:main:telegram:dm:777", chat_id="777", chat_type="dm")
    db.append_message("xp-tg", "user", "こんにちは", platform_message_id="5001",
                      display_metadata={"sender": {"name": "Aiko", "id": 777}})
    db.append_message("xp-tg", "assistant", "Hello! 안녕하세요", finish_reason="stop", platform_message_id="5002")
    db.update_token_counts("xp-tg", input_tokens=30, output_tokens=8, estimated_cost_usd=0.0001,
                           cost_status="estimated", api_call_count=1)
    db.create_session("xp-old", "cli", model="openai/gpt-y", user_id=None)
    db.append_message("xp-old", "user", "old question")
    db.set_session_title("xp-old", "Old one")
    db.set_session_archived("xp-old", True)
    db.set_session_pinned("xp-tg", True)


def read_jsonl(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def dump_rows(store):
    conn = sqlite3.connect(store)
    conn.row_factory = sqlite3.Row
    try:
        return {table: [jsonable(dict(row)) for row in conn.execute("SELECT * FROM %s ORDER BY %s" % (table, order))]
                for table, order in TABLES}
    finally:
        conn.close()


def main(action, *paths):
    folder = tempfile.mkdtemp(prefix="hermes-compat-xport-")
    os.environ["HERMES_HOME"] = folder
    store = os.path.join(folder, "state.db")
    try:
        db = open_db(store)
        try:
            if action == "make":
                make_history(db)
                return {"exported": write_jsonl(db, paths[0])}
            sessions = read_jsonl(paths[0])
            result = db.import_sessions(sessions)
            record = {"import": jsonable(result), "exported": write_jsonl(db, paths[1]), "rows": dump_rows(store),
                      "import_again": jsonable(db.import_sessions(read_jsonl(paths[0])))}
            if hasattr(db, "iter_export_all"):
                # Ours: the streamed export our own CLI writes (`hermes_state_cli export`) beside export_all's.
                from hermes_state_portability import write_export
                write_export(db.iter_export_all(), "jsonl", paths[1] + ".stream")
            return record
        finally:
            db.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    try:
        record = main(*sys.argv[1:])
    except Exception as exc:  # the failure is the finding, not a crash of the harness
        import traceback
        record = {"died": "%s: %s" % (type(exc).__name__, exc), "trace": traceback.format_exc()[-2000:]}
    print(json.dumps(record, ensure_ascii=False))
