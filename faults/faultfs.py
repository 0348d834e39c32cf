"""faultfs: an in-memory FUSE filesystem for `make test-faults` (run under the cached fusepy venv).

Owns: the files written through its mount point, a log of every write, truncate, fsync and name
operation (the "boundaries" a power cut may fall between), and a control socket. Must not touch
anything outside its mount and its socket.

Durability model, strict and ext4-like: a file's bytes survive a power cut only as of its last
fsync/fdatasync; a fsync of any file or folder makes every name operation before it (create,
unlink, rename) durable. `-shm` files are never logged nor kept: a rebooted machine starts with
none that SQLite trusts.

Control (one JSON line in, one out, on the unix socket): ["ack", label] -> the log length now;
["acks"] ; ["len"] ; ["counts"] -> reads, writes; ["restore", k] -> the live files become what a
power cut after the first k logged operations leaves; ["reset"] -> empty, log cleared;
["mark"] / ["revert"] -> save and put back the live files; ["eio", "read"|"write", n] -> the
n-th read or write from now fails with EIO (once); ["rofs", bool] -> writes fail with EROFS;
["bad", path, start, end] -> every read of those bytes of that file fails with EIO (a bad
sector; ["bad", null] heals it).
Usage: faultfs.py MOUNTPOINT SOCKET [SUBTYPE [noshm]]; `noshm`: a -shm file cannot be mapped
(as on NFS or SMB, WAL's shared memory is not to be had: SQLite's WAL open fails).
"""

import errno
import json
import os
import socket
import stat
import sys
import threading
import time

from fuse import FUSE, FuseOSError, Operations

LOCK = threading.RLock()


class Node:
    def __init__(self, ino, is_dir=False):
        self.ino, self.is_dir, self.data = ino, is_dir, bytearray()
        self.mode = (stat.S_IFDIR | 0o755) if is_dir else (stat.S_IFREG | 0o644)
        self.mtime = time.time()


