"""`python -m hermes_state serve`: a local HTTP API over SessionDB, and a page to browse it.

Owns the HTTP side only: routing, the bearer-token and Host checks, socket
timeouts and the connection limit, body limits, JSON errors, and the
self-contained browser page. Every answer is a SessionDB call (list, export,
search, import_sessions, backup, restore_home); nothing here touches SQL.
Session import (`/api/sessions/import`) and whole-home restore
(`/api/ops/import`) stay two different endpoints.
"""

import base64
import collections
import contextlib
import hmac
import ipaddress
import json
import re
import secrets
import socket
import sys
import tempfile
import threading
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from hermes_state import SessionDB, restore_home
from hermes_state_portability import json_default
from hermes_state_search import GRAMMAR_BOOLEAN

MAX_BODY_BYTES = 25 * 1024 * 1024
DEFAULT_PORT = 8765
PAGE_LIMIT_MAX = 200
# The shortest HERMES_STATE_TOKEN taken; the generated one has 43 characters (256 bits).
TOKEN_MIN_CHARS = 32
# A socket silent this long is dropped: an idle keep-alive connection, or a body that stalls.
READ_TIMEOUT_SECONDS = 10
# A request line, its headers and its body must all have arrived by then, so that a
# client sending a byte now and then cannot keep its thread either.
REQUEST_READ_SECONDS = 60
# Connections served at once (a thread each); one more is answered 503 and closed.
MAX_CONNECTIONS = 32

Response = collections.namedtuple("Response", "status body content_type headers")


class ApiError(Exception):
    """An error answered as {"error": message} with an HTTP status."""

    def __init__(self, status, message, **extra):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


