"""`make test-faults` must fail when what it guards is taken out: each mutant below patches one
product line in a copy of this checkout, and the scenarios named beside it must then fail.

Owns: a temp copy of the checkout per mutant (tracked and new files, as they are in the working
tree; removed after) and the report, one line a mutant: CAUGHT with the scenarios that failed, or
MISSED. Must not touch: the checkout itself, mutate/ (the suite's own mutants).

Usage: python3 faults/mutants.py [NAME ...]   (root and /dev/fuse, as make test-faults)
Environment: FAULTS_POINTS for the power-loss mutants (default 40).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name: (file, text as it is, text as the mutant has it, scenarios (FAULTS_ONLY) that must fail);
# a list of those patches for a mutant of several places.
MUTANTS = {
    "no-fsync-of-a-commit": (
        "hermes_state_wal.py", 'return "FULL" if mode == "wal" else "EXTRA"', 'return "OFF"',
        "power-loss-wal,power-loss-delete"),
    "wal-at-normal": (
        "hermes_state_wal.py", 'return "FULL" if mode == "wal" else "EXTRA"',
        'return "NORMAL" if mode == "wal" else "EXTRA"', "power-loss-wal"),
    "rollback-journal-at-full": (
        "hermes_state_wal.py", 'return "FULL" if mode == "wal" else "EXTRA"',
        'return "FULL"', "power-loss-delete"),
    "no-enospc-mapping-of-a-write": (
        "hermes_state.py", "note_store_failure(self.db_path, exc, writing=True)", "None",
        "disk-full-import,disk-full-append,disk-full-batch"),
    # Its preflight refuses a disk without room; past it (a disk another program fills) the
    # write path's mapping says so: each alone keeps the scenario passing, so both go.
    "no-enospc-handling-of-optimize-storage": [
        ("hermes_state_fts.py", "        if shortfall:\n", "        if False:\n",
         "disk-full-optimize"),
        ("hermes_state.py", "note_store_failure(self.db_path, exc, writing=True)", "None",
         "disk-full-optimize")],
    "no-cross-vm-refusal-of-sessiondb": (
        "hermes_state_wal.py", "if cross_vm:  # an asked-for WAL too",
        "if False:  # an asked-for WAL too",
        "cross-vm"),
    "no-cross-vm-refusal-of-other-databases": (
        "hermes_state_wal.py", "    if cross_vm:\n        if require_wal:",
        "    if False:\n        if require_wal:", "cross-vm"),
}


def copy_checkout(target):
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def main():
    chosen = sys.argv[1:] or list(MUTANTS)
    missed = 0
    for name in chosen:
        patches = MUTANTS[name]
        patches = patches if isinstance(patches, list) else [patches]
        scenarios = patches[0][3]
        scratch = Path(tempfile.mkdtemp(prefix="hermes-faults-mutant-"))
        try:
            copy_checkout(scratch)
            stale = False
            for path, before, after, _ in patches:
                text = (scratch / path).read_text()
                if text.count(before) != 1:
                    print(f"STALE {name}: {path} no longer holds this once: {before!r}")
                    stale = True
                (scratch / path).write_text(text.replace(before, after))
            if stale:
                missed += 1
                continue
            env = dict(os.environ, FAULTS_ONLY=scenarios,
                       FAULTS_POINTS=os.environ.get("FAULTS_POINTS", "40"))
            done = subprocess.run([sys.executable, str(scratch / "faults" / "run.py")],
                                  capture_output=True, text=True, env=env, cwd=str(scratch))
            failed = re.findall(r"^FAIL (\S+): (.{0,400})", done.stdout, re.M)
            if not re.search(r"^\d+ passed, \d+ failed", done.stdout, re.M):
                missed += 1
                print(f"BROKEN {name}: the run did not finish: {done.stderr.strip()[-300:]}")
            elif failed:
                print(f"CAUGHT {name}: " + "; ".join(f"{s} ({why})" for s, why in failed))
            else:
                missed += 1
                print(f"MISSED {name}: {done.stdout.strip().splitlines()[-1:]}")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
