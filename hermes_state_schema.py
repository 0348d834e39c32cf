"""SessionSchemaMixin: bring any store, old or new, to the declared schema.

Owns the open-time schema pass: creating missing tables, adding missing columns (SCHEMA_SQL is the
only description of them), deferred indexes (the same three steps for a raw connection:
reconcile_state_schema), table-shape heals, data repairs and data migrations,
the probe statements read-only callers use to detect a stale store, the probes of what this SQLite
can hold (FTS5, its trigram tokenizer) and of whose search index a store holds, hermes-agent's flag
for an index optimize-storage replaces, and the check of every trigger against the table it writes
to. It never removes a column, a table or a row, and never touches the search index layout. It
relies on SessionDB for what the mixin's docstring lists (`_execute_write(fn)`: one BEGIN IMMEDIATE
transaction, retried on lock); it never imports hermes_state.
"""

import contextlib
import datetime
import functools
import logging
import re
import sqlite3
import time
from collections import namedtuple

# DEFERRED_INDEX_SQL is re-exported: hermes-agent's name.
from hermes_state_common import (
    DEFERRED_INDEX_SQL, DEFERRED_INDEXES, DELETE_META_SQL, DROP_TABLE_SQL, GATEWAY_ROUTING_PK,
    GATEWAY_ROUTING_SIDE_TABLE, HERMES_FTS_TABLES, INSERT_META_SQL, INSERT_SYSTEM_PROMPT_SQL,
    LAST_ACTIVE_SQL, META_FTS_OPTIMIZE_AVAILABLE, MIGRATION_CHUNK_SIZE, PREVIOUS_LAYOUT_TABLES,
    LazyModule, RENAME_TABLE_SQL, SCHEMA_31_COLUMNS, SCHEMA_31_TABLES, SCHEMA_SQL, SCHEMA_VERSION,
    SELECT_META_SQL, SELECT_SCHEMA_VERSION_SQL, TITLE_INDEX_NAME, _RESET_END_REASONS,
    placeholders, quote_identifier, trigger_writes,
)
from hermes_state_errors import is_capability_gap
from hermes_state_identity import display_identity

logger = logging.getLogger("hermes_state")
uuid = LazyModule("uuid")  # (it loads platform; only a store's first stamps need it)


# -- Listing aids: read by the sessions mixin, made and filled here ---------------------------

# Ours (issue 27; names no hermes-agent release uses). hs_session_activity holds each session's
# LAST_ACTIVE_SQL value, so the activity-ordered listing reads sessions newest activity first
# instead of computing it for every session; hs_session_tally holds how many sessions each
# (source, archived, kind of row) has, so session_count reads a few rows. Plain-SQL triggers keep
# both for any writer, hermes-agent included. They are trusted only while META_LISTING_READY holds
# LISTING_VERSION: an open that finds any of LISTING_OBJECTS missing (or made by another version)
# makes it again and clears the key, and the open's data pass fills both tables again
# (LISTING_BACKFILL_ROWS sessions a transaction, resumed from META_LISTING_PROGRESS) before it sets
# the key.
META_LISTING_READY = "hs_listing_ready"
META_LISTING_PROGRESS = "hs_listing_progress"
LISTING_VERSION = "2"
LISTING_BACKFILL_ROWS = 5000
# The tally's kinds of row, as the listing would judge the session (sessions_mixin's
# _is_listable). Roots: 1 listed (no delegate marker can be in its model_config), 2 judged in
# Python. Children (a parent_session_id): 3 not listed, 4 listed, 5 judged in Python. A child's
# kind depends on its parent's end and routing key, so a parent's change re-judges its children.
TALLY_PLAIN_ROOT, TALLY_MARKED_ROOT = 1, 2
TALLY_CHILD_UNLISTED, TALLY_CHILD_LISTED, TALLY_CHILD_JUDGED = 3, 4, 5
TALLY_LISTED_KINDS = (TALLY_PLAIN_ROOT, TALLY_CHILD_LISTED)
TALLY_JUDGED_KINDS = (TALLY_MARKED_ROOT, TALLY_CHILD_JUDGED)
# The rows a count reads and judges; the partial index hs_session_activity_judged holds them
# (this very expression, so that SQLite sees the query's term implies the index's).
JUDGED_KIND_SQL = f"{{a}}.kind IN ({TALLY_MARKED_ROOT}, {TALLY_CHILD_JUDGED})"
_RESET_REASONS_SQL = ", ".join(f"'{reason}'" for reason in _RESET_END_REASONS)


def _markers_absent(*names):
    """SQL: true when {r}'s model_config surely holds none of the marker keys `names`, as the
    listing reads it (json_object, only when "_from" is in the text). Only a \\u escape can spell
    a letter or an underscore, so without one a key is spelled as itself in quotes and a marker
    whose quoted name is absent is not there; text with one, or a value that is not text, tells
    nothing."""
    quoted = " AND ".join(f"instr({{r}}.model_config, '\"{name}\"') = 0" for name in names)
    return ("(typeof({r}.model_config) = 'null' OR (typeof({r}.model_config) = 'text'"
            " AND (instr({r}.model_config, '_from') = 0"
            f" OR (instr({{r}}.model_config, '\\u') = 0 AND {quoted}))))")


# A root is listed unless a delegate marker says it is a subagent run.
LISTED_ROOT_SQL = f"({{r}}.parent_session_id IS NULL AND {_markers_absent('_delegate_from')})"
# A child is listed when its parent `p` ended by a branch before it started, or by a reset on its
# routing key; else by its own _branched_from or _reset_from marker; never by _delegate_from.
# Where the listing's comparisons could raise or compare otherwise than SQL does (a start or end
# that is not a number, a key that is not text), the row is left to Python.
_PARENT_ODD = ("(p.end_reason = 'branched' AND p.ended_at IS NOT NULL"
               " AND (typeof({r}.started_at) NOT IN ('integer', 'real')"
               "  OR typeof(p.ended_at) NOT IN ('integer', 'real')))"
               f" OR (p.end_reason IN ({_RESET_REASONS_SQL})"
               " AND (typeof({r}.session_key) NOT IN ('null', 'text')"
               "  OR typeof(p.session_key) NOT IN ('null', 'text')))")
_PARENT_LISTS = ("(p.end_reason = 'branched' AND p.ended_at IS NOT NULL"
                 " AND {r}.started_at >= p.ended_at)"
                 f" OR (p.end_reason IN ({_RESET_REASONS_SQL}) AND {{r}}.session_key <> ''"
                 " AND {r}.session_key = p.session_key)")
_OWN_MARKERS_ABSENT = _markers_absent("_branched_from", "_reset_from")
_CHILD_KIND_WITH_PARENT = (
    f"CASE WHEN {_PARENT_ODD} THEN {TALLY_CHILD_JUDGED}"
    f" WHEN {_PARENT_LISTS} THEN (CASE WHEN {_markers_absent('_delegate_from')}"
    f"  THEN {TALLY_CHILD_LISTED} ELSE {TALLY_CHILD_JUDGED} END)"
    f" WHEN {_OWN_MARKERS_ABSENT} THEN {TALLY_CHILD_UNLISTED} ELSE {TALLY_CHILD_JUDGED} END")
