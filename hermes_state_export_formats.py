"""The export renderers: session exports (the dicts SessionDB's export methods give) as jsonl, md,
qmd, html and trace text, and write_export, which writes them to a file, a folder or stdout.

Owns the formats' text, how a BLOB travels in JSON (json_default), the run of messages a streamed
export reads and encodes at once, and the private temporary files an export is written through;
write_export masks secrets through hermes_state_redact. Pure functions over export dicts: it never
opens a store or reads a row (hermes_state_portability does, and imports this module).
"""

import contextlib
import functools
import json
import os
import re
import sys
import time

from hermes_state_common import BYTES_MARKER, LazyModule, loads_or

# Loaded by the exports that use them, not by `import hermes_state`.
hashlib, tempfile = LazyModule("hashlib"), LazyModule("tempfile")

EXPORT_FORMATS = ("jsonl", "md", "qmd", "html", "trace")
# Messages measured, read or encoded at once: memory stays flat in a session of any length, and
# the encoder's set-up a call does not show.
EXPORT_RUN_MESSAGES = 256

# JSON has no bytes: a BLOB value travels as {"__base64__": "<standard base64>"}, and import stores
# it back as a BLOB (docs/moving-history.md).
BINARY_TYPES = (bytes, bytearray, memoryview)


def json_default(value):
    """The `default` hook of json.dumps for every output:
    bytes as the BYTES_MARKER object, else str()."""
    if isinstance(value, BINARY_TYPES):
        import base64  # here, not at import: only a BLOB value needs it
        return {BYTES_MARKER: base64.b64encode(bytes(value)).decode("ascii")}
    return str(value)


def message_runs(messages):
    """`messages` in lists of EXPORT_RUN_MESSAGES; one empty list for none."""
    return [messages[i:i + EXPORT_RUN_MESSAGES]
            for i in range(0, max(1, len(messages)), EXPORT_RUN_MESSAGES)]


# -- Renderers: each takes one export at a time, so exporting streams --------------------------


def iso_time(ts):
    if ts is None:
        return ""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1e6):06d}Z"


def jsonl_line(export):
    return json.dumps(export, ensure_ascii=False, default=json_default) + "\n"


JSONL_ENCODER = json.JSONEncoder(ensure_ascii=False, default=json_default)
# Scalars as JSONL_ENCODER writes them, NUL between them (no JSON text holds one): a list splits
# apart.
SCALARS_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=("\x00", ": "))


def jsonl_pieces(export):
    """jsonl_line(export) as strings that join to it, a run of messages a piece: text stays narrow
    (one CJK character anywhere makes a whole joined line two or four bytes a character)."""
    messages = export.get("messages")
    if type(messages) is not list or not messages:
        return [jsonl_line(export)]
    keys, encode = list(export), JSONL_ENCODER.encode
    at = keys.index("messages")
    texts = (encode(run)[1:-1] for run in message_runs(messages))
    before = {key: export[key] for key in keys[:at]}
    after = {key: export[key] for key in keys[at + 1:]}
    return jsonl_session(before, texts, after)


def decoded_calls(texts, scan=json.JSONDecoder().scan_once):
    """Set tool_calls texts as get_messages decodes each, loads_or(text, []) ("" kept): one scan of
    them all as a JSON array when each is one JSON value (the count tells), one by one otherwise."""
    with contextlib.suppress(StopIteration, TypeError, ValueError):
        values = scan("[" + ", ".join(texts) + "]", 0)[0]
        if len(values) == len(texts):
            return values
    return [loads_or(text, []) if text else text for text in texts]


def encoded_calls(column):
    """A tool_calls column as jsonl_line writes its values:
    null, or the text as get_messages decodes it."""
    set_texts = [text for text in column if text is not None]
    decoded = map(JSONL_ENCODER.encode, decoded_calls(set_texts))
    return ["null" if text is None else next(decoded) for text in column]


def jsonl_session(before, texts, after):
    """The pieces of jsonl_line({**before, "messages": [texts joined], **after});
    texts are a list's items."""
    encode = JSONL_ENCODER.encode
    yield encode(before)[:-1] + (', "messages": [' if before else '"messages": [')
    separator = ""
    for text in texts:
        yield separator
        yield text
        separator = ", "
    yield "]" + (", " + encode(after)[1:] if after else "}") + "\n"


