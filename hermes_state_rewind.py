"""Rewinding a session by user turn (/undo, /retry): the one place that turns "the Nth user turn"
into a rewind of the stored transcript, checked against the history a program holds in memory.

Owns rewind_user_turn and its result. The stored transcript is the authority; nothing here writes
but rewind_to_message. Relies on `get_active_message_ids`, `get_messages_as_conversation` and
`rewind_to_message` (messages mixin).
"""

from hermes_state_common import record_class
from hermes_state_identity import loaded_view_content, split_user_turn

_HISTORY_CHANGED = "session history changed before the rewind could be persisted"
# Flags of the recovery turns hermes-agent keeps in memory only; never counted as history.
_EPHEMERAL_FLAGS = ("_empty_recovery_synthetic", "_empty_terminal_sentinel", "_thinking_prefill",
                    "_verification_stop_synthetic", "_pre_verify_synthetic",
                    "_kanban_stop_synthetic", "_dropped_toolcall_nudge")
_IMAGE_PART_TYPES = ("image", "image_url", "input_image")
_TEXT_PART_TYPES = ("text", "input_text", "output_text")


class RewindTargetUnavailableError(ValueError):
    """The asked-for user turn cannot be rewound: there is none at that ordinal, the row is no
    person's turn, or it is no compaction carrier where one was required."""


# What rewind_user_turn did, a dataclass as 0.22's, made at its first use (record_class).
_REWIND_OUTCOME = ("RewindOutcome", (("prefix", list), ("live_view", dict), ("live_text", str),
                                     ("rewound_count", int), ("turns_undone", int)))
_REWIND_OUTCOME_DOC = """What rewind_user_turn did. `prefix`: the history to keep (the in-memory one
    when given); `live_view`: the withdrawn turn as the person typed it; `live_text`: its text
    (exact, for a retry); `rewound_count`: rows withdrawn; `turns_undone`: user turns withdrawn."""


def __getattr__(name):  # (PEP 562: RewindOutcome made at its first use)
    if name == _REWIND_OUTCOME[0]:
        return record_class(__name__, *_REWIND_OUTCOME, doc=_REWIND_OUTCOME_DOC)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SessionRewindMixin:
    """SessionDB's rewind by user turn."""

    def rewind_user_turn(self, session_id, user_ordinal, *, warm_history=None,
                         require_retryable=False, require_composite=False, adopt_row_ids=False):
        """Withdraw user turn `user_ordinal` (0 the oldest; -n the nth from the newest, clamped
        to the oldest) and all after it, and return a RewindOutcome.

        Turns are counted on the replay view (repaired alternation: a user;user pair is one turn,
        rewound from its first row). `warm_history`, the caller's in-memory history, must have as
        many turns and the same target text, else RuntimeError; its prefix is returned.
        `require_retryable`: the turn must be plain text (ValueError). `require_composite`: it
        must be a compaction carrier, whose handoff then stays as the new head. `adopt_row_ids`
        gives a matching warm prefix the stored rows' `_row_id` and message_uid. Raises
        RewindTargetUnavailableError for a missing or wrong target; nothing is written then, nor
        when the transcript changed meanwhile (RuntimeError)."""
        split = split_user_turn
        expected_ids = self.get_active_message_ids(session_id)
        stored = self.get_messages_as_conversation(session_id, include_row_ids=True)
        durable = self.get_messages_as_conversation(session_id, include_row_ids=True,
                                                    repair_alternation=True)
        turns = _turn_indices(durable, split)
        if user_ordinal < 0:
            user_ordinal = max(len(turns) + user_ordinal, 0)
        if user_ordinal >= len(turns):
            raise RewindTargetUnavailableError(
                "target user message is no longer in session history")
        target = durable[turns[user_ordinal]]
        durable_prefix, live_view, handoff = _before_turn(durable, turns[user_ordinal], split)
        if require_composite and handoff is None:
            raise RewindTargetUnavailableError("target user message is not a compaction carrier")
        prefix = durable_prefix
        if warm_history is not None:
            warm = [m for m in warm_history
                    if not (isinstance(m, dict) and any(m.get(flag) for flag in _EPHEMERAL_FLAGS))]
            warm_turns = _turn_indices(warm, split)
            if len(warm_turns) != len(turns):
                raise RuntimeError(_HISTORY_CHANGED)
            prefix, warm_view, _ = _before_turn(warm, warm_turns[user_ordinal], split)
            if self._comparable(live_view) != self._comparable(warm_view):
                raise RuntimeError(_HISTORY_CHANGED)
        live_text = retryable_text(live_view.get("content")) if require_retryable else None
        row_id = target.get("_row_id")
        if not isinstance(row_id, int):
            raise RuntimeError("rewind target has no durable row identity")
        # The stored row of a merged turn holds its first ask only: pin that, not the merge.
        stored_view = next((split(m)[1] for m in stored if m.get("_row_id") == row_id), None)
        if stored_view is None:
            raise RuntimeError(_HISTORY_CHANGED)
        try:
            result = self.rewind_to_message(
                session_id, row_id, preserve_compaction_handoff=handoff is not None,
                expected_active_ids=expected_ids, expected_target_content=stored_view["content"])
        except ValueError as exc:  # gone or changed role meanwhile: as out of range
            raise RewindTargetUnavailableError(str(exc)) from exc
        if handoff is not None:
            durable_prefix[-1].update(_row_id=result["replacement_message_id"], _db_persisted=True)
            if result.get("replacement_message_uid"):
                durable_prefix[-1]["message_uid"] = result["replacement_message_uid"]
            prefix[-1] = durable_prefix[-1]
        if adopt_row_ids and prefix is not durable_prefix \
                and self._same_rows(prefix, durable_prefix):
            for warm_message, row in zip(prefix, durable_prefix):
                if isinstance(row.get("_row_id"), int):
                    warm_message["_row_id"] = row["_row_id"]
                if isinstance(row.get("message_uid"), str) and row["message_uid"]:
                    warm_message["message_uid"] = row["message_uid"]
        return record_class(__name__, *_REWIND_OUTCOME, doc=_REWIND_OUTCOME_DOC)(
            prefix=prefix, live_view=live_view,
            live_text=live_text if live_text is not None else _flat_text(live_view.get("content")),
            rewound_count=int(result.get("rewound_count", 0)),
            turns_undone=len(turns) - user_ordinal)

    def _comparable(self, message):
        """A message's content as its stored row reads back, so a warm dict and its row compare."""
        return loaded_view_content(message.get("role"), _stored_projection(
            message.get("content")))

    def _same_rows(self, warm, durable):
        return len(warm) == len(durable) and all(
            w.get("role") == d.get("role") and bool(w.get("display_kind")) == bool(
                d.get("display_kind")) and self._comparable(w) == self._comparable(d)
            for w, d in zip(warm, durable))