_TALLY_KIND_EXPR = (
    f"(CASE WHEN {{r}}.parent_session_id IS NULL THEN (CASE WHEN {LISTED_ROOT_SQL}"
    f"  THEN {TALLY_PLAIN_ROOT} ELSE {TALLY_MARKED_ROOT} END)"
    f" ELSE COALESCE((SELECT {_CHILD_KIND_WITH_PARENT} FROM sessions AS p"
    "  WHERE p.id = {r}.parent_session_id),"
    # A parent that is not there lists none of its children.
    f" CASE WHEN {_OWN_MARKERS_ABSENT} THEN {TALLY_CHILD_UNLISTED} ELSE {TALLY_CHILD_JUDGED} END)"
    " END)")
# No statement in these trigger bodies can meet a conflict: the OR clause of the statement that
# fires a trigger (hermes-agent's INSERT OR IGNORE, another program's OR ABORT) replaces every
# ON CONFLICT inside it, so an OR REPLACE or OR IGNORE here would turn into that writer's.
# A tally key never holds NULL (NULLs never collide in a unique index, so each would make a new
# row): a NULL `archived` counts as -1, which no filter asks for, as no filter matches NULL on the
# sessions table (`source` is NOT NULL in every schema).
_TALLY_KEY = "{r}.source, IFNULL({r}.archived, -1), " + _TALLY_KIND_EXPR
# A session's activity row keeps the tally key it is counted under, and triggers on it keep the
# tally: every change of a key is a change of an activity row. A REPLACE deletes the row it
# replaces without firing a delete trigger (unless recursive_triggers is on), so the session
# triggers delete an activity row before they make it again.
_ACTIVITY_COLUMNS = "(session_id, active_at, source, archived, kind)"
_ACTIVITY_OF = (" hs_session_activity " + _ACTIVITY_COLUMNS + " SELECT s.id, "
                + LAST_ACTIVE_SQL.format(a="s") + ", " + _TALLY_KEY.format(r="s")
                + " FROM sessions AS s WHERE ")
_REFRESH_ACTIVITY = ("DELETE FROM hs_session_activity WHERE session_id = {sid};"
                     " INSERT INTO" + _ACTIVITY_OF + "s.id = {sid};")
# The children of {ids} judged again (their parent was made, changed or deleted).
_REJUDGE_CHILDREN = ("UPDATE hs_session_activity SET kind = (SELECT "
                     + _TALLY_KIND_EXPR.format(r="c") + " FROM sessions AS c"
                     " WHERE c.id = hs_session_activity.session_id)"
                     " WHERE session_id IN (SELECT c.id FROM sessions AS c"
                     " WHERE c.parent_session_id IN ({ids}));")
_TALLY_MATCH = "source IS {r}.source AND archived IS {r}.archived AND kind IS {r}.kind"
_TALLY_ADD = ("INSERT INTO hs_session_tally (source, archived, kind, n)"
              " SELECT {r}.source, {r}.archived, {r}.kind, 0"
              " WHERE NOT EXISTS (SELECT 1 FROM hs_session_tally WHERE " + _TALLY_MATCH + ");"
              " UPDATE hs_session_tally SET n = n + 1 WHERE " + _TALLY_MATCH + ";")
_TALLY_DROP = "UPDATE hs_session_tally SET n = n - 1 WHERE " + _TALLY_MATCH + ";"
LISTING_OBJECTS = {
    # Keys are unique indexes, not primary keys: every object is named hs_*, as the doctor's
    # last-resort repair (which drops every hs_* object) expects; an automatic index would stay.
    "hs_session_activity": ("CREATE TABLE hs_session_activity (session_id TEXT, active_at REAL,"
                            " source TEXT, archived INTEGER, kind INTEGER)"),
    "hs_session_activity_id": ("CREATE UNIQUE INDEX hs_session_activity_id"
                               " ON hs_session_activity(session_id)"),
    "hs_session_activity_order": ("CREATE INDEX hs_session_activity_order"
                                  " ON hs_session_activity(active_at DESC, session_id DESC)"),
    "hs_session_activity_judged": ("CREATE INDEX hs_session_activity_judged"
                                   " ON hs_session_activity(kind) WHERE "
                                   + JUDGED_KIND_SQL.format(a="hs_session_activity")),
    "hs_session_tally": ("CREATE TABLE hs_session_tally (source TEXT, archived INTEGER,"
                         " kind INTEGER, n INTEGER)"),
    "hs_session_tally_key": ("CREATE UNIQUE INDEX hs_session_tally_key"
                             " ON hs_session_tally(source, archived, kind)"),
    "hs_listing_tally_insert": f"""CREATE TRIGGER hs_listing_tally_insert
 AFTER INSERT ON hs_session_activity BEGIN
 {_TALLY_ADD.format(r="new")}
END""",
    "hs_listing_tally_delete": f"""CREATE TRIGGER hs_listing_tally_delete
 AFTER DELETE ON hs_session_activity BEGIN
 {_TALLY_DROP.format(r="old")}
END""",
    "hs_listing_tally_move": f"""CREATE TRIGGER hs_listing_tally_move
 AFTER UPDATE OF source, archived, kind ON hs_session_activity
 WHEN old.source IS NOT new.source OR old.archived IS NOT new.archived
  OR old.kind IS NOT new.kind BEGIN
 {_TALLY_DROP.format(r="old")}
 {_TALLY_ADD.format(r="new")}
END""",
    # A session made may be the parent some rows already name (made out of order, or a REPLACE).
    "hs_listing_session_insert": f"""CREATE TRIGGER hs_listing_session_insert
 AFTER INSERT ON sessions BEGIN
 {_REFRESH_ACTIVITY.format(sid="new.id")}
 {_REJUDGE_CHILDREN.format(ids="new.id")}
END""",
    "hs_listing_session_activity": f"""CREATE TRIGGER hs_listing_session_activity
 AFTER UPDATE OF id, started_at, last_activity_at ON sessions BEGIN
 DELETE FROM hs_session_activity WHERE session_id = old.id;
 {_REFRESH_ACTIVITY.format(sid="new.id")}
END""",
    # What the row's own kind reads of itself.
    "hs_listing_session_tally": f"""CREATE TRIGGER hs_listing_session_tally
 AFTER UPDATE OF source, archived, parent_session_id, model_config, started_at, session_key
 ON sessions
 WHEN old.source IS NOT new.source OR old.archived IS NOT new.archived
  OR old.parent_session_id IS NOT new.parent_session_id
  OR old.model_config IS NOT new.model_config OR old.started_at IS NOT new.started_at
  OR old.session_key IS NOT new.session_key BEGIN
 UPDATE hs_session_activity SET (source, archived, kind) = ({_TALLY_KEY.format(r="new")})
  WHERE session_id = new.id;
END""",
    # What its children's kinds read of a parent (end_session, reopen, hermes-agent's own UPDATE);
    # an end of a session nothing names costs one look at the parent index.
    "hs_listing_parent_change": f"""CREATE TRIGGER hs_listing_parent_change
 AFTER UPDATE OF id, end_reason, ended_at, session_key ON sessions
 WHEN (old.id IS NOT new.id OR old.end_reason IS NOT new.end_reason
   OR old.ended_at IS NOT new.ended_at OR old.session_key IS NOT new.session_key)
  AND EXISTS (SELECT 1 FROM sessions AS c WHERE c.parent_session_id IN (old.id, new.id)) BEGIN
 {_REJUDGE_CHILDREN.format(ids="old.id, new.id")}
END""",
    "hs_listing_session_delete": f"""CREATE TRIGGER hs_listing_session_delete
 AFTER DELETE ON sessions BEGIN
 DELETE FROM hs_session_activity WHERE session_id = old.id;
 {_REJUDGE_CHILDREN.format(ids="old.id")}
END""",
    # An append only raises the activity, unless it is the start standing in for no activity yet
    # (no other message, no heartbeat): an UPDATE, not a REPLACE with its subqueries (9% of an
    # append at 100,000 messages).
    "hs_listing_message_insert": """CREATE TRIGGER hs_listing_message_insert
 AFTER INSERT ON messages BEGIN
 UPDATE hs_session_activity SET active_at = new.timestamp WHERE session_id = new.session_id
  AND (new.timestamp > active_at
   OR (NOT EXISTS (SELECT 1 FROM messages AS m
                   WHERE m.session_id = new.session_id AND m.id <> new.id)
       AND (SELECT s.last_activity_at FROM sessions AS s WHERE s.id = new.session_id) IS NULL));
END""",
    # A deleted message changes the session's activity only if it was the newest.
    "hs_listing_message_delete": f"""CREATE TRIGGER hs_listing_message_delete
 AFTER DELETE ON messages
 WHEN old.timestamp >= (SELECT active_at FROM hs_session_activity WHERE session_id = old.session_id)
 BEGIN
 {_REFRESH_ACTIVITY.format(sid="old.session_id")}
END""",
    "hs_listing_message_update": f"""CREATE TRIGGER hs_listing_message_update
 AFTER UPDATE OF session_id, timestamp ON messages BEGIN
 {_REFRESH_ACTIVITY.format(sid="old.session_id")}
 {_REFRESH_ACTIVITY.format(sid="new.session_id")}
END""",
}
SELECT_LISTING_OBJECT_COUNT_SQL = (f"SELECT COUNT(*) FROM sqlite_master WHERE name IN"
                                   f" ({', '.join(repr(name) for name in LISTING_OBJECTS)})")