def trace_lines(export):
    """One JSON event a line: session_start, message, tool_call, tool_result, session_end."""
    sid = export["id"]
    events = [{"event": "session_start", "session_id": sid, "timestamp": export.get("started_at"),
               "source": export.get("source"), "model": export.get("model"),
               "title": export.get("title"), "parent_session_id": export.get("parent_session_id")}]
    for message in export["messages"]:
        base = {"session_id": sid, "message_id": message["id"], "timestamp": message["timestamp"]}
        if message["role"] == "tool":
            events.append({"event": "tool_result", **base,
                           "tool_call_id": message.get("tool_call_id"),
                           "name": message.get("tool_name"), "content": message.get("content")})
            continue
        events.append({"event": "message", **base, "role": message["role"],
                       "content": message.get("content"), "reasoning": message.get("reasoning"),
                       "token_count": message.get("token_count")})
        for call in message.get("tool_calls") or []:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            events.append({"event": "tool_call", **base,
                           "tool_call_id": call.get("id") if isinstance(call, dict) else None,
                           "name": function.get("name"), "arguments": function.get("arguments")})
    events.append({"event": "session_end", "session_id": sid, "timestamp": export.get("ended_at"),
                   "end_reason": export.get("end_reason"),
                   "message_count": export.get("message_count")})
    return "".join(map(jsonl_line, events))


# Markdown text that renders as itself. CommonMark and pandoc both read a backslash before any
# ASCII punctuation character as that character, so every one that starts a construct in either
# (emphasis, links and images, raw HTML, attributes `{...}`, math, lists, tables, fenced divs, a
# YAML block, smart quotes and dashes, citations, shortcodes `{{< >}}`) is escaped; `, ; ? / ! %`
# start none once `[`, `&` and `<` are escaped. A backtick becomes `&#96;`: Quarto and knitr find
# inline code (`r x`, `{python} x`) and cells by scanning the raw text, where `\`` still reads as
# a backtick. What YAML or HTML cannot hold raw (C0 and C1 controls, DEL, U+2028/9, BOM and the
# two non-characters) goes as a numeric character reference.
MARKDOWN_ESCAPES = {ord(c): "\\" + c for c in "\\*_{}[]<>()#+-.'\":|&$^~=@"}
MARKDOWN_ESCAPES.update({code: f"&#x{code:X};" for code in (
    *range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), *range(0x7F, 0xA0),
    0x2028, 0x2029, 0xFEFF, 0xFFFE, 0xFFFF)})
MARKDOWN_ESCAPES[ord("`")] = "&#96;"
# Markdown's line endings (a lone CR is one); str.splitlines knows more, which Markdown does not.
MARKDOWN_LINE_END = re.compile(r"\r\n|\r|\n")
# Four leading spaces would make an indented code block, where escapes show as backslashes.
LEADING_BLANKS = re.compile(r"^[ \t]+")


def markdown_text(text, *, one_line=False):
    """`text` as Markdown that CommonMark, pandoc and Quarto render as this text: no markup, link,
    raw HTML, attribute, math or code of it takes effect. Its lines stay lines (hard breaks; a
    blank line a paragraph break); `one_line` joins them with spaces (a heading, a YAML value)."""
    lines = MARKDOWN_LINE_END.split(str(text))
    if one_line:
        lines = [" ".join(lines)]
    lines = [LEADING_BLANKS.sub(lambda m: m.group().replace(" ", "&#32;").replace("\t", "&#9;"),
                                line.translate(MARKDOWN_ESCAPES)) for line in lines]
    # A backslash ending a line that another line follows is a hard break; before a blank line or
    # at the end it would show.
    return "\n".join(line + "\\" if line and following else line
                     for line, following in zip(lines, lines[1:] + [""]))


def _md_count(value):
    """A count in a code span when it is one; a store may hold anything in the column."""
    return f"`{value}`" if type(value) is int else markdown_text(value, one_line=True)


# Tool calls go in a fence as JSON, which shows them as written; inside JSON strings these are
# written as \\u escapes, so that no backtick (Quarto's and knitr's inline code, the fence's end)
# and no `{{<` (a Quarto shortcode) is in the file. Outside strings JSON has none of them.
JSON_FENCE_ESCAPES = {ord("`"): "\\u0060", ord("<"): "\\u003c", ord(">"): "\\u003e"}


def _md_body(export):
    line = functools.partial(markdown_text, one_line=True)
    parts = [f"# {line(export.get('title') or export['id'])}\n\n",
             f"Session ID: {line(export['id'])}\n\n",
             f"Source: {line(export.get('source'))}\n\n"]
    if export.get("lineage_session_ids"):
        lineage = " → ".join(line(s) for s in export["lineage_session_ids"])
        parts.append(f"Lineage: {lineage}\n\n")
    if export.get("system_prompt"):
        parts.append(f"## System prompt\n\n{markdown_text(export['system_prompt'])}\n\n")
    parts.append("## Messages\n\n")
    for message in export["messages"]:
        label = line(str(message["role"]).capitalize())
        if message.get("tool_name"):
            label += f" — {line(message['tool_name'])}"
        parts.append(f"### {label} — {iso_time(message['timestamp'])}\n\n"
                     f"{markdown_text(message_text(message))}\n\n")
        if message.get("tool_calls"):
            calls = json.dumps(message["tool_calls"], ensure_ascii=False, indent=2,
                               default=json_default).translate(JSON_FENCE_ESCAPES)
            parts.append(f"#### Tool calls\n\n```json\n{calls}\n```\n\n")
    return "".join(parts)


