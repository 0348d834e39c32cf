"""What a person reads on a terminal: the command line's tables, fields and values, a session
shown with its messages, progress lines on stderr, the escaping of every control character a
store's text may hold, and the subcommand parsers whose help it shows (made when named). Pure
formatting over rows and export dicts: it never opens a store, and the data formats (JSON, CSV,
exports) pass through it unescaped.
"""

import argparse
import csv
import json
import re
import sys
import threading
import time
import unicodedata
from datetime import datetime, timezone

from hermes_state_portability import json_default, message_text

# A progress line on a terminal is redrawn at most this often; a plain line (stderr not a
# terminal) is printed at most every PLAIN_PROGRESS_SECONDS.
TTY_PROGRESS_SECONDS = 0.1
PLAIN_PROGRESS_SECONDS = 5.0

# Every C0 control, DEL and every C1 control, shown as `\xNN`: a store's text (a source, a title, a
# tool's output) must never move the cursor, retitle the window, write the clipboard (OSC 52) or
# hide a row of a confirmation with `\r`. Newlines and tabs stay where text runs over lines.
_CONTROL_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
_TEXT_ESCAPES = {code: escape for code, escape in _CONTROL_ESCAPES.items() if code not in (9, 10)}


def printable(text):
    """`text` for one line of a person's terminal: every control character escaped."""
    return str(text).translate(_CONTROL_ESCAPES)


class PrintableStream:
    """A stream for human output: what passes through keeps its lines and tabs, loses its
    controls. JSON, CSV and exported files are data and go to the stream unwrapped."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        return self.stream.write(text.translate(_TEXT_ESCAPES))

    def __getattr__(self, name):
        return getattr(self.stream, name)


def print_json(value, out):
    json.dump(value, out, ensure_ascii=False, indent=2, default=json_default)
    out.write("\n")


def plural(count, noun):
    """`1 session`, `2 sessions`, `1.5 days`."""
    shown = f"{count:,}" if isinstance(count, int) else f"{count:g}"
    return f"{shown} {noun}" + ("" if count == 1 else "s")


def human_size(n):
    """`1.2 MB` for 1,234,567 bytes (decimal units, as `ls -h --si` prints them)."""
    if n is None:
        return "-"
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000


def human_value(key, value):
    """A value as a person reads it: `-` for none, yes/no, `cli 2, telegram 1`, sizes in kB/MB."""
    if value is None or value == "" or value == [] or value == {}:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and key.endswith("_bytes"):
        return human_size(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {human_value(k, v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return "; ".join(human_value(key, v) for v in value)
    return str(value)


def print_fields(mapping, out):
    width = max((len(key) for key in mapping), default=0)
    for key, value in mapping.items():
        out.write(f"{key:>{width}}: {printable(human_value(key, value))}\n")


def format_time(ts):
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"


def utc_iso(ts):
    """`2026-03-01T09:15:02Z` for an epoch value (whole seconds, UTC)."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _is_time(key, value):
    # Every epoch column of a session row or a hit: *_at, last_active, timestamp, session_started.
    return (value is None or isinstance(value, (int, float)) and not isinstance(value, bool)) \
        and (key.endswith("_at") or key in ("last_active", "timestamp", "session_started"))


def with_utc(record):
    """`record` with `<key>_utc` (ISO 8601, UTC) beside each epoch value, None beside a time not
    set (an open session's `ended_at`): every record has the same keys, whatever was set."""
    out = {}
    for key, value in record.items():
        out[key] = value
        if _is_time(key, value):
            out[key + "_utc"] = None if value is None else utc_iso(value)
    return out


