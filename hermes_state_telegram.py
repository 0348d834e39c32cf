"""Telegram DM topic mode: which private chats use topics, which thread is bound to which session.

Owns `telegram_dm_topic_mode` and `telegram_dm_topic_bindings`, created only when a user opts in
(`apply_telegram_topic_migration`), never at open, as hermes-agent does; while they are absent every
read answers as if empty. Relies on the sessions mixin's `_rich_rows`; never writes a session or
message row.
"""

import sqlite3
import time

from hermes_state_common import TABLE_EXISTS_SQL
from hermes_state_schema import read_meta, write_meta

TOPIC_SCHEMA_META_KEY = "telegram_dm_topic_schema_version"
TOPIC_SCHEMA_VERSION = "2"

# The text SQLite keeps in sqlite_master, byte for byte as stores made by earlier versions hold it.
_BINDINGS_TABLE_SQL = (
    "CREATE TABLE {name} (\n"
    "    chat_id TEXT NOT NULL, thread_id TEXT NOT NULL, user_id TEXT NOT NULL,"
    " session_key TEXT NOT NULL,\n"
    "    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,\n"
    "    managed_mode TEXT NOT NULL DEFAULT 'auto', linked_at REAL NOT NULL,"
    " updated_at REAL NOT NULL,\n"
    "    PRIMARY KEY (chat_id, thread_id)\n"
    ")")
_TOPIC_TABLES_SQL = [
    """CREATE TABLE IF NOT EXISTS telegram_dm_topic_mode (
    chat_id TEXT PRIMARY KEY, user_id TEXT NOT NULL, enabled INTEGER NOT NULL DEFAULT 1,
    activated_at REAL NOT NULL, updated_at REAL NOT NULL, has_topics_enabled INTEGER,
    allows_users_to_create_topics INTEGER, capability_checked_at REAL, intro_message_id TEXT,
    pinned_message_id TEXT
)""",
    _BINDINGS_TABLE_SQL.format(name="IF NOT EXISTS telegram_dm_topic_bindings")]
_BINDING_INDEXES_SQL = [
    "CREATE UNIQUE INDEX IF NOT EXISTS idx_telegram_dm_topic_bindings_session"
    " ON telegram_dm_topic_bindings(session_id)",
    "CREATE INDEX IF NOT EXISTS idx_telegram_dm_topic_bindings_user"
    " ON telegram_dm_topic_bindings(user_id, chat_id)"]
_DISABLE_MODE_SQL = (
    "UPDATE telegram_dm_topic_mode SET enabled = 0, updated_at = ? WHERE chat_id = ?")