# Not part of the trust above: a missing one only makes a listing slower. A page of one source, and
# the pinned rows a page adds, read in start order without sorting every match (10-15 ms at 54,000
# sessions without them); a start-order page reads its rows in the page's order, id included,
# where hermes-agent's idx_sessions_started leaves SQLite to sort the rows of one start by id
# (0.56 -> 0.52 ms a page of 50 at 54,000 sessions).
LISTING_INDEXES = {
    "hs_idx_sessions_started_id": ("CREATE INDEX hs_idx_sessions_started_id"
                                   " ON sessions(started_at DESC, id DESC)"),
    "hs_idx_sessions_source_started": ("CREATE INDEX hs_idx_sessions_source_started"
                                       " ON sessions(source, started_at DESC, id DESC)"),
    "hs_idx_sessions_pinned": ("CREATE INDEX hs_idx_sessions_pinned"
                               " ON sessions(started_at DESC, id DESC) WHERE pinned = 1"),
}


# -- What this SQLite can hold: our search index needs FTS5, its trigram part the trigram tokenizer

Capabilities = namedtuple("Capabilities", "fts5 trigram")


# -- Message identity and display index: hermes-agent 0.22's (schema 31) -----------------------

# Its triggers, under its names and with its effect, so that a row any program writes gets a
# message_uid and a display_order, and a rewritten row loses the display identity its old content
# had (0.22's next read computes it again). A trigger of one of these names that another release
# made is kept as it is: two texts of one rule would otherwise replace each other on every open.
# "Visible" is 0.22's display set: live or compacted rows.
_VISIBLE = "(active = 1 OR compacted = 1)"
_PEER_ORDER = ("(SELECT display_order FROM messages WHERE session_id = new.session_id"
               f" AND id <> new.id AND {_VISIBLE} AND display_identity = new.display_identity"
               " AND display_order IS NOT NULL ORDER BY display_order LIMIT 1)")
_FIRST_PEER_OF_OLD = ("(SELECT MIN(peer.id) FROM messages AS peer WHERE peer.session_id ="
                      " old.session_id AND (peer.active = 1 OR peer.compacted = 1)"
                      " AND peer.display_identity = old.display_identity)")
IDENTITY_TRIGGERS = {
    # Programs that predate the column insert NULL; the store mints the uid for them.
    "messages_message_uid_insert": """CREATE TRIGGER messages_message_uid_insert
 AFTER INSERT ON messages WHEN new.message_uid IS NULL BEGIN
  UPDATE messages SET message_uid = lower(hex(randomblob(16))) WHERE id = new.id;
 END""",
    # A new row joins the display group of an earlier copy of the same message, else starts one.
    "messages_display_order_insert": f"""CREATE TRIGGER messages_display_order_insert
 AFTER INSERT ON messages WHEN new.display_order IS NULL BEGIN
  UPDATE messages SET display_order = COALESCE({_PEER_ORDER}, new.id) WHERE id = new.id;
 END""",
    # A row entering the visible set takes (and gives) its group's order; one leaving it hands
    # the group to the first visible row left.
    "messages_display_visibility_update": f"""CREATE TRIGGER messages_display_visibility_update
 AFTER UPDATE OF active, compacted ON messages
 WHEN (new.active = 1 OR new.compacted = 1) <> (old.active = 1 OR old.compacted = 1) BEGIN
  UPDATE messages SET display_order = MIN(new.id, COALESCE({_PEER_ORDER}, new.id))
   WHERE id = new.id AND (new.active = 1 OR new.compacted = 1);
  UPDATE messages SET display_order = (SELECT display_order FROM messages WHERE id = new.id)
   WHERE session_id = new.session_id AND id <> new.id AND {_VISIBLE}
    AND display_identity = new.display_identity AND (new.active = 1 OR new.compacted = 1);
  UPDATE messages SET display_order = {_FIRST_PEER_OF_OLD}
   WHERE session_id = old.session_id AND {_VISIBLE} AND display_identity = old.display_identity
    AND NOT (new.active = 1 OR new.compacted = 1);
 END""",
    # Content rewritten: the row and its old group lose identity and order until a read
    # recomputes them.
    "messages_display_identity_update": f"""CREATE TRIGGER messages_display_identity_update
 AFTER UPDATE OF role, content, timestamp, tool_call_id, tool_calls, tool_name, display_kind
 ON messages WHEN new.role IS NOT old.role OR new.content IS NOT old.content
  OR new.timestamp IS NOT old.timestamp OR new.tool_call_id IS NOT old.tool_call_id
  OR new.tool_calls IS NOT old.tool_calls OR new.tool_name IS NOT old.tool_name
  OR new.display_kind IS NOT old.display_kind BEGIN
  UPDATE messages SET display_identity = NULL, display_order = NULL WHERE id = new.id
   OR (session_id = old.session_id AND display_identity = old.display_identity AND {_VISIBLE});
 END""",
    "messages_display_identity_delete": f"""CREATE TRIGGER messages_display_identity_delete
 AFTER DELETE ON messages WHEN old.active = 1 OR old.compacted = 1 BEGIN
  UPDATE messages SET display_order = {_FIRST_PEER_OF_OLD}
   WHERE session_id = old.session_id AND {_VISIBLE} AND display_identity = old.display_identity;
 END""",
}
# An update trigger without a column list, and the columns hermes-agent's index triggers read.
_BROAD_UPDATE = re.compile(r"\bAFTER\s+UPDATE\s+ON\s+messages\b", re.I)
_INDEXED_COLUMNS_UPDATE = "AFTER UPDATE OF content, tool_name, tool_calls, role ON messages"
# 0.22's state_meta keys: who the store is (minted when it is born), which file it is (minted
# once per file: a copy keeps it, a store made anew gets another), and how far the uid backfill
# of rows written before schema 31 got ("1" when done; else the last id done).
META_STORE_INSTANCE = "store_instance_id"
META_STORE_CREATED = "store_created_at_utc"
META_DB_FILE_GENERATION = "db_file_generation"
META_UID_BACKFILL_DONE = "message_uid_backfill"
META_UID_BACKFILL_CURSOR = "message_uid_backfill_id"
# The backfill's budget: each chunk a transaction of its own that stays well under 100 ms of lock
# (the chunk's id span halves after a slow one and doubles after a quick one: an old store's
# per-row update triggers make rows cost ten times more), and an open spends at most
# OPEN_BACKFILL_BUDGET_S on it, as 0.22's does; the next open resumes.
UID_BACKFILL_FIRST_SPAN = 2000
UID_BACKFILL_MAX_SPAN = 50000
BACKFILL_CHUNK_TARGET_S = 0.025
OPEN_BACKFILL_BUDGET_S = 1.0
# Schema 31's indexes on messages, which a store written before it lacks: at 1M messages each
# takes 0.3-0.8 s to build, and the four in the schema pass held the write lock 2.2 s. A store
# with messages gets them after the pass, a transaction each, before the backfills that use them.
# No reader pins them (INDEXED BY) but the display backfill, which runs after them; hermes-agent's
# open builds any that is missing.
INDEXES_BUILT_AFTER_THE_PASS = ("idx_messages_session_uid", "idx_messages_display_page",
                                "idx_messages_display_backfill", "idx_messages_display_identity")


