"""Streaming gRPC calls from the client: `rpc M(A) returns (stream B)`, `rpc M(stream A)
returns (B)` and `rpc M(stream A) returns (stream B)`, over a channel with
`ChannelOptions(protocol="grpc")` (docs/grpc.md, "Streaming calls").

One `StreamingCall` is one HTTP/2 stream on a `GrpcConnection` (client/grpc_connection.py),
which hands it the stream's events. The server is chosen once, by the channel's load balancer
(or its single server), and the call is never retried nor backed up: a stream may have
delivered messages already. One deadline (the controller's `timeout_ms`, else the channel's)
covers the whole call and is sent as `grpc-timeout`.

Bounds: response messages wait in a queue of at most MAX_QUEUED_MESSAGES; while it is full the
stream's HTTP/2 receive window is not given back, so the server waits for the reader. What the
server may still send then is what its window allows (the connection's initial stream window,
4 MiB), held by the message decoder until the reader takes messages. Each message is at most `max_body_size`
(`max_decompressed_size` inflated): ERESPONSE, and the stream is reset. A request message waits
for the server's flow-control window before the next one is taken from the caller's iterable.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import deque
from collections.abc import AsyncIterable, Iterable
from typing import Generic, TypeVar

from google.protobuf.message import EncodeError, Message

from ..controller import Controller
from ..errors import (ECANCELED, EFAILEDSOCKET, EINTERNAL, ELIMIT, EREQUEST, ERESPONSE, ERPCTIMEDOUT,
                      LocalProtocolError, RpcError)
from ..protocol import grpc as wire
from ..protocol import utf8
from .call import CallbackFailed
from .grpc_connection import (DEADLINE_RACE_S, GrpcConnection, ended_without_status, keep_body_head, read_headers,
                              read_trailers)
from .pool import GRPC, SINGLE

MAX_QUEUED_MESSAGES = 16  # response messages received and not yet read by the caller

_new_controller = object.__new__
_EMPTY_DECODER = wire.MessageDecoder(0)  # never fed: holds no message
_now_ns = time.perf_counter_ns


def refuse_unless_grpc(channel, method_name: str) -> None:
    """RpcError(EREQUEST) unless `channel` is an aiobrpc.Channel speaking gRPC: baidu_std carries
    one message each way."""
    from .channel import Channel
    if isinstance(channel, Channel) and channel.options.protocol == GRPC:
        return
    where = ("a baidu_std channel" if isinstance(channel, Channel)
             else f"{type(channel).__name__} (only aiobrpc.Channel streams)")
    raise RpcError(EREQUEST, f'{method_name} is a streaming rpc: call it over gRPC (ChannelOptions(protocol="grpc")), '
                             f"not over {where}")


class StreamingCall:
    """The life of one streaming call: connect, send the request(s), receive the replies, end
    exactly once (`_end`) with the status, an error, the deadline or a cancel."""

    def __init__(self, channel, service_name: str, method_name: str, request_class, response_class,
                 one_response: bool, cntl: Controller | None) -> None:
        if cntl is None:
            cntl = _new_controller(Controller)
        else:
            cntl.reset_result()
        cntl.service_name = service_name
        cntl.method_name = method_name
        self.channel = channel
        self.cntl = cntl
        self.service_name = service_name
        self.method_name = method_name
        self.request_class = request_class
        self.response_class = response_class
        self.one_response = one_response  # a client-streaming rpc: exactly one response message
        self.loop = asyncio.get_running_loop()
        self.streams = None  # GrpcConnection._request reads it: no aiobrpc.Stream rides on gRPC
        self.serialized = b""  # idem: the request message of a call that sends exactly one
        opts = channel.options
        self.timeout_ms = opts.timeout_ms if cntl.timeout_ms is None else cntl.timeout_ms
        self.deadline: float | None = None
        self.ctype = opts.connection_type if cntl.connection_type is None else cntl.connection_type
        self.max_decompressed_size = opts.max_decompressed_size
        self.start_ns = 0
        self.pool = None
        self.conn: GrpcConnection | None = None
        self.stream_id = 0
        self.task: asyncio.Task | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.sent_all = False  # our side of the stream ended (END_STREAM sent)
        self.finished = False  # the call's outcome is decided; queued messages may remain
        self.error: BaseException | None = None  # what the reader raises once the queue is read
        # The reply as it arrives.
        self.http_status = 0
        self.grpc_reply = False
        self.encoding = wire.IDENTITY
        self.status: int | None = None
        self.message = ""
        self.fields: list = []
        self.body_head = b""
        self.decoder = wire.MessageDecoder(opts.max_body_size)
        self.queue: deque = deque()  # (compressed, payload) for the reader, at most MAX_QUEUED_MESSAGES
        self.unacked = 0  # flow-controlled bytes received and not yet given back to the server
        self.reader: asyncio.Future | None = None
        self.received = 0  # response messages queued so far
        self.max_queued = 0  # the most messages the queue held at once

    # -- the channel's view of a call --------------------------------------------------------
    @property
    def call(self) -> StreamingCall:  # Channel.pending_calls reads `pending[id].call.channel`
        return self

    def abort(self, err: RpcError) -> None:
        """The channel is closing (Channel._end_calls)."""
        self._end(err)

    # -- start -------------------------------------------------------------------------------
    def start(self, first_request: Message | None, requests) -> None:
        """Start on the running loop: one request (`first_request`) or an iterable / async
        iterable of them (`requests`), sent as they come."""
        loop = self.loop
        channel = self.channel
        if loop is not channel._loop:
            try:
                channel._move_to(loop)
            except RpcError as e:
                raise channel._refused(self.service_name, self.method_name, self.cntl, e.code, e.text) from None
        channel._check_open(self.cntl)
        self.start_ns = _now_ns()
        if self.timeout_ms is not None and self.timeout_ms >= 0:
            self.deadline = loop.time() + self.timeout_ms / 1000
            self.timer = loop.call_at(self.deadline, self._timed_out)
        self.channel._calls.add(self)
        self.task = loop.create_task(self._run(first_request, requests))

    async def _run(self, first_request, requests) -> None:
        try:
            if self.cntl._streams is not None:
                self.cntl._streams = None
                raise RpcError(EREQUEST, "aiobrpc.Stream has no place in gRPC: streams need a baidu_std channel")
            conn = await self._connect()
            if self.finished:
                return
            if first_request is not None:
                self.serialized = self._serialize(first_request)
            try:
                headers, out = conn._request(self, self.cntl)
            except (LocalProtocolError, ValueError, TypeError) as e:
                raise RpcError(EREQUEST, f"Fail to pack gRPC request: {e}") from None
            self.stream_id = conn.open_stream(self, headers)
            self.conn = conn
            if first_request is not None:
                await self._send(out, True)
                return
            ctype = self.cntl.request_compress_type
            encoding = wire.ENCODING_OF_COMPRESS_TYPE.get(ctype) if ctype else None
            if isinstance(requests, AsyncIterable):
                it = aiter(requests)
                try:
                    async for request in it:
                        await self._send_request(request, encoding)
                finally:
                    if inspect.isasyncgen(it):  # a call that ended early stops its generator now
                        await it.aclose()
            else:
                it = iter(requests)
                try:
                    for request in it:
                        await self._send_request(request, encoding)
                finally:
                    if inspect.isgenerator(it):
                        it.close()
            await self._send(b"", True)
        except asyncio.CancelledError:
            if not self.finished:  # not by _end: the loop is shutting down
                self._end(RpcError(ECANCELED, "the streaming call's task was cancelled"))
            raise
        except RpcError as e:
            if e.code == ERPCTIMEDOUT and not self.finished:  # the connect saw the deadline before the timer
                self.channel.stats.timeouts += 1
            self._end(e)
        except CallbackFailed as e:
            self._end(e.error)
        except TypeError as e:  # a request of the wrong type: the caller's mistake, raised as such
            self._end(e)
        except (EncodeError, LocalProtocolError, ValueError) as e:
            self._end(RpcError(EREQUEST, f"Fail to pack gRPC request: {e}"))
        except Exception as e:  # the caller's iterable raised, or a bug: the call ends with it
            self._end(e)

    async def _connect(self) -> GrpcConnection:
        channel = self.channel
        loop = self.loop
        if channel.lb is not None and not channel.pools and (channel._first_list is None
                                                             or not channel._first_list.done()):
            await channel._wait_first_list(loop, self.cntl)
            channel._check_open(self.cntl)
        pool = self.pool = channel._select_server([], self.cntl)
        conn = pool.ready(self.ctype)
        if conn is None:
            conn = await pool.connect(loop, self.deadline, self.ctype)
            if self.finished:  # ended meanwhile (deadline, cancel): the connection serves later calls
                pool.release(conn, self.ctype, True)
                return conn
        if type(conn) is not GrpcConnection:
            raise RpcError(EREQUEST, f"{self.method_name} is a streaming rpc: its connection does not speak gRPC")
        if conn.is_closed:
            raise RpcError(EFAILEDSOCKET, f"Connection to {conn.peer} was lost before the request was sent")
        return conn

    def _serialize(self, request) -> bytes:
        if type(request) is not self.request_class and not isinstance(request, self.request_class):
            raise TypeError(f"{self.service_name}.{self.method_name} takes a stream of "
                            f"{self.request_class.DESCRIPTOR.full_name}, got {type(request).__name__}")
        return request.SerializeToString()

    async def _send_request(self, request, encoding: str | None) -> None:
        data = self._serialize(request)
        if encoding is not None:
            data = wire.compress_message(encoding, data)
        await self._send(memoryview(b"".join(wire.encode_message(data, encoding is not None))), False)

    async def _send(self, out, end: bool) -> None:
        """Send one length-prefixed message (or END_STREAM alone), waiting for the window."""
        out = memoryview(out)
        sent = 0
        while True:
            if self.finished:
                raise asyncio.CancelledError  # the call ended; _run returns quietly
            conn = self.conn
            assert conn is not None  # set once the stream is open, before anything is sent
            sent = conn.write_stream(self.stream_id, out, sent, end)
            if sent == len(out):
                break
            await conn.window_opened()
        if end:
            self.sent_all = True

    # -- events from the GrpcConnection --------------------------------------------------------
    def on_headers(self, headers) -> None:
        err = read_headers(self, headers)
        if err is not None:
            self._end(err)

    def on_trailers(self, headers) -> None:
        err = read_trailers(self, headers)
        if err is not None:
            self._end(err)

    def on_data(self, data, flow_controlled: int) -> None:
        if self.finished:
            self._acknowledge(flow_controlled)
            return
        if not (self.http_status == 200 and self.grpc_reply):
            keep_body_head(self, data)
            self._acknowledge(flow_controlled)
            return
        self.unacked += flow_controlled
        try:
            self.decoder.feed(data)
        except wire.GrpcProtocolError as e:
            self._end(RpcError(ERESPONSE, f"Fail to parse gRPC response: {e}"))
            return
        self._fill_queue()

    def _fill_queue(self) -> None:
        """Move decoded messages to the reader's queue, up to its bound; give the window back
        only when everything received fits in it."""
        queue = self.queue
        if len(queue) < MAX_QUEUED_MESSAGES:
            for message in self.decoder:
                queue.append(message)
                self.received += 1
                if len(queue) >= MAX_QUEUED_MESSAGES:
                    break
            if len(queue) > self.max_queued:
                self.max_queued = len(queue)
            self._wake_reader()
        if len(queue) < MAX_QUEUED_MESSAGES and self.unacked:  # the decoder holds no whole message
            self._acknowledge(self.unacked)
            self.unacked = 0
        if self.one_response and self.received > 1:
            self._end(RpcError(ERESPONSE, "a client-streaming gRPC reply carries more than one message"))

    def _acknowledge(self, n: int) -> None:
        conn = self.conn
        if n and conn is not None and conn.transport is not None:  # also after a graceful GOAWAY
            conn.acknowledge(self.stream_id, n)

    def on_ended(self) -> None:
        """The server ended the stream: the call's outcome is its status."""
        if self.finished:
            return
        self._end(self._outcome(), reset=not self.sent_all, keep_messages=True)

    def _outcome(self) -> RpcError | None:
        err = ended_without_status(self)
        if err is not None:
            return err
        if self.status == wire.DEADLINE_EXCEEDED and self.deadline is not None \
                and self.loop.time() >= self.deadline - DEADLINE_RACE_S:
            return self._timeout_error()  # the server's timer ran out before ours: the same deadline
        if self.status != wire.OK:
            return RpcError(wire.brpc_code_of(self.status),
                            self.message or wire.STATUS_NAMES.get(self.status, f"gRPC status {self.status}"))
        try:
            self.decoder.finish()
        except wire.GrpcProtocolError as e:
            return RpcError(ERESPONSE, f"Fail to parse gRPC response: {e}")
        if self.one_response and self.received == 0:
            return RpcError(ERESPONSE, "the gRPC reply carries no message")
        return None

    def on_reset(self, error_code) -> None:
        """The server reset the stream: REFUSED_STREAM (it did no work) is ELIMIT as for a
        unary call, any other reset EFAILEDSOCKET."""
        name = getattr(error_code, "name", str(error_code))
        code = ELIMIT if name == "REFUSED_STREAM" else EFAILEDSOCKET
        peer = self.conn.peer if self.conn is not None else self.channel.address
        self._end(RpcError(code, f"{peer} reset the gRPC stream ({name})"), reset=False)

    def on_failed(self, err: RpcError) -> None:
        """The connection was lost, or a GOAWAY left the stream unprocessed."""
        self._end(err, reset=False)

    # -- the reader ----------------------------------------------------------------------------
    async def read(self):
        """The next response, None after the last; raises what ended the call otherwise."""
        while not self.queue:
            if self.finished:
                self._fill_queue()  # what the decoder still holds
                if not self.queue:
                    if self.error is not None:
                        raise self.error
                    return None
                break
            fut = self.reader = self.loop.create_future()
            try:
                await fut
            finally:
                self.reader = None
        compressed, payload = self.queue.popleft()
        self._fill_queue()
        return self._parse(compressed, payload)

    async def result(self):
        """The one response of a client-streaming call, once the call ended; cancelling the task
        that awaits it cancels the call."""
        while not self.finished:
            fut = self.reader = self.loop.create_future()
            try:
                await fut
            except asyncio.CancelledError:
                self.cancel()
                raise
            finally:
                self.reader = None
        if self.error is not None:
            raise self.error
        compressed, payload = self.queue.popleft()
        return self._parse(compressed, payload)

    def _parse(self, compressed: bool, payload):
        try:
            if compressed:
                payload = wire.decompress_message(self.encoding, payload, self.max_decompressed_size)
                self.cntl.response_compress_type = wire.COMPRESS_TYPE_OF_ENCODING.get(self.encoding, 0)
            response = self.response_class.FromString(payload)
            bad = utf8.bad_field(response)  # protocol/utf8.py: a proto2 string left unchecked
            if bad:
                raise ValueError(f"string field {bad} is not UTF-8")
            return response
        except Exception as e:  # noqa: BLE001  a message that does not parse ends the call
            err = RpcError(ERESPONSE, f"Fail to parse gRPC response: {e}")
            if self.finished:
                self.queue.clear()
                self.decoder = _EMPTY_DECODER  # what it held is dropped
                self.error = err
            else:
                self._end(err)
            raise err from None

    def _wake_reader(self) -> None:
        reader = self.reader
        if reader is not None and not reader.done():
            reader.set_result(None)

    # -- the end -------------------------------------------------------------------------------
    def cancel(self, why: str = "RPC was cancelled by the caller") -> None:
        self._end(RpcError(ECANCELED, why))

    def _timed_out(self) -> None:
        self.timer = None
        if self.finished:
            return
        self._end(self._timeout_error())

    def _timeout_error(self) -> RpcError:
        self.channel.stats.timeouts += 1
        where = self.conn.peer if self.conn is not None else self.pool.address if self.pool else self.channel.address
        return RpcError(ERPCTIMEDOUT, f"Reached timeout={self.timeout_ms}ms @{where}")

    def _end(self, err: BaseException | None, reset: bool = True, keep_messages: bool = False) -> None:
        """Decide the call's outcome, once: `err` or success (None). A reset stream tells the
        server to stop (CANCEL); the window of bytes left unread is given back to the connection.
        The messages received before a failure are dropped, except before an error status
        (`keep_messages`): the reader gets them, then the error."""
        if self.finished:
            return
        self.finished = True
        self.channel._calls.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        task = self.task
        if task is not None and not task.done() and task is not _current_task():
            task.cancel()
        self.task = None
        conn = self.conn
        if conn is not None:
            conn.close_stream(self.stream_id, reset)
            self._acknowledge(self.unacked)
            self.unacked = 0
            if self.ctype != SINGLE and self.pool is not None:
                self.pool.release(conn, self.ctype, err is None)
        if err is not None:
            self.error = err
            if not keep_messages:
                self.queue.clear()
                self.decoder = _EMPTY_DECODER  # what it held is dropped
        cntl = self.cntl
        if conn is not None:
            cntl.remote_side = conn.peer
            cntl.local_side = conn.local
            cntl.correlation_id = self.stream_id
        elif self.pool is not None:
            cntl.remote_side = self.pool.address
        if self.fields:
            cntl.response_user_fields = dict(self.fields)
        latency_us = cntl.latency_us = (_now_ns() - self.start_ns) // 1000
        if err is not None:
            if isinstance(err, RpcError):
                cntl.error_code, cntl.error_text = err.code, err.text
            else:
                cntl.error_code, cntl.error_text = (EREQUEST if isinstance(err, TypeError) else EINTERNAL), str(err)
        methods = self.channel._methods
        if methods is not None:
            methods.ended(self.service_name, self.method_name, latency_us, err is not None, 0, False)
        self._wake_reader()


