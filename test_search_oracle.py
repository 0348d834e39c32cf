"""A seeded random workload against search_messages, checked against a Python oracle.

Owns: the oracle (what search_messages should return, computed from the messages table with the documented
tokenisation and routing), the workload driving the store through its public API (appends, batches,
rewind/restore, replace, compaction, delete, prune, import, the marker purge (the API's one content
update), optimize_fts, reopen, a second process appending at
the same time), the drift checks of our three indexes (FTS5 'integrity-check', the CJK side index, its queue and
its time bounds against the rows), and one test for each finding of the oracle.
It must not touch product code; it reads the store through plain sqlite3 connections only to build the oracle.
"""
import json
import os
import random
import re
import sqlite3
import subprocess
import sys
import time
import unicodedata
import unittest
from collections import namedtuple

from hermes_state import SessionDB
from hermes_state_common import (
    CJK_BLOCK_BITS, CJK_CHAR_CLASS, FTS_TRIGRAM_EXCLUDED_SOURCES, QUERY_MAX_CHARS, QUERY_MAX_TERMS,
    TOOL_INDEX_PREFIX_CHARS)
from hermes_state_search import (
    GRAMMAR_BOOLEAN, GRAMMAR_HERMES, _any_term, _leaves, _substring_retry, cjk_terms,
    parse_query)
from test_support import (
    REPO, SEARCHABLE, V26_DB, TempDirTestCase, backdate, without_fts5, without_trigram)

CJK_RE = re.compile(f"[{CJK_CHAR_CLASS}]")  # the oracle's own, beside the product's

# Which of our indexes each way of opening the store can use (docs/search.md, "Degraded runtimes").
# "full" is all this SQLite can keep (make test-runtimes runs the suite on builds without trigram or FTS5).
MODES = {"full": (None, set(SEARCHABLE)),
         "without_trigram": (without_trigram, {"word", "cjk"} & set(SEARCHABLE)),
         "without_fts5": (without_fts5, set())}
INDEX_TABLES = ("messages_fts", "messages_fts_trigram", "hs_fts_cjk")

WORDS = ["alpha", "Beta", "gamma", "delta", "schema", "schemas", "parser", "config", "my-app.config.ts", "foo",
         "foobar", "barfoo", "deploy", "Deployment", "server", "serverless", "x1", "omega", "tea"]
CJK = "迁移数据库服务端修改京都大阪東北南西中文字符测试"
KANA = "あいうえおかきくけこアイウエオカキクケコー"  # no ・゠゛゜: their own test below
HANGUL = "가나다라마바사아자차"
EMOJI = ["😀", "🚀", "🔥", "✅"]
PUNCT = [".", ",", "!", "?", "-", "_", "%", "(", ")", "\"", "'", ":", "/", "、", "。"]


# -- the oracle -------------------------------------------------------------------------------------------

def _token_char(ch):
    """unicode61's default token characters: letters, numbers, private use (emoji and punctuation separate)."""
    category = unicodedata.category(ch)
    return category[0] in "LN" or category == "Co"


def tokens(text):
    out, current = [], []
    for ch in text or "":
        if _token_char(ch):
            current.append(ch.lower())
        elif current:
            out.append("".join(current))
            current = []
    if current:
        out.append("".join(current))
    return out


def _phrase_in(doc, phrase, prefix):
    if not phrase:
        return False
    for start in range(len(doc) - len(phrase) + 1):
        window = doc[start:start + len(phrase)]
        if window[:-1] == phrase[:-1] and (window[-1].startswith(phrase[-1]) if prefix else window[-1] == phrase[-1]):
            return True
    return False


def _like(value, text):
    """SQLite LIKE '%text%' without wildcards: ASCII case folded only."""
    def fold(s):
        return "".join(c.lower() if c < "\x80" else c for c in s)
    return fold(text) in fold(value or "")


def _route(text, usable, substring):
    """Which index answers a term (docs/search.md, "Routing, term by term"); None is the LIKE fallback."""
    trigram = "trigram" if len(text) >= 3 and "trigram" in usable else None
    if substring:
        return trigram
    if CJK_RE.search(text):
        return trigram or ("cjk" if len(text) <= 2 and all(CJK_RE.match(c) for c in text) and "cjk" in usable
                           else None)
    return "word" if "word" in usable else trigram


def term_matches(row, term, usable, substring, tool_rows):
    index = _route(term.text, usable, substring)
    columns = getattr(term, "columns", None)  # (hermes-agent's reading has no column filter)
    if columns not in (None, ("content",)) and index in ("trigram", "cjk"):
        index = None  # those indexes are read for content alone
    columns = columns or COLUMNS
    content, is_tool = row["content"], row["role"] == "tool"
    if index == "word":
        words = content[:TOOL_INDEX_PREFIX_CHARS] if is_tool and content else content
        phrase = tokens(term.text)
        return any(_phrase_in(tokens(value), phrase, term.prefix)
                   for column, value in zip(COLUMNS, (words, row["tool_name"], row["tool_calls"]))
                   if column in columns)
    if index == "trigram":  # hermes-agent 0.22's index: no tool rows, no cron or subagent session's
        return not is_tool and content is not None and term.text.lower() in content.lower() \
            and row["source"] not in FTS_TRIGRAM_EXCLUDED_SOURCES
    if index == "cjk":
        return not is_tool and content is not None and term.text in content
    if (substring or CJK_RE.search(term.text)) and not tool_rows and is_tool:
        return False
    return any(_like(row[column], term.text) for column in columns)


def tree_matches(row, node, *args):
    kind = node[0]
    if kind == "term":
        return term_matches(row, node[1], *args)
    if kind == "not":
        return tree_matches(row, node[1], *args) and not tree_matches(row, node[2], *args)
    results = [tree_matches(row, child, *args) for child in node[1]]
    return all(results) if kind == "and" else any(results)


