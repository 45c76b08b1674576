"""A client connection that speaks gRPC over HTTP/2 (`ChannelOptions(protocol="grpc")`).

One HTTP/2 connection (python-hyper's `h2` state machine) carries many calls, each on its own
stream: HEADERS (`:method POST`, `:path /package.Service/Method`, `content-type
application/grpc`, `te trailers`, `grpc-timeout` from the call's deadline, the user fields as
metadata), then the request as one length-prefixed message in DATA ending the stream. The
reply is headers, one message, and trailers carrying `grpc-status` / `grpc-message`, mapped to
brpc's codes as brpc's src/brpc/grpc.cpp maps them (protocol/grpc.py), so the call's retry
rules apply as for baidu_std.

It offers what the server pool and the call use of a `ClientConnection` (`pending`,
`is_closed`, `peer`, `local`, `close`, `abort`, `forget`, `drop`); `Call._send` hands an
attempt on it to `send_call` instead of building a baidu_std frame.

A streaming call (client/grpc_stream.py) opens its stream with `open_stream`, sends with
`write_stream` (waiting in `window_opened` for the peer's window), gives the receive window
back itself with `acknowledge` as its reader takes messages, and ends with `close_stream`; the
stream's events go to it, and it sits in `pending` too, so a lost connection or a GOAWAY ends it
as it ends a unary call.

Bounds: a request waits for the peer's flow-control window (HTTP/2), and the request bytes
waiting so (plus the transport's buffer) are capped by `max_unwritten_bytes`: an attempt that
would pass it is not sent and fails with EOVERCROWDED. A call past the server's
SETTINGS_MAX_CONCURRENT_STREAMS is not sent either and fails with ELIMIT, as in brpc (both
codes are retried, on another server when there is one). A response message is at most
`max_body_size` bytes, `max_decompressed_size` once inflated; one past either fails its call
with ERESPONSE and resets its stream.

`h2` is imported when the first gRPC connection is made, so channels that never speak gRPC
do not pay for it.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from ..errors import (EFAILEDSOCKET, EHTTP, ELIMIT, ELOGOFF, EOVERCROWDED, EREQUEST, ERESPONSE,
                      LocalProtocolError, RemoteProtocolError, RpcError)
from ..protocol import content
from ..protocol import grpc as wire
from ..transport.tcp import _fmt
from .connection import connection_lost_error

log = logging.getLogger(__name__)

# Our receive windows: a whole message of a few MiB comes without waiting for WINDOW_UPDATEs
# one round trip at a time; what the peer may send unread is bounded by the window anyway.
_STREAM_WINDOW = 4 * 1024 * 1024
_CONNECTION_WINDOW = 16 * 1024 * 1024
_H2_DEFAULT_WINDOW = 65535
_ERROR_BODY_SHOWN = 256  # bytes of a non-gRPC reply's body quoted in the error
# The server's DEADLINE_EXCEEDED and the call's own timer race for the same deadline: a status
# this close to it leaves the call to its timer ("Reached timeout", counted as a timeout).
DEADLINE_RACE_S = 0.05
_AFTER_THE_DEADLINE_S = 0.005  # past the call's timer (deadlines.py: up to 1 ms late)

_h2 = None  # the h2 names this module uses, once imported (_import_h2)


def _import_h2():
    global _h2
    if _h2 is None:
        from h2 import config, errors, events, exceptions, settings

        from .. import __version__
        from ..protocol import h2_policy, hpack_memo

        class Names:
            user_agent = f"aiobrpc/{__version__}"
            # h2 with the policy the server keeps too (protocol/h2_policy.py): a graceful GOAWAY
            # (a server shutting down, a max connection age) lets the streams it took be read to
            # their end (GrpcConnection opens no stream after it); frame and header block bounds.
            H2Connection = h2_policy.H2Connection
            install_hpack_memo = staticmethod(hpack_memo.install)
            H2Configuration = config.H2Configuration
            Settings = settings.Settings
            SettingCodes = settings.SettingCodes
            ErrorCodes = errors.ErrorCodes
            H2Error = exceptions.H2Error
            ProtocolError = exceptions.ProtocolError
            handlers = {
                events.ResponseReceived: "_on_headers",
                events.InformationalResponseReceived: None,
                events.DataReceived: "_on_data",
                events.TrailersReceived: "_on_trailers",
                events.StreamEnded: "_on_stream_ended",
                events.StreamReset: "_on_stream_reset",
                events.WindowUpdated: "_on_window_updated",
                events.RemoteSettingsChanged: "_on_window_updated",  # a larger initial window
                events.ConnectionTerminated: "_on_goaway",
            }
        _h2 = Names
    return _h2


class GrpcReplyMeta:
    """What `Call._ended` and `_parse_response` read of a reply's meta, for a gRPC reply:
    the brpc code and text of its status, the message's compression (inflated by the call,
    bounded by max_decompressed_size) and the response's metadata as user fields."""

    __slots__ = ("error_code", "error_text", "compress_type", "user_fields", "stream_settings", "content_type",
                 "checksum_type", "checksum_with_attachment", "checksum_value")

    def __init__(self, error_code: int, error_text: str, compress_type: int, user_fields) -> None:
        self.error_code = error_code
        self.error_text = error_text
        self.compress_type = compress_type
        self.user_fields = user_fields  # a list of (name, value), or None
        self.stream_settings = None
        self.content_type = None
        self.checksum_type = None
        self.checksum_with_attachment = None
        self.checksum_value = None


