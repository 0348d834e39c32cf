"""The transcript: appends, reads, the chat-API conversation, rewind and restore, the
turn-lease check of a write, reactions, the windows session_search reads and the recent
user turns /undo picks from.

Owns message rows and the session counters that move with them in one transaction. Never edits a
session's other fields and never takes or releases a lease (the gateway mixin does). Values are
stored as hermes-agent stores them, so both programs read each other's rows: what it accepts we
accept, what it raises we raise.
"""

import functools
import json
import operator
import time

from hermes_state_common import (
    COMPRESSION_END_REASON, CONTENT_JSON_PREFIX, COUNT_ALL_MESSAGES_SQL, MESSAGE_WRITE_COLUMNS,
    LINEAGE_MAX_HOPS, PREVIEW_CHARS, SELECT_COMPRESSION_LOCK_SQL, SET_MESSAGE_COUNTS_SQL,
    STALE_MARKER, chunked, decode_content, decode_display_metadata, decode_message,
    describe_skill_invocation, encode_content, host_is_020, host_view, is_fork_child, json_object,
    loads_or, placeholders, scrub_surrogates,
)
from hermes_state_errors import (
    CompressionSessionClosedError, SessionCompressionInProgressError, SessionTurnLeaseLostError,
    UnknownSessionError,
)
from hermes_state_identity import (
    IDENTITY_COLUMNS, MESSAGE_UID, ROW_WRITE_COLUMNS, SNAPSHOT_COLUMNS, call_count,
    display_metadata_text, identity_keys, is_compaction_summary, loaded_view_content, message_row,
    pair_tool_result, repair_alternation_in_place, row_snapshot, snapshot_of, split_user_turn,
    tool_call_key,
)
from hermes_state_schema import live_columns


@functools.lru_cache(maxsize=None)
def _insert_sql(columns):
    return "INSERT INTO messages ({}) VALUES ({})".format(", ".join(columns),
                                                          placeholders(len(columns)))


# One message row of a schema-26 store, its values in MESSAGE_WRITE_COLUMNS order (see _write_row);
# bench.py runs it.
INSERT_MESSAGE_SQL = _insert_sql(MESSAGE_WRITE_COLUMNS)
# Columns hermes-agent 0.22 (schema 31) adds to a message write. Each is written where the store
# has it (_write_columns); a schema-26 store keeps none of them.
OPTIONAL_WRITE_COLUMNS = ("_compressed_summary", "display_identity") + IDENTITY_COLUMNS
# Every column a message write names on a store that has them all, in 0.22's order
# (agent/transcript_repair.py imports it under this name).
_MESSAGE_WRITE_COLUMNS = ROW_WRITE_COLUMNS
# (messages added, tool calls added, session id); append_messages_batch runs it.
BUMP_MESSAGE_COUNTS_SQL = ("UPDATE sessions SET message_count = COALESCE(message_count, 0) + ?,"
                           " tool_call_count = COALESCE(tool_call_count, 0) + ? WHERE id = ?")
# append_message's: the same, and the end reason a compression closes a session with.
BUMP_OPEN_SESSION_COUNTS_SQL = (BUMP_MESSAGE_COUNTS_SQL
                                + " AND (ended_at IS NULL OR end_reason IS NOT ?)")
# Prompts of hermes-agent's background skill/memory review that old builds wrote into the user's
# session; replayed, they turn the agent into the curator.
_REVIEW_HARNESS_PREFIXES = ("Review the conversation above and update the skill library",
                            "Review the conversation above and consider saving to memory")
