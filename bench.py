"""`make bench`: speed of the store as ratios within one run, standard library only.

Every figure compares hermes_state with raw sqlite3 doing the same work on a
store of the same schema, indexes, triggers, journal mode and synchronous
setting, measured in the same run on the same machine. Prints a table.
"""

import base64
import json
import multiprocessing
import os
import random
import re
import sqlite3
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from hermes_state import CHECKPOINT_EVERY_COMMITS, SessionDB, choose_journal_policy
from hermes_state_common import BUMP_MESSAGE_COUNTS_SQL, INSERT_MESSAGE_SQL, MESSAGE_WRITE_COLUMNS
from hermes_state_portability import write_export

HISTORY_MESSAGES = 20_000
PROCESS_MESSAGES = 3_000
OPEN_STORE_MESSAGES = 100_000
BATCH_SIZE = 100
WORDS = ("schema migration index tokens runs build patching files agent tool terminal reads checks "
         "parser streams module the and of to").split()
CJK = "会话历史索引迁移数据库备份搜索压缩导出导入检查验证"


def agent_history(count, seed=7):
    """`count` messages shaped like an agent's: user asks, assistant calls a tool, tool answers
    with several KB (base64 or a code dump), assistant replies."""
    rng = random.Random(seed)
    messages = []
    while len(messages) < count:
        call_id = f"call_{rng.getrandbits(32):08x}"
        user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
        user += " " + "".join(rng.choice(CJK) for _ in range(rng.randint(2, 12)))
        tool_calls = [{"id": call_id, "type": "function", "function": {
            "name": "terminal", "arguments": json.dumps({"command": f"pytest -x tests/test_{rng.choice(WORDS)}.py"})}}]
        if rng.random() < 0.5:
            output = base64.b64encode(rng.randbytes(rng.randint(1500, 6000))).decode()
        else:
            output = "\n".join(f"def f{i}(x):\n    return x * {i}  # {rng.choice(WORDS)}"
                               for i in range(rng.randint(40, 150)))
        messages += [
            {"role": "user", "content": user},
            {"role": "assistant", "content": "Running the tests.", "tool_calls": tool_calls},
            {"role": "tool", "content": output, "tool_name": "terminal", "tool_call_id": call_id},
            {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60)))},
        ]
    return messages[:count]


def raw_row(session_id, message):
    """The row raw sqlite3 inserts: the same values append_message stores."""
    values = dict.fromkeys(MESSAGE_WRITE_COLUMNS)
    values.update(message, session_id=session_id, timestamp=time.time(), observed=0, active=1)
    if values["tool_calls"] is not None:
        values["tool_calls"] = json.dumps(values["tool_calls"], ensure_ascii=False)
    return tuple(values.values())


def fresh_store(folder, name, journal):
    """A store made by SessionDB (so raw sqlite3 gets the identical schema), with one session."""
    path = Path(folder) / name
    with SessionDB(path, journal=journal) as db:
        db.create_session("bench", "cli")
    return path


