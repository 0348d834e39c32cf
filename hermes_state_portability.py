"""SessionPortabilityMixin: sessions as portable objects, in and out.

Owns the export shapes (one session, a compression chain as one session, the whole store as a list
and as streams; hermes-agent 0.22's views of the stored rows and its `timings`), the export size
guard `assert_exports_safe`, `import_sessions` (validate everything, then write; history comes
back, runtime ownership does not), another agent's transcript imported once
(`import_foreign_history`) and how a row's BLOB values are made portable and back. Moving a session
between two profiles' stores is the profile repair's. The renderers (jsonl, md, qmd, html, trace)
and write_export are hermes_state_export_formats'; the names the command line and the server take
from here are re-exported. Whole-home backup and restore are hermes_state's. It reads through
SessionDB's readers and pooled read connections, writes through `_execute_write`, and never
imports hermes_state.
"""

import binascii
import contextlib
import functools
import gc
import itertools
import json
import math
import sqlite3
import time
from collections import Counter
from datetime import datetime, timezone

from hermes_state_common import (
    BYTES_MARKER, CONTENT_JSON_PREFIX, DELETE_UNUSED_PROMPTS_SQL, INSERT_SYSTEM_PROMPT_SQL,
    LAST_ACTIVE_SQL, MESSAGE_WRITE_COLUMNS, SELECT_TITLE_OWNER_SQL, SESSION_EXISTS_SQL,
    SET_MESSAGE_COUNTS_SQL, SQL_CHUNK_SIZE, SQLITE_INT_RANGE, TABLE_EXISTS_SQL, TITLE_MAX_LENGTH,
    decode_message, host_view, loads_or, normalize_title, placeholders, quote_identifier,
    resolved_max_export_messages, scrub_surrogates, sqlite_keeps)
from hermes_state_errors import SessionExportTooLargeError
from hermes_state_health import note_store_failure
from hermes_state_ids import new_session_id
from hermes_state_identity import ABSORBED_MESSAGE_UIDS, TOOL_CALL_UID, TOOL_CALL_UIDS
from hermes_state_export_formats import (
    BINARY_TYPES, EXPORT_RUN_MESSAGES, JSONL_ENCODER, SCALARS_ENCODER, decoded_calls,
    encoded_calls, json_default, jsonl_session, message_runs)
# Re-exported: the command line, the server and the tests import these from here.
from hermes_state_export_formats import (  # noqa: F401
    EXPORT_FORMATS, markdown_file_name, message_text, write_export)
from hermes_state_repair import _exclusive
from hermes_state_schema import (
    live_columns, pause_between_chunks, prompt_hash, read_meta, write_meta)

ID_MAX_LENGTH = 256
# hermes-agent's export_all reads at most this many sessions.
EXPORT_ALL_LIMIT = 100_000
# Sessions iter_export_all reads a query (a query each cost more than a short one's rows); under
# SQLite's 999.
EXPORT_SESSION_CHUNK = 200


def count_tool_calls(tool_calls):
    """How many calls hermes-agent counts in a `tool_calls` value: a list's length, 1 for any
    other value, 0 for None; JSON text is read first (text that is not JSON counts 0)."""
    if isinstance(tool_calls, str):
        tool_calls = loads_or(tool_calls, [])
    return 0 if tool_calls is None else len(tool_calls) if isinstance(tool_calls, list) else 1


# -- What an export says about its messages' timing ------------------------------------------

# The span of timestamps hermes-agent 0.22 trusts (hermes_cli.timefmt's EPOCH_MIN/MAX): anything
# else (text, inf, a value salvaged from a damaged page) counts as missing, never fails the export.
EPOCH_RANGE = (0.0, 4_200_000_000.0)


def _epoch(value):
    """A stored timestamp as epoch seconds, or None when it is unset or cannot be trusted."""
    if value is None or value == "":
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return seconds if EPOCH_RANGE[0] <= seconds <= EPOCH_RANGE[1] else None


def _iso(seconds):
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat()


def _export_timings(messages, session_id=None):
    """hermes-agent 0.22's `timings` of an export: ids, roles, counts and gaps between the messages'
    timestamps, never their text. `complete` is always False (no stopwatch is stored); a timestamp
    that is not a plausible epoch counts as missing. `session_id` is accepted as 0.22's is (it
    names the session in its log line); the result does not depend on it."""
    stamped = [(message, seconds) for message in messages
               for seconds in [_epoch(message.get("timestamp"))] if seconds is not None]
    roles = Counter(str(message.get("role") or "unknown") for message in messages)
    calls = [message.get("tool_calls") for message in messages]
    intervals = [{"from_message_id": earlier.get("id"), "to_message_id": later.get("id"),
                  "from_role": earlier.get("role"), "to_role": later.get("role"),
                  "gap_ms": max(0, round((later_at - earlier_at) * 1000))}
                 for (earlier, earlier_at), (later, later_at) in zip(stamped, stamped[1:])]
    first, last = (stamped[0][1], stamped[-1][1]) if stamped else (None, None)
    return {
        "source": "message_timestamps",
        "available": bool(stamped),
        "complete": False,
        "unavailable_reason": None if stamped else "no_timestamped_messages",
        "message_timestamps": {"available": len(stamped), "missing": len(messages) - len(stamped)},
        "first_message_at": None if first is None else _iso(first),
        "last_message_at": None if last is None else _iso(last),
        "wall_clock_ms": None if first is None else max(0, round((last - first) * 1000)),
        "largest_gap_ms": max(gap["gap_ms"] for gap in intervals) if intervals else None,
        "role_counts": dict(roles),
        "tool_result_count": roles.get("tool", 0),
        "tool_calls_emitted": sum(len(call) if isinstance(call, list) else 1
                                  for call in calls if call),
        "intervals": intervals,
    }


# -- Portable values: a BLOB in JSON ---------------------------------------------------------

# JSON has no bytes: a BLOB value travels as {"__base64__": "<standard base64>"}
# (json_default), and import stores it back as a BLOB (docs/moving-history.md).

# Message columns hermes-agent 0.22 derives from the row itself (its display dedupe key and
# order): its get_messages leaves them out, so exports do; it derives them again after import.
DERIVED_MESSAGE_COLUMNS = frozenset({"display_identity", "display_order"})
DROPPED_MESSAGE_COLUMNS = (*DERIVED_MESSAGE_COLUMNS, "_compressed_summary")


def portable_row(row, dropped=()):
    """A row dict JSON can hold: BLOB values as BYTES_MARKER objects,
    the `dropped` keys left out."""
    portable = dict(row)
    for key in dropped:
        portable.pop(key, None)
    # (C loops; most rows hold none)
    if not any(map(isinstance, portable.values(), itertools.repeat(BINARY_TYPES))):
        return portable
    return {key: json_default(value) if isinstance(value, BINARY_TYPES) else value
            for key, value in portable.items()}


def portable_message(message):
    """A message row as hermes-agent 0.22 exports it: portable, without the columns it derives,
    `_compressed_summary` only when set (as true, last)."""
    portable = portable_row(message, DROPPED_MESSAGE_COLUMNS)
    if message.get("_compressed_summary"):
        portable["_compressed_summary"] = True
    return portable


def from_portable(value):
    """A BYTES_MARKER object back as bytes; any other value as it is."""
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get(BYTES_MARKER), str):
        import base64  # here, not at import: only an import of BLOB values decodes them
        try:
            return base64.b64decode(value[BYTES_MARKER], validate=True)
        except (binascii.Error, ValueError):
            pass
    return value


# -- Import validation (pass 1): pure functions over the payload -----------------------------