class SessionMessagesMixin:
    """SessionDB's methods for the transcript.

    Relies on: `_execute_write`, `_update_rows`, `_read_value`, `_read_one`, `_read_all`,
    `_with_reader`, `_transcript_patience` (SessionDB, hermes_state.py)."""

    # The columns _write_columns found, once per SessionDB.
    _message_columns = None
    # hermes-agent 0.22's agent decodes a stored content through the class (a multimodal turn
    # that re-entered its history as the stored string).
    _decode_content = staticmethod(decode_content)

    # -- writes ------------------------------------------------------------------

    def append_message(self, session_id, role, content=None, tool_name=None, tool_calls=None,
                       tool_call_id=None, token_count=None, finish_reason=None, reasoning=None,
                       reasoning_content=None, reasoning_details=None, codex_reasoning_items=None,
                       codex_message_items=None, platform_message_id=None, observed=False,
                       effect_disposition=None, *later, **named):
        """Append one message and return its id; the session's counts move in the same transaction.

        After `effect_disposition` it takes, by keyword or position, 0.20's `timestamp`,
        `api_content`, `display_kind`, `display_metadata`, `compression_lock_holder`,
        `turn_lease_holder`, `turn_lease_ttl_seconds` (300.0) and 0.22's `_compressed_summary`
        (False) and `message_uid`; positions follow _APPEND_LATER_ORDERS. `_compressed_summary`
        marks a compaction handoff and `message_uid` names the message where the store keeps them.

        Raises CompressionSessionClosedError for a session compression ended,
        SessionTurnLeaseLostError when `turn_lease_holder` does not hold the turn lease,
        UnknownSessionError (an IntegrityError) for an unknown session; nothing is written then.
        `compression_lock_holder` is not checked: as in hermes-agent, appends never wait for a
        compression, which keeps the rows that arrive meanwhile."""
        fields = dict(locals())
        for name in ("self", "session_id", "later", "named"):
            del fields[name]
        fields.update(_append_later_fields(later, named))
        lease_holder = fields.pop("turn_lease_holder")
        lease_ttl = fields.pop("turn_lease_ttl_seconds")
        del fields["compression_lock_holder"]
        columns = self._write_columns()
        row, calls, _ = message_row(session_id, fields, time.time(), columns, direct=True)

        def write(conn):
            if lease_holder:
                self._check_turn_lease(conn, session_id, lease_holder, lease_ttl)
            # The count update admits the write too: it changes no row of a session that is unknown
            # or closed by compression, and only then is the session read, to say which.
            bump = (1, calls, session_id, COMPRESSION_END_REASON)
            if not conn.execute(BUMP_OPEN_SESSION_COUNTS_SQL, bump).rowcount:
                _check_open_session(conn, session_id)  # raises: unknown, or closed by compression
            return conn.execute(_insert_sql(columns), row).lastrowid
        return self._execute_write(write, patience_s=self._transcript_patience())

    def append_delegation_delivery(self, session_id, content, metadata):
        """Record a detached delegation's result as a user row once, and return its id: a row of the
        compression chain with the same `delegation_id` and `delivery_notice` is returned instead.

        The row's display_kind is "async_delegation_complete" ("hidden" with
        `presentation_suppressed`), its display_metadata `metadata`. Raises ValueError without a
        `delegation_id`, SessionTurnLeaseLostError while a turn holds the lease, and as
        append_message; the check and the insert share one transaction."""
        delegation_id = metadata.get("delegation_id")
        if not delegation_id:
            raise ValueError("a delegation delivery needs metadata['delegation_id']")
        kind = "hidden" if metadata.get("presentation_suppressed") else "async_delegation_complete"
        message = {"role": "user", "content": content, "display_kind": kind,
                   "display_metadata": metadata}
        columns = self._write_columns()
        row, _, _ = message_row(session_id, message, time.time(), columns)
        notice = metadata.get("delivery_notice", "")

        def write(conn):
            chain = self._compression_chain(conn, session_id)
            earlier = conn.execute(
                f"SELECT id, display_metadata FROM messages WHERE session_id IN"
                f" ({placeholders(len(chain))}) AND display_kind IN"
                " ('async_delegation_complete', 'hidden') ORDER BY id", chain).fetchall()
            for found in earlier:
                meta = decode_display_metadata(found["display_metadata"]) or {}
                if meta.get("delegation_id") == delegation_id \
                        and (meta.get("delivery_notice") or "") == (notice or ""):
                    return found["id"]
            self._refuse_active_turn_lease(conn, session_id)
            _check_open_session(conn, session_id)
            row_id = conn.execute(_insert_sql(columns), row).lastrowid
            conn.execute(BUMP_MESSAGE_COUNTS_SQL, (1, 0, session_id))
            return row_id
        return self._execute_write(write, patience_s=self._transcript_patience())

    def append_messages_batch(self, session_id, messages, compression_lock_holder=None,
                              turn_lease_holder=None, chunk_rows=None,
                              turn_lease_ttl_seconds=300.0):
        """Append message dicts in one transaction and return how many; 0 for none.

        Raises as append_message. Each dict gets its row state (_insert_message_rows), and a
        failed write leaves the dicts as they were; `message_id` stands for
        `platform_message_id`, reasoning is kept on assistant rows only, missing timestamps
        count up from now 1 µs apart. With `chunk_rows`, each chunk of that many rows is its
        own transaction."""
        if not messages:
            return 0
        if chunk_rows is not None and len(messages) > chunk_rows:
            return sum(self.append_messages_batch(
                session_id, messages[start:start + chunk_rows], compression_lock_holder,
                turn_lease_holder, turn_lease_ttl_seconds=turn_lease_ttl_seconds)
                for start in range(0, len(messages), chunk_rows))

        def write(conn):
            self._admit_transcript_write(conn, session_id, turn_lease_holder,
                                         turn_lease_ttl_seconds)
            inserted, calls = self._insert_message_rows(conn, session_id, messages,
                                                        callers=True)
            conn.execute(BUMP_MESSAGE_COUNTS_SQL, (inserted, calls, session_id))
            return inserted
        return self._execute_transcript_write(write, messages,
                                              patience_s=self._transcript_patience())

    def replace_messages(self, session_id, messages, active_only=False, archive_dropped=False,
                         reject_active_turn_lease=False):
        """Make `messages` the session's whole live transcript in one transaction; returns None.

        Replaced rows are deleted (the active ones only with `active_only`), or with
        `archive_dropped` kept inactive, as a rewind keeps them: then the live rows that already
        hold the head of `messages` (role, content as read back, tool fields) stay with their ids,
        which their dicts get as `_row_id`, and only the rest is archived and inserted.
        `reject_active_turn_lease` refuses while a turn holds the lease or a compression the lock
        (see _refuse_active_turn_lease). Raises CompressionSessionClosedError or
        UnknownSessionError as append_message does."""
        def write(conn):
            if reject_active_turn_lease:
                self._refuse_active_turn_lease(conn, session_id)
            _check_open_session(conn, session_id, must_exist=bool(messages))
            kept = kept_calls = 0
            if archive_dropped:
                live = conn.execute(
                    "SELECT id, role, content, tool_call_id, tool_calls FROM messages"
                    " WHERE session_id = ? AND active = 1 ORDER BY id LIMIT ?",
                    (session_id, len(messages) + 1)).fetchall()
                kept = _kept_live_prefix(live, messages)
                kept_calls = sum(call_count(loads_or(row["tool_calls"], None))
                                 for row in live[:kept] if row["tool_calls"])
                if kept < len(live):
                    conn.execute("UPDATE messages SET active = 0 WHERE session_id = ?"
                                 " AND active = 1 AND id >= ?", (session_id, live[kept]["id"]))
            else:
                conn.execute("DELETE FROM messages WHERE session_id = ?"
                             + (" AND active = 1" if active_only else ""), (session_id,))
            count, calls = self._insert_message_rows(conn, session_id, messages[kept:],
                                                     callers=True)
            conn.execute(SET_MESSAGE_COUNTS_SQL, (kept + count, kept_calls + calls, session_id))
        self._execute_transcript_write(write, messages)

    def set_latest_user_api_content(self, session_id, content, api_content):
        """Set api_content of the newest active user message if its content is `content`;
        rows changed."""
        return self._update_rows(
            "UPDATE messages SET api_content = ? WHERE id = (SELECT id FROM messages"
            " WHERE session_id = ? AND role = 'user' AND active = 1 ORDER BY id DESC LIMIT 1)"
            " AND content IS ?",
            (scrub_surrogates(api_content), session_id, encode_content(content)))

    # -- row-addressed edits: each changes at most the named row of the session; 0 for a bad
    # session id or row id (not a positive int), as in hermes-agent --

    def set_message_api_content(self, session_id, row_id, content, api_content):
        """Set api_content of the active user message `row_id` if its content is still `content`;
        rows changed."""
        if not session_id or not _is_row_id(row_id):
            return 0
        return self._update_rows(
            "UPDATE messages SET api_content = :api WHERE id = :id AND session_id = :sid"
            " AND role = 'user' AND active = 1 AND content IS :content",
            {"api": scrub_surrogates(api_content), "id": row_id, "sid": session_id,
             "content": encode_content(content)})

    def set_user_message_content(self, session_id, row_id, content):
        """Replace the content of the active user message `row_id` (a prompt rewritten after it
        was stored); rows changed."""
        if not session_id or not _is_row_id(row_id):
            return 0
        return self._update_rows(
            "UPDATE messages SET content = ? WHERE id = ? AND session_id = ? AND role = 'user'"
            " AND active = 1", (encode_content(content), row_id, session_id))

    def deactivate_message(self, session_id, row_id):
        """Make message `row_id` inactive (kept, as a rewind keeps it); rows changed."""
        if not session_id or not _is_row_id(row_id):
            return 0
        return self._update_rows("UPDATE messages SET active = 0 WHERE id = ? AND session_id = ?",
                                 (row_id, session_id))

    def deactivate_messages_by_display_kind(self, session_id, display_kind):
        """Make every active message with this display_kind inactive; rows changed (0 for an
        empty kind)."""
        if not session_id or not display_kind:
            return 0
        return self._update_rows(
            "UPDATE messages SET active = 0 WHERE session_id = ? AND display_kind = ?"
            " AND active = 1", (session_id, scrub_surrogates(display_kind)))

    def resolve_active_row_id(self, session_id, row_id):
        """The active row holding message `row_id`: itself while active, else the one live copy
        an in-place compaction made of it (same role, content and time, a higher id); None when
        there is none, or more than one."""
        if not session_id or not _is_row_id(row_id):
            return None
        active = self._read_value("SELECT active FROM messages WHERE id = ? AND session_id = ?",
                                  (row_id, session_id))
        if active is None:
            return None
        if active:
            return row_id
        copies = self._read_all(
            "SELECT c.id FROM messages c JOIN messages o ON o.id = :id WHERE c.session_id = :sid"
            " AND c.active = 1 AND c.id > o.id AND c.role = o.role AND c.content IS o.content"
            " AND c.timestamp = o.timestamp LIMIT 2", {"id": row_id, "sid": session_id})
        return copies[0][0] if len(copies) == 1 else None

    def set_latest_matching_message_display_kind(self, session_id, *, role, content, display_kind,
                                                 display_metadata=None):
        """Set display_kind and display_metadata (None clears it) on the newest active `role`
        message whose content is `content`; False when there is none or session_id, content or
        display_kind is empty."""
        if not session_id or not content or not display_kind:
            return False
        return self._update_rows(
            "UPDATE messages SET display_kind = ?, display_metadata = ? WHERE id = (SELECT id"
            " FROM messages WHERE session_id = ? AND role = ? AND content = ? AND active = 1"
            " ORDER BY id DESC LIMIT 1)",
            (scrub_surrogates(display_kind), display_metadata_text(display_metadata), session_id,
             role, encode_content(content))) > 0

    # -- reactions: kept in a message's display_metadata, so they travel with its row --

    REACTIONS_METADATA_KEY = "reactions"
    # (display_metadata, message id); both reaction writes run it.
    _SET_DISPLAY_METADATA_SQL = "UPDATE messages SET display_metadata = ? WHERE id = ?"

    def set_message_reaction(self, session_id, message_row_id, emoji, *, author="user"):
        """Give `author` the reaction `emoji` on message `message_row_id` (one per author: the
        same emoji again, an empty one or None takes it back); returns the message's reactions
        after the write, None when the message is not in the session."""
        if not session_id or message_row_id is None:
            return None

        def write(conn):
            row = conn.execute(
                "SELECT display_metadata FROM messages WHERE id = ? AND session_id = ?",
                (message_row_id, session_id)).fetchone()
            if row is None:
                return None
            meta = decode_display_metadata(row[0]) or {}
            listed = self._reactions(meta)
            previous = next((r for r in listed if r.get("author") == author), {})
            reactions = [r for r in listed if r.get("author") != author]
            if emoji and previous.get("emoji") != emoji:
                reactions.append(
                    {"emoji": scrub_surrogates(emoji), "author": author, "at": time.time()})
            if reactions:
                meta[self.REACTIONS_METADATA_KEY] = reactions
            else:
                meta.pop(self.REACTIONS_METADATA_KEY, None)
            conn.execute(self._SET_DISPLAY_METADATA_SQL,
                         (display_metadata_text(meta), message_row_id))
            return reactions
        return self._execute_write(write)

    def get_message_reactions(self, session_id, message_row_id):
        """The reactions on message `message_row_id` of the session; [] when none."""
        if not session_id or message_row_id is None:
            return []
        stored = self._read_value(
            "SELECT display_metadata FROM messages WHERE id = ? AND session_id = ?",
            (message_row_id, session_id))
        return self._reactions(decode_display_metadata(stored))

    def take_unseen_reactions(self, session_id, *, author="user"):
        """`author`'s reactions on active messages not taken before, oldest message first, as
        {"row_id", "role", "emoji", "text"}; each is marked seen. [] when none."""
        if not session_id:
            return []

        def write(conn):
            taken = []
            rows = conn.execute(
                "SELECT id, role, content, display_metadata FROM messages WHERE session_id = ?"
                " AND active = 1 AND display_metadata IS NOT NULL ORDER BY id",
                (session_id,)).fetchall()
            for row in rows:
                meta = decode_display_metadata(row["display_metadata"]) or {}
                fresh = [r for r in self._reactions(meta)
                         if r.get("author") == author and not r.get("seen")]
                if not fresh:
                    continue
                text = decode_content(row["content"])
                for reaction in fresh:
                    reaction["seen"] = True
                    taken.append({"row_id": row["id"], "role": row["role"],
                                  "emoji": reaction.get("emoji") or "",
                                  "text": text if isinstance(text, str) else ""})
                conn.execute(self._SET_DISPLAY_METADATA_SQL,
                             (display_metadata_text(meta), row["id"]))
            return taken
        return self._execute_write(write)

    def _reactions(self, meta):
        listed = (meta or {}).get(self.REACTIONS_METADATA_KEY)
        return [r for r in listed if isinstance(r, dict)] if isinstance(listed, list) else []

    def _insert_message_rows(self, conn, session_id, messages, *, callers=False):
        """Inside a write: insert message dicts as append_messages_batch reads them; returns
        (rows inserted, tool calls). The session's counters are the caller's.

        Each dict gets its row id as `_row_id`. With `callers` (the dicts are a caller's, written
        through _execute_transcript_write) and outside 0.20, also the timestamp its row got and
        the stored row's ownership version (`_db_row_snapshot`), as 0.22's inserters stamp them:
        a dict written again then names the same message, and 0.22's next flush of it rewrites
        its row instead of adding one. Inside 0.20 the dict goes to the model as it is; our own
        copies (an import's, a rewind's handoff) need neither."""
        now, inserted, calls = time.time(), 0, 0
        columns, calls_seen = self._write_columns(conn), {}
        insert = _insert_sql(columns)
        stamp_dicts = callers and not host_is_020()
        stamped = {}  # row id -> the caller's dict
        for message in messages:
            row, row_calls, stamp = message_row(session_id, message, now, columns,
                                                 calls_seen=calls_seen)
            row_id = conn.execute(insert, row).lastrowid
            if isinstance(message, dict):
                message["_row_id"] = row_id
                if stamp_dicts:
                    message["timestamp"] = stamp
                    stamped[row_id] = message
            inserted, calls, now = inserted + 1, calls + row_calls, max(now + 1e-6, stamp + 1e-6)
        # The digest is of the stored values: column affinity changes what was bound (a float
        # token count stored as an integer), and 0.22 compares what it reads back.
        wanted = [column for column in SNAPSHOT_COLUMNS if column in columns]
        for chunk in chunked(stamped):
            for row in conn.execute(
                    f"SELECT id, {', '.join(wanted)} FROM messages"
                    f" WHERE id IN ({placeholders(len(chunk))})", chunk):
                stamped[row[0]]["_db_row_snapshot"] = row_snapshot(dict(zip(wanted, row[1:])))
        return inserted, calls

    # What _insert_message_rows stamps on a caller's dicts.
    _ROW_STATE_KEYS = ("_row_id", "_db_row_snapshot", "timestamp")

    def _execute_transcript_write(self, fn, messages, **kwargs):
        """_execute_write(fn) for a write that inserts the caller's `messages`: each attempt
        starts from, and a failure leaves, the row state the dicts came with. A rolled-back
        insert's row id is SQLite's to give again, so a stale `_row_id` would name another
        message's row."""
        absent = object()
        dicts = [message for message in messages if isinstance(message, dict)]
        before = [tuple(message.get(key, absent) for key in self._ROW_STATE_KEYS)
                  for message in dicts]

        def restore():
            for message, state in zip(dicts, before):
                for key, value in zip(self._ROW_STATE_KEYS, state):
                    if value is absent:
                        message.pop(key, None)
                    else:
                        message[key] = value

        def attempt(conn):
            restore()
            return fn(conn)
        try:
            return self._execute_write(attempt, **kwargs)
        except BaseException:
            restore()
            raise

    def _admit_transcript_write(self, conn, session_id, lease_holder, lease_ttl):
        if lease_holder:
            self._check_turn_lease(conn, session_id, lease_holder, lease_ttl)
        _check_open_session(conn, session_id)

    def _check_turn_lease(self, conn, session_id, holder, ttl):
        """Inside a write: raise SessionTurnLeaseLostError unless `holder` holds the
        conversation's turn lease. A lapsed lease nobody took over is still the holder's: it is
        renewed for max(ttl, 0.1) s."""
        key = self._turn_lease_key(conn, session_id)
        lease = conn.execute(
            "SELECT holder, expires_at FROM session_turn_leases WHERE conversation_id = ?",
            (key,)).fetchone()
        if lease is None or lease["holder"] != holder:
            raise SessionTurnLeaseLostError(
                f"Session turn lease lost; refusing transcript write for {session_id!r}")
        now = time.time()
        if float(lease["expires_at"]) <= now:
            conn.execute("UPDATE session_turn_leases SET expires_at = ?"
                         " WHERE conversation_id = ? AND holder = ?",
                         (now + max(0.1, float(ttl)), key, holder))

    def _turn_lease_key(self, conn, session_id):
        """The id the turn lease is kept under: the root of the compression chain through
        `session_id` (a branch, delegate or tool child starts its own)."""
        root = self._compression_chain(conn, session_id)[0]
        return str(root) if root else session_id

    def _compression_chain(self, conn, session_id):
        """`session_id` and the sessions it continues, root first: each step goes to a parent that
        compression ended, from a child that is no branch, delegate or tool child (0.22's
        _resume_lineage_ids); [session_id] for anything else or an unknown id."""
        def lineage_row(sid):
            return conn.execute("SELECT id, parent_session_id, source, model_config, end_reason "
                                "FROM sessions WHERE id = ?", (sid,)).fetchone()
        chain, current = [session_id], (lineage_row(session_id) if session_id else None)
        while current is not None and len(chain) < LINEAGE_MAX_HOPS:
            parent_id = current["parent_session_id"]
            if not parent_id or parent_id in chain or is_fork_child(current):
                break
            parent = lineage_row(parent_id)
            if parent is None or parent["end_reason"] != COMPRESSION_END_REASON:
                break
            chain.append(parent_id)
            current = parent
        return chain[::-1]

    def _write_columns(self, conn=None):
        """The columns a message write names here: MESSAGE_WRITE_COLUMNS and those of
        OPTIONAL_WRITE_COLUMNS the store's messages table has. Read once per SessionDB, from
        `conn` or a reader (SessionDB brings the schema up to date when it opens the store)."""
        if self._message_columns is None:
            found = live_columns(conn, "messages") if conn is not None else self._with_reader(
                lambda reader: live_columns(reader, "messages"))
            self._message_columns = MESSAGE_WRITE_COLUMNS + tuple(
                name for name in OPTIONAL_WRITE_COLUMNS if name in found)
        return self._message_columns

    def _refuse_active_turn_lease(self, conn, session_id):
        """Inside a write: SessionTurnLeaseLostError while a turn holds the conversation's lease
        or SessionCompressionInProgressError while a compression holds the session's lock, as
        0.22 refuses a user's rewrite of the transcript; an expired lease or lock is removed."""
        now = time.time()
        key = self._turn_lease_key(conn, session_id)
        lease = conn.execute("SELECT holder, expires_at FROM session_turn_leases"
                             " WHERE conversation_id = ?", (key,)).fetchone()
        if lease is not None:
            if float(lease["expires_at"]) > now:
                raise SessionTurnLeaseLostError(
                    f"Session has an active turn lease; refusing transcript mutation for"
                    f" {session_id!r}")
            conn.execute("DELETE FROM session_turn_leases WHERE conversation_id = ? AND holder = ?",
                         (key, lease["holder"]))
        lock = conn.execute(SELECT_COMPRESSION_LOCK_SQL, (session_id,)).fetchone()
        if lock is not None:
            if float(lock["expires_at"]) > now:
                raise SessionCompressionInProgressError(
                    f"Session {session_id!r} is being compressed by another writer")
            conn.execute("DELETE FROM compression_locks WHERE session_id = ? AND holder = ?",
                         (session_id, lock["holder"]))

    # -- reads ---------------------------------------------------------------------

    def get_messages(self, session_id, include_inactive=False, include_compacted=False, limit=None,
                     offset=0, latest=False, after_id=None, include_ancestors=False):
        """A session's messages in id order as decoded row dicts; [] for an unknown session.

        Active rows by default; `include_compacted` adds the rows compaction kept (each message
        once, see one_per_generation), `include_inactive` every row. `include_ancestors` reads
        the compression chain the session continues (root first, a branch stands alone), each
        message once. `limit`/`offset` page from the oldest, or from the newest with `latest`;
        `after_id` pages by id. Raises ValueError for `after_id` with `latest`, `offset`,
        `include_compacted` or `include_ancestors`."""
        if after_id is not None and (latest or offset):
            raise ValueError("after_id is incompatible with latest/offset paging")
        if after_id is not None and include_compacted:
            raise ValueError("after_id is incompatible with include_compacted (it pages by offset)")
        if after_id is not None and include_ancestors:
            raise ValueError("after_id is incompatible with include_ancestors (it pages by offset)")
        session_ids = self._ancestor_chain(session_id) if include_ancestors else [session_id]
        sql = (f"SELECT * FROM messages WHERE session_id IN ({placeholders(len(session_ids))})"
               + _visible_rows(include_inactive, include_compacted))
        if include_compacted or len(session_ids) > 1:
            rows = one_per_generation(self._read_all(sql + " ORDER BY id", session_ids),
                                       operator.getitem)
            rows = rows[::-1] if latest else rows
            rows = rows[offset:] if limit is None else rows[offset:][:limit]
        else:
            params = list(session_ids)
            if after_id is not None:
                sql, params = sql + " AND id > ?", params + [after_id]
            sql += " ORDER BY id DESC" if latest else " ORDER BY id"
            if limit is not None or offset:
                sql += " LIMIT ? OFFSET ?"
                params += [-1 if limit is None else limit, offset]
            rows = self._read_all(sql, params)
        return [message_dict(row) for row in (rows[::-1] if latest else rows)]

    def get_messages_as_conversation(self, session_id, include_ancestors=False,
                                     include_inactive=False, repair_alternation=False,
                                     include_row_ids=False, include_compacted=False):
        """The session as chat-API message dicts, oldest first; [] for an unknown session.

        Fields as _conversation_message builds them. `include_ancestors` prepends the compression
        chain the session continues (a branch stands alone) without replayed user turns;
        `include_compacted` adds the rows compaction kept, each message once (for display: the
        model's context stays what compaction left); `repair_alternation` runs
        repair_alternation_in_place; `include_row_ids` adds `_row_id`."""
        session_ids = self._ancestor_chain(session_id) if include_ancestors else [session_id]
        return self._conversation(session_ids, include_inactive, include_ancestors,
                                  repair_alternation, include_row_ids, include_compacted)

    def get_ancestor_display_prefix(self, session_id):
        """The ancestors' part of a resume's display history (the compression chain's messages,
        compacted ones included, each once, less the session's own rows); [] for a branch, a root
        or an unknown session."""
        ancestors = self._resume_chain(session_id)[:-1]
        if not ancestors:
            return []
        theirs = {row[0] for row in self._read_all(
            f"SELECT id FROM messages WHERE session_id IN ({placeholders(len(ancestors))})",
            ancestors)}
        lineage = self._conversation(ancestors + [session_id], False, True,
                                     include_row_ids=True, include_compacted=True)
        return [{key: value for key, value in message.items() if key != "_row_id"}
                for message in lineage if message.get("_row_id") in theirs]

    def _resume_chain(self, session_id):
        """_compression_chain on a reader."""
        return self._with_reader(lambda conn: self._compression_chain(conn, session_id))

    def _ancestor_chain(self, session_id):
        """The sessions whose rows `include_ancestors` reads, root first: 0.22's verified
        compression chain; inside hermes-agent 0.20, as 0.20 reads it, every parent link up to
        the root unless the session is a /branch copy (docs/differences.md, rule 6)."""
        if not host_is_020():
            return self._resume_chain(session_id)
        config = self._read_value("SELECT model_config FROM sessions WHERE id = ?", (session_id,))
        if json_object(config).get("_branched_from"):
            return [session_id]
        return self._session_lineage_root_to_tip(session_id)

    def _conversation(self, session_ids, include_inactive, include_ancestors,
                      repair_alternation=False, include_row_ids=False, include_compacted=False):
        """The messages of `session_ids` in id order, as get_messages_as_conversation gives them.
        Outside 0.20: a tool result stored without its call's uid gets it (pair_tool_result), and
        a replay without row ids carries each row's ownership version (`_db_row_snapshot`) for
        0.22's flush."""
        hosted_by_020 = host_is_020()
        snapshot = repair_alternation and not include_row_ids and not hosted_by_020
        extras = self._write_columns()[len(MESSAGE_WRITE_COLUMNS):] + (
            ("token_count",) if snapshot else ())
        sql = (f"SELECT {CONVERSATION_ROW_COLUMNS}, active{''.join(', ' + c for c in extras)}"
               f" FROM messages WHERE session_id IN ({placeholders(len(session_ids))})"
               f"{_visible_rows(include_inactive, include_compacted)} ORDER BY id")

        def read(conn):  # plain tuples: sqlite3.Row objects read by name cost a third of the call
            cursor = conn.cursor()
            cursor.row_factory = None
            return cursor.execute(sql, session_ids).fetchall()
        rows = self._with_reader(read)
        if include_compacted:
            rows = one_per_generation(rows, _conversation_field)
        width = len(_CONVERSATION_FIELDS)  # the base columns and `active`
        if snapshot:  # where each snapshot column sits in a row (None: the store lacks it)
            read = {name: index for index, name in enumerate((*_CONVERSATION_FIELDS, *extras))}
            places = [read.get(column) for column in SNAPSHOT_COLUMNS]
        messages, calls_seen = [], {}
        for row in rows:
            extra = dict(zip(extras, row[width:])) if extras else None
            message = _conversation_message(row[:width - 1], include_row_ids, extra)
            if not hosted_by_020:
                pair_tool_result(message, calls_seen)
            if snapshot:
                message["_db_row_snapshot"] = snapshot_of(
                    [None if place is None else row[place] for place in places])
            if not repair_alternation:
                message.pop("_compressed_summary", None)  # only a live replay keeps the marker
            if not (include_ancestors and _is_replayed_user_turn(messages, message)):
                messages.append(message)
        messages = _without_review_harness(messages)
        for message in messages:
            if _is_stale_marker(message):
                message["content"] = ""
        if repair_alternation:
            repair_alternation_in_place(messages)
        return messages

    def _session_lineage_root_to_tip(self, session_id):
        """`session_id` with every ancestor by parent link, root first (a loop or
        LINEAGE_MAX_HOPS ends the walk); [session_id] for an unknown id."""
        chain, current = [], session_id
        while current and current not in chain and len(chain) < LINEAGE_MAX_HOPS:
            chain.append(current)
            current = self._read_value("SELECT parent_session_id FROM sessions WHERE id = ?",
                                       (current,))
        return chain[::-1] or [session_id]

    def get_messages_around(self, session_id, around_message_id, window=5):
        """{"window", "messages_before", "messages_after"}: message `around_message_id` with up
        to `window` messages (rewound too) on each side as get_messages rows, and each side's
        count; empty and 0 when the message is not in the session."""
        window = max(window, 0)
        if self._read_one("SELECT 1 FROM messages WHERE id = ? AND session_id = ?",
                          (around_message_id, session_id)) is None:
            return {"window": [], "messages_before": 0, "messages_after": 0}
        sql = "SELECT * FROM messages WHERE session_id = ? AND id {} ? ORDER BY id {} LIMIT ?"
        before = self._read_all(sql.format("<=", "DESC"),
                                (session_id, around_message_id, window + 1))
        after = self._read_all(sql.format(">", ""), (session_id, around_message_id, window))
        return {"window": [decode_message(row) for row in [*before[::-1], *after]],
                "messages_before": max(0, len(before) - 1), "messages_after": len(after)}

    def get_anchored_view(self, session_id, around_message_id, window=5, bookend=3,
                          keep_roles=("user", "assistant")):
        """get_messages_around's dict, its window cut to `keep_roles` (None keeps all; the
        anchor stays), plus "bookend_start"/"bookend_end": the session's first and last
        `bookend` messages with text in `keep_roles` outside the window. All empty when the
        message is not in the session."""
        view = self.get_messages_around(session_id, around_message_id, window=window)
        rows, bookend = view["window"], max(bookend, 0)
        view.update(bookend_start=[], bookend_end=[])
        if not rows:
            return view
        if keep_roles is not None:
            kept = set(keep_roles)
            view["window"] = [m for m in rows
                              if m.get("id") == around_message_id or m.get("role") in kept]
        if bookend > 0:
            roles = "" if keep_roles is None else f" AND role IN ({placeholders(len(keep_roles))})"
            sql = (f"SELECT * FROM messages WHERE session_id = ? AND id {{}} ?{roles}"
                   " AND length(content) > 0 ORDER BY id {} LIMIT ?")
            ends = (("bookend_start", "<", "", rows[0]), ("bookend_end", ">", "DESC", rows[-1]))
            for key, side, order, edge in ends:
                params = (session_id, edge["id"], *(keep_roles or ()), bookend)
                found = self._read_all(sql.format(side, order), params)
                view[key] = [decode_message(row) for row in (found[::-1] if order else found)]
        return view

    def list_recent_user_messages(self, session_id, limit=20, include_inactive=False):
        """The session's newest `limit` user turns, newest first, as {"id", "timestamp",
        "preview"}; [] when none. Rows with a display_kind and compaction handoffs are
        not turns; the preview is the text (a /skill turn as typed), whitespace
        collapsed, cut to 80 characters."""
        active = "" if include_inactive else " AND active = 1"
        rows = self._read_all(
            "SELECT id, timestamp, content FROM messages WHERE session_id = ? AND role = 'user'"
            f"{active} AND (display_kind IS NULL OR display_kind = '') ORDER BY id DESC LIMIT ?",
            (session_id, int(limit) * 2 + 5))
        turns = []
        for row in rows:
            if len(turns) >= int(limit):
                break
            content = decode_content(row["content"])
            if is_compaction_summary(content):
                continue
            if isinstance(content, list):
                texts = (part.get("text") for part in content
                         if isinstance(part, dict) and part.get("type") == "text")
                preview = " ".join(text for text in texts if text).strip() or "[multimodal content]"
            elif isinstance(content, str):
                preview = describe_skill_invocation(content) or content
            else:
                preview = ""
            preview = " ".join(preview.split())
            if len(preview) > PREVIEW_CHARS:
                preview = preview[:PREVIEW_CHARS - 3] + "..."
            turns.append({"id": row["id"], "timestamp": row["timestamp"], "preview": preview})
        return turns

    def message_count(self, session_id=None):
        """Messages of one session, or of the store for an empty `session_id`;
        rewound and compacted count."""
        if session_id:
            return self._read_value("SELECT COUNT(*) FROM messages WHERE session_id = ?",
                                    (session_id,))
        return self._read_value(COUNT_ALL_MESSAGES_SQL)

    def count_messages_all(self, session_id):
        """Every message row of the session, rewound and compacted ones too; 0 for none (and for
        an empty id, where message_count counts the store)."""
        return self.message_count(session_id) if session_id else 0

    def display_message_count(self, session_id):
        """How many messages a display read of the session shows: get_messages with
        include_compacted, counted; 0 for an unknown session."""
        rows = self._read_all(
            "SELECT id, role, content, timestamp, tool_call_id, tool_calls, tool_name, active,"
            " display_metadata FROM messages WHERE session_id = ? AND (active = 1 OR compacted = 1)"
            " ORDER BY id", (session_id,))
        return len(one_per_generation(rows, operator.getitem))

    def latest_conversation_role(self, session_id):
        """Role of the newest active message that is not bookkeeping (session_meta, system);
        None when there is none."""
        return self._read_value(
            "SELECT role FROM messages WHERE session_id = ? AND active = 1"
            " AND role NOT IN ('session_meta', 'system') ORDER BY id DESC LIMIT 1", (session_id,))

    def get_active_message_ids(self, session_id):
        """Ids of the session's active messages, oldest first ([] for none)."""
        return [row[0] for row in self._read_all(
            "SELECT id FROM messages WHERE session_id = ? AND active = 1 ORDER BY id",
            (session_id,))]

    def latest_message_row_id(self, session_id, *, role="user", offset=0, require_text=True):
        """Id of the newest active `role` message (`offset` steps back that many); None when
        there is none, or for a role other than user/assistant or a negative offset.
        `require_text` skips rows without text."""
        if not session_id or role not in ("user", "assistant") or offset < 0:
            return None
        text = "AND content IS NOT NULL AND TRIM(content) != '' " if require_text else ""
        return self._read_value(
            "SELECT id FROM messages WHERE session_id = ? AND role = ? AND active = 1 "
            f"{text}ORDER BY id DESC LIMIT 1 OFFSET ?", (session_id, role, int(offset)))

    def latest_user_message_row_id(self, session_id):
        """Id of the newest active user message with text; None when there is none."""
        return self.latest_message_row_id(session_id, role="user")

    def get_message_role(self, session_id, row_id):
        """Role of the active message `row_id` of the session; None when there is none."""
        if not session_id:
            return None
        return self._read_value(
            "SELECT role FROM messages WHERE id = ? AND session_id = ? AND active = 1",
            (int(row_id), session_id))

    def has_platform_message_id(self, session_id, platform_message_id):
        """True if the session has a message (active or not) with this platform message id."""
        row = self._read_one(
            "SELECT 1 FROM messages WHERE session_id = ? AND platform_message_id = ? LIMIT 1",
            (session_id, platform_message_id))
        return row is not None

    # -- rewind ----------------------------------------------------------------------

    def rewind_to_message(self, session_id, target_message_id, *, preserve_compaction_handoff=False,
                          expected_active_ids=None, expected_target_content=None):
        """Withdraw user message `target_message_id` and all after it (kept inactive);
        returns {"rewound_count", "target_message" (the row, content decoded), "new_head_id"
        (newest active or None)}.

        rewind_count goes up by one per call; message_count and tool_call_count count the live
        rows left (0.22), but stay as they were inside hermes-agent 0.20 unless a 0.22 keyword
        is given.
        0.22's keywords: `expected_active_ids` (the session's active ids, oldest first) and
        `expected_target_content` (the target's turn as split_user_turn reads it) must still
        hold, else RuntimeError; `preserve_compaction_handoff` needs a compaction carrier as the
        target and stores its handoff as the new head (the result adds
        "replacement_message_id" and "replacement_message_uid"). With any of them, a live turn
        lease or compression lock refuses the rewind as _refuse_active_turn_lease says.
        Raises ValueError when the message is not a user message of the session (or not a
        turn, or no carrier, where a keyword asks). Nothing is written when it raises. Undo with
        restore_rewound."""
        checked = (preserve_compaction_handoff or expected_active_ids is not None
                   or expected_target_content is not None)

        def write(conn):
            if checked:
                self._refuse_active_turn_lease(conn, session_id)
            if expected_active_ids is not None and [row[0] for row in conn.execute(
                    "SELECT id FROM messages WHERE session_id = ? AND active = 1 ORDER BY id",
                    (session_id,))] != list(expected_active_ids):
                raise RuntimeError("active transcript changed before the rewind could be persisted")
            target = conn.execute("SELECT * FROM messages WHERE id = ? AND session_id = ?",
                                  (target_message_id, session_id)).fetchone()
            if target is None:
                raise ValueError(
                    f"message {target_message_id!r} is not in session {session_id!r}")
            if target["role"] != "user":
                raise ValueError(f"rewind target must be a 'user' message, not {target['role']!r}"
                                 f" (message {target_message_id!r})")
            target = dict(target, content=decode_content(target["content"]))
            handoff = _rewind_handoff(target, expected_target_content,
                                      preserve_compaction_handoff) if checked else None
            rewound = conn.execute(
                "UPDATE messages SET active = 0 WHERE session_id = ? AND id >= ? AND active = 1",
                (session_id, target_message_id)).rowcount
            if handoff is not None:
                self._insert_message_rows(conn, session_id, [handoff])  # stamps _row_id
            conn.execute(
                "UPDATE sessions SET rewind_count = COALESCE(rewind_count, 0) + 1 WHERE id = ?",
                (session_id,))
            if checked or not host_is_020():  # 0.22 counts what stays live; 0.20 left the counts
                live = [row[0] for row in conn.execute(
                    "SELECT tool_calls FROM messages WHERE session_id = ? AND active = 1",
                    (session_id,))]
                calls = sum(call_count(loads_or(text, None)) for text in live if text)
                conn.execute(SET_MESSAGE_COUNTS_SQL, (len(live), calls, session_id))
            head = conn.execute("SELECT MAX(id) FROM messages WHERE session_id = ? AND active = 1",
                                (session_id,)).fetchone()[0]
            result = {"rewound_count": rewound, "new_head_id": head,
                      "target_message": host_view(dict(target), "messages")}
            if preserve_compaction_handoff:
                result.update(replacement_message_id=handoff["_row_id"],
                              replacement_message_uid=handoff.get(MESSAGE_UID))
            return result
        return self._execute_write(write)

    def restore_rewound(self, session_id, since_message_id):
        """Make the session's inactive messages from `since_message_id` on active again;
        returns how many."""
        return self._update_rows("UPDATE messages SET active = 1 WHERE session_id = ? AND id >= ? "
                                 "AND active = 0", (session_id, since_message_id))

    def clear_messages(self, session_id):
        """Delete every message of the session (rewound and compacted ones too) and zero its message
        and tool call counts, in one transaction; None, and nothing for an unknown session."""
        def write(conn):
            conn.execute("DELETE FROM messages WHERE session_id = ?", (session_id,))
            conn.execute(SET_MESSAGE_COUNTS_SQL, (0, 0, session_id))
        self._execute_write(write)

    def has_archived_messages(self, session_id):
        """True if the session keeps any inactive (rewound or compacted) message; else False."""
        row = self._read_one("SELECT 1 FROM messages WHERE session_id = ? AND active = 0 LIMIT 1",
                             (session_id,))
        return row is not None

    def get_first_assistant_text(self, session_id):
        """The text of the session's first assistant message with content (by time, then id;
        inactive ones count); '' when there is none or its content is a list."""
        content = self._read_value(
            "SELECT content FROM messages WHERE session_id = ? AND role = 'assistant'"
            " AND content IS NOT NULL ORDER BY timestamp, id LIMIT 1", (session_id,))
        text = decode_content(content)
        return text if isinstance(text, str) else ""


