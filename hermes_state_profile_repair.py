"""Profile identity inside one store: find rows whose profile disagrees with their gateway key, set
them right, move a session to the store of its profile, and rename or purge a profile's rows.

Every store belongs to one profile, and a gateway key `agent:<namespace>:...` names the profile of
its conversation (`main` is the default profile, `main~` one literally named "main"). Owns those
rules and the writes `hermes sessions repair-profiles`, profile rename and profile delete make on
sessions, gateway_routing and the tables 0.22 keeps beside them (gateway_heartbeats,
delivery_obligations, the Telegram topic tables), each only where the store has it. Which profiles
exist and which store is whose is the caller's business; a move between two stores is two
transactions (copy into the target, then delete here), so a crash between leaves a duplicate the
next run settles, never a loss. Never touches the schema or the search index.
"""

import json
import time

from hermes_state_common import (  # session_key_profile: 0.22's callers import it from here
    INSERT_SYSTEM_PROMPT_SQL, TABLE_EXISTS_SQL, TITLE_MAX_LENGTH, chunked, placeholders,
    profile_key_prefix, session_key_profile,
)
from hermes_state_identity import display_identity
from hermes_state_schema import live_columns, prompt_hash

# A moved message gets the target's own id; its display order named a row of this store, so it
# is left for the target's trigger to work out again, and its display identity (bytes, which the
# payload as plain data cannot hold) is worked out again from the row.
_MESSAGE_COLUMNS_NOT_MOVED = frozenset({"id", "display_order", "display_identity"})


def _label(value):
    """sessions.profile_name as a profile; None (no owner, not a crossing) when blank."""
    return str(value or "").strip() or None


def _columns_of(conn, tables):
    """{table: set of its columns} for those of `tables` the store has."""
    return {table: set(live_columns(conn, table)) for table in tables
            if conn.execute(TABLE_EXISTS_SQL, (table,)).fetchone()}


def _insert_known(conn, table, values, skipped=frozenset()):
    """INSERT the items of `values` whose keys are columns of `table` here (others are dropped,
    never invented), but `skipped`."""
    columns = [c for c in live_columns(conn, table) if c in values and c not in skipped]
    conn.execute(f"INSERT INTO {table} ({', '.join(columns)})"
                 f" VALUES ({placeholders(len(columns))})", [values[c] for c in columns])


def _store_text(conn, text):
    """The hash `text` is kept under in system_prompts (stored once); None for None."""
    if text is None:
        return None
    digest = prompt_hash(text)
    conn.execute(INSERT_SYSTEM_PROMPT_SQL, (digest, text))
    return digest


