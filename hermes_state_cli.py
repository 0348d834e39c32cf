"""`python -m hermes_state`: the command line over SessionDB.

Owns argument parsing and its ranges, what each subcommand prints (data on stdout; progress,
questions and diagnostics on stderr), the checks made before a store is opened (a read never
creates, upgrades or repairs one; no command sets aside a file that is not a store), the
confirmation of destructive commands, and exit codes (0 success, 1 failure, 2 usage). It holds no
store logic: every command is a few SessionDB calls. Only the agent's own open (the API) keeps
quarantining a damaged file.
"""

import argparse
import contextlib
import errno
import logging
import math
import os
import shutil
import sqlite3
import sys
from functools import partial
from pathlib import Path

from hermes_constants import get_hermes_home, reset_hermes_home_override, set_hermes_home_override
from hermes_state import SessionDB, damage_reason, restore_home
from hermes_state_health import note_store_failure
from hermes_state_common import LIST_LIMIT_MAX, LazyModule, store_file_bytes
from hermes_state_display import (
    SHOWN_TEXT_CHARS, ParserPlan, PrintableStream, Progress, Subcommands, counted, end_progress,
    fit_table, format_time, hit_rows, human_size, one_line, plural, print_fields, print_json,
    print_session, print_table, printable, session_cost, session_rows, utc_iso, write_records,
)
from hermes_state_lockguard import _raw_store_access
from hermes_state_portability import EXPORT_FORMATS, write_export
from hermes_state_schema import SCHEMA_VERSION
from hermes_state_search import GRAMMAR_BOOLEAN, GRAMMAR_HERMES

tempfile = LazyModule("tempfile")  # (export, import and demo only)

# Commands that only read: opened read-only (no DDL, no repair, no journal switch, no lock file).
# The others write, to a store that must exist already (import may create one).
READ_COMMANDS = ("list", "show", "search", "stats", "doctor", "export", "backup", "serve",
                 "pinned")
# The largest --offset: SQLite's OFFSET is a signed 64-bit integer, and offset + limit (+ 1 to see
# whether more match) must stay one.
OFFSET_MAX = 2 ** 63 - 1 - 2 * LIST_LIMIT_MAX
LIST_FORMATS = ("table", "json", "jsonl", "csv", "tsv")
# What csv and tsv carry unless -c names others (a session row has some 65 columns).
CSV_COLUMNS = {
    "list": ("id", "source", "title", "preview", "started_at", "started_at_utc", "last_active",
             "last_active_utc", "ended_at", "ended_at_utc", "end_reason", "message_count",
             "tool_call_count", "input_tokens", "output_tokens", "model", "parent_session_id"),
    "search": ("session_id", "number", "id", "role", "tool_name", "timestamp", "timestamp_utc",
               "source", "snippet"),
}
# The cells a table's last column (a title, a snippet) gets when stdout is not a terminal and
# COLUMNS is not set.
LAST_COLUMN_CELLS = {"list": 60, "search": 80}
# How many candidates an ambiguous id prefix lists.
CANDIDATES_SHOWN = 10
_DAMAGE_WORDS = {"empty": "an empty file", "zeroed": "all zero bytes", "notsqlite": "not SQLite"}


class CommandError(Exception):
    """A failure the command explains in one line, with `details` (lines) after it; exit 1."""

    def __init__(self, message, details=()):
        super().__init__(message)
        self.details = list(details)


# -- argument types: argparse makes an ArgumentTypeError a usage error (exit 2) ---------------

def _int_range(low, high, what=""):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: {low}-{high:,}{what}")
        return value
    return parse


