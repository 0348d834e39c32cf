"""Keeping the store healthy: prune, archive and delete sessions; vacuum, stats, doctor; the small
reports and one-shot fixes hermes-agent's commands run.

Owns which sessions a prune, archive or delete selects (pinned ones spared), what a delete takes
with it: messages, usage rows and Telegram topic bindings (as hermes-agent's foreign keys do),
delegate subagents, the compression chain when asked, system prompts no session uses any more, and
transcript files in a `sessions_dir`; and what refuses one: a live turn lease or compression lock,
a transcript changed since an export read it. Also the sweep that ends sessions a dead process
left open. Relies on SessionDB's write and read paths and on other mixins' methods (the class
docstring lists them). Never repairs the schema: that happens at open (hermes_state_schema) or in
hermes_state_repair.
"""

import collections
import contextlib
import json
import logging
import sqlite3
import threading
import time
from pathlib import Path

from hermes_state_common import (
    COUNT_ALL_MESSAGES_SQL, DELETE_META_SQL,
    DELETE_UNUSED_PROMPTS_SQL, JOURNAL_MODE_SQL, LAST_ACTIVE_SQL,
    MESSAGES_LAST_ACTIVE_SQL, SCHEMA_VERSION, SELECT_SCHEMA_VERSION_SQL, SESSION_EXISTS_SQL,
    SELECT_COMPRESSION_LOCK_SQL, SESSION_RICH_SQL, SKILL_SCAFFOLD_PREFIX, SQL_CHUNK_SIZE,
    STALE_MARKER, TABLE_EXISTS_SQL, chunked, cwd_prefix_clause, escape_like, claim_file_beside,
    is_fork_child, json_object, placeholders, prefix_bounds, sqlite_has_wal_reset_bug,
    store_file_bytes)
from hermes_state_errors import SessionActiveWriteGuardError
from hermes_state_schema import pause_between_chunks, write_meta

logger = logging.getLogger("hermes_state")

_TOKENS = "(COALESCE(s.input_tokens, 0) + COALESCE(s.output_tokens, 0))"
_COST = "COALESCE(s.actual_cost_usd, s.estimated_cost_usd, 0)"
_LIKE = "LOWER(COALESCE({}, '')) LIKE ? ESCAPE '\\'"
# Prune deletes only ended sessions; count_open_prune_matches flips this guard alone.
_ENDED = "s.ended_at IS NOT NULL"
# hermes-agent's bulk prune/archive filters, all ANDed: "bound" applies when not None, "flag"
# when True or False (else both sides), the others when truthy ("like": a case-insensitive
# substring, "lower": equality ignoring case, "cwd": the path or below). Activity is the
# newest message, else the start.
_PRUNE_FILTERS = {
    "last_active_before": ("bound", MESSAGES_LAST_ACTIVE_SQL + " < ?"),
    "last_active_after": ("bound", MESSAGES_LAST_ACTIVE_SQL + " >= ?"),
    "started_before": ("bound", "s.started_at < ?"),
    "started_after": ("bound", "s.started_at >= ?"),
    "source": ("exact", "s.source = ?"),
    "title_like": ("like", _LIKE.format("s.title")),
    "end_reason": ("exact", "s.end_reason = ?"),
    "cwd_prefix": ("cwd", None),
    "min_messages": ("bound", "s.message_count >= ?"),
    "max_messages": ("bound", "s.message_count <= ?"),
    "model_like": ("like", _LIKE.format("s.model")),
    "provider": ("lower", "LOWER(COALESCE(s.billing_provider, '')) = ?"),
    "user_id": ("exact", "s.user_id = ?"),
    "chat_id": ("exact", "s.chat_id = ?"),
    "chat_type": ("exact", "s.chat_type = ?"),
    "branch_like": ("like", _LIKE.format("s.git_branch")),
    "min_tokens": ("bound", _TOKENS + " >= ?"),
    "max_tokens": ("bound", _TOKENS + " <= ?"),
    "min_cost": ("bound", _COST + " >= ?"),
    "max_cost": ("bound", _COST + " <= ?"),
    "min_tool_calls": ("bound", "COALESCE(s.tool_call_count, 0) >= ?"),
    "max_tool_calls": ("bound", "COALESCE(s.tool_call_count, 0) <= ?"),
    "archived": ("flag", None),
}
_PRUNE_PARAM = {"bound": lambda v: v, "exact": lambda v: v, "lower": lambda v: v.lower(),
                "like": lambda v: f"%{escape_like(v.lower())}%"}

# Sessions the "delete empty" button removes: ended, unarchived, no messages counted.
_EMPTY_SESSIONS_WHERE = "WHERE message_count = 0 AND ended_at IS NOT NULL AND archived = 0"
_DELEGATE_ROWS_SQL = ("SELECT id, parent_session_id, model_config FROM sessions"
                      " WHERE instr(model_config, '_delegate_from') > 0")
# A deleted session's messages go after its row, a chunk per transaction, so no delete holds the
# write lock for long (each message also leaves three indexes). One state_meta key per session
# still to sweep, its value the highest message id it may have: ids are AUTOINCREMENT, so a session
# made again under the same id keeps its new messages. A sweep cut short (the process died) is
# finished by the next writable open, delete or prune, and by a create_session of one of its ids
# before the row is made again.
SWEEP_META_PREFIX = "hs_sweep_messages:"
# When a delete last marked or swept: an open leaves the sweeps to a
# process that may still be at them.
SWEEP_BEAT_META = "hs_sweep_beat"
_SWEEP_PENDING_SQL = "SELECT 1 FROM state_meta WHERE key >= ? AND key < ? LIMIT 1"
# Every child of a session compression ended: the links a chain may take (see _compression_chains).
_CONTINUATION_LINKS_SQL = (
    "SELECT c.id, c.parent_session_id, c.source, c.model_config FROM sessions AS c"
    " JOIN sessions AS p ON p.id = c.parent_session_id WHERE p.end_reason = 'compression'")
_TURN_LEASE_SQL = "SELECT holder, expires_at FROM session_turn_leases WHERE conversation_id = ?"
# The open sessions of sources whose lifecycle the store owns (their process never ends them when it
# dies): automatic maintenance closes them once idle past the retention, as hermes-agent 0.22 does.
AUTO_PRUNE_STALE_OPEN_SOURCES = (
    "cli", "cron", "kanban", "acp", "api_server", "subagent", "tool", "recovered")
