"""HTTP/1.1 on the server's port: protobuf methods as JSON (or binary) and the builtin pages.

The bytes are parsed by h11, never by hand. Requests on a connection are answered one at a
time, in order (pipelined ones wait their turn). Limits, each answered and then closed:
a request head over MAX_HEAD_BYTES (431), a target over MAX_TARGET_BYTES (414), a body over
the server's max_body_size (413: at once for a Content-Length, as soon as a chunked body passes
it), a malformed request, both Content-Length and Transfer-Encoding, or conflicting
Content-Lengths (400), a head not complete within first_frame_timeout_sec (408: slow headers).

With ServerOptions.auth, every request carries its credential in `Authorization` (as brpc's
VerifyHttpRequest): one without it is refused from its head (401, before its body is read),
one whose credential the authenticator refuses gets 401 once read; both then close. A
connection remembers the last credential let in and does not ask again for the same one.
Builtin pages are exempt only on the internal port (stricter than brpc, which exempts them
everywhere and lets a connection that began with a page in unverified).
Stricter than h11 on those, and on line ends and folding (http_head.py): a head with a bare LF
line end or an obs-fold line is refused with 400, as brpc's http_parser refuses them.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import parse_qsl, unquote, urlsplit

import h11

from ..errors import EPERM, ERPCAUTH
from ..transport.tcp import RateLimitedLog
from . import auth, builtin
from .http_head import HeadScanner
from .http_rpc import HttpReply, call_over_http, error_reply

log = logging.getLogger(__name__)
_reject_log = RateLimitedLog()
_auth_log = RateLimitedLog()

MAX_HEAD_BYTES = 80 * 1024  # as brpc (http_parser's HPE_HEADER_OVERFLOW)
MAX_TARGET_BYTES = 8 * 1024
# RFC 9110 §5.5: a field value is visible characters, spaces, tabs and obs-text; CR, LF and NUL
# (refused by h11 already) and the other controls would reach a handler's user fields
_CONTROL = bytes(range(0, 9)) + bytes(range(10, 32)) + b"\x7f"
_REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden", 404: b"Not Found",
            408: b"Request Timeout", 413: b"Payload Too Large", 414: b"URI Too Long",
            431: b"Request Header Fields Too Large", 500: b"Internal Server Error",
            503: b"Service Unavailable", 504: b"Gateway Timeout"}


def split_target(target: bytes) -> tuple[str, str] | None:
    """A request target's path (unquoted) and query; None for one that is not a URL.

    An origin-form target (RFC 9112 3.2.1, "/path?query") is split by hand: urlsplit would
    read "//x/y" as a host "x" and path "/y", and raise on "//h]x" (an IPv6 host never closed).
    Anything else (absolute-form "http://host/path", asterisk-form) goes through urlsplit.
    """
    text = target.decode("latin-1").partition("#")[0]
    if text.startswith("/"):
        path, _, query = text.partition("?")
    else:
        try:
            parts = urlsplit(text)
        except ValueError:
            return None
        path, query = parts.path, parts.query
    return unquote(path), query


class HttpSession:
    """The HTTP side of one server connection (`conn`, a ServerConnection)."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.server = conn.server
        self.parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.request: h11.Request | None = None
        self.request_headers: dict = {}
        self.body = bytearray()
        self.busy = False      # a request is being answered; the next waits
        self.finished = False  # closing: nothing more is read or answered
        self.requests = 0
        self.head_scanner = HeadScanner()
        self.bad_head: str | None = None  # why the head being read is refused, once the scanner knows
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    # -- bytes in --------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.finished:
            return
        if self.bad_head is None:
            self.bad_head = self.head_scanner.feed(data)
        try:
            self.parser.receive_data(data)
        except h11.RemoteProtocolError as e:  # data after the peer's end of stream
            self._reject(400, str(e))
            return
        if self.busy:  # reading was resumed by something else (backpressure): pause again
            self._pause_reading()
            return
        self._next()

    def eof_received(self) -> bool:
        """The peer half-closed: answer what it sent; True keeps the write side open meanwhile."""
        if not self.finished:
            try:
                self.parser.receive_data(b"")
            except h11.RemoteProtocolError:
                pass
            self._next()
        return self.busy

    def _next(self) -> None:
        parser = self.parser
        while not self.busy and not self.finished:
            if self.bad_head is not None:  # before h11 reads that head
                self._reject(400, self.bad_head)
                return
            try:
                event = parser.next_event()
            except h11.RemoteProtocolError as e:
                self._reject(e.error_status_hint, str(e))
                return
            if event is h11.NEED_DATA:
                if parser.their_state is h11.IDLE and parser.trailing_data[1]:
                    self.finished = True  # the peer closed between requests: nothing to answer
                    self.conn.close()
                return
            if event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                if not self._take_head(event):
                    return
            elif isinstance(event, h11.Data):
                if len(self.body) + len(event.data) > self.server.options.max_body_size:
                    self._reject(413, f"the body is over max_body_size={self.server.options.max_body_size}")
                    return
                self.body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self.busy = True
                # What a client pipelines meanwhile waits in the kernel, not in h11's buffer.
                self._pause_reading()
                request, body = self.request, bytes(self.body)
                self.request, self.body = None, bytearray()
                self.bad_head = self.head_scanner.start(parser.trailing_data[0])  # the next head's first bytes
                task = self.conn.loop.create_task(self._answer(request, body))
                self.server._track(task)
            elif isinstance(event, h11.ConnectionClosed):
                self.finished = True
                self.conn.close()
                return

    def _take_head(self, event: h11.Request) -> bool:
        self._cancel_head_timer()
        self.requests += 1
        self.conn.frames += 1
        headers = {}
        lengths = 0
        chunked = False
        # h11 bounds a head that arrives in pieces (max_incomplete_event_size); one that
        # arrives whole is measured here
        head_bytes = len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers)
        if head_bytes > MAX_HEAD_BYTES:
            self._reject(431, f"the request head is over {MAX_HEAD_BYTES} bytes")
            return False
        for name, value in event.headers:
            if len(value.translate(None, _CONTROL)) != len(value):
                self._reject(400, f"the value of header {name[:64]!r} holds a control character")
                return False
            name = name.lower()
            if name == b"content-length":
                lengths += 1
            elif name == b"transfer-encoding":
                chunked = True
            headers[name.decode("latin-1")] = value.decode("latin-1")
        if lengths and chunked:
            self._reject(400, "both Content-Length and Transfer-Encoding")
            return False
        if len(event.target) > MAX_TARGET_BYTES:
            self._reject(414, f"the target is over {MAX_TARGET_BYTES} bytes")
            return False
        length = headers.get("content-length")
        if length is not None and int(length) > self.server.options.max_body_size:
            self._reject(413, f"Content-Length {length} is over max_body_size={self.server.options.max_body_size}")
            return False
        if "authorization" not in headers and self._needs_credential(event.target):
            self._refuse_auth(event, "no Authorization header")
            return False
        if headers.get("expect", "").lower() == "100-continue":
            self.conn.write([self.parser.send(h11.InformationalResponse(status_code=100, headers=[]))])
        self.request = event
        self.request_headers = headers
        return True

    # -- answering -------------------------------------------------------------------------------
    async def _answer(self, request: h11.Request, body: bytes) -> None:
        credential = self.request_headers.get("authorization")
        if credential is not None and self._needs_credential(request.target):
            credential = credential.encode("latin-1")
            if credential != self.conn.credential:
                ok, why = await auth.verify(self.server.options.auth, credential, self.conn.peer)
                if not ok:
                    self._refuse_auth(request, why or "the authenticator refused the credential")
                    return
                self.conn.credential = credential
        try:
            reply = await self._route(request, self.request_headers, body)
        except Exception as e:  # noqa: BLE001 - a bug of ours: answered 500, the connection goes on
            log.error("answering %s %s from %s raised %r", request.method, request.target, self.conn.peer, e,
                      exc_info=e)
            reply = HttpReply(500, [("Content-Type", "text/plain")], b"internal error\n")
        if reply is None:
            self.server.stats.count_close("close_connection")
            self.finished = True
            self.conn.close()
            return
        try:
            self._send(request, reply)
        except Exception as e:  # noqa: BLE001 - a bug of ours: never leave the connection busy forever
            log.error("answering %s %s from %s raised %r; closing the connection", request.method, request.target,
                      self.conn.peer, e, exc_info=e)
            self.finished = True
            self.conn.abort()

    async def _route(self, request: h11.Request, headers: dict, body: bytes) -> HttpReply | None:
        split = split_target(request.target)
        if split is None:
            return HttpReply(400, [("Content-Type", "text/plain")], b"the request target is not a URL\n")
        path, query = split
        query = dict(parse_qsl(query, keep_blank_values=True))
        first, _, rest = path.strip("/").partition("/")
        first = first or "index"
        opts = self.server.options
        if first in builtin.PAGES and opts.has_builtin_services:
            if opts.internal_port >= 0 and not self.conn.internal:
                tag = opts.server_tag or self.conn.local
                return error_reply(EPERM, f"/{first} is served on the internal port only", tag)
            return builtin.serve_page(first, builtin.Request(self.server, rest, query, headers))
        if first in self.server.registry.services or first in self.server.registry._short:
            return await call_over_http(self.server, self.conn, path, headers, body)
        return HttpReply(404, [("Content-Type", "text/plain")], f"Fail to find service on `{path}'\n".encode())

    # -- authentication --------------------------------------------------------------------------
    def _needs_credential(self, target: bytes) -> bool:
        opts = self.server.options
        if opts.auth is None:
            return False
        if self.conn.internal and opts.has_builtin_services:
            split = split_target(target)  # the same reading as _route's, so both name one page
            if split is not None and (split[0].strip("/").partition("/")[0] or "index") in builtin.PAGES:
                return False
        return True

    def _refuse_auth(self, request: h11.Request, why: str) -> None:
        """401 with brpc's text, then close."""
        self._cancel_head_timer()
        self.server.stats.count_close("auth_failed")
        _auth_log(logging.WARNING, "authentication failed for %s (HTTP %s): %s", self.conn.peer,
                  request.target[:64].decode("latin-1"), why)
        tag = self.server.options.server_tag or self.conn.local
        self._send(request, error_reply(ERPCAUTH, auth.refusal_text(self.server.options.auth), tag), close=True)

    def _send(self, request: h11.Request, reply: HttpReply, close: bool = False) -> None:
        if self.conn.is_closed:
            return
        parser = self.parser
        headers = [("Content-Length", str(len(reply.body)))] + reply.headers
        if close:
            headers.append(("Connection", "close"))
        try:
            # latin-1, as request headers are read: a value echoed back (the request's
            # Content-Type) may hold obs-text, which h11's ASCII would refuse
            headers = [(n, v.encode("latin-1") if isinstance(v, str) else v) for n, v in headers]
            out = [parser.send(h11.Response(status_code=reply.status, headers=headers,
                                            reason=_REASONS.get(reply.status, b"")))]
            if reply.body and request is not None and request.method != b"HEAD":
                out.append(parser.send(h11.Data(data=reply.body)))
            out.append(parser.send(h11.EndOfMessage()))
        except (h11.LocalProtocolError, ValueError) as e:  # ValueError: a value no encoding takes
            log.error("cannot answer %s: %s; closing the connection", self.conn.peer, e)
            self.finished = True
            self.conn.abort()
            return
        self.conn.write(out)
        if close or parser.our_state is h11.MUST_CLOSE:
            self.finished = True
            self.conn.close()
            return
        try:
            parser.start_next_cycle()
        except h11.LocalProtocolError:  # the peer's side is not done: it must close
            self.finished = True
            self.conn.close()
            return
        self.busy = False
        self._arm_head_timer()
        self._next()
        if not self.busy and not self.finished and self.conn.transport is not None and not self.conn.write_paused:
            self.conn.transport.resume_reading()

    def _pause_reading(self) -> None:
        if self.conn.transport is not None:
            self.conn.transport.pause_reading()

    def _reject(self, status: int, why: str) -> None:
        """Answer `status` with `why` and close: the bytes that follow cannot be trusted."""
        if self.finished:
            return
        self._cancel_head_timer()
        self.server.stats.count_close("bad_http")
        _reject_log(logging.WARNING, "closing HTTP connection from %s: %s (%d)", self.conn.peer, why, status)
        self.finished = True
        body = f"{why}\n".encode()
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, b'').decode()}\r\nContent-Length: {len(body)}\r\n"
                "Content-Type: text/plain\r\nConnection: close\r\n\r\n").encode()
        self.conn.write([head + body])  # by hand: the parser may be in an error state
        self.conn.close()

    # -- slow headers ------------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        timeout = self.server.options.first_frame_timeout_sec
        self._head_timer = self.conn.loop.call_later(timeout, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.busy or self.finished:
            return
        if self.parser.their_state is h11.IDLE and not self.parser.trailing_data[0]:
            if self.requests:  # an idle keep-alive connection: the idle timeout is for those
                return
        self._reject(408, f"no complete request head within first_frame_timeout_sec="
                          f"{self.server.options.first_frame_timeout_sec}")

    def closed(self) -> None:
        self.finished = True
        self._cancel_head_timer()
