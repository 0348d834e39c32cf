"""Stress: several real processes, each with its own SessionDB, share one store for a few seconds.

Owns only this test module. It never touches product code: workers call the public API (and, as hermes-agent
does, raw SQL on `db._conn` under `with db._lock:`), record what they wrote, and one process checks afterwards
that nothing failed, nothing was lost, every counter matches its rows and the store is intact.

Longer runs outside the suite: HERMES_STRESS_SECONDS=120 HERMES_STRESS_SEED=7 python3 -m unittest test_stress
"""

import json
import multiprocessing
import os
import random
import sqlite3
import sys
import threading
import time
import traceback
import unittest
from pathlib import Path

from test_support import HAS_FTS5, HAS_TRIGRAM, INDEX_TABLES, TempDirTestCase

try:
    import fcntl  # noqa: F401  (the writer lock needs flock)
    HAVE_FLOCK = hasattr(fcntl, "flock")
except ImportError:
    HAVE_FLOCK = False

HAVE_FORK = "fork" in multiprocessing.get_all_start_methods()
SECONDS = float(os.environ.get("HERMES_STRESS_SECONDS", "3"))
SEED = int(os.environ.get("HERMES_STRESS_SEED", "20261130"))
MIXED_WORKERS = int(os.environ.get("HERMES_STRESS_WORKERS", "3"))
SHARED_SESSIONS = ("shared-0", "shared-1")
OWN_SESSIONS = 3
# 3 s of this mix reached 34 MB beside a 2 MB store while only each process's 500th commit checkpointed; with
# every close checkpointing too, about 6 MB (ShortLivedWritersBesideALongLivedOne pins that close).
WAL_LIMIT_BYTES = 24 * 1024 * 1024
CJK_WORDS = ("数据库", "缓存", "日本語のテキスト", "검색")
FTS_TABLES = tuple(INDEX_TABLES.values())  # (the ones this SQLite keeps)
COUNTER_KEY = "stress_counter"
REBUILD_MARKS = "search indexes marked for a rebuild"


# -- what a worker does ------------------------------------------------------------------------------------

class Record:
    """What one worker did and saw, written as JSON for the checking process."""

    def __init__(self, wid):
        self.wid = wid
        self.errors, self.appended, self.kept_imports, self.ops = [], {}, [], {}
        self.tokens = {}  # session -> [input, output, api calls]
        self.counter_bumps = 0
        self.longest = (0.0, "")
        self.title_conflicts = 0
        self.search_misses = []

    def run(self, name, call):
        start = time.monotonic()
        try:
            return call()
        except Exception as exc:  # every failure is a finding; the checker reports them all
            self.errors.append({"op": name, "type": type(exc).__name__, "error": str(exc)[:300],
                                "after_s": round(time.monotonic() - start, 3),
                                "trace": traceback.format_exc()[-800:]})
            return None
        finally:
            took = time.monotonic() - start
            self.ops[name] = self.ops.get(name, 0) + 1
            if took > self.longest[0]:
                self.longest = (took, name)

    def succeeded(self, name, call):
        before = len(self.errors)
        self.run(name, call)
        return len(self.errors) == before

    def add_tokens(self, sid, inp, out, calls):
        total = self.tokens.setdefault(sid, [0, 0, 0])
        total[0] += inp
        total[1] += out
        total[2] += calls

    def dump(self, path):
        Path(path).write_text(json.dumps(self.__dict__))


def _cjk_tag(wid, n):
    """A CJK term no other message holds (3+ letters: the trigram index answers it)."""
    digits = "零一二三四五六七八九"
    return "检" + "".join(digits[int(d)] for d in str(wid)) + "号" + "".join(digits[int(d)] for d in str(n)) + "终"


def _content(rng, wid, n):
    # A word no other message holds, as a token and as a substring too (the LIKE fallback's test without FTS5).
    words = [f"tok{wid}x{n}e", rng.choice(("parser", "gateway", "cron", "memory", "ledger"))]
    if rng.random() < 0.3:
        words.append(rng.choice(CJK_WORDS))
    return " ".join(words) + f" #{n} " + _cjk_tag(wid, n)


