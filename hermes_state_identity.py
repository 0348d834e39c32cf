"""What a message is, apart from any store: a message dict as the values of the messages columns a
write names; the identity keys hermes-agent 0.22 (schema 31) keeps in `message_uid`,
`absorbed_message_uids`, `tool_call_uids` and `tool_call_uid`, both ways; a stored row's ownership
version (`row_snapshot`, 0.22's `_db_row_snapshot`); which part of a user row a person typed (a
compaction summary may carry the ask), which rewind and the timeline count; and the repair of a
conversation's turn alternation before it goes to a model (`repair_alternation_in_place`).

Pure functions over dicts and rows; never opens a store or runs SQL (the transcript mixin does).
A row of a store without the identity columns (schema 26) has no identity, and nothing here fails
on it. The live keys are hermes-agent's (agent.message_metadata), so dicts pass between its code
and ours unchanged.
"""

import functools
import json
import math
import operator
import re
import struct

from hermes_state_common import (
    MESSAGE_WRITE_COLUMNS, LazyModule, content_text, decode_content, decode_display_metadata,
    encode_content, host_is_020, loads_or, scrub_surrogates, sqlite_keeps,
)

hashlib = LazyModule("hashlib")  # (its OpenSSL start-up is the dearest of an import's modules)

# A message dict's identity keys, as hermes-agent names them.
MESSAGE_UID = "message_uid"
ABSORBED_MESSAGE_UIDS = "_absorbed_message_uids"
TOOL_CALL_UIDS = "_tool_call_uids"
TOOL_CALL_UID = "_tool_call_uid"
# The columns they are stored in, in the order a message write names them.
IDENTITY_COLUMNS = ("message_uid", "absorbed_message_uids", "tool_call_uids", "tool_call_uid")


# Every column a message write names on a store that has them all (schema 31), in 0.22's order.
ROW_WRITE_COLUMNS = (MESSAGE_WRITE_COLUMNS[:MESSAGE_WRITE_COLUMNS.index("active")]
                     + ("_compressed_summary",)
                     + MESSAGE_WRITE_COLUMNS[MESSAGE_WRITE_COLUMNS.index("active"):]
                     + ("display_identity",) + IDENTITY_COLUMNS)
# 0.22's ownership version of a stored row, which its flush (agent.transcript_repair) compares with
# the row it finds before it rewrites one: a digest of the payload columns a rewrite may change,
# leaving out identity, time and place (they never change on a rewrite) and what other writers of
# the same process update after a flush (reactions, display stamps, api_content, platform ids).
SNAPSHOT_COLUMNS = tuple(column for column in ROW_WRITE_COLUMNS if column not in {
    "session_id", "role", "timestamp", "active", "display_identity", "message_uid", "tool_call_uid",
    "display_kind", "display_metadata", "api_content", "codex_reasoning_items",
    "platform_message_id"})
_LENGTH = struct.Struct(">Q")  # a snapshot part's length prefix


def row_snapshot(stored):
    """The ownership version of a row ({column: stored value} of SNAPSHOT_COLUMNS)."""
    return snapshot_of([stored.get(column) for column in SNAPSHOT_COLUMNS])


def snapshot_of(values):
    """The ownership version of a row's SNAPSHOT_COLUMNS values, in that order (None for a column
    a store 0.20 left lacks): 16 bytes of BLAKE2b, hex, over each value tagged by its SQLite type
    and length-prefixed, as 0.22 makes it. One digest call over the joined parts, not one a column:
    a loaded transcript digests every row (it was a third of a 2,000-message load)."""
    parts = []
    for value in values:
        if value is None:
            parts.append(b"N")
            continue
        if isinstance(value, str):
            tag, data = b"S", value.encode("utf-8", "surrogatepass")
        elif isinstance(value, (bytes, bytearray, memoryview)):
            tag, data = b"B", bytes(value)
        else:
            tag, data = b"F" if isinstance(value, float) else b"I", repr(value).encode("ascii")
        parts.append(tag + _LENGTH.pack(len(data)) + data)
    return hashlib.blake2b(b"".join(parts), digest_size=16).hexdigest()


def mint_uid():
    """A fresh durable id: random, never derived from content (two messages may share it all)."""
    import uuid  # here, not at import: uuid loads platform, which only a write needs
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
    """A tool call's pairing id: `call_id` before `id` (Codex), the part before a `|`;
    '' for none."""
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
    if message.get("role") == "assistant" and isinstance(tool_calls, list) and tool_calls:
        uids = uid_map(_live_or_column(message, TOOL_CALL_UIDS, "tool_call_uids"))
        for call in tool_calls:
            key = tool_call_key(call)
            if key and key not in uids:
                uids[key] = mint_uid()  # a repeat of one id in a response shares it
        if uids:
            message[TOOL_CALL_UIDS] = uids
    pair_tool_result(message, calls_seen)