# qmd only: Quarto runs no engine and executes nothing, whatever a later edit adds.
QMD_NO_EXECUTION = "engine: markdown\nexecute:\n  enabled: false\n"
# Front matter values we write (times, names of ours), where Markdown means nothing.
OUR_FIELDS = {"created_at", "ended_at", "export_format", "exported_at", "exporter"}


def _front_matter(export, fmt):
    fields = {"session_id": export["id"], "title": export.get("title"),
              "source": export.get("source"), "created_at": iso_time(export.get("started_at")),
              "ended_at": iso_time(export.get("ended_at")), "model": export.get("model"),
              "cwd": export.get("cwd"), "archived": bool(export.get("archived")),
              "message_count": export.get("message_count"),
              "tool_call_count": export.get("tool_call_count"), "export_format": fmt,
              "exported_at": iso_time(time.time()), "exporter": "hermes_state export v2"}
    # pandoc and Quarto read a YAML string as Markdown: escaped as the body is, on one line, in a
    # single-quoted scalar (backslashes stay as they are; markdown_text leaves nothing YAML may not
    # hold raw). Quarto's own `format` key would name the output format, so ours is export_format.
    lines = []
    for key, value in fields.items():
        if value is None or type(value) in (bool, int, float):
            shown = json.dumps(value)
        else:
            if not isinstance(value, str):
                value = json.dumps(value, default=json_default)
            if key not in OUR_FIELDS:
                value = markdown_text(value, one_line=True)
            shown = "'" + value.replace("'", "''") + "'"
        lines.append(f"{key}: {shown}\n")
    extra = QMD_NO_EXECUTION if fmt == "qmd" else ""
    return "---\n" + "".join(lines) + extra + "---\n\n"


def markdown_document(export, fmt="md"):
    """(text, sha256 of the body) for an md or qmd file. The body is everything
    between the front matter and the verification block; its SHA-256 is in the block."""
    body = _md_body(export)
    digest = hashlib.sha256(body.encode("utf-8")).hexdigest()
    stored = _md_count(export.get("message_count"))
    verification = ("## Export verification\n\n"
                    f"- Session id: {markdown_text(export['id'], one_line=True)}\n"
                    f"- Exported messages: `{len(export['messages'])}`\n"
                    f"- Source DB message count at export: {stored}\n"
                    f"- SHA256 of exported body: `{digest}`\n")
    return _front_matter(export, fmt) + body + verification, digest


# Short literals joined into one text, a line of the page at most each.
HTML_HEAD = (
    '<!DOCTYPE html>\n'
    '<html lang="en"><head><meta charset="utf-8">\n'
    '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
    '<meta http-equiv="Content-Security-Policy"'
    ' content="default-src \'none\'; style-src \'unsafe-inline\'">\n'
    '<title>{title}</title>\n'
    '<style>\n'
    'body {{ font: 15px/1.5 system-ui, "Noto Sans CJK SC", "PingFang SC", "Microsoft YaHei",'
    ' sans-serif; margin: 0 auto; max-width: 60rem; padding: 1rem; color: #0f172a; }}\n'
    '.session {{ border-top: 3px solid #cd7f32; margin-top: 2rem; }}\n'
    '.meta {{ color: #475569; font-size: 13px; }}\n'
    '.message {{ border: 1px solid #e2e8f0; border-radius: 8px; margin: .6rem 0;'
    ' padding: .5rem .8rem; }}\n'
    '.role-user {{ background: #fff; }} .role-assistant {{ background: #f1f5f9; }}'
    ' .role-tool {{ background: #f0f9ff; }}\n'
    '.role {{ font-weight: 600; text-transform: capitalize; }}'
    ' .time {{ color: #64748b; font-size: 12px; margin-left: .5rem; }}\n'
    'pre {{ white-space: pre-wrap; word-break: break-word; margin: .3rem 0;\n'
    '       font-family: ui-monospace, "Noto Sans Mono CJK SC", monospace; }}\n'
    '.tool-call {{ background: #1e293b; color: #f8fafc; border-radius: 6px;'
    ' padding: .4rem .6rem; font-size: 13px; }}\n'
    'details {{ margin: .3rem 0; }}\n'
    '</style></head><body>\n'
    '<h1>{title}</h1>\n'
)


HTML_FOLD_CHARS = 600


