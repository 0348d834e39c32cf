"""Probing and repairing a store from outside SessionDB: the helpers hermes-agent imports from
hermes_state_repair (and from hermes_state) for `hermes doctor` and `hermes sessions repair`.

Owns the health probe, the structural-damage verdict, the proof that no live writer holds a store
and the exclusion a repair runs under, the forensic backup, the escalating schema/index repair,
and the write barriers a guest connection to the store takes, each on a path with short-lived
SQLite connections (never a SessionDB), so a store whose schema does not parse can still be
probed and repaired. Never opens the store or a sidecar with anything but SQLite while this
process may hold a connection to it: closing any descriptor of a file drops every POSIX lock the
process holds on it, SQLite's included. Never deletes a session or message row, nor a backup: a
repair rebuilds or drops search indexes and duplicate schema entries only, and runs only while no
other connection has the store open.
"""

import contextlib
import logging
import os
import re
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
    hermes_agent_config_section,
)
from hermes_state_errors import is_capability_gap, is_sqlite_lock_error
from hermes_state_dbfile import _connect_tracked_db
from hermes_state_holders import foreign_state_db_holders, open_descriptors, read_only_db_uri

logger = logging.getLogger("hermes_state")

# The search index tables hermes-agent and we may have; each is probed only if present.
_FTS_TABLES = tuple(HERMES_FTS_TABLES.values()) + tuple(SEARCH_TABLES.values())
# How long a repair waits for another process's repair (hermes-agent's lock file and timeout, so its
# processes and ours take turns).
REPAIR_LOCK_WAIT = 120.0


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
                        or not (is_capability_gap(exc) or _schema_not_built(exc)):
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
        if _schema_not_built(exc) or "no such tokenizer: cjk_unicode61" in str(exc).lower():
            return None
        return str(exc)
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    return None


def _schema_not_built(exc):
    """True for 'no such table' / 'no such column': a store whose tables are not (all) created yet,
    or one an older release wrote, not a damaged one."""
    text = str(exc).lower()
    return "no such table" in text or "no such column" in text


def _connect(db_path, timeout=5.0):
    """An autocommit read-write connection to an existing store (never creates one), with the write
    barriers taken where the schema lets them. Counted as ours until closed: while the repair
    guard holds the store through it, no raw open of this process may close a descriptor of the
    file and drop its locks."""
    conn = _connect_tracked_db(f"{Path(db_path).resolve().as_uri()}?mode=rw",
                               tracking_path=db_path, uri=True, isolation_level=None,
                               timeout=timeout)
    _write_barriers(conn)
    return conn


# -- structural damage ----------------------------------------------------------------------

# The search index objects, which a repair can rebuild: hermes-agent's FTS5 (and FTS3/4) tables with
# their shadow tables, and everything of ours named hs_*. Matched whole, so a user's lookalike
# ("archive_fts_data") is not one.
_INDEX_OBJECT_RE = re.compile(
    r"messages_fts(_trigram|_cjk)?(_data|_idx|_content|_docsize|_config|_segdir|_segments)?"
    r"|hs_\w+")
_TREE_RE = re.compile(r"\bTree (\d+)\b")
_MISSING_FROM_INDEX_RE = re.compile(r"missing from index (\S+)")


def integrity_damage_is_structural(integrity_lines, master_rows):
    """True if a damage line of PRAGMA integrity_check names an object outside the search indexes:
    a 'Tree N' whose root page (`master_rows`: (rootpage, type, name)) is a table or index of the
    data, a row missing from such an index, or the freelist. Lines naming nothing are not
    counted."""
    by_root_page = {int(page): name for page, _, name in master_rows if page}
    for line in map(str, integrity_lines):
        if line.startswith("Freelist"):
            return True
        tree = _TREE_RE.search(line)
        name = by_root_page.get(int(tree.group(1)), "") if tree else ""
        missing = _MISSING_FROM_INDEX_RE.search(line)
        for damaged in (name, missing.group(1) if missing else ""):
            if damaged and not _INDEX_OBJECT_RE.fullmatch(damaged):
                return True
    return False


