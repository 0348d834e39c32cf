"""One process of `make test-faults`: drives this checkout's SessionDB on a faulty mount.

Owns nothing on disk but what it is told to write. Modes:
  agent DB SOCK JOURNAL SYNC
                      agent-like work in journal JOURNAL ('wal', 'delete'; 'default': the
                      product's choice) at PRAGMA synchronous=SYNC ('default': SessionDB's own);
                      after each call returns, its acknowledgement (what must now survive)
                      goes to faultfs's control socket, outside the mount
  check DB ACKS K     a fresh process after a cut at boundary K: opens, both integrity checks,
                      every acknowledged commit present; prints one JSON line
  checks DB ACKS SOCK K,K,...
                      for each K: faultfs restores the cut at K, then a child forked from this
                      process (which has imported SessionDB but opened nothing) runs `check`
  rofs DB SOCK        the filesystem goes read-only under an open writer
  journal DB          a new store's journal mode through SessionDB, and DB's sibling `plain.db`'s
                      through apply_wal_with_fallback (hermes-agent's other databases), with
                      what each logged; one JSON line
  op NAME DB ARG      one operation; prints "OK" or the error's lines; exit 0 / 1
  doctor DB           the command line's doctor on DB; its output and exit code
"""

import contextlib
import io
import json
import logging
import os
import socket
import sqlite3
import sys
import traceback
from pathlib import Path

import hermes_state
from hermes_state import SessionDB


def control(sock_path):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sock_path)
    stream = conn.makefile("rw")

    def ask(*cmd):
        stream.write(json.dumps(cmd) + "\n")
        stream.flush()
        return json.loads(stream.readline())
    return ask


def open_store(db_path, journal, sync):
    db = SessionDB(db_path, journal=None if journal == "default" else journal)
    if sync != "default":
        # SessionDB sets its level on its writer (hermes_state_wal.writer_synchronous); the
        # level under test replaces it on the same connection, the one every write goes through.
        db._writer.execute(f"PRAGMA synchronous={sync}")
    return db


def agent(db_path, sock_path, journal, sync, turns=200):
    ask = control(sock_path)
    db = open_store(db_path, journal, sync)
    level = db._writer.execute("PRAGMA synchronous").fetchone()[0]
    mode = db._writer.execute("PRAGMA journal_mode").fetchone()[0]
    ask("ack", ["level", {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}.get(level, level), mode])

    def ack(spec):
        ask("ack", spec)

    db.create_session("main", "cli")
    ack(["session", "main"])
    titles = 0
    for turn in range(turns):
        text = f"turn {turn} user asks about fault {turn * 7 % 13}"
        db.append_message("main", "user", text)
        ack(["msg", "main", text])
        text = f"turn {turn} assistant answers with detail " + "x" * (turn % 50)
        db.append_message("main", "assistant", text)
        ack(["msg", "main", text])
        if turn % 3 == 0:
            batch = [{"role": "tool", "content": f"turn {turn} tool result {i}",
                      "tool_call_id": f"c{turn}-{i}"} for i in range(3)]
            db.append_messages_batch("main", batch)
            ack(["batch", "main", [m["content"] for m in batch]])
        if turn % 40 == 5:
            titles += 1
            title = f"Fault study {titles}"
            db.set_session_title("main", title)
            ack(["title", "main", title])
        if turn % 50 == 10:
            sid = f"scratch-{turn}"
            db.create_session(sid, "cli")
            db.append_message(sid, "user", f"scratch {turn}")
            ack(["session", sid])
            db.delete_session(sid)
            ack(["gone", sid])
        if turn % 60 == 15:
            exported = db.export_session("main")
            exported = dict(exported, id=f"imported-{turn}", title=None)
            result = db.import_sessions([exported])
            ack(["import", f"imported-{turn}"] if result.get("ok", True) else ["none"])
        if turn == 100:
            db.optimize_fts_storage()
            ack(["none"])
    db.close()
    ack(["closed"])