def _turn_indices(messages, split):
    return [i for i, message in enumerate(messages) if split(message)[1] is not None]


def _before_turn(messages, index, split):
    """(copies of the messages before turn `index` plus its handoff if it is a carrier, the
    turn as typed, the handoff or None)."""
    handoff, turn = split(messages[index])
    prefix = [dict(message) for message in messages[:index]]
    return prefix + ([handoff] if handoff is not None else []), turn, handoff


def _stored_projection(content):
    """Content as hermes-agent stores a turn: a part list as its text, images as [screenshot]."""
    if not isinstance(content, list):
        return content
    texts = [str(part.get("text", "")) if part.get("type") == "text" else "[screenshot]"
             for part in content if isinstance(part, dict)
             and (part.get("type") == "text" or part.get("type") in _IMAGE_PART_TYPES)]
    return "\n".join(texts) if texts else None


def _flat_text(content):
    """The visible text of a content: text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [content]
    texts = (part if isinstance(part, str) else part.get("text") if isinstance(part, dict)
             else None for part in parts)
    return "\n".join(text for text in texts if isinstance(text, str) and text)


def retryable_text(content):
    """The exact text a retry sends again: text parts joined as stored (no separator); ValueError
    for media, annotated or other parts, which have no lossless replay, and for no text."""
    if not isinstance(content, (str, list)):
        raise ValueError("retry does not support non-text content")
    chunks = []
    for part in [content] if isinstance(content, str) else content:
        if isinstance(part, str):
            chunks.append(part)
        elif not isinstance(part, dict):
            raise ValueError("retry does not support non-text content")
        elif part.get("type") not in _TEXT_PART_TYPES:
            raise ValueError("retry does not support media or unknown content parts")
        elif set(part) - {"type", "text"}:
            raise ValueError("retry cannot losslessly flatten annotated text parts")
        elif not isinstance(part.get("text"), str):
            raise ValueError("retry text parts must contain text")
        else:
            chunks.append(part["text"])
    text = "".join(chunks)
    if not text.strip():
        raise ValueError("retry found no text to send")
    return text
