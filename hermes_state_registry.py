"""One shared SessionDB per store file in this process, reference counted.

Owns the process's shared handles: hermes-agent's gateway, TUI, cron and in-process tools acquire()
the handle of a store path instead of opening their own, so that one process has one writer
connection (one close-time checkpoint, one token queue) per file. Never opens a store itself except
through SessionDB, and never touches a handle it did not lend.

The rules:
- acquire(path) lends the path's current handle and counts one reference; the first acquire opens
  it, outside the registry lock, while other acquirers of that path wait (one open, never two).
- close() on a lent handle returns one reference (SessionDB asks `_registry_release`); the last
  reference closes it for real. release_or_close() does the same for any handle, closing one the
  registry did not lend.
- When the file at the path is another file than the one the handle opened (a restore, a swap),
  the handle is retired: never lent again, still working for those holding it, closed with their
  last reference, and the next acquire opens the new file.
- A real close runs outside the registry lock, and the path's next open waits for it: a close-time
  checkpoint never runs beside a new writer on the same file. close_all() and close_all_under()
  return only when every close they started or found running has finished.
- A handle this module closed has `_shared_registry_owned` False; hermes-agent's caches test that.
"""

import contextlib
import logging
import os
import threading
from pathlib import Path

from hermes_state import SessionDB, _default_db_path
from hermes_state_lockguard import _file_key

logger = logging.getLogger("hermes_state")


class _Lent:
    """One handle the registry lends: its path, the file it opened, how many hold it."""

    __slots__ = ("db", "path", "identity", "refs")

    def __init__(self, db, path, identity):
        self.db, self.path, self.identity, self.refs = db, path, identity, 1


_changed = threading.Condition(threading.Lock())  # guards everything below; notified on each change
_lent = {}      # id(handle) -> _Lent: every handle not yet closed, current or retired
_current = {}   # path -> _Lent lent to new acquirers
_opening = set()  # paths whose handle is being opened
_closing = {}   # path -> how many real closes of its handles are running


def _forget_after_fork():
    """A forked child starts with no shared handles: the parent's connections are not the
    child's to use, and a lock another thread held at the fork would never be released."""
    global _changed
    _changed = threading.Condition(threading.Lock())
    for table in (_lent, _current, _opening, _closing):
        table.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _resolved(path):
    path = Path(path).expanduser()
    try:
        return path.resolve()
    except OSError:
        return path


def acquire(db_path=None):
    """The shared SessionDB of `db_path` (default: the home's state.db), counting one reference;
    give it back with close() or release_or_close(). Raises what SessionDB() raises, keeping
    nothing for the path then."""
    path = _resolved(_default_db_path() if db_path is None else db_path)
    with _changed:
        while True:
            lent = _current.get(path)
            if lent is not None:
                identity = _file_key(path)
                if identity is None or lent.identity is None or identity == lent.identity:
                    lent.refs += 1
                    return lent.db
                del _current[path]  # another file now: its holders keep it, nobody new gets it
                continue
            if path not in _opening and not _closing.get(path):
                _opening.add(path)
                break
            _changed.wait()
    try:
        db = SessionDB(path)
    except BaseException:
        with _changed:
            _opening.discard(path)
            _changed.notify_all()
        raise
    lent = _Lent(db, path, _file_key(path))
    db._registry_release = release
    with _changed:
        _opening.discard(path)
        _lent[id(db)] = _current[path] = lent
        _changed.notify_all()
    return db


def _forget(lent):
    """Stop lending `lent` and count its close as running (the caller holds _changed)."""
    _lent.pop(id(lent.db), None)
    if _current.get(lent.path) is lent:
        del _current[lent.path]
    _closing[lent.path] = _closing.get(lent.path, 0) + 1


def _close(lent):
    """Close `lent`'s handle for real (outside _changed), then let its path open again."""
    try:
        lent.db._registry_release = None
        lent.db.close()
    except Exception:  # one handle failing to close must not keep the others open
        logger.warning("closing the shared SessionDB of %s failed", lent.path, exc_info=True)
    finally:
        with _changed:
            _closing[lent.path] -= 1
            if not _closing[lent.path]:
                del _closing[lent.path]
            _changed.notify_all()


def release(db):
    """Give back one reference to a lent handle, closing it with the last; True. False, doing
    nothing, for a handle the registry does not lend (its owner closes it)."""
    with _changed:
        lent = _lent.get(id(db))
        if lent is None or lent.db is not db:
            return False
        lent.refs -= 1
        if lent.refs > 0:
            return True
        _forget(lent)
    _close(lent)
    return True


def release_or_close(db):
    """release(db), or db.close() for a handle the registry does not lend; None. A failing close
    is logged, never raised (a caller's cleanup path)."""
    if db is None or release(db):
        return
    try:
        db.close()
    except Exception:
        logger.debug("closing a SessionDB the registry did not lend failed", exc_info=True)


def _path_is_under(path, root):
    prefix = os.path.normcase(str(root)).rstrip(os.sep) + os.sep
    return os.path.normcase(str(path)).startswith(prefix)


def _close_where(selected):
    """Close every lent handle whose path `selected` accepts, whoever holds it; wait for those and
    for closes already running on such paths; return how many this call closed."""
    with _changed:
        chosen = [lent for lent in _lent.values() if selected(lent.path)]
        for lent in chosen:
            _forget(lent)
    for lent in chosen:
        _close(lent)
    with _changed:
        while any(selected(path) for path in _closing):
            _changed.wait()
    return len(chosen)


def close_all():
    """Close every shared handle, held or not (a gateway's shutdown, after its agents stopped);
    returns how many. Holders still using one find it reopening on use."""
    return _close_where(lambda path: True)


def close_all_under(directory):
    """Close every shared handle whose store lies in `directory` or below, held or not, so that the
    folder can be removed; returns how many (0 when none is open here)."""
    root = _resolved(directory)
    return _close_where(lambda path: path == root or _path_is_under(path, root))


def live_shared_session_dbs():
    """The handles lent to new acquirers now, references untouched (one may close meanwhile: use
    borrow_live_shared_session_dbs to keep them open)."""
    with _changed:
        return [lent.db for lent in _current.values()]


@contextlib.contextmanager
def borrow_live_shared_session_dbs():
    """`with borrow_live_shared_session_dbs() as dbs:` the current handles, each holding one
    reference of this block, so that none closes under maintenance; released at the block's end,
    also on error."""
    with _changed:
        borrowed = list(_current.values())
        for lent in borrowed:
            lent.refs += 1
    try:
        yield [lent.db for lent in borrowed]
    finally:
        for lent in reversed(borrowed):
            release(lent.db)


def stats():
    """{"live_generations", "retired_generations", "total_refcounts"}: the current handles, the
    retired ones still held, and the references to the current ones."""
    with _changed:
        return {"live_generations": len(_current),
                "retired_generations": len(_lent) - len(_current),
                "total_refcounts": sum(lent.refs for lent in _current.values())}
