"""aiobrpc.testing.ChannelFor: a channel to servicers of the same process, in memory, through
the real codec and the server's real dispatch."""

from __future__ import annotations

import asyncio
import os
import zlib

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.protocol import compress
from aiobrpc.testing import MEMORY_HOST, ChannelFor
from aiobrpc.transport import connect
from aiobrpc.transport.memory import MemoryServer, MemoryTransport
from tests.helpers.interop_server import SERVICE, InteropEcho

MiB = 1 << 20


def echo(message: str = "hi", **fields) -> interop_pb2.EchoRequest:
    return interop_pb2.EchoRequest(message=message, **fields)


class Failing(aiobrpc.Servicer):
    SERVICE = SERVICE

    async def Echo(self, request, cntl):
        if request.message == "bad input":
            raise aiobrpc.RpcError(errors.EREQUEST, "message must be good")
        raise ValueError("a bug in the servicer")


def open_sockets() -> int:
    """Sockets this process holds (Linux: /proc/self/fd)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            pass
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts sockets in /proc/self/fd")
async def test_a_round_trip_goes_through_memory_not_a_socket(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a TCP connection was tried")
    monkeypatch.setattr(connect, "connect_socket", refuse)
    before = open_sockets()
    async with ChannelFor([InteropEcho()]) as channel:
        resp = await aiobrpc.Stub(channel, SERVICE).Echo(echo("hello"))
        assert resp.message == "hello" and resp.calls_served == 1
        assert open_sockets() == before
        assert channel.address.startswith(f"{MEMORY_HOST}:")
        assert type(channel._conn.transport) is MemoryTransport
        assert channel._conn.transport.get_extra_info("socket") is None


async def test_the_server_is_reachable_while_open_and_stopped_after():
    channel_for = ChannelFor([InteropEcho()], aiobrpc.ChannelOptions(max_retry=0))
    async with channel_for as channel:
        server = channel_for.server
        assert type(server._listener) is MemoryServer and server.host == MEMORY_HOST
        await aiobrpc.Stub(channel, SERVICE).Echo(echo())
        assert server.stats.connections_accepted == 1 and len(server.connections) == 1
        address = server.address
    assert channel_for.server is None and not server.connections
    async with aiobrpc.Channel(address, aiobrpc.ChannelOptions(max_retry=0)) as late:
        with pytest.raises(aiobrpc.RpcError) as e:
            await aiobrpc.Stub(late, SERVICE).Echo(echo())
    assert e.value.code == errors.ECONNREFUSED and "Connection refused" in e.value.text


async def test_errors_of_a_servicer_arrive_with_their_codes_and_texts():
    async with ChannelFor([Failing()]) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        cntl = aiobrpc.Controller()
        with pytest.raises(aiobrpc.RpcError) as e:
            await stub.Echo(echo("bad input"), cntl)
        assert e.value.code == errors.EREQUEST and e.value.text.endswith("message must be good")
        assert cntl.error_code == errors.EREQUEST and cntl.remote_side == channel.address
        with pytest.raises(aiobrpc.RpcError) as e:
            await stub.Echo(echo("anything"))
        assert e.value.code == errors.EINTERNAL and "a bug in the servicer" in e.value.text
        with pytest.raises(aiobrpc.RpcError) as e:
            await channel.call_method("interop.Elsewhere", "Echo", echo(), interop_pb2.EchoResponse)
        assert e.value.code == errors.ENOMETHOD


async def test_attachments_go_both_ways():
    async with ChannelFor([InteropEcho()]) as channel:
        cntl = aiobrpc.Controller()
        cntl.request_attachment = bytearray(b"to the server")
        resp = await aiobrpc.Stub(channel, SERVICE).Echo(echo(response_attachment_size=5), cntl)
        assert resp.request_attachment_size == 13 and resp.request_attachment_crc32 == zlib.crc32(b"to the server")
        assert bytes(cntl.response_attachment) == b"to the server" + bytes(range(5))


async def test_a_large_message_and_attachment():
    payload = bytes(range(256)) * (8 * MiB // 256)
    attachment = memoryview(payload[::-1])
    async with ChannelFor([InteropEcho()]) as channel:
        cntl = aiobrpc.Controller(timeout_ms=30_000)
        cntl.request_attachment = attachment
        resp = await aiobrpc.Stub(channel, SERVICE).Echo(echo(payload=payload), cntl)
    assert resp.payload_size == 8 * MiB and resp.payload_crc32 == zlib.crc32(payload)
    assert cntl.response_attachment == attachment


async def test_a_deadline_is_propagated_and_expires():
    async with ChannelFor([InteropEcho()], aiobrpc.ChannelOptions(deliver_timeout_ms=True),
                          join_timeout=0.1) as channel:  # the abandoned handler is cancelled
        stub = aiobrpc.Stub(channel, SERVICE)
        resp = await stub.Echo(echo(), aiobrpc.Controller(timeout_ms=1000))
        assert 0 < resp.server_timeout_ms <= 1000
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(aiobrpc.RpcError) as e:
            await stub.Echo(echo(sleep_ms=5000), aiobrpc.Controller(timeout_ms=100))
        # The answer comes after 5 s: ERPCTIMEDOUT is the deadline's, and not before its time.
        assert e.value.code == errors.ERPCTIMEDOUT and loop.time() - started >= 0.09


async def test_user_fields_and_log_id():
    async with ChannelFor([InteropEcho()]) as channel:
        cntl = aiobrpc.Controller(log_id=42)
        cntl.request_user_fields = {"tenant": "a", "trace": "b"}
        resp = await aiobrpc.Stub(channel, SERVICE).Echo(echo(), cntl)
    assert list(resp.user_fields) == ["tenant=a", "trace=b"] and resp.log_id == 42
    assert cntl.response_user_fields == {"trace": "b", "tenant": "a"}


@pytest.mark.parametrize("kind", [compress.SNAPPY, compress.GZIP, compress.ZLIB])
async def test_compression_both_ways(kind):
    async with ChannelFor([InteropEcho()]) as channel:
        cntl = aiobrpc.Controller()
        cntl.request_compress_type = kind
        resp = await aiobrpc.Stub(channel, SERVICE).Echo(echo("z" * 1000, response_compress_type=kind), cntl)
    assert resp.request_compress_type == kind and resp.message == "z" * 1000
    assert cntl.response_compress_type == kind


async def test_server_options_apply():
    options = aiobrpc.ServerOptions(max_body_size=1024)
    async with ChannelFor([InteropEcho()], server_options=options) as channel:
        with pytest.raises(aiobrpc.RpcError) as e:
            await aiobrpc.Stub(channel, SERVICE).Echo(echo(payload=b"x" * 4096), aiobrpc.Controller(max_retry=0))
    assert e.value.code in (errors.EFAILEDSOCKET, errors.EEOF), e.value


async def test_the_fixture_closes_what_the_test_left_open(aiobrpc_channel_for):
    async with aiobrpc_channel_for([InteropEcho()]) as channel:
        assert (await aiobrpc.Stub(channel, SERVICE).Echo(echo("in a block"))).message == "in a block"
    left_open = aiobrpc_channel_for([InteropEcho()])
    channel = await left_open.start()
    assert (await aiobrpc.Stub(channel, SERVICE).Echo(echo("left open"))).message == "left open"
    assert left_open.server is not None  # the fixture closes it after the test


def test_channel_for_needs_a_servicer():
    with pytest.raises(ValueError, match="at least one servicer"):
        ChannelFor([])