class ReadWriteGate:
    """Many requests at once (`shared`), or one whole-home restore alone (`exclusive`)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False

    @contextlib.contextmanager
    def shared(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._writing = True
            self._cond.wait_for(lambda: self._readers == 0)
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


def is_loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _whole_number(text, digits=18):
    """`text` as an int if it is 1 to `digits` ASCII digits, else None ("²" is a digit to
    str.isdigit but not to int)."""
    return int(text) if re.fullmatch(rf"[0-9]{{1,{digits}}}", text) else None


def _int_param(query, name, default, maximum):
    value = _whole_number(query.get(name, [str(default)])[-1])
    if value is None or value > maximum:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{name} must be an integer from 0 to {maximum}")
    return value


def loggable(text, limit=1000):
    """`text` fit for one log line: control characters, line breaks and backslashes
    escaped, cut at `limit` characters."""
    text = text[:limit] + ("…" if len(text) > limit else "")
    return "".join(ch if ch.isprintable() and ch != "\\"
                   else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


class StateServer(ThreadingHTTPServer):
    """The HTTP server: one SessionDB shared by at most `max_connections` request threads."""

    daemon_threads = True

    def __init__(self, db_path=None, host="127.0.0.1", port=DEFAULT_PORT, token=None,
                 allow_remote=False, read_only=False, db=None):
        host = host.strip("[]")  # `--host [::1]`, as a URL writes it, is the address ::1
        if ":" in host:  # socketserver binds IPv4 unless told
            self.address_family = socket.AF_INET6
        if not is_loopback(host) and not allow_remote:
            raise ValueError(f"refusing to listen on {host}: not a loopback address; "
                             "pass --allow-remote to expose the store beyond this machine")
        if token and len(token) < TOKEN_MIN_CHARS:
            raise ValueError(f"the token (HERMES_STATE_TOKEN) is {len(token)} characters; "
                             f"the minimum is {TOKEN_MIN_CHARS}")
        self.token = token or secrets.token_urlsafe(32)
        self.read_timeout = READ_TIMEOUT_SECONDS
        self.request_read_seconds = REQUEST_READ_SECONDS
        self.max_connections = MAX_CONNECTIONS
        self._connections = 0
        self._connections_lock = threading.Lock()
        self.gate = ReadWriteGate()
        self.log_stream = sys.stderr
        # `serve` without --writable: no import, no restore, no DDL; `db`: an open store
        # (a replica's)
        self.db = SessionDB(db_path, read_only=read_only) if db is None else db
        self.read_only = read_only or self.db.read_only
        self.db_path = self.db.db_path
        try:
            super().__init__((host, port), ApiHandler)
        except BaseException:
            self.db.close()
            raise

    @property
    def url(self):
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/"

    @property
    def open_connections(self):
        """How many connections are being served now."""
        return self._connections

    def host_allowed(self, header):
        """True if a request's Host header names an address this server listens on, with
        its port: a page on another site that renamed itself to 127.0.0.1 (DNS rebinding)
        still sends its own name."""
        try:
            parts = urlsplit("//" + (header or ""))
            name, port = parts.hostname, parts.port or 80
        except ValueError:
            return False
        if not name or parts.netloc != header or "@" in header or port != self.server_address[1]:
            return False
        bound = ipaddress.ip_address(self.server_address[0])
        if name == "localhost":
            return bound.is_loopback or bound.is_unspecified
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return False
        if bound.is_unspecified:
            return True
        return address.is_loopback if bound.is_loopback else address == bound

    def process_request(self, request, client_address):
        """A thread for the connection while fewer than `max_connections` are served; else a 503."""
        with self._connections_lock:
            busy = self._connections >= self.max_connections
            self._connections += not busy
        if busy:
            self._refuse_busy(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._connection_ended()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connection_ended()

    def _connection_ended(self):
        with self._connections_lock:
            self._connections -= 1

    def _refuse_busy(self, request):
        error = (f"the server already serves {self.max_connections} connections; "
                 "retry in a moment")
        body = json.dumps({"error": error}).encode("utf-8")
        head = ("HTTP/1.1 503 Service Unavailable\r\n"
                "Content-Type: application/json; charset=utf-8\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Retry-After: 1\r\n"
                "Connection: close\r\n\r\n").encode("ascii")
        self.log_stream.write(f"{time.strftime('%d/%b/%Y %H:%M:%S')} - - 503 (connection limit)\n")
        try:
            request.settimeout(0.2)
            request.sendall(head + body)
            request.shutdown(socket.SHUT_WR)
            # Read what the client sent before closing: closing over unread data would reset
            # the connection and could discard the answer. Bounded, as this is the accept loop.
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline and request.recv(65536):
                pass
        except OSError:
            pass
        finally:
            request.close()

    def handle_error(self, request, client_address):
        """A client that went away mid-request is nobody's error; anything else is logged
        to the server's log, not printed to the terminal."""
        error = sys.exc_info()[1]
        if not isinstance(error, (ConnectionError, TimeoutError, socket.timeout)):
            self.log_stream.write(
                f"error while serving {client_address[0]}: {traceback.format_exc()}")

    def restore(self, archive_path, force):
        """Swap the whole home while no request runs, then reopen the store."""
        if self.db.read_only:
            raise PermissionError(f"{self.db_path} is open read-only: restore through "
                                  "`serve --writable` on the primary")
        with self.gate.exclusive():
            self.db.close()
            try:
                return restore_home(archive_path, self.db_path, force=force)
            finally:
                self.db = SessionDB(self.db_path, read_only=self.read_only)

    def server_close(self):
        super().server_close()
        self.db.close()


def json_response(value, status=HTTPStatus.OK, headers=None):
    """`value` as a JSON Response (a BLOB as the export writes it, see json_default)."""
    body = json.dumps(value, ensure_ascii=False, default=json_default).encode("utf-8")
    return Response(status, body, "application/json; charset=utf-8", headers or {})


