"""The differential API scenarios: SessionDB and module-level calls, written with the reference's names
and parameters (reference-api.json), run by `api_worker.py` on the reference and on ours.

Owns: the list of scenarios and the tiny notation for a step. Must not touch: any store (the worker
runs the steps). Add a scenario by appending to SCENARIOS; every step is compared, return value and
stored rows, so a scenario need not say what it expects.

A step is `c(method, *args, **kwargs)`; `save=` keeps its return under a name, and '@name' (or
'@name.key', '@name.0') in a later argument stands for it. `on=` calls a module-level name instead of
a SessionDB method ('hermes_state', 'hermes_state_common', or 'SessionDB' for the class); `attr=True`
reads an attribute instead of calling it. {'$exc': ['sqlite3.OperationalError', 'text']} builds an
exception argument.
"""

CONTROL = {"save", "on", "attr"}


def c(call, *args, **kwargs):
    step = {"call": call, "args": list(args)}
    for key in CONTROL:
        if key in kwargs:
            step[key] = kwargs.pop(key)
    step["kwargs"] = kwargs
    return step


def attr(name, on="db"):
    return {"call": name, "attr": True, "on": on}


def describe(step):
    """Return a one-line text of a step, for reports."""
    target = "" if step.get("on", "db") == "db" else step["on"] + "."
    if step.get("attr"):
        return target + step["call"]
    parts = [repr(a) if len(repr(a)) <= 40 else repr(a)[:37] + "..." for a in step.get("args", [])]
    parts += ["%s=%s" % (k, repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "...")
              for k, v in sorted(step.get("kwargs", {}).items())]
    return "%s%s(%s)" % (target, step["call"], ", ".join(parts))


TOOL_CALLS = [{"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"a\"}"}}]


def _chat(session="s1"):
    """Steps that make a session with a small user/assistant/tool exchange, ids saved as u1, a1, t1, a2."""
    return [
        c("create_session", session, "cli", model="model-a"),
        c("append_message", session, "user", "first question about banana", save="u1"),
        c("append_message", session, "assistant", None, tool_calls=TOOL_CALLS, finish_reason="tool_calls",
          save="a1"),
        c("append_message", session, "tool", "file text", tool_call_id="call_1", tool_name="read_file", save="t1"),
        c("append_message", session, "assistant", "answer about banana", finish_reason="stop", save="a2"),
    ]


