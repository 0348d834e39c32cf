"""One step of a store round trip, done by whichever `hermes_state` this Python imports: a release's own
(0.19, 0.20, 0.22) or ours.

Owns: opening the store as that program does and doing one thing to it, reported as one JSON line on
stdout. Must not touch: anything but the store it is given. It compares nothing: `releases.py` runs it
in turn in each program's Python and judges the records.

Usage: python release_worker.py write|read|check|export|import STORE TAG
  write  open, start session TAG and append the TEXTS (and a tool row) one by one, read them back
  read   open, read every session's messages back and search
  check  (ours) every FTS5 index's integrity-check, our CJK search complete, doctor's trigger check
  export write export_all() as JSON lines to the file TAG; the uids of what it wrote
  import import_sessions() the JSON lines of the file TAG; the result and the uids now stored
"""

import json
import pathlib
import re
import sqlite3
import sys

# The same mix the unit tests use (test_releases.py): CJK runs of every length, words, hangul, kana.
TEXTS = ("请检查会话历史和数据库迁移", "好的，会话已保存", "deploy the service to staging", "迁移 schema 完成",
         "日本語のテキスト検索", "한국어 검색 테스트", "索引 rebuild 会")
CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+")


def raw(store):
    return sqlite3.connect(store, isolation_level=None, timeout=30)


def write(db, tag):
    errors, ok = [], 0
    db.create_session(tag, "cli")
    rows = [("user" if i % 2 else "assistant", "%s %s" % (text, tag), None) for i, text in enumerate(TEXTS)]
    for role, content, tool in rows + [("tool", "x" * 3000 + " 会话", "terminal")]:
        try:
            db.append_message(tag, role, content, tool_name=tool)
            ok += 1
        except Exception as exc:  # every failure is the finding, not a crash of the harness
            errors.append("%s: %s" % (type(exc).__name__, exc))
    return {"appends": ok, "wanted": len(rows) + 1, "errors": errors[:3], "read_back": len(db.get_messages(tag))}


def read(db, store):
    conn = raw(store)
    try:
        counts = dict(conn.execute("SELECT session_id, COUNT(*) FROM messages WHERE active = 1 GROUP BY session_id"))
    finally:
        conn.close()
    got = {sid: len(db.get_messages(sid)) for sid in counts}
    return {"sessions": len(counts), "unequal": {s: [counts[s], got[s]] for s in counts if counts[s] != got[s]},
            "search_hits": len(db.search_messages("会话", limit=1000))}


def check(store):
    from hermes_state import SessionDB
    conn = raw(store)
    try:
        failed = {}
        for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                     "AND sql LIKE 'CREATE VIRTUAL%'").fetchall():
            try:
                conn.execute("INSERT INTO %s(%s) VALUES ('integrity-check')" % (table, table))
            except sqlite3.Error as exc:
                failed[table] = str(exc)
        rows = conn.execute("SELECT id, content FROM messages WHERE role <> 'tool' AND active = 1").fetchall()
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()
    terms = sorted({run[i:i + n] for _id, content in rows for run in CJK.findall(content or "")
                    for n in (1, 2, 3) for i in range(len(run) - n + 1)})
    incomplete = []
    with SessionDB(pathlib.Path(store), read_only=True) as db:
        for term in terms:
            found = {hit["id"] for hit in db.search_messages(term, limit=10000)}
            if found != {i for i, content in rows if term in content}:
                incomplete.append(term)
        health = db.doctor()
    return {"integrity": integrity, "fts_failed": failed, "cjk_terms": len(terms), "cjk_incomplete": incomplete[:5],
            "layout": health.get("fts_layout"), "trigger_damage": health.get("trigger_damage")}


def uids_of(sessions):
    """[[session id, [message_uid of each message, in order]]] of export entries."""
    return [[entry["id"], [m.get("message_uid") for m in entry.get("messages") or ()]]
            for entry in sorted(sessions, key=lambda entry: entry["id"])]


def export(db, out):
    sessions = db.export_all()
    with open(out, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(entry, ensure_ascii=False) + "\n" for entry in sessions)
    return {"uids": uids_of(sessions)}


def import_(db, source):
    with open(source, encoding="utf-8") as handle:
        sessions = [json.loads(line) for line in handle if line.strip()]
    result = db.import_sessions(sessions)
    return {"ok": result.get("ok"), "imported": result.get("imported"), "uids": uids_of(db.export_all())}


def main(action, store, tag):
    if action == "check":
        return check(store)
    from hermes_state import SessionDB
    db = SessionDB(pathlib.Path(store))
    try:
        return {"write": lambda: write(db, tag), "read": lambda: read(db, store),
                "export": lambda: export(db, tag), "import": lambda: import_(db, tag)}[action]()
    finally:
        db.close()


if __name__ == "__main__":
    try:
        result = main(*sys.argv[1:4])
    except Exception as exc:
        result = {"died": "%s: %s" % (type(exc).__name__, exc)}
    print(json.dumps(result, ensure_ascii=False))
