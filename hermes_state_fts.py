"""SessionSearchIndexMixin: the life of the search index, from creation to retirement.

Owns: the store's index (hermes-agent 0.22's layout 3, `messages_fts` and `messages_fts_trigram`
with their views, triggers and `fts_*` keys, and our CJK side index under `hs_` names and
`hs_search_*` keys; see hermes_state_common), which index answers a search and how whole it is
(`_index_state`), finding and repairing what another program changed in it, moving every other
layout (ours of layouts 1-3, hermes-agent 0.20's, ours before layout 1) to it at open in chunks,
backfills and rebuilds, the CJK side index's queue and bounds, holding the triggers back for a bulk
insert, degrading on runtimes without FTS5 or the trigram tokenizer, `optimize_fts`,
optimize-storage (the only path from hermes-agent 0.19's inline index to layout 3), hermes-agent's
own probe of an index its optimize-storage would upgrade, and the search facts `doctor` reports.

It never parses or runs a search (SessionSearchMixin does, and calls `_read_objects`, `_index_state`
and `_mark_index_stale` here through `self`). It never changes hermes-agent 0.19's inline index on
open (0.22 keeps it too, until optimize-storage), except to drop the triggers this runtime cannot
run (as hermes-agent itself does).

It relies on SessionDB for `_execute_write`, `_read_all`/`_read_one`/`_read_value`,
`_with_fresh_reader`, `_commits`, `_cjk_drained`, `fts_caps`, `read_only`, `db_path`, `policy` and
`_checkpoint` (optimize-storage checkpoints between its chunks), and on SessionMaintenanceMixin for
`vacuum()` (after optimize-storage), all through `self`; it never imports another mixin or
hermes_state. SessionDB calls `_init_search` at a writable open and `_maintain_search` at the end of
each write; SessionPortabilityMixin calls `_hold_back_index_triggers` and `_index_held_back_rows`
around a bulk import; `_schema_version_held_back` is the named hook SessionSchemaMixin's version
stamp asks (this class comes before that mixin in SessionDB's bases, so its answer wins).
"""
import functools
import itertools
import logging
import shutil
import sqlite3
import time
from collections import namedtuple

from hermes_state_common import (
    CJK_BLOCK_BITS, CJK_BOUNDS_OBJECTS, CJK_GLOB, CJK_QUEUE_TABLE, DROP_TABLE_SQL,
    FTS5_SHADOW_SUFFIXES, FTS_STORAGE_VERSION, HERMES_FTS_TABLES, HERMES_FTS_TRIGGERS,
    HERMES_INDEX_META, META_FTS_CJK_STALE, META_FTS_STALE, META_FTS_STORAGE_VERSION,
    META_SEARCH_CJK_BOUNDS_PROGRESS, META_SEARCH_HERMES_FAILED, META_SEARCH_LAYOUT,
    META_SEARCH_STALE_PREFIX, META_SEARCH_TOOL_JSON_FROM, OLD_SEARCH_OBJECTS, ORPHAN_TRIGGER,
    PREVIOUS_LAYOUT_LEFTOVERS, PREVIOUS_LAYOUT_META, PREVIOUS_LAYOUT_TABLES, RENAME_TABLE_SQL,
    RETIRED_PREFIX, SEARCH_LAYOUT_VERSION, SEARCH_MARKS, SEARCH_OBJECTS, SEARCH_TABLES,
    SEARCH_TRIGGERS, TABLE_EXISTS_SQL, TOOL_INDEX_PREFIX_CHARS,
    _trigram_session, cjk_terms, placeholders, quote_identifier, same_ddl, store_file_bytes,
    trigger_writes,
)
from hermes_state_errors import is_fts_scoped_corruption_error
from hermes_state_schema import (
    SELECT_SCHEMA_OBJECTS_SQL, fts_layout_of, pause_between_chunks, read_meta, schema_objects,
    trigger_damage, write_meta)

logger = logging.getLogger("hermes_state")

# Ids the first chunk of a backfill covers; later chunks are sized to take about
# BACKFILL_CHUNK_SECONDS each (halved when one took over twice that, doubled when one took under
# half), between 16 and 4 times this: a tool row gives layout 3's word index up to 8,192
# characters, so 500 ids took 20-350 ms at 100,000 messages, as the rows ran.
BACKFILL_CHUNK_IDS = 500
BACKFILL_CHUNK_SECONDS = 0.04
DROP_CHUNK_ROWS = 500
CJK_DRAIN_CHUNK = 500
# Ids a chunk of the CJK bounds' fill covers (layout 1 to 2): 50,000, a quarter CJK, held 30-80 ms
# at 1M messages.
CJK_BOUNDS_CHUNK_IDS = 25_000
# At most this many queued CJK rows are indexed in one transaction (open or maintenance), so a
# foreign writer's backlog never means one long write lock (10,000 held it for 1.9 s on a busy
# 2-core machine); the rest stays answerable through the queue and goes with later writes.
CJK_DRAIN_MAX_ROWS = 500
# Merge steps beyond one per MERGE_STEP_PAGES rows of an index's _data table (the most its merge can
# write): the structure and averages rows, a partial page.
MERGE_EXTRA_STEPS = 4
# Queued CJK rows are indexed with every this-many commits of a writer, and right away by any
# transaction that changed at least BULK_CHANGES rows.
CJK_DRAIN_EVERY_COMMITS = 64
# A high water no message id reaches: our triggers index no row (see _hold_back_index_triggers).
UNREACHED_HIGH_WATER = str(2 ** 63 - 1)
BULK_CHANGES = 64
# optimize-storage checkpoints the WAL itself after every this-many steps: a teardown chunk
# changes fewer rows than a commit's own checkpoint waits for, so at 1M messages 500 of them left
# 880 MB of WAL, whose one checkpoint then held our writer lock for 2 s.
OPTIMIZE_CHECKPOINT_STEPS = 16
# The indexes a search may use: `tables` names them, `usable` are the whole ones but for `gaps`
# ({index: (progress, high water)}: the ids in between wait for a backfill); `substring` is the
# retry of a query whose words found nothing, inside longer tokens; `cjk_bounded`: every CJK row's
# block bound holds.
IndexState = namedtuple("IndexState", "layout tables usable gaps cjk_pending"
                                      " tool_rows substring cjk_bounded")

