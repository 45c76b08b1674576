"""Streaming calls of aiobrpc's gRPC client (client/grpc_stream.py), against a real grpc.aio
server and against aiobrpc's own server, which implement aiobrpc.test.GrpcTestService alike:

* ServerStream(m): `m.count` responses (text, count=i, data=m.data), each after `m.sleep_ms`;
  then, with `m.error_code` (a brpc code), fails with it and `m.text`;
* ClientStream(ms): text = the texts joined by ",", count = how many, data = sha256 of every
  `data` in order; fails with the first `error_code` seen;
* Bidi(ms): for each request, after its `sleep_ms`: (text upper-cased, count, data);
* Unary(m): m.text back;
* the request's `x-*` metadata comes back in the response metadata, and as `t-x-*` too, with
  `remaining-ms`, the time the call had left when it arrived (-1: no grpc-timeout).

A call that ends unfinished on the server side is recorded in `Observer.cancelled` by text.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import os
import socket
import time

import grpc
import pytest

import aiobrpc
import aiobrpc.sync
from aiobrpc import ChannelOptions, Controller, RpcError, Server, ServerOptions, errors
from aiobrpc._proto import grpc_test_pb2, interop_pb2
from aiobrpc.client import grpc_stream
from aiobrpc.protocol import compress
from aiobrpc.protocol import grpc as wire
from tests.grpc.grpcio_server import MAX_MESSAGE, GrpcioServer
from tests.grpc.test_grpc_server import GrpcTest
from tests.helpers.waiting import wait_until

Msg = grpc_test_pb2.GrpcMessage
SERVICE = grpc_test_pb2.DESCRIPTOR.services_by_name["GrpcTestService"]
KIB = 1024
MIB = 1024 * KIB
WAIT = 20  # seconds any one step may take before the test fails instead of hanging
KINDS = ["grpcio", "aiobrpc"]


# -- the servers ---------------------------------------------------------------------------------
class Observer:
    """What the servers saw, shared between their threads and the test."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.produced: dict[str, int] = {}  # responses a ServerStream handed to its server, by text

    def saw_cancelled(self, text: str, timeout: float = 5.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if text in self.cancelled:
                return True
            time.sleep(0.01)
        return False


async def server_stream(obs: Observer, request, fail):
    done = False
    try:
        for i in range(request.count):
            if request.sleep_ms:
                await asyncio.sleep(request.sleep_ms / 1000)
            obs.produced[request.text] = i + 1
            yield Msg(text=request.text, count=i, data=request.data)
        done = True
    finally:
        if not done:
            obs.cancelled.append(request.text)
    if request.error_code:
        await fail(request.error_code, request.text)


async def client_stream(obs: Observer, requests, fail):
    texts, digest, error = [], hashlib.sha256(), None
    done = False
    try:
        async for r in requests:
            texts.append(r.text)
            digest.update(r.data)
            error = error or (r.error_code and r)
        done = True
    finally:
        if not done:
            obs.cancelled.append(texts[0] if texts else "?")
    if error:
        await fail(error.error_code, error.text)
    return Msg(text=",".join(texts), count=len(texts), data=digest.digest())


async def bidi(obs: Observer, requests):
    done = False
    text = "?"
    try:
        async for r in requests:
            text = r.text
            if r.sleep_ms:
                await asyncio.sleep(r.sleep_ms / 1000)
            yield Msg(text=r.text.upper(), count=r.count, data=r.data)
        done = True
    finally:
        if not done:
            obs.cancelled.append(text)


class AiobrpcStreaming(GrpcTest):
    """The streaming methods above on aiobrpc's server (Unary is GrpcTest's)."""

    def __init__(self) -> None:
        super().__init__()
        self.observer = Observer()

    @staticmethod
    def _echo_metadata(cntl) -> None:
        for k, v in cntl.request_user_fields.items():
            if k.startswith("x-"):
                cntl.response_user_fields[k] = v
                cntl.response_user_fields["t-" + k] = v
        if cntl.request_user_fields:
            cntl.response_user_fields["remaining-ms"] = str(cntl.timeout_ms or -1)

    @staticmethod
    async def _fail(code: int, text: str):
        raise RpcError(code, text)

    async def ServerStream(self, request, cntl):
        self._echo_metadata(cntl)
        async for m in server_stream(self.observer, request, self._fail):
            yield m

    async def ClientStream(self, requests, cntl):
        self._echo_metadata(cntl)
        return await client_stream(self.observer, requests, self._fail)

    async def Bidi(self, requests, cntl):
        self._echo_metadata(cntl)
        async for m in bidi(self.observer, requests):
            yield m


class GrpcioStreaming(GrpcioServer):
    """The same methods on a grpc.aio server, in its own thread (tests/grpc/grpcio_server.py)."""

    def __init__(self, compression=None) -> None:
        super().__init__(compression=compression)
        self.observer = Observer()

    async def _start(self) -> None:
        server = self._server = grpc.aio.server(compression=self.compression, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.so_reuseport", 0)])
        ser, de = Msg.SerializeToString, Msg.FromString
        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(self._unary, de, ser),
            "ServerStream": grpc.unary_stream_rpc_method_handler(self._server_stream, de, ser),
            "ClientStream": grpc.stream_unary_rpc_method_handler(self._client_stream, de, ser),
            "Bidi": grpc.stream_stream_rpc_method_handler(self._bidi, de, ser),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()

    @staticmethod
    async def _echo_metadata(context) -> None:
        metadata = [(k, v) for k, v in context.invocation_metadata() if k.startswith("x-")]
        if metadata:
            remaining = context.time_remaining()
            await context.send_initial_metadata(tuple(metadata))
            context.set_trailing_metadata(tuple((f"t-{k}", v) for k, v in metadata) + (
                ("remaining-ms", str(-1 if remaining is None else int(remaining * 1000))),))

    @staticmethod
    def _failer(context):
        async def fail(code: int, text: str):
            await context.abort(grpc.StatusCode[_STATUS_NAMES[wire.grpc_status_of(code)]], text)
        return fail

    @staticmethod
    async def _unary(request, context):
        return Msg(text=request.text)

    async def _server_stream(self, request, context):
        await self._echo_metadata(context)
        async for m in server_stream(self.observer, request, self._failer(context)):
            yield m

    async def _client_stream(self, requests, context):
        await self._echo_metadata(context)
        return await client_stream(self.observer, requests, self._failer(context))

    async def _bidi(self, requests, context):
        await self._echo_metadata(context)
        async for m in bidi(self.observer, requests):
            yield m


_STATUS_NAMES = {s.value[0]: s.name for s in grpc.StatusCode}


@pytest.fixture(scope="module")
def grpcio_server():
    srv = GrpcioStreaming()
    srv.start()
    yield srv
    srv.stop()


@contextlib.asynccontextmanager
async def serving(kind: str, grpcio_server: GrpcioStreaming):
    """(address, observer) of a server of `kind`; a fresh observer for each test."""
    if kind == "grpcio":
        grpcio_server.observer = Observer()
        yield f"127.0.0.1:{grpcio_server.port}", grpcio_server.observer
        return
    servicer = AiobrpcStreaming()
    server = Server(ServerOptions(max_body_size=64 * MIB))
    server.add_service(servicer)
    await server.start("127.0.0.1:0")
    try:
        yield server.address, servicer.observer
    finally:
        await server.stop()
        await server.join(2)


def grpc_channel(address: str, **options) -> aiobrpc.Channel:
    options.setdefault("timeout_ms", 10000)
    options.setdefault("max_retry", 0)
    return aiobrpc.Channel(address, ChannelOptions(protocol="grpc", **options))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def collect(stream, timeout: float = WAIT) -> list:
    async def read_all():
        return [m async for m in stream]
    return await asyncio.wait_for(read_all(), timeout)


async def async_requests(*messages, pause: float = 0.0):
    for m in messages:
        if pause:
            await asyncio.sleep(pause)
        yield m


def gone(obs: Observer, text: str):
    """Wait (from a thread) until the server saw the call `text` end unfinished."""
    return asyncio.wait_for(asyncio.to_thread(obs.saw_cancelled, text, 5.0), WAIT)


# -- the three kinds -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
async def test_server_streaming_reads_every_response_then_the_end(kind, grpcio_server):
    async with serving(kind, grpcio_server) as (address, obs), grpc_channel(address) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        got = await collect(stub.ServerStream(Msg(text="s", count=5, data=b"d")))
        assert [(m.text, m.count, m.data) for m in got] == [("s", i, b"d") for i in range(5)]
        stream = stub.ServerStream(Msg(text="r", count=2))  # read() as the server's RequestStream
        assert isinstance(stream, grpc_stream.ResponseStream)
        first = await asyncio.wait_for(stream.read(), WAIT)
        second = await asyncio.wait_for(stream.read(), WAIT)
        assert (first.count, second.count) == (0, 1)
        assert await asyncio.wait_for(stream.read(), WAIT) is None
        assert await asyncio.wait_for(stream.read(), WAIT) is None  # the end stays the end
        assert stream.done() and not stream.cntl.failed
        assert stream.cntl.remote_side == address
        assert await collect(stub.ServerStream(Msg(text="none", count=0))) == []
        # the unary method of the same service still goes the unary way, on the same connection
        assert (await stub.Unary(Msg(text="u"))).text == "u"
        assert channel.connection_count() == 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("iterable", ["list", "generator", "async generator"])
async def test_client_streaming_from_sync_and_async_iterables(kind, iterable, grpcio_server):
    messages = [Msg(text=t, data=t.encode() * 10) for t in ("a", "b", "c")]
    requests = {"list": lambda: messages, "generator": lambda: iter(messages),
                "async generator": lambda: async_requests(*messages, pause=0.01)}[iterable]()
    async with serving(kind, grpcio_server) as (address, _), grpc_channel(address) as channel:
        cntl = Controller()
        reply = await asyncio.wait_for(aiobrpc.Stub(channel, SERVICE).ClientStream(requests, cntl), WAIT)
        assert (reply.text, reply.count) == ("a,b,c", 3)
        assert reply.data == hashlib.sha256(b"a" * 10 + b"b" * 10 + b"c" * 10).digest()
        assert not cntl.failed and cntl.latency_us > 0
        empty = await asyncio.wait_for(aiobrpc.Stub(channel, SERVICE).ClientStream([]), WAIT)
        assert (empty.text, empty.count) == ("", 0)


@pytest.mark.parametrize("kind", KINDS)
async def test_bidi_sends_each_request_as_it_is_produced(kind, grpcio_server):
    async with serving(kind, grpcio_server) as (address, _), grpc_channel(address) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        answered = asyncio.Event()

        async def requests():
            # Each request waits for the answer to the one before: a client that sent only at
            # the end, or read only after sending everything, would never get there.
            for i, t in enumerate(("p", "q", "r")):
                answered.clear()
                yield Msg(text=t, count=i)
                await answered.wait()

        got = []
        async for m in stub.Bidi(requests()):
            got.append((m.text, m.count))
            answered.set()
        assert got == [("P", 0), ("Q", 1), ("R", 2)]
        # and from a plain list
        assert [m.text for m in await collect(stub.Bidi([Msg(text="x"), Msg(text="y")]))] == ["X", "Y"]


# -- ending early ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
async def test_leaving_early_resets_the_stream(kind, grpcio_server):
    async with serving(kind, grpcio_server) as (address, obs), grpc_channel(address) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        # aclose() after a break
        stream = stub.ServerStream(Msg(text="aclose", count=1000, sleep_ms=5))
        async for m in stream:
            if m.count == 2:
                break
        await stream.aclose()
        assert stream.cntl.error_code == errors.ECANCELED
        with pytest.raises(RpcError) as info:
            await stream.read()
        assert info.value.code == errors.ECANCELED
        assert await gone(obs, "aclose")
        # the iterator of the `async for` dropped with it (garbage)
        async for m in stub.ServerStream(Msg(text="dropped", count=1000, sleep_ms=5)):
            break
        gc.collect()
        assert await gone(obs, "dropped")
        # leaving `async with`: the stream is reset and the requests' generator closed
        stopped = asyncio.Event()

        async def requests():
            try:
                for _ in range(1000):
                    yield Msg(text="bidi-with", sleep_ms=5)
                    await asyncio.sleep(0.005)
            finally:
                stopped.set()
        async with stub.Bidi(requests()) as s:
            assert (await asyncio.wait_for(s.read(), WAIT)).text == "BIDI-WITH"
        assert channel._conn.h2.open_outbound_streams == 0  # reset, not left open
        if kind == "aiobrpc":  # grpc.aio may end the handler's request iterator quietly instead
            assert await gone(obs, "bidi-with")
        await asyncio.wait_for(stopped.wait(), WAIT)
        # cancel() while a read waits
        stream = stub.ServerStream(Msg(text="cancel", count=10, sleep_ms=3000))
        reader = asyncio.ensure_future(stream.read())
        await asyncio.sleep(0.1)
        stream.cancel()
        with pytest.raises(RpcError) as info:
            await asyncio.wait_for(reader, WAIT)
        assert info.value.code == errors.ECANCELED
        assert await gone(obs, "cancel")
        # the connection goes on
        assert [m.count for m in await collect(stub.ServerStream(Msg(text="after", count=3)))] == [0, 1, 2]
        assert channel.pending_calls() == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_cancelling_the_awaiting_task_resets_a_client_streaming_call(kind, grpcio_server):
    async with serving(kind, grpcio_server) as (address, obs), grpc_channel(address) as channel:
        never = asyncio.Event()
        closed = []

        async def requests():
            try:
                yield Msg(text="one")
                await never.wait()
                yield Msg(text="two")  # pragma: no cover
            finally:
                closed.append(True)
        task = asyncio.ensure_future(aiobrpc.Stub(channel, SERVICE).ClientStream(requests()))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT)
        await asyncio.sleep(0.05)
        await wait_until(lambda: closed == [True])
        assert closed == [True]  # the requests' generator was stopped with the call
        assert channel._conn.h2.open_outbound_streams == 0  # reset, not left open
        if kind == "aiobrpc":  # grpc.aio ends the handler's request iterator quietly instead
            assert await gone(obs, "one")
        assert channel.pending_calls() == 0
        assert (await aiobrpc.Stub(channel, SERVICE).ClientStream([Msg(text="ok")])).text == "ok"


# -- failures --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
async def test_deadline_mid_stream_is_erpctimedout(kind, grpcio_server):
    async with serving(kind, grpcio_server) as (address, obs), grpc_channel(address, timeout_ms=10000) as channel:
        cntl = Controller(timeout_ms=1000)  # the controller's, over the channel's
        got = []
        started = time.perf_counter()
        with pytest.raises(RpcError) as info:
            # 100 messages 100 ms apart: 10 s, far past the deadline however fast the machine
            async for m in stub_of(channel).ServerStream(Msg(text="late", count=100, sleep_ms=100), cntl):
                got.append(m.count)
        took = time.perf_counter() - started
        assert info.value.code == errors.ERPCTIMEDOUT == cntl.error_code
        assert "timeout=1000ms" in cntl.error_text
        # Mid-stream: the first message (due after 100 ms) came, the stream was cut short, not before the deadline.
        assert 1 <= len(got) < 100 and took > 0.95
        assert await gone(obs, "late")
        assert channel.stats.timeouts == 1
        # a client-streaming call whose requests never end times out too
        never = asyncio.Event()

        async def requests():
            yield Msg(text="x")
            await never.wait()
        cntl = Controller(timeout_ms=200)
        with pytest.raises(RpcError) as info:
            await asyncio.wait_for(stub_of(channel).ClientStream(requests(), cntl), WAIT)
        assert info.value.code == errors.ERPCTIMEDOUT == cntl.error_code


@pytest.mark.parametrize("kind", KINDS)
async def test_the_servers_deadline_status_at_our_deadline_is_our_timeout(kind, grpcio_server):
    # grpc-timeout is the time left: the server's timer and ours run out together, and the
    # server's DEADLINE_EXCEEDED may come first. Near the deadline it ends the call as ours does.
    async with serving(kind, grpcio_server) as (address, _), grpc_channel(address) as channel:
        cntl = Controller(timeout_ms=400)
        ending = Msg(text="racing", count=1, sleep_ms=380, error_code=errors.ERPCTIMEDOUT)
        with pytest.raises(RpcError) as info:
            await collect(stub_of(channel).ServerStream(ending, cntl))
        assert info.value.code == errors.ERPCTIMEDOUT and "timeout=400ms" in cntl.error_text
        assert channel.stats.timeouts == 1
        # far from the deadline, DEADLINE_EXCEEDED is the server's own: its text stands
        cntl = Controller(timeout_ms=10000)
        early = Msg(text="server's own limit", count=0, error_code=errors.ERPCTIMEDOUT)
        with pytest.raises(RpcError) as info:
            await collect(stub_of(channel).ServerStream(early, cntl))
        assert info.value.code == errors.ERPCTIMEDOUT and cntl.error_text == "server's own limit"
        assert channel.stats.timeouts == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_no_deadline_with_timeout_minus_one(kind, grpcio_server):
    async with serving(kind, grpcio_server) as (address, _), grpc_channel(address, timeout_ms=-1) as channel:
        cntl = Controller()
        cntl.request_user_fields = {"x-a": "b"}
        got = await collect(stub_of(channel).ServerStream(Msg(text="slow", count=3, sleep_ms=50), cntl))
        assert len(got) == 3
        assert cntl.response_user_fields["remaining-ms"] == "-1"  # no grpc-timeout sent


@pytest.mark.parametrize("kind", KINDS)
async def test_error_status_mid_stream_after_the_messages_before_it(kind, grpcio_server):
    async with serving(kind, grpcio_server) as (address, _), grpc_channel(address) as channel:
        cntl = Controller()
        cntl.request_user_fields = {"x-k": "v"}
        got = []
        with pytest.raises(RpcError) as info:
            async for m in stub_of(channel).ServerStream(Msg(text="denied", count=3, error_code=errors.EPERM), cntl):
                got.append(m.count)
        assert got == [0, 1, 2]
        assert info.value.code == errors.EPERM == cntl.error_code  # PERMISSION_DENIED, mapped as brpc does
        assert info.value.text == "denied" == cntl.error_text
        assert cntl.response_user_fields["x-k"] == "v" and cntl.response_user_fields["t-x-k"] == "v"
        # client streaming, and a mapping that is not one-to-one
        cntl = Controller()
        with pytest.raises(RpcError) as info:
            await stub_of(channel).ClientStream([Msg(text="a"), Msg(error_code=errors.EINTERNAL, text="bad")], cntl)
        assert info.value.code == errors.EINTERNAL == cntl.error_code and cntl.error_text == "bad"


@pytest.mark.parametrize("kind", KINDS)
async def test_metadata_both_ways_for_each_kind(kind, grpcio_server):
    async with serving(kind, grpcio_server) as (address, _), grpc_channel(address) as channel:
        stub = stub_of(channel)
        for call in (lambda c: collect(stub.ServerStream(Msg(count=1), c)),
                     lambda c: stub.ClientStream([Msg()], c),
                     lambda c: collect(stub.Bidi([Msg()], c))):
            cntl = Controller()
            cntl.request_user_fields = {"x-token": "abc", "x-raw-bin": b"\x00\xff"}
            await asyncio.wait_for(call(cntl), WAIT)
            fields = cntl.response_user_fields
            assert fields["x-token"] == "abc" and fields["t-x-token"] == "abc"
            assert fields["t-x-raw-bin"] == b"\x00\xff"
            assert 5000 < int(fields["remaining-ms"]) <= 10000  # the deadline went as grpc-timeout


async def test_wrong_request_types_raise_typeerror(grpcio_server):
    async with serving("grpcio", grpcio_server) as (address, _), grpc_channel(address) as channel:
        stub = stub_of(channel)
        wrong = interop_pb2.EchoRequest(message="m")
        with pytest.raises(TypeError, match="aiobrpc.test.GrpcMessage, got EchoRequest"):
            stub.ServerStream(wrong)
        with pytest.raises(TypeError, match="iterable or async iterable of aiobrpc.test.GrpcMessage, got GrpcMessage"):
            stub.ClientStream(Msg())  # one message where a stream of them is taken
        with pytest.raises(TypeError, match="iterable"):
            stub.Bidi(42)
        cntl = Controller()
        with pytest.raises(TypeError, match="stream of aiobrpc.test.GrpcMessage, got EchoRequest"):
            await asyncio.wait_for(stub.ClientStream([Msg(), wrong], cntl), WAIT)
        assert cntl.error_code == errors.EREQUEST
        with pytest.raises(TypeError, match="stream of aiobrpc.test.GrpcMessage, got EchoRequest"):
            await collect(stub.Bidi(async_requests(Msg(text="fine"), wrong)))
        assert channel.pending_calls() == 0


async def test_streaming_over_baidu_std_is_erequest_before_sending():
    port = free_port()  # nothing listens: any attempt to send would fail otherwise
    async with aiobrpc.Channel(f"127.0.0.1:{port}") as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        calls = {"ServerStream": lambda c: stub.ServerStream(Msg(), c),
                 "ClientStream": lambda c: stub.ClientStream([Msg()], c),
                 "Bidi": lambda c: stub.Bidi([Msg()], c)}
        for name, call in calls.items():
            cntl = Controller()
            with pytest.raises(RpcError) as info:
                await call(cntl)
            assert info.value.code == errors.EREQUEST == cntl.error_code
            assert info.value.text.startswith(f'{name} is a streaming rpc: call it over gRPC '
                                              '(ChannelOptions(protocol="grpc"))'), info.value.text
        assert channel.connection_count() == 0


def test_the_sync_stub_refuses_streaming_methods():
    channel = aiobrpc.sync.Channel(f"127.0.0.1:{free_port()}")
    try:
        stub = aiobrpc.sync.Stub(channel, SERVICE)
        with pytest.raises(TypeError, match="ServerStream is a streaming rpc: aiobrpc.sync.Stub calls unary"):
            stub.ServerStream(Msg())
    finally:
        channel.close()


async def test_no_server_fails_as_a_unary_call_does():
    async with grpc_channel(f"127.0.0.1:{free_port()}") as channel:
        with pytest.raises(RpcError) as unary:
            await stub_of(channel).Unary(Msg())
    async with grpc_channel(f"127.0.0.1:{free_port()}") as channel:
        cntl = Controller()
        with pytest.raises(RpcError) as streamed:
            await collect(stub_of(channel).ServerStream(Msg(count=1), cntl))
        assert streamed.value.code == unary.value.code == errors.ECONNREFUSED == cntl.error_code


@pytest.mark.parametrize("kind", KINDS)
async def test_connection_loss_mid_stream_fails_at_once(kind, grpcio_server):
    async with serving(kind, grpcio_server) as (address, _), grpc_channel(address) as channel:
        stream = stub_of(channel).ServerStream(Msg(text="lost", count=1000, sleep_ms=20))
        assert (await asyncio.wait_for(stream.read(), WAIT)).count == 0
        channel._conn.transport.abort()  # as a reset connection
        with pytest.raises(RpcError) as info:
            await collect(stream)
        # The loss ends it (not a deadline, nor the 1000 messages 20 s later).
        assert info.value.code in (errors.EEOF, errors.EFAILEDSOCKET)
        assert stream.cntl.error_code == info.value.code


async def test_server_stopping_mid_stream_fails_the_stream():
    srv = GrpcioStreaming()
    port = srv.start()
    try:
        async with grpc_channel(f"127.0.0.1:{port}") as channel:
            stream = stub_of(channel).ServerStream(Msg(text="stop", count=1000, sleep_ms=20))
            assert (await asyncio.wait_for(stream.read(), WAIT)).count == 0
            await asyncio.to_thread(srv.stop, 0)
            with pytest.raises(RpcError) as info:
                await collect(stream)
            # The stop ends it (not a deadline, nor the 1000 messages 20 s later).
            assert info.value.code != errors.ERPCTIMEDOUT
    finally:
        srv.stop()


async def test_graceful_goaway_lets_the_stream_in_flight_finish():
    srv = GrpcioStreaming()
    port = srv.start()
    try:
        async with grpc_channel(f"127.0.0.1:{port}") as channel:
            stream = stub_of(channel).ServerStream(Msg(text="finish", count=6, sleep_ms=50))
            assert (await asyncio.wait_for(stream.read(), WAIT)).count == 0
            stopping = asyncio.ensure_future(asyncio.to_thread(srv.stop, 3.0))  # GOAWAY, then it waits
            assert [m.count for m in await collect(stream)] == [1, 2, 3, 4, 5]
            await asyncio.wait_for(stopping, WAIT)
    finally:
        srv.stop()


# -- server selection ------------------------------------------------------------------------------
@pytest.mark.parametrize("connection_type", ["pooled", "short"])
async def test_pooled_and_short_connections(connection_type, grpcio_server):
    async with serving("grpcio", grpcio_server) as (address, _), \
            grpc_channel(address, connection_type=connection_type) as channel:
        stub = stub_of(channel)
        for _ in range(3):
            assert len(await collect(stub.ServerStream(Msg(count=2)))) == 2
            assert (await stub.ClientStream([Msg(text="a")])).text == "a"
        assert channel.pending_calls() == 0


async def test_the_load_balancer_picks_a_server_per_call():
    servers = []
    try:
        for _ in range(2):
            server = Server()
            server.add_service(AiobrpcStreaming())
            await server.start("127.0.0.1:0")
            servers.append(server)
        url = "list://" + ",".join(s.address for s in servers)
        async with aiobrpc.Channel(url, ChannelOptions(protocol="grpc", timeout_ms=5000),
                                   load_balancer="rr") as channel:
            sides = []
            for _ in range(4):
                cntl = Controller()
                assert len(await collect(stub_of(channel).ServerStream(Msg(count=1), cntl))) == 1
                sides.append(cntl.remote_side)
            assert sorted(set(sides)) == sorted(s.address for s in servers)
    finally:
        for server in servers:
            await server.stop()
            await server.join(2)


# -- bounds ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
async def test_slow_consumer_holds_the_server_back(kind, grpcio_server):
    size, count = 64 * KIB, 1000
    async with serving(kind, grpcio_server) as (address, obs), grpc_channel(address, timeout_ms=60000) as channel:
        stream = stub_of(channel).ServerStream(Msg(text="slow", count=count, data=b"z" * size))
        call = stream._call
        for i in range(5):  # the consumer reads slowly; the server fills what it may meanwhile
            assert (await asyncio.wait_for(stream.read(), WAIT)).count == i
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)
        # What came while the consumer was slow: its queue, plus what the stream's receive window
        # (4 MiB, never given back while the queue is full) let the server send.
        window = 4 * MIB // size
        assert len(call.queue) <= grpc_stream.MAX_QUEUED_MESSAGES
        assert obs.produced["slow"] < 5 + grpc_stream.MAX_QUEUED_MESSAGES + window + 16, obs.produced
        seen = 5
        async for m in stream:
            assert m.count == seen and len(m.data) == size
            seen += 1
            assert len(call.queue) <= grpc_stream.MAX_QUEUED_MESSAGES
        assert seen == count
        assert call.max_queued <= grpc_stream.MAX_QUEUED_MESSAGES