# The share of free pages under which an automatic VACUUM is not worth rewriting the file.
AUTO_VACUUM_MIN_FREELIST_RATIO = 0.25
ORPHAN_END_REASON = "startup_orphan_reap"


class SessionMaintenanceMixin:
    """SessionDB's methods for pruning, archiving, deleting and reporting on the store.

    Relies on: `_execute_write`, `_read_all`, `_read_one`, `_read_value`, `_with_reader`,
    `get_meta`, `set_meta`, `_connect`, `_checkpoint_mode`, `db_path`, `fts_caps`, `policy`,
    `repairs`, `stale_schema` (SessionDB); `_flush_token_counts` (usage mixin); `_resolved`,
    `set_session_archived` (sessions mixin); `_turn_lease_key`, `get_messages` (messages mixin);
    `fts_layout`, `fts_rebuild_status`, `fts_rebuild_step`, `optimize_fts`, `search_health`
    (search index mixin); `staged_import` (portability mixin)."""

    # Messages a delete removes per transaction: each costs up to 0.9 ms with our three indexes at
    # 1M messages on a busy 2-core machine (2,000 held the lock for up to 1.8 s).
    DELETE_CHUNK_ROWS = 400
    # An open finishes the sweeps left when none went on for this long: a sweep's
    # process does a chunk at least every few seconds, and an open that joined a live
    # sweep would wait for all of it.
    SWEEP_ALIVE_SECONDS = 60
    # The largest store maybe_auto_prune_and_vacuum VACUUMs on its own (issue 17's 1 s hold).
    AUTO_VACUUM_MAX_BYTES = 32 * 1024 * 1024

    # -- selecting sessions for prune and archive ------------------------------

    def list_prune_candidates(self, older_than_days=None, source=None, **filters):
        """Rows (id, source, title, model, started_at, last_active, ended_at,
        message_count, archived) a prune_sessions or archive_sessions with these filters
        would touch, least recently active first.

        Only ended sessions qualify. `older_than_days` means inactive that long (newest
        message, else start) unless `last_active_before` or `started_before` is given; an
        unknown filter raises TypeError."""
        where, params = _prune_where(older_than_days, source, filters)
        return [dict(row) for row in self._read_all(
            f"SELECT s.id, s.source, s.title, s.model, s.started_at, {MESSAGES_LAST_ACTIVE_SQL}"
            " AS last_active, s.ended_at, s.message_count, s.archived FROM sessions AS s"
            f" WHERE {_ENDED}{where} ORDER BY last_active ASC, s.started_at ASC", params)]

    def count_open_prune_matches(self, older_than_days=None, source=None, **filters):
        """How many sessions still open match the same filters (prune skips them); 0 if none."""
        where, params = _prune_where(older_than_days, source, filters)
        return int(self._read_value(
            f"SELECT COUNT(*) FROM sessions AS s WHERE s.ended_at IS NULL{where}", params))

    def prune_sessions(self, older_than_days=90, source=None, sessions_dir=None,
                       exclude_active_write_guards=False, **filters):
        """Delete the ended sessions list_prune_candidates selects (children become roots),
        and their files in `sessions_dir`; returns how many. `exclude_active_write_guards`
        spares those under a live turn lease or compression lock. Ours, not hermes-agent's:
        `session_ids=[...]` deletes only those of them (the CLI's prune deletes no session
        it did not list when it asked)."""
        only = filters.pop("session_ids", None)
        where, params = _prune_where(older_than_days, source, filters)
        return self._delete_selected(
            f"SELECT s.id FROM sessions AS s WHERE {_ENDED}{where}", params, sessions_dir,
            only=None if only is None else set(only), spare_guarded=exclude_active_write_guards)

    def count_prune_matches(self, older_than_days=None, source=None, *, pinned_only=False,
                            **filters):
        """How many sessions list_prune_candidates selects; with `pinned_only`, how many pinned
        ones match the other filters (what a prune spares unless `include_pinned`)."""
        if pinned_only:
            filters["include_pinned"] = True
        where, params = _prune_where(older_than_days, source, filters)
        pinned = " AND COALESCE(s.pinned, 0) = 1" if pinned_only else ""
        return int(self._read_value(
            f"SELECT COUNT(*) FROM sessions AS s WHERE {_ENDED}{where}{pinned}", params))

    def sweep_orphaned_sessions(self, *, max_idle_seconds, sources=("tui", "desktop", "subagent"),
                                exclude_ids=(), exclude_pinned=False,
                                heartbeat_staleness_seconds=None,
                                heartbeat_ownership_grace_seconds=None,
                                respect_gateway_heartbeats=True):
        """End (ORPHAN_END_REASON) the open sessions of `sources` whose start and last activity
        are both older than `max_idle_seconds`, left open by a process that died; returns their
        ids. Spared: `exclude_ids`, pinned ones with `exclude_pinned`, any under a live turn lease
        or compression lock, and with `respect_gateway_heartbeats` any a backend with a heartbeat
        newer than `heartbeat_staleness_seconds` (default twice the idle time) could own: one
        started no later than the session plus `heartbeat_ownership_grace_seconds` (default the
        staleness). Messages stay; the session can be resumed."""
        wanted = [source for source in sources if source]
        if max_idle_seconds <= 0 or not wanted:
            return []
        staleness = heartbeat_staleness_seconds
        if not (staleness and staleness > 0):
            staleness = max_idle_seconds * 2
        grace = heartbeat_ownership_grace_seconds
        if grace is None or grace < 0:
            grace = staleness
        now = time.time()
        spared = {str(sid) for sid in exclude_ids if sid}
        binds = {f"source{n}": source for n, source in enumerate(wanted)}
        binds.update(cutoff=now - max_idle_seconds, fresh=now - staleness, grace=grace)
        clauses = [f"s.source IN ({', '.join(':source%d' % n for n in range(len(wanted)))})",
                   "s.ended_at IS NULL", "s.started_at < :cutoff",
                   f"{LAST_ACTIVE_SQL.format(a='s')} < :cutoff"]
        clauses += ["COALESCE(s.pinned, 0) = 0"] if exclude_pinned else []

        def write(conn):
            owned = []
            if respect_gateway_heartbeats and conn.execute(
                    TABLE_EXISTS_SQL, ("gateway_heartbeats",)).fetchone():
                owned = ["NOT EXISTS (SELECT 1 FROM gateway_heartbeats AS h"
                         " WHERE h.last_heartbeat >= :fresh"
                         " AND h.started_at <= s.started_at + :grace)"]
            found = [row[0] for row in conn.execute(
                f"SELECT s.id FROM sessions AS s WHERE {' AND '.join(clauses + owned)}", binds)]
            candidates = [sid for sid in found if sid not in spared]
            victims = [sid for sid in candidates if sid not in self._guarded_ids(conn, [sid])]
            for chunk in chunked(victims):
                conn.execute(f"UPDATE sessions SET ended_at = ?, end_reason = ?"
                             f" WHERE id IN ({placeholders(len(chunk))}) AND ended_at IS NULL",
                             (time.time(), ORPHAN_END_REASON, *chunk))
            return victims
        return self._execute_write(write)

    def archive_sessions(self, older_than_days=None, source=None, **filters):
        """Archive every session list_prune_candidates selects (only unarchived ones unless
        `archived` is given), each with its compression chain; returns how many matched."""
        filters.setdefault("archived", False)
        rows = self.list_prune_candidates(older_than_days, source, **filters)
        for row in rows:
            self.set_session_archived(row["id"], True)
        return len(rows)

    def archive_stale_sessions(self, idle_days, *, exclude_pinned=True):
        """Archive sessions, open or ended, whose heartbeat and newest message are older than
        `idle_days`, each with its compression chain (chain tips and standalone ones only); returns
        how many (0 if `idle_days` is None or negative)."""
        if idle_days is None or idle_days < 0:
            return 0
        pinned = " AND s.pinned = 0" if exclude_pinned else ""
        ids = [row[0] for row in self._read_all(
            "SELECT s.id FROM sessions AS s WHERE s.archived = 0 AND COALESCE(s.end_reason, '') <>"
            f" 'compression'{pinned} AND {LAST_ACTIVE_SQL.format(a='s')} < ?"
            " ORDER BY s.started_at ASC",
            (time.time() - float(idle_days) * 86400,))]
        for session_id in ids:
            self.set_session_archived(session_id, True)
        return len(ids)

    def maybe_auto_prune_and_vacuum(self, retention_days=90, min_interval_hours=24, vacuum=True,
                                    sessions_dir=None, min_vacuum_interval_days=30,
                                    min_vacuum_freelist_ratio=AUTO_VACUUM_MIN_FREELIST_RATIO):
        """Prune sessions inactive `retention_days` (none under a live turn lease or compression
        lock), then close the open sessions of AUTO_PRUNE_STALE_OPEN_SOURCES idle that long, at
        most once per `min_interval_hours`; returns {"skipped", "pruned", "closed", "vacuumed"},
        plus "error" instead of raising. A retention of None or below 0 skips. VACUUMs after a
        prune that deleted something, at most once per `min_vacuum_interval_days`, a store of at
        most AUTO_VACUUM_MAX_BYTES whose free pages are more than `min_vacuum_freelist_ratio` of
        it ("freelist_ratio" says how many were)."""
        result = {"skipped": False, "pruned": 0, "closed": 0, "vacuumed": False}
        if retention_days is None or retention_days < 0:
            logger.warning("state.db auto-maintenance skipped: retention_days=%r is below 0;"
                           " auto_prune: false is the switch that turns pruning off",
                           retention_days)
            return dict(result, skipped=True)

        def step(now):
            result["pruned"] = self.prune_sessions(
                older_than_days=retention_days, sessions_dir=sessions_dir,
                exclude_active_write_guards=True)
            result["closed"] = len(self.sweep_orphaned_sessions(
                max_idle_seconds=float(retention_days) * 86400,
                sources=AUTO_PRUNE_STALE_OPEN_SOURCES, exclude_pinned=True,
                respect_gateway_heartbeats=False))
            if not (vacuum and result["pruned"]) or _within(self.get_meta("last_vacuum"), now,
                                                             min_vacuum_interval_days * 86400):
                return
            size = store_file_bytes(self.db_path)
            if size > self.AUTO_VACUUM_MAX_BYTES:
                # VACUUM rewrites the file under the write lock, about 1 s per 50 MB here: past this
                # size only a command that says so first (optimize-storage) may hold it that long.
                logger.info(
                    "state.db is %.0f MB: no automatic VACUUM (it would hold the write lock for "
                    "seconds); `python -m hermes_state optimize-storage` reclaims the space",
                    size / 1e6)
                return
            pages, free = (self._read_value(f"PRAGMA {name}")
                           for name in ("page_count", "freelist_count"))
            result["freelist_ratio"] = ratio = free / pages if pages else 0.0
            if ratio <= min_vacuum_freelist_ratio:
                logger.debug("state.db: no VACUUM, %.0f%% of pages free (threshold %.0f%%)",
                             ratio * 100, min_vacuum_freelist_ratio * 100)
                return
            try:
                self.vacuum()
                result["vacuumed"] = True
                self.set_meta("last_vacuum", str(now))
            except Exception as exc:
                logger.warning("state.db VACUUM failed: %s", exc)
        return self._when_due(
            "last_auto_prune", min_interval_hours, "auto-maintenance", result, step)

    def maybe_auto_archive(self, idle_days=3, min_interval_hours=24, exclude_pinned=True):
        """archive_stale_sessions at most once per `min_interval_hours`; returns {"skipped",
        "archived"}, plus "error" when something failed: it never raises."""
        result = {"skipped": False, "archived": 0}

        def step(now):
            result["archived"] = self.archive_stale_sessions(
                idle_days, exclude_pinned=exclude_pinned)
        return self._when_due("last_auto_archive", min_interval_hours, "auto-archive", result, step)

    def _when_due(self, meta_key, min_interval_hours, what, result, step):
        """`result` after `step(now)`, or with "skipped" if state_meta `meta_key` is under
        `min_interval_hours` old; a failure is logged and put under "error", never raised."""
        try:
            now = time.time()
            if _within(self.get_meta(meta_key), now, min_interval_hours * 3600):
                result["skipped"] = True
                return result
            step(now)
            self.set_meta(meta_key, str(now))
        except Exception as exc:
            logger.warning("state.db %s failed: %s", what, exc)
            result["error"] = str(exc)
        return result

    # -- deleting ----------------------------------------------------------------

    def get_session_delete_targets(self, session_id):
        """[session_id, its delegate subagents sorted] as delete_session would remove them;
        [] if unknown."""
        if not self._read_one(SESSION_EXISTS_SQL, (session_id,)):
            return []
        delegates = _delegate_descendants(self._read_all(_DELEGATE_ROWS_SQL), [session_id])
        return [session_id] + sorted(delegates)

    def delete_session(self, session_id, sessions_dir=None, expected_delete_ids=None,
                       expected_display_messages=None, exclude_active_write_guards=False,
                       include_compression_chain=False):
        """Delete a session with its delegate subagents (other children become roots);
        False if unknown. Their files in `sessions_dir` go after the commit.

        Deletes nothing (False) when, as the write starts, `expected_delete_ids` are not exactly
        the session and its delegates, or a session of `expected_display_messages` ({id: the
        messages an export read, compacted ones included}) no longer reads so. With
        `exclude_active_write_guards`, raises SessionActiveWriteGuardError if a live turn lease
        or compression lock holds the session or a delegate. `include_compression_chain` deletes
        its whole compression chain as delete_sessions does."""
        if include_compression_chain:
            return self.delete_sessions(
                [session_id], sessions_dir, exclude_active_write_guards=exclude_active_write_guards,
                include_compression_chain=True) > 0
        expected = None if expected_delete_ids is None else set(expected_delete_ids)
        seen = self._transcripts_as_read(expected_display_messages or {})

        def write(conn):
            if not conn.execute(SESSION_EXISTS_SQL, (session_id,)).fetchone():
                return None
            delegates = _delegate_descendants(conn.execute(_DELEGATE_ROWS_SQL), [session_id])
            ids = sorted(delegates) + [session_id]
            if exclude_active_write_guards and self._guarded_ids(conn, ids):
                raise SessionActiveWriteGuardError(
                    f"session '{session_id}' (or a delegate child) has an active turn lease or"
                    " compression lock")
            if expected is not None and expected != delegates | {session_id}:
                return None
            if seen is None or any(_transcript_fingerprint(conn, sid) != fingerprint
                                   for sid, fingerprint in seen.items()):
                return None
            self._delete_sessions_in(conn, ids)
            return ids
        return self._delete_committed(write, sessions_dir) is not None

    def delete_sessions(self, session_ids, sessions_dir=None, exclude_active_write_guards=False,
                        skipped_ids=None, include_compression_chain=False):
        """Delete the given sessions that exist, with their delegates, in one transaction; returns
        how many of the given ones existed (non-text values are skipped).

        `include_compression_chain` takes each one's whole compression chain with it (a listing
        shows a chain as its tip). `exclude_active_write_guards` keeps every given session that
        a live turn lease or compression lock holds, on it, its chain (with
        `include_compression_chain`) or a delegate, and adds its id to `skipped_ids`."""
        wanted = list({sid for sid in session_ids or () if isinstance(sid, str) and sid})

        def write(conn):
            existing = [row[0] for chunk in chunked(wanted) for row in conn.execute(
                f"SELECT id FROM sessions WHERE id IN ({placeholders(len(chunk))})", chunk)]
            chains = (_compression_chains(conn, existing) if include_compression_chain
                      else {sid: {sid} for sid in existing})
            delegate_rows = conn.execute(_DELEGATE_ROWS_SQL).fetchall() if existing else []
            doomed = {sid: chains[sid] | _delegate_descendants(delegate_rows, chains[sid])
                      for sid in existing}
            if exclude_active_write_guards:
                guarded = self._guarded_ids(conn, set().union(*doomed.values()))
                kept = sorted(sid for sid in existing if doomed[sid] & guarded)
                if skipped_ids is not None:
                    skipped_ids.extend(kept)
                existing = [sid for sid in existing if sid not in kept]
            ids = sorted(set().union(*(doomed[sid] for sid in existing)))
            self._delete_sessions_in(conn, ids)
            return ids, existing
        removed, existing = self._execute_write(write) if wanted else ([], [])
        self._sweep_deleted_messages()
        _remove_transcripts(sessions_dir, removed)
        return len(existing)

    def _guarded_ids(self, conn, session_ids):
        """Inside a write: the ids of `session_ids` a live compression lock, or a live turn lease
        of their conversation, protects. An expired one found on the way is deleted, so that its
        late holder finds it gone, as hermes-agent reclaims it."""
        now, guarded = time.time(), set()
        for session_id in session_ids:
            key = self._turn_lease_key(conn, session_id)
            for table, column, name, sql in (
                    ("compression_locks", "session_id", session_id, SELECT_COMPRESSION_LOCK_SQL),
                    ("session_turn_leases", "conversation_id", key, _TURN_LEASE_SQL)):
                row = conn.execute(sql, (name,)).fetchone()
                if row is None:
                    continue
                if float(row["expires_at"] or 0) > now:
                    guarded.add(session_id)
                else:
                    conn.execute(f"DELETE FROM {table} WHERE {column} = ? AND holder IS ?",
                                 (name, row["holder"]))
        return guarded

    def _transcripts_as_read(self, expected):
        """{session id: _transcript_fingerprint} of each session of `expected` ({id: messages})
        whose messages (compacted ones included) read as given, unchanged while read; None if
        one does not."""
        seen = {}
        for session_id, messages in expected.items():
            before = self._with_reader(lambda conn: _transcript_fingerprint(conn, session_id))
            if before is None or self.get_messages(session_id, include_compacted=True) != messages:
                return None
            if self._with_reader(lambda conn: _transcript_fingerprint(conn, session_id)) != before:
                return None
            seen[session_id] = before
        return seen

    def delete_session_if_empty(self, session_id, sessions_dir=None):
        """Delete a session that has no title, no messages and no children; False otherwise."""
        def write(conn):
            empty = conn.execute(
                "SELECT 1 FROM sessions AS s WHERE s.id = ? AND s.title IS NULL"
                " AND NOT EXISTS (SELECT 1 FROM messages AS m WHERE m.session_id = s.id)"
                " AND NOT EXISTS (SELECT 1 FROM sessions AS c WHERE c.parent_session_id = s.id)",
                (session_id,)).fetchone()
            return bool(empty) and self._delete_sessions_in(conn, [session_id]) > 0
        deleted = self._execute_write(write)
        if deleted:
            self._sweep_deleted_messages()  # none of its own: its sweep key, and any left behind
            _remove_transcripts(sessions_dir, [session_id])
        return deleted

    def count_empty_sessions(self):
        """How many ended, unarchived sessions have no messages (what
        delete_empty_sessions removes)."""
        return self._read_value(f"SELECT COUNT(*) FROM sessions {_EMPTY_SESSIONS_WHERE}")

    def delete_empty_sessions(self, sessions_dir=None):
        """Delete every ended, unarchived session without messages; returns how many."""
        return self._delete_selected(
            f"SELECT id FROM sessions {_EMPTY_SESSIONS_WHERE}", (), sessions_dir)

    def prune_empty_ghost_sessions(self, sessions_dir=None):
        """Delete ended, untitled TUI sessions over a day old that never got a message;
        returns how many. Like hermes-agent, raises sqlite3.IntegrityError and deletes
        nothing if one of them has children."""
        return self._delete_selected(
            "SELECT id FROM sessions AS s"
            " WHERE source = 'tui' AND title IS NULL AND ended_at IS NOT NULL AND started_at < ?"
            " AND NOT EXISTS (SELECT 1 FROM messages AS m WHERE m.session_id = s.id)",
            (time.time() - 86400,), sessions_dir, refuse_parents=True)

    def _delete_selected(self, sql, params, sessions_dir, refuse_parents=False, only=None,
                         spare_guarded=False):
        """How many sessions `sql` selected (of `only`, when given; without those a live turn
        lease or compression lock holds, with `spare_guarded`) and _delete_committed deleted;
        with `refuse_parents`, sqlite3.IntegrityError and nothing deleted if one has children."""
        def write(conn):
            ids = [row[0] for row in conn.execute(sql, params) if only is None or row[0] in only]
            if spare_guarded:
                guarded = self._guarded_ids(conn, ids)
                ids = [sid for sid in ids if sid not in guarded]
            if refuse_parents and any(conn.execute(
                    "SELECT 1 FROM sessions"
                    f" WHERE parent_session_id IN ({placeholders(len(chunk))}) LIMIT 1",
                    chunk).fetchone() for chunk in chunked(ids)):
                raise sqlite3.IntegrityError("FOREIGN KEY constraint failed")
            self._delete_sessions_in(conn, ids)
            return ids
        return len(self._delete_committed(write, sessions_dir))

    def _delete_committed(self, write, sessions_dir):
        """The ids `write(conn)` deleted (None or [] if none), once committed,
        swept and files removed."""
        removed = self._execute_write(write)
        self._sweep_deleted_messages()
        _remove_transcripts(sessions_dir, removed)
        return removed

    def _delete_sessions_in(self, conn, session_ids):
        """Inside a write: how many of the sessions went, with their usage rows, topic bindings
        and unused prompts; children become roots, messages are marked for
        _sweep_deleted_messages (run after commit)."""
        bindings = conn.execute(TABLE_EXISTS_SQL, ("telegram_dm_topic_bindings",)).fetchone()
        deleted = 0
        for chunk in chunked(session_ids):
            marks = placeholders(len(chunk))
            if bindings:
                conn.execute(
                    f"DELETE FROM telegram_dm_topic_bindings WHERE session_id IN ({marks})", chunk)
            conn.execute(
                "UPDATE sessions SET parent_session_id = NULL"
                f" WHERE parent_session_id IN ({marks})", chunk)
            conn.execute(f"DELETE FROM session_model_usage WHERE session_id IN ({marks})", chunk)
            deleted += conn.execute(f"DELETE FROM sessions WHERE id IN ({marks})", chunk).rowcount
        self._sweep_later(conn, session_ids)
        if deleted:
            conn.execute(DELETE_UNUSED_PROMPTS_SQL)
        return deleted

    def _sweep_later(self, conn, session_ids):
        """Inside a write: mark the messages these ids have now for _sweep_deleted_messages (run
        after commit): a deleted session's, a discarded import's."""
        upto = conn.execute("SELECT MAX(id) FROM messages").fetchone()[0]
        # No key for a session without messages: its delete then takes no sweep transaction.
        has_messages = "SELECT 1 FROM messages WHERE session_id = ? LIMIT 1"
        marked = [sid for sid in session_ids if conn.execute(has_messages, (sid,)).fetchone()]
        for session_id in marked:
            write_meta(conn, SWEEP_META_PREFIX + session_id, str(upto))
        if marked:
            write_meta(conn, SWEEP_BEAT_META, str(time.time()))

    def _sweep_deleted_messages(self, prefix=SWEEP_META_PREFIX):
        """How many messages of deleted sessions (sweep key under `prefix`, this
        call's or left by another) went, DELETE_CHUNK_ROWS per transaction; only reads
        when nothing is left to sweep."""
        swept = 0
        while self._read_one(_SWEEP_PENDING_SQL, prefix_bounds(prefix)) is not None:
            if swept:
                pause_between_chunks()
            swept += self._execute_write(lambda conn: self._sweep_chunk(conn, prefix))
        return swept

    def _finish_abandoned_sweeps(self):
        """At a writable open, how many messages of sweeps a dead process left went; only reads when
        none is left or one went on under SWEEP_ALIVE_SECONDS ago.

        Readers are not filtered meanwhile (a filter in every message query costs more than it
        saves), so `get_messages` of a deleted id still returns its rows, as during any sweep; a
        session made again first sweeps its id (_sweep_before_reuse)."""
        if self._read_one(_SWEEP_PENDING_SQL, prefix_bounds(SWEEP_META_PREFIX)) is None \
                or _within(self.get_meta(SWEEP_BEAT_META), time.time(), self.SWEEP_ALIVE_SECONDS):
            return 0
        return self._sweep_deleted_messages()

    def _sweep_before_reuse(self, session_id):
        """How many messages a deletion of `session_id` (or of ids it prefixes) left went,
        before reuse."""
        return self._sweep_deleted_messages(SWEEP_META_PREFIX + session_id)

    def _sweep_chunk(self, conn, prefix):
        room = self.DELETE_CHUNK_ROWS
        write_meta(conn, SWEEP_BEAT_META, str(time.time()))
        sweeps = conn.execute(
            "SELECT key, CAST(value AS INTEGER) FROM state_meta WHERE key >= ? AND key < ?"
            " ORDER BY key LIMIT ?", (*prefix_bounds(prefix), SQL_CHUNK_SIZE)).fetchall()
        for key, upto in sweeps:
            ids = [row[0] for row in conn.execute(
                "SELECT id FROM messages WHERE session_id = ? AND id <= ? ORDER BY id LIMIT ?",
                (key[len(SWEEP_META_PREFIX):], upto or 0, room))]
            for chunk in chunked(ids):
                marks = placeholders(len(chunk))
                conn.execute(f"DELETE FROM messages WHERE id IN ({marks})", chunk)
            room -= len(ids)
            if room == 0:  # this session may have more: its key stays
                break
            conn.execute(DELETE_META_SQL, (key,))
        return self.DELETE_CHUNK_ROWS - room

    # -- reports -------------------------------------------------------------------

    def session_lifecycle_statuses(self, session_ids):
        """{id: 'complete', 'interrupted', 'error'} from each session's last message, 'empty'
        without messages (or unknown); {} for no ids."""
        ids = [sid for sid in session_ids or () if sid]
        statuses = dict.fromkeys(ids, SESSION_STATUS_EMPTY)
        for chunk in chunked(ids):
            rows = self._read_all(
                "SELECT m.session_id, m.role, m.tool_calls IS NOT NULL, m.finish_reason"
                " FROM messages AS m"
                " JOIN (SELECT MAX(id) AS last_id FROM messages WHERE session_id IN"
                f" ({placeholders(len(chunk))}) GROUP BY session_id) AS last"
                " ON m.id = last.last_id", chunk)
            statuses.update((row[0], classify_session_status(*row[1:])) for row in rows)
        return statuses

    def list_cron_job_runs(self, job_id, limit=20, offset=0):
        """Runs of cron job `job_id` (ids `cron_<job_id>_...`) as list_sessions_rich rows,
        newest first; [] if none."""
        rich = SESSION_RICH_SQL.format(columns="s.*", last_active=LAST_ACTIVE_SQL.format(a="s"))
        return self._resolved(self._read_all(
            rich + " WHERE s.source = 'cron' AND s.id >= ? AND s.id < ?"
            " ORDER BY s.started_at DESC, s.id DESC LIMIT ? OFFSET ?",
            (*prefix_bounds(f"cron_{job_id}_"), limit, offset)))

    def find_pr_url_messages(self, session_ids):
        """[{session_id, content}] of their tool results naming '/pull/',
        oldest first; [] if none."""
        ids = [sid for sid in session_ids if sid]
        # hermes-agent's chunks of 900, so that more ids than one chunk come back in the same order.
        return [dict(row) for chunk in chunked(ids, 900) for row in self._read_all(
            "SELECT session_id, content FROM messages"
            f" WHERE session_id IN ({placeholders(len(chunk))})"
            " AND role = 'tool' AND content LIKE '%/pull/%' ORDER BY id", chunk)]

    def list_skill_scaffolded_sessions(self, limit=200):
        """[{id, title, content}] of titled sessions whose first user turn (`content`) invoked
        /skill, newest first; [] if none."""
        return [dict(row) for row in self._read_all(
            "SELECT s.id, s.title, m.content FROM sessions AS s JOIN messages AS m ON m.id ="
            " (SELECT f.id FROM messages AS f WHERE f.session_id = s.id AND f.role = 'user'"
            " AND f.content IS NOT NULL ORDER BY f.timestamp, f.id LIMIT 1)"
            " WHERE s.title IS NOT NULL AND m.content LIKE ? ORDER BY s.started_at DESC LIMIT ?",
            (SKILL_SCAFFOLD_PREFIX + "%", int(limit)))]

    def logical_size_bytes(self):
        """page_count * page_size: the store's size once its WAL is checkpointed;
        None if unreadable."""
        try:
            pages = int(self._read_value("PRAGMA page_count"))
            return pages * int(self._read_value("PRAGMA page_size"))
        except Exception as exc:
            logger.debug("could not read the logical size of %s: %s", self.db_path, exc)
            return None

    # -- one-shot fixes ---------------------------------------------------------------

    def backfill_repo_roots(self, cwd_to_root):
        """Record `cwd_to_root[cwd]` as git_repo_root of sessions in that cwd that have none;
        returns None."""
        pairs = [(root, cwd) for cwd, root in cwd_to_root.items() if root and cwd]
        if pairs:
            self._execute_write(lambda conn: conn.executemany(
                "UPDATE sessions SET git_repo_root = ?"
                " WHERE cwd = ? AND COALESCE(git_repo_root, '') = ''", pairs))

    def retag_kanban_worker_sessions(self, workspaces_root):
        """How many 'cli' sessions at or under `workspaces_root` became 'kanban';
        0 if that root was done."""
        prefix = str(workspaces_root).rstrip("/\\")
        gate = f"kanban_worker_source_retagged:{prefix}"
        if not prefix or self.get_meta(gate) == "1":
            return 0

        def write(conn):
            count = conn.execute(
                "UPDATE sessions SET source = 'kanban' WHERE source = 'cli' AND (cwd = ?"
                " OR cwd LIKE ? ESCAPE '\\')", (prefix, escape_like(prefix) + "/%")).rowcount
            write_meta(conn, gate, "1")
            return count
        return self._execute_write(write)

    def purge_stale_tool_call_markers(self, *, dry_run=False, backup=True):
        """{"dry_run", "rows_affected", "row_ids", "backup_path"} after emptying assistant tool-call
        rows whose content is only a stale "[name]" marker. A dry run writes nothing; with `backup`,
        the store is first copied (VACUUM INTO) to `<name>.pre-clean-markers-backup-<time>`."""
        def affected(rows):
            return [row[0] for row in rows
                    if isinstance(row[1], str) and STALE_MARKER.fullmatch(row[1].strip())]

        candidates = ("SELECT id, content FROM messages WHERE role = 'assistant'"
                      " AND tool_calls IS NOT NULL AND tool_calls != ''")
        ids = affected(self._read_all(candidates))
        report = {"dry_run": bool(dry_run), "rows_affected": len(ids), "row_ids": ids,
                  "backup_path": None}
        if dry_run or not ids:
            return report
        if backup:
            report["backup_path"] = str(self._vacuum_into_beside("pre-clean-markers-backup"))

        def write(conn):
            found = affected(conn.execute(candidates))
            for chunk in chunked(found):
                marks = placeholders(len(chunk))
                conn.execute(f"UPDATE messages SET content = '' WHERE id IN ({marks})", chunk)
            return found
        report["row_ids"] = self._execute_write(write)
        report["rows_affected"] = len(report["row_ids"])
        return report

    def _vacuum_into_beside(self, label):
        """A consistent copy of the store, made by SQLite, as
        `<name>.<label>-<time>[_n]`, owner-only."""
        target = claim_file_beside(self.db_path, label)
        self._read_value("VACUUM INTO ?", (str(target),))
        return target

    # -- vacuum, stats and doctor ----------------------------------------------------

    def vacuum(self):
        """How many search indexes were merged (0 if merging failed) before rewriting the file
        without free pages and truncating the WAL (unless the replicator checkpoints)."""
        self._flush_token_counts()
        try:
            merged = self.optimize_fts()
        except Exception as exc:
            logger.warning("FTS optimize before VACUUM failed: %s", exc)
            merged = 0
        # Said before it starts: nothing else can write until the whole file is rewritten.
        logger.info("VACUUM of %s (%.0f MB) holds the write lock until it ends; other writers wait",
                    self.db_path, store_file_bytes(self.db_path) / 1e6)

        def run(conn):
            conn.execute("VACUUM")
            if self.policy.checkpoint != "external":  # only the replicator checkpoints then
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._execute_write(run, transaction=False)
        return merged

    def schema_version(self):
        """The store's schema version (hermes-agent's numbering); None if it has none."""
        return self._read_value(SELECT_SCHEMA_VERSION_SQL)

    def stats(self):
        """Counts and sizes for `stats`: sessions, messages, sources, file size, versions."""
        self._flush_token_counts()
        by_source = {row[0]: row[1] for row in self._read_all(
            "SELECT source, COUNT(*) FROM sessions GROUP BY source ORDER BY source")}
        where, size = self._store_location()
        return {"db_path": where, "db_bytes": size,
                "sessions": sum(by_source.values()), "sessions_by_source": by_source,
                "messages_active": self._read_value(
                    "SELECT COUNT(*) FROM messages WHERE active = 1"),
                "messages_total": self._read_value(COUNT_ALL_MESSAGES_SQL),
                "schema_version": self.schema_version(), "fts_layout": self.fts_layout()}

    def _store_location(self):
        """The store as its user names it, and its bytes: a replica's URL and the
        pages SQLite reads through the VFS (open_replica has no local file), else the
        path and the file with its WAL."""
        url = getattr(self._connect, "replica_url", None)
        if url is None:
            return str(self.db_path), store_file_bytes(self.db_path)
        pages = self._read_value("PRAGMA page_count")
        return url, pages * self._read_value("PRAGMA page_size")

    def doctor(self, full=False):
        """Integrity, layouts, journal and runtime facts; `ok` is False on damage, `trigger_damage`
        included. Never raises on a damaged file: a check that cannot run reports why.

        `integrity_check` holds what SQLite's quick_check finds (every page and record, in a
        third of the time), or with `full` its integrity_check, which also matches every index
        entry to its row; `check` names the one that ran."""
        check = "integrity_check" if full else "quick_check"
        # The check reads every page; the rest is read on another connection meanwhile (SQLite
        # lets go of the GIL), so the whole takes about as long as the check alone.
        found = []
        checking = threading.Thread(target=lambda: found.append(_checked(
            lambda: [row[0] for row in self._read_all(f"PRAGMA {check}")])), name="doctor")
        checking.start()
        report = {
            "db_path": self._store_location()[0],
            "check": check,
            "integrity_check": None,  # (the check's answer, in its place when it is in)
            "ok": None,
            "sqlite_version": sqlite3.sqlite_version,
            "fts5": self.fts_caps.fts5,
            "trigram": self.fts_caps.trigram,
            "wal_reset_bug": sqlite_has_wal_reset_bug(),
            "journal_mode": _checked(lambda: self._read_value(JOURNAL_MODE_SQL)),
            "journal_policy": self.policy.reason,
            "checkpoint_mode": _checked(self._checkpoint_mode),
            "schema_version": _checked(self.schema_version),
            "schema_version_of_release": SCHEMA_VERSION,
            "stale_schema": self.stale_schema,
            "repairs_at_open": self.repairs,
        }
        search = _checked(self.search_health)
        report.update(search if isinstance(search, dict) else {"search_health": search})
        report["staged_import"] = _checked(self.staged_import)
        checking.join()
        report["integrity_check"] = found[0]
        report["ok"] = found[0] == ["ok"] and not report.get("trigger_damage")
        return report

    # -- hermes-agent's CJK index names, answering for our CJK side index ---------

    def fts_cjk_rebuild_status(self):
        """fts_rebuild_status() while our CJK side index is backfilled (one backfill fills all our
        indexes); None when none runs, or searches use hermes-agent's index (its CJK one needs a
        tokenizer ours lacks)."""
        status = self.fts_rebuild_status()
        return status if status is not None and self.fts_layout() == "current" else None

    def fts_cjk_rebuild_step(self):
        """One step (fts_rebuild_step) of the backfill fts_cjk_rebuild_status reports; True while
        it still runs, False when none did. Our CJK side index needs no tokenizer extension."""
        if self.fts_cjk_rebuild_status() is None:
            return False
        self.fts_rebuild_step()
        return self.fts_cjk_rebuild_status() is not None


