"""SessionSearchMixin: the query side of full-text search.

Owns: the query sanitiser and parser (user text to an AND/OR/NOT tree of quoted terms), routing
each term to an index or the LIKE fallback, building and running the search's SQL (ranked, by time,
the CJK walk by block bounds), the scan hermes-agent answers some CJK queries by, snippets, a hit's
context and its fields, and the statements for all of that.

It never writes: it does not create, repair, rebuild or set aside an index, nor write a meta key.
It relies on SessionSearchIndexMixin (through `self`) for `_read_objects`, `_index_state` (which
indexes answer and how whole they are) and `_mark_index_stale` (after an index failed a search),
and on SessionDB for `_read_all`/`_read_value`, `_with_reader` (one read transaction) and
`_idle_index_readers`; it never imports another mixin or hermes_state.
"""
import bisect
import contextlib
import functools
import re
import sqlite3
import unicodedata
from collections import namedtuple

from hermes_state_common import (
    CJK_BLOCK_BITS, CJK_CHAR_CLASS, CONTENT_JSON_PREFIX, CONTEXT_CHARS,
    FTS_TRIGRAM_EXCLUDED_SOURCES, QUERY_MAX_CHARS, QUERY_MAX_TERMS, SNIPPET_CHARS, decode_content,
    escape_like, host_is_020, sqlite_keeps,
)
from hermes_state_errors import QuerySyntaxError
# Tests import these from here, where search kept them before the index's life moved out.
from hermes_state_common import cjk_terms  # noqa: F401
from hermes_state_schema import fts_layout_of  # noqa: F401

# A page of CJK hits by time walks at most this many hits and block bounds from the top; past that
# (a store whose ids run against time) it sorts every hit, as a page deeper than half the walk does.
CJK_WALK_MAX_HITS = 2000
CJK_WALK_MAX_CHECKS = 64
CJK_WALK_MAX_LATE = 16  # late blocks a page takes in; past that the walk goes on
SEARCH_RESULT_FIELDS = (
    "id", "session_id", "role", "snippet", "timestamp", "tool_name", "source", "model",
    "session_started", "context",
)

# How search_messages reads a query: hermes-agent's way (a query holding CJK it scans means any of
# its terms, operators aside), or as written for every term.
GRAMMAR_HERMES, GRAMMAR_BOOLEAN = "hermes-agent", "boolean"


@functools.lru_cache(maxsize=None)
def cjk_letter():
    """A CJK letter's regex, compiled at first use (a class of 40,000 letters: 4 ms an import)."""
    return re.compile(f"[{CJK_CHAR_CLASS}]")


# Characters that part a user's word, as hermes-agent's sanitiser parts it (`\`, `%` and `_` stay:
# the LIKE routes take them literally).
FTS_SYNTAX_RE = re.compile(r"[\"^*():{}\[\]+~'`@/#&|<>,;!?$=]")
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")

# `AS MATERIALIZED` is SQLite 3.35+; an older one plans the plain CTEs itself, to the same answer.
CTE_MATERIALIZED = "MATERIALIZED" if sqlite3.sqlite_version_info >= (3, 35) else ""
# Hits per context statement: four parameters each, within SQLite's 999 before 3.32.
CONTEXT_CHUNK_HITS = 240

# `columns`: the messages columns a column filter (boolean reading) limits the term to, in
# SEARCH_COLUMNS' order; None for all of them.
Term = namedtuple("Term", "text prefix columns", defaults=(None,))


class _Binds(dict):
    """One search statement's values by name. The page's are set as keys (`match`, `limit`,
    `offset`, `floor`); `add` files a value of the filters or of one
    tree term under a new numbered name and returns the placeholder the SQL writes (`:like_3`)."""

    def add(self, stem, value):
        name = f"{stem}_{len(self)}"
        self[name] = value
        return f":{name}"


# -- The search's SQL -------------------------------------------------------------------------
# Every statement of a search binds by name from one _Binds: `:match` is the MATCH expression of
# the one index that answers the whole query, `:limit` and `:offset` the page.

# A hit's columns; `{snippet}` is the index's own snippet or NULL.
_SEARCH_COLUMNS_SQL = """SELECT m.id, m.session_id, m.role, m.content, m.timestamp, m.tool_name,
       s.source, s.model, s.started_at AS session_started, {snippet} AS index_snippet"""
