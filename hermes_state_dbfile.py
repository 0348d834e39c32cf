"""File-level facts of a store for `hermes doctor` and `hermes backup`: its read-only stats, how
many processes have it open, and who still holds a deleted generation of its -wal or -shm; and
`_connect_tracked_db`, the connection hermes-agent opens its own readers of a store with.

Reads a store through read-only SQLite connections counted as ours in hermes_state_lockguard's
registry, and /proc; never writes, never opens a store file but through SQLite, never composes
SessionDB, so it works on a store another program is writing or whose schema SessionDB would
repair first.
"""

import contextlib
import json
import logging
import os
import sqlite3
import sys
from pathlib import Path

from hermes_state_common import (
    HERMES_FTS_TABLES, META_FTS_REBUILD_HIGH_WATER, META_FTS_REBUILD_PROGRESS,
    META_FTS_STORAGE_VERSION,
)
from hermes_state_holders import (
    _gone, canonical_sqlite_path, open_descriptors, read_only_db_uri,
)
from hermes_state_lockguard import _hold, _release

logger = logging.getLogger("hermes_state")

# The folder name hermes-agent 0.22 gives a captured retired WAL generation
# (`state.db.retired-wal-<time>-<pid>/`); `hermes backup` leaves such folders out whole.
RETIRED_GENERATION_DIR_SUFFIX = ".retired-wal-"
# hermes-agent 0.22's state_meta key for a deferred search-index rebuild (a JSON object saying
# which processes held the store); its doctor shows it. We never write it; a store of 0.22's may
# have it.
_FTS_REBUILD_DEFERRAL = "fts_rebuild_deferral"
# The state_meta markers of a search-index backfill: ours when our index tables are there, else
# hermes-agent's.
class _TrackedConnection(sqlite3.Connection):
    """A connection counted in hermes_state_lockguard's registry until its first close()."""

    _tracked_key = None
    _tracked = False

    def close(self):
        try:
            super().close()
        finally:
            if self._tracked:
                self._tracked = False
                _release(self._tracked_key)


def _connect_tracked_db(path, tracking_path=None, **kwargs):
    """sqlite3.connect(path, **kwargs), counted as one of this process's connections to the store
    file (`tracking_path`, for when `path` is a `file:` URI) until closed, so that no raw open of
    the file in this process runs meanwhile and cancels its locks. A connection left unclosed keeps
    raw opens refused, the safe side. A `factory` given must subclass sqlite3.Connection."""
    factory = kwargs.pop("factory", sqlite3.Connection)
    tracked = _TrackedConnection if factory is sqlite3.Connection else type(
        "Tracked" + factory.__name__, (_TrackedConnection, factory), {})
    key = _hold(path if tracking_path is None else tracking_path)
    try:
        conn = sqlite3.connect(str(path), factory=tracked, **kwargs)
    except BaseException:
        _release(key)
        raise
    conn._tracked_key, conn._tracked = key, True
    return conn


