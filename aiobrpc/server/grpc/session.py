"""The HTTP/2 side of one server connection: framing, HPACK and flow control by the `h2`
package (never by hand), the limits a hostile peer meets, and the calls on its streams.

A connection becomes an H2Session when its first bytes are the HTTP/2 preface (h2c with prior
knowledge, or inside TLS, whose ALPN offers `h2`). Each read is handed to h2 once; the frames
it makes us send (replies of calls that finished meanwhile, acknowledgements, window updates)
go out in one write at the end of that read, and those made later in one write per loop
iteration.

Limits, each ending the connection with a GOAWAY and one log line naming the cause:
a protocol error h2 finds (a malformed frame, a header list over MAX_HEADER_LIST_SIZE, a
CONTINUATION flood, more streams than MAX_CONCURRENT_STREAMS, a WINDOW_UPDATE past 2^31-1,
which is FLOW_CONTROL_ERROR); more than MAX_RESETS_PER_SECOND streams reset by the peer in a
second ("Rapid Reset", ENHANCE_YOUR_CALM); more than MAX_CONTROL_FRAMES_PER_SECOND PING and
SETTINGS frames in a second (ENHANCE_YOUR_CALM). A gRPC message over max_body_size ends only
its call (RESOURCE_EXHAUSTED), as does anything wrong inside one call.
"""

from __future__ import annotations

import asyncio
import inspect
import logging

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes

from ...deadlines import TimerWheel
from ...protocol import h2_frames, hpack_memo  # noqa: F401  (h2_frames: h2's DATA frame repr made cheap)
from ...transport.tcp import RateLimitedLog
from .call import GrpcCall, respond_plain

log = logging.getLogger(__name__)
_close_log = RateLimitedLog()

MAX_CONCURRENT_STREAMS = 100  # brpc's h2 default (-h2_max_concurrent_streams)
MAX_HEADER_LIST_SIZE = 64 * 1024
STREAM_WINDOW = 4 * 1024 * 1024  # what a peer may send on one stream before we read it
MAX_FRAME_SIZE = 1024 * 1024  # fewer, larger DATA frames for large messages (16 KiB is HTTP/2's least)
CONNECTION_WINDOW = 32 * 1024 * 1024  # ... and on all of them
MAX_RESETS_PER_SECOND = 2 * MAX_CONCURRENT_STREAMS
MAX_CONTROL_FRAMES_PER_SECOND = 1000

_RequestReceived = h2.events.RequestReceived
_DataReceived = h2.events.DataReceived
_StreamEnded = h2.events.StreamEnded
_StreamReset = h2.events.StreamReset
_WindowUpdated = h2.events.WindowUpdated
_RemoteSettingsChanged = h2.events.RemoteSettingsChanged
_PingReceived = h2.events.PingReceived
_ConnectionTerminated = h2.events.ConnectionTerminated


