"""`make test-faults`: real power cuts, a full disk, I/O errors and a virtiofs-typed mount under
this checkout's SessionDB.

Owns: the cached fusepy venv (~/.cache/hermes_state_faults, HERMES_FAULTS_CACHE; made on first use
from faults/requirements.txt, Debian's libfuse2 installed by apt when missing), the mounts it makes
under a scratch folder (faultfs.py FUSE mounts, a 4 MB tmpfs) and their removal, and the report:
one PASS/FAIL/SKIP line a scenario with its figure, then "N passed, N failed, N skipped". Must not
touch: the product modules (workers are worker.py processes importing this checkout), any mount or
process it did not make. Skips with the reason where mounts are not permitted (not root, no
/dev/fuse, no libfuse2).

Environment: FAULTS_POINTS (power cuts of each gating run, a third as many for the others;
default 60, which keeps a run under 10 minutes here), FAULTS_ONLY (comma-separated scenario
name prefixes).
"""

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "worker.py"
CACHE = Path(os.environ.get("HERMES_FAULTS_CACHE")
             or Path.home() / ".cache" / "hermes_state_faults")
POINTS = int(os.environ.get("FAULTS_POINTS", "60"))
ONLY = [p for p in os.environ.get("FAULTS_ONLY", "").split(",") if p]
STEP_TIMEOUT = 120
ENV = dict(os.environ, PYTHONPATH=str(REPO), HERMES_HOME="/nonexistent-hermes-home")
RESULTS = []
sys.path[:0] = [str(REPO), str(HERE)]  # worker.py's control client, over this checkout
# Error texts that say what happened: a full disk, an I/O error, a read-only filesystem.
DISK_FULL_WORDS = ("disk is full", "no space left", "disk full", " bytes free",
                   "insufficient_disk")
IO_WORDS = ("i/o error", "input/output error")
RO_WORDS = ("read-only", "readonly")


def report(name, ok, figure, skipped=False):
    word = "SKIP" if skipped else ("PASS" if ok else "FAIL")
    RESULTS.append((name, word, figure))
    print(f"{word} {name}: {figure}", flush=True)


def wanted(name):
    return not ONLY or any(name.startswith(p) for p in ONLY)


# ---- setup ----------------------------------------------------------------------------------

def why_not_mountable():
    if os.geteuid() != 0:
        return "not root: mounts are not permitted"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


def fuse_python():
    """The venv's python with fusepy, after libfuse2 is present; None and a reason if not."""
    import ctypes.util  # fusepy finds the library so: a file ldconfig does not list is not found
    if not ctypes.util.find_library("fuse"):
        apt = subprocess.run(["apt-get", "install", "-y", "-qq", "libfuse2"],
                             capture_output=True, text=True, timeout=600)
        if apt.returncode:
            return None, f"libfuse2 could not be installed: {apt.stderr.strip()[-200:]}"
        if not ctypes.util.find_library("fuse"):
            return None, ("no libfuse after `apt-get install libfuse2` exited 0: "
                          f"{(apt.stdout + apt.stderr).strip()[-200:] or 'it printed nothing'}")
    venv = CACHE / "venv"
    stamp = venv / "stamp"
    want = (HERE / "requirements.txt").read_text()
    if not (stamp.exists() and stamp.read_text() == want):
        shutil.rmtree(venv, ignore_errors=True)
        print(f"faults: building {venv} (once; pip from PyPI)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-input",
                        "--disable-pip-version-check", "--require-hashes", "-r",
                        str(HERE / "requirements.txt")], check=True, timeout=600)
        stamp.write_text(want)
    return str(venv / "bin" / "python"), None