def cells(text):
    """The terminal cells `text` takes: 2 for a wide or full-width character (CJK), 0 for a
    combining mark, else 1."""
    return sum(0 if unicodedata.combining(ch) else
               2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def _cut(text, width):
    """The longest head of `text` that fits in `width` cells."""
    used = 0
    for index, ch in enumerate(text):
        used += cells(ch)
        if used > width:
            return text[:index]
    return text


def one_line(text, width):
    """`text` on one line in `width` terminal cells; a long one is cut around its first
    >>>match<<<, an ellipsis where it was cut."""
    text = " ".join(str(text or "").split())
    if cells(text) <= width:
        return text
    found = start = max(text.find(">>>"), 0)
    while start and cells(text[start - 1:found]) <= width // 4:  # a quarter before the match
        start -= 1
    while start and cells(text[start - 1:]) < width:  # a match near the end: the end shown whole
        start -= 1
    head = "…" if start else ""
    rest = text[start:]
    if cells(rest) <= width - len(head):
        return head + rest
    return head + _cut(rest, width - 1 - len(head)) + "…"


def session_rows(sessions, title_width=60):
    """(header, rows) of `list`'s table. A session without a title shows its first message in
    quotes: “like this”."""
    def title(s):
        if s.get("title"):
            return one_line(s["title"], title_width)
        if s.get("preview"):
            return "“" + one_line(s["preview"], title_width - 2) + "”"
        return "-"
    rows = [(s["id"], s.get("source") or "-", format_time(s.get("last_active")),
             f"{s.get('message_count') or 0:,}", title(s)) for s in sessions]
    return ("id", "source", "last active", "messages", "title"), rows


def query_terms(query):
    """The words and phrases of a search query a hit contains (no operators, nothing after NOT
    or -)."""
    terms, skip = [], False
    for match in re.finditer(r'"([^"]*)"|(\S+)', query or ""):
        word = match.group(1) if match.group(1) is not None else match.group(2).strip("()")
        if word.upper() in ("AND", "OR", "NOT") and match.group(1) is None:
            skip = word.upper() == "NOT"
            continue
        if not skip and word and not word.startswith("-"):
            terms.append(word)
        skip = False
    return terms


def mark_terms(snippet, query):
    """`snippet` with the query's terms in >>> <<<, when the search left it unmarked (hermes-agent's
    plain snippet of a scanned hit, as for a CJK term of 1 or 2 characters)."""
    if not snippet or ">>>" in snippet:
        return snippet
    terms = sorted(set(query_terms(query)), key=len, reverse=True)
    if not terms:
        return snippet
    pattern = re.compile("|".join(map(re.escape, terms)), re.IGNORECASE)
    return pattern.sub(lambda found: f">>>{found.group(0)}<<<", snippet)


def hit_rows(hits, query=None, snippet_width=80):
    """(header, rows) of `search`'s table; `#` is the message's number in `show SESSION`."""
    rows = [(h["session_id"], "-" if h.get("number") is None else str(h["number"]), h["role"],
             format_time(h["timestamp"]), one_line(mark_terms(h["snippet"], query), snippet_width))
            for h in hits]
    return ("session", "#", "role", "time", "snippet"), rows


def fit_table(make, width, default):
    """(header, rows) of `make(last)`, the last column cut to `last` cells: `default` when
    `width` is 0 (not a terminal), else what fits a terminal of `width` cells (at least 10)."""
    header, rows = make(default)
    if not width:
        return header, rows
    widths = _widths(header, rows)
    return make(max(width - sum(widths[:-1]) - 2 * (len(widths) - 1), 10))


def print_table(header, rows, out, headers=True):
    """`rows` under `header` (and a rule; neither when `headers` is False), every cell escaped,
    columns padded in terminal cells (a CJK character takes two)."""
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = _widths(header, rows)
    right = {i for i, name in enumerate(header) if name in ("messages", "#")}

    def line(row):
        return "  ".join(" " * (w - cells(cell)) + cell if i in right
                         else cell + " " * (w - cells(cell))
                         for i, (cell, w) in enumerate(zip(row, widths))).rstrip() + "\n"
    if headers:
        out.write(line(header))
        out.write(line(["-" * w for w in widths]))
    for row in rows:
        out.write(line(row))


def _widths(header, rows):
    return [max([len(header[i])] + [cells(printable(row[i])) for row in rows])
            for i in range(len(header))]


def write_records(records, fmt, out, table, columns=None, headers=True):
    """`records` (dicts) as json, jsonl, csv or tsv (nested values as JSON), each epoch time with
    its `<key>_utc` beside it; or the table `table()` makes. `columns` (names) keeps those keys in
    that order, ValueError for a name no record has; `headers` False drops the header row (the
    table's header and rule too)."""
    if fmt == "table":
        if records:  # no rows, no table: stderr says why
            header, rows = table()
            print_table(header, rows, out, headers)
        return
    records = [with_utc(record) for record in records]
    known = list(dict.fromkeys(key for record in records for key in record))
    unknown = [name for name in columns or () if records and name not in known]
    if unknown:
        raise ValueError(f"no column {unknown[0]!r}; the columns are: {', '.join(known)}")
    fields = list(columns) if columns else known
    if columns:
        records = [{key: record.get(key) for key in fields} for record in records]
    if fmt == "json":
        print_json(records, out)
    elif fmt == "jsonl":
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False, default=json_default) + "\n")
    else:
        writer = csv.writer(out, lineterminator="\n", delimiter="\t" if fmt == "tsv" else ",")
        if headers:
            writer.writerow(fields)
        for record in records:
            writer.writerow([_csv_cell(record.get(key)) for key in fields])


