"""Tokens and cost: the in-memory token queue and the session counters it feeds.

Owns the token columns of `sessions` and `session_model_usage`. The queue is
applied inside whichever write comes next (SessionDB's write path calls
`apply_token_batch`), by a read that must be exact, by close and at exit.
Never writes messages.
"""

import threading
import time

from hermes_state_common import (
    TOKEN_QUEUE_MAX_AGE,
    UPDATE_TOKEN_COUNTS_SQL,
    UPSERT_MODEL_USAGE_SQL,
    require_int,
    require_text,
)


class SessionUsageMixin:
    """SessionDB's methods for tokens and cost."""

    def update_token_counts(self, session_id, input_tokens=0, output_tokens=0, model=None,
                            cache_read_tokens=0, cache_write_tokens=0, reasoning_tokens=0,
                            api_call_count=0):
        """Add token counts to a session (and to its per-model usage row when `model` is given).

        Queued and applied with the next write, by any read that needs them
        exact, by close(), at interpreter exit, or when the queue is a second old.
        """
        counts = [require_int(name, value) for name, value in zip(
            TOKEN_FIELDS, (input_tokens, output_tokens, cache_read_tokens, cache_write_tokens,
                           reasoning_tokens, api_call_count))]
        require_text("model", model, allow_none=True)
        self._check_open()
        stale = self._tokens.is_stale()
        self._tokens.add(session_id, model, counts)
        if stale:
            self._flush_token_counts()

    def _flush_token_counts(self):
        """Apply queued token counts now, for a read that must see them."""
        if self._tokens and not self.read_only:
            self._execute_write(lambda conn: None)


TOKEN_FIELDS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
                "reasoning_tokens", "api_call_count")


class TokenQueue:
    """Token counts added up in memory, applied later in one write."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending = {}
        self._oldest = None

    def add(self, session_id, model, counts):
        with self._lock:
            totals = self._pending.setdefault((session_id, model), [0] * len(TOKEN_FIELDS))
            for i, value in enumerate(counts):
                totals[i] += value
            if self._oldest is None:
                self._oldest = time.monotonic()

    def is_stale(self):
        oldest = self._oldest
        return oldest is not None and time.monotonic() - oldest > TOKEN_QUEUE_MAX_AGE

    def __bool__(self):
        return bool(self._pending)

    def take(self):
        with self._lock:
            batch, self._pending, self._oldest = self._pending, {}, None
            return batch

    def put_back(self, batch):
        for (session_id, model), counts in batch.items():
            self.add(session_id, model, counts)


def apply_token_batch(conn, batch):
    now = time.time()
    for (session_id, model), counts in batch.items():
        conn.execute(UPDATE_TOKEN_COUNTS_SQL, (*counts, model, session_id))
        if model:
            conn.execute(UPSERT_MODEL_USAGE_SQL, (session_id, model, *counts[:5], counts[5], now, now))