def message_text(message):
    """A message's content as text: multimodal parts (a list) and anything else as their JSON."""
    content = message.get("content")
    if isinstance(content, str) or content is None:
        return content or ""
    return json.dumps(content, ensure_ascii=False, default=json_default)


def _html_content(message, e):
    """The message text escaped by `e`; a long tool output folds away behind its first lines."""
    text = message_text(message)
    if message["role"] != "tool" or len(text) <= HTML_FOLD_CHARS:
        return f"<pre>{e(text)}</pre>"
    return (f"<details><summary><pre>{e(text[:200])}… ({len(text):,} characters)"
            f"</pre></summary><pre>{e(text)}</pre></details>")


def html_section(export):
    """One session as an escaped HTML section: meta, system prompt, messages, tool calls."""
    # Imported by the one renderer that needs it, not by every `import hermes_state` (its
    # entity table is most of what html loads).
    from html import escape as e

    lineage = export.get("lineage_session_ids")
    parts = [f'<section class="session" id="{e(export["id"])}">',
             f"<h2>{e(export.get('title') or export['id'])}</h2>",
             f'<p class="meta">ID {e(export["id"])} · source {e(str(export.get("source")))}'
             f' · model {e(str(export.get("model")))}'
             f' · started {e(iso_time(export.get("started_at")))}'
             f' · {len(export["messages"])} messages'
             + (f" · lineage {e(' → '.join(lineage))}" if lineage else "") + "</p>"]
    if export.get("system_prompt"):
        parts.append("<details><summary>System prompt</summary>"
                     f"<pre>{e(export['system_prompt'])}</pre></details>")
    for message in export["messages"]:
        role = e(message["role"])
        tool = f" · {e(message['tool_name'])}" if message.get("tool_name") else ""
        parts.append(f'<div class="message role-{role}"><span class="role">{role}{tool}</span>'
                     f'<span class="time">{e(iso_time(message["timestamp"]))}</span>'
                     + _html_content(message, e))
        for call in message.get("tool_calls") or []:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            parts.append(f'<div class="tool-call">→ {e(str(function.get("name")))}('
                         f'{e(str(function.get("arguments", "")))})</div>')
        parts.append("</div>")
    parts.append("</section>\n")
    return "".join(parts)


def write_export(exports, fmt, out, *, redact_secrets=False):
    """How many of `exports` (for jsonl, maybe SessionDB.iter_export_jsonl's) went in `fmt`
    to `out`: a path, a folder for md/qmd, '-' for stdout with jsonl and trace. Files get
    temporary names until the last session is written: an export that fails part-way leaves
    no partial file behind."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {', '.join(EXPORT_FORMATS)}")
    if out == "-" and fmt not in ("jsonl", "trace"):
        raise ValueError(f"only jsonl and trace can go to stdout; {fmt} needs a path")
    exports = map(_redacted, exports) if redact_secrets else exports
    if fmt in ("md", "qmd"):
        return _write_markdown_folder(exports, fmt, out)
    with _private_output(out) as handle:
        if fmt == "html":
            handle.write(HTML_HEAD.format(title="Hermes sessions"))
        count = 0
        for export in exports:
            if fmt == "jsonl":
                handle.writelines(jsonl_pieces(export) if isinstance(export, dict) else export)
            else:
                handle.write({"trace": trace_lines, "html": html_section}[fmt](export))
            count += 1
        if fmt == "html":
            handle.write("</body></html>\n")
    return count


def _redacted(export):
    if not isinstance(export, dict):  # jsonl pieces: a secret may be split across them
        raise ValueError("redact_secrets needs whole exports (iter_export_all's),"
                         " not iter_export_jsonl's pieces")
    from hermes_state_redact import redact  # here: only a redacted export needs the table
    return redact(export)


# The readable part of a Markdown file name; the hash after it keeps names unique.
FILE_NAME_ID_CHARS = 64


def markdown_file_name(session_id, fmt, taken=()):
    """A file name for one session: its id's safe characters (at most FILE_NAME_ID_CHARS) and the
    start of its SHA-256 (ids differing in unsafe characters, case or past the cut differ);
    all of it if that is `taken`."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", session_id)[:FILE_NAME_ID_CHARS]
    readable = readable.strip("._-") or "session"
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
            entry = {"session_id": export["id"], "file": name, "body_sha256": digest,
                     "messages": len(export["messages"])}
            manifest.append(json.dumps(entry, ensure_ascii=False) + "\n")
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
    if os.path.exists(path) and not os.path.isfile(path):
        # The rename would replace a device, a FIFO or a socket (as root, /dev/full itself).
        raise ValueError(f"{path} is not a regular file (a device, a FIFO, a socket or a folder);"
                         " nothing was written")
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
