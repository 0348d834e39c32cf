"""The replica reader of `make replicate-test`: this checkout's SessionDB.open_replica, alone.

Owns: following a replica while the primary is written (when each message count is first seen, and
that every look is a consistent snapshot), then the comparison of its answers with the primary's
at the same point and the cost figures (open, first and warm queries, bytes read from the
replica). Must not touch: the replica or the primary (the primary is opened read-only, at the end,
only to compare and time the same reads); it writes nothing but stdout.

Usage: reader.py URL PRIMARY   run under a Python that loads SQLite extensions, with
HERMES_STATE_LITESTREAM_VFS naming the extension. Prints "ready OPEN_S", then "seen N T" each time
the replica's message count grows to N (T: time.monotonic()); on a stdin line "compare N" it waits
for N messages, compares, times, and prints one "result JSON" line.
"""

import json
import logging
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hermes_state import SessionDB  # noqa: E402  (the checkout's)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every kind of search the store answers: words (word index), CJK of 1-2 characters (the CJK side
# index, hermes-agent's LIKE order) and of 3+ (trigram), tool rows (whole tool outputs).
QUERIES = [("harbour", {}), ("lantern notes", {}), ("迁移", {}), ("备", {}),
           ("数据库迁移脚本", {}), ("会话历史", {}), ("exit code", {"role_filter": ["tool"]}),
           ("harbour", {"role_filter": ["tool"]}), ("harbour", {"sort": "oldest", "limit": 7})]
# One statement, so one read transaction: a torn view (a message without its session's count)
# would show here.
TORN_SQL = ("SELECT count(*) FROM sessions s WHERE s.message_count != "
            "(SELECT count(*) FROM messages m WHERE m.session_id = s.id)")
CLI_READS = [["list", "--json", "--limit", "100"], ["search", "迁移", "--json", "--limit", "100"],
             ["search", "exit code", "--role", "tool", "--json", "--limit", "100"],
             ["show", "live-1", "--json"], ["export", "-"]]


def rchar():
    """Bytes this process has read() so far: for a file replica, what the VFS fetched from it."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def answers(db):
    """Everything a read command shows, as plain data to compare."""
    searches = {f"{q} {kw}": db.search_messages(q, limit=kw.get("limit", 100),
                                                **{k: v for k, v in kw.items() if k != "limit"})
                for q, kw in QUERIES}
    stats = {k: v for k, v in db.stats().items() if k not in ("db_path", "db_bytes")}
    return {"searches": searches, "list": db.list_sessions_rich(limit=100, include_children=True),
            "messages": {s["id"]: db.get_messages(s["id"])
                         for s in db.list_sessions_rich(limit=100)},
            "export": list(db.iter_export_all()), "stats": stats}


def timed(call, rounds=5):
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cli(*args):
    result = subprocess.run([sys.executable, "-m", "hermes_state", *args], capture_output=True,
                            text=True, timeout=120, cwd=REPO)
    return result.returncode, result.stdout


def follow(db, commands):
    """Print each new message count until a "compare N" line has come and N messages are seen (or
    60 s more have passed); returns N and the torn looks."""
    seen, torn, looks, last_torn_check, expected, deadline = 0, 0, 0, 0.0, None, None
    while True:
        if expected is None:
            try:
                expected, deadline = int(commands.get_nowait().split()[1]), time.monotonic() + 60
            except queue.Empty:
                pass
        if expected is not None and (seen >= expected or time.monotonic() > deadline):
            return expected, torn, looks
        count = db.message_count()
        if count > seen:
            seen = count
            print(f"seen {count} {time.monotonic():.4f}", flush=True)
        if time.monotonic() - last_torn_check > 0.25:
            last_torn_check = time.monotonic()
            looks += 1
            torn += db._conn.execute(TORN_SQL).fetchone()[0] != 0
        time.sleep(0.02)


def compare(url, primary, db, expected):
    deadline = time.monotonic() + 60
    while db.message_count() < expected:
        if time.monotonic() > deadline:
            return {"error": f"the replica holds {db.message_count()} messages 60 s after the "
                             f"primary's last commit, want {expected}"}
        time.sleep(0.05)
    result = {"messages": db.message_count()}
    with SessionDB(primary, read_only=True) as local:
        mine, theirs = answers(db), answers(local)
        result["differ"] = sorted(key for key in mine if mine[key] != theirs[key])
        result["differ"] += [f"search {k}" for k in mine["searches"]
                             if mine["searches"][k] != theirs["searches"][k]]
        named = db.stats()  # the replica by its URL and the bytes read through the VFS
        if named["db_path"] != url or not named["db_bytes"]:
            result["differ"].append(f"stats names {named['db_path']!r}, {named['db_bytes']} bytes")
        result["empty"] = [k for k, hits in theirs["searches"].items() if not hits]
        result["hits"] = {k: len(hits) for k, hits in theirs["searches"].items()}
        for args in CLI_READS:
            over_replica, over_primary = cli("--replica", url, *args), cli("--db", primary, *args)
            if over_replica != over_primary or over_replica[0] != 0:
                result["differ"].append(f"cli {' '.join(args)} (exit {over_replica[0]} against "
                                        f"{over_primary[0]})")
        result["times_ms"] = {f"{q} {kw}": [
            round(1000 * timed(lambda: store.search_messages(q, **kw)), 2) for store in (db, local)]
            for q, kw in QUERIES}
        result["times_ms"]["list 20"] = [
            round(1000 * timed(lambda: store.list_sessions_rich(limit=20)), 2)
            for store in (db, local)]
    return result


def cold_costs(url):
    """A fresh open: its time, then a first search and the same search again (ms and bytes read)."""
    start, before = time.perf_counter(), rchar()
    db = SessionDB.open_replica(url)
    costs = {"open_ms": round(1000 * (time.perf_counter() - start), 1),
             "open_bytes": rchar() - before}
    try:
        for label in ("first", "warm"):
            start, before = time.perf_counter(), rchar()
            db.search_messages("数据库迁移脚本")
            db.search_messages("harbour")
            costs[f"{label}_ms"] = round(1000 * (time.perf_counter() - start), 1)
            costs[f"{label}_bytes"] = rchar() - before
    finally:
        db.close()
    return costs


class Reopens(logging.Handler):
    """Counts the replica connections the product replaced: because their VFS stopped following
    (`count`), or after a read that met a torn page set (`torn`, read again on the fresh one)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.count = self.torn = 0

    def emit(self, record):
        message = record.getMessage()
        if "reopened" in message:
            self.torn += "torn page set" in message
            self.count += "torn page set" not in message


def main():
    url, primary = sys.argv[1], sys.argv[2]
    reopens = Reopens()
    logging.getLogger("hermes_state").addHandler(reopens)
    logging.getLogger("hermes_state").setLevel(logging.INFO)
    commands = queue.SimpleQueue()
    threading.Thread(target=lambda: [commands.put(line) for line in sys.stdin], daemon=True).start()
    start = time.monotonic()
    with SessionDB.open_replica(url) as db:
        print(f"ready {time.monotonic() - start:.3f}", flush=True)
        expected, torn, looks = follow(db, commands)
        result = compare(url, primary, db, expected)
        result.update(torn=torn, looks=looks, reopened=reopens.count, torn_reads=reopens.torn)
    result["cold"] = cold_costs(url)
    print("result " + json.dumps(result, ensure_ascii=False, default=str), flush=True)


if __name__ == "__main__":
    main()