# -- append_message's later parameters ----------------------------------------------
# 0.20 and 0.22 disagree on the positions after `effect_disposition`: 0.22 put `_compressed_summary`
# first and `message_uid` last. No caller of either passes that far by position, but both shapes
# stay callable: a bool in the first later position is 0.22's `_compressed_summary` (a timestamp
# is never a bool), anything else 0.20's `timestamp`.
_APPEND_LATER_ORDERS = {
    "0.20": ("timestamp", "api_content", "display_kind", "display_metadata",
             "compression_lock_holder", "turn_lease_holder", "turn_lease_ttl_seconds"),
    "0.22": ("_compressed_summary", "timestamp", "api_content", "display_kind",
             "display_metadata", "compression_lock_holder", "turn_lease_holder",
             "turn_lease_ttl_seconds", "message_uid"),
}
_APPEND_LATER_DEFAULTS = {name: None for name in _APPEND_LATER_ORDERS["0.22"]}
_APPEND_LATER_DEFAULTS.update(_compressed_summary=False, turn_lease_ttl_seconds=300.0)


def _append_later_fields(positional, named):
    """append_message's parameters after `effect_disposition`, from its `*later` and `**named`,
    with their defaults; TypeError as Python gives for a bad call."""
    order = _APPEND_LATER_ORDERS["0.22" if positional and isinstance(positional[0], bool)
                                 else "0.20"]
    if len(positional) > len(order):
        raise TypeError(f"append_message() takes at most {16 + len(order)} positional arguments"
                        f" after self ({16 + len(positional)} given)")
    fields = dict(zip(order, positional))
    for name, value in named.items():
        if name not in _APPEND_LATER_DEFAULTS:
            raise TypeError(f"append_message() got an unexpected keyword argument {name!r}")
        if name in fields:
            raise TypeError(f"append_message() got multiple values for argument {name!r}")
        fields[name] = value
    return {**_APPEND_LATER_DEFAULTS, **fields}


