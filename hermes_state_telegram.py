"""Telegram DM topic mode: which private chats use topics, which thread is bound to which session,
per gateway profile.

Owns `telegram_dm_topic_mode` and `telegram_dm_topic_bindings`, created only when a user opts in
(`apply_telegram_topic_migration`), never at open, as hermes-agent does; while they are absent every
read answers as if empty. Both tables lead their key with `profile_name`: bots of several profiles
share one state.db, and a private chat's id is the user's, the same for every bot. Tables from
before the profile column are rebuilt under 'default' (on opt-in, or on the first read that needs
it). Relies on the sessions mixin's `_rich_rows`; never writes a session or message row.
"""

import logging
import sqlite3
import time

from hermes_state_common import session_key_profile
from hermes_state_schema import live_columns, write_meta

logger = logging.getLogger("hermes_state")

TOPIC_SCHEMA_META_KEY = "telegram_dm_topic_schema_version"
TOPIC_SCHEMA_VERSION = "3"
DEFAULT_TOPIC_PROFILE = "default"

# Each table's columns and body, spaced as hermes-agent 0.22 writes them: SQLite keeps the text in
# sqlite_master, and a store must read the same to every program.
_TOPIC_TABLES = (
    ("telegram_dm_topic_mode",
     ("profile_name", "chat_id", "user_id", "enabled", "activated_at", "updated_at",
      "has_topics_enabled", "allows_users_to_create_topics", "capability_checked_at",
      "intro_message_id", "pinned_message_id"),
     """
                    profile_name TEXT NOT NULL DEFAULT 'default',
                    chat_id TEXT NOT NULL,
                    user_id TEXT NOT NULL,
                    enabled INTEGER NOT NULL DEFAULT 1,
                    activated_at REAL NOT NULL,
                    updated_at REAL NOT NULL,
                    has_topics_enabled INTEGER,
                    allows_users_to_create_topics INTEGER,
                    capability_checked_at REAL,
                    intro_message_id TEXT,
                    pinned_message_id TEXT,
                    PRIMARY KEY (profile_name, chat_id)
                """),
    ("telegram_dm_topic_bindings",
     ("profile_name", "chat_id", "thread_id", "user_id", "session_key", "session_id",
      "managed_mode", "linked_at", "updated_at"),
     """
                    profile_name TEXT NOT NULL DEFAULT 'default',
                    chat_id TEXT NOT NULL,
                    thread_id TEXT NOT NULL,
                    user_id TEXT NOT NULL,
                    session_key TEXT NOT NULL,
                    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
                    managed_mode TEXT NOT NULL DEFAULT 'auto',
                    linked_at REAL NOT NULL,
                    updated_at REAL NOT NULL,
                    PRIMARY KEY (profile_name, chat_id, thread_id)
                """))
_BINDING_INDEXES_SQL = (
    "CREATE UNIQUE INDEX IF NOT EXISTS idx_telegram_dm_topic_bindings_session "
    "ON telegram_dm_topic_bindings(session_id)",
    "CREATE INDEX IF NOT EXISTS idx_telegram_dm_topic_bindings_user "
    "ON telegram_dm_topic_bindings(profile_name, user_id, chat_id)")
_DISABLE_MODE_SQL = ("UPDATE telegram_dm_topic_mode SET enabled = 0, updated_at = ?"
                     " WHERE profile_name = ? AND chat_id = ?")
_MISSING_PROFILE_COLUMN = "no such column: profile_name"


def topic_profile(profile_name):
    """The profile a topic row is kept under: the name given, 'default' when blank."""
    return str(profile_name or "").strip() or DEFAULT_TOPIC_PROFILE