def state_db_has_structural_damage(db_path):
    """True if integrity_check finds damage in the store's data (its tables and their indexes, not a
    search index, which a repair rebuilds; doctor then sends the user to `sessions recover`), or
    cannot finish its walk for damage; False for a healthy store and for one that cannot be opened
    or is locked. Read-only."""
    try:
        conn = sqlite3.connect(read_only_db_uri(db_path), uri=True, timeout=1.0)
    except sqlite3.Error:
        return False
    try:
        master_rows = conn.execute(
            "SELECT rootpage, type, name FROM sqlite_master WHERE rootpage > 0").fetchall()
        lines = [str(row[0]) for row in conn.execute("PRAGMA integrity_check")]
    except sqlite3.OperationalError:  # locked, or unreadable for want of a capability
        return False
    except sqlite3.DatabaseError:  # the check itself hit a torn page
        return True
    finally:
        conn.close()
    return integrity_damage_is_structural(
        [part for line in lines for part in line.splitlines()], master_rows)


# -- who else holds the store, and holding it alone ----------------------------------------------

def _live_writer_holds_db(db_path):
    """True unless this call can prove no one else holds `db_path`: another process has it or a
    sidecar open (or the scan could not rule that out: hermes_state_holders fails closed), or
    another connection, of this process too, stops an exclusive write lock. False for a file
    SQLite cannot read that no process holds. hermes-agent's doctor asks before a checkpoint."""
    if foreign_state_db_holders(db_path):
        return True
    try:
        probe = _connect(db_path, timeout=0.0)
    except sqlite3.Error:
        return False
    try:
        _take_alone(probe, "BEGIN IMMEDIATE")
        return False
    except sqlite3.OperationalError as exc:
        return is_sqlite_lock_error(exc)
    except sqlite3.DatabaseError:  # unreadable, and held by nobody: a repair may run
        return False
    finally:
        _close_unpinned(probe)


@contextlib.contextmanager
def _exclusive_repair_db_guard(db_path):
    """Yields (connection, None) while that one connection keeps every other connection, of any
    process, out of the store, or (None, the error) when another holds it or it cannot be opened.
    The exclusion lasts until the block ends (locking_mode=EXCLUSIVE after a rolled-back BEGIN
    EXCLUSIVE); nothing waits: a repair under a live writer is refused, never queued."""
    try:
        guard = _connect(db_path, timeout=0.0)
    except sqlite3.Error as exc:
        yield None, exc
        return
    try:
        _take_alone(guard, "BEGIN EXCLUSIVE")
    except sqlite3.Error as exc:
        _close_unpinned(guard)
        yield None, exc
        return
    try:
        yield guard, None
    finally:
        _close_unpinned(guard)


def _take_alone(conn, begin):
    for statement in ("PRAGMA locking_mode=EXCLUSIVE", begin, "ROLLBACK"):
        conn.execute(statement)


def _close_unpinned(conn):
    """Close, leaving exclusive locking first: a close-time checkpoint then runs as any other."""
    with contextlib.suppress(sqlite3.Error):
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        conn.execute("PRAGMA locking_mode=NORMAL")
    conn.close()


# -- write barriers ---------------------------------------------------------------------------

# PRAGMA synchronous by name, as config.yaml's `database.synchronous` spells it.
SYNCHRONOUS_LEVELS = {"OFF": 0, "NORMAL": 1, "FULL": 2, "EXTRA": 3}


def apply_durability_barriers(conn):
    """Give `conn` (a guest connection to the store, which keeps the journal mode its owner set) the
    write barriers of the store's own connections and config.yaml's `database.synchronous`; True
    if the barriers took (always, but on macOS), False if the schema refused them."""
    accepted = _write_barriers(conn)
    raw = hermes_agent_config_section("database").get("synchronous")
    if raw is not None:
        apply_synchronous_setting(conn, raw, db_label="state.db (guest)")
    return accepted


