"""Compression and resume: the lineage of a compacted conversation, and what a resume loads.

Owns compaction (which rows it summarises is the coverage mixin's answer), publishing a
continuation, lineage reads, where a resume lands, the resume and export caps, the compressor's
durable guards, conversation-wide model_config keys, reopening a deliberately closed session, and
adopting a lineage from another profile's store (through import_sessions, and the donor's own
end/archive methods). Relies on SessionDB's read/write paths, `get_messages_as_conversation`.
Never changes a session's fields beyond its counts, model_config and end, nor the search indexes
or the schema. Fork markers are read in Python, not with JSON1, so every SQLite build walks a
lineage alike.
"""

import json
import logging
import sqlite3
import time

from hermes_state_common import (
    COMPRESSION_END_REASON, INSERT_SYSTEM_PROMPT_SQL, LAST_ACTIVE_SQL, LINEAGE_MAX_HOPS,
    SELECT_COMPRESSION_LOCK_SQL, SET_MESSAGE_COUNTS_SQL, _RESET_END_REASONS, chunked,
    cwd_prefix_clause, escape_like, has_fork_marker, is_fork_child, json_object, loads_or,
    merge_model_config, placeholders, resolved_max_export_messages, resolved_max_resume_messages,
)
from hermes_state_errors import (
    CompressionSessionBusyError, SessionCompressionInProgressError, SessionExportTooLargeError,
    SessionInputTypeError, SessionResumeTooLargeError, SessionRowError,
)
from hermes_state_schema import prompt_hash

logger = logging.getLogger("hermes_state")

# How many sessions a resume looks at down child links: far beyond any real chain, short enough for
# damaged links.
RESUME_MAX_DEPTH = 32
# A continuation this old with no API call was abandoned (hermes-agent's #20001).
ORPHANED_CONTINUATION_AGE = 7 * 86400
# The continuations of a compressed parent, best first: ones that compressed again, then live ones,
# then the most recently active.
_TIP_CANDIDATES_SQL = f"""
SELECT c.id, c.model_config FROM sessions AS p JOIN sessions AS c ON c.parent_session_id = p.id
WHERE p.id = ? AND p.end_reason = 'compression' AND COALESCE(c.source, '') <> 'tool'
ORDER BY CASE WHEN c.end_reason = 'compression' THEN 0 WHEN c.ended_at IS NULL THEN 1 ELSE 2 END,
         {LAST_ACTIVE_SQL.format(a="c")} DESC, c.started_at DESC, c.id DESC"""
_SET_COOLDOWN_SQL = ("UPDATE sessions SET compression_failure_cooldown_until = ?,"
                     " compression_failure_error = ? WHERE id = ?")
# The live messages written after a compressor's snapshot (id > watermark, up to an optional
# ceiling); none without a watermark, as `id > NULL` is never true.
_TAIL_SQL = ("SELECT id, tool_calls FROM messages WHERE session_id = ? AND active = 1 AND id > ?"
             " AND id <= COALESCE(?, id) ORDER BY id")
# What a compression child takes from its parent as it is.
_INHERITED_COLUMNS = ("git_branch", "git_repo_root", "user_id", "session_key", "chat_id",
                      "chat_type", "thread_id", "display_name", "origin_json")
# model_config keys of the whole conversation, not of one segment: a continuation takes them from
# its parent (hermes-agent's onboarding record reads them by this name).
_CONVERSATION_MODEL_CONFIG_KEYS = ("onboarding_run",)
# End stamps of hermes-agent's automatic cleanup (shutdown, disconnect, reaps, evictions), as
# against a deliberate close; and the deliberate conversation boundaries (a reset, CLI /new) that a
# reopen must never undo. -> hermes_state_common, beside _RESET_END_REASONS
_AUTOMATIC_END_REASONS = frozenset((
    "agent_close", "ws_orphan_reap", "superseded_by_resume", "startup_orphan_reap",
    "tui_shutdown", "ws_disconnect", "idle_timeout", "lru_evict"))
_BOUNDARY_END_REASONS = frozenset(_RESET_END_REASONS) | {"new_session"}
# A donor session an adoption moved to another profile's store: not a recoverable end.
ADOPTED_END_REASON = "adopted_by_profile"


