"""aiobrpc's gRPC client (`ChannelOptions(protocol="grpc")`) against a real grpcio server.

The grpc.aio servers run in their own threads (tests/grpc/grpcio_server.py), one per module
for the plain cases; tests that stop a server start their own.
"""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest

import aiobrpc
from aiobrpc import ChannelOptions, Controller, RpcError, errors
from aiobrpc._proto import echo_aiobrpc, echo_pb2, interop_pb2
from aiobrpc.protocol import compress
from aiobrpc.protocol import grpc as wire
from tests.grpc.grpcio_server import GrpcioServer
from tests.helpers.waiting import wait_until

SERVICE = interop_pb2.DESCRIPTOR.services_by_name["EchoService"]
EchoRequest = interop_pb2.EchoRequest


@pytest.fixture(scope="module")
def server():
    srv = GrpcioServer()
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def gzip_server():
    srv = GrpcioServer(compression=grpc.Compression.Gzip)
    srv.start()
    yield srv
    srv.stop()


def grpc_channel(port: int, **options) -> aiobrpc.Channel:
    options.setdefault("timeout_ms", 3000)
    return aiobrpc.Channel(f"127.0.0.1:{port}", ChannelOptions(protocol="grpc", **options))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- options -----------------------------------------------------------------------------------
def test_protocol_option():
    assert ChannelOptions().protocol == "baidu_std"
    assert ChannelOptions(protocol="grpc").protocol == "grpc"
    assert ChannelOptions(protocol="h2:grpc").protocol == "grpc"  # brpc's spelling
    with pytest.raises(ValueError, match="protocol must be one of"):
        ChannelOptions(protocol="http")
    with pytest.raises(TypeError, match="protocol must be a str"):
        ChannelOptions(protocol=None)


# -- calls -------------------------------------------------------------------------------------
async def test_unary_through_stub_and_metadata_both_ways(server):
    async with grpc_channel(server.port) as channel:
        cntl = Controller()
        cntl.request_user_fields = {"x-token": "abc", "x-raw-bin": b"\x00\xff"}
        cntl.log_id = 7
        resp = await aiobrpc.Stub(channel, SERVICE).Echo(EchoRequest(message="hello", payload=b"p" * 100), cntl)
        assert resp.message == "hello" and resp.payload_size == 100
        assert 2000 < resp.server_timeout_ms <= 3000  # grpc-timeout reached the server
        assert server.seen_metadata[-1] == {"x-token": "abc", "x-raw-bin": b"\x00\xff"}
        fields = cntl.response_user_fields
        assert fields["x-token"] == "abc" and fields["t-x-token"] == "abc"  # headers and trailers
        assert fields["t-x-raw-bin"] == b"\x00\xff"
        assert not cntl.failed and cntl.remote_side == f"127.0.0.1:{server.port}"


async def test_generated_typed_stub():
    srv = _echo_service_server()
    try:
        async with grpc_channel(srv.port) as channel:
            resp = await echo_aiobrpc.EchoServiceStub(channel).Echo(echo_pb2.EchoRequest(message="typed"))
            assert resp.message == "typed"
    finally:
        srv.stop()


def _echo_service_server() -> _EchoServer:
    srv = _EchoServer()
    srv.start()
    return srv


class _EchoServer(GrpcioServer):
    """example.EchoService (echo.proto), for the generated stub."""

    async def _start(self) -> None:
        server = self._server = grpc.aio.server()

        async def echo(request, context):
            return echo_pb2.EchoResponse(message=request.message)
        handler = grpc.unary_unary_rpc_method_handler(echo, request_deserializer=echo_pb2.EchoRequest.FromString,
                                                      response_serializer=echo_pb2.EchoResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("example.EchoService",
                                                                              {"Echo": handler}),))
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()


async def test_each_grpc_status_becomes_brpcs_code(server):
    async with grpc_channel(server.port, max_retry=0) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        for status in range(1, 17):
            cntl = Controller()
            with pytest.raises(RpcError) as info:
                await stub.Echo(EchoRequest(message="x", fail_code=status, fail_text=f"no {status} é%"), cntl)
            assert info.value.code == wire.brpc_code_of(status) == cntl.error_code, status
            assert info.value.text == f"no {status} é%"
        # brpc's mapping, spelled out for a few
        assert wire.brpc_code_of(wire.UNAVAILABLE) == errors.EINTERNAL
        assert wire.brpc_code_of(wire.RESOURCE_EXHAUSTED) == errors.ELIMIT


