"""A server connection: requests dispatched as they arrive, replies in completion order."""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import TYPE_CHECKING

from ..errors import EEOF, EFAILEDSOCKET, RemoteProtocolError
from ..protocol.baidu_std import SERVER
from ..protocol.events import StreamFrameReceived
from ..transport.sockopts import set_socket_options
from ..transport.streams import StreamTable
from ..transport.tcp import FramedConnection, RateLimitedLog
from . import auth, detect
from .dispatch import attachment_destination, auth_failure_response
from .http import HttpSession
from .tls_layer import TlsLayer

if TYPE_CHECKING:
    from .grpc.session import H2Session

log = logging.getLogger(__name__)
_auth_log = RateLimitedLog()
_timeout_log = RateLimitedLog()
_detect_log = RateLimitedLog()

_OPEN, _NEEDS_AUTH, _VERIFYING, _REJECTED = 0, 1, 2, 3
_MAX_QUEUED_BEFORE_VERDICT = 64


class ServerConnection(FramedConnection):
    def __init__(self, server, internal: bool = False) -> None:
        opts = server.options
        self.internal = internal  # accepted on the internal port (options.internal_port)
        super().__init__(SERVER, opts.max_body_size, opts.max_unwritten_bytes)
        self.server = server
        self.credential: bytes | None = None
        self.auth_state = _OPEN if opts.auth is None else _NEEDS_AUTH
        self.queued: list = []
        self.inflight = 0
        self.frames = 0
        self.eof = False
        self.poisoned = False
        self.last_active = self.opened_at = self.loop.time()
        self._first_frame_timer = None
        self.protocol: str | None = None  # named by the first bytes (detect.py)
        self.http: HttpSession | H2Session | None = None  # the session of HTTP/1.1 or HTTP/2, once detected
        self.tls: TlsLayer | None = None  # set once the connection turned out to speak TLS
        if server.registry.places:
            self.receive_attachments_into(self._attachment_destination)

    def _attachment_destination(self, meta, data):
        if self.auth_state != _OPEN or self.poisoned:
            return None  # nothing is written where a servicer says before the peer is let in
        return attachment_destination(self.server.registry, meta, data)

    def connection_made_hook(self) -> None:
        if not self.server._connection_opened(self):
            return
        set_socket_options(self.transport, self.server.options)
        self._first_frame_timer = self.loop.call_later(
            self.server.options.first_frame_timeout_sec, self._no_first_frame)

    def _no_first_frame(self) -> None:
        self._first_frame_timer = None
        if self.frames == 0 and not self.is_closed:
            self.server.stats.count_close("first_frame_timeout")
            _timeout_log(logging.INFO, "closing connection from %s: no complete frame within "
                         "first_frame_timeout_sec=%s", self.peer, self.server.options.first_frame_timeout_sec)
            self.abort()

    def buffer_updated(self, nbytes: int) -> None:
        if self.poisoned:
            self.decoder.reader.rbuf.clear()
            return
        self.last_active = self.loop.time()
        if self.protocol is None or self.http is not None:
            self._not_baidu_std(nbytes)
            return
        # Handlers that do not suspend reply while their requests are read (run inline): their
        # replies go out together, in one write when this read is handled, as soon as the
        # lone reply of one request in flight and with no loop iteration in between.
        self.batching_writes = True
        try:
            super().buffer_updated(nbytes)
        finally:
            self.batching_writes = False
        if self._out and not self._flush_scheduled:
            self._flush()

    def _not_baidu_std(self, nbytes: int) -> None:
        """Bytes of a connection whose protocol is not known yet, or is HTTP."""
        self.decoder.buffer_updated(nbytes)
        rbuf = self.decoder.reader.rbuf
        if self.http is not None:
            self.http.data_received(bytes(rbuf.take(rbuf.available())))
            return
        proto = detect.detect(bytes(rbuf.peek(min(rbuf.available(), detect.LONGEST))))
        if proto is None:
            return
        if proto == detect.TLS and self.tls is None and self.server.ssl_context is not None:
            self._start_tls(bytes(rbuf.take(rbuf.available())))
            return
        if self.server.force_ssl and self.tls is None:
            _detect_log(logging.WARNING, "closing connection from %s: it does not start with a TLS handshake "
                        "and the server requires TLS (%s)", self.peer,
                        "force_ssl" if self.server.options.force_ssl else "client certificates are required")
            self.server.stats.count_close("not_tls")
            self.protocol = detect.UNKNOWN
            self.abort()
            return
        self.protocol = proto
        if proto == detect.HTTP or proto == detect.H2:
            if self._first_frame_timer is not None:  # the HTTP session times the request head
                self._first_frame_timer.cancel()
                self._first_frame_timer = None
            if proto == detect.HTTP:
                self.http = HttpSession(self)
            else:
                from .grpc.session import H2Session  # h2 is imported by the first HTTP/2 connection only

                self.http = H2Session(self)  # which reads the preface itself
            self.http.data_received(bytes(rbuf.take(rbuf.available())))
            return
        if proto == detect.TLS:
            self.protocol = detect.UNKNOWN
            what = "TLS inside TLS" if self.tls is not None else "TLS, which this server has no certificate for"
            _detect_log(logging.WARNING, "closing connection from %s: it speaks %s", self.peer, what)
            self.server.stats.count_close("unknown_protocol")
            self.abort()
            return
        # baidu_std, or bytes no protocol takes: the frame reader reads them (and names the
        # latter when it closes the connection)
        self.batching_writes = True
        try:
            self.process_events()
        finally:
            self.batching_writes = False
        if self._out and not self._flush_scheduled:
            self._flush()

    def _start_tls(self, first: bytes) -> None:
        """Serve this connection over TLS: the TCP transport's protocol becomes a TlsLayer that
        hands this connection plaintext, whose protocol is then detected again."""
        self.tls = TlsLayer(self.transport, self.server.ssl_context, self, self.server.options.ssl_handshake_timeout_sec,
                            on_failure=self._tls_failed)
        self.transport = self.tls.transport
        self._writelines_ok = True  # one encrypted write for the replies of a turn
        self.tls.start(first)

    def _tls_failed(self, reason: str) -> None:
        self.server.stats.count_close("tls_handshake")
        _detect_log(logging.WARNING, "closing connection from %s: TLS handshake failed: %s", self.peer, reason)

    def event_received(self, ev) -> None:
        if self.poisoned:
            return
        self.frames += 1
        if self._first_frame_timer is not None:
            self._first_frame_timer.cancel()
            self._first_frame_timer = None
        if type(ev) is StreamFrameReceived:
            if self.auth_state != _OPEN:
                self.server.stats.stream_frames_dropped += 1  # no stream before authentication
                return
            self.stream_table().frame_received(ev)
            return
        if self.auth_state != _OPEN:
            self._authenticate(ev)
            return
        self.server._dispatch(self, ev)

    # -- authentication (once per connection, on the first message) --------------------------
    def _authenticate(self, ev) -> None:
        if self.auth_state == _VERIFYING:
            self.queued.append(ev)
            if len(self.queued) >= _MAX_QUEUED_BEFORE_VERDICT and self.transport is not None:
                self.transport.pause_reading()
            return
        if self.auth_state == _REJECTED:
            return
        self.auth_state = _VERIFYING
        credential = ev.meta.authentication_data or b""
        try:
            verdict = self.server.options.auth.verify_credential(credential, self.peer)
            if not inspect.isawaitable(verdict):
                verdict = bool(verdict)
        except (Exception, asyncio.CancelledError) as e:  # in no task: a CancelledError is the authenticator's
            self._auth_done(ev, credential, False, f"authenticator raised {e!r}")
            return
        if type(verdict) is bool:
            self._auth_done(ev, credential, verdict, "")
        else:
            task = self.loop.create_task(self._await_verdict(ev, credential, verdict))
            self.server._track(task)

    async def _await_verdict(self, ev, credential, verdict) -> None:
        try:
            ok, why = bool(await verdict), ""
        except asyncio.CancelledError as e:
            if self.server._cancelling_requests:
                raise
            ok, why = False, f"authenticator raised {e!r}"
        except Exception as e:
            ok, why = False, f"authenticator raised {e!r}"
        self._auth_done(ev, credential, ok, why)

    def _auth_done(self, ev, credential: bytes, ok: bool, why: str) -> None:
        if self.is_closed:
            return
        if not ok:
            self.auth_state = _REJECTED
            self.queued.clear()
            self.server.stats.count_close("auth_failed")
            _auth_log(logging.WARNING, "authentication failed for %s%s", self.peer, f": {why}" if why else "")
            self.write(auth_failure_response(ev.meta, auth.unauthorized_error_text(self.server.options.auth)))
            self.close()
            return
        self.credential = bytes(credential)
        self.auth_state = _OPEN
        queued, self.queued = self.queued, []
        self.server._dispatch(self, ev)
        for q in queued:
            if self.is_closed:
                break
            self.server._dispatch(self, q)
        if self.transport is not None and not self.is_closed:
            self.transport.resume_reading()

    # -- backpressure ------------------------------------------------------------------------
    # While the peer does not read our replies, stop reading its requests and leave the ones
    # already buffered undispatched: replies queued per connection stay bounded.
    def pause_writing(self) -> None:
        super().pause_writing()
        self.hold_events = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        self.hold_events = False
        if self.transport is not None and not self.poisoned and self.auth_state != _VERIFYING:
            self.transport.resume_reading()
        self.process_events()

    # -- lifecycle ---------------------------------------------------------------------------
    def keep_open_after_eof(self) -> bool:
        self.eof = True
        if self.http is not None:
            return self.http.eof_received()
        return self.inflight > 0 or self.auth_state == _VERIFYING

    def request_done(self) -> None:
        self.inflight -= 1
        self.last_active = self.loop.time()
        if self.inflight == 0 and (self.eof or self.server.closing_connections):
            self.close()

    def protocol_error(self, e: RemoteProtocolError) -> None:
        self.server.stats.count_close("unknown_protocol" if "unknown protocol" in str(e) else "bad_frame")
        if self.inflight == 0:
            if self._out:  # replies to the requests before the bad bytes, answered inline
                self._flush()
            super().protocol_error(e)
            return
        # Requests received before the bad bytes are still answered (nothing lost); nothing
        # more is read, and the connection closes after the last reply.
        self.protocol_error_log_only(e)
        self.poisoned = True
        self.eof = True
        self.decoder.reader.rbuf.clear()
        if self.transport is not None:
            self.transport.pause_reading()

    def close(self, reason: BaseException | None = None) -> None:
        if self.protocol == detect.H2 and self.http is not None and not self.is_closed:
            self.http.goaway()  # HTTP/2 peers learn that no new stream will be served
        super().close(reason)

    def stream_table(self) -> StreamTable:
        if self.streams is None:
            self.streams = StreamTable(self, self.server.stats)
        return self.streams

    def closed(self, exc) -> None:
        table = self.streams
        if table:
            if exc is None:
                table.connection_lost(EEOF, f"Got EOF of {self.peer}")
            else:
                table.connection_lost(EFAILEDSOCKET, f"Broken connection to {self.peer}: {exc}")
        if self._first_frame_timer is not None:
            self._first_frame_timer.cancel()
            self._first_frame_timer = None
        self.queued.clear()
        if self.http is not None:
            self.http.closed()
        self.server.connection_closed(self)
