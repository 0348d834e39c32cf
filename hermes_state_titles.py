"""Titles: their rules (cleaned, capped, unique), who set them, lookups by title.

Owns the `title` and `title_source` columns. Never writes any other column.
"""

import re

from hermes_state_common import (
    SELECT_TITLE_OWNER_SQL, TITLE_MAX_LENGTH, TITLE_SOURCE_DERIVED, TITLE_SOURCE_LLM,
    TITLE_SOURCE_RANK, TITLE_SOURCE_USER, escape_like, normalize_title)

# A title whose writer is unknown (rows older than title_source) counts as the user's: an automatic
# title may fill an empty slot but never replace it.
_UNKNOWN_SOURCE_RANK = TITLE_SOURCE_RANK[TITLE_SOURCE_USER]
# A row when the second ? is a session the first continues
# (up the chain of compression-ended parents).
_IS_COMPRESSION_ANCESTOR_SQL = (
    "\nWITH RECURSIVE chain(id) AS (\n"
    "  SELECT ? UNION SELECT parent.id FROM chain JOIN sessions AS child ON child.id = chain.id\n"
    "  JOIN sessions AS parent ON parent.id = child.parent_session_id"
    " WHERE parent.end_reason = 'compression')\n"
    "SELECT 1 FROM chain WHERE id = ? AND id <> ? LIMIT 1")
_NUMBERED_SUFFIX = re.compile(r"^(.*?) #(\d+)$")
# The title of Bot Mode's chat, which finds it by that title.
CANONICAL_BOT_CHAT_TITLE = "Bot Chat"
_ID_BY_TITLE_SQL = "SELECT id FROM sessions WHERE title = ?"


