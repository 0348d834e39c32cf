"""What `PRAGMA synchronous=FULL` (and EXTRA) costs a transcript write against NORMAL, in WAL and
in a rollback journal, on the disk under a folder (default: a temp folder on the disk of /tmp).

Owns only the stores it makes in its own temp folder (removed after). It drives this checkout's
SessionDB as the agent does (one append_message a call, and a batch of three tool results), with
the journal forced by SessionDB's `journal` override and the level set on the writer, the one
connection every write goes through, after the open has set the product's own. Rounds interleave
the four settings, so a machine busy with other work slows them alike. Prints one line a setting
(median and 90th percentile of a call, calls a second) and each level's ratio to NORMAL.

Usage: python3 faults/sync_cost.py [--calls N] [--rounds R] [--dir FOLDER]
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hermes_state import SessionDB  # noqa: E402 (after the path above)

SETTINGS = (("wal", "NORMAL"), ("wal", "FULL"), ("delete", "NORMAL"), ("delete", "FULL"),
            ("delete", "EXTRA"))


def one_round(folder, journal, level, calls, times):
    path = Path(folder) / f"{journal}-{level}-{len(times)}" / "state.db"
    path.parent.mkdir()
    db = SessionDB(path, journal=journal)
    try:
        db._writer.execute(f"PRAGMA synchronous={level}")
        db.create_session("s", "cli")
        for i in range(calls):
            started = time.perf_counter()
            if i % 3 == 2:
                db.append_messages_batch("s", [
                    {"role": "tool", "content": f"tool result {i}.{k} " + "z" * 300,
                     "tool_call_id": f"c{i}-{k}"} for k in range(3)])
            else:
                db.append_message("s", "user" if i % 3 == 0 else "assistant",
                                  f"turn {i} of the transcript " + "y" * 400)
            times.append(time.perf_counter() - started)
        mode = db._writer.execute("PRAGMA journal_mode").fetchone()[0]
    finally:
        db.close()
    shutil.rmtree(path.parent)
    return mode


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="hermes-sync-cost-", dir=args.dir)
    times = {s: [] for s in SETTINGS}
    modes = {}
    try:
        for _ in range(args.rounds):
            for journal, level in SETTINGS:
                modes[journal] = one_round(folder, journal, level, args.calls,
                                           times[(journal, level)])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{args.rounds} rounds x {args.calls} calls a setting, in {folder}'s filesystem, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    median = {}
    for (journal, level), seen in times.items():
        ms = sorted(t * 1000 for t in seen)
        median[(journal, level)] = statistics.median(ms)
        print(f"journal {modes[journal]:6} synchronous={level:6}: median "
              f"{median[(journal, level)]:.2f} ms, p90 {ms[int(len(ms) * 0.9)]:.2f} ms, "
              f"{1000 / statistics.mean(ms):.0f} calls/s")
    for journal, level in SETTINGS:
        if level != "NORMAL":
            ratio = median[(journal, level)] / median[(journal, "NORMAL")]
            print(f"journal {modes[journal]}: {level} costs {ratio:.2f}x NORMAL's median call")


if __name__ == "__main__":
    main()
