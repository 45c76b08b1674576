"""One gRPC call on one HTTP/2 stream: its request read, its handler run, its reply written.

The handler is the method's `MethodEntry.handler`, as for baidu_std, in the servicer shape of
its rpc (docs/grpc.md): unary `M(request, cntl) -> response`; server streaming an async
generator `M(request, cntl)` yielding responses; client streaming `M(requests, cntl) ->
response` and bidirectional an async generator `M(requests, cntl)`, where `requests` is a
RequestStream. A call ends with trailers `grpc-status` (0, or brpc's mapping of the error
code: protocol/grpc.py) and `grpc-message`, unless the peer reset the stream or the
connection was lost (the handler's task is then cancelled).

`grpc-timeout` is the call's deadline: the handler reads it as `cntl.timeout_ms`, and when it
passes the call ends with DEADLINE_EXCEEDED and the handler's task is cancelled.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import time
from collections import deque

from h2.errors import ErrorCodes
from h2.exceptions import ProtocolError as H2Refused  # StreamClosedError too: h2 will not send that

from ...controller import Controller
from ...errors import ECANCELED, EINTERNAL, EREQUEST, ERESPONSE, ERPCAUTH, ERPCTIMEDOUT, RpcError
from ...protocol import grpc as codec
from ..dispatch import (check_strings, handler_failed, limit_error, request_ended, server_admission_error, set_failed,
                        user_fields_error)
from .. import auth
from ..inline import run_inline

log = logging.getLogger(__name__)

MAX_QUEUED_MESSAGES = 16  # request messages of a streaming call read but not yet taken by its handler

_now_ns = time.perf_counter_ns
_new_controller = object.__new__
_current_task = asyncio.current_task if sys.version_info >= (3, 12) else asyncio.tasks._current_tasks.get
_EAGER = {"eager_start": True} if sys.version_info >= (3, 12) else {}
_INLINE = sys.version_info[:2] == (3, 11)
_CancelledError = asyncio.CancelledError

_STATUS_200 = (b":status", b"200")
_GRPC_CONTENT_TYPE = (b"content-type", b"application/grpc")
_GRPC_OK = (b"grpc-status", b"0")
_SMALL_MESSAGE = 64 * 1024  # smaller payloads are joined with their prefix: one DATA frame
_LARGEST_DATA_FRAME = 1024 * 1024  # what one call adds at once to the bytes unwritten, whatever the peer allows


class RequestStream:
    """The request messages of a client-streaming or bidirectional call, in order.

    `async for request in requests: ...`, or `await requests.read()`, which is None after the
    last. Once MAX_QUEUED_MESSAGES wait unread the stream's flow-control window is not given
    back, so a fast sender waits for the handler: what waits is those messages and at most the
    stream's window (session.STREAM_WINDOW, 4 MiB); and the connection's window gets a
    message's bytes back only once the handler took it. A message that cannot be read raises
    RpcError(EREQUEST).
    """

    __slots__ = ("_call",)

    def __init__(self, call: GrpcCall) -> None:
        self._call = call

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self):
        message = await self.read()
        if message is None:
            raise StopAsyncIteration
        return message

    async def read(self):
        """The next request message; None once the client has sent its last."""
        call = self._call
        while not call.messages:
            if call.request_done or call.finished:
                return None
            fut = call.loop.create_future()
            call.reader = fut
            try:
                await fut
            finally:
                call.reader = None
        compressed, payload = call.messages.popleft()
        call.message_taken(len(payload) + codec.PREFIX_SIZE)
        return call.parse(compressed, payload)


class GrpcCall:
    __slots__ = ("session", "stream_id", "loop", "entry", "cntl", "decoder", "encoding", "accept", "messages",
                 "held", "unacked", "reader", "window_waiter", "task", "timer", "request_done", "finished",
                 "headers_sent", "encoding_out", "sent_fields", "status", "running")

    def __init__(self, session, stream_id: int) -> None:
        self.session = session
        self.stream_id = stream_id
        self.loop = session.loop
        self.entry = None
        self.cntl: Controller | None = None
        self.decoder: codec.MessageDecoder | None = None
        self.encoding = codec.IDENTITY
        self.accept: tuple = ()
        self.messages: deque = deque()
        self.held = 0  # request bytes received and not released to the connection's window (session.release)
        self.unacked = 0  # bytes whose stream window is held back while the handler has not taken its messages
        self.reader: asyncio.Future | None = None  # RequestStream.read waiting for a message
        self.window_waiter: asyncio.Future | None = None
        self.task: asyncio.Task | None = None
        self.timer: int | None = None  # the key of the deadline in session.deadlines
        self.request_done = False  # the client ended its side of the stream
        self.finished = False  # answered (trailers sent), reset, or lost: nothing more goes out
        self.headers_sent = False
        self.encoding_out: str | None = None
        self.sent_fields: frozenset | None = None  # user fields sent as initial metadata
        self.status = None  # the method's MethodStatus where the call is counted in it
        self.running = False  # _serve has begun: cancelling its task runs its accounting

    # -- the request -----------------------------------------------------------------------------
    def headers_received(self, headers, ended: bool) -> None:
        session = self.session
        server = session.server
        path = method = ctype = timeout = encoding = accept = None
        meta = None
        for name, value in headers:
            if name[0] == 58:  # b":"
                if name == b":path":
                    path = value
                elif name == b":method":
                    method = value
            elif name == b"content-type":
                ctype = value
            elif name == b"grpc-timeout":
                timeout = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name == b"grpc-accept-encoding":
                accept = value
            elif name == b"te" or name == b"user-agent" or name.startswith(b"grpc-"):
                pass
            elif meta is None:
                meta = [(name, value)]
            else:
                meta.append((name, value))
        if ended:
            self.request_done = True
        if ctype is None or not (ctype == b"application/grpc" or ctype.startswith((b"application/grpc+proto",
                                                                                   b"application/grpc;"))):
            self._refuse_http(415, f"Content-Type {ctype!r} is not application/grpc[+proto]")
            return
        if method != b"POST":
            self._refuse_http(405, f"gRPC calls are POST, not {method!r}")
            return
        server.stats.requests += 1
        path_s = path.decode("latin-1") if path is not None else ""
        entry = server.registry.by_path.get(path_s)
        try:
            if entry is None:
                entry = _lookup(server.registry, path_s)
            self.entry = entry
            if timeout is not None:
                timeout_ms = codec.parse_timeout_ms(timeout)
                self.timer = session.deadlines.add(self.loop.time() + timeout_ms / 1000, self)
            else:
                timeout_ms = None
            if encoding is not None:
                self.encoding = codec.parse_encoding(encoding)
            if accept is not None:
                self.accept = _accepted(accept)
            fields = codec.user_fields_of_headers(meta) if meta is not None else None
        except RpcError as e:
            self._fail(codec.grpc_status_of(e.code), e.text)
            return
        except codec.GrpcProtocolError as e:
            self._fail(e.grpc_status, str(e))
            return
        rejected = _admission_error(server, session.conn, entry, fields, timeout_ms)
        if rejected is not None:
            self._fail(codec.grpc_status_of(rejected[0]), rejected[1])
            return
        self.decoder = codec.MessageDecoder(server.options.max_body_size)
        self.cntl = cntl = _new_controller(Controller)  # class defaults: fields set here
        cntl.service_name = entry.service_name
        cntl.method_name = entry.method_name
        cntl.correlation_id = self.stream_id
        cntl.remote_side = session.conn.peer
        cntl.local_side = session.conn.local
        if timeout_ms is not None:
            cntl.timeout_ms = timeout_ms
        if fields:
            cntl._request_user_fields = fields
        if self.encoding != codec.IDENTITY:
            cntl.request_compress_type = codec.COMPRESS_TYPE_OF_ENCODING[self.encoding]
        if entry.client_streaming:
            self._start(RequestStream(self))
        elif ended:
            self.request_ended()

    def data_received(self, data, flow_controlled: int) -> None:
        """DATA of this stream. Its bytes are held (self.held) until the message they belong
        to is parsed, or taken by a streaming handler, or the call ends: only then does the
        connection's window get them back (session.release), so what a peer makes a connection
        hold is bounded by that window. The stream's window is given back as they arrive, so a
        message larger than it can be assembled; for a streaming call only while fewer than
        MAX_QUEUED_MESSAGES wait for the handler."""
        session = self.session
        if self.finished or self.decoder is None:
            session.release(flow_controlled)
            return
        size = len(data)
        if flow_controlled != size:
            session.release(flow_controlled - size)  # padding: nothing of it is held
        self.held += size
        try:
            self.decoder.feed(data)
        except codec.GrpcProtocolError as e:
            self._fail(e.grpc_status, str(e).replace("max_message_size", "max_body_size"))  # the server's name
            return
        messages = self.messages
        messages.extend(self.decoder)
        if not self.entry.client_streaming:
            if not messages:
                session.acknowledge_stream(self.stream_id, size)
            elif len(messages) > 1:
                self._fail(codec.INTERNAL, f"{self.entry.method_name} takes one request message; the client "
                                           "sent more")
            return
        if len(messages) < MAX_QUEUED_MESSAGES:
            session.acknowledge_stream(self.stream_id, size + self.unacked)
            self.unacked = 0
        else:
            self.unacked += size
        if messages:
            self._wake_reader()

    def request_ended(self) -> None:
        self.request_done = True
        if self.finished:
            self.session.call_ended(self)
            return
        if self.decoder is None:
            return  # refused before reading (answered already)
        try:
            self.decoder.finish()
        except codec.GrpcProtocolError as e:
            self._fail(e.grpc_status, str(e))
            return
        if self.entry.client_streaming:
            self._wake_reader()
            return
        if not self.messages:
            self._fail(codec.INTERNAL, f"{self.entry.method_name} takes one request message; the client sent none")
            return
        compressed, payload = self.messages.popleft()
        held, self.held = self.held, 0
        self.session.release(held)  # parsed below: the connection holds it no more
        try:
            request = self.parse(compressed, payload)
        except RpcError as e:
            self._fail(codec.grpc_status_of(e.code), e.text)
            return
        self._start(request)

    def parse(self, compressed: bool, payload):
        """The request message in `payload`; RpcError(EREQUEST) naming why it cannot be read."""
        entry = self.entry
        try:
            if compressed:
                payload = codec.decompress_message(self.encoding, payload,
                                                   self.session.server.options.max_decompressed_size)
            request = entry.request_class.FromString(payload)
        except codec.GrpcProtocolError as e:
            text = str(e).replace("max_message_size", "max_decompressed_size")  # the server's name of it
            raise RpcError(EREQUEST, f"Fail to read request={entry.request_class.DESCRIPTOR.full_name}: {text}") \
                from None
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise RpcError(EREQUEST, f"Fail to parse request={entry.request_class.DESCRIPTOR.full_name}: {e}") \
                from None
        if entry.bad_string is not None:
            check_strings(entry, request)
        return request

    def message_taken(self, size: int) -> None:
        """The handler took a message of `size` bytes (prefix included) from the queue."""
        if self.finished:
            return  # released when it finished
        self.held -= size
        self.session.release(size)
        if self.unacked and len(self.messages) < MAX_QUEUED_MESSAGES:
            self.session.acknowledge_stream(self.stream_id, self.unacked)
            self.unacked = 0

    def _release_held(self) -> None:
        if self.held:
            self.session.release(self.held)
            self.held = 0

    def _wake_reader(self) -> None:
        reader = self.reader
        if reader is not None and not reader.done():
            reader.set_result(None)

    # -- the end of a call from outside ----------------------------------------------------------
    def reset_by_peer(self) -> None:
        """RST_STREAM from the client: the call is cancelled, nothing more is sent."""
        self._stop(ECANCELED, "the client cancelled the call (RST_STREAM)")

    def connection_lost(self) -> None:
        self._stop(ECANCELED, "the connection was lost")

    def peer_closed(self) -> None:
        """The client closed its side of the connection (EOF) while this call could not end:
        its request unfinished, or its reply waiting for a window no one will open."""
        self._stop(ECANCELED, "the client closed the connection before the call could end")
        self.session.call_ended(self)

    def _stop(self, code: int, text: str) -> None:
        if self.finished:
            return
        self.finished = True
        self._cancel_timer()
        self._release_held()
        if self.cntl is not None and not self.cntl.error_code:
            self.cntl.error_code, self.cntl.error_text = code, text
        self._wake_reader()
        if self.task is not None:
            # A task cancelled before its first step never runs its coroutine (Python < 3.12
            # starts tasks late): one not begun is left to run, sees `finished` and only counts.
            # One stopping itself (_send_data) raises on its own.
            if self.running and self.task is not _current_task(self.loop):
                self.task.cancel()
        elif self.window_waiter is not None and not self.window_waiter.done():
            self.window_waiter.cancel()

    def deadline_passed(self) -> None:
        """The session's TimerWheel reached this call's grpc-timeout."""
        self.timer = None
        if self.finished:
            return
        text = f"the deadline of {self.cntl.timeout_ms if self.cntl else '?'} ms (grpc-timeout) passed"
        if self.cntl is not None:
            set_failed(self.cntl, self.entry, ERPCTIMEDOUT, text)
        self._fail(codec.DEADLINE_EXCEEDED, text)
        if self.task is not None and self.running:
            self.task.cancel()
        self.session.schedule_flush()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.session.deadlines.remove(self.timer, self)
            self.timer = None

    def window_opened(self) -> None:
        waiter = self.window_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the handler -----------------------------------------------------------------------------
    def _start(self, arg) -> None:
        session = self.session
        server = session.server
        conn = session.conn
        entry = self.entry
        status = entry.status
        if server.options.method_status or status.limiter is not None:
            status.concurrency += 1
            self.status = status
        server.concurrency += 1
        conn.inflight += 1
        loop = self.loop
        coro = self._serve(arg)
        if _INLINE and _current_task(loop) is None:
            task = run_inline(coro, loop)
            if task is not None:
                server._tasks.add(task)
                self.task = task
            return
        task = asyncio.Task(coro, loop=loop, **_EAGER)
        if not task.done():
            server._tasks.add(task)
            self.task = task

    async def _serve(self, arg) -> None:
        session = self.session
        server = session.server
        conn = session.conn
        entry = self.entry
        cntl = self.cntl
        started = _now_ns()
        refused = False
        self.running = True
        try:
            if self.finished:  # reset or lost before the handler began
                return
            try:
                if not session.authenticated:
                    credential = (cntl._request_user_fields or {}).get("authorization", "")
                    credential = credential.encode("latin-1") if isinstance(credential, str) else credential
                    if not await session.authenticate(credential):
                        refused = True
                        raise RpcError(ERPCAUTH, auth.refusal_text(server.options.auth))
                    cntl.authentication_data = credential
                if not entry.streaming:
                    if entry.is_async:
                        response = await entry.handler(arg, cntl)
                    else:
                        response = await self.loop.run_in_executor(server._thread_pool(), entry.handler, arg, cntl)
                    if type(response) is not entry.response_class:
                        while inspect.isawaitable(response):
                            response = await response
                    if not cntl.error_code and not self.finished:
                        await self._send_response(response)
                elif entry.server_streaming:
                    responses = entry.handler(arg, cntl)
                    if not hasattr(responses, "__anext__"):
                        raise _not_a_generator(entry, responses)
                    try:
                        async for response in responses:
                            if self.finished:
                                break
                            await self._send_response(response)
                            if cntl.error_code:
                                break
                    finally:
                        await responses.aclose()
                else:
                    response = entry.handler(arg, cntl)
                    while inspect.isawaitable(response):
                        response = await response
                    if not cntl.error_code and not self.finished:
                        await self._send_response(response)
            except RpcError as e:
                set_failed(cntl, entry, e.code, e.text)
            except _CancelledError as e:
                if not self.finished:
                    if server._cancelling_requests:
                        raise
                    handler_failed(cntl, entry, e)
            except Exception as e:
                handler_failed(cntl, entry, e)
            self._finish()
            if refused:
                session.refuse()
        except _CancelledError:
            raise
        except Exception:
            log.exception("no reply to %s from %s could be built; resetting its stream", entry.full_name, conn.peer)
            self._reset(ErrorCodes.INTERNAL_ERROR)
        finally:
            self._cancel_timer()
            if server.rpcz is not None:
                request_ended(server, conn, entry, cntl, self.status, started, "grpc", None)
            elif self.status is not None:
                self.status.ended((_now_ns() - started) // 1000, cntl.error_code)
            if server._tasks:
                server._tasks.discard(_current_task(self.loop))
            server.concurrency -= 1
            if server.concurrency == 0 and server._idle is not None and not server._idle.done():
                server._idle.set_result(None)
            if cntl.error_code:
                server.stats.failed_requests += 1
            if not session.reading:
                session.schedule_flush()
            conn.request_done()
            if session.draining:
                session.close_if_drained()

    # -- the reply -------------------------------------------------------------------------------
    async def _send_response(self, response) -> None:
        """One response message, after the headers if they are not sent yet; fails the call
        (ERESPONSE) for a response that cannot be sent."""
        entry = self.entry
        cntl = self.cntl
        if not isinstance(response, entry.response_class):
            why = f"handler returned {type(response).__name__}, expected {entry.response_class.DESCRIPTOR.full_name}"
            log.error("%s: %s", entry.full_name, why)
            set_failed(cntl, entry, ERESPONSE, why)
            return
        try:
            payload = response.SerializeToString()
            if not self.headers_sent:
                headers = self._initial_headers()
            encoding = self.encoding_out
            if encoding is not None:
                payload = codec.compress_message(encoding, payload)
        except Exception as e:  # noqa: BLE001 - what the handler returned or set cannot be sent
            why = f"Fail to send response={entry.response_class.DESCRIPTOR.full_name}: {e}"
            log.error("%s: %s", entry.full_name, why)
            set_failed(cntl, entry, ERESPONSE, why)
            return
        session = self.session
        h2c = session.h2
        if not session.conn.writable(h2c.unsent_bytes):
            await self._drain()
        sid = self.stream_id
        n = len(payload)
        prefix = (b"\x01" if encoding is not None else b"\x00") + n.to_bytes(4, "big")
        data = prefix + payload if n < _SMALL_MESSAGE else None
        try:
            if not self.headers_sent:
                h2c.send_headers(sid, headers)
                self.headers_sent = True
            if data is not None and len(data) <= h2c.local_flow_control_window(sid) \
                    and len(data) <= h2c.max_outbound_frame_size:
                h2c.send_data(sid, data)  # the usual case: one DATA frame, now
                if entry.server_streaming and not session.reading:
                    session.schedule_flush()  # a unary reply goes with its trailers
                return
        except H2Refused:
            self._cannot_send()
        if data is not None:
            await self._send_data(memoryview(data))
        else:
            await self._send_data(memoryview(prefix))
            await self._send_data(memoryview(payload))
        session.schedule_flush()

    def _cannot_send(self) -> None:
        """h2 refuses to send on this stream (it was closed, or the connection is closing, by
        frames of the same read handled after this call's): the call ends as if reset."""
        self._stop(ECANCELED, "the stream or the connection was closed before the reply could be sent")
        self.session.call_ended(self)
        raise _CancelledError()

    async def _drain(self) -> None:
        """What h2 and the transport hold unwritten is past max_unwritten_bytes (a peer that
        does not read): write h2's part, and wait for the transport to drain, once per message
        or DATA frame: what is unwritten stays within the bound and one of them."""
        session = self.session
        session.flush()
        conn = session.conn
        if not conn.writable():
            await conn.wait_flushed()
        if self.finished:
            raise _CancelledError()

    def _initial_headers(self) -> list:
        cntl = self.cntl
        headers = [_STATUS_200, _GRPC_CONTENT_TYPE]
        encoding = codec.ENCODING_OF_COMPRESS_TYPE.get(cntl.response_compress_type) if cntl.response_compress_type else None
        if encoding is not None and encoding in self.accept:
            self.encoding_out = encoding
            headers.append((b"grpc-encoding", encoding.encode()))
        fields = cntl._response_user_fields
        if fields:
            headers += codec.headers_of_user_fields(fields)
            self.sent_fields = frozenset(fields)
        return headers

    async def _send_data(self, view: memoryview) -> None:
        """`view` on this stream as the peer's flow-control windows let it go, waiting for
        them to open; and for the connection to drain past max_unwritten_bytes."""
        session = self.session
        h2c = session.h2
        sid = self.stream_id
        conn = session.conn
        while view:
            if self.finished:
                raise _CancelledError()
            window = min(h2c.local_flow_control_window(sid), h2c.max_outbound_frame_size, _LARGEST_DATA_FRAME)
            if window <= 0:
                if session.peer_eof:  # no WINDOW_UPDATE can come any more
                    self.peer_closed()
                    raise _CancelledError()
                session.flush()
                self.window_waiter = self.loop.create_future()
                session.waiting_for_window.add(self)
                try:
                    await self.window_waiter
                finally:
                    self.window_waiter = None
                    session.waiting_for_window.discard(self)
                continue
            if not conn.writable(h2c.unsent_bytes):
                await self._drain()
            try:
                h2c.send_data(sid, view[:window])  # h2 takes a memoryview: the frame is the one copy
            except H2Refused:
                self._cannot_send()
            view = view[window:]

    def _finish(self) -> None:
        """The trailers: grpc-status from cntl, and the user fields not sent yet."""
        if self.finished:
            return
        cntl = self.cntl
        code = cntl.error_code
        if code:
            # a status no brpc code maps to, set by a builtin gRPC service (health's NOT_FOUND)
            status = getattr(cntl, "_grpc_status", None)
            self._fail(status if status is not None else codec.grpc_status_of(code), cntl.error_text or "")
            return
        fields = cntl._response_user_fields
        if not self.headers_sent:  # no message (a stream of none): trailers only
            try:
                headers = self._initial_headers()
            except ValueError as e:
                self._fail(codec.INTERNAL, f"cntl.response_user_fields cannot be sent: {e}")
                return
            headers.append(_GRPC_OK)
            self._end(headers)
            return
        trailers = [_GRPC_OK]
        if fields:
            late = {k: v for k, v in fields.items() if self.sent_fields is None or k not in self.sent_fields}
            if late:
                try:
                    trailers += codec.headers_of_user_fields(late)
                except ValueError as e:
                    self._fail(codec.INTERNAL, f"cntl.response_user_fields cannot be sent: {e}")
                    return
        self._end(trailers)

    def _fail(self, grpc_status: int, text: str) -> None:
        """End the call with an error status (trailers only when nothing was sent yet)."""
        if self.finished:
            return
        if self.cntl is None:
            self.session.server.stats.failed_requests += 1  # refused before a handler: counted here
        trailers = [(b"grpc-status", str(grpc_status).encode()),
                    (b"grpc-message", codec.encode_grpc_message(text).encode())]
        if not self.headers_sent:
            trailers = [_STATUS_200, _GRPC_CONTENT_TYPE] + trailers
            if grpc_status == codec.UNIMPLEMENTED and text.startswith("grpc-encoding"):
                trailers.append((b"grpc-accept-encoding", codec.ACCEPT_ENCODING.encode()))
        cntl = self.cntl
        if cntl is not None and cntl._response_user_fields:
            try:
                trailers += codec.headers_of_user_fields(
                    {k: v for k, v in cntl._response_user_fields.items()
                     if self.sent_fields is None or k not in self.sent_fields})
            except ValueError:
                pass  # the error is what the caller needs; fields that cannot be sent are left out
        self._end(trailers)

    def _end(self, trailers: list) -> None:
        self.finished = True
        self._cancel_timer()
        if self.held:
            self._release_held()
        session = self.session
        if not session.finished:
            try:
                session.h2.send_headers(self.stream_id, trailers, end_stream=True)
                if not self.request_done:  # the client is still sending: tell it to stop
                    session.h2.reset_stream(self.stream_id, ErrorCodes.NO_ERROR)
            except H2Refused:
                pass
        session.call_ended(self)
        self._wake_reader()
        if not session.reading:
            session.schedule_flush()

    def _reset(self, error_code) -> None:
        self.finished = True
        self._release_held()
        try:
            self.session.h2.reset_stream(self.stream_id, error_code)
        except H2Refused:
            pass
        self.session.call_ended(self)
        self.session.schedule_flush()

    def _refuse_http(self, status: int, text: str) -> None:
        self.finished = True
        self._release_held()
        respond_plain(self.session, self.stream_id, status, text)
        if not self.request_done:
            try:
                self.session.h2.reset_stream(self.stream_id, ErrorCodes.NO_ERROR)
            except H2Refused:
                pass
        self.session.call_ended(self)


def respond_plain(session, stream_id: int, status: int, text: str) -> None:
    """An HTTP/2 answer with a text body, for a request that is no gRPC call."""
    body = f"{text}\n".encode()
    h2c = session.h2
    try:
        h2c.send_headers(stream_id, [(b":status", str(status).encode()), (b"content-type", b"text/plain"),
                                     (b"content-length", str(len(body)).encode())])
        if len(body) <= min(h2c.local_flow_control_window(stream_id), h2c.max_outbound_frame_size):
            h2c.send_data(stream_id, body, end_stream=True)
        else:
            h2c.send_data(stream_id, b"", end_stream=True)
    except H2Refused:
        pass  # the stream or the connection was closed by a later frame of the same read


_ACCEPTED: dict = {}  # grpc-accept-encoding values seen -> their codings (a client sends the same each call)


def _accepted(value: bytes) -> tuple:
    codings = _ACCEPTED.get(value)
    if codings is None:
        codings = codec.parse_accept_encoding(value)
        if len(_ACCEPTED) < 64:
            _ACCEPTED[value] = codings
    return codings


def _lookup(registry, path: str):
    """The entry of a gRPC path that is not "/full.Service/Method" (a short service name), or
    RpcError(ENOSERVICE/ENOMETHOD) in brpc's words."""
    service, _, method = path.strip("/").partition("/")
    return registry.lookup(service, method)


def _admission_error(server, conn, entry, fields, timeout_ms):
    rejected = server_admission_error(server, conn)
    if rejected is not None:
        return rejected
    if fields:
        rejected = user_fields_error(server.options, [(k, v) for k, v in fields.items()])
        if rejected is not None:
            return rejected
    if not entry.status.admits(timeout_ms):
        return limit_error(entry)
    return None


def _not_a_generator(entry, got) -> RpcError:
    why = (f"{entry.method_name} is a server-streaming rpc: its handler must be an async generator "
           f"(async def with yield), it returned {type(got).__name__}")
    log.error("%s: %s", entry.full_name, why)
    return RpcError(EINTERNAL, why)