def pair_tool_result(message, calls_seen):
    """Messages in order, one at a time: an assistant's tool call uids go into `calls_seen`
    ({call id: uid}; a later call of the same id shadows an earlier one), a user turn empties
    it, and a tool result without a uid takes its call's (a write pairs a batch so, a read the
    results an older build or a lone append stored unpaired)."""
    role = message.get("role")
    if role == "assistant":
        held = _live_or_column(message, TOOL_CALL_UIDS, "tool_call_uids")
        uids = uid_map(held) if held else {}
        calls_seen.update({key: uid if isinstance(uid, str) else uid[-1]
                           for key, uid in uids.items()})
    elif role == "user":
        calls_seen.clear()  # a result never pairs across a user turn
    elif role == "tool" and not _live_or_column(message, TOOL_CALL_UID, "tool_call_uid"):
        call_id = message.get("tool_call_id")  # (not text: the insert refuses it)
        uid = calls_seen.get(tool_call_key({"id": call_id})) if isinstance(call_id, str) else None
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


def identity_keys(stored):
    """The identity keys of a message dict made afresh from a stored row ({column: value} of
    IDENTITY_COLUMNS, missing ones None): restore_identity_columns' result on an empty dict,
    without its merging (a loaded transcript reads thousands of rows)."""
    keys = {}
    if stored.get("message_uid"):
        keys[MESSAGE_UID] = stored["message_uid"]
    calls = uid_map(stored.get("tool_call_uids")) if stored.get("tool_call_uids") else None
    if calls:
        keys[TOOL_CALL_UIDS] = calls
    if stored.get("tool_call_uid"):
        keys[TOOL_CALL_UID] = stored["tool_call_uid"]
    absorbed = uid_list(stored.get("absorbed_message_uids") or [])
    if absorbed:
        keys[ABSORBED_MESSAGE_UIDS] = absorbed
    return keys


def restore_identity_columns(row, msg):
    """_restore_row_identity, and the uids of the rows a merged turn absorbed."""
    _restore_row_identity(row, msg)
    absorbed = uid_list(_column(row, "absorbed_message_uids"))
    if absorbed:
        msg[ABSORBED_MESSAGE_UIDS] = absorbed


def display_identity(row):
    """0.22's display identity of a stored row (a dict of its column values): the SHA-256 of its
    dedupe key, the key one_per_generation folds copies by. An assistant row whose every tool call
    has an id is keyed by those ids (a pruned copy keeps them, not its arguments); a user row that
    carries a compaction summary by the ask it carries; any other by role, content, time and tool
    fields. Equal to 0.22's digest for the same row, so either release groups the other's copies."""
    content = row["content"]
    calls = loads_or(row["tool_calls"] or "[]", []) if row["role"] == "assistant" else None
    call_ids = tuple(tool_call_key(call) for call in calls) if isinstance(calls, list) else ()
    if call_ids and all(call_ids):
        key = ("assistant", None, row["timestamp"], row["tool_call_id"], call_ids, row["tool_name"])
    else:
        # (split_user_turn finds an ask only in a compaction summary: test that first, cheaply)
        if row["role"] == "user" and is_compaction_summary(decode_content(content)):
            handoff, turn = split_user_turn({
                "role": "user", "content": decode_content(content),
                "display_kind": row["display_kind"],
                "display_metadata": decode_display_metadata(row["display_metadata"])})
            if handoff is not None and turn is not None:
                content = encode_content(turn.get("content"))
        key = (row["role"], content, row["timestamp"], row["tool_call_id"], row["tool_calls"],
               row["tool_name"])
    return hashlib.sha256(repr(key).encode("utf-8", "surrogatepass")).digest()