class ApiHandler(BaseHTTPRequestHandler):
    """Routes, the token and Host checks, timeouts, body limits and JSON errors.

    A request is read whole (headers, then the body) before it enters the server's
    gate, and its answer is written after it leaves: a slow client holds its own
    thread only, never a restore or the other requests.
    """

    server_version = "hermes_state"
    protocol_version = "HTTP/1.1"

    # For a path several routes match (/api/sessions/import names a session too), the first
    # route that takes the method wins.
    ROUTES = (
        (re.compile(r"^/$"), {"GET": "page"}),
        (re.compile(r"^/api/sessions$"), {"GET": "list_sessions"}),
        (re.compile(r"^/api/sessions/import$"), {"POST": "import_sessions"}),
        (re.compile(r"^/api/sessions/(?P<session_id>[^/]+)$"), {"GET": "show_session"}),
        (re.compile(r"^/api/search$"), {"GET": "search"}),
        (re.compile(r"^/api/ops/export$"), {"GET": "ops_export"}),
        (re.compile(r"^/api/ops/import$"), {"POST": "ops_import"}),
    )

    def setup(self):
        self.timeout = self.server.read_timeout  # a socket timeout on every read and write
        super().setup()

    def handle_one_request(self):
        self._watchdog = threading.Timer(self.server.request_read_seconds, self._stop_reading)
        self._watchdog.daemon = True
        self._watchdog.start()
        try:
            super().handle_one_request()
        finally:
            self._watchdog.cancel()

    def _stop_reading(self):
        """The request took too long to arrive: end the reads that wait for the rest of it."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RD)

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def do_PATCH(self):
        self._dispatch("PATCH")

    def log_message(self, fmt, *args):
        """Method, path and status only: no query strings, no headers, so no token in a log line."""

    def log_request(self, code="-", size="-"):
        # http.server also logs requests it could not parse (a request line over 64 KiB
        # has no path), and the method and path may hold any character.
        path = urlsplit(getattr(self, "path", "") or "").path
        self.server.log_stream.write(
            f"{self.log_date_time_string()} {loggable(self.command or '-')} "
            f"{loggable(path or '-')} {getattr(code, 'value', code)}\n")

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (a bad or too long request line, too many headers,
        an unknown method) as JSON, like every other error."""
        self.close_connection = True
        reason = self.responses.get(code, ("error",))[0]
        self._send(json_response({"error": message or reason}, code, {"Connection": "close"}))

    def _dispatch(self, method):
        self._body_read = False
        try:
            if len(self.headers.get_all("Host") or ()) > 1:
                # RFC 9112 3.2: a request with more than one Host is answered 400, never
                # judged by the first (a proxy may route by the other).
                raise ApiError(HTTPStatus.BAD_REQUEST, "more than one Host header")
            if not self.server.host_allowed(self.headers.get("Host")):
                raise ApiError(HTTPStatus.MISDIRECTED_REQUEST,
                               f"Host {self.headers.get('Host')!r} is not an address "
                               "this server listens on")
            parts = urlsplit(self.path)
            handler, params = self._route(method, parts.path)
            if handler != "page":
                self._check_token()
            if method == "POST" and self.server.read_only:
                raise ApiError(HTTPStatus.FORBIDDEN, "this server is read-only; start it with "
                               "`python3 -m hermes_state serve --writable` to import or restore")
            query = parse_qs(parts.query, keep_blank_values=True)
            args = (query, self._read_json()) if method == "POST" else (query,)
            self._watchdog.cancel()  # the request is in; answering it may take as long as it takes
            if handler == "ops_import":  # the restore takes the gate itself, alone
                response = getattr(self, handler)(*args, **params)
            else:
                with self.server.gate.shared():
                    response = getattr(self, handler)(*args, **params)
            self._send(response)
        except ApiError as exc:
            headers = exc.extra.pop("headers", None)
            self._send(json_response({"error": exc.message, **exc.extra}, exc.status, headers))
        except Exception as exc:  # an answer, never a dropped connection
            self.server.log_stream.write(f"internal error on {loggable(self.command)} "
                                         f"{loggable(urlsplit(self.path).path)}: {exc!r}\n")
            self._send(json_response({"error": "internal error; see the server's log"},
                                     HTTPStatus.INTERNAL_SERVER_ERROR))
        finally:
            if not self._body_read and (self.headers.get("Content-Length", "0") != "0"
                                        or "Transfer-Encoding" in self.headers):
                # An unread body must not be taken for the next request.
                self.close_connection = True

    def _route(self, method, path):
        allowed = []
        for pattern, methods in self.ROUTES:
            match = pattern.match(path)
            if match and method in methods:
                return methods[method], {k: unquote(v) for k, v in match.groupdict().items()}
            if match:
                allowed += [m for m in methods if m not in allowed]
        if allowed:
            raise ApiError(HTTPStatus.METHOD_NOT_ALLOWED, f"{method} is not allowed on {path}",
                           headers={"Allow": ", ".join(allowed)})
        raise ApiError(HTTPStatus.NOT_FOUND, f"no such path: {path}")

    def _check_token(self):
        header = self.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 self.server.token.encode()):
            raise ApiError(HTTPStatus.UNAUTHORIZED,
                           "a valid 'Authorization: Bearer <token>' header is required",
                           headers={"WWW-Authenticate": "Bearer"})

    def _read_json(self):
        """The request body as JSON, refused before reading when it is over MAX_BODY_BYTES."""
        header = self.headers.get("Content-Length")
        if header is None:
            raise ApiError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
        length = _whole_number(header)
        if length is None:
            raise ApiError(HTTPStatus.BAD_REQUEST,
                           f"Content-Length must be a number of bytes, not {header!r}")
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                           f"the body is {length} bytes; the limit is {MAX_BODY_BYTES}")
        chunks, received = [], 0
        try:
            while received < length:
                chunk = self.rfile.read1(min(length - received, 1 << 16))
                if not chunk:
                    break
                chunks.append(chunk)
                received += len(chunk)
        except OSError:  # the socket timed out, or the watchdog ended the read
            pass
        body = b"".join(chunks)
        self._body_read = True
        if len(body) < length:
            self.close_connection = True
            raise ApiError(HTTPStatus.REQUEST_TIMEOUT,
                           f"the body stopped after {len(body)} of {length} bytes")
        try:
            return json.loads(body.decode("utf-8"))
        except RecursionError:
            raise ApiError(HTTPStatus.BAD_REQUEST, "malformed JSON: nested too deep") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"malformed JSON: {exc}") from None

    def _send(self, response):
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.end_headers()
        # The socket timeout bounds each write; in 1 MiB pieces, a large answer to a reader
        # that keeps reading is not cut, and one to a reader that stopped still ends.
        body = memoryview(response.body)
        for start in range(0, len(body), 1 << 20):
            self.wfile.write(body[start:start + (1 << 20)])

    # -- endpoints: each returns a Response, written after the gate is left -------

    def page(self, query):
        nonce = secrets.token_urlsafe(16)
        body = PAGE_HTML.replace("{nonce}", nonce).encode("utf-8")
        return Response(HTTPStatus.OK, body, "text/html; charset=utf-8", {
            "Content-Security-Policy": f"default-src 'none'; script-src 'nonce-{nonce}'; "
                                       "style-src 'unsafe-inline'; connect-src 'self'; "
                                       "base-uri 'none'; form-action 'none'; "
                                       "frame-ancestors 'none'"})

    def list_sessions(self, query):
        limit = _int_param(query, "limit", 50, PAGE_LIMIT_MAX) or 1
        offset = _int_param(query, "offset", 0, 10 ** 9)
        source = query.get("source", [None])[-1] or None
        db = self.server.db
        sessions = db.list_sessions_rich(source=source, limit=limit, offset=offset,
                                         include_children=True)
        return json_response({"sessions": sessions,
                              "total": db.session_count(source=source, include_archived=False),
                              "limit": limit, "offset": offset})

    def show_session(self, query, session_id):
        db = self.server.db
        lineage = query.get("lineage", ["0"])[-1] in ("1", "true")
        export = db.export_session_lineage(session_id) if lineage else db.export_session(session_id)
        if export is None:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no session {session_id!r}")
        return json_response(export)

    def search(self, query):
        text = query.get("q", [""])[-1]
        limit = _int_param(query, "limit", 20, PAGE_LIMIT_MAX) or 1
        offset = _int_param(query, "offset", 0, 10 ** 9)
        try:  # one hit more than asked says whether another page follows
            hits = self.server.db.search_messages(
                text, limit=limit + 1, offset=offset, role_filter=query.get("role") or None,
                source_filter=query.get("source") or None,
                grammar=query.get("grammar", [GRAMMAR_BOOLEAN])[-1])
        except ValueError as exc:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        return json_response({"query": text, "hits": hits[:limit], "limit": limit, "offset": offset,
                              "more": len(hits) > limit})

    def import_sessions(self, query, body):
        if not isinstance(body, dict) or "sessions" not in body:
            raise ApiError(HTTPStatus.BAD_REQUEST, 'the body must be {"sessions": [...]}')
        try:
            result = self.server.db.import_sessions(body["sessions"])
        except ValueError as exc:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        if not result["ok"]:
            raise ApiError(HTTPStatus.BAD_REQUEST, "the import was rejected; nothing was written",
                           **{k: v for k, v in result.items()})
        return json_response(result)

    def ops_export(self, query):
        with tempfile.TemporaryDirectory(prefix="hermes-ops-export-") as scratch:
            archive = Path(scratch) / "hermes-home.zip"
            self.server.db.backup(archive)
            body = archive.read_bytes()
        return Response(HTTPStatus.OK, body, "application/zip",
                        {"Content-Disposition": 'attachment; filename="hermes-home.zip"'})

    def ops_import(self, query, body):
        if not isinstance(body, dict) or not isinstance(body.get("archive"), str):
            raise ApiError(HTTPStatus.BAD_REQUEST,
                           'the body must be {"archive": "<base64 zip>", "force": false}')
        try:
            archive = base64.b64decode(body["archive"], validate=True)
        except ValueError:
            raise ApiError(HTTPStatus.BAD_REQUEST, "archive is not valid base64") from None
        with tempfile.TemporaryDirectory(prefix="hermes-ops-import-") as scratch:
            path = Path(scratch) / "backup.zip"
            path.write_bytes(archive)
            try:
                result = self.server.restore(path, force=body.get("force") is True)
            except FileExistsError as exc:
                raise ApiError(HTTPStatus.CONFLICT, f'{exc} (send "force": true)') from None
            except (ValueError, OSError) as exc:
                raise ApiError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        return json_response(result)