def _csv_cell(value):
    if value is None:
        return ""
    if isinstance(value, (str, int, float)):
        return value
    return json.dumps(value, ensure_ascii=False, default=json_default)


class Progress:
    """What a long command is doing, on stderr: one line rewritten in place on a terminal (at most
    every TTY_PROGRESS_SECONDS), else a plain line when a phase starts and at most every
    PLAIN_PROGRESS_SECONDS; each with its counts and the time since the command started. A phase
    that reports nothing for a while (one long SQLite call: an import's transaction, VACUUM, a
    backup) is kept alive by a ticker thread: the time moves on a terminal, a "still running" line
    every PLAIN_PROGRESS_SECONDS otherwise."""

    def __init__(self, command, stream=None):
        self.command, self.stream = command, stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = self._shown_at = time.monotonic()
        self.phase_name, self._open_line, self._last_text = None, False, None
        self._lock, self._stop, self._ticker = threading.Lock(), threading.Event(), None
        _RUNNING.append(self)

    def phase(self, name, detail=""):
        """A new phase, said when it starts."""
        self.phase_name = name
        self._show(f"{name}{': ' + detail if detail else ''}", force=True)
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="progress", daemon=True)
            self._ticker.start()

    def update(self, done, total=None, unit=""):
        counts = f"{done:,}" + (f"/{total:,}" if total else "") + (f" {unit}" if unit else "")
        percent = f" {100 * done // total:3d}%" if total else ""
        self._show(f"{self.phase_name}{percent} ({counts})")

    def finish(self, text=None):
        """End the progress line; `text`, if any, is the command's last diagnostic."""
        if self in _RUNNING:
            _RUNNING.remove(self)
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            if self._open_line:
                self.stream.write("\n")
                self._open_line = False
            if text:
                self.stream.write(f"{self.command}: {text} in {self._elapsed()}\n")
            self.stream.flush()

    def _elapsed(self):
        seconds = time.monotonic() - self.start
        if seconds < 60:
            return f"{seconds:.1f}s"
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"

    def _tick(self):
        interval = 1.0 if self.tty else PLAIN_PROGRESS_SECONDS
        while not self._stop.wait(interval / 4):
            if time.monotonic() - self._shown_at >= interval and self._last_text:
                text = self._last_text if self.tty else f"{self.phase_name} (still running)"
                self._show(text, force=True, again=True)

    def _show(self, text, force=False, again=False):
        with self._lock:
            now = time.monotonic()
            interval = TTY_PROGRESS_SECONDS if self.tty else PLAIN_PROGRESS_SECONDS
            if self._stop.is_set() or (text == self._last_text and not again) or (
                    not force and now - self._shown_at < interval):
                return
            self._shown_at = now
            if not again or self.tty:
                self._last_text = text
            line = f"{self.command}: {text}, {self._elapsed()}"
            if self.tty:
                self.stream.write(f"\r\033[K{line}")
                self._open_line = True
            else:
                self.stream.write(line + "\n")
            self.stream.flush()


