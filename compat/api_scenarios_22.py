"""The differential API scenarios of hermes-agent 0.22's own names (reference-api-22.json): the shared
SessionDB registry, session ids, storage health and its user-facing copy, the error predicates, the
rewind of a user turn and message edits, the subagent/compacted/ancestor views, pins and prune counts.
`api_worker.py --release 0.22.2.post1` runs them on 0.22 on its own modules and on ours.

Owns: the list of 0.22 scenarios, in the notation of `api_scenarios.py` (c(), `save=`, '@name'), plus
`on='<module>'` for any module (imported at the step, so a module ours lacks fails only that step),
`on='@name'` to call a method of an object an earlier step saved (a registry's SessionDB), and
{"$datetime": ISO} for a datetime argument, {"$class": "module.Name"} for a class. Must not touch: any
store (the worker runs the steps).
"""

from api_scenarios import _chat, c

REG = "hermes_state_registry"
STORE = {"$path": "state.db"}
LOCKED = {"$exc": ["sqlite3.OperationalError", "database is locked"]}
FULL = {"$exc": ["sqlite3.OperationalError", "database or disk is full"]}
MALFORMED = {"$exc": ["sqlite3.DatabaseError", "database disk image is malformed"]}


def _two_turns(session="s1"):
    """A session of two user turns (the first with a tool exchange): rows u1, a1, t1, a2, u2, a3."""
    return _chat(session) + [
        c("append_message", session, "user", "second question about cherries", save="u2"),
        c("append_message", session, "assistant", "cherries are red", finish_reason="stop", save="a3"),
    ]


