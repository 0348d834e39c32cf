"""Session rows: create (or enrich), read, resolve, end and reopen, flags, listing, counts, model
and cwd.

Owns what a session row holds and who may change it, through SessionDB's write and read paths and
the maintenance mixin's `_sweep_before_reuse` (a session made again never shows a deleted one's
messages). Never touches a message's content, the search indexes or the schema; title rules live in
hermes_state_titles, compression and resume in hermes_state_compression.
"""

import collections
import functools
import json
import logging
import re
import sqlite3
import string
import time
from pathlib import Path

from hermes_constants import get_default_hermes_root

from hermes_state_common import (
    DELETE_UNUSED_PROMPTS_SQL, INSERT_SYSTEM_PROMPT_SQL, LAST_ACTIVE_SQL, MESSAGES_LAST_ACTIVE_SQL,
    SELECT_META_SQL, SESSION_EXISTS_SQL, SESSION_ID_MAX_LENGTH, SESSION_RICH_SQL, TABLE_EXISTS_SQL,
    SKILL_EXCERPT_JOINT, _RESET_END_REASONS, chunked, cwd_prefix_clause, describe_skill_invocation,
    escape_like, has_fork_marker, host_is_020, host_view, is_fork_child, json_object, loads_or,
    merge_model_config, placeholders, require_text, sqlite_keeps,
    workspace_key,  # noqa: F401 (hermes-agent imports it from this module)
)
from hermes_state_errors import SessionInputTypeError, SessionRowError
from hermes_state_schema import (
    JUDGED_KIND_SQL, LISTED_ROOT_SQL, LISTING_OBJECTS, LISTING_VERSION, META_LISTING_READY,
    SELECT_LISTING_OBJECT_COUNT_SQL, TALLY_JUDGED_KINDS, TALLY_LISTED_KINDS, declared_columns,
    live_columns, prompt_hash)

logger = logging.getLogger("hermes_state")

# Sources whose sessions are no human conversation (kanban workers, tool integrations, one-shot
# runs): hermes-agent's session pickers leave them out.
INTERNAL_LISTING_SOURCES = ("kanban", "tool", "oneshot")
# Ends that were accidents (a reaper, a closed client, a resume elsewhere), not the user's
# choice: unarchive_recoverable_session brings such a session back.
RECOVERABLE_END_REASONS = (
    "agent_close", "ws_orphan_reap", "superseded_by_resume", "startup_orphan_reap")

# What create_session may fill on an existing row: only columns still NULL, so a later bare call
# (source "unknown", no model) never clobbers a real value.
# transport_profile only where the store has the column (hermes-agent 0.22's schema).
_FILLABLE_COLUMNS = (
    "model", "model_config", "user_id", "session_key", "chat_id", "chat_type", "thread_id",
    "parent_session_id", "cwd", "profile_name", "git_repo_root", "origin_json", "display_name",
    "transport_profile")
# Taken from the parent a child names, so a fork never drops out of its project; profile_name only
# when the two are not keyed under different gateway namespaces (`agent:<ns>:`).
_INHERITED_COLUMNS = ("cwd", "git_repo_root", "git_branch", "profile_name")
# Taken from a parent compression ended by its continuation (not by a branch or delegate run of
# it): the gateway's routing, so a continuation stays reachable if the gateway dies before
# re-recording it.
_ROUTING_COLUMNS = (
    "user_id", "session_key", "chat_id", "chat_type", "thread_id", "display_name", "origin_json",
    "transport_profile")
# A profile's folder name, as hermes-agent names profiles.
_PROFILE_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
# The compression chain through ? (both directions); the flag setters change it as one conversation.
_LINEAGE_IDS_SQL = """
WITH RECURSIVE
  up(id) AS (SELECT ? UNION SELECT p.id FROM up JOIN sessions AS c ON c.id = up.id
             JOIN sessions AS p ON p.id = c.parent_session_id WHERE p.end_reason = 'compression'),
  down(id) AS (SELECT ? UNION SELECT c.id FROM down JOIN sessions AS p ON p.id = down.id
               JOIN sessions AS c ON c.parent_session_id = p.id WHERE p.end_reason = 'compression')
SELECT id FROM up UNION SELECT id FROM down"""
# What the listing rules read of every matching session (see _is_listable).
_CANDIDATES_SQL = ("SELECT s.id, s.source, s.title, s.model_config, s.started_at, s.session_key,"
                   " s.parent_session_id AS parent, p.end_reason AS parent_end_reason,"
                   " p.ended_at AS parent_ended_at, p.session_key AS parent_key")
_CANDIDATES_FROM_SQL = " FROM sessions AS s LEFT JOIN sessions AS p ON p.id = s.parent_session_id"
# Listable without a look at their markers: roots that cannot be subagent runs.
_PLAIN_ROOT_SQL = LISTED_ROOT_SQL.format(r="s")
# What a listed compression root shows of its tip; the root keeps the rest (its start, flags,
# watermark).
_PROJECTED_COLUMNS = (
    "id", "ended_at", "end_reason", "message_count", "tool_call_count", "title", "last_active",
    "preview", "model", "system_prompt", "cwd", "git_branch", "git_repo_root")
_COMPACT_LEFT_OUT = frozenset({"system_prompt", "system_prompt_hash", "git_metadata_generation"})
_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)
_PREVIEW_MAX_CHARS = 60
_DEFAULT_RE = re.compile(r"\bDEFAULT\s+(.+)$")


