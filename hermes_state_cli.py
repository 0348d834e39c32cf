"""`python -m hermes_state`: the command line over SessionDB.

Owns argument parsing, what each subcommand prints (data on stdout,
progress and diagnostics on stderr) and exit codes (0 success, 1 failure,
2 usage). It holds no store logic: every command is a few SessionDB calls.
"""

import argparse
import json
import logging
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from hermes_constants import reset_hermes_home_override, set_hermes_home_override
from hermes_state import SessionDB, restore_home
from hermes_state_common import COMPRESSION_END_REASON, LIST_LIMIT_MAX, require_int, store_file_bytes
from hermes_state_portability import EXPORT_FORMATS, json_default, message_text, write_export


def _print_json(value, out):
    json.dump(value, out, ensure_ascii=False, indent=2, default=json_default)
    out.write("\n")


def _emit(args, out, value, print_text):
    """`value` as JSON with --json, else as text through `print_text(value, out)`."""
    if args.json:
        _print_json(value, out)
    else:
        print_text(value, out)


def _print_fields(width):
    def print_fields(mapping, out):
        for key, value in mapping.items():
            out.write(f"{key:>{width}}: {value}\n")
    return print_fields


def _format_time(ts):
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"


def _print_session_list(sessions, out):
    for s in sessions:
        title = s.get("title") or (s.get("preview") or "").replace("\n", " ")
        out.write(f"{s['id']:<24} {s['source']:<10} {_format_time(s.get('last_active')):<17} "
                  f"{s.get('message_count') or 0:>5} msgs  {title[:60]}\n")


def _print_session(export, out):
    fields = ("id", "source", "model", "title", "parent_session_id", "end_reason", "message_count",
              "tool_call_count", "input_tokens", "output_tokens")
    for key in fields:
        out.write(f"{key:>18}: {export.get(key)}\n")
    if export.get("lineage_session_ids"):
        out.write(f"{'lineage':>18}: {' -> '.join(export['lineage_session_ids'])}\n")
    for message in export["messages"]:
        label = message["role"] + (f" ({message['tool_name']})" if message.get("tool_name") else "")
        out.write(f"\n[{message['id']}] {label} at {_format_time(message['timestamp'])}\n")
        if message.get("content"):
            text = message_text(message)
            out.write((text if len(text) <= 400 else text[:400] + f" ... ({len(text)} chars)") + "\n")
        for call in message.get("tool_calls") or []:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            out.write(f"  -> {function.get('name', '?')}({function.get('arguments', '')})\n")


def _cmd_list(db, args, out):
    require_int("limit", args.limit, minimum=1, maximum=LIST_LIMIT_MAX)
    require_int("offset", args.offset)
    sessions = db.list_sessions_rich(source=args.source, limit=args.limit, offset=args.offset,
                                     include_archived=args.archived, include_children=True)
    _emit(args, out, sessions, _print_session_list)
    return 0


def _cmd_show(db, args, out):
    session_id = db.resolve_session_id(args.session_id)
    if session_id is None:
        sys.stderr.write(f"error: no session matches {args.session_id!r} (unknown or ambiguous)\n")
        return 1
    export = db.export_session_lineage(session_id) if args.lineage else db.export_session(session_id)
    _emit(args, out, export, _print_session)
    return 0


def _cmd_stats(db, args, out):
    _emit(args, out, db.stats(), _print_fields(20))
    return 0


def _cmd_doctor(args, out):
    """The report of a writable open; if the file is too damaged to open that way,
    the report of a read-only look (no repair, no DDL) with the open's error."""
    db_path = getattr(args, "db", None)
    try:
        with SessionDB(db_path) as db:
            report = db.doctor()
    except sqlite3.DatabaseError as exc:
        with SessionDB(db_path, read_only=True) as db:
            report = {"open_error": str(exc), **db.doctor(), "ok": False}
    _emit(args, out, report, _print_fields(26))
    return 0 if report["ok"] else 1