# Text or null, as hermes-agent checks them ("<field> must be a string").
SESSION_TEXT_FIELDS = ("source", "user_id", "model", "system_prompt", "end_reason", "cwd",
                       "git_branch", "git_repo_root", "billing_provider", "billing_base_url",
                       "billing_mode", "cost_status", "cost_source", "pricing_version", "title")
MESSAGE_TEXT_FIELDS = ("tool_call_id", "tool_name", "effect_disposition", "finish_reason",
                       "reasoning", "reasoning_content", "platform_message_id", "message_id")
# Restored as numbers; a value that is not one degrades (integers to 0, the rest to null).
SESSION_INT_FIELDS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
                      "reasoning_tokens", "api_call_count")
SESSION_FLOAT_FIELDS = ("ended_at", "estimated_cost_usd", "actual_cost_usd")
# Restored as 0/1 by truth, as hermes-agent 0.20 restores `archived` (0.22 keeps all four).
SESSION_FLAG_FIELDS = ("archived", "auto_archived", "pinned", "hidden")
# Session fields no import restores (hermes-agent 0.19 to 0.22 reset them all): gateway routing and
# identity, handoffs, rewinds, activity, compression cooldowns and streaks, per-store bookkeeping,
# and what an export derives (counts, the prompt's hash, recency, lineage, timings).
SESSION_RESET_FIELDS = frozenset({
    "session_key", "chat_id", "chat_type", "thread_id", "display_name", "origin_json",
    "expiry_finalized", "handoff_state", "handoff_platform", "handoff_error", "rewind_count",
    "last_activity_at", "last_activity_description", "last_activity_provenance", "last_read_at",
    "compression_failure_cooldown_until", "compression_failure_error",
    "compression_fallback_streak", "compression_ineffective_count",
    "compression_recovery_deadline", "compression_overload_streak", "profile_name", "title_source",
    "git_metadata_generation", "created_source", "transport_profile", "tool_names",
    "id", "parent_session_id", "messages", "message_count", "tool_call_count", "system_prompt_hash",
    "last_active", "preview", "segments", "lineage_session_ids", "timings", })
# Session fields converted on the way in, whatever their value (none is refused for its size).
SESSION_CONVERTED_FIELDS = SESSION_RESET_FIELDS | {
    "started_at", "model_config", *SESSION_TEXT_FIELDS, *SESSION_FLOAT_FIELDS, *SESSION_FLAG_FIELDS}
# Message fields the import writes its own way: new ids, the importing session, the flags, the
# `message_id` alias of platform_message_id, the columns 0.22 derives, and the live identity keys
# the write puts on its copies of the entries (their columns come in as exported).
MESSAGE_RESET_FIELDS = frozenset({"id", "session_id", "message_id", "active", "compacted",
                                  "_row_id", *DERIVED_MESSAGE_COLUMNS, TOOL_CALL_UIDS,
                                  TOOL_CALL_UID, ABSORBED_MESSAGE_UIDS})
# Message fields with a rule of their own; any other is carried as it is.
MESSAGE_RULED_FIELDS = MESSAGE_RESET_FIELDS | frozenset(MESSAGE_WRITE_COLUMNS)
# Structured message fields stored as JSON text; the import reads text in them as JSON first.
REASONING_JSON_FIELDS = ("reasoning_details", "codex_reasoning_items", "codex_message_items")
NESTED_MESSAGE_FIELDS = ("tool_calls", "display_metadata", *REASONING_JSON_FIELDS)


# NaN and Infinity pass, as in hermes-agent's measure: Python's JSON writes them, so exports hold
# them.
_COMPACT_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
# JSON's value types, exactly (a subclass takes the long way); numbers, null and text under
# SHORT_TEXT_CHARS are measured together.
_SHORT_TYPES = {int, float, bool, type(None)}
_CONTAINER_TYPES = {list, dict}
SHORT_TEXT_CHARS = 4096
_JSON_TYPES = {str, *_SHORT_TYPES, *_CONTAINER_TYPES}


def _utf8_size(text):
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _compact_size(value):
    """Bytes of `value` as compact UTF-8 JSON, the measure of every size limit; a run of messages
    or a long member at a time, the short ones together: no one whole text that a single CJK
    character makes 4 bytes a character."""
    encode = _COMPACT_ENCODER.encode
    if not isinstance(value, dict):
        return _utf8_size(encode(value))
    size, short = 2 + max(0, len(value) - 1), {}  # braces and commas
    for key, member in value.items():
        if key == "messages" and type(member) is list:
            # Each run is "[...]"; runs joined by commas make one list: one pair of brackets.
            runs = message_runs(member)
            runs_size = sum(_utf8_size(encode(run)) for run in runs)
            size += _utf8_size(encode(key)) + 1 + runs_size - len(runs) + 1
        elif (type(member) in _SHORT_TYPES
              or type(member) is str and len(member) < SHORT_TEXT_CHARS):
            short[key] = member
        else:
            size += _utf8_size(encode({key: member})) - 2
    return size + _utf8_size(encode(short)) - 1 - len(short) if short else size


def _depth(value, limit):
    """How deep lists and objects nest in `value`; stops counting past `limit`. A level at a
    time, not recursion, so that any nesting gets an answer; a level's containers are picked out
    in C loops (most values are text)."""
    depth, level = 0, [value] if isinstance(value, (list, dict)) else []
    while level and depth <= limit:
        depth += 1
        children = [*itertools.chain.from_iterable(
            item.values() if isinstance(item, dict) else item for item in level)]
        kinds = [*map(type, children)]
        if {*kinds} <= _JSON_TYPES:
            level = [*itertools.compress(children, map(_CONTAINER_TYPES.__contains__, kinds))]
        else:
            level = [child for child in children if isinstance(child, (list, dict))]
    return depth


def _check_nesting(field, value, limit):
    """Raise if `value`, or the JSON text it holds, nests too deep to store and export again."""
    if value is None or isinstance(value, str) and value.lstrip()[:1] not in ("[", "{"):
        return
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:
            raise ValueError(
                f"{field} nests lists and objects more than {limit} levels deep") from None
        except ValueError:
            return  # text that is not JSON is stored as text
    if _depth(value, limit) > limit:
        raise ValueError(f"{field} nests lists and objects more than {limit} levels deep")


def _check_text(entry, fields):
    for field in fields:
        if entry.get(field) is not None and not isinstance(entry[field], str):
            raise ValueError(f"{field} must be a string")


def _check_int_range(field, value):
    if isinstance(value, int) and not sqlite_keeps(value):
        raise ValueError(f"{field} is outside SQLite's integer range")


def import_id(entry):
    """The id an import files an entry under: its `id` as stripped text ('' for none)."""
    return str(entry.get("id") or "").strip() if isinstance(entry, dict) else ""


def validate_import(sessions, limits):
    """Pass 1: every rejected entry as {"index", "error", "session_id"?}, its first error in
    hermes-agent's words; `limits` as import_limits() names them. Raises ValueError for a
    non-list or too many entries."""
    if not isinstance(sessions, list):
        raise ValueError("sessions must be a list")
    if len(sessions) > limits["sessions"]:
        raise ValueError(f"sessions must contain at most {limits['sessions']} entries")
    return list(entry_errors(enumerate(sessions), limits, set(), "index"))


