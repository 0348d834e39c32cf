"""SessionSearchMixin: the full-text index generations and what they can answer.

Owns telling the search index layouts apart (legacy inline, hermes-agent's
external content, ours), the runtime capability probes (FTS5, trigram), the
search breadcrumbs in `state_meta`, and search health for `doctor`. It never
rebuilds an index layout on open: moving a legacy store to the current layout
is an explicit, separate operation.

It relies on SessionDB for `_read_one`/`_read_all`/`_execute_write`; it never
imports hermes_state.
"""

import sqlite3

from hermes_state_common import (
    META_FTS_CJK_STALE,
    META_FTS_OPTIMIZE_AVAILABLE,
    META_FTS_STALE,
    META_FTS_STORAGE_VERSION,
    SELECT_META_SQL,
    UPSERT_META_SQL,
)

FTS_TABLE = "messages_fts"
SELECT_FTS_DDL_SQL = "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?"


def _probe(connect, ddl):
    try:
        conn = connect(":memory:")
    except sqlite3.Error:
        return False
    try:
        conn.execute(ddl)
        conn.execute("DROP TABLE probe")
        return True
    except sqlite3.Error:
        return False
    finally:
        conn.close()


def sqlite_supports_fts5(connect=sqlite3.connect):
    """True if connections made by `connect` can create an FTS5 table."""
    return _probe(connect, "CREATE VIRTUAL TABLE temp.probe USING fts5(x)")


def sqlite_supports_trigram(connect=sqlite3.connect):
    """True if they also have FTS5's trigram tokenizer (SQLite 3.34 and later)."""
    return _probe(connect, "CREATE VIRTUAL TABLE temp.probe USING fts5(x, tokenize='trigram')")


def fts_layout_of(ddl):
    """Which generation a `messages_fts` DDL belongs to.

    'legacy': hermes-agent 0.19 and older, an inline table of `content` only
    (detected by the DDL not naming tool_name); 'external': external content
    read straight from `messages`; 'none' when there is no index.
    """
    if ddl is None:
        return "none"
    if "tool_name" not in ddl:
        return "legacy"
    return "external"


class SessionSearchMixin:
    """Search-side behaviour of SessionDB (see the module docstring)."""

    def _apply_search_schema(self, conn, objects):
        """On open: leave each generation as it is; flag a legacy store as optimizable."""
        layout = fts_layout_of(objects.get(FTS_TABLE, (None, None))[1])
        if layout == "legacy" and _meta(conn, META_FTS_OPTIMIZE_AVAILABLE) != "1":
            conn.execute(UPSERT_META_SQL, (META_FTS_OPTIMIZE_AVAILABLE, "1"))

    def _init_search_read_only(self):
        """A read-only open only looks; nothing to prepare yet."""

    def fts_layout(self):
        """'legacy', 'external' or 'none': the index generation on disk."""
        row = self._read_one(SELECT_FTS_DDL_SQL, (FTS_TABLE,))
        return fts_layout_of(row[0] if row else None)

    def fts_optimize_available(self):
        """True when the store still has the legacy index that optimize-storage would shrink."""
        return self._read_value(SELECT_META_SQL, (META_FTS_OPTIMIZE_AVAILABLE,)) == "1"

    def search_health(self):
        """The search facts `doctor` reports."""
        meta = {key: self._read_value(SELECT_META_SQL, (key,)) for key in (
            META_FTS_STORAGE_VERSION, META_FTS_OPTIMIZE_AVAILABLE, META_FTS_STALE, META_FTS_CJK_STALE)}
        return {"fts_layout": self.fts_layout(), "search_meta": meta}


def _meta(conn, key):
    row = conn.execute(SELECT_META_SQL, (key,)).fetchone()
    return None if row is None else row[0]