SCENARIOS = [
    ("sessions-create-ensure-end", [
        c("create_session", "s1", "cli", model="model-a", system_prompt="You are a test.", user_id="u-1",
          model_config={"max_iterations": 5}),
        c("get_session", "s1"),
        c("create_session", "s1", "telegram", model="model-b"),
        c("get_session", "s1"),
        c("ensure_session", "s2"),
        c("get_session", "s2"),
        c("ensure_session", "s2", "cli", "model-c"),
        c("end_session", "s1", "user_exit"),
        c("get_session", "s1"),
        c("reopen_session", "s1"),
        c("get_session", "s1"),
        c("get_session", "missing"),
        c("session_count"),
        c("message_count"),
    ]),
    ("append-message-fields", [
        c("create_session", "s1", "cli"),
        c("append_message", "s1", "user", "hello"),
        c("append_message", "s1", "assistant", "hi", finish_reason="stop", reasoning="thought",
          reasoning_content="", reasoning_details=[{"type": "reasoning.text", "text": "step"}],
          codex_reasoning_items=[{"id": "rs_1", "type": "reasoning"}], token_count=5),
        c("append_message", "s1", "assistant", None, tool_calls=TOOL_CALLS, finish_reason="tool_calls"),
        c("append_message", "s1", "tool", "tool output", tool_call_id="call_1", tool_name="read_file"),
        c("append_message", "s1", "user", [{"type": "text", "text": "look at this"},
                                           {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]),
        c("append_message", "s1", "assistant", "shown", display_kind="note", display_metadata={"badge": "x"},
          platform_message_id="pm-1", observed=True, api_content="api text", timestamp=1700000000.5),
        c("append_message", "s1", "user", "positional", None, None, None, 3),
        c("append_message", "s1", "assistant", "lease", compression_lock_holder=None, turn_lease_holder=None,
          turn_lease_ttl_seconds=30.0),
        c("get_messages", "s1"),
        c("get_messages_as_conversation", "s1"),
        c("message_count", "s1"),
        c("get_session", "s1"),
    ]),
    ("append-message-edges", [
        c("append_message", "ghost", "user", "to a session never created"),
        c("get_session", "ghost"),
        c("create_session", "s1", "cli"),
        c("append_message", "s1", "user", ""),
        c("append_message", "s1", "user", None),
        c("append_message", "s1", "user", "x" * 5000),
        c("append_message", "s1", "user", "tool calls as text", tool_calls="[]"),
        c("append_message", "s1", "user", "bad role check", token_count=-1),
        c("append_message", "s1", None, "no role"),
        c("append_message", "s1", "user", 12345),
        c("get_messages", "s1"),
    ]),
    ("append-messages-batch", [
        c("create_session", "s1", "cli"),
        c("append_messages_batch", "s1", [
            {"role": "user", "content": "batch one"},
            {"role": "assistant", "content": None, "tool_calls": TOOL_CALLS, "finish_reason": "tool_calls",
             "reasoning": "r"},
            {"role": "tool", "content": "out", "tool_call_id": "call_1", "tool_name": "read_file"},
            {"role": "assistant", "content": "batch done", "finish_reason": "stop"},
        ], compression_lock_holder=None, turn_lease_holder=None, chunk_rows=2, turn_lease_ttl_seconds=60.0),
        c("append_messages_batch", "s1", []),
        c("append_messages_batch", "s1", [{"role": "user", "content": [{"type": "text", "text": "list"}]}]),
        c("get_messages", "s1"),
        c("get_messages_as_conversation", "s1"),
        c("get_session", "s1"),
    ]),
    ("get-messages-paging", _chat() + [
        c("append_message", "s1", "user", "second question", save="u2"),
        c("append_message", "s1", "assistant", "second answer", save="a3"),
        c("get_messages", "s1", limit=2),
        c("get_messages", "s1", limit=2, offset=2),
        c("get_messages", "s1", limit=2, latest=True),
        c("get_messages", "s1", after_id="@a1"),
        c("get_messages", "s1", False, False, 3, 1),
        c("get_messages", "s1", include_inactive=True, include_compacted=True),
        c("get_messages", "missing"),
        c("get_messages", "s1", limit=0),
        c("get_messages", "s1", limit=-1),
    ]),
    ("conversation-options", _chat() + [
        c("append_message", "s1", "user", "one"),
        c("append_message", "s1", "user", "two in a row"),
        c("get_messages_as_conversation", "s1"),
        c("get_messages_as_conversation", "s1", include_row_ids=True),
        c("get_messages_as_conversation", "s1", repair_alternation=True),
        c("get_messages_as_conversation", "s1", include_inactive=True),
        c("create_session", "s2", "cli", parent_session_id="s1"),
        c("append_message", "s2", "user", "child turn"),
        c("get_messages_as_conversation", "s2", include_ancestors=True),
        c("get_messages_as_conversation", "missing"),
    ]),
    ("token-counts", [
        c("create_session", "s1", "cli", model="model-a"),
        c("update_token_counts", "s1", 10, 5, model="model-a", cache_read_tokens=2, cache_write_tokens=1,
          reasoning_tokens=3, estimated_cost_usd=0.01, cost_status="estimated", cost_source="table",
          pricing_version="v1", billing_provider="custom", billing_base_url="http://127.0.0.1:1/v1",
          billing_mode="metered", api_call_count=1),
        c("get_session", "s1"),
        c("update_token_counts", "s1", 4, 4, actual_cost_usd=0.02, api_call_count=1),
        c("get_session", "s1"),
        c("update_token_counts", "s1", 100, 50, absolute=True),
        c("get_session", "s1"),
        c("update_token_counts", "s1", 1, 1, "model-a", 0, 0, 0, None, None, None, None, None, None, None, None, 2),
        c("get_session", "s1"),
        c("update_token_counts", "lazy", 7, 3, model="model-b"),
        c("get_session", "lazy"),
        c("queue_token_counts", "s1", input_tokens=3, output_tokens=2, api_call_count=1),
        c("flush_token_counts"),
        c("flush_token_counts", timeout=1.0),
        c("get_session", "s1"),
        c("record_auxiliary_usage", "s1", "title_generation", model="model-a", input_tokens=5, output_tokens=2),
        c("record_auxiliary_usage", "s1", "title_generation", model="model-a", billing_provider="custom",
          input_tokens=1, output_tokens=1, estimated_cost_usd=0.001, api_call_count=2),
        c("get_session", "s1"),
        c("update_token_counts", "s1", "ten", 1),
    ]),
    ("system-prompt", [
        c("create_session", "s1", "cli", system_prompt="Prompt A"),
        c("get_session", "s1"),
        c("update_system_prompt", "s1", "Prompt B"),
        c("get_session", "s1"),
        c("create_session", "s2", "cli", system_prompt="Prompt B"),
        c("update_system_prompt", "s1", None),
        c("get_session", "s1"),
        c("get_session", "s2"),
        c("update_system_prompt", "missing", "Prompt C"),
    ]),
    ("titles", [
        c("create_session", "s1", "cli"),
        c("create_session", "s2", "cli"),
        c("set_session_title", "s1", "My title"),
        c("get_session_title", "s1"),
        c("get_session_title_source", "s1"),
        c("set_session_title", "s2", "My title"),
        c("set_session_title", "s2", "  spaced\u200b   title\n\t"),
        c("get_session_title", "s2"),
        c("set_session_title", "s2", "x" * 200),
        c("set_session_title", "s2", "\u202ebidi\x00 ctl"),
        c("get_session_title", "s2"),
        c("set_session_title", "missing", "Nobody"),
        c("set_session_title_source", "s1", "llm"),
        c("get_session_title_source", "s1"),
        c("set_session_title_source", "s1", "bogus"),
        c("resolve_session_by_title", "My title"),
        c("resolve_session_by_title", "no such title"),
        c("get_session_by_title", "My title"),
        c("get_next_title_in_lineage", "My title"),
        c("create_session", "s3", "cli"),
        c("set_session_title", "s3", "My title #2"),
        c("get_next_title_in_lineage", "My title"),
        c("resolve_session_by_title", "My title"),
        c("set_session_title", "s1", ""),
        c("get_session_title", "s1"),
        c("sanitize_title", "\u202eabc\x00  d\u200b", on="SessionDB"),
        c("sanitize_title", None, on="SessionDB"),
        c("sanitize_title", "   ", on="SessionDB"),
        attr("MAX_TITLE_LENGTH"),
        attr("TITLE_SOURCE_USER"),
        attr("TITLE_SOURCE_LLM"),
        attr("TITLE_SOURCE_DERIVED"),
    ]),
    ("search", _chat() + [
        c("create_session", "s2", "telegram"),
        c("append_message", "s2", "user", "apple pie and banana bread"),
        c("append_message", "s2", "assistant", "\u9999\u8549 means banana"),
        c("search_messages", "banana"),
        c("search_messages", "banana", role_filter=["user"]),
        c("search_messages", "banana", source_filter=["telegram"]),
        c("search_messages", "banana", exclude_sources=["telegram"]),
        c("search_messages", "banana", limit=10000),
        c("search_messages", "banana", limit=1, offset=1),
        c("search_messages", "banana", sort="newest"),
        c("search_messages", "banana", fields=["session_id", "role"]),
        c("search_messages", "\u9999\u8549"),
        c("search_messages", "\"unbalanced"),
        c("search_messages", ""),
        c("search_messages", "banana", limit=0),
        c("search_sessions"),
        c("search_sessions", source="telegram"),
        c("search_sessions", limit=1, offset=1),
        c("list_sessions_rich"),
        c("list_sessions_rich", source="cli", limit=5),
        attr("_RESET_END_REASONS", on="hermes_state_common"),
    ]),
    ("rewind", _chat() + [
        c("append_message", "s1", "user", "second question", save="u2"),
        c("append_message", "s1", "assistant", "second answer"),
        c("rewind_to_message", "s1", "@u2"),
        c("get_messages", "s1"),
        c("get_messages_as_conversation", "s1"),
        c("get_session", "s1"),
        c("rewind_to_message", "s1", "@a1"),
        c("rewind_to_message", "s1", 99999),
        c("restore_rewound", "s1", "@u2"),
        c("get_messages", "s1"),
        c("rewind_to_message", "missing", 1),
    ]),
    ("compression-and-resume", _chat() + [
        c("get_compression_tip", "s1"),
        c("get_compression_tip", "unknown-id"),
        c("get_conversation_root", "s1"),
        c("resolve_resume_session_id", "s1"),
        c("end_session", "s1", "compression"),
        c("create_session", "s2", "cli", parent_session_id="s1"),
        c("append_message", "s2", "user", "continued"),
        c("get_compression_tip", "s1"),
        c("get_conversation_root", "s2"),
        c("resolve_resume_session_id", "s1"),
        c("append_message", "s1", "user", "late write to a closed segment"),
        c("get_resume_conversations", "s2"),
        c("search_sessions"),
        c("get_messages", "s1"),
    ]),
    ("archive-and-compact", _chat() + [
        c("archive_and_compact", "s1", [{"role": "user", "content": "summary of earlier turns"},
                                        {"role": "assistant", "content": "ok"}]),
        c("get_messages", "s1"),
        c("get_messages", "s1", include_compacted=True),
        c("get_messages_as_conversation", "s1"),
        c("get_session", "s1"),
    ]),
    ("delete-prune-export", _chat() + [
        c("create_session", "s2", "cli"),
        c("end_session", "s2", "user_exit"),
        c("export_session", "s1"),
        c("export_session", "missing"),
        c("delete_session", "missing"),
        c("delete_session", "s1"),
        c("get_messages", "s1"),
        c("prune_sessions", older_than_days=0),
        c("session_count"),
        c("message_count"),
    ]),
    ("persistence-errors", [
        c("classify_persistence_error", {"$exc": ["sqlite3.OperationalError", "database or disk is full"]},
          on="hermes_state"),
        c("classify_persistence_error", {"$exc": ["sqlite3.DatabaseError", "database disk image is malformed"]},
          on="hermes_state"),
        c("classify_persistence_error", {"$exc": ["sqlite3.OperationalError", "database is locked"]},
          on="hermes_state"),
        c("classify_persistence_error", "attempt to write a readonly database", on="hermes_state"),
        c("is_disk_full_error", {"$exc": ["sqlite3.OperationalError", "database or disk is full"]},
          on="hermes_state"),
        c("is_disk_full_error", "no", on="hermes_state"),
        c("is_malformed_db_error", {"$exc": ["sqlite3.DatabaseError", "file is not a database"]},
          on="hermes_state"),
        c("format_session_db_unavailable", on="hermes_state"),
        c("format_session_db_unavailable", "Custom prefix", on="hermes_state"),
        c("get_last_init_error", on="hermes_state"),
        attr("PERSISTENCE_ERROR_CAUSES", on="hermes_state"),
        attr("MAX_SAFE_RESUME_MESSAGES", on="hermes_state"),
        attr("MAX_SAFE_EXPORT_MESSAGES", on="hermes_state"),
        c("CompressionSessionClosedError", "s1", on="hermes_state"),
        c("SessionExportTooLargeError", "s1", 5, on="hermes_state"),
    ]),
]