def check(db_path, acks_path, k):
    acks = json.loads(Path(acks_path).read_text())
    out = {"k": k, "opened": False, "ro_error": None, "integrity": None, "fts": None,
           "lost": [], "error": None}
    try:
        ro = SessionDB(db_path, read_only=True)
        ro.get_session("main")
        ro.close()
    except Exception as exc:  # noqa: BLE001 (its text is the figure)
        out["ro_error"] = f"{type(exc).__name__}: {exc}"
    try:
        db = SessionDB(db_path)
        out["opened"] = True
        db.close()
        conn = sqlite3.connect(db_path)
        out["integrity"] = conn.execute("PRAGMA integrity_check").fetchone()[0]
        fts = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND sql LIKE '%USING fts5%'")]
        bad = []
        for name in fts:
            try:
                conn.execute(f"INSERT INTO \"{name}\"(\"{name}\") VALUES ('integrity-check')")
            except sqlite3.Error as exc:
                bad.append(f"{name}: {exc}")
        out["fts"] = bad or "ok"
        titles_after = {}
        for spec, _ in acks:
            if spec[0] == "title":
                for prior in titles_after.values():
                    prior.add(spec[2])
                titles_after[spec[2]] = {spec[2]}
        for spec, at in acks:
            if at > k:
                break
            kind = spec[0]
            if kind == "msg" or kind == "batch":
                texts = [spec[2]] if kind == "msg" else spec[2]
                missing = [t for t in texts if not conn.execute(
                    "SELECT 1 FROM messages WHERE session_id = ? AND content = ?",
                    (spec[1], t)).fetchone()]
                if missing:  # one lost call, however many of its rows
                    out["lost"].append(f"{kind} {missing[0][:30]}")
            elif kind in ("session", "import"):
                if not conn.execute("SELECT 1 FROM sessions WHERE id = ?", (spec[1],)).fetchone():
                    if not any(s[0] == "gone" and s[1] == spec[1] for s, _ in acks):
                        out["lost"].append(f"{kind} {spec[1]}")
            elif kind == "gone":
                if conn.execute("SELECT 1 FROM sessions WHERE id = ?", (spec[1],)).fetchone():
                    out["lost"].append(f"delete {spec[1]}")
            elif kind == "title":
                row = conn.execute("SELECT title FROM sessions WHERE id = ?",
                                   (spec[1],)).fetchone()
                if not row or row[0] not in titles_after[spec[2]]:
                    out["lost"].append(f"title {spec[2]}")
        conn.close()
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)


def checks(db_path, acks_path, sock_path, cuts):
    """`check` after each cut in `cuts`, each in a child forked after faultfs restored it."""
    ask = control(sock_path)
    for k in cuts:
        answer = ask("restore", k)
        if answer is not True:
            raise SystemExit(f"faultfs could not restore boundary {k}: {answer}")
        child = os.fork()
        if child == 0:
            try:
                check(db_path, acks_path, k)
            finally:
                os._exit(0)
        os.waitpid(child, 0)


