"""The store's exception classes and the predicates that sort a failure into a cause.

Owns: every exception class the state layer raises (each defined once, here; the modules
hermes-agent imports them from re-export them), the text predicates callers use to tell a busy
store from a full disk from a damaged file (`is_sqlite_lock_error`, `is_disk_full_error`,
`is_malformed_db_error`, ...), and `classify_persistence_error` with its causes. Must not touch: a
connection, a file, a SessionDB; it imports only the standard library, so every other module may
import it.

The predicates take an exception or its text: hermes-agent passes strings that crossed an RPC
boundary, so a known SQLite result code decides first and the words of the text only without one.
"""

import errno
import re
import sqlite3

# -- Predicates ------------------------------------------------------------------------------------

# SQLite's words for a schema it cannot parse, and for a damaged page anywhere in the file.
_MALFORMED_SCHEMA_MARKERS = ("malformed database schema",)
MALFORMED_DB_MARKERS = (*_MALFORMED_SCHEMA_MARKERS, "database disk image is malformed")
# Plain substrings, so an OSError, SQLITE_FULL and a text passed through RPC all match.
DISK_FULL_MARKERS = ("no space left on device", "not enough space", "database or disk is full",
                     "disk full", "full disk", "enospc")
_DISK_IO_ERROR_MARKER = "disk i/o error"
# Busy, not damaged: worth a retry (HTTP callers answer 503 for these, 500 for the rest). Damage is
# left out on purpose: a malformed store must surface, not be retried until a timeout.
_TRANSIENT_MARKERS = (_DISK_IO_ERROR_MARKER, "database is locked", "database table is locked",
                      "busy")
# SQLITE_BUSY and SQLITE_LOCKED; sqlite3 names the codes only from Python 3.11 on.
_LOCK_CODES = (5, 6)
# Words of a damaged file. "database disk image is malformed" contains "disk", so the cause
# classifier tests these before the disk bucket.
_CORRUPTION_MARKERS = ("malformed", "file is not a database", "not a database",
                       "database corruption")
# SQLite's code for damage inside a virtual table (sqlite3 names it from Python 3.11 on).
SQLITE_CORRUPT_VTAB = getattr(sqlite3, "SQLITE_CORRUPT_VTAB", 267)
_FOREIGN_KEY_CODE = 787  # SQLITE_CONSTRAINT_FOREIGNKEY
_FTS_OBJECT = re.compile(r"\bmessages_fts\w*")