def _print_hits(hits, out):
    for hit in hits:
        out.write(f"{hit['session_id']}  [{hit['id']}] {hit['role']} at {_format_time(hit['timestamp'])}\n"
                  f"    {hit['snippet'].replace(chr(10), ' ')}\n")


def _cmd_search(db, args, out):
    require_int("limit", args.limit, minimum=1, maximum=LIST_LIMIT_MAX)
    require_int("offset", args.offset)
    hits = db.search_messages(args.query, source_filter=args.source, role_filter=args.role,
                              limit=args.limit, offset=args.offset, sort=args.sort,
                              include_inactive=args.include_inactive)
    _emit(args, out, hits, _print_hits)
    return 0


def _cmd_optimize(db, args, out):
    db.optimize_fts()
    out.write(f"merged the search index segments of {db.db_path}\n")
    return 0


def _report_progress(progress):
    percent = progress["percent"]
    done = f" {percent:3d}%" if percent is not None else ""
    counts = f" ({progress['indexed']}/{progress['total']})" if progress["total"] else ""
    sys.stderr.write(f"optimize-storage: {progress['phase']}{done}{counts}\n")
    if progress["phase"] == "vacuum":  # the one step that is not short: said before it starts
        sys.stderr.write("optimize-storage: VACUUM rewrites the whole file and holds the write lock until it "
                         "ends; other processes' writes wait (--no-vacuum skips it)\n")


def _cmd_optimize_storage(db, args, out):
    if not args.yes:
        prompt = (f"Rebuild the search index of {db.db_path} in the current layout"
                  f"{'' if args.no_vacuum else ' and VACUUM it (holding the write lock throughout)'}? [y/N] ")
        if not sys.stdin or not sys.stdin.isatty():
            sys.stderr.write("error: optimize-storage asks before it starts; pass --yes to run it unattended\n")
            return 1
        if input(prompt).strip().lower() not in ("y", "yes"):
            sys.stderr.write("nothing was changed\n")
            return 1
    before = store_file_bytes(db.db_path)
    try:
        result = db.optimize_fts_storage(progress_cb=_report_progress, vacuum=not args.no_vacuum)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted; the store is consistent, run optimize-storage again to resume\n")
        return 1
    if not result["ok"]:
        sys.stderr.write(f"error: optimize-storage refused: {result.get('detail') or result['reason']}\n")
        return 1
    if args.json:
        _print_json(result, out)
    else:
        out.write(f"{db.db_path}: {before / 1e6:.1f} MB -> {store_file_bytes(db.db_path) / 1e6:.1f} MB, "
                  f"layout {db.fts_layout()}\n")
    return 0


def _cmd_export(db, args, out):
    if args.session_id:
        session_id = db.resolve_session_id(args.session_id)
        export = None if session_id is None else (
            db.export_session_lineage(session_id) if args.lineage else db.export_session(session_id))
        if export is None:
            sys.stderr.write(f"error: no session matches {args.session_id!r} (unknown or ambiguous)\n")
            return 1
        exports = [export]
    elif args.format == "jsonl" and not args.redact:  # a run of messages in memory at a time (issue 17)
        exports = db.iter_export_jsonl(source=args.source)
    else:
        exports = db.iter_export_all(source=args.source)
    count = write_export(exports, args.format, args.out, redact_secrets=args.redact)
    sys.stderr.write(f"exported {count} sessions as {args.format} to {args.out}"
                     f"{' (redacted, best effort)' if args.redact else ''}\n")
    return 0


def _read_jsonl(path):
    """The file's sessions, one JSON value a line; ValueError names a line that cannot be read."""
    sessions = []
    with open(path, "rb") as handle:  # decoded a line at a time, so a bad byte is named by its line too
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
                if line.strip():
                    sessions.append(json.loads(line))
            except RecursionError:
                raise ValueError(f"{path}:{number}: JSON nested too deep to read") from None
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{number}: not UTF-8 ({exc.reason} at byte {exc.start + 1})") from None
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
    return sessions


