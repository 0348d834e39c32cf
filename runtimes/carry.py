"""The store carried across real SQLite builds (part of `make test-runtimes`): made on the full
runtime, opened and written on the one without FTS5, then on 3.31.1 (no trigram tokenizer), then
back on the full one. Every row must be kept, each runtime must write, find what it wrote and search
by the indexes it has, and back on the full runtime every search must answer exactly as a store that
never left it (the same rows, written on the full runtime alone).

Owns: the scenario's steps, each a child process on one runtime (`python carry.py STEP STORE N,..`),
and its result line. Must not touch: the product modules (it only calls SessionDB).
"""

import json
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# (runtime, batch written there); the reference store gets every batch on the full runtime alone.
STEPS = [("3.53.2 fts5", 0), ("3.53.2 no-fts5", 1), ("3.31.1 fts5", 2), ("3.53.2 fts5", 3)]
# What each runtime searches by index (the rest by the LIKE fallback).
SEARCHABLE = {"3.53.2 fts5": ["cjk", "trigram", "word"], "3.53.2 no-fts5": [],
              "3.31.1 fts5": ["cjk", "word"]}
QUERIES = ("parser", "tokens parser", '"parser reads"', "pars*", "gateway OR restarts",
           "parser NOT gateway", "数据库", "会话", "数据库迁移", "parser 数据库", "会话 gateway", "备份")
LINES = ("parser checks the tokens", "the parser reads tokens and the parser streams",
         "gateway restarts", "failing tests in the parser module", "tokens tokens parser",
         "会话历史 parser 数据库迁移", "数据库 备份 会话", "gateway restarts after failing tests",
         "备份了数据库")


def batch(number):
    """The messages of batch `number`: the same on every run, every kind of search term in them,
    tool rows too, and a word only this batch has."""
    rng = random.Random(number)
    rows = [{"role": rng.choice(("user", "assistant", "tool")), "content": rng.choice(LINES),
             "tool_name": "terminal", "timestamp": 1000.0 + number * 100 + i} for i in range(40)]
    rows.append({"role": "user", "content": f"marker{number} 标记{number}号",
                 "timestamp": 1000.0 + number * 100})
    return rows


def answers(db):
    """Every query's hits as (id, snippet) lists, newest first and by relevance."""
    return {f"{query} / {sort}": [[hit["id"], hit["snippet"]] for hit in db.search_messages(
        query, sort=sort, limit=1000, fields=("id", "snippet"))]
        for query in QUERIES for sort in (None, "newest")}


def rows_of(path):
    import sqlite3
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [list(row) for row in conn.execute(
            "SELECT id, session_id, role, content, tool_name, timestamp FROM messages "
            "ORDER BY id")]
    finally:
        conn.close()


def step(name, path, numbers):
    """Write `numbers`' batches into the store at `path` on this runtime; print as JSON what it
    holds and finds."""
    sys.path.insert(0, REPO)
    import sqlite3
    from hermes_state import SessionDB
    problems = []
    with SessionDB(path) as db:
        for number in numbers:
            session = f"s{number}"
            db.create_session(session, "cli")
            db.append_messages_batch(session, batch(number))
            hits = db.search_messages(f"marker{number}", fields=("id",))
            if len(hits) != 1:
                problems.append(f"{name}: marker{number} found {len(hits)} times, not once")
            if not db.search_messages(f"标记{number}号"[:2], fields=("id",)):
                problems.append(f"{name}: 标记 not found after batch {number}")
        while db.fts_rebuild_step():
            pass  # the index back on a full runtime: every chunk of the backfill, now
        found = answers(db)
        health = db.doctor()
    json.dump({"sqlite": sqlite3.sqlite_version, "rows": rows_of(path), "answers": found,
               "problems": problems, "searchable": health.get("searchable_by_index"),
               "ok": health.get("ok")}, sys.stdout)


def run_child(python, env, name, path, numbers):
    done = subprocess.run([python, os.path.abspath(__file__), name, path,
                           ",".join(map(str, numbers))],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-12:]
        raise RuntimeError(f"{name}: exit {done.returncode}\n" + "\n".join(tail))
    return json.loads(done.stdout)


def run(python, folders, runtime_env):
    """The scenario as one runtime line: (label, passed, failed, skipped, detail lines)."""
    detail, checks, failed = [], 0, 0

    def check(ok, text):
        nonlocal checks, failed
        checks += 1
        if not ok:
            failed += 1
            detail.append("FAIL: carry: " + text)

    with tempfile.TemporaryDirectory(prefix="hermes-carry-") as scratch:
        carried = os.path.join(scratch, "carried.db")
        reference = os.path.join(scratch, "reference.db")
        try:
            ref = run_child(python, runtime_env(folders["3.53.2 fts5"]), "reference", reference,
                            [number for _name, number in STEPS])
            results = [(name, run_child(python, runtime_env(folders[name]), name, carried,
                                        [number])) for name, number in STEPS]
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            return "carry", 0, 1, 0, [f"FAIL: carry: {exc}"]
        written = []
        for (name, number), (_name, result) in zip(STEPS, results):
            written += [row for row in ref["rows"] if row[1] == f"s{number}"]
            check(result["rows"] == written, f"on {name} the store holds "
                  f"{len(result['rows'])} rows, {len(written)} written (or they differ)")
            for problem in result["problems"]:
                check(False, problem)
            check(result["ok"], f"on {name} doctor is not ok")
            check(result["sqlite"] == name.split()[0],
                  f"step {name} ran on SQLite {result['sqlite']}")
            check(result["searchable"] == SEARCHABLE[name],
                  f"on {name} the indexes searched are {result['searchable']}, "
                  f"not {SEARCHABLE[name]}")
        final = results[-1][1]
        check(final["searchable"] == ref["searchable"] == ["cjk", "trigram", "word"],
              f"back on the full runtime the indexes are {final['searchable']}, "
              f"not {ref['searchable']}")
        for query, hits in ref["answers"].items():
            check(final["answers"][query] == hits, f"back on the full runtime {query!r} finds "
                  f"{[hit[0] for hit in final['answers'][query]][:12]}, a store that stayed "
                  f"finds {[hit[0] for hit in hits][:12]}")
        check(any(ref["answers"].values()), "the reference store found nothing at all")
        detail.insert(0, "%s: %d rows carried through %s" % (
            "ok" if not failed else "FAILED", len(written), " -> ".join(n for n, _ in STEPS)))
    return "carry", checks - failed, failed, 0, detail


if __name__ == "__main__":
    step(sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3].split(",")])
