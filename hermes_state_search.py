"""SessionSearchMixin: full-text search and the search index's own version line.

Owns: telling the three index generations apart (see hermes_state_common),
keeping each generation's triggers whole (per index, never mixing
generations), degrading on runtimes without FTS5 or the trigram tokenizer,
the query sanitiser and router, the LIKE fallback, the CJK side index, and
optimize-storage (the only path from an old generation to the current one).

It never rebuilds an index layout on open. It relies on SessionDB for
`_execute_write`, `_read_all`/`_read_one`/`_read_value`, `vacuum()` and
`db_path`; it never imports hermes_state.
"""

import logging
import re
import shutil
import sqlite3
import time
from collections import namedtuple

from hermes_state_schema import read_meta, write_meta
from hermes_state_common import (
    decode_content,
    DELETE_SHADOW_CHUNK_SQL,
    DROP_TABLE_SQL,
    DROP_TRIGGER_SQL,
    DROP_VIEW_SQL,
    FTS5_PROBE_SQL,
    FTS_COMMAND_SQL,
    FTS_PROBE_DROP_SQL,
    FTS_SNIPPET_SQL,
    RENAME_TABLE_SQL,
    TRIGRAM_PROBE_SQL,
    BACKFILL_SQL,
    CJK_CHAR_CLASS,
    CJK_PENDING_TABLE,
    CONTEXT_CHARS,
    CURRENT_FTS_INDEX_DDL,
    DELETE_CJK_PENDING_SQL,
    FTS_INDEX_TABLES,
    FTS_OLD_SUFFIX,
    FTS_STORAGE_VERSION,
    FTS_TRIGGERS,
    FTS_TRIGRAM_TABLE,
    FTS_WORD_TABLE,
    HAS_CJK_PENDING_SQL,
    LEGACY_REBUILD_SQL,
    META_FTS_CJK_STALE,
    META_FTS_OPTIMIZE_AVAILABLE,
    META_FTS_REBUILD_HIGH_WATER,
    META_FTS_REBUILD_PROGRESS,
    META_FTS_STALE,
    META_FTS_STORAGE_VERSION,
    QUERY_MAX_CHARS,
    QUERY_MAX_TERMS,
    RESET_INDEX_SQL,
    NOT_TOOL_ROW_SQL,
    SEARCH_BY_INDEX_SQL,
    SEARCH_BY_PREDICATE_SQL,
    SEARCH_ORDERS,
    SELECT_CJK_PENDING_SQL,
    SELECT_FTS_TRIGGERS_SQL,
    SELECT_INDEXED_TEXT_BYTES_SQL,
    SELECT_MAX_MESSAGE_ID_SQL,
    SELECT_META_KEYS_SQL,
    SELECT_META_SQL,
    SELECT_SCHEMA_OBJECTS_SQL,
    SELECT_TABLE_SQL_SQL,
    SNIPPET_CHARS,
    TABLE_EXISTS_SQL,
    TERM_IN_BACKFILL_GAP_SQL,
    TERM_IN_CJK_QUEUE_SQL,
    TERM_IN_INDEX_SQL,
    TERM_LIKE_PARAMS,
    TERM_LIKE_SQL,
    UPSERT_CJK_TERMS_SQL,
    escape_like,
    placeholders,
    quote_identifier,
    store_file_bytes,
)

logger = logging.getLogger("hermes_state")

BACKFILL_CHUNK_IDS = 1000
DROP_CHUNK_ROWS = 500
CJK_DRAIN_CHUNK = 500
# At most this many queued CJK rows are indexed in one transaction (open or
# maintenance), so a foreign writer's backlog never means one long write lock;
# the rest stays answerable through the queue and goes with later writes.
CJK_DRAIN_MAX_ROWS = 10_000
OPTIMIZE_PAUSE = 0.01
# Queued CJK rows are indexed with every this-many commits of a writer, and
# right away by any transaction that changed at least BULK_CHANGES rows.
CJK_DRAIN_EVERY_COMMITS = 64
BULK_CHANGES = 64
LEFTOVER_VIEWS = ("messages_fts_trigram_src",)
# A hit's keys in hermes-agent's order; `fields=` picks some of them.
SEARCH_RESULT_FIELDS = ("id", "session_id", "role", "snippet", "timestamp", "tool_name", "source", "model",
                        "session_started", "context")

CJK_RE = re.compile(f"[{CJK_CHAR_CLASS}]")
CJK_RUN_RE = re.compile(f"[{CJK_CHAR_CLASS}]+")
# Characters with a meaning in FTS5 query syntax; a user's word keeps none of them.
FTS_SYNTAX_RE = re.compile(r"[\"^*():{}\[\]+~'`]")
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")