# The display backfill: a session with a visible row lacking its display identity or order (the
# partial index idx_messages_display_backfill holds exactly those), and a session's visible rows
# in id order, a chunk at a time.
DISPLAY_BACKFILL_ROWS, DISPLAY_BACKFILL_MAX_ROWS = 500, 4000
_DISPLAY_BACKFILL_NEXT_SQL = (
    "SELECT session_id FROM messages INDEXED BY idx_messages_display_backfill"
    f" WHERE (display_order IS NULL OR display_identity IS NULL) AND {_VISIBLE} LIMIT 1")
_DISPLAY_ROWS_SQL = (
    "SELECT id, role, content, timestamp, tool_call_id, tool_calls, tool_name, display_kind,"
    " display_metadata, display_order, display_identity FROM messages"
    f" WHERE session_id = :session AND id > :after AND {_VISIBLE} ORDER BY id LIMIT :rows")


def _next_chunk_size(size, took, largest):
    """A backfill's next chunk: half after one slower than BACKFILL_CHUNK_TARGET_S, twice after
    one under a quarter of it (up to `largest`), else the same."""
    if took > BACKFILL_CHUNK_TARGET_S:
        return max(size // 2, 1)
    return min(size * 2, largest) if took < BACKFILL_CHUNK_TARGET_S / 4 else size


def _fold_display_chunk(conn, place, rows):
    """Inside a write: fold about `rows` visible rows, from `place` (a session begun in an
    earlier chunk, or None) on to the next sessions needing it; (where to go on: a place, None for
    the next session, False when none is left; rows written). Returns a new place, never changes
    the one given: a write retried on a lock starts from the same one."""
    budget, fixed = rows, 0
    while budget > 0:
        if place is None:
            found = conn.execute(_DISPLAY_BACKFILL_NEXT_SQL).fetchone()
            if found is None:
                return False, fixed
            place = (found[0], 0, {})
        session_id, after, first_ids = place[0], place[1], dict(place[2])
        limit = budget
        rows = conn.execute(_DISPLAY_ROWS_SQL, {"session": session_id, "after": after,
                                                "rows": limit}).fetchall()
        changed = []
        for row in rows:
            identity = display_identity(row)
            order = first_ids.setdefault(identity, row["id"])
            if (order, identity) != (row["display_order"], row["display_identity"]):
                changed.append({"order": order, "identity": identity, "id": row["id"]})
        conn.executemany("UPDATE messages SET display_order = :order,"
                         " display_identity = :identity WHERE id = :id", changed)
        fixed, budget = fixed + len(changed), budget - max(len(rows), 1)
        # A full read may have left rows of the session: go on there; else it is done.
        place = (session_id, rows[-1]["id"], first_ids) if len(rows) == limit else None
    return place, fixed


def _probe(connect, ddl):
    try:
        with contextlib.closing(connect(":memory:")) as conn:
            conn.execute(ddl)
            conn.execute("DROP TABLE temp.probe")
        return True
    except sqlite3.Error:
        return False


def sqlite_supports_fts5(connect=sqlite3.connect):
    """True if connections made by `connect` can create an FTS5 table."""
    return _probe(connect, "CREATE VIRTUAL TABLE temp.probe USING fts5(x)")


def sqlite_supports_trigram(connect=sqlite3.connect):
    """True if they also have FTS5's trigram tokenizer (SQLite 3.34 and later)."""
    return _probe(connect, "CREATE VIRTUAL TABLE temp.probe USING fts5(x, tokenize='trigram')")


def runtime_capabilities(connect=sqlite3.connect):
    """Capabilities(fts5, trigram) of connections made by `connect`: probed once a process for
    sqlite3.connect, whose library cannot change under a running process (its two probe
    connections were 8% of each open), at each call for any other factory (a replica's VFS, a
    test's runtime without FTS5)."""
    if connect is sqlite3.connect:
        return _sqlite3_capabilities(connect)
    return _probe_capabilities(connect)


def _probe_capabilities(connect):
    fts5 = sqlite_supports_fts5(connect)
    return Capabilities(fts5, fts5 and sqlite_supports_trigram(connect))


_sqlite3_capabilities = functools.lru_cache(maxsize=1)(_probe_capabilities)


def fts_layout_of(ddl):
    """Whose index a `messages_fts` DDL is: 'none', hermes-agent's 'legacy' (0.19: no tool_name
    column) or 'external' (0.20, 0.22), or 'previous' (ours before layout 1, which used
    hermes-agent's names)."""
    if ddl is None:
        return "none"
    if "tool_name" not in ddl:
        return "legacy"
    if PREVIOUS_LAYOUT_TABLES[HERMES_FTS_TABLES["word"]] in ddl:
        return "previous"
    return "external"


# Between two chunks of a long job (a sweep, a merge, a backfill, an import), the writer lock stays
# free this long: waiters poll every 1-4 ms (ours) or back off up to 100 ms (SQLite's busy handler),
# and a job that took it back at once would starve them as surely as one long transaction would.
CHUNK_PAUSE = 0.01


def pause_between_chunks():
    """Sleep CHUNK_PAUSE so that another process's writer gets the lock between our chunks."""
    time.sleep(CHUNK_PAUSE)


def is_lock_error(exc):
    """True for SQLite's "database is locked" / "busy": worth retrying, never swallowing."""
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def prompt_hash(prompt):
    """The key of a system prompt in `system_prompts`: hex SHA-256 of its UTF-8 text."""
    import hashlib  # here, not at import: only a write with a prompt needs it
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


@functools.lru_cache(maxsize=None)
def _default_clause(default):
    """`DEFAULT x`, parenthesised when x is an expression: table_info drops the parentheses of
    `DEFAULT (1 + 2)`, and ALTER TABLE needs them back. Cached: the schema's 43 defaults are 4
    texts, and a probe creating a table for each was a sixth of a process's first open."""
    scratch = sqlite3.connect(":memory:")
    try:
        scratch.execute(f"CREATE TABLE default_probe (x DEFAULT {default})")
        return f"DEFAULT {default}"
    except sqlite3.OperationalError:
        return f"DEFAULT ({default})"
    finally:
        scratch.close()


SELECT_SCHEMA_OBJECTS_SQL = "SELECT type, name, sql FROM sqlite_master"


class _SchemaObjects(dict):
    """sqlite_master's {name: (type, sql)}, with the schema cookie it was read at."""
    cookie = None


def schema_objects(conn, known=None):
    """sqlite_master as `conn` sees it; `known` (an earlier reading) again when the schema cookie
    is unchanged since: every DDL bumps it, even within a transaction, and a settled store's
    open reread an unchanged sqlite_master five times (a tenth of the open)."""
    cookie = conn.execute("PRAGMA schema_version").fetchone()[0]
    if known is not None and known.cookie == cookie:
        return known
    objects = _SchemaObjects((name, (kind, sql))
                             for kind, name, sql in conn.execute(SELECT_SCHEMA_OBJECTS_SQL))
    objects.cookie = cookie
    return objects


def read_meta(conn, key):
    """A state_meta value read inside a write, or None."""
    row = conn.execute(SELECT_META_SQL, (key,)).fetchone()
    return None if row is None else row[0]


def write_meta(conn, key, value):
    """Set (or with None remove) a state_meta key; writes nothing when it already holds `value`."""
    if read_meta(conn, key) == value:
        return
    conn.execute(DELETE_META_SQL, (key,))
    if value is not None:
        conn.execute(INSERT_META_SQL, (key, str(value)))


# A table's columns; the trigger check runs it through its `read_all` too.
TABLE_INFO_SQL = "PRAGMA table_info({table})"


def _table_info(conn, table):
    # A SELECT first: it checks the schema cookie and reloads a schema another connection changed;
    # SQLite before 3.3x answers PRAGMA table_info from a stale cached schema (a reader opened
    # before a table was made saw no columns).
    conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
    return conn.execute(TABLE_INFO_SQL.format(table=quote_identifier(table))).fetchall()


def _column_type_expr(col_type, notnull, default, in_pk):
    parts = [col_type] if col_type else []
    if notnull and not in_pk:
        parts.append("NOT NULL")
    if default is not None:
        parts.append(_default_clause(default))
    return " ".join(parts)


@functools.lru_cache(maxsize=None)
def _declared_schema(sql):
    """{table: (create_sql, {column: type_expr})} in creation order, as SQLite parses `sql` in a
    scratch in-memory database (so DEFAULT expressions with commas, REFERENCES and CHECK need no
    regex)."""
    scratch = sqlite3.connect(":memory:")
    try:
        scratch.executescript(sql)
        tables = scratch.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'"
                                 " AND name NOT LIKE 'sqlite_%'").fetchall()
        return {name: (create_sql,
                       {col: _column_type_expr(kind, notnull, default, pk > 0)
                        for _, col, kind, notnull, default, pk in _table_info(scratch, name)})
                for name, create_sql in tables}
    finally:
        scratch.close()


