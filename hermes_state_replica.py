"""Read replicas: the store read on another machine through Litestream's VFS, live.

Owns: finding Litestream's loadable VFS extension (the optional `litestream-vfs` wheel, located
without importing it, or HERMES_STATE_LITESTREAM_VFS), loading it once per process, the connection
factory `SessionDB.open_replica` opens every store connection through (read-only, no file of its
own; one whose VFS stopped following the replica is replaced), and the one-line ReplicaError for
each way that fails: the extension is not installed, this
Python cannot load extensions, the replica is unreachable or holds no database. Must not touch: any
local store or file (a replica has no -wal, -shm, .lock or journal here, and nothing of ours writes
through the VFS), the schema, the journal policy, the locks or the repairs (a read-only open runs
none); it imports no other module of ours.
"""

import importlib.util
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

# The wheel's names for the library (its litestream_vfs.loadable_path() picks them the same way).
EXTENSION_FILES = {"linux": "litestream-vfs.so", "darwin": "litestream-vfs.dylib"}
EXTENSION_ENV = "HERMES_STATE_LITESTREAM_VFS"
# A read-only VFS open waits, polling, until the replica holds a first snapshot: it never fails on a
# replica that is empty, missing or out of reach. Ours gives up after this long with a ReplicaError.
OPEN_TIMEOUT_SECONDS = 20.0
# Explicit, so that LITESTREAM_WRITE_ENABLED or LITESTREAM_HYDRATION_ENABLED in the environment
# cannot make the VFS write a buffer, a hydrated copy or LTX files of ours.
_VFS_PARAMS = (("vfs", "litestream"), ("mode", "ro"), ("write_enabled", "false"),
               ("hydration_enabled", "false"))
# Per connection: sorts and temporary b-trees stay in memory (the VFS would put them in a temp
# folder of its own), and SQLite refuses any write before it reaches the VFS.
_CONNECTION_PRAGMAS = ("PRAGMA temp_store = MEMORY", "PRAGMA query_only = 1")
_CAN_LOAD_EXTENSIONS = "import sqlite3; sqlite3.Connection.enable_load_extension"
# A VFS connection stops following for good when a poll fails on the replica's layout (measured with
# 0.5.17: after a restart of `litestream replicate`, "poll L1: non-contiguous ltx file", while a
# fresh open reads every row). PRAGMA litestream_lag is the seconds since its last good poll (it
# polls every second): past STALL_SECONDS the connection is replaced, looked at every STALL_CHECK.
STALL_SECONDS = 10
STALL_CHECK_SECONDS = 2.0
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/opt/homebrew/bin/python3")

_loader = None  # the connection the extension was loaded through, kept open for the process's life
_loader_guard = threading.Lock()
logger = logging.getLogger("hermes_state")


class ReplicaError(RuntimeError):
    """A replica cannot be read: the message is one line saying why and what to do."""


def extension_path():
    """The path of the VFS library: HERMES_STATE_LITESTREAM_VFS, else the installed wheel's file."""
    override = os.environ.get(EXTENSION_ENV, "").strip()
    if override:
        if not Path(override).is_file():
            raise ReplicaError(f"{EXTENSION_ENV}={override}: no such file")
        return override
    spec = importlib.util.find_spec("litestream_vfs")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    name = EXTENSION_FILES.get("linux" if sys.platform.startswith("linux") else sys.platform)
    found = [Path(folder) / name for folder in folders if name and (Path(folder) / name).is_file()]
    if not found:
        raise ReplicaError(f"a replica is read through Litestream's VFS extension, which "
                           f"{sys.executable} does not have: pip install litestream-vfs")
    return str(found[0])