# The Progress lines not finished yet: an error ends them before it is printed.
_RUNNING = []


def end_progress():
    """Finish every progress line still drawn (an error or ^C ends the command mid-line)."""
    for progress in list(_RUNNING):
        progress.finish()


def counted(items, progress, total=None, unit="sessions"):
    """`items`, reporting how many went by."""
    n = 0
    for item in items:
        yield item
        n += 1
        progress.update(n, total, unit)


# A message's text longer than this is cut in `show` unless --full.
SHOWN_TEXT_CHARS = 400


def session_cost(sessions):
    """`$0.0233 (actual)`: each session's actual cost where known, else its estimate, summed; None
    when no session has either."""
    known = [(s.get("actual_cost_usd"), s.get("estimated_cost_usd")) for s in sessions]
    known = [(actual, estimate) for actual, estimate in known
             if actual is not None or estimate is not None]
    if not known:
        return None
    kinds = {"actual" if actual is not None else "estimated" for actual, _ in known}
    total = sum(actual if actual is not None else estimate for actual, estimate in known)
    return f"${total:.4f} ({' and '.join(sorted(kinds))})"


def session_header(export):
    """The fields `show` heads a session with. A compression chain (an export with `segments`)
    is headed by the chain's totals: its first start, its tip's end, every segment's counters."""
    segments = export.get("segments") or [export]
    fields = {key: export.get(key) for key in ("id", "source", "model", "title",
                                                "parent_session_id")}
    if export.get("lineage_session_ids"):
        fields["lineage"] = " -> ".join(export["lineage_session_ids"])
    fields.update(started=format_time(segments[0].get("started_at")),
                  ended=format_time(export.get("ended_at")), end_reason=export.get("end_reason"),
                  message_count=len(export["messages"]))
    for key in ("tool_call_count", "input_tokens", "output_tokens"):
        fields[key] = sum(segment.get(key) or 0 for segment in segments)
    fields["cost"] = session_cost(segments)
    return fields


def print_session(export, out, full=False):
    """A session's header, then its messages numbered 1, 2, 3; a long text is cut unless
    `full`."""
    print_fields(session_header(export), out)
    for number, message in enumerate(export["messages"], 1):
        label = printable(message["role"] + (f" ({message['tool_name']})"
                                             if message.get("tool_name") else ""))
        out.write(f"\n[{number}] {label} at {format_time(message['timestamp'])}\n")
        if message.get("content"):
            text = message_text(message)
            if not full and len(text) > SHOWN_TEXT_CHARS:
                text = (text[:SHOWN_TEXT_CHARS]
                        + f" ... ({len(text):,} chars; show --full prints them all)")
            out.write(text + "\n")
        for call in message.get("tool_calls") or []:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            out.write(f"  -> {printable(function.get('name', '?'))}"
                      f"({printable(function.get('arguments', ''))})\n")


# -- the command line's subcommand parsers -------------------------------------------------------

class ParserPlan:
    """A subcommand's parser as the command line describes it: its arguments are kept, and the
    ArgumentParser is made with them when the command line (or a reader of `choices`) names it.
    Making all 23 up front cost a `list` run more than its query does (issue 38)."""

    def __init__(self, **kwargs):
        self._kwargs, self._arguments = kwargs, []

    def add_argument(self, *args, **kwargs):
        self._arguments.append((args, kwargs))

    def make(self):
        parser = argparse.ArgumentParser(**self._kwargs)
        for args, kwargs in self._arguments:
            parser.add_argument(*args, **kwargs)
        return parser


class Subcommands(argparse._SubParsersAction):
    """add_subparsers' action with parser_class=ParserPlan: each parser is made at its first
    lookup; what the command list, its help and its errors show is argparse's own."""

    class _Parsers(dict):
        def __getitem__(self, name):
            parser = dict.__getitem__(self, name)
            if isinstance(parser, ParserPlan):
                parser = self[name] = parser.make()
            return parser

        def items(self):
            return [(name, self[name]) for name in self]

        def values(self):
            return [self[name] for name in self]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._name_parser_map = self.choices = self._Parsers()
