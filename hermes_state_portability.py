"""SessionPortabilityMixin: sessions as portable objects, in and out.

Owns the export shapes (one session, a compression chain as one session, the
whole store as a stream), `import_sessions` (validate everything, then write
in one transaction; history comes back, runtime ownership does not), the
export renderers (jsonl, md, qmd, html, trace) and best-effort redaction.
Whole-home backup and restore are a different entry point (hermes_state).

It reads through SessionDB's public readers and writes through
`_execute_write`; it never imports hermes_state.
"""

import contextlib
import hashlib
import html
import json
import os
import re
import sys
import time

from hermes_state_common import (
    IMPORT_MESSAGE_COLUMNS,
    IMPORT_MESSAGE_SQL,
    IMPORT_RUNTIME_FIELDS,
    INSERT_SESSION_SQL,
    INSERT_SYSTEM_PROMPT_SQL,
    MESSAGE_JSON_FIELDS,
    SELECT_EXPORT_SESSION_IDS_SQL,
    SELECT_LAST_ACTIVE_SQL,
    SELECT_LINEAGE_LINK_SQL,
    SELECT_TITLE_OWNER_SQL,
    SESSION_EXISTS_SQL,
    SET_MESSAGE_COUNTS_SQL,
    SET_PARENT_SQL,
    count_tool_calls,
    placeholders,
    quote_identifier,
)
from hermes_state_schema import declared_columns, prompt_hash

ID_MAX_LENGTH = 256
EXPORT_FORMATS = ("jsonl", "md", "qmd", "html", "trace")


# ---------------------------------------------------------------------------
# Import validation (pass 1): pure functions over the payload
# ---------------------------------------------------------------------------


