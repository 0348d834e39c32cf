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
import tempfile
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
    TITLE_MAX_LENGTH,
    count_tool_calls,
    normalize_title,
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
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and not -2 ** 63 <= value < 2 ** 63:
        return f"{field} does not fit in a 64-bit integer"  # sqlite3 raises OverflowError on it
    if kind == "text" and not isinstance(value, str):
        return f"{field} must be a string"
    if kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{field} must be an integer"
    if kind == "real" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return f"{field} must be a number"
    return None


def _depth(value, limit):
    """How deep lists and objects nest in `value`; stops counting past `limit`.
    A loop, not recursion, so that any nesting gets an answer."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            if level > limit:
                return level
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _nesting_error(field, value, limit):
    """Why `value`, or the JSON text it holds, nests too deep to store and export again, or None."""
    if isinstance(value, str):
        if value.lstrip()[:1] not in ("[", "{"):
            return None
        try:
            value = json.loads(value)
        except RecursionError:
            return f"{field} nests lists and objects more than {limit} levels deep"
        except ValueError:
            return None  # text that is not JSON is stored as text
    if _depth(value, limit) > limit:
        return f"{field} nests lists and objects more than {limit} levels deep"
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


def _session_errors(entry, session_kinds, depth_limit):
    errors = []
    for field, value in entry.items():
        if field == "model_config":
            error = _nesting_error(field, value, depth_limit) or _json_object_error(field, value)
        elif field == "title":
            try:
                normalize_title(value)
                error = None
            except (TypeError, ValueError) as exc:
                error = str(exc)
        elif field in session_kinds:
            error = _value_error(field, value, session_kinds[field])
        else:
            continue  # export-only keys (messages, last_active, segments, ...) are not columns
        if error:
            errors.append(error)
    return errors


def _message_errors(index, message, message_kinds, depth_limit):
    if not isinstance(message, dict):
        return [f"messages[{index}] must be an object"]
    errors = []
    role = message.get("role")
    if not isinstance(role, str) or not role:
        errors.append(f"messages[{index}].role must be a non-empty string")
    for field, value in message.items():
        name = f"messages[{index}].{field}"
        error = None
        if field == "tool_calls":
            if value is not None and not isinstance(value, (list, dict, str)):
                error = f"{name} must be a list, an object or JSON text"
        elif field in message_kinds and field != "role":
            error = _value_error(name, value, message_kinds[field])
        if not error and field in MESSAGE_JSON_FIELDS:
            error = _nesting_error(name, value, depth_limit)
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
    # The limit counts from a field's value; an entry adds three levels around it
    # (the entry, its messages list, a message).
    envelope_limit = limits["depth"] + 3
    if _depth(entry, envelope_limit) > envelope_limit:
        yield f"entry nests lists and objects more than {envelope_limit} levels deep"
        return
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
    yield from _session_errors(entry, kinds[0], limits["depth"])
    for position, message in enumerate(messages):
        yield from _message_errors(position, message, kinds[1], limits["depth"])


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
    # A null leaves the column to its default: several are NOT NULL DEFAULT 0.
    row = {column: entry[column] for column in session_columns
           if entry.get(column) is not None and column not in skipped}
    row["id"] = entry["id"]
    row["title"] = normalize_title(row.get("title"))
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

# A name that says its value is a secret: it holds one of the words, or its last
# part (after _ . - or a camelCase hump) is one of the tails. "DB_PASS",
# "x-auth-token", "AccountKey" and "aws_secret_access_key" are such names;
# "token_count", "max_tokens" and "monkey" are not. Case does not matter.
_SECRET_WORDS = ("passw(?:or)?d|passphrase|passcode|secret|credential|private[_.-]?key"
                 "|api[_.-]?key|access[_.-]?key|cookie")
_SECRET_TAILS = "key|token|pass|pwd|pw|pin|auth|authorization|sig|signature|dsn"
SECRET_NAME = (rf"(?:[\w.-]*(?:{_SECRET_WORDS})[\w.-]*"
               rf"|(?:[\w.-]*?(?:[_.-]|(?-i:(?<=[a-z0-9])(?=[A-Z]))))?(?:{_SECRET_TAILS}))")

# What follows such a name. A quoted value keeps its quotes ("...", '...', and \"...\"
# inside JSON held in a string); an Authorization scheme stays readable. An unquoted value
# after ":" or a spaced "=" (YAML, headers, INI, code) runs to the end of the line; after a
# tight "=" (env files, URL queries, connection strings) to the next space, quote or &.
_SCHEME = r"(?:(?:bearer|basic|token|bot|digest|negotiate|apikey)[ \t]+)?"
_QUOTED = (rf"(?:(?P<q>[\"']){_SCHEME}(?P<secret_q>(?:\\.|(?!(?P=q))[^\\\n])*)(?P=q)"
           rf"|\\(?P<eq>[\"']){_SCHEME}(?P<secret_e>(?:(?!\\(?P=eq)).)*)\\(?P=eq))")
_NAMED = rf"(?<![\w.-])(?P<nq>\\?[\"']?)(?:{SECRET_NAME})(?P=nq)"
_TO_LINE_END = rf"{_SCHEME}(?P<secret_l>(?:(?!\\[nrt\"])[^\r\n])+)"
_TO_WORD_END = r"(?P<secret_w>[^\s\"'&<>\\]+)"
# The needs (see below) of the patterns built on SECRET_NAME, and of AWS key ids.
_NAME_WORDS = ("pass", "pwd", "pw", "secret", "credential", "key", "token", "auth", "sig", "cookie", "dsn", "pin")
_AWS_KEY_IDS = ("akia", "asia", "abia", "acca")

# (name, example, needs, pattern): what each group named secret* matched is masked, the rest
# kept. A pattern runs only on text whose lower-case form holds one of its `needs`: a quick
# substring test that spares most text most patterns. Run in this order.
SECRET_PATTERNS = (
    ("private key block (PEM, OpenSSH, PGP), with or without its END line",
     "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----",
     ("private key",),
     r"(?s)(?P<secret>-----BEGIN[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----"
     r"(?:.*?-----END[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----|.*))"),
    ("PuTTY private key", "PuTTY-User-Key-File-3: ssh-ed25519\nPrivate-Lines: 1\nAAAAIEXAMPLE\nPrivate-MAC: 0a1b",
     ("putty-user-key-file",),
     r"(?s)(?P<secret>PuTTY-User-Key-File-\d+:(?:.*?Private-MAC: *[0-9a-f]+|.*))"),
    ("password in a URL (user:password@host, also :password@ and passwords holding @)",
     "redis://:p@ss@cache.internal:6379/0",
     ("://",),
     r"(?i)\b[a-z][a-z0-9+.-]*://[^\s:/@\"'<>]{0,256}:(?P<secret>[^\s\"'<>]{1,256}?)"
     r"@(?=(?:[\w.-]+|\[[0-9a-f:.]+\])(?::\d+)?(?:[/?#\s\"'<>\\,;)\]]|$))"),
    ("Slack webhook", "https://hooks.slack.com/services/T0EXAMPLE/B0EXAMPLE/abcdefghijklmnopqrstuvwx",
     ("hooks.slack.com",),
     r"hooks\.slack\.com/(?:services|workflows|triggers)/(?P<secret>[A-Za-z0-9/_-]+)"),
    ("Discord webhook", "https://discord.com/api/webhooks/123456789012345678/abcdefGHIJKL-mnopqrst_uvwx",
     ("/api/webhooks/",),
     r"discord(?:app)?\.com/api/webhooks/\d+/(?P<secret>[A-Za-z0-9_-]+)"),
    ("AWS access key id with its secret key beside it", "AKIAIOSFODNN7EXAMPLE,wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
     _AWS_KEY_IDS,
     r"(?<![A-Z0-9])(?P<secret>(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16})[\s,;:|\"']+"
     r"(?P<secret2>[A-Za-z0-9/+]{40})(?![A-Za-z0-9/+])"),
    ("AWS access key id", "AKIAIOSFODNN7EXAMPLE",
     _AWS_KEY_IDS,
     r"(?<![A-Z0-9])(?P<secret>(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16})(?![A-Z0-9])"),
    ("sk- keys: OpenAI (sk-, sk-proj-, sk-svcacct-), Anthropic (sk-ant-), OpenRouter, DeepSeek",
     "sk-ant-api03-EXAMPLEexampleEXAMPLEexample",
     ("sk-",),
     r"(?<![\w-])(?P<secret>sk-[A-Za-z0-9_-]{20,})"),
    ("Stripe keys and webhook secrets, sk_ keys (ElevenLabs)", "whsec_EXAMPLEexampleEXAMPLEexample",
     ("sk_", "rk_", "pk_", "whsec_"),
     r"(?<![\w-])(?P<secret>(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{10,}|sk_[A-Za-z0-9]{32,}"
     r"|whsec_[A-Za-z0-9+/=]{20,})"),
    ("GitHub tokens", "ghp_EXAMPLEexampleEXAMPLEexample012345",
     ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
     r"(?<![\w-])(?P<secret>gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"),
    ("GitLab tokens", "glpat-EXAMPLEexample012345",
     ("gl",),
     r"(?<![\w-])(?P<secret>gl(?:pat|dt|rt|ptt|ft|imt|oas|cbt|soat|agent)-[A-Za-z0-9_-]{20,})"),
    ("Slack tokens", "xapp-1-A0EXAMPLE-1234567890-abcdef0123456789",
     ("xox", "xapp-"),
     r"(?<![\w-])(?P<secret>xox[a-z](?:\.xox[a-z])?-[A-Za-z0-9-]{10,}|xapp-\d-[A-Za-z0-9-]{10,})"),
    ("Discord bot token", "MTIzNDU2Nzg5MDEyMzQ1Njc4.GaBcDe.EXAMPLEexampleEXAMPLEexample0123",
     (".",),
     r"(?<![\w-])(?P<secret>[MNO][A-Za-z0-9_-]{23,27}\.[A-Za-z0-9_-]{6}\.[A-Za-z0-9_-]{27,40})(?![\w-])"),
    ("Telegram bot token", "123456789:AAEXAMPLEexampleEXAMPLEexample01234",
     (":",),
     r"(?<!\d)(?P<secret>\d{6,12}:[A-Za-z0-9_-]{30,})(?![\w-])"),
    ("SendGrid key", "SG.EXAMPLEexample012345.EXAMPLEexampleEXAMPLEexampleEXAMPLEexample0",
     ("sg.",),
     r"(?<![\w-])(?P<secret>SG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,})"),
    ("Twilio account and key ids", "SK0123456789abcdef0123456789abcdef",
     ("ac", "sk"),
     r"(?<![\w-])(?P<secret>(?:AC|SK)[0-9a-f]{32})(?![\w-])"),
    ("Google API key, OAuth client secret, access and refresh tokens", "GOCSPX-EXAMPLEexampleEXAMPLEexam",
     ("aiza", "gocspx-", "ya29.", "1//0"),
     r"(?<![\w-])(?P<secret>AIza[0-9A-Za-z_-]{35}|GOCSPX-[A-Za-z0-9_-]{20,}|ya29\.[A-Za-z0-9_-]{20,}"
     r"|1//0[A-Za-z0-9_-]{30,})"),
    ("Azure AD client secret", "abc8Q~EXAMPLEexampleEXAMPLEexample012",
     ("q~",),
     r"(?<![\w~.-])(?P<secret>[A-Za-z0-9_~.-]{3}\dQ~[A-Za-z0-9_~.-]{31,34})"),
    ("Hugging Face, npm, PyPI tokens", "hf_EXAMPLEexampleEXAMPLEexample0123",
     ("hf_", "api_org_", "npm_", "pypi-"),
     r"(?<![\w-])(?P<secret>hf_[A-Za-z0-9]{30,}|api_org_[A-Za-z0-9]{30,}|npm_[A-Za-z0-9]{36}"
     r"|pypi-[A-Za-z0-9_-]{50,})"),
    ("AI services: Groq, xAI, Replicate, Perplexity, Tavily, Firecrawl, LangSmith, Fireworks, NVIDIA",
     "gsk_EXAMPLEexampleEXAMPLEexampleEXAMPLEexample01",
     ("gsk_", "xai-", "r8_", "pplx-", "tvly-", "fc-", "lsv2_", "fw_", "nvapi-"),
     r"(?<![\w-])(?P<secret>gsk_[A-Za-z0-9]{40,}|xai-[A-Za-z0-9]{40,}|r8_[A-Za-z0-9]{30,}|pplx-[A-Za-z0-9]{40,}"
     r"|tvly-(?:dev-)?[A-Za-z0-9]{20,}|fc-[a-f0-9]{32}|lsv2_(?:pt|sk)_[a-f0-9]{32}_[a-f0-9]{10}"
     r"|fw_[A-Za-z0-9]{20,}|nvapi-[A-Za-z0-9_-]{40,})"),
    ("developer services: Shopify, DigitalOcean, Vault, Postman, Atlassian, Mailgun, Mailchimp, Sentry, "
     "Databricks, Linear, Notion, Square, Grafana, Doppler, Heroku", "dapi0123456789abcdef0123456789abcdef",
     ("shp", "_v1_", "hvs.", "hvb.", "pmak-", "atatt", "key-", "-us", "sntr", "dapi", "lin_", "secret_", "ntn_",
      "sq0", "eaaa", "gls", "glc_", "dp.", "hrku-"),
     r"(?<![\w-])(?P<secret>shp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}|do[opr]_v1_[a-f0-9]{64}|hv[sb]\.[A-Za-z0-9_-]{24,}"
     r"|PMAK-[a-f0-9]{24}-[a-f0-9]{34}|ATATT[A-Za-z0-9_=-]{50,}|key-[0-9a-f]{32}|[0-9a-f]{32}-us\d{1,2}"
     r"|sntr[ysu]_[A-Za-z0-9+/=_]{30,}|dapi[0-9a-f]{32}|lin_(?:api|oauth)_[A-Za-z0-9]{40}"
     r"|(?:secret|ntn)_[A-Za-z0-9]{40,}|(?:sq0atp|sq0csp|EAAA)[A-Za-z0-9_-]{22,}|glsa_[A-Za-z0-9_]{32,}"
     r"|glc_[A-Za-z0-9+/=]{30,}|dp\.(?:st|pt|ct|sa)\.[A-Za-z0-9_.-]{40,}|HRKU-[A-Za-z0-9_-]{30,})"),
    ("JSON Web Token", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJlLWV4YW1wbGU",
     ("eyj",),
     r"(?<![\w-])(?P<secret>eyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*)"),
    ("secret name, then : or = and a value (env, YAML, JSON, TOML, INI, headers, code, URL queries)",
     'db:\n  password: "pa ss w0rd"\nexport AZURE_OPENAI_KEY=0123456789abcdef',
     _NAME_WORDS,
     rf"(?i){_NAMED}(?:[ \t]*(?::=|=>|:(?!//)|=)[ \t]*{_QUOTED}"
     rf"|(?:[ \t]*(?::=|=>|:(?!//))[ \t]*|[ \t]+=[ \t]*|=[ \t]+){_TO_LINE_END}|=(?![=\s]){_TO_WORD_END})"),
    ("name/value pair with a secret name (JSON environment and header lists)",
     '{"name": "DB_PASSWORD", "value": "hunter2"}',
     ("value",),
     rf"(?i)(?P<nq>\\?[\"'])(?:name|key)(?P=nq)[ \t]*:[ \t]*(?P=nq)(?:{SECRET_NAME})(?P=nq)[ \t]*,[ \t]*"
     rf"(?P=nq)value(?P=nq)[ \t]*:[ \t]*(?:{_QUOTED}|{_TO_WORD_END})"),
    ("name/value pair with a secret name (YAML environment lists)", "- name: DB_PASSWORD\n  value: hunter2",
     ("value",),
     rf"(?i)\bname:[ \t]*[\"']?(?:{SECRET_NAME})[\"']?\s+value:[ \t]*(?:{_QUOTED}|{_TO_LINE_END})"),
    ("command-line option with a secret name, also in an argument list", "mysql --password hunter2 -h db",
     _NAME_WORDS,
     rf"(?i)(?<![\w.-])--?(?:{SECRET_NAME})(?:[ \t]+|\\?[\"'][ \t]*,[ \t]*)(?!-)(?:{_QUOTED}|{_TO_WORD_END})"),
    ("curl -u user:password", "curl -u admin:hunter2 https://example.com",
     ("-u", "--user"),
     r"(?:\s-u|--user)[ \t]*[\"']?[^\s:\"']*:(?P<secret>[^\s\"']+)"),
    (".netrc line", "machine api.example.com login bob password hunter2",
     ("machine",),
     r"(?i)\bmachine[ \t]+\S+(?:[ \t]+login[ \t]+\S+)?[ \t]+password[ \t]+(?P<secret>\S+)"),
    ("password said in prose", "the password is 'swordfish'",
     ("pass", "pwd"),
     r"(?i)\b(?:pass(?:word|phrase|code)|passwd|pwd)[ \t]+(?:is|was|:|=|->)[ \t]+"
     r"(?:(?P<pq>[\"'`])(?P<secret_q>[^\"'`\n]+)(?P=pq)|(?P<secret>[^\s\"'`]+))"),
    ("password followed by a word with a digit", "password Pa55w0rd",
     ("pass", "pwd"),
     r"(?i)\b(?:pass(?:word|phrase|code)|passwd|pwd)[ \t]+[\"'`]?(?P<secret>(?=[^\s\"'`]*\d)[^\s\"'`]{4,})"),
    ("token, secret or key said in prose, when the value looks like one", "my api key is 0123456789abcdef",
     ("secret", "token", "key"),
     r"(?i)\b(?:secret|token|api[ _-]?key|access[ _-]?key|key)[ \t]+(?:is|was|:|=|->)[ \t]+[\"'`]?"
     r"(?P<secret>(?=[^\s\"'`]*\d)[^\s\"'`]{8,}|[^\s\"'`]{16,})"),
    ("bearer token anywhere", "curl -H 'Authorization: Bearer abc123def456'",
     ("bearer",),
     r"(?i)\bbearer[ \t]+(?P<secret>(?=[A-Za-z0-9._~+/=-]*\d)[A-Za-z0-9._~+/=-]{8,})"),
)
_COMPILED_PATTERNS = tuple((needs, re.compile(pattern)) for _name, _example, needs, pattern in SECRET_PATTERNS)
_SECRET_NAME_RE = re.compile(SECRET_NAME, re.I)
_SECRET_OPTION_RE = re.compile(rf"--?(?:{SECRET_NAME})", re.I)

# Keys of an export whose values identify something (ids, roles, models, sources): never
# masked, wherever they sit in the export. JSON inside a string has no such keys.
ID_KEYS = frozenset({"id", "session_id", "parent_session_id", "tool_call_id", "lineage_session_ids",
                     "system_prompt_hash", "role", "model", "source", "session_key"})
# Past this depth a value is masked whole instead of walked: the walk recurses.
REDACT_MAX_DEPTH = 100


def _mask(match):
    """The match with every secret* group that took part replaced by REDACTED."""
    spans = sorted(match.span(name) for name, value in match.groupdict().items()
                   if name.startswith("secret") and value)
    text, position, parts = match.string, match.start(), []
    for start, end in spans:
        parts += [text[position:start], REDACTED]
        position = end
    parts.append(text[position:match.end()])
    return "".join(parts)


def redact_text(text):
    """`text` with every secret SECRET_PATTERNS recognises replaced by [REDACTED].
    Best effort, not a guarantee; see the README's security notes."""
    lowered = text.lower()
    for needs, pattern in _COMPILED_PATTERNS:
        if any(need in lowered for need in needs):
            text = pattern.sub(_mask, text)
    return text