def entry_errors(numbered, limits, seen, where):
    """Each rejected entry of (number, entry) pairs as {where: number, "error", "session_id"?};
    the ids of accepted ones go into `seen` (one pass, so a stream is checked as it is read)."""
    totals = {"messages": 0, "bytes": 0}
    for number, entry in numbered:
        session_id = import_id(entry)
        try:
            _check_entry(entry, session_id, seen, totals, limits)
        except ValueError as exc:
            error = {where: number, "error": str(exc)}
            if session_id:
                error["session_id"] = session_id
            yield error
            continue
        seen.add(session_id)


def _check_entry(entry, session_id, seen, totals, limits):
    """Raise ValueError with the first problem of one entry;
    count its bytes and messages into `totals`."""
    messages = (entry.get("messages") or []) if isinstance(entry, dict) else []
    # A field's limit counts from its value; an entry adds three levels (entry, messages, message).
    envelope = limits["depth"] + 3
    for failed, error in (  # in this order, the first failing one
            (lambda: not isinstance(entry, dict), "session must be an object"),
            (lambda: not session_id, "session id is required"),
            (lambda: len(session_id) > ID_MAX_LENGTH,
             f"session id is {len(session_id)} characters; the limit is {ID_MAX_LENGTH}"),
            (lambda: session_id in seen, "duplicate session id"),
            (lambda: not isinstance(messages, list), "messages must be a list"),
            (lambda: len(messages) > limits["messages_per_session"],
             "messages exceeds the per-session import limit"),
            (lambda: not all(isinstance(message, dict) for message in messages),
             "messages must contain only objects"),
            (lambda: _depth(entry, envelope) > envelope,
             f"session nests lists and objects more than {envelope} levels deep")):
        if failed():
            raise ValueError(error)
    # `timings` only describes the messages (hermes-agent 0.22 leaves it out of the measure too).
    try:
        size = _compact_size({key: value for key, value in entry.items() if key != "timings"})
    except (TypeError, ValueError):
        raise ValueError("session must be JSON serializable") from None
    if size > limits["session_bytes"]:
        raise ValueError("session exceeds the import size limit")
    totals["bytes"] += size
    if totals["bytes"] > limits["total_bytes"]:
        raise ValueError("import exceeds the total size limit")
    _check_session_fields(entry, limits["depth"])
    for position, message in enumerate(messages):
        _check_message(position, message, limits["depth"])
    totals["messages"] += len(messages)
    if totals["messages"] > limits["total_messages"]:
        raise ValueError("messages exceeds the total import limit")


def _check_session_fields(entry, depth_limit):
    config = entry.get("model_config")
    _check_nesting("model_config", config, depth_limit)
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            raise ValueError("model_config must be valid JSON") from None
    if config is not None and not isinstance(config, dict):
        raise ValueError("model_config must be a JSON object")
    _check_text(entry, ("parent_session_id", *SESSION_TEXT_FIELDS))
    for field, value in entry.items():  # the token counts, and fields carried as they are
        if field not in SESSION_CONVERTED_FIELDS:
            _check_int_range(field, value)


def _check_message(position, message, depth_limit):
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{position}].role must be a non-empty string")
    _check_text(message, MESSAGE_TEXT_FIELDS)
    if message.get("token_count") is not None:
        try:
            count = int(message["token_count"])
        except (TypeError, ValueError, OverflowError):
            raise ValueError("token_count must be an integer") from None
        _check_int_range("token_count", count)
    content = message.get("content")
    # (names are formatted only when needed: this runs for every message)
    if isinstance(content, int):
        _check_int_range(f"session.messages[{position}].content", content)
    carries_fields = not message.keys() <= MESSAGE_RULED_FIELDS
    for field, value in message.items() if carries_fields else ():  # fields carried as they are
        if field not in MESSAGE_RULED_FIELDS:
            _check_int_range(f"messages[{position}].{field}", value)
    # Values themselves were measured by the entry's envelope (a message field sits three levels in,
    # so its limit there is the same); JSON text in them is read here.
    for field in NESTED_MESSAGE_FIELDS:
        value = message.get(field)
        if isinstance(value, str):
            _check_nesting(f"messages[{position}].{field}", value, depth_limit)


# -- Import writing (pass 2): rows from a validated entry ------------------------------------


def _number(value, kind, default=None):
    """`kind(value)`, or `default` for null, a value that is not a number, or one SQLite cannot hold
    (an integer past 64 bits, a float that is not finite)."""
    try:
        number = default if value is None else kind(value)
    except (TypeError, ValueError, OverflowError):
        return default
    low, high = SQLITE_INT_RANGE
    if number is not None and not (low <= number <= high if kind is int else math.isfinite(number)):
        return default
    return number