class SessionTelegramMixin:
    """SessionDB's methods for Telegram DM topic mode.

    Relies on: `_execute_write`, `_read_all`, `_update_rows` (SessionDB);
    `_rich_rows` (sessions mixin)."""

    def apply_telegram_topic_migration(self):
        """Create the topic-mode tables if absent, and rebuild ones without `profile_name` under
        'default' (bindings of deleted sessions are left behind); returns None. Idempotent."""
        def write(conn):
            for table, _columns, body in _TOPIC_TABLES:
                conn.execute(f"CREATE TABLE IF NOT EXISTS {table} ({body})")
            _require_profile_columns(conn)
        self._execute_write(write)

    def enable_telegram_topic_mode(self, *, chat_id, user_id, profile_name=DEFAULT_TOPIC_PROFILE,
                                   has_topics_enabled=None, allows_users_to_create_topics=None):
        """Turn topic mode on for one private chat of one profile (creating the tables first);
        returns None."""
        self.apply_telegram_topic_migration()
        now = time.time()
        self._update_rows(
            "INSERT INTO telegram_dm_topic_mode (profile_name, chat_id, user_id, enabled,"
            " activated_at, updated_at, has_topics_enabled, allows_users_to_create_topics,"
            " capability_checked_at) VALUES (:profile, :chat_id, :user_id, 1, :now, :now,"
            " :has_topics, :users_create, :now)"
            " ON CONFLICT(profile_name, chat_id) DO UPDATE SET user_id = excluded.user_id,"
            " enabled = 1, updated_at = excluded.updated_at,"
            " has_topics_enabled = excluded.has_topics_enabled,"
            " allows_users_to_create_topics = excluded.allows_users_to_create_topics,"
            " capability_checked_at = excluded.capability_checked_at",
            {"profile": topic_profile(profile_name), "chat_id": str(chat_id),
             "user_id": str(user_id), "now": now, "has_topics": _flag(has_topics_enabled),
             "users_create": _flag(allows_users_to_create_topics)})

    def disable_telegram_topic_mode(self, *, chat_id, profile_name=DEFAULT_TOPIC_PROFILE,
                                    clear_bindings=True):
        """Turn topic mode off for one chat of one profile and, with `clear_bindings`, drop that
        profile's bindings in it; returns None. Never creates the tables."""
        key = (topic_profile(profile_name), str(chat_id))

        def write(conn):
            if _topic_tables_exist(conn):
                _require_profile_columns(conn)
                conn.execute(_DISABLE_MODE_SQL, (time.time(), *key))
                if clear_bindings:
                    conn.execute("DELETE FROM telegram_dm_topic_bindings"
                                 " WHERE profile_name = ? AND chat_id = ?", key)
        self._execute_write(write)

    def is_telegram_topic_mode_enabled(self, *, chat_id, user_id,
                                       profile_name=DEFAULT_TOPIC_PROFILE):
        """True if this profile's chat and user have topic mode on; False without the tables."""
        rows = self._topic_rows(
            "SELECT enabled FROM telegram_dm_topic_mode"
            " WHERE profile_name = ? AND chat_id = ? AND user_id = ?",
            (topic_profile(profile_name), str(chat_id), str(user_id)))
        return bool(rows and rows[0][0])

    def get_telegram_topic_binding(self, *, chat_id, thread_id, profile_name=DEFAULT_TOPIC_PROFILE):
        """The binding row of one topic thread of one profile as a dict, or None."""
        rows = self._bindings("profile_name = ? AND chat_id = ? AND thread_id = ?",
                              (topic_profile(profile_name), str(chat_id), str(thread_id)))
        return rows[0] if rows else None

    def get_telegram_topic_binding_by_session(self, *, session_id):
        """The binding row of the topic a session is bound to (any profile), or None."""
        rows = self._bindings("session_id = ?", (str(session_id),))
        return rows[0] if rows else None

    def is_telegram_session_linked_to_topic(self, *, session_id):
        """True if the session is bound to any topic thread."""
        return self.get_telegram_topic_binding_by_session(session_id=session_id) is not None

    def list_telegram_topic_bindings_for_chat(self, *, chat_id, profile_name=DEFAULT_TOPIC_PROFILE):
        """One profile's bindings in one chat as dicts, newest update first; [] when none."""
        return self._bindings("profile_name = ? AND chat_id = ? ORDER BY updated_at DESC",
                              (topic_profile(profile_name), str(chat_id)))

    def list_unlinked_telegram_sessions_for_user(self, *, chat_id, user_id,
                                                 profile_name=DEFAULT_TOPIC_PROFILE, limit=10):
        """The user's Telegram sessions of this profile (a session without one is the default's)
        bound to no topic, as list_sessions_rich rows without `unread`, most recently active
        first; [] when none. Without the tables: all the user's Telegram sessions, any profile,
        as there. `chat_id` is unused, as there."""
        scope, params = "", [str(user_id)]
        if self._bindings_keyed():
            scope = (" AND COALESCE(NULLIF(TRIM(s.profile_name), ''), 'default') = ?"
                     " AND NOT EXISTS (SELECT 1 FROM telegram_dm_topic_bindings AS b"
                     " WHERE b.session_id = s.id)")
            params.append(topic_profile(profile_name))
        return self._rich_rows(
            f" WHERE s.source = 'telegram' AND s.user_id = ?{scope}"
            " ORDER BY last_active DESC, s.started_at DESC LIMIT ?", (*params, int(limit)))

    def bind_telegram_topic(self, *, chat_id, thread_id, user_id, session_key, session_id,
                            managed_mode="auto", profile_name=DEFAULT_TOPIC_PROFILE):
        """Bind a topic thread of one profile to a session (creating the tables first); returns
        None. The same thread again refreshes it; ValueError, writing nothing, when the session is
        bound to another thread or the same thread of another profile."""
        self.apply_telegram_topic_migration()
        place = (topic_profile(profile_name), str(chat_id), str(thread_id))
        session_id, now = str(session_id), time.time()

        def write(conn):
            bound = conn.execute("SELECT profile_name, chat_id, thread_id"
                                 " FROM telegram_dm_topic_bindings WHERE session_id = ?",
                                 (session_id,)).fetchone()
            if bound is not None and tuple(str(value) for value in bound) != place:
                raise ValueError("session is already linked to another Telegram topic")
            conn.execute(
                "INSERT INTO telegram_dm_topic_bindings (profile_name, chat_id, thread_id, user_id,"
                " session_key, session_id, managed_mode, linked_at, updated_at) VALUES (:profile,"
                " :chat_id, :thread_id, :user_id, :session_key, :session_id, :managed_mode, :now,"
                " :now) ON CONFLICT(profile_name, chat_id, thread_id) DO UPDATE SET"
                " user_id = excluded.user_id, session_key = excluded.session_key,"
                " session_id = excluded.session_id, managed_mode = excluded.managed_mode,"
                " updated_at = excluded.updated_at",
                {"profile": place[0], "chat_id": place[1], "thread_id": place[2],
                 "user_id": str(user_id), "session_key": str(session_key),
                 "session_id": session_id, "managed_mode": managed_mode, "now": now})
        self._execute_write(write)

    def delete_telegram_topic_binding(self, *, chat_id, thread_id,
                                      profile_name=DEFAULT_TOPIC_PROFILE):
        """Remove one thread's binding of one profile; returns how many rows went (0 without the
        tables). After that profile's last binding in the chat, its topic mode goes off in the
        same transaction, so nothing steers messages to a chat with no topics left."""
        key = (topic_profile(profile_name), str(chat_id))

        def write(conn):
            if not _topic_tables_exist(conn):
                return 0
            _require_profile_columns(conn)
            deleted = conn.execute(
                "DELETE FROM telegram_dm_topic_bindings"
                " WHERE profile_name = ? AND chat_id = ? AND thread_id = ?",
                (*key, str(thread_id))).rowcount
            if deleted and not conn.execute(
                    "SELECT 1 FROM telegram_dm_topic_bindings"
                    " WHERE profile_name = ? AND chat_id = ? LIMIT 1", key).fetchone():
                conn.execute(_DISABLE_MODE_SQL, (time.time(), *key))
            return deleted
        return self._execute_write(write)

    # -- profile repair (`hermes sessions repair-profiles`) ---------------------------
    def find_profile_less_telegram_topic_rows(self):
        """Bindings kept under 'default' whose session key names another profile (written by a
        gateway before it stamped the routed profile), as {"chat_id", "thread_id", "session_key",
        "key_profile"}; [] without the tables or their profile column."""
        def read(conn):
            if "profile_name" not in live_columns(conn, "telegram_dm_topic_bindings"):
                return []
            return conn.execute(
                "SELECT chat_id, thread_id, session_key FROM telegram_dm_topic_bindings"
                " WHERE profile_name = 'default' ORDER BY chat_id, thread_id").fetchall()
        found = []
        for row in self._with_reader(read):
            profile = session_key_profile(row["session_key"])
            if profile not in (None, DEFAULT_TOPIC_PROFILE):
                found.append({**dict(row), "key_profile": profile})
        return found

    def relabel_telegram_topic_rows(self, rows):
        """Move these 'default' bindings to the profile their session key names, dropping one the
        named profile already holds for the same thread, and the chat's mode row with them unless
        that profile has its own; returns {"bindings_relabelled", "bindings_duplicates_removed",
        "mode_rows_relabelled"}. The target is read again from each row's key."""
        wanted = list(rows or ())
        counts = dict.fromkeys(
            ("bindings_relabelled", "bindings_duplicates_removed", "mode_rows_relabelled"), 0)

        def write(conn):
            modes_keyed = "profile_name" in live_columns(conn, "telegram_dm_topic_mode")
            for row in wanted:
                target = session_key_profile(row["session_key"])
                if target in (None, DEFAULT_TOPIC_PROFILE):
                    continue
                thread = {"target": target, "chat_id": row["chat_id"],
                          "thread_id": row["thread_id"]}
                held = conn.execute(
                    "SELECT 1 FROM telegram_dm_topic_bindings WHERE profile_name = :target"
                    " AND chat_id = :chat_id AND thread_id = :thread_id", thread).fetchone()
                outcome = "bindings_duplicates_removed" if held else "bindings_relabelled"
                change = ("DELETE FROM telegram_dm_topic_bindings" if held else
                          "UPDATE telegram_dm_topic_bindings SET profile_name = :target")
                counts[outcome] += conn.execute(
                    change + " WHERE profile_name = 'default' AND chat_id = :chat_id"
                    " AND thread_id = :thread_id", thread).rowcount
                if modes_keyed and conn.execute(
                        "SELECT 1 FROM telegram_dm_topic_mode WHERE profile_name = :target"
                        " AND chat_id = :chat_id", thread).fetchone() is None:
                    counts["mode_rows_relabelled"] += conn.execute(
                        "UPDATE telegram_dm_topic_mode SET profile_name = :target"
                        " WHERE profile_name = 'default' AND chat_id = :chat_id", thread).rowcount
            return counts
        return self._execute_write(write) if wanted else counts

    def _bindings(self, where, params):
        sql = "SELECT * FROM telegram_dm_topic_bindings WHERE " + where
        return [dict(row) for row in self._topic_rows(sql, params)]

    def _topic_rows(self, sql, params):
        """Rows of a topic read; [] while the opt-in tables do not exist. Tables an upgrade left
        without `profile_name` are migrated, then read again ([] if that cannot be written)."""
        try:
            return self._read_all(sql, params)
        except sqlite3.OperationalError as exc:
            if _MISSING_PROFILE_COLUMN not in str(exc):
                return []
        return self._read_all(sql, params) if self._migrated() else []

    def _bindings_keyed(self):
        """True when the bindings table exists with its profile column, migrating one without."""
        columns = self._with_reader(lambda conn: live_columns(conn, "telegram_dm_topic_bindings"))
        return self._migrated() if columns and "profile_name" not in columns else bool(columns)

    def _migrated(self):
        """Migrate tables an upgrade left without `profile_name`; False (logged) when the store
        cannot be written."""
        try:
            self.apply_telegram_topic_migration()
            return True
        except sqlite3.Error as exc:
            logger.warning("Telegram topic tables predate profiles and were not migrated: %s", exc)
            return False


