"""A fake OpenAI-compatible chat server for `make compat`: deterministic replies, on 127.0.0.1 only.

Owns: the HTTP side of the end-to-end run (`/v1/chat/completions` streaming and not, `/v1/models`),
the script of replies, and the log of what the client sent. Must not touch: any store, any network
address other than the loopback one it binds.

The reply depends only on the conversation it is sent, so the reference and our modules see the same
answers as long as they send the same conversation:
- the last message is a tool result: a fixed closing answer naming the tool;
- the last user message holds TOOL:read_file or TOOL:session_search: a call of that built-in tool
  (arguments taken from the prompt), with a reasoning text beside it;
- a request whose system prompt asks for a title: a title made from the first user words;
- hermes-agent's context-compression request: a fixed summary, or no text at all when the turns it
  summarises hold NOSUMMARY (a summary model that fails);
- anything else: "Reply to: <the user's words>" plus a reasoning text.
hermes-agent asks for a session's title from a daemon thread while the opening turn runs, and a one-shot
process can exit before that thread stores it. So the reply to an opening turn waits for its title to
be served, and TITLE_GRACE more, up to TITLE_WAIT: both sides then store the title, or both miss it.
`usage` counts are derived from the number of messages and words, never from the clock.

Run alone: `python3 fake_llm.py [--log FILE]` prints the port and serves until interrupted.
"""

import argparse
import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake-model"
SUMMARY = "Summary: the user asked about bananas and cherries and read big.txt, a list of numbered lines."
# Fixed so the stored rows do not depend on the clock.
CREATED = 1700000000
TITLE_WAIT = 5.0
TITLE_GRACE = 1.0