def _days(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: days must be a finite number >= 0")
    return value


def _non_empty(text):
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


# -- output ------------------------------------------------------------------------------

def _confirm(args, command, question, listing):
    """True to go ahead: --yes, or "y" typed at the terminal after `listing` (lines) was shown.
    CommandError when stdin is not a terminal and --yes was not given: nothing goes unasked."""
    if getattr(args, "yes", False):
        return True
    if not sys.stdin or not sys.stdin.isatty():
        # (only the commands that delete have a --dry-run)
        dry_run = (" (--dry-run lists what it would delete)" if command in ("delete", "prune")
                   else "")
        raise CommandError(f"{command} asks before it changes anything; pass --yes to run it "
                           f"unattended{dry_run}")
    for line in listing:
        sys.stderr.write(printable(line) + "\n")
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    if sys.stdin.readline().strip().lower() not in ("y", "yes"):
        sys.stderr.write("nothing was changed\n")
        return False
    return True




# -- opening a store -----------------------------------------------------------------------

def store_path(args):
    """The path the command works on: --db, else <hermes home>/state.db."""
    db = getattr(args, "db", None)
    return Path(db) if db is not None else get_hermes_home() / "state.db"


def check_store(path, *, may_create=False):
    """CommandError unless `path` is a SQLite file (or, with `may_create`, absent); changes
    nothing."""
    if not os.path.lexists(path):
        if may_create:
            return
        raise CommandError(f"no store at {path}")
    if path.is_dir():
        raise CommandError(f"{path} is a folder, not a store")
    try:
        reason = damage_reason(path)
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {os_error_text(exc, with_name=False)}") from None
    if reason is not None:
        what = _DAMAGE_WORDS.get(reason, reason)
        raise CommandError(f"{path} is not a SQLite store ({what}); it was left as it is")


def open_read_only(path, damaged_ok=False):
    """A read-only SessionDB of an existing store, or CommandError naming the path and why it
    cannot be read. With `damaged_ok` (doctor) a store SQLite finds damaged opens too;
    `db.open_error` says why."""
    check_store(path)
    db = SessionDB(path, read_only=True)
    db.open_error = None
    try:
        db.schema_version()
    except sqlite3.Error as exc:
        db.open_error = str(exc)
        wal_without_shm = (os.path.exists(f"{path}-wal") and not os.path.exists(f"{path}-shm")
                           and not os.access(path.parent, os.W_OK))
        if damaged_ok and not wal_without_shm and "readonly" not in str(exc):
            return db
        db.close()
        hint = (f"; its -wal has no -shm beside it in a folder this user may not write, so SQLite "
                f"cannot read it safely: copy {path.name} and {path.name}-wal to a folder you may "
                "write"
                if wal_without_shm else "")
        raise CommandError(f"cannot read {path}: {exc}{hint}") from None
    return db


def journal_in_header(path):
    """'wal' or 'delete' as the store file's header says (bytes 18-19 are 2 in WAL mode); None
    when it cannot be read. Read before the store opens: a read through `immutable=1` (a store we
    may only read, with no sidecars) makes SQLite report 'delete' for any file."""
    head = _raw_store_access(path, os.O_RDONLY, lambda fd: os.read(fd, 20))
    if not head or len(head) < 20:
        return None
    return "wal" if head[18:20] == b"\x02\x02" else "delete"


def agent_open_would(db, header_journal=None):
    """What the agent's writable open would change in this (read-only) store, a phrase each."""
    changes = []
    version = schema_behind(db)
    if version is not None:
        changes.append(f"upgrade its schema from version {version} to {SCHEMA_VERSION}")
    journal = header_journal or _safe(lambda: db._read_value("PRAGMA journal_mode"))
    if isinstance(journal, str) and journal.lower() != db.policy.mode:
        changes.append(f"switch its journal from {journal.lower()} to {db.policy.mode}")
    return changes


def schema_behind(db):
    """The schema version a writable open would upgrade this (read-only) store from, or None.
    Reads serve a 0.20 store's tables as they are, so its version says more than what reads miss;
    without FTS5 the open holds the version back (docs/search.md, "Degraded runtimes")."""
    version = _safe(db.schema_version)
    behind = isinstance(version, int) and version < SCHEMA_VERSION and db.fts_caps.fts5
    return version if db.stale_schema or behind else None


def os_error_text(exc, with_name=True):
    """An OSError as one phrase: `/x/y: no such file or directory`, without Python's
    `[Errno 2]`."""
    reason = exc.strerror or str(exc)
    reason = reason[:1].lower() + reason[1:]
    if with_name and exc.filename is not None:
        return f"{exc.filename}: {reason}"
    return reason


def _safe(fn):
    try:
        return fn()
    except sqlite3.Error as exc:
        return f"unknown ({exc})"


# -- the commands --------------------------------------------------------------------------

def _all_pages(fetch, limit):
    """fetch(limit, offset) for one page; with `limit` 0, every page, LIST_LIMIT_MAX rows each."""
    if limit:
        return fetch(limit, 0)
    rows = []
    while True:
        page = fetch(LIST_LIMIT_MAX, len(rows))
        rows.extend(page)
        if len(page) < LIST_LIMIT_MAX:
            return rows


def terminal_width():
    """$COLUMNS, else the width of the terminal stdout is; 0 for neither (a pipe, a file)."""
    return shutil.get_terminal_size((0, 0)).columns


def _columns(args):
    """The record keys to print: -c's names (comma-separated or repeated; '*' for all), else the
    command's CSV_COLUMNS for csv and tsv; None for every key."""
    names = [name.strip() for given in args.columns or () for name in given.split(",")
             if name.strip()]
    if names == ["*"]:
        return None
    if names:
        return names
    return CSV_COLUMNS[args.command] if args.format in ("csv", "tsv") else None


def _write_listing(records, args, out, make):
    """list's and search's records in args.format; `make(cells)` is the table with its last
    column cut to that many cells (fitted to the terminal's width)."""
    table = partial(fit_table, make, terminal_width(), LAST_COLUMN_CELLS[args.command])
    write_records(records, args.format, out, table, _columns(args), not args.no_headers)


def _cmd_list(db, args, out):
    # As `hermes sessions list`: delegate runs, continuations and tool sessions are the agent's
    # own bookkeeping, listed only when asked for (--all, or --source naming them).
    everything = args.all or args.source is not None
    hidden = None if everything else ["tool"]

    def fetch(limit, offset):
        return db.list_sessions_rich(source=args.source, exclude_sources=hidden, limit=limit,
                                     offset=args.offset + offset, include_archived=args.archived,
                                     include_children=everything)
    sessions = _all_pages(fetch, args.limit)
    _write_listing(sessions, args, out, partial(session_rows, sessions))
    total = db.session_count(source=args.source, exclude_sources=hidden,
                             include_archived=args.archived, exclude_children=not everything)
    if args.limit and len(sessions) == args.limit and total > args.offset + len(sessions):
        sys.stderr.write(f"showing {len(sessions):,} of {plural(total, 'session')} (-n 0 for all, "
                         f"--offset {args.offset + len(sessions)} for the next page)\n")
    elif not sessions:
        sys.stderr.write(f"no sessions past offset {args.offset:,} of {total:,}\n" if total
                         else "no sessions\n")
    return 0


def _numbered(db, hits):
    """Each hit with `number`: its place in `show SESSION` (None for a message show leaves out,
    one rewound)."""
    places = {}
    numbered = []
    for hit in hits:
        session_id = hit["session_id"]
        if session_id not in places:
            places[session_id] = {message_id: number for number, message_id in
                                  enumerate(db.get_active_message_ids(session_id), 1)}
        numbered.append({"id": hit["id"], "session_id": session_id,
                         "number": places[session_id].get(hit["id"]), **hit})
    return numbered


def _cmd_search(db, args, out):
    def fetch(limit, offset):
        return db.search_messages(args.query, source_filter=args.source, role_filter=args.role,
                                  limit=limit, offset=args.offset + offset, sort=args.sort,
                                  include_inactive=args.include_inactive, grammar=args.grammar)
    # One more than asked, to know whether there are more.
    asked = args.limit + 1 if args.limit and args.limit < LIST_LIMIT_MAX else args.limit
    hits = _all_pages(fetch, asked)
    more = bool(args.limit) and len(hits) > args.limit
    hits = _numbered(db, hits[:args.limit] if args.limit else hits)
    _write_listing(hits, args, out, partial(hit_rows, hits, args.query))
    if more:
        sys.stderr.write(f"showing the first {plural(len(hits), 'hit')}; more match (-n 0 for all, "
                         f"--offset {args.offset + len(hits)} for the next page)\n")
    elif not hits:
        sys.stderr.write("no hits\n")
    return 0


def _resolve(db, given):
    """The session `given` names (an id, or a prefix of exactly one); CommandError naming the
    candidates (as git does) when the prefix starts several."""
    session_id = db.resolve_session_id(given)
    if session_id is not None:
        return session_id
    rows = [row for row in _all_pages(lambda limit, offset: db.list_sessions_rich(
        limit=limit, offset=offset, include_children=True, include_archived=True,
        include_hidden=True, order_by_last_active=True, id_query=given, compact_rows=True), 0)
        if row["id"].lower().startswith(given.lower())]
    if len(rows) < 2:
        raise CommandError(f"no session matches {given!r}")
    rows.sort(key=lambda row: row["id"])
    more = len(rows) - CANDIDATES_SHOWN
    listing = [_describe(row) for row in rows[:CANDIDATES_SHOWN]]
    listing += [f"  ... and {more:,} more"] if more > 0 else []
    raise CommandError(f"{given!r} is ambiguous: {len(rows):,} sessions start with it; the "
                       "candidates are:", listing)


def _export_one(db, session_id, lineage):
    return db.export_session_lineage(session_id) if lineage else db.export_session(session_id)


def _cmd_show(db, args, out):
    session_id = _resolve(db, args.session_id)
    export = _export_one(db, session_id, args.lineage)
    if args.json:
        print_json(export, out)
    else:
        print_session(export, out, full=args.full)
    return 0


# The token counters a session row carries, summed by `stats`.
TOKEN_COLUMNS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
                 "reasoning_tokens")