def _tool_calls(rng):
    if rng.random() < 0.3:
        return [{"id": f"c{rng.randrange(10**6)}", "type": "function",
                 "function": {"name": "shell", "arguments": "{}"}} for _ in range(rng.randint(1, 2))]
    return None


def mixed_worker(path, journal, wid, seed, seconds, out):
    """The agent-like mix: appends, sessions, titles, tokens, searches, deletes, imports, maintenance."""
    from hermes_state import SessionDB
    rng, rec = random.Random(seed), Record(wid)
    db = SessionDB(path, journal=journal)
    own = [f"w{wid}-own{k}" for k in range(OWN_SESSIONS)]
    for sid in own:
        rec.run("create_session", lambda sid=sid: db.create_session(sid, "cli"))
    scratch, n, imports = [], 0, 0
    searchable = []  # (word, id) appended to sessions nobody deletes

    def append(sid):
        nonlocal n
        n += 1
        text = _content(rng, wid, n)
        role = rng.choice(("user", "assistant", "tool"))
        calls = _tool_calls(rng) if role == "assistant" else None
        mid = rec.run("append_message", lambda: db.append_message(sid, role, text, tool_calls=calls))
        if mid is not None and not sid.startswith(f"w{wid}-s"):
            rec.appended[str(mid)] = [sid, text]
            if role != "tool":  # a CJK term never matches tool output (docs/differences.md)
                searchable.append((rng.choice((f"tok{wid}x{n}e", _cjk_tag(wid, n))), mid))

    def batch(sid):
        nonlocal n
        msgs = []
        for _ in range(rng.randint(1, 5)):
            n += 1
            msgs.append({"role": "user", "content": _content(rng, wid, n)})
        msgs[-1]["tool_calls"] = _tool_calls(rng)
        msgs[-1]["role"] = "assistant"
        if rec.run("append_messages_batch", lambda: db.append_messages_batch(sid, msgs)) is not None \
                and not sid.startswith(f"w{wid}-s"):
            for m in msgs:
                rec.appended[str(m["_row_id"])] = [sid, m["content"]]

    def new_scratch():
        sid = f"w{wid}-s{len(scratch)}"
        scratch.append(sid)
        rec.run("create_session", lambda: db.create_session(sid, f"scratch-w{wid}"))
        for _ in range(rng.randint(0, 3)):
            append(sid)
        if rng.random() < 0.7:
            rec.run("end_session", lambda: db.end_session(sid, "stress"))

    def title():
        sid, name = rng.choice(own), f"stress title {rng.randrange(6)}"
        try:
            db.set_session_title(sid, name)
        except ValueError as exc:  # another session holds it: the unique-title rule, not a failure
            if "already in use" not in str(exc):
                raise
            rec.title_conflicts += 1

    def tokens(queued):
        sid, inp, out = rng.choice(own), rng.randint(0, 900), rng.randint(0, 300)
        call = db.queue_token_counts if queued else db.update_token_counts
        if rec.succeeded("queue_token_counts" if queued else "update_token_counts",
                         lambda: call(sid, input_tokens=inp, output_tokens=out, api_call_count=1)):
            rec.add_tokens(sid, inp, out, 1)

    def search():
        if searchable and rng.random() < 0.6:
            word, mid = rng.choice(searchable)
            hits = db.search_messages(word, limit=50)
            if mid not in [h["id"] for h in hits]:
                rec.search_misses.append([word, mid, [h["id"] for h in hits]])
        else:
            db.search_messages(rng.choice(CJK_WORDS + ("parser", "gateway ledger")), limit=10)

    def read():
        sid = rng.choice(own)
        ids = {m["id"] for m in db.get_messages(sid)}
        missing = [mid for mid, (s, _) in rec.appended.items() if s == sid and int(mid) not in ids]
        if missing:
            raise AssertionError(f"get_messages({sid}) lacks appended ids {missing[:5]}")

    def delete():
        if scratch:
            db.delete_session(rng.choice(scratch))

    def import_one():
        nonlocal imports
        imports += 1
        sid = f"w{wid}-imp{imports}"
        payload = {"id": sid, "source": f"imported-w{wid}", "started_at": time.time(),
                   "messages": [{"role": "user", "content": f"imported {sid} one", "timestamp": time.time()},
                                {"role": "assistant", "content": f"imported {sid} two", "timestamp": time.time()}]}
        result = db.import_sessions([payload])
        if not result.get("ok") or result.get("imported") != 1:
            raise AssertionError(f"import of {sid}: {result}")
        rec.kept_imports.append(sid)

    def hot():
        # Ids every worker creates, fills and deletes: deletes sweep big sessions in chunks while another
        # process makes the same id again and appends to it.
        from hermes_state_errors import UnknownSessionError
        sid, pick = f"hot-{rng.randrange(3)}", rng.random()
        if pick < 0.3:
            db.create_session(sid, "hot")
        elif pick < 0.8:
            msgs = [{"role": "user", "content": f"hot {wid} {k}"} for k in range(rng.choice((5, 50, 450)))]
            try:
                db.append_messages_batch(sid, msgs)
            except UnknownSessionError:  # another worker deleted it: the expected answer
                rec.ops["hot_unknown"] = rec.ops.get("hot_unknown", 0) + 1
        else:
            db.delete_session(sid)

    def bump_counter():
        def write(conn):
            row = conn.execute("SELECT value FROM state_meta WHERE key = ?", (COUNTER_KEY,)).fetchone()
            conn.execute("INSERT OR REPLACE INTO state_meta (key, value) VALUES (?, ?)",
                         (COUNTER_KEY, str(int(row[0] if row else 0) + 1)))
        db._execute_write(write)
        rec.counter_bumps += 1

    ops = [(30, "append_own", lambda: append(rng.choice(own))),
           (15, "append_shared", lambda: append(rng.choice(SHARED_SESSIONS))),
           (8, "batch_own", lambda: batch(rng.choice(own))),
           (6, "batch_shared", lambda: batch(rng.choice(SHARED_SESSIONS))),
           (6, "new_scratch", new_scratch),
           (5, "title", lambda: rec.run("set_session_title", title)),
           (6, "update_tokens", lambda: tokens(False)),
           (6, "queue_tokens", lambda: tokens(True)),
           (8, "search", lambda: rec.run("search_messages", search)),
           (6, "get_messages", lambda: rec.run("get_messages", read)),
           (4, "delete_session", lambda: rec.run("delete_session", delete)),
           (2, "prune_sessions", lambda: rec.run("prune_sessions", lambda: db.prune_sessions(
               older_than_days=0, source=f"scratch-w{wid}"))),
           (2, "import_sessions", lambda: rec.run("import_sessions", import_one)),
           (4, "hot", lambda: rec.run("hot_session", hot)),
           (4, "counter", lambda: rec.run("counter", bump_counter)),
           (1, "optimize_fts", lambda: rec.run("optimize_fts", db.optimize_fts)),
           (0.4, "vacuum", lambda: rec.run("vacuum", db.vacuum))]
    weights = [w for w, _, _ in ops]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        rng.choices(ops, weights)[0][2]()
    rec.run("close", db.close)
    rec.dump(out)