def redact(export):
    """A copy of an export with every secret masked and every identifier (ID_KEYS) kept.

    Strings go through redact_text; a value whose key is a secret name (api_key,
    DB_PASS, X-API-Key, ...) is masked whole; JSON held in a string (tool
    arguments, model_config) is walked as JSON, so its keys count too.
    """
    return _redact(export, None, ID_KEYS, 0)


def _is_secret_value(value):
    if isinstance(value, str):
        return value not in ("", REDACTED)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _redact(value, key, exempt, depth):
    if key in exempt:
        return value
    if depth > REDACT_MAX_DEPTH:
        return REDACTED
    if isinstance(key, str) and _is_secret_value(value) and _SECRET_NAME_RE.fullmatch(key):
        return REDACTED
    if isinstance(value, str):
        return _redact_string(value, depth)
    if isinstance(value, dict):
        return _redact_mapping(value, exempt, depth + 1)
    if isinstance(value, list):
        return _redact_list(value, key, exempt, depth + 1)
    return value


def _redact_string(text, depth):
    """JSON text is walked as JSON and written back only if something was masked;
    any other text goes through redact_text."""
    if text.lstrip()[:1] in ("{", "["):
        try:
            decoded = json.loads(text)
        except (ValueError, RecursionError):
            decoded = None
        if isinstance(decoded, (dict, list)):
            cleaned = _redact(decoded, None, frozenset(), depth + 1)
            return text if cleaned == decoded else json.dumps(cleaned, ensure_ascii=False)
    return redact_text(text)


