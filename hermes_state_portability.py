"""SessionPortabilityMixin: sessions as portable objects.

Owns the export shapes: one session with its messages, and a compression
chain as one logical session. It reads through SessionDB's public readers
(`get_session`, `get_messages`, `get_compression_lineage`) and never writes.
It never imports hermes_state.
"""

from hermes_state_common import SELECT_LAST_ACTIVE_SQL


class SessionPortabilityMixin:
    """Export behaviour of SessionDB (see the module docstring)."""

    def export_session(self, session_id):
        """Every `sessions` column (system prompt resolved), `last_active`, and `messages`:
        the active rows in id order with `tool_calls` decoded. None for an unknown id."""
        session = self.get_session(session_id)
        if session is None:
            return None
        session["last_active"] = self._read_value(SELECT_LAST_ACTIVE_SQL, (session_id,))
        session["messages"] = self.get_messages(session_id)
        return session

    def export_session_lineage(self, session_id):
        """A compression chain as one session: the tip's fields, `segments` (each
        segment's export, root to tip), `lineage_session_ids`, every message in
        order, and `message_count` recomputed as their sum. None for an unknown id."""
        lineage = self.get_compression_lineage(session_id)
        if not lineage:
            return None
        segments = [self.export_session(segment_id) for segment_id in lineage]
        combined = {key: value for key, value in segments[-1].items() if key != "messages"}
        combined["segments"] = segments
        combined["lineage_session_ids"] = lineage
        combined["messages"] = [message for segment in segments for message in segment["messages"]]
        combined["message_count"] = len(combined["messages"])
        combined["tool_call_count"] = sum(segment.get("tool_call_count") or 0 for segment in segments)
        return combined