def caller_lock_worker(path, journal, wid, seed, seconds, out):
    """hermes-agent's own SQL on db._conn while it holds db._lock: a read-modify-write no one may interleave."""
    from hermes_state import SessionDB
    rng, rec = random.Random(seed), Record(wid)
    db = SessionDB(path, journal=journal)

    def bump():
        with db._lock:
            conn = db._conn
            if rng.random() < 0.5:  # autocommit statements, one after the other
                row = conn.execute("SELECT value FROM state_meta WHERE key = ?", (COUNTER_KEY,)).fetchone()
                conn.execute("INSERT OR REPLACE INTO state_meta (key, value) VALUES (?, ?)",
                             (COUNTER_KEY, str(int(row[0] if row else 0) + 1)))
            else:  # an explicit transaction of the caller's own
                conn.execute("BEGIN")
                row = conn.execute("SELECT value FROM state_meta WHERE key = ?", (COUNTER_KEY,)).fetchone()
                conn.execute("INSERT OR REPLACE INTO state_meta (key, value) VALUES (?, ?)",
                             (COUNTER_KEY, str(int(row[0] if row else 0) + 1)))
                conn.execute("COMMIT")
        rec.counter_bumps += 1

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        rec.run("caller_lock_sql", bump)
        time.sleep(rng.uniform(0, 0.01))
    rec.run("close", db.close)
    rec.dump(out)


