"""Helpers shared by the test suites: temp folders, fixture copies, raw reads.

Not a test module itself; it holds no TestCase. Fixtures live gzipped in
fixtures/ inside the repo; each is unpacked once per run into a private
temp folder, read-only, and tests copy it again before opening it writable.
"""

import atexit
import contextlib
import gzip
import hashlib
import logging
import re
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import unittest
import warnings
from pathlib import Path

from hermes_state_schema import sqlite_supports_fts5, sqlite_supports_trigram

REPO = Path(__file__).resolve().parent
# The store's warnings (a damaged file set aside, an index rebuilt) are what many tests provoke on
# purpose; they would print between the dots. A test that wants them reads them with assertLogs.
logging.getLogger("hermes_state").addHandler(logging.NullHandler())
FIXTURES = REPO / "fixtures"
V22_DB = "hermes_v22_legacy_fts.db"
V26_DB = "hermes_v26_split.db"
FIXTURE_DBS = (V22_DB, V26_DB)

WRITE_VERBS = ("INSERT", "UPDATE", "DELETE", "REPLACE", "CREATE", "ALTER", "DROP")

# What the SQLite this process loaded can do, asked of the real sqlite3 module (`make test-runtimes`
# runs the suite on builds without FTS5 and without the trigram tokenizer); the connection factories
# below simulate the rest.
HAS_FTS5 = sqlite_supports_fts5()
HAS_TRIGRAM = HAS_FTS5 and sqlite_supports_trigram()
# The indexes a new store searches by here (doctor's `searchable_by_index`).
SEARCHABLE = ["cjk", "trigram", "word"] if HAS_TRIGRAM else ["cjk", "word"] if HAS_FTS5 else []

# The index tables a new store has here: none without FTS5, no trigram table without its tokenizer.
INDEX_TABLES = {index: table for index, table in (
    ("word", "messages_fts"), ("trigram", "messages_fts_trigram"), ("cjk", "hs_fts_cjk"))
    if index in SEARCHABLE}
RANKED_TABLES = [table for index, table in INDEX_TABLES.items() if index != "cjk"]


def drop_triggers_not_runnable_here(conn):
    """Drop the triggers of a store made elsewhere that write to an FTS5 table this SQLite cannot
    open (all without FTS5, the trigram ones without its tokenizer), as hermes-agent's open does."""
    triggers = conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'").fetchall()
    for name, sql in triggers:
        if (not HAS_FTS5 and "fts" in sql.lower()) or (not HAS_TRIGRAM and "trigram" in sql.lower()):
            conn.execute(f'DROP TRIGGER "{name}"')


def require(test, capability, why):
    """Skip the rest of `test` unless this SQLite has `capability` ("fts5", "trigram"), saying `why`
    the check means nothing without it."""
    if not {"fts5": HAS_FTS5, "trigram": HAS_TRIGRAM}[capability]:
        test.skipTest(f"SQLite {sqlite3.sqlite_version} has no {capability}: {why}")


_UNPACKED = None


def fixture_path(name):
    """A read-only, unpacked copy of fixtures/<name>.gz, made once per test run."""
    global _UNPACKED
    packed = FIXTURES / (name + ".gz")
    if not packed.exists():
        raise AssertionError(f"fixture {packed} is missing from the repository")
    if _UNPACKED is None:
        _UNPACKED = Path(tempfile.mkdtemp(prefix="hermes-fixtures-"))
        atexit.register(shutil.rmtree, _UNPACKED, True)
    path = _UNPACKED / name
    if not path.exists():
        scratch = path.with_name(name + ".part")
        with gzip.open(packed, "rb") as source, open(scratch, "wb") as target:
            shutil.copyfileobj(source, target)
        os.chmod(scratch, 0o444)
        os.replace(scratch, path)
    return path


def fork():
    """os.fork() without Python 3.12's DeprecationWarning that the process has threads: the tests
    that call it fork a threaded process on purpose, and the child only runs what they check,
    then leaves through os._exit."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
        return os.fork()


def backdate(db, session_id, started_at):
    """Set a session's started_at: create_session, like hermes-agent's, stamps the time of the call."""
    db._execute_write(lambda conn: conn.execute("UPDATE sessions SET started_at = ? WHERE id = ?",
                                                (started_at, session_id)))



# Holds SQLite's write lock on the store argv[1] for argv[2] seconds, after printing "held".
HOLD_SQLITE_LOCK = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("held", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("COMMIT")
"""