def _cmd_import(db, args, out):
    sessions = _read_jsonl(args.file)
    # The whole file is one import_sessions call, so one transaction: all of it or nothing.
    # Each session keeps its limits; the totals of one API call do not apply to a file.
    limits = dict(db.import_limits(), sessions=len(sessions), total_messages=float("inf"),
                  total_bytes=float("inf"))
    sys.stderr.write(f"import: {len(sessions)} sessions in one transaction (all or nothing); the write lock "
                     "is held until it ends, other processes' writes wait\n")
    try:
        result = db.import_sessions(sessions, limits=limits, one_transaction=True)
    except sqlite3.Error as exc:
        sys.stderr.write(f"error: {exc}\nthe import was rolled back; nothing was written\n")
        return 1
    if not result["ok"]:
        for error in result["errors"]:
            who = f" ({error['session_id']})" if "session_id" in error else ""
            sys.stderr.write(f"error: session {error['index']}{who}: {error['error']}\n")
        sys.stderr.write("the import was rejected; nothing was written\n")
        return 1
    totals = {key: result[key] for key in ("imported", "skipped", "detached")}
    if result.get("unstored_fields"):
        sys.stderr.write("warning: this store has no column for " + ", ".join(result["unstored_fields"])
                         + "; those values were not imported\n")
    if args.json:
        _print_json(totals, out)
    else:
        out.write(f"imported {totals['imported']}, skipped {totals['skipped']}, detached {totals['detached']}\n")
    return 0


def _cmd_delete(db, args, out):
    session_id = db.resolve_session_id(args.session_id)
    if session_id is None or not db.delete_session(session_id):
        sys.stderr.write(f"error: no session matches {args.session_id!r} (unknown or ambiguous)\n")
        return 1
    out.write(f"deleted {session_id}\n")
    return 0


def _cmd_prune(db, args, out):
    ids = [row["id"] for row in db.list_prune_candidates(args.older_than, source=args.source)]
    if not args.dry_run:
        db.prune_sessions(args.older_than, source=args.source)
    if args.json:
        _print_json({"dry_run": args.dry_run, "sessions": ids}, out)
    else:
        verb = "would delete" if args.dry_run else "deleted"
        out.write(f"{verb} {len(ids)} ended sessions inactive for more than {args.older_than:g} days\n")
        for session_id in ids:
            out.write(f"  {session_id}\n")
    return 0


def _cmd_backup(db, args, out):
    result = db.backup(args.out)
    out.write(f"backed up {len(result['files'])} files of {db.db_path.parent} to {result['archive']}\n")
    return 0


def _cmd_restore(args, out):
    result = restore_home(args.archive, getattr(args, "db", None), force=args.force)
    for kept in result["moved_aside"]:
        sys.stderr.write(f"kept the replaced file as {kept}\n")
    out.write(f"restored {len(result['restored'])} files into {Path(result['db_path']).parent}\n")
    return 0


def _cmd_serve(args, out):
    from hermes_state_server import serve

    token = os.environ.get("HERMES_STATE_TOKEN", "").strip() or None
    try:
        replica = _open_store(args) if getattr(args, "replica", None) is not None else None
        return serve(getattr(args, "db", None), args.host, args.port, allow_remote=args.allow_remote,
                     token=token, out=out, db=replica)
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2


def _cmd_demo(args, out):
    home = Path(tempfile.mkdtemp(prefix="hermes-demo-"))
    token = set_hermes_home_override(home)
    try:
        with SessionDB() as db:
            build_demo_history(db)
            out.write("== sessions (python -m hermes_state list)\n")
            _print_session_list(db.list_sessions_rich(limit=20, include_children=True), out)
            tip = db.get_compression_tip("demo-refactor-1")
            out.write(f"\n== the compression chain ending in {tip}, shown as one session\n")
            _print_session(db.export_session_lineage(tip), out)
            out.write("\n== one conversation in Chinese\n")
            _print_session(db.export_session("demo-zh"), out)
            for query in ("my-app.config.ts", "迁移", "会话历史"):
                out.write(f"\n== search {query!r} (python -m hermes_state search ...)\n")
                _print_hits(db.search_messages(query), out)
            out.write(f"\nstore: {db.db_path}\n"
                      f"try:   python3 -m hermes_state --db {db.db_path} list\n")
    finally:
        reset_hermes_home_override(token)
    return 0