# -- The index's SQL ------------------------------------------------------------------------------
_MAX_MESSAGE_ID_SQL = "SELECT COALESCE(MAX(id), 0) FROM messages"
# FTS5 commands ('rebuild', 'optimize', 'delete-all', 'integrity-check') on one index.
_FTS_COMMAND_SQL = "INSERT INTO {table}({table}) VALUES ('{command}')"
# Backfill of our index, one id range (lo, hi] at a time.
_BACKFILL_SQL = {
    "word": "INSERT INTO messages_fts(rowid, content, tool_name, tool_calls)"
            " SELECT id, content, tool_name, tool_calls FROM messages_fts_src"
            " WHERE id > ? AND id <= ?",
    "trigram": "INSERT INTO messages_fts_trigram(rowid, content, tool_name)"
               " SELECT id, content, tool_name FROM messages_fts_trigram_src"
               " WHERE id > ? AND id <= ?",
    "cjk": "INSERT OR IGNORE INTO hs_fts_cjk_queue(id) SELECT id FROM messages"
           f" WHERE id > ? AND id <= ? AND role <> 'tool' AND content GLOB {CJK_GLOB}",
}
# Emptying one index of ours before it is filled again.
_RESET_INDEX_SQL = {
    "cjk": ("DELETE FROM hs_fts_cjk", "DELETE FROM hs_fts_cjk_queue"),
}
# The backfill pairs, hermes-agent's (word, trigram) first.
_MARK_PAIRS = tuple(dict.fromkeys(SEARCH_MARKS.values()))


def free_disk_bytes(path):
    """Free bytes on the filesystem holding `path` (the optimize-storage pre-check)."""
    return shutil.disk_usage(path).free


# -- What is on disk ------------------------------------------------------------------------------

def _ours(objects, index):
    """True if the table of `index` is there as this layout makes it."""
    table = SEARCH_TABLES[index]
    return same_ddl(objects.get(table, (None, None))[1], SEARCH_OBJECTS[index][table])


def _stale_key(index):
    return META_SEARCH_STALE_PREFIX + index


def _retired_tables(objects):
    """Index tables set aside and not yet dropped (their shadow tables aside)."""
    return sorted(name for name, (kind, sql) in objects.items()
                  if kind == "table" and name.startswith(RETIRED_PREFIX)
                  and (sql or "").startswith("CREATE VIRTUAL"))


def _drop(conn, kind, name):
    conn.execute(f"DROP {kind.upper()} {quote_identifier(name)}")


def _drop_writers(conn, objects, tables):
    """Drop every trigger that writes to one of `tables` (whoever made it)."""
    for name, (kind, sql) in objects.items():
        if kind == "trigger" and any(table in tables for table, _columns in trigger_writes(sql)):
            _drop(conn, "trigger", name)


def _retire(conn, objects, tables, also=()):
    """Set index tables aside under our own names (the legacy rename), with every trigger writing to
    them or to `also`; they are emptied and dropped in chunks later."""
    _drop_writers(conn, objects, set(tables) | set(also))
    # The legacy rename: renaming must not make SQLite re-check every trigger and view of the store
    # (one broken foreign trigger would block it).
    conn.execute("PRAGMA legacy_alter_table=ON")
    try:
        for table in tables:
            new, number = RETIRED_PREFIX + table, 1
            while new in objects:
                new, number = f"{RETIRED_PREFIX}{table}_{number}", number + 1
            conn.execute(RENAME_TABLE_SQL.format(table=quote_identifier(table),
                                                 new_name=quote_identifier(new)))
    finally:
        conn.execute("PRAGMA legacy_alter_table=OFF")


# Reads the structure record and no leaf page: SQLite 3.53 reads the record at a first query, not
# at connect, so a PRAGMA table_info no longer shows a broken one.
_OPEN_FTS_TABLE_SQL = "SELECT rowid FROM {table} WHERE rowid = 0"


def _empty_unreadable_structure(conn, table, db_path):
    """True if FTS5 could not open index `table` and its structure record was emptied. Such an index
    fails every write to messages (its trigger), and a rename or DROP (both open it first): SQLite
    3.40 calls a structure record of over 2,000 levels corrupt, and a negative 'merge' before every
    new segment grew one that far. Emptied, it opens again, to be set aside and dropped in chunks
    like any stale index; the messages it indexed are all still there to refill ours from."""
    try:
        conn.execute(_OPEN_FTS_TABLE_SQL.format(table=quote_identifier(table))).fetchall()
        return False
    except sqlite3.DatabaseError as exc:
        data = quote_identifier(f"{table}_data")
        # Row 10 of an FTS5 index's _data table is its structure record (segments by level).
        row = conn.execute(f"SELECT block FROM {data} WHERE id = 10").fetchone()
        if row is None or not isinstance(row[0], bytes) or len(row[0]) < 4:
            raise
        # Kept: the 4-byte configuration cookie. Then no level, no segment, no write yet.
        conn.execute(f"UPDATE {data} SET block = ? WHERE id = 10", (row[0][:4] + bytes(3),))
        logger.warning("search: FTS5 could not open the index table %s of %s (%s); emptied its"
                       " structure record so it can be set aside and rebuilt from the messages",
                       table, db_path, exc)
        return True


def _create(conn, objects, name, ddl, db_path):
    """Run `ddl`, which makes `name`: an FTS5 table's shadow tables a recovery kept without their
    table (they would block the CREATE) are dropped first."""
    if ddl.startswith("CREATE VIRTUAL"):
        shadows = [f"{name}_{suffix}" for suffix in FTS5_SHADOW_SUFFIXES
                   if f"{name}_{suffix}" in objects]
        for shadow in shadows:
            _drop(conn, "table", shadow)
        if shadows:
            logger.warning("search: dropped %s of %s, kept without their table %s",
                           ", ".join(shadows), db_path, name)
    conn.execute(ddl)


def drain_cjk_queue(conn, limit=CJK_DRAIN_CHUNK):
    """Index up to `limit` queued rows into our CJK index and raise their blocks' bounds; returns
    how many."""
    rows = conn.execute("SELECT q.id, m.content, m.timestamp FROM hs_fts_cjk_queue AS q"
                        " JOIN messages AS m ON m.id = q.id ORDER BY q.id LIMIT ?",
                        (limit,)).fetchall()
    for message_id, content, timestamp in rows:
        if content is not None:
            conn.execute("INSERT OR REPLACE INTO hs_fts_cjk(rowid, terms) VALUES (?, ?)",
                         (message_id, cjk_terms(content)))
            if timestamp is not None:  # a backfill's rows: the triggers raised the others'
                conn.execute("INSERT INTO hs_fts_cjk_bounds(block, newest) VALUES (?, ?)"
                             " ON CONFLICT(block) DO UPDATE"
                             " SET newest = max(newest, excluded.newest)",
                             (message_id >> CJK_BLOCK_BITS, timestamp))
        conn.execute("DELETE FROM hs_fts_cjk_queue WHERE id = ?", (message_id,))
    return len(rows)


def _progress(phase, status):
    """An optimize-storage progress report as hermes-agent shapes it (whole percent; 100, 0, 0
    without a backfill)."""
    status = status or {"percent": 100, "indexed": 0, "total": 0}
    return {"phase": phase, "percent": status["percent"],
            "indexed": status["indexed"], "total": status["total"]}


