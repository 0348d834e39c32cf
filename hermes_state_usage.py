"""Tokens and cost: owns the token, cost and billing columns of `sessions`, its activity heartbeat
(`last_activity_*`), `session_model_usage` (one row per route and task) and the in-memory queue of
token deltas. A queued delta rides with the next write (SessionDB's write path calls
`apply_token_batch` first in its transaction), or goes with `flush_token_counts`, close() or
interpreter exit. A delta for a missing session creates a bare row (source 'unknown'). Never writes
messages.
"""

import logging
import math
import sqlite3
import threading
import time

from hermes_state_common import (
    DELETE_UNUSED_PROMPTS_SQL, TOKEN_QUEUE_MAX_AGE, json_object, placeholders, sqlite_keeps)
from hermes_state_errors import UsageValueError

logger = logging.getLogger("hermes_state")

COUNT_FIELDS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
                "reasoning_tokens", "api_call_count")
COST_FIELDS = ("estimated_cost_usd", "actual_cost_usd")
# Two queued deltas merge only when all of these match: they feed the
# first-wins and last-wins columns and the usage row's key.
ROUTE_FIELDS = ("model", "cost_status", "cost_source", "pricing_version",
                "billing_provider", "billing_base_url", "billing_mode")
_ROUTE_COLUMNS = ("model", "billing_provider", "billing_base_url", "billing_mode")

# The heartbeat is only an observation: under contention it gives up quickly rather than hold up the
# turn it describes (the next beat retries).
ACTIVITY_WRITE_PATIENCE = 0.5
ACTIVITY_DESCRIPTION_MAX = 120
ACTIVITY_PROVENANCES = ("unknown", "agent.compression", "agent.compression_timeout",
                        "agent.compression_cooldown")

# SessionDBs holding queued deltas: kept alive so that the exit hook (which holds a weak reference)
# still finds and closes one its owner dropped unclosed.
_UNFLUSHED = set()
# A missing session is made with the caller's surface (else 'unknown'); an existing one keeps
# its row, but takes a model where it has none, and its real surface where it only had 'unknown'.
_INSERT_BARE_SESSION_SQL = (
    "INSERT INTO sessions (id, source, model, started_at) VALUES (:id, :source, :model, :now)"
    " ON CONFLICT (id) DO UPDATE SET model = COALESCE(sessions.model, excluded.model),"
    " source = CASE WHEN sessions.source = 'unknown' THEN excluded.source ELSE sessions.source END"
    " WHERE (sessions.model IS NULL AND excluded.model IS NOT NULL)"
    " OR (sessions.source = 'unknown' AND excluded.source <> 'unknown')")


def _counters_sql(absolute):
    """The sessions UPDATE of one delta: counters added to, or set to the caller's totals."""
    counts = [f"{c} = :{c}" if absolute else f"{c} = COALESCE({c}, 0) + :{c}" for c in COUNT_FIELDS]
    estimated = ("COALESCE(:estimated_cost_usd, 0)" if absolute
                 else "COALESCE(estimated_cost_usd, 0) + COALESCE(:estimated_cost_usd, 0)")
    actual = ":actual_cost_usd" if absolute else "COALESCE(actual_cost_usd, 0) + :actual_cost_usd"
    return f"""UPDATE sessions SET {", ".join(counts)}, estimated_cost_usd = {estimated},
  actual_cost_usd = CASE WHEN :actual_cost_usd IS NULL THEN actual_cost_usd ELSE {actual} END,
  {", ".join(f"{c} = COALESCE(:{c}, {c})" for c in ROUTE_FIELDS[1:4])},
  {", ".join(f"{c} = COALESCE({c}, :fill_{c})" for c in _ROUTE_COLUMNS)}
WHERE id = :session_id"""