# The oracle's own reading of a boolean query (docs/search.md, "Query language"), apart from the product's parser:
# the query becomes a Python expression over t(n), its n-th term, and Python's precedence (not, and, or) is the
# documented one: `a NOT b` is `a and not b`, words side by side are ANDed, `-word` is `NOT word`, `AND NOT` is
# NOT. A column filter (`content:x`, `{tool_name tool_calls}:(a OR b)`) limits its term, or every term of its
# group, to those columns, nested ones to the columns they share. What Python cannot compile (a leading NOT, a
# dangling operator, an unbalanced parenthesis) the product must refuse, as an empty group, a filter naming
# another column or one with no term after it.
COLUMNS = ("content", "tool_name", "tool_calls")
OracleTerm = namedtuple("OracleTerm", "text prefix columns")
ORACLE_PIECE_RE = re.compile(r'(-*)(?:(\{[^}]*\}|content|tool_name|tool_calls)\s*:\s*)?("[^"]*"|\(|\)|[^\s()"]+)',
                             re.IGNORECASE)
OPERATORS = {"AND": "and", "OR": "or", "NOT": "and not"}


def _narrowed(columns, named):
    """`columns` (None: all) narrowed by a filter's text, e.g. '{content tool_name}'; ValueError for a bad one."""
    names = named.strip("{}").lower().split()
    if not names or set(names) - set(COLUMNS):
        raise ValueError(f"column filter {named!r}")
    kept = tuple(column for column in columns or COLUMNS if column in names)
    if not kept:
        raise ValueError(f"column filters share no column: {named!r}")
    return kept


def boolean_reading(query):
    """(terms, compiled expression over t(n)); (None, None) for a query holding no term; ValueError for a query
    the product must refuse."""
    terms, python, groups = [], [], [None]  # groups: the columns of each open parenthesis
    for dashes, named, piece in ORACLE_PIECE_RE.findall(query):
        if re.fullmatch(r"(\{[^}]*\}|content|tool_name|tool_calls)\s*:", piece, re.IGNORECASE) or \
                named and piece in ('""', ")"):
            raise ValueError(f"a column filter with no term after it in {query!r}")
        columns = _narrowed(groups[-1], named) if named else groups[-1]
        if piece in OPERATORS and not dashes and not named:
            if piece == "NOT" and python[-1:] == ["and"]:
                python.pop()
            python.append(OPERATORS[piece])
            continue
        if dashes:
            python.append("and not")
        elif python and (python[-1] == ")" or python[-1].startswith("t(")) and piece != ")":
            python.append("and")  # side by side
        if piece in "()":
            if piece == "(":
                groups.append(columns)
            elif len(groups) > 1:
                groups.pop()
            python.append(piece)
            continue
        prefix = piece.endswith("*") and not piece.startswith('"')
        terms.append(OracleTerm(" ".join(piece.strip('"*').split()), prefix, columns))
        python.append(f"t({len(terms) - 1})")
    if len(query) > QUERY_MAX_CHARS or len(terms) > QUERY_MAX_TERMS:
        raise ValueError(f"{query[:20]!r}... is past the limits")
    if not terms:
        return None, None
    expression = " ".join(python)
    if re.search(r"\(\s*\)", expression):
        raise ValueError(f"an empty group in {query!r}")
    try:
        return terms, compile(expression, "<query>", "eval")
    except SyntaxError:
        raise ValueError(f"{query!r} is not a boolean query") from None


def oracle(rows, query, usable, role_filter=None, include_inactive=False, sources=None, excluded=None,
           window=(None, None), grammar=GRAMMAR_HERMES):
    """(ids search_messages should return, whether the answer is a newest-first scan, whether it retried).
    `window`: whole seconds (after, before) the session's start must fall in, after inclusive. A boolean query
    the product must refuse raises ValueError."""
    roles = [role_filter] if isinstance(role_filter, str) else list(role_filter or [])
    tool_rows = "tool" in roles
    if tool_rows:
        usable = set()
    if grammar == GRAMMAR_BOOLEAN:
        terms, expression = boolean_reading(query)
        if terms is None:
            return set(), False, False
        scans = False
        retries = all(len(t.text) >= 3 and not CJK_RE.search(t.text) for t in terms)

        def matches(row, substring):
            return eval(expression, {"t": lambda n: term_matches(row, terms[n], usable, substring, tool_rows)})
    else:
        tree = parse_query(query)
        if tree is None:
            return set(), False, False
        cjk = [t for t in _leaves(tree) if CJK_RE.search(t.text)]
        scans = bool(cjk) and (
            any(len(CJK_RE.findall(t.text)) < 3 for t in cjk) or "trigram" not in usable or tool_rows)
        if scans:
            tree = ("or", [("term", t) for t in _leaves(tree)])
        retries = _substring_retry(tree)

        def matches(row, substring):
            return tree_matches(row, tree, usable, substring, tool_rows)
    visible = [r for r in rows if (include_inactive or r["active"] == 1 or r["compacted"] == 1)
               and (not roles or r["role"] in roles) and (sources is None or r["source"] in sources)
               and (not excluded or r["source"] not in excluded)
               and (window[0] is None or r["started_at"] >= window[0])
               and (window[1] is None or r["started_at"] < window[1]) and r["display_kind"] != "hidden"]
    hits = {r["id"] for r in visible if matches(r, False)}
    retried = False
    if not hits and "word" in usable and retries:
        retried = True
        hits = {r["id"] for r in visible if matches(r, True)}
    relaxed = _any_term(tree) if grammar == GRAMMAR_HERMES and not hits else None
    if relaxed:  # 0.22's retry of an all-words query that found nothing: any of its words
        hits = {r["id"] for r in visible if tree_matches(r, relaxed, usable, False, tool_rows)}
    return hits, scans, retried