def _replay_identity(role, content, tool_call_id, tool_calls):
    """What replace_messages compares to keep a live row: content as a read gives it back."""
    if isinstance(tool_calls, str):
        tool_calls = loads_or(tool_calls, [])
    return (role, encode_content(loaded_view_content(role, content)), tool_call_id,
            json.dumps(tool_calls) if tool_calls else None)


def _kept_live_prefix(live, messages):
    """How many of `live` rows (id, role, content, tool_call_id, tool_calls) hold the head of
    `messages` in order; each such dict gets its row's `_row_id`."""
    kept = 0
    for row, message in zip(live, messages):
        if not isinstance(message, dict):
            break
        role = message.get("role", "unknown")
        if row["role"] != role or row["tool_call_id"] != message.get("tool_call_id"):
            break
        ours = _replay_identity(role, message.get("content"), message.get("tool_call_id"),
                                message.get("tool_calls"))
        if ours != _replay_identity(row["role"], decode_content(row["content"]),
                                    row["tool_call_id"], row["tool_calls"]):
            break
        message["_row_id"] = row["id"]
        kept += 1
    return kept


def _is_row_id(value):
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _rewind_handoff(target, expected_content, keep_handoff):
    """rewind_to_message's checks of its target row (content decoded): the handoff to store in
    its place with `keep_handoff`, else None."""
    if not target["active"]:
        raise ValueError("rewind target is not active")
    meta = decode_display_metadata(target["display_metadata"])
    handoff, live = split_user_turn(dict(target, display_metadata=meta))
    if live is None:
        raise ValueError("rewind target is not a user-originated turn")
    if expected_content is not None \
            and loaded_view_content("user", live["content"]) != expected_content:
        raise RuntimeError("rewind target changed before it could be persisted")
    if keep_handoff and handoff is None:
        raise ValueError("preserve_compaction_handoff requires an active composite carrier")
    return handoff if keep_handoff else None


