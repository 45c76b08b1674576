"""TCP glue: one asyncio.BufferedProtocol per connection over the baidu_std codec.

Bytes in: the kernel reads straight into the decoder's buffers (get_buffer/buffer_updated),
and every complete event goes to `event_received`. Bytes out: buffers produced during one
loop iteration are collected and flushed once, with one `writelines` on uvloop (which
sends them with one scatter-gather call and no join). Plain asyncio on Python 3.11 joins
whatever `writelines` gets, so there small buffers are joined here and large ones are
written one by one, which keeps an attachment from being copied into a joined bytes object.

Backpressure: bytes queued per connection (ours plus the transport's) are capped by
`max_unwritten_bytes`; `writable()` tells a caller whether another message may be queued, and
`wait_flushed()` lets a writer that can wait (a stream) wait until what is queued went to the
transport and the transport is not paused.

Streams: `streams` is the connection's StreamTable once a stream lives on it (None before), and
STRM frames go there.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from ..errors import RemoteProtocolError
from ..protocol.baidu_std import Decoder, buffers_size  # noqa: F401  (buffers_size: also from here)
from ..protocol.placement import PlacingDecoder

log = logging.getLogger(__name__)

# Requests and replies (write(early=True)) queued in one loop iteration go out in groups of this
# many instead of all at its end: the peer starts on the first group while this side makes the
# next, so on two cores client and server work at once instead of taking turns. Measured with
# bench/echo.py (16 B, 3 rounds): 4, 8, 12 and unbounded gave 34k, 44k, 30k and 24k QPS at 16 in
# flight, 40k, 51k, 45k and 27k at 128; fewer per group pays a syscall and a wake-up of the peer
# too often, more leaves the peer idle longer.
EARLY_FLUSH_MESSAGES = 8

DEFAULT_MAX_UNWRITTEN_BYTES = 64 * 1024 * 1024
_JOIN_LIMIT = 64 * 1024  # asyncio only: buffers below this are joined, larger are written alone
_LOG_INTERVAL = 1.0


class RateLimitedLog:
    """At most `burst` records per interval for a noisy cause (to `logger`, default this
    module's); counts what it suppressed and says so in the next record."""

    __slots__ = ("_next", "_left", "_burst", "_log", "suppressed")

    def __init__(self, logger: logging.Logger | None = None, burst: int = 1) -> None:
        self._next = 0.0
        self._burst = self._left = burst
        self._log = logger or log
        self.suppressed = 0

    def __call__(self, level: int, msg: str, *args) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + _LOG_INTERVAL
            self._left = self._burst
        if self._left <= 0:
            self.suppressed += 1
            return
        self._left -= 1
        if self.suppressed:
            msg += " (%d similar messages suppressed)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        self._log.log(level, msg, *args)


protocol_error_log = RateLimitedLog()


def _is_uvloop_transport(transport) -> bool:
    return type(transport).__module__.startswith("uvloop")


class FramedConnection(asyncio.BufferedProtocol):
    """Base of client and server connections. Subclasses implement `event_received`,
    `connection_made_hook` and `closed`."""

    def __init__(self, role: str, max_body_size: int,
                 max_unwritten_bytes: int = DEFAULT_MAX_UNWRITTEN_BYTES) -> None:
        self.decoder = Decoder(role, max_body_size)
        # The kernel side asks for a buffer once per read: the decoder's own method, with no
        # Python frame of ours in between (get_buffer below documents it).
        self.get_buffer = self.decoder.get_buffer
        self.max_body_size = max_body_size
        self.streams = None  # a StreamTable, made by the first stream on this connection
        self.write_paused = False
        self._flush_waiters: list | None = None
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.peer: str = ""
        self.local: str = ""
        self.max_unwritten_bytes = max_unwritten_bytes
        self.is_closed = False
        self.close_reason: BaseException | None = None
        self._out: list = []
        self._out_bytes = 0
        self._flush_scheduled = False
        self._early_queued = 0
        # While set, write() only queues: the owner flushes everything at once when it ends
        # (a server handling the requests of one read inline: one writev for their replies).
        self.batching_writes = False
        self._writelines_ok = False
        self.hold_events = False  # a subclass sets it to leave events buffered for now

    def placing_decoder(self) -> PlacingDecoder:
        """The decoder, made a PlacingDecoder (placing nothing yet) if it is not one."""
        decoder = self.decoder
        if type(decoder) is not PlacingDecoder:
            decoder = self.decoder = PlacingDecoder.around(decoder)
            self.get_buffer = decoder.get_buffer
            if self.transport is not None:
                # uvloop looks get_buffer up once, when it is given the protocol: again.
                self.transport.set_protocol(self)
        return decoder

    def receive_attachments_into(self, place) -> None:
        """Receive large attachments where `place(meta, data)` says (protocol/placement.py)."""
        self.placing_decoder().place = place

    # -- asyncio callbacks --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self._writelines_ok = _is_uvloop_transport(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # not TCP (a unix socket in a test); nothing to tune
                pass
        # No peername when the peer reset the connection before the transport was made: keep
        # the address the creator set.
        self.peer = _fmt(transport.get_extra_info("peername")) or self.peer
        self.local = _fmt(transport.get_extra_info("sockname"))
        self.connection_made_hook()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.decoder.buffer_updated(nbytes)
        self.process_events()

    def process_events(self) -> None:
        """Hand every complete buffered event to `event_received` (until `hold_events`)."""
        decoder = self.decoder
        next_frame = decoder.next_frame
        try:
            while not self.is_closed and not self.hold_events:
                frame = next_frame()  # most reads complete no frame: no Python frame for those
                if frame is None:
                    break
                self.event_received(decoder.event(frame))
        except RemoteProtocolError as e:
            self.protocol_error(e)
        except Exception as e:  # a bug of ours: this connection closes, named, the others go on
            log.error("closing connection with %s: handling its bytes raised %r", self.peer, e, exc_info=e)
            self.abort(e)

    def eof_received(self) -> bool:
        # Keep the write side open so replies to requests already received still go out
        # (a client may half-close after its last request).
        pending = self.decoder.pending_bytes()
        if pending:
            protocol_error_log(logging.WARNING, "%s closed with a truncated frame of %d bytes buffered",
                               self.peer, pending)
        keep_open = self.keep_open_after_eof()
        if not keep_open and self._out:
            self._flush()  # replies queued this turn go out before the transport closes
        return keep_open

    def connection_lost(self, exc) -> None:
        if self.is_closed and self.transport is None:
            return
        self.is_closed = True
        t, self.transport = self.transport, None
        if exc is not None and t is not None and not t.is_closing():
            # Python 3.10's TLS transport, lost to a TLS error, is left "open" (a
            # ResourceWarning when collected); closing a lost transport does nothing else.
            try:
                t.close()
            except Exception:  # noqa: BLE001 - it is gone either way
                pass
        self._out.clear()
        self._out_bytes = 0
        self.decoder.reader.rbuf.clear()
        self._wake_flush_waiters()
        self.closed(self.close_reason or exc)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._flush_waiters and not self._out:
            self._wake_flush_waiters()

    # -- hooks -------------------------------------------------------------------------------
    def connection_made_hook(self) -> None:
        pass

    def keep_open_after_eof(self) -> bool:
        return False

    def closed(self, exc: BaseException | None) -> None:
        pass

    # -- writing -----------------------------------------------------------------------------
    def unwritten_bytes(self) -> int:
        t = self.transport
        try:
            return self._out_bytes + (t.get_write_buffer_size() if t is not None else 0)
        except AttributeError:  # Python 3.10's TLS transport, once its connection is lost
            return self._out_bytes

    def writable(self, nbytes: int = 0) -> bool:
        """Whether `nbytes` more may be queued without passing max_unwritten_bytes."""
        t = self.transport  # unwritten_bytes(), without its call: this runs for every message
        try:
            return self._out_bytes + (t.get_write_buffer_size() if t is not None else 0) + nbytes <= \
                self.max_unwritten_bytes
        except AttributeError:  # Python 3.10's TLS transport, once its connection is lost
            return self._out_bytes + nbytes <= self.max_unwritten_bytes

    def write(self, buffers: list, nbytes: int = -1, alone: bool = False, now: bool = False,
              early: bool = False) -> None:
        """Queue one message's buffers; they go out at the end of this loop iteration.

        `early`: a request or reply the peer can start on before the rest of this iteration's
        messages: every EARLY_FLUSH_MESSAGES of them go out at once (stream frames do not set
        it: a stream's writes of one iteration go in one send).

        `alone`: the caller knows no other message is coming now (one call in flight), so
        waiting for more to coalesce would only add a loop iteration of latency: it goes out
        at once unless something is already queued. `now`: it goes out at once, after what is
        queued (a large stream message: its bytes pay for the syscall, and waiting a loop
        iteration to batch it would only add a wake-up).
        """
        if self.is_closed:
            return
        if nbytes < 0:
            nbytes = buffers_size(buffers)
        out = self._out
        out.extend(buffers)
        self._out_bytes += nbytes
        if now:  # held replies of this read, if any, go out first: the order is kept
            self._flush()
            return
        if early:
            n = self._early_queued + 1
            if n >= EARLY_FLUSH_MESSAGES:
                self._send_queued()  # the scheduled flush, if any, sends what comes after
                return
            self._early_queued = n
        if self.batching_writes:
            return
        if alone and not self._flush_scheduled:
            self._flush()
            return
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self._send_queued()

    def _send_queued(self) -> None:
        self._early_queued = 0
        out = self._out
        if not out or self.transport is None:
            return
        self._out = []
        self._out_bytes = 0
        if self._writelines_ok:
            self.transport.writelines(out)
        else:
            self._write_joined(out)
        if self._flush_waiters and not self.write_paused:
            self._wake_flush_waiters()

    def _write_joined(self, out: list) -> None:
        small: list = []
        for buf in out:
            if len(buf) < _JOIN_LIMIT if type(buf) is bytes else buf.nbytes < _JOIN_LIMIT:
                small.append(buf)
                continue
            if small:
                self.transport.write(b"".join(small))
                small = []
            self.transport.write(buf)
        if small:
            self.transport.write(b"".join(small) if len(small) > 1 else small[0])

    def pace_writes(self, low_water: int) -> None:
        """Let `wait_flushed` return once the transport holds at most `low_water` bytes (its
        buffer limits become `low_water`), not only once it has almost drained: a writer of
        pieces of `low_water` bytes then waits only while more than one piece is queued."""
        if self.transport is not None and not self.is_closed:
            self.transport.set_write_buffer_limits(high=low_water, low=low_water)

    async def wait_flushed(self) -> None:
        """Wait until what is queued went to the transport and the transport is not paused
        (its buffer is below its low-water mark, see pace_writes). ConnectionError once the
        connection closed."""
        while True:
            if self.is_closed:
                raise ConnectionError(f"connection to {self.peer} is closed")
            if not self._out and not self.write_paused:
                return
            fut = self.loop.create_future()
            if self._flush_waiters is None:
                self._flush_waiters = [fut]
            else:
                self._flush_waiters.append(fut)
            await fut

    def _wake_flush_waiters(self) -> None:
        waiters, self._flush_waiters = self._flush_waiters, None
        if waiters:
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def close(self, reason: BaseException | None = None) -> None:
        """Flush what is queued, then close."""
        if self.is_closed:
            return
        if reason is not None and self.close_reason is None:
            self.close_reason = reason
        self.is_closed = True
        if self.transport is not None:
            self._flush()
            self.transport.close()
        self._wake_flush_waiters()

    def abort(self, reason: BaseException | None = None) -> None:
        """Close now, dropping what is queued."""
        if reason is not None and self.close_reason is None:
            self.close_reason = reason
        self.is_closed = True
        if self.transport is not None:
            self.transport.abort()
        self._wake_flush_waiters()

    def protocol_error(self, e: RemoteProtocolError) -> None:
        """A fatal framing error: log the cause and close at once."""
        self.protocol_error_log_only(e)
        self.abort(e)

    def protocol_error_log_only(self, e: RemoteProtocolError) -> None:
        rbuf = self.decoder.reader.rbuf
        head = bytes(rbuf.peek(min(rbuf.available(), 32))).hex()
        protocol_error_log(logging.WARNING, "closing connection with %s: %s (next bytes: %s)",
                           self.peer, e, head or "none")


def _fmt(addr) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = addr[0]
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    return str(addr) if addr else ""