class SessionTitlesMixin:
    """SessionDB's methods for titles.

    Relies on: `_execute_write`, `_read_all`, `_read_one`, `_read_value`, `_update_rows`
    (SessionDB); `get_session` (sessions mixin)."""

    MAX_TITLE_LENGTH = TITLE_MAX_LENGTH
    CANONICAL_BOT_CHAT_TITLE = CANONICAL_BOT_CHAT_TITLE
    TITLE_SOURCE_DERIVED = TITLE_SOURCE_DERIVED
    TITLE_SOURCE_LLM = TITLE_SOURCE_LLM
    TITLE_SOURCE_USER = TITLE_SOURCE_USER

    @staticmethod
    def sanitize_title(title):
        """The title as it would be stored; None for a falsy or blank title. Raises ValueError
        "Title too long (N chars, max 100)", TypeError for a non-string."""
        return normalize_title(title)

    def set_session_title(self, session_id, title):
        """Set the user's title (None or blank clears it); False for an unknown session.

        Raises ValueError "Title '...' is already in use by session ..." when another
        session holds it, writing nothing, unless that one is a compression ancestor of
        this one: the title then moves."""
        return self._write_title(session_id, title, TITLE_SOURCE_USER)

    def set_auto_title(self, session_id, title, *, source):
        """Set a generated title of `source` ('derived' or 'llm'); False when the session is
        unknown or holds a title of the same or higher authority. Raises ValueError for another
        source, and as set_session_title does."""
        if source not in (TITLE_SOURCE_DERIVED, TITLE_SOURCE_LLM):
            raise ValueError(f"invalid automatic title source: {source!r}")
        return self._write_title(session_id, title, source)

    def set_auto_title_if_empty(self, session_id, title):
        """set_auto_title with source 'llm' (older callers use this name)."""
        return self.set_auto_title(session_id, title, source=TITLE_SOURCE_LLM)

    def _write_title(self, session_id, title, source):
        title = normalize_title(title)

        def write(conn):
            current = conn.execute("SELECT title, title_source FROM sessions WHERE id = ?",
                                   (session_id,)).fetchone()
            if current is None:
                return False
            if source != TITLE_SOURCE_USER and current["title"] is not None:
                held = TITLE_SOURCE_RANK.get(current["title_source"], 0) \
                    if current["title_source"] is not None else _UNKNOWN_SOURCE_RANK
                if held >= TITLE_SOURCE_RANK[source]:
                    return False
            if title is not None:
                self._resolve_title_conflict(conn, session_id, title)
            conn.execute("UPDATE sessions SET title = ?, title_source = ? WHERE id = ?",
                         (title, source if title else None, session_id))
            return True
        return self._execute_write(write)

    def _resolve_title_conflict(self, conn, session_id, title):
        """Inside the caller's write: free `title` for `session_id`, or raise the reference's
        ValueError when another session rightly holds it. It gives the title up when it is a
        compression ancestor (ended and unlisted, so nobody can rename it), an ended empty visible
        session (an abandoned new chat the listings leave out), or a retired Bot Chat (archived
        and hidden); hermes-agent's API server calls this around its own INSERT."""
        owner = conn.execute(SELECT_TITLE_OWNER_SQL, (title, session_id)).fetchone()
        if owner is None:
            return
        owner = conn.execute(
            "SELECT s.id, s.archived, s.hidden, s.message_count = 0 AND s.ended_at IS NOT NULL"
            " AND s.archived = 0 AND NOT EXISTS (SELECT 1 FROM messages AS m"
            " WHERE m.session_id = s.id) AS ghost FROM sessions AS s WHERE s.id = ?",
            (owner[0],)).fetchone()
        if conn.execute(_IS_COMPRESSION_ANCESTOR_SQL,
                        (session_id, owner["id"], session_id)).fetchone():
            conn.execute("UPDATE sessions SET title = NULL WHERE id = ?", (owner["id"],))
        elif (owner["ghost"] and not owner["hidden"]) or (
                title == CANONICAL_BOT_CHAT_TITLE and owner["archived"] and owner["hidden"]):
            conn.execute("UPDATE sessions SET title = NULL, title_source = NULL WHERE id = ?",
                         (owner["id"],))
        else:
            raise ValueError(f"Title '{title}' is already in use by session {owner['id']}")

    def get_session_title(self, session_id):
        """The session's title; None when it has none or does not exist."""
        return self._read_value("SELECT title FROM sessions WHERE id = ?", (session_id,))

    def get_session_title_source(self, session_id):
        """Who set the title ('derived', 'llm', 'user'); None for rows older than provenance, or
        when the session is untitled or unknown."""
        row = self._read_one("SELECT title, title_source FROM sessions WHERE id = ?", (session_id,))
        return None if row is None or row["title"] is None else row["title_source"]

    def set_session_title_source(self, session_id, source):
        """Change who a title counts as set by; False when the session is unknown or untitled.
        Raises ValueError for an unknown source."""
        if source not in TITLE_SOURCE_RANK:
            raise ValueError(f"invalid title source: {source!r}")
        return self._update_rows(
            "UPDATE sessions SET title_source = ? WHERE id = ? AND title IS NOT NULL",
            (source, session_id)) > 0

    def get_session_by_title(self, title):
        """The session (as get_session returns it) whose title is exactly `title`, or None."""
        session_id = self._read_value(_ID_BY_TITLE_SQL, (title,))
        return None if session_id is None else self.get_session(session_id)

    def resolve_session_by_title(self, title):
        """The id of the newest "<title> #N" continuation, else of the
        session titled `title`, else None."""
        numbered = self._read_value(
            "SELECT id FROM sessions WHERE title LIKE ? ESCAPE '\\'"
            " ORDER BY started_at DESC LIMIT 1",
            (escape_like(title) + " #%",))
        return numbered if numbered is not None else self._read_value(_ID_BY_TITLE_SQL, (title,))

    def get_next_title_in_lineage(self, base_title):
        """The next free "<base> #N" for `base_title` (its own " #N" dropped first); the base itself
        when no session uses it or a numbered form."""
        match = _NUMBERED_SUFFIX.match(base_title)
        base = match.group(1) if match else base_title
        titles = [row[0] for row in self._read_all(
            "SELECT title FROM sessions WHERE title = ? OR title LIKE ? ESCAPE '\\'",
            (base, escape_like(base) + " #%"))]
        if not titles:
            return base
        numbers = [int(m.group(2)) for m in map(_NUMBERED_SUFFIX.match, titles) if m]
        return f"{base} #{max([1, *numbers]) + 1}"