def _primary_code(exc_or_str):
    """SQLite's primary result code of an exception (the low byte of an extended one), else None."""
    code = getattr(exc_or_str, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def is_sqlite_lock_error(exc_or_str):
    """True for SQLITE_BUSY or SQLITE_LOCKED: wait and retry, never treat it as damage."""
    code = _primary_code(exc_or_str)
    if code is not None:
        return code in _LOCK_CODES
    text = str(exc_or_str).lower()
    return "locked" in text or "busy" in text


def is_transient_sqlite_error(exc):
    """True for an OperationalError that means "busy right now" (locks, a passing I/O error)."""
    return isinstance(exc, sqlite3.OperationalError) and (
        is_sqlite_lock_error(exc) or any(m in str(exc).lower() for m in _TRANSIENT_MARKERS))


def is_malformed_db_error(exc):
    """True for SQLite's malformed-schema or malformed-image error; False for anything else."""
    return isinstance(exc, sqlite3.DatabaseError) and any(
        m in str(exc).lower() for m in MALFORMED_DB_MARKERS)


def is_malformed_schema_error(exc):
    """True only for a schema SQLite cannot parse. A damaged page ("disk image is malformed") may
    be anywhere in the file, so a repair that rebuilds the schema must not act on that."""
    return isinstance(exc, sqlite3.DatabaseError) and any(
        m in str(exc).lower() for m in _MALFORMED_SCHEMA_MARKERS)


def is_disk_full_error(exc):
    """True when `exc` (an exception or its text) says the disk is full; False for None."""
    if exc is None:
        return False
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    return any(marker in str(exc).lower() for marker in DISK_FULL_MARKERS)


def is_fts_scoped_corruption_error(exc_or_str):
    """True when SQLite places the damage in the search index, not the transcript's tables.

    A result code decides when there is one: only SQLITE_CORRUPT_VTAB is the index's; plain
    SQLITE_CORRUPT names no object, so it is not. Without a code the text must name a
    `messages_fts*` object and be an FTS5 corruption report or carry a corruption marker."""
    if exc_or_str is None:
        return False
    code = getattr(exc_or_str, "sqlite_errorcode", None)
    if code is not None:
        return code == SQLITE_CORRUPT_VTAB
    text = str(exc_or_str).lower()
    if not _FTS_OBJECT.search(text):
        return False
    return (text.startswith("fts5:") and "corrupt" in text) or any(
        m in text for m in _CORRUPTION_MARKERS)


def is_capability_gap(exc):
    """True for an error that means this runtime lacks FTS5 or a tokenizer, not that the store is
    damaged."""
    text = str(exc).lower()
    return (("no such module" in text and "fts5" in text)
            or "no such tokenizer: trigram" in text
            or "no such tokenizer: cjk_unicode61" in text)


# -- Exception classes -----------------------------------------------------------------------------
# Several subclass two builtin or sqlite3 classes: hermes-agent raises the sqlite3 one for the same
# bad value, so a caller that catches either still catches ours, and ours says which field was bad.

class UsageValueError(ValueError, sqlite3.IntegrityError, sqlite3.ProgrammingError):
    """A token, cost or route value that cannot be stored. Also the sqlite3 classes hermes-agent
    raises for such values (at insert or bind time), so callers that catch those still catch it."""


class SessionRowError(ValueError, sqlite3.IntegrityError):
    """A session row the store refuses: no usable id or source, or a parent that does not exist.
    hermes-agent's store fails on these with IntegrityError."""


class SessionInputTypeError(ValueError, TypeError, AttributeError):
    """A value of the wrong type for a session or compaction write (hermes-agent fails on these with
    TypeError or AttributeError, so callers may catch either)."""


class UnknownSessionError(ValueError, sqlite3.IntegrityError):
    """A message aimed at a session that does not exist;
    hermes-agent's foreign key raises IntegrityError."""

    def __init__(self, session_id):
        self.session_id = session_id
        super().__init__(f"unknown session_id {session_id!r}; nothing was written")


# Transcript sizes past which resume and in-memory export refuse; 0 in the caller's config turns a
# guard off.
MAX_SAFE_RESUME_MESSAGES = 20_000
MAX_SAFE_EXPORT_MESSAGES = 20_000


class QuerySyntaxError(ValueError):
    """A search query the boolean grammar cannot read as written; its one line names the query."""


class SessionResumeTooLargeError(ValueError):
    """Resuming would load more active messages than MAX_SAFE_RESUME_MESSAGES."""

    def __init__(self, message_count, limit=MAX_SAFE_RESUME_MESSAGES, scope="across its lineage"):
        self.message_count, self.limit = message_count, limit
        super().__init__(f"session has at least {message_count} active messages {scope}; "
                         f"safe resume limit is {limit}. Export the session instead, or set "
                         "sessions.max_resume_messages: 0 in config.yaml to disable the guard.")


class SessionExportTooLargeError(ValueError):
    """An in-memory export would hold more active messages than MAX_SAFE_EXPORT_MESSAGES."""

    def __init__(self, session_id, message_count, limit=MAX_SAFE_EXPORT_MESSAGES):
        self.session_id, self.message_count, self.limit = session_id, message_count, limit
        super().__init__(f"session '{session_id}' has at least {message_count} active messages; "
                         f"safe in-memory export limit is {limit}")


class CompressionSessionClosedError(RuntimeError):
    """A write aimed at a session that compression has already ended."""

    def __init__(self, session_id):
        self.session_id = session_id
        super().__init__(f"Session {session_id!r} is closed by compression; "
                         "adopt its live continuation before appending messages")


class CompressionSessionBusyError(RuntimeError):
    """Someone other than the compression-lock holder tried to write the session."""


class SessionCompressionInProgressError(CompressionSessionBusyError):
    """A live compression lock blocked the write; it is transient, so waiting helps."""


class SessionTurnLeaseLostError(RuntimeError):
    """A write named a turn-lease holder that no longer holds the lease; never retried."""


class SessionActiveWriteGuardError(RuntimeError):
    """A live turn lease or compression lock refused a delete of the session."""


class StateDbReplacedError(RuntimeError):
    """The store's path now names another file than the one this SessionDB opened (copied over,
    moved, restored by hand); writing on would split the history between two files."""


class DeletedWalGenerationError(StateDbReplacedError):
    """Another process still holds a deleted `-wal` or `-shm` of the store; a write through this
    path would start a second log beside it. A StateDbReplacedError, so callers that divert
    transcripts for a replaced store do the same here."""


class StateDbCorruptError(sqlite3.DatabaseError):
    """A live handle met damage outside the search index; it refuses further writes for its life.
    A sqlite3.DatabaseError, so every caller's fallback for a broken store still applies."""


class StoreLockedError(sqlite3.OperationalError):
    """The store stayed locked by another writer for the whole write budget."""


class StoreDiskError(sqlite3.OperationalError):
    """The disk under the store failed, not the store: it is full, read-only, or returned an I/O
    error. The text says which and names the folder (hermes_state_health.disk_fault); an
    OperationalError, as SQLite's own words for these are."""


class WalUnsupportedError(sqlite3.OperationalError):
    """WAL was required (`require_wal=True`) and the filesystem refused it."""


class InstallRefused(RuntimeError):
    """`install` or `uninstall` stopped with the host as it was; the message is one line."""


# -- What a failed write means to the user ---------------------------------------------------------

# Where hermes-agent's user-facing storage errors send a reader.
STORAGE_RECOVERY_DOCS_URL = (
    "https://hermes-agent.nousresearch.com/docs/user-guide/session-storage-recovery")

# Every answer classify_persistence_error gives; callers iterate it.
PERSISTENCE_ERROR_CAUSES = ("locked", "compression", "compression_closed", "turn_lease", "corrupt",
                            "fts_index", "replaced", "deleted_wal", "disk", "session_row_missing",
                            "unknown")

# Checked in order: a deleted WAL generation is a kind of replaced store, so it comes
# first.
_CAUSE_OF_CLASS = ((SessionTurnLeaseLostError, "turn_lease"),
                   (CompressionSessionClosedError, "compression_closed"),
                   (CompressionSessionBusyError, "compression"),
                   (DeletedWalGenerationError, "deleted_wal"),
                   (StateDbReplacedError, "replaced"),
                   (StateDbCorruptError, "corrupt"))
# For texts that lost their class crossing an RPC boundary. Damage before locks and disk: "disk
# image is malformed" holds "disk".
_CAUSE_OF_WORDS = ((("turn lease",), "turn_lease"),
                   (("closed by compression",), "compression_closed"),
                   (("being compressed", "compression lease"), "compression"),
                   (("deleted state.db-wal", "deleted state.db-shm"), "deleted_wal"),
                   (("was replaced underneath",), "replaced"),
                   (_CORRUPTION_MARKERS, "corrupt"),
                   (("locked", "busy"), "locked"),
                   (("foreign key constraint failed",), "session_row_missing"))


def classify_persistence_error(exc_or_str):
    """The cause of a failed session write, one of PERSISTENCE_ERROR_CAUSES; 'unknown' for None.

    The exception's class decides first, then where SQLite places damage (the search index is not
    the transcript), then its result code, then words of the text; disk trouble (full, read-only,
    permissions) last."""
    if exc_or_str is None:
        return "unknown"
    for cls, cause in _CAUSE_OF_CLASS:
        if isinstance(exc_or_str, cls):
            return cause
    if is_fts_scoped_corruption_error(exc_or_str):
        return "fts_index"
    if _primary_code(exc_or_str) in _LOCK_CODES:
        return "locked"
    if getattr(exc_or_str, "sqlite_errorcode", None) == _FOREIGN_KEY_CODE:
        return "session_row_missing"
    text = str(exc_or_str).lower()
    for words, cause in _CAUSE_OF_WORDS:
        if any(word in text for word in words):
            return cause
    if is_disk_full_error(exc_or_str) or any(w in text for w in ("disk", "readonly", "read-only")):
        return "disk"
    return "unknown"
