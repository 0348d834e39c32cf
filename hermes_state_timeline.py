"""A session's prompt index and bounded jumps into its display history, for hermes-agent's web
sessions page: get_session_timeline lists the prompts a person typed, get_session_messages_around
reads a page of messages from one of them.

Functions over a SessionDB, read only: each reads one snapshot of the store and never writes.
The display history is get_messages(include_compacted=True)'s: live and compacted rows, each
message once (never rewound rows), ordered by each message's first row, whose id is the cursor.
"""

import operator
import re

from hermes_state_common import decode_content
from hermes_state_identity import split_user_turn
from hermes_state_messages import message_dict, one_per_generation

# A preview is cut to this many characters, the last an ellipsis.
PREVIEW_CHARS = 120
# User rows hermes-agent writes for its background work, not typed by a person.
_SYNTHETIC_PROMPT = re.compile(
    r"\s*(?:\[IMPORTANT: Background process |\[ASYNC (?:DELEGATION )?(?:BATCH )?COMPLETE\b"
    r"|A background fan-out of \d+ subagent\(s\) you dispatched earlier has finished\."
    r"|A background subagent you dispatched earlier has finished\.)", re.I)
# The columns one_per_generation and the previews read; a page reads whole rows.
_DISPLAY_COLUMNS = ("id, role, content, timestamp, tool_call_id, tool_calls, tool_name, active,"
                    " display_kind, display_metadata")


def get_session_messages_around(db, session_id, row_id, *, limit=120):
    """{"messages", "pagination"}: up to `limit` display messages (get_messages rows) from the
    prompt at row `row_id` on; None when that row is no prompt a person typed (or not shown).
    pagination: row_id, limit, returned, order "oldest", offset (messages before the page),
    total, has_older, has_newer."""
    def read(conn):
        anchor = conn.execute(
            "SELECT * FROM messages WHERE session_id = ? AND id = ? AND role = 'user'"
            " AND (active = 1 OR compacted = 1)", (session_id, row_id)).fetchone()
        if anchor is None or not _preview(anchor):
            return None
        shown = _display_rows(db, conn, session_id)
        start = next((i for i, (row, _) in enumerate(shown) if row["id"] == row_id), None)
        if start is None:
            return None
        page = [row["id"] for row, _ in shown[start:start + max(int(limit), 0)]]
        full = {row["id"]: row for row in conn.execute(
            f"SELECT * FROM messages WHERE id IN ({', '.join('?' * len(page))})", page)}
        return [full[i] for i in page], start, len(shown)
    found = _snapshot(db, read)
    if found is None:
        return None
    rows, offset, total = found
    messages = [message_dict(row) for row in rows]
    return {"messages": messages, "pagination": {
        "row_id": row_id, "limit": limit, "returned": len(messages), "order": "oldest",
        "offset": offset, "total": total, "has_older": offset > 0,
        "has_newer": offset + len(messages) < total}}


def get_session_timeline(db, session_id, *, limit=500, after_row_id=0):
    """{"entries", "pagination"}: the prompts a person typed, oldest first, each {"row_id" (the
    row get_session_messages_around takes), "preview" (whitespace collapsed, cut to
    PREVIEW_CHARS), "timestamp"}, after cursor `after_row_id`, at most `limit`. pagination:
    limit, after_row_id, returned, total (every prompt), has_more, next_cursor (None at the
    end)."""
    def read(conn):
        prompts = []
        for row, first_id in _display_rows(db, conn, session_id, users_only=True):
            preview = _preview(row)
            if preview:
                prompts.append((row, first_id, preview))
        return prompts
    prompts = _snapshot(db, read)
    later = [prompt for prompt in prompts if prompt[1] > after_row_id]
    page, has_more = later[:max(int(limit), 0)], len(later) > limit
    return {
        "entries": [{"row_id": row["id"], "preview": preview, "timestamp": row["timestamp"]}
                    for row, _, preview in page],
        "pagination": {"limit": limit, "after_row_id": after_row_id, "returned": len(page),
                       "total": len(prompts), "has_more": has_more,
                       "next_cursor": page[-1][1] if has_more else None},
    }


def _snapshot(db, read):
    """`read(conn)` inside one read transaction: counts and pages see the same generation."""
    def in_transaction(conn):
        conn.execute("BEGIN")
        try:
            return read(conn)
        finally:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
    return db._with_reader(in_transaction)


def _display_rows(db, conn, session_id, users_only=False):
    """[(the row shown for a message, the id of its first row)] of the display history."""
    summary = ", _compressed_summary" if "_compressed_summary" in db._write_columns() else ""
    rows = conn.execute(
        f"SELECT {_DISPLAY_COLUMNS}{summary} FROM messages WHERE session_id = ?"
        f" AND (active = 1 OR compacted = 1){' AND role = ?' if users_only else ''} ORDER BY id",
        (session_id, "user") if users_only else (session_id,)).fetchall()
    first_ids = {}
    shown = one_per_generation(rows, operator.getitem, first_ids)
    return [(row, first_ids[row["id"]]) for row in shown]


def _preview(row):
    """The one-line preview of a user row a person typed; '' for any other row."""
    message = {"role": row["role"], "content": decode_content(row["content"]),
               "display_kind": row["display_kind"]}
    if "_compressed_summary" in row.keys() and row["_compressed_summary"]:
        message["_compressed_summary"] = True
    turn = split_user_turn(message)[1]
    if turn is None:
        return ""
    content = turn["content"]
    if isinstance(content, list):
        content = " ".join(part if isinstance(part, str) else part.get("text", "")
                           for part in content if isinstance(part, (str, dict)))
    text = " ".join(content.split()) if isinstance(content, str) else ""
    if not text or _SYNTHETIC_PROMPT.match(text):
        return ""
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS - 1].rstrip() + "…"
