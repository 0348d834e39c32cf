"""The transcript: append, read back, conversation shape, rewind and restore.

Owns message rows and the session counters that move with them in the same
transaction. Relies on SessionDB's write and read paths; the search indexes
follow by trigger and by `_maintain_search`. Never edits a session's other
fields.
"""

import time

from hermes_state_common import (
    BUMP_MESSAGE_COUNTS_SQL,
    BUMP_REWIND_COUNT_SQL,
    COUNT_ACTIVE_MESSAGES_SQL,
    COUNT_SESSION_MESSAGES_SQL,
    DEACTIVATE_AFTER_SQL,
    INSERT_MESSAGE_SQL,
    MESSAGE_JSON_FIELDS,
    MESSAGE_WRITE_COLUMNS,
    REACTIVATE_SQL,
    SELECT_ACTIVE_COUNT_INPUTS_SQL,
    SELECT_MESSAGES_SQL,
    SELECT_MESSAGE_OWNER_SQL,
    SET_MESSAGE_COUNTS_SQL,
    count_tool_calls,
    decode_message,
    json_text,
    require_int,
    require_text,
)


class SessionMessagesMixin:
    """SessionDB's methods for the transcript."""

    def append_message(self, session_id, role, content=None, tool_name=None, tool_calls=None,
                       tool_call_id=None, token_count=None, finish_reason=None, reasoning=None,
                       reasoning_content=None, reasoning_details=None, codex_reasoning_items=None,
                       codex_message_items=None, platform_message_id=None, api_content=None,
                       display_kind=None, display_metadata=None, effect_disposition=None,
                       timestamp=None):
        """Append one message and return its id; the session's counts move in the same transaction."""
        fields = dict(locals())
        del fields["self"], fields["session_id"]
        row, calls = _message_row(session_id, fields)

        def write(conn):
            message_id = conn.execute(INSERT_MESSAGE_SQL, row).lastrowid
            _bump_counts(conn, session_id, 1, calls)
            return message_id

        return self._execute_write(write)

    def append_messages_batch(self, session_id, messages):
        """Append many messages (dicts of append_message's arguments) in one transaction."""
        if not isinstance(messages, (list, tuple)):
            raise ValueError("messages must be a list of dicts")
        rows, calls = [], 0
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ValueError(f"messages[{index}] must be a dict")
            try:
                row, n = _message_row(session_id, message)
            except ValueError as exc:
                raise ValueError(f"messages[{index}]: {exc}") from None
            rows.append(row)
            calls += n
        if not rows:
            return 0

        def write(conn):
            conn.executemany(INSERT_MESSAGE_SQL, rows)
            _bump_counts(conn, session_id, len(rows), calls)
            return len(rows)

        return self._execute_write(write)

    def get_messages(self, session_id, include_inactive=False, limit=None, offset=0, after_id=None):
        """A session's messages in id order, `tool_calls` decoded; active ones unless asked."""
        sql, params = SELECT_MESSAGES_SQL, [session_id]
        if not include_inactive:
            sql += " AND active = 1"
        if after_id is not None:
            sql, params = sql + " AND id > ?", params + [require_int("after_id", after_id)]
        sql += " ORDER BY id"
        if limit is not None or offset:
            sql += " LIMIT ? OFFSET ?"
            params += [require_int("limit", limit, allow_none=True) or -1, require_int("offset", offset)]
        return [decode_message(row) for row in self._read_all(sql, params)]

    def get_messages_as_conversation(self, session_id):
        """Active messages as chat-API dicts: role, content, and tool_calls/tool_call_id when set."""
        conversation = []
        for message in self.get_messages(session_id):
            turn = {"role": message["role"], "content": message["content"]}
            for key in ("tool_calls", "tool_call_id"):
                if message.get(key):
                    turn[key] = message[key]
            conversation.append(turn)
        return conversation

    def message_count(self, session_id=None):
        """Active messages in one session, or in the whole store."""
        if session_id is None:
            return self._read_value(COUNT_ACTIVE_MESSAGES_SQL)
        return self._read_value(COUNT_SESSION_MESSAGES_SQL, (session_id,))

    def rewind_to_message(self, session_id, target_message_id):
        """Deactivate every message after `target_message_id`; returns how many. Undo: restore_rewound."""
        require_int("target_message_id", target_message_id)

        def write(conn):
            owner = conn.execute(SELECT_MESSAGE_OWNER_SQL, (target_message_id,)).fetchone()
            if owner is None or owner[0] != session_id:
                raise ValueError(f"message {target_message_id} is not in session {session_id!r}")
            hidden = conn.execute(DEACTIVATE_AFTER_SQL, (session_id, target_message_id)).rowcount
            if hidden:
                conn.execute(BUMP_REWIND_COUNT_SQL, (session_id,))
                _recount(conn, session_id)
            return hidden

        return self._execute_write(write)

    def restore_rewound(self, session_id):
        """Reactivate the messages a rewind hid; returns how many."""
        def write(conn):
            shown = conn.execute(REACTIVATE_SQL, (session_id,)).rowcount
            if shown:
                _recount(conn, session_id)
            return shown

        return self._execute_write(write)


def _message_row(session_id, fields):
    """Check one message's fields; returns (row in MESSAGE_WRITE_COLUMNS order, tool-call count)."""
    unknown = set(fields) - set(MESSAGE_WRITE_COLUMNS)
    if unknown:
        raise ValueError(f"unknown message field {sorted(unknown)[0]!r}")
    require_text("session_id", session_id)
    require_text("role", fields.get("role"))
    values = {}
    for column in MESSAGE_WRITE_COLUMNS[2:]:
        value = fields.get(column)
        if column in MESSAGE_JSON_FIELDS:
            value = json_text(column, value)
        elif column == "token_count":
            value = require_int("token_count", value, allow_none=True)
        elif column == "timestamp":
            value = time.time() if value is None else value
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError("timestamp must be a number (seconds since the epoch)")
        elif value is not None and not isinstance(value, str):
            raise ValueError(f"{column} must be a string or None")
        values[column] = value
    row = (session_id, fields["role"]) + tuple(values.values())
    return row, count_tool_calls(values["tool_calls"])


def _bump_counts(conn, session_id, messages, calls):
    if conn.execute(BUMP_MESSAGE_COUNTS_SQL, (messages, calls, session_id)).rowcount == 0:
        raise ValueError(f"unknown session_id {session_id!r}")


def _recount(conn, session_id):
    rows = conn.execute(SELECT_ACTIVE_COUNT_INPUTS_SQL, (session_id,)).fetchall()
    calls = sum(count_tool_calls(row["tool_calls"]) for row in rows)
    conn.execute(SET_MESSAGE_COUNTS_SQL, (len(rows), calls, session_id))