# A word or trigram index cuts the snippet itself, as hermes-agent's search does.
FTS_SNIPPET_SQL = "snippet({table}, -1, '>>>', '<<<', '...', 40)"
# Best first by one index. FTS5 hands its matches over in rank order itself only when the ORDER BY
# is its rank alone and it is the outer loop (CROSS JOIN keeps it there): then the filters run in
# that order, LIMIT stops the scan, and no other row's content or snippet is read. Equal ranks come
# in rowid order (FTS5 sorts its matches, read in rowid order, with a stable sort), which is what
# hermes-agent's `ORDER BY rank` gives too.
SEARCH_RANKED_SQL = _SEARCH_COLUMNS_SQL + """
FROM {table} CROSS JOIN messages AS m ON m.id = {table}.rowid
CROSS JOIN sessions AS s ON s.id = m.session_id
WHERE {table} MATCH :match{no_tools} {filters}
ORDER BY {table}.rank LIMIT :limit OFFSET :offset"""
# By time from an index that ranks, equal times by rank. Ranking every hit costs
# bm25 at each (24,000 hits of `parser`: 70 -> 110 ms), but only the hits at the
# page's times need it: the page by time alone gives its first and last time
# (`edge`), the hits between them are ranked in one pass of the index over their
# id range, and the page is cut from them after the hits before its first time.
_PAGE_BY_RANKED_INDEX_SQL = """WITH
hits(id, t) AS {materialized} (SELECT m.id, m.timestamp
    FROM {table} CROSS JOIN messages AS m ON m.id = {table}.rowid
    JOIN sessions AS s ON s.id = m.session_id
    WHERE {table} MATCH :match{no_tools} {filters}),
edge(lo, hi) AS {materialized} (SELECT min(t), max(t)
    FROM (SELECT t FROM hits ORDER BY t {direction} LIMIT :limit OFFSET :offset)),
near(id, t) AS {materialized} (SELECT hits.id, hits.t
    FROM edge CROSS JOIN hits WHERE hits.t BETWEEN edge.lo AND edge.hi),
ranked(id, rank) AS {materialized} (SELECT rowid, rank FROM {table} WHERE {table} MATCH :match
    AND rowid BETWEEN (SELECT min(id) FROM near) AND (SELECT max(id) FROM near)
    AND +rowid IN (SELECT id FROM near))
SELECT near.id AS hit, ranked.rank AS hit_rank FROM near JOIN ranked ON ranked.id = near.id
ORDER BY near.t {direction}, ranked.rank, near.id
LIMIT :limit
OFFSET :offset - (SELECT count(*) FROM edge CROSS JOIN hits WHERE hits.t {before} edge.{first})"""
_RANKED_PAGE_PARTS = {
    "newest": {"direction": "DESC", "before": ">", "first": "hi"},
    "oldest": {"direction": "ASC", "before": "<", "first": "lo"},
}
# Then the page's rows, and their snippets (`{join}` re-opens the index at each of them).
_PAGE_ROWS_SQL = _SEARCH_COLUMNS_SQL + """
FROM ({page}) AS page CROSS JOIN messages AS m ON m.id = page.hit{join}
CROSS JOIN sessions AS s ON s.id = m.session_id
ORDER BY {order}"""
# Equal times in hermes-agent's order: its word and trigram searches sort by
# "timestamp, rank", its LIKE scan by timestamp alone; both hand equal keys over
# in id order (SQLite's sorter keeps the order of its input, read by id). So:
# time, then rank where an index ranks (`{rank}`: the page's), then id ascending,
# in both directions.
_ORDERS = {"newest": "m.timestamp DESC, {rank}m.id ASC",
           "oldest": "m.timestamp ASC, {rank}m.id ASC"}
# The fallback: NULL reads as '' (NOT never turns NULL); NUL-led text past its NUL (LIKE stops
# there). `{pattern}` is the term's one `:like_N`, which all three columns test.
_LIKE_CONTENT_SQL = (
    "CASE WHEN m.content >= char(0) || 'json:' AND m.content < char(0) || 'json;' "
    f"THEN CAST(substr(CAST(m.content AS BLOB), {len(CONTENT_JSON_PREFIX) + 1}) AS TEXT) "
    "WHEN m.content >= char(0) AND m.content < char(1) "
    "THEN CAST(substr(CAST(m.content AS BLOB), 2) AS TEXT) ELSE m.content END")
# The columns a term is looked for in: messages_fts's, which a column filter names.
_LIKE_COLUMNS = {"content": _LIKE_CONTENT_SQL, "tool_name": "m.tool_name",
                 "tool_calls": "m.tool_calls"}
SEARCH_COLUMNS = tuple(_LIKE_COLUMNS)
_NOT_TOOL_ROW_SQL = "m.role <> 'tool'"
# The context of a page of hits, in one statement: each hit's neighbours in its session by
# (timestamp, id), in any state. Equal timestamps are common (a batch shares one): each neighbour
# is an index seek, first among rows of the same time by id, then across times. `{hits}` is one
# "(?, ?, ?, ?)" per hit: its place, session, time and id.
_NEIGHBOUR_ID_SQL = """COALESCE(
    (SELECT id FROM messages WHERE session_id = h.s AND timestamp = h.t AND id {cmp} h.i
     ORDER BY id {order} LIMIT 1),
    (SELECT id FROM messages WHERE session_id = h.s AND timestamp {cmp} h.t
     ORDER BY timestamp {order}, id {order} LIMIT 1))"""
_BEFORE_SQL = _NEIGHBOUR_ID_SQL.format(cmp="<", order="DESC")
_AFTER_SQL = _NEIGHBOUR_ID_SQL.format(cmp=">", order="ASC")
SEARCH_CONTEXT_SQL = f"""WITH hits(n, s, t, i) AS (VALUES {{hits}}),
near(n, before, i, after) AS (SELECT h.n, {_BEFORE_SQL}, h.i, {_AFTER_SQL} FROM hits AS h)
SELECT near.n, m.role, m.content
FROM near CROSS JOIN messages AS m ON m.id IN (near.before, near.i, near.after)
ORDER BY near.n, m.timestamp, m.id"""


# -- Query parsing: user text to an AND/OR/NOT tree of quoted terms -------------------------

