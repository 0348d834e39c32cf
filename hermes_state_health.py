"""Per-store health for this process: has a store shown structural damage?

Owns one in-memory note per store path, 'ok' or 'corrupt'. SessionDB writes it when a statement
meets damage outside the search index; hermes-agent's readiness probe and session-list endpoints
write and read it, so every surface tells the same story about one file. Only structural damage
counts: a damaged search index leaves the transcript intact (it is rebuilt), and a malformed
schema row is repaired at open. Once noted, a store stays corrupt until the process ends (or
reset_storage_state): damage does not heal, and nothing is written to the damaged file itself.

Also tells a failing disk from a damaged store (`disk_fault`): a full disk, a filesystem gone
read-only and an I/O error come out of SQLite as "disk I/O error", "unable to open database file"
or, for a failed read, "database disk image is malformed"; the errno SQLite saw is lost, so it
asks the filesystem (statvfs; on a failed write, one page written to a probe file beside the store
and removed) and, for "malformed", runs a quick_check on a read-only connection of its own. That
check is the only time it opens a store; it never writes one.
"""

import errno
import logging
import os
import sqlite3
import threading
from pathlib import Path

from hermes_state_errors import (
    StoreDiskError, classify_persistence_error, is_disk_full_error,
    is_fts_scoped_corruption_error, is_malformed_db_error, is_malformed_schema_error,
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
    nothing) otherwise: hermes-agent 0.22's contract, for its callers."""
    if not is_structural_corruption_error(exc):
        return False
    mark_storage_corrupt(db_path, exc)
    return True


def note_store_failure(db_path, exc, *, writing=False):
    """Ours, where a store read or write failed with `exc` and is about to re-raise it: when the
    disk failed instead (disk_fault; `writing`: `exc` came from a write), raises that clearer
    StoreDiskError from `exc`, and a failed read of a whole store is never noted corrupt; else
    note_storage_error."""
    clearer = disk_fault(db_path, exc, writing=writing)
    if clearer is not None:
        raise clearer from exc
    return note_storage_error(db_path, exc)


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


# -- a failing disk, told from a damaged store -------------------------------------------------

# SQLite's words when it could not create or write a file beside the store (a -journal, a -wal):
# on a filesystem gone read-only, or full, these are what a write meets.
_WRITE_REFUSED_WORDS = ("unable to open database file", "readonly database")
_PROBE_BYTES = 4096  # one page: what any write of the store needs at least
# A read's "disk full" names the store's folder only when it is this close to full: a read fills
# no disk of the store's but with temp files, which may live elsewhere.
_NEARLY_FULL_BYTES = 64 * 1024


def free_bytes(folder):
    """Bytes an unprivileged writer may still use in `folder`'s filesystem; -1 if unknown."""
    import shutil  # here, not at import: only a failure's diagnosis asks
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return -1


def disk_full_error(folder, what):
    """The StoreDiskError for `what` (e.g. "backup /x.zip") not fitting in `folder`'s disk."""
    return StoreDiskError(f"no space left on device: {what} did not fit in {folder} "
                          f"({free_bytes(folder)} bytes free); nothing was written. Free some "
                          "space and try again")


def disk_fault(db_path, exc, *, writing):
    """A StoreDiskError saying what the disk under `db_path` did, when that explains `exc` (a
    sqlite3 error met reading, or with `writing` writing, the store): full, read-only, or an I/O
    error; None when the store itself may be at fault (or `exc` says so clearly already)."""
    if not isinstance(exc, sqlite3.Error) or isinstance(exc, StoreDiskError):
        return None
    path = Path(db_path)
    folder, text = path.parent, str(exc).lower()
    if is_disk_full_error(exc):
        if writing or 0 <= free_bytes(folder) < _NEARLY_FULL_BYTES:
            return disk_full_error(folder, f"a write of state store {path}")
        return None
    if is_malformed_db_error(exc):
        # SQLite reads a failed or short read as a damaged page; a store that checks whole was
        # not damaged (a store that does not is left to be noted corrupt, for doctor).
        if is_malformed_schema_error(exc) or not _checks_whole(path):
            return None
        return StoreDiskError(f"disk I/O error reading state store {path}: the disk under "
                              f"{folder} failed a read, which SQLite took for damage, but the "
                              "store checks whole; try again, and check the disk if it repeats")
    io_error = "disk i/o error" in text
    if not (io_error or (writing and any(w in text for w in _WRITE_REFUSED_WORDS))):
        return None
    cause = _write_errno(folder) if writing else _statvfs_errno(folder)
    if cause in (errno.ENOSPC, errno.EDQUOT):
        return disk_full_error(folder, f"a write of state store {path}")
    if cause == errno.EROFS:
        return StoreDiskError(f"read-only filesystem: {folder} can no longer be written (EROFS), "
                              f"so state store {path} took no write; reads go on. Remount it "
                              "read-write (or check the disk: a failing disk is remounted "
                              "read-only)")
    if not io_error:
        return None
    return StoreDiskError(f"disk I/O error on state store {path}: the disk under {folder} failed "
                          f"a {'write' if writing else 'read'} (SQLite: {exc}); "
                          + ("this write may not have been saved, " if writing else "")
                          + "try again, and check the disk if it repeats")


def _statvfs_errno(folder):
    """EROFS or ENOSPC when statvfs says `folder`'s filesystem is read-only or full, else 0 (and
    where there is no statvfs)."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return 0
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS
    return errno.ENOSPC if st.f_bavail == 0 else 0


def _write_errno(folder):
    """What writing one page beside the store meets (an errno; 0 when it works): a failed write
    of SQLite's leaves no errno behind, and a filesystem's own error paths (ext4's
    errors=remount-ro, a FUSE server) need not show in statvfs. The probe file is removed."""
    cause = _statvfs_errno(folder)
    if cause:
        return cause
    import tempfile  # here, not at import: only a failure's diagnosis probes
    try:
        fd, probe = tempfile.mkstemp(prefix=".hermes-disk-probe-", dir=folder)
    except OSError as exc:
        return exc.errno or 0
    try:
        os.write(fd, b"\0" * _PROBE_BYTES)
        return 0
    except OSError as exc:
        return exc.errno or 0
    finally:
        os.close(fd)
        try:
            os.unlink(probe)
        except OSError:
            pass


def _checks_whole(path):
    """True when `PRAGMA quick_check` passes on a read-only connection of its own (False for no
    local file: a replica's damage is its reader's to tell)."""
    if not path.is_file():
        return False
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return False
    try:
        return conn.execute("PRAGMA quick_check").fetchall() == [("ok",)]
    except sqlite3.Error:
        return False
    finally:
        conn.close()