def _check_open_session(conn, session_id, must_exist=True):
    row = conn.execute("SELECT ended_at, end_reason FROM sessions WHERE id = ?",
                       (session_id,)).fetchone()
    if row is None:
        if must_exist:
            raise UnknownSessionError(session_id)
    elif row["ended_at"] is not None and row["end_reason"] == COMPRESSION_END_REASON:
        raise CompressionSessionClosedError(session_id)


def message_dict(row):
    """A `SELECT *` row as get_messages gives it: decode_message's dict without schema 31's display
    index (`display_identity` is bytes, which a JSON reply cannot hold), `_compressed_summary`
    only when set (as True), and inside 0.20 without any of schema 31's columns (host_view)."""
    message = decode_message(row)
    for key in ("display_identity", "display_order"):
        message.pop(key, None)
    if message.pop("_compressed_summary", 0):
        message["_compressed_summary"] = True
    return host_view(message, "messages")


def _visible_rows(include_inactive, include_compacted):
    """The WHERE clause of a read: every row, live and compacted ones, or live ones only."""
    if include_inactive:
        return ""
    return " AND (active = 1 OR compacted = 1)" if include_compacted else " AND active = 1"


def one_per_generation(rows, field, first_ids=None):
    """Compaction copies its kept tail into each generation: one row per message (same role,
    content, time and tool fields; an assistant's tool calls by their ids), preferring the live
    one, then the newest, in the order of each message's first row. Rows only the model reads
    (display_metadata `model_only`) are left out. `rows` come in id order; `field(row, name)`
    reads a column (0.22's _dedupe_display_generations). `first_ids`, a dict, gets {id of a row
    kept: id of its message's first row}."""
    best, first = {}, {}
    for row in rows:
        meta = field(row, "display_metadata")
        if meta and "model_only" in meta \
                and (decode_display_metadata(meta) or {}).get("model_only"):
            continue
        key = _generation_key(row, field)
        rank = (field(row, "active"), field(row, "id"))
        if key not in best or rank > (field(best[key], "active"), field(best[key], "id")):
            best[key] = row
        first.setdefault(key, field(row, "id"))
    if first_ids is not None:
        first_ids.update((field(best[key], "id"), first[key]) for key in best)
    return [best[key] for key in sorted(best, key=first.__getitem__)]