class SessionSessionsMixin:
    """SessionDB's methods for session rows and listing.

    Relies on: `_execute_write`, `_update_rows`, `_read_all`, `_read_one`, `_read_value`,
    `_with_reader`, `_transcript_patience`, `read_only`, `stale_schema` (SessionDB);
    `_sweep_before_reuse` (maintenance mixin); `_flush_token_counts` (usage mixin);
    `get_compression_tip`, `get_compression_lineage` (compression mixin)."""

    RECOVERABLE_END_REASONS = RECOVERABLE_END_REASONS

    def create_session(self, session_id, source, **kwargs):
        """Create the session, or fill the still-empty fields of an existing one (its source only
        when that is the bare 'unknown'); returns its id.

        Keywords are _insert_session_row's (model_config a dict; transport_profile kept where the
        store has the column). Without a profile_name the row gets the store's own
        (_own_profile_name). A child inherits the parent's cwd, git and profile (not across two
        gateway namespaces), and its gateway routing if it continues a parent compression ended.
        Raises,
        writing nothing, TypeError for an unknown keyword, SessionRowError (a ValueError and
        IntegrityError) for a missing id or source or an unknown parent, SessionInputTypeError for
        a non-text prompt."""
        self._insert_session_row(session_id, source, **kwargs)
        return session_id

    def ensure_session(self, session_id, source="unknown", model=None, **kwargs):
        """Make sure the session exists (create_session's rules); returns its id."""
        self._insert_session_row(session_id, source, model=model, **kwargs)
        return session_id

    def _insert_session_row(self, session_id, source, model=None, model_config=None,
                            system_prompt=None, user_id=None, session_key=None, chat_id=None,
                            chat_type=None, thread_id=None, parent_session_id=None, cwd=None,
                            profile_name=None, git_repo_root=None, origin_json=None,
                            display_name=None, transport_profile=None):
        try:
            require_text("session_id", session_id, max_length=SESSION_ID_MAX_LENGTH)
        except ValueError as exc:
            raise SessionRowError(f"{exc}; no session was written") from None
        if source is None:
            raise SessionRowError("source must be given, not None; no session was written")
        digest = _prompt_digest(system_prompt)
        # 0.22 stamps the store's own profile and replaces a bare 'unknown' source; inside 0.20
        # the row stays as 0.20 writes it (docs/differences.md, rule 6).
        as_022 = not host_is_020()
        if as_022 and not (profile_name or "").strip():
            profile_name = self._own_profile_name()
        values = dict(zip(_FILLABLE_COLUMNS, (
            model, _config_json(model_config), user_id, session_key, chat_id, chat_type, thread_id,
            parent_session_id, cwd, profile_name, git_repo_root, origin_json, display_name,
            transport_profile)))
        for name, value in (("source", source), *values.items()):
            if not sqlite_keeps(value):
                raise SessionRowError(f"{name} must be text or a number SQLite can store, "
                                      f"not {value!r:.60}; no session was written")
        self._sweep_before_reuse(session_id)

        def write(conn):
            if digest:
                conn.execute(INSERT_SYSTEM_PROMPT_SQL, (digest, system_prompt))
            row = conn.execute("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()
            live = set(live_columns(conn, "sessions"))
            changes = _fill_values(row, {c: v for c, v in values.items() if c in live}, digest)
            parent = changes.get("parent_session_id")
            if (parent and parent != session_id
                    and not conn.execute(SESSION_EXISTS_SQL, (parent,)).fetchone()):
                raise SessionRowError(f"parent_session_id {parent!r} names no session; "
                                      "no session was written")
            if row is None:
                changes.update(id=session_id, source=source, started_at=time.time())
                if "created_source" in live:  # the first surface, kept for good
                    changes["created_source"] = source
                conn.execute(f"INSERT INTO sessions ({', '.join(changes)})"
                             f" VALUES ({placeholders(len(changes))})",
                             tuple(changes.values()))
            elif as_022 and row["source"] == "unknown" and source != "unknown":
                # A bare row made for token counts: the real surface names it.
                changes["source"] = source
            if row is not None and changes:
                conn.execute(f"UPDATE sessions SET {', '.join(f'{c} = ?' for c in changes)}"
                             " WHERE id = ?",
                             (*changes.values(), session_id))
            if digest:
                conn.execute(DELETE_UNUSED_PROMPTS_SQL)
            if parent_session_id:
                _inherit_from_parent(conn, session_id)
        self._execute_write(write, patience_s=self._transcript_patience())

    def _own_profile_name(self):
        """The profile this store belongs to, from its path: 'default' for `<root>/state.db`, the
        name for `<root>/profiles/<name>/state.db`; None anywhere else (never a guess)."""
        try:
            root = get_default_hermes_root().resolve()
            folder = Path(self.db_path).resolve().parent
        except (OSError, RuntimeError):
            return None
        if folder == root:
            return "default"
        if folder.parent == root / "profiles" and _PROFILE_NAME_RE.fullmatch(folder.name):
            return folder.name
        return None

    def update_system_prompt(self, session_id, system_prompt):
        """Store the session's full system prompt (None clears it); nothing for an unknown session.
        Raises SessionInputTypeError, before writing, for a value that is not text."""
        digest = _prompt_digest(system_prompt)

        def write(conn):
            if digest:
                conn.execute(INSERT_SYSTEM_PROMPT_SQL, (digest, system_prompt))
            conn.execute(
                "UPDATE sessions SET system_prompt_hash = ?, system_prompt = NULL WHERE id = ?",
                (digest, session_id))
            conn.execute(DELETE_UNUSED_PROMPTS_SQL)
        self._execute_write(write)

    def get_session(self, session_id):
        """Every column of a session, `system_prompt` resolved; None for an unknown id."""
        self._flush_token_counts()
        return next(iter(self._read_sessions("", " WHERE s.id = ?", (session_id,))), None)

    def _read_sessions(self, columns, tail, params):
        """Session dicts, prompt resolved, with computed `columns` added and `tail` after the
        FROM."""
        return self._resolved(
            self._read_all(f"SELECT s.*{columns} FROM sessions AS s" + tail, params))

    def _resolved(self, rows):
        """`rows` as dicts, `system_prompt` read from its hash and `tool_names` from the hash it
        holds (a legacy inline list stays; each stored text read once), and a rich row's
        `_preview_raw` shaped into `preview`."""
        prompts, sessions = {}, [row if type(row) is dict else dict(row) for row in rows]
        for session in sessions:
            for column, digest in (("system_prompt", session.get("system_prompt_hash")),
                                   ("tool_names", session.get("tool_names"))):
                if not isinstance(digest, str) or not digest:
                    continue
                if digest not in prompts:
                    prompts[digest] = self._read_value(
                        "SELECT prompt FROM system_prompts WHERE hash = ?", (digest,))
                if prompts[digest] is not None:
                    session[column] = prompts[digest]
            if "_preview_raw" in session:
                session["preview"] = _shape_preview(session.pop("_preview_raw"))
            host_view(session, "sessions")
            if not host_is_020():
                _lift_fork_markers(session)
        return sessions

    def resolve_session_id(self, session_id_or_prefix):
        """The id itself if it exists, else the only id starting with it, ASCII case ignored as in
        hermes-agent; None if none or ambiguous."""
        if not isinstance(session_id_or_prefix, str) or not session_id_or_prefix:
            return None
        if self._read_one(SESSION_EXISTS_SQL, (session_id_or_prefix,)):
            return session_id_or_prefix
        matches = self._read_all("SELECT id FROM sessions WHERE id LIKE ? ESCAPE '\\' LIMIT 2",
                                 (escape_like(session_id_or_prefix) + "%",))
        return matches[0][0] if len(matches) == 1 else None

    def end_session(self, session_id, end_reason):
        """Mark a session ended now with `end_reason`; returns None. The first end wins (reopen to
        re-end)."""
        self._execute_write(lambda conn: self._end_at_boundary(
            conn, "UPDATE sessions SET ended_at = :now, end_reason = :reason"
                  " WHERE id = :id AND ended_at IS NULL", session_id, end_reason))

    def _end_at_boundary(self, conn, update, session_id, reason):
        """Inside a write: run `update` (binds :now, :reason, :id) and, when it ended the session
        with a reset reason (a conversation boundary), count the boundary for its routing peer in
        conversation_generations (0.22's; never derived from session rows, which prunes delete,
        so a generation is never handed out twice). The rows it changed."""
        changed = conn.execute(update, {"now": time.time(), "reason": reason,
                                        "id": session_id}).rowcount
        if changed and reason in _RESET_END_REASONS:
            conn.execute(
                "INSERT INTO conversation_generations (source, session_key, generation)"
                " SELECT TRIM(source), TRIM(session_key), 1 FROM sessions WHERE id = :id"
                " AND TRIM(COALESCE(source, '')) <> '' AND TRIM(COALESCE(session_key, '')) <> ''"
                " ON CONFLICT (source, session_key) DO UPDATE SET generation = generation + 1",
                {"id": session_id})
        return changed

    def latest_conversation_boundary(self, session_key, source):
        """How many conversation boundaries (resets) the peer (`session_key`, `source`) has
        crossed; None when none, or for an empty key or source."""
        if not session_key or not source:
            return None
        try:
            generation = self._read_value("SELECT generation FROM conversation_generations"
                                          " WHERE source = ? AND session_key = ?",
                                          (source, session_key))
        except sqlite3.OperationalError:  # a read-only store 0.22 never opened: none counted
            return None
        return int(generation) if generation else None

    def reopen_session(self, session_id):
        """Clear a session's end so it can be resumed; returns None. Children that continued it
        across a reset on its routing key get `_reset_from`, so they stay separate conversations."""
        def write(conn):
            parent = conn.execute("SELECT end_reason, session_key FROM sessions WHERE id = ?",
                                  (session_id,)).fetchone()
            if (parent is not None and parent["end_reason"] in _RESET_END_REASONS
                    and parent["session_key"]):
                children = conn.execute(
                    "SELECT id, model_config FROM sessions WHERE parent_session_id = ?"
                    " AND session_key = ?",
                    (session_id, parent["session_key"])).fetchall()
                for child in children:
                    config = loads_or(child["model_config"] or "{}", None)
                    if isinstance(config, dict) and config.get("_reset_from") is None:
                        config["_reset_from"] = session_id
                        conn.execute("UPDATE sessions SET model_config = ? WHERE id = ?",
                                     (json.dumps(config, separators=(",", ":")), child["id"]))
            conn.execute("UPDATE sessions SET ended_at = NULL, end_reason = NULL WHERE id = ?",
                         (session_id,))
        self._execute_write(write)

    def backfill_null_session_profiles(self, profile_name):
        """Stamp `profile_name` on every session without one (NULL or blank); never replaces an
        owner. Returns how many rows changed (0 for a blank name)."""
        stamp = (profile_name or "").strip()
        if not stamp:
            return 0
        return self._update_rows(
            "UPDATE sessions SET profile_name = ?"
            " WHERE profile_name IS NULL OR TRIM(profile_name) = ''", (stamp,))

    def backfill_acp_session_cwd(self):
        """Fill the cwd of ACP sessions that have none from their model_config's `cwd`, which the
        ACP adapter wrote; returns how many rows changed. A cwd already set always wins."""
        def write(conn):
            rows = conn.execute(
                "SELECT id, model_config FROM sessions WHERE source = 'acp'"
                " AND COALESCE(cwd, '') = '' AND instr(model_config, 'cwd') > 0").fetchall()
            changed = 0
            for row in rows:
                cwd = json_object(row["model_config"]).get("cwd")
                if isinstance(cwd, str) and cwd:
                    changed += conn.execute("UPDATE sessions SET cwd = ? WHERE id = ?",
                                            (cwd, row["id"])).rowcount
            return changed
        return self._execute_write(write)

    def is_explicit_fork_child(self, session_id):
        """True when the session is a branch, delegate run or tool child of its parent, not a
        compression continuation; False for an unknown id."""
        row = self._read_one("SELECT source, model_config, parent_session_id FROM sessions"
                             " WHERE id = ?", (session_id,))
        return row is not None and is_fork_child(row)

    def is_kanban_owned_session(self, session_id):
        """True when the session, or a compression ancestor a resume would load with it, was made
        by the Kanban dispatcher (source or, where the store keeps it, created_source 'kanban')."""
        lineage = self.get_compression_lineage(session_id)
        if not lineage:
            return False
        loaded = lineage[:lineage.index(session_id) + 1] if session_id in lineage else lineage

        def read(conn):
            created = (" OR created_source = 'kanban'"
                       if "created_source" in live_columns(conn, "sessions") else "")
            return any(conn.execute(
                f"SELECT 1 FROM sessions WHERE id IN ({placeholders(len(chunk))})"
                f" AND (source = 'kanban'{created}) LIMIT 1", chunk).fetchone()
                for chunk in chunked(loaded))
        return self._with_reader(read)

    def unarchive_recoverable_session(self, session_id):
        """Unarchive the session's compression chain when its tip ended by accident (one of
        RECOVERABLE_END_REASONS), clearing that end so a later deliberate archive stays; True
        when it did, False for anything else (not archived, archived on purpose, unknown)."""
        if not session_id:
            return False
        row = self._read_one("SELECT archived FROM sessions WHERE id = ?", (session_id,))
        if row is None or not row["archived"]:
            return False
        tip = self.get_compression_tip(session_id)
        reason = self._read_value("SELECT end_reason FROM sessions WHERE id = ?", (tip,))
        if reason not in self.RECOVERABLE_END_REASONS:
            return False
        if not self.set_session_archived(session_id, False):
            return False
        self._update_rows("UPDATE sessions SET ended_at = NULL, end_reason = NULL WHERE id = ?",
                          (tip,))
        return True

    def set_session_archived(self, session_id, archived):
        """Archive or unarchive the session's whole compression chain; False if no row matched."""
        return self._set_lineage_column(session_id, "archived", 1 if archived else 0)

    def set_session_pinned(self, session_id, pinned):
        """Pin or unpin the session's whole compression chain; False if no row matched."""
        return self._set_lineage_column(session_id, "pinned", 1 if pinned else 0)

    def set_session_hidden(self, session_id, hidden):
        """Hide the session's whole compression chain from default listings, or show it; False if
        no row matched."""
        return self._set_lineage_column(session_id, "hidden", 1 if hidden else 0)

    def set_session_read(self, session_id, read=True):
        """Mark the chain read now (or unread: watermark 0, so any activity is newer); False if no
        row matched."""
        return self._set_lineage_column(session_id, "last_read_at", time.time() if read else 0.0)

    def _set_lineage_column(self, session_id, column, value):
        sql = f"UPDATE sessions SET {column} = ? WHERE id IN ({_LINEAGE_IDS_SQL})"
        return self._update_rows(sql, (value, session_id, session_id)) > 0

    def set_expiry_finalized(self, session_id, finalized=True):
        """Record whether the gateway finalized this session's expiry; returns None (nothing for an
        empty id)."""
        if session_id:
            self._update_rows("UPDATE sessions SET expiry_finalized = ? WHERE id = ?",
                              (1 if finalized else 0, session_id))

    def set_session_yolo(self, session_id, enabled):
        """Set model_config.yolo_mode, other keys kept; returns None (nothing for an empty or
        unknown id)."""
        self.patch_session_model_config(session_id, {"yolo_mode": bool(enabled)})

    @staticmethod
    def session_yolo_enabled(session_meta):
        """True when a row's model_config (JSON text or a dict) sets yolo_mode; False on anything
        unreadable, so a resume never turns the bypass on by accident."""
        return bool(json_object((session_meta or {}).get("model_config")).get("yolo_mode"))

    def update_session_model(self, session_id, model, provider=None, *, base_url=None,
                             api_mode=None):
        """Switch the session's model (and provider, if given), dropping the stored system prompt
        and any browser model lock; returns None, nothing for an unknown session.

        A provider with a `base_url` or `api_mode` (hermes-agent 0.22's callers) writes the whole
        route, top level and as `gateway_runtime`, the one not given removed, so a resume never
        sends the new model to the old host; without them the provider alone is written, as
        0.20 stores it (docs/differences.md)."""
        self._flush_token_counts()
        patch = {"browser_model_lock": None}
        patch.update((key, value) for key, value in (("model", model), ("provider", provider))
                     if value)
        if provider and (base_url or api_mode):
            route = {"provider": provider, "base_url": base_url or None,
                     "api_mode": api_mode or None}
            patch.update(route, gateway_runtime=route)

        def write(conn):
            if _merge_config(conn, session_id, patch):
                conn.execute("UPDATE sessions SET model = ?, system_prompt = NULL,"
                             " system_prompt_hash = NULL WHERE id = ?",
                             (model, session_id))
                conn.execute(DELETE_UNUSED_PROMPTS_SQL)
        self._execute_write(write)

    def update_session_tool_names(self, session_id, pin):
        """Store the session's tools pin (JSON-serialisable; None clears it) as hermes-agent does:
        the JSON text once in system_prompts, its hash in sessions.tool_names. Returns None.
        Raises SessionInputTypeError for a pin JSON cannot hold, sqlite3.OperationalError on a
        store without that column."""
        try:
            payload = None if pin is None else json.dumps(pin)
        except (TypeError, ValueError) as exc:
            raise SessionInputTypeError(f"tools pin is not JSON-serialisable: {exc}") from None
        digest = None if payload is None else prompt_hash(payload)

        def write(conn):
            if "tool_names" not in live_columns(conn, "sessions"):
                raise sqlite3.OperationalError(
                    "sessions.tool_names is missing: this store predates the tools pin")
            if digest:
                conn.execute(INSERT_SYSTEM_PROMPT_SQL, (digest, payload))
            conn.execute("UPDATE sessions SET tool_names = ? WHERE id = ?", (digest, session_id))
        self._execute_write(write)

    def update_session_meta(self, session_id, model_config_json, model=None):
        """Replace model_config with `model_config_json` and, unless None, set the model; returns
        None."""
        self._flush_token_counts()
        self._update_rows(
            "UPDATE sessions SET model_config = ?, model = COALESCE(?, model) WHERE id = ?",
            (model_config_json, model, session_id))

    def get_session_model_config_value(self, session_id, key, default=None):
        """One key of a session's model_config; `default` for an unknown session, a missing key or a
        model_config that is not a JSON object."""
        return json_object(self._read_value("SELECT model_config FROM sessions WHERE id = ?",
                                            (session_id,))).get(key, default)

    def patch_session_model_config(self, session_id, patch):
        """Merge `patch` into model_config (a None value removes its key); returns None, and writes
        nothing for an unknown session or an empty patch."""
        if session_id and patch:
            self._execute_write(lambda conn: _merge_config(conn, session_id, patch))

    def update_session_cwd(self, session_id, cwd, git_branch=None, git_repo_root=None,
                           replace_git_meta=False):
        """Record the session's cwd and claim a new git-metadata generation; returns it, None if
        unknown. Branch and repo root are written when non-empty, or replaced (empty clears) when
        the cwd changed or with `replace_git_meta`."""
        if not session_id or not cwd:
            return None
        fields = (("cwd", cwd), ("git_branch", (git_branch or "").strip() or None),
                  ("git_repo_root", (git_repo_root or "").strip() or None))

        def write(conn):
            row = conn.execute("SELECT cwd FROM sessions WHERE id = ?", (session_id,)).fetchone()
            if row is None:
                return None
            # cwd is never empty, so `sets` always holds it and the UPDATE has a column to set.
            sets = {k: v for k, v in fields if v or replace_git_meta or row["cwd"] != cwd}
            conn.execute(f"UPDATE sessions SET {', '.join(f'{c} = ?' for c in sets)},"
                         " git_metadata_generation = COALESCE(git_metadata_generation, 0) + 1"
                         " WHERE id = ?",
                         (*sets.values(), session_id))
            return int(conn.execute("SELECT git_metadata_generation FROM sessions WHERE id = ?",
                                    (session_id,)).fetchone()[0])
        return self._execute_write(write)

    def publish_session_git_metadata(self, session_id, cwd, generation, git_branch=None,
                                     git_repo_root=None):
        """Record a git probe's branch and repo root if its cwd claim is still current; False if
        not."""
        branch, root = (git_branch or "").strip(), (git_repo_root or "").strip()
        if (not session_id or not cwd or isinstance(generation, bool)
                or not isinstance(generation, int) or generation < 1 or not (branch or root)):
            return False
        sets = {k: v for k, v in (("git_branch", branch), ("git_repo_root", root)) if v}
        return self._update_rows(f"UPDATE sessions SET {', '.join(f'{c} = ?' for c in sets)}"
                                 " WHERE id = ? AND cwd = ? AND git_metadata_generation = ?",
                                 (*sets.values(), session_id, cwd, generation)) == 1

    def list_sessions_rich(self, source=None, sources=None, exclude_sources=None, cwd_prefix=None,
                           limit=20, offset=0, include_children=False, min_message_count=0,
                           project_compression_tips=True, order_by_last_active=False,
                           include_archived=False, archived_only=False, id_query=None,
                           search_query=None, compact_rows=False, include_pinned=False,
                           session_key=None, include_hidden=False, include_subagents=False):
        """A page of sessions as rich rows (all columns, `preview`, `last_active`, `unread`); [] if
        none match.

        Newest start first, or newest activity along the compression chain
        (`order_by_last_active`, which alone applies `id_query` and `search_query`: title or id,
        also without punctuation). Unarchived, unhidden roots, branches and resets unless
        `include_children`; a compression root shows as its tip (`_lineage_root_id` names the root)
        unless `project_compression_tips` is False; `include_subagents` lists subagent runs too (not
        continuations). `include_pinned` adds the pinned rows the page left out; `compact_rows`
        drops the prompt columns. `limit` and `offset` are read as SQLite
        reads them (negative: no limit, from 0)."""
        limit, offset = _window_bound(limit), max(_window_bound(offset), 0)
        self._flush_token_counts()
        clauses, params = _filter_clauses(source, sources, exclude_sources, cwd_prefix,
                                          min_message_count, include_archived, archived_only,
                                          session_key, include_hidden)
        end = None if limit < 0 else offset + limit
        id_needle = (id_query or "").strip().lower()
        search_needle = (search_query or "").strip().lower()
        keep = _listing_rule(not include_children, include_subagents)
        # The listing aids' kinds judge the default rule only.
        aided = keep in (None, _is_listable) and self._listing_ready()
        if not order_by_last_active and aided:
            sessions = self._rich_by_start(clauses, params, keep, offset, limit, compact_rows)
            page = [session["id"] for session in sessions]
        else:
            if order_by_last_active and not id_needle and not search_needle and aided:
                rows = self._list_by_activity(clauses, params, keep, end)
            elif order_by_last_active:
                rows = self._by_chain_activity(
                    self._list_candidates(clauses, params, keep, True), id_needle, search_needle)
            else:
                rows = self._list_candidates(clauses, params, keep, False, want=end)
            page = [row["id"] for row in rows[offset:end]]
            sessions = self._rich_rows_by_id(page, compact_rows)
        if include_pinned:
            # As hermes-agent back-fills them: start order, last_active from messages only.
            pinned = self._list_candidates(clauses + ["s.pinned = 1"], params, keep, False)
            listed = set(page)
            missing = [row["id"] for row in pinned if row["id"] not in listed]
            sessions += self._rich_rows_by_id(missing, compact_rows, MESSAGES_LAST_ACTIVE_SQL)
        tips = {s["id"]: self.get_compression_tip(s["id"]) for s in sessions
                if project_compression_tips and not include_children
                and s.get("end_reason") == "compression"}
        found = {row["id"]: row for row in self._rich_rows_by_id(
            [tip for root, tip in tips.items() if tip != root], compact_rows)}
        for index, session in enumerate(sessions):
            tip = found.get(tips.get(session["id"]))
            if tip:
                # Outside 0.20 a tip without a title shows the root's (a rotation cut off before
                # the title moved to the tip left it there, as 0.22 reads it).
                title = tip.get("title") or (None if host_is_020() else session.get("title"))
                sessions[index] = session = {
                    **session, **{k: tip[k] for k in _PROJECTED_COLUMNS if k in tip},
                    "title": title, "_lineage_root_id": session["id"]}
            session["unread"] = self.session_unread(session)
        return sessions

    def list_recent_sessions_bounded(self, *, limit=20, exclude_sources=None, timeout_seconds=3.0,
                                     candidate_limit=None, lineage_limit=None):
        """0.22's session_search browse: the `limit` most recently active conversations (a
        compression chain as one row, delegate runs and archived or hidden sessions left out),
        as list_sessions_rich rows without the prompt columns. 0.22 bounds its walk of every
        chain with a deadline (`timeout_seconds`) and candidate caps; ours reads the activity
        table newest first, so its work is bounded by `limit` already and those are not needed."""
        return self.list_sessions_rich(limit=max(1, int(limit)), exclude_sources=exclude_sources,
                                       order_by_last_active=True, compact_rows=True)

    @staticmethod
    def session_unread(session_row):
        """True when the row's last activity is newer than its read watermark; False when never
        marked read."""
        last_read = session_row.get("last_read_at")
        last_active = session_row.get("last_active") or session_row.get("started_at") or 0
        return last_read is not None and float(last_active) > float(last_read)

    def get_session_rich_row(self, session_id, compact_rows=False):
        """One session as a list_sessions_rich row (no projection, no `unread`); None for an
        unknown id."""
        self._flush_token_counts()
        return next(iter(self._rich_rows_by_id([session_id], compact_rows)), None)

    def search_sessions_by_id(self, query, limit=20, include_archived=True, source=None,
                              sources=None, exclude_sources=None):
        """Listed sessions whose id, or an id along their compression chain, contains `query` (any
        case): exact matches first, then prefixes, then the rest by activity; [] for a blank query
        or limit <= 0."""
        needle = (query or "").strip().lower()
        if not needle or limit <= 0:
            return []
        rows = self.list_sessions_rich(source=source, sources=sources,
                                       exclude_sources=exclude_sources, limit=limit * 4,
                                       include_archived=include_archived,
                                       order_by_last_active=True, id_query=needle)

        def rank(row):
            ids = [str(value).lower() for value in (row.get("id"), row.get("_lineage_root_id"))
                   if value]
            return 0 if needle in ids else 1 if any(i.startswith(needle) for i in ids) else 2
        return sorted(rows, key=rank)[:limit]

    def distinct_session_cwds(self, include_archived=False):
        """[{cwd, sessions, last_active}] per distinct non-blank cwd, children included, archived
        ones only with `include_archived`; `last_active` is the newest end, else start. [] when
        none."""
        rows = self._read_all("SELECT cwd, COUNT(*), MAX(COALESCE(ended_at, started_at, 0))"
                              " FROM sessions WHERE cwd IS NOT NULL AND TRIM(cwd) != ''"
                              + ("" if include_archived else " AND archived = 0")
                              + " GROUP BY cwd")
        return [{"cwd": row[0], "sessions": int(row[1] or 0), "last_active": float(row[2] or 0)}
                for row in rows]

    def list_gateway_sessions(self, *, platform=None, active_only=True):
        """The newest session of each gateway routing key, with `last_active`, most recently active
        first; `platform` filters on source (any case), `active_only` keeps open sessions. [] when
        none."""
        self._flush_token_counts()
        where = ((" AND LOWER(s.source) = LOWER(?)" if platform else "")
                 + (" AND s.ended_at IS NULL" if active_only else ""))
        return self._resolved(self._read_all(self._listing_sql(
            f"SELECT s.*, {LAST_ACTIVE_SQL.format(a='s')} AS last_active FROM sessions AS s"
            " WHERE s.session_key IS NOT NULL AND s.started_at = (SELECT MAX(k.started_at)"
            f" FROM sessions AS k WHERE k.session_key = s.session_key){where}"
            " ORDER BY last_active DESC"), (platform,) if platform else ()))

    def session_count(self, source=None, sources=None, cwd_prefix=None, min_message_count=0,
                      include_archived=False, archived_only=False, exclude_children=False,
                      exclude_sources=None, include_subagents=False):
        """How many sessions match; unarchived ones unless `include_archived` or `archived_only`,
        and with `exclude_children` only what list_sessions_rich lists (no subagent runs, unless
        `include_subagents`, or continuations)."""
        clauses, params = _filter_clauses(source, sources, exclude_sources, cwd_prefix,
                                          min_message_count, include_archived, archived_only)
        tallied = not cwd_prefix and not min_message_count > 0
        keep = _listing_rule(exclude_children, include_subagents)
        return sum(self._tally_sessions(clauses, params, keep, tallied).values())

    def session_count_by_source(self, *, include_archived=False, archived_only=False,
                                exclude_children=False):
        """{source: sessions}, largest first (an empty source counts as 'cli'); {} for an empty
        store."""
        clauses, params = _filter_clauses(None, None, None, None, 0, include_archived,
                                          archived_only)
        tally = self._tally_sessions(clauses, params, _listing_rule(exclude_children, False),
                                     tallied=True)
        return dict(sorted(tally.items(), key=lambda item: (-item[1], item[0])))

    def session_count_ge(self, n=1):
        """True when the store holds at least `n` sessions, archived ones included."""
        return len(self._read_all("SELECT 1 FROM sessions LIMIT ?", (n,))) >= n

    def _tally_sessions(self, clauses, params, keep, tallied=False):
        """Counter {source (empty: 'cli'): sessions matching}, only those `keep` keeps (None:
        all; see _listing_rule). `tallied`: the clauses filter on source and archived only, so
        hs_session_tally can answer."""
        if tallied and keep in (None, _is_listable) and self._listing_ready():
            return self._tally_from_aids(clauses, params, keep is not None)
        sql = ("SELECT COALESCE(NULLIF(s.source, ''), 'cli'), COUNT(*)"
               " FROM sessions AS s{} GROUP BY 1")
        # Plain roots are listed by every rule; the rest are judged in Python.
        roots = clauses + [_PLAIN_ROOT_SQL] if keep else clauses
        tally = collections.Counter(dict(self._read_all(sql.format(_where(roots)), params)))
        if keep:
            tally.update(row["source"] or "cli" for row in self._list_candidates(
                clauses + [f"NOT {_PLAIN_ROOT_SQL}"], params, keep, False))
        return tally

    def _tally_from_aids(self, clauses, params, exclude_children):
        """_tally_sessions from hs_session_tally. With `exclude_children`, the kinds the triggers
        judged listed are counted there; the rows they left to Python (see JUDGED_KIND_SQL), only
        when it holds some, are read through their partial index and judged as the listing judges
        them."""
        sql = ("SELECT COALESCE(NULLIF(s.source, ''), 'cli'), s.kind, SUM(s.n)"
               " FROM hs_session_tally AS s{} GROUP BY 1, 2 HAVING SUM(s.n) > 0")
        tally, judged = collections.Counter(), False
        for source, kind, count in self._read_all(sql.format(_where(clauses)), params):
            if not exclude_children or kind in TALLY_LISTED_KINDS:
                tally[source] += count
            judged = judged or kind in TALLY_JUDGED_KINDS
        if exclude_children and judged:
            rows = self._read_all(self._listing_sql(
                _CANDIDATES_SQL + " FROM hs_session_activity AS a"
                " CROSS JOIN sessions AS s ON s.id = a.session_id"
                " LEFT JOIN sessions AS p ON p.id = s.parent_session_id"
                + _where([JUDGED_KIND_SQL.format(a="a")] + clauses)), params)
            tally.update(row["source"] or "cli" for row in rows if _is_listable(row))
        return tally

    def _list_candidates(self, clauses, params, keep, with_activity, want=None):
        """The matching sessions, newest start first, as the listing rules' inputs (markers are read
        in Python, so no JSON1): only those `keep` keeps (None: all), at most `want` of them."""
        activity = f", {self._activity_sql('s')} AS last_active" if with_activity else ""
        sql = (f"{_CANDIDATES_SQL}{activity}{_CANDIDATES_FROM_SQL}{{}}"
               " ORDER BY s.started_at DESC, s.id DESC")
        # Read in growing chunks (all at once without `want`: LIMIT -1), each after the last row
        # read, until `want` rows are listable.
        rows, after, chunk = [], [], -1 if want is None else want + 50
        while want is None or len(rows) < want:
            keyset = ["(s.started_at, s.id) < (?, ?)"] if after else []
            batch = self._read_all(
                self._listing_sql(sql.format(_where(clauses + keyset)) + " LIMIT ?"),
                [*params, *after, chunk])
            rows += batch if keep is None else [row for row in batch if keep(row)]
            if chunk < 0 or len(batch) < chunk:
                break
            after, chunk = [batch[-1]["started_at"], batch[-1]["id"]], chunk * 2
        return rows[:want]

    def _by_chain_activity(self, rows, id_needle, search_needle):
        """`rows` ordered by the newest activity along each one's forward compression chain, kept
        when the needles (already lower case) match an id, or a title, of that chain."""
        # Every child of a session compression ended: the links a chain walk may follow.
        continuations = ("SELECT c.id, c.parent_session_id AS parent, c.title, c.model_config,"
                         f" c.source, {self._activity_sql('c')} AS last_active FROM sessions AS c"
                         " JOIN sessions AS p ON p.id = c.parent_session_id"
                         " WHERE p.end_reason = 'compression'")
        children = collections.defaultdict(list)
        for link in self._read_all(self._listing_sql(continuations)):
            if not has_fork_marker(link["model_config"]) and (link["source"] or "") != "tool":
                children[link["parent"]].append(link)
        squeezed = re.sub(r"[\W_]+", "", search_needle)
        ranked = []
        for row in rows:
            chain, seen = [row], {row["id"]}
            for member in chain:
                for child in children.get(member["id"], ()):
                    if child["id"] not in seen:
                        seen.add(child["id"])
                        chain.append(child)
            # Lower case as SQLite's LOWER and LIKE fold it: ASCII letters only.
            ids = [str(member["id"]).translate(_ASCII_LOWER) for member in chain]
            titles = [str(member["title"] or "").translate(_ASCII_LOWER) for member in chain]
            if id_needle and not any(id_needle in i for i in ids):
                continue
            if search_needle and not any(search_needle in text for text in ids + titles) and not (
                    squeezed and any(squeezed in re.sub(r"[-_. ]", "", title) for title in titles)):
                continue
            activity = max(member["last_active"] or 0 for member in chain)
            ranked.append((activity, row["started_at"] or 0, row["id"], row))
        ranked.sort(key=lambda item: item[:3], reverse=True)
        return [item[3] for item in ranked]

    def _list_by_activity(self, clauses, params, keep, want):
        """The first `want` rows (all with None) of what _by_chain_activity orders without needles,
        read from hs_session_activity newest own activity first. A session's chain activity is the
        newest own activity along its forward compression chain, so it is the own activity of the
        first session read whose walk up the chain's links reaches it; a tie is read to its end."""
        matched = f"CASE WHEN {' AND '.join(clauses) or '1'} THEN 1 ELSE 0 END AS matched"
        # Rows that neither match nor continue a chain cannot reach a listed row: SQLite skips them.
        sql = (f"{_CANDIDATES_SQL}, a.active_at, {matched} FROM hs_session_activity AS a"
               " CROSS JOIN sessions AS s ON s.id = a.session_id"
               " LEFT JOIN sessions AS p ON p.id = s.parent_session_id"
               f" WHERE ({' AND '.join(clauses) or '1'} OR p.end_reason = 'compression'){{}}"
               " ORDER BY a.active_at DESC, a.session_id DESC LIMIT ?")
        one = f"{_CANDIDATES_SQL}, {matched}{_CANDIDATES_FROM_SQL} WHERE s.id = ?"
        found, reached = [], set()
        after, chunk = [], -1 if want is None else want + 50
        while True:
            keyset = " AND (a.active_at, a.session_id) < (?, ?)" if after else ""
            # The filters' values twice (`matched`, then the WHERE), the keyset, the LIMIT.
            binds = [*params, *params, *after, chunk]
            batch = self._read_all(self._listing_sql(sql.format(keyset)), binds)
            for row in batch:
                activity = row["active_at"] or 0
                if want is not None and len(found) >= want and activity < found[want - 1][0]:
                    return _by_found_order(found, want)
                node = row
                while node is not None and node["id"] not in reached:
                    reached.add(node["id"])
                    if node["matched"] and (keep is None or keep(node)):
                        found.append((activity, node["started_at"] or 0, node["id"], node))
                    links_up = (node["parent_end_reason"] == "compression"
                                and (node["source"] or "") != "tool"
                                and not has_fork_marker(node["model_config"]))
                    if not links_up:
                        break
                    node = self._read_one(self._listing_sql(one), [*params, node["parent"]])
            if chunk < 0 or len(batch) < chunk:
                return _by_found_order(found, want)
            after, chunk = [batch[-1]["active_at"], batch[-1]["id"]], chunk * 2

    def _activity_sql(self, alias):
        """The SQL of a session's last activity: read from hs_session_activity while it is trusted
        (a needle's activity order at 54,000 sessions: 590 -> 60 ms), else computed."""
        if self._listing_ready():
            # LAST_ACTIVE_SQL's value as hs_session_activity keeps it (see _listing_ready).
            return ("(SELECT k.active_at FROM hs_session_activity AS k"
                    f" WHERE k.session_id = {alias}.id)")
        return LAST_ACTIVE_SQL.format(a=alias)

    def _listing_ready(self):
        """True when the listing aids (hs_session_activity, hs_session_tally) can be trusted: the
        open's data pass filled them and every trigger keeping them is there. Cached per schema
        cookie."""
        cookie = self._read_value("PRAGMA schema_version")
        if self.__dict__.get("_listing_ready_cookie") == cookie:
            return True
        # A store a read-only open will not upgrade may have no state_meta: no aids then.
        ready = (self._read_value(SELECT_LISTING_OBJECT_COUNT_SQL) == len(LISTING_OBJECTS)
                 and self._read_value(TABLE_EXISTS_SQL, ("state_meta",)) is not None
                 and self._read_value(SELECT_META_SQL, (META_LISTING_READY,)) == LISTING_VERSION)
        if ready:
            self._listing_ready_cookie = cookie
        return ready

    def _rich_rows_by_id(self, session_ids, compact_rows=False, last_active=None):
        """The rich rows of `session_ids`, in their order; unknown ids are left out."""
        rows = {}
        for chunk in chunked([sid for sid in session_ids if sid]):
            tail = f" WHERE s.id IN ({placeholders(len(chunk))})"
            rows.update((row["id"], row)
                        for row in self._rich_rows(tail, chunk, compact_rows, last_active))
        return [rows[sid] for sid in session_ids if sid in rows]

    def _rich_rows(self, tail, params, compact_rows=False, last_active=None, extra=""):
        """Rich rows (columns, `last_active`, `preview`) of SESSION_RICH_SQL + `tail`; compact ones
        without the system prompt columns; `last_active` replaces the heartbeat-aware SQL; `extra`
        columns follow the row's."""
        columns = (_compact_columns() if compact_rows else "s.*") + extra
        sql = SESSION_RICH_SQL.format(columns=columns,
                                      last_active=last_active or LAST_ACTIVE_SQL.format(a="s"))
        sql = self._listing_sql(sql + tail)

        def read(conn):  # tuples zipped with names: dict() of a 70-column sqlite3.Row took 10 us
            cursor = conn.cursor()
            cursor.row_factory = None
            rows = cursor.execute(sql, params).fetchall()
            names = [column[0] for column in cursor.description]
            # Each row fills a copy of a dict that already holds the names: 2.1 -> 1.7 us a row.
            blank, shaped = dict.fromkeys(names), []
            for row in rows:
                shaped.append({**blank})
                shaped[-1].update(zip(names, row))
            return shaped
        return self._resolved(self._with_reader(read))

    def _listing_sql(self, sql):
        """`sql`, led on a read-only store that predates some session columns (0.20's lacks
        schema 31's) by a `sessions` CTE giving them their declared defaults, so the listings read
        old stores too."""
        shim = self.__dict__.get("_sessions_shim")
        if shim is None:
            shim = ""
            if self.read_only:
                live = {row[1] for row in self._read_all('PRAGMA table_info("sessions")')}
                added = [f"{(_DEFAULT_RE.findall(expr) or ['NULL'])[0]} AS {name}"
                         for name, expr in declared_columns()["sessions"].items()
                         if name not in live]
                shim = (f"WITH sessions AS (SELECT *, {', '.join(added)} FROM main.sessions) "
                        if added else "")
            self._sessions_shim = shim
        return shim + sql

    def _rich_by_start(self, clauses, params, keep, offset, limit, compact_rows):
        """list_sessions_rich's page in start order, read as rich rows in that order while the
        listing aids are trusted: one statement a page instead of the candidates, then their rich
        rows (a page of 50 at 54,000 sessions: 0.79 -> 0.55 ms). hs_session_activity's kinds leave
        out the children the listing hides; a row of a kind left to Python is judged as
        _list_candidates judges it. The rows before `offset` are read as candidates only."""
        after = []
        if offset and limit:
            skipped = self._list_candidates(clauses, params, keep, False, want=offset)
            if len(skipped) < offset:
                return []
            after = [skipped[-1]["started_at"], skipped[-1]["id"]]
        join, kinds, judged = "", [], ""
        if keep is not None:
            join = " CROSS JOIN hs_session_activity AS a ON a.session_id = s.id"
            shown = ", ".join(str(kind) for kind in TALLY_LISTED_KINDS + TALLY_JUDGED_KINDS)
            kinds = [f"a.kind IN ({shown})"]
            judged = f", {JUDGED_KIND_SQL.format(a='a')} AS _judged"
        rows, chunk = [], limit
        # Read until `limit` rows are listed (all at once for a negative limit): the first read
        # takes exactly the page, as only a row of a judged kind can fail.
        while limit and (limit < 0 or len(rows) < limit):
            keyset = ["(s.started_at, s.id) < (?, ?)"] if after else []
            batch = self._rich_rows(
                f"{join}{_where(clauses + kinds + keyset)} ORDER BY s.started_at DESC, s.id DESC"
                " LIMIT ?", [*params, *after, chunk], compact_rows, extra=judged)
            rows += batch if keep is None else self._judged_listable(batch)
            if chunk < 0 or len(batch) < chunk:
                break
            after, chunk = [batch[-1]["started_at"], batch[-1]["id"]], chunk * 2
        # As _rich_rows_by_id leaves out an empty id.
        return [row for row in rows[:limit if limit >= 0 else None] if row["id"]]

    def _judged_listable(self, batch):
        """The rows of `batch` (rich rows with `_judged`, which is dropped) the listing lists: those
        of a listed kind, and those of a judged kind that _is_listable lists."""
        judged = [row["id"] for row in batch if row.pop("_judged")]
        hidden = set(judged)
        for chunk in chunked(judged):
            hidden.difference_update(
                row["id"] for row in self._read_all(self._listing_sql(
                    f"{_CANDIDATES_SQL}{_CANDIDATES_FROM_SQL}"
                    f" WHERE s.id IN ({placeholders(len(chunk))})"), chunk)
                if _is_listable(row))
        return [row for row in batch if row["id"] not in hidden] if hidden else batch


def _filter_clauses(source, sources, exclude_sources, cwd_prefix, min_message_count,
                    include_archived, archived_only, session_key=None, include_hidden=True):
    """(clauses, params) of the filters session_count and list_sessions_rich share."""
    filters = [(f"s.source {operator} ({placeholders(len(values))})", values)
               for values, operator in (([source] if source else list(sources or []), "IN"),
                                        (exclude_sources, "NOT IN"))
               if values]
    filters += [("s.session_key = ?", [session_key])] if session_key else []
    filters += [cwd_prefix_clause(cwd_prefix)] if cwd_prefix else []
    filters += [("s.message_count >= ?", [min_message_count])] if min_message_count > 0 else []
    if archived_only or not include_archived:
        filters.append((f"s.archived = {1 if archived_only else 0}", []))
    filters += [("s.hidden = 0", [])] if not include_hidden else []
    return [clause for clause, _ in filters], [param for _, values in filters for param in values]


def _by_found_order(found, want):
    """_list_by_activity's rows in _by_chain_activity's order: activity, start, id, newest first."""
    found.sort(key=lambda item: item[:3], reverse=True)
    return [item[3] for item in found[:want]]


def _where(clauses):
    return (" WHERE " + " AND ".join(clauses)) if clauses else ""


def _window_bound(value):
    """A LIMIT or OFFSET value as SQLite takes it: an integer, or a number or text holding one."""
    if isinstance(value, int):
        return int(value)
    try:
        number = float(value) if isinstance(value, (float, str)) else None
    except ValueError:
        number = None
    if number is None or not number.is_integer():
        raise sqlite3.IntegrityError("datatype mismatch")
    return int(number)


@functools.lru_cache(maxsize=1)
def _compact_columns():
    return ", ".join(f"s.{name}" for name in declared_columns()["sessions"]
                     if name not in _COMPACT_LEFT_OUT)


def _listing_rule(listable_only, include_subagents):
    """Which rows a listing keeps: None (all of them), _is_listable, or with `include_subagents`
    (hermes-agent's sessions.show_subagents) also the subagent runs."""
    if not listable_only:
        return None
    return _is_listable_or_subagent if include_subagents else _is_listable


def _is_listable_or_subagent(row):
    return _is_listable(row, subagents=True)


def _is_listable(row, subagents=False):
    """A root, branch or reset row that is not a subagent run (a run marked `_delegate_from`:
    `subagents` says): what list_sessions_rich shows. hermes_state_schema's tally kinds judge the
    default rules in SQL: a change here is a change there, with a new LISTING_VERSION."""
    text = row["model_config"]
    config = json_object(text) if text and "_from" in text else {}
    if config.get("_delegate_from") is not None:
        return subagents
    return (row["parent"] is None or config.get("_branched_from") is not None
            or config.get("_reset_from") is not None
            or (row["parent_end_reason"] == "branched" and row["parent_ended_at"] is not None
                and row["started_at"] >= row["parent_ended_at"])
            or (row["parent_end_reason"] in _RESET_END_REASONS and bool(row["session_key"])
                and row["session_key"] == row["parent_key"]))


def _lift_fork_markers(session):
    """0.22's session dicts: a /new reset's and a /branch fork's markers (`_reset_from`,
    `_branched_from`) lifted out of model_config, so a listing that drops that heavy field still
    tells a reset sibling from a fork."""
    config = session.get("model_config")
    config = config if isinstance(config, dict) else json_object(config)
    for marker in ("_reset_from", "_branched_from"):
        value = config.get(marker)
        if not session.get(marker) and isinstance(value, str) and value.strip():
            session[marker] = value.strip()


def _shape_preview(raw):
    """The preview hermes-agent shows for a `_preview_raw`: a /skill turn as typed, else the text up
    to the excerpt joint; past _PREVIEW_MAX_CHARS it is cut and ends in "..."."""
    text = str(raw or "").strip()
    described = describe_skill_invocation(text)
    text = text.split(SKILL_EXCERPT_JOINT)[0] if described is None else described
    return text[:_PREVIEW_MAX_CHARS] + "..." if len(text) > _PREVIEW_MAX_CHARS else text


def _prompt_digest(system_prompt):
    """The hash a system prompt is stored under; None for None, SessionInputTypeError for a
    non-string."""
    if system_prompt is None:
        return None
    if not isinstance(system_prompt, str):
        raise SessionInputTypeError(f"system_prompt must be a string or None, not "
                                    f"{type(system_prompt).__name__}")
    return prompt_hash(system_prompt)


def _config_json(model_config):
    """model_config as hermes-agent stores it: JSON text of a non-empty value, else NULL."""
    if not model_config:
        return None
    try:
        return json.dumps(model_config)
    except (TypeError, ValueError) as exc:
        raise SessionInputTypeError(f"model_config is not JSON-serialisable: {exc}") from None


def _fill_values(row, values, digest):
    """What a row gains: every given value for a new one (`row` None), else the columns still
    NULL."""
    if row is None:
        changes = {column: value for column, value in values.items() if value is not None}
        return dict(changes, system_prompt_hash=digest) if digest else changes
    changes = {c: v for c, v in values.items() if v is not None and row[c] is None}
    # A row made at a reset holds only {"_reset_from": ...}; the real config
    # joins it instead of being dropped because the column is no longer NULL.
    stored, new = json_object(row["model_config"]), json_object(values["model_config"])
    if new and list(stored) == ["_reset_from"]:
        new["_reset_from"] = stored["_reset_from"]
        changes["model_config"] = json.dumps(new, separators=(",", ":"))
    if digest and row["system_prompt_hash"] is None:
        changes.update(system_prompt_hash=digest, system_prompt=None)
    return changes


def _merge_config(conn, session_id, patch):
    """Merge `patch` into the session's model_config (merge_model_config's rules); False for an
    unknown id."""
    row = conn.execute("SELECT model_config FROM sessions WHERE id = ?", (session_id,)).fetchone()
    if row is not None:
        conn.execute("UPDATE sessions SET model_config = ? WHERE id = ?",
                     (merge_model_config(row["model_config"], patch), session_id))
    return row is not None


def _inherit_from_parent(conn, session_id):
    row = conn.execute("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()
    parent = conn.execute("SELECT * FROM sessions WHERE id = ?",
                          (row["parent_session_id"],)).fetchone()
    if parent is None:
        return
    mine, theirs = _key_namespace(row["session_key"]), _key_namespace(parent["session_key"])
    columns = [c for c in _INHERITED_COLUMNS
               if c != "profile_name" or None in (mine, theirs) or mine == theirs]
    config = json_object(row["model_config"])
    if parent["end_reason"] == "compression" and parent["id"] not in (
            config.get("_delegate_from"), config.get("_branched_from")):
        columns += _ROUTING_COLUMNS
    changes = {c: parent[c] for c in columns
               if c in row.keys() and row[c] is None and parent[c] is not None}
    if changes:
        conn.execute(f"UPDATE sessions SET {', '.join(f'{c} = ?' for c in changes)} WHERE id = ?",
                     (*changes.values(), session_id))


def _key_namespace(session_key):
    """A gateway key's `agent:<ns>:` (up to its second colon, as hermes-agent compares it); None
    for no key."""
    if not session_key or not isinstance(session_key, str):
        return None
    return session_key[:session_key[6:].find(":") + 7]
