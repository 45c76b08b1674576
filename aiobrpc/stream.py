"""Streaming RPC (brpc's docs/en/streaming_rpc.md): ordered, flow-controlled, full-duplex message
channels carried on the connection of the call that created them.

A client creates streams on a Controller before a call; the server's handler accepts them;
once the call succeeded both ends write messages and read them, by iteration or through a
handler object with brpc's StreamInputHandler shape. The wire format is brpc's (STRM frames,
aiobrpc/protocol/streaming.py), so either end may be C++ brpc.

Flow control is brpc's: a writer may have `max_buf_size` bytes written and not yet consumed by
the reader (the window may be passed by one message), and the reader reports what it consumed
in FEEDBACK frames. The reader also enforces it: a peer that writes more than its window plus
one message (`max_body_size`) without waiting is reset, so memory stays bounded whatever it
sends.

A stream ends exactly once, by whichever comes first: `close()` at either end, an RST, the
connection's loss, the idle timeout (iteration form), the call that created it failing, or a
protocol violation of the peer. Then blocked writers raise, readers see the end of iteration
(a clean close, after the messages already received) or the error, and the handler gets
`on_failed` (on an error) then `on_closed`.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import itertools
import logging
from typing import Any

from . import _fast
from .controller import Controller
from .errors import (EAGAIN, EBADF, ECANCELED, ECONNRESET, EFAILEDSOCKET, EINTERNAL, EPROTO, EREQUEST,
                     ERPCTIMEDOUT, RemoteProtocolError, RpcError)
from .protocol import streaming

log = logging.getLogger(__name__)

__all__ = ["Stream", "StreamHandler"]

_PENDING, _CONNECTED, _ENDED = 0, 1, 2
_ids = itertools.count(1)  # process-wide: an id is never reused, so a late frame never finds a new stream
_SEND_CLOSE, _SEND_RST = 1, 2
# A message at least this large is sent at once (after what is queued), not at the end of the
# loop iteration: its bytes pay for the syscall, and batching it would only add a wake-up.
_FLUSH_NOW_BYTES = 256 * 1024


class StreamHandler:
    """brpc's StreamInputHandler: pass one as `handler=` to receive by callbacks instead of
    iterating. Every method is optional; `on_received_messages` may be `async def` (the next
    batch waits for it, and what it consumed is reported to the writer after it returns).

    >>> class Printer(aiobrpc.StreamHandler):  # doctest: +SKIP
    ...     def on_received_messages(self, stream, messages):
    ...         for m in messages:
    ...             print(bytes(m))
    ...     def on_closed(self, stream):
    ...         print("closed")
    """

    def on_received_messages(self, stream: Stream, messages: list) -> Any:
        """Up to `messages_in_batch` messages (memoryviews), in order."""

    def on_idle_timeout(self, stream: Stream) -> None:
        """No message was consumed for `idle_timeout_ms`; called again after each such period."""

    def on_failed(self, stream: Stream, error: RpcError) -> None:
        """The stream ended with an error (`error.code`, `error.text`); `on_closed` follows."""

    def on_closed(self, stream: Stream) -> None:
        """The stream ended; called once, after the last message."""


class Stream:
    """One end of a stream. Made by `Stream.create` / `Stream.create_many` (client, before the
    call) or `Stream.accept` (in the server's handler), never directly.

    Client:

    >>> cntl = aiobrpc.Controller()  # doctest: +SKIP
    >>> stream = aiobrpc.Stream.create(cntl)  # doctest: +SKIP
    >>> await stub.StartStream(request, cntl)  # doctest: +SKIP
    >>> await stream.write(b"hello")  # doctest: +SKIP
    >>> async for message in stream:  # doctest: +SKIP
    ...     print(bytes(message))
    >>> await stream.close()  # doctest: +SKIP

    Server (an `async def` handler):

    >>> async def StartStream(self, request, cntl):  # doctest: +SKIP
    ...     if cntl.has_remote_stream:
    ...         stream = aiobrpc.Stream.accept(cntl)
    ...         asyncio.create_task(echo(stream))  # runs once the response is sent
    ...     return EchoResponse(message="ok")

    Options (`create`, `create_many`, `accept`):
        max_buf_size (int): The send window in bytes (default 2 MiB): bytes written and not yet
            consumed by the reader; `write` waits while it is full. 0 or less: unlimited (the
            peer then sends no FEEDBACK). Receiving, a peer that passes its window by more than
            one message is reset; a C++ peer with a larger window than this needs the same
            `max_buf_size` here.
        idle_timeout_ms (int): -1 (default): none. Otherwise, when no message was consumed for
            that long, the handler's `on_idle_timeout` runs (again after each such period); a
            stream read by iteration ends with ERPCTIMEDOUT instead, and resets the peer's end
            (an RST: the peer's stream fails with ECONNRESET, never ends as if closed).
        messages_in_batch (int): The most messages per `on_received_messages` (default 128).
        handler (StreamHandler | None): Receive by callbacks; None (default): by iteration
            (`async for message in stream`, or `await stream.read()`).

    Attributes:
        id (int): This end's stream id (the peer routes its frames to it).
        remote_side (str): "ip:port" of the peer, once the stream is on a connection.
        error (RpcError | None): Why the stream ended, when it ended with an error.
    """

    __slots__ = ("id", "remote_side", "error", "_conn", "_peer_id", "_state", "_max_buf_size",
                 "_idle_timeout_ms", "_messages_in_batch", "_handler", "_awaiting_response",
                 "_peer_need_feedback", "_peer_writable", "produced", "_remote_consumed", "consumed",
                 "_unconsumed", "_feedback_sent", "_recv_cap", "_segment_size", "_queue", "_reassembly", "_backlog",
                 "_writer_busy", "_write_turns", "_waiters", "_reader", "_feedback_scheduled", "_idle_handle",
                 "_last_active", "_closed_fut", "_handler_task", "_handler_live", "_delivering", "_notified",
                 "_close_pending",
                 "_data_meta", "_data_meta_more", "_feedback_meta", "_last_head", "_loop")

    def __init__(self, max_buf_size: int, idle_timeout_ms: int, messages_in_batch: int, handler) -> None:
        self.id = next(_ids)
        self.remote_side = ""
        self.error: RpcError | None = None
        self._conn = None
        self._peer_id: int | None = None
        self._state = _PENDING
        self._max_buf_size = max_buf_size
        self._idle_timeout_ms = idle_timeout_ms
        self._messages_in_batch = messages_in_batch
        self._handler = handler
        self._awaiting_response = False
        self._peer_need_feedback = False
        self._peer_writable = True
        self.produced = 0  # message bytes accepted for sending
        self._remote_consumed = 0  # the largest consumed_size the peer reported
        self.consumed = 0  # message bytes this end consumed (reported to the peer)
        self._unconsumed = 0
        self._feedback_sent = 0  # the consumed count of the last FEEDBACK sent
        self._recv_cap = 0
        self._segment_size = streaming.DEFAULT_MAX_SEGMENT_SIZE
        self._queue: collections.deque = collections.deque()
        self._reassembly: streaming.Reassembly | None = None
        self._backlog: list = []
        self._writer_busy = False  # a write() is in its slow path: later ones queue behind it
        self._write_turns: collections.deque | None = None  # futures of writes waiting for their turn
        self._waiters: list = []
        self._reader: asyncio.Future | None = None
        self._feedback_scheduled = False
        self._idle_handle = None
        self._last_active = 0.0
        self._closed_fut: asyncio.Future | None = None
        self._handler_task: asyncio.Task | None = None  # awaits an awaitable the handler returned
        self._handler_live = False  # the handler form, connected: batches go to the handler
        self._delivering = False  # a delivery is scheduled, or the handler's awaitable runs
        self._notified = False
        self._close_pending = False
        self._data_meta = b""
        self._data_meta_more = b""
        self._feedback_meta = b""
        self._last_head = (-1, b"")  # (size, DATA head) of the last single-frame message
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- creating ------------------------------------------------------------------------------
    @classmethod
    def create(cls, cntl: Controller, *, max_buf_size: int = streaming.DEFAULT_MAX_BUF_SIZE,
               idle_timeout_ms: int = -1, messages_in_batch: int = streaming.DEFAULT_MESSAGES_IN_BATCH,
               handler: StreamHandler | None = None) -> Stream:
        """A stream offered to the server with the next call made with `cntl` (brpc's
        StreamCreate). It is usable once that call succeeded, and ends with the call's error
        if the call fails (or with EREQUEST if the server did not accept it). The call is
        made on a single connection, with no retry and no backup request."""
        return cls.create_many(cntl, 1, max_buf_size=max_buf_size, idle_timeout_ms=idle_timeout_ms,
                               messages_in_batch=messages_in_batch, handler=handler)[0]

    @classmethod
    def create_many(cls, cntl: Controller, n: int, *, max_buf_size: int = streaming.DEFAULT_MAX_BUF_SIZE,
                    idle_timeout_ms: int = -1, messages_in_batch: int = streaming.DEFAULT_MESSAGES_IN_BATCH,
                    handler: StreamHandler | None = None) -> list:
        """`n` streams offered with one call (the server accepts them all or none); each gets
        these options."""
        if not isinstance(cntl, Controller):
            raise TypeError(f"cntl must be a Controller, got {type(cntl).__name__}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if cntl._streams is not None:
            raise ValueError("this Controller already has streams for its next call")
        _check_options(max_buf_size, idle_timeout_ms, messages_in_batch, handler)
        streams = [cls(max_buf_size, idle_timeout_ms, messages_in_batch, handler) for _ in range(n)]
        cntl._streams = streams
        return streams

    @classmethod
    def accept(cls, cntl: Controller, *, max_buf_size: int = streaming.DEFAULT_MAX_BUF_SIZE,
               idle_timeout_ms: int = -1, messages_in_batch: int = streaming.DEFAULT_MESSAGES_IN_BATCH,
               handler: StreamHandler | None = None):
        """In an `async def` handler whose request offered streams (`cntl.has_remote_stream`):
        accept them (brpc's StreamAccept). Returns the stream, or the list of streams when the
        client offered several. They connect when the handler's response is sent; what is
        written before that is sent right after the response, up to `max_buf_size` bytes (a
        write beyond raises EAGAIN: the response cannot go before the handler returns)."""
        offer = cntl._stream_offer
        if offer is None:
            raise ValueError("the request offers no stream (see cntl.has_remote_stream)")
        if cntl._accepted_streams is not None:
            raise ValueError("the streams of this request are already accepted")
        conn, settings = offer
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not conn.loop:
            raise RuntimeError("Stream.accept() must be called on the server's event loop (from an "
                               "async def handler)")
        _check_options(max_buf_size, idle_timeout_ms, messages_in_batch, handler)
        table = conn.stream_table()
        streams = []
        for peer_id in settings.stream_ids:
            s = cls(max_buf_size, idle_timeout_ms, messages_in_batch, handler)
            s._attach(conn)
            s._peer_id = peer_id
            s._peer_need_feedback = settings.need_feedback
            s._peer_writable = settings.writable
            if conn.is_closed:
                s._end(EFAILEDSOCKET, f"Connection to {conn.peer} closed")
            else:
                table.add(s)
            streams.append(s)
        cntl._accepted_streams = streams
        return streams[0] if len(streams) == 1 else streams

    # -- state ---------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether the stream has ended (closed by either side, reset or failed)."""
        return self._state == _ENDED

    @property
    def connected(self) -> bool:
        """Whether the stream is connected to its peer and not ended."""
        return self._state == _CONNECTED

    async def wait_closed(self) -> None:
        """Wait until the stream has ended (whichever way); never raises its error."""
        if self._state == _ENDED:
            return
        if self._closed_fut is None:
            self._closed_fut = self._get_loop().create_future()
        await asyncio.shield(self._closed_fut)

    def __repr__(self) -> str:
        state = ("pending", "connected", "closed")[self._state]
        return f"<Stream {self.id} peer={self._peer_id} {state}{f' {self.error}' if self.error else ''}>"

    # -- writing -------------------------------------------------------------------------------
    async def write(self, message) -> None:
        """Send one message: any C-contiguous buffer (bytes, bytearray, memoryview, a numpy
        array), referenced until it is written to the socket, so do not change it meanwhile.

        Waits while the window (`max_buf_size`) is full or the connection's queue is; messages
        larger than 1 MiB go in segments, between which other streams and calls are sent.
        Raises RpcError: the stream's error once it ended (ECONNRESET after a close), EBADF
        when the peer does not read (brpc's EBADF: it has no handler), EAGAIN when the window
        is full before the stream is connected."""
        view = streaming.message_view(message)
        n = view.nbytes
        if not self._writer_busy and self._state == _CONNECTED and self._peer_writable and n <= self._segment_size:
            # The common case needs no turn and no wait: nothing below awaits, so no other
            # writer can come between the window check and the write.
            window = self._max_buf_size
            conn = self._conn
            if (window <= 0 or self.produced < self._remote_consumed + window) and conn.writable(n):
                self.produced += n
                self._write_whole(conn, view, n)
                return
        # Writes that wait go one at a time, in the order they were made (a FIFO of turns; the
        # turn passes straight from one writer to the next).
        if self._writer_busy:
            await self._wait_turn()
        else:
            self._writer_busy = True
        try:
            while True:
                state = self._state
                if state == _CONNECTED:
                    if not self._peer_writable:
                        raise RpcError(EBADF, f"the peer of stream {self.id} does not read it (it has no handler)")
                    window = self._max_buf_size
                    if window <= 0 or self.produced < self._remote_consumed + window:
                        break
                    fut = self._loop.create_future()  # woken by a FEEDBACK, or the end
                    self._waiters.append(fut)
                    try:
                        await fut
                    finally:
                        if not fut.done():
                            fut.cancel()
                elif state == _PENDING:
                    window = self._max_buf_size
                    if self._close_pending:
                        raise self._write_error()
                    if self.produced >= (window if window > 0 else streaming.DEFAULT_MAX_BUF_SIZE):
                        raise RpcError(EAGAIN, f"stream {self.id} is not connected yet and its window "
                                               f"(max_buf_size={window}) is full")
                    self.produced += n
                    self._backlog.append(view)
                    return
                else:
                    raise self._write_error()
            self.produced += n
            conn = self._conn
            if n <= self._segment_size and conn.writable(n):  # the usual wake-up: no coroutine more
                self._write_whole(conn, view, n)
                return
            await self._send(view, n)
        finally:
            self._next_writer()

    def _write_whole(self, conn, view: memoryview, n: int) -> None:
        """One DATA frame carrying the whole message (n <= the segment size)."""
        head = self._last_head
        if head[0] != n:  # messages of one size share their DATA head
            head = self._last_head = (n, streaming.data_head(self._data_meta, n))
        conn.write([head[1], view] if n else [head[1]], n + len(head[1]), now=n >= _FLUSH_NOW_BYTES)

    async def _wait_turn(self) -> None:
        turns = self._write_turns
        if turns is None:
            turns = self._write_turns = collections.deque()
        fut = self._get_loop().create_future()
        turns.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._next_writer()  # the turn came with the cancel: it passes on
            else:
                turns.remove(fut)
            raise

    def _next_writer(self) -> None:
        turns = self._write_turns
        while turns:
            fut = turns.popleft()
            if not fut.done():
                fut.set_result(None)  # still busy: the turn is that writer's now
                return
        self._writer_busy = False

    async def _send(self, view: memoryview, n: int) -> None:
        conn = self._conn
        seg = self._segment_size
        if n <= seg:
            if not conn.writable(n):
                await self._wait_conn(conn)
            self._write_whole(conn, view, n)
            return
        frames = streaming.segments(view, n, self._data_meta, self._data_meta_more, seg)
        sent = 0
        try:
            for i in range(0, len(frames), 2):
                if i or not conn.writable(seg):
                    await self._wait_conn(conn)  # other streams and calls go between segments
                conn.write(frames[i:i + 2], now=True)
                sent += 1
        except asyncio.CancelledError:
            if sent and self._state == _CONNECTED:
                # The peer holds the first segments: the message can never be completed.
                self._end(ECANCELED, "a write was cancelled in the middle of a message", _SEND_RST)
            raise

    async def _wait_conn(self, conn) -> None:
        try:
            await conn.wait_flushed()
        except ConnectionError:
            pass
        if self._state != _CONNECTED:
            raise self._write_error()
        if conn.is_closed:
            raise RpcError(EFAILEDSOCKET, f"the connection of stream {self.id} to {conn.peer} closed")

    def _write_error(self) -> RpcError:
        if self.error is not None:
            return RpcError(self.error.code, self.error.text)
        return RpcError(ECONNRESET, f"stream {self.id} is closed")

    def _wake_writers(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # -- reading -------------------------------------------------------------------------------
    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self):
        message = await self.read()
        if message is None:
            raise StopAsyncIteration
        return message

    async def read(self):
        """The next message (a memoryview), or None once the stream was closed and every
        message received before was read. Raises RpcError when it ended with an error.
        Messages already received are returned without waiting for the loop."""
        while True:
            queue = self._queue
            if queue:
                message = queue.popleft()
                self._consume(len(message))
                return message
            if self._state == _ENDED:
                if self.error is not None:
                    raise RpcError(self.error.code, self.error.text)
                return None
            if self._handler is not None:
                raise RuntimeError("this stream has a handler: its messages go to on_received_messages")
            if self._reader is not None and not self._reader.done():
                raise RuntimeError(f"another task is already reading stream {self.id}")
            fut = self._reader = self._get_loop().create_future()
            try:
                await fut
            finally:
                self._reader = None

    def _consume(self, n: int, schedule_feedback: bool = True) -> None:
        self._unconsumed -= n
        self.consumed += n
        if self._idle_handle is not None:
            self._last_active = self._loop.time()
        if (schedule_feedback and self._peer_need_feedback and not self._feedback_scheduled
                and self._state == _CONNECTED):
            self._feedback_scheduled = True
            self._loop.call_soon(self._send_feedback)  # one FEEDBACK for what is consumed this turn

    def _send_feedback(self) -> None:
        """FEEDBACK of what was consumed, unless the last one said it already. It goes out now
        (with what is queued): the writer may be waiting for it."""
        self._feedback_scheduled = False
        consumed = self.consumed
        if self._state == _CONNECTED and consumed != self._feedback_sent:
            self._feedback_sent = consumed
            self._conn.write([streaming.feedback_frame_from(self._feedback_meta, consumed)], alone=True)

    # -- closing -------------------------------------------------------------------------------
    async def close(self) -> None:
        """Close the stream (brpc's StreamClose), idempotent: the peer gets a CLOSE, writers
        waiting here raise ECONNRESET, and messages already received can still be read."""
        if self._state == _PENDING:
            self._close_pending = True  # closes once connected, or ends with the call's error
            self._wake_writers()
            return
        self._end(0, "", _SEND_CLOSE)

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- from the connection ---------------------------------------------------------------------
    def _get_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _attach(self, conn, awaiting_response: bool = False) -> None:
        """On `conn` now (the call carrying it is being sent, or the handler accepted it)."""
        self._conn = conn
        self._loop = conn.loop
        self.remote_side = conn.peer
        self._awaiting_response = awaiting_response
        body_limit = conn.max_body_size
        window = self._max_buf_size if self._max_buf_size > 0 else streaming.DEFAULT_MAX_BUF_SIZE
        self._recv_cap = window + body_limit
        self._reassembly = streaming.Reassembly(body_limit)
        self._segment_size = max(1, min(streaming.DEFAULT_MAX_SEGMENT_SIZE, body_limit - 64))

    def _connect(self, peer_id: int, need_feedback: bool, writable: bool) -> None:
        """Client: the call succeeded and the server's stream `peer_id` is ours."""
        self._peer_id = peer_id
        self._peer_need_feedback = need_feedback
        self._peer_writable = writable
        self._connected()

    def _connected(self) -> None:
        conn = self._conn
        self._state = _CONNECTED
        self._awaiting_response = False
        self._data_meta = streaming.data_meta(self._peer_id, self.id, False)
        self._data_meta_more = streaming.data_meta(self._peer_id, self.id, True)
        self._feedback_meta = streaming.feedback_meta_prefix(self._peer_id, self.id)
        backlog, self._backlog = self._backlog, []
        for view in backlog:
            conn.write(streaming.segments(view, view.nbytes, self._data_meta, self._data_meta_more,
                                          self._segment_size))
        if self._close_pending:
            self._end(0, "", _SEND_CLOSE)
            return
        if self._idle_timeout_ms >= 0:
            self._last_active = self._loop.time()
            self._idle_handle = self._loop.call_later(self._idle_timeout_ms / 1000, self._idle_check)
        if self._handler is not None:
            self._handler_live = True
        self._wake_writers()

    def _segment_destination(self, n: int, has_continuation: bool):
        """Where the connection should receive the next DATA segment of this stream (`n`
        bytes): into the message being assembled, when the message has several segments."""
        reassembly = self._reassembly
        if (reassembly is None or self._state != _CONNECTED or self._awaiting_response
                or not (has_continuation or reassembly.busy)):
            return None
        return reassembly.place(n)

    def _on_data(self, payload, has_continuation: bool) -> None:
        reassembly = self._reassembly
        if has_continuation or reassembly.busy:
            try:
                message = reassembly.add(payload, has_continuation)
            except RemoteProtocolError as e:
                self._violation(str(e))
                return
            if message is None:
                return
        else:
            message = payload
        if self._awaiting_response:
            self._awaiting_response = False
            self._conn.response_in_stream(message)
            return
        if self._state != _CONNECTED:
            self._violation("DATA before the stream was connected")
            return
        n = len(message)
        if message is payload:
            message = _fast.split_payload(payload, n)[1]  # a small one is copied out of the shared block
        self._queue.append(message)
        unconsumed = self._unconsumed = self._unconsumed + n
        if unconsumed > self._recv_cap:
            self._violation(f"the peer wrote {unconsumed} bytes not yet consumed, past its window plus one "
                            f"message ({self._recv_cap}): it does not wait for FEEDBACK")
            return
        if self._handler_live:
            self._schedule_delivery()
            return
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)

    def _on_feedback(self, consumed_size: int) -> None:
        if consumed_size > self._remote_consumed:
            # A peer cannot consume what was never sent: a larger value never opens the window more.
            self._remote_consumed = min(consumed_size, self.produced)
            if self._waiters:
                self._wake_writers()

    def _on_close(self) -> None:
        self._end(0, "", _SEND_CLOSE)

    def _on_rst(self) -> None:
        self._end(ECONNRESET, "Received RST frame", _SEND_CLOSE)

    def _violation(self, why: str) -> None:
        log.warning("resetting stream %s from %s: %s", self.id, self.remote_side, why)
        self._end(EPROTO, why, _SEND_RST)

    def _idle_check(self) -> None:
        self._idle_handle = None
        if self._state != _CONNECTED:
            return
        loop = self._loop
        timeout = self._idle_timeout_ms / 1000
        due = self._last_active + timeout
        if loop.time() < due:
            self._idle_handle = loop.call_at(due, self._idle_check)
            return
        handler = self._handler
        if handler is None:
            # An RST, not a CLOSE: the peer must not take a stream that failed here for one
            # that ended cleanly (its messages in flight would be lost without an error).
            self._end(ERPCTIMEDOUT, f"no message was read for idle_timeout_ms={self._idle_timeout_ms}", _SEND_RST)
            return
        self._last_active = loop.time()
        self._idle_handle = loop.call_later(timeout, self._idle_check)
        self._callback("on_idle_timeout")

    def _end(self, code: int, text: str, send: int = 0) -> None:
        """End the stream, once: every way a stream ends comes here."""
        state = self._state
        if state == _ENDED:
            return
        self._state = _ENDED
        if code:
            self.error = RpcError(code, text)
        conn = self._conn
        if conn is not None:
            table = conn.streams
            if table is not None:
                table.remove(self.id)
                if self._awaiting_response:
                    table.response_abandoned(self.id)
            if send and state == _CONNECTED and not conn.is_closed:
                frame = (streaming.close_frame(self._peer_id, self.id) if send == _SEND_CLOSE
                         else streaming.rst_frame(self._peer_id))
                conn.write([frame])
        if self._idle_handle is not None:
            self._idle_handle.cancel()
            self._idle_handle = None
        if self._reassembly is not None:
            self._reassembly.clear()
        self._backlog = []
        if code:
            self._queue.clear()  # a broken stream's data is dropped, freeing it now
            self._unconsumed = 0
        self._wake_writers()
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)
        if self._closed_fut is not None and not self._closed_fut.done():
            self._closed_fut.set_result(None)
        if self._handler_live:
            self._schedule_delivery()  # the rest of the queue, then on_failed/on_closed
        elif self._handler is not None:
            self._notify_end()  # never connected: nothing was delivered

    # -- the handler form -------------------------------------------------------------------------
    def _schedule_delivery(self) -> None:
        if not self._delivering:
            self._delivering = True
            self._loop.call_soon(self._deliver)  # what arrives meanwhile joins the batch

    def _deliver(self) -> None:
        """The handler form: hand the queued messages to `on_received_messages` in batches of
        at most `messages_in_batch`, in a loop callback (one per wake-up, not a task); once the
        stream ended and its queue is empty, `on_failed`/`on_closed`. A handler returning an
        awaitable is awaited in a task before the next batch."""
        queue = self._queue
        limit = self._messages_in_batch
        try:
            while queue:
                batch = ([queue.popleft()] if len(queue) == 1 else
                         [queue.popleft() for _ in range(min(limit, len(queue)))])
                result = self._handler.on_received_messages(self, batch)
                if result is not None and inspect.isawaitable(result):
                    self._handler_task = self._loop.create_task(self._await_handler(result, batch))
                    return  # still delivering: the task goes on
                self._batch_done(batch)
        except asyncio.CancelledError:
            self._handler_failed(ECANCELED, "the stream's handler was cancelled")
            return
        except Exception as e:
            self._handler_raised(e)
            return
        self._delivering = False
        if self._state == _ENDED:
            self._notify_end()

    async def _await_handler(self, result, batch: list) -> None:
        try:
            await result
        except asyncio.CancelledError:
            self._handler_task = None
            self._handler_failed(ECANCELED, "the stream's handler was cancelled")
            raise
        except Exception as e:
            self._handler_task = None
            self._handler_raised(e)
            return
        self._handler_task = None
        self._batch_done(batch)
        self._deliver()

    def _batch_done(self, batch: list) -> None:
        n = 0
        for m in batch:
            n += len(m)
        if not self._queue and self._peer_need_feedback:
            self._consume(n, False)
            self._send_feedback()  # all read: report it now, not a loop iteration later
        else:
            self._consume(n)

    def _handler_raised(self, e: Exception) -> None:
        log.error("stream %s: handler.on_received_messages raised %r; resetting the stream", self.id, e,
                  exc_info=e)
        self._handler_failed(EINTERNAL, f"handler.on_received_messages raised {e!r}")

    def _handler_failed(self, code: int, text: str) -> None:
        self._end(code, text, _SEND_RST)
        self._delivering = False
        self._notify_end()

    def _notify_end(self) -> None:
        if self._notified:
            return
        self._notified = True
        if self.error is not None:
            self._callback("on_failed", self.error)
        self._callback("on_closed")

    def _callback(self, name: str, *args) -> None:
        method = getattr(self._handler, name, None)
        if method is None:
            return
        try:
            result = method(self, *args)
        except Exception as e:
            log.error("stream %s: handler.%s raised %r", self.id, name, e, exc_info=e)
            return
        if inspect.iscoroutine(result):
            result.close()
            log.error("stream %s: handler.%s must be a plain def, not async: it did not run", self.id, name)


def _check_options(max_buf_size, idle_timeout_ms, messages_in_batch, handler) -> None:
    if not isinstance(max_buf_size, int) or isinstance(max_buf_size, bool):
        raise TypeError(f"max_buf_size must be an int (<= 0: unlimited), got {max_buf_size!r}")
    if not isinstance(idle_timeout_ms, int) or isinstance(idle_timeout_ms, bool) or idle_timeout_ms < -1:
        raise ValueError(f"idle_timeout_ms must be -1 (none) or an int >= 0, got {idle_timeout_ms!r}")
    if not isinstance(messages_in_batch, int) or isinstance(messages_in_batch, bool) or messages_in_batch < 1:
        raise ValueError(f"messages_in_batch must be an int >= 1, got {messages_in_batch!r}")
    if handler is not None and not callable(getattr(handler, "on_received_messages", None)):
        raise TypeError("handler must have an on_received_messages(stream, messages) method "
                        "(see aiobrpc.StreamHandler)")


def streams_failed(streams: list, code: int, text: str) -> None:
    """The call carrying `streams` failed: each ends with its error (nothing is sent)."""
    for s in streams:
        s._end(code, text)


def connect_streams(streams: list, conn, raw_settings) -> RpcError | None:
    """The call carrying `streams` succeeded: connect them to the server's streams named in the
    response's settings; the error the call fails with instead, or None."""
    if raw_settings is None:
        return RpcError(EREQUEST, "The server didn't accept the stream")
    try:
        settings = streaming.decode_settings(raw_settings)
    except RemoteProtocolError as e:
        return RpcError(EREQUEST, f"The server's stream settings are bad: {e}")
    ids = settings.stream_ids
    for i, s in enumerate(streams):
        if i < len(ids):
            s._connect(ids[i], settings.need_feedback, settings.writable)
        else:
            s._end(EREQUEST, f"the server accepted {len(ids)} of {len(streams)} streams")
    for extra in ids[len(streams):]:
        conn.write([streaming.rst_frame(extra)])
    return None