def _topic_tables_exist(conn):
    count = conn.execute(
        "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name IN"
        " ('telegram_dm_topic_mode', 'telegram_dm_topic_bindings')").fetchone()[0]
    return count == 2


def _require_profile_columns(conn):
    """Inside a write: migrate tables without `profile_name` before a statement names it."""
    for table, columns, body in _TOPIC_TABLES:
        if "profile_name" not in live_columns(conn, table):
            _rebuild_with_profile(conn, table, columns, body)
    for sql in _BINDING_INDEXES_SQL:
        conn.execute(sql)
    write_meta(conn, TOPIC_SCHEMA_META_KEY, TOPIC_SCHEMA_VERSION)


def _rebuild_with_profile(conn, table, columns, body):
    """SQLite cannot change a primary key: rename the table aside, create it keyed by profile,
    copy its rows under 'default' (bindings only of sessions that still exist: the new foreign key
    refuses the others), drop the old one. Its indexes go with it; the caller makes them again."""
    legacy, kept = f"{table}_legacy", ", ".join(columns[1:])
    live = (" WHERE EXISTS (SELECT 1 FROM sessions AS s WHERE s.id = session_id)"
            if "session_id" in columns else "")
    conn.execute(f"DROP TABLE IF EXISTS {legacy}")
    conn.execute(f"ALTER TABLE {table} RENAME TO {legacy}")
    conn.execute(f"CREATE TABLE {table} ({body})")
    conn.execute(f"INSERT INTO {table} ({', '.join(columns)})"
                 f" SELECT 'default', {kept} FROM {legacy}{live}")
    conn.execute(f"DROP TABLE {legacy}")


def _flag(value):
    return None if value is None else int(bool(value))