def _compact_size(value):
    """Bytes of `value` as compact UTF-8 JSON, the measure of every size limit."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8"))


def _column_kinds(table):
    """{column: 'text' | 'integer' | 'real'} from the declared schema."""
    kinds = {}
    for column, type_expr in declared_columns()[table].items():
        declared = type_expr.split()[0] if type_expr else ""
        kinds[column] = {"TEXT": "text", "INTEGER": "integer", "REAL": "real"}.get(declared, "any")
    return kinds


def _value_error(field, value, kind):
    """Why `value` cannot go into a column of `kind`, or None if it can."""
    if value is None or kind == "any":
        return None
    if kind == "text" and not isinstance(value, str):
        return f"{field} must be a string"
    if kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{field} must be an integer"
    if kind == "real" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return f"{field} must be a number"
    return None


def _json_object_error(field, value):
    if value is None or isinstance(value, dict):
        return None
    if isinstance(value, str):
        try:
            if isinstance(json.loads(value), dict):
                return None
        except ValueError:
            pass
    return f"{field} must be a JSON object"


def _session_errors(entry, session_kinds):
    errors = []
    for field, value in entry.items():
        if field == "model_config":
            error = _json_object_error(field, value)
        elif field in session_kinds:
            error = _value_error(field, value, session_kinds[field])
        else:
            continue  # export-only keys (messages, last_active, segments, ...) are not columns
        if error:
            errors.append(error)
    return errors


def _message_errors(index, message, message_kinds):
    if not isinstance(message, dict):
        return [f"messages[{index}] must be an object"]
    errors = []
    role = message.get("role")
    if not isinstance(role, str) or not role:
        errors.append(f"messages[{index}].role must be a non-empty string")
    for field, value in message.items():
        if field == "tool_calls":
            if value is not None and not isinstance(value, (list, dict, str)):
                errors.append(f"messages[{index}].tool_calls must be a list, an object or JSON text")
        elif field in message_kinds and field != "role":
            error = _value_error(f"messages[{index}].{field}", value, message_kinds[field])
            if error:
                errors.append(error)
    return errors


def validate_import(sessions, limits):
    """Pass 1: every error of the payload, as [{"index", "error", "session_id"?}].

    Raises ValueError when `sessions` is not a list or has too many entries.
    `limits` maps the names of the _IMPORT_MAX_* limits to their values.
    """
    if not isinstance(sessions, list):
        raise ValueError("sessions must be a list")
    if len(sessions) > limits["sessions"]:
        raise ValueError(f"sessions has {len(sessions)} entries; the limit is {limits['sessions']}")
    kinds = (_column_kinds("sessions"), _column_kinds("messages"))
    errors, seen, totals = [], set(), {"messages": 0, "bytes": 0}
    for index, entry in enumerate(sessions):
        session_id = entry.get("id") if isinstance(entry, dict) else None
        for message in _entry_errors(entry, seen, totals, limits, kinds):
            error = {"index": index, "error": message}
            if isinstance(session_id, str) and session_id:
                error["session_id"] = session_id
            errors.append(error)
    return errors


def _entry_errors(entry, seen, totals, limits, kinds):
    """Every problem of one entry; adds its id to `seen` and its size to the running `totals`."""
    if not isinstance(entry, dict):
        yield "entry must be an object"
        return
    session_id = entry.get("id")
    if not isinstance(session_id, str) or not session_id:
        yield "id must be a non-empty string"
        return
    if len(session_id) > ID_MAX_LENGTH:
        yield f"id is {len(session_id)} characters; the limit is {ID_MAX_LENGTH}"
        return
    if session_id in seen:
        yield "duplicate id in the payload"
    seen.add(session_id)
    yield from _size_errors(entry, totals, limits)
    messages = entry.get("messages", [])
    if not isinstance(messages, list):
        yield "messages must be a list of objects"
        messages = []
    totals["messages"] += len(messages)
    if len(messages) > limits["messages_per_session"]:
        yield f"messages has {len(messages)} entries; the limit is {limits['messages_per_session']}"
    if totals["messages"] > limits["total_messages"]:
        yield f"the payload passes {limits['total_messages']} messages here"
    yield from _session_errors(entry, kinds[0])
    for position, message in enumerate(messages):
        yield from _message_errors(position, message, kinds[1])


def _size_errors(entry, totals, limits):
    try:
        size = _compact_size(entry)
    except (TypeError, ValueError, RecursionError):
        yield "entry is not plain JSON (numbers, strings, lists, objects)"
        return
    totals["bytes"] += size
    if size > limits["session_bytes"]:
        yield f"entry is {size} bytes as compact JSON; the limit is {limits['session_bytes']}"
    if totals["bytes"] > limits["total_bytes"]:
        yield f"the payload passes {limits['total_bytes']} bytes as compact JSON here"


# ---------------------------------------------------------------------------
# Import writing (pass 2): rows from a validated entry
# ---------------------------------------------------------------------------


def _as_json_text(value):
    """A validated structured value as the JSON text the store keeps."""
    return value if value is None or isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _session_row(entry, session_columns):
    """The columns imported for a session: history, never runtime ownership or counters."""
    skipped = IMPORT_RUNTIME_FIELDS | {"id", "parent_session_id", "message_count", "tool_call_count",
                                       "system_prompt", "system_prompt_hash"}
    row = {column: entry[column] for column in session_columns if column in entry and column not in skipped}
    row["id"] = entry["id"]
    if not isinstance(row.get("source"), str) or not row["source"]:
        row["source"] = "import"
    if row.get("started_at") is None:
        timestamps = [m.get("timestamp") for m in entry.get("messages", []) if m.get("timestamp") is not None]
        row["started_at"] = min(timestamps) if timestamps else time.time()
    row["model_config"] = _as_json_text(row.get("model_config"))
    return row


def _message_rows(session_id, messages, started_at):
    """(rows for IMPORT_MESSAGE_COLUMNS, active count, tool calls of active rows)."""
    rows, active, calls = [], 0, 0
    for message in messages:
        values = {column: message.get(column) for column in IMPORT_MESSAGE_COLUMNS}
        values["session_id"] = session_id
        for column in MESSAGE_JSON_FIELDS:
            values[column] = _as_json_text(values[column])
        if values["timestamp"] is None:
            values["timestamp"] = started_at
        values["active"] = 0 if values["active"] == 0 else 1
        values["observed"] = values["observed"] or 0
        values["compacted"] = values["compacted"] or 0
        if values["active"]:
            active += 1
            calls += count_tool_calls(values["tool_calls"])
        rows.append(tuple(values.values()))
    return rows, active, calls


def _would_close_cycle(conn, child, parent):
    """True if making `parent` the parent of `child` closes a loop of parent links."""
    seen, current = set(), parent
    while current is not None and current not in seen:
        if current == child:
            return True
        seen.add(current)
        row = conn.execute(SELECT_LINEAGE_LINK_SQL, (current,)).fetchone()
        current = row[0] if row else None
    return False


# ---------------------------------------------------------------------------
# Redaction (best effort)
# ---------------------------------------------------------------------------

REDACTED = "[REDACTED]"
SECRET_PATTERNS = (
    # PEM private keys, whole blocks.
    (re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?-----END [A-Z0-9 ]*PRIVATE KEY-----", re.S), REDACTED),
    # Authorization headers keep their scheme.
    (re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?(?:bearer|basic|token|bot)?\s*)[^\s\"',;]+"),
     r"\1" + REDACTED),
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"), r"\1" + REDACTED),
    # JSON Web Tokens.
    (re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}"), REDACTED),
    # Vendor API keys by their prefixes.
    (re.compile(r"\b(?:sk|rk|pk)-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_-]{16,}"), REDACTED),
    (re.compile(r"\b(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}"), REDACTED),
    (re.compile(r"\b(?:ghp|gho|ghs|ghu|ghr)_[A-Za-z0-9]{20,}|\bgithub_pat_[A-Za-z0-9_]{20,}"), REDACTED),
    (re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}"), REDACTED),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{30,}"), REDACTED),
    (re.compile(r"\b(?:glpat|hf|npm)_?-?[A-Za-z0-9_-]{20,}"), REDACTED),
    # Passwords in connection strings: scheme://user:password@host.
    (re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^:/\s@]+:)[^@\s/]+(@)"), r"\1" + REDACTED + r"\2"),
    # KEY=value and "key": "value" where the name says it is a secret.
    (re.compile(r"(?i)\b([A-Z0-9_.-]*(?:api[_-]?key|secret|token|passw(?:or)?d|pwd|credential)[A-Z0-9_.-]*"
                r"\s*=\s*)([\"']?)[^\s\"']+\2"), r"\1\2" + REDACTED + r"\2"),
    (re.compile(r"(?i)(\"[A-Z0-9_.-]*(?:api[_-]?key|secret|token|passw(?:or)?d|pwd|credential)[A-Z0-9_.-]*\""
                r"\s*:\s*\")[^\"]+(\")"), r"\1" + REDACTED + r"\2"),
)
# Keys whose values are identifiers, never secrets: redaction leaves them alone.
ID_KEYS = frozenset({"id", "session_id", "parent_session_id", "tool_call_id", "lineage_session_ids",
                     "system_prompt_hash"})


def redact_text(text):
    """`text` with every recognised secret replaced by [REDACTED]. Best effort, not a guarantee."""
    for pattern, replacement in SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def redact(value, key=None):
    """A copy of an export with every string redacted, identifiers excepted."""
    if key in ID_KEYS:
        return value
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(item, key) for item in value]
    return value


# ---------------------------------------------------------------------------
# Renderers: each takes one export at a time, so exporting streams
# ---------------------------------------------------------------------------


def iso_time(ts):
    if ts is None:
        return ""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1e6):06d}Z"


def jsonl_line(export):
    return json.dumps(export, ensure_ascii=False) + "\n"


def trace_lines(export):
    """One JSON event a line: session_start, message, tool_call, tool_result, session_end."""
    sid = export["id"]
    events = [{"event": "session_start", "session_id": sid, "timestamp": export.get("started_at"),
               "source": export.get("source"), "model": export.get("model"), "title": export.get("title"),
               "parent_session_id": export.get("parent_session_id")}]
    for message in export["messages"]:
        base = {"session_id": sid, "message_id": message["id"], "timestamp": message["timestamp"]}
        if message["role"] == "tool":
            events.append({"event": "tool_result", **base, "tool_call_id": message.get("tool_call_id"),
                           "name": message.get("tool_name"), "content": message.get("content")})
            continue
        events.append({"event": "message", **base, "role": message["role"], "content": message.get("content"),
                       "reasoning": message.get("reasoning"), "token_count": message.get("token_count")})
        for call in message.get("tool_calls") or []:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            events.append({"event": "tool_call", **base, "tool_call_id": call.get("id") if isinstance(call, dict)
                           else None, "name": function.get("name"), "arguments": function.get("arguments")})
    events.append({"event": "session_end", "session_id": sid, "timestamp": export.get("ended_at"),
                   "end_reason": export.get("end_reason"), "message_count": export.get("message_count")})
    return "".join(json.dumps(event, ensure_ascii=False) + "\n" for event in events)


def _md_body(export):
    parts = [f"# {export.get('title') or export['id']}\n\n", f"Session ID: `{export['id']}`\n\n",
             f"Source: `{export.get('source')}`\n\n"]
    if export.get("lineage_session_ids"):
        parts.append(f"Lineage: {' -> '.join(f'`{s}`' for s in export['lineage_session_ids'])}\n\n")
    if export.get("system_prompt"):
        parts.append(f"## System prompt\n\n{export['system_prompt']}\n\n")
    parts.append("## Messages\n\n")
    for message in export["messages"]:
        label = message["role"].capitalize() + (f" — {message['tool_name']}" if message.get("tool_name") else "")
        parts.append(f"### {label} — {iso_time(message['timestamp'])}\n\n{message.get('content') or ''}\n\n")
        if message.get("tool_calls"):
            calls = json.dumps(message["tool_calls"], ensure_ascii=False, indent=2)
            parts.append(f"#### Tool calls\n\n```json\n{calls}\n```\n\n")
    return "".join(parts)


def _front_matter(export, fmt):
    fields = {"session_id": export["id"], "title": export.get("title"), "source": export.get("source"),
              "created_at": iso_time(export.get("started_at")), "ended_at": iso_time(export.get("ended_at")),
              "model": export.get("model"), "cwd": export.get("cwd"), "archived": bool(export.get("archived")),
              "message_count": export.get("message_count"), "tool_call_count": export.get("tool_call_count"),
              "format": fmt, "exported_at": iso_time(time.time()), "exporter": "hermes_state export v1"}
    return "---\n" + "".join(f"{key}: {json.dumps(value, ensure_ascii=False)}\n" for key, value in fields.items()) \
        + "---\n\n"


def markdown_document(export, fmt="md"):
    """(text, sha256 of the body) for an md or qmd file. The body is everything
    between the front matter and the verification block; its SHA-256 is in the block."""
    body = _md_body(export)
    digest = hashlib.sha256(body.encode("utf-8")).hexdigest()
    verification = ("## Export verification\n\n"
                    f"- Session id: `{export['id']}`\n"
                    f"- Exported messages: `{len(export['messages'])}`\n"
                    f"- Source DB message count at export: `{export.get('message_count')}`\n"
                    f"- SHA256 of exported body: `{digest}`\n")
    return _front_matter(export, fmt) + body + verification, digest


HTML_HEAD = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>{title}</title>
<style>
body {{ font: 15px/1.5 system-ui, "Noto Sans CJK SC", "PingFang SC", "Microsoft YaHei", sans-serif; margin: 0 auto; max-width: 60rem; padding: 1rem; color: #0f172a; }}
.session {{ border-top: 3px solid #cd7f32; margin-top: 2rem; }}
.meta {{ color: #475569; font-size: 13px; }}
.message {{ border: 1px solid #e2e8f0; border-radius: 8px; margin: .6rem 0; padding: .5rem .8rem; }}
.role-user {{ background: #fff; }} .role-assistant {{ background: #f1f5f9; }} .role-tool {{ background: #f0f9ff; }}
.role {{ font-weight: 600; text-transform: capitalize; }} .time {{ color: #64748b; font-size: 12px; margin-left: .5rem; }}
pre {{ white-space: pre-wrap; word-break: break-word; margin: .3rem 0;
       font-family: ui-monospace, "Noto Sans Mono CJK SC", monospace; }}
.tool-call {{ background: #1e293b; color: #f8fafc; border-radius: 6px; padding: .4rem .6rem; font-size: 13px; }}
details {{ margin: .3rem 0; }}
</style></head><body>
<h1>{title}</h1>
"""