class GrpcReply:
    """A reply event for `Attempt.on_response`: `meta` (GrpcReplyMeta) and the message `data`."""

    __slots__ = ("meta", "data", "attachment", "error")

    def __init__(self, meta: GrpcReplyMeta, data) -> None:
        self.meta = meta
        self.data = data
        self.attachment = b""  # gRPC has none
        self.error = None


class _Stream:
    """One call's HTTP/2 stream: what is left to send, and what came back so far."""

    __slots__ = ("attempt", "out", "sent", "http_status", "grpc_reply", "encoding", "status", "message",
                 "fields", "decoder", "message_data", "message_compressed", "body_head", "failure")

    def __init__(self, attempt, out, max_message_size: int) -> None:
        self.attempt = attempt
        self.out = out  # the request: one length-prefixed message, sent as the window allows
        self.sent = 0
        self.http_status = 0
        self.grpc_reply = False  # content-type application/grpc...
        self.encoding = wire.IDENTITY
        self.status: int | None = None
        self.message = ""
        self.fields: list = []
        self.decoder = wire.MessageDecoder(max_message_size)
        self.message_data = None
        self.message_compressed = False
        self.body_head = b""  # the start of a body that is not gRPC, for the error text
        self.failure: RpcError | None = None  # the reply broke a rule: the call fails with it