SCENARIOS = [
    ("registry-sharing", [
        c("acquire", STORE, on=REG, save="r1"),
        c("acquire", STORE, on=REG, save="r2"),
        c("is_", "@r1", "@r2", on="operator"),
        c("create_session", "r-1", "cli", model="model-a", on="@r1"),
        c("append_message", "r-1", "user", "through the registry", on="@r2"),
        c("release_or_close", "@r1", on=REG),
        c("get_session", "r-1", on="@r2"),
        c("release_or_close", "@r2", on=REG),
        c("acquire", STORE, on=REG, save="r3"),
        c("is_", "@r1", "@r3", on="operator"),
        c("message_count", "r-1", on="@r3"),
        # close() on a borrowed instance gives its reference back.
        c("close", on="@r3"),
        c("acquire", {"$path": "other/state.db"}, on=REG, save="o1"),
        c("create_session", "o-1", "cli", on="@o1"),
        c("close_all_under", {"$path": "other"}, on=REG),
        c("acquire", {"$path": "other/state.db"}, on=REG, save="o2"),
        c("is_", "@o1", "@o2", on="operator"),
        c("get_session", "o-1", on="@o2"),
        c("close_all", on=REG),
    ]),
    ("ids", [
        c("new_session_id", {"$datetime": "2026-01-02T03:04:05"}, on="hermes_state_ids", save="id6"),
        c("is_known_session_id", "@id6", on="hermes_state_ids"),
        c("new_session_id", hex_len=8, on="hermes_state_ids", save="id8", shape=True),
        c("fullmatch", r"\d{8}_\d{6}_[0-9a-f]{8}", "@id8", on="re"),
        c("is_known_session_id", "@id8", on="hermes_state_ids"),
        c("is_known_session_id", "not-an-id", on="hermes_state_ids"),
        c("is_known_session_id", "20260102_030405_abcdef", on="hermes_state_ids"),
        c("create_session", "@id6", "cli"),
        c("resolve_session_id", "@id6"),
    ]),
    ("errors-health-copy", [
        c("is_disk_full_error", FULL, on="hermes_state_errors"),
        c("is_disk_full_error", "database or disk is full", on="hermes_state_errors"),
        c("is_disk_full_error", None, on="hermes_state_errors"),
        c("is_sqlite_lock_error", LOCKED, on="hermes_state_errors"),
        c("is_transient_sqlite_error", LOCKED, on="hermes_state_errors"),
        c("is_malformed_db_error", MALFORMED, on="hermes_state_errors"),
        c("classify_persistence_error", FULL, on="hermes_state_errors"),
        c("classify_persistence_error", MALFORMED, on="hermes_state_errors"),
        c("classify_persistence_error", "attempt to write a readonly database", on="hermes_state_errors"),
        c("PERSISTENCE_ERROR_CAUSES", on="hermes_state_errors", attr=True),
        c("STORAGE_RECOVERY_DOCS_URL", on="hermes_state_errors", attr=True),
        c("SessionActiveWriteGuardError", on="hermes_state_errors", attr=True, save="guard"),
        c("issubclass", "@guard", {"$class": "builtins.Exception"}, on="builtins"),
        c("storage_state", STORE, on="hermes_state_health"),
        c("note_storage_error", STORE, LOCKED, on="hermes_state_health"),
        c("storage_state", STORE, on="hermes_state_health"),
        c("note_storage_error", STORE, MALFORMED, on="hermes_state_health"),
        c("storage_state", STORE, on="hermes_state_health"),
        c("STORAGE_CORRUPT", on="hermes_state_health", attr=True),
        c("describe_storage_failure", FULL, on="hermes_state_user_copy"),
        c("describe_storage_failure", LOCKED, on="hermes_state_user_copy"),
        c("describe_storage_failure", "attempt to write a readonly database", on="hermes_state_user_copy"),
        c("storage_failure_details", MALFORMED, on="hermes_state_user_copy"),
        c("storage_failure_details", "x" * 400, limit=50, on="hermes_state_user_copy"),
        c("format_session_db_unavailable", on="hermes_state"),
        c("format_session_db_unavailable", details=True, on="hermes_state"),
        c("format_session_db_unavailable", "Sessions are unavailable", on="hermes_state"),
    ]),
    ("rewind-user-turn", _two_turns() + [
        c("latest_conversation_role", "s1"),
        c("display_message_count", "s1"),
        c("count_messages_all", "s1"),
        c("rewind_user_turn", "s1", 2),
        c("get_messages_as_conversation", "s1"),
        c("get_messages", "s1", include_inactive=True),
        c("get_active_message_ids", "s1"),
        c("rewind_user_turn", "s1", 9),
        c("rewind_user_turn", "missing", 1),
        c("rewind_user_turn", "s1", 1, require_retryable=True),
        c("latest_conversation_role", "s1"),
    ]),
    ("message-edits", _two_turns() + [
        c("set_user_message_content", "s1", "@u1", "first question, edited"),
        c("set_user_message_content", "s1", "@a2", "not a user row"),
        c("set_user_message_content", "s1", "@u2", [{"type": "text", "text": "list content"}]),
        c("get_messages", "s1"),
        c("deactivate_message", "s1", "@a3"),
        c("get_messages_as_conversation", "s1", include_row_ids=True),
        c("display_message_count", "s1"),
    ]),
    ("views-subagents-compacted-ancestors", _chat("p1") + [
        c("create_session", "sub-1", "cli", parent_session_id="p1", model_config={"_delegate_from": "p1"}),
        c("append_message", "sub-1", "user", "delegated task"),
        c("create_session", "br-1", "cli", parent_session_id="p1", model_config={"_branched_from": "p1"}),
        c("list_sessions_rich"),
        c("list_sessions_rich", include_subagents=True),
        c("list_sessions_rich", include_children=True),
        c("archive_and_compact", "p1", [{"role": "user", "content": "summary of the talk"},
                                        {"role": "assistant", "content": "compacted answer"}]),
        c("get_messages", "p1"),
        c("get_messages", "p1", include_compacted=True),
        c("get_messages_as_conversation", "p1", include_compacted=True),
        c("end_session", "p1", "compression"),
        c("create_session", "p2", "cli", parent_session_id="p1"),
        c("append_message", "p2", "user", "after the compression"),
        c("get_messages", "p2", include_ancestors=True),
        c("get_messages_as_conversation", "p2", include_ancestors=True),
        c("get_compression_chain", "p2"),
        c("list_sessions_rich", include_children=True, include_subagents=True),
    ]),
    ("pins-prune-delete", _chat("k1") + _chat("k2") + [
        c("create_session", "k3", "telegram"),
        c("end_session", "k1", "user_exit"),
        c("end_session", "k2", "user_exit"),
        c("end_session", "k3", "user_exit"),
        c("set_session_pinned", "k1", True),
        c("set_session_pinned", "missing", True),
        c("list_sessions_rich", include_pinned=True),
        c("count_prune_matches", None, "cli"),
        c("count_prune_matches", None, "cli", pinned_only=True),
        c("count_prune_matches", 0),
        c("assert_exports_safe", ["k1", "k2"]),
        c("assert_exports_safe", ["k1"], max_messages=1),
        c("search_sessions", source="cli"),
        c("prune_sessions", 0, "cli", exclude_active_write_guards=True),
        c("session_count"),
        c("session_count", source="telegram"),
        c("unarchive_recoverable_session", "k3"),
        c("delete_session", "k1", exclude_active_write_guards=True),
        c("delete_session", "k3", include_compression_chain=True),
        c("session_count"),
    ]),
]
