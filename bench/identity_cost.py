"""What schema 31's message identity costs a writer and a reader: one side's append (one message a
transaction) and conversation load CPU time, and bytes per message, on a 3,000-message agent history.

Run it once per side, interleaved, and compare (issue 34's figures in docs/benchmarks.md):
    python3 bench/identity_cost.py .                      # this checkout
    python3 bench/identity_cost.py /path/to/other/checkout
    ~/.cache/hermes_state_compat/release-0.22.2.post1/bin/python bench/identity_cost.py -  # 0.22's own
`-` imports the hermes_state the running Python finds (a release's venv). CPU time, not wall time:
the fsyncs of a busy disk are the machine's, not the code's. Prints one JSON line.
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
MESSAGES = 3000
LOADS = 5


def main(root):
    if root != "-":
        sys.path.insert(0, str(Path(root).resolve()))
    sys.path.insert(1, str(BENCH))
    from bench import agent_history
    from hermes_state import SessionDB
    history = agent_history(MESSAGES, seed=7)
    path = Path(tempfile.mkdtemp(prefix="identity-cost-")) / "state.db"
    db = SessionDB(path)
    db.create_session("s", "cli")
    started = time.process_time()
    for message in history:
        db.append_message("s", message["role"], message.get("content"),
                          tool_calls=message.get("tool_calls"), tool_name=message.get("tool_name"),
                          tool_call_id=message.get("tool_call_id"))
    append = time.process_time() - started
    started = time.process_time()
    for _ in range(LOADS):
        db.get_messages_as_conversation("s")
    load = (time.process_time() - started) / LOADS
    db.close()
    print(json.dumps({"side": root, "append_cpu_ms": round(append / MESSAGES * 1000, 3),
                      "load_cpu_ms": round(load * 1000, 1),
                      "bytes_per_message": round(os.path.getsize(path) / MESSAGES)}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