# One neighbour of a search hit in its session, in (timestamp, id) order.
_NEIGHBOUR_SQL = """SELECT * FROM (SELECT role, content FROM messages WHERE session_id = :s AND timestamp = :t AND {same}
              ORDER BY id {order} LIMIT 1)
UNION ALL SELECT * FROM (SELECT role, content FROM messages WHERE session_id = :s AND {other}
                        ORDER BY timestamp {order}, id {order} LIMIT 1)
LIMIT 1"""

Capabilities = namedtuple("Capabilities", "fts5 trigram")
Term = namedtuple("Term", "text prefix")
# `substring`: the retry of a query whose words found nothing, matching them inside longer tokens.
IndexState = namedtuple("IndexState", "layout usable high_water progress cjk_pending tool_rows substring")


# ---------------------------------------------------------------------------
# Runtime capabilities
# ---------------------------------------------------------------------------


def _probe(connect, ddl):
    try:
        conn = connect(":memory:")
    except sqlite3.Error:
        return False
    try:
        conn.execute(ddl)
        conn.execute(FTS_PROBE_DROP_SQL)
        return True
    except sqlite3.Error:
        return False
    finally:
        conn.close()


def sqlite_supports_fts5(connect=sqlite3.connect):
    """True if connections made by `connect` can create an FTS5 table."""
    return _probe(connect, FTS5_PROBE_SQL)


def sqlite_supports_trigram(connect=sqlite3.connect):
    """True if they also have FTS5's trigram tokenizer (SQLite 3.34 and later)."""
    return _probe(connect, TRIGRAM_PROBE_SQL)


def runtime_capabilities(connect=sqlite3.connect):
    fts5 = sqlite_supports_fts5(connect)
    return Capabilities(fts5, fts5 and sqlite_supports_trigram(connect))


def free_disk_bytes(path):
    """Free bytes on the filesystem holding `path` (the optimize-storage pre-check)."""
    return shutil.disk_usage(path).free


# ---------------------------------------------------------------------------
# Generations on disk
# ---------------------------------------------------------------------------


def fts_layout_of(ddl):
    """The generation a `messages_fts` DDL belongs to: 'none', 'legacy' (no
    tool_name column), 'current' (reads our projection view) or 'external'."""
    if ddl is None:
        return "none"
    if "tool_name" not in ddl:
        return "legacy"
    return "current" if "messages_fts_projection" in ddl else "external"


def _layout(objects):
    return fts_layout_of(objects.get(FTS_WORD_TABLE, (None, None))[1])


def _schema_objects(conn):
    return {name: (kind, sql) for kind, name, sql in conn.execute(SELECT_SCHEMA_OBJECTS_SQL)}


def _stale_key(index):
    """The breadcrumb that stops an index from serving: the trigram index has its own."""
    return META_FTS_CJK_STALE if index == "trigram" else META_FTS_STALE


def _old_tables(objects):
    return [name for name in (FTS_WORD_TABLE + FTS_OLD_SUFFIX, FTS_TRIGRAM_TABLE + FTS_OLD_SUFFIX)
            if name in objects]


def cjk_terms(text):
    """The CJK side index's terms for `text`: every CJK letter and every adjacent pair."""
    terms = set()
    for run in CJK_RUN_RE.findall(text or ""):
        terms.update(run)
        terms.update(run[i:i + 2] for i in range(len(run) - 1))
    return " ".join(sorted(terms))


def drain_cjk_pending(conn, limit=CJK_DRAIN_CHUNK):
    """Index up to `limit` queued rows into messages_fts_cjk; returns how many were taken."""
    rows = conn.execute(SELECT_CJK_PENDING_SQL, (limit,)).fetchall()
    for message_id, content in rows:
        if content is not None:
            conn.execute(UPSERT_CJK_TERMS_SQL, (message_id, cjk_terms(content)))
        conn.execute(DELETE_CJK_PENDING_SQL, (message_id,))
    return len(rows)


# ---------------------------------------------------------------------------
# Query parsing: user text to an AND/OR/NOT tree of quoted terms
# ---------------------------------------------------------------------------


def _clean_word(word):
    prefix = word.endswith("*")
    word = FTS_SYNTAX_RE.sub("", word).lstrip("-")
    return word, prefix


def _tokens(query):
    """Phrases, words and operators; nothing from the user reaches MATCH unquoted."""
    tokens = []
    for phrase, word in re.findall(r'"([^"]*)"|(\S+)', CONTROL_RE.sub(" ", query[:QUERY_MAX_CHARS])):
        if word in ("AND", "OR", "NOT"):
            tokens.append(word)
            continue
        text, prefix = (" ".join(phrase.split()), False) if phrase else _clean_word(word)
        if any(ch.isalnum() for ch in text):
            tokens.append(Term(text, prefix and not phrase))
    return tokens


def _normalise(tokens):
    """Drop dangling operators, keep the last of a run of them, cap the terms."""
    cleaned, terms = [], 0
    for token in tokens:
        if isinstance(token, Term):
            if terms == QUERY_MAX_TERMS:
                break
            terms += 1
            cleaned.append(token)
        elif cleaned:
            if isinstance(cleaned[-1], str):
                cleaned[-1] = token
            else:
                cleaned.append(token)
    while cleaned and isinstance(cleaned[-1], str):
        cleaned.pop()
    return cleaned