def declared_columns(sql=SCHEMA_SQL):
    """{table: {column: type_expr}} for the tables `sql` declares."""
    return {table: cols for table, (_ddl, cols) in _declared_schema(sql).items()}


def live_columns(conn, table):
    """Column names of `table` as it is on disk, in order (empty if it does not exist)."""
    return [row[1] for row in _table_info(conn, table)]


def live_primary_key(conn, table):
    """The primary-key column names of `table` on disk, in key order."""
    return [row[1] for row in sorted((r for r in _table_info(conn, table) if r[5] > 0),
                                     key=lambda r: r[5])]


def schema_read_probe_statements(sql=SCHEMA_SQL):
    """One `SELECT "t"."c", ... FROM "t" LIMIT 0` per declared table, for a read-only caller to
    learn whether the store lacks a table or column. Columns are table-qualified: a bare
    double-quoted name that does not resolve silently becomes a string literal and would hide the
    gap. What schema 31 added is left out: every reader of ours reads a store 0.20 left (schema
    26) as it is, so a read-only command needs no upgraded copy of one."""
    q = quote_identifier
    statements = []
    for table, columns in declared_columns(sql).items():
        newer = SCHEMA_31_COLUMNS.get(table, ())
        probed = [q(table) + "." + q(c) for c in columns if c not in newer]
        if table not in SCHEMA_31_TABLES:
            statements.append(f"SELECT {', '.join(probed)} FROM {q(table)} LIMIT 0")
    return statements


def trigger_damage(objects, read_all):
    """Every trigger of `objects` ({name: (type, sql)}) that writes to a table or column the store
    lacks, and every table whose writes fail to compile because of its triggers (SQLite checks
    trigger bodies only then), as sentences; `read_all(sql)` runs a read."""
    names = {name.lower(): name for name in objects}
    damage = []
    for name, (kind, sql) in sorted(objects.items()):
        if kind != "trigger":
            continue
        for table, columns in trigger_writes(sql):
            target = names.get(table.lower())
            if target is None or objects[target][0] not in ("table", "view"):
                damage.append(f"trigger {name} writes to {table}, which does not exist")
                continue
            try:
                info = read_all(TABLE_INFO_SQL.format(table=quote_identifier(target)))
            except sqlite3.OperationalError as exc:
                # An FTS5 table this SQLite lacks the module or tokenizer for is no damage of the
                # store: an open here (ours, hermes-agent's) drops its triggers, a full runtime runs
                # them.
                if not is_capability_gap(exc):
                    raise
                continue
            known = {row[1].lower() for row in info} | {target.lower(), "rowid", "rank"}
            damage += [f"trigger {name} writes to {table}.{column}, which does not exist"
                       for column in columns or () if column.lower() not in known]
    for (table,) in read_all("SELECT DISTINCT tbl_name FROM sqlite_master WHERE type = 'trigger'"
                             " ORDER BY tbl_name"):
        columns = [row[1] for row in read_all(TABLE_INFO_SQL.format(table=quote_identifier(table)))]
        sets = ", ".join(f"{quote_identifier(c)} = {quote_identifier(c)}" for c in columns)
        for verb, sql in (("insert", f"INSERT INTO {quote_identifier(table)} DEFAULT VALUES"),
                          ("update", f"UPDATE {quote_identifier(table)} SET {sets}"),
                          ("delete", f"DELETE FROM {quote_identifier(table)}")):
            try:
                read_all("EXPLAIN " + sql)
            except sqlite3.Error as exc:
                if not is_capability_gap(exc):  # (as above)
                    damage.append(f"every {verb} on {table} fails: {exc}")
    return damage


