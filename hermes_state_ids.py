"""Session ids: minting `YYYYMMDD_HHMMSS_<hex>` and recognising every shape hermes-agent mints.

Owns the id format. Standard library only and imports nothing of ours: hermes-agent's agent, CLI
and gateway mint ids without loading the store. Its lost-and-found salvage tells a session id from
any other cell with is_known_session_id, so a shape added to hermes-agent's minting belongs in
_KNOWN_SHAPES too.
"""

import os
import re
from datetime import datetime

# Interactive surfaces use 6 hex digits (the desktop app's id pattern expects 6), the gateway 8,
# imports 12: many of them share one second.
DEFAULT_HEX_LEN = 6

_STAMP = r"\d{8}_\d{6}"
_KNOWN_SHAPES = re.compile("|".join((
    _STAMP + "_.*",                                # new_session_id, any hex width
    r"cron_[A-Za-z0-9][A-Za-z0-9._-]*_" + _STAMP,  # a cron job's run: cron_<job id>_<time>
    r"bg_(?:\d{6}_)?[0-9a-f]{6}",                  # /bg: bg_<HHMMSS>_<hex6>, or bg_<hex6>
    r"room_[0-9a-f]{32}",                          # API server rooms: room_<sha256[:32]>
    r"api_\d{9,}_[0-9a-f]{8}",                     # API server sessions: api_<unix time>_<hex8>
    r"api-[0-9a-f]{16}",                           # chat completions: api-<sha256[:16]>
    r"run_[0-9a-f]{32}",                           # /v1/runs: run_<uuid4 hex>
    # ACP and /v1/responses: a canonical uuid4
    r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
)), re.DOTALL)


def new_session_id(now=None, *, hex_len=DEFAULT_HEX_LEN):
    """A fresh id: `now` (default: the local time now) as YYYYMMDD_HHMMSS, '_', and `hex_len`
    random lowercase hex digits. ValueError for a `hex_len` below 1."""
    if isinstance(hex_len, bool) or not isinstance(hex_len, int) or hex_len < 1:
        raise ValueError(f"hex_len must be a whole number of at least 1, not {hex_len!r}")
    stamp = (now or datetime.now()).strftime("%Y%m%d_%H%M%S")
    # os.urandom, as secrets.token_hex reads it (secrets loads hashlib's OpenSSL, hmac, random).
    return f"{stamp}_{os.urandom((hex_len + 1) // 2).hex()[:hex_len]}"


def is_known_session_id(value):
    """True when `value` is a string of a shape some part of hermes-agent mints as a session id;
    False for anything else."""
    return isinstance(value, str) and _KNOWN_SHAPES.fullmatch(value) is not None
