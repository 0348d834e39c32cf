"""What a user reads when session storage fails: one table of causes, one sentence each.

Owns the plain-language text for a failed open or write of the store (the CLI banner, the gateway's
home-channel warning, the TUI and desktop errors all read it), the stable machine-readable `code`
a GUI keys a "Run doctor" button on, and which hermes-agent release hosts us, since the two
releases word the open failure differently (hermes_state.format_session_db_unavailable). The cause
comes from hermes_state_errors.classify_persistence_error; this module never opens a store.
"""

from hermes_constants import get_default_hermes_root, get_hermes_home
from hermes_state_common import _WAL_INCOMPAT_MARKERS, host_release, record_class
from hermes_state_errors import (
    STORAGE_RECOVERY_DOCS_URL, classify_persistence_error, is_disk_full_error,
)

# hermes-agent's shape: callers read .cause (classify_persistence_error's answer), .code (stable,
# for GUIs), .gloss (what happened: a clause, lower case) and .action (what to do: sentences).
_STORAGE_FAILURE = ("StorageFailure", (("cause", str), ("code", str), ("gloss", str),
                                       ("action", str)))


def __getattr__(name):  # (PEP 562: StorageFailure, a frozen dataclass, made at its first use)
    if name == _STORAGE_FAILURE[0]:
        return record_class(__name__, *_STORAGE_FAILURE, frozen=True)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_DOCTOR_FIX = "Run `hermes {p}doctor --fix` to diagnose and repair."
# cause -> (code, gloss, action); "{p}" becomes the profile's `-p <name> `. Codes and words are
# hermes-agent 0.22's: GUIs key on the codes, and what a user reads is output `make compat`
# compares. A full disk is "disk" split out at lookup.
_FAILURES = {
    "locked": ("storage_locked", "the session database is locked by another Hermes process",
               "Wait a moment and try again; if it persists, stop the other Hermes process "
               "(`hermes {p}gateway stop`)."),
    "disk_full": ("disk_full", "the disk is full", "Free some disk space, then try again."),
    "disk": ("storage_readonly", "the session database file is read-only or not writable",
             _DOCTOR_FIX),
    "corrupt": ("storage_corrupt", "the session database file is damaged",
                _DOCTOR_FIX + " Recovery: "
                "`hermes {p}sessions recover --source <state.db> --inspect-only`."),
    "session_row_missing": (
        "storage_session_missing",
        "this session's database row was deleted while the chat was still open and could not "
        "be recreated",
        "Try again; if it persists, run `hermes {p}doctor`."),
    "fts_index": ("storage_index_corrupt",
                  "the session search index is damaged (the messages themselves are intact)",
                  "Run `hermes {p}doctor --fix` (or `hermes {p}sessions repair`) to rebuild it."),
    "replaced": ("storage_replaced",
                 "the session database file was replaced while Hermes was running",
                 "Stop Hermes (`hermes {p}gateway stop`), run `hermes {p}doctor`, then start it "
                 "again."),
    # GUIs know this one as storage_replaced too; the remedy differs: every writer must stop.
    "deleted_wal": ("storage_replaced",
                    "another Hermes process still holds an old copy of the session database's "
                    "write-ahead log, so Hermes stopped writing to keep the file safe",
                    "Nothing is lost. Quit every Hermes process on this profile (Desktop app, "
                    "`hermes {p}gateway stop`, dashboard, cron), run `hermes {p}doctor` \u2014 it "
                    "names any process still holding the log \u2014 then start Hermes again. Do "
                    "not run `doctor --fix` or delete any state.db files while they run. Guide: "
                    + STORAGE_RECOVERY_DOCS_URL),
    "compression": ("storage_busy", "another process is compressing this session",
                    "Send your message again once compression finishes."),
    "compression_closed": ("storage_session_rotated",
                           "this session was rotated by context compression",
                           "Refresh the client (or start a new turn) and send your message "
                           "again."),
    "turn_lease": ("storage_busy", "another Hermes process took over this session",
                   "Wait for it to finish, then send your message again."),
    "unknown": ("storage_unavailable", "the session database could not be opened", _DOCTOR_FIX),
}


def profile_cli_arg():
    """'-p <name> ' when the home in use is a named profile's (<folder>/profiles/<name>), so that a
    command a user copies acts on the store that failed (a bare `hermes` follows the sticky active
    profile); '' for the default home and any other folder."""
    home = get_hermes_home()
    try:
        is_root = home.resolve() == get_default_hermes_root().resolve()
    except OSError:
        return ""
    named = home.parent.name == "profiles" and not home.name.startswith(".")
    return f"-p {home.name} " if named and not is_root and home.name != "default" else ""