def _tokens(query):
    """Phrases, words and operators; nothing from the user reaches MATCH unquoted."""
    tokens = []
    cleaned = CONTROL_RE.sub(" ", query[:QUERY_MAX_CHARS])
    for phrase, word in re.findall(r'"([^"]*)"|(\S+)', cleaned):
        if word in ("AND", "OR", "NOT"):
            tokens.append(word)
            continue
        # FTS5's syntax characters part a word, as hermes-agent's sanitiser parts it
        # ("user's": user, s).
        if phrase:
            parts = [" ".join(phrase.split())]
        else:
            parts = FTS_SYNTAX_RE.sub(" ", word).lstrip("-").split()
        tokens += [Term(text, not phrase and word.endswith("*") and n == len(parts) - 1)
                   for n, text in enumerate(parts) if any(ch.isalnum() for ch in text)]
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


def parse_query(query, grammar=GRAMMAR_HERMES):
    """A tree of ('term', Term) / ('and'|'or', [nodes]) / ('not', left, right), or None.

    OR binds loosest, then AND (also implicit between terms), then the binary NOT ("a NOT b" is
    a and not b). hermes-agent's reading drops what it cannot read (parentheses, dangling
    operators, terms past the cap); the boolean one (_parse_boolean) reads parentheses and `-`
    and raises QuerySyntaxError for the rest."""
    if grammar == GRAMMAR_BOOLEAN:
        return _parse_boolean(query)
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


# A boolean query's pieces: dashes (a NOT) and a column filter (FTS5's `content:`,
# `{content tool_name}:`) before a phrase, a '(' or a word; or a ')'. A '"' without its pair is
# dropped, as hermes-agent's sanitiser drops it. Only SEARCH_COLUMNS' names make a bare filter
# (`key:value` and `12:30` stay words); braces name columns and nothing else.
_BOOLEAN_TOKEN_RE = re.compile(
    r'(-*)(?:(\{[^{}]*\}|(?<![^\s(-])(?:content|tool_name|tool_calls))\s*:\s*)?'
    r'(?:"([^"]*)"|(\()|([^\s()"]+))|(\))', re.IGNORECASE)
_DANGLING_FILTER_RE = re.compile(r"-*(?:\{[^{}]*\}|content|tool_name|tool_calls)\s*:", re.I)
_GROUP_DEPTH_MAX = 32
_NOT_SPELLINGS = {"NOT": "NOT", "-": "'-' (NOT)"}


def _boolean_tokens(query, fail):
    """Terms, "(", ")", "AND", "OR", "NOT" and "-" (a NOT typed as a leading dash); `AND NOT`
    is a NOT."""
    if len(query) > QUERY_MAX_CHARS:
        fail(f"a query is at most {QUERY_MAX_CHARS:,} characters")
    cleaned = CONTROL_RE.sub(" ", query)
    tokens = []
    for found in _BOOLEAN_TOKEN_RE.finditer(cleaned):
        dashes, named, phrase, group, word, close = found.groups()
        columns = None if named is None else _filter_columns(named, fail)
        if word in ("AND", "OR", "NOT") and not dashes and columns is None:
            pieces = [word]
        elif group or close:
            # A filter before a group holds for every term in it, as in FTS5.
            pieces = [group or close] if columns is None else [columns, group]
        else:
            parts = [" ".join(phrase.split())] if phrase is not None else \
                FTS_SYNTAX_RE.sub(" ", word).lstrip("-").split()
            pieces = [Term(text, word is not None and word.endswith("*") and n == len(parts) - 1,
                           columns)
                      for n, text in enumerate(parts) if any(ch.isalnum() for ch in text)]
            # (`content:` at the end reads as a word the filter's regex left alone)
            dangling = not pieces if columns is not None else \
                _DANGLING_FILTER_RE.fullmatch(word or "")
            if dangling:
                fail("a column filter needs a term after it")
        if dashes and pieces:
            pieces.insert(0, "-")
        for piece in pieces:
            if piece in ("NOT", "-") and tokens and tokens[-1] == "AND":
                tokens[-1] = piece
            else:
                tokens.append(piece)
    if sum(isinstance(token, Term) for token in tokens) > QUERY_MAX_TERMS:
        fail(f"a query holds at most {QUERY_MAX_TERMS} terms")
    return tokens


def _filter_columns(named, fail):
    """The columns a filter (`content`, `{tool_name tool_calls}`) names, in SEARCH_COLUMNS'
    order."""
    names = named.strip("{}").lower().split()
    unknown = [name for name in names if name not in SEARCH_COLUMNS]
    if unknown or not names:
        fail(f"a column filter names {', '.join(SEARCH_COLUMNS)}, not {named!r}")
    return tuple(column for column in SEARCH_COLUMNS if column in names)


def _within(node, columns, fail):
    """`node` with every term's columns narrowed to `columns` (a filter before a group)."""
    if node[0] == "term":
        term = node[1]
        narrowed = columns if term.columns is None else \
            tuple(column for column in term.columns if column in columns)
        if not narrowed:
            fail("nested column filters share no column")
        return ("term", term._replace(columns=narrowed))
    if node[0] == "not":
        return ("not", _within(node[1], columns, fail), _within(node[2], columns, fail))
    return (node[0], [_within(child, columns, fail) for child in node[1]])


