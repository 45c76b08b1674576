"""A server finds clients that vanished without a FIN or RST: TCP keepalive on every accepted
connection, on by default (stricter than brpc). The dead-peer run itself is in
tests/reliability/test_netns_faults.py (E13)."""

from __future__ import annotations

import asyncio
import socket

import pytest

import aiobrpc
from tests.helpers.interop_server import InteropEcho


async def accepted_socket(opts: aiobrpc.ServerOptions):
    srv = aiobrpc.Server(opts)
    srv.add_service(InteropEcho())
    await srv.start("127.0.0.1:0")
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    loop = asyncio.get_running_loop()
    end = loop.time() + 5
    while not srv.connections and loop.time() < end:
        await asyncio.sleep(0.005)
    (conn,) = srv.connections
    sock = conn.transport.get_extra_info("socket")
    got = (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
           sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
           sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
           sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT))
    writer.close()
    await srv.stop()
    await srv.join(timeout=2)
    return got


async def test_accepted_connections_have_tcp_keepalive_by_default():
    alive, idle, interval, count = await accepted_socket(aiobrpc.ServerOptions())
    assert alive and (idle, interval, count) == (60, 10, 3)


async def test_keepalive_follows_the_options():
    alive, idle, interval, count = await accepted_socket(aiobrpc.ServerOptions(
        socket_keepalive_idle_s=5, socket_keepalive_interval_s=2, socket_keepalive_count=4))
    assert alive and (idle, interval, count) == (5, 2, 4)
    alive, *_ = await accepted_socket(aiobrpc.ServerOptions(socket_keepalive=False))
    assert not alive


def test_keepalive_options_are_checked():
    with pytest.raises(TypeError, match="socket_keepalive must be a bool"):
        aiobrpc.ServerOptions(socket_keepalive=1)
    with pytest.raises(ValueError, match="socket_keepalive_count must be -1"):
        aiobrpc.ServerOptions(socket_keepalive_count=0)