def _write_barriers(conn):
    """On macOS, checkpoint_fullfsync and synchronous=FULL: its fsync neither orders writes nor
    reaches the disk unless asked (a shutdown then leaves torn b-tree pages). False if refused."""
    if sys.platform != "darwin":
        return True
    try:
        conn.execute("PRAGMA checkpoint_fullfsync=1")
        conn.execute("PRAGMA synchronous=FULL")
        return True
    except sqlite3.Error:  # a schema that does not parse refuses pragmas until repaired
        return False


def synchronous_level(raw):
    """The PRAGMA synchronous level of a config value ('normal', 'FULL', 2, '3', False for off);
    None for anything else."""
    if isinstance(raw, bool):  # YAML reads a bare `off` as False; True says nothing
        return 0 if raw is False else None
    text = str(raw).strip().upper()
    if text in SYNCHRONOUS_LEVELS:
        return SYNCHRONOUS_LEVELS[text]
    return int(text) if text.isdigit() and int(text) in SYNCHRONOUS_LEVELS.values() else None


def apply_synchronous_setting(conn, raw, *, db_label):
    """PRAGMA synchronous from config value `raw`, never below FULL on macOS; a value that names no
    level is logged and changes nothing (guessing at durability is worse)."""
    level = synchronous_level(raw)
    if level is None:
        logger.warning("%s: database.synchronous=%r is not OFF, NORMAL, FULL, EXTRA or 0-3;"
                       " ignored", db_label, raw)
    elif sys.platform == "darwin" and level < SYNCHRONOUS_LEVELS["FULL"]:
        logger.warning("%s: database.synchronous=%r is below FULL, which macOS needs for ordered"
                       " writes; keeping FULL", db_label, raw)
    else:
        with contextlib.suppress(sqlite3.OperationalError):
            conn.execute(f"PRAGMA synchronous={level}")


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
    with contextlib.closing(sqlite3.connect(read_only_db_uri(db_path), uri=True,
                                            timeout=5.0)) as source, \
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
    return bool(wanted & {target for _, target in open_descriptors("self")})


# -- repair -----------------------------------------------------------------------------

def repair_state_db_schema(db_path, *, backup=True):
    """{"repaired", "strategy", "backup_path", "error"} after repairing a store whose schema does
    not parse or whose search indexes reject writes; strategy 'already_healthy' for a healthy one.

    Strategies, least destructive first, each followed by the health probe: 'rebuild_fts',
    'reindex_btree', 'dedup_schema' (the first of duplicate sqlite_master entries kept),
    'drop_fts_rebuild' (every search index object dropped, the file vacuumed; the next writable open
    rebuilds them). Refused (an error, nothing touched) while another process holds the store or
    the scan cannot rule that out. The strategies work on a copy, taken and copied back through one
    connection that keeps every other out meanwhile (`_exclusive_repair_db_guard`), so a repair
    that fails changes nothing. Unless `backup` is False, nothing is touched before
    `_backup_db_file` succeeded; sessions and messages never are. Serialised across processes by
    hermes-agent's `<name>.repair.lock`; not by our `<name>.lock`, as closing a second descriptor
    of it could drop the lock a SessionDB of this process holds where flock is emulated."""
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
        if _live_writer_holds_db(db_path):
            return _skipped(report, "a live writer still holds state.db; skipped schema surgery to"
                            " avoid tearing b-tree pages under a concurrent writer. Stop the"
                            " gateway (hermes gateway stop) and retry.")
        if _db_opens_cleanly(db_path) is None:
            return dict(report, repaired=True, strategy="already_healthy")
        if backup:
            copy, why = _backup_db_file(db_path)
            report["backup_path"] = None if copy is None else str(copy)
            if copy is None:
                return _skipped(report, "pre-repair backup refused; aborting schema repair to"
                                f" avoid mutating the only copy of the damaged DB: {why}")
        with _exclusive_repair_db_guard(db_path) as (guard, why):
            if guard is None:
                return _skipped(report, "could not acquire exclusive state.db repair ownership;"
                                " skipped schema surgery to avoid overwriting a concurrent writer."
                                f" Stop the gateway and retry: {why}")
            try:  # a new owner-only file (SQLite gives its sidecars the same mode), named apart
                scratch = claim_file_beside(db_path, "repair-scratch")
            except OSError as exc:
                return _skipped(report, f"could not copy {db_path} for repair: {exc}")
            try:
                return _repair_on_scratch(db_path, guard, scratch, report)
            finally:
                _remove_with_sidecars(scratch)  # never mistaken for a store later