def operation(name, db_path, arg):
    """One call of the product on a store made by `make_store`; `arg` is an output path."""
    if name == "restore":
        hermes_state.restore_home(arg, db_path, force=True)
        return
    db = SessionDB(db_path)
    try:
        if name == "append":
            db.append_message("main", "user", "one more line " * 200)
        elif name == "batch":
            db.append_messages_batch("main", [{"role": "tool", "content": "r" * 3000,
                                               "tool_call_id": f"b{i}"} for i in range(40)])
        elif name == "import":
            exported = db.export_session("main")
            result = db.import_sessions([dict(exported, id="imported-op", title=None)])
            if not result.get("ok", True):
                raise RuntimeError(f"import refused: {result.get('errors')}")
        elif name == "export":
            db.close()  # the command line's export writes the file: it owns a half-written one
            from hermes_state_cli import main as cli
            said = io.StringIO()  # its progress lines are no error: the error is its last line
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                code = cli(["export", "--db", db_path, arg])
            if code:
                raise RuntimeError(f"export exited {code}: {said.getvalue().splitlines()[-1]}")
        elif name == "backup":
            db.backup(arg)
        elif name == "optimize":
            # hermes-agent's contract: a refusal is a result, and a failed VACUUM after the work
            # only a warning in the log; either is this call's error.
            logged = []
            handler = logging.Handler(logging.WARNING)
            handler.emit = lambda record: logged.append(record.getMessage())
            logging.getLogger("hermes_state").addHandler(handler)
            try:
                result = db.optimize_fts_storage()
            finally:
                logging.getLogger("hermes_state").removeHandler(handler)
            if not result.get("ok"):
                raise RuntimeError(f"optimize-storage refused ({result.get('reason')}): "
                                   f"{result.get('detail')}")
            if result.get("vacuumed") is False:
                raise RuntimeError("optimize-storage finished but its VACUUM failed: "
                                   + " ".join(line for line in logged if "VACUUM" in line))
        elif name == "vacuum":
            db.vacuum()
        elif name == "checkpoint":
            db.append_message("main", "user", "before the checkpoint " * 100)
            busy, _, _ = db._writer.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if busy:
                raise RuntimeError("checkpoint could not finish")
        elif name == "read":
            if len(db.get_messages("main")) < 1:
                raise RuntimeError("the transcript read back empty")
        elif name == "make":
            db.create_session("main", "cli")
            db.set_session_title("main", "A store to break")
            for i in range(int(arg)):
                db.append_message("main", "user" if i % 2 else "assistant",
                                  f"line {i} of the transcript " + "y" * 400)
        else:
            raise SystemExit(f"unknown operation {name}")
    finally:
        db.close()


def read_only_under_writer(db_path, sock_path):
    """The filesystem turns read-only while this writer has the store open: a write must fail
    saying read-only, a read must go on. Prints one JSON line."""
    ask = control(sock_path)
    db = SessionDB(db_path)
    db.append_message("main", "user", "written before the filesystem went read-only")
    ask("rofs", True)
    out = {"write_error": None, "read_ok": False}
    try:
        db.append_message("main", "user", "written after " * 300)
    except Exception as exc:  # noqa: BLE001
        out["write_error"] = f"{type(exc).__name__}: {exc}"
    try:
        out["read_ok"] = len(db.get_messages("main")) > 0
    except Exception as exc:  # noqa: BLE001
        out["read_error"] = f"{type(exc).__name__}: {exc}"
    ask("rofs", False)
    db.close()
    print(json.dumps(out))


def journal(db_path):
    from hermes_state_wal import apply_wal_with_fallback
    out = {"sqlite": sqlite3.sqlite_version}
    for who in ("store", "plain"):
        seen = []
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())
        logging.getLogger("hermes_state").addHandler(handler)
        try:
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
            if who == "store":
                with SessionDB(db_path) as db:
                    out[who] = db._writer.execute("PRAGMA journal_mode").fetchone()[0]
            else:
                with contextlib.closing(sqlite3.connect(str(Path(db_path).parent / "plain.db"))) \
                        as conn:
                    out[who] = apply_wal_with_fallback(conn, db_label="plain.db")
        except Exception as exc:  # noqa: BLE001 (the runner shows it)
            out["error"] = f"{who}: {type(exc).__name__}: {exc}"
        finally:
            logging.getLogger("hermes_state").removeHandler(handler)
        out[f"{who}_logs"] = seen
    print(json.dumps(out))


def main():
    mode = sys.argv[1]
    if mode == "journal":
        journal(sys.argv[2])
        return
    if mode == "doctor":
        from hermes_state_cli import main as cli
        sys.exit(cli(["doctor", "--db", sys.argv[2]]))
    if mode == "rofs":
        read_only_under_writer(sys.argv[2], sys.argv[3])
        return
    if mode == "agent":
        agent(*sys.argv[2:6])
    elif mode == "check":
        check(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif mode == "checks":
        checks(sys.argv[2], sys.argv[3], sys.argv[4], [int(k) for k in sys.argv[5].split(",")])
    elif mode == "op":
        try:
            operation(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "")
        except Exception as exc:  # noqa: BLE001 (the runner judges the text)
            text = f"{type(exc).__name__}: {exc}"
            print(text)
            if "--trace" in sys.argv:
                traceback.print_exc(file=sys.stdout)
            sys.exit(1)
        print("OK")


if __name__ == "__main__":
    main()