class SessionProfileRepairMixin:
    """SessionDB's methods for profile identity.

    Relies on: `_execute_write`, `_read_all`, `_read_value`, `_with_reader` (SessionDB);
    `_delete_sessions_in`, `_delete_committed` (maintenance mixin)."""

    # -- finding -------------------------------------------------------------------------

    def find_crossed_profile_sessions(self, owner):
        """{"mislabelled", "foreign", "crossed_parents"}: the keyed sessions whose profile_name
        names another profile than their key, whose key names another profile than `owner` (this
        store's), and whose parent's key names another profile than theirs. A row may be in
        several lists; oldest first."""
        found = {"mislabelled": [], "foreign": [], "crossed_parents": []}
        for row in self._read_all(
                "SELECT s.id, s.session_key, s.profile_name, s.parent_session_id,"
                " s.message_count, p.session_key AS parent_key FROM sessions AS s"
                " LEFT JOIN sessions AS p ON p.id = s.parent_session_id"
                " WHERE s.session_key LIKE 'agent:%' ORDER BY s.started_at, s.id"):
            profile = session_key_profile(row["session_key"])
            if profile is None:
                continue
            label, parent = _label(row["profile_name"]), session_key_profile(row["parent_key"])
            if label is not None and label != profile:
                found["mislabelled"].append({"id": row["id"], "session_key": row["session_key"],
                                             "profile_name": label, "key_profile": profile})
            if profile != owner:
                found["foreign"].append({"id": row["id"], "session_key": row["session_key"],
                                         "key_profile": profile,
                                         "message_count": int(row["message_count"] or 0)})
            if parent is not None and parent != profile:
                found["crossed_parents"].append({
                    "id": row["id"], "key_profile": profile,
                    "parent_session_id": row["parent_session_id"], "parent_profile": parent})
        return found

    def key_profiles_for_chat(self, platform, chat_id):
        """The profiles whose keyed sessions of `platform` hold `chat_id` here."""
        rows = self._read_all("SELECT DISTINCT session_key FROM sessions WHERE source = ?"
                              " AND chat_id = ? AND session_key LIKE 'agent:%'",
                              (platform, str(chat_id)))
        return {session_key_profile(row[0]) for row in rows} - {None}

    # -- settling in this store -------------------------------------------------------------

    def relabel_sessions_to_key_profile(self, ids):
        """Set each session's profile_name to the profile its key names, read again in the
        write; returns how many rows changed."""
        def relabel(conn, row):
            profile = session_key_profile(row["session_key"])
            return 0 if profile is None else conn.execute(
                "UPDATE sessions SET profile_name = ? WHERE id = ? AND profile_name IS NOT ?",
                (profile, row["id"], profile)).rowcount
        return self._each_session(ids, "SELECT id, session_key FROM sessions AS s", relabel)

    def sever_crossed_parents(self, ids):
        """Clear parent_session_id of each session whose parent's key names another profile than
        its own, if that still holds in the write; returns how many rows changed."""
        def sever(conn, row):
            mine, theirs = (session_key_profile(row[key]) for key in ("session_key", "parent_key"))
            crossed = None not in (mine, theirs) and mine != theirs
            return conn.execute("UPDATE sessions SET parent_session_id = NULL WHERE id = ?",
                                (row["id"],)).rowcount if crossed else 0
        return self._each_session(
            ids, "SELECT s.id, s.session_key, p.session_key AS parent_key FROM sessions AS s"
                 " JOIN sessions AS p ON p.id = s.parent_session_id", sever)

    def rekey_legacy_main_sessions(self, ids, profile):
        """Move the given sessions still keyed `agent:main:...` (a gateway wrote them before the
        store's profile was served beside others) to `profile`'s keys and label; returns how
        many."""
        prefix, legacy = profile_key_prefix(profile), profile_key_prefix("default")

        def rekey(conn, row):
            return conn.execute(
                "UPDATE sessions SET session_key = :prefix || substr(session_key, :rest),"
                " profile_name = :profile WHERE id = :id"
                " AND substr(session_key, 1, :length) = :legacy",
                {"prefix": prefix, "rest": len(legacy) + 1, "profile": profile, "id": row["id"],
                 "length": len(legacy), "legacy": legacy}).rowcount
        return self._each_session(ids, "SELECT s.id FROM sessions AS s", rekey)

    def _each_session(self, ids, select, change):
        """In one write, `change(conn, row)` for each row `select` (over `sessions AS s`) gives for
        the sessions `ids`; the sum of what it returned."""
        wanted = list(ids)

        def write(conn):
            return sum(change(conn, row) for chunk in chunked(wanted)
                       for row in conn.execute(
                           f"{select} WHERE s.id IN ({placeholders(len(chunk))})",
                           chunk).fetchall())
        return self._execute_write(write) if wanted else 0

    def export_session_for_move(self, session_id):
        """What another store needs to hold the session as its own: {"session" (every column),
        "system_prompt", "tool_pin", "messages" (every row, inactive ones too), "usage"}; None for
        an unknown id."""
        def read(conn):
            session = conn.execute("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()
            if session is None:
                return None
            session = dict(session)

            def stored(digest):
                row = digest and conn.execute("SELECT prompt FROM system_prompts WHERE hash = ?",
                                              (digest,)).fetchone()
                return row[0] if row else None
            def rows(table, order="", skipped=()):
                found = conn.execute(f"SELECT * FROM {table} WHERE session_id = ?{order}",
                                     (session_id,))
                return [{k: v for k, v in dict(row).items() if k not in skipped} for row in found]
            return {"session": session, "system_prompt": stored(session["system_prompt_hash"]),
                    "tool_pin": stored(session.get("tool_names")),
                    "messages": rows("messages", " ORDER BY id",
                                     _MESSAGE_COLUMNS_NOT_MOVED - {"id"}),
                    "usage": rows("session_model_usage")}
        return self._with_reader(read)

    def import_moved_session(self, payload, *, profile_name):
        """Make export_session_for_move's `payload` a session of this store, labelled
        `profile_name`: "imported", or "present" when the id is already here (an earlier run
        copied it). Its parent link stays only if the parent is here; a title another session
        here holds gets the moved id's tail; columns this store lacks are dropped."""
        session = dict(payload["session"])
        session_id = session["id"]

        def write(conn):
            exists = "SELECT 1 FROM sessions WHERE id = ?"
            if conn.execute(exists, (session_id,)).fetchone():
                return "present"
            session["profile_name"] = profile_name
            parent = session.get("parent_session_id")
            if parent and not conn.execute(exists, (parent,)).fetchone():
                session["parent_session_id"] = None
            title = session.get("title")
            if title is not None and conn.execute("SELECT 1 FROM sessions WHERE title = ?",
                                                  (title,)).fetchone():
                tail = f" ({session_id[-12:]})"
                session["title"] = title[:TITLE_MAX_LENGTH - len(tail)] + tail
            session["system_prompt_hash"] = _store_text(conn, payload.get("system_prompt"))
            session["system_prompt"] = None
            pin = session.get("tool_names")
            if payload.get("tool_pin") is not None or (isinstance(pin, str) and len(pin) == 64):
                # A pin's hash names nothing here: store the pin again, or drop what cannot be.
                session["tool_names"] = _store_text(conn, payload.get("tool_pin"))
            _insert_known(conn, "sessions", session)
            for message in payload.get("messages") or ():
                message = dict(message, session_id=session_id)
                message = dict(message, display_identity=display_identity(message))
                _insert_known(conn, "messages", message, _MESSAGE_COLUMNS_NOT_MOVED - {
                    "display_identity"})
            for usage in payload.get("usage") or ():
                _insert_known(conn, "session_model_usage", dict(usage, session_id=session_id))
            return "imported"
        return self._execute_write(write)

    def delete_moved_session(self, session_id):
        """Delete a session another store now holds (no delegates with it, children become
        roots); False if it is not here."""
        def write(conn):
            return [session_id] if self._delete_sessions_in(conn, [session_id]) else []
        return bool(self._delete_committed(write, None))

    # -- renaming and deleting a profile --------------------------------------------------------

    def rekey_profile_state(self, old_name, new_name):
        """Rename profile `old_name` to `new_name` in one transaction: labels, `agent:<old>:` keys
        and their routing rows (entry JSON too), origin JSON, heartbeats, delivery obligations and
        Telegram topic rows, where this store has them. Returns {what: rows changed}; {} for a
        blank or unchanged name. Raises ValueError, changing nothing, when a renamed routing key
        or topic row would collide with one the new name already has."""
        old, new = (old_name or "").strip(), (new_name or "").strip()
        counts = {}
        if not old or not new or old == new:
            return counts
        binds = {"old": old, "new": new, "old_ns": f"agent:{old}:", "new_ns": f"agent:{new}:",
                 "length": len(old) + 7, "rest": len(old) + 8}
        renamed_key = ":new_ns || substr({c}, :rest)"
        under_old = "substr({c}, 1, :length) = :old_ns"

        def write(conn):
            columns = _columns_of(conn, ("gateway_heartbeats", "delivery_obligations",
                                         "telegram_dm_topic_mode", "telegram_dm_topic_bindings"))
            collision = conn.execute(
                "SELECT a.scope, " + renamed_key.format(c="a.session_key")
                + " FROM gateway_routing AS a JOIN gateway_routing AS b ON b.scope = a.scope"
                " AND b.session_key = " + renamed_key.format(c="a.session_key")
                + " WHERE " + under_old.format(c="a.session_key") + " LIMIT 1", binds).fetchone()
            if collision is not None:
                raise ValueError(f"profile routing collision in scope {collision[0]!r}: "
                                 f"{collision[1]!r}")
            for table, keys in (("telegram_dm_topic_mode", ("chat_id",)),
                                ("telegram_dm_topic_bindings", ("chat_id", "thread_id"))):
                same = " AND ".join(f"b.{key} = a.{key}" for key in keys)
                if "profile_name" in columns.get(table, ()) and conn.execute(
                        f"SELECT 1 FROM {table} AS a JOIN {table} AS b ON b.profile_name = :new"
                        f" AND {same} WHERE a.profile_name = :old LIMIT 1", binds).fetchone():
                    raise ValueError(f"profile identity collision in {table}")
            changes = [("sessions_profile_name", "sessions", "profile_name", "label"),
                       ("sessions_session_key", "sessions", "session_key", "key")]
            if "gateway_heartbeats" in columns:
                changes.append(("gateway_heartbeats_profile", "gateway_heartbeats", "profile",
                                "label"))
            obligations = columns.get("delivery_obligations", ())
            if "adapter_profile" in obligations:
                changes.append(("delivery_obligations_adapter_profile", "delivery_obligations",
                                "adapter_profile", "label"))
            if "session_key" in obligations:
                changes.append(("delivery_obligations_session_key", "delivery_obligations",
                                "session_key", "key"))
            for table in ("telegram_dm_topic_mode", "telegram_dm_topic_bindings"):
                if "profile_name" in columns.get(table, ()):
                    changes.append((f"{table}_profile_name", table, "profile_name", "label"))
            if "session_key" in columns.get("telegram_dm_topic_bindings", ()):
                changes.append(("telegram_dm_topic_bindings_session_key",
                                "telegram_dm_topic_bindings", "session_key", "key"))
            for name, table, column, kind in changes:
                sql = (f"UPDATE {table} SET {column} = :new WHERE {column} = :old"
                       if kind == "label" else
                       f"UPDATE {table} SET {column} = {renamed_key.format(c=column)}"
                       f" WHERE {under_old.format(c=column)}")
                counts[name] = conn.execute(sql, binds).rowcount
            origins = conn.execute("SELECT id, origin_json FROM sessions"
                                   " WHERE origin_json IS NOT NULL").fetchall()
            counts["sessions_origin_json"] = 0
            for session_id, text in origins:
                renamed = _renamed_json(text, old, new, in_origin=False)
                if renamed is not None:
                    conn.execute("UPDATE sessions SET origin_json = ? WHERE id = ?",
                                 (renamed, session_id))
                    counts["sessions_origin_json"] += 1
            routing = conn.execute("SELECT rowid, entry_json FROM gateway_routing WHERE "
                                   + under_old.format(c="session_key"), binds).fetchall()
            for rowid, text in routing:
                entry = _renamed_json(text, old, new, True, binds["old_ns"], binds["new_ns"])
                conn.execute("UPDATE gateway_routing SET session_key = "
                             + renamed_key.format(c="session_key")
                             + ", entry_json = COALESCE(:entry, entry_json) WHERE rowid = :rowid",
                             dict(binds, entry=entry, rowid=rowid))
            counts["gateway_routing"] = len(routing)
        self._execute_write(write)
        return counts

    def purge_profile_state(self, profile):
        """Forget deleted profile `profile` here: its `agent:<profile>:` routing rows,
        heartbeats and Telegram topic rows go, its pending delivery obligations become
        'abandoned'; sessions stay as they are. Returns {table: rows}; {} for a blank name."""
        name = (profile or "").strip()
        counts = {}
        if not name:
            return counts
        binds = {"name": name, "ns": f"agent:{name}:", "length": len(name) + 7,
                 "now": time.time()}
        under = "substr(session_key, 1, :length) = :ns"

        def write(conn):
            columns = _columns_of(conn, ("gateway_routing", "gateway_heartbeats",
                                         "delivery_obligations", "telegram_dm_topic_mode",
                                         "telegram_dm_topic_bindings"))
            statements = []
            if "gateway_routing" in columns:
                statements.append(("gateway_routing", f"DELETE FROM gateway_routing WHERE {under}"))
            if "gateway_heartbeats" in columns:
                statements.append(("gateway_heartbeats",
                                   "DELETE FROM gateway_heartbeats WHERE profile = :name"))
            if "delivery_obligations" in columns:
                mine = ("adapter_profile = :name OR "
                        if "adapter_profile" in columns["delivery_obligations"] else "")
                statements.append((
                    "delivery_obligations",
                    "UPDATE delivery_obligations SET state = 'abandoned', updated_at = :now"
                    f" WHERE ({mine}{under}) AND state NOT IN ('delivered', 'abandoned')"))
            if "profile_name" in columns.get("telegram_dm_topic_mode", ()):
                statements.append(("telegram_dm_topic_mode",
                                   "DELETE FROM telegram_dm_topic_mode WHERE profile_name = :name"))
            bindings = columns.get("telegram_dm_topic_bindings", ())
            if "session_key" in bindings:
                mine = "profile_name = :name OR " if "profile_name" in bindings else ""
                statements.append(("telegram_dm_topic_bindings",
                                   f"DELETE FROM telegram_dm_topic_bindings WHERE {mine}{under}"))
            for table, sql in statements:
                counts[table] = conn.execute(sql, binds).rowcount
        self._execute_write(write)
        return counts


def _renamed_json(text, old, new, in_origin, old_ns="", new_ns=""):
    """`text`, a JSON object, with profile `old` renamed `new`: its `profile` (under `origin` when
    `in_origin`, as routing entries keep it), and a `session_key` starting `old_ns`. None when
    nothing changed or `text` holds no JSON object."""
    try:
        payload = json.loads(text)
    except (TypeError, ValueError):
        return None
    if not isinstance(payload, dict):
        return None
    changed = False
    key = payload.get("session_key")
    if old_ns and isinstance(key, str) and key.startswith(old_ns):
        payload["session_key"], changed = new_ns + key[len(old_ns):], True
    holder = payload.get("origin") if in_origin else payload
    if isinstance(holder, dict) and holder.get("profile") == old:
        holder["profile"], changed = new, True
    return json.dumps(payload, ensure_ascii=False) if changed else None