# -- drift of our indexes from the messages table ------------------------------------------------------

def index_drift(path):
    """Problems found in our indexes (empty when they agree with the messages table)."""
    problems = []
    conn = sqlite3.connect(str(path), isolation_level=None)  # (a check left in a transaction blocks the backup)
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        stale = {key for (key,) in conn.execute("SELECT key FROM state_meta WHERE key LIKE 'hs_search_stale_%'")}
        backfilling = conn.execute("SELECT 1 FROM state_meta WHERE key IN ('hs_search_high_water',"
                                   " 'fts_rebuild_high_water')").fetchone()
        for index, table in zip(("word", "trigram", "cjk"), INDEX_TABLES):
            # An index marked stale (a runtime that cannot keep it wrote meanwhile) serves no search until rebuilt.
            if table in tables and "hs_search_stale_" + index not in stale:
                try:
                    conn.execute(f"INSERT INTO {table}({table}, rank) VALUES ('integrity-check', 1)")
                except sqlite3.Error as exc:
                    problems.append(f"{table}: integrity-check failed: {exc}")
                if index != "cjk" and not backfilling:
                    problems += totals_drift(conn, table)
        if "hs_fts_cjk" not in tables or "hs_search_stale_cjk" in stale:
            return problems
        rows = {i: (role, content, ts) for i, role, content, ts in
                conn.execute("SELECT id, role, content, timestamp FROM messages")}
        queued = {i for (i,) in conn.execute("SELECT id FROM hs_fts_cjk_queue")}
        indexed = dict(conn.execute("SELECT rowid, terms FROM hs_fts_cjk"))
        bounds = dict(conn.execute("SELECT block, newest FROM hs_fts_cjk_bounds"))
        for i, (role, content, ts) in rows.items():
            wanted = role != "tool" and content is not None and CJK_RE.search(content) is not None
            if wanted and i not in queued and indexed.get(i) != cjk_terms(content):
                problems.append(f"cjk: message {i} indexed as {indexed.get(i)!r}, not {cjk_terms(content)!r}")
            if not wanted and (i in indexed or i in queued):
                problems.append(f"cjk: message {i} ({role}) is in the CJK index or queue without CJK content")
            if wanted and ts is not None and not (bounds.get(i >> CJK_BLOCK_BITS) is not None
                                                  and bounds[i >> CJK_BLOCK_BITS] >= ts):
                problems.append(f"cjk: block of message {i} has bound {bounds.get(i >> CJK_BLOCK_BITS)} < {ts}")
        problems += [f"cjk: index holds deleted message {i}" for i in set(indexed) - set(rows)]
        problems += [f"cjk: queue holds deleted message {i}" for i in queued - set(rows)]
    finally:
        conn.close()
    return problems


def totals_drift(conn, table):
    """The index's row count and token totals (bm25's; FTS5's integrity-check does not read them) against what
    a rebuild of a copy of the store makes: a delete that gave other text than its insert shows here."""
    averages = f"SELECT block FROM {table}_data WHERE id = 1"
    copy = sqlite3.connect(":memory:")
    try:
        conn.backup(copy)
        copy.execute(f"INSERT INTO {table}({table}) VALUES ('rebuild')")
        if conn.execute(averages).fetchone() != copy.execute(averages).fetchone():
            return [f"{table}: its row count and token totals are not a rebuild's"]
        return []
    finally:
        copy.close()


def stored_rows(path):
    conn = sqlite3.connect(str(path))
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(
            "SELECT m.id, m.role, m.content, m.tool_name, m.tool_calls, m.active, m.compacted, m.timestamp, s.source,"
            " s.started_at, m.display_kind FROM messages AS m JOIN sessions AS s ON s.id = m.session_id")]
    finally:
        conn.close()


# -- the workload --------------------------------------------------------------------------------------