def _parse_boolean(query):
    """`query` read as written: terms, phrases, prefix*, AND (or nothing), OR, NOT (or a leading
    `-`), parentheses, column filters (`content:x`, `{tool_name tool_calls}:(a OR b)`). A NOT with
    no term before it in its group, an operator with no term after it, an unbalanced parenthesis,
    an empty group or a filter naming another column raise QuerySyntaxError."""
    shown = query if len(query) <= 80 else query[:77] + "..."

    def fail(problem):
        raise QuerySyntaxError(f"{problem}: {shown!r}")
    tokens = _boolean_tokens(query, fail)
    if not any(isinstance(token, Term) for token in tokens):
        return None
    position, depth = 0, 0

    def peek():
        return tokens[position] if position < len(tokens) else None

    def take():
        nonlocal position
        position += 1
        return tokens[position - 1] if position <= len(tokens) else None

    def operand(after):
        """A term or a group; `after` the operator typed before it (None at a group's start)."""
        nonlocal depth
        token = take()
        if isinstance(token, Term):
            return ("term", token)
        if isinstance(token, tuple):  # a column filter before a group
            return _within(operand(after), token, fail)
        if token == "(":
            depth += 1
            if depth > _GROUP_DEPTH_MAX:
                fail(f"parentheses nest at most {_GROUP_DEPTH_MAX} deep")
            if peek() == ")":
                fail("a group '( )' holds no term")
            node = or_expr()
            if take() != ")":
                fail("a '(' has no ')'")
            depth -= 1
            return node
        if token in _NOT_SPELLINGS:
            fail(f"{_NOT_SPELLINGS[token]} needs a term before it")
        if after is not None:
            fail(f"{after} needs a term after it")
        if token == ")":
            fail("a ')' has no '('")
        fail(f"{token} needs a term before it")

    def not_expr(after):
        node = operand(after)
        while peek() in _NOT_SPELLINGS:
            node = ("not", node, operand(_NOT_SPELLINGS[take()]))
        return node

    def and_expr(after):
        nodes = [not_expr(after)]
        while peek() not in (None, ")", "OR"):
            nodes.append(not_expr(take() if peek() == "AND" else None))
        return nodes[0] if len(nodes) == 1 else ("and", nodes)

    def or_expr():
        nodes = [and_expr(None)]
        while peek() == "OR":
            take()
            nodes.append(and_expr("OR"))
        return nodes[0] if len(nodes) == 1 else ("or", nodes)

    tree = or_expr()
    if position < len(tokens):
        fail("a ')' has no '('")
    return tree


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
    return all(len(term.text) >= 3 and not cjk_letter().search(term.text) for term in _leaves(tree))


def _any_term(tree):
    """0.22's retry of an all-words query that found nothing: the same terms, any of them
    (phrases stay whole); None where it does not retry (one term, an explicit OR or NOT, CJK)."""
    if tree[0] != "and" or any(child[0] != "term" or cjk_letter().search(child[1].text)
                               for child in tree[1]):
        return None
    return ("or", tree[1])


def hermes_scans(tree, state):
    """True for a query hermes-agent answers by a LIKE scan (any of its terms, newest first):
    CJK its trigram index cannot answer (a CJK term of 1-2 letters, no trigram index, tool rows
    asked for)."""
    cjk = [term for term in _leaves(tree) if cjk_letter().search(term.text)]
    return bool(cjk) and (any(len(cjk_letter().findall(term.text)) < 3 for term in cjk)
                          or "trigram" not in state.usable
                          or state.tool_rows)


def scan_snippet(content, term):
    """hermes-agent's snippet of a scanned hit: 120 characters from 40 before `term` (or from
    the start)."""
    start = max(0, content.find(term.text) - 40) if content and term.text in content else 0
    return None if content is None else content[start:start + 120]


def _sql_order(value):
    """`value`'s place in SQLite's ORDER BY: NULL, numbers, text (UTF-8 order is code point
    order), blobs."""
    if value is None:
        return (0, 0)
    if isinstance(value, (int, float)):
        return (1, value)
    return (2 if isinstance(value, str) else 3, value)


def _cjk_floor(conn, hits, wanted):
    """(lowest id, [blocks below it]) holding the newest `wanted` of `hits` (by id from the top),
    or (0, []).

    At a block's lower edge, with `wanted` hits seen, t the `wanted`-th newest time among them: a
    hit below outranking one has a time >= t (an equal time wins by its lower id), so its block's
    bound is >= t. Blocks later than their neighbours (a row given a new time, a clock once ahead)
    are few; more end the walk."""
    seen, block, checks = [], None, 0
    for number, (message_id, timestamp) in enumerate(hits):
        if message_id >> CJK_BLOCK_BITS != block:
            if block is not None and len(seen) >= wanted and seen[-wanted][0]:
                # The blocks below this one that hold a time at least as late as t.
                late = conn.execute("SELECT block FROM hs_fts_cjk_bounds"
                                    " WHERE newest >= ? AND block < ?"
                                    f" LIMIT {CJK_WALK_MAX_LATE + 1}",
                                    (seen[-wanted][1], block)).fetchall()
                if len(late) <= CJK_WALK_MAX_LATE:
                    return block << CJK_BLOCK_BITS, [late_block for (late_block,) in late]
                checks += 1
            if number >= CJK_WALK_MAX_HITS or checks > CJK_WALK_MAX_CHECKS:
                break
            block = message_id >> CJK_BLOCK_BITS
        bisect.insort(seen, _sql_order(timestamp))
    return 0, []