async def test_the_servers_deadline_status_at_our_deadline_is_our_timeout(server):
    # grpc-timeout is the time left: the server's timer and the call's run out together, and the
    # server's DEADLINE_EXCEEDED may come first. Near the deadline the call ends as its own timeout.
    async with grpc_channel(server.port, max_retry=0) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        cntl = Controller(timeout_ms=400)
        racing = EchoRequest(message="racing", sleep_ms=380, fail_code=wire.DEADLINE_EXCEEDED, fail_text="racing")
        with pytest.raises(RpcError) as info:
            await stub.Echo(racing, cntl)
        assert info.value.code == errors.ERPCTIMEDOUT and "timeout=400ms" in cntl.error_text
        assert channel.stats.timeouts == 1
        # far from the deadline, DEADLINE_EXCEEDED is the server's own: its text stands
        cntl = Controller(timeout_ms=10000)
        early = EchoRequest(message="early", fail_code=wire.DEADLINE_EXCEEDED, fail_text="server's own limit")
        with pytest.raises(RpcError) as info:
            await stub.Echo(early, cntl)
        assert info.value.code == errors.ERPCTIMEDOUT and cntl.error_text == "server's own limit"
        assert channel.stats.timeouts == 1


async def test_unknown_method_is_unimplemented(server):
    async with grpc_channel(server.port, max_retry=0) as channel:
        with pytest.raises(RpcError) as info:
            await channel.call_method("interop.EchoService", "Nope", EchoRequest(message="m"), interop_pb2.EchoResponse)
        assert info.value.code == errors.ENOMETHOD


async def test_deadline_ends_the_call_on_time_and_cancels_the_server_call(server):
    async with grpc_channel(server.port, timeout_ms=300) as channel:
        started = time.perf_counter()
        with pytest.raises(RpcError) as info:
            await aiobrpc.Stub(channel, SERVICE).Echo(EchoRequest(message="deadline", sleep_ms=3000))
        took = time.perf_counter() - started
        # The server answers only after 3 s: an error before then is the deadline's, never early.
        assert info.value.code == errors.ERPCTIMEDOUT
        assert took > 0.28
        assert await asyncio.to_thread(_cancelled, server, "deadline")


