"""Keeping the store healthy: prune, vacuum, stats and doctor.

Owns the reports about the store and the deletes prune makes (through the
sessions mixin's `_delete_sessions_in`). Relies on SessionDB's write and read
paths and on the search mixin's `search_health`/`fts_layout`. Never repairs
anything by itself: repairs happen at open, in hermes_state_schema.
"""

import sqlite3
import time

from hermes_state_common import (
    CHECKPOINT_TRUNCATE_SQL,
    COUNT_ACTIVE_MESSAGES_SQL,
    COUNT_ALL_MESSAGES_SQL,
    INTEGRITY_CHECK_SQL,
    JOURNAL_MODE_SQL,
    SCHEMA_VERSION,
    SELECT_PRUNABLE_SQL,
    SELECT_SCHEMA_VERSION_SQL,
    SESSIONS_BY_SOURCE_SQL,
    VACUUM_SQL,
    sqlite_has_wal_reset_bug,
    store_file_bytes,
)


class SessionMaintenanceMixin:
    """SessionDB's methods for keeping the store healthy."""

    def prune_sessions(self, older_than_days=90, source=None):
        """Delete ended sessions started more than `older_than_days` ago; returns how many."""
        ids = self.prunable_session_ids(older_than_days, source)
        return self._execute_write(lambda conn: self._delete_sessions_in(conn, ids)) if ids else 0

    def prunable_session_ids(self, older_than_days=90, source=None):
        """The ids prune_sessions would delete (for a dry run)."""
        if isinstance(older_than_days, bool) or not isinstance(older_than_days, (int, float)) \
                or older_than_days < 0:
            raise ValueError("older_than_days must be a number >= 0")
        sql, params = SELECT_PRUNABLE_SQL, [time.time() - older_than_days * 86400]
        if source is not None:
            sql, params = sql + " AND source = ?", params + [source]
        return [row[0] for row in self._read_all(sql, params)]

    def vacuum(self):
        """Rewrite the file without free pages, then truncate the WAL; under the writer lock."""
        self._flush_token_counts()

        def run(conn):
            conn.execute(VACUUM_SQL)
            conn.execute(CHECKPOINT_TRUNCATE_SQL)

        self._execute_write(run, transaction=False)

    def schema_version(self):
        return self._read_value(SELECT_SCHEMA_VERSION_SQL)

    def stats(self):
        """Counts and sizes for `stats`: sessions, messages, sources, file size, versions."""
        self._flush_token_counts()
        by_source = {row[0]: row[1] for row in self._read_all(SESSIONS_BY_SOURCE_SQL)}
        return {
            "db_path": str(self.db_path),
            "db_bytes": store_file_bytes(self.db_path),
            "sessions": sum(by_source.values()),
            "sessions_by_source": by_source,
            "messages_active": self._read_value(COUNT_ACTIVE_MESSAGES_SQL),
            "messages_total": self._read_value(COUNT_ALL_MESSAGES_SQL),
            "schema_version": self.schema_version(),
            "fts_layout": self.fts_layout(),
        }

    def doctor(self):
        """Integrity, layouts, breadcrumbs, journal and runtime facts; `ok` is False on damage.

        Never raises on a damaged file: a check that cannot run is reported as such.
        """
        integrity = _checked(lambda: [row[0] for row in self._read_all(INTEGRITY_CHECK_SQL)])
        report = {
            "db_path": str(self.db_path),
            "integrity_check": integrity,
            "ok": integrity == ["ok"],
            "sqlite_version": sqlite3.sqlite_version,
            "fts5": self.fts_caps.fts5,
            "trigram": self.fts_caps.trigram,
            "wal_reset_bug": sqlite_has_wal_reset_bug(),
            "journal_mode": _checked(lambda: self._read_value(JOURNAL_MODE_SQL)),
            "journal_policy": self.policy.reason,
            "schema_version": _checked(self.schema_version),
            "schema_version_of_release": SCHEMA_VERSION,
            "stale_schema": self.stale_schema,
            "repairs_at_open": self.repairs,
        }
        search = _checked(self.search_health)
        report.update(search if isinstance(search, dict) else {"search_health": search})
        return report


def _checked(read):
    """`read()`, or what stopped it, for a report about a store that may be damaged."""
    try:
        return read()
    except sqlite3.DatabaseError as exc:
        return [f"could not run: {exc}"]