def _text(content):
    """Return the plain text of an OpenAI message content (a string or a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _words(text):
    return len(text.split())


def _last_user_text(messages):
    for message in reversed(messages):
        if message.get("role") == "user":
            return _text(message.get("content")).strip()
    return ""


def _is_title_request(body):
    fmt = ((body.get("response_format") or {}).get("json_schema") or {}).get("name", "")
    if "title" in fmt:
        return True
    messages = body.get("messages") or []
    system = " ".join(_text(m.get("content")) for m in messages if m.get("role") == "system")
    return not body.get("tools") and "title" in system.lower() and len(messages) <= 3


def _title_key(text):
    return " ".join(re.findall(r"[A-Za-z]+", text)[:4])


def _is_opening_turn(body):
    roles = [m.get("role") for m in body.get("messages") or []]
    return roles.count("user") == 1 and "assistant" not in roles and "tool" not in roles


def plan_reply(body):
    """Return (text, reasoning, tool_call) for a chat request body; tool_call is None or (name, args)."""
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    if last.get("role") == "tool":
        name = last.get("name") or "the tool"
        return "The tool %s answered; that is all." % name, None, None
    user = _last_user_text(messages)
    if _is_title_request(body):
        title = ("Title " + _title_key(user)).strip()
        if (body.get("response_format") or {}).get("type") in ("json_schema", "json_object"):
            return json.dumps({"title": title}), None, None
        return title, None, None
    if user.startswith("You are a summarization agent"):
        return ("" if "NOSUMMARY" in user else SUMMARY), None, None
    match = re.search(r"TOOL:(\w+)(?:\s+(\S+))?", user)
    if match:
        tool, arg = match.group(1), match.group(2) or ""
        if tool == "read_file":
            args = {"path": arg or "notes.txt"}
        elif tool == "session_search":
            args = {"query": arg or "banana"}
        else:
            args = {}
        return "", "I should call %s." % tool, (tool, args)
    return "Reply to: %s" % user, "Thinking about: %s" % user[:40], None


def usage_for(body, text, tool_call):
    messages = body.get("messages") or []
    prompt = 100 + 10 * len(messages)
    completion = _words(text) + (7 if tool_call else 0) + 1
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def _tool_call_id(body):
    # Deterministic per conversation length, so both runs store the same id.
    return "call_%d" % len(body.get("messages") or [])


class Handler(BaseHTTPRequestHandler):
    server_version = "fake-llm/1"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: the log file records requests
        pass

    def _send_json(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self, body):
        log = self.server.request_log
        if log is None:
            return
        with self.server.log_lock:
            log.write(json.dumps({"method": self.command, "path": self.path, "body": body}) + "\n")
            log.flush()

    def do_GET(self):
        self._record(None)
        path = self.path.split("?")[0].rstrip("/")
        if path.endswith("/models"):
            self._send_json(200, {"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": CREATED, "owned_by": "fake",
                 "context_length": 128000}]})
        elif path.endswith("/models/" + MODEL):
            self._send_json(200, {"id": MODEL, "object": "model", "created": CREATED, "owned_by": "fake"})
        else:
            self._send_json(404, {"error": {"message": "not found", "type": "not_found"}})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            self._record({"unparsed": raw[:200].decode("utf-8", "replace")})
            self._send_json(400, {"error": {"message": "bad json", "type": "invalid_request_error"}})
            return
        self._record(body)
        if not self.path.split("?")[0].rstrip("/").endswith("/chat/completions"):
            self._send_json(404, {"error": {"message": "not found", "type": "not_found"}})
            return
        text, reasoning, tool_call = plan_reply(body)
        usage = usage_for(body, text, tool_call)
        key = _title_key(_last_user_text(body.get("messages") or []))
        if _is_title_request(body):
            self._whole(body, text, reasoning, tool_call, usage)
            self.server.titles.served(key)
            return
        if _is_opening_turn(body) and self.server.titles is not None:
            self.server.titles.await_title(key)
        if body.get("stream"):
            self._stream(body, text, reasoning, tool_call, usage)
        else:
            self._whole(body, text, reasoning, tool_call, usage)

    def _tool_calls(self, body, tool_call):
        name, args = tool_call
        return [{"id": _tool_call_id(body), "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}}]

    def _whole(self, body, text, reasoning, tool_call, usage):
        message = {"role": "assistant", "content": text or None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if tool_call:
            message["tool_calls"] = self._tool_calls(body, tool_call)
        self._send_json(200, {
            "id": "chatcmpl-fake", "object": "chat.completion", "created": CREATED, "model": MODEL,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if tool_call else "stop"}],
            "usage": usage})

    def _stream(self, body, text, reasoning, tool_call, usage):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def chunk(delta, finish=None, with_usage=False):
            payload = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": CREATED,
                       "model": MODEL, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if with_usage:
                payload["usage"] = usage
            self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            self.wfile.flush()

        chunk({"role": "assistant", "content": ""})
        if reasoning:
            chunk({"reasoning_content": reasoning})
        # Two pieces, so the client really assembles a stream.
        if text:
            half = len(text) // 2
            chunk({"content": text[:half]})
            chunk({"content": text[half:]})
        if tool_call:
            call = self._tool_calls(body, tool_call)[0]
            chunk({"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                   "function": {"name": call["function"]["name"], "arguments": ""}}]})
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": call["function"]["arguments"]}}]})
        chunk({}, finish="tool_calls" if tool_call else "stop")
        if (body.get("stream_options") or {}).get("include_usage"):
            payload = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": CREATED,
                       "model": MODEL, "choices": [], "usage": usage}
            self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        else:
            chunk({}, with_usage=True)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


class TitleGate:
    """Counts, per opening words, the opening turns seen and the titles served, so a turn waits for its own."""

    def __init__(self):
        self.cond = threading.Condition()
        self.openings = {}
        self.titles = {}

    def served(self, key):
        with self.cond:
            self.titles[key] = self.titles.get(key, 0) + 1
            self.cond.notify_all()

    def await_title(self, key):
        with self.cond:
            wanted = self.openings[key] = self.openings.get(key, 0) + 1
            came = self.cond.wait_for(lambda: self.titles.get(key, 0) >= wanted, TITLE_WAIT)
            if not came:
                # No title asked for this turn (auto-title off): the next opening waits for its own.
                self.titles[key] = wanted
        if came:
            time.sleep(TITLE_GRACE)


def start(log_path=None, title_gate=True):
    """Return a running server on 127.0.0.1 at a free port (its `.server_address[1]`); stop it with `.shutdown()`.
    Without `title_gate`, an opening turn's reply waits for no title (a client that asks for none)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.request_log = open(log_path, "a", encoding="utf-8") if log_path else None
    server.log_lock = threading.Lock()
    server.titles = TitleGate() if title_gate else None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", help="append each request as a JSON line to this file")
    args = parser.parse_args(argv)
    server = start(args.log)
    print(server.server_address[1], flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