# The compression ancestors of every session a prune's filters leave: a compressed-away segment
# ages with its conversation, so while a later segment stays it stays too (0.22's whole_lineages).
_KEPT_ANCESTORS_SQL = """WITH RECURSIVE kept(id) AS (
SELECT p.id FROM sessions AS c JOIN sessions AS p ON p.id = c.parent_session_id
WHERE p.end_reason = 'compression'
  AND NOT EXISTS (SELECT 1 FROM sessions AS s WHERE s.id = c.id AND {selected})
UNION
SELECT p.id FROM kept AS k JOIN sessions AS c ON c.id = k.id
JOIN sessions AS p ON p.id = c.parent_session_id WHERE p.end_reason = 'compression')
SELECT id FROM kept"""
# hermes-agent 0.22's keywords beside the filters: `include_pinned` (a pin is a keep unless
# asked), `lineage_tips_only` (a bulk archive matches a chain by its tip, never an old
# ancestor on its own), `whole_lineages` (see _KEPT_ANCESTORS_SQL).
_PRUNE_SCOPES = ("include_pinned", "lineage_tips_only", "whole_lineages")


def _prune_where(older_than_days, source, filters):
    """(" AND ..." conditions, params) of hermes-agent's prune filters; pinned sessions are
    left out unless `include_pinned` (a pin is a keep, as in 0.22). TypeError for an unknown
    filter."""
    unknown = sorted(set(filters) - set(_PRUNE_FILTERS) - set(_PRUNE_SCOPES))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
    filters = dict(filters, source=source)
    include_pinned, tips_only, whole = (filters.pop(name, False) for name in _PRUNE_SCOPES)
    where, params = _filter_where(older_than_days, filters)
    where += "" if include_pinned else " AND COALESCE(s.pinned, 0) = 0"
    where += " AND COALESCE(s.end_reason, '') <> 'compression'" if tips_only else ""
    if whole:
        kept = _KEPT_ANCESTORS_SQL.format(selected=_ENDED + where)
        return f"{where} AND s.id NOT IN ({kept})", [*params, *params]
    return where, params


