"""Held-row coverage for in-place compaction: which stored rows a compressor really held.

An in-place compaction (archive_and_compact) archives as summarised only the rows the compressor
was handed. It names them by row id where the dicts carry one; this module names the rest: carried
dicts (copied verbatim after the summary, by row id or by a unique identity and timestamp), held
dicts without an id, user rows an alternation repair merged into one dict, and rows it dropped
or folded. When a stored row the compressor held cannot be named, it answers None and the
compaction falls back to its watermark. Reads only, on the writer's connection inside its
transaction; never writes a row, never opens a store.

The dict keys are hermes-agent 0.22's (agent.conversation_compression_archive,
agent.context_compressor), so its compressor's dicts are read as it writes them.
"""

import json
import math
import re

from hermes_state_common import decode_content, encode_content, loads_or
from hermes_state_identity import loaded_view_content

# Keys hermes-agent's compressor puts on a held dict.
ABSORBED_ROW_IDS = "_absorbed_row_ids"  # row ids a repair merged into this dict
MERGED_DURABLE_ROWS = "_merged_durable_rows"  # how many stored user rows the dict joins
UNNAMED_DURABLE_ROWS = "_unnamed_durable_rows"  # rows dropped or folded behind it, unnamed
RETIRED_DURABLE_ROWS = "_retired_durable_rows"  # what names those rows: role, content, call ids
RETIRED_ROW = "_retired_row"  # an entry of the list above, handed over as unresolved
OWN_ROW = "_own_row"  # that entry is the dict's own row (a fold rewrote its text)
DB_PERSISTED_MARKER = "_db_persisted"  # the dict was loaded from the store
# A gateway's timestamp prefix on a user turn ("[Tue 2026-04-28 13:40:53 CEST] " or an ISO time):
# a surface may render one after the repair, so a merged run is matched without them.
_TIMESTAMP_PREFIX = re.compile(
    r"^\[(?:[A-Z][a-z]{2} \d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?: [A-Za-z0-9_+\-/:]+)?"
    r"|\d{4}-\d{2}-\d{2}T[^\]]+)\]\s*")
_ACTIVE_ROWS_SQL = ("SELECT id, role, content, tool_call_id, tool_calls, timestamp FROM messages"
                    " WHERE session_id = :session_id AND active = 1{bound} ORDER BY id")


class SessionCoverageMixin:
    """SessionDB's held-row coverage for archive_and_compact (compression mixin).

    Relies on nothing of SessionDB but the connection it is handed."""

    def _resolve_carried_row_ids(self, conn, session_id, carried_messages):
        """Ids of the live rows the carried dicts copy verbatim: a dict's `_row_id` while that row
        still holds the same message, else the one live row with its identity and timestamp.
        A dict that matches no row or several is left out (its original stays compacted)."""
        carried = [(_identity(message), _positive_id(message.get("_row_id")),
                    _epoch(message.get("timestamp")))
                   for message in carried_messages or () if isinstance(message, dict)]
        if not carried:
            return []
        by_id, by_key = {}, {}
        for row in _live_rows(conn, session_id, None):
            identity = _row_identity(row)
            by_id[row["id"]] = identity
            stamp = _epoch(row["timestamp"])
            if stamp is not None:
                by_key.setdefault((identity, stamp), []).append(row["id"])
        resolved = []
        for identity, row_id, stamp in carried:
            if row_id is not None and by_id.get(row_id) == identity:
                resolved.append(row_id)
            elif stamp is not None and len(by_key.get((identity, stamp), ())) == 1:
                resolved.append(by_key[identity, stamp][0])
        return list(dict.fromkeys(resolved))

    def _proved_coverage(self, conn, session_id, covered_ids, unresolved_held, watermark=None):
        """(row ids safe to archive as summarised, ids merged into another held dict), or None
        when a stored row the compressor held cannot be named (no `covered_ids`; a dict loaded
        from the store matching no row or several; a merged or retired row not named once).
        A dict never stored names nothing and costs nothing. The second set leaves out rows a
        dict lists in `_absorbed_row_ids`: the caller counted those in tail_count."""
        if covered_ids is None:
            return None
        proved = [row_id for row_id in map(_positive_id, covered_ids) if row_id is not None]
        merged_away = set()
        for message in unresolved_held or ():
            if not isinstance(message, dict):
                continue
            if message.get(RETIRED_ROW):
                matches = _retired_matches(conn, session_id, message, watermark)
                if len(matches) != 1:
                    return None
                proved += matches
                if not message.get(OWN_ROW):  # another held dict stands for it in the tail
                    merged_away.update(matches)
                continue
            # A fold's combined text never was stored: its own row is named by its OWN_ROW entry.
            if any(isinstance(entry, dict) and entry.get(OWN_ROW)
                   for entry in message.get(RETIRED_DURABLE_ROWS) or ()):
                continue
            run = _merged_user_run(conn, session_id, message, watermark)
            if run is None or (message.get(MERGED_DURABLE_ROWS) and not run):
                return None  # stamped as merged, so stored: it must name its run
            matches = [] if run else _same_content_ids(conn, session_id, message)
            if len(matches) > 1 or (message.get(DB_PERSISTED_MARKER) and not run
                                    and len(matches) != 1):
                return None
            proved += matches or run
            merged_away.update(set(run[1:]) - set(message.get(ABSORBED_ROW_IDS) or ()))
        return list(dict.fromkeys(proved)), merged_away

    @staticmethod
    def _uncounted_merged_rows(tail):
        """Stored rows behind the carried `tail` dicts beyond one each, which tail_count does not
        count: a merged run past its listed `_absorbed_row_ids`, and rows dropped or folded behind
        a dict. A dict with a `_row_id` was written back as one row and stands for itself."""
        def behind(message):
            merged, unnamed = message.get(MERGED_DURABLE_ROWS), message.get(UNNAMED_DURABLE_ROWS)
            unlisted = (merged - 1 - len(message.get(ABSORBED_ROW_IDS) or ())
                        if type(merged) is int else 0)
            return max(0, unlisted) + (unnamed if type(unnamed) is int else 0)
        return sum(behind(message) for message in tail
                   if isinstance(message, dict) and not isinstance(message.get("_row_id"), int))

    @staticmethod
    def _tail_originals(covered_active, tail_count, merged_away):
        """The newest covered rows behind `tail_count` carried dicts, widened by each row in the
        window that a merge folded into another dict."""
        width = int(tail_count)
        while True:
            window = covered_active[-width:]
            need = int(tail_count) + sum(1 for row_id in window if row_id in merged_away)
            if need <= width or width >= len(covered_active):
                return window
            width = need