def _redact_mapping(mapping, exempt, depth):
    """Each value under its own key; in a {"name": <secret name>, "value": ...} pair
    (environment lists, header lists) the value is masked too."""
    label = mapping.get("name", mapping.get("key"))
    paired = isinstance(label, str) and _SECRET_NAME_RE.fullmatch(label) is not None
    return {key: REDACTED if paired and key == "value" and _is_secret_value(value)
            else _redact(value, key, exempt, depth) for key, value in mapping.items()}


def _redact_list(items, key, exempt, depth):
    """Each item under the list's key; in an argument list, the item after a
    secret option ("--password", "hunter2") is masked too."""
    cleaned, after_option = [], False
    for item in items:
        cleaned.append(REDACTED if after_option and _is_secret_value(item) else _redact(item, key, exempt, depth))
        after_option = isinstance(item, str) and _SECRET_OPTION_RE.fullmatch(item) is not None
    return cleaned


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


def _md_text(text):
    """Free text for a Markdown body: HTML in it shows as text, as in the html export."""
    return html.escape(str(text), quote=False)


def _code(text):
    """`text` as one Markdown code span whatever backticks or line breaks it holds
    (a code span shows a line break as a space anyway)."""
    text = " ".join(str(text).splitlines())
    ticks = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _md_body(export):
    parts = [f"# {_md_text(export.get('title') or export['id'])}\n\n", f"Session ID: {_code(export['id'])}\n\n",
             f"Source: {_code(export.get('source'))}\n\n"]
    if export.get("lineage_session_ids"):
        parts.append(f"Lineage: {' -> '.join(_code(s) for s in export['lineage_session_ids'])}\n\n")
    if export.get("system_prompt"):
        parts.append(f"## System prompt\n\n{_md_text(export['system_prompt'])}\n\n")
    parts.append("## Messages\n\n")
    for message in export["messages"]:
        label = message["role"].capitalize() + (f" — {message['tool_name']}" if message.get("tool_name") else "")
        parts.append(f"### {_md_text(label)} — {iso_time(message['timestamp'])}\n\n"
                     f"{_md_text(_content_text(message))}\n\n")
        if message.get("tool_calls"):
            calls = json.dumps(message["tool_calls"], ensure_ascii=False, indent=2)
            # Inside a fence HTML is not rendered; the fence outlasts any backticks in the calls.
            fence = "`" * max(3, max((len(run) for run in re.findall(r"`+", calls)), default=0) + 1)
            parts.append(f"#### Tool calls\n\n{fence}json\n{calls}\n{fence}\n\n")
    return "".join(parts)