def _generation_key(row, field):
    """What makes two rows one message across generations. A pruned copy of a tool-calling
    assistant turn has other arguments but the same call ids, so those stand for its calls."""
    values = [field(row, name) for name in ("role", "content", "timestamp", "tool_call_id",
                                            "tool_calls", "tool_name")]
    if values[0] == "assistant" and values[4]:
        calls = loads_or(values[4], None)
        ids = tuple(tool_call_key(call) for call in calls) if isinstance(calls, list) else ()
        if ids and all(ids):
            values[1], values[4] = None, ids
    return tuple(values)


# -- the conversation --------------------------------------------------------------

# The columns _conversation reads, in the order _conversation_message unpacks them.
CONVERSATION_ROW_COLUMNS = (
    "id, role, content, tool_call_id, tool_calls, tool_name, effect_disposition, finish_reason, "
    "reasoning, reasoning_content, reasoning_details, codex_reasoning_items, codex_message_items, "
    "platform_message_id, observed, timestamp, api_content, display_kind, display_metadata")
_CONVERSATION_FIELDS = {name: index for index, name
                        in enumerate(CONVERSATION_ROW_COLUMNS.split(", ") + ["active"])}


def _conversation_field(row, name):
    """A column of a _conversation row (a plain tuple) by name."""
    return row[_CONVERSATION_FIELDS[name]]