def serve(db_path=None, host="127.0.0.1", port=DEFAULT_PORT, allow_remote=False, token=None,
          out=None, read_only=False, as_json=False, db=None):
    """Run the server until interrupted; prints the page's URL (with the token in its fragment),
    as one JSON line with `as_json`."""
    out = out or sys.stdout
    server = StateServer(db_path, host, port, token=token, allow_remote=allow_remote,
                         read_only=read_only, db=db)
    where = server.db._store_location()[0]  # a replica by its URL
    if as_json:
        out.write(json.dumps({"db_path": where, "url": server.url,
                              "token": server.token, "read_only": server.read_only}) + "\n")
    else:
        out.write(f"hermes_state serving {where}{' (read-only)' if server.read_only else ''}\n"
                  f"open {server.url}#token={server.token}\n"
                  f"API: Authorization: Bearer {server.token}\n")
    out.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


PAGE_HTML = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Hermes sessions</title>
<style>
* { box-sizing: border-box; }
body { margin: 0;
       font: 14px/1.5 system-ui, "Noto Sans CJK SC", "PingFang SC", "Microsoft YaHei", sans-serif;
       color: #0f172a; display: grid; grid-template-columns: 22rem 1fr; height: 100vh; }
aside { border-right: 1px solid #e2e8f0; display: flex; flex-direction: column; min-height: 0; }
aside header { padding: .8rem; border-bottom: 1px solid #e2e8f0; }
aside h1 { font-size: 1.1rem; margin: 0 0 .5rem; }
input[type=search] { width: 100%; padding: .45rem .6rem; border: 1px solid #cbd5e1;
                     border-radius: 6px; font: inherit; }
#list { overflow-y: auto; flex: 1; }
.item { padding: .55rem .8rem; border-bottom: 1px solid #f1f5f9; cursor: pointer; }
.item:hover, .item.active { background: #f8fafc; }
.item .title { font-weight: 600; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.item .sub { color: #64748b; font-size: 12px; }
.item .snippet { font-size: 13px; color: #334155; }
mark { background: #fde68a; }
button.more { margin: .6rem .8rem; }
main { overflow-y: auto; overflow-x: hidden; padding: 1rem 1.5rem; }
summary { overflow-wrap: anywhere; cursor: pointer; }
.meta { color: #475569; font-size: 13px; }
.message { border: 1px solid #e2e8f0; border-radius: 8px; margin: .6rem 0; padding: .5rem .8rem; }
.role-assistant { background: #f1f5f9; } .role-tool { background: #f0f9ff; }
.role { font-weight: 600; text-transform: capitalize; }
.time { color: #64748b; font-size: 12px; margin-left: .5rem; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; margin: .3rem 0;
      font-family: ui-monospace, monospace; }
.call { background: #1e293b; color: #f8fafc; border-radius: 6px; padding: .3rem .6rem;
        font-size: 13px; margin: .3rem 0; }
.error { color: #b91c1c; padding: .8rem; }
.segment { margin-top: 1.2rem; padding-top: .4rem; border-top: 2px dashed #cd7f32; color: #92400e;
            font-size: 12px; }
.message.target { outline: 3px solid #f59e0b; }
.count { color: #475569; font-size: 12px; padding: .4rem 0; }
.pages { display: flex; gap: .5rem; padding: .5rem 0; }
main .item { padding: .55rem 0; }
button.back { margin-bottom: .6rem; }
form.token { max-width: 32rem; }
form.token input { width: 100%; padding: .45rem .6rem; font: inherit; }
@media (max-width: 720px) {
  body { display: block; height: auto; }
  aside { border-right: 0; border-bottom: 1px solid #e2e8f0; }
  #list { max-height: 45vh; }
  body.searching #list { display: none; }
  main { padding: .8rem; }
  .item .title { white-space: normal; }
}
</style></head>
<body>
<aside>
  <header><h1>Hermes sessions</h1>
  <input type="search" id="q" placeholder="Search messages (words, phrases, 中文)"
         autocomplete="off"></header>
  <div id="list"></div>
</aside>
<main id="view"></main>
<script nonce="{nonce}">
"use strict";
const fragment = new URLSearchParams(location.hash.slice(1));
if (fragment.get("token")) sessionStorage.setItem("hermes_token", fragment.get("token"));
if (location.hash) history.replaceState(null, "", location.pathname);
let token = sessionStorage.getItem("hermes_token") || "";
const list = document.getElementById("list"), view = document.getElementById("view");
let offset = 0;

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}
// As the command line prints a time: local, YYYY-MM-DD HH:MM.
function when(ts) {
  if (!ts) return "";
  const d = new Date(ts * 1000), two = (n) => String(n).padStart(2, "0");
  return d.getFullYear() + "-" + two(d.getMonth() + 1) + "-" + two(d.getDate()) + " " +
         two(d.getHours()) + ":" + two(d.getMinutes());
}
const narrow = window.matchMedia("(max-width: 720px)");
function hint() {
  // The list is beside the view on a wide screen, above it on a narrow one.
  return el("p", "meta", "Pick a session " + (narrow.matches ? "above" : "on the left") +
                         ", or search.");
}
// The search cuts a snippet by characters and marks a cut with "...": a word cut in two is
// dropped, and the cut shows as an ellipsis. Text without spaces (CJK) has no word to drop.
const CUT_HEAD = /^[A-Za-z0-9_\\u00C0-\\u024F'\\u2019-]+\\s+/;
const CUT_TAIL = /\\s+[A-Za-z0-9_\\u00C0-\\u024F'\\u2019-]+$/;
function tidySnippet(snippet) {
  let text = snippet, head = "", tail = "";
  if (text.startsWith("...")) { text = text.slice(3).replace(CUT_HEAD, ""); head = "… "; }
  if (text.endsWith("...")) { text = text.slice(0, -3).replace(CUT_TAIL, ""); tail = " …"; }
  return head + text + tail;
}
class NeedsToken extends Error {}
async function api(path) {
  if (!token) throw new NeedsToken();
  const response = await fetch(path, {headers: {Authorization: "Bearer " + token}});
  if (response.status === 401) throw new NeedsToken();
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}
function askForToken() {
  const form = el("form", "token"), input = el("input");
  input.type = "password";
  input.autocomplete = "off";
  input.placeholder = "token";
  form.append(el("h2", null, "This page needs its token"),
              el("p", null, "Paste the token that `python3 -m hermes_state serve` printed " +
                            "(the part after #token= in the address it showed), " +
                            "or open that address again."),
              input, el("button", null, "Open"));
  form.onsubmit = (event) => {
    event.preventDefault();
    token = input.value.trim();
    sessionStorage.setItem("hermes_token", token);
    start();
  };
  list.replaceChildren();
  view.replaceChildren(form);
  input.focus();
}
function fail(where, error) {
  if (error instanceof NeedsToken) return askForToken();
  where.replaceChildren(el("p", "error", error.message));
}
function queryTerms(text) {
  const terms = [];
  let skip = false;
  for (const found of text.matchAll(/"([^"]*)"|(\\S+)/g)) {
    const word = found[1] !== undefined ? found[1] : found[2].replace(/^[()]+|[()]+$/g, "");
    if (found[1] === undefined && /^(AND|OR|NOT)$/i.test(word)) {
      skip = /^NOT$/i.test(word);
      continue;
    }
    if (!skip && word && !word.startsWith("-")) terms.push(word);
    skip = false;
  }
  return terms.sort((a, b) => b.length - a.length);
}
function highlight(node, text, terms) {
  // The search marks its matches >>>so<<<; a snippet it left plain (hermes-agent's, for a CJK term
  // of 1 or 2 characters) gets the query's own terms marked here.
  const escaped = terms.map((t) => t.replace(/[.*+?^${}()|[\\]\\\\]/g, "\\\\$&"));
  const pattern = escaped.length ? new RegExp("(" + escaped.join("|") + ")", "gi") : null;
  for (const part of pattern ? text.split(pattern) : [text]) {
    const hit = pattern && terms.some((t) => t.toLowerCase() === part.toLowerCase());
    node.append(hit ? el("mark", null, part) : document.createTextNode(part));
  }
}
function marked(snippet, terms) {
  const span = el("span", "snippet");
  snippet = tidySnippet(snippet);
  if (!snippet.includes(">>>")) { highlight(span, snippet, terms || []); return span; }
  snippet.split(/(>>>|<<<)/).reduce((inside, part) => {
    if (part === ">>>") return true;
    if (part === "<<<") return false;
    span.append(inside ? el("mark", null, part) : document.createTextNode(part));
    return inside;
  }, false);
  return span;
}
async function loadSessions(more) {
  if (!more) { offset = 0; list.replaceChildren(); }
  try {
    const page = await api("/api/sessions?limit=50&offset=" + offset);
    list.querySelector("button.more")?.remove();
    for (const s of page.sessions) {
      const item = el("div", "item");
      item.append(el("div", "title", s.title || s.preview || s.id),
                  el("div", "sub", s.source + " · " + when(s.last_active) + " · " +
                                   (s.message_count || 0) + " msgs"));
      item.onclick = () => showSession(s.id);
      list.append(item);
    }
    offset += page.sessions.length;
    if (offset < page.total) {
      const button = el("button", "more", "More sessions");
      button.onclick = () => loadSessions(true);
      list.append(button);
    }
  } catch (error) { fail(list, error); }
}
const PAGE = 50;
let results = null;  // the search shown, so that a session opened from it can go back
async function search(text, from) {
  document.body.classList.toggle("searching", Boolean(text.trim()));
  if (!text.trim()) { results = null; view.replaceChildren(hint()); return loadSessions(false); }
  from = from || 0;
  try {
    const result = await api("/api/search?limit=" + PAGE + "&offset=" + from +
                             "&q=" + encodeURIComponent(text));
    const terms = queryTerms(text);
    const last = from + result.hits.length;
    const shown = [el("div", "count", result.hits.length ? "hits " + (from + 1) + "–" + last +
                      (result.more ? " of more than " + last : " of " + last) :
                      "No messages match.")];
    for (const hit of result.hits) {
      const item = el("div", "item");
      item.append(el("div", "sub",
                     hit.session_id + " · " + hit.role + " · " + when(hit.timestamp)),
                  marked(hit.snippet || "", terms));
      item.onclick = () => showSession(hit.session_id, hit.id, terms);
      shown.push(item);
    }
    const pages = el("div", "pages");
    if (from > 0) {
      const back = el("button", null, "← Previous");
      back.onclick = () => search(text, Math.max(0, from - PAGE));
      pages.append(back);
    }
    if (result.more) {
      const next = el("button", null, "Next →");
      next.onclick = () => search(text, last);
      pages.append(next);
    }
    if (pages.childElementCount) shown.push(pages);
    results = {text: text, from: from, count: result.hits.length};
    view.replaceChildren(...shown);
    view.scrollTop = 0;
  } catch (error) { fail(view, error); }
}
function messageNode(m) {
  const node = el("div", "message role-" + m.role);
  node.id = "message-" + m.id;
  node.append(el("span", "role", m.role + (m.tool_name ? " · " + m.tool_name : "")),
              el("span", "time", when(m.timestamp)));
  const text = m.content || "";
  if (m.role === "tool" && text.length > 600) {
    const fold = el("details");
    const summary = el("summary", null,
                       text.slice(0, 200) + "… (" + text.length + " characters)");
    fold.append(summary, el("pre", null, text));
    node.append(fold);
  } else {
    node.append(el("pre", null, text));
  }
  for (const call of m.tool_calls || []) {
    const fn = call.function || {};
    node.append(el("div", "call", "→ " + fn.name + "(" + (fn.arguments || "") + ")"));
  }
  return node;
}
async function showSession(id, messageId, terms) {
  try {
    const s = await api("/api/sessions/" + encodeURIComponent(id) + "?lineage=1");
    const header = el("header");
    const titled = (s.segments || []).find((segment) => segment.title);
    header.append(el("h2", null, s.title || (titled && titled.title) || s.id),
                  el("p", "meta", [s.source, s.model, when(s.started_at),
                                   s.message_count + " messages"].filter(Boolean).join(" · ")));
    if (s.lineage_session_ids && s.lineage_session_ids.length > 1)
      header.append(el("p", "meta", "Compression lineage: " + s.lineage_session_ids.join(" → ")));
    if (s.system_prompt) {
      const prompt = el("details");
      prompt.append(el("summary", null, "System prompt"), el("pre", null, s.system_prompt));
      header.append(prompt);
    }
    const body = [header];
    if (results) {
      const shown = results, back = el("button", "back", "← Back to the search");
      back.onclick = () => search(shown.text, shown.from);
      body.unshift(back);
    }
    for (const segment of s.segments) {
      if (s.segments.length > 1) body.push(el("div", "segment", "Segment " + segment.id));
      for (const m of segment.messages) body.push(messageNode(m));
    }
    view.replaceChildren(...body);
    const target = messageId && document.getElementById("message-" + messageId);
    if (target) {
      target.classList.add("target");
      const text = target.querySelector("pre");
      if (text && terms && terms.length) {
        const plain = text.textContent;
        text.replaceChildren();
        highlight(text, plain, terms);
      }
      target.scrollIntoView({block: "center"});
    } else if (narrow.matches) {
      view.scrollIntoView({block: "start"});  // below the list: bring the session into sight
    } else {
      view.scrollTop = 0;
    }
  } catch (error) { fail(view, error); }
}
let pending;
document.getElementById("q").addEventListener("input", (event) => {
  clearTimeout(pending);
  pending = setTimeout(() => search(event.target.value), 250);
});
function start() {
  view.replaceChildren(hint());
  loadSessions(false);
  if (fragment.get("q")) {
    document.getElementById("q").value = fragment.get("q");
    search(fragment.get("q"));
  }
  if (fragment.get("session")) showSession(fragment.get("session"));
}
start();
</script>
</body></html>
"""
