"""`make test`: the suite's test modules, each in its own `python -m unittest` process, as many at
once as the machine has cores (TEST_JOBS), the longest first; one line a module as it ends, the
failures' unittest output, then "N passed, N failed, N skipped".

Owns: the order and the summary. Must not touch: the tests themselves (each module runs exactly as
`python -m unittest MODULE` runs it, in the repository root, with the caller's environment).
A serial run took 400 s in CI on 2 cores, over the suite's five minutes; most of the time is spent
waiting on subprocesses, locks and timeouts, which run side by side without slowing each other.
Usage: run.py PATTERN (a glob of test files at the root, as unittest's -p takes it)
"""

import fnmatch
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Modules known to run longest start first, so that no long one is left to run alone at the end;
# the rest follow by file size, which tracks their length well enough.
LONGEST = ("test_hermes_state_portability", "test_hermes_state_search", "test_concurrency",
           "test_hermes_state_sessions", "test_hermes_state_install", "test_hermes_state_server")
RAN = re.compile(r"^Ran (\d+) tests? in ", re.M)
COUNTS = re.compile(r"(failures|errors|skipped)=(\d+)")


def modules(pattern):
    found = sorted((p for p in ROOT.glob("test_*.py") if fnmatch.fnmatch(p.name, pattern)),
                   key=lambda p: -p.stat().st_size)
    # test_support holds the suite's helpers; unittest 3.12+ fails a module with no tests.
    names = [p.stem for p in found if p.stem != "test_support"]
    return [n for n in LONGEST if n in names] + [n for n in names if n not in LONGEST]


def outcome(output, returncode):
    """(ran, failed, skipped) from one module's unittest output; a module that died or printed
    no summary counts as one failure."""
    ran = RAN.search(output)
    # The verdict line, wherever it is (a warning at the interpreter's exit may follow it).
    verdicts = [line for line in output.splitlines() if line.startswith(("OK", "FAILED"))]
    counts = {key: int(value) for key, value in COUNTS.findall(verdicts[-1] if verdicts else "")}
    failed = counts.get("failures", 0) + counts.get("errors", 0)
    if ran is None or (returncode != 0 and failed == 0):
        return (int(ran.group(1)) if ran else 0), max(failed, 1), counts.get("skipped", 0)
    return int(ran.group(1)), failed, counts.get("skipped", 0)


def main(pattern="test_*.py"):
    queue = modules(pattern)
    jobs = max(1, int(os.environ.get("TEST_JOBS") or os.cpu_count() or 1))
    lock, totals, crashed, children = threading.Lock(), [0, 0, 0], [], []
    started = time.monotonic()

    def work():
        while True:
            with lock:
                if not queue:
                    return
                name = queue.pop(0)
            child = subprocess.Popen([sys.executable, "-m", "unittest", name], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace")
            with lock:
                children.append(child)
            output = child.communicate()[0]
            ran, failed, skipped = outcome(output, child.returncode)
            with lock:
                totals[0] += ran
                totals[1] += failed
                totals[2] += skipped
                if child.returncode < 0:
                    crashed.append(-child.returncode)
                word = "ok" if not failed else "FAILED"
                print(f"{name}: {ran} tests, {word} ({time.monotonic() - started:.0f} s)",
                      flush=True)
                if failed:
                    print(output, flush=True)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(jobs)]
    # Stopped (Ctrl-C, or CI's kill), the modules running stop too, not left to run on their own.
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except BaseException:
        with lock:
            queue.clear()
            for child in children:
                child.kill()
        raise
    ran, failed, skipped = totals
    print(f"Ran {ran} tests in {time.monotonic() - started:.1f}s with {jobs} at once")
    print(f"{ran - failed - skipped} passed, {failed} failed, {skipped} skipped")
    if crashed:  # make then says "Error 139" for a segfault, which runtimes/run.py reads
        return 128 + crashed[0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