def opener_worker(path, journal, wid, seed, seconds, out):
    """A short-lived process again and again (cron, doctor): open, write a little, queue tokens, close."""
    from hermes_state import SessionDB
    rng, rec = random.Random(seed), Record(wid)
    sid, n = f"w{wid}-opener", 0
    end = time.monotonic() + seconds
    first = True
    while time.monotonic() < end:
        db = rec.run("open", lambda: SessionDB(path, journal=journal))
        if db is None:
            continue
        if first:
            first = not rec.succeeded("create_session", lambda: db.create_session(sid, "cron"))
        n += 1
        text = f"opener tok{wid}x{n}"
        mid = rec.run("append_message", lambda: db.append_message(sid, "user", text))
        if mid is not None:
            rec.appended[str(mid)] = [sid, text]
        inp = rng.randint(1, 50)
        if rec.succeeded("queue_token_counts", lambda: db.queue_token_counts(sid, input_tokens=inp,
                                                                             api_call_count=1)):
            rec.add_tokens(sid, inp, 0, 1)
        rec.run("close", db.close)  # applies the queued tokens: the last connection's checkpoint
    rec.dump(out)


# -- one run and its checks --------------------------------------------------------------------------------

def run_stress(folder, journal, seconds=SECONDS, seed=SEED, mixed=MIXED_WORKERS):
    """Start the workers on folder/state.db, wait, and return (records, largest WAL seen, wall seconds)."""
    from hermes_state import SessionDB
    path = str(Path(folder) / "state.db")
    with SessionDB(path, journal=journal) as db:
        for sid in SHARED_SESSIONS:
            db.create_session(sid, "gateway")
    ctx = multiprocessing.get_context("fork")
    kinds = [mixed_worker] * mixed + [caller_lock_worker, opener_worker]
    procs, outs = [], []
    for wid, kind in enumerate(kinds):
        out = Path(folder) / f"worker-{wid}.json"
        outs.append(out)
        procs.append(ctx.Process(target=kind, args=(path, journal, wid, seed * 100 + wid, seconds, str(out))))
    wal, largest, stop = Path(path + "-wal"), [0], threading.Event()

    def watch_wal():  # stat only: never open a live store file
        while not stop.wait(0.02):
            try:
                largest[0] = max(largest[0], wal.stat().st_size)
            except OSError:
                pass
    watcher = threading.Thread(target=watch_wal, daemon=True)
    started = time.monotonic()
    for proc in procs:
        proc.start()
    watcher.start()  # after the forks: a child forked beside a running thread may inherit a held lock
    for proc in procs:
        proc.join(seconds + 120)
    stop.set()
    watcher.join()
    wall = time.monotonic() - started
    records = []
    for wid, (proc, out) in enumerate(zip(procs, outs)):
        if proc.is_alive():
            proc.kill()
            records.append({"wid": wid, "errors": [{"op": "process", "error": "hung"}]})
        elif not out.exists():
            records.append({"wid": wid, "errors": [{"op": "process", "error": f"exit code {proc.exitcode}"}]})
        else:
            records.append(json.loads(out.read_text()))
            out.unlink()
    return path, records, largest[0], wall