def parse_query(query):
    """A tree of ('term', Term) / ('and'|'or', [nodes]) / ('not', left, right), or None.

    OR binds loosest, then AND (also implicit between terms), then the binary
    NOT ("a NOT b" is a and not b). Parentheses are not syntax here.
    """
    tokens = _normalise(_tokens(query))
    if not tokens:
        return None
    position = 0

    def take(op):
        nonlocal position
        if position < len(tokens) and tokens[position] == op:
            position += 1
            return True
        return False

    def term():
        nonlocal position
        position += 1
        return ("term", tokens[position - 1])

    def not_expr():
        node = term()
        while take("NOT"):
            node = ("not", node, term())
        return node

    def and_expr():
        nodes = [not_expr()]
        while position < len(tokens) and tokens[position] != "OR":
            take("AND")
            nodes.append(not_expr())
        return nodes[0] if len(nodes) == 1 else ("and", nodes)

    nodes = [and_expr()]
    while take("OR"):
        nodes.append(and_expr())
    return nodes[0] if len(nodes) == 1 else ("or", nodes)


def _leaves(node):
    if node[0] == "term":
        return [node[1]]
    children = node[1] if node[0] in ("and", "or") else node[1:]
    return [term for child in children for term in _leaves(child)]


def _positive_terms(node):
    """Terms a hit must contain (not those after NOT), for snippets."""
    if node[0] == "term":
        return [node[1]]
    if node[0] == "not":
        return _positive_terms(node[1])
    return [term for child in node[1] for term in _positive_terms(child)]


def _substring_retry(tree):
    """True when words that found nothing should be tried inside longer tokens
    ('youer' in '修改youer服务端'), as hermes-agent does: no CJK, every term 3+ characters."""
    return all(len(term.text) >= 3 and not CJK_RE.search(term.text) for term in _leaves(tree))


def _fts_string(term):
    return '"' + term.text.replace('"', '""') + '"' + ("*" if term.prefix else "")


def _route(term, state):
    """The index that answers `term`, or None for the LIKE fallback."""
    if state.substring:
        return "trigram" if len(term.text) >= 3 and "trigram" in state.usable else None
    if CJK_RE.search(term.text):
        if len(term.text) >= 3 and "trigram" in state.usable:
            return "trigram"
        if len(term.text) <= 2 and all(CJK_RE.match(ch) for ch in term.text) and "cjk" in state.usable:
            return "cjk"
        return None
    if "word" in state.usable:
        return "word"
    if len(term.text) >= 3 and "trigram" in state.usable:
        return "trigram"
    return None


def _like_sql(term, state):
    """The fallback for one term. A CJK term (and a substring retry) skips tool rows
    unless they were asked for, as the trigram and CJK indexes do, so every route
    gives the same answer."""
    sql = TERM_LIKE_SQL
    if (state.substring or CJK_RE.search(term.text)) and not state.tool_rows:
        sql = f"({NOT_TOOL_ROW_SQL} AND {sql})"
    return sql, [f"%{escape_like(term.text)}%"] * TERM_LIKE_PARAMS


def _leaf_sql(term, index, state):
    like, like_params = _like_sql(term, state)
    if index is None:
        return like, like_params
    sql, params = TERM_IN_INDEX_SQL.format(table=FTS_INDEX_TABLES[index]), [_fts_string(term)]
    if index != "word":
        sql = f"{NOT_TOOL_ROW_SQL} AND {sql}"
    if state.high_water is not None:
        # Rows a backfill has not reached yet are in no index of this generation.
        sql += TERM_IN_BACKFILL_GAP_SQL.format(like=like)
        params += [state.progress, state.high_water] + like_params
    if index == "cjk" and state.cjk_pending:
        sql += TERM_IN_CJK_QUEUE_SQL.format(like=like)
        params += like_params
    return f"({sql})", params


def _tree_sql(node, routes, state):
    kind = node[0]
    if kind == "term":
        return _leaf_sql(node[1], routes[node[1]], state)
    if kind == "not":
        left, lp = _tree_sql(node[1], routes, state)
        right, rp = _tree_sql(node[2], routes, state)
        return f"({left} AND NOT {right})", lp + rp
    parts = [_tree_sql(child, routes, state) for child in node[1]]
    joiner = " AND " if kind == "and" else " OR "
    return "(" + joiner.join(p[0] for p in parts) + ")", [x for p in parts for x in p[1]]


def _match_string(node):
    kind = node[0]
    if kind == "term":
        return _fts_string(node[1])
    if kind == "not":
        return f"({_match_string(node[1])} NOT {_match_string(node[2])})"
    joiner = " AND " if kind == "and" else " OR "
    return "(" + joiner.join(_match_string(child) for child in node[1]) + ")"