class FaultFS(Operations):
    def __init__(self, shm_mappable=True):
        self.shm_mappable = shm_mappable
        self.reset()

    def reset(self):
        self.next_ino = 2
        self.names = {"/": Node(1, True)}
        self.handles, self.next_fh = {}, 1
        self.log, self.acks = [], []
        self.reads = self.writes = 0
        self.eio = None  # (kind, count-at-which-to-fail)
        self.rofs = False
        self.bad = None  # (path, start, end): a bad sector, failing every read of it
        self.saved = None
        self.recorded = None  # the run a power cut is chosen in, kept while restores change files
        self.replayed = None  # (k, data, durable, names, durable_names) of the last cut replayed

    # -- the model --------------------------------------------------------------------------
    def _record(self, *entry):
        if not (len(entry) > 1 and isinstance(entry[1], str) and entry[1].endswith("-shm")):
            self.log.append(entry)

    def image(self, k):
        """{path: bytes} a power cut after the first k logged operations leaves (folders kept).
        Cuts asked in rising order go on from the last one's replay instead of from the start."""
        if self.replayed is None or self.replayed[0] > k:
            self.replayed = (0, {}, {}, {}, {})
        done, data, durable, names, durable_names = self.replayed
        for entry in self.recorded[done:k]:
            op = entry[0]
            if op in ("write", "truncate", "fsync") and entry[2] is not None \
                    and entry[2] not in data:
                continue  # a -shm file's, under a name it was not created with
            if op == "rename" and entry[1] not in names:
                continue
            if op == "create":
                _, path, ino = entry
                names[path] = ino
                data[ino], durable[ino] = bytearray(), b""
            elif op == "write":
                _, path, ino, off, buf = entry
                d = data[ino]
                if len(d) < off:
                    d.extend(b"\0" * (off - len(d)))
                d[off:off + len(buf)] = buf
            elif op == "truncate":
                _, path, ino, size = entry
                d = data[ino]
                del d[size:]
                d.extend(b"\0" * (size - len(d)))
            elif op == "fsync":
                _, path, ino = entry
                if ino is not None:
                    durable[ino] = bytes(data[ino])
                durable_names = dict(names)
            elif op == "unlink":
                names.pop(entry[1], None)
            elif op == "rename":
                _, old, new = entry
                names[new] = names.pop(old)
        self.replayed = (k, data, durable, names, durable_names)
        return {p: durable[i] for p, i in durable_names.items()}

    def load(self, files):
        dirs = {p: n for p, n in self.names.items() if n.is_dir}
        self.names = dict(dirs)
        for path, content in files.items():
            node = Node(self._ino())
            node.data = bytearray(content)
            self.names[path] = node
        # Start a fresh log whose base is this state, every file in it durable.
        self.log = [("create", p, n.ino) for p, n in self.names.items() if not n.is_dir]
        self.log += [("write", p, n.ino, 0, bytes(n.data)) for p, n in self.names.items()
                     if not n.is_dir]
        self.log += [("fsync", p, n.ino) for p, n in self.names.items() if not n.is_dir]
        self.acks = []

    def _ino(self):
        self.next_ino += 1
        return self.next_ino

    def _node(self, path):
        node = self.names.get(path)
        if node is None:
            raise FuseOSError(errno.ENOENT)
        return node

    def _fault(self, kind):
        if kind == "write" and self.rofs:
            raise FuseOSError(errno.EROFS)
        if kind == "read":
            self.reads += 1
            count = self.reads
        else:
            self.writes += 1
            count = self.writes
        if self.eio and self.eio[0] == kind and self.eio[1] == count:
            self.eio = None
            raise FuseOSError(errno.EIO)

    # -- FUSE operations ----------------------------------------------------------------------
    def getattr(self, path, fh=None):
        with LOCK:
            # With raw_fi, fh is the kernel's file info (an open, perhaps unlinked, file).
            node = self.handles.get(getattr(fh, "fh", None)) if fh is not None else None
            node = node or self._node(path)
            return {"st_mode": node.mode, "st_nlink": 2 if node.is_dir else 1,
                    "st_size": len(node.data), "st_ino": node.ino, "st_uid": 0, "st_gid": 0,
                    "st_mtime": node.mtime, "st_ctime": node.mtime, "st_atime": node.mtime,
                    "st_blksize": 4096, "st_blocks": (len(node.data) + 511) // 512}

    def readdir(self, path, fh):
        with LOCK:
            prefix = path.rstrip("/") + "/"
            kids = [p[len(prefix):] for p in self.names
                    if p != "/" and p.startswith(prefix) and "/" not in p[len(prefix):]]
            return [".", ".."] + kids

    def mkdir(self, path, mode):
        with LOCK:
            self._fault("write")
            self.names[path] = Node(self._ino(), True)

    def rmdir(self, path):
        with LOCK:
            self.names.pop(path, None)

    def chmod(self, path, mode):
        with LOCK:
            node = self._node(path)
            node.mode = (node.mode & ~0o7777) | (mode & 0o7777)

    def chown(self, path, uid, gid):
        return 0

    def utimens(self, path, times=None):
        return 0

    def statfs(self, path):
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 1 << 20, "f_bfree": 1 << 19,
                "f_bavail": 1 << 19, "f_files": 1 << 16, "f_ffree": 1 << 15, "f_namemax": 255}

    def _open_node(self, node, fi):
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = node
        fi.fh = fh
        # Every read and write reaches us; a direct-I/O file cannot be mapped shared, so a -shm
        # file is not direct unless it must not be mapped.
        fi.direct_io = 0 if self._is_shm(node) and self.shm_mappable else 1
        return 0

    def _is_shm(self, node):
        return any(p.endswith("-shm") for p, n in self.names.items() if n is node)

    def create(self, path, mode, fi=None):
        with LOCK:
            self._fault("write")
            node = Node(self._ino())
            self.names[path] = node
            self._record("create", path, node.ino)
            return self._open_node(node, fi)

    def open(self, path, fi):
        with LOCK:
            node = self._node(path)
            if fi.flags & os.O_TRUNC and node.data:
                node.data = bytearray()
                self._record("truncate", path, node.ino, 0)
            return self._open_node(node, fi)

    def release(self, path, fi):
        with LOCK:
            self.handles.pop(fi.fh, None)
        return 0

    def read(self, path, size, offset, fi):
        with LOCK:
            self._fault("read")
            if self.bad and path == self.bad[0] and offset < self.bad[2] \
                    and offset + size > self.bad[1]:
                raise FuseOSError(errno.EIO)
            node = self.handles.get(fi.fh) or self._node(path)
            return bytes(node.data[offset:offset + size])

    def write(self, path, buf, offset, fi):
        with LOCK:
            self._fault("write")
            node = self.handles.get(fi.fh) or self._node(path)
            if len(node.data) < offset:
                node.data.extend(b"\0" * (offset - len(node.data)))
            node.data[offset:offset + len(buf)] = buf
            node.mtime = time.time()
            self._record("write", path, node.ino, offset, bytes(buf))
            return len(buf)

    def truncate(self, path, length, fh=None):
        with LOCK:
            self._fault("write")
            node = self._node(path)
            del node.data[length:]
            node.data.extend(b"\0" * (length - len(node.data)))
            self._record("truncate", path, node.ino, length)

    def fsync(self, path, datasync, fi):
        with LOCK:
            self._fault("write")
            node = self.handles.get(fi.fh) or self._node(path)
            self._record("fsync", path, node.ino)
            return 0

    def fsyncdir(self, path, datasync, fi):
        with LOCK:
            self._record("fsync", path, None)
            return 0

    def flush(self, path, fi):
        return 0

    def unlink(self, path):
        with LOCK:
            self._fault("write")
            self._node(path)
            del self.names[path]
            self._record("unlink", path)

    def rename(self, old, new):
        with LOCK:
            self._fault("write")
            self.names[new] = self._node(old)
            del self.names[old]
            self._record("rename", old, new)

    # -- control ------------------------------------------------------------------------------
    def control(self, cmd):
        with LOCK:
            op = cmd[0]
            if op == "ack":
                self.acks.append((cmd[1], len(self.log)))
                return len(self.log)
            if op == "acks":
                return self.acks
            if op == "len":
                return len(self.log)
            if op == "kinds":
                return [e[0] for e in self.log]
            if op == "counts":
                return [self.reads, self.writes]
            if op == "restore":
                if self.recorded is None:
                    self.recorded = list(self.log)
                self.load(self.image(cmd[1]))
                return True
            if op == "reset":
                self.reset()
                return True
            if op == "mark":
                self.saved = {p: bytes(n.data) for p, n in self.names.items()
                              if not n.is_dir and not p.endswith("-shm")}
                return True
            if op == "revert":
                self.load(self.saved)
                return True
            if op == "eio":
                base = self.reads if cmd[1] == "read" else self.writes
                self.eio = None if cmd[2] is None else (cmd[1], base + cmd[2])
                return True
            if op == "bad":
                self.bad = tuple(cmd[1:4]) if cmd[1] else None
                return True
            if op == "rofs":
                self.rofs = bool(cmd[1])
                return True
            return "unknown command"


def serve(fs, sock_path):
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(8)

    def client(conn):
        with conn, conn.makefile("rw") as stream:
            for line in stream:
                try:
                    answer = fs.control(json.loads(line))
                except Exception as exc:  # noqa: BLE001 (the runner shows it)
                    answer = f"faultfs error: {type(exc).__name__}: {exc!r}"
                stream.write(json.dumps(answer) + "\n")
                stream.flush()

    while True:
        conn, _ = server.accept()
        threading.Thread(target=client, args=(conn,), daemon=True).start()


def main():
    mount, sock_path = sys.argv[1], sys.argv[2]
    subtype = sys.argv[3] if len(sys.argv) > 3 else "faultfs"
    fs = FaultFS(shm_mappable="noshm" not in sys.argv[4:])
    threading.Thread(target=serve, args=(fs, sock_path), daemon=True).start()
    FUSE(fs, mount, foreground=True, raw_fi=True, nothreads=False, allow_other=True,
         subtype=subtype, fsname="faultfs", attr_timeout=0, entry_timeout=0,
         negative_timeout=0, use_ino=True, hard_remove=True)


if __name__ == "__main__":
    main()
