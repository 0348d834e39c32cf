"""Session rows: create (or enrich), read, resolve, end and reopen, flags,
listing, counts, deletes, the model and cwd a session runs with.

Owns what a session row holds and who may change it. Relies on SessionDB's
write path (`_execute_write`, `_update_rows`) and read path (`_read_all`,
`_read_one`, `_read_value`). Never touches a message's content, the search
indexes or the schema; titles' rules live in hermes_state_titles, compression
and resume in hermes_state_compression.
"""

import collections
import json
import sqlite3
import time

from hermes_state_common import (
    INSERT_SYSTEM_PROMPT_SQL,
    LIST_LIMIT_MAX,
    LIST_SESSIONS_RICH_SQL,
    SELECT_ID_PREFIX_SQL,
    SELECT_SYSTEM_PROMPT_SQL,
    SESSION_EXISTS_SQL,
    SESSION_ID_MAX_LENGTH,
    SessionInputTypeError,
    SessionRowError,
    _RESET_END_REASONS,
    cwd_prefix_clause,
    loads_or,
    placeholders,
    prefix_bounds,
    require_int,
    require_text,
)
from hermes_state_schema import prompt_hash

# What create_session may fill on a row that exists: only columns still NULL,
# so a later bare call (source "unknown", no model) never clobbers a real value.
_FILLABLE_COLUMNS = ("model", "model_config", "user_id", "session_key", "chat_id", "chat_type", "thread_id",
                     "parent_session_id", "cwd", "profile_name", "git_repo_root", "origin_json", "display_name")
# Filled from the parent when a child names one: where the work happens and
# whose profile it is, so a fork never drops out of its project.
_INHERITED_COLUMNS = ("cwd", "git_repo_root", "git_branch", "profile_name")
# Filled from a parent that ended by compression: the gateway's routing, so a
# continuation stays reachable if the gateway dies before re-recording it.
_ROUTING_COLUMNS = ("user_id", "session_key", "chat_id", "chat_type", "thread_id", "display_name", "origin_json")
# A session with `system_prompt` resolved from system_prompts, else the inline
# column stores older than schema 26 still hold; {columns} adds computed ones.
_SESSION_WITH_PROMPT_SQL = ("SELECT s.*, sp.prompt AS resolved_prompt{columns} FROM sessions AS s"
                            " LEFT JOIN system_prompts AS sp ON sp.hash = s.system_prompt_hash")
_DELETE_UNREFERENCED_PROMPTS_SQL = ("DELETE FROM system_prompts WHERE NOT EXISTS (SELECT 1 FROM sessions"
                                    " WHERE sessions.system_prompt_hash = system_prompts.hash)")
# Every session of the compression chain through ? (both directions); the flag
# setters change the chain as one conversation.
_LINEAGE_IDS_SQL = """
WITH RECURSIVE
  up(id) AS (SELECT ? UNION SELECT p.id FROM up JOIN sessions AS c ON c.id = up.id
             JOIN sessions AS p ON p.id = c.parent_session_id WHERE p.end_reason = 'compression'),
  down(id) AS (SELECT ? UNION SELECT c.id FROM down JOIN sessions AS p ON p.id = down.id
               JOIN sessions AS c ON c.parent_session_id = p.id WHERE p.end_reason = 'compression')
SELECT id FROM up UNION SELECT id FROM down"""


