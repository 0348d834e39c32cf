"""Message identity: the codec between a message dict's identity keys and the columns hermes-agent
0.22 (schema 31) keeps them in: `message_uid`, `absorbed_message_uids`, `tool_call_uids`,
`tool_call_uid`.

Pure functions over dicts and rows; never opens a store. A row read from a store without those
columns (schema 26) has no identity, and nothing here fails on it. The live keys are hermes-agent's
(agent.message_metadata), so dicts pass between its code and ours unchanged.
"""

import json
import uuid

from hermes_state_common import loads_or

# A message dict's identity keys, as hermes-agent names them.
MESSAGE_UID = "message_uid"
ABSORBED_MESSAGE_UIDS = "_absorbed_message_uids"
TOOL_CALL_UIDS = "_tool_call_uids"
TOOL_CALL_UID = "_tool_call_uid"
# The columns they are stored in, in the order a message write names them.
IDENTITY_COLUMNS = ("message_uid", "absorbed_message_uids", "tool_call_uids", "tool_call_uid")


def mint_uid():
    """A fresh durable id: random, never derived from content (two messages may share it all)."""
    return uuid.uuid4().hex


def _column(row, name):
    """`row[name]`, or None where the row (a sqlite3.Row or a dict) has no such column."""
    keys = row.keys()
    return row[name] if name in keys else None


def _live_or_column(message, live_key, column):
    # Live dicts carry hermes-agent's key; exported rows and import payloads the column name.
    return message.get(live_key) if live_key in message else message.get(column)


def uid_list(value):
    """The unique non-empty string uids of a list (or of its JSON text), in order; else []."""
    if isinstance(value, str):
        value = loads_or(value, [])
    if not isinstance(value, list):
        return []
    return list(dict.fromkeys(uid for uid in value if isinstance(uid, str) and uid))


def uid_map(value):
    """{tool call id: uid} from a dict (or its JSON text): a uid is a non-empty string, or a list of
    them when one provider id repeats inside a row; other entries are dropped, a non-map is {}."""
    if isinstance(value, str):
        value = loads_or(value, {})
    if not isinstance(value, dict):
        return {}

    def is_uid(uid):
        return isinstance(uid, str) and uid != ""
    return {key: uid for key, uid in value.items() if isinstance(key, str) and key and (
        is_uid(uid) or (isinstance(uid, list) and uid and all(map(is_uid, uid))))}


def tool_call_key(call):
    """A tool call's pairing id: `call_id` before `id` (Codex), the part before a `|`; '' for none."""
    for name in ("call_id", "id"):
        raw = call.get(name) if isinstance(call, dict) else getattr(call, name, None)
        value = raw.strip() if isinstance(raw, str) else ""
        if value:
            return value.split("|", 1)[0].strip() or value
    return ""


def stamp_identity(message, tool_calls, calls_seen):
    """Before an insert: mint the dict's message_uid when it has none, and a uid for each of an
    assistant's tool calls without one; a tool result takes the uid its call got earlier in the
    same write (`calls_seen`, {call id: uid}, which a user turn empties)."""
    if not (isinstance(message.get(MESSAGE_UID), str) and message[MESSAGE_UID]):
        message[MESSAGE_UID] = mint_uid()
    role = message.get("role")
    if role == "assistant" and isinstance(tool_calls, list) and tool_calls:
        uids = uid_map(_live_or_column(message, TOOL_CALL_UIDS, "tool_call_uids"))
        for call in tool_calls:
            key = tool_call_key(call)
            if key and key not in uids:
                uids[key] = mint_uid()  # a repeat of one id in a response shares it
        if uids:
            message[TOOL_CALL_UIDS] = uids
            calls_seen.update({key: uid if isinstance(uid, str) else uid[-1]
                               for key, uid in uids.items()})
    elif role == "user":
        calls_seen.clear()  # a result never pairs across a user turn
    elif role == "tool" and not _live_or_column(message, TOOL_CALL_UID, "tool_call_uid"):
        uid = calls_seen.get(message.get("tool_call_id"))
        if uid:
            message[TOOL_CALL_UID] = uid


def identity_values(message):
    """{column: stored value} of IDENTITY_COLUMNS for a message dict; None where it has none."""
    uid = message.get(MESSAGE_UID)
    absorbed = uid_list(_live_or_column(message, ABSORBED_MESSAGE_UIDS, "absorbed_message_uids"))
    calls = uid_map(_live_or_column(message, TOOL_CALL_UIDS, "tool_call_uids"))
    call_uid = _live_or_column(message, TOOL_CALL_UID, "tool_call_uid")
    return {
        "message_uid": uid if isinstance(uid, str) and uid else None,
        "absorbed_message_uids": json.dumps(absorbed) if absorbed else None,
        "tool_call_uids": json.dumps(calls, sort_keys=True) if calls else None,
        "tool_call_uid": call_uid if isinstance(call_uid, str) and call_uid else None,
    }


def _fill_missing_tool_call_uids(row, msg):
    """Before a row is rewritten from `msg`: the stored uid of each call `msg` still names but
    lost the uid of (a copy), so the rewrite keeps it; a call `msg` dropped keeps none."""
    stored = uid_map(_column(row, "tool_call_uids"))
    calls = msg.get("tool_calls")
    if not stored or not isinstance(calls, list):
        return
    live = msg.get(TOOL_CALL_UIDS)
    live = live if isinstance(live, dict) else {}
    named = {tool_call_key(call) for call in calls}
    missing = {key: uid for key, uid in stored.items() if key in named and key not in live}
    if missing:
        msg[TOOL_CALL_UIDS] = {**live, **missing}


def _restore_row_identity(row, msg):
    """A stored row's message_uid and tool call uids onto its dict; the stored value wins, except
    a live per-occurrence list that starts with the stored uids (a merge not yet written)."""
    uid = _column(row, "message_uid")
    if uid:
        msg[MESSAGE_UID] = uid
    stored = uid_map(_column(row, "tool_call_uids"))
    if stored:
        live = msg.get(TOOL_CALL_UIDS)
        live = live if isinstance(live, dict) else {}

        def extends(live_uid, stored_uid):
            head = stored_uid if isinstance(stored_uid, list) else [stored_uid]
            return isinstance(live_uid, list) and live_uid[:len(head)] == head
        msg[TOOL_CALL_UIDS] = {**live, **{key: uid for key, uid in stored.items()
                                          if not extends(live.get(key), uid)}}
    call_uid = _column(row, "tool_call_uid")
    if call_uid:
        msg[TOOL_CALL_UID] = call_uid


def restore_identity_columns(row, msg):
    """_restore_row_identity, and the uids of the rows a merged turn absorbed."""
    _restore_row_identity(row, msg)
    absorbed = uid_list(_column(row, "absorbed_message_uids"))
    if absorbed:
        msg[ABSORBED_MESSAGE_UIDS] = absorbed