HTML_FOLD_CHARS = 600


def _html_content(message):
    """The message text; a long tool output folds away behind its first lines."""
    text = message.get("content") or ""
    if message["role"] != "tool" or len(text) <= HTML_FOLD_CHARS:
        return f"<pre>{html.escape(text)}</pre>"
    return (f"<details><summary><pre>{html.escape(text[:200])}… ({len(text):,} characters)</pre></summary>"
            f"<pre>{html.escape(text)}</pre></details>")


def html_section(export):
    """One session as an escaped HTML section: meta, system prompt, messages, tool calls."""
    e = html.escape
    lineage = export.get("lineage_session_ids")
    parts = [f'<section class="session" id="{e(export["id"])}">',
             f"<h2>{e(export.get('title') or export['id'])}</h2>",
             f'<p class="meta">ID {e(export["id"])} · source {e(str(export.get("source")))} · model '
             f'{e(str(export.get("model")))} · started {e(iso_time(export.get("started_at")))} · '
             f'{len(export["messages"])} messages'
             + (f" · lineage {e(' → '.join(lineage))}" if lineage else "") + "</p>"]
    if export.get("system_prompt"):
        parts.append(f"<details><summary>System prompt</summary><pre>{e(export['system_prompt'])}</pre></details>")
    for message in export["messages"]:
        tool = f" · {e(message['tool_name'])}" if message.get("tool_name") else ""
        parts.append(f'<div class="message role-{e(message["role"])}"><span class="role">{e(message["role"])}'
                     f'{tool}</span><span class="time">{e(iso_time(message["timestamp"]))}</span>'
                     + _html_content(message))
        for call in message.get("tool_calls") or []:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            parts.append(f'<div class="tool-call">→ {e(str(function.get("name")))}('
                         f'{e(str(function.get("arguments", "")))})</div>')
        parts.append("</div>")
    parts.append("</section>\n")
    return "".join(parts)


