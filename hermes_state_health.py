"""Per-store health for this process: has a store shown structural damage?

Owns one in-memory note per store path, 'ok' or 'corrupt'. SessionDB writes it when a statement
meets damage outside the search index; hermes-agent's readiness probe and session-list endpoints
write and read it, so every surface tells the same story about one file. Only structural damage
counts: a damaged search index leaves the transcript intact (it is rebuilt), and a malformed
schema row is repaired at open. Once noted, a store stays corrupt until the process ends (or
reset_storage_state): damage does not heal, and nothing is written to the damaged file itself.
Never opens a store.
"""

import logging
import sqlite3
import threading
from pathlib import Path

from hermes_state_errors import (
    classify_persistence_error, is_fts_scoped_corruption_error, is_malformed_schema_error,
)

logger = logging.getLogger("hermes_state")

STORAGE_OK = "ok"
STORAGE_CORRUPT = "corrupt"

_corrupt = {}  # resolved store path -> the first error text seen (for logs, never shown to users)
_corrupt_lock = threading.Lock()


def _key(db_path):
    return str(Path(db_path).expanduser().resolve(strict=False))


def is_structural_corruption_error(exc):
    """True for SQLite damage outside the search index (a corrupt page, not a database), which no
    write path can repair; False for a damaged search index, a malformed schema row and anything
    else."""
    return (isinstance(exc, sqlite3.DatabaseError)
            and not is_fts_scoped_corruption_error(exc)
            and not is_malformed_schema_error(exc)
            and classify_persistence_error(exc) == "corrupt")


def mark_storage_corrupt(db_path, reason):
    """Note `db_path` as corrupt for the rest of this process; the first reason is kept (and
    logged once with what to do)."""
    key = _key(db_path)
    with _corrupt_lock:
        if key in _corrupt:
            return
        _corrupt[key] = str(reason)
    logger.error("state store %s is damaged (%s): stop Hermes, then run "
                 "`hermes sessions recover --source %s --inspect-only` or restore a backup",
                 db_path, reason, db_path)


def note_storage_error(db_path, exc):
    """Note `db_path` as corrupt when `exc` is structural damage; True when it was, False (noting
    nothing) otherwise."""
    if not is_structural_corruption_error(exc):
        return False
    mark_storage_corrupt(db_path, exc)
    return True


def storage_state(db_path):
    """STORAGE_CORRUPT once this process has noted damage on `db_path`, else STORAGE_OK."""
    with _corrupt_lock:
        return STORAGE_CORRUPT if _key(db_path) in _corrupt else STORAGE_OK


def storage_corrupt_reason(db_path):
    """The first error text noted for `db_path`; None while it is ok."""
    with _corrupt_lock:
        return _corrupt.get(_key(db_path))


def reset_storage_state(db_path=None):
    """Forget the note on `db_path` (on every store when None): for tests and a recovery checked in
    this process. Nothing else clears it."""
    with _corrupt_lock:
        if db_path is None:
            _corrupt.clear()
        else:
            _corrupt.pop(_key(db_path), None)