class SessionSessionsMixin:
    """SessionDB's methods for session rows and listing."""

    # -- creating -------------------------------------------------------------

    def create_session(self, session_id, source, **kwargs):
        """Create the session, or fill the still-empty fields of an existing one; returns its id.

        Keywords: model, model_config (a dict), system_prompt, user_id,
        session_key, chat_id, chat_type, thread_id, parent_session_id, cwd,
        profile_name, git_repo_root, origin_json, display_name; any other
        raises TypeError. On an existing id only NULL columns are filled and
        `source` is kept. A child inherits the parent's cwd, git root and
        branch and profile, and, if the parent ended by compression, its
        gateway routing. Raises SessionRowError (a ValueError and
        IntegrityError) for a missing id or source or an unknown parent,
        SessionInputTypeError for a non-text prompt; nothing is written then.
        """
        self._insert_session_row(session_id, source, **kwargs)
        return session_id

    def ensure_session(self, session_id, source="unknown", model=None, **kwargs):
        """Make sure the session exists (create_session's rules); returns its id."""
        self._insert_session_row(session_id, source, model=model, **kwargs)
        return session_id

    def _insert_session_row(self, session_id, source, model=None, model_config=None, system_prompt=None,
                            user_id=None, session_key=None, chat_id=None, chat_type=None, thread_id=None,
                            parent_session_id=None, cwd=None, profile_name=None, git_repo_root=None,
                            origin_json=None, display_name=None):
        _check_session_id(session_id)
        if source is None:
            raise SessionRowError("source must be given, not None; no session was written")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise SessionInputTypeError(f"system_prompt must be a string or None, not "
                                        f"{type(system_prompt).__name__}")
        values = dict(zip(_FILLABLE_COLUMNS, (
            model, _config_json(model_config), user_id, session_key, chat_id, chat_type, thread_id,
            parent_session_id, cwd, profile_name, git_repo_root, origin_json, display_name)))
        digest = None if system_prompt is None else prompt_hash(system_prompt)

        def write(conn):
            if digest:
                conn.execute(INSERT_SYSTEM_PROMPT_SQL, (digest, system_prompt))
            row = conn.execute("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()
            changes = _new_row_values(values, digest) if row is None else _fill_values(row, values, digest)
            parent = changes.get("parent_session_id")
            if parent and parent != session_id and not conn.execute(SESSION_EXISTS_SQL, (parent,)).fetchone():
                raise SessionRowError(f"parent_session_id {parent!r} names no session; no session was written")
            if row is None:
                changes.update(id=session_id, source=source, started_at=time.time())
                conn.execute(f"INSERT INTO sessions ({', '.join(changes)}) VALUES ({placeholders(len(changes))})",
                             tuple(changes.values()))
            elif changes:
                conn.execute(f"UPDATE sessions SET {', '.join(f'{c} = ?' for c in changes)} WHERE id = ?",
                             (*changes.values(), session_id))
            if digest:
                conn.execute(_DELETE_UNREFERENCED_PROMPTS_SQL)
            if parent_session_id:
                _inherit_from_parent(conn, session_id)

        self._execute_write(write)

    def update_system_prompt(self, session_id, system_prompt):
        """Store the session's full system prompt (None clears it); nothing for an unknown session.

        Raises SessionInputTypeError for a value that is not text, before writing.
        """
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise SessionInputTypeError(f"system_prompt must be a string or None, not "
                                        f"{type(system_prompt).__name__}")
        digest = None if system_prompt is None else prompt_hash(system_prompt)

        def write(conn):
            if digest:
                conn.execute(INSERT_SYSTEM_PROMPT_SQL, (digest, system_prompt))
            conn.execute("UPDATE sessions SET system_prompt_hash = ?, system_prompt = NULL WHERE id = ?",
                         (digest, session_id))
            conn.execute(_DELETE_UNREFERENCED_PROMPTS_SQL)

        self._execute_write(write)

    # -- reading ----------------------------------------------------------------

    def get_session(self, session_id):
        """Every column of a session, `system_prompt` resolved; None for an unknown id."""
        self._flush_token_counts()
        rows = self._read_sessions("", " WHERE s.id = ?", (session_id,))
        return rows[0] if rows else None

    def _read_sessions(self, columns, tail, params):
        """Session dicts, system_prompt resolved, with computed `columns` added and `tail` after the FROM."""
        try:
            rows = self._read_all(_SESSION_WITH_PROMPT_SQL.format(columns=columns) + tail, params)
        except sqlite3.OperationalError as exc:
            if "system_prompts" not in str(exc):
                raise
            # A read-only open of a store older than the prompt table, whose
            # prompts are all still inline.
            rows = self._read_all(f"SELECT s.*{columns} FROM sessions AS s" + tail, params)
        sessions = [dict(row) for row in rows]
        for session in sessions:
            resolved = session.pop("resolved_prompt", None)
            if resolved is not None:
                session["system_prompt"] = resolved
        return sessions

    def _resolve_prompt(self, session, cache):
        digest = session.get("system_prompt_hash")
        if digest:
            if digest not in cache:
                cache[digest] = self._read_value(SELECT_SYSTEM_PROMPT_SQL, (digest,))
            if cache[digest] is not None:
                session["system_prompt"] = cache[digest]
        return session

    def resolve_session_id(self, session_id_or_prefix):
        """The id itself if it exists, else the only id starting with it; None if none or ambiguous."""
        if not isinstance(session_id_or_prefix, str) or not session_id_or_prefix:
            return None
        if self._read_one(SESSION_EXISTS_SQL, (session_id_or_prefix,)):
            return session_id_or_prefix
        matches = self._read_all(SELECT_ID_PREFIX_SQL, prefix_bounds(session_id_or_prefix))
        return matches[0][0] if len(matches) == 1 else None

    # -- ending and flags ---------------------------------------------------------

    def end_session(self, session_id, end_reason):
        """Mark a session ended now with `end_reason`; the first end wins (reopen to re-end).

        Returns None, like hermes-agent; an unknown or ended session is left as it is.
        """
        self._update_rows("UPDATE sessions SET ended_at = ?, end_reason = ? WHERE id = ? AND ended_at IS NULL",
                          (time.time(), end_reason, session_id))

    def reopen_session(self, session_id):
        """Clear a session's end so it can be resumed; returns None.

        Children that continued it across a reset on the same routing key get
        `_reset_from` in their model_config first, so they stay separate
        conversations once the parent no longer says it was reset.
        """
        def write(conn):
            parent = conn.execute("SELECT end_reason, session_key FROM sessions WHERE id = ?",
                                  (session_id,)).fetchone()
            if parent is not None and parent["end_reason"] in _RESET_END_REASONS and parent["session_key"]:
                children = conn.execute("SELECT id, model_config FROM sessions WHERE parent_session_id = ?"
                                        " AND session_key = ?", (session_id, parent["session_key"])).fetchall()
                for child in children:
                    config = _config_dict(child["model_config"])
                    if config is not None and config.get("_reset_from") is None:
                        config["_reset_from"] = session_id
                        conn.execute("UPDATE sessions SET model_config = ? WHERE id = ?",
                                     (json.dumps(config, separators=(",", ":")), child["id"]))
            conn.execute("UPDATE sessions SET ended_at = NULL, end_reason = NULL WHERE id = ?", (session_id,))

        self._execute_write(write)

    def set_session_archived(self, session_id, archived):
        """Archive or unarchive the session's whole compression chain; False if no row matched."""
        return self._set_lineage_column(session_id, "archived", 1 if archived else 0)

    def set_session_pinned(self, session_id, pinned):
        """Pin or unpin the session's whole compression chain; False if no row matched."""
        return self._set_lineage_column(session_id, "pinned", 1 if pinned else 0)

    def set_session_hidden(self, session_id, hidden):
        """Hide the session's whole compression chain from default listings, or show it; False if no row matched."""
        return self._set_lineage_column(session_id, "hidden", 1 if hidden else 0)

    def set_session_read(self, session_id, read=True):
        """Mark the chain read now (or unread: watermark 0, so any activity is newer); False if no row matched."""
        return self._set_lineage_column(session_id, "last_read_at", time.time() if read else 0.0)

    def set_expiry_finalized(self, session_id, finalized=True):
        """Record whether the gateway finalized this session's expiry; returns None (nothing for an empty id)."""
        if session_id:
            self._update_rows("UPDATE sessions SET expiry_finalized = ? WHERE id = ?", (1 if finalized else 0, session_id))

    def set_session_yolo(self, session_id, enabled):
        """Keep the per-session YOLO flag in model_config.yolo_mode (other keys kept); returns None,
        and writes nothing for an empty id or an unknown session."""
        self.patch_session_model_config(session_id, {"yolo_mode": bool(enabled)})

    @staticmethod
    def session_yolo_enabled(session_meta):
        """True when a session row (model_config as JSON text or a dict) has yolo_mode set; False on
        anything unreadable, so a resume never turns the bypass on by accident."""
        config = (session_meta or {}).get("model_config")
        if isinstance(config, str):
            config = loads_or(config, None)
        return bool(config.get("yolo_mode")) if isinstance(config, dict) else False

    def _set_lineage_column(self, session_id, column, value):
        sql = f"UPDATE sessions SET {column} = ? WHERE id IN ({_LINEAGE_IDS_SQL})"
        return self._update_rows(sql, (value, session_id, session_id)) > 0

    # -- model and working directory ------------------------------------------------

    def update_session_model(self, session_id, model, provider=None):
        """Switch the session's model (and provider, if given) mid-session; returns None.

        Drops the stored system prompt so the next turn rebuilds it for the new
        model, and any browser model lock in model_config. Nothing for an unknown session.
        """
        self._flush_token_counts()
        patch = {"browser_model_lock": None}
        if model:
            patch["model"] = model
        if provider:
            patch["provider"] = provider

        def write(conn):
            row = conn.execute("SELECT model_config FROM sessions WHERE id = ?", (session_id,)).fetchone()
            if row is None:
                return
            conn.execute("UPDATE sessions SET model = ?, model_config = ?, system_prompt = NULL,"
                         " system_prompt_hash = NULL WHERE id = ?",
                         (model, merge_model_config(row["model_config"], patch), session_id))
            conn.execute(_DELETE_UNREFERENCED_PROMPTS_SQL)

        self._execute_write(write)

    def update_session_meta(self, session_id, model_config_json, model=None):
        """Replace model_config with `model_config_json` and, unless None, set the model; returns None."""
        self._flush_token_counts()
        self._update_rows("UPDATE sessions SET model_config = ?, model = COALESCE(?, model) WHERE id = ?",
                          (model_config_json, model, session_id))

    def patch_session_model_config(self, session_id, patch):
        """Merge `patch` into model_config (a None value removes its key); returns None.

        Nothing for an unknown session or an empty patch.
        """
        if not session_id or not patch:
            return

        def write(conn):
            row = conn.execute("SELECT model_config FROM sessions WHERE id = ?", (session_id,)).fetchone()
            if row is not None:
                conn.execute("UPDATE sessions SET model_config = ? WHERE id = ?",
                             (merge_model_config(row["model_config"], patch), session_id))

        self._execute_write(write)

    def update_session_cwd(self, session_id, cwd, git_branch=None, git_repo_root=None, replace_git_meta=False):
        """Record the session's cwd and claim a new git-metadata generation; returns it, None if unknown.

        Branch and repo root are written only when non-empty, unless the cwd
        changed or `replace_git_meta`, when they are replaced (empty clears).
        """
        if not session_id or not cwd:
            return None
        branch, root = (git_branch or "").strip() or None, (git_repo_root or "").strip() or None

        def write(conn):
            row = conn.execute("SELECT cwd FROM sessions WHERE id = ?", (session_id,)).fetchone()
            if row is None:
                return None
            sets = {"cwd": cwd}
            if row["cwd"] != cwd or replace_git_meta:
                sets.update(git_branch=branch, git_repo_root=root)
            else:
                sets.update({k: v for k, v in (("git_branch", branch), ("git_repo_root", root)) if v})
            conn.execute(f"UPDATE sessions SET {', '.join(f'{c} = ?' for c in sets)},"
                         " git_metadata_generation = COALESCE(git_metadata_generation, 0) + 1 WHERE id = ?",
                         (*sets.values(), session_id))
            return int(conn.execute("SELECT git_metadata_generation FROM sessions WHERE id = ?",
                                    (session_id,)).fetchone()[0])

        return self._execute_write(write)

    def publish_session_git_metadata(self, session_id, cwd, generation, git_branch=None, git_repo_root=None):
        """Record a git probe's branch and repo root if its cwd claim is still current; False if not."""
        branch, root = (git_branch or "").strip(), (git_repo_root or "").strip()
        if not session_id or not cwd or isinstance(generation, bool) or not isinstance(generation, int) \
                or generation < 1 or not (branch or root):
            return False
        sets = {k: v for k, v in (("git_branch", branch), ("git_repo_root", root)) if v}
        return self._update_rows(f"UPDATE sessions SET {', '.join(f'{c} = ?' for c in sets)}"
                                 " WHERE id = ? AND cwd = ? AND git_metadata_generation = ?",
                                 (*sets.values(), session_id, cwd, generation)) == 1

    # -- deleting ---------------------------------------------------------------------

    # -- listing -------------------------------------------------------------------------

    def list_sessions_rich(self, source=None, limit=20, offset=0, include_archived=False,
                           exclude_sources=None):
        """Sessions newest first, each with `preview` (first user message) and `last_active`."""
        require_int("limit", limit, minimum=1, maximum=LIST_LIMIT_MAX)
        require_int("offset", offset)
        self._flush_token_counts()
        where, params = _session_filters(source, exclude_sources, include_archived)
        rows = self._read_all(LIST_SESSIONS_RICH_SQL.format(where=where), params + [limit, offset])
        cache = {}
        return [self._resolve_prompt(dict(row), cache) for row in rows]

    def session_count(self, source=None, sources=None, cwd_prefix=None, min_message_count=0,
                      include_archived=False, archived_only=False, exclude_children=False,
                      exclude_sources=None):
        """How many sessions match; unarchived ones unless `include_archived` or `archived_only`.

        `exclude_children` counts what a session picker lists: roots, branches
        and resets, without subagent runs or compression continuations.
        """
        clauses, params = [], []
        for values, operator in (([source] if source else sources, "IN"), (exclude_sources, "NOT IN")):
            if values:
                clauses.append(f"s.source {operator} ({placeholders(len(values))})")
                params.extend(values)
        if cwd_prefix:
            clause, clause_params = cwd_prefix_clause(cwd_prefix)
            clauses.append(clause)
            params.extend(clause_params)
        if min_message_count > 0:
            clauses.append("s.message_count >= ?")
            params.append(min_message_count)
        return sum(self._tally_sessions(clauses, params, include_archived, archived_only, exclude_children).values())

    def session_count_by_source(self, *, include_archived=False, archived_only=False, exclude_children=False):
        """{source: sessions}, largest first (an empty source counts as 'cli'); {} for an empty store."""
        tally = self._tally_sessions([], [], include_archived, archived_only, exclude_children)
        return dict(sorted(tally.items(), key=lambda item: (-item[1], item[0])))

    def session_count_ge(self, n=1):
        """True when the store holds at least `n` sessions, archived ones included."""
        return len(self._read_all("SELECT 1 FROM sessions LIMIT ?", (n,))) >= n

    def _tally_sessions(self, clauses, params, include_archived, archived_only, exclude_children):
        if archived_only or not include_archived:
            clauses, params = clauses + ["s.archived = ?"], params + [1 if archived_only else 0]
        where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
        source = "COALESCE(NULLIF(s.source, ''), 'cli')"
        if not exclude_children:
            return dict(self._read_all(f"SELECT {source}, COUNT(*) FROM sessions AS s {where} GROUP BY 1", params))
        # Which child is listable depends on markers inside model_config, read
        # here rather than with JSON1 so that every SQLite build counts alike.
        rows = self._read_all(
            f"SELECT {source} AS source, s.model_config, s.started_at, s.session_key, s.parent_session_id AS parent,"
            " p.end_reason AS parent_end_reason, p.ended_at AS parent_ended_at, p.session_key AS parent_key"
            f" FROM sessions AS s LEFT JOIN sessions AS p ON p.id = s.parent_session_id {where}", params)
        return collections.Counter(row["source"] for row in rows if _is_listable(row))


def _is_listable(row):
    """A root, branch or reset row that is not a subagent run (session_count's exclude_children)."""
    config = _config_dict(row["model_config"]) or {}
    if config.get("_delegate_from") is not None:
        return False
    if not row["parent"]:
        return True
    if config.get("_branched_from") is not None or config.get("_reset_from") is not None:
        return True
    if row["parent_end_reason"] == "branched" and row["parent_ended_at"] is not None \
            and row["started_at"] >= row["parent_ended_at"]:
        return True
    return (row["parent_end_reason"] in _RESET_END_REASONS and bool(row["session_key"])
            and row["session_key"] == row["parent_key"])


def _check_session_id(session_id):
    try:
        require_text("session_id", session_id, max_length=SESSION_ID_MAX_LENGTH)
    except ValueError as exc:
        raise SessionRowError(f"{exc}; no session was written") from None


def _config_json(model_config):
    """model_config as hermes-agent stores it: JSON text of a non-empty value, else NULL."""
    if not model_config:
        return None
    try:
        return json.dumps(model_config)
    except (TypeError, ValueError) as exc:
        raise SessionInputTypeError(f"model_config is not JSON-serialisable: {exc}") from None


def _config_dict(text):
    """A stored model_config as a dict ({} for NULL); None when it is not a JSON object."""
    try:
        config = json.loads(text) if text else {}
    except ValueError:
        return None
    return config if isinstance(config, dict) else None


def merge_model_config(text, patch):
    """A stored model_config with `patch` merged (a None value removes its key); NULL when empty."""
    config = _config_dict(text) or {}
    for key, value in patch.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return json.dumps(config) if config else None


def _new_row_values(values, digest):
    changes = {column: value for column, value in values.items() if value is not None}
    if digest:
        changes["system_prompt_hash"] = digest
    return changes


def _fill_values(row, values, digest):
    """What an existing row gains: the columns it still has NULL."""
    changes = {c: v for c, v in values.items() if v is not None and row[c] is None}
    # A row made at a reset holds only {"_reset_from": ...}; the real config
    # joins it instead of being dropped because the column is no longer NULL.
    stored = _config_dict(row["model_config"]) if row["model_config"] else None
    new = _config_dict(values["model_config"]) if values["model_config"] else None
    if stored is not None and new is not None and list(stored) == ["_reset_from"]:
        new["_reset_from"] = stored["_reset_from"]
        changes["model_config"] = json.dumps(new, separators=(",", ":"))
    if digest and row["system_prompt_hash"] is None:
        changes.update(system_prompt_hash=digest, system_prompt=None)
    return changes


def _inherit_from_parent(conn, session_id):
    row = conn.execute("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()
    parent = conn.execute("SELECT * FROM sessions WHERE id = ?", (row["parent_session_id"],)).fetchone()
    if parent is None:
        return
    columns = _INHERITED_COLUMNS + (_ROUTING_COLUMNS if parent["end_reason"] == "compression" else ())
    changes = {c: parent[c] for c in columns if row[c] is None and parent[c] is not None}
    if changes:
        conn.execute(f"UPDATE sessions SET {', '.join(f'{c} = ?' for c in changes)} WHERE id = ?",
                     (*changes.values(), session_id))


def _session_filters(source, exclude_sources, include_archived):
    clauses, params = [], []
    if source is not None:
        clauses.append("s.source = ?")
        params.append(source)
    if exclude_sources:
        clauses.append(f"s.source NOT IN ({placeholders(len(exclude_sources))})")
        params.extend(exclude_sources)
    if not include_archived:
        clauses.append("COALESCE(s.archived, 0) = 0")
    return ("WHERE " + " AND ".join(clauses)) if clauses else "", params