def write_export(exports, fmt, out, *, redact_secrets=False):
    """Render a stream of exports in `fmt` to `out` (a path; a folder for md/qmd; '-' for
    stdout with jsonl and trace). Returns how many sessions were written."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {', '.join(EXPORT_FORMATS)}")
    if out == "-" and fmt not in ("jsonl", "trace"):
        raise ValueError(f"only jsonl and trace can go to stdout; {fmt} needs a path")
    exports = (redact(e) for e in exports) if redact_secrets else exports
    if fmt in ("md", "qmd"):
        return _write_markdown_folder(exports, fmt, out)
    with _open_private(out) as handle:
        if fmt == "html":
            handle.write(HTML_HEAD.format(title="Hermes sessions"))
        count = 0
        for export in exports:
            handle.write({"jsonl": jsonl_line, "trace": trace_lines, "html": html_section}[fmt](export))
            count += 1
        if fmt == "html":
            handle.write("</body></html>\n")
    return count


def _write_markdown_folder(exports, fmt, folder):
    os.makedirs(folder, mode=0o700, exist_ok=True)
    count = 0
    with _open_private(os.path.join(folder, "manifest.jsonl")) as manifest:
        for export in exports:
            text, digest = markdown_document(export, fmt)
            name = re.sub(r"[^A-Za-z0-9._-]", "_", export["id"]) + f".{fmt}"
            with _open_private(os.path.join(folder, name)) as handle:
                handle.write(text)
            manifest.write(json.dumps({"session_id": export["id"], "file": name, "body_sha256": digest,
                                       "messages": len(export["messages"])}, ensure_ascii=False) + "\n")
            count += 1
    return count


@contextlib.contextmanager
def _open_private(path):
    """A text file created 0600 (exports hold prompts and messages), or stdout for '-'."""
    if path == "-":
        yield sys.stdout
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
        yield handle


class SessionPortabilityMixin:
    """Export and import behaviour of SessionDB (see the module docstring)."""

    _IMPORT_MAX_SESSIONS = 500
    _IMPORT_MAX_MESSAGES_PER_SESSION = 10_000
    _IMPORT_MAX_TOTAL_MESSAGES = 50_000
    _IMPORT_MAX_SESSION_BYTES = 5 * 1024 * 1024
    _IMPORT_MAX_TOTAL_BYTES = 25 * 1024 * 1024

    # -- export ----------------------------------------------------------------

    def export_session(self, session_id):
        """Every `sessions` column (system prompt resolved), `last_active`, and `messages`:
        the active rows in id order with `tool_calls` decoded. None for an unknown id."""
        session = self.get_session(session_id)
        if session is None:
            return None
        session["last_active"] = self._read_value(SELECT_LAST_ACTIVE_SQL, (session_id,))
        session["messages"] = self.get_messages(session_id)
        return session

    def export_session_lineage(self, session_id):
        """A compression chain as one session: the tip's fields, `segments` (each
        segment's export, root to tip), `lineage_session_ids`, every message in
        order, and `message_count` recomputed as their sum. None for an unknown id."""
        lineage = self.get_compression_lineage(session_id)
        if not lineage:
            return None
        segments = [self.export_session(segment_id) for segment_id in lineage]
        combined = {key: value for key, value in segments[-1].items() if key != "messages"}
        combined["segments"] = segments
        combined["lineage_session_ids"] = lineage
        combined["messages"] = [message for segment in segments for message in segment["messages"]]
        combined["message_count"] = len(combined["messages"])
        combined["tool_call_count"] = sum(segment.get("tool_call_count") or 0 for segment in segments)
        return combined

    def export_all(self, source=None):
        """Every session with its messages, oldest first (parents before children), one at a
        time: memory is bounded by the largest session, not the store."""
        if source is None:
            ids = self._read_all(SELECT_EXPORT_SESSION_IDS_SQL.format(where=""))
        else:
            ids = self._read_all(SELECT_EXPORT_SESSION_IDS_SQL.format(where="WHERE source = ?"), (source,))
        for (session_id,) in ids:
            export = self.export_session(session_id)
            if export is not None:
                yield export

    # -- import ----------------------------------------------------------------

    def import_limits(self):
        """{name: limit} of import_sessions: sessions, messages_per_session, total_messages, session_bytes, total_bytes."""
        return {"sessions": self._IMPORT_MAX_SESSIONS, "messages_per_session": self._IMPORT_MAX_MESSAGES_PER_SESSION,
                "total_messages": self._IMPORT_MAX_TOTAL_MESSAGES, "session_bytes": self._IMPORT_MAX_SESSION_BYTES,
                "total_bytes": self._IMPORT_MAX_TOTAL_BYTES}

    def import_sessions(self, sessions):
        """Add exported sessions to the store: history, not runtime ownership.

        Pass 1 checks the whole payload and writes nothing if anything is wrong:
        {"ok": False, "imported": 0, "skipped": 0, "detached": 0, "errors": [...]}.
        Pass 2, one transaction: ids already stored are skipped (never
        overwritten); messages get fresh ids; counts are recomputed; routing,
        identity, handoff, rewind, pin, activity and compression-cooldown fields
        are not restored; then parent links are attached unless the parent is
        unknown or the link would close a cycle (counted in `detached`).
        Raises ValueError if `sessions` is not a list or has over 500 entries.
        """
        errors = validate_import(sessions, self.import_limits())
        if errors:
            return {"ok": False, "imported": 0, "skipped": 0, "detached": 0, "errors": errors}
        result = self._execute_write(lambda conn: self._write_import(conn, sessions))
        result.update(ok=True, errors=[])
        return result

    def _write_import(self, conn, sessions):
        session_columns = list(declared_columns()["sessions"])
        imported, skipped, parents = [], [], {}
        for entry in sessions:
            session_id = entry["id"]
            if conn.execute(SESSION_EXISTS_SQL, (session_id,)).fetchone():
                skipped.append(session_id)
                continue
            row = _session_row(entry, session_columns)
            row["title"] = _free_title(conn, row.get("title"), session_id)
            prompt = entry.get("system_prompt")
            if isinstance(prompt, str):
                row["system_prompt_hash"] = prompt_hash(prompt)
                conn.execute(INSERT_SYSTEM_PROMPT_SQL, (row["system_prompt_hash"], prompt))
            conn.execute(INSERT_SESSION_SQL.format(columns=", ".join(quote_identifier(c) for c in row),
                                                   values=placeholders(len(row))), tuple(row.values()))
            rows, active, calls = _message_rows(session_id, entry.get("messages", []), row["started_at"])
            conn.executemany(IMPORT_MESSAGE_SQL, rows)
            conn.execute(SET_MESSAGE_COUNTS_SQL, (active, calls, session_id))
            imported.append(session_id)
            if entry.get("parent_session_id"):
                parents[session_id] = entry["parent_session_id"]
        detached = 0
        for child, parent in parents.items():
            known = conn.execute(SESSION_EXISTS_SQL, (parent,)).fetchone() is not None
            if known and not _would_close_cycle(conn, child, parent):
                conn.execute(SET_PARENT_SQL, (parent, child))
            else:
                detached += 1
        return {"imported": len(imported), "skipped": len(skipped), "detached": detached,
                "imported_ids": imported, "skipped_ids": skipped}


def _free_title(conn, title, session_id):
    """Titles are unique: an imported title another session holds gets the id appended."""
    if not title or conn.execute(SELECT_TITLE_OWNER_SQL, (title, session_id)).fetchone() is None:
        return title
    return f"{title} [{session_id}]"