_ADD_COUNTERS_SQL = _counters_sql(absolute=False)
_SET_COUNTERS_SQL = _counters_sql(absolute=True)
_USAGE_KEY = ("session_id",) + _ROUTE_COLUMNS + ("task",)
_USAGE_SUMS = ("api_call_count",) + COUNT_FIELDS[:5] + COST_FIELDS
_ADD_MODEL_USAGE_SQL = (
    f"INSERT INTO session_model_usage ({', '.join(_USAGE_KEY + _USAGE_SUMS)},"
    " cost_status, cost_source, first_seen, last_seen)"
    f" VALUES ({', '.join(':' + c for c in _USAGE_KEY + _USAGE_SUMS)},"
    " :cost_status, :cost_source, :now, :now)"
    f" ON CONFLICT ({', '.join(_USAGE_KEY)}) DO UPDATE SET"
    f" {', '.join(f'{c} = {c} + excluded.{c}' for c in _USAGE_SUMS)},"
    " cost_status = COALESCE(excluded.cost_status, cost_status),"
    " cost_source = COALESCE(excluded.cost_source, cost_source), last_seen = excluded.last_seen")


class SessionUsageMixin:
    """SessionDB's methods for tokens and cost.

    Relies on: `_execute_write`, `_read_one`, `_read_all`, `_closed`, `_tokens` (a TokenQueue),
    `_write_lock`, `db_path`, `read_only` (SessionDB); `_session_lineage_root_to_tip`
    (messages mixin)."""

    def update_token_counts(self, session_id, input_tokens=0, output_tokens=0, model=None,
                            cache_read_tokens=0, cache_write_tokens=0, reasoning_tokens=0,
                            estimated_cost_usd=None, actual_cost_usd=None, cost_status=None,
                            cost_source=None, pricing_version=None, billing_provider=None,
                            billing_base_url=None, billing_mode=None, api_call_count=0,
                            absolute=False, source=None, task=""):
        """Add one API call's tokens and cost to a session (a missing one is made with `source`,
        else 'unknown') and its route's usage row now, or with `absolute` set the session's totals
        only; None. cost_status, cost_source and pricing_version keep the last value; model and
        billing_* fill empty columns, but the first counted call records its own route. A `task`
        (a per-turn route, 0.22's `voice_chat`) counts in the totals and gets its own usage row,
        but never becomes the session's route. Raises UsageValueError (a ValueError) before
        writing a value that cannot be stored."""
        delta = _token_delta(session_id, dict(locals()))
        self._execute_write(lambda conn: write_token_delta(conn, session_id, delta, time.time()))

    def queue_token_counts(self, session_id, **kwargs):
        """Queue update_token_counts(session_id, **kwargs) to ride with the next write (or
        the next call, once the queue is TOKEN_QUEUE_MAX_AGE old); None. Like hermes-agent's
        background writer it logs and drops a bad delta, never raises; after close() it
        raises like update_token_counts."""
        if self._closed:
            return self.update_token_counts(session_id, **kwargs)
        try:
            if self.read_only:
                raise PermissionError(f"state store {self.db_path} was opened read-only")
            unknown = kwargs.keys() - _UPDATE_DEFAULTS.keys()
            if unknown:
                raise TypeError("update_token_counts() got an unexpected keyword argument "
                                f"{min(unknown)!r}")
            delta = _token_delta(session_id, {**_UPDATE_DEFAULTS, **kwargs})
        except (TypeError, ValueError, PermissionError) as exc:
            logger.warning("token counts for session %r dropped: %s", session_id, exc)
            return
        stale = self._tokens.is_stale()
        self._tokens.add(self, delta)
        if stale:
            self.flush_token_counts()

    def flush_token_counts(self, timeout=5.0):
        """Apply every queued token delta now; True when none is left queued. False, never
        raising, when another thread kept the write lock for `timeout` seconds or the
        write failed (the deltas stay)."""
        if not self._tokens:
            return True
        if self._closed or self.read_only or not self._write_lock.acquire(timeout=max(timeout, 0)):
            return False
        try:
            self._execute_write(lambda conn: None)
            return True
        except Exception as exc:  # the contract: a flush reports, it never raises into a turn
            logger.warning("queued token counts not written yet (%d deltas kept): %s",
                           len(self._tokens), exc)
            return False
        finally:
            self._write_lock.release()

    _flush_token_counts = flush_token_counts

    def record_auxiliary_usage(self, session_id, task, *, model=None, billing_provider=None,
                               billing_base_url=None, input_tokens=0, output_tokens=0,
                               cache_read_tokens=0, cache_write_tokens=0, reasoning_tokens=0,
                               estimated_cost_usd=None, api_call_count=1):
        """Add an auxiliary call's usage (vision, titles, ...) to the usage row of its
        model, provider and `task`, not to the session's counters (a missing session gets a
        bare row); None, nothing for an empty id or task. Raises UsageValueError before
        writing a value that cannot be stored."""
        if not session_id or not task:
            return
        arguments = dict(locals(), api_call_count=1 if api_call_count is None else api_call_count)
        row = {name: _count(name, arguments[name]) for name in COUNT_FIELDS}
        row.update(session_id=_session_id(session_id), task=_text("task", task),
                   api_call_count=int(row["api_call_count"]),
                   model=_text("model", model) or "unknown",
                   billing_provider=_text("billing_provider", billing_provider) or "",
                   billing_base_url=_text("billing_base_url", billing_base_url) or "",
                   billing_mode="",
                   estimated_cost_usd=_cost("estimated_cost_usd", estimated_cost_usd) or 0.0,
                   actual_cost_usd=0.0, cost_status=None, cost_source=None)

        def write(conn):
            row["now"] = time.time()
            conn.execute(_INSERT_BARE_SESSION_SQL, {"id": row["session_id"], "source": "unknown",
                                                    "model": None, "now": row["now"]})
            conn.execute(_ADD_MODEL_USAGE_SQL, row)
        self._execute_write(write)

    def update_session_billing_route(self, session_id, *, provider, base_url, billing_mode=None):
        """Overwrite the session's billing route after a model switch (billing_mode
        when given) and drop its stored system prompt, whose header names the old
        route; None, also for an unknown id."""
        route = (_text("provider", provider), _text("base_url", base_url),
                 _text("billing_mode", billing_mode))

        def write(conn):
            conn.execute("UPDATE sessions SET billing_provider = ?, billing_base_url = ?,"
                         " billing_mode = COALESCE(?, billing_mode), system_prompt = NULL,"
                         " system_prompt_hash = NULL WHERE id = ?", (*route, session_id))
            conn.execute(DELETE_UNUSED_PROMPTS_SQL)
        self._execute_write(write)

    def touch_session_activity(self, session_id, ts=None, *, description=None, provenance=None):
        """Stamp the session's last activity (`ts`, default now, never moved back) with a
        description cut to ACTIVITY_DESCRIPTION_MAX and a known provenance (else
        'unknown'); None, nothing for no session."""
        if not session_id:
            return
        when, text = float(time.time() if ts is None else ts), _bounded_description(description)
        params = {"when": when, "text": text, "provenance": _known_provenance(provenance),
                  "session_id": session_id}
        self._execute_write(lambda conn: conn.execute(
            "UPDATE sessions SET last_activity_at = :when, last_activity_description = :text,"
            " last_activity_provenance = :provenance WHERE id = :session_id"
            " AND (last_activity_at IS NULL OR last_activity_at < :when)", params),
            patience_s=ACTIVITY_WRITE_PATIENCE)

    def clear_session_activity_labels(self, session_id):
        """Blank the activity description and provenance ('unknown') once a turn ends, keeping
        `last_activity_at`; None, and no write when they are already blank."""
        if not session_id:
            return
        row = self._read_one(
            "SELECT last_activity_description, last_activity_provenance FROM sessions"
            " WHERE id = ?", (session_id,))
        if row is not None and not row[0] and row[1] in (None, "", "unknown"):
            return
        self._execute_write(lambda conn: conn.execute(
            "UPDATE sessions SET last_activity_description = '',"
            " last_activity_provenance = 'unknown' WHERE id = ?", (session_id,)),
            patience_s=ACTIVITY_WRITE_PATIENCE)

    def get_dominant_session_model_route(self, session_id):
        """{model, billing_provider, billing_base_url, billing_mode, api_call_count}
        of the main-loop route that served most calls; None when no counted call
        names both a model and a provider."""
        self.flush_token_counts()
        row = self._read_one(
            "SELECT model, billing_provider, billing_base_url, billing_mode, api_call_count"
            " FROM session_model_usage WHERE session_id = ? AND task = '' AND model <> 'unknown'"
            " AND billing_provider <> '' ORDER BY api_call_count DESC, input_tokens + output_tokens"
            " + cache_read_tokens + cache_write_tokens + reasoning_tokens DESC, last_seen DESC"
            " LIMIT 1",
            (session_id,))
        return None if row is None else dict(row)

    def get_recent_session_model_route(self, session_id):
        """The same dict for the main-loop route used last (the newest `last_seen`, the later
        row on a tie): a route retired long ago may still hold the most calls. None when no counted
        call names both a model and a provider."""
        self.flush_token_counts()
        row = self._read_one(
            "SELECT model, billing_provider, billing_base_url, billing_mode, api_call_count"
            " FROM session_model_usage WHERE session_id = ? AND task = '' AND model <> 'unknown'"
            " AND billing_provider <> '' ORDER BY last_seen DESC, rowid DESC LIMIT 1",
            (session_id,))
        return None if row is None else dict(row)

    def auxiliary_usage_by_task(self, session_id):
        """{task: {api_calls, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens,
        reasoning_tokens, estimated_cost_usd}} of the auxiliary calls (task not '') billed to the
        session and its ancestors, up to the nearest /branch copy (which owns its spend): a turn's
        auxiliary calls bill to the id it started with, compression mints another. {} if none."""
        if not session_id:
            return {}
        self.flush_token_counts()
        chain = self._session_lineage_root_to_tip(session_id)
        # A /branch copy names `_branched_from` in its model_config.
        configs = self._read_all(
            f"SELECT id, model_config FROM sessions WHERE id IN ({placeholders(len(chain))})",
            chain)
        branched = {row["id"] for row in configs
                    if json_object(row["model_config"]).get("_branched_from")}
        branches = [n for n, sid in enumerate(chain) if sid in branched]
        chain = chain[branches[-1]:] if branches else chain
        sums = ", ".join(f"COALESCE(SUM({column}), 0) AS {name}" for name, column in (
            ("api_calls", "api_call_count"), *((c, c) for c in COUNT_FIELDS[:5]),
            ("estimated_cost_usd", "estimated_cost_usd")))
        rows = self._read_all(
            f"SELECT task, {sums} FROM session_model_usage"
            f" WHERE session_id IN ({placeholders(len(chain))}) AND task <> '' GROUP BY task",
            chain)
        return {row["task"]: {name: row[name] for name in row.keys() if name != "task"}
                for row in rows}

    def usage_totals(self, *, min_message_count=1, include_archived=False):
        """{"tokens": input + output, "cost_usd": actual cost where known, else the estimate} summed
        over root sessions with at least `min_message_count` messages; zeros when none match."""
        self.flush_token_counts()
        archived = "" if include_archived else " AND COALESCE(archived, 0) = 0"
        tokens, cost = self._read_one(
            "SELECT COALESCE(SUM(COALESCE(input_tokens, 0) + COALESCE(output_tokens, 0)), 0),"
            " COALESCE(SUM(COALESCE(actual_cost_usd, estimated_cost_usd, 0)), 0) FROM sessions"
            " WHERE parent_session_id IS NULL AND message_count >= ?" + archived,
            (min_message_count,))
        return {"tokens": int(tokens or 0), "cost_usd": float(cost or 0.0)}

    def get_session_activity(self, session_id):
        """The session's last activity as hermes-agent's snapshot: last_activity_at (None if
        never), last_activity_description (cut as touch_session_activity cuts it),
        last_activity_provenance (a known one, else 'unknown'), seconds_since_activity (to 0.1 s;
        None if never) and the short aliases last_activity_ts, last_activity_desc, description and
        provenance; None for no or an unknown session."""
        row = session_id and self._read_one(
            "SELECT last_activity_at, last_activity_description, last_activity_provenance"
            " FROM sessions WHERE id = ?", (session_id,))
        if not row:
            return None
        when = None if row[0] is None else float(row[0])
        text, source = _bounded_description(row[1]), _known_provenance(row[2])
        return {"last_activity_at": when, "last_activity_description": text,
                "last_activity_provenance": source,
                "seconds_since_activity": None if when is None else round(time.time() - when, 1),
                "last_activity_ts": when, "last_activity_desc": text, "description": text,
                "provenance": source}