def _repair_on_scratch(db_path, guard, scratch, report):
    """The strategies on `scratch`, a copy of the store taken through `guard`; the first one the
    probe finds healthy is copied back through `guard` in one transaction. So a failed strategy
    changes nothing of the store: a VACUUM of a schema that does not parse drops the tables it
    cannot see."""
    try:
        with contextlib.closing(sqlite3.connect(scratch, isolation_level=None)) as copy:
            guard.backup(copy)
    except (OSError, sqlite3.Error) as exc:
        return _skipped(report, f"could not copy {db_path} for repair: {exc}")
    for strategy, surgery in _STRATEGIES:
        try:
            with contextlib.closing(_connect(scratch)) as conn:
                surgery(conn)
            report["error"] = _db_opens_cleanly(scratch)
        except sqlite3.DatabaseError as exc:
            report["error"] = str(exc)
        logger.warning("state.db repair %s on %s: %s",
                       strategy, db_path, report["error"] or "healthy")
        if report["error"] is None:
            try:
                with contextlib.closing(_connect(scratch)) as repaired:
                    repaired.backup(guard)
            except sqlite3.Error as exc:
                return _skipped(report, f"the repaired copy could not replace {db_path}: {exc}")
            return dict(report, repaired=True, strategy=strategy)
    logger.error("state.db repair could not recover %s (nothing of it was changed; backup: %s)",
                 db_path, report["backup_path"])
    return report


def _remove_with_sidecars(path):
    for suffix in ("",) + SIDECAR_SUFFIXES:
        try:
            os.unlink(f"{path}{suffix}")
        except FileNotFoundError:
            pass
        except OSError as exc:  # the report stands; the copy is ours to clean up by hand
            logger.warning("could not remove the repair copy %s%s: %s", path, suffix, exc)


def _skipped(report, error):
    """`report` with `error`, logged: a repair that did not start or could not finish."""
    logger.error("state.db repair stopped: %s", error)
    return dict(report, error=error)


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
    def edit():
        duplicates = conn.execute("SELECT type, name, MIN(rowid) FROM sqlite_master"
                                  " GROUP BY type, name HAVING COUNT(*) > 1").fetchall()
        for kind, name, keep in duplicates:
            conn.execute("DELETE FROM sqlite_master WHERE type IS ? AND name IS ? AND rowid <> ?",
                         (kind, name, keep))
        return bool(duplicates)
    _edit_schema(conn, edit)


def _drop_fts(conn):
    _edit_schema(conn, lambda: conn.execute(
        "DELETE FROM sqlite_master"
        " WHERE name LIKE 'messages_fts%' OR name LIKE 'hs\\_%' ESCAPE '\\'") or True)
    conn.execute("VACUUM")
    # The markers described indexes that are gone; the next open starts afresh.
    with contextlib.suppress(sqlite3.OperationalError):
        _delete_meta(conn, META_FTS_STORAGE_VERSION, META_FTS_OPTIMIZE_AVAILABLE,
                     META_FTS_REBUILD_HIGH_WATER, META_FTS_REBUILD_PROGRESS, META_FTS_STALE,
                     META_FTS_CJK_STALE)
        conn.execute("DELETE FROM state_meta WHERE key LIKE 'hs\\_search\\_%' ESCAPE '\\'")


def _edit_schema(conn, edit):
    """`edit()` on sqlite_master with writable_schema on, and off again whatever happens: left on,
    it would hide a schema that still does not parse from the health probe. The schema cookie moves
    if `edit` returns True."""
    conn.execute("PRAGMA writable_schema=ON")
    try:
        if edit():
            _bump_schema_cookie(conn)
    finally:
        conn.execute("PRAGMA writable_schema=OFF")


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