def raw_connection(path, journal):
    """Plain sqlite3 with the store's journal, synchronous and checkpoint settings."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous=NORMAL")
    policy = choose_journal_policy(override=journal)
    if policy.autocheckpoint is not None:
        conn.execute(f"PRAGMA wal_autocheckpoint={policy.autocheckpoint}")
    return conn, policy.autocheckpoint == 0


def raw_commit(conn, commits, manual_checkpoints):
    conn.execute("COMMIT")
    if manual_checkpoints and commits % CHECKPOINT_EVERY_COMMITS == 0:
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")


def rate(count, seconds):
    return count / seconds if seconds else float("inf")


def bench_append(folder, history, journal):
    """One message per transaction: ours, raw doing the same work, raw inserting only."""
    path = fresh_store(folder, f"ours-{journal}.db", journal)
    with SessionDB(path, journal=journal) as db:
        start = time.perf_counter()
        for message in history:
            db.append_message("bench", **message)
        ours = rate(len(history), time.perf_counter() - start)

    results = {"ours": ours}
    for label, bump in (("raw_same_work", True), ("raw_insert_only", False)):
        conn, manual = raw_connection(fresh_store(folder, f"{label}-{journal}.db", journal), journal)
        start = time.perf_counter()
        for commits, message in enumerate(history, 1):
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(INSERT_MESSAGE_SQL, raw_row("bench", message))
            if bump:
                conn.execute(BUMP_MESSAGE_COUNTS_SQL, (1, 1 if message.get("tool_calls") else 0, "bench"))
            raw_commit(conn, commits, manual)
        results[label] = rate(len(history), time.perf_counter() - start)
        conn.close()
    return results


def bench_batch(folder, history, journal):
    path = fresh_store(folder, f"batch-ours-{journal}.db", journal)
    batches = [history[i:i + BATCH_SIZE] for i in range(0, len(history), BATCH_SIZE)]
    with SessionDB(path, journal=journal) as db:
        start = time.perf_counter()
        for batch in batches:
            db.append_messages_batch("bench", [dict(m) for m in batch])  # it stamps `_row_id` on what it is given
        ours = rate(len(history), time.perf_counter() - start)
    conn, manual = raw_connection(fresh_store(folder, f"batch-raw-{journal}.db", journal), journal)
    start = time.perf_counter()
    for commits, batch in enumerate(batches, 1):
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(INSERT_MESSAGE_SQL, [raw_row("bench", m) for m in batch])
        conn.execute(BUMP_MESSAGE_COUNTS_SQL, (len(batch), 0, "bench"))
        raw_commit(conn, commits, manual)
    raw = rate(len(history), time.perf_counter() - start)
    conn.close()
    return {"ours": ours, "raw": raw}


def _append_worker(path, journal, session_id, count, start_at, results):
    history = agent_history(count, seed=hash(session_id) & 0xFFFF)
    errors = 0
    with SessionDB(path, journal=journal) as db:
        db.create_session(session_id, "cli")
        while time.time() < start_at:
            time.sleep(0.001)
        begin = time.time()
        for message in history:
            try:
                db.append_message(session_id, **message)
            except Exception:
                errors += 1
        results.put((begin, time.time(), errors))


def bench_processes(folder, journal, processes):
    """`processes` processes each appending PROCESS_MESSAGES one per transaction, all at once."""
    path = fresh_store(folder, f"procs{processes}-{journal}.db", journal)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    start_at = time.time() + 1.5
    workers = [ctx.Process(target=_append_worker, args=(str(path), journal, f"p{i}", PROCESS_MESSAGES,
                                                        start_at, results)) for i in range(processes)]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join()
    begin = min(o[0] for o in outcomes)
    end = max(o[1] for o in outcomes)
    with SessionDB(path, journal=journal) as db:
        stored = db.message_count()
    return {"rate": rate(processes * PROCESS_MESSAGES, end - begin),
            "errors": sum(o[2] for o in outcomes), "stored": stored, "expected": processes * PROCESS_MESSAGES}


def build_large_store(folder, journal):
    """OPEN_STORE_MESSAGES messages of agent history in 50 sessions, written in batches."""
    path = fresh_store(folder, f"large-{journal}.db", journal)
    history = agent_history(2_000)
    with SessionDB(path, journal=journal) as db:
        for i in range(OPEN_STORE_MESSAGES // len(history)):
            session_id = f"s{i}"
            db.create_session(session_id, "cli")
            for j in range(0, len(history), 500):
                db.append_messages_batch(session_id, [dict(m) for m in history[j:j + 500]])
    return path


def median_seconds(fn, runs=7):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_open(path, journal):
    def open_close():
        SessionDB(path, journal=journal).close()

    def raw_open():
        conn = sqlite3.connect(path)
        conn.execute("SELECT COUNT(*) FROM sessions").fetchone()
        conn.close()

    return {"ours_ms": median_seconds(open_close) * 1000, "raw_ms": median_seconds(raw_open) * 1000,
            "bytes": os.path.getsize(path)}


def searches():
    """One query of each kind; the CJK ones are cut from the history so that they occur."""
    run = next(r for m in agent_history(50) for r in re.findall(f"[{CJK}]{{4,}}", m["content"]))
    return (("word", "migration"), ("two words", "schema parser"), ("phrase", '"index tokens"'),
            ("CJK, 4 characters", run[:4]), ("CJK, 2 characters", run[:2]), ("CJK, 1 character", run[0]))


def bench_search(path, journal):
    """Latency of each kind of query, and of a full LIKE scan for the 2-character CJK query."""
    queries = searches()
    with SessionDB(path, journal=journal) as db:
        results = {label: (median_seconds(lambda q=query: db.search_messages(q)) * 1000,
                           len(db.search_messages(query, limit=1000)))
                   for label, query in queries}
    two = dict(queries)["CJK, 2 characters"]
    conn = sqlite3.connect(path)
    scan = median_seconds(lambda: conn.execute(
        "SELECT COUNT(*) FROM messages WHERE content LIKE ?", (f"%{two}%",)).fetchone(), runs=3) * 1000
    conn.close()
    return results, scan


def bench_portability(folder, history, journal):
    """Export the 20,000-message history (throughput and peak Python memory), then import it."""
    path = fresh_store(folder, f"export-{journal}.db", journal)
    with SessionDB(path, journal=journal) as db:
        for i in range(0, len(history), 400):  # 50 sessions of 400 messages
            db.create_session(f"x{i}", "cli")
            db.append_messages_batch(f"x{i}", [dict(m) for m in history[i:i + 400]])
        out = Path(folder) / "export.jsonl"
        tracemalloc.start()
        start = time.perf_counter()
        write_export(db.iter_export_all(), "jsonl", str(out))
        exported = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    payload = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    with SessionDB(fresh_store(folder, f"import-{journal}.db", journal), journal=journal) as db:
        start = time.perf_counter()
        for i in range(0, len(payload), 10):
            result = db.import_sessions(payload[i:i + 10])
            assert result["ok"], result["errors"][:3]
        imported = time.perf_counter() - start
    return {"export_rate": rate(len(history), exported), "import_rate": rate(len(history), imported),
            "peak_mb": peak / 1e6, "file_mb": out.stat().st_size / 1e6}


def row(label, value, note=""):
    print(f"| {label:<58} | {value:>16} | {note}")


def main():
    policy = choose_journal_policy()
    print(f"hermes_state bench: Python {sys.version.split()[0]}, SQLite {sqlite3.sqlite_version}, "
          f"{os.cpu_count()} cores")
    print(f"default journal policy: {policy.reason}\n")
    history = agent_history(HISTORY_MESSAGES)
    size = sum(len(m["content"] or "") for m in history)
    print(f"history: {len(history):,} messages, {size / 1e6:.1f} MB of text\n")
    print(f"| {'measure':<58} | {'figure':>16} | note")
    print(f"|{'-' * 60}|{'-' * 18}|------")
    with tempfile.TemporaryDirectory(prefix="hermes-bench-") as folder:
        for journal in ("wal", "delete"):
            label = "WAL + writer lock" if journal == "wal" and policy.writer_lock else journal
            append = bench_append(folder, history, journal)
            row(f"[{label}] append, 1 msg/txn, ours", f"{append['ours']:,.0f} msg/s")
            row(f"[{label}] append, 1 msg/txn, raw sqlite3 same work", f"{append['raw_same_work']:,.0f} msg/s",
                "insert + count update")
            row(f"[{label}] append ratio ours / raw same work", f"{append['ours'] / append['raw_same_work']:.2f}",
                "target >= 0.85")
            row(f"[{label}] append ratio ours / raw insert only",
                f"{append['ours'] / append['raw_insert_only']:.2f}", "raw skips the count update")
            batch = bench_batch(folder, history, journal)
            row(f"[{label}] batch append ({BATCH_SIZE}/txn), ours", f"{batch['ours']:,.0f} msg/s",
                f"ratio {batch['ours'] / batch['raw']:.2f} over raw executemany")
            one = bench_processes(folder, journal, 1)
            four = bench_processes(folder, journal, 4)
            row(f"[{label}] 1 process appending", f"{one['rate']:,.0f} msg/s")
            row(f"[{label}] 4 processes appending at once, total", f"{four['rate']:,.0f} msg/s",
                f"ratio {four['rate'] / one['rate']:.2f} (target >= 0.8), errors {four['errors']}, "
                f"rows {four['stored']}/{four['expected']}")
        moved = bench_portability(folder, history, policy.mode)
        row("export_all to jsonl, 20,000 messages", f"{moved['export_rate']:,.0f} msg/s",
            f"{moved['file_mb']:.0f} MB written; peak Python memory {moved['peak_mb']:.1f} MB")
        row("import_sessions, same 20,000 messages (10 sessions a call)", f"{moved['import_rate']:,.0f} msg/s",
            "validated, then one transaction per call")
        large = build_large_store(folder, policy.mode)
        opened = bench_open(large, policy.mode)
        row(f"open a {OPEN_STORE_MESSAGES:,}-message store ({opened['bytes'] / 1e6:.0f} MB)",
            f"{opened['ours_ms']:.1f} ms", f"raw sqlite3 connect + query {opened['raw_ms']:.1f} ms")
        searches, scan = bench_search(large, policy.mode)
        for label, (ms, hits) in searches.items():
            row(f"search at {OPEN_STORE_MESSAGES:,} messages: {label}", f"{ms:.1f} ms", f"{hits} hits (top 20 fetched)")
        row(f"full LIKE scan of the same store for the 2-character query", f"{scan:.1f} ms",
            f"CJK 2-char search / scan = 1/{scan / searches['CJK, 2 characters'][0]:.0f} (target <= 1/20)")


if __name__ == "__main__":
    main()
