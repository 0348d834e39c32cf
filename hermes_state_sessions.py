"""Session rows: create, read, resolve, end and reopen, flags, listing, counts,
deletes and compression-lineage reads.

Owns what a session row holds and who may change it. Relies on SessionDB's
write path (`_execute_write`, `_update_rows`) and read path (`_read_all`,
`_read_one`, `_read_value`). Never touches a message's content, the search
indexes or the schema; titles' rules live in hermes_state_titles.
"""

import time

from hermes_state_common import (
    COMPRESSION_END_REASON,
    COUNT_SESSIONS_SQL,
    END_SESSION_SQL,
    INSERT_SESSION_SQL,
    INSERT_SYSTEM_PROMPT_SQL,
    LIST_LIMIT_MAX,
    LIST_SESSIONS_RICH_SQL,
    REOPEN_SESSION_SQL,
    SELECT_COMPRESSION_CHILD_SQL,
    SELECT_ID_PREFIX_SQL,
    SELECT_LINEAGE_LINK_SQL,
    SELECT_SESSION_SQL,
    SELECT_SYSTEM_PROMPT_SQL,
    SESSION_CASCADE_DELETE_SQL,
    SESSION_EXISTS_SQL,
    SESSION_ID_MAX_LENGTH,
    SET_ARCHIVED_SQL,
    SET_PINNED_SQL,
    chunked,
    json_text,
    normalize_title,
    placeholders,
    prefix_bounds,
    require_int,
    require_text,
)
from hermes_state_schema import declared_columns, prompt_hash


class SessionSessionsMixin:
    """SessionDB's methods for session rows and listing."""

    def create_session(self, session_id, source, model=None, model_config=None, system_prompt=None,
                       parent_session_id=None, **fields):
        """Create a session and return its id; an id that exists is left as it is.

        `fields` may name any other `sessions` column (`user_id`, `cwd`,
        `title`, `started_at`, ...). `model_config` is a dict or JSON text of
        an object. `system_prompt` is stored once in `system_prompts` by hash.
        """
        values = self._session_values(session_id, source, model, model_config, parent_session_id, fields)
        require_text("system_prompt", system_prompt, allow_none=True)
        digest = prompt_hash(system_prompt) if system_prompt is not None else None
        if digest:
            values["system_prompt_hash"] = digest
        sql = INSERT_SESSION_SQL.format(columns=", ".join(values), values=placeholders(len(values)))

        def write(conn):
            if conn.execute(SESSION_EXISTS_SQL, (session_id,)).fetchone():
                return
            self._check_title_free(conn, values.get("title"), session_id)
            if digest:
                conn.execute(INSERT_SYSTEM_PROMPT_SQL, (digest, system_prompt))
            conn.execute(sql, tuple(values.values()))

        self._execute_write(write)
        return session_id

    def ensure_session(self, session_id, source="cli", **fields):
        """Create the session if it does not exist yet (e.g. on resume); return its id."""
        return self.create_session(session_id, source, **fields)

    def _session_values(self, session_id, source, model, model_config, parent_session_id, fields):
        require_text("session_id", session_id, max_length=SESSION_ID_MAX_LENGTH)
        require_text("source", source)
        allowed = declared_columns()["sessions"]
        for name in fields:
            if name not in allowed or name in _PROTECTED_SESSION_FIELDS:
                raise ValueError(f"unknown or protected session field {name!r}")
        values = {"id": session_id, "source": source, "started_at": time.time()}
        values.update(fields)
        values["model"] = require_text("model", model, allow_none=True)
        values["model_config"] = json_text("model_config", model_config, want_object=True)
        values["parent_session_id"] = require_text("parent_session_id", parent_session_id, allow_none=True)
        if "title" in values:
            values["title"] = normalize_title(values["title"])
        return values

    def end_session(self, session_id, end_reason):
        """Mark a session ended now with `end_reason`; False if there is no such session."""
        require_text("end_reason", end_reason)
        return self._update_rows(END_SESSION_SQL, (time.time(), end_reason, session_id)) > 0

    def reopen_session(self, session_id):
        """Clear a session's end; False if there is no such session."""
        return self._update_rows(REOPEN_SESSION_SQL, (session_id,)) > 0

    def get_session(self, session_id):
        """Every column of a session, `system_prompt` resolved; None for an unknown id."""
        self._flush_token_counts()
        row = self._read_one(SELECT_SESSION_SQL, (session_id,))
        return None if row is None else self._resolve_prompt(dict(row), {})

    def _resolve_prompt(self, session, cache):
        digest = session.get("system_prompt_hash")
        if digest and session.get("system_prompt") is None:
            if digest not in cache:
                cache[digest] = self._read_value(SELECT_SYSTEM_PROMPT_SQL, (digest,))
            session["system_prompt"] = cache[digest]
        return session

    def resolve_session_id(self, id_or_prefix):
        """The id itself if it exists, else the only id starting with it; None if none or ambiguous."""
        if not isinstance(id_or_prefix, str) or not id_or_prefix:
            return None
        if self._read_one(SESSION_EXISTS_SQL, (id_or_prefix,)):
            return id_or_prefix
        matches = self._read_all(SELECT_ID_PREFIX_SQL, prefix_bounds(id_or_prefix))
        return matches[0][0] if len(matches) == 1 else None

    def set_session_archived(self, session_id, archived=True):
        return self._update_rows(SET_ARCHIVED_SQL, (int(bool(archived)), session_id)) > 0

    def set_session_pinned(self, session_id, pinned=True):
        return self._update_rows(SET_PINNED_SQL, (int(bool(pinned)), session_id)) > 0

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

    def session_count(self, source=None, include_archived=True, exclude_sources=None):
        where, params = _session_filters(source, exclude_sources, include_archived)
        return self._read_value(COUNT_SESSIONS_SQL.format(where=where), params)

    def get_compression_lineage(self, session_id):
        """[root, ..., tip] ids of the compression chain through `session_id` ([] if unknown).

        A parent belongs to the chain when it ended with end_reason 'compression'.
        """
        if self._read_one(SESSION_EXISTS_SQL, (session_id,)) is None:
            return []
        chain, seen = [session_id], {session_id}
        row = self._read_one(SELECT_LINEAGE_LINK_SQL, (session_id,))
        while row["parent_session_id"]:
            parent = row["parent_session_id"]
            row = self._read_one(SELECT_LINEAGE_LINK_SQL, (parent,))
            if row is None or parent in seen or row["end_reason"] != COMPRESSION_END_REASON:
                break
            chain.insert(0, parent)
            seen.add(parent)
        current = session_id
        while True:
            child = self._read_value(SELECT_COMPRESSION_CHILD_SQL, (current,))
            if child is None or child in seen:
                break
            chain.append(child)
            seen.add(child)
            current = child
        return chain

    def get_compression_tip(self, session_id):
        """The newest segment of the compression chain through `session_id`, or None."""
        chain = self.get_compression_lineage(session_id)
        return chain[-1] if chain else None


# Session columns a caller may not set through create_session: identity,
# counters kept by the store, and the prompt hash derived from system_prompt.
_PROTECTED_SESSION_FIELDS = {"id", "source", "message_count", "tool_call_count", "system_prompt",
                             "system_prompt_hash"}


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
