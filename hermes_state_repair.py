"""Probing and repairing a store from outside SessionDB: the helpers hermes-agent imports from
hermes_state for `hermes doctor`, `hermes status` and `hermes sessions repair`.

Owns the health probe, the forensic backup, the escalating schema/index repair, the read-only stats,
the count of processes holding the file and the SQLite runtime facts, each on a path with
short-lived SQLite connections (never a SessionDB), so a store whose schema does not parse can still
be probed and repaired. Never opens the store or a sidecar with anything but SQLite while this
process may hold a connection to it: closing any descriptor of a file drops every POSIX lock the
process holds on it, SQLite's included. Never deletes a session or message row, nor a backup: a
repair rebuilds or drops search indexes and duplicate schema entries only.
"""

import contextlib
import logging
import os
import shutil
import sqlite3
import sys
import time
from pathlib import Path

if sys.platform == "win32":
    import msvcrt
else:
    import fcntl

from hermes_state_common import (
    FILE_MODE, HERMES_FTS_TABLES, META_FTS_CJK_STALE, META_FTS_OPTIMIZE_AVAILABLE,
    META_FTS_REBUILD_HIGH_WATER, META_FTS_REBUILD_PROGRESS, META_FTS_STALE,
    META_FTS_STORAGE_VERSION, META_SEARCH_HIGH_WATER, META_SEARCH_PROGRESS,
    META_SEARCH_STALE_PREFIX, SEARCH_TABLES, SIDECAR_SUFFIXES, claim_file_beside,
    hermes_agent_config, sqlite_has_wal_reset_bug,
)
from hermes_state_errors import is_capability_gap

logger = logging.getLogger("hermes_state")

# The search index tables hermes-agent and we may have; each is probed only if present.
_FTS_TABLES = tuple(HERMES_FTS_TABLES.values()) + tuple(SEARCH_TABLES.values())
# How long a repair waits for another process's repair (hermes-agent's lock file and timeout, so its
# processes and ours take turns).
REPAIR_LOCK_WAIT = 120.0


# -- the SQLite runtime ----------------------------------------------------------

def is_sqlite_wal_reset_vulnerable(version_info=None):
    """True if this SQLite (or `version_info`, e.g. (3, 45, 1)) has the WAL-reset bug (3.7.0 to
    3.51.2; fixed in 3.51.3 and the 3.50.7 / 3.44.6 backports)."""
    if version_info is None:
        version_info = sqlite3.sqlite_version_info
    parts = [int(p) for p in version_info][:3]
    return sqlite_has_wal_reset_bug(tuple(parts + [0] * (3 - len(parts))))


def sqlite_source_id():
    """SQLite's `sqlite_source_id()`: the build date and check-in hash of the library in use."""
    with contextlib.closing(sqlite3.connect(":memory:")) as conn:
        return conn.execute("SELECT sqlite_source_id()").fetchone()[0]


def _wal_reset_repair_hint():
    """How to get a SQLite without the WAL-reset bug, for hermes-agent's kind of install if it
    is one."""
    config = hermes_agent_config()
    try:
        method = config.detect_install_method(config.get_project_root())
        command = config.recommended_update_command_for_method(method)
    except Exception:  # outside hermes-agent (config is None) or an older one without these
        return ("install a Python build bundled with SQLite 3.51.3+ (or backports 3.50.7 / 3.44.6) "
                "and restart Hermes")
    if method in ("git", "unknown"):
        return f"Hermes-managed installs can repair the embedded runtime with `{command}`"
    if method == "docker":
        return f"update the container image with `{command}`"
    return command


# -- read-only reports -------------------------------------------------------------

