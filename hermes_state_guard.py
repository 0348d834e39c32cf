"""Why the last SessionDB() of this process failed to open.

Owns one per-process record: the cause of the most recent failed open, as '<Class>: <message>',
which hermes-agent's slash commands and banners show through format_session_db_unavailable().
SessionDB.__init__ is its only writer. Holds no connection and imports nothing of ours.
hermes-agent 0.22 keeps a test-isolation guard here too; no caller outside its state layer uses
it, so ours has none.
"""

import threading

_last_init_error = None
_last_init_error_lock = threading.Lock()


def _set_last_init_error(message):
    """Remember why opening the store failed (None forgets it). SessionDB sets it and never clears
    it, so another thread's successful open cannot hide the cause from a user."""
    global _last_init_error
    with _last_init_error_lock:
        _last_init_error = message


def get_last_init_error():
    """Why the last SessionDB() of this process failed to open ('<Class>: <message>'); None if none
    has."""
    return _last_init_error