def _current_task():
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


ResponseT = TypeVar("ResponseT")


class ResponseStream(Generic[ResponseT]):
    """The responses of a server-streaming or bidirectional call, in order.

    `async for response in stream`, or `await stream.read()` (None after the last). A failure
    (a gRPC status other than OK, the deadline, the connection lost) raises RpcError there, and
    is in the call's `cntl`. `await stream.aclose()` or `stream.cancel()` stops the call (the
    HTTP/2 stream is reset with CANCEL); so does leaving an `async with stream:` block, or
    dropping the stream unfinished.
    """

    __slots__ = ("_call", "__weakref__")

    def __init__(self, call: StreamingCall) -> None:
        self._call = call

    @property
    def cntl(self) -> Controller:
        """The call's controller: its error, remote side and response metadata once it ended."""
        return self._call.cntl

    def __aiter__(self) -> ResponseStream[ResponseT]:
        return self

    async def __anext__(self) -> ResponseT:
        response = await self.read()
        if response is None:
            raise StopAsyncIteration
        return response

    async def read(self) -> ResponseT | None:
        """The next response; None once the server ended the stream with status OK."""
        call = self._call
        try:
            response: ResponseT | None = await call.read()
            return response
        except asyncio.CancelledError:
            call.cancel()
            raise

    def cancel(self) -> None:
        """Stop the call now: ECANCELED, and the server sees its stream cancelled."""
        self._call.cancel()

    async def aclose(self) -> None:
        """Stop the call if it is still going (as `cancel`)."""
        self._call.cancel()

    def done(self) -> bool:
        """Whether the call's outcome is decided (responses may still be queued)."""
        return self._call.finished

    async def __aenter__(self) -> ResponseStream[ResponseT]:
        return self

    async def __aexit__(self, *exc) -> None:
        self._call.cancel()

    def __del__(self) -> None:
        call = self._call
        if not call.finished:
            try:
                call.cancel("the response stream was dropped unfinished")
            except RuntimeError:  # its event loop is closed: nothing runs there any more
                pass

    def __repr__(self) -> str:
        call = self._call
        return f"<ResponseStream {call.service_name}/{call.method_name} {'done' if call.finished else 'open'}>"


def check_requests(method: str, requests, request_class) -> None:
    """TypeError unless `requests` is an iterable or async iterable (and not one message)."""
    if isinstance(requests, Message) or not isinstance(requests, (Iterable, AsyncIterable)) \
            or isinstance(requests, (str, bytes)):
        raise TypeError(f"{method} is a client-streaming rpc: it takes an iterable or async iterable of "
                        f"{request_class.DESCRIPTOR.full_name}, got {type(requests).__name__}")