def collect_state_db_stats(db_path):
    """A read-only snapshot for doctor, with every key below (None if unreadable); never
    raises or writes."""
    stats = dict.fromkeys((
        "page_count", "page_size", "freelist_count", "logical_size_bytes", "wal_size_bytes",
        "journal_mode", "messages", "sessions", "fts_tables", "fts_storage_version",
        "fts_rebuild_pending", "fts_rebuild_high_water", "fts_rebuild_progress",
    ))
    wal = Path(str(db_path) + "-wal")
    with contextlib.suppress(OSError):
        stats["wal_size_bytes"] = wal.stat().st_size if wal.exists() else 0
    try:
        conn = _connect(db_path, "ro", timeout=2.0)
    except Exception as exc:
        logger.debug("collect_state_db_stats: cannot open %s read-only: %s", db_path, exc)
        return stats

    def value(sql, params=(), cast=int):
        with contextlib.suppress(Exception):  # None, as for a missing row
            row = conn.execute(sql, params).fetchone()
            return None if row is None or row[0] is None else cast(row[0])

    with contextlib.closing(conn):
        for key in ("page_count", "page_size", "freelist_count"):
            stats[key] = value(f"PRAGMA {key}")
        if stats["page_count"] is not None and stats["page_size"] is not None:
            stats["logical_size_bytes"] = stats["page_count"] * stats["page_size"]
        stats["journal_mode"] = value("PRAGMA journal_mode", cast=str)
        for table in ("messages", "sessions"):
            stats[table] = value(f"SELECT COUNT(*) FROM {table}")
        ours = False
        with contextlib.suppress(Exception):
            tables = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            present = {row[0] for row in tables}
            ours = SEARCH_TABLES["word"] in present
            # By hermes-agent's names, for the role each index plays: our word and trigram indexes
            # count as its own (its CJK index needs its tokenizer; ours is apart).
            stats["fts_tables"] = {
                table: table in present or (index != "cjk" and SEARCH_TABLES[index] in present)
                for index, table in HERMES_FTS_TABLES.items()}
        meta = "SELECT value FROM state_meta WHERE key = ?"
        stats["fts_storage_version"] = value(meta, (META_FTS_STORAGE_VERSION,))
        marks = (META_SEARCH_HIGH_WATER, META_SEARCH_PROGRESS) if ours else (
            META_FTS_REBUILD_HIGH_WATER, META_FTS_REBUILD_PROGRESS)
        high_water = stats["fts_rebuild_high_water"] = value(meta, (marks[0],))
        progress = stats["fts_rebuild_progress"] = value(meta, (marks[1],))
        stats["fts_rebuild_pending"] = high_water is not None and (progress or 0) < high_water
    return stats