def store_problems(path, records):
    """Every way the store disagrees with what the workers recorded, as readable lines; [] when none."""
    problems = []
    conn = sqlite3.connect(path)
    try:
        check = [r[0] for r in conn.execute("PRAGMA integrity_check")]
        if check != ["ok"]:
            problems.append(f"integrity_check: {check[:5]}")
        for table in FTS_TABLES:
            try:
                conn.execute(f"INSERT INTO {table}({table}) VALUES ('integrity-check')")
            except sqlite3.DatabaseError as exc:
                problems.append(f"{table} integrity-check: {exc}")
        calls, counts = {}, {}
        for sid, tool_calls in conn.execute("SELECT session_id, tool_calls FROM messages"):
            counts[sid] = counts.get(sid, 0) + 1
            parsed = json.loads(tool_calls) if tool_calls else None
            calls[sid] = calls.get(sid, 0) + (0 if parsed is None else len(parsed) if isinstance(parsed, list) else 1)
        sessions = {row[0]: row[1:] for row in conn.execute(
            "SELECT id, message_count, tool_call_count, input_tokens, output_tokens, api_call_count FROM sessions")}
        for sid, (mc, tc, _, _, _) in sessions.items():
            if (mc, tc) != (counts.get(sid, 0), calls.get(sid, 0)):
                problems.append(f"{sid}: message_count/tool_call_count {mc}/{tc}, rows say "
                                f"{counts.get(sid, 0)}/{calls.get(sid, 0)}")
        orphans = set(counts) - set(sessions)
        if orphans:
            problems.append(f"messages of deleted sessions left: {sorted(orphans)[:5]}")
        sweeps = conn.execute("SELECT count(*) FROM state_meta WHERE key LIKE 'hs_sweep_messages:%'").fetchone()[0]
        if sweeps:
            problems.append(f"{sweeps} unfinished message sweeps")
        from hermes_state_common import META_SEARCH_HERMES_FAILED, META_SEARCH_STALE_PREFIX
        stale = conn.execute("SELECT key FROM state_meta WHERE substr(key, 1, ?) = ? OR key = ?",
                             (len(META_SEARCH_STALE_PREFIX), META_SEARCH_STALE_PREFIX,
                              META_SEARCH_HERMES_FAILED)).fetchall()
        # The trigram index a SQLite without its tokenizer cannot keep is marked from the store's first open.
        stale = [row for row in stale if HAS_TRIGRAM or not HAS_FTS5 or row[0] != META_SEARCH_STALE_PREFIX + "trigram"]
        if stale:
            problems.append(f"{REBUILD_MARKS}: {[r[0] for r in stale]}")
        dup = conn.execute("SELECT title, count(*) FROM sessions WHERE title IS NOT NULL GROUP BY title "
                           "HAVING count(*) > 1").fetchall()
        if dup:
            problems.append(f"titles held twice: {dup}")
        stored = dict(((str(i), [s, c]) for i, s, c in conn.execute("SELECT id, session_id, content FROM messages")))
        tokens, bumps = {}, 0
        for rec in records:
            for err in rec.get("errors", []):
                problems.append(f"worker {rec['wid']} {err.get('op')}: {err.get('type', '')} {err.get('error')} "
                                f"(after {err.get('after_s', '?')} s)")
            for miss in rec.get("search_misses", []):
                problems.append(f"worker {rec['wid']} search {miss[0]!r} did not find message {miss[1]}: {miss[2]}")
            for mid, (sid, text) in rec.get("appended", {}).items():
                if stored.get(mid) != [sid, text]:
                    problems.append(f"message {mid} ({sid}, {text!r}) appended by worker {rec['wid']}: "
                                    f"stored {stored.get(mid)}")
            for sid in rec.get("kept_imports", []):
                if sessions.get(sid, (None,))[0] != 2:
                    problems.append(f"imported {sid}: {sessions.get(sid)}")
            for sid, total in rec.get("tokens", {}).items():
                tokens[sid] = [a + b for a, b in zip(tokens.get(sid, [0, 0, 0]), total)]
            bumps += rec.get("counter_bumps", 0)
        for sid, (inp, out, api) in tokens.items():
            got = list(sessions.get(sid, (0, 0, None, None, None))[2:])
            if got != [inp, out, api]:
                problems.append(f"{sid}: tokens in/out/api calls {got}, workers added {[inp, out, api]}")
        row = conn.execute("SELECT value FROM state_meta WHERE key = ?", (COUNTER_KEY,)).fetchone()
        if int(row[0] if row else 0) != bumps:
            problems.append(f"{COUNTER_KEY} is {row and row[0]}, workers bumped it {bumps} times")
    finally:
        conn.close()
    return problems


def summary(records, largest_wal, wall):
    ops = sum(sum(r.get("ops", {}).values()) for r in records)
    longest = max((tuple(r.get("longest", (0, ""))) for r in records), default=(0, ""))
    return (f"{len(records)} processes, {ops} ops in {wall:.1f} s ({ops / wall:.0f}/s), longest op "
            f"{longest[0]:.2f} s ({longest[1]}), largest WAL {largest_wal // 1024} KiB")


@unittest.skipUnless(HAVE_FORK and HAVE_FLOCK, "needs os.fork and fcntl.flock: the workers are forked "
                     "processes and the writer lock is a flock")