# -- a message dict as row values ------------------------------------------------
def message_row(session_id, message, default_time, columns, direct=False, calls_seen=None):
    """(values of `columns` for INSERT, tool calls it counts, its timestamp). `direct` reads
    the fields as append_message does; else reasoning is kept on assistant rows only and
    `message_id` is a fallback. Where the store keeps message identity, a dict message gets its
    uids minted (see stamp_identity; `calls_seen` pairs a batch's tool results with its calls)."""
    # AttributeError, as hermes-agent's .get raises (a dict for the list: its keys).
    if not hasattr(message, "get"):
        raise AttributeError(
            f"a message must be a dict, not {type(message).__name__}: {message!r:.60}")
    get = message.get
    role = get("role", "unknown")

    def reasoning(key):
        return get(key) if direct or role == "assistant" else None
    tool_calls = get("tool_calls")
    if isinstance(tool_calls, str):
        tool_calls = loads_or(tool_calls, [])
    calls = call_count(tool_calls)
    stamp = _timestamp(get("timestamp"), default_time)
    platform_id = get("platform_message_id")
    if not direct:
        platform_id = platform_id or get("message_id")
    row = {
        "session_id": session_id,
        "role": role,
        "content": encode_content(_storable("content", get("content"))),
        "tool_call_id": get("tool_call_id"),
        "tool_calls": json.dumps(tool_calls) if tool_calls else None,
        "tool_name": scrub_surrogates(get("tool_name")),
        "effect_disposition": get("effect_disposition"),
        "timestamp": stamp,
        "token_count": _storable("token_count", get("token_count")),
        "finish_reason": get("finish_reason"),
        "reasoning": scrub_surrogates(reasoning("reasoning")),
        "reasoning_content": scrub_surrogates(reasoning("reasoning_content")),
        "reasoning_details": _json_field(reasoning("reasoning_details")),
        "codex_reasoning_items": _json_field(reasoning("codex_reasoning_items")),
        "codex_message_items": _json_field(reasoning("codex_message_items")),
        "platform_message_id": platform_id,
        "observed": 1 if get("observed") else 0,
        "active": 1,  # a new message is live; rewind and compaction clear the flag
        "api_content": _text_or_none(get("api_content")),
        "display_kind": _text_or_none(get("display_kind")),
        "display_metadata": display_metadata_text(get("display_metadata")),
    }
    if len(columns) > len(MESSAGE_WRITE_COLUMNS):
        optional = {"_compressed_summary": 1 if get("_compressed_summary") else 0}
        if "message_uid" in columns and isinstance(message, dict):
            # The caller's dict keeps the uids its row got (a later write of it names the same
            # message, and 0.22's flush pairs a result written later with its call's uid read
            # off the assistant's dict); inside 0.20 they stay on a copy.
            stamped = dict(message)
            stamp_identity(stamped, tool_calls, {} if calls_seen is None else calls_seen)
            if not host_is_020():  # its dicts go to the model as they are (docs/differences.md)
                message.update((key, stamped[key]) for key in (MESSAGE_UID, TOOL_CALL_UIDS,
                                                               TOOL_CALL_UID) if key in stamped)
            optional.update(identity_values(stamped))
        if "display_identity" in columns:
            optional["display_identity"] = display_identity(row)
        row.update((name, optional.get(name)) for name in columns[len(MESSAGE_WRITE_COLUMNS):])
    return _write_row(row, columns), calls, stamp


@functools.lru_cache(maxsize=None)
def _values_getter(columns):
    return operator.itemgetter(*columns)


def _write_row(row, columns):
    """INSERT's values from `row`, a dict keyed by exactly `columns`.

    The one place a message row becomes a tuple: a name missing from `row` raises KeyError, an
    extra one ValueError, so the order of the values cannot drift from the statement's."""
    if len(row) != len(columns):
        extra = sorted(row.keys() - set(columns))
        raise ValueError(f"a message row has columns the statement lacks: {extra}")
    return _values_getter(columns)(row)


def call_count(tool_calls):
    """Tool calls a row counts: a list's length, 1 for another value, 0 for none."""
    return 0 if tool_calls is None else len(tool_calls) if isinstance(tool_calls, list) else 1


def _storable(name, value):
    """`value`, or ValueError naming `name` for a number SQLite cannot keep (NaN,
    an integer past 64 bits)."""
    if isinstance(value, (int, float)) and not sqlite_keeps(value):
        raise ValueError(f"{name} must be a number SQLite can store (not NaN, within 64 bits),"
                         f" not {value!r}")
    return value


def _timestamp(value, default):
    """Seconds since the epoch from a finite number, numeric text or a datetime;
    `default` otherwise."""
    if value is None:
        return default
    try:
        stamp = float(value.timestamp()) if hasattr(value, "timestamp") else float(value)
    except (TypeError, ValueError, OverflowError):
        return default
    return stamp if math.isfinite(stamp) else default


def _json_field(value):
    """A structured reasoning field as stored:
    text as given (never encoded twice), values as JSON."""
    if not value:
        return None
    return value if isinstance(value, str) else json.dumps(value)