def _stored_value(value):
    """A carried field's value as SQLite stores it: BLOBs back to bytes, structures as JSON text."""
    value = from_portable(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return scrub_surrogates(value)


def _import_title(title):
    """A title by set_session_title's rules; one past TITLE_MAX_LENGTH is cut, not refused."""
    try:
        return normalize_title(title)
    except ValueError:
        return normalize_title(title[:TITLE_MAX_LENGTH])


def _carry(row, entry, reset, columns, table, unstored):
    """Add to `row` every field of `entry` the import has no rule for, when the store has its
    column; a field it has no column for, holding a value, goes into `unstored` as table.field."""
    for key, value in entry.items():
        if key in row or key in reset:
            continue
        if key in columns:
            row[key] = _stored_value(value)
        elif value not in (None, 0, "", [], {}):
            unstored.add(f"{table}.{key}")
    for key in [key for key in row if key not in columns]:
        if row.pop(key) not in (None, 0):
            unstored.add(f"{table}.{key}")
    return row


def _session_row(entry, session_id, columns, unstored):
    """The `sessions` row of an entry: its history, never its runtime ownership or counters."""
    row = {"id": session_id, "source": entry.get("source") or "import"}
    started_at = _number(entry.get("started_at"), float)
    row["started_at"] = time.time() if started_at is None else started_at
    for field in SESSION_TEXT_FIELDS[1:]:
        if field != "system_prompt":
            row[field] = entry.get(field)
    row["title"] = _import_title(row["title"])
    config = entry.get("model_config")
    row["model_config"] = json.dumps(config) if isinstance(config, dict) else config
    row.update({field: _number(entry.get(field), int, 0) for field in SESSION_INT_FIELDS})
    row.update({field: _number(entry.get(field), float) for field in SESSION_FLOAT_FIELDS})
    row.update({field: 1 if entry.get(field) else 0 for field in SESSION_FLAG_FIELDS})
    row["auto_archived"] &= row["archived"]  # only the archive sweep sets it, on rows it archives
    return _carry(row, entry, SESSION_RESET_FIELDS | {"system_prompt"},
                  columns, "sessions", unstored)


def _would_create_cycle(conn, pending, child, parent):
    """True if making `parent` the parent of `child` closes a loop, counting the links of the
    payload not attached yet (`pending`, child -> parent) as well as the stored ones."""
    seen, current = {child}, parent
    while current:
        if current in seen:
            return True
        seen.add(current)
        if current in pending:
            current = pending[current]
            continue
        row = conn.execute("SELECT parent_session_id, end_reason FROM sessions WHERE id = ?",
                           (current,)).fetchone()
        current = row[0] if row else None
    return False


def _attach_parents(conn, links):
    """Attach each (child, parent) link in payload order unless the parent is unknown or the link
    closes a loop; a dropped link leaves its child a root. Returns how many were dropped."""
    pending, detached = dict(links), 0
    for child, parent in links:
        if conn.execute(SESSION_EXISTS_SQL, (parent,)).fetchone() and \
                not _would_create_cycle(conn, pending, child, parent):
            conn.execute("UPDATE sessions SET parent_session_id = ? WHERE id = ?", (parent, child))
        else:
            del pending[child]
            detached += 1
    return detached

# The flag the export query gives each message row (its last column): how much decoding it needs.
ROW_AS_STORED = 0  # every value goes out as read
ROW_TOOL_CALLS = 1  # only tool_calls: JSON text to decode
ROW_DECODED = 2  # the long way (decode_message): encoded content, display_metadata, a summary mark
ROW_HAS_BLOB = 3  # a BLOB value; not flagged in a streamed export, whose encoder finds it


class SessionPortabilityMixin:
    """Export and import behaviour of SessionDB (see the module docstring).

    Relies on: `_execute_write`, `_read_all`, `_read_value`, `_with_reader`, `_borrow_reader`,
    `_return_reader` (SessionDB, hermes_state.py); `get_session`, `_resolved` (sessions mixin);
    `_flush_token_counts` (usage mixin); `get_compression_lineage` (compression mixin);
    `_insert_message_rows`, `get_messages` (messages mixin); `_hold_back_index_triggers`,
    `_index_held_back_rows` (search index mixin); `_sweep_deleted_messages`, `_sweep_later`
    (maintenance mixin)."""

    _IMPORT_MAX_SESSIONS = 500
    _IMPORT_MAX_MESSAGES_PER_SESSION = 10_000
    _IMPORT_MAX_TOTAL_MESSAGES = 50_000
    _IMPORT_MAX_SESSION_BYTES = 5 * 1024 * 1024
    _IMPORT_MAX_TOTAL_BYTES = 25 * 1024 * 1024
    # Lists and objects inside one field; deeper values could not be exported again (json and the
    # renderers recurse), and no agent writes them.
    _IMPORT_MAX_DEPTH = 100
    # An import transaction takes no further session once it has run this long (issue 17: no
    # write-lock hold over 1 s); filling the indexes for its rows afterwards adds as much again (0.3
    # held 0.7 s at 1M messages once inserts ran without our triggers).
    IMPORT_CHUNK_SECONDS = 0.2

    # -- export ----------------------------------------------------------------

    def export_session(self, session_id, include_compacted=False, include_inactive=False):
        """Every `sessions` column (system prompt resolved) and `messages`; BLOBs portable (see
        BYTES_MARKER). None for an unknown id. The messages are the active rows in id order as
        get_messages gives them; hermes-agent 0.22's flags choose others, as its get_messages
        does: `include_inactive` every stored row with its active/compacted flags (what
        import_sessions restores archived), `include_compacted` the history the user sees, rows
        compaction archived included (deduped for display: not for import). Either flag also adds
        0.22's `timings` (_export_timings); without one the export has 0.20's shape."""
        session = self.get_session(session_id)
        if session is None:
            return None
        view = (include_compacted, include_inactive)
        return next(self._exported(one=portable_row(session), view=view))

    def _exported(self, source=None, streamed=False, one=None, view=(False, False)):
        """Each session of `source` (or `one`) with its messages (a generator): a dict, or
        `streamed`, jsonl pieces read a run at a time; one pooled read connection, plain tuples
        (a sqlite3.Row costs more). `view` is export_session's (include_compacted,
        include_inactive); the display projection of include_compacted is get_messages'."""
        include_compacted, include_inactive = view
        conn = self._borrow_reader()
        try:
            cursor, sessions = conn.cursor(), conn.cursor()
            cursor.row_factory = sessions.row_factory = None
            read, convert, runs = self._export_reader(cursor, streamed, include_inactive)
            for session in [one] if one else self._export_sessions(source, sessions):
                if streamed:
                    yield jsonl_session(session, runs(session["id"]), {})
                    continue
                if include_compacted:
                    messages = [portable_message(message) for message in self.get_messages(
                        session["id"], include_inactive=include_inactive, include_compacted=True)]
                else:
                    messages = convert(read(session["id"]).fetchall())
                export = {**session, "messages": messages}
                if any(view):
                    export["timings"] = _export_timings(messages, session["id"])
                yield export
        except sqlite3.DatabaseError as exc:
            # Read on a reader of its own, past the pool's translation: a failing disk is said so
            note_store_failure(self.db_path, exc)
            raise
        finally:
            # Closed, a pieces iterator kept past its session fails loudly instead of reading on a
            # lent reader; ProgrammingError: the store was closed first, nothing to release.
            with contextlib.suppress(sqlite3.ProgrammingError):
                cursor.close()
                sessions.close()
            self._return_reader(conn)

    def _export_reader(self, cursor, streamed=False, every_row=False):
        """(read, convert, runs): read(session_id) queries a session's messages on `cursor` (the
        active ones, or `every_row`), convert makes rows what portable_message(get_messages(id))
        gives, runs(session_id) yields their jsonl a run at a time. The query's last column is
        each row's flag: one of the ROW_* names above the class."""
        names = [name for (name,) in
                 cursor.execute("SELECT name FROM pragma_table_info('messages')")]
        kept = [name for name in names if name not in DROPPED_MESSAGE_COLUMNS]
        columns = kept + ["_compressed_summary"] * ("_compressed_summary" in names)
        # The conditions of ROW_DECODED, each on a column the store has.
        decoded_when = [f"{name} IS NOT NULL"
                        for name in ("display_metadata", "_compressed_summary") if name in names]
        params = ()
        if "content" in names:
            # Text starting with CONTENT_JSON_PREFIX sorts from it to the next prefix (substr()
            # would stop at its NUL).
            decoded_when.append("(content >= ? AND content < ?)")
            next_prefix = CONTENT_JSON_PREFIX[:-1] + chr(ord(CONTENT_JSON_PREFIX[-1]) + 1)
            params = (CONTENT_JSON_PREFIX, next_prefix)
        if "tool_calls" in kept:
            calls_when, at = "tool_calls IS NOT NULL", kept.index("tool_calls")
        else:
            calls_when, at = "0", 0
        if streamed:
            blob_when = "0"  # encoded() finds a BLOB for free
        else:  # every BLOB sorts at or after X'', every other value before it
            blob_when = " OR ".join(f"{name} >= X''" for name in map(quote_identifier, columns))
        # Each kept column's JSON key, as a %-template's text.
        keys = [json.dumps(name, ensure_ascii=False).replace("%", "%%") + ": " for name in kept]
        sql = (f"SELECT {', '.join(map(quote_identifier, columns))},"
               f" CASE WHEN {blob_when} THEN {ROW_HAS_BLOB}"
               f" WHEN {' OR '.join(decoded_when) or 0} THEN {ROW_DECODED}"
               f" WHEN {calls_when} THEN {ROW_TOOL_CALLS} ELSE {ROW_AS_STORED} END"
               f" FROM messages WHERE session_id = ?{'' if every_row else ' AND active = 1'}"
               " AND id > ? ORDER BY id LIMIT ?")

        def convert(rows):
            # A dict a row in C loops (zip stops at `kept`), then the flagged rows decoded
            # (ROW_AS_STORED is 0: compress leaves those rows out).
            messages = [*map(dict, map(zip, itertools.repeat(kept), rows))]
            flagged = [*itertools.compress(enumerate(rows), [row[-1] for row in rows])]
            calls = [(position, row[at]) for position, row in flagged
                     if row[-1] == ROW_TOOL_CALLS]
            for (position, _), value in zip(calls, decoded_calls([text for _, text in calls])):
                messages[position]["tool_calls"] = value
            for position, row in flagged:
                if row[-1] >= ROW_DECODED:  # the long way of get_messages and portable_message
                    messages[position] = portable_message(host_view(
                        decode_message(zip(columns, row)), "messages"))
            return messages

        def encoded(rows):
            # As a list's items, a column at a time: no dicts, a column of nulls written once.
            columns = list(zip(*rows))
            if not rows or max(columns[-1]) >= ROW_DECODED:
                return JSONL_ENCODER.encode(convert(rows))[1:-1] if rows else ""
            members, values = [], []  # values: the texts of each column that holds any
            for key, name, column in zip(keys, kept, columns):
                if column.count(None) == len(column):
                    members.append(key + "null")
                    continue
                members.append(key + "%s")
                try:
                    if name == "tool_calls":
                        values.append(encoded_calls(column))
                    else:
                        values.append(SCALARS_ENCODER.encode(column)[1:-1].split("\x00"))
                except TypeError:  # a BLOB, found here for free (encoded as convert's rows are)
                    return JSONL_ENCODER.encode(convert(rows))[1:-1]
            template = "{" + ", ".join(members) + "}"  # one row's object, its values to fill in
            return ", ".join([template % row_values for row_values in zip(*values)])

        def read(session_id, after=-1 << 63, limit=-1):
            """The messages past id `after`, `limit` of them (-1: all)."""
            return cursor.execute(sql, (*params, session_id, after, limit))

        def runs(session_id):
            # Each run read whole by its own statement: no read stays open while the consumer
            # writes (on a rollback journal it holds off every writer).
            after, at = -1 << 63, columns.index("id")
            while rows := read(session_id, after, EXPORT_RUN_MESSAGES).fetchall():
                yield encoded(rows)
                after = rows[-1][at]

        return read, convert, runs

    def export_session_lineage(self, session_id, include_compacted=False, include_inactive=False):
        """A compression chain as one session: the tip's export with `segments` (root first),
        `message_count`, `lineage_session_ids`, every message in order; the flags are
        export_session's (and with one, `timings` of all the messages). None for an unknown id."""
        lineage = self.get_compression_lineage(session_id) or []
        segments = [*filter(None, (self.export_session(segment, include_compacted, include_inactive)
                                   for segment in lineage))]
        if not segments:
            return None
        combined = dict(segments[-1], segments=segments,
                        lineage_session_ids=[s["id"] for s in segments])
        combined["messages"] = [message for segment in segments for message in segment["messages"]]
        combined["message_count"] = len(combined["messages"])
        if include_compacted or include_inactive:
            combined["timings"] = _export_timings(combined["messages"], session_id)
        return combined

    def export_all(self, source=None, include_compacted=False, include_inactive=False):
        """A list of every session (of `source` when given) as export_session gives it (the flags
        are its) plus `last_active`, most recently active first; [] for none. iter_export_all
        streams the same. Python's cycle collector is paused for the call, in the whole process
        (gc.disable)."""
        # The list makes no cycles, but its growth sets off full collections of the whole heap: they
        # wait.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return list(self.iter_export_all(source, include_compacted, include_inactive))
        finally:
            if collecting:
                gc.enable()

    def iter_export_all(self, source=None, include_compacted=False, include_inactive=False):
        """export_all one session at a time (a generator):
        memory holds the largest session, not the store."""
        return self._exported(source, view=(include_compacted, include_inactive))

    def assert_exports_safe(self, session_ids, max_messages=None):
        """Refuse, before any is read, an export whose sessions would each load more than
        `max_messages` rows (default: config.yaml's sessions.max_export_messages; 0: no limit, no
        query): SessionExportTooLargeError for the first session past it. Counts every stored
        row, as the export hermes-agent 0.22 guards with it (include_inactive) loads them all;
        ValueError for a negative limit."""
        limit = resolved_max_export_messages() if max_messages is None else max_messages
        if limit < 0:
            raise ValueError(f"max_messages must be >= 0, not {limit}")
        if limit == 0:
            return
        for session_id in session_ids:
            # Counted only to one past the limit: a huge session costs no more than a small one.
            count = self._read_value(
                "SELECT COUNT(*) FROM (SELECT 1 FROM messages WHERE session_id = :session_id"
                " LIMIT :past_limit)", {"session_id": session_id, "past_limit": limit + 1})
            if count > limit:
                raise SessionExportTooLargeError(session_id, count, limit)

    def iter_export_jsonl(self, source=None):
        """iter_export_all as write_export's jsonl, an iterator of pieces a session:
        EXPORT_RUN_MESSAGES in memory."""
        return self._exported(source, streamed=True)

    def _export_sessions(self, source, cursor):
        """iter_export_all's sessions, portable, without messages, read on a tuple `cursor`.
        The order is read once, at the start; the rows EXPORT_SESSION_CHUNK at a time, each
        as get_session gives it."""
        where, params = ("WHERE s.source = ?", (source,)) if source else ("", ())
        # export_all's order, hermes-agent's search_sessions': most recently active first
        # (LAST_ACTIVE_SQL), newest start, id.
        order = self._read_all(
            f"SELECT s.id, {LAST_ACTIVE_SQL.format(a='s')} AS last_active FROM sessions AS s"
            f" {where} ORDER BY last_active DESC, s.started_at DESC, s.id DESC LIMIT ?",
            (*params, EXPORT_ALL_LIMIT))
        for start in range(0, len(order), EXPORT_SESSION_CHUNK):
            chunk = order[start:start + EXPORT_SESSION_CHUNK]
            self._flush_token_counts()  # as get_session does: queued counts are part of the row
            rows = cursor.execute(
                f"SELECT s.* FROM sessions AS s WHERE s.id IN ({placeholders(len(chunk))})",
                [session_id for session_id, _ in chunk])
            # (dict(sqlite3.Row) finds each value by name)
            names = [column[0] for column in rows.description]
            resolved = self._resolved([dict(zip(names, row)) for row in rows])
            sessions = {one["id"]: one for one in resolved}
            for session_id, last_active in chunk:
                session = sessions.pop(session_id, None)
                if session is not None:  # (None: deleted since the order was read)
                    session["last_active"] = last_active
                    yield portable_row(session)

    # -- import ----------------------------------------------------------------

    @classmethod
    def import_limits(cls):
        """The limits of one import_sessions call, by name: what validate_import checks (a class
        method: the command line checks a file before it opens the store)."""
        return {"sessions": cls._IMPORT_MAX_SESSIONS,
                "messages_per_session": cls._IMPORT_MAX_MESSAGES_PER_SESSION,
                "total_messages": cls._IMPORT_MAX_TOTAL_MESSAGES,
                "session_bytes": cls._IMPORT_MAX_SESSION_BYTES,
                "total_bytes": cls._IMPORT_MAX_TOTAL_BYTES, "depth": cls._IMPORT_MAX_DEPTH}

    def import_sessions(self, sessions, *, limits=None):
        """Add exported sessions (hermes-agent 0.19 to 0.22's exports, or ours) to the store:
        history, not runtime ownership. Pass 1 checks the whole payload and writes nothing if any
        entry is wrong: {"ok": False, "imported": 0, "skipped": 0, "detached": 0, "errors":
        [...]}. Pass 2, whole sessions in transactions of about IMPORT_CHUNK_SECONDS, parent
        links in a last one: stored ids are skipped, never overwritten (a link a cut-short run
        left out is attached); messages get fresh ids, rewound ones stay rewound; counts are
        recomputed; titles follow set_session_title's rules (a taken one gets the id appended);
        SESSION_RESET_FIELDS are not restored; a field with no rule is restored when the store
        has its column, else named in `unstored_fields` (a key present only then); a link to an
        unknown parent or closing a loop is dropped (`detached`). `limits` replaces
        import_limits(). A file of any size goes through import_checked_file instead.
        Raises ValueError if `sessions` is not a list or has too many entries."""
        errors = validate_import(sessions, limits or self.import_limits())
        if errors:
            return {"ok": False, "imported": 0, "skipped": 0, "detached": 0, "errors": errors}
        # A deleted session's leftovers never join an import of its id.
        self._sweep_deleted_messages()
        # A transaction of about IMPORT_CHUNK_SECONDS at a time, whole sessions, so an import never
        # holds the write lock for long (issue 17); cut short, a rerun skips what is stored.
        found, done = ([], [], [], [], set()), 0
        while done < len(sessions):
            if done:
                pause_between_chunks()
            part = self._execute_write(
                lambda conn: self._write_import(conn, sessions[done:], self.IMPORT_CHUNK_SECONDS))
            done += len(part[0]) + len(part[1])
            found = tuple(total + new if isinstance(total, list) else total | new
                          for total, new in zip(found, part))
        return self._execute_write(lambda conn: _finish_import(conn, found))

    # -- a file of any size: checked, staged out of sight, shown at once ---------------------------

    def import_checked_file(self, handle, name, digest, *, progress=None):
        """Store a jsonl file check_import_file accepted (`handle` at its start, `digest` as it
        returned); import_sessions' answer without the id lists. Sessions are written
        IMPORT_CHUNK_SECONDS at a time, their rows into IMPORT_STAGING_TABLE (no reader looks
        there; get_messages of an id not yet stored, and raw counts, see the messages); one last
        transaction moves them into `sessions`. A run cut short is resumed by the same file's,
        discarded by another's. RuntimeError while another file import runs, nothing written.
        `progress` (phase(name, detail), update(done, total, unit)) hears of each step."""
        with _exclusive(f"{self.db_path}.import.lock", 0) as held:
            if not held:
                raise RuntimeError(f"another import into {self.db_path} is running; nothing was "
                                   "written")
            self._sweep_deleted_messages()  # a deleted session's leftovers never join an import
            resumed = self._execute_write(lambda conn: _open_staging(conn, digest))
            if resumed is None:
                if progress:
                    progress.phase("discarding", "the staged rows of another file's import")
                while self._execute_write(self._discard_staging_chunk):
                    pause_between_chunks()
                self._sweep_deleted_messages()
                resumed = self._execute_write(lambda conn: _open_staging(conn, digest))
            if progress:
                progress.phase("staging", "unseen by readers until the last step" + (
                    f"; resuming after {resumed:,} sessions staged before" if resumed else ""))
            staged, batch, size = 0, [], 0
            for _number, entry, length in jsonl_entries(handle, name):
                batch.append(entry)
                size += length
                if size >= IMPORT_BATCH_BYTES:  # what is parsed ahead of the writes, at most
                    staged, batch, size = self._stage_batch(batch, digest, staged, progress), [], 0
            self._stage_batch(batch, digest, staged, progress)
            if progress:
                progress.phase("publishing", "one transaction makes every session visible")
            return self._execute_write(lambda conn: self._publish_staging(conn, digest))

    def staged_import(self):
        """{"sessions": staged, "file_digest": ...} of a file import not finished (running, or
        cut short: a rerun of the file resumes it); None when there is none."""
        if self._read_one(TABLE_EXISTS_SQL, (IMPORT_STAGING_TABLE,)) is None:
            return None
        return {"sessions": self._read_value(f"SELECT COUNT(*) FROM {IMPORT_STAGING_TABLE}"),
                "file_digest": self.get_meta(META_IMPORT_FILE)}

    def _stage_batch(self, entries, digest, staged, progress):
        """Stage `entries` in transactions of IMPORT_CHUNK_SECONDS (each retried whole, so it
        reads only this list); `staged` plus how many there were, said to `progress`."""
        done = 0
        while done < len(entries):
            if done:
                pause_between_chunks()
            done += self._execute_write(lambda conn: _stage_chunk(
                conn, digest, lambda: self._write_import(
                    conn, entries[done:], self.IMPORT_CHUNK_SECONDS, staged=True)))
        if progress:
            progress.update(staged + done, unit="sessions")
        return staged + done

    def _publish_staging(self, conn, digest):
        """Inside the last write: the staged sessions into `sessions` (a title or an id taken
        meanwhile as import_sessions takes them), links attached; import_sessions' answer."""
        _check_staging(conn, digest)
        table = IMPORT_STAGING_TABLE
        taken = conn.execute(f"SELECT st.id, st.title FROM {table} AS st JOIN sessions AS s"
                             " ON s.title = st.title WHERE st.hs_skipped = 0").fetchall()
        for session_id, title in taken:
            conn.execute(f"UPDATE {table} SET title = :title WHERE id = :id",
                         {"title": _free_title(conn, title, session_id, True), "id": session_id})
        conn.execute(f"UPDATE {table} SET hs_skipped = 1 WHERE hs_skipped = 0"
                     " AND id IN (SELECT id FROM sessions)")
        staged = set(live_columns(conn, table))
        names = ", ".join(quote_identifier(column) for column in live_columns(conn, "sessions")
                          if column in staged and column != "parent_session_id")
        imported = conn.execute(f"INSERT INTO sessions ({names}) SELECT {names} FROM {table}"
                                " WHERE hs_skipped = 0 ORDER BY rowid").rowcount
        links = conn.execute(f"SELECT id, hs_parent, hs_skipped FROM {table}"
                             " WHERE hs_parent IS NOT NULL ORDER BY rowid").fetchall()
        _attach_parents(conn, [(child, parent) for child, parent, skip in links if skip])
        detached = _attach_parents(conn, [(child, parent) for child, parent, skip in links
                                          if not skip])
        skipped = conn.execute(f"SELECT COUNT(*) FROM {table} WHERE hs_skipped = 1").fetchone()[0]
        unstored = json.loads(read_meta(conn, META_IMPORT_UNSTORED) or "[]")
        _drop_staging(conn)
        return dict({"ok": True, "imported": imported, "skipped": skipped, "detached": detached,
                     "errors": []}, **({"unstored_fields": unstored} if unstored else {}))

    def _discard_staging_chunk(self, conn):
        """Inside a write: SQL_CHUNK_SIZE staged sessions' messages handed to the deleted-message
        sweep, the sessions forgotten; False once the staging is gone."""
        rows = conn.execute(f"SELECT id, hs_skipped FROM {IMPORT_STAGING_TABLE} LIMIT :n",
                            {"n": SQL_CHUNK_SIZE}).fetchall()
        if not rows:
            _drop_staging(conn)
            conn.execute(DELETE_UNUSED_PROMPTS_SQL)
            return False
        self._sweep_later(conn, [session_id for session_id, skipped in rows if not skipped])
        conn.execute(f"DELETE FROM {IMPORT_STAGING_TABLE} WHERE id IN"
                     f" ({placeholders(len(rows))})", [row[0] for row in rows])
        return True

    # -- another agent's history (hermes-agent 0.22's desktop importer) ---------------------------

    def find_foreign_import(self, origin):
        """The id of the session an earlier import_foreign_history (or hermes-agent's own
        `import_foreign_session`) made of `origin`, else None: same tool, and the same foreign
        session id, or the same file when `origin` has none. Raises ValueError for an `origin`
        that is not such an object."""
        _check_origin(origin)
        return self._with_reader(lambda conn: _foreign_import_of(conn, origin))

    def import_foreign_history(self, origin, messages, *, title, cwd, profile):
        """Make a session of another agent's transcript (`origin`: {"tool", "path",
        "foreign_session_id"}, `messages`: role/content dicts), labelled `profile`, in one write
        transaction, so that two clicks at once make one: {"session_id": the new id,
        "already_imported": False}, or the earlier import's id and True. The session's source is
        the tool, its origin_json {"imported_from": origin}; a title another session holds gets
        " (<id tail>)", as hermes-agent 0.22 names it. The payload is checked as import_sessions
        checks one; its first error is raised as ValueError, nothing written."""
        _check_origin(origin)
        session_id = new_session_id(hex_len=12)  # imports mint many a second
        entry = {"id": session_id, "source": origin["tool"], "title": title, "cwd": cwd,
                 "messages": messages}
        errors = validate_import([entry], self.import_limits())
        if errors:
            raise ValueError(errors[0]["error"])

        def write(conn):
            earlier = _foreign_import_of(conn, origin)
            if earlier is not None:
                return {"session_id": earlier, "already_imported": True}
            wanted = _import_title(title)
            if wanted is not None and conn.execute(SELECT_TITLE_OWNER_SQL,
                                                   (wanted, session_id)).fetchone():
                tail = f" ({session_id[-12:]})"
                wanted = normalize_title(wanted[:TITLE_MAX_LENGTH - len(tail)] + tail)
            self._write_import(conn, [dict(entry, title=wanted)])
            conn.execute("UPDATE sessions SET origin_json = :origin, profile_name = :profile"
                         " WHERE id = :id", {"origin": json.dumps({"imported_from": origin}),
                                             "profile": profile, "id": session_id})
            return {"session_id": session_id, "already_imported": False}
        return self._execute_write(write)

    def _write_import(self, conn, sessions, seconds=None, staged=False):
        """Inside a write: store these sessions, from the first, taking no further one after
        `seconds`; (imported ids, skipped ids, parent links, links a skipped session still
        lacks, unstored fields). `staged`: the rows go to IMPORT_STAGING_TABLE (a skipped id as a
        mark; one staged already counts as skipped), in chunks small enough for the usual cache."""
        with contextlib.nullcontext() if staged else _import_cache(conn):
            held = self._hold_back_index_triggers(conn)
            after = staged and conn.execute("SELECT MAX(id) FROM messages").fetchone()[0] or 0
            result = self._write_import_rows(conn, sessions, seconds, staged)
            self._index_held_back_rows(conn, held)
            if staged:
                self._index_staged_trigram_rows(conn, IMPORT_STAGING_TABLE, after)
            return result

    def _write_import_rows(self, conn, sessions, seconds, staged):
        columns = {table: set(live_columns(conn, table)) for table in ("sessions", "messages")}
        imported, skipped, links, relinks, unstored = [], [], [], [], set()
        target = IMPORT_STAGING_TABLE if staged else "sessions"
        started = time.monotonic()
        for entry in sessions:
            if seconds is not None and imported + skipped and time.monotonic() - started > seconds:
                break
            session_id = import_id(entry)
            parent = str(entry.get("parent_session_id") or "").strip()
            if staged and conn.execute(f"SELECT 1 FROM {target} WHERE id = ?",
                                       (session_id,)).fetchone():
                skipped.append(session_id)  # staged by an earlier run of this file
                continue
            stored = conn.execute("SELECT parent_session_id FROM sessions WHERE id = ?",
                                  (session_id,)).fetchone()
            if stored:
                skipped.append(session_id)
                if parent and stored[0] is None:
                    relinks.append((session_id, parent))
                if staged:  # counted, and its missing link attached, at the end
                    conn.execute(f"INSERT INTO {target} (id, hs_parent, hs_skipped) VALUES (:id,"
                                 " :parent, 1)", {"id": session_id, "parent": stored[0] is None
                                                  and parent or None})
                continue
            row = _session_row(entry, session_id, columns["sessions"], unstored)
            row["title"] = _free_title(conn, row["title"], session_id, staged)
            prompt = entry.get("system_prompt")
            if prompt is not None:
                row["system_prompt_hash"] = prompt_hash(prompt)
                conn.execute(INSERT_SYSTEM_PROMPT_SQL, (row["system_prompt_hash"], prompt))
            messages = functools.partial(self._import_messages, conn, entry.get("messages")
                                         or [], session_id, columns["messages"], unstored)
            if staged:  # a staged row carries its messages' counts (the trigram rows: below)
                row["message_count"], row["tool_call_count"] = messages()
                row.update(hs_parent=parent or None, hs_skipped=0)
            # The row's names and its values come from the one dict, in its order.
            names = ", ".join(map(quote_identifier, row))
            conn.execute(f"INSERT INTO {target} ({names}) VALUES ({placeholders(len(row))})",
                         tuple(row.values()))
            if not staged:  # after the session's row, which the trigram index's trigger asks
                conn.execute(SET_MESSAGE_COUNTS_SQL, (*messages(), session_id))
            imported.append(session_id)
            if parent:
                links.append((session_id, parent))
        return imported, skipped, links, relinks, unstored

    def _import_messages(self, conn, messages, session_id, columns, unstored):
        """Insert a validated entry's messages as append_messages_batch does, put back what it
        does not write (rewound rows, carried columns); (message_count, tool_call_count)."""
        copies = [dict(message, content=from_portable(message.get("content")),
                       token_count=_number(message.get("token_count"), int),
                       timestamp=_number(message.get("timestamp"), float),
                       **{field: loads_or(message[field], message[field])
                          for field in REASONING_JSON_FIELDS
                          if isinstance(message.get(field), str)})
                  for message in messages]
        self._insert_message_rows(conn, session_id, copies)
        live = calls = 0
        for message in copies:
            if _number(message.get("active"), int, 1):
                live, calls = live + 1, calls + count_tool_calls(message.get("tool_calls"))
            else:
                compacted = 1 if _number(message.get("compacted"), int, 0) else 0
                conn.execute("UPDATE messages SET active = 0, compacted = ? WHERE id = ?",
                             (compacted, message["_row_id"]))
            # (the subset test runs in C: most messages carry nothing)
            carried = not message.keys() <= MESSAGE_RULED_FIELDS and _carry(
                {}, message, MESSAGE_RULED_FIELDS, columns, "messages", unstored)
            if carried:
                assignments = ", ".join(f"{quote_identifier(column)} = ?" for column in carried)
                conn.execute(f"UPDATE messages SET {assignments} WHERE id = ?",
                             (*carried.values(), message["_row_id"]))
        return live, calls


# -- a file import's two passes and its staging ----------------------------------------------

# A file import's session rows while it runs, out of every reader's sight: `sessions`' columns,
IMPORT_STAGING_TABLE = "hs_import_sessions"  # hs_parent (a link to attach), hs_skipped (an id had)
META_IMPORT_FILE = "hs_import_file"  # the digest of the file staged
META_IMPORT_UNSTORED = "hs_import_unstored"  # fields it had no column for, as a JSON list
# The longest line read: 5 MB of compact JSON a session, six times that in escapes (\u0001).
IMPORT_LINE_BYTES = 6 * 5 * 1024 * 1024 + 1024
# Lines parsed ahead of the writes, at most: what pass 2 holds in memory beside SQLite's cache.
IMPORT_BATCH_BYTES = 4 * 1024 * 1024
# A rejected file: the errors listed before the check stops reading.
IMPORT_ERRORS_SHOWN = 20


def jsonl_entries(handle, name, on_line=None):
    """(line number, value, bytes) of each non-blank line of a binary stream; `on_line(raw)` sees
    every line first. ValueError names a line (`name`:N) that cannot be read."""
    for number in itertools.count(1):
        raw = handle.readline(IMPORT_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) > IMPORT_LINE_BYTES and not raw.endswith(b"\n"):
            raise ValueError(f"{name}:{number}: the line is longer than {IMPORT_LINE_BYTES:,} "
                             "bytes; one session is at most 5 MB")
        if on_line is not None:
            on_line(raw)
        try:  # decoded a line at a time, so a bad byte is named by its line too
            line = raw.decode("utf-8")
            if line.strip():
                yield number, json.loads(line), len(raw)
        except RecursionError:
            raise ValueError(f"{name}:{number}: JSON nested too deep to read") from None
        except UnicodeDecodeError as exc:
            where = f"{exc.reason} at byte {exc.start + 1}"
            raise ValueError(f"{name}:{number}: not UTF-8 ({where})") from None
        except ValueError as exc:
            raise ValueError(f"{name}:{number}: not JSON ({exc})") from None


def check_import_file(handle, name, limits, copy=None, on_bytes=None):
    """Pass 1 of a file import, reading `handle` once (also into `copy`), holding one line and
    the ids: (digest, sessions, the first IMPORT_ERRORS_SHOWN rejected entries as {"line",
    "error", "session_id"?}) by import_limits() but its totals; `on_bytes(bytes read)` after
    each line. ValueError for a line that cannot be read (jsonl_entries)."""
    import hashlib  # here, not at import: OpenSSL's start-up, for a file import only
    digest, read = hashlib.blake2b(digest_size=16), [0]

    def seen_line(raw):
        digest.update(raw)
        read[0] += copy.write(raw) if copy is not None else len(raw)
        return on_bytes and on_bytes(read[0])
    limits = dict(limits, total_messages=float("inf"), total_bytes=float("inf"))
    numbered = ((number, entry) for number, entry, _size in jsonl_entries(handle, name, seen_line))
    seen = set()
    errors = list(itertools.islice(entry_errors(numbered, limits, seen, "line"),
                                   IMPORT_ERRORS_SHOWN))
    return digest.hexdigest(), len(seen), errors


def _open_staging(conn, digest):
    """Inside a write: how many sessions an earlier run of the file `digest` staged (0 for a new
    staging, made now); None while another file's staging is there."""
    table = IMPORT_STAGING_TABLE
    if conn.execute(TABLE_EXISTS_SQL, (table,)).fetchone():
        found = read_meta(conn, META_IMPORT_FILE) == digest
        return conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] if found else None
    # The columns of `sessions` with their types and defaults, without its constraints.
    columns = [f"{quote_identifier(name)} {kind}" + (f" DEFAULT {default}" if default else "")
               for _cid, name, kind, _notnull, default, _pk in conn.execute(
                   "SELECT * FROM pragma_table_info('sessions')")]
    conn.execute(f"CREATE TABLE {table} ({', '.join(columns)}, hs_parent TEXT, hs_skipped INTEGER)")
    conn.execute(f"CREATE UNIQUE INDEX {table}_id ON {table}(id)")
    conn.execute(f"CREATE INDEX {table}_title ON {table}(title)")
    write_meta(conn, META_IMPORT_FILE, digest)
    return 0