def make_snippet(content, terms):
    """About SNIPPET_CHARS of `content` around the first term found, the match in >>> <<<."""
    content = content or ""
    lowered = content.casefold()
    for term in terms:
        at = lowered.find(term.text.casefold())
        if at >= 0:
            start = max(0, at - SNIPPET_CHARS // 2)
            end = min(len(content), at + len(term.text) + SNIPPET_CHARS // 2)
            return ("..." if start else "") + content[start:at] + ">>>" + content[at:at + len(term.text)] \
                + "<<<" + content[at + len(term.text):end] + ("..." if end < len(content) else "")
    return content[:SNIPPET_CHARS] + ("..." if len(content) > SNIPPET_CHARS else "")


def _as_list(value):
    """A filter's values (one string is one value); None for no filter."""
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)


def search_fields(fields):
    """The hit keys `fields` asks for, in SEARCH_RESULT_FIELDS order; all of them for None."""
    if fields is None:
        return SEARCH_RESULT_FIELDS
    if isinstance(fields, str):
        raise TypeError("search fields must be a collection of field names, not a string")
    wanted = set(fields)
    unknown = wanted.difference(SEARCH_RESULT_FIELDS)
    if unknown:
        raise ValueError(f"unknown search result field(s): {', '.join(sorted(unknown))}")
    return tuple(field for field in SEARCH_RESULT_FIELDS if field in wanted)


def context_text(content):
    """A message's text as a hit's context shows it: list content as its text parts
    (or '[multimodal content]'), no content as '', at most CONTEXT_CHARS."""
    content = decode_content(content)
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        content = " ".join(text for text in texts if text and isinstance(text, str)).strip() \
            or "[multimodal content]"
    return content[:CONTEXT_CHARS] if isinstance(content, str) else ""


def _index_failure(exc):
    """True for an error that says an index is damaged, not that the store is busy or the input bad."""
    if isinstance(exc, (sqlite3.IntegrityError, sqlite3.ProgrammingError)):
        return False
    return not (isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc).lower())