def _python_that_loads_extensions():
    """Another Python here whose sqlite3 loads extensions, or None (looked for only on failure)."""
    candidates = [shutil.which("python3"), *SYSTEM_PYTHONS]
    seen = {os.path.realpath(sys.executable)}
    for candidate in candidates:
        if not candidate or not os.path.exists(candidate) or os.path.realpath(candidate) in seen:
            continue
        seen.add(os.path.realpath(candidate))
        try:
            probe = subprocess.run([candidate, "-c", _CAN_LOAD_EXTENSIONS], capture_output=True,
                                   timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return candidate
    return None


def load_extension():
    """Register the `litestream` VFS in this process's SQLite, once; ReplicaError if it cannot."""
    global _loader
    with _loader_guard:
        if _loader is not None:
            return
        if not hasattr(sqlite3.Connection, "enable_load_extension"):
            other = _python_that_loads_extensions()
            raise ReplicaError(
                f"{sys.executable} cannot read a replica: its sqlite3 module was built without "
                "loadable extensions (no --enable-loadable-sqlite-extensions); "
                + (f"run it with {other}, which can" if other else
                   "use a Python built with them (most system Pythons are)"))
        path = extension_path()
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        try:
            conn.enable_load_extension(True)
            conn.load_extension(path)
            conn.enable_load_extension(False)
        except sqlite3.Error as exc:
            conn.close()
            raise ReplicaError(f"{sys.executable} could not load {path}: {exc}") from None
        _drop_auto_extension(path)
        _loader = conn  # kept open: the library stays mapped whatever SQLite does with extensions


def _drop_auto_extension(path):
    """Undo the auto-extension litestream-vfs 0.5.17 registers on load.

    SQLite runs it on every later open, and for a connection that is not on the VFS it fails: every
    ordinary connection of the process (the store's own ":memory:" scratch ones included) then
    raises "automatic extension loading failed" (measured; Litestream's later sources test for
    exactly this). The VFS stays registered without it, and its PRAGMAs (litestream_txid, ...) go
    through the VFS file itself. sqlite3_reset_auto_extension is not in the sqlite3 module, so it is
    called through ctypes, in the library _sqlite3 links (dlsym searches its dependencies)."""
    try:
        import ctypes
        import _sqlite3
        ctypes.CDLL(_sqlite3.__file__).sqlite3_reset_auto_extension()
    except (ImportError, OSError, AttributeError):
        pass  # the probe below says whether ordinary connections still open
    try:
        sqlite3.connect(":memory:").close()
    except sqlite3.Error as exc:
        raise ReplicaError(f"loading {path} broke ordinary SQLite connections in {sys.executable} "
                           f"({exc}) and its auto-extension could not be removed") from None


def replica_uri(url):
    """The SQLite URI that reads the replica at `url` through the VFS, read-only."""
    params = (("replica_url", url),) + _VFS_PARAMS
    return "file:state.db?" + "&".join(f"{key}={quote(value, safe='')}" for key, value in params)


def check_url(url):
    """`url` if it names a replica Litestream can read; ReplicaError otherwise. A file:// replica is
    looked at here (a folder with Litestream's ltx/ in it): the VFS would wait on it forever."""
    parts = urlsplit(url or "")
    if not parts.scheme or "://" not in url:
        raise ReplicaError(f"replica {url!r}: not a replica URL (s3://bucket/path, file:///path, "
                           "gs://, abs://, sftp://, ...)")
    if parts.scheme == "file":
        folder = Path(unquote(parts.path))
        if not (folder / "ltx").is_dir():
            raise ReplicaError(f"replica {url} holds no database: {folder} has no ltx/ folder "
                               "(point it at the path of a Litestream file replica)")
    return url


class ReplicaConnector:
    """The `connection_factory` of a replica SessionDB: every store connection reads the replica.

    SessionDB asks for its store by path; that target is ignored, the replica's URI is opened
    instead. Other targets (":memory:", the runtime probes) are plain connections.
    """

    def __init__(self, url, open_timeout=OPEN_TIMEOUT_SECONDS):
        self.replica_url = check_url(url)
        self.open_timeout = float(open_timeout)
        load_extension()

    def __call__(self, target, **kwargs):
        if target == ":memory:":
            return sqlite3.connect(target, **kwargs)
        kwargs["uri"] = True
        return FollowingConnection(lambda: self._open(replica_uri(self.replica_url), kwargs))

    def _open(self, uri, kwargs):
        """The VFS connection, opened in a thread so that a replica that never answers costs
        `open_timeout` seconds and a ReplicaError, not a hang (the thread is left to its wait)."""
        result = {}

        def connect():
            try:
                conn = sqlite3.connect(uri, **kwargs)
                for pragma in _CONNECTION_PRAGMAS:
                    conn.execute(pragma)
                conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # the first pages
                result["conn"] = conn
            except sqlite3.Error as exc:
                result["error"] = exc

        opener = threading.Thread(target=connect, name="replica-open", daemon=True)
        opener.start()
        opener.join(self.open_timeout)
        if "conn" in result:
            return result["conn"]
        if "error" in result:
            raise ReplicaError(f"replica {self.replica_url} cannot be read: {result['error']}") \
                from None
        raise ReplicaError(f"replica {self.replica_url} gave no database in "
                           f"{self.open_timeout:.0f}s: it is unreachable or holds no database yet")


class FollowingConnection:
    """A VFS connection that replaces itself, between statements, once the VFS has stopped
    following the replica (STALL_SECONDS without a good poll); otherwise the connection itself."""

    def __init__(self, open_connection):
        vars(self).update(_open=open_connection, _conn=open_connection(), _settings={},
                          _checked=time.monotonic())

    def __getattr__(self, name):
        return getattr(self._conn, name)

    def __setattr__(self, name, value):  # row_factory and the like, kept for a replacement
        self._settings[name] = value
        setattr(self._conn, name, value)

    def _following(self):
        now = time.monotonic()
        if now - self._checked < STALL_CHECK_SECONDS or self._conn.in_transaction:
            return self._conn
        vars(self)["_checked"] = now
        try:
            lag = int(self._conn.execute("PRAGMA litestream_lag").fetchone()[0])
        except (sqlite3.Error, TypeError, ValueError):  # a VFS without the PRAGMA: no stall check
            return self._conn
        if lag > STALL_SECONDS:
            self._replace(f"stalled {lag}s (the VFS stopped following)")
        return self._conn

    def _replace(self, why):
        """A fresh VFS connection in place of this one (True), or this one kept (False)."""
        try:
            fresh = self._open()
        except ReplicaError as exc:
            logger.warning("replica reader %s and could not reopen: %s", why, exc)
            return False
        for name, value in self._settings.items():
            setattr(fresh, name, value)
        stale, vars(self)["_conn"] = self._conn, fresh
        stale.close()
        logger.info("replica reader %s; reopened", why)
        return True

    def reopen_after(self, error):
        """True once a fresh connection replaces this one after `error`, a read's "malformed" or
        SQLite's bare "SQL logic error": around a restart of Litestream the VFS can hand one read
        pages of two states of the replica (replicate-test scenario 5, 2 of 3 runs), or fail a
        read with no word of its own (1 run in ~5 on CI's load; bad SQL names its fault instead),
        and a fresh connection reads one state. False for any other error, which the read raises
        as it is; the read is tried once more only, so a real fault still surfaces."""
        torn = "malformed" in str(error) or str(error) == "SQL logic error"
        if not torn or self._conn.in_transaction:
            return False
        return self._replace(f"read a torn page set ({error})")

    def execute(self, *args):
        return self._following().execute(*args)

    def executemany(self, *args):
        return self._following().executemany(*args)

    def cursor(self, *args):
        return self._following().cursor(*args)