def _filter_where(older_than_days, filters):
    """The conditions of the filters themselves (and the age `older_than_days` stands for)."""
    if older_than_days is not None and filters.get("last_active_before") is None \
            and filters.get("started_before") is None:
        filters["last_active_before"] = time.time() - older_than_days * 86400
    where, params = "", []
    for name, (kind, sql) in _PRUNE_FILTERS.items():
        value = filters.get(name)
        if kind == "flag":
            where += f" AND s.archived = {int(value)}" if value is True or value is False else ""
        elif value is not None and (value or kind == "bound"):
            if kind == "cwd":
                clause, values = cwd_prefix_clause(value)
            else:
                clause, values = sql, [_PRUNE_PARAM[kind](value)]
            where += " AND " + clause
            params.extend(values)
    return where, params


def _within(stamp, now, seconds):
    """True if the state_meta time `stamp` is less than `seconds` before `now`;
    False if absent or garbled."""
    try:
        return bool(stamp) and now - float(stamp) < seconds
    except (TypeError, ValueError):
        return False


def _compression_chains(conn, session_ids):
    """{id: the ids of its compression chain, both ways and every continuation, itself included}
    for each of `session_ids`. A fork (branch, delegate, tool or reset child) is no link."""
    links = collections.defaultdict(set)
    for row in conn.execute(_CONTINUATION_LINKS_SQL):
        if not is_fork_child(row) and json_object(row["model_config"]).get("_reset_from") is None:
            links[row["id"]].add(row["parent_session_id"])
            links[row["parent_session_id"]].add(row["id"])
    chains = {}
    for session_id in session_ids:
        chain, frontier = {session_id}, [session_id]
        while frontier:
            frontier = [linked for node in frontier for linked in links[node] - chain]
            chain.update(frontier)
        chains[session_id] = chain
    return chains


