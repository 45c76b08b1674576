"""The HTTP/2 side of one server connection: framing, HPACK and flow control by the `h2`
package (never by hand) under aiobrpc's HTTP/2 policy (protocol/h2_policy.py), the limits a
hostile peer meets, and the calls on its streams.

A connection becomes an H2Session when its first bytes are the HTTP/2 preface (h2c with prior
knowledge, or inside TLS, whose ALPN offers `h2`). Each read is handed to h2 once; the frames
it makes us send (replies of calls that finished meanwhile, acknowledgements, window updates)
go out in one write at the end of that read, and those made later in one write per loop
iteration.

Limits, each ending the connection with a GOAWAY and one (rate-limited) log line naming the
cause: a protocol error h2 or the policy finds (a malformed frame, a frame longer than
MAX_FRAME_SIZE, refused from its header: FRAME_SIZE_ERROR; a header list over
MAX_HEADER_LIST_SIZE or a header block over twice that, a CONTINUATION flood:
ENHANCE_YOUR_CALM; a WINDOW_UPDATE past 2^31-1: FLOW_CONTROL_ERROR); more than
MAX_RESETS_PER_SECOND streams reset by the peer or refused to it in a second ("Rapid Reset",
ENHANCE_YOUR_CALM); more than MAX_CONTROL_FRAMES_PER_SECOND PING and SETTINGS frames in a
second (ENHANCE_YOUR_CALM); no stream opened within first_frame_timeout_sec, a header block
left unfinished as long, or no stream open for idle_timeout_sec (the watchdog).

Limits that end one stream only: a stream past MAX_CONCURRENT_STREAMS (RST_STREAM
REFUSED_STREAM), a malformed request (RFC 9113 §8.2: RST_STREAM PROTOCOL_ERROR before any
handler runs), a gRPC message over max_body_size (RESOURCE_EXHAUSTED), anything wrong inside
one call.

Memory a peer makes a connection hold: request bytes at most CONNECTION_WINDOW plus
max_body_size (see "the receive windows" below); h2's read buffer one frame still arriving
(MAX_FRAME_SIZE) or one header block (2 x MAX_HEADER_LIST_SIZE); decoded headers at most
MAX_HEADER_LIST_SIZE per stream open; reply bytes not yet written max_unwritten_bytes plus
one message (GrpcCall._send_response).
"""

from __future__ import annotations

import asyncio
import logging

import h2.events
import h2.exceptions
from h2.errors import ErrorCodes

from ...deadlines import TimerWheel
from ...protocol import grpc as codec
from ...protocol import h2_policy
from ...protocol.h2_policy import MALFORMED_REQUEST
from ...transport.tcp import RateLimitedLog
from .. import auth
from .call import GrpcCall, respond_plain

log = logging.getLogger(__name__)
_close_log = RateLimitedLog()
_stream_log = RateLimitedLog()

MAX_CONCURRENT_STREAMS = 100  # brpc's h2 default (-h2_max_concurrent_streams)
MAX_HEADER_LIST_SIZE = 64 * 1024
STREAM_WINDOW = 4 * 1024 * 1024  # what a peer may send on one stream before we read it
MAX_FRAME_SIZE = 1024 * 1024  # fewer, larger DATA frames for large messages (16 KiB is HTTP/2's least)
CONNECTION_WINDOW = 32 * 1024 * 1024  # ... and on all of them: what request bytes a connection holds
STARVED_WINDOW = 16 * 1024  # a connection window under this lets no message complete: lend
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
_StreamRefused = h2_policy.StreamRefused