class SessionSearchMixin:
    """Search-side behaviour of SessionDB (see the module docstring)."""

    # -- open ------------------------------------------------------------------

    def _init_search(self):
        """Writable open: keep this generation's triggers whole, rebuild what is stale.

        A store without any index gets the current generation, built in chunks
        right away; an old generation is left as it is and flagged optimizable.
        """
        started_backfill = self._execute_write(self._apply_search_schema)
        while started_backfill and self.fts_rebuild_step():
            pass

    def _schema_version_held_back(self, conn):
        """Without FTS5 the store keeps its schema version (see README)."""
        return not self.fts_caps.fts5

    def _apply_search_schema(self, conn):
        objects = _schema_objects(conn)
        layout = _layout(objects)
        started_backfill = False
        if layout == "none" and self.fts_caps.fts5:
            started_backfill = self._create_current_generation(conn)
            objects, layout = _schema_objects(conn), "current"
        if layout == "current":
            self._create_missing_index_tables(conn, objects)
            objects = _schema_objects(conn)
        if layout != "none":
            self._sync_triggers(conn, layout, objects)
            self._rebuild_stale_indexes(conn, layout, objects)
        if layout in ("legacy", "external"):
            write_meta(conn, META_FTS_OPTIMIZE_AVAILABLE, "1")
        self._stamp_if_complete(conn)
        return started_backfill

    def _usable_indexes(self, layout, objects):
        """The indexes of this generation that exist and this runtime can maintain."""
        usable = set()
        for index in FTS_TRIGGERS.get(layout, {}):
            if FTS_INDEX_TABLES[index] in objects and self.fts_caps.fts5 and \
                    (index != "trigram" or self.fts_caps.trigram):
                usable.add(index)
        return usable

    def _create_current_generation(self, conn):
        """Tables and triggers of the current generation; existing rows become a pending backfill."""
        for index in self._buildable_indexes():
            for ddl in CURRENT_FTS_INDEX_DDL[index] + tuple(FTS_TRIGGERS["current"][index].values()):
                conn.execute(ddl)
        high_water = conn.execute(SELECT_MAX_MESSAGE_ID_SQL).fetchone()[0]
        if high_water:
            write_meta(conn, META_FTS_REBUILD_HIGH_WATER, str(high_water))
            write_meta(conn, META_FTS_REBUILD_PROGRESS, "0")
        return bool(high_water)

    def _buildable_indexes(self):
        return [index for index in CURRENT_FTS_INDEX_DDL if index != "trigram" or self.fts_caps.trigram]

    def _create_missing_index_tables(self, conn, objects):
        """An index this runtime could not build before (no trigram) is built now."""
        if not self.fts_caps.fts5:
            return
        for index in self._buildable_indexes():
            if FTS_INDEX_TABLES[index] not in objects:
                for ddl in CURRENT_FTS_INDEX_DDL[index]:
                    conn.execute(ddl)
                write_meta(conn, _stale_key(index), "1")

    def _sync_triggers(self, conn, layout, objects):
        """Per index: all of its generation's triggers, or none when the runtime cannot maintain it."""
        present = dict(conn.execute(SELECT_FTS_TRIGGERS_SQL).fetchall())
        usable = self._usable_indexes(layout, objects)
        for index, triggers in FTS_TRIGGERS[layout].items():
            if index not in usable:
                dropped = [name for name in triggers if name in present]
                for name in dropped:
                    conn.execute(DROP_TRIGGER_SQL.format(trigger=quote_identifier(name)))
                if dropped or (FTS_INDEX_TABLES[index] in objects and not self.fts_caps.fts5):
                    write_meta(conn, _stale_key(index), "1")
                continue
            for name, ddl in triggers.items():
                if name not in present:
                    # Rows written while it was missing are not indexed: rebuild.
                    conn.execute(ddl)
                    write_meta(conn, _stale_key(index), "1")
                elif layout == "legacy" and "UPDATE OF" not in present[name] and "UPDATE ON" in present[name]:
                    conn.execute(DROP_TRIGGER_SQL.format(trigger=quote_identifier(name)))
                    conn.execute(ddl)

    def _rebuild_stale_indexes(self, conn, layout, objects):
        usable = self._usable_indexes(layout, objects)
        for key, indexes in ((META_FTS_STALE, ("word", "cjk")), (META_FTS_CJK_STALE, ("trigram",))):
            if read_meta(conn, key) is None:
                continue
            targets = [index for index in indexes if index in FTS_TRIGGERS[layout]]
            if not all(index in usable for index in targets):
                continue
            for index in targets:
                self._rebuild_index(conn, layout, index)
            write_meta(conn, key, None)
            logger.info("search: rebuilt the %s index of %s", "/".join(targets), self.db_path)

    def _rebuild_index(self, conn, layout, index):
        table = FTS_INDEX_TABLES[index]
        if layout == "legacy":
            for sql in LEGACY_REBUILD_SQL[index]:
                conn.execute(sql)
        elif index == "cjk":
            for sql in RESET_INDEX_SQL["cjk"]:
                conn.execute(sql)
            conn.execute(BACKFILL_SQL["cjk"], (0, conn.execute(SELECT_MAX_MESSAGE_ID_SQL).fetchone()[0]))
            while drain_cjk_pending(conn):
                pass
        else:
            conn.execute(FTS_COMMAND_SQL.format(table=table, command="rebuild"))

    def _stamp_if_complete(self, conn):
        """Stamp fts_storage_version only when the current generation is whole and alone."""
        objects = _schema_objects(conn)
        complete = (_layout(objects) == "current"
                    and all(table in objects for table in FTS_INDEX_TABLES.values())
                    and not _old_tables(objects)
                    and not any(read_meta(conn, key) for key in (META_FTS_REBUILD_HIGH_WATER, META_FTS_STALE,
                                                            META_FTS_CJK_STALE)))
        if complete:
            write_meta(conn, META_FTS_STORAGE_VERSION, str(FTS_STORAGE_VERSION))
            write_meta(conn, META_FTS_OPTIMIZE_AVAILABLE, "0")
        return complete

    def _maintain_search(self, conn, changes):
        """Called at the end of every write transaction that changed `changes` rows:
        index queued CJK rows after a bulk write and on every 64th commit, starting
        with the first (the open's own schema pass), at most CJK_DRAIN_MAX_ROWS."""
        commit_number = self._commits + 1  # this transaction's, counted by the write path
        if changes < BULK_CHANGES and commit_number % CJK_DRAIN_EVERY_COMMITS != 1:
            return
        if self.fts_caps.fts5 and conn.execute(TABLE_EXISTS_SQL, (CJK_PENDING_TABLE,)).fetchone():
            drain_cjk_pending(conn, CJK_DRAIN_MAX_ROWS)

    # -- state ---------------------------------------------------------------

    def fts_layout(self):
        """'none', 'legacy', 'external' or 'current': the index generation on disk."""
        return fts_layout_of(self._read_value(SELECT_TABLE_SQL_SQL, (FTS_WORD_TABLE,)))

    def fts_optimize_available(self):
        """True when the store has an older index generation that optimize-storage would shrink."""
        return self._read_value(SELECT_META_SQL, (META_FTS_OPTIMIZE_AVAILABLE,)) == "1"

    def _read_objects(self):
        """{name: (type, sql)} of sqlite_master, through a read connection."""
        return {name: (kind, sql) for kind, name, sql in self._read_all(SELECT_SCHEMA_OBJECTS_SQL)}

    def _read_meta(self, *keys):
        """{key: value or None} for these state_meta keys, in one query."""
        found = dict(self._read_all(SELECT_META_KEYS_SQL.format(placeholders(len(keys))), keys))
        return {key: found.get(key) for key in keys}

    def _index_state(self):
        objects = self._read_objects()
        layout = _layout(objects)
        meta = self._read_meta(META_FTS_STALE, META_FTS_CJK_STALE, META_FTS_REBUILD_HIGH_WATER,
                               META_FTS_REBUILD_PROGRESS)
        usable = {index for index in self._usable_indexes(layout, objects) if not meta[_stale_key(index)]}
        high_water = meta[META_FTS_REBUILD_HIGH_WATER]
        pending = CJK_PENDING_TABLE in objects and self._read_one(HAS_CJK_PENDING_SQL) is not None
        return IndexState(layout, usable, int(high_water) if high_water else None,
                          int(meta[META_FTS_REBUILD_PROGRESS] or 0), pending, False, False)

    def fts_rebuild_status(self):
        """{pending: True, total, indexed, percent (whole, 0-100)} while a backfill runs; None otherwise."""
        status = self._rebuild_phase()
        if status is None or status["phase"] != "backfill" or not status["total"]:
            return None
        return {"pending": True, "total": status["total"], "indexed": status["indexed"],
                "percent": min(100, 100 * status["indexed"] // status["total"])}

    def _rebuild_phase(self):
        """What a backfill or an optimize still has to do, or None when nothing is pending."""
        meta = self._read_meta(META_FTS_REBUILD_HIGH_WATER, META_FTS_REBUILD_PROGRESS)
        if meta[META_FTS_REBUILD_HIGH_WATER]:
            progress = int(meta[META_FTS_REBUILD_PROGRESS] or 0)
            total = int(meta[META_FTS_REBUILD_HIGH_WATER])
            return {"phase": "backfill", "indexed": progress, "total": total,
                    "percent": round(100.0 * progress / total, 1) if total else 100.0}
        old = _old_tables(self._read_objects())
        if old:
            return {"phase": "drop-old", "tables": old, "indexed": None, "total": None, "percent": None}
        return None

    def search_health(self):
        """The search facts `doctor` reports."""
        objects = self._read_objects()
        layout = _layout(objects)
        triggers = {name for name, (kind, _sql) in objects.items() if kind == "trigger"}
        return {
            "fts_layout": layout,
            "fts_storage_version_of_release": FTS_STORAGE_VERSION,
            "fts_triggers_complete": {index: all(name in triggers for name in names)
                                      for index, names in FTS_TRIGGERS.get(layout, {}).items()},
            "search_meta": self._read_meta(META_FTS_STORAGE_VERSION, META_FTS_OPTIMIZE_AVAILABLE, META_FTS_STALE,
                                           META_FTS_CJK_STALE, META_FTS_REBUILD_HIGH_WATER,
                                           META_FTS_REBUILD_PROGRESS),
            "fts_rebuild": self._rebuild_phase(),
            "searchable_by_index": sorted(self._index_state().usable),
        }

    # -- search --------------------------------------------------------------

    def search_messages(self, query, source_filter=None, exclude_sources=None, role_filter=None,
                        limit=20, offset=0, sort=None, include_inactive=False, fields=None):
        """Messages matching `query`, best first (bm25) unless `sort` is 'newest' or 'oldest'; [] for no query.

        Each hit has SEARCH_RESULT_FIELDS, or only those `fields` names; its
        context is the message before it, itself and the one after, each
        {role, content} cut to CONTEXT_CHARS. Words use the word index; CJK
        terms of 3+ characters the trigram index, of 1-2 the CJK side index;
        anything an index cannot answer falls back to LIKE. Words that match no
        whole token are retried as substrings. Rewound messages are left out
        unless `include_inactive`; compacted ones are found. An unknown sort
        means relevance; `limit` and `offset` go to SQLite as they are (a
        negative limit is no limit). A string `fields` raises TypeError, an
        unknown field ValueError.
        """
        fields = search_fields(fields)
        if not query or not query.strip():
            return []
        tree = parse_query(query)
        if tree is None:
            return []
        sort = sort.strip().lower() if isinstance(sort, str) else None
        roles = _as_list(role_filter) or []
        filters, filter_params = _search_filters(roles, _as_list(source_filter), _as_list(exclude_sources),
                                                 include_inactive)
        state = self._index_state()
        if "tool" in roles:
            state = state._replace(usable=set(), tool_rows=True)  # tool rows are only whole in the fallback
        search = (tree, filters, filter_params, sort, limit, offset)
        try:
            rows = self._run_search(state, *search)
        except sqlite3.DatabaseError as exc:
            if not _index_failure(exc):
                raise
            self._mark_index_stale(exc)
            state = state._replace(usable=set())
            rows = self._run_search(state, *search)
        if not rows and "word" in state.usable and _substring_retry(tree):
            rows = self._run_search(state._replace(substring=True), *search)
        terms = _positive_terms(tree)
        return [self._hit(row, terms, fields) for row in rows]

    def _run_search(self, state, tree, filters, filter_params, sort, limit, offset):
        routes = {term: _route(term, state) for term in _leaves(tree)}
        tables = {routes[t] for t in routes}
        single = len(tables) == 1 and None not in tables and state.high_water is None and \
            not (tables == {"cjk"} and state.cjk_pending)
        if single:
            index = tables.pop()
            table = FTS_INDEX_TABLES[index]
            # The legacy trigram index still holds tool rows; the current ones do not.
            no_tools = f" AND {NOT_TOOL_ROW_SQL}" if index != "word" else ""
            order = SEARCH_ORDERS[sort if sort in ("newest", "oldest") else "rank"].format(table=table)
            snippet = "NULL" if index == "cjk" else FTS_SNIPPET_SQL.format(table=table)
            sql = SEARCH_BY_INDEX_SQL.format(table=table, snippet=snippet, no_tools=no_tools, filters=filters,
                                             order=order)
            params = [_match_string(tree)] + filter_params
        else:
            where, params = _tree_sql(tree, routes, state)
            order = SEARCH_ORDERS["oldest" if sort == "oldest" else "newest"]
            sql = SEARCH_BY_PREDICATE_SQL.format(where=where, filters=filters, order=order)
            params += filter_params
        return self._read_all(sql, params + [limit, offset])

    def _mark_index_stale(self, exc):
        logger.warning("search: the index of %s failed (%s); answering by the fallback until it is "
                          "rebuilt at the next open", self.db_path, exc)
        if not self.read_only:
            self._execute_write(lambda conn: write_meta(conn, META_FTS_STALE, "1"))

    def _hit(self, row, terms, fields):
        values = dict(row)
        values["snippet"] = values.get("index_snippet") or make_snippet(row["content"], terms)
        if "context" in fields:
            values["context"] = self._context(row)
        return {field: values[field] for field in fields}

    def _context(self, hit):
        """[before, the hit, after] as {role, content}: neighbours by (timestamp, id) in its session, any state."""
        # Equal timestamps are common (a batch shares one): each neighbour is an
        # index seek, first among rows of the same time by id, then across times.
        rows = self._read_all(f"""
SELECT * FROM ({_NEIGHBOUR_SQL.format(same="id < :i", other="timestamp < :t", order="DESC")})
UNION ALL SELECT role, content FROM messages WHERE id = :i
UNION ALL SELECT * FROM ({_NEIGHBOUR_SQL.format(same="id > :i", other="timestamp > :t", order="ASC")})""",
                              {"s": hit["session_id"], "t": hit["timestamp"], "i": hit["id"]})
        return [{"role": role, "content": context_text(content)} for role, content in rows]

    # -- maintenance -----------------------------------------------------------

    def fts_rebuild_step(self):
        """Do one short transaction of pending index work; True while more remains."""
        return self._execute_write(self._rebuild_step)

    def _rebuild_step(self, conn):
        objects = _schema_objects(conn)
        if read_meta(conn, META_FTS_REBUILD_HIGH_WATER) is not None:
            self._backfill_chunk(conn, objects)
            return True
        if CJK_PENDING_TABLE in objects and self.fts_caps.fts5 and drain_cjk_pending(conn):
            return True
        old = _old_tables(objects)
        if old:
            _drop_old_chunk(conn, old[0], objects)
            return True
        for view in LEFTOVER_VIEWS:
            if view in objects:
                conn.execute(DROP_VIEW_SQL.format(view=quote_identifier(view)))
        self._stamp_if_complete(conn)
        return False

    def _backfill_chunk(self, conn, objects):
        high_water = int(read_meta(conn, META_FTS_REBUILD_HIGH_WATER))
        progress = int(read_meta(conn, META_FTS_REBUILD_PROGRESS) or 0)
        upper = min(progress + BACKFILL_CHUNK_IDS, high_water)
        for index in self._usable_indexes("current", objects):
            conn.execute(BACKFILL_SQL[index], (progress, upper))
        if upper >= high_water:
            write_meta(conn, META_FTS_REBUILD_HIGH_WATER, None)
            write_meta(conn, META_FTS_REBUILD_PROGRESS, None)
        else:
            write_meta(conn, META_FTS_REBUILD_PROGRESS, str(upper))

    def rebuild_fts(self):
        """Rebuild every index of the store's generation from the messages, in one transaction."""
        def rebuild(conn):
            objects = _schema_objects(conn)
            layout = _layout(objects)
            for index in self._usable_indexes(layout, objects):
                self._rebuild_index(conn, layout, index)
            return layout
        return self._execute_write(rebuild)

    def optimize_fts(self):
        """Merge each index's segments (FTS5 'optimize') and index queued CJK rows."""
        while self.fts_rebuild_step():
            pass

        def merge(conn):
            objects = _schema_objects(conn)
            for index in self._usable_indexes(_layout(objects), objects):
                table = FTS_INDEX_TABLES[index]
                conn.execute(FTS_COMMAND_SQL.format(table=table, command="optimize"))
        self._execute_write(merge)

    def optimize_fts_storage(self, *, progress_cb=None, vacuum=True):
        """Move an old index generation to the current one, then VACUUM, then stamp.

        Chunked short transactions with pauses between them, so live writers
        are never blocked for long; interrupt it at any point (Ctrl-C, kill -9)
        and run it again to resume. Raises OSError before starting when the disk
        has too little free space. Returns sizes before and after.
        """
        if not self.fts_caps.fts5:
            raise RuntimeError("optimize-storage needs a SQLite with FTS5; this one has none")
        report = progress_cb or (lambda _progress: None)
        before = store_file_bytes(self.db_path)
        self._check_disk_space(vacuum)
        report({"phase": "prepare", "percent": 0.0, "indexed": 0, "total": None})
        self._execute_write(self._begin_optimize)
        while True:
            status = self._rebuild_phase() or {"phase": "finish", "percent": 100.0}
            report({"phase": status["phase"], "percent": status.get("percent"),
                    "indexed": status.get("indexed"), "total": status.get("total")})
            if not self.fts_rebuild_step():
                break
            time.sleep(OPTIMIZE_PAUSE)
        if vacuum:
            report({"phase": "vacuum", "percent": None, "indexed": None, "total": None})
            self.vacuum()
        stamped = self._execute_write(self._stamp_if_complete)
        report({"phase": "done", "percent": 100.0, "indexed": None, "total": None})
        return {"bytes_before": before, "bytes_after": store_file_bytes(self.db_path), "stamped": stamped,
                "fts_layout": self.fts_layout()}

    def _begin_optimize(self, conn):
        """Set the old generation aside and put the current one in its place, in one transaction."""
        objects = _schema_objects(conn)
        layout = _layout(objects)
        if layout == "current":
            return
        for name, _sql in conn.execute(SELECT_FTS_TRIGGERS_SQL).fetchall():
            conn.execute(DROP_TRIGGER_SQL.format(trigger=quote_identifier(name)))
        for table in (FTS_WORD_TABLE, FTS_TRIGRAM_TABLE):
            if table in objects:
                conn.execute(RENAME_TABLE_SQL.format(table=table, new_name=table + FTS_OLD_SUFFIX))
        self._create_current_generation(conn)
        for key in (META_FTS_STORAGE_VERSION, META_FTS_STALE, META_FTS_CJK_STALE):
            write_meta(conn, key, None)
        logger.info("search: optimize-storage set the %s index of %s aside", layout, self.db_path)

    def _check_disk_space(self, vacuum):
        word_bytes, trigram_bytes = self._read_one(SELECT_INDEXED_TEXT_BYTES_SQL)
        new_index = 2 * word_bytes + 4 * trigram_bytes
        need = new_index + (store_file_bytes(self.db_path) if vacuum else 0)
        free = free_disk_bytes(self.db_path.parent)
        if free < need:
            hint = "" if not vacuum else (f"; with --no-vacuum (rebuild now, reclaim later) it needs about "
                                          f"{new_index / 1e6:.1f} MB")
            raise OSError(f"optimize-storage needs about {need / 1e6:.1f} MB free next to {self.db_path} "
                          f"(new index{' plus a VACUUM copy of the file' if vacuum else ''}); only "
                          f"{free / 1e6:.1f} MB are free{hint}. Nothing was changed.")


def _drop_old_chunk(conn, table, objects):
    """Empty an old index a chunk at a time through its shadow tables, then drop it.

    The structure records (ids up to 10 in _data) stay until the DROP, which needs them.
    """
    for shadow, where in ((f"{table}_data", "id > 10"), (f"{table}_content", "1")):
        if shadow not in objects:
            continue
        try:
            deleted = conn.execute(DELETE_SHADOW_CHUNK_SQL.format(
                shadow=quote_identifier(shadow), where=where, limit=DROP_CHUNK_ROWS)).rowcount
        except sqlite3.OperationalError:
            break  # shadow tables are read-only in defensive mode: drop the whole table at once
        if deleted:
            return
    conn.execute(DROP_TABLE_SQL.format(table=quote_identifier(table)))


def _search_filters(roles, sources, excluded, include_inactive):
    """SQL and parameters of the filters, as hermes-agent reads them: an empty source
    list matches nothing, an empty role or excluded list filters nothing."""
    clauses, params = [], []
    if not include_inactive:
        clauses.append("(m.active = 1 OR m.compacted = 1)")  # rewound rows are hidden, compacted ones kept
    for column, values, negate in (("m.role", roles or None, False), ("s.source", sources, False),
                                   ("s.source", excluded, True)):
        if values is not None:
            clauses.append(f"{column} {'NOT ' if negate else ''}IN ({placeholders(len(values))})")
            params += values
    return "".join(f" AND {c}" for c in clauses), params
