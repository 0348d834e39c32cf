"""Who holds a store's write lock right now, read from Linux's /proc/locks.

A writer that gave up waiting knows it was locked out, not by whom; the holder scan
(hermes_state_holders) cannot tell the one writer from the readers, as every process has the store
open. The kernel lists every advisory lock with its owner pid, and SQLite's unix VFS encodes the
lock's kind in its byte offset, so the writer can be named. Our own writers take a whole-file
flock on `<store>.lock` (hermes_state_lockguard), which is listed too. Owns that parse; reads
/proc/locks and stats the store's files, never opens one, and touches no connection.
"""

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("hermes_state")

# SQLite's os_unix.c: the -shm lock bytes start at 120 (WAL write lock), one byte per lock.
_SHM_LOCKS = {120: "WAL write", 121: "WAL checkpoint", 122: "WAL recover",
              128: "shm dead-man switch"}
_SHM_READ_SLOTS = range(123, 128)
# Rollback-journal locks on the main file sit in the page at 1 GiB.
_PENDING_BYTE = 0x40000000
_MAIN_LOCKS = {_PENDING_BYTE: "PENDING", _PENDING_BYTE + 1: "RESERVED"}
# The files watched, by the suffix after the store's path ("" is the store itself).
_WATCHED = ("", "-wal", "-shm", ".lock")
# /proc/locks is read in several chunks and shifts while other processes lock: a holder skipped
# once is rarely skipped again, so three reads are merged.
_READS = 3


def _kind(suffix, start, end):
    if suffix == ".lock":
        return "hermes_state writer"
    if suffix == "-shm" and start == end:
        if start in _SHM_LOCKS:
            return _SHM_LOCKS[start]
        if start in _SHM_READ_SLOTS:
            return f"WAL read slot {start - _SHM_READ_SLOTS[0]}"
    if suffix == "" and start == end and start in _MAIN_LOCKS:
        return _MAIN_LOCKS[start]
    if suffix == "" and start == _PENDING_BYTE + 2:
        return "SHARED range"
    return f"{'shm' if suffix == '-shm' else 'db'} bytes {start}-{end}"


def parse_proc_locks(text, inodes):
    """[(pid, lock kind, suffix)] for every write lock in /proc/locks `text` on a file of `inodes`
    ({(st_dev, st_ino): suffix}); read locks (which never stop a WAL writer) and waiters are left
    out, as are lines that do not parse. An OFD lock's pid is -1: the kernel does not export it."""
    found = []
    for line in text.splitlines():
        # "1: POSIX  ADVISORY  WRITE 4242 08:01:1234 1073741825 1073741825";
        # a waiter: "1: -> POSIX ..."
        fields = line.split()
        if len(fields) < 8 or fields[1] == "->" or fields[3] != "WRITE":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            key = (os.makedev(int(major, 16), int(minor, 16)), int(inode))
            pid, start = int(fields[4]), int(fields[6])
            end = start if fields[7] == "EOF" else int(fields[7])
        except ValueError:
            continue
        if key in inodes:
            found.append((pid, _kind(inodes[key], start, end), inodes[key]))
    return found


def state_db_write_lock_holders(db_path):
    """['PID 4242 holds WAL write lock on state.db-shm', ...]: one line per write lock held on the
    store, its -wal, -shm or our writer lock file; [] when none is held or there is no
    /proc/locks."""
    if not sys.platform.startswith("linux"):
        return []
    base = os.path.realpath(os.fspath(db_path))
    inodes = {}
    for suffix in _WATCHED:
        try:
            found = os.stat(base + suffix)
        except OSError:
            continue
        inodes[(found.st_dev, found.st_ino)] = suffix
    held = []
    for _ in range(_READS):
        try:
            with open("/proc/locks", encoding="ascii", errors="replace") as handle:
                text = handle.read()
        except OSError:
            return []
        held += [entry for entry in parse_proc_locks(text, inodes) if entry not in held]
    name = Path(base).name
    return [f"{f'PID {pid}' if pid > 0 else 'an OFD lock (owner not exported)'} holds {kind} lock"
            f" on {name}{suffix}" for pid, kind, suffix in held]


def log_write_lock_holders(db_path, patience_s):
    """Log one warning naming the write-lock holders of `db_path` after a writer waited
    `patience_s` seconds in vain; returns None."""
    holders = state_db_write_lock_holders(db_path)
    logger.warning("%s write lock unavailable for %.0fs: %s", Path(db_path).name, patience_s,
                   " | ".join(holders)
                   or "no write lock held at the deadline (released just before)")