def _positive_id(value):
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _epoch(value):
    """A timestamp as float seconds; None when unset or not a finite number."""
    if value is None or value == "" or isinstance(value, bool):
        return None
    try:
        stamp = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer past a float
        return None
    return stamp if math.isfinite(stamp) else None


def _calls(value):
    calls = loads_or(value, None) if isinstance(value, str) else value
    return json.dumps(calls) if calls else None


def _identity(message):
    """(role, stored content, tool_call_id, tool calls) of a message dict, as its row holds them."""
    role = message.get("role", "unknown")
    return (role, encode_content(loaded_view_content(role, message.get("content"))),
            message.get("tool_call_id"), _calls(message.get("tool_calls")))


def _row_identity(row):
    return _identity({"role": row["role"], "content": decode_content(row["content"]),
                      "tool_call_id": row["tool_call_id"], "tool_calls": row["tool_calls"]})


def _same_content_ids(conn, session_id, message):
    """Live rows of the session with the dict's role and stored content; [] for non-text."""
    content = message.get("content")
    if not isinstance(content, str):
        return []
    stored = encode_content(loaded_view_content(message.get("role", "unknown"), content))
    return [row[0] for row in conn.execute(
        "SELECT id FROM messages WHERE session_id = ? AND active = 1 AND role = ? AND content = ?",
        (session_id, message.get("role"), stored))]


def _live_rows(conn, session_id, watermark, role=None):
    """The session's live rows up to `watermark` (all without one), optionally of one role: a
    repair ran on a load taken before the snapshot, so a later equal row is another surface's."""
    bound = ("" if watermark is None else " AND id <= :watermark") + (
        "" if role is None else " AND role = :role")
    return conn.execute(_ACTIVE_ROWS_SQL.format(bound=bound),
                        {"session_id": session_id, "watermark": watermark, "role": role})


def _retired_matches(conn, session_id, retired, watermark):
    """Live rows equal to a row the repair retired without an id: role, loaded content (an empty
    assistant text is None or ""), tool_call_id and its calls' ids, at or below the watermark."""
    role = str(retired.get("role") or "")
    want_calls = list(retired.get("tool_call_ids") or ())
    matches = []
    for row in _live_rows(conn, session_id, watermark, role):
        content = loaded_view_content(role, decode_content(row["content"]))
        calls = loads_or(row["tool_calls"], None) if row["tool_calls"] else None
        call_ids = ([call.get("id") for call in calls if isinstance(call, dict)]
                    if isinstance(calls, list) else [])
        if ((content or None) == (retired.get("content") or None)
                and (row["tool_call_id"] or None) == (retired.get("tool_call_id") or None)
                and call_ids == want_calls):
            matches.append(row["id"])
    return matches


def _merged_user_run(conn, session_id, message, watermark):
    """The live user rows an alternation repair joined into `message` (a user dict stamped with
    `_merged_durable_rows` = n >= 2): [] for no such dict or no run, None when the run or a row
    it skipped is ambiguous. The run is n adjacent user rows at or below the watermark whose
    texts, joined by blank lines, equal the dict's (without a gateway timestamp prefix); rows
    the repair dropped between them (named in `_retired_durable_rows`) are skipped."""
    content, width = message.get("content"), message.get(MERGED_DURABLE_ROWS)
    if (message.get("role") != "user" or not isinstance(content, str)
            or type(width) is not int or width < 2):
        return []
    while _TIMESTAMP_PREFIX.match(content):
        content = content[_TIMESTAMP_PREFIX.match(content).end():]
    skipped = set()
    for retired in message.get(RETIRED_DURABLE_ROWS) or ():
        if retired.get(OWN_ROW):
            continue
        matches = _retired_matches(conn, session_id, retired, watermark)
        if len(matches) != 1:
            return None
        skipped.update(matches)
    rows = [(row["id"], row["role"],
             loaded_view_content(row["role"], decode_content(row["content"])))
            for row in _live_rows(conn, session_id, watermark) if row["id"] not in skipped]
    runs = []
    for start in range(len(rows)):
        joined = ""
        for end in range(start, len(rows)):
            _row_id, role, part = rows[end]
            if role != "user" or not isinstance(part, str):
                break
            joined = f"{joined}\n\n{part}" if joined and part else (joined or part)
            if not content.startswith(joined):
                break
            if end - start + 1 == width:
                if joined == content:
                    runs.append([row[0] for row in rows[start:end + 1]])
                break
    if len(runs) > 1:
        return None
    return runs[0] if runs else []