def _check_staging(conn, digest):
    if read_meta(conn, META_IMPORT_FILE) != digest:  # (the key goes with the table)
        raise RuntimeError("this import's staged rows are gone (another program dropped them); "
                           "run the import again")


def _stage_chunk(conn, digest, write):
    """Inside a write: `write()`'s sessions staged; how many entries it took."""
    _check_staging(conn, digest)
    imported, skipped, _links, _relinks, unstored = write()
    if unstored:
        known = set(json.loads(read_meta(conn, META_IMPORT_UNSTORED) or "[]"))
        write_meta(conn, META_IMPORT_UNSTORED, json.dumps(sorted(known | unstored)))
    return len(imported) + len(skipped)


def _drop_staging(conn):
    conn.execute(f"DROP TABLE {IMPORT_STAGING_TABLE}")
    write_meta(conn, META_IMPORT_FILE, None)
    write_meta(conn, META_IMPORT_UNSTORED, None)


def _check_origin(origin):
    if not isinstance(origin, dict) or not isinstance(origin.get("tool"), str):
        raise ValueError("origin must be an object with a 'tool' string")


def _foreign_import_of(conn, origin):
    """find_foreign_import on `conn`: the first session of the tool whose origin_json names
    `origin` (its foreign session id, else its path)."""
    foreign_id = origin.get("foreign_session_id")
    rows = conn.execute("SELECT id, origin_json FROM sessions"
                        " WHERE source = ? AND origin_json IS NOT NULL", (origin["tool"],))
    for session_id, origin_json in rows:
        imported = loads_or(origin_json, None)
        imported = imported.get("imported_from") if isinstance(imported, dict) else None
        if not isinstance(imported, dict) or imported.get("tool") != origin["tool"]:
            continue
        if (imported.get("foreign_session_id") == foreign_id if foreign_id
                else imported.get("path") == origin.get("path")):
            return session_id
    return None