def _transcript_fingerprint(conn, session_id):
    """A digest of every message row of the session, every column; None for an unknown session."""
    if not conn.execute(SESSION_EXISTS_SQL, (session_id,)).fetchone():
        return None
    rows = conn.execute("SELECT * FROM messages WHERE session_id = ? ORDER BY id", (session_id,))
    import hashlib  # here, not at import: OpenSSL's start-up, for a rare check
    return hashlib.sha256(repr([tuple(row) for row in rows]).encode()).hexdigest()


def _delegate_descendants(rows, parent_ids):
    """Ids of the delegate subagents under `parent_ids` at any depth, never the parents; `rows` are
    (id, parent_session_id, model_config). A delegate's model_config has "_delegate_from": its child
    is one whose marker names it, or which has a marker and it as parent_session_id."""
    marked = []
    for session_id, parent, config in rows:
        try:
            marker = json.loads(config).get("_delegate_from")
        except (TypeError, ValueError, AttributeError):
            continue
        if marker is not None:
            marked.append((session_id, parent, marker if isinstance(marker, str) else None))
    found = frontier = set(parent_ids)
    while frontier:
        frontier = {sid for sid, parent, marker in marked
                    if sid not in found and (marker in frontier or parent in frontier)}
        found = found | frontier
    return found - set(parent_ids)