def build_demo_history(db):
    """A small agent history: English and Chinese, tool calls, a compression chain."""
    prompt = "You are a helpful coding agent. 你是一个编程助手。"
    db.create_session("demo-refactor-1", "cli", model="demo-model", system_prompt=prompt,
                      cwd="/home/demo/app")
    db.set_session_title("demo-refactor-1", "Refactor the config loader")
    call = [{"id": "call_1", "type": "function",
             "function": {"name": "terminal", "arguments": json.dumps({"command": "pytest -q"})}}]
    db.append_message("demo-refactor-1", "user", "Please refactor my-app.config.ts and run the tests.")
    db.append_message("demo-refactor-1", "assistant", "Running the test suite first.", tool_calls=call)
    db.append_message("demo-refactor-1", "tool", "12 passed in 0.41s", tool_name="terminal",
                      tool_call_id="call_1")
    db.update_token_counts("demo-refactor-1", input_tokens=812, output_tokens=64, model="demo-model")
    db.end_session("demo-refactor-1", COMPRESSION_END_REASON)
    db.create_session("demo-refactor-2", "cli", model="demo-model", system_prompt=prompt,
                      parent_session_id="demo-refactor-1")
    db.append_message("demo-refactor-2", "user", "[summary] Tests pass; now split the loader.")
    db.append_message("demo-refactor-2", "assistant", "Split into load() and validate().")
    db.create_session("demo-zh", "telegram", model="demo-model", system_prompt=prompt)
    db.set_session_title("demo-zh", "数据库迁移")
    db.append_message("demo-zh", "user", "帮我检查一下数据库迁移脚本，会话历史不能丢。")
    db.append_message("demo-zh", "assistant", "好的，我先备份 state.db，再运行迁移。")
    db.end_session("demo-zh", "user_exit")


