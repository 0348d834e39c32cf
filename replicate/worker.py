"""A writer process for `make replicate-test`: appends to a store through this checkout's SessionDB.

Owns: the shape of what the scenarios write (one session per worker plus a shared one, numbered
messages, a tool call every third one, token counts; the live writer's words, CJK and tool rows)
and the append-rate measure. Must not touch: any
store but the one it is given; it never checkpoints, never opens the store except through SessionDB.

Usage:
  worker.py append DB WORKER SECONDS   append for SECONDS; prints "ready" once the sessions exist,
                                       then "appended N" at the end (a SIGKILL may stop it anywhere)
  worker.py rate DB COUNT              append COUNT one-message transactions; prints "rate R" (msg/s)
  worker.py live DB SECONDS            append one message a transaction at a human pace (words, CJK,
                                       tool rows; a new session every 40), printing "commit N T"
                                       after each (N messages in the store, T time.monotonic())
The checkpoint mode comes from HERMES_STATE_CHECKPOINT, as in any process of the agent.
"""

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hermes_state import SessionDB  # noqa: E402  (the checkout's, not an installed one)

CALL = [{"id": "c", "type": "function", "function": {"name": "terminal", "arguments": "{\"command\": \"ls\"}"}}]
CJK = ("数据库迁移脚本", "会话历史", "迁移", "备份")  # 1-2 and 3+ characters, for each CJK index
WORDS = ("replica", "harbour", "lantern", "meridian", "quartz", "saffron", "tundra", "vellum")


def message_text(worker, seq):
    """The content of message `seq` of `worker`: unique, searchable, a few hundred bytes."""
    word = WORDS[seq % len(WORDS)]
    return f"w{worker} seq {seq} {word} " + f"notes about {word} and step {seq} of the plan. " * 6


def append(path, worker, seconds):
    """Append numbered messages to this worker's session and the shared one until `seconds` pass."""
    with SessionDB(path) as db:
        db.create_session(f"own{worker}", "cli", model="m")
        db.create_session("shared", "cli", model="m")
        print("ready", flush=True)
        deadline, seq = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            calls = CALL if seq % 3 == 0 else None
            db.append_message(f"own{worker}", "assistant", message_text(worker, seq), tool_calls=calls)
            db.append_message("shared", "user", message_text(worker, seq))
            db.update_token_counts(f"own{worker}", input_tokens=10, output_tokens=2, model="m")
            seq += 1
        print(f"appended {seq}", flush=True)


def rate(path, count):
    """Messages a second for `count` one-message transactions on a fresh session."""
    with SessionDB(path) as db:
        db.create_session("rate", "cli", model="m")
        start = time.perf_counter()
        for seq in range(count):
            db.append_message("rate", "user", message_text(0, seq))
        elapsed = time.perf_counter() - start
    print(f"rate {count / elapsed:.1f}", flush=True)


def live(path, seconds):
    """One message a transaction, 4-20 a second, each commit printed with its monotonic time (a
    clock every process of the machine shares) so a reader elsewhere can be timed against it."""
    rng = random.Random(29)
    with SessionDB(path) as db:
        print("ready", flush=True)
        deadline, seq, session = time.monotonic() + seconds, 0, None
        while time.monotonic() < deadline:
            if seq % 40 == 0:
                session = f"live-{seq // 40}"
                db.create_session(session, "cli" if seq % 80 else "telegram", model="m")
                db.set_session_title(session, f"{CJK[(seq // 40) % len(CJK)]} run {seq // 40}")
            if seq % 4 == 3:
                db.append_message(session, "tool", f"live {seq}: exit code {seq % 7} after the "
                                  "harbour build", tool_name="terminal", tool_call_id=f"call-{seq}")
            elif seq % 4 == 1:
                db.append_message(session, "user", f"live {seq}: 请检查{CJK[seq // 4 % len(CJK)]}第{seq}步")
            else:
                db.append_message(session, "assistant", message_text(9, seq), tool_calls=CALL)
            seq += 1
            print(f"commit {seq} {time.monotonic():.4f}", flush=True)
            time.sleep(rng.uniform(0.05, 0.25))
        print(f"appended {seq}", flush=True)


if __name__ == "__main__":
    command, db_path = sys.argv[1], sys.argv[2]
    if command == "append":
        append(db_path, int(sys.argv[3]), float(sys.argv[4]))
    elif command == "rate":
        rate(db_path, int(sys.argv[3]))
    elif command == "live":
        live(db_path, float(sys.argv[3]))
    else:
        raise SystemExit(f"worker.py: unknown command {command!r}")