@pytest.mark.parametrize("kind", KINDS)
async def test_unread_streams_left_early_give_the_connection_window_back(kind, grpcio_server):
    # Each abandoned stream held up to its 4 MiB window unacknowledged: without giving it back
    # to the connection (16 MiB), the fifth call would wait forever.
    async with serving(kind, grpcio_server) as (address, _), grpc_channel(address) as channel:
        stub = stub_of(channel)
        for i in range(6):
            stream = stub.ServerStream(Msg(text=f"full{i}", count=200, data=b"w" * (64 * KIB)))
            await asyncio.wait_for(stream.read(), WAIT)
            await asyncio.sleep(0.2)  # the server fills the window
            await stream.aclose()
        got = await collect(stub.ServerStream(Msg(text="then", count=100, data=b"v" * (64 * KIB))))
        assert len(got) == 100


@pytest.mark.parametrize("kind", KINDS)
async def test_large_streamed_request_waits_for_the_window_and_arrives_intact(kind, grpcio_server):
    big = os.urandom(8 * MIB)
    async with serving(kind, grpcio_server) as (address, _), \
            grpc_channel(address, max_body_size=64 * MIB) as channel:
        reply = await asyncio.wait_for(stub_of(channel).ClientStream([Msg(text="a", data=big), Msg(text="b")]),
                                       WAIT)
        assert (reply.text, reply.data) == ("a,b", hashlib.sha256(big).digest())
        got = await collect(stub_of(channel).Bidi([Msg(text="big", data=big)]))
        assert len(got) == 1 and got[0].data == big