def _text_or_none(value):
    return scrub_surrogates(value) if isinstance(value, str) else None


def display_metadata_text(value):
    """display_metadata as stored: JSON of an object, from a dict or JSON text;
    anything else is dropped."""
    if not value:
        return None
    if isinstance(value, str):
        value = loads_or(value, None)
    return json.dumps(value) if isinstance(value, dict) else None


# -- what of a user row a person typed --------------------------------------------
# Every handoff text hermes-agent's compaction has written starts with one of these; a merged
# handoff carries it after the delimiter.
_COMPACTION_SUMMARY_LEADS = (
    "[CONTEXT COMPACTION — REFERENCE ONLY] Earlier turns were compacted into the summary below.",
    "[CONTEXT SUMMARY]:")
_MERGED_SUMMARY_DELIMITER = "[END OF PRIOR CONTEXT — COMPACTION SUMMARY BELOW]"


def is_compaction_summary(content):
    """True for a compaction handoff, alone or merged after earlier turns' text."""
    text = content_text(content).lstrip()
    if _MERGED_SUMMARY_DELIMITER in text:
        text = text.split(_MERGED_SUMMARY_DELIMITER, 1)[1].lstrip()
    return text.startswith(_COMPACTION_SUMMARY_LEADS)


# -- what of a user row a person typed -----------------------------------------------
# The line that ends a compaction summary; a carrier row holds the live ask after it.
_SUMMARY_END_MARKER = ("--- END OF CONTEXT SUMMARY — respond to the message below, not the summary"
                       " above ---")
_MERGED_PRIOR_CONTEXT_HEADER = "[PRIOR CONTEXT — for reference only; not a new message]"
# The one display_kind a typed user turn has (a /steer); every other marks a synthetic row.
STEER_DISPLAY_KIND = "steer"
# Keys of a user row that describe the row, not the person's turn.
_TURN_ROW_KEYS = ("_compressed_summary", "_compressed_summary_has_user_turn",
                  "_micro_compact_marker", "_db_persisted", "display_kind", "display_metadata",
                  "api_content")


def split_user_turn(message):
    """(handoff, turn) of a user message dict, either None, both new dicts (0.22's
    split_user_originated_turn). A compaction summary's handoff is the summary alone, hidden and
    marked `_compressed_summary`; the turn is what a person typed: a plain or /steer user row,
    or the ask a summary carries after its end marker (merged: the prior turn before the
    delimiter), without row markers (reactions stay). No turn for other roles, other
    display_kinds or blank text."""
    if not isinstance(message, dict) or message.get("role") != "user":
        return None, None
    content, kind = message.get("content"), message.get("display_kind")
    summary = bool(message.get("_compressed_summary")) or is_compaction_summary(content)
    handoff = None
    if summary:
        handoff = {"role": "user", "content": _handoff_only(content), "_compressed_summary": True,
                   "display_kind": "hidden"}
        if message.get("timestamp") is not None:
            handoff["timestamp"] = message["timestamp"]
        live = _carried_ask(content) if not kind or kind == "hidden" else None
        if live is None:
            return handoff, None
        turn = dict(message, content=live)
        turn.pop("_row_id", None)  # the row is the carrier, not the turn
    elif kind and kind != STEER_DISPLAY_KIND:
        return None, None
    else:
        turn = dict(message)
    for key in _TURN_ROW_KEYS:
        turn.pop(key, None)
    meta = message.get("display_metadata")
    if isinstance(meta, dict) and "reactions" in meta:
        turn["display_metadata"] = {"reactions": json.loads(json.dumps(meta["reactions"]))}
    if not content_text(turn["content"]).strip() and not _has_media(turn["content"]):
        return handoff, None
    return handoff, turn


def _handoff_only(content):
    """A summary's text through its end marker, without a merged prior turn."""
    if not isinstance(content, str):
        return content
    if _MERGED_SUMMARY_DELIMITER in content:
        content = content.split(_MERGED_SUMMARY_DELIMITER, 1)[1].lstrip()
    end = content.find(_SUMMARY_END_MARKER)
    return content[:end + len(_SUMMARY_END_MARKER)] if end >= 0 else content


def _carried_ask(content):
    """The person's text a summary row carries, or None."""
    if not isinstance(content, str):
        return None
    if _MERGED_SUMMARY_DELIMITER in content:
        prior = content.split(_MERGED_SUMMARY_DELIMITER, 1)[0].strip()
        if prior.startswith(_MERGED_PRIOR_CONTEXT_HEADER):
            prior = prior[len(_MERGED_PRIOR_CONTEXT_HEADER):].lstrip()
    elif _SUMMARY_END_MARKER in content:
        prior = content.split(_SUMMARY_END_MARKER, 1)[1].lstrip()
    else:
        prior = ""
    return prior or None