class Mount:
    """A faultfs mount (subtype `subtype`) and its control socket."""

    def __init__(self, python, root, subtype="faultfs", *flags):
        self.path = Path(tempfile.mkdtemp(dir=root, prefix=f"{subtype}-"))
        self.sock = str(self.path) + ".sock"
        self.proc = subprocess.Popen([python, str(HERE / "faultfs.py"), str(self.path), self.sock,
                                      subtype, *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while not (os.path.ismount(self.path) and os.path.exists(self.sock)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"faultfs did not mount: {self.proc.stderr.read()[-300:]}")
            time.sleep(0.05)
        from worker import control
        self.ask = control(self.sock)

    def close(self):
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=60)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def work(*args, timeout=STEP_TIMEOUT, extra_env=None):
    try:
        done = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True,
                              text=True, timeout=timeout, env=dict(ENV, **(extra_env or {})),
                              cwd=str(REPO))
    except subprocess.TimeoutExpired:
        return 124, f"hung: no answer in {timeout}s"
    return done.returncode, (done.stdout.strip() or done.stderr.strip())


def check(db, acks_file, k):
    code, text = work("check", str(db), str(acks_file), str(k))
    try:
        return json.loads(text.splitlines()[-1])
    except (ValueError, IndexError):
        return {"k": k, "opened": False, "error": f"checker died: {text[-300:]}", "lost": [],
                "integrity": None, "fts": None, "ro_error": None}


def store_whole(result):
    return (result.get("opened") and result.get("integrity") == "ok"
            and result.get("fts") == "ok" and not result.get("error"))


# ---- power loss -----------------------------------------------------------------------------

# (journal, synchronous): the product's level in each journal gates (no loss allowed); the level
# each would have without our choice (WAL at NORMAL, a rollback journal at SQLite's FULL) is run
# for the figure of what it loses (hermes_state_wal.writer_synchronous), and gates on corruption.
POWER_RUNS = (("wal", "default"), ("delete", "default"), ("wal", "NORMAL"), ("delete", "FULL"))


def ro_error_clear(text):
    """A read-only open after a cut may fail, saying there is no store yet or that a writable
    open must recover it; anything else is not a clear line."""
    return text.startswith("FileNotFoundError: no state store") or "writable open" in text