def _defaults(function):
    """{parameter: default} of `function`'s parameters that have one, read from the function
    itself: inspect.signature would load inspect (and ast, dis) with hermes_state."""
    code, values = function.__code__, function.__defaults__ or ()
    named = code.co_varnames[code.co_argcount - len(values):code.co_argcount]
    return dict(zip(named, values), **(function.__kwdefaults__ or {}))


# queue_token_counts' keywords bind to these, as update_token_counts' would.
_UPDATE_DEFAULTS = _defaults(SessionUsageMixin.update_token_counts)


def _token_delta(session_id, arguments):
    """One delta with every value checked and in the form SQLite will store."""
    delta = {name: _count(name, arguments[name]) for name in COUNT_FIELDS}
    delta.update({name: _cost(name, arguments[name]) for name in COST_FIELDS})
    delta.update({name: _text(name, arguments[name]) for name in ROUTE_FIELDS})
    delta.update(absolute=bool(arguments["absolute"]), session_id=_session_id(session_id),
                 source=_text("source", arguments["source"]) or "unknown",
                 task=_text("task", arguments["task"]) or "")
    return delta


def _session_id(value):
    if not isinstance(value, str):
        raise UsageValueError(f"session_id must be a string, not {type(value).__name__}")
    return value


def _count(name, value):
    """A token count or call count: None counts as 0, numeric text as its number."""
    if value is None:
        return 0
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            raise UsageValueError(f"{name} must be a number, not {value!r}") from None
    if isinstance(value, float):
        storable = math.isfinite(value)
    else:
        storable = isinstance(value, int) and sqlite_keeps(value)
    if storable:
        return int(value) if isinstance(value, bool) else value
    raise UsageValueError(
        f"{name} must be a finite number within SQLite's integer range, not {value!r}")