class H2Session:
    """The HTTP/2 side of `conn`, a ServerConnection whose first bytes were the h2 preface."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.server = conn.server
        self.loop = conn.loop
        self.deadlines = TimerWheel(self.loop, GrpcCall.deadline_passed)  # the calls' grpc-timeouts, one loop timer
        self.h2 = h2_policy.server_connection(
            max_concurrent_streams=MAX_CONCURRENT_STREAMS, max_header_list_size=MAX_HEADER_LIST_SIZE,
            stream_window=STREAM_WINDOW, max_frame_size=MAX_FRAME_SIZE, connection_window=CONNECTION_WINDOW)
        self.lend_limit = self.server.options.max_body_size + codec.PREFIX_SIZE  # one message past the window
        self._window_low = CONNECTION_WINDOW // 2
        self.calls: dict[int, GrpcCall] = {}
        self.waiting_for_window: set[GrpcCall] = set()  # calls with a reply held by flow control
        self.authenticated = self.server.options.auth is None
        self._verdict: asyncio.Task | None = None  # the connection's one verification, once asked
        self.finished = False
        self.draining = False  # the peer sent GOAWAY or EOF: no new stream, closed after the last call
        self.peer_eof = False  # nothing more comes from the peer: no WINDOW_UPDATE either
        self.reading = False
        self._flush_scheduled = False
        self._window_start = 0.0  # the second that resets and control frames are counted in
        self._resets = 0
        self._refused = 0
        self._control_frames = 0
        self._busy_at = self.loop.time()  # when the watchdog last saw a stream open (or opened since)
        self._streams_seen = 0
        self._block_seen = None  # the unfinished header block the watchdog saw last, and since when
        self._block_seen_at = 0.0
        opts = self.server.options
        first, idle = opts.first_frame_timeout_sec, opts.idle_timeout_sec
        self._first_stream_timer: asyncio.TimerHandle | None = self.loop.call_later(first, self._no_first_stream)
        self._watch_every = min(first, idle) if idle > 0 else first
        self._watchdog: asyncio.TimerHandle | None = self.loop.call_later(self._watch_every, self._watch)
        self.flush()

    # -- bytes in ------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.finished:
            return
        self.reading = True  # replies made meanwhile go out with this read's flush
        h2c = self.h2
        try:
            events = h2c.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            self.reading = False
            # h2 has queued the GOAWAY with the error's code (FLOW_CONTROL_ERROR for a window
            # past 2^31-1, FRAME_SIZE_ERROR, ENHANCE_YOUR_CALM for a header block too large, ...)
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
                    self.release(ev.flow_controlled_length)
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
            elif t is _StreamRefused:
                self._stream_refused(ev)
            elif t is _ConnectionTerminated:
                self._peer_went_away(ev)
            if self.finished:
                self.reading = False
                return
        if h2c.inbound_flow_control_window < self._window_low:
            self._connection_window_low()
        self.reading = False
        self.flush()

    def _request_received(self, ev) -> None:
        conn = self.conn
        conn.frames += 1
        sid = ev.stream_id
        headers = ev.headers
        if headers[0][0] == MALFORMED_REQUEST:
            self._refuse_stream(sid, ErrorCodes.PROTOCOL_ERROR, headers[0][1].decode())
            return
        if self.draining:  # after the peer's GOAWAY: it opens no stream (RFC 9113 §6.8), or may retry it
            self._refuse_stream(sid, ErrorCodes.REFUSED_STREAM, None)
            return
        call = GrpcCall(self, sid)
        self.calls[sid] = call
        call.headers_received(headers, ev.stream_ended is not None)

    def _refuse_stream(self, stream_id: int, error_code, why: str | None) -> None:
        """RST_STREAM before any call began on it; counted as a reset (a peer that keeps doing
        it is told to calm down)."""
        if why is not None:
            _stream_log(logging.WARNING, "resetting stream %d of %s (%s): malformed request: %s",
                        stream_id, self.conn.peer, error_code.name, why)
        try:
            self.h2.reset_stream(stream_id, error_code)
        except h2.exceptions.ProtocolError:  # closed already, by a later frame of the same read
            pass
        self._count_reset(refused=True)

    def _stream_reset(self, ev) -> None:
        call = self.calls.pop(ev.stream_id, None)
        if call is not None:
            call.reset_by_peer()
            if self.draining:
                self.close_if_drained()
        self._count_reset(refused=False)

    def _stream_refused(self, ev) -> None:
        """h2_policy refused a stream past MAX_CONCURRENT_STREAMS (RST_STREAM REFUSED_STREAM)."""
        self._count_reset(refused=True)

    def _count_reset(self, refused: bool) -> None:
        self._roll_window()
        if refused:
            self._refused += 1
        else:
            self._resets += 1
        if self._resets + self._refused > MAX_RESETS_PER_SECOND:
            self._calm_down(f"{self._resets} streams reset by the peer and {self._refused} refused to it within "
                            f"a second (more than {MAX_RESETS_PER_SECOND}: a rapid reset flood)")

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
            self._window_start, self._resets, self._refused, self._control_frames = now, 0, 0, 0

    def _calm_down(self, why: str) -> None:
        self._close(why, ErrorCodes.ENHANCE_YOUR_CALM)

    def _peer_went_away(self, ev) -> None:
        """GOAWAY from the peer. A graceful one (NO_ERROR: a client or proxy draining the
        connection) speaks of streams we would have pushed, none: every call it opened is
        answered, streams it opens after are refused, and the connection closes after the last
        call. Any other code ends the connection now."""
        if ev.error_code != ErrorCodes.NO_ERROR:
            code = getattr(ev.error_code, "name", ev.error_code)
            self._close(f"the peer sent GOAWAY({code})", None, level=logging.INFO, reason=None)
            return
        self.draining = True
        self.close_if_drained()

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

    # -- the receive windows -------------------------------------------------------------------
    # What the server holds of request messages (GrpcCall.held: the bytes of a message still
    # arriving, and of messages a streaming handler has not taken) is given back to the
    # connection's window only when released: a peer makes the connection hold at most
    # CONNECTION_WINDOW plus what was lent, lend_limit (max_body_size and a message prefix),
    # so that one message larger than what is left of the window still arrives. A stream's
    # own window is given back as its bytes arrive (GrpcCall.data_received).
    def release(self, n: int) -> None:
        """`n` bytes received are held no more (or were never held)."""
        if n and not self.finished and self.h2.release(n) and not self.reading:
            self.schedule_flush()

    def acknowledge_stream(self, stream_id: int, n: int) -> None:
        """Give the peer `n` bytes of `stream_id`'s window back, not the connection's."""
        if n and self.h2.acknowledge_stream(n, stream_id) and not self.reading:
            self.schedule_flush()

    def _connection_window_low(self) -> None:
        """After a read that left the connection's window under half: what was released goes
        back now. A window too small for a message to complete while no message waits for a
        streaming handler to take it is starved: a part of lend_limit is lent (a unary message
        larger than what is left of the window, or several arriving side by side)."""
        h2c = self.h2
        h2c.give_back()
        if h2c.inbound_flow_control_window >= STARVED_WINDOW:
            return
        held = 0
        for call in self.calls.values():
            if call.messages and call.entry.client_streaming:
                return  # its handler will take them, releasing their bytes
            held += call.held
        lendable = self.lend_limit - h2c.lent
        if held and lendable > 0:
            h2c.lend(min(lendable, STREAM_WINDOW))

    def held_bytes(self) -> int:
        """Bytes of request messages the connection holds (for tests and introspection)."""
        return sum(call.held for call in self.calls.values())

    # -- bytes out -----------------------------------------------------------------------------
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
        of its first call; the calls that come meanwhile wait for that verdict. The verification
        is a task of its own (the server's stop cancels it), not the first call's: a call that
        ends while it runs (its deadline, a reset) leaves it to the others. One cancelled is
        asked again by the next call."""
        if self.authenticated:
            return True
        verdict = self._verdict
        if verdict is None or verdict.cancelled():
            verdict = self._verdict = self.loop.create_task(self._verify(credential))
            self.server._track(verdict)
        return await asyncio.shield(verdict)

    async def _verify(self, credential: bytes) -> bool:
        ok, why = await auth.verify(self.server.options.auth, credential, self.conn.peer)
        if ok:
            self.authenticated = True
            self.conn.credential = credential
        else:
            self.server.stats.count_close("auth_failed")
            _close_log(logging.WARNING, "authentication failed for %s%s", self.conn.peer, f": {why}" if why else "")
        return ok

    # -- timers: a stream in time, a header block finished in time, idleness ---------------------
    def _no_first_stream(self) -> None:
        """A connection must open a stream within first_frame_timeout_sec (the preface and
        SETTINGS alone hold it open no longer than a silent one)."""
        self._first_stream_timer = None
        if not self.conn.frames:
            first = self.server.options.first_frame_timeout_sec
            self._close(f"no stream opened within first_frame_timeout_sec={first}", ErrorCodes.NO_ERROR,
                        level=logging.INFO, reason="first_frame_timeout")

    def _watch(self) -> None:
        """Every min(first_frame_timeout_sec, idle_timeout_sec): a header block unfinished for
        first_frame_timeout_sec ends the connection (a CONTINUATION frame now and then holds no
        connection), and so does no stream open for idle_timeout_sec (nor do PINGs)."""
        self._watchdog = None
        if self.finished:
            return
        opts = self.server.options
        first = opts.first_frame_timeout_sec
        idle = opts.idle_timeout_sec
        now = self.loop.time()
        conn = self.conn
        block = self.h2.unfinished_header_block()
        if block is None or block is not self._block_seen:
            self._block_seen, self._block_seen_at = block, now
        elif now - self._block_seen_at >= first:
            self._close(f"a header block unfinished (no END_HEADERS) for first_frame_timeout_sec={first}",
                        ErrorCodes.ENHANCE_YOUR_CALM)
            return
        if self.calls or conn.inflight or conn.frames != self._streams_seen:
            self._busy_at, self._streams_seen = now, conn.frames
        elif idle > 0 and now - self._busy_at >= idle:
            self._close(f"no stream open for idle_timeout_sec={idle}", ErrorCodes.NO_ERROR,
                        level=logging.INFO, reason="idle_timeout")
            return
        self._watchdog = self.loop.call_later(self._watch_every, self._watch)

    # -- lifecycle -----------------------------------------------------------------------------
    def call_ended(self, call: GrpcCall) -> None:
        calls = self.calls
        if calls.get(call.stream_id) is call:
            del calls[call.stream_id]
            if self.draining and not calls:
                self.close_if_drained()

    def close_if_drained(self) -> None:
        """After the peer's GOAWAY or EOF: close once no call is left."""
        if not self.calls and not self.conn.inflight and not self.finished:
            self._close(None, ErrorCodes.NO_ERROR)

    def _close(self, why: str | None, error_code, *, level: int = logging.WARNING,
               reason: str | None = "bad_h2") -> None:
        """End the connection: GOAWAY(`error_code`) (None: h2 queued one already, or none is
        due) and what h2 queued go out first; `why`, if given, is logged, and counted in the
        server's stats.closed as `reason`."""
        if self.finished:
            return
        self.finished = True
        if error_code is not None:
            try:
                self.h2.close_connection(error_code=error_code)
            except h2.exceptions.ProtocolError:  # closed already
                pass
        if why is not None:
            if reason is not None:
                self.server.stats.count_close(reason)
            _close_log(level, "closing HTTP/2 connection from %s: %s", self.conn.peer, why)
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
        """The peer closed its side: no frame comes any more, no request byte and no
        WINDOW_UPDATE. A call whose request is unfinished, or whose reply waits for a window,
        can never end: it ends now (ECANCELED, its handler cancelled). The others finish and
        their replies are written (a client may half-close and read on); True keeps the write
        side open for them, and the connection closes after the last."""
        if self.finished:
            return False
        self.peer_eof = self.draining = True
        waiting = self.waiting_for_window
        for call in list(self.calls.values()):
            if not call.request_done or call in waiting:
                call.peer_closed()
        return bool(self.conn.inflight) and not self.finished

    def closed(self) -> None:
        self.finished = True
        for call in list(self.calls.values()):
            call.connection_lost()
        self.calls.clear()
        self.deadlines.close()
        for timer in (self._first_stream_timer, self._watchdog):
            if timer is not None:
                timer.cancel()
        self._first_stream_timer = self._watchdog = None

    def respond_plain(self, stream_id: int, status: int, text: str) -> None:
        """An HTTP answer (not gRPC) to a request that is not a gRPC call."""
        respond_plain(self, stream_id, status, text)