def power_loss(python, root, journal, sync):
    gate = sync == "default"
    name = f"power-loss-{journal}" + ("" if gate else f"-{sync}")
    mount = Mount(python, root)
    try:
        db = mount.path / "home" / "state.db"
        mount.ask("reset")
        os.mkdir(mount.path / "home")
        started = time.monotonic()
        code, text = work("agent", str(db), mount.sock, journal, sync, timeout=600)
        if code:
            return report(name, False, f"the agent run failed: {text[-300:]}")
        run_s = time.monotonic() - started
        kinds = mount.ask("kinds")
        acks = mount.ask("acks")
        syncs = [i + 1 for i, k in enumerate(kinds) if k == "fsync"]
        budget = POINTS if gate else max(POINTS // 3, 10)
        points = sorted(set(p for s in syncs for p in (s - 1, s) if p > 0))
        rest = [i for i in range(1, len(kinds) + 1) if i not in set(points)]
        room = max(budget - len(points), 0)
        if len(points) > budget:  # every sync boundary when they fit, else evenly sampled
            points = points[::max(1, len(points) // (budget // 2))]
            room = budget - len(points)
        if room and rest:
            points += rest[::max(1, len(rest) // room)][:room]
        points = sorted(set(points))
        acks_file = Path(root) / f"acks-{journal}-{sync}.json"
        acks_file.write_text(json.dumps(acks))
        code, text = work("checks", str(db), str(acks_file), mount.sock,
                          ",".join(map(str, points)), timeout=1200)
        results = {}
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                result = json.loads(line)
                results[result["k"]] = result
        corrupt, lost, ro_errors, unclear = [], [], {}, 0
        worst = None
        for k in points:
            result = results.get(k) or {"k": k, "opened": False, "lost": [],
                                        "error": f"no answer from the checker: {text[-200:]}"}
            if not store_whole(result):
                corrupt.append(f"k={k}: {result.get('error') or result.get('integrity')} "
                               f"{result.get('fts')}")
            lost.append(len(result.get("lost") or []))
            if lost[-1] and lost[-1] == max(lost):
                acked = sum(1 for spec, at in acks if at <= k and spec[0] != "level")
                worst = (k, acked, (result.get("lost") or [""])[0])
            said = result.get("ro_error")
            if said:
                key = said.replace(str(mount.path), "MOUNT")[:100]
                ro_errors[key] = ro_errors.get(key, 0) + 1
                unclear += not ro_error_clear(said)
        level, mode = next(spec[1:3] for spec, _ in acks if spec[0] == "level")
        calls = sum(1 for spec, _ in acks if spec[0] not in ("closed", "level"))
        figure = (f"{len(points)} cuts over {len(kinds)} boundaries ({len(syncs)} syncs) of "
                  f"{calls} API calls (run {run_s:.1f}s); stores corrupted {len(corrupt)}; "
                  f"acknowledged calls lost: max {max(lost)}, median "
                  f"{statistics.median(lost):g}, cuts losing any {sum(1 for n in lost if n)}; "
                  f"read-only opens not one clear line {unclear}")
        if worst:
            figure += "; worst cut at boundary {} ({} calls acknowledged; lost e.g. {!r})".format(
                *worst)
        if ro_errors:
            figure += "; read-only open said: " + "; ".join(
                f"{n}x {said}" for said, n in sorted(ro_errors.items(), key=lambda i: -i[1]))
        if corrupt:
            figure += "; first corrupt: " + corrupt[0]
        ok = not corrupt and not unclear and (max(lost) == 0 or not gate)
        report(name, ok, f"journal {mode}, synchronous={level}: {figure}")
    finally:
        mount.close()


# ---- disk full --------------------------------------------------------------------------------

ENOSPC_OPS = ("append", "batch", "import", "export", "backup", "restore", "optimize", "vacuum",
              "checkpoint")


def fill(folder, leave=0):
    """Write a filler file until the filesystem refuses, then give back `leave` bytes: a real
    ENOSPC for whatever needs more than that (the store's open needs its -shm's 32 KiB)."""
    filler = Path(folder) / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    if leave:
        os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


def disk_full(root, base_home, archive):
    no_acks = Path(root) / "no-acks.json"
    no_acks.write_text("[]")
    for op in ENOSPC_OPS:
        if wanted(f"disk-full-{op}"):
            for leave in (0, 40 * 1024):
                disk_full_op(root, base_home, archive, no_acks, op, leave)


def disk_full_op(root, base_home, archive, no_acks, op, leave):
    # restore_home wants the WAL size limit (64 MiB) free beside the files before it starts.
    size = "80m" if op == "restore" else "4m"
    name = f"disk-full-{op}" + ("-at-open" if not leave else "")
    tmpfs = Path(tempfile.mkdtemp(dir=root, prefix="tmpfs-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(tmpfs)],
                             capture_output=True, text=True)
    if mounted.returncode:
        return report(name, False, f"tmpfs not mounted: {mounted.stderr.strip()}", True)
    try:
        shutil.copytree(base_home, tmpfs / "home")  # a fresh tmpfs for each case
        db = tmpfs / "home" / "state.db"
        out = {"export": tmpfs / "export.json", "backup": tmpfs / "backup.zip",
               "restore": archive}.get(op, "")
        filler = fill(tmpfs, leave)
        code, text = work("op", op, str(db), str(out))
        # One line that says the disk is full and names the folder (or a file in it).
        clear = code != 0 and len(text.splitlines()) == 1 and any(
            w in text.lower() for w in DISK_FULL_WORDS) and str(tmpfs) in text
        half = op in ("export", "backup") and Path(out).exists() and Path(out).stat().st_size
        # Nothing else left behind either: a temporary archive, a probe file of the store's.
        kept = {"filler", "home", Path(out).name} | {p.name for p in Path(base_home).iterdir()}
        litter = sorted(p.name for p in tmpfs.rglob("*") if p.name not in kept
                        and not p.name.endswith(("-wal", "-shm", "-journal", ".lock")))
        half = half or litter
        filler.unlink()  # the checker's own open may need a page
        whole = check(db, no_acks, 0)
        again, again_text = work("op", op, str(db), str(out))
        ok = clear and not half and store_whole(whole) and again == 0
        if code == 0 and ok is False and leave and not half and store_whole(whole):
            return report(name, True, f"needed no more than the {leave // 1024} KiB left: no "
                          "ENOSPC reached (the -at-open case covers it)", skipped=True)
        unclear = (" (not one clear disk-full line naming the folder)"
                   if code and not clear else "")
        figure = (f"while full: {'failed' if code else 'SUCCEEDED'} with {text[:160]!r}{unclear}"
                  f"; half-written output: {litter or ('yes' if half else 'no')}; store "
                  f"afterwards: {'whole' if store_whole(whole) else whole}; after freeing space: "
                  f"{'OK' if again == 0 else again_text[:160]}")
        report(name, ok, figure)
    finally:
        subprocess.run(["umount", "-l", str(tmpfs)], capture_output=True)


# ---- I/O errors -------------------------------------------------------------------------------

EIO_OPS = ("append", "batch", "import", "export", "backup", "optimize", "vacuum", "read",
           "bad-sector")
EIO_SWEEP = 5  # values of n per kind (read, write), spread over the operation's own count


def io_errors(python, root, base_home):
    no_acks = Path(root) / "no-acks.json"
    no_acks.write_text("[]")
    mount = Mount(python, root)
    try:
        files = {f"/home/{p.name}": p.read_bytes() for p in Path(base_home).iterdir()}
        os.mkdir(mount.path / "home")
        for op in EIO_OPS[:-1]:
            if not wanted(f"io-error-{op}"):
                continue
            db = mount.path / "home" / "state.db"
            out = mount.path / "out.bin"
            mount.ask("reset")
            os.makedirs(mount.path / "home", exist_ok=True)
            for name, content in files.items():
                (mount.path / name.lstrip("/")).write_bytes(content)
            mount.ask("mark")
            before = mount.ask("counts")
            code, text = work("op", op, str(db), str(out))
            after = mount.ask("counts")
            if code:
                report(f"io-error-{op}", False, f"fails with no fault: {text[:200]}")
                continue
            trials, corrupt, unclear, swallowed, hung = 0, [], [], 0, 0
            for kind, total in (("read", after[0] - before[0]), ("write", after[1] - before[1])):
                sweep = set(max(1, total * i // EIO_SWEEP) for i in range(1, EIO_SWEEP + 1))
                for n in sorted(sweep):
                    mount.ask("revert")
                    if out.exists():
                        out.unlink()
                    mount.ask("eio", kind, n)
                    code, text = work("op", op, str(db), str(out), timeout=60)
                    mount.ask("eio", kind, None)
                    trials += 1
                    hung += code == 124
                    if code == 0:
                        swallowed += 1
                    elif len(text.splitlines()) != 1 or not any(
                            w in text.lower() for w in IO_WORDS) or "malformed" in text.lower():
                        unclear.append(f"{kind} #{n}: {text.splitlines()[0][:110]}")
                    result = check(db, no_acks, 0)
                    if not store_whole(result):
                        what = result.get("error") or result.get("integrity")
                        corrupt.append(f"{kind} #{n}: {what}")
            figure = (f"{trials} faults (n swept over {after[0] - before[0]} reads, "
                      f"{after[1] - before[1]} writes): corrupted {len(corrupt)}, hung {hung}, "
                      f"absorbed (call succeeded) {swallowed}, errors not one clear I/O line "
                      f"{len(unclear)}")
            if unclear:
                figure += f"; e.g. {unclear[0]!r}"
            if corrupt:
                figure += f"; e.g. {corrupt[0]!r}"
            report(f"io-error-{op}", not corrupt and not unclear and not hung, figure)
        if wanted("io-error-bad-sector"):
            bad_sector(mount, files)
    finally:
        mount.close()


def bad_sector(mount, files):
    """A page of the transcript that never reads again: reads fail (never an empty answer) and
    doctor reports the store, read-only, as it finds it."""
    mount.ask("reset")
    os.makedirs(mount.path / "home", exist_ok=True)
    for name, content in files.items():
        (mount.path / name.lstrip("/")).write_bytes(content)
    db = mount.path / "home" / "state.db"
    middle = len(files["/home/state.db"]) // 2 // 4096 * 4096
    mount.ask("bad", "/home/state.db", middle, middle + 4096)
    code, text = work("op", "read", str(db), "")
    read_ok = code != 0 and len(text.splitlines()) == 1
    code_doctor, said = work("doctor", str(db))
    mount.ask("bad", None)
    doctor_ok = code_doctor == 1 and "PROBLEM" in said
    report("io-error-bad-sector", read_ok and doctor_ok,
           f"page at byte {middle} fails every read: read {'FAILED' if code else 'SERVED'} with "
           f"{text[:140]!r}; doctor exit {code_doctor}: {said.splitlines()[0][:160]!r}")


# ---- read-only and virtiofs ---------------------------------------------------------------------

def read_only(python, root, base_home):
    mount = Mount(python, root)
    try:
        shutil.copytree(base_home, mount.path / "home")
        code, text = work("rofs", str(mount.path / "home" / "state.db"), mount.sock)
        try:
            result = json.loads(text.splitlines()[-1])
        except (ValueError, IndexError):
            return report("read-only-under-writer", False, f"worker died: {text[-300:]}")
        error = result.get("write_error") or ""
        says = any(w in error.lower() for w in RO_WORDS)
        report("read-only-under-writer", bool(error) and says and result.get("read_ok"),
               f"write: {error[:150] or 'SUCCEEDED'}{'' if says else ' (does not say read-only)'}; "
               f"reads go on: {'yes' if result.get('read_ok') else result.get('read_error')}")
    finally:
        mount.close()
    # A real remount while the writer holds the file open, for the record.
    tmpfs = Path(tempfile.mkdtemp(dir=root, prefix="tmpfs-ro-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(tmpfs)], check=True)
    try:
        with open(tmpfs / "held", "w"):
            remount = subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)],
                                     capture_output=True, text=True)
        report("read-only-remount-tmpfs", True, "the kernel refuses a read-only remount while a "
               f"file is open for writing ({' '.join(remount.stderr.split())[:90] or 'allowed'}); "
               "the fault above is faultfs answering EROFS, as ext4's errors=remount-ro does",
               skipped=remount.returncode != 0)
    finally:
        subprocess.run(["umount", "-l", str(tmpfs)], capture_output=True)


def healthy_sqlite():
    """LD_LIBRARY_PATH of a SQLite free of the WAL-reset bug that `make test-runtimes` built
    (CPython's _sqlite3 loads it), or None: on a runtime with the bug every new store gets a
    rollback journal anyway, so only the forced-WAL case tests the refusal there."""
    cache = Path(os.environ.get("HERMES_RUNTIMES_CACHE")
                 or Path.home() / ".cache" / "hermes_state_runtimes")
    found = sorted(cache.glob("lib/3.5[3-9]*-fts5/libsqlite3.so.0"))
    return str(found[-1].parent) if found else None


def journal_on(mount, name, extra_env):
    """The worker's `journal` answer for a new store on `mount`, under `extra_env`."""
    db = mount.path / name / "state.db"
    code, text = work("journal", str(db), extra_env=extra_env)
    try:
        return json.loads(text.splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": text[-300:]}


def cross_vm(python, root):
    """A store on a mount whose type says virtiofs never gets WAL, asked for or not, on this
    SQLite and on a healthy one; SessionDB and a plain connection (hermes-agent's kanban.db) say
    why in 0.22's terms. A FUSE "9p" would be no 9p: the kernel's are not to be had here."""
    mount = Mount(python, root, "virtiofs")
    try:
        fstype = next((line.split()[2] for line in open("/proc/mounts")
                       if line.split()[1] == str(mount.path)), "?")
        cases = [("this SQLite, WAL asked for", {"HERMES_STATE_JOURNAL": "wal"})]
        lib = healthy_sqlite()
        if lib:
            cases.append(("SQLite without the WAL-reset bug", {"LD_LIBRARY_PATH": lib}))
        said, ok = [], fstype == "fuse.virtiofs"
        for i, (what, extra) in enumerate(cases):
            answer = journal_on(mount, f"case{i}", extra)
            modes = (answer.get("store"), answer.get("plain"))
            # With the WAL-reset bug a plain connection gets a rollback journal for that reason.
            who = ("store",) if "LD_LIBRARY_PATH" not in extra else ("store", "plain")
            told = all(any("cross-VM filesystem" in line and "journal_mode=DELETE" in line
                           for line in answer.get(f"{w}_logs", ())) for w in who)
            ok = ok and "error" not in answer and "wal" not in modes and told
            said.append(f"{what} ({answer.get('sqlite')}): SessionDB {modes[0]}, plain connection "
                        f"{modes[1]}, refusal logged {'yes' if told else 'NO'}"
                        + (f", {answer['error'][:150]}" if "error" in answer else ""))
        if not lib:
            said.append("no SQLite without the bug cached (make test-runtimes builds one)")
        report(f"cross-vm-{fstype}", ok, f"mount type {fstype}: " + "; ".join(said))
    finally:
        mount.close()
    # A filesystem without WAL's shared memory (NFS, SMB): -shm cannot be mapped.
    mount = Mount(python, root, "faultfs", "noshm")
    try:
        said, ok = [], True
        for i, (what, extra) in enumerate(cases):
            answer = journal_on(mount, f"nfs-like{i}", extra)
            told = any("WAL is not supported on this filesystem" in line
                       for line in answer.get("store_logs", ()))
            ok = ok and "error" not in answer and told and answer.get("store") == "delete"
            said.append(f"{what}: SessionDB {answer.get('store')}, refusal logged "
                        f"{'yes' if told else 'NO'}"
                        + (f", {answer['error'][:200]}" if "error" in answer else ""))
        report("wal-refused-no-shared-memory", ok,
               "a FUSE mount whose -shm cannot be mapped (as NFS/SMB): " + "; ".join(said))
    finally:
        mount.close()
    report("cross-vm-kernel-virtiofs-9p-nfs-smb", True, "the kernel's virtiofs, 9p, NFS and SMB "
           "need a host or server this machine does not have", skipped=True)


# ---- main ---------------------------------------------------------------------------------------

def main():
    started = time.monotonic()
    reason = why_not_mountable()
    python = None
    if reason is None:
        python, reason = fuse_python()
    if reason is not None:
        report("all", True, reason, skipped=True)
    else:
        root = tempfile.mkdtemp(prefix="hermes-faults-")
        try:
            base = Path(root) / "base" / "home"
            base.mkdir(parents=True)
            code, text = work("op", "make", str(base / "state.db"), "300")
            if code:
                raise SystemExit(f"faults: could not make the base store: {text}")
            for extra in base.iterdir():
                if extra.name != "state.db":
                    extra.unlink()
            archive = Path(root) / "base-backup.zip"
            code, text = work("op", "backup", str(base / "state.db"), str(archive))
            for journal, sync in POWER_RUNS:
                if wanted(f"power-loss-{journal}" + ("" if sync == "default" else f"-{sync}")):
                    power_loss(python, root, journal, sync)
            if any(wanted(f"disk-full-{op}") for op in ENOSPC_OPS):
                disk_full(root, base, archive)
            if any(wanted(f"io-error-{op}") for op in EIO_OPS):
                io_errors(python, root, base)
            if wanted("read-only"):
                read_only(python, root, base)
            if wanted("cross-vm"):
                cross_vm(python, root)
        finally:
            for line in open("/proc/mounts"):
                if line.split()[1].startswith(root):
                    subprocess.run(["umount", "-l", line.split()[1]], capture_output=True)
            shutil.rmtree(root, ignore_errors=True)
    counts = {w: sum(1 for r in RESULTS if r[1] == w) for w in ("PASS", "FAIL", "SKIP")}
    print(f"({time.monotonic() - started:.0f}s on {os.cpu_count()} cores)")
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    sys.exit(1 if counts["FAIL"] else 0)


if __name__ == "__main__":
    main()
