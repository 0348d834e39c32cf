"""Titles: their rules (normalised, capped, unique) and lookups by title.

Owns the `title` column. Relies on SessionDB's write and read paths. Never
writes any other column.
"""

from hermes_state_common import (
    SELECT_SESSION_BY_TITLE_SQL,
    SELECT_TITLE_OWNER_SQL,
    SELECT_TITLE_SQL,
    SET_TITLE_SQL,
    normalize_title,
)


class SessionTitlesMixin:
    """SessionDB's methods for titles."""

    def set_session_title(self, session_id, title):
        """Set (or with None/"" clear) a title; titles are unique. False for an unknown session."""
        title = normalize_title(title)

        def write(conn):
            self._check_title_free(conn, title, session_id)
            return conn.execute(SET_TITLE_SQL, (title, session_id)).rowcount > 0

        return self._execute_write(write)

    def get_session_title(self, session_id):
        return self._read_value(SELECT_TITLE_SQL, (session_id,))

    def get_session_by_title(self, title):
        """The session holding `title`, or None."""
        session_id = self._read_value(SELECT_SESSION_BY_TITLE_SQL, (normalize_title(title),))
        return None if session_id is None else self.get_session(session_id)

    def _check_title_free(self, conn, title, session_id):
        if title is None:
            return
        owner = conn.execute(SELECT_TITLE_OWNER_SQL, (title, session_id)).fetchone()
        if owner:
            raise ValueError(f"title {title!r} is already used by session {owner[0]}")