def describe_storage_failure(exc_or_str):
    """The StorageFailure for an exception or its text (None: 'unknown'); never raises."""
    cause = classify_persistence_error(exc_or_str)
    key = "disk_full" if cause == "disk" and is_disk_full_error(exc_or_str) else cause
    code, gloss, action = _FAILURES.get(key, _FAILURES["unknown"])
    made = record_class(__name__, *_STORAGE_FAILURE, frozen=True)
    return made(cause, code, gloss, action.replace("{p}", profile_cli_arg()))


def storage_failure_details(exc_or_str, limit=200):
    """The raw error text on one line, cut to `limit` characters (ending '...'), for a trailing
    'Details:' line; '' for None."""
    text = " ".join(str(exc_or_str or "").split())
    return text if len(text) <= limit else text[:max(limit - 3, 0)].rstrip() + "..."


def host_speaks_022():
    """True inside hermes-agent 0.21 or later, whose texts for a failed open are the 0.22 line's
    sentence; False inside 0.20 and earlier and outside hermes-agent (0.20's sentence)."""
    release = host_release()
    return release is not None and release >= (0, 21)


# -- the sentence for a failed open ----------------------------------------------------------------
# hermes-agent 0.20 says '<prefix>: <raw cause>.'; the 0.22 line says what happened, that sessions
# are not saved, and what to do. Which one speaks: host_speaks_022(), or a caller passing
# `details`, a keyword only the 0.22 line's callers know.
SESSION_DB_UNAVAILABLE = "Session database not available"  # 0.20's default prefix, and ours
SESSION_HISTORY_UNAVAILABLE = "Hermes can't open its session history right now"  # the 0.22 line's
WAL_INCOMPAT_HINT = (" (state.db may be on NFS/SMB/FUSE/ZFS \u2014"
                     " see https://www.sqlite.org/wal.html)")
_NOT_SAVED = "Sessions will not be saved until this is fixed."
# A network filesystem cannot carry SQLite's write-ahead log, and no doctor repairs a mount.
_NETWORK_DRIVE_HINT = " If the database lives on a network drive, move it to a local disk."
_NETWORK_DRIVE_GLOSS = ("the session database could not be opened; it may be on a network or "
                        "unsupported drive")
_NETWORK_DRIVE_ACTION = ("Move it to a local disk (`hermes {p}doctor` shows where it is), then "
                         "start Hermes again.")


def open_failure_sentence(cause, prefix=SESSION_DB_UNAVAILABLE, *, details=False):
    """What a user reads when the store did not open, `cause` being why ('<Class>: <message>';
    None when unknown).

    0.20's form: '<prefix>: <cause>.' ('<prefix>.' without a cause), with a hint when the cause is
    a filesystem without WAL. The 0.22 line's: '<prefix>: <what happened>. <not saved> <what to
    do>', its own default prefix in place of 0.20's, and with `details` a second line
    'Details: <cause, at most 200 characters>'."""
    on_network_drive = bool(cause) and any(m in cause.lower() for m in _WAL_INCOMPAT_MARKERS)
    if not (details or host_speaks_022()):
        if not cause:
            return f"{prefix}."
        return f"{prefix}: {cause}{WAL_INCOMPAT_HINT if on_network_drive else ''}."
    if prefix is SESSION_DB_UNAVAILABLE:  # the default object, not a caller's text
        prefix = SESSION_HISTORY_UNAVAILABLE
    profile_arg = profile_cli_arg()
    if not cause:
        return (f"{prefix}. {_NOT_SAVED} Run `hermes {profile_arg}doctor` to check the storage "
                "location.")
    failure = describe_storage_failure(cause)
    gloss, action, hint = failure.gloss, failure.action, ""
    if on_network_drive and failure.cause == "unknown":
        gloss, action = _NETWORK_DRIVE_GLOSS, _NETWORK_DRIVE_ACTION.replace("{p}", profile_arg)
    elif on_network_drive:
        hint = _NETWORK_DRIVE_HINT
    text = f"{prefix}: {gloss}. {_NOT_SAVED} {action}{hint}"
    return f"{text}\nDetails: {storage_failure_details(cause)}" if details else text