def _has_media(content):
    return isinstance(content, list) and any(
        not (isinstance(part, str) or (isinstance(part, dict)
                                       and part.get("type") in ("text", "input_text")))
        for part in content)


# Recalled-memory blocks hermes-agent injects into prompts; never replayed.
_MEMORY_BLOCK = re.compile(r"<\s*memory-context\s*>[\s\S]*?</\s*memory-context\s*>", re.I)
_MEMORY_NOTE = re.compile(
    r"\[System note:\s*The following is recalled memory context,\s*NOT new user input\.\s*Treat as "
    r"(?:informational background data|authoritative reference data[^\]]*)\.\]\s*", re.I)
_MEMORY_TAG = re.compile(r"</?\s*memory-context\s*>", re.I)
_MEMORY_HINT = re.compile("memory", re.I)  # in every text the three above can match


def loaded_view_content(role, content):
    """Decoded content as a conversation read gives it: user and assistant text without
    recalled-memory blocks, stripped."""
    if role in ("user", "assistant") and isinstance(content, str):
        if _MEMORY_HINT.search(content):  # one scan for the word all three patterns need
            content = _MEMORY_TAG.sub("", _MEMORY_NOTE.sub("", _MEMORY_BLOCK.sub("", content)))
        content = content.strip()
    return content


# -- the chat-API conversation ------------------------------------------------------------

# Assistant turns that a later answer supersedes when alternation is repaired.
_VERIFICATION_FINISHES = ("verification_required", "verify_hook_continue")


def _is_codex_interim(message):
    return bool(message.get("codex_reasoning_items") or message.get("codex_message_items")
                or message.get("finish_reason") == "incomplete")


def repair_alternation_in_place(messages):
    """hermes-agent's pre-request alternation repair; returns how many repairs it made.

    Back-to-back assistant turns merge (tool calls and text joined; a verification candidate is
    replaced; Codex interim turns stay), tool results no preceding call asked for go, and
    back-to-back user turns with text merge with a blank line (their api_content dropped), but
    never into a /steer row or a compaction summary."""
    repairs, collapsed = 0, []
    for message in messages:
        previous = collapsed[-1] if collapsed else None
        if previous is None or not message.get("role") == previous.get("role") == "assistant" \
                or _is_codex_interim(message) or _is_codex_interim(previous):
            collapsed.append(message)
            continue
        repairs += 1
        if previous.get("finish_reason") in _VERIFICATION_FINISHES:
            collapsed[-1] = message
            continue
        calls = list(previous.get("tool_calls") or []) + list(message.get("tool_calls") or [])
        if calls:
            previous["tool_calls"] = calls
        else:
            previous.pop("tool_calls", None)
        first, second = previous.get("content"), message.get("content")
        if isinstance(first, str) and isinstance(second, str):
            parts = (first.strip(), second.strip())
            previous["content"] = "\n".join(part for part in parts if part)
        elif not first and second is not None:
            previous["content"] = second
        if not previous.get("reasoning_content") and message.get("reasoning_content"):
            previous["reasoning_content"] = message["reasoning_content"]
    answered, kept = set(), []
    for message in collapsed:
        role = message.get("role")
        if role == "assistant":
            asked = [call for call in message.get("tool_calls") or [] if isinstance(call, dict)]
            answered = {call.get(key) for call in asked
                        for key in ("id", "call_id") if call.get(key)}
        elif role == "tool":
            if message.get("tool_call_id") not in answered:
                repairs += 1
                continue
            answered.discard(message.get("tool_call_id"))
        elif role == "user":
            answered = set()
        kept.append(message)
    merged = []
    for message in kept:
        previous = merged[-1] if merged else None
        first, second = (previous or {}).get("content", ""), message.get("content", "")
        # 0.22 never merges into a /steer row or a compaction summary: both stay as stored.
        if previous is not None and message.get("role") == previous.get("role") == "user" \
                and isinstance(first, str) and isinstance(second, str) \
                and previous.get("display_kind") != STEER_DISPLAY_KIND \
                and split_user_turn(previous)[0] is None:
            previous["content"] = first + "\n\n" + second if first and second else first or second
            previous.pop("api_content", None)
            repairs += 1
            continue
        merged.append(message)
    if repairs:
        messages[:] = merged
    return repairs