def _usage(db):
    """Token and cost totals over every session (delegates and archived ones included: each
    counts its own calls), with the first and last activity: stats' additions."""
    rows = _all_pages(lambda limit, offset: db.list_sessions_rich(
        limit=limit, offset=offset, include_children=True, include_archived=True,
        include_hidden=True, compact_rows=True), 0)
    tokens = {key[:-len("_tokens")]: sum(row.get(key) or 0 for row in rows)
              for key in TOKEN_COLUMNS}
    known = [row for row in rows if row.get("actual_cost_usd") is not None
             or row.get("estimated_cost_usd") is not None]
    starts = [row["started_at"] for row in rows if row.get("started_at")]
    ends = [row.get("last_active") or row.get("started_at") for row in rows]
    return {"tokens": tokens,
            "cost_usd": None if not known else sum(
                row["actual_cost_usd"] if row.get("actual_cost_usd") is not None
                else row["estimated_cost_usd"] for row in known),
            "cost": session_cost(known),
            "first_activity": min(starts, default=None),
            "last_activity": max(filter(None, ends), default=None)}


def _cmd_stats(db, args, out):
    would = agent_open_would(db, getattr(args, "header_journal", None))
    stats = dict(db.stats(), **_usage(db), agent_open_would=would)
    if args.json:
        del stats["cost"]  # cost_usd is the number
        for key in ("first_activity", "last_activity"):
            stats[key + "_utc"] = stats[key] and utc_iso(stats[key])
        print_json(stats, out)
    else:
        del stats["cost_usd"]
        for key in ("first_activity", "last_activity"):
            stats[key] = stats[key] and format_time(stats[key])
        print_fields(stats, out)
    return 0


def _cmd_doctor(db, args, out):
    """The report of a read-only look (no repair, no DDL), opened by a one-line verdict."""
    would = agent_open_would(db, getattr(args, "header_journal", None))
    report = dict(db.doctor(full=args.full), agent_open_would=would)
    if db.open_error:
        report.update(open_error=db.open_error, ok=False)
    for key in ("search_meta", "hermes_agent_meta"):  # only the keys this store has set
        if isinstance(report.get(key), dict):
            report[key] = {k: v for k, v in report[key].items() if v is not None}
    hint = _optimize_hint(report)
    if hint:
        report["hint"] = hint
    if args.json:
        print_json(report, out)
    else:
        check = report["check"]
        if report["ok"]:
            verdict = f"ok: {db.db_path} is healthy ({check}" + (
                ")" if args.full else "; --full also runs integrity_check)")
        else:
            problems = [] if report.get("integrity_check") == ["ok"] else [f"{check} failed"]
            if report.get("open_error"):
                problems.append(f"SQLite cannot read it: {report['open_error']}")
            problems += ["search triggers damaged"] if report.get("trigger_damage") else []
            verdict = f"PROBLEM: {db.db_path}: {', '.join(problems) or 'see below'}"
        if report["agent_open_would"]:
            verdict += "; the agent's next open will " + " and ".join(report["agent_open_would"])
        out.write(verdict + "\n")
        print_fields(report, out)
    return 0 if report["ok"] else 1


def _optimize_hint(report):
    """What doctor suggests for a store whose search index is not yet ours in this release's
    layout: the layout as the store reports it (`fts_layout`, from its layout records, whatever
    its tables are called); None when there is nothing to move or no FTS5 to move it with."""
    layout = report.get("fts_layout")
    if report.get("fts5") and layout in ("legacy", "external", "previous"):
        return (f"its search index is in the {layout} layout; `{_M} optimize-storage` moves it "
                "to the current one (smaller, CJK of any length)")
    return None


def _cmd_optimize(db, args, out):
    db.optimize_fts()
    upgraded = getattr(args, "schema_upgraded", None)
    if args.json:
        print_json({"db_path": str(db.db_path), "optimized": True,
                    "schema_upgraded": upgraded and dict(zip(("from", "to"), upgraded))}, out)
    else:
        if upgraded:
            out.write(f"upgraded the schema of {db.db_path} from version {upgraded[0]} to "
                      f"{upgraded[1]}\n")
        out.write(f"merged the search index segments of {db.db_path}\n")
    return 0


def _cmd_optimize_storage(db, args, out):
    vacuum = "" if args.no_vacuum else " and VACUUM it (holding the write lock throughout)"
    question = f"Rebuild the search index of {db.db_path} in the current layout{vacuum}?"
    if not _confirm(args, "optimize-storage", question, []):
        return 1
    progress = Progress("optimize-storage")
    seen = {"phase": None}

    def report(step):
        if step["phase"] == "done":  # said by finish, with the time it took
            return
        if step["phase"] != seen["phase"]:
            seen["phase"] = step["phase"]
            detail = "" if step["phase"] != "vacuum" else (
                "rewrites the whole file and holds the write lock until it ends; other processes' "
                "writes wait (--no-vacuum skips it)")
            progress.phase(step["phase"], detail)
        elif step["total"]:
            progress.update(step["indexed"], step["total"], "rows")
    try:
        result = db.optimize_fts_storage(progress_cb=report, vacuum=not args.no_vacuum)
    except KeyboardInterrupt:
        progress.finish()
        raise CommandError("interrupted; the store is consistent, run optimize-storage again to "
                           "resume") from None
    if not result["ok"]:
        progress.finish()
        raise CommandError(f"optimize-storage refused: {result.get('detail') or result['reason']}")
    progress.finish("done")
    if args.json:
        print_json(result, out)
    else:
        after = human_size(store_file_bytes(db.db_path))
        out.write(f"{db.db_path}: {human_size(args.bytes_before)} -> {after}, layout "
                  f"{db.fts_layout()}\n")
    return 0