class SessionSearchIndexMixin:
    """Index-side behaviour of SessionDB (see the module docstring).

    Relies on: `_execute_write`, `_read_all`, `_read_one`, `_read_value`, `_with_fresh_reader`,
    `_checkpoint` and the attributes `db_path`, `policy`, `read_only`, `fts_caps`, `_commits`,
    `_cjk_drained` (SessionDB); `vacuum` (maintenance mixin).
    """

    # hermes-agent 0.22's gateway asks the class whether a failed transcript write met damage in
    # the search index only (one retry then), or in the store.
    _is_fts_write_corruption_error = staticmethod(is_fts_scoped_corruption_error)

    # Leaf pages one step of an index merge writes: 500 took up to 0.6 s at 1M messages on a busy
    # 2-core machine, 200 up to 0.8 s with the checkpoint after it; issue 17's bound on a write-lock
    # hold is 1 s.
    MERGE_STEP_PAGES = 100

    # -- open ------------------------------------------------------------------

    def _init_search(self):
        """Writable open: repair our index, or build it where no usable index is; True if that
        started a backfill, which the open runs to the end in chunks; work an interrupted
        optimize-storage left waits."""
        return self._execute_write(self._apply_search_schema)

    def _schema_version_held_back(self, conn):
        """Without FTS5 the store keeps its schema version (docs/search.md, "Degraded runtimes")."""
        return not self.fts_caps.fts5

    def _apply_search_schema(self, conn, optimize=False):
        objects = schema_objects(conn)
        moved = self.fts_caps.fts5 and self._move_previous_layout(conn, objects)
        objects = schema_objects(conn, objects)
        self._drop_hermes_triggers_not_runnable(conn, objects)
        objects = schema_objects(conn, objects)
        started = False
        foreign = self._foreign_tables(objects)
        if foreign or SEARCH_TABLES["word"] not in objects:
            if not self.fts_caps.fts5:
                _drop_writers(conn, objects, set(OLD_SEARCH_OBJECTS))  # they would fail every write
                return False
            if not (moved or optimize) and self._keeps_hermes_index(conn, objects):
                return False
            started = self._move_to_layout(conn, objects, foreign)
            objects = schema_objects(conn, objects)
        if self.fts_caps.fts5 and SEARCH_TABLES["cjk"] not in objects:
            # A store hermes-agent indexed: its two indexes stay, ours is added beside them.
            started = self._create_search_index(conn, ["cjk"]) or started
            objects = schema_objects(conn, objects)
        return self._repair_search_index(conn, objects) or started or moved

    def _buildable(self):
        """Our indexes this runtime can keep (the trigram one needs its tokenizer)."""
        return tuple(index for index in SEARCH_TABLES
                     if self.fts_caps.fts5 and (index != "trigram" or self.fts_caps.trigram))

    def _move_previous_layout(self, conn, objects):
        """Set aside (with any trigger writing to them) the index our releases before layout 1 kept
        under hermes-agent's names and keys, so ours is built under our names; True if there was
        one."""
        old = [table for table, word in PREVIOUS_LAYOUT_TABLES.items()
               if word in (objects.get(table, (None, None))[1] or "")]
        leftovers = [name for name in PREVIOUS_LAYOUT_LEFTOVERS if name in objects]
        if not old and not leftovers:
            return False
        # SQLite opens an FTS5 table to rename it, which takes its tokenizer: without trigram, that
        # table stays (its triggers go) until a runtime with the tokenizer sets it aside.
        stuck = [t for t in old if "trigram" in objects[t][1]] if not self.fts_caps.trigram else []
        old = [table for table in old if table not in stuck]
        _retire(conn, objects, old, also=[*PREVIOUS_LAYOUT_LEFTOVERS, *stuck])
        for name in leftovers:
            _drop(conn, PREVIOUS_LAYOUT_LEFTOVERS[name], name)
        if HERMES_FTS_TABLES["word"] in old:
            # No index of hermes-agent's was there, so every fts_* key was ours.
            for key in PREVIOUS_LAYOUT_META:
                write_meta(conn, key, None)
        logger.info("search: moved the index of %s off hermes-agent's names (%s);"
                    " rebuilding it as ours",
                    self.db_path, ", ".join(old + leftovers))
        return True

    def _drop_hermes_triggers_not_runnable(self, conn, objects):
        """Drop hermes-agent's triggers this runtime cannot run (they would fail every write), as it
        does itself (it rebuilds when they are back). Its CJK index needs a tokenizer only its
        connections load."""
        for index, names in HERMES_FTS_TRIGGERS.items():
            runnable = index != "cjk" and self.fts_caps.fts5 and (
                index != "trigram" or self.fts_caps.trigram)
            present = [name for name in names if name in objects]
            if runnable or not present:
                continue
            for name in present:
                _drop(conn, "trigger", name)
            if index == "cjk":
                # hermes-agent's own breadcrumb for exactly this
                write_meta(conn, META_FTS_CJK_STALE, "1")
            logger.info("search: dropped hermes-agent's %s index triggers of %s"
                        " (this runtime cannot run them)",
                        index, self.db_path)

    def _keeps_hermes_index(self, conn, objects):
        """True if the store keeps hermes-agent 0.19's inline index (0.22 keeps it until its
        optimize-storage too): whole enough to answer searches, and no index of ours to move."""
        return fts_layout_of(objects.get(HERMES_FTS_TABLES["word"], (None, None))[1]) == "legacy" \
            and all(n in objects for n in HERMES_FTS_TRIGGERS["word"]) \
            and not read_meta(conn, META_FTS_STALE) \
            and not read_meta(conn, META_SEARCH_HERMES_FAILED) \
            and not any(table in objects for table in OLD_SEARCH_OBJECTS)

    def _foreign_tables(self, objects):
        """The word and trigram index tables here that are not this layout's (ours of layouts 1-3,
        hermes-agent's older ones): set aside by a move. A trigram table only where its tokenizer
        is here (SQLite needs it to rename the table)."""
        found = []
        for index, old in (("word", "hs_fts_words"), ("trigram", "hs_fts_trigram")):
            if index == "trigram" and not self.fts_caps.trigram:
                continue
            table = SEARCH_TABLES[index]
            found += [old] if old in objects else []
            found += [table] if table in objects and not _ours(objects, index) else []
        return found

    def _move_to_layout(self, conn, objects, foreign):
        """Set `foreign` aside (with every trigger writing to them and our old views), make this
        layout's word and trigram indexes and start their backfill in chunks (fts_rebuild_step);
        True if rows wait for it. Searches meanwhile read the rows not yet indexed by the
        fallback."""
        if foreign:
            _retire(conn, objects, foreign)
            for table, (view, *_triggers) in OLD_SEARCH_OBJECTS.items():
                if view in objects:
                    _drop(conn, "view", view)
            # The keys described the index set aside; the new one's are written as it fills.
            for key in HERMES_INDEX_META + (META_SEARCH_TOOL_JSON_FROM,):
                write_meta(conn, key, None)
            logger.info("search: set aside the index of %s (%s); filling hermes-agent's layout %d"
                        " in its place", self.db_path, ", ".join(foreign), FTS_STORAGE_VERSION)
        return self._create_search_index(conn, ["word", "trigram"])

    def _create_search_index(self, conn, indexes):
        """Make what is missing of `indexes` (those this runtime can keep), with every existing row
        pending their chunked backfill; True if rows wait for it."""
        objects = schema_objects(conn)
        indexes = [index for index in self._buildable()
                   if index in indexes and SEARCH_TABLES[index] not in objects]
        for index in indexes:
            for name, ddl in (*SEARCH_OBJECTS[index].items(), *SEARCH_TRIGGERS[index].items()):
                kind, sql = objects.get(name, (None, None))
                if not same_ddl(sql, ddl):
                    if kind is not None:
                        _drop(conn, kind, name)  # a view or trigger of another layout
                    _create(conn, objects, name, ddl, self.db_path)
            write_meta(conn, _stale_key(index), None)
        write_meta(conn, META_SEARCH_HERMES_FAILED, None)
        write_meta(conn, META_SEARCH_LAYOUT, str(SEARCH_LAYOUT_VERSION))
        return self._start_backfill(conn, indexes)

    def _start_backfill(self, conn, indexes):
        """Every row now pending the backfill of `indexes` (each pair of marks they test); True if
        there are rows."""
        high_water = conn.execute(_MAX_MESSAGE_ID_SQL).fetchone()[0]
        if "cjk" in indexes:
            conn.execute(_RESET_INDEX_SQL["cjk"][1])  # the queue: every row is refilled
        for high_key, progress_key in {SEARCH_MARKS[index] for index in indexes}:
            write_meta(conn, high_key, str(high_water) if high_water else None)
            write_meta(conn, progress_key, "0" if high_water else None)
        if set(indexes) & {"word", "trigram"}:
            self._stamp_storage_version(conn)
        return bool(high_water)

    def _stamp_storage_version(self, conn):
        """hermes-agent's fts_storage_version of a whole layout 3 index (0.22 stamps it when its
        backfill is done; 0.20 writes 1 over it, harmlessly); written only when it changes."""
        if read_meta(conn, SEARCH_MARKS["word"][0]) is None \
                and read_meta(conn, META_FTS_STORAGE_VERSION) != str(FTS_STORAGE_VERSION):
            write_meta(conn, META_FTS_STORAGE_VERSION, str(FTS_STORAGE_VERSION))

    def _repair_search_index(self, conn, objects):
        """Put back what someone else changed in the index (stamp, objects), drop the triggers of an
        index this runtime cannot keep, rebuild every one not whole; True if a backfill or the CJK
        bounds' fill is due."""
        layout = read_meta(conn, META_SEARCH_LAYOUT)
        if layout == "1" and self._add_cjk_bounds(conn, objects):
            objects = schema_objects(conn, objects)
        if layout in ("1", "2", "3") or (layout is None and SEARCH_TABLES["cjk"] not in objects):
            # Older layouts' word and trigram indexes were moved (_move_to_layout); a store
            # hermes-agent indexed has no stamp of ours yet.
            write_meta(conn, META_SEARCH_LAYOUT, str(SEARCH_LAYOUT_VERSION))
        if read_meta(conn, META_SEARCH_LAYOUT) != str(SEARCH_LAYOUT_VERSION):
            logger.warning("search: the layout stamp of our index in %s was changed;"
                           " rebuilding the index",
                           self.db_path)
            write_meta(conn, META_SEARCH_LAYOUT, str(SEARCH_LAYOUT_VERSION))
            for index in SEARCH_TABLES:
                write_meta(conn, _stale_key(index), "1")
        if read_meta(conn, META_FTS_STALE):  # hermes-agent detached its two (corruption)
            for index in ("word", "trigram"):
                write_meta(conn, _stale_key(index), "1")
        buildable = self._buildable()
        for index in SEARCH_TABLES:
            if index in buildable:
                # An index we set aside ourselves (no FTS5 or trigram then) is expected to need it.
                expected = bool(read_meta(conn, _stale_key(index)))
                changed = self._restore_objects(conn, index, objects, expected)
                emptied = _empty_unreadable_structure(conn, SEARCH_TABLES[index], self.db_path)
                changed = emptied or changed
            else:
                changed = [name for name in SEARCH_TRIGGERS[index] if name in objects]
                for name in changed:
                    _drop(conn, "trigger", name)
                changed = changed or not self.fts_caps.fts5 or SEARCH_TABLES[index] not in objects
            if changed:
                # Rows written while it was not kept are missing from it.
                write_meta(conn, _stale_key(index), "1")
        # A fill another open began (and did not finish) goes on from where it stopped.
        filling = any(read_meta(conn, key) is not None for key in
                      (META_SEARCH_CJK_BOUNDS_PROGRESS, *[high for high, _ in _MARK_PAIRS]))
        started = self._rebuild_stale_indexes(conn)
        if self.fts_caps.fts5 and _ours(schema_objects(conn, objects), "word"):
            self._stamp_storage_version(conn)
        return started or filling

    def _add_cjk_bounds(self, conn, objects):
        """Layout 1 to 2 without a rebuild: the CJK bounds and the triggers that raise them, filled
        from every indexed row in chunks (fts_rebuild_step); True if that fill is pending. Rows they
        hold from an earlier layout 2 stay: a bound only has to be at least each row's time."""
        write_meta(conn, META_SEARCH_LAYOUT, str(SEARCH_LAYOUT_VERSION))
        if "cjk" not in self._buildable() or SEARCH_TABLES["cjk"] not in objects:
            return False  # the repair rebuilds or drops it
        ddl = {**SEARCH_OBJECTS["cjk"], **SEARCH_TRIGGERS["cjk"]}
        for name in CJK_BOUNDS_OBJECTS:  # layout 1's triggers raise no bound
            kind, sql = schema_objects(conn).get(name, (None, None))
            if kind and not same_ddl(sql, ddl[name]):
                _drop(conn, kind, name)
            if not same_ddl(sql, ddl[name]):
                conn.execute(ddl[name])
        write_meta(conn, META_SEARCH_CJK_BOUNDS_PROGRESS, "0")
        logger.info("search: adding the CJK bounds of layout %d to %s", SEARCH_LAYOUT_VERSION,
                    self.db_path)
        return True

    def _restore_objects(self, conn, index, objects, expected):
        """Create each object of `index` that is missing or differs from ours; their names."""
        changed = []
        for name, ddl in (*SEARCH_OBJECTS[index].items(), *SEARCH_TRIGGERS[index].items()):
            kind, sql = objects.get(name, (None, None))
            if same_ddl(sql, ddl):
                continue
            if kind is not None:
                _drop(conn, kind, name)
            _create(conn, objects, name, ddl, self.db_path)
            if name == ORPHAN_TRIGGER and kind is None:
                # hermes-agent's store has none; its own deletes take the rows out first.
                logger.info("search: added %s to %s", name, self.db_path)
            else:
                changed.append(name)
        if changed:
            logger.log(logging.INFO if expected else logging.WARNING,
                       "search: restored %s of our index in %s",
                       ", ".join(changed), self.db_path)
        return changed

    def _rebuild_stale_indexes(self, conn):
        """Refill an index from the start when it is not whole; True if that started a backfill.

        Indexes sharing a backfill pair (hermes-agent's two) are refilled together, in chunks
        (fts_rebuild_step). Emptying a filled index in place rewrites every page of it in this one
        transaction (3-5 s at 1M messages): it is set aside instead, and dropped in chunks once the
        backfill is done."""
        stale = [index for index in self._buildable() if read_meta(conn, _stale_key(index))]
        if not stale:
            return False
        pairs = {SEARCH_MARKS[index] for index in stale}
        indexes = [index for index in self._buildable() if SEARCH_MARKS[index] in pairs]
        objects = schema_objects(conn)
        _retire(conn, objects,
                [SEARCH_TABLES[index] for index in indexes if SEARCH_TABLES[index] in objects])
        objects = schema_objects(conn)
        for index in indexes:
            for name, ddl in (*SEARCH_OBJECTS[index].items(), *SEARCH_TRIGGERS[index].items()):
                if name not in objects:
                    conn.execute(ddl)
            write_meta(conn, _stale_key(index), None)
        if "word" in indexes:
            write_meta(conn, META_FTS_STALE, None)  # hermes-agent's note: rebuilt now
        logger.info("search: rebuilding the %s index of %s", "/".join(stale), self.db_path)
        self._start_backfill(conn, indexes)
        return True

    def _rebuild_index(self, conn, index):
        if index == "cjk":
            for sql in _RESET_INDEX_SQL["cjk"]:
                conn.execute(sql)
            conn.execute(_BACKFILL_SQL["cjk"], (0, conn.execute(_MAX_MESSAGE_ID_SQL).fetchone()[0]))
            while drain_cjk_queue(conn):
                pass
        else:
            conn.execute(_FTS_COMMAND_SQL.format(table=SEARCH_TABLES[index], command="rebuild"))

    def _maintain_search(self, conn, changes):
        """At the end of every write transaction that changed `changes` rows: index queued CJK rows
        after a bulk write and on every 64th commit from the first (the open's own), at most
        CJK_DRAIN_MAX_ROWS."""
        commit_number = self._commits + 1  # this transaction's, counted by the write path
        drained, self._cjk_drained = self._cjk_drained, False
        if drained or (changes < BULK_CHANGES and commit_number % CJK_DRAIN_EVERY_COMMITS != 1):
            return
        if self.fts_caps.fts5 and conn.execute(TABLE_EXISTS_SQL, (CJK_QUEUE_TABLE,)).fetchone():
            drain_cjk_queue(conn, CJK_DRAIN_MAX_ROWS)

    # -- state ---------------------------------------------------------------

    def fts_layout(self):
        """'current' (ours), hermes-agent's 'legacy' or 'external', 'previous' (ours, not yet moved)
        or 'none'."""
        return self._index_state().layout

    def fts_optimize_available(self):
        """True when optimize-storage has work: an index of another layout to replace (0.19's
        inline one), or ours unfinished."""
        if not self.fts_caps.fts5 or self.read_only:
            return False
        objects = self._read_objects()
        keys = [high for high, _progress in _MARK_PAIRS] \
            + [_stale_key(index) for index in self._buildable()]
        return not _ours(objects, "word") or bool(_retired_tables(objects)) \
            or bool(self._foreign_tables(objects)) or any(self._read_meta(*keys).values())

    @staticmethod
    def _db_needs_fts_storage_upgrade(cursor):
        """hermes-agent 0.22's probe (`hermes update` reads it on a read-only open): True when the
        store `cursor` (or a connection) reads holds hermes-agent's index in a layout its
        optimize-storage upgrades: 0.19's inline word index (fts_layout_of 'legacy'), or a trigram
        index that still indexes tool calls (0.20's). 0.22's own layout, and a store with ours
        alone, answer False."""
        ddl = dict(cursor.execute(
            "SELECT name, sql FROM sqlite_master"
            " WHERE type = 'table' AND name IN (:word, :trigram)",
            {"word": HERMES_FTS_TABLES["word"], "trigram": HERMES_FTS_TABLES["trigram"]}))
        trigram = ddl.get(HERMES_FTS_TABLES["trigram"]) or ""
        return (fts_layout_of(ddl.get(HERMES_FTS_TABLES["word"])) == "legacy"
                or "tool_calls" in trigram.lower())

    def _read_objects(self):
        """{name: (type, sql)} of sqlite_master, through a read connection."""
        return {name: (kind, sql) for kind, name, sql in self._read_all(SELECT_SCHEMA_OBJECTS_SQL)}

    def _read_meta(self, *keys):
        """{key: value or None} for these state_meta keys, in one query."""
        found = dict(self._read_all(
            f"SELECT key, value FROM state_meta WHERE key IN ({placeholders(len(keys))})", keys))
        return {key: found.get(key) for key in keys}

    def _index_state(self, objects=None):
        """Which indexes answer a search: layout 3's and ours when the store has them, else
        hermes-agent 0.19's (or, on a read-only open, any other release's)."""
        objects = self._read_objects() if objects is None else objects
        stale = [_stale_key(index) for index in SEARCH_TABLES]
        meta = self._read_meta(*[key for pair in _MARK_PAIRS for key in pair],
                               META_FTS_STALE, META_SEARCH_HERMES_FAILED,
                               META_SEARCH_CJK_BOUNDS_PROGRESS, META_SEARCH_LAYOUT, *stale)
        if _ours(objects, "word"):
            layout, tables, triggers = "current", SEARCH_TABLES, SEARCH_TRIGGERS
            marks = SEARCH_MARKS
            blocked = {index: meta[_stale_key(index)] for index in SEARCH_TABLES}
            for index in ("word", "trigram"):
                blocked[index] = blocked[index] or meta[META_FTS_STALE]
        else:
            layout = fts_layout_of(objects.get(HERMES_FTS_TABLES["word"], (None, None))[1])
            tables = {index: HERMES_FTS_TABLES[index] for index in ("word", "trigram")}
            triggers = HERMES_FTS_TRIGGERS
            marks = SEARCH_MARKS  # (its triggers read hermes-agent's pair, as ours do)
            blocked = dict.fromkeys(tables, meta[META_FTS_STALE] or meta[META_SEARCH_HERMES_FAILED])
        usable = {index for index, table in tables.items()
                  if table in objects and not blocked[index]
                  and all(name in objects for name in triggers[index])
                  and self.fts_caps.fts5 and (index != "trigram" or self.fts_caps.trigram)}
        gaps = {index: (int(meta[marks[index][1]] or 0), int(meta[marks[index][0]]))
                for index in usable if meta[marks[index][0]]}
        pending = "cjk" in usable \
            and self._read_one("SELECT 1 FROM hs_fts_cjk_queue LIMIT 1") is not None
        # Bounds an older release left behind (its layout stamp) may miss rows it indexed since.
        bounded = layout == "current" \
            and meta[META_SEARCH_LAYOUT] in ("2", "3", str(SEARCH_LAYOUT_VERSION)) \
            and "hs_fts_cjk_bounds" in objects and not meta[META_SEARCH_CJK_BOUNDS_PROGRESS]
        return IndexState(layout, tables, usable, gaps, pending, False, False, bounded)

    def fts_rebuild_status(self):
        """{pending: True, total, indexed, percent (whole, 0-100)} while an index searches use is
        being backfilled (hermes-agent's two first); None otherwise."""
        state = self._index_state()
        gap = next((state.gaps[index] for index in SEARCH_TABLES if index in state.gaps), None)
        if gap is None:
            return None
        progress, high_water = gap
        return {"pending": True, "total": high_water, "indexed": progress,
                "percent": min(100, 100 * progress // high_water)}

    def _rebuild_phase(self):
        """What a backfill or an optimize still has to do, or None when nothing is pending."""
        status = self.fts_rebuild_status()
        if status is not None:
            return dict(status, phase="backfill")
        retired = _retired_tables(self._read_objects())
        return {"phase": "teardown", "tables": retired} if retired else None

    def search_health(self):
        """The search facts `doctor` reports; `trigger_damage` lists every trigger whose writes
        would fail."""
        objects = self._read_objects()
        state = self._index_state(objects)
        triggers = SEARCH_TRIGGERS if state.layout == "current" else HERMES_FTS_TRIGGERS
        return {
            "fts_layout": state.layout,
            "search_layout_of_release": SEARCH_LAYOUT_VERSION,
            "hermes_agent_index": fts_layout_of(
                objects.get(HERMES_FTS_TABLES["word"], (None, None))[1]),
            "fts_triggers_complete": {index: all(name in objects for name in triggers[index])
                                      for index, table in state.tables.items() if table in objects},
            "search_meta": self._read_meta(
                META_SEARCH_LAYOUT, *SEARCH_MARKS["cjk"], META_SEARCH_CJK_BOUNDS_PROGRESS,
                META_SEARCH_HERMES_FAILED, *[_stale_key(i) for i in SEARCH_TABLES]),
            "hermes_agent_meta": self._read_meta(*HERMES_INDEX_META, META_FTS_CJK_STALE),
            "fts_rebuild": self._rebuild_phase(),
            "searchable_by_index": sorted(state.usable),
            "trigger_damage": self._with_fresh_reader(
                lambda conn: trigger_damage(objects, lambda sql: conn.execute(sql).fetchall())),
        }

    def _mark_index_stale(self, exc, state):
        """Answer by the fallback; rebuild the index (or build layout 3 beside hermes-agent 0.19's)
        at the next open. hermes-agent's `fts_stale` says so to its releases too: they search by
        LIKE meanwhile."""
        logger.warning("search: the index of %s failed (%s); answering by the fallback until"
                       " the next open",
                       self.db_path, exc)
        if self.read_only:
            return
        keys = [_stale_key(index) for index in state.usable] if state.layout == "current" \
            else [META_SEARCH_HERMES_FAILED]
        if state.layout == "current" and state.usable & {"word", "trigram"}:
            keys.append(META_FTS_STALE)
        self._execute_write(lambda conn: [write_meta(conn, key, "1") for key in keys])

    # -- bulk inserts ----------------------------------------------------------

    def _hold_back_index_triggers(self, conn):
        """Inside a write, before a bulk insert of new messages (an import): hold the index triggers
        back so that _index_held_back_rows puts its rows into the indexes with one statement an
        index, and return what it needs; None when the triggers index as usual: none of this
        layout, an insert trigger not as we make it, a backfill under way. The triggers test "id >
        high water OR id <= progress", false for every row under a high water no id reaches; the
        insert triggers, whose test costs twice the row's insert, are dropped. Marks and drops live
        only inside this transaction: no other writer sees them, a rollback undoes them."""
        objects = schema_objects(conn)
        inserts = {f"{SEARCH_TABLES[index]}_insert": index for index in SEARCH_TRIGGERS}
        held = [(index, name, objects[name][1])
                for name, index in inserts.items() if name in objects]
        pairs = {SEARCH_MARKS[index] for index, _name, _sql in held}
        if not held \
                or not all(same_ddl(sql, SEARCH_TRIGGERS[index][name])
                           for index, name, sql in held) \
                or any(read_meta(conn, key) is not None for pair in pairs for key in pair):
            return None
        for high_key, _progress_key in pairs:
            write_meta(conn, high_key, UNREACHED_HIGH_WATER)
        for _index, name, _sql in held:
            conn.execute(f"DROP TRIGGER {name}")
        return held, conn.execute(_MAX_MESSAGE_ID_SQL).fetchone()[0]

    def _index_held_back_rows(self, conn, held):
        """Inside the same write, after the bulk insert: take the marks back, make the triggers
        again (stored text) and put every row past the insert's first id into their indexes, as
        they would have (CJK: by its queue)."""
        if held is None:
            return
        triggers, after = held
        for index, _name, _sql in triggers:
            write_meta(conn, SEARCH_MARKS[index][0], None)
        last = conn.execute(_MAX_MESSAGE_ID_SQL).fetchone()[0]
        for index, _name, sql in triggers:
            conn.execute(sql)
            conn.execute(_BACKFILL_SQL[index], (after, last))

    def _index_staged_trigram_rows(self, conn, staging, after):
        """Inside the write that staged them: put the messages past id `after` whose session row
        waits in the table `staging` (a file import's) into messages_fts_trigram. Its trigger and
        backfill ask `sessions` for the row, where a staged one is not yet; the word and CJK
        indexes ask nothing of it. A discarded staging's rows leave by ORPHAN_TRIGGER."""
        if f"{SEARCH_TABLES['trigram']}_insert" not in schema_objects(conn):
            return  # no trigram index maintained here (none, or hermes-agent 0.19's inline one)
        conn.execute(f"""INSERT INTO {SEARCH_TABLES['trigram']}(rowid, content, tool_name)
SELECT m.id, m.content, m.tool_name FROM messages AS m JOIN {staging} AS s ON s.id = m.session_id
WHERE m.id > :after AND m.role <> 'tool' AND {_trigram_session('s.')}""", {"after": after})

    # -- maintenance -----------------------------------------------------------

    def fts_rebuild_step(self):
        """Do one short transaction of pending index work (a backfill, CJK bounds, CJK queue,
        teardown); True while more remains."""
        return self._execute_write(self._rebuild_step)

    def _rebuild_step(self, conn):
        objects = schema_objects(conn)
        for pair in _MARK_PAIRS:
            indexes = [index for index in self._buildable()
                       if SEARCH_MARKS[index] == pair and _ours(objects, index)]
            if indexes and read_meta(conn, pair[0]) is not None:
                self._backfill_chunk(conn, indexes, pair)
                return True
        bounded = read_meta(conn, META_SEARCH_CJK_BOUNDS_PROGRESS)
        if bounded is not None:
            lower, upper = int(bounded), int(bounded) + CJK_BOUNDS_CHUNK_IDS
            more = self.fts_caps.fts5 \
                and {SEARCH_TABLES["cjk"], "hs_fts_cjk_bounds"} <= set(objects) \
                and conn.execute("SELECT 1 FROM hs_fts_cjk WHERE rowid > ? LIMIT 1",
                                 (lower,)).fetchone()
            if more:
                # The CJK bounds (see CJK_BLOCK_BITS), filled from the rows a layout 1 store
                # indexed.
                conn.execute(f"""INSERT INTO hs_fts_cjk_bounds(block, newest)
SELECT m.id >> {CJK_BLOCK_BITS}, max(m.timestamp)
FROM hs_fts_cjk AS c CROSS JOIN messages AS m ON m.id = c.rowid
WHERE c.rowid > ? AND c.rowid <= ? AND m.timestamp IS NOT NULL GROUP BY 1
ON CONFLICT(block) DO UPDATE SET newest = max(newest, excluded.newest)""", (lower, upper))
            write_meta(conn, META_SEARCH_CJK_BOUNDS_PROGRESS, str(upper) if more else None)
            return True
        if CJK_QUEUE_TABLE in objects and self.fts_caps.fts5 and drain_cjk_queue(conn):
            self._cjk_drained = True  # this transaction's share: _maintain_search adds none
            return True
        retired = _retired_tables(objects)
        if retired:
            _drop_retired_chunk(conn, retired[0], objects)
            return True
        return False

    def _backfill_chunk(self, conn, indexes, pair):
        """The next chunk of ids into `indexes`, which test the marks `pair`."""
        high_key, progress_key = pair
        high_water = int(read_meta(conn, high_key))
        progress = int(read_meta(conn, progress_key) or 0)
        size = self.__dict__.get("_backfill_ids", BACKFILL_CHUNK_IDS)
        upper = min(progress + size, high_water)
        start = time.monotonic()
        for index in indexes:
            conn.execute(_BACKFILL_SQL[index], (progress, upper))
        took = time.monotonic() - start
        if took > 2 * BACKFILL_CHUNK_SECONDS:
            size = max(16, size // 2)
        elif took < BACKFILL_CHUNK_SECONDS / 2:
            size = min(4 * BACKFILL_CHUNK_IDS, size * 2)
        self._backfill_ids = size
        if upper >= high_water:
            write_meta(conn, high_key, None)
        write_meta(conn, progress_key, None if upper >= high_water else str(upper))
        if upper >= high_water and "word" in indexes:
            self._stamp_storage_version(conn)

    def rebuild_fts(self):
        """Rebuild the indexes searches use (ours, else hermes-agent's) from the messages; returns
        how many, 0 without any (hermes-agent's gateway calls it after an append failed on its
        index).

        An explicit repair in one transaction, which holds the write lock to the end and logs so
        first."""
        objects = self._read_objects()
        state = self._index_state(objects)
        indexes = [index for index in self._buildable() if SEARCH_TABLES[index] in objects] \
            if state.layout == "current" else list(state.usable)
        if not indexes:
            return 0
        logger.info("search: rebuilding %s of %s holds the write lock until it is done",
                    "/".join(indexes),
                    self.db_path)

        def rebuild(conn):
            if state.layout == "current":
                for index in indexes:
                    self._rebuild_index(conn, index)
                # A whole index has no backfill left (its triggers read the marks).
                for key in (*[key for index in indexes for key in SEARCH_MARKS[index]],
                            *map(_stale_key, indexes), META_FTS_STALE):
                    write_meta(conn, key, None)
                self._stamp_storage_version(conn)
                return
            for index in indexes:
                conn.execute(_FTS_COMMAND_SQL.format(table=state.tables[index], command="rebuild"))
            for key in SEARCH_MARKS["word"]:  # hermes-agent's triggers read them
                write_meta(conn, key, None)
        self._execute_write(rebuild)
        return len(indexes)

    def optimize_fts(self):
        """Merge each index's segments into one and index queued CJK rows; returns how many indexes.

        FTS5's 'optimize' would rewrite a whole index in one transaction (over a minute at 1M
        messages); its incremental 'merge', MERGE_STEP_PAGES leaf pages a transaction, ends with the
        same single segment. Only the first step groups the segments (a negative 'merge', as
        'optimize' does): each grouping adds a level to the index's structure record, and SQLite
        3.40's FTS5 calls an index of over 2,000 levels corrupt, which a live writer's new segment
        before every step reached in about 1,000 steps. Later steps only carry that merge on, and
        stop after the pages it needs, whatever the writers add meanwhile."""
        while self.fts_rebuild_step():
            pause_between_chunks()
        state = self._index_state()
        for index in state.usable:
            table = state.tables[index]
            steps = self._read_value(f"SELECT COUNT(*) FROM {quote_identifier(f'{table}_data')}") \
                // self.MERGE_STEP_PAGES + MERGE_EXTRA_STEPS
            step = functools.partial(_merge_step, table=table, pages=self.MERGE_STEP_PAGES,
                                     group=True)
            while self._execute_write(step) and steps > 1:
                step, steps = functools.partial(step, group=False), steps - 1
                pause_between_chunks()
        return len(state.usable)

    def optimize_fts_storage(self, *, progress_cb=None, vacuum=True):
        """Move the store to our index and reclaim the space; hermes-agent's result dict.

        {"ok": True, "vacuumed": True/False (None when not asked)}, or {"ok": False, "reason": ...}
        when refused ("fts5_unavailable", "read_only", "insufficient_disk" with a "detail",
        "backfill_incomplete", "teardown_incomplete"). hermes-agent's index (and our unfinished
        work) is replaced by ours in short transactions with pauses between them, so live writers
        are never blocked for long; interrupt it at any point and run it again to resume.
        `progress_cb` gets {phase ('backfill', 'teardown', 'vacuum', 'done'), percent (whole),
        indexed, total}."""
        if not self.fts_caps.fts5:
            return {"ok": False, "reason": "fts5_unavailable"}
        if self.read_only:
            return {"ok": False, "reason": "read_only"}
        shortfall = self._disk_shortfall(vacuum)
        if shortfall:
            logger.info("search: %s", shortfall)
            return {"ok": False, "reason": "insufficient_disk", "vacuumed": None,
                    "detail": shortfall}
        report = progress_cb or (lambda _progress: None)
        self._execute_write(self._begin_optimize)
        # Reported in hermes-agent's order, which its CLI prints line by line: the backfill from
        # where it stands, after each chunk that leaves some and moved it (a step that only set
        # the layout up moves nothing; 0.22 has no such step, so it never repeats a line),
        # closed at 100%; then teardown (with the CJK queue).
        last = _progress("backfill", self.fts_rebuild_status())
        report(last)
        steps = itertools.count(1)
        while self.fts_rebuild_status() is not None and self._optimize_step(next(steps)):
            status = self.fts_rebuild_status()
            if status is not None and _progress("backfill", status) != last:
                last = _progress("backfill", status)
                report(last)
            pause_between_chunks()
        report(_progress("backfill", self.fts_rebuild_status()))
        report(_progress("teardown", None))
        while self._optimize_step(next(steps)):
            report(_progress("teardown", None))
            pause_between_chunks()
        phase = self._rebuild_phase()
        if phase is not None:
            return {"ok": False, "reason": f"{phase['phase']}_incomplete", "vacuumed": None}
        vacuumed = None
        if vacuum:
            report(_progress("vacuum", None))
            try:
                self.vacuum()
                vacuumed = True
            except sqlite3.OperationalError as exc:
                logger.warning("search: VACUUM after optimize-storage failed (%s);"
                               " run it again later", exc)
                vacuumed = False
        report(_progress("done", None))
        return {"ok": True, "vacuumed": vacuumed}

    def _optimize_step(self, count):
        """optimize-storage's `count`th fts_rebuild_step; every OPTIMIZE_CHECKPOINT_STEPS-th is
        followed by a checkpoint (under our locks, when we checkpoint this store)."""
        more = self.fts_rebuild_step()
        if count % OPTIMIZE_CHECKPOINT_STEPS == 0 and self.policy.checkpoint == "locked":
            self._execute_write(self._checkpoint, transaction=False)
        return more

    def _begin_optimize(self, conn):
        """Set every index of another layout aside, hermes-agent 0.19's included, and start
        filling layout 3's (and ours), in one transaction."""
        self._apply_search_schema(conn, optimize=True)

    def _disk_shortfall(self, vacuum):
        """Why the disk is too small for optimize-storage, or None."""
        # Estimated bytes of text our index holds.
        word_bytes, trigram_bytes = self._read_one(f"""
SELECT COALESCE(SUM(CASE WHEN role = 'tool'
                         THEN MIN(LENGTH(CAST(content AS BLOB)), {TOOL_INDEX_PREFIX_CHARS})
                         ELSE LENGTH(CAST(content AS BLOB)) END), 0),
       COALESCE(SUM(CASE WHEN role = 'tool' THEN 0 ELSE LENGTH(CAST(content AS BLOB)) END), 0)
FROM messages
""")
        new_index = 2 * word_bytes + 4 * trigram_bytes
        need = new_index + (store_file_bytes(self.db_path) if vacuum else 0)
        free = free_disk_bytes(self.db_path.parent)
        if free >= need:
            return None
        hint = "" if not vacuum else ("; with --no-vacuum (rebuild now, reclaim later) it needs"
                                      f" about {new_index / 1e6:.1f} MB")
        return (f"optimize-storage needs about {need / 1e6:.1f} MB free next to {self.db_path} "
                f"(new index{' plus a VACUUM copy of the file' if vacuum else ''}); only "
                f"{free / 1e6:.1f} MB are free{hint}. Nothing was changed.")

    def _set_aside_unreadable_indexes(self, conn):
        """After a write SQLite refused as corrupt: each index of ours FTS5 cannot open, as a fresh
        connection reads it (the writer's may hold it open from before), loses its writers and is
        marked stale: searches answer by the fallback, the next open refills it. True if any."""
        def unreadable(probe, table):
            try:
                probe.execute(_OPEN_FTS_TABLE_SQL.format(table=quote_identifier(table))).fetchall()
                return False
            except sqlite3.DatabaseError:
                return True
        objects = schema_objects(conn)
        tables = {index: SEARCH_TABLES[index] for index in self._buildable()
                  if SEARCH_TABLES[index] in objects}
        broken = self._with_fresh_reader(
            lambda probe: [index for index, table in tables.items() if unreadable(probe, table)])
        for index in broken:  # the CJK queue too: it is refilled whole with the index
            queue = {CJK_QUEUE_TABLE} if index == "cjk" else set()
            _drop_writers(conn, objects, {tables[index]} | queue)
            if index == "cjk":
                conn.execute(_RESET_INDEX_SQL["cjk"][1])
            write_meta(conn, _stale_key(index), "1")
            logger.warning("search: FTS5 cannot open the index table %s of %s; set it aside "
                           "(writes go on, searches use the fallback), the next open refills it",
                           tables[index], self.db_path)
        return bool(broken)

def _merge_step(conn, table, pages, group):
    """One bounded step of FTS5's incremental merge; True while it still found work (FTS5's own
    test: a step that changed fewer than two rows did nothing). `group` first sets every segment
    aside as one merge (a negative page count, which adds a level to the structure record); without
    it the step carries on the merge in progress, or merges a level FTS5's 'usermerge' finds full,
    and adds no level."""
    before = conn.total_changes
    table = quote_identifier(table)
    conn.execute(f"INSERT INTO {table}({table}, rank) VALUES ('merge', ?)",
                 (-pages if group else pages,))
    return conn.total_changes - before >= 2


def _drop_retired_chunk(conn, table, objects):
    """Empty a retired index a chunk at a time through its shadow tables, then drop it.

    The structure records (ids up to 10 in _data) stay until the DROP, which needs them."""
    for shadow, where in ((f"{table}_data", "id > 10"), (f"{table}_content", "1")):
        if shadow not in objects:
            continue
        try:
            shadow = quote_identifier(shadow)
            deleted = conn.execute(
                f"DELETE FROM {shadow} WHERE rowid IN"
                f" (SELECT rowid FROM {shadow} WHERE {where} LIMIT {DROP_CHUNK_ROWS})").rowcount
        except sqlite3.OperationalError:
            break  # shadow tables are read-only in defensive mode: drop the whole table at once
        if deleted:
            return
    conn.execute(DROP_TABLE_SQL.format(table=quote_identifier(table)))