# An import's megabytes of rows and index pages spill from SQLite's default 2 MB page cache to the
# WAL before the commit, many to be written again: it runs with at least this much, then the
# connection's own size again (dirty pages stay until the commit).
IMPORT_CACHE_KIB = 64 * 1024


@contextlib.contextmanager
def _import_cache(conn):
    size = conn.execute("PRAGMA cache_size").fetchone()[0]
    held = -size * 1024 if size < 0 else size * conn.execute("PRAGMA page_size").fetchone()[0]
    if held < IMPORT_CACHE_KIB * 1024:
        conn.execute(f"PRAGMA cache_size = {-IMPORT_CACHE_KIB}")
    try:
        yield
    finally:
        if held < IMPORT_CACHE_KIB * 1024:
            conn.execute(f"PRAGMA cache_size = {int(size)}")


# Past this many characters an id is shortened in a title suffix, to leave room for the title.
TITLE_SUFFIX_ID_CHARS = 40


def _free_title(conn, title, session_id, staged=False):
    """A title no other session holds (nor, `staged`, a staged one): `title`, else "title [id]",
    else "title [id] (2)", (3), ...; each cut to fit TITLE_MAX_LENGTH. None stays None."""
    tag = session_id
    if len(session_id) > TITLE_SUFFIX_ID_CHARS:
        tag = session_id[:TITLE_SUFFIX_ID_CHARS] + "…"
    candidate, number = title, 1
    while candidate is not None and (
            conn.execute(SELECT_TITLE_OWNER_SQL, (candidate, session_id)).fetchone()
            or staged and conn.execute(
                f"SELECT 1 FROM {IMPORT_STAGING_TABLE} WHERE title = :title AND id <> :id",
                {"id": session_id, "title": candidate}).fetchone()):
        suffix = f" [{tag}]" if number == 1 else f" [{tag}] ({number})"
        candidate = normalize_title(title[:max(0, TITLE_MAX_LENGTH - len(suffix))] + suffix)
        number += 1
    return candidate


def _finish_import(conn, found):
    """Attach an import's parent links in one write; import_sessions' answer for what it stored."""
    imported, skipped, links, relinks, unstored = found
    _attach_parents(conn, relinks)  # left by a run cut short: attached where valid, never counted
    detached = _attach_parents(conn, links)
    result = {"ok": True, "imported": len(imported), "skipped": len(skipped), "detached": detached,
              "imported_ids": imported, "skipped_ids": skipped, "errors": []}
    if unstored:
        result["unstored_fields"] = sorted(unstored)
    return result