def _cost(name, value):
    if value is None:
        return None
    if not isinstance(value, (int, float, str)):
        raise UsageValueError(f"{name} must be a number, not {type(value).__name__}")
    try:
        cost = float(value)
    except ValueError:
        raise UsageValueError(f"{name} must be a number, not {value!r}") from None
    if not math.isfinite(cost):  # SQLite would store NaN as NULL and keep an infinite sum for good
        raise UsageValueError(f"{name} must be a finite number, not {value!r}")
    return cost


def _text(name, value):
    """A route or status value: text; a number is stored as its text, as SQLite would."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if value is not None and not isinstance(value, str):
        raise UsageValueError(f"{name} must be a string, not {type(value).__name__}")
    if value is not None and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageValueError(f"{name} holds a lone surrogate") from None
    return value


def _bounded_description(description):
    """An activity description stripped and cut to ACTIVITY_DESCRIPTION_MAX (then its last
    character is an ellipsis)."""
    text = (description or "").strip()
    if len(text) <= ACTIVITY_DESCRIPTION_MAX:
        return text
    return text[:ACTIVITY_DESCRIPTION_MAX - 1] + "\u2026"


def _known_provenance(provenance):
    """`provenance` stripped when it is one of ACTIVITY_PROVENANCES, else 'unknown'."""
    source = (provenance or "").strip()
    return source if source in ACTIVITY_PROVENANCES else "unknown"


def write_token_delta(conn, session_id, delta, now):
    """Apply one checked delta inside the caller's transaction."""
    conn.execute(_INSERT_BARE_SESSION_SQL, {"id": session_id, "source": delta["source"],
                                            "model": delta["model"], "now": now})
    counted = any(delta[name] for name in COUNT_FIELDS + COST_FIELDS)
    routed = counted and not delta["task"]  # a task's route is never the session's
    held = conn.execute("SELECT model, billing_provider, api_call_count FROM sessions WHERE id = ?",
                        (session_id,)).fetchone()
    # Until a call has been counted the row only holds the route asked for at creation;
    # the first call that counts usage (after a fallback, maybe another route) names the
    # route the session really ran on.
    ran = (delta["model"], delta["billing_provider"])
    first_call = routed and not (held["api_call_count"] or 0)
    if first_call and all(ran) and (held["model"], held["billing_provider"]) != ran:
        conn.execute(
            "UPDATE sessions SET model = ?, billing_provider = ?, billing_base_url = ?,"
            " billing_mode = ? WHERE id = ?", (*(delta[c] for c in _ROUTE_COLUMNS), session_id))
    params = dict(delta, **{f"fill_{c}": delta[c] if routed else None for c in _ROUTE_COLUMNS})
    conn.execute(_SET_COUNTERS_SQL if delta["absolute"] else _ADD_COUNTERS_SQL, params)
    if delta["absolute"] or not any(delta[name] for name in COUNT_FIELDS + ("estimated_cost_usd",)):
        return
    # The usage row's route: the delta's, else (for the main loop) what the session row holds.
    route = {} if delta["task"] else dict(conn.execute(
        "SELECT model, billing_provider, billing_base_url, billing_mode FROM sessions"
        " WHERE id = ?", (session_id,)).fetchone())
    conn.execute(_ADD_MODEL_USAGE_SQL, dict(
        params, now=now, model=delta["model"] or route.get("model") or "unknown",
        **{c: delta[c] or 0.0 for c in COST_FIELDS},
        **{c: delta[c] or route.get(c) or "" for c in _ROUTE_COLUMNS[1:]}))