def _front_matter(export, fmt):
    fields = {"session_id": export["id"], "title": export.get("title"), "source": export.get("source"),
              "created_at": iso_time(export.get("started_at")), "ended_at": iso_time(export.get("ended_at")),
              "model": export.get("model"), "cwd": export.get("cwd"), "archived": bool(export.get("archived")),
              "message_count": export.get("message_count"), "tool_call_count": export.get("tool_call_count"),
              "format": fmt, "exported_at": iso_time(time.time()), "exporter": "hermes_state export v1"}
    # Quarto renders a title as Markdown, so the strings here are escaped like the body.
    lines = (f"{key}: {json.dumps(_md_text(value) if isinstance(value, str) else value, ensure_ascii=False)}\n"
             for key, value in fields.items())
    return "---\n" + "".join(lines) + "---\n\n"


def markdown_document(export, fmt="md"):
    """(text, sha256 of the body) for an md or qmd file. The body is everything
    between the front matter and the verification block; its SHA-256 is in the block."""
    body = _md_body(export)
    digest = hashlib.sha256(body.encode("utf-8")).hexdigest()
    verification = ("## Export verification\n\n"
                    f"- Session id: {_code(export['id'])}\n"
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


def _content_text(message):
    """A message's content as text: multimodal parts (a list) are shown as their JSON."""
    content = message.get("content")
    return content if isinstance(content, str) else "" if content is None else json.dumps(content, ensure_ascii=False)


def _html_content(message):
    """The message text; a long tool output folds away behind its first lines."""
    text = _content_text(message)
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
    stdout with jsonl and trace). Returns how many sessions were written.

    Files are written under temporary names and renamed when the last session is
    written: an export that fails part-way leaves no partial file behind.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {', '.join(EXPORT_FORMATS)}")
    if out == "-" and fmt not in ("jsonl", "trace"):
        raise ValueError(f"only jsonl and trace can go to stdout; {fmt} needs a path")
    exports = (redact(e) for e in exports) if redact_secrets else exports
    if fmt in ("md", "qmd"):
        return _write_markdown_folder(exports, fmt, out)
    with _private_output(out) as handle:
        if fmt == "html":
            handle.write(HTML_HEAD.format(title="Hermes sessions"))
        count = 0
        for export in exports:
            handle.write({"jsonl": jsonl_line, "trace": trace_lines, "html": html_section}[fmt](export))
            count += 1
        if fmt == "html":
            handle.write("</body></html>\n")
    return count