def _cancelled(server: GrpcioServer, message: str, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if message in server.cancelled:
            return True
        time.sleep(0.01)
    return False


async def test_cancelling_the_caller_resets_the_stream(server):
    async with grpc_channel(server.port) as channel:
        task = asyncio.ensure_future(aiobrpc.Stub(channel, SERVICE).Echo(EchoRequest(message="cancel me",
                                                                                     sleep_ms=3000)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(_cancelled, server, "cancel me")
        resp = await aiobrpc.Stub(channel, SERVICE).Echo(EchoRequest(message="after"))  # the connection goes on
        assert resp.message == "after"


async def test_large_messages_both_ways(server):
    big = "m" * (8 << 20)  # 8 MiB each way, beside a small call on the same connection
    async with grpc_channel(server.port, max_body_size=16 << 20) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        resp, resp2 = await asyncio.gather(stub.Echo(EchoRequest(message=big)),
                                           stub.Echo(EchoRequest(message="small")))
        assert resp.message == big
        assert resp2.message == "small"


async def test_response_over_max_body_size_fails_with_eresponse(server):
    async with grpc_channel(server.port, max_body_size=1 << 20, max_retry=0) as channel:
        with pytest.raises(RpcError) as info:
            await aiobrpc.Stub(channel, SERVICE).Echo(EchoRequest(message="m" * (2 << 20)))
        assert info.value.code == errors.ERESPONSE and "max_message_size" in info.value.text
        assert (await aiobrpc.Stub(channel, SERVICE).Echo(EchoRequest(message="ok"))).message == "ok"


async def test_gzip_both_ways(gzip_server):
    async with grpc_channel(gzip_server.port, max_decompressed_size=1 << 20, max_retry=0) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        cntl = Controller()
        cntl.request_compress_type = compress.GZIP
        resp = await stub.Echo(EchoRequest(message="gz" * 10000), cntl)
        assert resp.message == "gz" * 10000
        assert cntl.response_compress_type == compress.GZIP
        cntl = Controller()
        with pytest.raises(RpcError) as info:  # inflated past max_decompressed_size
            await stub.Echo(EchoRequest(message="z" * (2 << 20)), cntl)
        assert info.value.code == errors.ERESPONSE


async def test_attachment_and_streams_have_no_place_in_grpc(server):
    async with grpc_channel(server.port) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        with pytest.raises(RpcError) as info:
            await stub.Echo(EchoRequest(message="a"), Controller(request_attachment=b"att"))
        assert info.value.code == errors.EREQUEST and "request_attachment" in info.value.text
        cntl = Controller()
        aiobrpc.Stream.create(cntl)
        with pytest.raises(RpcError) as info:
            await stub.Echo(EchoRequest(message="s"), cntl)
        assert info.value.code == errors.EREQUEST and "Stream" in info.value.text
        cntl = Controller()
        cntl.request_compress_type = compress.SNAPPY
        with pytest.raises(RpcError) as info:
            await stub.Echo(EchoRequest(message="s"), cntl)
        assert info.value.code == errors.EREQUEST


async def test_pooled_and_short_connections(server):
    for ctype in ("pooled", "short"):
        async with grpc_channel(server.port, connection_type=ctype) as channel:
            stub = aiobrpc.Stub(channel, SERVICE)
            got = await asyncio.gather(*(stub.Echo(EchoRequest(message=str(i))) for i in range(5)))
            assert [r.message for r in got] == [str(i) for i in range(5)]


# -- resilience --------------------------------------------------------------------------------
async def test_retry_goes_to_the_second_server_when_the_first_is_down(server):
    dead = free_port()
    url = f"list://127.0.0.1:{dead},127.0.0.1:{server.port}"
    channel = aiobrpc.Channel(url, ChannelOptions(protocol="grpc", timeout_ms=3000, max_retry=2),
                              load_balancer="rr")
    async with channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        for i in range(4):
            assert (await stub.Echo(EchoRequest(message=f"r{i}"))).message == f"r{i}"
        assert channel.stats.retries >= 1
        assert channel.server_states()[f"127.0.0.1:{dead}"] == "down"


async def test_backup_request_wins_and_the_original_is_cancelled():
    srv = GrpcioServer(delay_first_ms=2000)
    srv.start()
    try:
        async with grpc_channel(srv.port, backup_request_ms=100) as channel:
            cntl = Controller()
            resp = await aiobrpc.Stub(channel, SERVICE).Echo(EchoRequest(message="backup"), cntl)
            # The answer is the second call's (the first one's would say calls_served=1).
            assert resp.calls_served == 2 and cntl.has_backup_request
            assert await asyncio.to_thread(_cancelled, srv, "backup")  # the loser's stream was reset
    finally:
        srv.stop()


async def test_connection_loss_mid_call_fails_the_call_at_once():
    srv = GrpcioServer()
    port = srv.start()
    try:
        async with grpc_channel(port, timeout_ms=5000, max_retry=0) as channel:
            task = asyncio.ensure_future(aiobrpc.Stub(channel, SERVICE).Echo(EchoRequest(message="lost",
                                                                                         sleep_ms=5000)))
            for _ in range(1000):  # until the server has the call in hand (10 s at most)
                if srv.calls:
                    break
                await asyncio.sleep(0.01)
            await wait_until(lambda: srv.calls == 1 and not task.done())
            assert srv.calls == 1 and not task.done()
            await asyncio.to_thread(srv.stop, 0)
            with pytest.raises(RpcError) as info:
                await task
            # Ended by the loss, not by its deadline (timeout_ms=5000) nor the server's answer (after 5 s).
            assert info.value.code != errors.ERPCTIMEDOUT
            assert channel.stats.connections_lost == 1
    finally:
        srv.stop()


async def test_graceful_goaway_lets_the_call_in_flight_finish():
    srv = GrpcioServer()
    port = srv.start()
    try:
        async with grpc_channel(port, max_retry=0) as channel:
            task = asyncio.ensure_future(aiobrpc.Stub(channel, SERVICE).Echo(EchoRequest(message="finish",
                                                                                         sleep_ms=300)))
            await asyncio.sleep(0.1)
            await asyncio.to_thread(srv.stop, 2.0)  # GOAWAY, then the server waits for its calls
            assert (await task).message == "finish"
    finally:
        srv.stop()


# -- against aiobrpc's own gRPC server ---------------------------------------------------------
async def test_aiobrpc_server_answers_the_grpc_client():
    from tests.helpers.interop_server import InteropEcho

    server = aiobrpc.Server()
    server.add_service(InteropEcho())
    await server.start("127.0.0.1:0")
    try:
        async with grpc_channel(server.port, max_retry=0) as channel:
            stub = aiobrpc.Stub(channel, SERVICE)
            cntl = Controller(timeout_ms=2000)
            cntl.request_user_fields = {"x-k": "v"}
            resp = await stub.Echo(EchoRequest(message="to aiobrpc", payload=b"q" * 1000), cntl)
            assert resp.message == "to aiobrpc" and resp.payload_size == 1000
            assert 0 < resp.server_timeout_ms <= 2000  # grpc-timeout became the handler's timeout_ms
            with pytest.raises(RpcError) as info:
                await stub.Echo(EchoRequest(message="x", fail_code=errors.EPERM, fail_text="denied"))
            assert info.value.code == errors.EPERM and info.value.text == "denied"
            cntl = Controller()
            cntl.request_compress_type = compress.GZIP
            assert (await stub.Echo(EchoRequest(message="g" * 5000), cntl)).message == "g" * 5000
    finally:
        await server.stop()
        await server.join()


async def test_window_waits_and_the_servers_stream_limit_against_aiobrpc():
    from aiobrpc._proto import grpc_test_pb2
    from aiobrpc.server.grpc.session import MAX_CONCURRENT_STREAMS, STREAM_WINDOW
    from tests.grpc.test_grpc_server import GrpcTest

    service = grpc_test_pb2.DESCRIPTOR.services_by_name["GrpcTestService"]
    Msg = grpc_test_pb2.GrpcMessage
    server = aiobrpc.Server(aiobrpc.ServerOptions(max_body_size=64 << 20))
    server.add_service(GrpcTest())
    await server.start("127.0.0.1:0")
    try:
        async with grpc_channel(server.port, max_retry=0, max_body_size=64 << 20) as channel:
            stub = aiobrpc.Stub(channel, service)
            big = bytes(range(256)) * (3 * STREAM_WINDOW // 256)  # waits twice for the stream's window
            assert (await stub.Unary(Msg(data=big))).data == big
            # calls past the server's SETTINGS_MAX_CONCURRENT_STREAMS are not sent: ELIMIT, as brpc
            results = await asyncio.gather(*(stub.Unary(Msg(text=str(i), sleep_ms=300))
                                             for i in range(MAX_CONCURRENT_STREAMS + 20)), return_exceptions=True)
            refused = [r for r in results if isinstance(r, RpcError)]
            assert len(refused) == 20 and {r.code for r in refused} == {errors.ELIMIT}
            assert "max concurrent stream" in refused[0].text
            assert sorted(int(r.text) for r in results if not isinstance(r, RpcError)) == list(
                range(MAX_CONCURRENT_STREAMS))
    finally:
        await server.stop()
        await server.join()


@pytest.mark.parametrize("status", [b"abc", b"", b"20", b"2000", b"+20"])
def test_a_reply_whose_status_is_no_3_digit_number_fails_its_call_only(status):
    """fuzz/grpc_client finding: int(b"abc") raised out of the frame handling and aborted the
    connection (every call on it EFAILEDSOCKET); now the one reply fails with ERESPONSE."""
    from aiobrpc.client.grpc_connection import read_headers

    class Reply:
        http_status = 0
        grpc_reply = False
        encoding = None
        status = None
        message = ""

        def __init__(self):
            self.fields = []

    reply = Reply()
    err = read_headers(reply, [(b":status", status), (b"content-type", b"application/grpc")])
    assert reply.http_status == 0
    assert err is not None and err.code == errors.ERESPONSE and "is not a 3-digit number" in err.text