class SessionCompressionMixin:
    """SessionDB's methods for compaction, compression lineage and resume.

    Relies on: `_execute_write`, `_read_all`, `_read_one`, `_read_value`, `_update_rows`,
    `_closed` (SessionDB); `_flush_token_counts` (usage mixin); `_insert_message_rows`,
    `_execute_transcript_write`, `_session_lineage_root_to_tip`, `get_messages_as_conversation`
    (messages mixin);
    `_read_sessions`, `get_session`, `reopen_session`, `end_session`, `set_session_archived`,
    `_listing_sql` (sessions mixin); `import_sessions`, `export_session_lineage`
    (portability mixin); `_resolve_carried_row_ids`, `_proved_coverage`,
    `_uncounted_merged_rows`, `_tail_originals` (coverage mixin)."""

    # -- lineage ----------------------------------------------------------------
    def get_conversation_root(self, session_id):
        """The id at the top of the session's parent links (any kind of parent);
        the id itself if it has none."""
        return self._session_lineage_root_to_tip(session_id)[0]

    def get_compression_tip(self, session_id):
        """The newest continuation (never a fork) of `session_id`'s compression chain;
        else the id itself."""
        return self._with_reader(lambda conn: self._compression_tip_on(conn, session_id))

    def get_compression_chain(self, session_id):
        """`session_id` and the continuations compression made of it, in order, through the tip
        get_compression_tip names; [session_id] when there is none."""
        return self._with_reader(lambda conn: self._compression_path_on(conn, session_id))

    def _compression_tip_on(self, conn, session_id):
        """get_compression_tip read on `conn`: inside a write, no rotation can publish between
        finding the tip and writing to it."""
        return self._compression_path_on(conn, session_id)[-1]

    def _compression_path_on(self, conn, session_id):
        def best_continuation(parent_id):
            # Through the listing shim: a read-only 0.19 store has no last_activity_at.
            rows = conn.execute(self._listing_sql(_TIP_CANDIDATES_SQL), (parent_id,)).fetchall()
            continuations = (row["id"] for row in rows if not has_fork_marker(row["model_config"]))
            return next(continuations, None)
        return self._descend(session_id, best_continuation, LINEAGE_MAX_HOPS)

    def _is_compression_child_row(self, child):
        """True when a session row (a dict) continues a parent that compression ended, rather than
        forking it (branch, delegate, reset or tool child) or having no parent."""
        parent_id = child.get("parent_session_id")
        if not parent_id or not _continues(child):
            return False
        return self._read_value("SELECT end_reason FROM sessions WHERE id = ?",
                                (parent_id,)) == COMPRESSION_END_REASON

    def _descend(self, session_id, next_child, hops):
        """[session_id, child, ...] by `next_child(id)`, at most `hops` steps,
        stopping before a loop."""
        path = [session_id]
        for _ in range(hops):
            child = next_child(path[-1])
            if not child or child in path:
                break
            path.append(child)
        return path

    def get_compression_lineage(self, session_id):
        """[root, ..., tip] ids of the compression chain through `session_id`; [] for an unknown id.
        A fork (branch, delegate or tool child) is its own chain of one; each compressed segment
        continues in its oldest continuation child."""
        links = ("SELECT id, source, model_config, parent_session_id, end_reason FROM sessions"
                 " WHERE ")
        session = self._read_one(links + "id = ?", (session_id,))
        if session is None:
            return []
        if is_fork_child(session):
            return [session_id]
        root, ancestors = session, {session_id}
        # Up while the row continues a parent that ended by compression
        # (a fork of a parent never does).
        while root["parent_session_id"] and not is_fork_child(root):
            parent = self._read_one(links + "id = ?", (root["parent_session_id"],))
            if (parent is None or parent["end_reason"] != COMPRESSION_END_REASON
                    or parent["id"] in ancestors):
                break
            root = parent
            ancestors.add(root["id"])
        lineage, current = [root["id"]], root
        while current["end_reason"] == COMPRESSION_END_REASON:
            children = self._read_all(links + "parent_session_id = ? ORDER BY started_at",
                                      (current["id"],))
            child = next((row for row in children if not is_fork_child(row)), None)
            if child is None or child["id"] in lineage:
                break
            lineage.append(child["id"])
            current = child
        return lineage if session_id in lineage else [session_id]

    # -- resume -----------------------------------------------------------------
    def search_sessions(self, source=None, limit=20, offset=0, workspace_key=None):
        """Sessions most recently active first, with `last_active` and `system_prompt`; []
        when none match. `source` is one source or several (0.22: the CLI family's); a
        `workspace_key` keeps one workspace's: a git repo root, or a cwd under it for sessions
        without one."""
        clauses, params = [], []
        if source:
            sources = [source] if isinstance(source, str) else list(source)
            clauses.append(f"s.source IN ({placeholders(len(sources))})")
            params += sources
        if workspace_key:
            prefix = workspace_key.rstrip("/\\") or workspace_key
            clause, clause_params = cwd_prefix_clause(prefix)
            clauses.append(
                f"(s.git_repo_root = ? OR (COALESCE(s.git_repo_root, '') = '' AND {clause}))")
            params += [prefix, *clause_params]
        where = (" WHERE " + " AND ".join(clauses)) if clauses else ""
        self._flush_token_counts()
        return self._read_sessions(
            f", {LAST_ACTIVE_SQL.format(a='s')} AS last_active",
            f"{where} ORDER BY last_active DESC, s.started_at DESC, s.id DESC LIMIT ? OFFSET ?",
            (*params, limit, offset))

    def resolve_resume_session_id(self, session_id):
        """The session a resume of `session_id` loads: the deepest continuation
        holding messages (the compression tip, then newest children not forks, resets
        or tool runs); else the id itself."""
        if not session_id:
            return session_id
        path = self._descend(self.get_compression_tip(session_id) or session_id,
                             self._resume_child, RESUME_MAX_DEPTH - 1)
        used = [sid for sid in path
                if self._read_value("SELECT 1 FROM messages WHERE session_id = ? LIMIT 1", (sid,))]
        return used[-1] if used else path[0]

    def _resume_child(self, parent_id):
        parent = self._read_one(
            "SELECT end_reason, session_key FROM sessions WHERE id = ?", (parent_id,))
        reset_parent = parent is not None and parent["end_reason"] in _RESET_END_REASONS
        rows = self._read_all(
            "SELECT id, source, model_config, session_key FROM sessions"
            " WHERE parent_session_id = ? ORDER BY started_at DESC, id DESC", (parent_id,))
        for row in rows:
            legacy_reset = (reset_parent and row["session_key"]
                            and row["session_key"] == parent["session_key"])
            reset_child = json_object(row["model_config"]).get("_reset_from") is not None
            fork = has_fork_marker(row["model_config"]) or row["source"] == "tool"
            if not (fork or reset_child or legacy_reset):
                return row["id"]
        return None

    def get_resume_conversations(self, session_id):
        """(model_history, display_history) for a resume, both with `_row_id`; ([], [])
        for an unknown session. The first is its own active messages, alternation
        repaired; the second its lineage."""
        model = self.get_messages_as_conversation(
            session_id, repair_alternation=True, include_row_ids=True)
        display = self.get_messages_as_conversation(
            session_id, include_ancestors=True, include_row_ids=True)
        return model, display

    def get_resume_message_count(self, session_id):
        """Active messages a full resume would load, across the lineage;
        0 for an unknown session."""
        ids = self._session_lineage_root_to_tip(session_id)
        return self._read_value(
            f"SELECT COUNT(*) FROM messages WHERE session_id IN ({placeholders(len(ids))})"
            " AND active = 1", ids)

    def assert_resume_safe(self, session_id, max_messages=None, *, tip_only=False):
        """The lineage's active message count (0 when the cap is 0, off);
        SessionResumeTooLargeError past `max_messages` (default: config.yaml's
        sessions.max_resume_messages); ValueError if negative. `tip_only` counts the session's own
        active rows, for a resume that loads only them: a much compressed lineage is no refusal."""
        count, limit = self._capped_count(
            max_messages, resolved_max_resume_messages,
            lambda: [session_id] if tip_only else self._session_lineage_root_to_tip(session_id))
        if count > limit:
            raise SessionResumeTooLargeError(
                count, limit, scope="in its tip segment" if tip_only else "across its lineage")
        return count

    def assert_export_safe(self, session_id, max_messages=None):
        """The session's own active message count (0 when the cap is 0, off);
        SessionExportTooLargeError past `max_messages` (default: config.yaml's
        sessions.max_export_messages); ValueError if negative."""
        count, limit = self._capped_count(max_messages, resolved_max_export_messages,
                                          lambda: [session_id])
        if count > limit:
            raise SessionExportTooLargeError(session_id, count, limit)
        return count

    def _capped_count(self, max_messages, resolve, session_ids):
        """(active messages of `session_ids()` counted to the cap + 1, the cap);
        (0, 0) when it is off."""
        limit = resolve() if max_messages is None else max_messages
        if limit < 0:
            raise ValueError(f"max_messages must be >= 0, not {limit}")
        if limit == 0:
            return 0, 0
        ids = session_ids()
        count = self._read_value(
            "SELECT COUNT(*) FROM (SELECT 1 FROM messages"
            f" WHERE session_id IN ({placeholders(len(ids))}) AND active = 1 LIMIT ?)",
            (*ids, limit + 1))
        return count, limit

    # -- compaction -------------------------------------------------------------
    def get_active_message_watermark(self, session_id):
        """The id of the session's newest active message; 0 when it has none."""
        return self._read_value(
            "SELECT COALESCE(MAX(id), 0) FROM messages WHERE session_id = ? AND active = 1",
            (session_id,))

    def archive_and_compact(self, session_id, compacted_messages, model_config_patch=None,
                            watermark=None, lock_holder=None, tail_count=0,
                            carried_messages=None, covered_ids=None, unresolved_held=None):
        """Replace the live transcript with `compacted_messages` in one transaction; returns the
        new active count. Rows the compressor summarised stay, compacted (searchable); a row
        that lives on after the new set is copied there (a fresh id) and its original rewound
        (active 0, compacted 0), so search finds it once.

        Which rows were summarised: with `covered_ids` (the row ids the compressor held) and
        `unresolved_held` (held dicts without one, named by the coverage mixin), exactly those;
        every other live row is copied after the new set. Without them, or when a held stored
        row cannot be named, every live row up to `watermark`; rows after it are copied after
        the new set. The last `tail_count` compacted dicts and `carried_messages` are copies of
        held rows (by `_row_id`, else a unique identity and timestamp): their originals are
        rewound. Raises SessionCompressionInProgressError when `lock_holder` no longer holds the
        compression lock, SessionRowError (a ValueError) for an unknown session unless nothing
        is written."""
        messages = _message_dicts("compacted_messages", compacted_messages)
        if model_config_patch is not None and not isinstance(model_config_patch, dict):
            raise SessionInputTypeError("model_config_patch must be a dict or None, not "
                                        f"{type(model_config_patch).__name__}")
        watermark = None if watermark is None else int(watermark)
        tail_count = int(tail_count or 0)

        def write(conn):
            if lock_holder is not None and not _holds_lock(conn, session_id, lock_holder):
                raise SessionCompressionInProgressError(
                    f"compression lock of session {session_id!r} was lost before commit; "
                    "the compaction was not published")
            row = conn.execute(
                "SELECT model_config FROM sessions WHERE id = ?", (session_id,)).fetchone()
            if row is None:
                if model_config_patch is not None or messages:
                    raise SessionRowError(
                        f"session {session_id!r} does not exist; nothing was compacted")
                return 0
            # (the coverage mixin's, asked only when there is something to name)
            carried = (self._resolve_carried_row_ids(conn, session_id, carried_messages)
                       if carried_messages else [])
            proved = None if covered_ids is None else self._proved_coverage(
                conn, session_id, covered_ids, unresolved_held, watermark)
            if proved is None:
                rewound, copied = self._rows_past_watermark(
                    conn, session_id, watermark, tail_count, messages)
            else:
                rewound, copied = self._rows_not_held(
                    conn, session_id, set(proved[0]) | set(carried), tail_count, proved[1])
            rewound = list(dict.fromkeys([*carried, *rewound, *copied]))
            for chunk in chunked(rewound):
                conn.execute("UPDATE messages SET active = 0, compacted = 0"
                             f" WHERE session_id = ? AND id IN ({placeholders(len(chunk))})",
                             (session_id, *chunk))
            conn.execute(
                "UPDATE messages SET active = 0, compacted = 1 WHERE session_id = ? AND active = 1",
                (session_id,))
            count, calls = self._insert_message_rows(conn, session_id, messages,
                                                     callers=True)
            tail = [dict(id=row_id, tool_calls=tool_calls) for row_id, tool_calls in copied.items()]
            count, calls = count + len(tail), calls + _copy_tail(conn, tail, session_id)
            sets, params = "message_count = ?, tool_call_count = ?", [count, calls]
            if model_config_patch is not None:
                sets += ", model_config = ?"
                params.append(merge_model_config(row["model_config"], model_config_patch))
            conn.execute(f"UPDATE sessions SET {sets} WHERE id = ?", (*params, session_id))
            return count
        return self._execute_transcript_write(write, messages)

    def _rows_past_watermark(self, conn, session_id, watermark, tail_count, messages):
        """Inside a compaction without proved coverage: (the originals of the last `tail_count`
        dicts: the newest live rows at or below the watermark, widened by the rows a merged dict
        stands for; {id: tool_calls} of the live rows after the watermark, none without one)."""
        copied = {} if watermark is None else dict(
            (row["id"], row["tool_calls"])
            for row in conn.execute(_TAIL_SQL, (session_id, watermark, None)))
        if tail_count <= 0:
            return [], copied
        width = tail_count + self._uncounted_merged_rows(messages[-tail_count:])
        bound = "" if watermark is None else " AND id <= :watermark"
        rows = conn.execute(f"SELECT id FROM messages WHERE session_id = :session_id"
                            f" AND active = 1{bound} ORDER BY id DESC LIMIT :width",
                            {"session_id": session_id, "watermark": watermark, "width": width})
        return [row[0] for row in rows], copied

    def _rows_not_held(self, conn, session_id, held, tail_count, merged_away):
        """Inside a compaction with proved coverage: (the originals of the last `tail_count` dicts
        among the `held` live rows; {id: tool_calls} of the live rows not held, which live on)."""
        live = conn.execute("SELECT id, tool_calls FROM messages WHERE session_id = ?"
                            " AND active = 1 ORDER BY id", (session_id,)).fetchall()
        covered = [row["id"] for row in live if row["id"] in held]
        copied = {row["id"]: row["tool_calls"] for row in live if row["id"] not in held}
        originals = (self._tail_originals(covered, tail_count, merged_away)
                     if tail_count > 0 else [])
        return originals, copied

    def publish_compression_child(self, *, parent_session_id, child_session_id, source, messages,
                                  model=None, model_config=None, system_prompt=None, cwd=None,
                                  profile_name=None, compression_lock_holder=None,
                                  require_compression_lease=True, require_lease_refresh=False,
                                  lease_ttl_seconds=300.0, watermark=None, watermark_ceiling=None):
        """End the parent by compression and create its continuation with `messages`, atomically;
        None. The child takes the parent's conversation-wide model_config keys
        (_CONVERSATION_MODEL_CONFIG_KEYS) under its own. Parent messages after `watermark`, up to
        `watermark_ceiling`, are copied after the handoff. `require_lease_refresh` first extends
        `compression_lock_holder`'s lease by `lease_ttl_seconds`, in the same transaction, so a
        holder whose refresher stalled gets one last chance. A parent ended by automatic cleanup is
        reopened first: its holder is still continuing it. Raises CompressionSessionBusyError when
        the required lease is no longer the holder's, RuntimeError for an unknown or deliberately
        ended parent or an empty handoff, sqlite3.IntegrityError for a child id in use; nothing is
        written then."""
        if not isinstance(child_session_id, str) or not child_session_id:
            raise SessionRowError(
                "child_session_id must be a non-empty string; nothing was published")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise SessionInputTypeError(
                f"system_prompt must be a string or None, not {type(system_prompt).__name__}")
        handoff = _message_dicts("messages", messages) if messages else []
        digest = None if system_prompt is None else prompt_hash(system_prompt)
        low = None if watermark is None else int(watermark)
        high = None if watermark_ceiling is None else int(watermark_ceiling)

        def write(conn):
            if require_lease_refresh and compression_lock_holder:
                conn.execute("UPDATE compression_locks SET expires_at = ?"
                             " WHERE session_id = ? AND holder = ?",
                             (time.time() + float(lease_ttl_seconds), parent_session_id,
                              compression_lock_holder))
            if require_compression_lease and not (compression_lock_holder and _holds_lock(
                    conn, parent_session_id, compression_lock_holder)):
                raise CompressionSessionBusyError(
                    f"compression lease of {parent_session_id!r} was lost before publication")
            parent = conn.execute(
                "SELECT * FROM sessions WHERE id = ?", (parent_session_id,)).fetchone()
            if parent is None:
                raise RuntimeError(f"compression parent {parent_session_id!r} does not exist")
            if parent["ended_at"] is not None:
                if parent["end_reason"] not in _AUTOMATIC_END_REASONS:
                    raise RuntimeError(
                        f"compression parent {parent_session_id!r} has already ended")
                conn.execute("UPDATE sessions SET ended_at = NULL, end_reason = NULL WHERE id = ?",
                             (parent_session_id,))
            if not handoff:
                raise RuntimeError("a compression child needs a non-empty handoff")
            if digest:
                conn.execute(INSERT_SYSTEM_PROMPT_SQL, (digest, system_prompt))
            inherited = json_object(parent["model_config"])
            config = {**{key: inherited[key] for key in _CONVERSATION_MODEL_CONFIG_KEYS
                         if key in inherited}, **(model_config or {})}
            row = {"id": child_session_id, "source": source, "model": model,
                   "model_config": json.dumps(config) if config else None,
                   "system_prompt_hash": digest,
                   "parent_session_id": parent_session_id, "cwd": cwd or parent["cwd"],
                   "profile_name": profile_name or parent["profile_name"],
                   "started_at": time.time(),
                   **{column: parent[column] for column in _INHERITED_COLUMNS}}
            conn.execute(
                f"INSERT INTO sessions ({', '.join(row)}) VALUES ({placeholders(len(row))})",
                tuple(row.values()))
            count, calls = self._insert_message_rows(conn, child_session_id, handoff,
                                                     callers=True)
            tail = conn.execute(_TAIL_SQL, (parent_session_id, low, high)).fetchall()
            count, calls = count + len(tail), calls + _copy_tail(conn, tail, child_session_id)
            conn.execute(SET_MESSAGE_COUNTS_SQL, (count, calls, child_session_id))
            # The parent was read (or made) open above, in this transaction.
            conn.execute("UPDATE sessions SET ended_at = ?, end_reason = ? WHERE id = ?",
                         (time.time(), COMPRESSION_END_REASON, parent_session_id))
        self._execute_transcript_write(write, handoff)

    def reopen_if_explicitly_closed(self, session_id, *, provenance, patience_s=None):
        """Clear a deliberate close (`tui_close`, `cli_close`, ...) from a session its host has
        just shown is still routed to it; returns the end reason cleared, else None. Automatic
        stamps, compression, reset boundaries and a session with a continuation are left alone,
        and a close written after the stamp was read is kept. `provenance` says, in the warning
        logged, why the host knows."""
        if not session_id:
            return None

        def write(conn):
            row = conn.execute("SELECT ended_at, end_reason FROM sessions WHERE id = ?",
                               (session_id,)).fetchone()
            if row is None or row["ended_at"] is None:
                return None
            reason = row["end_reason"]
            if (reason in _AUTOMATIC_END_REASONS or reason in _BOUNDARY_END_REASONS
                    or reason == COMPRESSION_END_REASON):
                return None
            children = conn.execute("SELECT source, model_config, parent_session_id"
                                    " FROM sessions WHERE parent_session_id = ?",
                                    (session_id,)).fetchall()
            if any(_continues(dict(child)) for child in children):
                return None
            conn.execute("UPDATE sessions SET ended_at = NULL, end_reason = NULL"
                         " WHERE id = ? AND ended_at = ? AND end_reason IS ?",
                         (session_id, row["ended_at"], reason))
            return None if reason is None else str(reason)
        reason = self._execute_write(write, patience_s=patience_s)
        if reason is not None:
            logger.warning("session %s was still routed to while %s, yet ended %r: reopened",
                           session_id, provenance, reason)
        return reason

    def reopen_orphaned_compression_session(self, session_id):
        """Reopen a session ended by compression whose continuation was never published;
        False when it is not so ended, has any continuation, or a compression lease on it
        still runs (an expired one goes)."""
        if not session_id:
            return False

        def write(conn):
            row = conn.execute(
                "SELECT ended_at, end_reason FROM sessions WHERE id = ?", (session_id,)).fetchone()
            if (row is None or row["ended_at"] is None
                    or row["end_reason"] != COMPRESSION_END_REASON):
                return False
            children = conn.execute("SELECT source, model_config, parent_session_id FROM sessions"
                                    " WHERE parent_session_id = ?", (session_id,)).fetchall()
            if any(not is_fork_child(child) for child in children):
                return False
            lock = conn.execute(SELECT_COMPRESSION_LOCK_SQL, (session_id,)).fetchone()
            if lock is not None:
                if lock["expires_at"] is None or float(lock["expires_at"]) >= time.time():
                    return False
                conn.execute("DELETE FROM compression_locks WHERE session_id = ?", (session_id,))
            return conn.execute(
                "UPDATE sessions SET ended_at = NULL, end_reason = NULL WHERE id = ?",
                (session_id,)).rowcount == 1
        return self._execute_write(write)

    def finalize_orphaned_compression_sessions(self):
        """End, as 'orphaned_compression', continuations (with messages, no API call) left unused
        for a week; returns how many. Nothing is deleted."""
        now = time.time()
        return self._update_rows(
            "UPDATE sessions SET ended_at = ?, end_reason = 'orphaned_compression'"
            " WHERE api_call_count = 0 AND end_reason IS NULL AND ended_at IS NULL"
            " AND started_at < ?"
            " AND parent_session_id IS NOT NULL"
            " AND EXISTS (SELECT 1 FROM sessions AS p WHERE p.id = sessions.parent_session_id"
            "             AND p.end_reason = 'compression' AND p.ended_at IS NOT NULL)"
            " AND EXISTS (SELECT 1 FROM messages AS m WHERE m.session_id = sessions.id)",
            (now, now - ORPHANED_CONTINUATION_AGE))

    # -- conversation-wide model_config -----------------------------------------------
    # A key kept for the whole conversation (_CONVERSATION_MODEL_CONFIG_KEYS) lives on the
    # compression tip; each continuation takes it over when it is published.
    def session_ids_with_model_config_key(self, key):
        """Ids of the sessions whose model_config holds `key` (not null), newest first."""
        pattern = "%" + escape_like(json.dumps(str(key))) + "%"
        rows = self._read_all("SELECT id, model_config FROM sessions"
                              " WHERE model_config LIKE ? ESCAPE '\\'"
                              " ORDER BY started_at DESC", (pattern,))
        return [row["id"] for row in rows
                if json_object(row["model_config"]).get(key) is not None]

    def update_conversation_model_config_value(self, session_id, key, update):
        """Set `key` of the model_config at the session's compression tip to `update(value now)`
        (None removes it), reading and writing in one transaction so neither a concurrent writer
        nor a rotation is lost; returns the id written, None for an unknown session. `update` may
        run again when the write is retried: it must not have side effects."""
        def write(conn):
            tip = self._compression_tip_on(conn, session_id)
            row = conn.execute("SELECT model_config FROM sessions WHERE id = ?",
                               (tip,)).fetchone()
            if row is None:
                return None
            config = json_object(row["model_config"])
            value = update(config.get(key))
            conn.execute("UPDATE sessions SET model_config = ? WHERE id = ?",
                         (merge_model_config(row["model_config"], {key: value}), tip))
            return tip
        return self._execute_write(write)

    # -- adoption from another profile's store ---------------------------------------------
    def adopt_session_lineage_from(self, donor_db, session_id, *, retire_donor=True):
        """Import `session_id`'s compression lineage, every message row with its state, from
        `donor_db` (another profile's store that ran this profile's turns); returns
        import_sessions' dict with `adopted` (every segment is here now) and `donor_retired`.
        With `retire_donor`, a complete adoption ends each donor segment as 'adopted_by_profile'
        and archives it (never deletes), unless the donor holds more messages of a segment than
        this store (it kept growing): then nothing is retired. {"ok": False, "adopted": False,
        "donor_retired": False, "error"} when the donor has no such session."""
        payload = donor_db.export_session_lineage(session_id, include_inactive=True)
        if not payload:
            return {"ok": False, "adopted": False, "donor_retired": False,
                    "error": f"session {session_id!r} not found in donor store"}
        segments = payload.get("segments") or [payload]
        ahead = [segment["id"] for segment in segments if self.get_session(segment["id"])
                 and len(segment.get("messages") or ()) > self._all_message_count(segment["id"])]
        result = self.import_sessions([dict(segment) for segment in segments])
        adopted = bool(result.get("ok")) and (
            int(result.get("imported") or 0) + int(result.get("skipped") or 0) == len(segments))
        if not adopted:
            logger.warning("adoption of %s incomplete: %s", session_id, result.get("errors"))
        if ahead:
            logger.warning("donor segments %s hold messages this store lacks: not retired", ahead)
        retired = adopted and retire_donor and not ahead and all(
            [self._retire_donor_segment(donor_db, segment["id"]) for segment in segments])
        return {**result, "adopted": adopted, "donor_retired": retired}

    def _retire_donor_segment(self, donor_db, segment_id):
        """End and archive one adopted donor segment; False (logged) when the donor grew since
        the export or the write failed: the adoption stands, a later one retires it."""
        try:
            if donor_db._all_message_count(segment_id) > self._all_message_count(segment_id):
                logger.warning("donor segment %s grew during adoption: not retired", segment_id)
                return False
            donor_db.reopen_session(segment_id)  # the first end reason wins otherwise
            donor_db.end_session(segment_id, ADOPTED_END_REASON)
            donor_db.set_session_archived(segment_id, True)
            return True
        except (sqlite3.Error, ValueError, RuntimeError) as exc:
            logger.warning("donor segment %s not retired after adoption: %s", segment_id, exc)
            return False

    def _all_message_count(self, session_id):
        """Every message row of the session, live, compacted or rewound."""
        return self._read_value("SELECT COUNT(*) FROM messages WHERE session_id = ?",
                                (session_id,))

    # -- the compressor's durable guards -------------------------------------------
    def record_compression_failure_cooldown(self, session_id, cooldown_until, error=None):
        """Keep compression of the session off until `cooldown_until`, saying why;
        None (failures logged)."""
        self._set_cooldown(session_id, cooldown_until, error)

    def clear_compression_failure_cooldown(self, session_id):
        """Drop the session's compression cooldown; None (failures logged)."""
        self._set_cooldown(session_id, None, None)

    def _set_cooldown(self, session_id, until, error):
        if session_id:
            try:
                self._update_rows(_SET_COOLDOWN_SQL, (until, error, session_id))
            except sqlite3.Error as exc:
                logger.warning(
                    "compression cooldown of session %r not written: %s", session_id, exc)

    def get_compression_failure_cooldown(self, session_id):
        """{"cooldown_until", "remaining_seconds", "error"} of a cooldown still running; None
        when there is none, it has passed, or the session is unknown."""
        row, now = self.get_compression_failure_cooldown_row(session_id), time.time()
        until = row["cooldown_until"]
        if until is None or until <= now:
            return None
        return {"cooldown_until": until, "remaining_seconds": until - now, "error": row["error"]}

    def get_compression_failure_cooldown_row(self, session_id):
        """The stored cooldown, expired or not, as {"session_exists", "cooldown_until" (float or
        None), "error"}; session_exists False and the rest None for an unknown session."""
        return _cooldown_row(session_id and self._read_one(
            "SELECT compression_failure_cooldown_until, compression_failure_error FROM sessions"
            " WHERE id = ?",
            (session_id,)))

    def restore_compression_failure_cooldown_row(self, session_id, snapshot):
        """Put back a get_compression_failure_cooldown_row snapshot exactly; None.
        RuntimeError when the session's existence no longer matches the snapshot or
        the row does not read back equal."""
        if not snapshot.get("session_exists", False):
            if self.get_compression_failure_cooldown_row(session_id)["session_exists"]:
                raise RuntimeError(
                    "cannot restore absent compression cooldown row: session now exists")
            return
        until, error = snapshot.get("cooldown_until"), snapshot.get("error")
        if self._update_rows(_SET_COOLDOWN_SQL, (until, error, session_id)) != 1:
            raise RuntimeError(f"compression cooldown rollback session missing: {session_id}")
        expected = _cooldown_row((until, error))
        actual = self.get_compression_failure_cooldown_row(session_id)
        if actual != expected:
            raise RuntimeError("compression cooldown rollback verification failed: "
                               f"expected={expected!r}, actual={actual!r}")

    def get_compression_fallback_streak(self, session_id):
        """How many compactions in a row fell back to the deterministic summary; 0 when unknown."""
        return self._guard_count("compression_fallback_streak", session_id)

    def set_compression_fallback_streak(self, session_id, streak):
        """Store the fallback streak (negative stored as 0); None, also for an unknown session."""
        self._set_guard_count("compression_fallback_streak", session_id, streak)

    def get_compression_ineffective_count(self, session_id):
        """How many recent compactions freed too little; 0 when unknown."""
        return self._guard_count("compression_ineffective_count", session_id)

    def set_compression_ineffective_count(self, session_id, count):
        """Store the ineffective-compaction count (negative stored as 0);
        None, also for an unknown session."""
        self._set_guard_count("compression_ineffective_count", session_id, count)

    def get_compression_overload_streak(self, session_id):
        """How many compactions in a row were aborted by a provider's sustained overload; 0 when
        unknown."""
        return self._guard_count("compression_overload_streak", session_id)

    def set_compression_overload_streak(self, session_id, streak):
        """Store the overload streak (negative stored as 0); None, also for an unknown session."""
        self._set_guard_count("compression_overload_streak", session_id, streak)

    def increment_compression_overload_streak(self, session_id):
        """Add one to the overload streak in one write (concurrent agents lose no strike); the
        new value, None for an unknown session."""
        if not session_id:
            return None

        def write(conn):
            if not conn.execute("UPDATE sessions SET compression_overload_streak ="
                                " COALESCE(compression_overload_streak, 0) + 1 WHERE id = ?",
                                (session_id,)).rowcount:
                return None
            return int(conn.execute("SELECT compression_overload_streak FROM sessions"
                                    " WHERE id = ?", (session_id,)).fetchone()[0])
        return self._execute_write(write)

    def get_compression_recovery_deadline(self, session_id):
        """When a session tripped by repeated failures may try compaction again (epoch seconds);
        0.0 when none is set. Stored, since the gateway builds its compressor anew every turn."""
        if not session_id or self._closed:
            return 0.0
        try:
            value = self._read_value("SELECT compression_recovery_deadline FROM sessions"
                                     " WHERE id = ?", (session_id,))
            return max(0.0, float(value or 0.0))
        except (TypeError, ValueError, sqlite3.OperationalError):
            return 0.0

    def set_compression_recovery_deadline(self, session_id, deadline):
        """Store the recovery deadline; 0, None or a value that is not a number clears it."""
        if not session_id:
            return
        try:
            value = max(0.0, float(deadline or 0.0))
        except (TypeError, ValueError):
            value = 0.0
        self._update_rows("UPDATE sessions SET compression_recovery_deadline = ? WHERE id = ?",
                          (value or None, session_id))

    def _guard_count(self, column, session_id):
        if not session_id or self._closed:
            return 0
        try:
            value = self._read_value(f"SELECT {column} FROM sessions WHERE id = ?", (session_id,))
            return max(0, int(value or 0))
        except (TypeError, ValueError):
            return 0

    def _set_guard_count(self, column, session_id, value):
        if session_id:
            self._update_rows(f"UPDATE sessions SET {column} = ? WHERE id = ?",
                              (max(0, int(value)), session_id))

    def find_live_compression_child(self, parent_session_id):
        """The one live continuation (no branch, delegate or tool child) of a session compression
        ended, as get_session gives it; None when it is not so ended, or has no such child or
        several (ambiguous: no caller may guess which one owns the transcript)."""
        if not parent_session_id:
            return None
        children = self._read_all(
            "SELECT c.id, c.source, c.model_config, c.parent_session_id FROM sessions AS p"
            " JOIN sessions AS c ON c.parent_session_id = p.id"
            " WHERE p.id = ? AND p.ended_at IS NOT NULL AND p.end_reason = ? AND c.ended_at IS NULL"
            " ORDER BY c.started_at",
            (parent_session_id, COMPRESSION_END_REASON))
        live = [child["id"] for child in children if not is_fork_child(child)]
        return self.get_session(live[0]) if len(live) == 1 else None


