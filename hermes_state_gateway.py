"""Who is routed to a session or may work on it: routing entries, compression locks, turn leases,
CLI-to-gateway handoffs, hygiene failure streaks, backend heartbeats, and hermes-agent's repairs of
gateway sessions.

Owns those tables (`gateway_heartbeats` made on a backend's first heartbeat), the `handoff_*`
columns, and of other session columns only what the repairs change (routing identity and
`transport_profile`, a reset's or superseded session's end,
`model_config.browser_model_lock`). Relies on SessionDB's read/write paths and on the other
mixins' methods SessionGatewayMixin's docstring names. Never changes a message.
"""

import json
import logging
import os
import re
import sqlite3
import sys
import threading
import time
from collections import Counter

from hermes_state_common import (
    DELETE_UNUSED_PROMPTS_SQL, LAST_ACTIVE_SQL, SELECT_COMPRESSION_LOCK_SQL, LazyModule,
    _BARE_BILLING_PROVIDERS, _RESET_END_REASONS, decode_display_metadata, has_fork_marker,
    json_object, json_text, placeholders, require_text,
)
from hermes_state_errors import classify_persistence_error
from hermes_state_pidns import holder_pid_checkable
from hermes_state_schema import live_columns

logger = logging.getLogger("hermes_state")
socket = LazyModule("socket")  # (for the host name of a compression lock's holder only)

_UPSERT_ROUTING_SQL = ("INSERT INTO gateway_routing (scope, session_key, entry_json, updated_at)"
                       " VALUES (?, ?, ?, ?) ON CONFLICT (scope, session_key) DO UPDATE SET"
                       " entry_json = excluded.entry_json, updated_at = excluded.updated_at")
_DELETE_ROUTING_SQL = "DELETE FROM gateway_routing WHERE scope = ? AND session_key = ?"
# hermes-agent keeps the first 500 characters of a handoff's error.
HANDOFF_ERROR_MAX_CHARS = 500
# hermes-agent's holders name their process as a `pid=N` field.
_HOLDER_PID = re.compile(r"(?:^|:)pid=(\d+)(?::|$)")
# A keyed predecessor must have fallen quiet this close to an orphan's start.
ORPHAN_ADOPTION_MAX_GAP_S = 900.0
# Ends a gateway may still resume a session from (older cleanup bugs), so a reset may replace them.
_RECOVERABLE_END_REASONS_SQL = "('agent_close', 'ws_orphan_reap')"
_USE_COUNTERS = ("message_count", "tool_call_count", "api_call_count", "input_tokens",
                 "output_tokens", "pinned", "archived")
_NEVER_ACTIVE_SQL = f"""
SELECT s.id, s.session_key, s.source, s.chat_id, s.chat_type, s.user_id, s.started_at
FROM sessions AS s
WHERE s.session_key IS NOT NULL AND s.ended_at IS NULL AND s.title IS NULL
  AND s.last_activity_at IS NULL
  AND {" AND ".join(f"COALESCE(s.{c}, 0) = 0" for c in _USE_COUNTERS)}
  AND s.started_at < ? AND NOT EXISTS (SELECT 1 FROM messages AS m WHERE m.session_id = s.id)
ORDER BY s.started_at"""
_ORPHANS_SQL = f"""
SELECT o.id, o.source, o.user_id, o.started_at, o.parent_session_id, o.model_config,
  {LAST_ACTIVE_SQL.format(a="o")} AS last_active,
  (SELECT COUNT(*) FROM messages AS m WHERE m.session_id = o.id) AS message_count
FROM sessions AS o WHERE o.session_key IS NULL AND COALESCE(o.source, '') != 'tool'
  AND EXISTS (SELECT 1 FROM messages AS m WHERE m.session_id = o.id)
ORDER BY o.started_at"""
_HAS_MESSAGES_SQL = ("(COALESCE(s.message_count, 0) > 0"
                     " OR EXISTS (SELECT 1 FROM messages AS m WHERE m.session_id = s.id))")
# A gateway row recovery may resume: open, or ended by a cleanup bug. A later reset boundary of the
# same peer fences it off, so recovery never reaches behind a /new.
_RECOVERABLE_PEER_SQL = f"""
 WHERE {{match}} AND (s.ended_at IS NULL OR s.end_reason IN {_RECOVERABLE_END_REASONS_SQL})
  AND NOT EXISTS (SELECT 1 FROM sessions AS b WHERE {{fence}} AND b.source = s.source
    AND b.ended_at IS NOT NULL
    AND b.end_reason IN ({", ".join("'%s'" % r for r in _RESET_END_REASONS)})
    AND b.ended_at > COALESCE(s.last_activity_at, s.started_at))
ORDER BY {{order}}COALESCE(s.last_activity_at, s.started_at) DESC LIMIT 1"""
_PEER_COLUMNS = ("user_id", "chat_id", "chat_type", "thread_id")
_SAME_PEER_SQL = " AND ".join(f"COALESCE(b.{c}, '') = COALESCE(s.{c}, '')" for c in _PEER_COLUMNS)
_PEER_MATCH_SQL = "s.source = ? AND " + " AND ".join(
    f"COALESCE(s.{c}, '') = COALESCE(?, '')" for c in _PEER_COLUMNS)