class H2Session:
    """The HTTP/2 side of `conn`, a ServerConnection whose first bytes were the h2 preface."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.server = conn.server
        self.loop = conn.loop
        self.deadlines = TimerWheel(self.loop, GrpcCall.deadline_passed)  # the calls' grpc-timeouts, one loop timer
        config = h2.config.H2Configuration(client_side=False, header_encoding=None,
                                           validate_outbound_headers=False, normalize_outbound_headers=False,
                                           validate_inbound_headers=False, normalize_inbound_headers=False)
        h2conn = self.h2 = h2.connection.H2Connection(config)
        hpack_memo.install(h2conn)
        h2conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_SIZE,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME_SIZE,
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
        })
        # Both in force at once, not when the peer acknowledges them: h2 reads a frame by the
        # limit of the read's start, and a peer may send its ACK and a large frame in one read.
        h2conn.decoder.max_header_list_size = MAX_HEADER_LIST_SIZE
        h2conn.max_inbound_frame_size = MAX_FRAME_SIZE
        h2conn.initiate_connection()
        h2conn.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        self.calls: dict[int, GrpcCall] = {}
        self.waiting_for_window: set[GrpcCall] = set()  # calls with a reply held by flow control
        self.authenticated = self.server.options.auth is None
        self._verdict: asyncio.Future | None = None  # the connection's one verification, once asked
        self.finished = False
        self.reading = False
        self._flush_scheduled = False
        self._window_start = 0.0  # the second that resets and control frames are counted in
        self._resets = 0
        self._control_frames = 0
        self.flush()

    # -- bytes in ------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.finished:
            return
        self.reading = True  # replies made meanwhile go out with this read's flush
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            self.reading = False
            # h2 has queued the GOAWAY with the error's code (FLOW_CONTROL_ERROR for a window
            # past 2^31-1, PROTOCOL_ERROR, ...)
            self._close(f"HTTP/2 protocol error: {type(e).__name__}: {e}", None)
            return
        calls = self.calls
        for ev in events:
            t = type(ev)
            if t is _DataReceived:
                call = calls.get(ev.stream_id)
                if call is not None:
                    call.data_received(ev.data, ev.flow_controlled_length)
                else:
                    self.acknowledge(ev.stream_id, ev.flow_controlled_length)
            elif t is _RequestReceived:
                self._request_received(ev)
            elif t is _StreamEnded:
                call = calls.get(ev.stream_id)
                if call is not None:
                    call.request_ended()
            elif t is _StreamReset:
                self._stream_reset(ev)
            elif t is _WindowUpdated:
                self._window_opened(ev.stream_id)
            elif t is _RemoteSettingsChanged:
                self._window_opened(0)
                self._control_frame()
            elif t is _PingReceived:
                self._control_frame()
            elif t is _ConnectionTerminated:
                self._peer_went_away(ev)
            if self.finished:
                self.reading = False
                return
        self.reading = False
        self.flush()

    def _request_received(self, ev) -> None:
        conn = self.conn
        conn.frames += 1
        sid = ev.stream_id
        call = GrpcCall(self, sid)
        self.calls[sid] = call
        call.headers_received(ev.headers, ev.stream_ended is not None)

    def _stream_reset(self, ev) -> None:
        call = self.calls.pop(ev.stream_id, None)
        if call is not None:
            call.reset_by_peer()
        self._roll_window()
        self._resets += 1
        if self._resets > MAX_RESETS_PER_SECOND:
            self._calm_down(f"{self._resets} streams reset by the peer within a second "
                            f"(more than {MAX_RESETS_PER_SECOND}: a rapid reset flood)")

    def _control_frame(self) -> None:
        self._roll_window()
        self._control_frames += 1
        if self._control_frames > MAX_CONTROL_FRAMES_PER_SECOND:
            self._calm_down(f"{self._control_frames} PING and SETTINGS frames within a second "
                            f"(more than {MAX_CONTROL_FRAMES_PER_SECOND})")

    def _roll_window(self) -> None:
        """Resets and control frames are counted per second: a new second starts at zero."""
        now = self.loop.time()
        if now - self._window_start >= 1.0:
            self._window_start, self._resets, self._control_frames = now, 0, 0

    def _calm_down(self, why: str) -> None:
        self.h2.close_connection(error_code=ErrorCodes.ENHANCE_YOUR_CALM)
        self._close(why, None)

    def _peer_went_away(self, ev) -> None:
        """GOAWAY from the peer: calls on streams past its last one are dropped; the others
        finish, and the connection closes after them."""
        self.conn.eof = True
        if not self.conn.inflight:
            self._close(None, None)

    def _window_opened(self, stream_id: int) -> None:
        # gRPC clients send two WINDOW_UPDATEs per call (its stream's, the connection's): only
        # the calls waiting for a window are looked at
        waiting = self.waiting_for_window
        if not waiting:
            return
        if stream_id:
            call = self.calls.get(stream_id)
            if call is not None and call in waiting:
                call.window_opened()
            return
        for call in list(waiting):
            call.window_opened()

    # -- bytes out -----------------------------------------------------------------------------
    def acknowledge(self, stream_id: int, n: int) -> None:
        """Give the peer `n` bytes of window back on `stream_id` (and the connection)."""
        if n:
            self.h2.acknowledge_received_data(n, stream_id)  # a closed stream's: the connection's only
            if not self.reading:
                self.schedule_flush()

    def schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write what h2 has to send, in one write."""
        self._flush_scheduled = False
        data = self.h2.data_to_send()
        if data:
            t = self.conn.transport
            if t is not None and not self.conn.is_closed:
                t.write(data)

    # -- authentication (once per connection, as baidu_std's) ----------------------------------
    async def authenticate(self, credential: bytes) -> bool:
        """Whether the connection is let in: options.auth verifies the `authorization` metadata
        of its first call; the calls that come meanwhile wait for that verdict."""
        if self.authenticated:
            return True
        if self._verdict is not None:
            return await asyncio.shield(self._verdict)
        verdict = self._verdict = self.loop.create_future()
        why = ""
        try:
            ok = self.server.options.auth.verify_credential(credential, self.conn.peer)
            if inspect.isawaitable(ok):
                ok = await ok
            ok = bool(ok)
        except Exception as e:  # noqa: BLE001 - the authenticator's failure refuses the connection
            ok, why = False, f": authenticator raised {e!r}"
        if ok:
            self.authenticated = True
            self.conn.credential = credential
        else:
            self.server.stats.count_close("auth_failed")
            _close_log(logging.WARNING, "authentication failed for %s%s", self.conn.peer, why)
        verdict.set_result(ok)
        return ok

    # -- lifecycle -----------------------------------------------------------------------------
    def call_ended(self, call: GrpcCall) -> None:
        if self.calls.get(call.stream_id) is call:
            del self.calls[call.stream_id]

    def _close(self, why: str | None, error_code) -> None:
        """End the connection: what h2 queued (a GOAWAY) goes out first."""
        if self.finished:
            return
        self.finished = True
        if why is not None:
            self.server.stats.count_close("bad_h2")
            _close_log(logging.WARNING, "closing HTTP/2 connection from %s: %s", self.conn.peer, why)
        elif error_code is not None:
            self.h2.close_connection(error_code=error_code)
        self.flush()
        for call in list(self.calls.values()):
            call.connection_lost()
        self.calls.clear()
        self.conn.close()

    def refuse(self) -> None:
        """Close after the replies written so far: authentication failed."""
        self._close(None, ErrorCodes.NO_ERROR)

    def goaway(self) -> None:
        """GOAWAY(NO_ERROR) before the connection closes (the server stops, or closes it)."""
        if not self.finished:
            try:
                self.h2.close_connection()
            except h2.exceptions.ProtocolError:  # the connection is closed already
                return
            self.flush()

    def eof_received(self) -> bool:
        """The peer half-closed: True keeps the write side open for calls still running."""
        return bool(self.conn.inflight) and not self.finished

    def closed(self) -> None:
        self.finished = True
        for call in list(self.calls.values()):
            call.connection_lost()
        self.calls.clear()
        self.deadlines.close()

    def respond_plain(self, stream_id: int, status: int, text: str) -> None:
        """An HTTP answer (not gRPC) to a request that is not a gRPC call."""
        respond_plain(self, stream_id, status, text)
