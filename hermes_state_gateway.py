"""Who is routed to a session or may work on it: gateway routing entries and
compression locks.

Owns `gateway_routing` and `compression_locks`. Relies on SessionDB's write
and read paths. Never changes a session or message row.
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


class SessionGatewayMixin:
    """SessionDB's methods for gateway routing and compression locks."""

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