class GrpcConnection:
    """One HTTP/2 connection to a gRPC server, its calls multiplexed as streams.

    `pending` maps stream id -> the attempt waiting for that stream's reply; an attempt's
    `on_response(GrpcReply)` or `on_failed(RpcError)` is called exactly once unless the
    attempt removed itself first (`forget`, which resets the stream with CANCEL).
    """

    def __init__(self, stats, options, authority: str, on_closed=None, ctype: str = "single") -> None:
        names = _import_h2()
        self.h2 = names.H2Connection(names.H2Configuration(client_side=True, header_encoding=None))
        names.install_hpack_memo(self.h2)
        self.stats = stats
        self.ctype = ctype
        self.authority = authority
        self.scheme = "http"
        self.max_body_size = options.max_body_size
        self.max_unwritten_bytes = options.max_unwritten_bytes
        self.pending: dict = {}
        self.streams = None  # no aiobrpc.Stream lives on a gRPC connection
        self.credential: bytes | None = None  # sent as the `authorization` header of every call
        self.needs_credential = True
        self.failure_counted = False  # the retry throttle counted this connection's failure
        self.transport = None
        self.loop = None
        self.peer = authority
        self.local = ""
        self.is_closed = False
        self.close_reason: BaseException | None = None
        self._streams: dict[int, _Stream] = {}
        self._blocked: list[int] = []  # streams waiting for window, in the order they were sent
        self._streaming: dict = {}  # stream id -> its StreamingCall (client/grpc_stream.py), also in pending
        self._window_waiters: list[asyncio.Future] = []  # streaming calls waiting to send more
        self._unsent = 0  # request bytes waiting for window
        self._on_closed = on_closed
        self._lost = False

    # -- asyncio callbacks --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.peer = _fmt(transport.get_extra_info("peername")) or self.peer
        self.local = _fmt(transport.get_extra_info("sockname"))
        if transport.get_extra_info("ssl_object") is not None:
            self.scheme = "https"
        names = _h2
        h2 = self.h2
        h2.local_settings = names.Settings(client=True, initial_values={
            names.SettingCodes.ENABLE_PUSH: 0,
            names.SettingCodes.INITIAL_WINDOW_SIZE: _STREAM_WINDOW,
        })
        h2.initiate_connection()
        h2.increment_flow_control_window(_CONNECTION_WINDOW - _H2_DEFAULT_WINDOW)
        self._flush()
        self.stats.connections_made += 1

    def data_received(self, data: bytes) -> None:
        if self.is_closed and self.transport is None:
            return
        try:
            events = self.h2.receive_data(data)
        except _h2.ProtocolError as e:
            self._protocol_error(RemoteProtocolError(f"HTTP/2 protocol error: {e}"))
            return
        except Exception as e:  # h2 failed on what it was given: this connection closes, named
            log.error("closing gRPC connection with %s: h2 raised %r", self.peer, e, exc_info=e)
            self.abort(e)
            return
        handlers = _h2.handlers
        try:
            for ev in events:
                name = handlers.get(type(ev))
                if name is not None:
                    getattr(self, name)(ev)
        except Exception as e:  # a bug of ours: this connection closes, named, the others go on
            log.error("closing gRPC connection with %s: handling its frames raised %r", self.peer, e, exc_info=e)
            self.abort(e)
            return
        self._flush()

    def eof_received(self) -> bool:
        return False

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass

    def connection_lost(self, exc) -> None:
        if self._lost:
            return
        self._lost = True
        self.is_closed = True
        self.transport = None
        self.stats.connections_lost += 1
        exc = self.close_reason or exc
        if self._on_closed is not None:
            self._on_closed(self, exc)  # first: retries of the failures below see the server down
        pending, self.pending = self.pending, {}
        self._streams.clear()
        self._blocked.clear()
        self._streaming.clear()
        self._wake_window_waiters()
        if not pending:
            return
        err = connection_lost_error(exc, self.peer)
        for attempt in pending.values():
            attempt.on_failed(RpcError(err.code, err.text))

    # -- calls ---------------------------------------------------------------------------------
    def send_call(self, call, att) -> None:
        """Send `att`, an attempt of `call`, as a new stream; its end comes to the attempt."""
        cntl = call.cntl
        try:
            headers, out = self._request(call, cntl)
        except (LocalProtocolError, ValueError, TypeError) as e:
            call._ended(att, None, RpcError(EREQUEST, f"Fail to pack gRPC request: {e}"))
            return
        except RpcError as e:
            call._ended(att, None, e)
            return
        h2 = self.h2
        limit = h2.remote_settings.max_concurrent_streams
        if h2.open_outbound_streams >= limit:
            call._ended(att, None, RpcError(ELIMIT, f"Pending Stream count exceeds max concurrent stream "
                                                   f"({limit}) of {self.peer}"))
            return
        unwritten = self._unsent + self._transport_buffered()
        if unwritten + len(out) > self.max_unwritten_bytes and unwritten:
            call._ended(att, None, RpcError(
                EOVERCROWDED, f"{unwritten} bytes are waiting to be written to {self.peer} "
                              f"(max_unwritten_bytes={self.max_unwritten_bytes})"))
            return
        try:
            stream_id = h2.get_next_available_stream_id()
            h2.send_headers(stream_id, headers)
        except _h2.H2Error as e:  # the HTTP/2 connection is ending
            call._ended(att, None, RpcError(EFAILEDSOCKET, f"Fail to open a gRPC stream to {self.peer}: {e!r}"))
            return
        stream = _Stream(att, out, self.max_body_size)
        self._streams[stream_id] = stream
        att.cid = stream_id
        self.pending[stream_id] = att
        att.sent = True
        if not self._send_data(stream_id, stream):
            self._blocked.append(stream_id)
            self._unsent += len(out) - stream.sent
        self._flush()

    def _request(self, call, cntl) -> tuple[list, memoryview]:
        """The HEADERS and the length-prefixed request message of a call."""
        if call.streams is not None:
            raise RpcError(EREQUEST, "aiobrpc.Stream has no place in gRPC: streams need a baidu_std channel")
        if cntl.request_attachment is not None and _size(cntl.request_attachment):
            raise RpcError(EREQUEST, "request_attachment must be empty on a gRPC channel: gRPC carries the "
                                     "request message only")
        if cntl.request_content_type != content.PB:
            raise RpcError(EREQUEST, "a gRPC channel sends protobuf requests only (request_content_type)")
        if cntl.request_checksum_type or cntl.request_checksum_with_attachment:
            raise RpcError(EREQUEST, "gRPC has no checksums: leave request_checksum_type unset")
        headers = [
            (":method", "POST"),
            (":scheme", self.scheme),
            (":path", f"/{call.service_name}/{call.method_name}"),
            (":authority", self.authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            ("user-agent", _h2.user_agent),
            ("grpc-accept-encoding", wire.ACCEPT_ENCODING),
        ]
        if call.deadline is not None:
            headers.append(("grpc-timeout", wire.format_timeout(call.deadline - call.loop.time())))
        data = call.serialized
        ctype = cntl.request_compress_type
        if ctype:
            encoding = wire.ENCODING_OF_COMPRESS_TYPE.get(ctype)
            if encoding is None:
                raise RpcError(EREQUEST, f"gRPC has no encoding for compress type {ctype}: use gzip or zlib")
            headers.append(("grpc-encoding", encoding))
            data = wire.compress_message(encoding, data)
        if self.credential is not None:
            headers.append(("authorization", self.credential.decode("latin-1")))
        if cntl.log_id is not None:
            headers.append(("log-id", str(cntl.log_id)))  # brpc's http client sends it so
        fields = cntl._request_user_fields
        if fields:
            headers.extend(wire.headers_of_user_fields(fields))
        return headers, memoryview(b"".join(wire.encode_message(data, bool(ctype))))

    def _send_data(self, stream_id: int, stream: _Stream) -> bool:
        """Send what the flow-control windows allow of the stream's request; True when all went."""
        stream.sent = self._send_window(stream_id, stream.out, stream.sent, True)
        return stream.sent == len(stream.out)

    def _send_window(self, stream_id: int, out: memoryview, sent: int, end: bool) -> int:
        """Send what the flow-control windows allow of `out[sent:]` (END_STREAM with its last
        byte when `end`); the bytes of `out` sent so far. h2 takes the memoryview's slices: the
        frame it builds is the one copy."""
        h2 = self.h2
        total = len(out)
        while sent < total:
            n = min(h2.local_flow_control_window(stream_id), h2.max_outbound_frame_size, total - sent)
            if n <= 0:
                break
            h2.send_data(stream_id, out[sent:sent + n], end_stream=end and sent + n == total)
            sent += n
        if end and total == 0:
            h2.end_stream(stream_id)
        return sent

    def _transport_buffered(self) -> int:
        t = self.transport
        try:
            return t.get_write_buffer_size() if t is not None else 0
        except AttributeError:  # Python 3.10's TLS transport, once its connection is lost
            return 0

    def forget(self, stream_id: int) -> None:
        """An attempt stopped waiting (deadline, cancel, a backup won): its stream is reset with
        CANCEL, so the server stops working on it."""
        if self.pending.pop(stream_id, None) is None:
            return
        self._drop_stream(stream_id)
        if self.transport is not None:
            try:
                self.h2.reset_stream(stream_id, _h2.ErrorCodes.CANCEL)
            except _h2.H2Error:  # closed meanwhile on the HTTP/2 side
                pass
            self._flush()

    def _drop_stream(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is not None and stream.sent < len(stream.out):
            self._unsent -= len(stream.out) - stream.sent
            try:
                self._blocked.remove(stream_id)
            except ValueError:
                pass

    # -- streaming calls (client/grpc_stream.py) -----------------------------------------------
    def open_stream(self, call, headers: list) -> int:
        """Open a stream for a streaming call and send its HEADERS; the stream's events go to
        `call` (on_headers, on_trailers, on_data, on_ended, on_reset, on_failed)."""
        h2 = self.h2
        limit = h2.remote_settings.max_concurrent_streams
        if h2.open_outbound_streams >= limit:
            raise RpcError(ELIMIT, f"Pending Stream count exceeds max concurrent stream ({limit}) of {self.peer}")
        try:
            stream_id = h2.get_next_available_stream_id()
            h2.send_headers(stream_id, headers)
        except _h2.H2Error as e:  # the HTTP/2 connection is ending
            raise RpcError(EFAILEDSOCKET, f"Fail to open a gRPC stream to {self.peer}: {e!r}") from None
        self._streaming[stream_id] = call
        self.pending[stream_id] = call
        self._flush()
        return stream_id

    def write_stream(self, stream_id: int, out: memoryview, sent: int, end: bool) -> int:
        """Send what the flow-control windows allow of `out[sent:]` (END_STREAM with its last
        byte when `end`); the bytes of `out` sent so far."""
        try:
            sent = self._send_window(stream_id, out, sent, end)
        except _h2.H2Error as e:
            raise RpcError(EFAILEDSOCKET, f"Fail to send on the gRPC stream to {self.peer}: {e!r}") from None
        self._flush()
        return sent

    async def window_opened(self) -> None:
        """Wait until the peer gives flow-control window (or the connection ends)."""
        fut = self.loop.create_future()
        self._window_waiters.append(fut)
        await fut

    def _wake_window_waiters(self) -> None:
        waiters, self._window_waiters = self._window_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def acknowledge(self, stream_id: int, n: int) -> None:
        """Give the peer `n` bytes of window back on `stream_id` (only the connection's, once
        the stream is closed)."""
        try:
            self.h2.acknowledge_received_data(n, stream_id)
        except _h2.H2Error:
            return
        self._flush()

    def close_stream(self, stream_id: int, reset: bool) -> None:
        """A streaming call ended: forget its stream, reset with CANCEL when `reset`."""
        self.pending.pop(stream_id, None)
        self._streaming.pop(stream_id, None)
        if reset and self.transport is not None:
            try:
                self.h2.reset_stream(stream_id, _h2.ErrorCodes.CANCEL)
            except _h2.H2Error:  # closed meanwhile on the HTTP/2 side
                pass
        self._flush()

    # -- HTTP/2 events -------------------------------------------------------------------------
    def _on_headers(self, ev) -> None:
        stream = self._streams.get(ev.stream_id)
        if stream is None:
            streaming = self._streaming.get(ev.stream_id)
            if streaming is not None:
                streaming.on_headers(ev.headers)
            return
        err = read_headers(stream, ev.headers)
        if err is not None:
            stream.failure = err

    def _on_trailers(self, ev) -> None:
        stream = self._streams.get(ev.stream_id)
        if stream is not None:
            err = read_trailers(stream, ev.headers)
            if err is not None:
                stream.failure = err
        elif self._streaming:
            streaming = self._streaming.get(ev.stream_id)
            if streaming is not None:
                streaming.on_trailers(ev.headers)

    def _on_data(self, ev) -> None:
        stream_id = ev.stream_id
        stream = self._streams.get(stream_id)
        if stream is None and self._streaming:
            streaming = self._streaming.get(stream_id)
            if streaming is not None:  # it gives the window back as its reader takes messages
                streaming.on_data(ev.data, ev.flow_controlled_length)
                return
        if ev.flow_controlled_length:
            self.h2.acknowledge_received_data(ev.flow_controlled_length, stream_id)
        if stream is None or stream.failure is not None:
            return
        if not (stream.http_status == 200 and stream.grpc_reply):
            keep_body_head(stream, ev.data)
            return
        try:
            stream.decoder.feed(ev.data)
            for compressed, payload in stream.decoder:
                if stream.message_data is not None:
                    raise wire.GrpcProtocolError("a unary gRPC reply carries more than one message")
                stream.message_data = payload
                stream.message_compressed = compressed
        except wire.GrpcProtocolError as e:
            self._fail_stream(stream_id, stream, RpcError(ERESPONSE, f"Fail to parse gRPC response: {e}"))

    def _fail_stream(self, stream_id: int, stream: _Stream, err: RpcError) -> None:
        """The reply broke a rule: the stream is reset, the attempt fails with `err`."""
        stream.failure = err
        self._finish(stream_id)
        try:
            self.h2.reset_stream(stream_id, _h2.ErrorCodes.CANCEL)
        except _h2.H2Error:
            pass

    def _on_stream_ended(self, ev) -> None:
        self._finish(ev.stream_id)

    def _finish(self, stream_id: int) -> None:
        stream = self._streams.get(stream_id)
        if stream is None:
            streaming = self._streaming.get(stream_id)
            if streaming is not None:
                streaming.on_ended()
            return
        self._drop_stream(stream_id)
        attempt = self.pending.pop(stream_id, None)
        if attempt is None:
            return
        if stream.failure is not None:
            attempt.on_failed(stream.failure)
            return
        reply = _reply_of(stream)
        if stream.status == wire.DEADLINE_EXCEEDED:
            deadline = attempt.call.deadline
            if deadline is not None and self.loop.time() >= deadline - DEADLINE_RACE_S:
                # The server's timer ran out with the call's (grpc-timeout is the time left): the
                # call's own timer ends it as a timeout; this reply, only if that has not happened.
                self.loop.call_at(deadline + _AFTER_THE_DEADLINE_S, _deliver, attempt, reply)
                return
        _deliver(attempt, reply)

    def _on_stream_reset(self, ev) -> None:
        stream_id = ev.stream_id
        if self._streaming:
            streaming = self._streaming.pop(stream_id, None)
            if streaming is not None:
                self.pending.pop(stream_id, None)
                streaming.on_reset(ev.error_code)
                return
        self._drop_stream(stream_id)
        attempt = self.pending.pop(stream_id, None)
        if attempt is None:
            return
        code = ev.error_code
        name = getattr(code, "name", str(code))
        if code == _h2.ErrorCodes.REFUSED_STREAM:
            # The server did no work on it: like brpc's ELIMIT from a server, retried even
            # for a method that is not idempotent.
            attempt.on_response(GrpcReply(GrpcReplyMeta(ELIMIT, f"{self.peer} refused the stream (REFUSED_STREAM)",
                                                        0, None), b""))
            return
        attempt.on_failed(RpcError(EFAILEDSOCKET, f"{self.peer} reset the gRPC stream ({name})"))

    def _on_window_updated(self, ev) -> None:
        if self._window_waiters:
            self._wake_window_waiters()
        blocked = self._blocked
        if not blocked:
            return
        still = []
        for stream_id in blocked:
            stream = self._streams.get(stream_id)
            if stream is None:
                continue
            before = stream.sent
            if not self._send_data(stream_id, stream):
                still.append(stream_id)
            self._unsent -= stream.sent - before
        self._blocked = still

    def _on_goaway(self, ev) -> None:
        """The server ends the connection (GOAWAY): streams it did not take fail with ELOGOFF
        (retried); those it took finish, then the connection closes. No new call goes on it."""
        self.is_closed = True
        last = ev.last_stream_id if ev.last_stream_id is not None else 0
        why = f"{self.peer} sent GOAWAY ({getattr(ev.error_code, 'name', ev.error_code)})"
        for stream_id in [sid for sid in self.pending if sid > last]:
            self._drop_stream(stream_id)
            self.pending.pop(stream_id).on_failed(RpcError(ELOGOFF, f"{why}: the stream was not processed"))
        if ev.error_code:
            self.abort(RemoteProtocolError(why))
        elif not self.pending and self.transport is not None:
            self.transport.close()

    # -- writing and closing -------------------------------------------------------------------
    def _flush(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None:
            self.transport.write(data)
        if self.is_closed and not self.pending and self.transport is not None and not self.transport.is_closing():
            self.transport.close()  # after GOAWAY, its last stream is done

    def _protocol_error(self, e: RemoteProtocolError) -> None:
        log.warning("closing gRPC connection with %s: %s", self.peer, e)
        self.abort(e)

    def close(self, reason: BaseException | None = None) -> None:
        """Tell the server (GOAWAY) and close; calls still on it fail."""
        if reason is not None and self.close_reason is None:
            self.close_reason = reason
        self.is_closed = True
        if self.transport is not None:
            try:
                self.h2.close_connection()
                self._flush()
            except _h2.H2Error:
                pass
            if self.transport is not None:
                self.transport.close()

    def abort(self, reason: BaseException | None = None) -> None:
        """Close now, dropping what is queued."""
        if reason is not None and self.close_reason is None:
            self.close_reason = reason
        self.is_closed = True
        if self.transport is not None:
            self.transport.abort()

    def drop(self) -> None:
        """Its event loop ended: forget the connection without that loop (see ClientConnection.drop)."""
        transport, self.transport = self.transport, None
        if transport is None:
            return
        self.is_closed = True
        self._lost = True
        self.pending = {}
        self._streams.clear()
        self._streaming.clear()
        self._window_waiters.clear()
        self.stats.connections_lost += 1
        try:
            transport.abort()
        except RuntimeError:  # "Event loop is closed"
            pass


def _deliver(attempt, reply) -> None:
    if type(reply) is RpcError:
        attempt.on_failed(reply)
    else:
        attempt.on_response(reply)


def read_headers(reply, headers) -> RpcError | None:
    """Read a reply's HEADERS into `reply` (a unary _Stream or a StreamingCall): `:status`,
    content-type, grpc-encoding, then what `read_trailers` reads (a trailers-only reply carries
    the status here). The error the reply fails with, if any."""
    err = None
    for name, value in headers:
        if name == b":status":
            if len(value) == 3 and value.isdigit():
                reply.http_status = int(value)
            else:  # the call fails as a non-gRPC reply (HTTP/2 0), its connection untouched
                err = RpcError(ERESPONSE, f":status {value[:32]!r} is not a 3-digit number")
        elif name == b"content-type":
            reply.grpc_reply = value.startswith(b"application/grpc")
        elif name == b"grpc-encoding":
            try:
                reply.encoding = wire.parse_encoding(value)
            except wire.GrpcProtocolError as e:
                err = RpcError(ERESPONSE, str(e))
    return read_trailers(reply, headers) or err


def read_trailers(reply, headers) -> RpcError | None:
    """Read metadata, grpc-status and grpc-message into `reply`; the error it fails with, if any."""
    err = None
    try:
        reply.fields.extend(wire.user_fields_of_headers(headers).items())
    except wire.GrpcProtocolError as e:
        err = RpcError(ERESPONSE, str(e))
    for name, value in headers:
        if name == b"grpc-status":
            try:
                reply.status = int(value)
            except ValueError:
                err = RpcError(ERESPONSE, f"grpc-status {value[:32]!r} is not a number")
        elif name == b"grpc-message":
            reply.message = wire.decode_grpc_message(value)
    return err


def keep_body_head(reply, data) -> None:
    """Keep the start of a reply's body that is not gRPC, quoted by `ended_without_status`."""
    if len(reply.body_head) < _ERROR_BODY_SHOWN:
        reply.body_head += data[:_ERROR_BODY_SHOWN - len(reply.body_head)]


def ended_without_status(reply) -> RpcError | None:
    """The error of a reply that ended with no grpc-status (not gRPC: EHTTP, quoting the start of
    its body; or ERESPONSE); None when it has one."""
    if reply.status is not None:
        return None
    if reply.http_status != 200 or not reply.grpc_reply:
        text = f"HTTP/2 {reply.http_status}"
        if reply.body_head:
            text += ": " + reply.body_head.decode("utf-8", "replace")
        if reply.http_status == 200:
            text += " (not a gRPC reply: no content-type application/grpc)"
        return RpcError(EHTTP, text)
    return RpcError(ERESPONSE, "the gRPC reply ended without grpc-status")


def _reply_of(stream: _Stream):
    """The GrpcReply of a stream that ended, or the RpcError its attempt fails with."""
    err = ended_without_status(stream)
    if err is not None:
        return err
    status = stream.status
    fields = stream.fields or None
    if status != wire.OK:
        text = stream.message or wire.STATUS_NAMES.get(status, f"gRPC status {status}")
        return GrpcReply(GrpcReplyMeta(wire.brpc_code_of(status), text, 0, fields), b"")
    try:
        stream.decoder.finish()
    except wire.GrpcProtocolError as e:
        return RpcError(ERESPONSE, f"Fail to parse gRPC response: {e}")
    data = stream.message_data
    if data is None:
        return RpcError(ERESPONSE, "the gRPC reply carries no message")
    ctype = 0
    if stream.message_compressed:
        ctype = wire.COMPRESS_TYPE_OF_ENCODING.get(stream.encoding, 0)
        if not ctype:
            return RpcError(ERESPONSE, "the gRPC response message is flagged compressed but grpc-encoding "
                                       "is identity")
    return GrpcReply(GrpcReplyMeta(0, "", ctype, fields), data)


def _size(buf) -> int:
    if isinstance(buf, (list, tuple)):
        return sum(_size(b) for b in buf)
    return memoryview(buf).nbytes