def _export_source(db, args):
    """The store to export from: this one, or, for a store an agent's open would upgrade, a private
    upgraded copy (the store itself is not changed). Returns (db, cleanup)."""
    if not db.stale_schema:
        return db, lambda: None
    scratch = Path(tempfile.mkdtemp(prefix="hermes-export-"))
    sys.stderr.write(f"export: {db.db_path} predates this release's schema; exporting from an "
                     f"upgraded copy in {scratch} (the store is not changed)\n")
    try:
        with sqlite3.connect(scratch / "state.db") as target:
            db._conn.backup(target)
        target.close()
        copy = SessionDB(scratch / "state.db")
    except BaseException:
        shutil.rmtree(scratch, True)
        raise

    def cleanup():
        copy.close()
        shutil.rmtree(scratch, True)
    return copy, cleanup


@contextlib.contextmanager
def _writing(target):
    """An OSError while `target` is written, as one line naming `target` (not the temporary
    file beside it the write goes through). A `target` that is a device, a FIFO or a socket is
    refused first: the write renames a new file over it (as root, over /dev/full itself)."""
    if target != "-" and os.path.exists(target) and not (
            os.path.isfile(target) or os.path.isdir(target)):
        raise CommandError(f"{target} is not a regular file (a device, a FIFO or a socket); "
                           "nothing was written: give a file, or '-' for standard output")
    try:
        yield
    except OSError as exc:
        where = "standard output" if target == "-" else target
        raise CommandError(f"cannot write {where}: {os_error_text(exc, with_name=False)}; "
                           "nothing was written") from None


def _cmd_export(db, args, out):
    progress = Progress("export")
    source, cleanup = _export_source(db, args)
    try:
        if args.session_id:
            session_id = _resolve(source, args.session_id)
            exports = [_export_one(source, session_id, args.lineage)]
            total = 1
        else:
            total = source.session_count(source=args.source, include_archived=True)
            if args.format == "jsonl" and not args.redact:  # a run of messages in memory (issue 17)
                exports = source.iter_export_jsonl(source=args.source)
            else:
                exports = source.iter_export_all(source=args.source)
        progress.phase(f"writing {args.format}" + (" (redacting secrets)" if args.redact else ""))
        with _writing(args.out):
            count = write_export(counted(exports, progress, total), args.format, args.out,
                                 redact_secrets=args.redact)
    except sqlite3.DatabaseError as exc:
        # The messages stream on as the file is written, past the export's own reader: a failing
        # disk is said so here (SQLite calls a short read "malformed" while the store is whole).
        note_store_failure(source.db_path, exc)
        raise
    finally:
        cleanup()
    progress.finish(f"exported {plural(count, 'session')} as {args.format} to {args.out}"
                    f"{' (redacted, best effort)' if args.redact else ''}")
    if args.json and args.out != "-":
        print_json({"exported": count, "format": args.format, "out": args.out,
                     "redacted": args.redact}, out)
    return 0


def _read_jsonl(path):
    """The import file open for binary reads ('-': standard input), and where its lines are
    copied as they are checked: None, or for a pipe, read only once, an unnamed temporary file
    the writes read again."""
    handle = sys.stdin.buffer if path == "-" else open(path, "rb")
    return handle, None if handle.seekable() else tempfile.TemporaryFile(prefix="hermes-import-")


