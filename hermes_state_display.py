"""What a person reads on a terminal: the command line's tables, fields and values, a session
shown with its messages, progress lines on stderr, and the escaping of every control character a
store's text may hold. Pure formatting over rows and export dicts: it never opens a store, and the
data formats (JSON, CSV, exports) pass through it unescaped.
"""

import csv
import json
import re
import sys
import threading
import time

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


def one_line(text, width):
    """`text` on one line in `width` characters; a long one is cut around its first >>>match<<<."""
    text = " ".join(str(text or "").split())
    if len(text) <= width:
        return text
    start = max(0, min(text.find(">>>") - width // 4, len(text) - width + 1))
    head = "…" if start else ""
    return head + text[start + len(head):start + width - 1] + "…"


def session_rows(sessions):
    """(header, rows) of `list`'s table."""
    rows = [(s["id"], s.get("source") or "-", format_time(s.get("last_active")),
             f"{s.get('message_count') or 0:,}",
             one_line(s.get("title") or s.get("preview") or "-", 60)) for s in sessions]
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


def hit_rows(hits, query=None):
    rows = [(h["session_id"], str(h["id"]), h["role"], format_time(h["timestamp"]),
             one_line(mark_terms(h["snippet"], query), 80)) for h in hits]
    return ("session", "message id", "role", "time", "snippet"), rows


def print_table(header, rows, out):
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max([len(header[i])] + [len(row[i]) for row in rows]) for i in range(len(header))]
    right = {i for i, name in enumerate(header) if name in ("messages", "message id")}

    def line(cells):
        return "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths))).rstrip() + "\n"
    out.write(line(header))
    out.write(line(["-" * w for w in widths]))
    for row in rows:
        out.write(line(row))


def write_records(records, fmt, out, table):
    """`records` (dicts) as json, jsonl, csv (a header row; nested values as JSON) or the table
    `table(records)` makes."""
    if fmt == "json":
        print_json(records, out)
    elif fmt == "jsonl":
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False, default=json_default) + "\n")
    elif fmt == "csv":
        fields = list(dict.fromkeys(key for record in records for key in record))
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(fields)
        for record in records:
            writer.writerow([_csv_cell(record.get(key)) for key in fields])
    elif records:  # no rows, no table: stderr says why
        print_table(*table(records), out)


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


def print_session(export, out):
    fields = ("id", "source", "model", "title", "parent_session_id", "end_reason", "message_count",
              "tool_call_count", "input_tokens", "output_tokens")
    print_fields({key: export.get(key) for key in fields}, out)
    if export.get("lineage_session_ids"):
        out.write(f"{'lineage':>17}: {printable(' -> '.join(export['lineage_session_ids']))}\n")
    for number, message in enumerate(export["messages"], 1):
        label = printable(message["role"] + (f" ({message['tool_name']})"
                                             if message.get("tool_name") else ""))
        out.write(f"\n[{number}] {label} at {format_time(message['timestamp'])}\n")
        if message.get("content"):
            text = message_text(message)
            cut = text if len(text) <= 400 else text[:400] + f" ... ({len(text):,} chars)"
            out.write(cut + "\n")
        for call in message.get("tool_calls") or []:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            out.write(f"  -> {printable(function.get('name', '?'))}"
                      f"({printable(function.get('arguments', ''))})\n")