def _continues(child):
    """True when a child session row (source, model_config, parent_session_id) is no branch,
    delegate, reset or tool child of its parent: a compression continuation if the parent ended so.
    Markers count only when they name the parent (a continuation inherits its parent's)."""
    row = {name: child.get(name) for name in ("source", "model_config", "parent_session_id")}
    return not is_fork_child(row) and (
        json_object(row["model_config"]).get("_reset_from") != row["parent_session_id"])


def _holds_lock(conn, session_id, holder):
    row = conn.execute(SELECT_COMPRESSION_LOCK_SQL, (session_id,)).fetchone()
    return row is not None and row["holder"] == holder and float(row["expires_at"]) > time.time()


def _cooldown_row(row):
    """get_compression_failure_cooldown_row's dict for a (cooldown_until, error) row,
    or for no session."""
    if not row:
        return {"session_exists": False, "cooldown_until": None, "error": None}
    until, error = row
    return {"session_exists": True, "cooldown_until": None if until is None else float(until),
            "error": error}


def _message_dicts(name, messages):
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise SessionInputTypeError(f"{name} must be a list of message dicts; nothing was written")
    return messages


def _copy_tail(conn, tail, session_id):
    """Copy messages (rows of _TAIL_SQL) as live rows of `session_id`, every column but the id kept
    byte for byte (message_uid included: a copy is the same message), except display_order, which
    names a row of the source and which the insert trigger sets again; returns the tool calls they
    hold."""
    if not tail:
        return 0
    columns = ", ".join(row[1] for row in conn.execute("PRAGMA table_info(messages)")
                        if row[1] not in ("id", "session_id", "active", "compacted",
                                          "display_order"))
    for ids in chunked(sorted(row["id"] for row in tail)):
        conn.execute(
            f"INSERT INTO messages ({columns}, session_id, active, compacted)"
            f" SELECT {columns}, ?, 1, 0"
            f" FROM messages WHERE id IN ({placeholders(len(ids))}) ORDER BY id",
            (session_id, *ids))
    parsed = [loads_or(row["tool_calls"], None) for row in tail]
    return sum(len(calls) for calls in parsed if isinstance(calls, list))
