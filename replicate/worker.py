"""A writer process for `make replicate-test`: appends to a store through this checkout's SessionDB.

Owns: the shape of what the scenarios write (one session per worker plus a shared one, numbered
messages, a tool call every third one, token counts) and the append-rate measure. Must not touch: any
store but the one it is given; it never checkpoints, never opens the store except through SessionDB.

Usage:
  worker.py append DB WORKER SECONDS   append for SECONDS; prints "ready" once the sessions exist,
                                       then "appended N" at the end (a SIGKILL may stop it anywhere)
  worker.py rate DB COUNT              append COUNT one-message transactions; prints "rate R" (msg/s)
The checkpoint mode comes from HERMES_STATE_CHECKPOINT, as in any process of the agent.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hermes_state import SessionDB  # noqa: E402  (the checkout's, not an installed one)

CALL = [{"id": "c", "type": "function", "function": {"name": "terminal", "arguments": "{\"command\": \"ls\"}"}}]
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


if __name__ == "__main__":
    command, db_path = sys.argv[1], sys.argv[2]
    if command == "append":
        append(db_path, int(sys.argv[3]), float(sys.argv[4]))
    elif command == "rate":
        rate(db_path, int(sys.argv[3]))
    else:
        raise SystemExit(f"worker.py: unknown command {command!r}")