def _try_ddl(conn, sql, failure, quiet=None):
    """True when `sql` ran; False when SQLite refused it, logged as `failure` unless its error names
    `quiet`. A lock error propagates, so that the open is retried."""
    try:
        conn.execute(sql)
        return True
    except sqlite3.OperationalError as exc:
        if is_lock_error(exc):
            raise
        if quiet is None or quiet not in str(exc).lower():
            logger.warning("schema: %s (%s); the open goes on", failure, exc)
        return False


def _build_index(conn, name):
    """Build the declared index `name` if it is missing; a refusal is logged, the open goes on."""
    return _try_ddl(conn, DEFERRED_INDEXES[name], f"index {name} not built")


def reconcile_state_schema(conn):
    """Bring the store a raw sqlite3 connection reads to the declared tables, columns and indexes
    (hermes-agent's entry for a program that opens state.db without a SessionDB). One transaction
    of its own, or the caller's when one is open; adds only, never removes or rewrites a row."""
    own = not conn.in_transaction
    if own:
        conn.execute("BEGIN IMMEDIATE")
    try:
        # The open's own structure steps, which read nothing of a SessionDB.
        schema = SessionSchemaMixin()
        objects = schema_objects(conn)
        schema._create_missing_tables(conn, objects)
        schema._reconcile_columns(conn, objects)
        schema._ensure_deferred_indexes(conn, objects)
    except BaseException:
        if own:
            conn.rollback()
        raise
    if own:
        conn.commit()


