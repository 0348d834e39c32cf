"""The PID namespace a lock or lease holder lives in.

A holder string such as `pid=123:pidns=4026531836:turn=...` names a pid that only means something
inside the PID namespace of the process that wrote it: two containers sharing a volume (or a
systemd unit with PrivatePIDs=) each see the other's pids as absent. hermes-agent stamps its
compression-lock and turn-lease holders with `holder_namespace_token()` and probes a recorded pid
only when `holder_pid_checkable` says the stamp is ours. Owns that stamp and that verdict; reads
/proc/self/ns/pid only, and touches no store.
"""

import os
import re
import sys

# `pidns=<digits>` as one `:`-separated field of a holder string.
_STAMP_RE = re.compile(r"(?:^|:)pidns=(\d+)(?::|$)")
# Our namespace, once read: a process cannot change its own PID namespace (setns applies to its
# children). A failed read is not kept, as it may pass.
_resolved = []


def _has_namespaces():
    return sys.platform.startswith("linux")


def pid_namespace_id():
    """This process's PID namespace, the inode number of /proc/self/ns/pid as text ('4026531836');
    None where there are no PID namespaces or the link cannot be read."""
    if _resolved:
        return _resolved[0]
    if not _has_namespaces():
        return None
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return None
    match = re.search(r"\[(\d+)\]", link)
    if match:
        _resolved.append(match.group(1))
    return match.group(1) if match else None


def holder_namespace_token():
    """':pidns=<id>' to append after `pid=<n>` in a new holder string; '' where the namespace is
    unknown (a holder never claims a namespace it cannot prove)."""
    namespace = pid_namespace_id()
    return f":pidns={namespace}" if namespace else ""


def _stamp(holder):
    match = _STAMP_RE.search(holder or "")
    return match.group(1) if match else None


def _checkable(recorded, unstamped):
    if not _has_namespaces():
        return True  # one namespace for every process: a pid is evidence on its own
    if recorded is None:
        return unstamped
    local = pid_namespace_id()
    return local is not None and recorded == local


def holder_pid_checkable(holder):
    """True if the `pid=` of holder string `holder` may be probed from here: stamped with this
    process's namespace, or on a platform without namespaces. An unstamped or foreign holder of a
    row with an expiry waits for that expiry instead (a wrong wait passes, a wrong reclaim ends a
    live turn)."""
    return _checkable(_stamp(holder), unstamped=False)


def persistent_record_pidns_checkable(recorded):
    """Like holder_pid_checkable for a record with no expiry, whose namespace `recorded` (None if
    unstamped) is kept apart: an unstamped one is probed, or it could never be cleaned up."""
    return _checkable(recorded, unstamped=True)