class SessionTelegramMixin:
    """SessionDB's methods for Telegram DM topic mode.

    Relies on: `_execute_write`, `_read_all`, `_update_rows` (SessionDB);
    `_rich_rows` (sessions mixin)."""

    def apply_telegram_topic_migration(self):
        """Create the topic-mode tables if absent, give an early bindings table the ON DELETE
        CASCADE on session_id; returns None. Idempotent."""
        def write(conn):
            for sql in _TOPIC_TABLES_SQL + _BINDING_INDEXES_SQL:
                conn.execute(sql)
            version = read_meta(conn, TOPIC_SCHEMA_META_KEY)
            if not (version and str(version).isdigit() and int(version) >= 2):
                keys = conn.execute(
                    "PRAGMA foreign_key_list(telegram_dm_topic_bindings)").fetchall()
                if any(key[2] == "sessions" and (key[6] or "") != "CASCADE" for key in keys):
                    _rebuild_bindings_with_cascade(conn)
            write_meta(conn, TOPIC_SCHEMA_META_KEY, TOPIC_SCHEMA_VERSION)
        self._execute_write(write)

    def enable_telegram_topic_mode(self, *, chat_id, user_id, has_topics_enabled=None,
                                   allows_users_to_create_topics=None):
        """Turn topic mode on for one private chat (creating the tables first); returns None."""
        self.apply_telegram_topic_migration()
        now = time.time()
        self._update_rows(
            "INSERT INTO telegram_dm_topic_mode (chat_id, user_id, enabled, activated_at,"
            " updated_at, has_topics_enabled, allows_users_to_create_topics,"
            " capability_checked_at) VALUES (:chat_id, :user_id, 1, :now, :now, :has_topics,"
            " :users_create, :now)"
            " ON CONFLICT(chat_id) DO UPDATE SET user_id = excluded.user_id, enabled = 1,"
            " updated_at = excluded.updated_at, has_topics_enabled = excluded.has_topics_enabled,"
            " allows_users_to_create_topics = excluded.allows_users_to_create_topics,"
            " capability_checked_at = excluded.capability_checked_at",
            {"chat_id": str(chat_id), "user_id": str(user_id), "now": now,
             "has_topics": _flag(has_topics_enabled),
             "users_create": _flag(allows_users_to_create_topics)})

    def disable_telegram_topic_mode(self, *, chat_id, clear_bindings=True):
        """Turn topic mode off for one chat and, with `clear_bindings`, drop its bindings;
        returns None."""
        def write(conn):
            if not _topic_tables_exist(conn):
                return
            conn.execute(_DISABLE_MODE_SQL, (time.time(), str(chat_id)))
            if clear_bindings:
                conn.execute("DELETE FROM telegram_dm_topic_bindings WHERE chat_id = ?",
                             (str(chat_id),))
        self._execute_write(write)

    def is_telegram_topic_mode_enabled(self, *, chat_id, user_id):
        """True if this chat and user have topic mode on; False too when the tables do not exist."""
        rows = self._topic_rows(
            "SELECT enabled FROM telegram_dm_topic_mode WHERE chat_id = ? AND user_id = ?",
            (str(chat_id), str(user_id)))
        return bool(rows and rows[0][0])

    def get_telegram_topic_binding(self, *, chat_id, thread_id):
        """The binding row of one topic thread as a dict, or None."""
        rows = self._bindings("chat_id = ? AND thread_id = ?", (str(chat_id), str(thread_id)))
        return rows[0] if rows else None

    def get_telegram_topic_binding_by_session(self, *, session_id):
        """The binding row of the topic a session is bound to, or None."""
        rows = self._bindings("session_id = ?", (str(session_id),))
        return rows[0] if rows else None

    def is_telegram_session_linked_to_topic(self, *, session_id):
        """True if the session is bound to any topic thread."""
        return self.get_telegram_topic_binding_by_session(session_id=session_id) is not None

    def list_telegram_topic_bindings_for_chat(self, *, chat_id):
        """One chat's bindings as dicts, most recently updated first; [] when none."""
        return self._bindings("chat_id = ? ORDER BY updated_at DESC", (str(chat_id),))

    def list_unlinked_telegram_sessions_for_user(self, *, chat_id, user_id, limit=10):
        """The user's Telegram sessions bound to no topic (all, without the tables) as
        list_sessions_rich rows without `unread`, most recently active first; [] when none.
        `chat_id` is unused, as there."""
        unbound = ""
        if self._topic_rows(TABLE_EXISTS_SQL, ("telegram_dm_topic_bindings",)):
            unbound = (" AND NOT EXISTS (SELECT 1 FROM telegram_dm_topic_bindings AS b"
                       " WHERE b.session_id = s.id)")
        return self._rich_rows(
            f" WHERE s.source = 'telegram' AND s.user_id = ?{unbound}"
            " ORDER BY last_active DESC, s.started_at DESC LIMIT ?", (str(user_id), int(limit)))

    def bind_telegram_topic(self, *, chat_id, thread_id, user_id, session_key, session_id,
                            managed_mode="auto"):
        """Bind a topic thread to a session (creating the tables first); returns None.
        The same pair again refreshes it; ValueError, writing nothing, when the
        session is bound to another thread."""
        self.apply_telegram_topic_migration()
        chat_id, thread_id, session_id = str(chat_id), str(thread_id), str(session_id)
        now = time.time()

        def write(conn):
            bound = conn.execute(
                "SELECT chat_id, thread_id FROM telegram_dm_topic_bindings WHERE session_id = ?",
                (session_id,)).fetchone()
            if bound is not None and (str(bound[0]), str(bound[1])) != (chat_id, thread_id):
                raise ValueError("session is already linked to another Telegram topic")
            conn.execute(
                "INSERT INTO telegram_dm_topic_bindings (chat_id, thread_id, user_id, session_key,"
                " session_id, managed_mode, linked_at, updated_at) VALUES (:chat_id, :thread_id,"
                " :user_id, :session_key, :session_id, :managed_mode, :now, :now)"
                " ON CONFLICT(chat_id, thread_id) DO UPDATE SET user_id = excluded.user_id,"
                " session_key = excluded.session_key, session_id = excluded.session_id,"
                " managed_mode = excluded.managed_mode, updated_at = excluded.updated_at",
                {"chat_id": chat_id, "thread_id": thread_id, "user_id": str(user_id),
                 "session_key": str(session_key), "session_id": session_id,
                 "managed_mode": managed_mode, "now": now})
        self._execute_write(write)

    def delete_telegram_topic_binding(self, *, chat_id, thread_id):
        """Remove one thread's binding; returns how many rows went (0 without the tables). After the
        chat's last binding, topic mode goes off in the same transaction, so nothing steers messages
        to a chat with no topics left."""
        chat_id = str(chat_id)

        def write(conn):
            if not _topic_tables_exist(conn):
                return 0
            deleted = conn.execute(
                "DELETE FROM telegram_dm_topic_bindings WHERE chat_id = ? AND thread_id = ?",
                (chat_id, str(thread_id))).rowcount
            if deleted and not conn.execute(
                    "SELECT 1 FROM telegram_dm_topic_bindings WHERE chat_id = ? LIMIT 1",
                    (chat_id,)).fetchone():
                conn.execute(_DISABLE_MODE_SQL, (time.time(), chat_id))
            return deleted
        return self._execute_write(write)

    def _bindings(self, where, params):
        sql = "SELECT * FROM telegram_dm_topic_bindings WHERE " + where
        return [dict(row) for row in self._topic_rows(sql, params)]

    def _topic_rows(self, sql, params):
        try:
            return self._read_all(sql, params)
        except sqlite3.OperationalError:  # the opt-in tables do not exist yet
            return []


def _topic_tables_exist(conn):
    count = conn.execute(
        "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name IN"
        " ('telegram_dm_topic_mode', 'telegram_dm_topic_bindings')").fetchone()[0]
    return count == 2


def _rebuild_bindings_with_cascade(conn):
    """SQLite cannot alter a foreign key: copy the table into one declared with the cascade."""
    conn.execute(_BINDINGS_TABLE_SQL.format(name="telegram_dm_topic_bindings_new"))
    conn.execute(
        "INSERT INTO telegram_dm_topic_bindings_new SELECT chat_id, thread_id, user_id,"
        " session_key, session_id, managed_mode, linked_at, updated_at"
        " FROM telegram_dm_topic_bindings")
    conn.execute("DROP TABLE telegram_dm_topic_bindings")
    conn.execute("ALTER TABLE telegram_dm_topic_bindings_new RENAME TO telegram_dm_topic_bindings")
    for sql in _BINDING_INDEXES_SQL:
        conn.execute(sql)


def _flag(value):
    return None if value is None else int(bool(value))