def _remove_transcripts(sessions_dir, session_ids):
    """Remove each session's `<id>.json`, `<id>.jsonl` and `request_dump_<id>_*.json` from
    `sessions_dir` as hermes-agent does; a file that will not go stays, an id reaching
    outside the folder is skipped."""
    if sessions_dir is None or not session_ids:
        return
    import glob  # here, not at import: only a delete with a sessions folder escapes names
    folder = Path(sessions_dir)
    for session_id in map(str, session_ids):
        if Path(session_id).is_absolute() or ".." in Path(session_id).parts:
            continue
        dumps = []
        with contextlib.suppress(OSError, ValueError):
            dumps = list(folder.glob(f"request_dump_{glob.escape(session_id)}_*.json"))
        for path in [folder / f"{session_id}.json", folder / f"{session_id}.jsonl"] + dumps:
            with contextlib.suppress(OSError):
                path.unlink()


# A session's lifecycle as session_lifecycle_statuses gives it (hermes-agent's names and values).
SESSION_STATUS_COMPLETE, SESSION_STATUS_INTERRUPTED = "complete", "interrupted"
SESSION_STATUS_ERROR, SESSION_STATUS_EMPTY = "error", "empty"


def classify_session_status(role, has_tool_calls, finish_reason):
    """'error', 'interrupted' or 'complete' for a session whose last message has these fields."""
    if (finish_reason or "").strip().lower() in ("error", "agent_error", "content_filter"):
        return SESSION_STATUS_ERROR
    role = (role or "").strip().lower()
    interrupted = role in ("user", "tool") or role == "assistant" and has_tool_calls
    return SESSION_STATUS_INTERRUPTED if interrupted else SESSION_STATUS_COMPLETE


def _checked(read):
    """`read()`, or what stopped it, for a report about a store that may be damaged."""
    try:
        return read()
    except sqlite3.DatabaseError as exc:
        return [f"could not run: {exc}"]
