"""Helpers shared by the test suites: temp folders, fixture copies, raw reads.

Not a test module itself; it holds no TestCase. Fixtures are read from
../shared/fixtures (or $HERMES_FIXTURES) and always copied before opening.
"""

import hashlib
import os
import shutil
import sqlite3
import tempfile
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parent
FIXTURES = Path(os.environ.get("HERMES_FIXTURES", REPO.parent / "shared" / "fixtures"))
V22_DB = "hermes_v22_legacy_fts.db"
V26_DB = "hermes_v26_split.db"
FIXTURE_DBS = (V22_DB, V26_DB)

WRITE_VERBS = ("INSERT", "UPDATE", "DELETE", "REPLACE", "CREATE", "ALTER", "DROP")


def fixture_path(name):
    path = FIXTURES / name
    if not path.exists():
        raise AssertionError(f"fixture {path} is missing: the suite needs ../shared/fixtures "
                             "(or HERMES_FIXTURES pointing at a copy)")
    return path


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

    def raw(self, path):
        """A plain sqlite3 connection with dict-like rows, closed after the test."""
        conn = sqlite3.connect(str(path))
        conn.row_factory = sqlite3.Row
        self.addCleanup(conn.close)
        return conn


def dump_hash(path):
    """SHA-256 of the logical content (iterdump), independent of page layout."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        digest = hashlib.sha256()
        for line in conn.iterdump():
            digest.update(line.encode("utf-8"))
        return digest.hexdigest()
    finally:
        conn.close()


def schema_snapshot(path):
    """Every schema object's SQL and every table's columns, for 'nothing changed' checks."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        objects = sorted(conn.execute("SELECT type, name, sql FROM sqlite_master").fetchall(),
                         key=lambda r: (r[0], r[1]))
        columns = {name: conn.execute(f'PRAGMA table_info("{name}")').fetchall()
                   for kind, name, _sql in objects if kind == "table"}
        return objects, columns
    finally:
        conn.close()


def tracing_factory(statements):
    """A connection factory that records every statement SQLite runs."""
    def connect(*args, **kwargs):
        conn = sqlite3.connect(*args, **kwargs)
        conn.set_trace_callback(statements.append)
        return conn
    return connect


def write_statements(statements):
    return [s for s in statements if s.lstrip().upper().startswith(WRITE_VERBS)]
