"""TCP keepalive and TCP_USER_TIMEOUT on a channel's connections, as brpc's -socket_keepalive*
and -socket_tcp_user_timeout_ms flags set them."""

from __future__ import annotations

import socket

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc._proto import interop_pb2
from tests.helpers.interop_server import SERVICE, running_echo


@pytest_asyncio.fixture
async def echo():
    async with running_echo() as pair:
        yield pair


async def connected_socket(server, **opts):
    channel = aiobrpc.Channel(f"127.0.0.1:{server.port}", aiobrpc.ChannelOptions(**opts))
    await aiobrpc.Stub(channel, SERVICE).Echo(interop_pb2.EchoRequest(message="x"))
    return channel, channel._conn.transport.get_extra_info("socket")


async def test_keepalive_and_user_timeout_are_set_as_asked(echo):
    server, _ = echo
    channel, sock = await connected_socket(server, socket_keepalive=True, socket_keepalive_idle_s=7,
                                           socket_keepalive_interval_s=3, socket_keepalive_count=4,
                                           tcp_user_timeout_ms=5000)
    try:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 7
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 3
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 4
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 5000
    finally:
        await channel.close()


async def test_by_default_the_systems_settings_stay(echo):
    server, _ = echo
    channel, sock = await connected_socket(server, connection_group="defaults")
    try:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 0
    finally:
        await channel.close()


@pytest.mark.parametrize("name,value", [("socket_keepalive_idle_s", 0), ("socket_keepalive_count", -2),
                                        ("tcp_user_timeout_ms", "5"), ("socket_keepalive_interval_s", True)])
def test_bad_values_are_refused(name, value):
    with pytest.raises(ValueError, match=name):
        aiobrpc.ChannelOptions(**{name: value})
    with pytest.raises(TypeError, match="socket_keepalive must be a bool"):
        aiobrpc.ChannelOptions(socket_keepalive=1)