def build_parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=argparse.SUPPRESS, help="store path (default: <home>/state.db)")
    common.add_argument("--replica", default=argparse.SUPPRESS, metavar="URL",
                        help="read commands: read this Litestream replica live (s3://, file://)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print data as JSON")
    parser = argparse.ArgumentParser(prog="python -m hermes_state", parents=[common],
                                     description="The agent's session store.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    listing = commands.add_parser("list", parents=[common], help="sessions, newest first")
    listing.add_argument("--source")
    listing.add_argument("--limit", type=int, default=20)
    listing.add_argument("--offset", type=int, default=0)
    listing.add_argument("--archived", action="store_true", help="include archived sessions")
    show = commands.add_parser("show", parents=[common], help="one session with its messages")
    show.add_argument("session_id", metavar="ID", help="a session id or a unique prefix of one")
    show.add_argument("--lineage", action="store_true", help="the whole compression chain as one session")
    search = commands.add_parser("search", parents=[common], help="full-text search over messages")
    search.add_argument("query")
    search.add_argument("--source", action="append", help="only this source (repeatable)")
    search.add_argument("--role", action="append", help="only this role (repeatable); 'tool' searches tool output")
    search.add_argument("--limit", type=int, default=20)
    search.add_argument("--offset", type=int, default=0)
    search.add_argument("--sort", choices=["relevance", "newest", "oldest"])
    search.add_argument("--include-inactive", action="store_true", help="include rewound messages")
    commands.add_parser("optimize", parents=[common], help="merge the search index segments")
    storage = commands.add_parser("optimize-storage", parents=[common],
                                  help="move an old search index layout to the current one, then VACUUM")
    storage.add_argument("--no-vacuum", action="store_true", help="rebuild now, reclaim the space later")
    storage.add_argument("--yes", action="store_true", help="do not ask before starting")
    export = commands.add_parser("export", parents=[common], help="write sessions out (jsonl, md, qmd, html, trace)")
    export.add_argument("out", metavar="OUT", help="file (folder for md/qmd); '-' is stdout for jsonl and trace")
    export.add_argument("--format", choices=EXPORT_FORMATS, default="jsonl")
    export.add_argument("--session-id", help="one session (an id or a unique prefix) instead of all")
    export.add_argument("--lineage", action="store_true", help="with --session-id: its whole compression chain")
    export.add_argument("--source", help="only sessions from this source")
    export.add_argument("--redact", action="store_true", help="mask secrets in every string (best effort)")
    importing = commands.add_parser("import", parents=[common], help="add sessions from a jsonl export")
    importing.add_argument("file", metavar="FILE")
    delete = commands.add_parser("delete", parents=[common], help="delete one session and its messages")
    delete.add_argument("session_id", metavar="ID")
    prune = commands.add_parser("prune", parents=[common], help="delete old ended sessions")
    prune.add_argument("--older-than", type=float, required=True, metavar="DAYS")
    prune.add_argument("--source")
    prune.add_argument("--dry-run", action="store_true", help="only list what would go")
    backup = commands.add_parser("backup", parents=[common], help="zip the whole home, store included")
    backup.add_argument("out", metavar="OUT.zip")
    restore = commands.add_parser("restore", parents=[common], help="put a whole home back from a backup")
    restore.add_argument("archive", metavar="ARCHIVE")
    restore.add_argument("--force", action="store_true", help="replace an existing store (it is kept as .bak)")
    server = commands.add_parser("serve", parents=[common], help="local HTTP API and session browser")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8765)
    server.add_argument("--allow-remote", action="store_true", help="allow a host that is not loopback")
    commands.add_parser("stats", parents=[common], help="counts and sizes")
    commands.add_parser("doctor", parents=[common], help="integrity, layouts, journal, runtime")
    commands.add_parser("demo", parents=[common], help="build and show an example store in a temp home")
    return parser


_COMMANDS = {"list": _cmd_list, "show": _cmd_show, "search": _cmd_search, "optimize": _cmd_optimize,
             "optimize-storage": _cmd_optimize_storage, "stats": _cmd_stats,
             "export": _cmd_export, "import": _cmd_import, "delete": _cmd_delete, "prune": _cmd_prune,
             "backup": _cmd_backup}


# The commands that only read: they, and only they, run on a replica (writes stay on the primary).
REPLICA_COMMANDS = ("list", "show", "search", "stats", "export", "serve")


def _open_store(args):
    """The store a command runs on: the local one (--db, else the home's), or with --replica URL a
    read-only one over that Litestream replica (SessionDB.open_replica)."""
    if getattr(args, "replica", None) is not None:
        return SessionDB.open_replica(args.replica)
    return SessionDB(getattr(args, "db", None))


def main(argv=None, out=None):
    """Entry point of `python -m hermes_state`; returns the exit status."""
    out = out or sys.stdout
    parser = build_parser()
    args = parser.parse_args(argv)
    args.json = getattr(args, "json", False)
    if getattr(args, "lineage", False) and args.command == "export" and not args.session_id:
        parser.error("export --lineage needs --session-id")
    if getattr(args, "replica", None) is not None and (args.command not in REPLICA_COMMANDS
                                                       or getattr(args, "db", None) is not None):
        parser.error(f"--replica goes with {', '.join(REPLICA_COMMANDS)} only, without --db; "
                     f"{args.command} runs on the primary")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        if args.command == "demo":
            return _cmd_demo(args, out)
        if args.command == "doctor":
            return _cmd_doctor(args, out)
        if args.command == "restore":
            return _cmd_restore(args, out)
        if args.command == "serve":
            return _cmd_serve(args, out)
        with _open_store(args) as db:
            return _COMMANDS[args.command](db, args, out)
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly, and keep Python from
        # complaining about the unflushed stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, OSError, RuntimeError, sqlite3.Error) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
