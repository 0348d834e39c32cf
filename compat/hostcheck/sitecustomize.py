"""The 0.20.1.2 host check of `make compat`'s end-to-end run: does a state layer hand a message dict back
to hermes-agent 0.20 with a `message_uid` key it did not have?

hermes-agent 0.22's state layer stamps `message_uid` on the message dicts a caller passes (its host keeps
them as live rows); 0.20's host never expects the key and may send the dict on to a provider. Python runs
this file at start-up when its folder is on PYTHONPATH (`e2e.py` puts it there, ref and swap alike, on
the 0.20 side) and `COMPAT_HOSTCHECK_LOG` names a file: every public or private method of
`hermes_state.SessionDB` is wrapped so that, after an outermost call, a dict argument (or one inside a
list argument) that gained `message_uid` is written to that file, one line each; `<file>.armed` says
the wrapping happened.

Owns: nothing but that log. Must not touch: the values passed or returned (the wrapper only looks).
"""

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types

LOG = os.environ.get("COMPAT_HOSTCHECK_LOG")
KEY = "message_uid"
_depth = threading.local()


def _note(line):
    with open(LOG, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


def _message_dicts(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, dict):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, dict):
                    yield item


def _wrap(name, fn):
    @functools.wraps(fn)
    def watched(self, *args, **kwargs):
        outermost = not getattr(_depth, "n", 0)
        before = [d for d in _message_dicts(args, kwargs) if KEY not in d] if outermost else []
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            return fn(self, *args, **kwargs)
        finally:
            _depth.n -= 1
            for message in before:
                if KEY in message:
                    _note("SessionDB.%s put message_uid on a %s message dict the host passed"
                          % (name, message.get("role", "role-less")))
    return watched


def _watch(module):
    cls = getattr(module, "SessionDB", None)
    if cls is None:
        return
    done = set()
    for klass in cls.__mro__:
        for name, value in list(vars(klass).items()):
            if name in done or name.startswith("__") or not isinstance(value, types.FunctionType):
                continue
            done.add(name)
            setattr(cls, name, _wrap(name, value))
    # Proof the check ran in this process: e2e.py fails an agent turn that leaves no such file.
    open(LOG + ".armed", "w").close()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `hermes_state` as the path finder would, and watches its SessionDB once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "hermes_state":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _watch(module)
        spec.loader.exec_module = exec_module
        return spec


if LOG:
    sys.meta_path.insert(0, _Finder())