async def test_response_over_max_body_size_is_eresponse(grpcio_server):
    async with serving("grpcio", grpcio_server) as (address, obs), \
            grpc_channel(address, max_body_size=1000) as channel:
        got = []
        cntl = Controller()
        with pytest.raises(RpcError) as info:
            async for m in stub_of(channel).ServerStream(Msg(text="big", count=5, data=b"b" * 2000), cntl):
                got.append(m)  # pragma: no cover
        assert info.value.code == errors.ERESPONSE == cntl.error_code and "max_message_size" in info.value.text
        assert got == []
        assert len(await collect(stub_of(channel).ServerStream(Msg(text="small", count=2)))) == 2


async def test_gzip_both_ways():
    srv = GrpcioStreaming(compression=grpc.Compression.Gzip)
    port = srv.start()
    try:
        async with grpc_channel(f"127.0.0.1:{port}") as channel:
            cntl = Controller()
            cntl.request_compress_type = compress.GZIP
            text = "g" * 5000
            got = await collect(stub_of(channel).Bidi([Msg(text=text), Msg(text="h")], cntl))
            assert [m.text for m in got] == [text.upper(), "H"]
            assert cntl.response_compress_type == compress.GZIP
            cntl = Controller()
            cntl.request_compress_type = compress.ZLIB
            reply = await stub_of(channel).ClientStream([Msg(text=text)], cntl)
            assert reply.text == text
    finally:
        srv.stop()


async def test_the_channel_closing_ends_its_streams(grpcio_server):
    async with serving("grpcio", grpcio_server) as (address, obs):
        channel = grpc_channel(address)
        stream = stub_of(channel).ServerStream(Msg(text="closing", count=1000, sleep_ms=20))
        await asyncio.wait_for(stream.read(), WAIT)
        await channel.close()
        with pytest.raises(RpcError) as info:
            await collect(stream)
        assert info.value.code == errors.EFAILEDSOCKET


def stub_of(channel) -> aiobrpc.Stub:
    return aiobrpc.Stub(channel, SERVICE)