def _fts_string(term, index):
    """`term` as FTS5 reads it in `index`, with its column filter (the CJK index holds content
    alone, in a column of its own name)."""
    quoted = '"' + term.text.replace('"', '""') + '"' + ("*" if term.prefix else "")
    if term.columns is None or index == "cjk":
        return quoted
    return "{" + " ".join(term.columns) + "}: " + quoted


def _route(term, state):
    """The index that answers `term`, or None for the LIKE fallback."""
    index = _index_for(term.text, state)
    if index in (None, "word") or term.columns in (None, ("content",)):
        return index
    # The trigram and CJK indexes are read for content: a filter naming another column is LIKE's.
    return None


def _index_for(text, state):
    trigram = "trigram" if len(text) >= 3 and "trigram" in state.usable else None
    if state.substring:
        return trigram
    # (a mark the CJK index splits on, as ・, is for LIKE to match)
    if cjk_letter().search(text):
        cjk = len(text) <= 2 and "cjk" in state.usable and all(
            cjk_letter().match(ch) and unicodedata.category(ch)[0] in "LN" for ch in text)
        return trigram or ("cjk" if cjk else None)
    return "word" if "word" in state.usable else trigram


def _like_sql(term, state, binds):
    """The fallback for one term, in its filter's columns. A CJK term (and a substring retry)
    skips tool rows unless they were asked for, as the trigram and CJK indexes do, so every route
    gives the same answer."""
    pattern = binds.add("like", f"%{escape_like(term.text)}%")
    sql = "(" + " OR ".join(f"COALESCE({_LIKE_COLUMNS[column]}, '') LIKE {pattern} ESCAPE '\\'"
                            for column in term.columns or SEARCH_COLUMNS) + ")"
    if (state.substring or cjk_letter().search(term.text)) and not state.tool_rows:
        sql = f"({_NOT_TOOL_ROW_SQL} AND {sql})"
    return sql


def _leaf_sql(term, index, state, binds):
    if index is None:
        return _like_sql(term, state, binds)
    table = state.tables[index]
    match = binds.add("term", _fts_string(term, index))
    sql = f"m.id IN (SELECT rowid FROM {table} WHERE {table} MATCH {match})"
    if index != "word":
        sql = f"{_NOT_TOOL_ROW_SQL} AND {sql}"
    unindexed = []  # rows this index does not hold yet, for the fallback to test
    if index in state.gaps:
        # Rows its backfill has not reached yet.
        progress, high_water = state.gaps[index]
        unindexed.append(f"m.id > {binds.add('progress', progress)}"
                         f" AND m.id <= {binds.add('high_water', high_water)}")
    if index == "cjk" and state.cjk_pending:
        unindexed.append("m.id IN (SELECT id FROM hs_fts_cjk_queue)")
    if unindexed:
        like = _like_sql(term, state, binds)
        sql += "".join(f" OR ({rows} AND {like})" for rows in unindexed)
    return f"({sql})"


def _matched_alone(term, index, state):
    """True when `term`'s index alone gives its ids: False for the fallback, a backfill or CJK
    queue not indexed yet, or a hermes-agent index that may hold tool rows (ours never do but in
    the word index)."""
    return not (index is None or index in state.gaps
                or (index == "cjk" and state.cjk_pending)
                or (index != "word" and state.layout != "current"))


def _id_set_sql(node, routes, state, binds):
    """The ids `node` matches as one compound SELECT over its indexes (each term _matched_alone)."""
    if node[0] == "term":
        table = state.tables[routes[node[1]]]
        match = binds.add("term", _fts_string(node[1], routes[node[1]]))
        return f"SELECT rowid FROM {table} WHERE {table} MATCH {match}"
    children = node[1] if node[0] in ("and", "or") else node[1:]
    operator = {"and": "INTERSECT", "or": "UNION", "not": "EXCEPT"}[node[0]]
    return f" {operator} ".join(f"SELECT * FROM ({_id_set_sql(child, routes, state, binds)})"
                                for child in children)


def _tree_sql(node, routes, state, binds):
    """`node` as a condition on a messages row `m`, its values added to `binds`."""
    if all(_matched_alone(term, routes[term], state) for term in _leaves(node)):
        return f"m.id IN ({_id_set_sql(node, routes, state, binds)})"
    kind = node[0]
    if kind == "term":
        return _leaf_sql(node[1], routes[node[1]], state, binds)
    if kind == "not":
        left = _tree_sql(node[1], routes, state, binds)
        right = _tree_sql(node[2], routes, state, binds)
        return f"({left} AND NOT {right})"
    joiner = " AND " if kind == "and" else " OR "
    return "(" + joiner.join(_tree_sql(child, routes, state, binds) for child in node[1]) + ")"


def _match_string(node, index):
    kind = node[0]
    if kind == "term":
        return _fts_string(node[1], index)
    if kind == "not":
        return f"({_match_string(node[1], index)} NOT {_match_string(node[2], index)})"
    joiner = " AND " if kind == "and" else " OR "
    return "(" + joiner.join(_match_string(child, index) for child in node[1]) + ")"