class TempDirTestCase(unittest.TestCase):
    """A fresh temporary folder per test, removed afterwards."""

    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="hermes-test-")
        self.tmp = Path(self._tmp.name)
        self.addCleanup(self._tmp.cleanup)

    def copy_fixture(self, name):
        """Copy a fixture store into the temp folder (never open the original writable)."""
        target = self.tmp / name
        shutil.copyfile(fixture_path(name), target)
        return target

    def held_by_another_process(self, code, *args):
        """Run `code` (python -c, with `args`) in another process until it prints "held"; the returned function
        (also run at cleanup, its `pid` the process's) closes its stdin, which it waits on to let go."""
        holder = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)

        def release():
            if holder.poll() is None:
                holder.stdin.close()
                holder.wait(30)
            for pipe in (holder.stdin, holder.stdout):  # also when the holder ended by itself
                pipe.close()
        self.addCleanup(release)
        self.assertEqual(holder.stdout.readline().strip(), "held")
        release.pid = holder.pid
        return release

    @contextlib.contextmanager
    def hosted_by(self, package, version):
        """As if inside that hermes-agent release: a site folder holding only `package`'s
        dist-info first on sys.path, as an install of it has (the state layer asks its version
        where the releases disagree, docs/differences.md)."""
        from hermes_state_common import host_release
        site = self.tmp / f"site-{package}-{version}"
        info = site / f"{package.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n", encoding="utf-8")
        sys.path.insert(0, str(site))
        host_release.cache_clear()
        try:
            yield
        finally:
            sys.path.remove(str(site))
            host_release.cache_clear()

    def raw(self, path):
        """A plain sqlite3 connection with dict-like rows, closed after the test."""
        conn = sqlite3.connect(str(path))
        conn.row_factory = sqlite3.Row
        self.addCleanup(conn.close)
        return conn


class StoreTestCase(TempDirTestCase):
    """A fresh writable SessionDB at self.path, closed after the test."""

    def setUp(self):
        super().setUp()
        from hermes_state import SessionDB
        self.path = self.tmp / "state.db"
        self.db = SessionDB(self.path)
        self.addCleanup(self.db.close)

    def session_row(self, session_id):
        """The session's row as raw sqlite3 reads it."""
        return self.raw(self.path).execute("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()


def dump_hash(path):
    """SHA-256 of the logical content, independent of page layout: every schema object's SQL and
    every plain table's rows. A virtual table is hashed through its shadow tables (iterdump reads
    one whose DDL is not in capitals as a plain table: that fails where SQLite lacks its module)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        digest = hashlib.sha256()
        objects = conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type, name")
        for kind, name, sql in objects.fetchall():
            digest.update(repr((kind, name, sql)).encode("utf-8"))
            if kind == "table" and not re.match(r"\s*create\s+virtual\b", sql or "", re.I):
                for row in conn.execute('SELECT * FROM "{}"'.format(name.replace('"', '""'))):
                    digest.update(repr(tuple(row)).encode("utf-8"))
        return digest.hexdigest()
    finally:
        conn.close()


def schema_snapshot(path):
    """Every schema object's SQL and every table's columns, for 'nothing changed' checks."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        objects = sorted(conn.execute("SELECT type, name, sql FROM sqlite_master").fetchall(),
                         key=lambda r: (r[0], r[1]))
        columns = {name: _table_info(conn, name) for kind, name, _sql in objects if kind == "table"}
        return objects, columns
    finally:
        conn.close()


def _table_info(conn, name):
    """A table's columns; for a virtual table this SQLite cannot load, the error."""
    try:
        return conn.execute(f'PRAGMA table_info("{name}")').fetchall()
    except sqlite3.OperationalError as exc:
        return str(exc)


def tracing_factory(statements):
    """A connection factory that records every statement SQLite runs on the store
    (not on the scratch in-memory connections of the capability probes)."""
    def connect(database, *args, **kwargs):
        conn = sqlite3.connect(database, *args, **kwargs)
        if database != ":memory:":
            conn.set_trace_callback(statements.append)
        return conn
    return connect


def write_statements(statements):
    return [s for s in statements if s.lstrip().upper().startswith(WRITE_VERBS)]


# Runtimes without FTS5 or without the trigram tokenizer. An authorizer sees
# every table a statement touches, trigger bodies included, at prepare time,
# so a write to `messages` fails while an FTS trigger exists, as it would on
# such a runtime; the error carries SQLite's own message.
FTS_VTABLES = re.compile(r"^(hs_retired_)?(messages_fts(_trigram|_cjk)?|hs_fts_(words|trigram|cjk))(_\d+)?$")
TRIGRAM_VTABLES = re.compile(r"^(hs_retired_)?(messages_fts|hs_fts)_trigram(_\d+)?$")
_TOUCH = (sqlite3.SQLITE_READ, sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE,
          sqlite3.SQLITE_DROP_VTABLE, sqlite3.SQLITE_CREATE_VTABLE)


def _degraded_factory(message, vtables, ddl_marker):
    class Degraded(sqlite3.Connection):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.set_authorizer(self._authorize)

        @staticmethod
        def _authorize(action, arg1, arg2, _db, _trigger):
            name = arg2 if action == sqlite3.SQLITE_CREATE_VTABLE else arg1
            if action in _TOUCH and name and vtables.match(name):
                return sqlite3.SQLITE_DENY
            return sqlite3.SQLITE_OK

        def execute(self, sql, *args):
            if ddl_marker in sql.lower():
                raise sqlite3.OperationalError(message)
            try:
                return super().execute(sql, *args)
            except sqlite3.DatabaseError as exc:
                if "not authorized" in str(exc) or "prohibited" in str(exc):
                    raise sqlite3.OperationalError(message) from None
                raise

    def connect(*args, **kwargs):
        return sqlite3.connect(*args, factory=Degraded, **kwargs)
    return connect


without_fts5 = _degraded_factory("no such module: fts5", FTS_VTABLES, "using fts5")
without_trigram = _degraded_factory("no such tokenizer: trigram", TRIGRAM_VTABLES, "tokenize='trigram'")