class SeveralProcessesShareOneStore(TempDirTestCase):

    def check_run(self, journal):
        path, records, largest_wal, wall = run_stress(self.tmp, journal)
        if os.environ.get("HERMES_STRESS_VERBOSE"):
            print(f"\n[{journal or 'wal'}] {summary(records, largest_wal, wall)}", file=sys.stderr)
        self.assertEqual(store_problems(path, records), [], summary(records, largest_wal, wall))
        self.assertLess(largest_wal, WAL_LIMIT_BYTES)
        left = sorted(p.name for p in self.tmp.iterdir())
        self.assertEqual(left, ["state.db", "state.db.lock"], "temp, journal or WAL files were left behind")
        self.assertTrue(all(r.get("ops") for r in records), "a worker did nothing")

    def test_the_wal_policy_loses_nothing_and_counts_exactly(self):
        self.check_run("wal")

    def test_a_rollback_journal_loses_nothing_and_counts_exactly(self):
        self.check_run("delete")


class ShortLivedWritersBesideALongLivedOne(TempDirTestCase):

    def test_commits_past_the_checkpoint_cadence_reach_the_store_file_when_each_writer_is_short_lived(self):
        # A gateway keeps the store open; cron runs and CLI calls open it, write a little and close. None of them
        # is the last connection, so no close checkpoints, and the cadence counts each SessionDB's own commits.
        from hermes_state import CHECKPOINT_EVERY_COMMITS, SessionDB
        path = self.tmp / "state.db"
        gateway = SessionDB(path, journal="wal")
        self.addCleanup(gateway.close)
        gateway.create_session("gw", "gateway")
        empty_size = path.stat().st_size
        for run in range(CHECKPOINT_EVERY_COMMITS // 20 + 5):
            with SessionDB(path, journal="wal") as cron:
                for i in range(20):
                    cron.append_message("gw", "user", f"cron run {run} line {i}")
        wal = Path(str(path) + "-wal").stat().st_size
        self.assertGreater(path.stat().st_size, empty_size,
                           f"{CHECKPOINT_EVERY_COMMITS + 100} commits and not one checkpoint: the WAL holds "
                           f"{wal // 1024} KiB and keeps growing while the gateway runs")


def _vacuum_loop(path, seconds, stop):
    from hermes_state import SessionDB
    with SessionDB(path, journal="delete") as db:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not stop.is_set():
            db.vacuum()


@unittest.skipUnless(HAVE_FORK and HAVE_FLOCK, "needs os.fork and fcntl.flock")
class SearchBesideAVacuumInAnotherProcess(TempDirTestCase):

    def test_a_search_while_another_process_vacuums_a_rollback_journal_store_leaves_the_indexes_alone(self):
        from hermes_state import SessionDB
        from hermes_state_common import META_SEARCH_STALE_PREFIX
        path = str(self.tmp / "state.db")
        db = SessionDB(path, journal="delete")
        self.addCleanup(db.close)
        db.create_session("a", "cli")
        db.append_messages_batch("a", [{"role": "user", "content": f"数据库 缓存 parser {i}"} for i in range(20)])
        ctx = multiprocessing.get_context("fork")
        stop = ctx.Event()
        vacuums = ctx.Process(target=_vacuum_loop, args=(path, 8, stop))
        vacuums.start()
        self.addCleanup(vacuums.join)
        self.addCleanup(stop.set)
        end, searches = time.monotonic() + 8, 0
        # (An index this SQLite cannot keep, the trigram one without its tokenizer, is marked from the start.)
        before = db.list_meta_prefix(META_SEARCH_STALE_PREFIX)
        stale = before
        while time.monotonic() < end and stale == before:
            with SessionDB(path, journal="delete") as cli:  # a `hermes search` run: a fresh connection each
                cli.search_messages("缓存", limit=1)
            searches += 1
            stale = db.list_meta_prefix(META_SEARCH_STALE_PREFIX)
        self.assertEqual(stale, before, f"search {searches} beside a VACUUM marked the indexes for a rebuild")
        self.assertEqual(len(before), 0 if HAS_TRIGRAM or not HAS_FTS5 else 1)


if __name__ == "__main__":
    unittest.main()