def count_db_holders(db_path):
    """How many processes have `db_path` open, from /proc/*/fd (Linux; a lower bound, other users'
    are invisible without root); None elsewhere or on error."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        target = os.path.realpath(db_path)
        return sum(1 for pid in os.listdir("/proc") if pid.isdigit() and target in _open_files(pid))
    except Exception:
        return None


def _open_files(pid):
    """The paths process `pid` has open (its /proc fd symlinks); empty if unreadable."""
    paths, folder = set(), f"/proc/{pid}/fd"
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            with contextlib.suppress(OSError):
                paths.add(os.readlink(f"{folder}/{name}"))
    return paths


# -- the health probe ---------------------------------------------------------------

def _db_opens_cleanly(db_path):
    """None if the store parses, passes integrity_check, answers its search indexes and takes a
    message write (rolled back); else the reason. A runtime lacking FTS5, trigram or hermes-agent's
    cjk tokenizer, and a store not yet built, count as healthy. Never creates the file."""
    try:
        conn = _connect(db_path)
    except sqlite3.Error as exc:
        return str(exc)
    try:
        conn.execute("PRAGMA journal_mode").fetchone()
        problems = [str(row[0]) for row in conn.execute("PRAGMA integrity_check")
                    if str(row[0]).lower() != "ok"]
        if problems:
            return "; ".join(problems[:3])
        conn.execute("SELECT COUNT(*) FROM sessions").fetchone()
        for table in _FTS_TABLES:
            try:
                conn.execute(f"SELECT 1 FROM {table} WHERE {table} MATCH '\"\"' LIMIT 1").fetchone()
            except sqlite3.DatabaseError as exc:
                if not isinstance(exc, sqlite3.OperationalError) \
                        or not (is_capability_gap(exc) or _not_built(exc)):
                    return f"fts5 read probe failed on {table}: {exc}"
        return _write_probe(conn)
    except sqlite3.DatabaseError as exc:
        return str(exc)
    finally:
        conn.close()


def _write_probe(conn):
    """A session and a message written through every trigger, then rolled back; None or
    the reason."""
    probe, now = f"_hermes_fts_health_probe_{time.time_ns()}", time.time()
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO sessions (id, source, started_at)"
                     " VALUES (?, '_health_probe', ?)", (probe, now))
        conn.execute("INSERT INTO messages (session_id, role, content, timestamp)"
                     " VALUES (?, 'user', '_fts_health_probe', ?)", (probe, now))
    except sqlite3.OperationalError as exc:
        if _not_built(exc) or "no such tokenizer: cjk_unicode61" in str(exc).lower():
            return None
        return str(exc)
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    return None


def _not_built(exc):
    text = str(exc).lower()
    return "no such table" in text or "no such column" in text


def _connect(db_path, mode="rw", timeout=5.0):
    """An autocommit connection to an existing store (never creates one)."""
    return sqlite3.connect(f"{Path(db_path).resolve().as_uri()}?mode={mode}", uri=True,
                           isolation_level=None, timeout=timeout)


# -- backup ---------------------------------------------------------------------------

def _backup_db_file(db_path):
    """(backup path, None) after copying the store to `<name>.malformed-backup-<time>[_n]` beside
    it, owner-only; (None, the reason) when no copy could be made.

    SQLite's backup API copies consistently, committed WAL included. A file SQLite cannot read is
    copied byte for byte with its sidecars, only while this process has none of them open (a copy
    would close a descriptor and cancel our own locks)."""
    db_path = Path(db_path)
    target = claim_file_beside(db_path, "malformed-backup")

    def discard(*suffixes):  # our own half-written copy, nothing of the user's
        for suffix in suffixes:
            with contextlib.suppress(OSError):
                os.unlink(f"{target}{suffix}")

    try:
        _sqlite_copy(db_path, target)
    except sqlite3.Error as exc:
        discard("", "-journal")
        if _process_has_open(db_path):
            return None, (f"SQLite cannot read {db_path} ({exc}) and this process has it open; "
                          "copying it byte for byte would cancel that connection's locks. "
                          "Close all SessionDB handles first.")
        try:
            for suffix in ("",) + SIDECAR_SUFFIXES[:2]:
                source = Path(f"{db_path}{suffix}")
                if source.exists():
                    shutil.copy2(source, f"{target}{suffix}")
                    os.chmod(f"{target}{suffix}", FILE_MODE)
        except OSError as copy_exc:
            discard("", *SIDECAR_SUFFIXES[:2])
            return None, f"backup copy failed: {copy_exc}"
    return target, None


def _sqlite_copy(db_path, target):
    with contextlib.closing(_connect(db_path, "ro")) as source, \
            contextlib.closing(sqlite3.connect(target)) as copy:
        source.backup(copy)
        # A copy of a damaged schema keeps its WAL flag.
        with contextlib.suppress(sqlite3.DatabaseError):
            copy.execute("PRAGMA journal_mode=DELETE")  # one self-contained file


def _process_has_open(db_path):
    """True if this process has a descriptor on the store or a sidecar, or if that cannot
    be known."""
    if not os.path.isdir("/proc/self/fd"):
        return True
    wanted = {os.path.realpath(f"{db_path}{suffix}") for suffix in ("",) + SIDECAR_SUFFIXES}
    return bool(wanted & _open_files("self"))


# -- repair -----------------------------------------------------------------------------

def repair_state_db_schema(db_path, *, backup=True):
    """{"repaired", "strategy", "backup_path", "error"} after repairing a store whose schema does
    not parse or whose search indexes reject writes; strategy 'already_healthy' for a healthy one.

    Strategies, least destructive first, each followed by the health probe: 'rebuild_fts' (in
    place), 'reindex_btree', 'dedup_schema' (the first of duplicate sqlite_master entries kept),
    'drop_fts_rebuild' (every search index object dropped, the file vacuumed; the next writable open
    rebuilds them). Unless `backup` is False, nothing is touched before `_backup_db_file` succeeded;
    sessions and messages never are. Serialised across processes by hermes-agent's
    `<name>.repair.lock`; not by our `<name>.lock`, as closing a second descriptor of it could drop
    the lock a SessionDB of this process holds where flock is emulated."""
    report = {"repaired": False, "strategy": None, "backup_path": None, "error": None}
    db_path = Path(db_path)
    if not db_path.exists():
        report["error"] = f"{db_path} does not exist"
        return report
    with _exclusive(Path(f"{db_path}.repair.lock"), REPAIR_LOCK_WAIT) as held:
        if not held:
            if _db_opens_cleanly(db_path) is None:
                return dict(report, repaired=True, strategy="repaired_by_other_process")
            report["error"] = ("another process holds the state.db repair lock; "
                               "skipped schema surgery to avoid racing it")
            return report
        if _db_opens_cleanly(db_path) is None:
            return dict(report, repaired=True, strategy="already_healthy")
        if backup:
            copy, why = _backup_db_file(db_path)
            report["backup_path"] = None if copy is None else str(copy)
            if copy is None:
                report["error"] = ("pre-repair backup refused; aborting schema repair to avoid "
                                   f"mutating the only copy of the damaged DB: {why}")
                return report
        for strategy, surgery in _STRATEGIES:
            try:
                with contextlib.closing(_connect(db_path)) as conn:
                    surgery(conn)
                report["error"] = _db_opens_cleanly(db_path)
            except sqlite3.DatabaseError as exc:
                report["error"] = str(exc)
            logger.warning("state.db repair %s on %s: %s",
                           strategy, db_path, report["error"] or "healthy")
            if report["error"] is None:
                return dict(report, repaired=True, strategy=strategy)
    logger.error("state.db repair could not recover %s (backup: %s)",
                 db_path, report["backup_path"])
    return report


def _rebuild_fts(conn):
    for table in _FTS_TABLES:
        with contextlib.suppress(sqlite3.OperationalError):  # absent, or its tokenizer is not here
            conn.execute(f"INSERT INTO {table}({table}) VALUES ('rebuild')")
    # The rebuilt indexes hold every row, so a pending backfill would index some twice: end it (ours
    # and hermes-agent's), and let the next open rebuild what Python indexes (our CJK index).
    # A store without state_meta has no backfill.
    with contextlib.suppress(sqlite3.OperationalError):
        _delete_meta(conn, META_FTS_REBUILD_HIGH_WATER, META_FTS_REBUILD_PROGRESS)
        backfill = conn.execute("SELECT 1 FROM state_meta WHERE key = ?",
                                (META_SEARCH_HIGH_WATER,)).fetchone()
        if backfill:
            _delete_meta(conn, META_SEARCH_HIGH_WATER, META_SEARCH_PROGRESS)
            conn.execute("INSERT INTO state_meta (key, value) VALUES (?, '1')",
                         (META_SEARCH_STALE_PREFIX + "cjk",))


def _dedup_schema(conn):
    conn.execute("PRAGMA writable_schema=ON")
    duplicates = conn.execute("SELECT type, name, MIN(rowid) FROM sqlite_master GROUP BY type, name"
                              " HAVING COUNT(*) > 1").fetchall()
    for kind, name, keep in duplicates:
        conn.execute("DELETE FROM sqlite_master WHERE type IS ? AND name IS ? AND rowid <> ?",
                     (kind, name, keep))
    if duplicates:
        _bump_schema_cookie(conn)
    conn.execute("PRAGMA writable_schema=OFF")


def _drop_fts(conn):
    conn.execute("PRAGMA writable_schema=ON")
    conn.execute("DELETE FROM sqlite_master"
                 " WHERE name LIKE 'messages_fts%' OR name LIKE 'hs\\_%' ESCAPE '\\'")
    _bump_schema_cookie(conn)
    conn.execute("PRAGMA writable_schema=OFF")
    conn.execute("VACUUM")
    # The markers described indexes that are gone; the next open starts afresh.
    with contextlib.suppress(sqlite3.OperationalError):
        _delete_meta(conn, META_FTS_STORAGE_VERSION, META_FTS_OPTIMIZE_AVAILABLE,
                     META_FTS_REBUILD_HIGH_WATER, META_FTS_REBUILD_PROGRESS, META_FTS_STALE,
                     META_FTS_CJK_STALE)
        conn.execute("DELETE FROM state_meta WHERE key LIKE 'hs\\_search\\_%' ESCAPE '\\'")


_STRATEGIES = (
    ("rebuild_fts", _rebuild_fts),
    ("reindex_btree", lambda conn: conn.execute("REINDEX")),
    ("dedup_schema", _dedup_schema),
    ("drop_fts_rebuild", _drop_fts),
)


def _delete_meta(conn, *keys):
    conn.execute(f"DELETE FROM state_meta WHERE key IN ({', '.join('?' for _ in keys)})", keys)


def _bump_schema_cookie(conn):
    """Other connections notice schema changes by this counter; sqlite_master edits do not
    move it."""
    try:
        current = conn.execute("PRAGMA schema_version").fetchone()[0]
        conn.execute(f"PRAGMA schema_version={(int(current) + 1) & 0x7FFFFFFF}")
    except sqlite3.DatabaseError as exc:
        logger.warning("could not bump the schema cookie: %s", exc)


@contextlib.contextmanager
def _exclusive(lock_path, wait):
    """Yields True while holding the lock on `lock_path` (the repair lock, never a store file),
    False if it stayed taken for `wait` seconds; True if it cannot be opened (the repair then runs
    unserialised)."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except OSError as exc:
        logger.warning("could not open %s (%s); repairing without it", lock_path, exc)
        yield True
        return
    deadline, held = time.monotonic() + wait, _lock(fd)
    try:
        while not held and time.monotonic() < deadline:
            time.sleep(0.1)
            held = _lock(fd)
        yield held
    finally:
        if held:
            _lock(fd, take=False)
        os.close(fd)


def _lock(fd, take=True):
    """Take without waiting (True, or False while another holds it) or release the lock on `fd`."""
    try:
        if sys.platform == "win32":
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK if take else msvcrt.LK_UNLCK, 1)
        else:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if take else fcntl.LOCK_UN)
        return True
    except OSError:
        return False