# The readable part of a Markdown file name; the hash after it keeps names unique.
FILE_NAME_ID_CHARS = 64


def markdown_file_name(session_id, fmt, taken=()):
    """A file name for one session: its id's safe characters (at most FILE_NAME_ID_CHARS)
    and the start of the id's SHA-256, so that ids differing only in unsafe characters,
    in case, or past the cut get different names. The whole hash if the short one is in `taken`."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", session_id)[:FILE_NAME_ID_CHARS].strip("._-") or "session"
    digest = hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()
    name = f"{readable}-{digest[:12]}.{fmt}"
    return name if name not in taken else f"{readable}-{digest}.{fmt}"


def _write_markdown_folder(exports, fmt, folder):
    os.makedirs(folder, mode=0o700, exist_ok=True)
    pending, names, manifest = [], set(), []  # pending: (temporary path, final path)
    try:
        for export in exports:
            text, digest = markdown_document(export, fmt)
            name = markdown_file_name(export["id"], fmt, names)
            names.add(name)
            pending.append((_write_private_temp(folder, name, text), os.path.join(folder, name)))
            manifest.append(json.dumps({"session_id": export["id"], "file": name, "body_sha256": digest,
                                        "messages": len(export["messages"])}, ensure_ascii=False) + "\n")
        pending.append((_write_private_temp(folder, "manifest.jsonl", "".join(manifest)),
                        os.path.join(folder, "manifest.jsonl")))
    except BaseException:
        for temporary, _final in pending:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        raise
    for temporary, final in pending:
        os.replace(temporary, final)
    return len(manifest)


def _write_private_temp(folder, name, text):
    """`text` in a new 0600 file of `folder` under a temporary name; returns its path."""
    fd, temporary = tempfile.mkstemp(prefix=f".{name[:80]}.", suffix=".part", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
    except BaseException:
        os.unlink(temporary)
        raise
    return temporary


@contextlib.contextmanager
def _private_output(path):
    """A text file (exports hold prompts and messages) created 0600 under a temporary
    name and renamed to `path` when the block ends well, removed when it fails; stdout for '-'."""
    if path == "-":
        yield sys.stdout
        return
    folder, name = os.path.split(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix=f".{name[:80]}.", suffix=".part", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            yield handle
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


class SessionPortabilityMixin:
    """Export and import behaviour of SessionDB (see the module docstring)."""

    _IMPORT_MAX_SESSIONS = 500
    _IMPORT_MAX_MESSAGES_PER_SESSION = 10_000
    _IMPORT_MAX_TOTAL_MESSAGES = 50_000
    _IMPORT_MAX_SESSION_BYTES = 5 * 1024 * 1024
    _IMPORT_MAX_TOTAL_BYTES = 25 * 1024 * 1024
    # Lists and objects inside one field; deeper values could not be exported again
    # (json and the renderers recurse), and no agent writes them.
    _IMPORT_MAX_DEPTH = 100

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
        """The limits of one import_sessions call, by name: what validate_import checks."""
        return {"sessions": self._IMPORT_MAX_SESSIONS, "messages_per_session": self._IMPORT_MAX_MESSAGES_PER_SESSION,
                "total_messages": self._IMPORT_MAX_TOTAL_MESSAGES, "session_bytes": self._IMPORT_MAX_SESSION_BYTES,
                "total_bytes": self._IMPORT_MAX_TOTAL_BYTES, "depth": self._IMPORT_MAX_DEPTH}

    def import_sessions(self, sessions, *, limits=None):
        """Add exported sessions to the store: history, not runtime ownership.

        Pass 1 checks the whole payload and writes nothing if anything is wrong:
        {"ok": False, "imported": 0, "skipped": 0, "detached": 0, "errors": [...]}.
        Pass 2, one transaction: ids already stored are skipped (never
        overwritten); messages get fresh ids; counts are recomputed; titles
        follow set_session_title's rules, and one another session holds gets
        the id appended; routing, identity, handoff, rewind, pin, activity and
        compression-cooldown fields are not restored; then parent links are
        attached unless the parent is unknown or the link would close a cycle
        (counted in `detached`). `limits` replaces import_limits() for this
        call (the command line lifts the totals to import a whole file at once).
        Raises ValueError if `sessions` is not a list or has too many entries.
        """
        errors = validate_import(sessions, limits or self.import_limits())
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
            row["title"] = _free_title(conn, row["title"], session_id)
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


# Past this many characters an id is shortened in a title suffix, to leave room for the title.
TITLE_SUFFIX_ID_CHARS = 40


def _free_title(conn, title, session_id):
    """A title no other session holds: `title`, else "title [id]", else "title [id] (2)", (3), ...;
    each cut to fit TITLE_MAX_LENGTH. None stays None."""
    tag = session_id if len(session_id) <= TITLE_SUFFIX_ID_CHARS else session_id[:TITLE_SUFFIX_ID_CHARS] + "…"
    candidate, number = title, 1
    while candidate is not None and conn.execute(SELECT_TITLE_OWNER_SQL, (candidate, session_id)).fetchone():
        suffix = f" [{tag}]" if number == 1 else f" [{tag}] ({number})"
        candidate = normalize_title(title[:max(0, TITLE_MAX_LENGTH - len(suffix))] + suffix)
        number += 1
    return candidate