class SessionSchemaMixin:
    """Open-time schema work for SessionDB (see the module docstring).

    Relies on: `_execute_write`, `_read_all`, `_read_one`, `_read_value` and `fts_caps`
    (SessionDB); `_schema_version_held_back` is a hook here that the search index mixin overrides.
    """

    _parse_schema_columns = staticmethod(declared_columns)
    # Messages one transaction of the NULL-active repair fixes (two small index updates each).
    NULL_ACTIVE_CHUNK_ROWS = 5000

    def _init_schema(self):
        """The writable open's schema pass, in one transaction (the data migrations follow, a chunk
        each). Every step reads before it writes: opening a current store changes nothing. Returns
        the indexes left for _migrate_data to build (INDEXES_BUILT_AFTER_THE_PASS)."""
        return self._execute_write(self._apply_schema)

    def _apply_schema(self, conn):
        # sqlite_master is read once: each step is handed what it held (a table made since is not
        # in it, and a step that needs to know more reads that table itself).
        objects = schema_objects(conn)
        self._create_missing_tables(conn, objects)
        self._reconcile_columns(conn, objects)
        self._heal_gateway_routing_pk(conn, objects)
        # A store that has messages gets schema 31's message indexes after the pass, each alone.
        later = INDEXES_BUILT_AFTER_THE_PASS if "messages" in objects else ()
        left = self._ensure_deferred_indexes(conn, objects, later)
        self._ensure_title_index(conn, objects)
        self._stamp_schema_version(conn)
        self._ensure_listing_objects(conn, objects)
        self._ensure_identity_triggers(conn, objects)
        self._stamp_store_identity(conn, born="sessions" not in objects)
        # _db_has_legacy_inline_fts, answered from `objects` (pass 1 leaves the index as it is).
        word_index = objects.get(HERMES_FTS_TABLES["word"], (None, None))[1]
        if self.fts_caps.fts5 and fts_layout_of(word_index) == "legacy":
            # hermes-agent's flag for that index, written as its open writes it (its tools read it).
            write_meta(conn, META_FTS_OPTIMIZE_AVAILABLE, "1")
        return left

    # -- structure --------------------------------------------------------

    def _create_missing_tables(self, conn, objects):
        for table, (create_sql, _cols) in _declared_schema(SCHEMA_SQL).items():
            if table not in objects:
                conn.execute(create_sql)
                logger.info("schema: created table %s", table)

    def _reconcile_columns(self, conn, objects):
        """ADD COLUMN every declared column the live table lacks, whatever schema_version says; the
        count. `objects`: sqlite_master's {name: (type, sql)}, read in this transaction."""
        added, declared = 0, _declared_schema(SCHEMA_SQL)
        names = tuple(declared)
        stored = {name: sql for name, (kind, sql) in objects.items() if kind == "table"}
        # A table whose CREATE text is the declared one has the declared columns; the others
        # (another release's, or grown by ADD COLUMN) are read, in one statement (reading every
        # table's was a sixth of an open). Declared tables are plain: pragma_table_info of an
        # FTS5 table would fail on a runtime without FTS5.
        others = tuple(table for table in names if stored.get(table) != declared[table][0])
        live_of = {}
        if others:
            for table, column in conn.execute(
                    "SELECT m.name, p.name FROM sqlite_master AS m, pragma_table_info(m.name) AS p"
                    f" WHERE m.type = 'table' AND m.name IN ({placeholders(len(others))})",
                    others):
                live_of.setdefault(table, set()).add(column)
        for table, (_create_sql, columns) in declared.items():
            live = live_of.get(table, set()) if table in others else columns
            for column, type_expr in columns.items():
                if column not in live and self._add_column(conn, table, column, type_expr):
                    added += 1
        return added

    def _add_column(self, conn, table, column, type_expr):
        if "NOT NULL" in type_expr and "DEFAULT" not in type_expr:
            # SQLite cannot add a NOT NULL column without a default to a table that has rows; old
            # rows have no value, so the column is nullable here.
            type_expr = type_expr.replace("NOT NULL", "").strip()
        sql = (f"ALTER TABLE {quote_identifier(table)}"
               f" ADD COLUMN {quote_identifier(column)} {type_expr}")
        # "duplicate column": another process added it first.
        added = _try_ddl(conn, sql, f"could not add {table}.{column}", quiet="duplicate column")
        if added:
            logger.info("schema: added column %s.%s %s", table, column, type_expr)
        return added

    def _heal_gateway_routing_pk(self, conn, objects):
        """Rebuild gateway_routing keyed on (scope, session_key) if an old store keys it otherwise.
        Rows are copied oldest first with INSERT OR REPLACE (newest wins); the losers stay in a kept
        side table. `objects` as for _reconcile_columns: a table stored as declared is keyed so."""
        stored = objects.get("gateway_routing", (None, None))[1]
        if stored == _declared_schema(SCHEMA_SQL)["gateway_routing"][0] or \
                not live_columns(conn, "gateway_routing") or \
                live_primary_key(conn, "gateway_routing") == GATEWAY_ROUTING_PK:
            return
        side = quote_identifier(f"{GATEWAY_ROUTING_SIDE_TABLE}_{time.strftime('%Y%m%d_%H%M%S')}")
        conn.execute(RENAME_TABLE_SQL.format(table="gateway_routing", new_name=side))
        conn.execute(_declared_schema(SCHEMA_SQL)["gateway_routing"][0])
        conn.execute("INSERT OR REPLACE INTO gateway_routing"
                     " (scope, session_key, entry_json, updated_at)"
                     " SELECT COALESCE(scope, ''), session_key, entry_json, COALESCE(updated_at, 0)"
                     f" FROM {side} ORDER BY updated_at ASC")
        copied = conn.execute(f"SELECT COUNT(*) FROM {side}").fetchone()[0]
        kept = conn.execute("SELECT COUNT(*) FROM gateway_routing").fetchone()[0]
        if copied == kept:
            conn.execute(DROP_TABLE_SQL.format(table=side))
            logger.info("schema: rebuilt gateway_routing on (scope, session_key), %d rows kept",
                        kept)
        else:
            logger.warning("schema: rebuilt gateway_routing on (scope, session_key); %d older"
                           " colliding rows were superseded and are kept in table %s",
                           copied - kept, side)

    def _ensure_deferred_indexes(self, conn, objects, later=()):
        """Build each declared index the store lacks, but those named in `later`: the list of them
        it lacks, for _migrate_data."""
        left = []
        for name in DEFERRED_INDEXES:
            if name in objects:
                continue
            if name in later:
                left.append(name)
            else:
                _build_index(conn, name)
        return left

    def _ensure_title_index(self, conn, objects):
        """Titles are unique when not NULL; on duplicates the newest row keeps the title."""
        if TITLE_INDEX_NAME in objects:
            return
        create_index = ("CREATE UNIQUE INDEX IF NOT EXISTS idx_sessions_title_unique"
                        " ON sessions(title) WHERE title IS NOT NULL")
        try:
            conn.execute(create_index)
        except sqlite3.IntegrityError:
            # Of the rows sharing a title, only the newest keeps it.
            cleared = conn.execute("""
                UPDATE sessions SET title = NULL WHERE title IS NOT NULL AND EXISTS (
                  SELECT 1 FROM sessions AS newer WHERE newer.title = sessions.title
                    AND (newer.started_at > sessions.started_at
                         OR (newer.started_at = sessions.started_at
                             AND newer.rowid > sessions.rowid)))""").rowcount
            logger.warning("schema: cleared %d duplicate titles (the newest session keeps each)",
                           cleared)
            conn.execute(create_index)

    def _ensure_listing_objects(self, conn, objects):
        """Make any missing listing aid; then the tables are no longer trusted until the data pass
        fills them again (rows written while a trigger was missing were not kept)."""
        for name, sql in LISTING_INDEXES.items():
            if name not in objects:
                _try_ddl(conn, sql, f"index {name} not built")
        # A trigger or index another version made under the same name is made again.
        stale = [name for name, sql in LISTING_OBJECTS.items() if name in objects
                 and objects[name][0] in ("trigger", "index") and objects[name][1] != sql]
        for name in stale:
            conn.execute(f"DROP {objects[name][0].upper()} {quote_identifier(name)}")
        missing = [name for name in LISTING_OBJECTS if name not in objects or name in stale]
        for name in missing:
            conn.execute(LISTING_OBJECTS[name])
        if missing:
            conn.execute(DELETE_META_SQL, (META_LISTING_READY,))
            conn.execute(DELETE_META_SQL, (META_LISTING_PROGRESS,))

    def _ensure_identity_triggers(self, conn, objects):
        self._narrow_broad_index_triggers(conn, objects)
        for name, sql in IDENTITY_TRIGGERS.items():
            if name not in objects:
                conn.execute(sql)

    @staticmethod
    def _narrow_broad_index_triggers(conn, objects):
        """hermes-agent 0.19's index triggers fire on an update of any column and re-add the row:
        fired by the display triggers' own updates inside an insert, before the insert's trigger,
        the row then went in twice and the insert failed. Each is made again to fire on the
        columns it indexes only (as 0.22 does; its rows need no rebuild)."""
        for name, (kind, sql) in objects.items():
            if kind == "trigger" and name.startswith("messages_fts") and sql and \
                    _BROAD_UPDATE.search(sql):
                conn.execute(f"DROP TRIGGER {quote_identifier(name)}")
                conn.execute(_BROAD_UPDATE.sub(_INDEXED_COLUMNS_UPDATE, sql, count=1))
                logger.info("schema: trigger %s now fires on the columns it indexes", name)

    def _stamp_store_identity(self, conn, born):
        """0.22's provenance keys: a store born in this transaction gets its instance id and birth
        time (and has no row for the uid backfill to do); every file gets its generation once,
        which also goes into the header's application_id while that is 0."""
        if born and read_meta(conn, META_STORE_INSTANCE) is None:
            write_meta(conn, META_STORE_INSTANCE, str(uuid.uuid4()))
            write_meta(conn, META_STORE_CREATED,
                       datetime.datetime.now(datetime.timezone.utc).isoformat())
            write_meta(conn, META_UID_BACKFILL_DONE, "1")
        generation = read_meta(conn, META_DB_FILE_GENERATION)
        if not generation:
            generation = uuid.uuid4().hex
            write_meta(conn, META_DB_FILE_GENERATION, generation)
        if conn.execute("PRAGMA application_id").fetchone()[0] == 0:
            conn.execute(f"PRAGMA application_id = {(int(generation[:8], 16) & 0x7FFFFFFF) or 1}")

    def _stamp_schema_version(self, conn):
        if self._schema_version_held_back(conn):
            return
        current = conn.execute(SELECT_SCHEMA_VERSION_SQL).fetchone()[0]
        if current is None:
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
        elif current < SCHEMA_VERSION:
            conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
            logger.info("schema: version %d -> %d", current, SCHEMA_VERSION)
        elif current > SCHEMA_VERSION:
            logger.info("schema: store is at version %d, newer than this release (%d); "
                        "opened without changing it", current, SCHEMA_VERSION)

    def _schema_version_held_back(self, conn):
        """Hook: the search index mixin holds the version back on a runtime without FTS5."""
        return False

    # -- data repairs and migrations (resumable, one chunk per transaction) ---

    def _migrate_data(self, indexes_left=()):
        """The open's data repairs and migrations, after the structure and the indexes it left
        (`indexes_left`). Each is gated on the data, never on schema_version: the rows still to
        fix are the work left, so an interrupted run resumes."""
        for name in indexes_left:
            # (IF NOT EXISTS: another opener may have built it since)
            self._execute_write(lambda conn: _build_index(conn, name))
            pause_between_chunks()
        self._repair_null_active()
        self._migrate_inline_system_prompts()
        self._backfill_listing()
        self._backfill_message_uids()
        self._backfill_display_index()

    def _write_in_chunks(self, chunk, size):
        """Run the write `chunk` (returns the rows it did, at most `size`) until one does fewer; the
        total."""
        total = 0
        while True:
            done = self._execute_write(chunk)
            total += done
            if done < size:
                return total
            pause_between_chunks()

    def _repair_null_active(self):
        """Rows an older reconciler left with active NULL were hidden from history; show them,
        NULL_ACTIVE_CHUNK_ROWS a transaction (a whole old store at once held the lock for
        seconds)."""
        if self._read_one("SELECT 1 FROM messages WHERE active IS NULL LIMIT 1") is None:
            return

        def repair_chunk(conn):
            return conn.execute("UPDATE messages SET active = 1 WHERE id IN"
                                " (SELECT id FROM messages WHERE active IS NULL LIMIT ?)",
                                (self.NULL_ACTIVE_CHUNK_ROWS,)).rowcount
        fixed = self._write_in_chunks(repair_chunk, self.NULL_ACTIVE_CHUNK_ROWS)
        logger.info("schema: repaired %d messages whose active flag was NULL", fixed)

    def _migrate_inline_system_prompts(self):
        """Move `sessions.system_prompt` text of old stores into `system_prompts`, keyed by
        SHA-256."""
        if self._read_one("SELECT 1 FROM sessions WHERE system_prompt IS NOT NULL LIMIT 1") is None:
            return
        moved = self._write_in_chunks(self._move_inline_prompt_chunk, MIGRATION_CHUNK_SIZE)
        logger.info("schema: moved %d inline system prompts into system_prompts", moved)

    def _move_inline_prompt_chunk(self, conn):
        rows = conn.execute("SELECT id, system_prompt FROM sessions WHERE system_prompt IS NOT NULL"
                            " LIMIT ?", (MIGRATION_CHUNK_SIZE,)).fetchall()
        for session_id, prompt in rows:
            digest = prompt_hash(prompt)
            conn.execute(INSERT_SYSTEM_PROMPT_SQL, (digest, prompt))
            conn.execute("UPDATE sessions SET system_prompt = NULL, system_prompt_hash = ?"
                         " WHERE id = ?", (digest, session_id))
        return len(rows)

    def _backfill_listing(self):
        """Fill hs_session_activity, LISTING_BACKFILL_ROWS sessions a transaction in id order
        (resumed from META_LISTING_PROGRESS), then hs_session_tally in one; set META_LISTING_READY.
        The triggers keep every row already filled, and every session written meanwhile."""
        if self._read_value(SELECT_META_SQL, (META_LISTING_READY,)) == LISTING_VERSION:
            return
        filled = self._write_in_chunks(self._backfill_listing_chunk, LISTING_BACKFILL_ROWS)

        def finish(conn):
            # Rows of sessions deleted while a trigger was missing go; the tally is counted from
            # the rows the triggers keep from now on.
            conn.execute("DELETE FROM hs_session_activity WHERE NOT EXISTS (SELECT 1"
                         " FROM sessions AS s WHERE s.id = hs_session_activity.session_id)")
            conn.execute("DELETE FROM hs_session_tally")
            conn.execute("INSERT INTO hs_session_tally (source, archived, kind, n)"
                         " SELECT source, archived, kind, COUNT(*) FROM hs_session_activity"
                         " GROUP BY 1, 2, 3")
            conn.execute(DELETE_META_SQL, (META_LISTING_PROGRESS,))
            write_meta(conn, META_LISTING_READY, LISTING_VERSION)
        self._execute_write(finish)
        logger.info("schema: filled the listing aids for %d sessions", filled)

    def _backfill_listing_chunk(self, conn):
        after = read_meta(conn, META_LISTING_PROGRESS) or ""
        ids = [row[0] for row in conn.execute("SELECT id FROM sessions WHERE id > ? ORDER BY id"
                                              " LIMIT ?", (after, LISTING_BACKFILL_ROWS))]
        if ids:
            conn.execute("INSERT OR REPLACE INTO" + _ACTIVITY_OF + "s.id >= ? AND s.id <= ?",
                         (ids[0], ids[-1]))
            write_meta(conn, META_LISTING_PROGRESS, ids[-1])
        return len(ids)

    def _backfill_message_uids(self, budget_s=None):
        """Mint a message_uid for each row written before the store had the column, in id order:
        a chunk a transaction (see BACKFILL_CHUNK_TARGET_S), the last id done kept in
        META_UID_BACKFILL_CURSOR in the same transaction, so a kill loses no work and repeats none;
        at most `budget_s` (OPEN_BACKFILL_BUDGET_S) an open. A row without one reads as a message
        without identity."""
        if self._read_value(SELECT_META_SQL, (META_UID_BACKFILL_DONE,)) is not None:
            return
        deadline = time.monotonic() + (OPEN_BACKFILL_BUDGET_S if budget_s is None else budget_s)
        span, done = UID_BACKFILL_FIRST_SPAN, 0

        def chunk(conn):
            after = int(read_meta(conn, META_UID_BACKFILL_CURSOR) or 0)
            last = conn.execute("SELECT MAX(id) FROM messages").fetchone()[0] or 0
            if after >= last:
                write_meta(conn, META_UID_BACKFILL_CURSOR, None)
                write_meta(conn, META_UID_BACKFILL_DONE, "1")
                return None
            upper = min(after + span, last)
            minted = conn.execute("UPDATE messages SET message_uid = lower(hex(randomblob(16)))"
                                  " WHERE id > :after AND id <= :upper AND message_uid IS NULL",
                                  {"after": after, "upper": upper}).rowcount
            write_meta(conn, META_UID_BACKFILL_CURSOR, str(upper))
            return minted
        while time.monotonic() < deadline:
            started = time.monotonic()
            minted = self._execute_write(chunk)
            if minted is None:
                break
            done += minted
            span = _next_chunk_size(span, time.monotonic() - started, UID_BACKFILL_MAX_SPAN)
            pause_between_chunks()
        if done:
            logger.info("schema: minted a message_uid for %d older messages", done)

    def _backfill_display_index(self, budget_s=None):
        """Give visible rows without one their display identity and order, as 0.22's next display
        read of their session would (rows 0.20 wrote, rows an edit cleared): chunks of rows
        across sessions sized to BACKFILL_CHUNK_TARGET_S a transaction, at most `budget_s`
        (OPEN_BACKFILL_BUDGET_S) an open. Each row's order is the id of the first visible row of
        its session with the same identity; only rows that differ are written. The rows still
        without one are the work left, so a cut-short run resumes."""
        if self._read_one(_DISPLAY_BACKFILL_NEXT_SQL) is None:
            return  # a settled store: no write lock taken (every open asks)
        deadline = time.monotonic() + (OPEN_BACKFILL_BUDGET_S if budget_s is None else budget_s)
        place, done = None, 0  # (session, last id folded, {identity: first id}) of a session begun
        rows = DISPLAY_BACKFILL_ROWS
        while time.monotonic() < deadline:
            started = time.monotonic()
            place, fixed = self._execute_write(lambda conn: _fold_display_chunk(conn, place, rows))
            done += fixed
            if place is False:
                break
            rows = _next_chunk_size(rows, time.monotonic() - started, DISPLAY_BACKFILL_MAX_ROWS)
            pause_between_chunks()
        if done:
            logger.info("schema: gave %d older messages their display identity", done)

    # -- read-only callers ---------------------------------------------------

    def _stale_schema_report(self):
        """The probe statements that fail on this store (empty when it is current)."""
        failures = []
        for statement in schema_read_probe_statements():
            try:
                self._read_all(statement)
            except sqlite3.OperationalError as exc:
                failures.append(f"{statement.split(' FROM ')[-1].split()[0]}: {exc}")
        return failures

    # -- the layout probes, by hermes-agent's names -------------------------

    def _sqlite_supports_fts5(self, cursor=None):
        """True if this runtime's connections can create FTS5 tables (sqlite_supports_fts5, probed
        once as the store opened: fts_caps); `cursor`, hermes-agent's probe target, is not
        needed."""
        return self.fts_caps.fts5

    @staticmethod
    def _db_has_legacy_inline_fts(cursor):
        """True when the store `cursor` (or a connection) reads has hermes-agent 0.19's inline index
        (fts_layout_of 'legacy': optimize-storage replaces it); False with none or another one."""
        row = cursor.execute("SELECT sql FROM sqlite_master WHERE name = ?",
                             (HERMES_FTS_TABLES["word"],)).fetchone()
        return fts_layout_of(None if row is None else row[0]) == "legacy"