def _read_import(args):
    """Pass 1, before the store is opened: every line of the file read and checked, so that a
    file that cannot be read or holds a bad entry writes nothing, not even a new store (nor its
    lock). (the checked file, its Progress); CommandError lists the first rejected entries."""
    progress = Progress("import")
    name = "<stdin>" if args.file == "-" else args.file
    progress.phase("checking", f"{name}, every line before anything is written")
    try:
        handle, copy = _read_jsonl(args.file)
    except OSError as exc:
        progress.finish()
        raise CommandError(f"cannot read {args.file}: {os_error_text(exc, with_name=False)}; "
                           "nothing was imported") from None
    # (imported here, not at the top: the checks are the import command's alone)
    from hermes_state_portability import IMPORT_ERRORS_SHOWN, check_import_file
    reader = copy or handle  # what the writes read again
    try:
        size = None if copy is not None else os.fstat(handle.fileno()).st_size // 2**20 or None
        digest, sessions, errors = check_import_file(
            handle, name, SessionDB.import_limits(), copy,
            lambda done: progress.update(done // 2**20, size, "MB"))
        if errors:
            lines = [f"{name}:{error['line']}: " + (f"session {error['session_id']!r}: "
                     if "session_id" in error else "") + error["error"] for error in errors]
            more = [] if len(errors) < IMPORT_ERRORS_SHOWN else [
                f"(the check stops at {IMPORT_ERRORS_SHOWN} rejected entries)"]
            raise CommandError(lines[0], [f"error: {line}" for line in lines[1:]] + more + [
                "the import was rejected; nothing was written"])
    except BaseException:
        reader.close()
        progress.finish()
        raise
    reader.seek(0)
    progress.phase("checked", f"{plural(sessions, 'session')}, every line valid")
    return (reader, name, digest), progress


def _cmd_import(db, args, out):
    (reader, name, digest), progress = args.sessions, args.progress  # _read_import's (_run)
    try:
        result = db.import_checked_file(reader, name, digest, progress=progress)
    except sqlite3.Error as exc:
        progress.finish()
        raise CommandError(str(exc), ["none of the import is visible; run it again to resume"]
                           ) from None
    finally:
        reader.close()
    totals = {key: result[key] for key in ("imported", "skipped", "detached")}
    if result.get("unstored_fields"):
        fields = ", ".join(result["unstored_fields"])
        sys.stderr.write(f"warning: this store has no column for {fields}; those values were not "
                         "imported\n")
    progress.finish("written")
    if args.json:
        print_json(totals, out)
    else:
        out.write("imported {imported}, skipped {skipped}, detached {detached}\n".format(**totals))
    return 0


def _describe(row):
    return (f"  {row['id']}  {row.get('source') or '-'}  {format_time(row.get('last_active'))}  "
            f"{row.get('message_count') or 0:,} msgs  {one_line(row.get('title') or '-', 50)}")


def _cmd_delete(db, args, out):
    session_id = _resolve(db, args.session_id)
    targets = db.get_session_delete_targets(session_id)  # the session, then its delegates
    rows = [dict(db.get_session(sid) or {"id": sid}, message_count=db.message_count(sid))
            for sid in targets]
    if args.dry_run:
        _emit_deleted(args, out, targets, dry_run=True)
        return 0
    if not _confirm(args, "delete", f"Delete this session and its messages from {db.db_path}?",
                    ["will delete:"] + [_describe(row) for row in rows]):
        return 1
    # Exactly what was shown: a delegate started while the question waited stops the delete.
    if not db.delete_session(session_id, expected_delete_ids=targets):
        raise CommandError(f"{args.session_id!r} changed while you were asked (deleted, or a "
                           "delegate started); nothing was deleted: run delete again")
    _emit_deleted(args, out, targets, dry_run=False)
    return 0


def _emit_deleted(args, out, ids, dry_run):
    if args.json:
        print_json({"dry_run": dry_run, "sessions": ids}, out)
    else:
        verb = "would delete" if dry_run else "deleted"
        out.write("".join(f"{verb} {printable(session_id)}\n" for session_id in ids))


def _cmd_prune(db, args, out):
    rows = db.list_prune_candidates(args.older_than, source=args.source)
    ids = [row["id"] for row in rows]
    what = (f"{plural(len(ids), 'ended session')} inactive for more than "
            f"{plural(args.older_than, 'day')}")
    if not args.dry_run and ids:
        if not _confirm(args, "prune", f"Delete these {what} from {db.db_path}?",
                        ["will delete:"] + [_describe(row) for row in rows]):
            return 1
        progress = Progress("prune")
        progress.phase("deleting", what)
        # Only the sessions shown, and only those still eligible: one that ended while the
        # question waited is left for the next prune.
        db.prune_sessions(args.older_than, source=args.source, session_ids=ids)
        progress.finish("done")
    if args.json:
        print_json({"dry_run": args.dry_run, "sessions": ids}, out)
    else:
        out.write(f"{'would delete' if args.dry_run else 'deleted'} {what}\n")
        for session_id in ids:
            out.write(f"  {printable(session_id)}\n")
    return 0


def _cmd_rename(db, args, out):
    session_id = _resolve(db, args.session_id)
    title = " ".join(args.title)
    if not title.strip():
        raise CommandError("title: empty; give the session a title of at least one character")
    if any(ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 for ch in title):
        raise CommandError("title: holds a control character (a newline, a tab, ...); "
                           "a title is one line")
    db.set_session_title(session_id, title)  # ValueError names the limit, or the session holding it
    stored = db.get_session_title(session_id)
    if args.json:
        print_json({"id": session_id, "title": stored}, out)
    else:
        out.write(f"renamed {session_id} to {stored}\n")
    return 0


def _cmd_flag(db, args, out, column, value):
    """pin, unpin, unarchive: the flag on each session's whole compression chain."""
    ids = [_resolve(db, given) for given in args.session_ids]  # every id resolves, or none is set
    setter = db.set_session_pinned if column == "pinned" else db.set_session_archived
    for session_id in ids:
        setter(session_id, value)
    verb = {"pinned": "pinned" if value else "unpinned", "archived": "unarchived"}[column]
    if args.json:
        print_json({verb: ids}, out)
    else:
        out.write("".join(f"{verb} {printable(session_id)}\n" for session_id in ids))
    return 0


def _cmd_archive(db, args, out):
    if bool(args.session_ids) == (args.older_than is not None) or (
            args.source is not None and args.older_than is None):
        raise CommandError("archive takes session ids, or --older-than DAYS [--source S]; not both")
    if args.session_ids:
        ids = [_resolve(db, given) for given in args.session_ids]
    else:
        # A pin is a keep flag: a bulk archive passes over pinned sessions, as hermes-agent's does.
        rows = [row for row in db.list_prune_candidates(args.older_than, source=args.source,
                                                        archived=False)
                if not (db.get_session(row["id"]) or {}).get("pinned")]
        ids = [row["id"] for row in rows]
        what = (f"{plural(len(ids), 'ended session')} inactive for more than "
                f"{plural(args.older_than, 'day')}")
        if ids and not _confirm(args, "archive", f"Archive these {what}?",
                                ["will archive:"] + [_describe(row) for row in rows]):
            return 1
    for session_id in ids:
        db.set_session_archived(session_id, True)
    if args.json:
        print_json({"archived": ids}, out)
    else:
        out.write("".join(f"archived {printable(session_id)}\n" for session_id in ids)
                  or "nothing to archive\n")
    return 0


def _cmd_pinned(db, args, out):
    rows = [row for row in _all_pages(
        lambda limit, offset: db.list_sessions_rich(limit=limit, offset=offset,
                                                    include_archived=True), 0)
            if row.get("pinned")]
    if args.json:
        print_json(rows, out)
    elif rows:
        print_table(*fit_table(partial(session_rows, rows), terminal_width(),
                               LAST_COLUMN_CELLS["list"]), out)
    else:
        out.write(f"no pinned sessions; pin one with: {_M} pin ID\n")
    return 0


def _cmd_backup(db, args, out):
    if os.path.lexists(args.out) and not args.force:
        raise CommandError(f"{args.out} exists; pass --force to replace it (nothing was written)")
    progress = Progress("backup")
    progress.phase("snapshotting and zipping", str(db.db_path.parent))
    with _writing(args.out):
        result = db.backup(args.out)
    size = human_size(os.path.getsize(result["archive"]))
    progress.finish(f"{plural(len(result['files']), 'file')}, {size}")
    if args.json:
        print_json(result, out)
    else:
        out.write(f"backed up {plural(len(result['files']), 'file')} of {db.db_path.parent} to "
                  f"{result['archive']}\n")
    return 0


def _cmd_restore(args, out):
    if not os.path.isfile(args.archive):
        what = "is a folder" if os.path.isdir(args.archive) else "does not exist"
        raise CommandError(f"restore: {args.archive} {what}; give the zip `backup` wrote")
    progress = Progress("restore")
    progress.phase("checking and unpacking", args.archive)
    try:
        result = restore_home(args.archive, getattr(args, "db", None), force=args.force)
    except ValueError as exc:
        # The archive's checks name it "backup refused"; here it is the restore that refuses.
        reason = str(exc)
        reason = reason[len(_ARCHIVE_REFUSED):] if reason.startswith(_ARCHIVE_REFUSED) else reason
        raise CommandError(f"restore refused: {reason}") from None
    progress.finish(plural(len(result['restored']), 'file'))
    for kept in result["moved_aside"]:
        sys.stderr.write(f"kept the replaced file as {kept}\n")
    if args.json:
        print_json(result, out)
    else:
        home = Path(result["db_path"]).parent
        out.write(f"restored {plural(len(result['restored']), 'file')} into {home}\n")
    return 0


# How restore_home's archive checks begin their message.
_ARCHIVE_REFUSED = "backup refused: "


def _cmd_serve(args, out):
    from hermes_state_server import serve

    path = store_path(args)
    if getattr(args, "replica", None) is None:
        open_read_only(path).close()  # the same checks and message as every read command
    token = os.environ.get("HERMES_STATE_TOKEN", "").strip() or None
    try:
        if getattr(args, "replica", None) is not None:
            replica = SessionDB.open_replica(args.replica)
            return serve(None, args.host, args.port, allow_remote=args.allow_remote, token=token,
                         out=out, read_only=True, as_json=args.json, db=replica)
        return serve(path, args.host, args.port, allow_remote=args.allow_remote, token=token,
                     out=out, read_only=not args.writable, as_json=args.json)
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            taken = "; another program listens there (--port picks another)" \
                if exc.errno == errno.EADDRINUSE else ""
            raise CommandError(f"cannot listen on {args.host}:{args.port}: "
                               f"{os_error_text(exc, with_name=False)}{taken}") from None
        raise


def _cmd_demo(args, out):
    from hermes_state_demo import build_demo_history  # (the demo's alone)
    home = Path(tempfile.mkdtemp(prefix="hermes-demo-"))
    token = set_hermes_home_override(home)
    try:
        with SessionDB() as db:
            build_demo_history(db)
            sessions = db.list_sessions_rich(limit=20, include_children=True)
            if args.json:
                print_json({"db_path": str(db.db_path), "sessions": sessions}, out)
                return 0
            out.write("== sessions (python3 -m hermes_state list)\n")
            print_table(*session_rows(sessions), out)
            tip = db.get_compression_tip("demo-refactor-1")
            out.write(f"\n== the compression chain ending in {tip}, shown as one session\n")
            print_session(db.export_session_lineage(tip), out)
            out.write("\n== one conversation in Chinese\n")
            print_session(db.export_session("demo-zh"), out)
            for query in ("my-app.config.ts", "迁移", "会话历史"):
                out.write(f"\n== search {query!r} (python3 -m hermes_state search ...)\n")
                hits = db.search_messages(query, grammar=GRAMMAR_BOOLEAN)
                print_table(*hit_rows(_numbered(db, hits), query), out)
            out.write(f"\nstore: {db.db_path}\n"
                      f"try:   python3 -m hermes_state --db {db.db_path} list\n")
    finally:
        reset_hermes_home_override(token)
    return 0


# -- the parser ----------------------------------------------------------------------------

_M = "python3 -m hermes_state"
SESSION_ID_HELP = "a session id or a unique prefix of one"
YES_HELP = "do not ask (needed when stdin is not a terminal)"
EXAMPLES = {
    "list": f"{_M} list -n 5\n  {_M} list --source telegram --format csv > sessions.csv\n"
            f"  {_M} list -n 0 --format jsonl",
    "show": f"{_M} show 20260301_0915 --lineage",
    "search": f"{_M} search 'config loader' --sort newest\n"
              f"  {_M} search 迁移 --role user --format json",
    "stats": f"{_M} stats --json",
    "doctor": f"{_M} --db ~/.hermes/state.db doctor\n  {_M} doctor --full --json",
    "optimize": f"{_M} optimize",
    "optimize-storage": f"{_M} optimize-storage --no-vacuum --yes",
    "export": f"{_M} export sessions.jsonl\n  {_M} export --format html --redact page.html\n"
              f"  {_M} export --session-id 20260301 --lineage -",
    "import": f"{_M} import sessions.jsonl\n  gunzip -c old.jsonl.gz | {_M} import -",
    "delete": f"{_M} delete 20260301_0915 --dry-run\n  {_M} delete 20260301_0915 --yes",
    "prune": f"{_M} prune --older-than 90 --dry-run\n"
             f"  {_M} prune --older-than 90 --source cron --yes",
    "rename": f"{_M} rename 20260301_0915 Release checklist",
    "archive": f"{_M} archive 20260301_0915\n  {_M} archive --older-than 30 --source cron --yes",
    "unarchive": f"{_M} unarchive 20260301_0915",
    "pin": f"{_M} pin 20260301_0915 20260302_1100",
    "unpin": f"{_M} unpin 20260301_0915",
    "pinned": f"{_M} pinned --json",
    "backup": f"{_M} backup home-2026-03-01.zip",
    "restore": f"{_M} restore home-2026-03-01.zip --force",
    "serve": f"HERMES_STATE_TOKEN=$(openssl rand -hex 24) {_M} serve --port 8765",
    "demo": f"{_M} demo",
    "install": f"{_M} install ~/.hermes/hermes-agent/venv\n  {_M} install --check",
    "uninstall": f"{_M} uninstall ~/.hermes/hermes-agent/venv",
}
INSTALL_COMMANDS = ("install", "uninstall")  # hermes_state_install's, loaded when one runs
_PATH_HELP = ("a hermes-agent git checkout, venv or site-packages folder (default: where the "
              "`hermes` on $PATH runs from)")


# This checkout's release; pyproject.toml reads it from here.
__version__ = "2026.12.0"


def _version_line():
    return (f"hermes_state {__version__} (schema {SCHEMA_VERSION}, SQLite "
            f"{sqlite3.sqlite_version}, Python {sys.version.split()[0]})")


def build_parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=argparse.SUPPRESS, metavar="PATH",
                        help="store path (default: $HERMES_HOME/state.db, else ~/.hermes/state.db)")
    common.add_argument("--replica", default=argparse.SUPPRESS, metavar="URL",
                        help="read commands: read this Litestream replica live (s3://, file://)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print the result as JSON on stdout (list and search: --format "
                             "json; with another --format it is a usage error)")
    parser = argparse.ArgumentParser(
        prog=_M, parents=[common],
        description="The agent's session store: browse, search, export, maintain.",
        epilog=f"example:\n  {_M} demo\n  {_M} list\n\nexit status: 0 success, 1 failure, 2 usage "
               "error. Data goes to stdout, progress and diagnostics to stderr.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version_line())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     action=Subcommands, parser_class=ParserPlan)

    def command(name, help_text, more="", parents=(common,)):
        """A subcommand: `help_text` in the command list, `more` (lines) after it in its own
        --help."""
        return commands.add_parser(name, parents=list(parents), help=help_text,
                                   description=help_text + (".\n" + more if more else ""),
                                   epilog="example:\n  " + EXAMPLES[name],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)

    def paging(sub, name, what):
        sub.add_argument("-n", "--limit", type=_int_range(0, LIST_LIMIT_MAX), default=20,
                         metavar="N", help=f"at most N {what} (default 20; 0 for all)")
        sub.add_argument("--offset", type=_int_range(0, OFFSET_MAX), default=0, metavar="N",
                         help=f"skip the first N {what}")
        sub.add_argument("--format", choices=LIST_FORMATS, default="table",
                         help="table (default; fitted to the terminal's width or $COLUMNS), json, "
                              "jsonl (one object a line), csv or tsv; each time in the data "
                              "formats has <name>_utc (ISO 8601) beside it")
        sub.add_argument("--tsv", action="store_true", help="the same as --format tsv")
        sub.add_argument("-c", "--column", dest="columns", action="append", metavar="NAME",
                         help="csv, tsv, json, jsonl: only these columns, in this order "
                              "(repeatable or comma-separated; '*' for all). csv and tsv print "
                              f"these unless asked: {', '.join(CSV_COLUMNS[name])}")
        sub.add_argument("--no-headers", action="store_true",
                         help="table, csv, tsv: no header row")

    listing = command("list", "sessions, newest start first",
                      "As `hermes sessions list`: a compression chain is one row, shown by its\n"
                      "tip at its first segment's start; delegate runs and tool sessions only\n"
                      "with --all. A title in “quotes” is the first message of a session without\n"
                      "one.")
    listing.add_argument("--source", help="only sessions from this source (cli, telegram, ...)")
    paging(listing, "list", "sessions")
    listing.add_argument("--archived", action="store_true", help="include archived sessions")
    listing.add_argument("--all", action="store_true",
                         help="include delegate runs, compression continuations, tool sessions")
    show = command("show", "one session with its messages, numbered 1, 2, 3 (search's `#`)")
    show.add_argument("session_id", metavar="ID", type=_non_empty, help=SESSION_ID_HELP)
    show.add_argument("--lineage", action="store_true",
                      help="the whole compression chain as one session (headed by its totals)")
    show.add_argument("--full", action="store_true",
                      help=f"every message whole (else a text past "
                           f"{SHOWN_TEXT_CHARS} characters is cut)")
    search = command("search", "full-text search over messages (words, phrases, CJK)",
                     "Each hit names its session and `#`, the message's number in `show SESSION`.")
    search.add_argument("query", help="words, \"a phrase\", or CJK text of any length")
    search.add_argument("--source", action="append", help="only this source (repeatable)")
    search.add_argument("--role", action="append",
                        help="only this role (repeatable); 'tool' searches tool output")
    paging(search, "search", "hits")
    search.add_argument("--sort", choices=["relevance", "newest", "oldest"],
                        help="relevance (default: best match first), newest or oldest")
    search.add_argument("--include-inactive", action="store_true", help="include rewound messages")
    search.add_argument("--grammar", choices=[GRAMMAR_BOOLEAN, GRAMMAR_HERMES],
                        default=GRAMMAR_BOOLEAN,
                        help="boolean (default): terms are ANDed, with OR, NOT (or -word), "
                             "(groups), \"phrases\", prefix* and column filters (content:, "
                             "tool_name:, tool_calls:, {content tool_name}:) meaning what they say "
                             "in any script; hermes-agent: its reading (a query with a 1-2 "
                             "character CJK term matches any term)")
    command("optimize", "merge the search index segments (quick)")
    storage = command("optimize-storage",
                      "move an old search index layout to the current one, then VACUUM")
    storage.add_argument("--no-vacuum", action="store_true",
                         help="rebuild now, reclaim the space later")
    storage.add_argument("--yes", action="store_true", help="do not ask before starting")
    export = command("export", "write sessions out (jsonl, md, qmd, html, trace)")
    export.add_argument("out", metavar="OUT",
                        help="file (folder for md/qmd); '-' is stdout for jsonl and trace")
    export.add_argument("--format", choices=EXPORT_FORMATS, default="jsonl",
                        help="jsonl (default), md, qmd, html or trace")
    export.add_argument("--session-id", type=_non_empty, metavar="ID",
                        help="one session (an id or a unique prefix) instead of all")
    export.add_argument("--lineage", action="store_true",
                        help="with --session-id: its whole compression chain")
    export.add_argument("--source", help="only sessions from this source")
    export.add_argument("--redact", action="store_true",
                        help="mask secrets in every string (best effort)")
    importing = command("import", "add sessions from a jsonl export, all or nothing")
    importing.add_argument("file", metavar="FILE", help="a jsonl export; '-' reads standard input")
    delete = command("delete", "delete one session and its messages (asks first)")
    delete.add_argument("session_id", metavar="ID", type=_non_empty, help=SESSION_ID_HELP)
    delete.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    delete.add_argument("--yes", action="store_true", help=YES_HELP)
    prune = command("prune", "delete old ended sessions (asks first)")
    prune.add_argument("--older-than", type=_days, required=True, metavar="DAYS",
                       help="sessions inactive for more than DAYS days (a number >= 0)")
    prune.add_argument("--source", help="only sessions from this source")
    prune.add_argument("--dry-run", action="store_true", help="only list what would go")
    prune.add_argument("--yes", action="store_true", help=YES_HELP)
    rename = command("rename", "set a session's title (its whole compression chain keeps one)")
    rename.add_argument("session_id", metavar="ID", type=_non_empty, help=SESSION_ID_HELP)
    rename.add_argument("title", nargs="+", help="the new title (the words are joined by spaces)")
    archive = command("archive", "hide sessions from listings without deleting them")
    archive.add_argument("session_ids", metavar="ID", nargs="*", type=_non_empty,
                         help=SESSION_ID_HELP + "; or --older-than for every old ended session")
    archive.add_argument("--older-than", type=_days, metavar="DAYS",
                         help="ended sessions inactive for more than DAYS days (pinned ones stay)")
    archive.add_argument("--source", help="with --older-than: only sessions from this source")
    archive.add_argument("--yes", action="store_true", help=YES_HELP)
    for name, verb in (("unarchive", "list archived sessions again"),
                       ("pin", "pin sessions: never archived or pruned in bulk; `pinned` lists "
                               "them"),
                       ("unpin", "unpin sessions")):
        flag = command(name, verb)
        flag.add_argument("session_ids", metavar="ID", nargs="+", type=_non_empty,
                          help=SESSION_ID_HELP)
    command("pinned", "the pinned sessions")
    backup = command("backup", "zip the whole home, store included")
    backup.add_argument("out", metavar="OUT.zip", help="the archive to write")
    backup.add_argument("--force", action="store_true", help="replace an existing OUT.zip")
    restore = command("restore", "put a whole home back from a backup")
    restore.add_argument("archive", metavar="ARCHIVE", help="a zip written by backup")
    restore.add_argument("--force", action="store_true",
                         help="replace an existing store (it is kept as .bak)")
    server = command("serve", "local HTTP API and session browser (read-only unless --writable)")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1)")
    server.add_argument("--port", type=_int_range(1, 65535), default=8765,
                        help="TCP port, 1-65535 (default 8765)")
    server.add_argument("--allow-remote", action="store_true",
                        help="allow a host that is not loopback")
    server.add_argument("--writable", action="store_true",
                        help="also serve the import and restore endpoints")
    command("stats", "counts and sizes")
    doctor = command("doctor", "a verdict, then integrity, layouts, journal, runtime")
    doctor.add_argument("--full", action="store_true",
                        help="run integrity_check (every index entry against its row) instead "
                        "of quick_check; about 2.5x as long")
    command("demo", "build and show an example store in a temp home")
    for name, text in (("install", "put our state modules into a hermes-agent install, verified, "
                                   "undoable"),
                       ("uninstall", "put a hermes-agent install back as it was before install")):
        sub = command(name, text, parents=())  # a hermes-agent PATH, none of the store's options
        sub.add_argument("path", metavar="PATH", nargs="?", help=_PATH_HELP)
        sub.add_argument("--python", metavar="EXE",
                         help="the python that runs hermes-agent (default: its venv's)")
        if name == "install":
            sub.add_argument("--check", action="store_true",
                             help="say what install would do and whether the host is supported; "
                                  "change nothing")
    return parser


_COMMANDS = {
    "list": _cmd_list, "show": _cmd_show, "search": _cmd_search, "optimize": _cmd_optimize,
    "optimize-storage": _cmd_optimize_storage, "stats": _cmd_stats, "doctor": _cmd_doctor,
    "export": _cmd_export, "import": _cmd_import, "delete": _cmd_delete, "prune": _cmd_prune,
    "backup": _cmd_backup, "rename": _cmd_rename, "archive": _cmd_archive,
    "unarchive": partial(_cmd_flag, column="archived", value=False),
    "pin": partial(_cmd_flag, column="pinned", value=True),
    "unpin": partial(_cmd_flag, column="pinned", value=False), "pinned": _cmd_pinned,
}


# The commands that only read: they, and only they, run on a replica (writes stay on the primary).
REPLICA_COMMANDS = ("list", "show", "search", "stats", "export", "serve", "pinned")


def _check_listing_options(parser, args):
    """One format for list and search: --json and --tsv name one each (beside another --format,
    a usage error), and -c and --no-headers only where they mean something."""
    for flag, name in (("json", "JSON"), ("tsv", "tsv")):
        if getattr(args, flag) and args.format not in ("table", flag):
            parser.error(f"--{flag} prints {name} and --format {args.format} prints "
                         f"{args.format}: give one of them")
        if getattr(args, flag):
            if args.json and args.tsv:
                parser.error("--json prints JSON and --tsv prints tsv: give one of them")
            args.format = flag
    if args.columns and args.format == "table":
        parser.error("-c/--column chooses the columns of csv, tsv, json and jsonl, not of the "
                     "table")
    if args.no_headers and args.format in ("json", "jsonl"):
        parser.error(f"--no-headers goes with table, csv and tsv; {args.format} has no header row")


def main(argv=None, out=None):
    """Entry point of `python -m hermes_state`; returns the exit status."""
    out = out or sys.stdout
    parser = build_parser()
    args = parser.parse_args(argv)
    args.json = getattr(args, "json", False)
    if args.command in ("list", "search"):
        _check_listing_options(parser, args)
    if getattr(args, "lineage", False) and args.command == "export" and not args.session_id:
        parser.error("export --lineage needs --session-id")
    if getattr(args, "replica", None) is not None and (args.command not in REPLICA_COMMANDS
                                                       or getattr(args, "db", None) is not None):
        parser.error(f"--replica goes with {', '.join(REPLICA_COMMANDS)} only, without --db; "
                     f"{args.command} runs on the primary")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    if not args.json and getattr(args, "format", "table") == "table" and args.command != "export":
        out = PrintableStream(out)
    try:
        return _run(args, out)
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly, and keep Python from
        # complaining about the unflushed stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        end_progress()
        sys.stderr.write("\ninterrupted\n")
        return 1
    except (CommandError, ValueError, OSError, RuntimeError, sqlite3.Error) as exc:
        end_progress()
        text = os_error_text(exc) if type(exc) is not CommandError and isinstance(exc, OSError) \
            else str(exc)
        sys.stderr.write(f"error: {printable(text)}\n")
        for line in getattr(exc, "details", ()):
            sys.stderr.write(printable(line) + "\n")
        return 1


def _run(args, out):
    """The command, on a store opened the way it needs (read-only for a read)."""
    if args.command == "demo":
        return _cmd_demo(args, out)
    if args.command in INSTALL_COMMANDS:
        from hermes_state_install import run_install_command
        return run_install_command(args, out)
    if args.command == "restore":
        return _cmd_restore(args, out)
    if args.command == "serve":
        return _cmd_serve(args, out)
    path = store_path(args)
    if getattr(args, "replica", None) is not None:
        db = SessionDB.open_replica(args.replica)
    elif args.command in READ_COMMANDS:
        if args.command in ("stats", "doctor"):
            check_store(path)
            args.header_journal = journal_in_header(path)
        db = open_read_only(path, damaged_ok=args.command == "doctor")
    else:
        check_store(path, may_create=args.command == "import")
        if args.command == "import":
            args.sessions, args.progress = _read_import(args)
        before = _stale_version(path)
        # the file as stats saw it, before the open's upgrade grows it (optimize-storage's "from")
        args.bytes_before = store_file_bytes(path) if os.path.exists(path) else 0
        db = SessionDB(path)
        after = db.schema_version() if before is not None else None
        if after not in (None, before):
            args.schema_upgraded = (before, after)
            sys.stderr.write(f"{args.command}: upgraded the schema of {path} from version "
                             f"{before} to {after}, as the agent's next open "
                             "would\n")
    with db:
        return _COMMANDS[args.command](db, args, out)


def _stale_version(path):
    """The schema version of an existing store a writable open will upgrade; None for a
    current one, a missing one, or one that cannot be read (the open says why)."""
    if not os.path.exists(path):
        return None
    try:
        with SessionDB(path, read_only=True) as peek:
            return schema_behind(peek)
    except (OSError, sqlite3.Error):
        return None
