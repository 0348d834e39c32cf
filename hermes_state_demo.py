"""The demo's history: a small agent history (English and Chinese, tool calls, a compression
chain) written through the SessionDB it is given, for `python3 -m hermes_state demo`.

Writes only through SessionDB's public calls, as an agent would; never opens a store itself.
"""

import json

from hermes_state_common import COMPRESSION_END_REASON


def build_demo_history(db):
    """A small agent history: English and Chinese, tool calls, a compression chain."""
    prompt = "You are a helpful coding agent. 你是一个编程助手。"
    db.create_session("demo-refactor-1", "cli", model="demo-model", system_prompt=prompt,
                      cwd="/home/demo/app")
    db.set_session_title("demo-refactor-1", "Refactor the config loader")
    call = [{"id": "call_1", "type": "function",
             "function": {"name": "terminal", "arguments": json.dumps({"command": "pytest -q"})}}]
    db.append_message("demo-refactor-1", "user",
                      "Please refactor my-app.config.ts and run the tests.")
    db.append_message("demo-refactor-1", "assistant", "Running the test suite first.",
                      tool_calls=call)
    db.append_message("demo-refactor-1", "tool", "12 passed in 0.41s", tool_name="terminal",
                      tool_call_id="call_1")
    db.update_token_counts("demo-refactor-1", input_tokens=812, output_tokens=64,
                           model="demo-model")
    db.end_session("demo-refactor-1", COMPRESSION_END_REASON)
    db.create_session("demo-refactor-2", "cli", model="demo-model", system_prompt=prompt,
                      parent_session_id="demo-refactor-1")
    db.append_message("demo-refactor-2", "user", "[summary] Tests pass; now split the loader.")
    db.append_message("demo-refactor-2", "assistant", "Split into load() and validate().")
    db.create_session("demo-zh", "telegram", model="demo-model", system_prompt=prompt)
    db.set_session_title("demo-zh", "数据库迁移")
    db.append_message("demo-zh", "user",
                      "帮我检查一下数据库迁移脚本，会话历史不能丢。")
    db.append_message("demo-zh", "assistant", "好的，我先备份 state.db，再运行迁移。")
    db.end_session("demo-zh", "user_exit")
