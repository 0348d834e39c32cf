"""Normalisation of outputs and stored rows for `make compat`: what varies between runs becomes a placeholder.

Owns: the placeholder rules (session ids become S1, S2, ... in order of first sight; timestamps, dates,
durations, sizes, hashes, HTML nonces, temp paths and the server port become <ts>, <date>, <dur>,
<size>, <hash>, <nonce>, <root>, <port>; a store that would not open reads the same on either side).
Must not touch: the meaning of what it normalises: anything the state layer decides (counts, titles,
contents, order, exit codes) passes through unchanged.
"""

import json
import re

SESSION_ID = re.compile(r"\b\d{8}_\d{6}_[0-9a-f]{6}\b")
# Shown cut short by some commands (insights prints the first 16 characters).
SESSION_ID_PREFIX = re.compile(r"\b\d{8}_\d{6}_?[0-9a-f]{0,5}(?![0-9a-f])")
TEXT_RULES = [
    (re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07"), ""),
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "<uuid>"),
    (re.compile(r"\b[0-9a-f]{32,}\b"), "<hash>"),
    # The HTML export's content-security nonce is random per file.
    (re.compile(r"\bnonce(-|=\")[A-Za-z0-9_+/=-]+"), r"nonce\1<nonce>"),
    (re.compile(r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?"), "<datetime>"),
    (re.compile(r"\b\d{8}_\d{6}\b"), "<datetime>"),
    (re.compile(r"\b\d{4}-\d{2}-\d{2}\b"), "<date>"),
    (re.compile(r"\b(Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,?\s+"), "<day> "),
    (re.compile(r"\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?\s+\d{1,2}(st|nd|rd|th)?(,?\s+\d{4})?"),
     "<date>"),
    (re.compile(r"\b\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?(\s?[AaPp][Mm])?\b"), "<time>"),
    (re.compile(r"\bjust now\b|\b\d+(\.\d+)?\s?(ms|s|sec|secs|seconds?|m|min|mins|minutes?|h|hrs?|hours?|d|days?)\s+ago\b"),
     "<ago>"),
    (re.compile(r"\b1[5-9]\d{8}(\.\d+)?\b"), "<ts>"),
    (re.compile(r"\b\d+(\.\d+)?\s?(ms|s|sec|secs|seconds?|minutes?)\b"), "<dur>"),
    (re.compile(r"\b\d[\d,]*(\.\d+)?\s?(B|KB|MB|GB|KiB|MiB|GiB|bytes)\b"), "<size>"),
    (re.compile(r"\b(pid|PID)[ =:]+\d+"), r"\1 <pid>"),
    # Byte counts and file times in a JSON report (0.22's `sessions recover --inspect-only`): the disk's.
    (re.compile(r'("\w*(?:_bytes|_ns)"\s*:\s*)\d+'), r"\1<size>"),
    # Wall-clock milliseconds in 0.22's JSONL export (`timings.wall_clock_ms = 86092`, or as JSON text).
    (re.compile(r'(\b\w+_ms"?\s*[:=]\s*)\d+(\.\d+)?'), r"\1<dur>"),
    # Rounded durations (`insights`: "Active time: ~4m").
    (re.compile(r"~\d+(\.\d+)?\s?[smhd](\s\d+(\.\d+)?\s?[smhd])*\b"), "~<dur>"),
    # A session's wall-clock length as the run took it (`insights`: "Longest session 1m"): under
    # load one side's run takes longer.
    (re.compile(r"(Longest session )\d+[smhd](\s\d+[smhd])*\b"), r"\1<dur>"),
    (re.compile(r"[─━═]+"), "─"),
    (re.compile(r"[ \t]+"), " "),
]
TIMESTAMP_RANGE = (1.5e9, 2.5e9)


class Normaliser:
    """Turn one run's texts and rows into placeholders; one instance per run, so labels follow that run."""

    def __init__(self, paths=None, port=None):
        # Longest first, so a path inside another is replaced as the longer one.
        self.paths = sorted(((p, r) for p, r in (paths or {}).items() if p), key=lambda pr: -len(pr[0]))
        self.port = port
        self.labels = {}

    def label_session(self, session_id):
        """Return the label of a session id, giving it the next one at first sight."""
        if session_id not in self.labels:
            self.labels[session_id] = "S%d" % (len(self.labels) + 1)
        return self.labels[session_id]

    def _label_prefix(self, match):
        known = sorted({label for sid, label in self.labels.items() if sid.startswith(match.group(0))})
        if not known and "_" not in match.group(0)[9:]:
            # A bare date_time no session id starts with (a backup's name): the time rules take it.
            return match.group(0)
        return known[0] + "(cut)" if len(known) == 1 else "<session id cut short>"

    def label_sessions_from_store(self, store):
        table = store.get("sessions") if isinstance(store, dict) else None
        if not table or "rows" not in table:
            return
        index = table["columns"].index("id")
        for row in table["rows"]:
            self.label_session(row[index])

    def text(self, value):
        for path, replacement in self.paths:
            value = value.replace(path, replacement)
        if self.port:
            value = value.replace(":%d" % self.port, ":<port>")
        value = SESSION_ID.sub(lambda m: self.label_session(m.group(0)), value)
        value = SESSION_ID_PREFIX.sub(self._label_prefix, value)
        for pattern, replacement in TEXT_RULES:
            value = pattern.sub(replacement, value)
        return value.strip()

    def lines(self, value):
        """Return the non-blank normalised lines of a text."""
        return [line for line in (self.text(raw) for raw in (value or "").splitlines()) if line]

    def lines_json(self, value):
        """Return `lines(value)`, with each line that is a JSON object or list spelled out one field a line."""
        out = []
        for raw in (value or "").splitlines():
            stripped = raw.strip()
            if stripped[:1] in ("{", "["):
                try:
                    parsed = json.loads(stripped)
                except ValueError:
                    parsed = None
                if isinstance(parsed, (dict, list)):
                    out.extend(flatten(self.value(parsed)))
                    continue
            line = self.text(raw)
            if line:
                out.append(line)
        return out

    def value(self, obj):
        """Return `obj` (JSON-like) with every string normalised and every epoch-looking number as <ts>."""
        if isinstance(obj, str):
            if obj in self.labels:
                return self.labels[obj]
            return self.text(obj)
        if isinstance(obj, bool) or obj is None:
            return obj
        if isinstance(obj, bytes):
            # A blob is its text when UTF-8, else hex (a random digest becomes <hash>).
            try:
                return self.text(obj.decode("utf-8"))
            except UnicodeDecodeError:
                return self.text(obj.hex())
        if isinstance(obj, (int, float)):
            return "<ts>" if TIMESTAMP_RANGE[0] <= obj <= TIMESTAMP_RANGE[1] else obj
        if isinstance(obj, dict):
            # A `*_ms` number is a wall-clock duration (0.22's JSONL export: `timings.gap_ms`).
            return {self.value(k) if isinstance(k, str) else k:
                    "<dur>" if _is_duration(k, v) else self.value(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.value(v) for v in obj]
        return self.text(repr(obj))

    @staticmethod
    def uid_labels(messages, message_labels):
        """{uid: label} of a store's message rows (columns, rows): a message uid reads as the
        message label of the first row that has it (`U@M3`), a tool call uid as the first row
        that names it (`C@M3`); random hex otherwise, a copy that keeps its original's uid reads
        the same on both sides, and a difference stays on the rows it is about."""
        labels = {}
        index = {name: i for i, name in enumerate(messages["columns"])}
        for row in messages["rows"]:
            label = message_labels.get(row[index["id"]])
            uid = row[index["message_uid"]] if "message_uid" in index else None
            if isinstance(uid, str) and uid:
                labels.setdefault(uid, "U@%s" % label)
            calls = row[index["tool_call_uids"]] if "tool_call_uids" in index else None
            try:
                calls = json.loads(calls) if isinstance(calls, str) else {}
            except ValueError:
                calls = {}
            for value in (calls.values() if isinstance(calls, dict) else ()):
                for uid in (value if isinstance(value, list) else [value]):
                    if isinstance(uid, str):
                        labels.setdefault(uid, "C@%s" % label)
        return labels

    @staticmethod
    def _label_identity(row, message_labels, uid_labels):
        """Schema 31's identity columns of a message row, labelled: uids as uid_labels gives them,
        display_order as the message label of the row it names."""
        def relabel(value):
            if isinstance(value, str):
                return uid_labels.get(value, value)
            if isinstance(value, list):
                return [relabel(item) for item in value]
            if isinstance(value, dict):
                return {key: relabel(item) for key, item in value.items()}
            return value
        if "display_order" in row:
            row["display_order"] = message_labels.get(row["display_order"], row["display_order"])
        for column in ("message_uid", "tool_call_uid"):
            if column in row:
                row[column] = relabel(row[column])
        for column in ("absorbed_message_uids", "tool_call_uids"):
            if isinstance(row.get(column), str):
                try:
                    row[column] = json.dumps(relabel(json.loads(row[column])), sort_keys=True)
                except ValueError:
                    pass

    def store(self, store):
        """Return the dumped store as {table: [row dicts]} with message ids as M1, M2, ... in id order."""
        if isinstance(store, dict) and set(store) == {"error"}:
            # The store would not open (a damaged schema): each table says why, on either side alike.
            return {table: {"error": self.text(store["error"])} for table in ("sessions", "messages",
                                                                             "session_model_usage")}
        if not isinstance(store, dict) or "sessions" not in store:
            return store
        out = {}
        prompts = store.get("system_prompts_by_hash") or {}
        message_labels, uid_labels = {}, {}
        messages = store.get("messages") or {}
        if "rows" in messages:
            index = messages["columns"].index("id")
            for n, row in enumerate(messages["rows"], 1):
                message_labels[row[index]] = "M%d" % n
            uid_labels = self.uid_labels(messages, message_labels)
        for table in ("sessions", "messages", "session_model_usage"):
            dumped = store.get(table) or {}
            if "rows" not in dumped:
                out[table] = dumped
                continue
            rows = []
            for raw in dumped["rows"]:
                row = dict(zip(dumped["columns"], raw))
                if table == "sessions":
                    # Where the prompt lives (inline or by hash) is the layer's business; its text is not.
                    row["system_prompt_resolved"] = row.get("system_prompt") or prompts.get(
                        row.get("system_prompt_hash"))
                if table == "messages":
                    row["id"] = message_labels.get(row["id"], row["id"])
                    self._label_identity(row, message_labels, uid_labels)
                rows.append({k: self.value(v) for k, v in row.items()})
            out[table] = rows
        return out


def _is_duration(key, value):
    return (isinstance(key, str) and key.endswith("_ms") and isinstance(value, (int, float))
            and not isinstance(value, bool))


def flatten(obj, path=""):
    """Return 'path = value' lines for every leaf of a JSON value (an empty dict or list is a leaf)."""
    if isinstance(obj, dict) and obj:
        return [line for key in obj for line in flatten(obj[key], "%s.%s" % (path, key) if path else str(key))]
    if isinstance(obj, list) and obj:
        return [line for i, item in enumerate(obj) for line in flatten(item, "%s[%d]" % (path, i))]
    return ["%s = %s" % (path or ".", json.dumps(obj, ensure_ascii=False, sort_keys=True))]