def apply_token_batch(conn, batch):
    """Apply queued deltas in order first in the caller's BEGIN IMMEDIATE transaction. One
    SQLite still refuses (another program's trigger, say) is logged and dropped under its own
    savepoint, never blocking the write."""
    now, applied = time.time(), []
    for delta in batch:
        conn.execute("SAVEPOINT token_delta")
        try:
            write_token_delta(conn, delta["session_id"], delta, now)
        except (sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.InterfaceError) as exc:
            logger.warning("queued token counts for session %r dropped: %s",
                           delta["session_id"], exc)
            if not conn.in_transaction:
                # RAISE(ROLLBACK) ended the whole transaction, savepoint included; put
                # back, the delta would fail every later write. It held only the deltas
                # before this one: begin it again.
                conn.execute("BEGIN IMMEDIATE")
                for kept in applied:
                    write_token_delta(conn, kept["session_id"], kept, now)
                continue
            conn.execute("ROLLBACK TO token_delta")
        else:
            applied.append(delta)
        conn.execute("RELEASE token_delta")


class TokenQueue:
    """Token deltas in call order, adjacent ones of one session and route merged."""

    def __init__(self):
        self._lock, self._pending, self._since, self._owner = threading.Lock(), [], None, None

    def add(self, owner, delta):
        with self._lock:
            last = self._pending[-1] if self._pending else None
            if last and not (last["absolute"] or delta["absolute"]) \
                    and all(last[name] == delta[name] for name in ("session_id",) + ROUTE_FIELDS):
                for name in COUNT_FIELDS:
                    last[name] += delta[name]
                for name in COST_FIELDS:
                    if delta[name] is not None:
                        last[name] = (last[name] or 0.0) + delta[name]
            else:
                self._pending.append(delta)
            if self._since is None:
                self._since, self._owner = time.monotonic(), owner
                _UNFLUSHED.add(owner)

    def is_stale(self):
        since = self._since
        return since is not None and time.monotonic() - since > TOKEN_QUEUE_MAX_AGE

    def __len__(self):
        return len(self._pending)

    def take(self):
        with self._lock:
            batch, self._pending, self._since = self._pending, [], None
            _UNFLUSHED.discard(self._owner)
            return batch

    def put_back(self, batch):
        """Return a batch whose write failed, ahead of anything queued since."""
        if not batch:
            return
        with self._lock:
            self._pending[:0] = batch
            self._since = time.monotonic() if self._since is None else self._since
            _UNFLUSHED.add(self._owner)