def make_snippet(content, terms):
    """About SNIPPET_CHARS of `content` around the first term found, the match in >>> <<<."""
    content = content or ""
    lowered = content.casefold()
    for term in terms:
        at = lowered.find(term.text.casefold())
        if at >= 0:
            start = max(0, at - SNIPPET_CHARS // 2)
            end = min(len(content), at + len(term.text) + SNIPPET_CHARS // 2)
            stop = at + len(term.text)
            return (("..." if start else "") + content[start:at] + ">>>" + content[at:stop]
                    + "<<<" + content[stop:end] + ("..." if end < len(content) else ""))
    return content[:SNIPPET_CHARS] + ("..." if len(content) > SNIPPET_CHARS else "")


def _as_list(value):
    """A filter's values (one string is one value); None for no filter."""
    return None if value is None else [value] if isinstance(value, str) else list(value)


def search_fields(fields):
    """The hit keys `fields` asks for, in SEARCH_RESULT_FIELDS order; all of them for None."""
    if fields is None:
        return SEARCH_RESULT_FIELDS
    if isinstance(fields, str):
        raise TypeError("search fields must be a collection of field names, not a string")
    wanted = set(fields)  # once: `fields` may be an iterator
    if unknown := wanted.difference(SEARCH_RESULT_FIELDS):
        raise ValueError(f"unknown search result field(s): {', '.join(sorted(unknown))}")
    return tuple(field for field in SEARCH_RESULT_FIELDS if field in wanted)


def context_text(content):
    """A message's text as a hit's context shows it: list content as its text parts
    (or '[multimodal content]'), no content as '', at most CONTEXT_CHARS."""
    content = decode_content(content)
    if isinstance(content, list):
        texts = [part.get("text") for part in content
                 if isinstance(part, dict) and part.get("type") == "text"]
        joined = " ".join(text for text in texts if text and isinstance(text, str)).strip()
        content = joined or "[multimodal content]"
    return content[:CONTEXT_CHARS] if isinstance(content, str) else ""


def _index_failure(exc):
    """True for an error that says an index is damaged, not that the store is busy or the
    input bad."""
    if isinstance(exc, (sqlite3.IntegrityError, sqlite3.ProgrammingError)):
        return False
    # A busy store, or SQL this runtime cannot take (our bug, which a rebuild would not cure).
    causes = ("locked", "syntax error", "too many sql variables")
    return not (isinstance(exc, sqlite3.OperationalError)
                and any(cause in str(exc).lower() for cause in causes))


class SessionSearchMixin:
    """Search-side behaviour of SessionDB (see the module docstring).

    Relies on: `_read_objects`, `_index_state`, `_mark_index_stale` (SessionSearchIndexMixin);
    `_read_all`, `_read_value`, `_with_reader`, `_idle_index_readers` (SessionDB)."""

    # -- search --------------------------------------------------------------

    def search_messages(self, query, source_filter=None, exclude_sources=None, role_filter=None,
                        limit=20, offset=0, sort=None, include_inactive=False, fields=None,
                        after_ts=None, before_ts=None, *, grammar=GRAMMAR_HERMES):
        """Messages matching `query`, best first (bm25) unless `sort` is 'newest' or 'oldest';
        [] for no query.

        Each hit has SEARCH_RESULT_FIELDS, or only those `fields` names; its context is the message
        before it, itself and the one after, each {role, content} cut to CONTEXT_CHARS. Words use
        the word index; CJK terms of 3+ characters the trigram index, of 1-2 the CJK side index;
        anything an index cannot answer falls back to LIKE. A query hermes-agent answers by a LIKE
        scan (a CJK term of 1-2 characters) is answered as that scan: any of its terms, newest
        first, its plain snippet. Words that match no whole token are retried as substrings.
        Rewound messages are left out unless `include_inactive`, and hidden ones (display_kind
        'hidden') always; compacted ones are found. An unknown sort means relevance; `limit` and
        `offset` go to SQLite as they are (a negative limit is no limit). `after_ts` (inclusive)
        and `before_ts` (exclusive), whole epoch seconds as hermes-agent 0.22 takes them, bound the
        start of a hit's session on every route, so the page is filled by hits in the window.
        `grammar` GRAMMAR_BOOLEAN reads every query as written, whatever the script of its terms
        (implicit AND, OR, NOT, phrases, prefixes): no scan's any-term reading, so a NOT never adds
        a hit. A string `fields` raises TypeError, an unknown field, grammar or a bound that is not
        a whole number ValueError."""
        fields = search_fields(fields)
        if grammar not in (GRAMMAR_HERMES, GRAMMAR_BOOLEAN):
            raise ValueError(f"grammar must be {GRAMMAR_HERMES!r} or {GRAMMAR_BOOLEAN!r},"
                             f" not {grammar!r}")
        if not query or not query.strip():
            return []
        tree = parse_query(query, grammar)
        if tree is None:
            return []
        sort = sort.strip().lower() if isinstance(sort, str) else None
        roles = _as_list(role_filter) or []
        window = (_epoch_bound("after_ts", after_ts), _epoch_bound("before_ts", before_ts))
        cookie = self._read_value("PRAGMA schema_version")  # sqlite_master: 0.06 of a 0.6 ms search
        if self.__dict__.get("_objects_at_cookie", (None,))[0] != cookie:  # read when it moves
            self._objects_at_cookie = (cookie, self._read_objects())
        objects = self._objects_at_cookie[1]
        # A read-only open of a store older than the column (0.19's) has no hidden rows.
        kinds = "display_kind" in (objects.get("messages", (None, None))[1] or "")
        filters, filter_binds = _search_filters(
            roles, _as_list(source_filter), _as_list(exclude_sources), include_inactive, window,
            kinds)
        state = self._index_state(objects)
        if "tool" in roles:
            # Tool rows are only whole in the fallback.
            state = state._replace(usable=set(), tool_rows=True)
        elif set(_as_list(source_filter) or ()) & set(FTS_TRIGRAM_EXCLUDED_SOURCES):
            # Sessions the trigram index leaves out, asked for: their CJK by the fallback (0.22).
            state = state._replace(usable=state.usable - {"trigram"})
        scans = grammar == GRAMMAR_HERMES and hermes_scans(tree, state)
        if scans:
            tree, sort = ("or", [("term", term) for term in _leaves(tree)]), "newest"
        search = (tree, filters, filter_binds, sort, limit, offset)
        try:
            rows = self._run_search(state, *search)
        except sqlite3.DatabaseError as exc:
            if not _index_failure(exc):
                raise
            # Another process's VACUUM (rollback journal) fails a fresh reader's FTS tables now and
            # then: this call is answered by the fallback, but that is no damage to rebuild.
            if "vtable constructor failed" not in str(exc):
                self._mark_index_stale(exc, state)
            state = state._replace(usable=set())
            rows = self._run_search(state, *search)
        if not rows and "word" in state.usable and _substring_retry(tree):
            rows = self._run_search(state._replace(substring=True), *search)
        relaxed = not rows and grammar == GRAMMAR_HERMES and not host_is_020() and _any_term(tree)
        if relaxed:  # (0.20 answered such a query with nothing: rule 14)
            rows = self._run_search(state, relaxed, *search[1:])
        terms = _positive_terms(tree)
        contexts = self._contexts(rows) if "context" in fields else [None] * len(rows)
        return [self._hit(row, terms, fields, scans, context)
                for row, context in zip(rows, contexts)]

    def _run_search(self, state, tree, filters, filter_binds, sort, limit, offset):
        routes = {term: _route(term, state) for term in _leaves(tree)}
        indexes = set(routes.values())
        binds = _Binds(filter_binds, limit=limit, offset=offset)
        single = (len(indexes) == 1 and None not in indexes and not indexes & set(state.gaps)
                  and not (indexes == {"cjk"} and state.cjk_pending))
        if not single:
            where = _tree_sql(tree, routes, state, binds)
            order = _ORDERS["oldest" if sort == "oldest" else "newest"].format(rank="")
            page = ("SELECT m.id AS hit, NULL AS hit_rank"
                    " FROM messages AS m JOIN sessions AS s ON s.id = m.session_id"
                    f" WHERE {where} {filters} ORDER BY {order} LIMIT :limit OFFSET :offset")
            # A scan would churn the index readers' caches.
            pool = self._idle_index_readers if indexes != {None} else None
            rows = _PAGE_ROWS_SQL.format(page=page, join="", snippet="NULL", order=order)
            return self._read_all(rows, binds, pool)
        index = indexes.pop()
        table = state.tables[index]
        # hermes-agent's legacy trigram index still holds tool rows; ours does not.
        no_tools = f" AND {_NOT_TOOL_ROW_SQL}" if index != "word" else ""
        snippet = "NULL" if index == "cjk" else FTS_SNIPPET_SQL.format(table=table)
        binds["match"] = _match_string(tree, index)
        if sort not in _ORDERS:
            ranked = SEARCH_RANKED_SQL.format(
                table=table, snippet=snippet, no_tools=no_tools, filters=filters)
            return self._read_all(ranked, binds, self._idle_index_readers)
        if index == "cjk":  # only ever asked by a scan, whose order has no rank
            return self._cjk_page(state, no_tools, filters, binds, sort)
        page = _PAGE_BY_RANKED_INDEX_SQL.format(
            table=table, no_tools=no_tools, filters=filters, materialized=CTE_MATERIALIZED,
            **_RANKED_PAGE_PARTS[sort])
        join = f" CROSS JOIN {table} ON {table}.rowid = page.hit AND {table} MATCH :match"
        rows = _PAGE_ROWS_SQL.format(page=page, join=join, snippet=snippet,
                                     order=_ORDERS[sort].format(rank="page.hit_rank, "))
        return self._read_all(rows, binds, self._idle_index_readers)

    def _cjk_page(self, state, no_tools, filters, binds, sort):
        """A page of CJK index hits by time: only the hits from the floor _cjk_floor finds go to
        the sorter."""
        order = _ORDERS[sort].format(rank="")
        table = state.tables["cjk"]
        # One page of hit ids by time: only (timestamp, id) of each hit goes through the sorter, the
        # hits from the floor up and in the late blocks the walk found (`{late}`).
        page = (f"SELECT m.id AS hit, NULL AS hit_rank FROM {table}"
                f" CROSS JOIN messages AS m ON m.id = {table}.rowid"
                " JOIN sessions AS s ON s.id = m.session_id"
                f" WHERE {table} MATCH :match{no_tools}"
                f" AND (hs_fts_cjk.rowid >= :floor{{late}}) {filters}"
                f" ORDER BY {order} LIMIT :limit OFFSET :offset")
        page = _PAGE_ROWS_SQL.format(page=page, join="", snippet="NULL", order=order)
        limit, offset = binds["limit"], binds["offset"]
        wanted = 0
        if type(limit) is int and type(offset) is int and min(limit, offset) >= 0:
            wanted = limit + offset
        if not state.cjk_bounded or sort != "newest" or not 0 < wanted <= CJK_WALK_MAX_HITS // 2:
            return self._read_all(page.format(late=""), dict(binds, floor=0),
                                  self._idle_index_readers)
        # Newest first (a CJK index search's only order): hits walked by id from the top.
        walk = ("SELECT m.id, m.timestamp"
                " FROM hs_fts_cjk CROSS JOIN messages AS m ON m.id = hs_fts_cjk.rowid"
                " JOIN sessions AS s ON s.id = m.session_id"
                f" WHERE hs_fts_cjk MATCH :match{no_tools} {filters}"
                " ORDER BY hs_fts_cjk.rowid DESC")

        def walk_then_page(conn):
            # One read transaction: the walk's statement is open while the page is read.
            with contextlib.closing(conn.execute(walk, binds)) as hits:
                floor, late = _cjk_floor(conn, hits, wanted)
                blocks = ", ".join(map(str, late))
                late = f" OR hs_fts_cjk.rowid >> {CJK_BLOCK_BITS} IN ({blocks})" if late else ""
                return conn.execute(page.format(late=late), dict(binds, floor=floor)).fetchall()
        return self._with_reader(walk_then_page, self._idle_index_readers)

    def _hit(self, row, terms, fields, scans, context):
        values = dict(row, context=context)
        if scans:
            values["snippet"] = scan_snippet(row["content"], terms[0])
        else:
            values["snippet"] = values.get("index_snippet") or self._fallback_snippet(row, terms)
        return {field: values[field] for field in fields}

    def _fallback_snippet(self, row, terms):
        """make_snippet of the first of the content, the tool name and the tool calls holding a
        term: the LIKE fallback matches all three, as an index does, and a hit found in its tool
        call (a file name in the arguments) shows the match, not an unmarked cut of its text."""
        def holds_a_term(text):
            return any(term.text.casefold() in text.casefold() for term in terms)
        if holds_a_term(row["content"] or ""):
            return make_snippet(row["content"], terms)
        calls = self._read_value("SELECT tool_calls FROM messages WHERE id = ?", (row["id"],))
        for text in (row["tool_name"], calls):
            if isinstance(text, str) and holds_a_term(text):
                return make_snippet(text, terms)
        return make_snippet(row["content"], terms)

    def _contexts(self, hits):
        """Each hit's [before, the hit, after] as {role, content}, in the order of `hits`."""
        contexts = [[] for _hit in hits]
        for start in range(0, len(hits), CONTEXT_CHUNK_HITS):
            chunk = hits[start:start + CONTEXT_CHUNK_HITS]
            params = [value for n, hit in enumerate(chunk, start)
                      for value in (n, hit["session_id"], hit["timestamp"], hit["id"])]
            # Each hit's four values fill one "(?, ?, ?, ?)" row of the VALUES list, in order.
            sql = SEARCH_CONTEXT_SQL.format(hits=", ".join(["(?, ?, ?, ?)"] * len(chunk)))
            for n, role, content in self._read_all(sql, params):
                contexts[n].append({"role": role, "content": context_text(content)})
        return contexts

    @staticmethod
    def _sanitize_fts5_query(query):
        """hermes-agent's name: the MATCH expression a search for `query` runs on one index (every
        term quoted, AND/OR/NOT as parse_query reads them); '' when nothing searchable is left."""
        tree = parse_query(query or "")
        return "" if tree is None else _match_string(tree, "word")


def _epoch_bound(name, value):
    """A search window's bound as the whole seconds hermes-agent 0.22 compares (int(), so 1.9 is
    1); None stays None."""
    if value is None:
        return None
    try:
        bound = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be a whole number of epoch seconds, not {value!r}") from None
    if not sqlite_keeps(bound):
        raise ValueError(f"{name} is outside SQLite's integer range")
    return bound


def _search_filters(roles, sources, excluded, include_inactive, window, kinds):
    """SQL and values of the filters (a _Binds of `:role_N`, `:source_N`, `:excluded_N`,
    `:after_N`, `:before_N`), as hermes-agent reads them: an empty source list matches nothing,
    an empty role or excluded list filters nothing; `window` (after, before) bounds the session's
    start, after inclusive, before exclusive; rows of display_kind 'hidden' (model-facing
    scaffolding the user never saw, which 0.22 leaves out) are left out where the store has the
    column (`kinds`)."""
    clauses, binds = [], _Binds()
    if not include_inactive:
        clauses.append("(m.active = 1 OR m.compacted = 1)")  # rewound rows hidden, compacted kept
    if kinds:
        clauses.append("COALESCE(m.display_kind, '') <> 'hidden'")
    for test, stem, values in (("m.role IN", "role", roles or None),
                               ("s.source IN", "source", sources),
                               ("s.source NOT IN", "excluded", excluded)):
        if values is not None:
            clauses.append(f"{test} ({', '.join(binds.add(stem, value) for value in values)})")
    for test, stem, bound in (("s.started_at >=", "after", window[0]),
                              ("s.started_at <", "before", window[1])):
        if bound is not None:
            clauses.append(f"{test} {binds.add(stem, bound)}")
    return "".join(f" AND {clause}" for clause in clauses), binds