def _conversation_message(row, include_row_id, extra=None):
    """A row (CONVERSATION_ROW_COLUMNS, in order) as a chat-API dict: role, content (memory blocks
    cut), `_db_persisted`, the fields set; on assistant turns the reasoning fields
    (`reasoning_content` also "").
    `extra`, {column: value} of the identity columns a store has, adds the dict's identity keys
    (and `_compressed_summary` when it holds that column, for a replay that keeps the marker)."""
    (row_id, role, content, tool_call_id, tool_calls, tool_name, effect_disposition, finish_reason,
     reasoning, reasoning_content, reasoning_details, codex_reasoning_items, codex_message_items,
     platform_message_id, observed, timestamp, api_content, display_kind, display_metadata) = row
    if isinstance(content, str) and content.startswith(CONTENT_JSON_PREFIX):
        content = decode_content(content)
    # Most of a row's columns are NULL: each is tested once, in the order the dict's keys keep.
    # Born durable: 0.22's flush skips a dict with this marker, so a loaded transcript is never
    # written twice; 0.22 stamps it on every row it loads, 0.20's own loader on none.
    message = {"role": role, "content": loaded_view_content(role, content)}
    if not host_is_020():
        message["_db_persisted"] = True
    if include_row_id and row_id is not None:
        message["_row_id"] = row_id
    if extra and not host_is_020():  # 0.20 sends a loaded dict's keys to the model as they are
        message.update(identity_keys(extra))
        if extra.get("_compressed_summary"):
            message["_compressed_summary"] = True
    if api_content:
        message["api_content"] = api_content
    if display_kind:
        message["display_kind"] = display_kind
    if display_metadata is not None:
        meta = decode_display_metadata(display_metadata)
        if meta is not None:
            message["display_metadata"] = meta
    if timestamp:
        message["timestamp"] = timestamp
    if tool_call_id:
        message["tool_call_id"] = tool_call_id
    if tool_name:
        message["tool_name"] = tool_name
    if effect_disposition:
        message["effect_disposition"] = effect_disposition
    if tool_calls:
        message["tool_calls"] = loads_or(tool_calls, [])
    if platform_message_id:
        message["message_id"] = platform_message_id
    if observed:
        message["observed"] = True
    if role == "assistant":
        if finish_reason:
            message["finish_reason"] = finish_reason
        if reasoning:
            message["reasoning"] = reasoning
        if reasoning_content is not None:
            message["reasoning_content"] = reasoning_content
        for key, value in (("reasoning_details", reasoning_details),
                           ("codex_reasoning_items", codex_reasoning_items),
                           ("codex_message_items", codex_message_items)):
            if value:
                message[key] = loads_or(value, None)
    return message


def _is_replayed_user_turn(messages, message):
    """True when a user turn repeats one already there with no assistant answer between."""
    content = message["content"]
    if message["role"] != "user" or not isinstance(content, str) or not content:
        return False
    for earlier in reversed(messages):
        if earlier["role"] == "user" and earlier["content"] == content:
            return True
        if earlier["role"] == "assistant" and (earlier["content"] or earlier.get("tool_calls")):
            return False
    return False


def _without_review_harness(messages):
    """Drop background-review prompts and the assistant answer right after each."""
    kept, skip_answer = [], False
    for message in messages:
        content = message["content"]
        if message["role"] in ("user", "system") and isinstance(content, str) \
                and content.lstrip().startswith(_REVIEW_HARNESS_PREFIXES):
            skip_answer = True
            continue
        answer, skip_answer = skip_answer and message["role"] == "assistant", False
        if not answer:
            kept.append(message)
    return kept


def _is_stale_marker(message):
    content = message["content"]
    return (message["role"] == "assistant" and bool(message.get("tool_calls"))
            and isinstance(content, str) and STALE_MARKER.fullmatch(content.strip()) is not None)