def collect_state_db_stats(db_path):
    """A read-only snapshot for doctor: page_count, page_size, freelist_count, logical_size_bytes,
    wal_size_bytes (0 without a -wal), journal_mode, messages, sessions, fts_tables (hermes-agent's
    index names -> present), fts_storage_version, fts_rebuild_pending / _high_water / _progress and
    fts_rebuild_deferral; each None when it cannot be read. Never raises, writes or creates."""
    stats = dict.fromkeys((
        "page_count", "page_size", "freelist_count", "logical_size_bytes", "wal_size_bytes",
        "journal_mode", "messages", "sessions", "fts_tables", "fts_storage_version",
        "fts_rebuild_pending", "fts_rebuild_high_water", "fts_rebuild_progress",
        "fts_rebuild_deferral",
    ))
    wal = Path(str(db_path) + "-wal")
    with contextlib.suppress(OSError):
        stats["wal_size_bytes"] = wal.stat().st_size if wal.exists() else 0
    try:
        # A short timeout keeps doctor quick while a writer holds the store.
        conn = _connect_tracked_db(read_only_db_uri(db_path), tracking_path=db_path, uri=True,
                                   timeout=2.0)
    except Exception as exc:
        logger.debug("collect_state_db_stats: cannot open %s read-only: %s", db_path, exc)
        return stats

    def value(sql, params=(), cast=int):
        with contextlib.suppress(Exception):  # None, as for a missing row
            row = conn.execute(sql, params).fetchone()
            return None if row is None or row[0] is None else cast(row[0])

    try:
        for pragma in ("page_count", "page_size", "freelist_count"):
            stats[pragma] = value(f"PRAGMA {pragma}")
        if stats["page_count"] is not None and stats["page_size"] is not None:
            stats["logical_size_bytes"] = stats["page_count"] * stats["page_size"]
        stats["journal_mode"] = value("PRAGMA journal_mode", cast=str)
        for table in ("messages", "sessions"):
            stats[table] = value(f"SELECT COUNT(*) FROM {table}")
        # Presence read off sqlite_master: a damaged index must not fail the snapshot. (Our word
        # and trigram indexes are hermes-agent's layout 3; its CJK index needs its tokenizer.)
        with contextlib.suppress(Exception):
            tables = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            present = {row[0] for row in tables}
            stats["fts_tables"] = {table: table in present for table in HERMES_FTS_TABLES.values()}
        meta = "SELECT value FROM state_meta WHERE key = ?"
        stats["fts_storage_version"] = value(meta, (META_FTS_STORAGE_VERSION,))
        high_water = stats["fts_rebuild_high_water"] = value(meta, (META_FTS_REBUILD_HIGH_WATER,))
        progress = stats["fts_rebuild_progress"] = value(meta, (META_FTS_REBUILD_PROGRESS,))
        stats["fts_rebuild_pending"] = high_water is not None and (progress or 0) < high_water
        deferral = value(meta, (_FTS_REBUILD_DEFERRAL,), cast=str)
        with contextlib.suppress(ValueError, TypeError):
            parsed = json.loads(deferral)
            stats["fts_rebuild_deferral"] = parsed if isinstance(parsed, dict) else None
    finally:
        conn.close()
    return stats


def count_db_holders(db_path):
    """How many processes (this one included) have `db_path` itself open, from /proc/*/fd (Linux;
    a lower bound, as other users' processes are invisible without root); None elsewhere or on
    error."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        target = os.path.realpath(db_path)
        return sum(1 for pid in os.listdir("/proc")
                   if pid.isdigit() and any(link == target for _, link in _descriptors(pid)))
    except Exception:
        return None


def _descriptors(pid):
    """open_descriptors(pid), or [] for a process that cannot be inspected or has ended."""
    try:
        return open_descriptors(pid)
    except OSError:
        return []


def iter_deleted_sqlite_sidecar_holders(db_path):
    """[(pid, fd target)] for every process, this one included, that holds a -wal or -shm of
    `db_path` which is no longer the file at that path (deleted or replaced: a retired WAL
    generation, whose frames no other connection sees). Linux only; [] elsewhere and when the
    scan fails."""
    if not sys.platform.startswith("linux"):
        return []
    watched = _watched_sidecars(db_path)
    holders = []
    try:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            for link, target in _descriptors(pid):
                path = None if isinstance(target, OSError) else watched.get(
                    canonical_sqlite_path(target))
                if path is not None and target.endswith(" (deleted)") and _retired(link, path):
                    holders.append((int(pid), target))
    except Exception as exc:
        logger.debug("retired WAL generation scan failed for %s: %s", db_path, exc)
    return holders


def _watched_sidecars(db_path):
    """{canonical sidecar path: the path to stat}: the path as given and resolved, as /proc shows
    the kernel's resolved path and SQLite names sidecars after either spelling."""
    given = os.path.abspath(os.fspath(db_path))
    spellings = (given, os.path.join(os.path.realpath(os.path.dirname(given)),
                                     os.path.basename(given)), os.path.realpath(given))
    return {canonical_sqlite_path(base + suffix): base + suffix
            for base in reversed(spellings) for suffix in ("-wal", "-shm")}


def _retired(link, path):
    """True if descriptor `link` is not the file now at `path`. Compared by (st_dev, st_ino), not by
    the link count: a retired file may keep another hard link, and some filesystems mark a live
    file deleted."""
    try:
        held = os.stat(link)
    except OSError as exc:
        return not _gone(exc)  # closed meanwhile: it holds nothing any more
    try:
        current = os.stat(path)
    except OSError:
        return True
    return (held.st_dev, held.st_ino) != (current.st_dev, current.st_ino)