class Workload:
    """Seeded random operations through SessionDB's public API."""

    def __init__(self, seed, path, mode, multimodal=False):
        self.rnd = random.Random(seed)
        self.path, self.mode, self.factory, self.multimodal = path, mode, MODES[mode][0], multimodal
        self.db = self.open()
        self.sessions, self.counter = [], 0

    def open(self):
        return SessionDB(self.path, connection_factory=self.factory) if self.factory else SessionDB(self.path)

    def reopen(self):
        self.db.close()
        self.db = self.open()

    def piece(self):
        rnd = self.rnd
        kind = rnd.random()
        if kind < 0.45:
            return rnd.choice(WORDS)
        if kind < 0.7:
            start = rnd.randrange(len(CJK))
            return CJK[start:start + rnd.randint(1, 6)]
        if kind < 0.8:
            return "".join(rnd.choice(KANA) for _ in range(rnd.randint(1, 4)))
        if kind < 0.87:
            return "".join(rnd.choice(HANGUL) for _ in range(rnd.randint(1, 3)))
        if kind < 0.93:
            return rnd.choice(EMOJI)
        return rnd.choice(PUNCT)

    def text(self, pieces=None):
        rnd = self.rnd
        out = []
        for _ in range(pieces or rnd.randint(1, 8)):
            out.append(self.piece())
            out.append(rnd.choice([" ", " ", "", ", ", "\n"]))
        return "".join(out).strip() or "empty"

    def message(self):
        rnd = self.rnd
        role = rnd.choice(["user", "user", "assistant", "assistant", "tool", "system"])
        msg = {"role": role, "content": self.text()}
        if role == "tool":
            msg["tool_name"] = rnd.choice(["read_file", "terminal", "web_search"])
            if rnd.random() < 0.4:  # a long output: the word index keeps its first TOOL_INDEX_PREFIX_CHARS
                filler = "x" * rnd.randint(TOOL_INDEX_PREFIX_CHARS - 30, TOOL_INDEX_PREFIX_CHARS + 10)
                msg["content"] = self.text(2) + " " + filler + " " + self.text(3)
        if role == "assistant" and rnd.random() < 0.3:
            msg["tool_calls"] = [{"id": f"c{self.counter}", "type": "function",
                                  "function": {"name": rnd.choice(WORDS), "arguments": "{}"}}]
        if self.multimodal and role == "user" and rnd.random() < 0.3:
            msg["content"] = [{"type": "text", "text": self.text()},
                              {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
        if role == "assistant" and rnd.random() < 0.05:  # scaffolding no search shows (hermes-agent 0.22)
            msg["display_kind"] = "hidden"
        if rnd.random() < 0.15:  # an old time: imported-like rows, the CJK bounds' reason to exist
            msg["timestamp"] = time.time() - rnd.randint(10, 10 ** 7)
        self.counter += 1
        return msg

    def new_session(self):
        sid = f"s{len(self.sessions)}-{self.rnd.randrange(10 ** 6)}"
        self.db.create_session(sid, self.rnd.choice(["cli", "telegram"]))
        self.sessions.append(sid)
        return sid

    def step(self):
        rnd, db = self.rnd, self.db
        if not self.sessions or rnd.random() < 0.1:
            self.new_session()
        sid = rnd.choice(self.sessions)
        op = rnd.random()
        if op < 0.35:
            m = self.message()
            db.append_message(sid, m["role"], m["content"], tool_name=m.get("tool_name"),
                              tool_calls=m.get("tool_calls"), timestamp=m.get("timestamp"),
                              display_kind=m.get("display_kind"))
        elif op < 0.55:
            db.append_messages_batch(sid, [self.message() for _ in range(rnd.randint(1, 70))])
        elif op < 0.62:
            users = [m for m in db.get_messages(sid) if m["role"] == "user"]
            if users:
                db.rewind_to_message(sid, rnd.choice(users)["id"])
        elif op < 0.66:
            db.restore_rewound(sid, 0)
        elif op < 0.71:
            db.replace_messages(sid, [self.message() for _ in range(rnd.randint(0, 5))],
                                active_only=rnd.random() < 0.5, archive_dropped=rnd.random() < 0.5)
        elif op < 0.76:
            db.archive_and_compact(sid, [self.message() for _ in range(rnd.randint(1, 3))])
        elif op < 0.79:
            db.delete_session(sid)
            self.sessions.remove(sid)
        elif op < 0.82:
            old = self.new_session()
            db.append_messages_batch(old, [dict(self.message(), timestamp=time.time() - 200 * 86400)
                                           for _ in range(3)])
            db.end_session(old, "user_exit")
            backdate(db, old, time.time() - 200 * 86400)
            db.prune_sessions(older_than_days=90)
            self.sessions = [s for s in self.sessions if db.get_session(s) is not None]
        elif op < 0.87:
            exported = db.export_session(sid)
            if exported is not None:
                exported["id"] = f"imp{self.counter}-{rnd.randrange(10 ** 6)}"
                exported.pop("parent_session_id", None)
                result = db.import_sessions([exported])
                assert result["ok"], result
                self.sessions.append(exported["id"])
        elif op < 0.9:
            db.optimize_fts()
        elif op < 0.93:
            self.reopen()
        elif op < 0.96:  # the API's one content update: stale "[name]" markers emptied
            calls = [{"id": "m", "type": "function", "function": {"name": "deploy", "arguments": "{}"}}]
            db.append_message(sid, "assistant", f"[{rnd.choice(['deploy', 'schema', 'tea'])}]", tool_calls=calls)
            db.purge_stale_tool_call_markers(backup=False)
        else:
            m = self.message()
            db.append_message(sid, m["role"], m["content"], tool_name=m.get("tool_name"))

    def concurrent_writer(self, count):
        """A second process appending `count` CJK/English rows through its own SessionDB."""
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from hermes_state import SessionDB\n"
                "import test_support\n"
                "factory = getattr(test_support, sys.argv[4], None)\n"
                "db = SessionDB(sys.argv[2], connection_factory=factory) if factory else SessionDB(sys.argv[2])\n"
                "db.create_session('other', 'cli')\n"
                "for i in range(int(sys.argv[3])):\n"
                "    db.append_message('other', 'user', f'parallel 迁移{i} 服务 deploy{i % 3}')\n"
                "db.close()\n")
        # The same runtime as ours (a full one beside a degraded one: its own test below).
        return subprocess.Popen([sys.executable, "-c", code, str(REPO), str(self.path), str(count), self.mode])

    def queries(self, rows, count):
        """Sampled queries: words, pairs, phrases, prefixes, CJK of 1-4 letters, mixed, operators, groups."""
        rnd = self.rnd
        texts = [r["content"] for r in rows if r["content"] and not r["content"].startswith("\x00")] or ["alpha"]
        out = []
        for _ in range(count):
            kind = rnd.randrange(10)
            source = rnd.choice(texts)
            cjk_runs = [run for run in CJK_RE.findall(source)] or [rnd.choice(CJK)]
            run = "".join(CJK_RE.findall(source)) or CJK
            if kind == 0:
                out.append(rnd.choice(WORDS))
            elif kind == 1:
                out.append(f"{rnd.choice(WORDS)} {rnd.choice(WORDS)}")
            elif kind == 2:
                parts = tokens(source)
                at = rnd.randrange(len(parts)) if parts else 0
                out.append('"' + " ".join(parts[at:at + 2]) + '"' if parts else '"alpha beta"')
            elif kind == 3:
                out.append(rnd.choice(WORDS)[:rnd.randint(2, 4)] + "*")
            elif kind in (4, 5):
                length = rnd.randint(1, 4)
                at = rnd.randrange(len(run))
                out.append(run[at:at + length])
            elif kind == 6:
                out.append(f"{rnd.choice(cjk_runs)[:rnd.randint(1, 4)]} {rnd.choice(WORDS)}")
            elif kind == 7:
                out.append(f"{rnd.choice(WORDS)} {rnd.choice(['OR', 'NOT', 'AND'])} {rnd.choice(WORDS)}")
            elif kind == 8:
                out.append(rnd.choice(["oob", "erv", "chem", "ploy", "onfi"]))  # substring retry
            else:  # groups and `-` (hermes-agent's reading drops both)
                a, b, c = (rnd.choice([rnd.choice(WORDS), rnd.choice(cjk_runs)[:rnd.randint(1, 4)]])
                           for _ in range(3))
                out.append(rnd.choice([f"({a} OR {b}) {c}", f"{a} -{b}", f"{a} NOT ({b} OR {c})"]))
        return out


class SearchOracle:
    """Runs a workload and compares every sampled query with the oracle; collects mismatches."""

    def __init__(self, case, seed, mode, steps, rounds, queries, multimodal=False, concurrent=True):
        self.case, self.seed, self.mode = case, seed, mode
        self.steps, self.rounds, self.queries = steps, rounds, queries
        self.multimodal, self.concurrent = multimodal, concurrent

    def run(self):
        usable = MODES[self.mode][1]
        path = self.case.tmp / f"{self.mode}-{self.seed}.db"
        work = Workload(self.seed, path, self.mode, self.multimodal)
        mismatches = []
        try:
            for round_no in range(self.rounds):
                other = work.concurrent_writer(40) if self.concurrent and round_no == 1 else None
                for _ in range(self.steps):
                    work.step()
                if other is not None:
                    self.case.assertEqual(other.wait(timeout=60), 0)
                drift = index_drift(path) if self.mode != "without_fts5" else []
                mismatches += [f"round {round_no}: {p}" for p in drift]
                rows = stored_rows(path)
                for query in work.queries(rows, self.queries):
                    mismatches += self.check(work, rows, query, usable, round_no)
        finally:
            work.db.close()
        return mismatches

    def check(self, work, rows, query, usable, round_no):
        rnd, db = work.rnd, work.db
        roles = rnd.choice([None, None, None, ["user"], ["user", "assistant"], ["tool"], ["assistant", "tool"]])
        inactive = rnd.random() < 0.2
        sort = rnd.choice([None, "newest", "oldest"])
        sources, excluded = rnd.choice([(None, None)] * 4 + [(["cli"], None), (None, ["cli"]), (["cli", "telegram"], [])])
        # A window on the sessions' start, bounds at and around a start the store holds.
        start = int(rnd.choice(rows)["started_at"]) if rows else 0
        window = rnd.choice([(None, None)] * 4 + [(start, None), (None, start), (start, start + 1),
                                                  (start + 1, None)])
        grammar = rnd.choice([GRAMMAR_HERMES, GRAMMAR_HERMES, GRAMMAR_BOOLEAN])
        try:
            expected, scans, retried = oracle(rows, query, usable, roles, inactive, sources, excluded, window,
                                              grammar)
        except ValueError:  # one the boolean reading refuses (a phrase cut from a long row: past the limit)
            with self.case.assertRaises(ValueError, msg=query):
                db.search_messages(query, grammar=grammar)
            return []
        limit = rnd.choice([3, 7, 20])
        got, times, offset = [], [], 0
        while True:
            page = db.search_messages(query, source_filter=sources, exclude_sources=excluded, role_filter=roles,
                                      include_inactive=inactive, sort=sort, after_ts=window[0],
                                      before_ts=window[1], limit=limit, offset=offset, fields=("id", "timestamp"),
                                      grammar=grammar)
            got += [h["id"] for h in page]
            times.append([h["timestamp"] for h in page])
            offset += limit
            # A page past the last whole-word hit is retried as substrings (as hermes-agent does; test below),
            # and by hermes-agent's reading with any of its words: stop at a short page, and skip the empty
            # page after an exact multiple when a retry could apply.
            tree = parse_query(query, grammar) or ("and", [])
            if len(page) < limit or (len(got) == len(expected) and (
                    _substring_retry(tree) or (grammar == GRAMMAR_HERMES and _any_term(tree)))):
                break
            if offset > 10 * (len(rows) + limit):
                break
        label = f"seed {self.seed} {self.mode} round {round_no}: {query!r} roles={roles} inactive={inactive} " \
                f"sources={sources} excluded={excluded} window={window} sort={sort} limit={limit} {grammar}"
        problems = []
        if len(got) != len(set(got)):
            problems.append(f"{label}: a page repeats ids {sorted(i for i in set(got) if got.count(i) > 1)}")
        if set(got) != expected:
            problems.append(f"{label}: missing {sorted(expected - set(got))} extra {sorted(set(got) - expected)}"
                            f"{' (substring retry)' if retried else ''}")
        whole = [h["id"] for h in db.search_messages(query, source_filter=sources, exclude_sources=excluded,
                                                      role_filter=roles, include_inactive=inactive, sort=sort,
                                                      after_ts=window[0], before_ts=window[1], limit=-1,
                                                      fields=("id",), grammar=grammar)]
        if set(whole) != set(got) and set(got) == expected:
            problems.append(f"{label}: limit=-1 gives {sorted(set(whole) ^ set(got))} unlike the pages")
        if scans and len(whole) == len(got) and whole != got:
            problems.append(f"{label}: limit=-1 and the pages order a scan differently")
        flat = [t for page in times for t in page]
        if scans:  # a scan has no rank: equal times by ascending id (docs/search.md, "How a query runs")
            by_time = {}
            for message_id, t in zip(got, flat):
                by_time.setdefault(t, []).append(message_id)
            if any(ids != sorted(ids) for ids in by_time.values()):
                problems.append(f"{label}: equal times of a scan not by ascending id")
        order = "newest" if scans else sort
        if order in ("newest", "oldest"):
            keyed = [(t is None, t) for t in flat]
            wanted = sorted(keyed, key=lambda k: (not k[0], k[1] or 0), reverse=order == "newest") \
                if order == "newest" else sorted(keyed, key=lambda k: (not k[0], k[1] or 0))
            if keyed != wanted:
                problems.append(f"{label}: not in {order} order")
        return problems


class SearchAgreesWithTheOracle(TempDirTestCase):
    """search_messages returns exactly the messages the documented semantics select, on every index path."""

    def assert_no_mismatch(self, mode, seed):
        mismatches = SearchOracle(self, seed, mode, steps=25, rounds=3, queries=50).run()
        self.assertEqual(mismatches[:20], [], f"{len(mismatches)} mismatches")

    def test_the_indexes_answer_as_the_oracle_and_stay_whole(self):
        self.assert_no_mismatch("full", 11)

    def test_without_the_trigram_tokenizer_the_word_and_cjk_indexes_and_like_answer_as_the_oracle(self):
        self.assert_no_mismatch("without_trigram", 12)

    def test_without_fts5_the_like_fallback_answers_as_the_oracle(self):
        self.assert_no_mismatch("without_fts5", 13)


# The grammar table (issue 40): English, CJK of 1, 2 and 4 letters and mixed queries, with every operator,
# parentheses, `-`, column filters, and the queries the boolean reading refuses (REFUSED: a leading NOT or `-`,
# a dangling operator, an unbalanced or empty group, a filter naming another column, sharing none with the one
# around it, or with no term after it).
GRAMMAR_LINES = [("cli", "user", "the parser reads the schema"), ("cli", "assistant", "迁移 done, schema kept"),
                 ("cli", "user", "迁移 alone here"), ("telegram", "user", "数据库服务端 restarted, parser ok"),
                 ("telegram", "assistant", "京都 and 大阪 trip"), ("cli", "user", "京 only 京"),
                 ("cron", "user", "nightly 数据库服务端 parser report"), ("cli", "tool", "parser 迁移 tool output"),
                 ("cli", "user", "schemas and parsers, not the word itself"), ("telegram", "user", "修改youer服务端"),
                 ("cli", "user", "会话历史 kept with the schema"), ("telegram", "assistant", "会话历史 and 数据库迁移"),
                 ("cli", "assistant", "会话 only, no history"), ("cron", "user", "数据库迁移 parser nightly"),
                 ("cli", "assistant", "calling the tool")]
# The last line's tool call, searched in the tool_calls column.
GRAMMAR_TOOL_CALLS = [{"id": "call_1", "type": "function",
                       "function": {"name": "terminal", "arguments": '{"cmd": "grep parser 京都"}'}}]
GRAMMAR_QUERIES = ["parser", "parser schema", "parser AND schema", "parser OR 大阪", "parser NOT schema",
                   '"the parser"', "pars*", "迁", "迁移", "数据库服务", "迁移 schema", "迁移 NOT schema",
                   "schema NOT 迁移", "迁移 OR 京都", "京 NOT 京都", "数据库服务 parser", "数据库服务 NOT parser",
                   "京都 大阪", '"京都 and"', "parser NOT 迁移 NOT 数据库服务", "youer", "服务端 OR schema",
                   "会话历史", "会话历史 schema", "会话历史 OR 京都", "数据库迁移 NOT 会话历史", "会话 NOT 会话历史",
                   "数据库迁移 parser", "(迁移 OR 会话) schema", "迁移 OR 会话 schema", "迁移 -schema",
                   "迁移 AND NOT schema", "(京 OR parser) NOT (schema OR 大阪)", "parser (schema OR 会话历史)",
                   '"the parser" -schema', "(会话 -会话历史) OR (京 -京都)", "((数据库迁移))",
                   "content:parser", "tool_name:terminal", "tool_calls:parser", "tool_name:terminal parser",
                   "parser -tool_name:terminal", "parser -tool_calls:grep", "content:迁移", "tool_calls:京都",
                   "{content tool_calls}:京都", "{content tool_name}:迁移", "{tool_name tool_calls}:(terminal OR 京)",
                   "content:(迁移 OR 京都) -schema", 'content:"the parser"', "content:pars*", "CONTENT:数据库服务",
                   "{tool_name tool_calls}:({content tool_calls}:grep)", "parser -content:schema"]
REFUSED = ["NOT 迁移", "NOT schema", "-schema 迁移", "迁移 NOT", "会话 OR", "AND 京都", "迁移 OR NOT schema",
           "(迁移 OR 会话", "迁移)", "会话历史 ()", "{content role}:schema", "{}:迁移", "schema content:",
           "迁移 -{tool_name}:", "{content}:(tool_name:迁移)", "-content:schema"]


def found(db, query, grammar=GRAMMAR_BOOLEAN):
    return {hit["id"] for hit in db.search_messages(query, limit=-1, fields=("id",), grammar=grammar)}


class SearchGrammarIsOneLanguage(TempDirTestCase):
    """With grammar='boolean', every query means what it says whatever the script of its terms, checked
    against the oracle's own reading and scan of the same rows; a NOT never adds a hit. The default keeps
    hermes-agent's reading."""

    def store(self, mode, queued=True):
        """The table's rows written in `mode`; with `queued`, the CJK rows wait in the CJK index's queue (15
        single appends), else the store is reopened, which indexes them."""
        path = self.tmp / f"{mode}-{queued}.db"
        factory = MODES[mode][0]

        def open_store():
            db = SessionDB(path, connection_factory=factory) if factory else SessionDB(path)
            self.addCleanup(db.close)
            return db
        db = open_store()
        for source in ("cli", "telegram", "cron"):
            db.create_session(source, source)
        for number, (source, role, text) in enumerate(GRAMMAR_LINES):
            db.append_message(source, role, text, tool_name="terminal" if role == "tool" else None,
                              tool_calls=GRAMMAR_TOOL_CALLS if number == len(GRAMMAR_LINES) - 1 else None,
                              timestamp=1000 + number)
        if not queued:
            db.close()
            db = open_store()
        return db, stored_rows(path)

    def stores(self):
        """(mode, queued, db, rows) of every runtime mode, with the CJK queue full and drained."""
        for mode in MODES:
            for queued in (True, False):
                yield (mode, queued) + self.store(mode, queued)

    def test_every_query_of_the_table_is_answered_as_a_scan_of_the_rows_reads_it(self):
        for mode, queued, db, rows in self.stores():
            if "cjk" in MODES[mode][1]:  # the two states the table is read in
                waiting = self.raw(db.db_path).execute("SELECT COUNT(*) FROM hs_fts_cjk_queue").fetchone()[0]
                self.assertEqual(bool(waiting), queued)
            for query in GRAMMAR_QUERIES:
                for grammar in (GRAMMAR_BOOLEAN, GRAMMAR_HERMES):
                    with self.subTest(mode=mode, queued=queued, query=query, grammar=grammar):
                        wanted, _scans, _retried = oracle(rows, query, MODES[mode][1], grammar=grammar)
                        self.assertEqual(found(db, query, grammar), wanted)

    def test_the_table_holds_cjk_terms_of_1_2_and_4_letters_and_its_groups_change_answers(self):
        lengths = {len(t.text) for q in GRAMMAR_QUERIES for t in boolean_reading(q)[0] if CJK_RE.search(t.text)}
        self.assertLessEqual({1, 2, 4}, lengths)
        db, rows = self.store("full")
        # The group typed holds; without it OR binds loosest: 迁移 OR (会话 AND schema). (The tool row's 迁移, 8, is
        # left out as the trigram and CJK indexes leave tool rows out.)
        self.assertEqual((found(db, "(迁移 OR 会话) schema"), found(db, "迁移 OR 会话 schema")),
                         ({2, 11}, {2, 3, 11, 12, 14}))

    def test_a_column_filter_keeps_its_terms_to_its_columns_on_every_runtime(self):
        for mode, queued, db, _rows in self.stores():
            with self.subTest(mode=mode, queued=queued):
                # parser: in row 8's tool output, row 15's tool call and content elsewhere.
                self.assertEqual(found(db, "tool_calls:parser"), {15})
                self.assertEqual(found(db, "parser") - found(db, "content:parser"), {15})
                self.assertEqual(found(db, "tool_name:terminal"), {8})
                # A CJK term filtered to other columns than content is looked for in them by LIKE (its indexes
                # hold content); tool calls are stored as JSON, whose CJK is \\u-escaped.
                self.assertEqual(found(db, "{content tool_calls}:京都"), {5})
                self.assertEqual((found(db, "tool_name:迁移"), found(db, "tool_calls:京都")), (set(), set()))
                self.assertEqual(found(db, "{tool_name tool_calls}:(terminal OR grep)"), {8, 15})
                self.assertEqual(found(db, "parser -tool_calls:grep"), found(db, "parser") - {15})

    def test_a_query_the_boolean_reading_cannot_read_is_refused_in_one_line_naming_it(self):
        db, rows = self.store("full")
        for query in REFUSED:
            with self.subTest(query=query):
                self.assertRaises(ValueError, oracle, rows, query, MODES["full"][1], grammar=GRAMMAR_BOOLEAN)
                with self.assertRaisesRegex(ValueError, "^[^\\n]*: " + re.escape(repr(query)) + "$"):
                    found(db, query)
                # hermes-agent's reading drops what it cannot read, as hermes-agent does.
                self.assertEqual(found(db, query, GRAMMAR_HERMES),
                                 oracle(rows, query, MODES["full"][1])[0])
        with self.assertRaisesRegex(ValueError, "NOT needs a term before it: 'NOT 迁移'"):
            found(db, "NOT 迁移")
        with self.assertRaisesRegex(ValueError, "a column filter names content, tool_name, tool_calls, not"
                                                " '{content role}'"):
            found(db, "{content role}:schema")
        self.assertEqual(found(db, "key:value 12:30"), set())  # not column names: words

    def test_a_not_never_adds_a_hit(self):
        db, _rows = self.store("full")
        for query in GRAMMAR_QUERIES:
            left = re.split(r" (?:AND )?NOT | -", query)[0]
            if left != query and left.count("(") == left.count(")"):
                with self.subTest(query=query):
                    self.assertLessEqual(found(db, query), found(db, left))
        # hermes-agent's own reading of a query it scans: any term (issue 40's finding, kept by default).
        # Where SQLite has no FTS5, 'schema' is scanned too and row 9's 'schemas' holds it.
        self.assertEqual(found(db, "迁移 NOT schema", GRAMMAR_HERMES),
                         {1, 2, 3, 11, 12, 14} if "word" in SEARCHABLE else {1, 2, 3, 9, 11, 12, 14})

    def test_an_unknown_grammar_names_the_field(self):
        db, _rows = self.store("full")
        with self.assertRaisesRegex(ValueError, "grammar must be 'hermes-agent' or 'boolean', not 'sql'"):
            db.search_messages("parser", grammar="sql")


class SearchCommandAgreesWithTheScan(TempDirTestCase):
    """`python3 -m hermes_state search QUERY --json` on a copy of a real 0.20 store (schema 26), against the
    oracle's reading and scan of its rows."""

    QUERIES = ["迁移", "schema", "迁移 schema", "迁移 NOT schema", "(迁移 OR 会话) schema", "迁移 -schema",
               "关词话件", "关词话件 OR 分移本迁", "parser NOT (migration OR 迁移)", "版 OR 谱机缩文",
               "tool_name:terminal", "content:schema", "tool_calls:schema", "{content tool_calls}:(迁移 OR schema)"]

    def search(self, db, query):
        env = dict(os.environ, HERMES_HOME=str(self.tmp / "home"), PYTHONPATH=str(REPO))
        return subprocess.run([sys.executable, "-m", "hermes_state", "--db", db, "search", query, "-n", "0",
                               "--json"], capture_output=True, text=True, env=env, cwd=self.tmp, timeout=120)

    def test_the_command_answers_each_query_as_the_scan_and_refuses_a_leading_not(self):
        db = str(self.copy_fixture(V26_DB))
        rows = stored_rows(db)
        for query in self.QUERIES:
            with self.subTest(query=query):
                wanted = oracle(rows, query, MODES["full"][1], grammar=GRAMMAR_BOOLEAN)[0]
                run = self.search(db, query)
                self.assertEqual(run.returncode, 0, run.stderr)
                self.assertEqual({hit["id"] for hit in json.loads(run.stdout)}, wanted)
        for query in ("NOT 迁移", "{content role}:schema"):
            with self.subTest(query=query):
                run = self.search(db, query)
                self.assertEqual((run.returncode, run.stdout, run.stderr.count("\n")), (1, "", 1), run.stderr)
                self.assertIn(repr(query), run.stderr)


class SearchFindingsOfTheOracle(TempDirTestCase):
    """The smallest workloads for what the oracle found."""

    def store(self, factory=None):
        db = SessionDB(self.tmp / "state.db", connection_factory=factory) if factory else SessionDB(self.tmp / "state.db")
        self.addCleanup(db.close)
        return db

    def test_the_substring_retry_is_decided_by_the_page_as_hermes_agent_decides_it(self):
        # hermes-agent retries a word query as substrings when the page it asked for came back empty, not when
        # the query has no whole-word hit at all: the page after the last whole-word hit holds the substring
        # hits ("xfoox"). Drop-in: ours does the same.
        db = self.store()
        db.create_session("s", "cli")
        whole = [db.append_message("s", "user", "alpha foo") for _ in range(2)]
        inside = [db.append_message("s", "user", "xfoox bar") for _ in range(2)]
        pages = [[h["id"] for h in db.search_messages("foo", limit=2, offset=offset, sort="oldest")]
                 for offset in (0, 2)]
        self.assertEqual(pages, [whole, inside])

    def test_a_two_letter_cjk_term_with_kana_punctuation_finds_only_messages_holding_both(self):
        # '・' (U+30FB, like U+309B/309C/30A0) is in the CJK range but the CJK side index's unicode61 tokenizer
        # splits on it: such a term goes to LIKE, not to the index, which would read '京・' as '京'.
        db = self.store()
        db.create_session("s", "cli")
        both = db.append_message("s", "user", "東京・大阪")
        db.append_message("s", "user", "京都")
        db.optimize_fts()  # the queued rows into the CJK side index
        self.assertEqual([h["id"] for h in db.search_messages("京・")], [both])

    def test_a_multimodal_message_is_found_by_its_text_without_fts5_too(self):
        # List content is stored as '\x00json:' + JSON, and SQLite's LIKE reads text only up to its first NUL:
        # the fallback reads such content past its prefix. (The trigram index, hermes-agent's as ours, reads
        # it only up to the NUL: a substring retry does not find it.)
        db = self.store()
        db.create_session("s", "cli")
        image = db.append_message("s", "user", [{"type": "text", "text": "zebra picture"},
                                                {"type": "image_url", "image_url": {"url": "https://e.x/a.png"}}])
        found = {"word index": [h["id"] for h in db.search_messages("zebra")]}
        db.close()
        degraded = self.store(without_fts5)
        found["without fts5"] = [h["id"] for h in degraded.search_messages("zebra")]
        self.assertEqual(found, {"word index": [image], "without fts5": [image]})

    def test_a_degraded_runtime_keeps_writing_after_a_full_runtime_opened_the_store(self):
        # The degraded open set the triggers it cannot run aside; a full runtime opening the same store puts them
        # back, and the degraded one's next write meets "no such tokenizer: trigram" ("no such module: fts5"):
        # it sets them aside again and writes.
        for name, factory in (("trigram", without_trigram), ("fts5", without_fts5)):
            with self.subTest(without=name):
                path = self.tmp / f"without-{name}.db"
                degraded = SessionDB(path, connection_factory=factory)
                self.addCleanup(degraded.close)
                degraded.create_session("s", "cli")
                degraded.append_message("s", "user", "one")
                with SessionDB(path) as full:
                    full.append_message("s", "user", "two")
                third = degraded.append_message("s", "user", "three")
                self.assertEqual([h["id"] for h in degraded.search_messages("three")], [third])
                with SessionDB(path) as full:  # the full runtime's next open rebuilds what went stale
                    self.assertEqual([h["id"] for h in full.search_messages("three")], [third])


if __name__ == "__main__":
    unittest.main()