# What a routing peer sets on its session rows as given (others keep a stored value over None).
_PEER_SET_COLUMNS = ("session_key", "source", "user_id", "chat_id", "chat_type", "thread_id")
# An orphan takes what it lacks of its donor's identity, and the donor as its parent.
_ADOPTED_COLUMNS = ("chat_id", "chat_type", "thread_id", "user_id", "origin_json", "display_name")
_DELETE_LEASE_SQL = "DELETE FROM session_turn_leases WHERE conversation_id = ? AND holder = ?"
# Each gateway or serve process's liveness row, made on its first heartbeat. The text is
# hermes-agent 0.22's (its schema makes the table at open), so sqlite_master reads the same to both.
class SessionGatewayMixin:
    """SessionDB's methods for gateway routing, compression locks, turn leases, handoffs and
    gateway sessions.

    Relies on: `_execute_write`, `_update_rows`, `_read_all`, `_read_one` (SessionDB);
    `_read_sessions`, `_resolved` (sessions mixin); `_turn_lease_key` (messages mixin);
    `delete_session` (maintenance mixin); `_flush_token_counts` (usage mixin)."""

    # -- routing ---------------------------------------------------------------
    # One row per (scope, session_key) holding the gateway's serialised entry; hermes-agent passes
    # its sessions folder as the scope. As there, an empty key or entry is skipped rather than
    # refused.
    def save_gateway_routing_entry(self, session_key, entry_json, *, scope=""):
        """Store one routing entry (JSON text, or a value to encode); returns None, skipping an
        empty one."""
        if session_key and entry_json:
            row = _routing_row(session_key, entry_json, scope)
            self._execute_write(lambda conn: conn.execute(_UPSERT_ROUTING_SQL, row))

    def load_gateway_routing_entries(self, *, scope=""):
        """{session_key: entry_json} for one scope; {} when it has none."""
        return dict(self._read_all("SELECT session_key, entry_json FROM gateway_routing"
                                   " WHERE scope = ? ORDER BY session_key", (scope,)))

    def delete_gateway_routing_entries(self, session_keys, *, scope=""):
        """Delete these keys from one scope; returns None (unknown keys are no error)."""
        rows = [(scope, key) for key in session_keys or ()]
        if rows:
            self._execute_write(lambda conn: conn.executemany(_DELETE_ROUTING_SQL, rows))

    def replace_gateway_routing_entries(self, entries, *, scope=""):
        """Make one scope hold exactly `entries` ({session_key: entry_json}), atomically; returns
        None. Pairs with an empty key or entry are left out, as a save would skip them."""
        rows = [_routing_row(key, entry, scope) for key, entry in dict(entries or {}).items()
                if key and entry]

        def write(conn):
            conn.execute("DELETE FROM gateway_routing WHERE scope = ?", (scope,))
            conn.executemany(_UPSERT_ROUTING_SQL, rows)
        self._execute_write(write)

    def gateway_routing_entry_for_session(self, session_id):
        """The routing entry (any scope, decoded) whose `session_id` is this session; None when no
        entry routes to it."""
        rows = self._read_all("SELECT entry_json FROM gateway_routing")
        return next((entry for entry in map(json_object, (row[0] for row in rows))
                     if entry.get("session_id") == session_id), None)

    # `hermes sessions repair-profiles` moves routing rows between profiles' stores as they are.
    def list_gateway_routing_rows(self):
        """Every routing row as {"scope", "session_key", "entry_json", "updated_at"}, by scope and
        key."""
        return [dict(row) for row in self._read_all(
            "SELECT scope, session_key, entry_json, updated_at FROM gateway_routing"
            " ORDER BY scope, session_key")]

    def delete_gateway_routing_rows(self, rows):
        """Delete these (scope, session_key) rows; returns how many existed."""
        wanted = [tuple(row) for row in rows or ()]
        return self._execute_write(lambda conn: sum(
            conn.execute(_DELETE_ROUTING_SQL, row).rowcount for row in wanted)) if wanted else 0

    def insert_gateway_routing_rows_if_absent(self, rows):
        """Add these (scope, session_key, entry_json, updated_at) rows where the key has none;
        returns how many were added. A row already here wins: it is the one the gateway loads."""
        wanted = [tuple(row) for row in rows or ()]
        return self._execute_write(lambda conn: sum(conn.execute(
            "INSERT OR IGNORE INTO gateway_routing (scope, session_key, entry_json, updated_at)"
            " VALUES (?, ?, ?, ?)", row).rowcount for row in wanted)) if wanted else 0

    def _delete_routing_entries_for_sessions(self, conn, session_ids):
        """Inside a write: drop the entries (any scope) naming one of `session_ids`; returns how
        many."""
        rows = conn.execute("SELECT scope, session_key, entry_json FROM gateway_routing").fetchall()
        doomed = [(scope, key) for scope, key, entry in rows
                  if isinstance(sid := json_object(entry).get("session_id"), str)
                  and sid in session_ids]
        conn.executemany(_DELETE_ROUTING_SQL, doomed)
        return len(doomed)

    # -- compression locks -------------------------------------------------------
    def try_acquire_compression_lock(self, session_id, holder, ttl_seconds=300.0):
        """True once `holder` holds the session's compression lock, taking over an expired one or a
        dead local process's (`ttl_seconds` <= 0 makes an expired lock, as in hermes-agent); False
        if another live holder has it, for an empty id, or when the store fails (compression is
        then skipped)."""
        if not session_id:
            return False

        def write(conn):
            now = time.time()
            row = conn.execute(SELECT_COMPRESSION_LOCK_SQL, (session_id,)).fetchone()
            if row and (row["expires_at"] < now or not holder_is_alive(row["holder"] or "")):
                # The row was read in this transaction, so the id alone names it (a holder may be
                # NULL in an old store).
                conn.execute("DELETE FROM compression_locks WHERE session_id = ?", (session_id,))
            conn.execute("INSERT OR IGNORE INTO compression_locks"
                         " (session_id, holder, acquired_at, expires_at) VALUES (?, ?, ?, ?)",
                         (session_id, holder, now, now + float(ttl_seconds)))
            return conn.execute(SELECT_COMPRESSION_LOCK_SQL,
                                (session_id,)).fetchone()["holder"] == holder
        return self._lock_write(write, "try_acquire_compression_lock", session_id)

    def refresh_compression_lock(self, session_id, holder, ttl_seconds=300.0):
        """Extend the lock while `holder` owns it, expired or not; else False, also when the store
        fails."""
        if not session_id or not holder:
            return False
        expires = time.time() + float(ttl_seconds)
        return self._lock_write(lambda conn: conn.execute(
            "UPDATE compression_locks SET expires_at = ? WHERE session_id = ? AND holder = ?",
            (expires, session_id, holder)).rowcount > 0, "refresh_compression_lock", session_id)

    def release_compression_lock(self, session_id, holder):
        """Release the lock if `holder` owns it; returns None. A store failure is logged, never
        raised."""
        if session_id:
            self._lock_write(lambda conn: conn.execute(
                "DELETE FROM compression_locks WHERE session_id = ? AND holder = ?",
                (session_id, holder)), "release_compression_lock", session_id)

    def get_compression_lock_holder(self, session_id):
        """Who holds the session's lock now; None when free, expired or for an empty id."""
        row = self._read_one(SELECT_COMPRESSION_LOCK_SQL, (session_id,)) if session_id else None
        return row["holder"] if row and row["expires_at"] >= time.time() else None

    def _lock_write(self, fn, name, session_id):
        # hermes-agent's lock calls fail open: a broken store means "no lock", never an exception.
        try:
            return self._execute_write(fn)
        except sqlite3.Error as exc:
            logger.warning("%s(%s) failed: %s", name, session_id, exc)
            return False

    # -- turn leases -------------------------------------------------------------
    # One agent turn at a time per conversation, across processes. The lease is kept under the root
    # of the compression chain (`_turn_lease_key`), so a turn keeps it when compression rotates the
    # session; a write naming a holder checks it in its own transaction. As in hermes-agent, an
    # empty id or holder is no lease.
    def try_acquire_session_turn_lease(self, session_id, holder, *, ttl_seconds=300.0,
                                       patience_s=None):
        """True once `holder` holds the conversation's turn lease, taking over an expired one or a
        dead local process's; False if someone else holds it. `patience_s` bounds the wait for a
        busy store."""
        if not session_id or not holder:
            return False
        ttl = max(0.1, float(ttl_seconds))

        select = "SELECT holder, expires_at FROM session_turn_leases WHERE conversation_id = ?"

        def write(conn):
            key, now = self._turn_lease_key(conn, session_id), time.time()
            row = conn.execute(select, (key,)).fetchone()
            if row is not None and (float(row["expires_at"]) <= now
                                    or not holder_is_alive(row["holder"])):
                conn.execute(_DELETE_LEASE_SQL, (key, row["holder"]))
            conn.execute("INSERT OR IGNORE INTO session_turn_leases (conversation_id, holder,"
                         " acquired_at, expires_at) VALUES (?, ?, ?, ?)",
                         (key, holder, now, now + ttl))
            return conn.execute(select, (key,)).fetchone()["holder"] == holder
        return self._execute_write(write, patience_s=patience_s)

    def acquire_session_turn_lease(self, session_id, holder, *, ttl_seconds=300.0,
                                   wait_seconds=1800.0, poll_interval_seconds=1.0, on_wait=None,
                                   wait_notice_interval_seconds=15.0, should_abort=None,
                                   acquire_patience_s=0.5, on_contended=None):
        """True once `holder` has the turn lease, polling up to `wait_seconds` with no lock held
        between tries; False on timeout or when `should_abort()` says so. `on_wait(elapsed)` runs
        after the first miss to another holder, then every `wait_notice_interval_seconds`. A store
        busy past the write patience is no holder: `on_contended()` runs instead (the busy writer
        may be the last holder's final flush) and the next try follows at once, waiting up to a
        poll interval longer for the write lock. Callback errors are logged and ignored; any
        other store error is raised."""
        deadline = time.monotonic() + max(0.0, float(wait_seconds))
        notice_every = max(0.0, float(wait_notice_interval_seconds))
        poll = max(0.0, float(poll_interval_seconds))
        patience, started, last_notice = acquire_patience_s, None, None
        while True:
            if should_abort is not None and _callback_says(should_abort):
                return False
            try:
                if self.try_acquire_session_turn_lease(session_id, holder, ttl_seconds=ttl_seconds,
                                                       patience_s=patience):
                    return True
            except sqlite3.Error as exc:
                if classify_persistence_error(exc) != "locked":
                    raise
                if on_contended is not None:
                    _callback_says(on_contended)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                patience = min(acquire_patience_s + poll, max(acquire_patience_s, remaining))
                continue
            patience, now = acquire_patience_s, time.monotonic()
            if now >= deadline:
                return False
            started = now if started is None else started
            if on_wait is not None and (last_notice is None or now - last_notice >= notice_every):
                _callback_says(on_wait, now - started)
                last_notice = now
            time.sleep(min(max(0.01, poll), deadline - now))

    def refresh_session_turn_lease(self, session_id, holder, *, ttl_seconds=300.0,
                                   patience_s=None):
        """Extend the lease by `ttl_seconds` (at least 0.1) from before the write waits; False
        unless `holder` holds it. `patience_s` bounds the wait for a busy store."""
        if not session_id or not holder:
            return False
        expires_at = time.time() + max(0.1, float(ttl_seconds))
        return self._execute_write(lambda conn: conn.execute(
            "UPDATE session_turn_leases SET expires_at = ?"
            " WHERE conversation_id = ? AND holder = ?",
            (expires_at, self._turn_lease_key(conn, session_id), holder)).rowcount > 0,
            patience_s=patience_s)

    def release_session_turn_lease(self, session_id, holder):
        """Give the lease up if `holder` holds it; returns None (releasing twice is no error)."""
        if session_id and holder:
            self._execute_write(lambda conn: conn.execute(
                _DELETE_LEASE_SQL, (self._turn_lease_key(conn, session_id), holder)))

    # -- handoffs ----------------------------------------------------------------
    # A handoff moves a session from the CLI to a gateway platform: the CLI requests it (pending),
    # one gateway claims it (running), then completes or fails it. Each step is a compare-and-set:
    # no two gateways claim.
    def request_handoff(self, session_id, platform):
        """Mark the session pending handoff to `platform`; False if unknown or a handoff is in
        flight."""
        return self._update_rows(
            "UPDATE sessions SET handoff_state = 'pending', handoff_platform = ?,"
            " handoff_error = NULL"
            " WHERE id = ? AND (handoff_state IS NULL OR handoff_state IN ('completed', 'failed'))",
            (platform, session_id)) > 0

    def claim_handoff(self, session_id):
        """Move a pending handoff to running; True only for the one caller that did."""
        return self._update_rows("UPDATE sessions SET handoff_state = 'running'"
                                 " WHERE id = ? AND handoff_state = 'pending'", (session_id,)) > 0

    def complete_handoff(self, session_id):
        """Mark the handoff completed (whatever its state); returns None."""
        self._update_rows(
            "UPDATE sessions SET handoff_state = 'completed', handoff_error = NULL WHERE id = ?",
            (session_id,))

    def fail_handoff(self, session_id, error, *, only_states=None):
        """Mark the handoff failed with `error`, cut to HANDOFF_ERROR_MAX_CHARS; True when the row
        changed. `only_states` (e.g. ("pending",)) fails it only from those states: a waiter that
        gives up must not overwrite a handoff a gateway has claimed and now owns."""
        states = tuple(only_states or ())
        among = f" AND handoff_state IN ({placeholders(len(states))})" if states else ""
        return self._update_rows(
            "UPDATE sessions SET handoff_state = 'failed', handoff_error = ? WHERE id = ?" + among,
            (str(error)[:HANDOFF_ERROR_MAX_CHARS], session_id, *states)) > 0

    def has_pending_handoffs(self):
        """True while any session waits for a gateway to claim its handoff."""
        return self._read_one(
            "SELECT 1 FROM sessions WHERE handoff_state = 'pending' LIMIT 1") is not None

    def get_handoff_state(self, session_id):
        """{"state", "platform", "error"} of the session's handoff, or None for an unknown
        session."""
        row = self._read_one("SELECT handoff_state, handoff_platform, handoff_error FROM sessions"
                             " WHERE id = ?", (session_id,))
        return None if row is None else dict(zip(("state", "platform", "error"), row))

    def list_pending_handoffs(self):
        """Every session row with a pending handoff, oldest first, `system_prompt` resolved."""
        return self._resolved(self._read_all(
            "SELECT * FROM sessions WHERE handoff_state = 'pending' ORDER BY started_at"))

    def has_gateway_input_owner(self, session_id, owner):
        """True when a user message of the session the gateway accepted (live or compacted, not
        merely observed) carries `owner` as its display_metadata's `gateway_input_owner`."""
        rows = self._read_all(
            "SELECT display_metadata FROM messages WHERE session_id = ? AND role = 'user'"
            " AND observed = 0 AND (active = 1 OR compacted = 1)"
            " AND display_metadata LIKE '%gateway_input_owner%'", (session_id,))
        return any((decode_display_metadata(row[0]) or {}).get("gateway_input_owner") == owner
                   for row in rows)

    # -- backend heartbeats -------------------------------------------------------------
    # Each gateway or serve process refreshes its row while it runs and clears it at exit, so a
    # sweep can tell a live backend's sessions from a dead one's.
    def register_backend_heartbeat(self, *, backend_id, pid, started_at, last_heartbeat=None,
                                   profile="", host=""):
        """Store or refresh one backend's liveness row (`last_heartbeat` default now); None, and
        nothing for an empty id."""
        if not backend_id:
            return
        row = {"backend_id": str(backend_id), "pid": int(pid), "started_at": float(started_at),
               "beat": time.time() if last_heartbeat is None else float(last_heartbeat),
               "profile": str(profile), "host": str(host)}

        def write(conn):
            conn.execute(
                "INSERT INTO gateway_heartbeats (backend_id, pid, started_at, last_heartbeat,"
                " profile, host) VALUES (:backend_id, :pid, :started_at, :beat, :profile, :host)"
                " ON CONFLICT(backend_id) DO UPDATE SET pid = excluded.pid,"
                " started_at = excluded.started_at, last_heartbeat = excluded.last_heartbeat,"
                " profile = excluded.profile, host = excluded.host", row)
        self._execute_write(write)

    def clear_backend_heartbeat(self, backend_id):
        """Remove one backend's row; True if it was there (False without the table)."""
        if not backend_id:
            return False

        return self._update_rows("DELETE FROM gateway_heartbeats WHERE backend_id = ?",
                                 (str(backend_id),)) > 0

    def prune_stale_heartbeats(self, *, max_age_seconds):
        """Remove the rows of backends silent for over `max_age_seconds`; their ids ([] for a
        window of 0 or less). Rows of live backends are never touched, so any process may run it."""
        if max_age_seconds <= 0:
            return []
        cutoff = time.time() - max_age_seconds

        def write(conn):
            stale = [row[0] for row in conn.execute(
                "SELECT backend_id FROM gateway_heartbeats WHERE last_heartbeat < ?", (cutoff,))]
            conn.execute("DELETE FROM gateway_heartbeats WHERE last_heartbeat < ?", (cutoff,))
            return stale
        return self._execute_write(write)

    def list_backend_heartbeats(self):
        """Every backend's heartbeat row as a dict, the most recent first ([] on a read-only
        store 0.22 never opened)."""
        try:
            return [dict(row) for row in self._read_all(
                "SELECT backend_id, pid, started_at, last_heartbeat, profile, host"
                " FROM gateway_heartbeats ORDER BY last_heartbeat DESC")]
        except sqlite3.OperationalError:
            return []

    # -- gateway sessions ------------------------------------------------------------
    # Rows the gateway keys by `session_key`: the end of a reset, rows opened and never used, and
    # orphans that lost their routing identity to a failed write.
    @staticmethod
    def session_gateway_runtime(session_meta):
        """The provider route a session row last ran on, as a dict; {} when the row names none.

        Tried in order: model_config's `gateway_runtime` naming a provider, its top-level
        provider/base_url/api_mode, a billing_provider that is no bucket ('auto', 'custom'), then
        any `gateway_runtime`."""
        meta = session_meta or {}
        config = json_object(meta.get("model_config"))
        runtime = config.get("gateway_runtime")
        runtime = ({k: v for k, v in runtime.items() if v is not None}
                   if isinstance(runtime, dict) else {})
        if runtime.get("provider"):
            return runtime
        top_level = {key: config[key] for key in ("provider", "base_url", "api_mode")
                     if config.get(key)}
        if top_level:
            return top_level
        billing = str(meta.get("billing_provider") or "").strip()
        return ({"provider": billing}
                if billing and billing.lower() not in _BARE_BILLING_PROVIDERS else runtime)

    def update_session_runtime_lock(self, session_id, *, model=None, provider=None,
                                    model_options=None, route_source=None, confirmed=False):
        """Record the model route a browser or API client pinned, dropping the stored system prompt
        so the next turn names it; None, nothing for an unknown id. TypeError for `model_options`
        JSON can't hold."""
        lock = {"provider": provider or "", "model": model or "",
                "model_options": model_options or {}, "route_source": route_source or "",
                "confirmed": bool(confirmed), "updated_at": time.time()}
        json.dumps(lock)

        def write(conn):
            row = conn.execute("SELECT model_config FROM sessions WHERE id = ?",
                               (session_id,)).fetchone()
            if row is None:
                return
            config = json_object(row["model_config"])
            config["browser_model_lock"] = lock
            conn.execute("UPDATE sessions SET model_config = ?, model = COALESCE(?, model),"
                         " system_prompt = NULL, system_prompt_hash = NULL WHERE id = ?",
                         (json.dumps(config), model, session_id))
            conn.execute(DELETE_UNUSED_PROMPTS_SQL)
        self._execute_write(write)

    def record_gateway_session_peer(self, session_id, *, source, user_id=None, session_key=None,
                                    chat_id=None, chat_type=None, thread_id=None,
                                    display_name=None, origin_json=None,
                                    include_compression_ancestors=False, transport_profile=None):
        """Give a session the gateway peer it is routed by, creating a missing row so a failed
        create_session never leaves the chat unroutable; None (nothing without an id or key). With
        `include_compression_ancestors` the compression parents it continues get it too; none is
        created. `display_name`, `origin_json` and `transport_profile` (the profile whose bot
        carries the chat) left None keep what is stored."""
        if not session_id or not session_key:
            return
        peer = {"session_key": session_key, "source": source, "user_id": user_id,
                "chat_id": chat_id, "chat_type": chat_type, "thread_id": thread_id,
                "display_name": display_name, "origin_json": origin_json,
                "transport_profile": transport_profile}

        def write(conn):
            ids = [session_id]
            while include_compression_ancestors:
                # The compression parent a row continues, with what tells a fork or tool child
                # from a continuation.
                link = conn.execute("SELECT p.id, c.source, c.model_config FROM sessions AS c"
                                    " JOIN sessions AS p ON p.id = c.parent_session_id"
                                    " AND p.end_reason = 'compression' WHERE c.id = ?",
                                    (ids[-1],)).fetchone()
                if (link is None or link["id"] in ids or (link["source"] or "") == "tool"
                        or has_fork_marker(link["model_config"])):
                    break
                ids.append(link["id"])
            # Columns of schema 31 a store made before it lacks.
            columns = set(live_columns(conn, "sessions"))
            kept = ["display_name", "origin_json"] + [
                name for name in ("transport_profile",) if name in columns]
            sets = ", ".join(f"{name} = :{name}" for name in _PEER_SET_COLUMNS) + "".join(
                f", {name} = COALESCE(:{name}, {name})" for name in kept)
            conn.executemany(f"UPDATE sessions SET {sets} WHERE id = :id",
                             [dict(peer, id=row_id) for row_id in ids])
            if not include_compression_ancestors and conn.execute(
                    "SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is None:
                row = dict({name: peer[name] for name in (*_PEER_SET_COLUMNS, *kept)},
                           id=session_id, started_at=time.time())
                if "created_source" in columns:
                    row["created_source"] = source
                conn.execute(f"INSERT INTO sessions ({', '.join(row)})"
                             f" VALUES ({', '.join(':' + name for name in row)})", row)
        self._execute_write(write)

    def find_latest_gateway_session_for_peer(self, *, source, user_id=None, session_key=None,
                                             chat_id=None, chat_type=None, thread_id=None):
        """The session row (with `_has_messages`) the gateway should resume for this routing key,
        else for the whole peer when `chat_id` and `chat_type` are given; None without a key or a
        match. Rows with messages first (by peer: only those), then the most recently active, none
        behind a reset."""
        if not session_key:
            return None
        self._flush_token_counts()
        column = ", %s AS _has_messages" % _HAS_MESSAGES_SQL
        by_key = _RECOVERABLE_PEER_SQL.format(match="s.session_key = ? AND s.source = ?",
                                              fence="b.session_key = s.session_key",
                                              order="_has_messages DESC, ")
        rows = self._read_sessions(column, by_key, (session_key, source))
        if not rows and chat_id is not None and chat_type is not None:
            by_peer = _RECOVERABLE_PEER_SQL.format(
                match=_PEER_MATCH_SQL + " AND " + _HAS_MESSAGES_SQL, fence=_SAME_PEER_SQL, order="")
            rows = self._read_sessions(column, by_peer,
                                       (source, user_id, chat_id, chat_type, thread_id))
        return rows[0] if rows else None

    def find_session_by_origin(self, *, platform, chat_id, thread_id=None, user_id=None):
        """The id of the newest open gateway session of this platform (any case) and chat (and
        thread, when given); None when there is none or it is ambiguous: several rows, none of
        `user_id`'s, or without `user_id` of more than one user."""
        if not platform or chat_id in (None, ""):
            return None
        thread = "" if thread_id is None else " AND COALESCE(thread_id, '') = ?"
        rows = self._read_all(f"SELECT id, user_id FROM sessions WHERE LOWER(source) = LOWER(?)"
                              " AND session_key IS NOT NULL AND chat_id = ?"
                              f" AND ended_at IS NULL{thread} ORDER BY started_at DESC",
                              [platform, str(chat_id)]
                              + ([] if thread_id is None else [str(thread_id)]))
        users = [str(row["user_id"] or "") for row in rows]
        if user_id and str(user_id) in users:
            return str(rows[users.index(str(user_id))]["id"])
        if not rows or len(rows) > 1 and (
                user_id or len({u.strip() for u in users if u.strip()}) > 1):
            return None
        return str(rows[0]["id"])

    def increment_hygiene_failure_streak(self, session_key):
        """Count one more failed session-hygiene run for a chat; the new streak (1, unstored, for no
        key)."""
        if not session_key:
            return 1

        def write(conn):
            conn.execute("INSERT INTO gateway_hygiene_state (session_key, failure_streak)"
                         " VALUES (?, 1) ON CONFLICT (session_key)"
                         " DO UPDATE SET failure_streak = failure_streak + 1", (session_key,))
            return int(conn.execute(
                "SELECT failure_streak FROM gateway_hygiene_state WHERE session_key = ?",
                (session_key,)).fetchone()[0])
        return self._execute_write(write)

    def reset_hygiene_failure_streak(self, session_key):
        """Forget a chat's session-hygiene failure streak; returns None (nothing for an empty
        key)."""
        if session_key:
            self._update_rows("DELETE FROM gateway_hygiene_state WHERE session_key = ?",
                              (session_key,))

    def promote_to_session_reset(self, session_id, reason="session_reset"):
        """End the session now with `reason`, a reset boundary gateway recovery never crosses; False
        when the row is missing, the write failed, or it ended otherwise than by an end recovery
        would resume."""
        if not session_id:
            return False
        try:
            return self._execute_write(lambda conn: self._end_at_boundary(
                conn, "UPDATE sessions SET ended_at = :now, end_reason = :reason WHERE id = :id"
                      f" AND (ended_at IS NULL OR end_reason IN {_RECOVERABLE_END_REASONS_SQL})",
                session_id, reason)) > 0
        except Exception:  # as in hermes-agent: a reset boundary never raises into the gateway
            logger.warning("could not mark session %r as reset", session_id, exc_info=True)
            return False

    def list_never_active_keyed_sessions(self, *, older_than_days):
        """Open keyed sessions started over `older_than_days` ago and never used (no message, title,
        token, call or activity; not pinned or archived), oldest first, as dicts; [] when none."""
        cutoff = time.time() - float(older_than_days) * 86400.0
        return [dict(row) for row in self._read_all(_NEVER_ACTIVE_SQL, (cutoff,))]

    def prune_never_active_keyed_sessions(self, *, older_than_days, sessions_dir=None):
        """Delete what list_never_active_keyed_sessions lists (through delete_session) and, first,
        the routing entries naming it; returns (sessions deleted, routing entries deleted)."""
        ids = {row["id"] for row in
               self.list_never_active_keyed_sessions(older_than_days=older_than_days)}
        if not ids:
            return (0, 0)
        routing = self._execute_write(
            lambda conn: self._delete_routing_entries_for_sessions(conn, ids))
        extra = {} if sessions_dir is None else {"sessions_dir": sessions_dir}
        return (sum(1 for session_id in sorted(ids) if self.delete_session(session_id, **extra)),
                routing)

    def find_orphaned_gateway_sessions(self, *, max_gap_s=None):
        """Sessions with messages but no `session_key` (forks and tool runs aside), oldest first,
        each with the keyed session it continues when exactly one can be named; [] when none. The
        donor is the keyed parent of the same source ('lineage'), else the one keyed session of that
        source and a compatible user that fell quiet within `max_gap_s` of the orphan's start,
        before its last activity ('contiguity'). An orphan whose donor is missing, ambiguous or
        claimed twice is not adoptable, and `reason` says why."""
        gap = ORPHAN_ADOPTION_MAX_GAP_S if max_gap_s is None else float(max_gap_s)
        orphans = [row for row in self._read_all(_ORPHANS_SQL)
                   if not has_fork_marker(row["model_config"])]
        donors = {}
        if orphans:
            rows = self._read_all(f"SELECT d.id, d.session_key, d.source, d.user_id,"
                                  f" {LAST_ACTIVE_SQL.format(a='d')} AS last_active"
                                  " FROM sessions AS d WHERE d.session_key IS NOT NULL")
            donors = {row["id"]: row for row in rows}
        records = [_orphan_record(orphan, donors, gap) for orphan in orphans]
        claims = Counter(record["donor_id"] for record in records if record["adoptable"])
        for record in records:
            if claims[record["donor_id"]] > 1:
                record.update(adoptable=False, reason="ambiguous: more than one unkeyed session"
                                                      " claims this predecessor")
        return records

    def adopt_orphaned_gateway_session(self, orphan_id, donor_id):
        """Give `orphan_id` the routing identity of `donor_id` and end the donor as
        'superseded_by_repair'; False when either is missing, the donor has no key, the orphan has
        one, or their sources differ (checked inside the write, so a row a gateway healed meanwhile
        is left alone)."""
        if not orphan_id or not donor_id or orphan_id == donor_id:
            return False

        def write(conn):
            donor = conn.execute(f"SELECT session_key, {', '.join(_ADOPTED_COLUMNS)}, source"
                                 " FROM sessions WHERE id = ?", (donor_id,)).fetchone()
            orphan = conn.execute("SELECT session_key, source FROM sessions WHERE id = ?",
                                  (orphan_id,)).fetchone()
            if (donor is None or orphan is None or not donor["session_key"] or orphan["session_key"]
                    or (donor["source"] or "") != (orphan["source"] or "")):
                return False
            # The orphan keeps the identity columns it has; a missing parent becomes the donor.
            fill = ", ".join(f"{c} = COALESCE({c}, :{c})"
                             for c in (*_ADOPTED_COLUMNS, "parent_session_id"))
            conn.execute(f"UPDATE sessions SET session_key = :session_key, {fill}"
                         " WHERE id = :orphan_id AND session_key IS NULL",
                         {**{c: donor[c] for c in ("session_key", *_ADOPTED_COLUMNS)},
                          "parent_session_id": donor_id, "orphan_id": orphan_id})
            # Not an end recovery resumes ('agent_close'), or the donor could win the chat back.
            conn.execute("UPDATE sessions SET ended_at = COALESCE(ended_at, ?),"
                         " end_reason = 'superseded_by_repair' WHERE id = ?",
                         (time.time(), donor_id))
            return True
        return self._execute_write(write)


def lock_holder_name():
    """A compression-lock holder name whose process this host can check for liveness."""
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


def holder_is_alive(holder):
    """False only when `holder` names a process of this host that no longer exists:
    hermes-agent's `pid=N:...` (its store is host-local) or our `host:pid:thread`; any other name
    counts as alive."""
    text = str(holder or "")
    match = _HOLDER_PID.search(text)
    parts = text.split(":")
    if match:
        if ":pidns=" in text and not holder_pid_checkable(text):
            # Stamped by a process of another PID namespace (a container on a shared volume):
            # that pid is not ours to probe, so its expiry decides. An unstamped holder (0.20
            # writes none) is probed as before.
            return True
        pid = int(match.group(1))
    elif len(parts) >= 2 and parts[0] == socket.gethostname() and parts[1].isdigit():
        pid = int(parts[1])
    else:
        return True
    if pid == os.getpid() or pid <= 0 or pid >= 2 ** 31:
        return True  # ours, or not a process id we can probe (0 would signal our own group)
    if sys.platform == "win32":
        import ctypes
        # 0x1000 is PROCESS_QUERY_LIMITED_INFORMATION.
        handle = ctypes.windll.kernel32.OpenProcess(0x1000, False, pid)
        if handle:
            ctypes.windll.kernel32.CloseHandle(handle)
        return bool(handle)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # it exists, but is not ours to signal
    return True


def _callback_says(callback, *args):
    """A caller's callback's answer; its errors are logged and read as no."""
    try:
        return callback(*args)
    except Exception:  # a caller's UI callback must not end the wait
        logger.debug("callback %r failed", callback, exc_info=True)
        return False


def _orphan_record(orphan, donors, gap):
    """find_orphaned_gateway_sessions' dict for one orphan, given every keyed session by id."""
    source = orphan["source"] or ""
    if orphan["parent_session_id"]:
        evidence, parent = "lineage", donors.get(orphan["parent_session_id"])
        candidates = [parent] if parent is not None and (parent["source"] or "") == source else []
        miss = "parent session carries no gateway identity of this source"
    else:
        evidence, start, last, user = ("contiguity", orphan["started_at"] or 0,
                                       orphan["last_active"], orphan["user_id"])
        candidates = [d for d in donors.values()
                      if (d["source"] or "") == source
                      and (not d["user_id"] or not user or d["user_id"] == user)
                      and d["last_active"] is not None and last is not None
                      and start - gap <= d["last_active"] <= start + gap
                      and d["last_active"] < last]
        miss = f"no keyed predecessor fell quiet within {gap:.0f}s of this session's start"
    if len(candidates) > 1:
        miss = "ambiguous: more than one keyed predecessor matches this window"
    found = len(candidates) == 1
    donor = candidates[0] if found else {"id": None, "session_key": None}
    return {"orphan_id": orphan["id"], "source": orphan["source"],
            "message_count": orphan["message_count"], "started_at": orphan["started_at"],
            "last_active": orphan["last_active"], "donor_id": donor["id"],
            "session_key": donor["session_key"], "evidence": evidence if found else "",
            "adoptable": found, "reason": "" if found else miss}


def _routing_row(session_key, entry_json, scope):
    require_text("session_key", session_key)
    if not isinstance(scope, str):
        raise ValueError("scope must be a string")
    entry = entry_json if isinstance(entry_json, str) else json_text("entry_json", entry_json)
    return (scope, session_key, entry, time.time())
