"""Who is routed to a session or may work on it: gateway routing entries,
compression locks and handoffs between the CLI and the gateway.

Owns `gateway_routing`, `compression_locks` and the `handoff_*` columns of
`sessions`. Relies on SessionDB's write and read paths. Never changes any
other session column or a message row.
"""

import os
import socket
import sys
import threading
import time

from hermes_state_common import (
    DELETE_ROUTING_KEYS_SQL,
    DELETE_ROUTING_SCOPE_SQL,
    REFRESH_LOCK_SQL,
    RELEASE_LOCK_SQL,
    SELECT_LOCK_SQL,
    SELECT_ROUTING_SQL,
    UPSERT_LOCK_SQL,
    UPSERT_ROUTING_SQL,
    chunked,
    json_text,
    placeholders,
    require_text,
)

# hermes-agent keeps the first 500 characters of a handoff's error.
HANDOFF_ERROR_MAX_CHARS = 500


class SessionGatewayMixin:
    """SessionDB's methods for gateway routing, compression locks and handoffs."""

    def save_gateway_routing_entry(self, session_key, entry_json, *, scope=""):
        row = _routing_row(session_key, entry_json, scope)
        self._execute_write(lambda conn: conn.execute(UPSERT_ROUTING_SQL, row))

    def load_gateway_routing_entries(self, *, scope=""):
        """{session_key: entry_json} for one scope."""
        return {key: entry for key, entry in self._read_all(SELECT_ROUTING_SQL, (scope,))}

    def delete_gateway_routing_entries(self, keys, *, scope=""):
        """Delete these keys from one scope; returns how many rows went."""
        keys = list(keys)

        def write(conn):
            return sum(conn.execute(DELETE_ROUTING_KEYS_SQL.format(placeholders(len(chunk))),
                                    [scope, *chunk]).rowcount for chunk in chunked(keys))

        return self._execute_write(write) if keys else 0

    def replace_gateway_routing_entries(self, entries, *, scope=""):
        """Make one scope hold exactly `entries` ({session_key: entry_json}), atomically."""
        rows = [_routing_row(key, entry, scope) for key, entry in dict(entries).items()]

        def write(conn):
            conn.execute(DELETE_ROUTING_SCOPE_SQL, (scope,))
            conn.executemany(UPSERT_ROUTING_SQL, rows)

        self._execute_write(write)

    def try_acquire_compression_lock(self, session_id, holder, ttl_seconds=300.0):
        """Take the session's compression lock for `holder`; False if someone alive holds it.

        An expired lock, or one whose holder names a dead process on this host,
        is taken over. Re-acquiring your own lock refreshes it.
        """
        require_text("holder", holder)
        ttl = _require_ttl(ttl_seconds)

        def write(conn):
            now = time.time()
            row = conn.execute(SELECT_LOCK_SQL, (session_id,)).fetchone()
            if row and row["holder"] != holder and row["expires_at"] > now and holder_is_alive(row["holder"]):
                return False
            conn.execute(UPSERT_LOCK_SQL, (session_id, holder, now, now + ttl))
            return True

        return self._execute_write(write)

    def refresh_compression_lock(self, session_id, holder, ttl_seconds=300.0):
        """Extend a lock `holder` holds; False if it holds none."""
        expires = time.time() + _require_ttl(ttl_seconds)
        return self._update_rows(REFRESH_LOCK_SQL, (expires, session_id, holder)) > 0

    def release_compression_lock(self, session_id, holder):
        """Release a lock `holder` holds; False if it holds none."""
        return self._update_rows(RELEASE_LOCK_SQL, (session_id, holder)) > 0

    def get_compression_lock_holder(self, session_id):
        """Who holds the session's lock now (None when free or expired)."""
        row = self._read_one(SELECT_LOCK_SQL, (session_id,))
        return row["holder"] if row and row["expires_at"] > time.time() else None


    # -- handoffs ----------------------------------------------------------------
    # A handoff moves a session from the CLI to a gateway platform: the CLI
    # requests it (pending), one gateway claims it (running), then completes or
    # fails it. Each step is a compare-and-set, so two gateways never both claim.

    def request_handoff(self, session_id, platform):
        """Mark the session pending handoff to `platform`; False if unknown or a handoff is in flight."""
        return self._update_rows(
            "UPDATE sessions SET handoff_state = 'pending', handoff_platform = ?, handoff_error = NULL"
            " WHERE id = ? AND (handoff_state IS NULL OR handoff_state IN ('completed', 'failed'))",
            (platform, session_id)) > 0

    def claim_handoff(self, session_id):
        """Move a pending handoff to running; True only for the one caller that did."""
        return self._update_rows("UPDATE sessions SET handoff_state = 'running'"
                                 " WHERE id = ? AND handoff_state = 'pending'", (session_id,)) > 0

    def complete_handoff(self, session_id):
        """Mark the handoff completed (whatever its state); returns None."""
        self._update_rows("UPDATE sessions SET handoff_state = 'completed', handoff_error = NULL WHERE id = ?",
                          (session_id,))

    def fail_handoff(self, session_id, error):
        """Mark the handoff failed with `error`, cut to HANDOFF_ERROR_MAX_CHARS; returns None."""
        self._update_rows("UPDATE sessions SET handoff_state = 'failed', handoff_error = ? WHERE id = ?",
                          (str(error)[:HANDOFF_ERROR_MAX_CHARS], session_id))

    def get_handoff_state(self, session_id):
        """{"state", "platform", "error"} of the session's handoff, or None for an unknown session."""
        row = self._read_one("SELECT handoff_state, handoff_platform, handoff_error FROM sessions WHERE id = ?",
                             (session_id,))
        return None if row is None else {"state": row[0], "platform": row[1], "error": row[2]}

    def list_pending_handoffs(self):
        """Every session row with a pending handoff, oldest first, `system_prompt` resolved."""
        rows = self._read_all("SELECT * FROM sessions WHERE handoff_state = 'pending' ORDER BY started_at")
        cache = {}
        return [self._resolve_prompt(dict(row), cache) for row in rows]


def lock_holder_name():
    """A compression-lock holder name whose process this host can check for liveness."""
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


def _pid_alive(pid):
    if sys.platform == "win32":
        import ctypes
        handle = ctypes.windll.kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return False
        ctypes.windll.kernel32.CloseHandle(handle)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_is_alive(holder):
    """False only when `holder` names a process on this host that no longer exists."""
    parts = holder.split(":")
    if len(parts) < 2 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return True
    return _pid_alive(int(parts[1]))


def _routing_row(session_key, entry_json, scope):
    require_text("session_key", session_key)
    if not isinstance(scope, str):
        raise ValueError("scope must be a string")
    entry = entry_json if isinstance(entry_json, str) else json_text("entry_json", entry_json)
    return (scope, session_key, entry, time.time())


def _require_ttl(ttl_seconds):
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, (int, float)) or ttl_seconds <= 0:
        raise ValueError("ttl_seconds must be a number > 0")
    return float(ttl_seconds)
