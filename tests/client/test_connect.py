"""Connecting: connect_timeout_ms counts the network's time, not a blocked event loop's (a
handshake that completed in the kernel while the loop was busy is used, never reported as a
timeout), and a single connection is made once however late a caller asks for it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.transport.connect import open_connection
from tests.helpers.interop_server import SERVICE, running_echo


async def test_a_loop_blocked_past_the_connect_timeout_still_connects():
    async with running_echo() as (server, servicer):
        opts = aiobrpc.ChannelOptions(connect_timeout_ms=50, timeout_ms=5000)
        async with aiobrpc.Channel(f"127.0.0.1:{server.port}", opts) as channel:
            call = asyncio.ensure_future(aiobrpc.Stub(channel, SERVICE).Echo(interop_pb2.EchoRequest(message="x")))
            for _ in range(5):  # the call starts the connect, the connect sends its SYN
                await asyncio.sleep(0)
            time.sleep(0.2)  # the loop is blocked: the timer and the handshake are both due
            assert (await call).message == "x"
            assert channel.stats.servers_marked_down == 0 and channel.connection_count() == 1
    assert servicer.calls_served == 1


@contextlib.contextmanager
def full_accept_queue():
    """(host, port) of a listener whose accept queue is full: Linux drops every further SYN."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    fillers = []
    try:
        for _ in range(8):
            s = socket.socket()
            fillers.append(s)
            s.setblocking(False)
            s.connect_ex(listener.getsockname())
        yield listener.getsockname()
    finally:
        for s in fillers:
            s.close()
        listener.close()


async def test_a_handshake_that_never_completes_times_out():
    with full_accept_queue() as (host, port):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(asyncio.TimeoutError):
            await open_connection(loop, asyncio.Protocol, host, port, timeout=0.2)
        # The handshake never completes: only the 0.2 s timer can end it, and not before its time.
        assert loop.time() - t0 > 0.15


async def test_a_refused_connect_fails_at_once():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        await open_connection(asyncio.get_running_loop(), asyncio.Protocol, "127.0.0.1", port, timeout=5)


async def test_the_channel_reports_a_connect_timeout_as_etimedout():
    opts = aiobrpc.ChannelOptions(connect_timeout_ms=100, timeout_ms=3000, max_retry=0)
    with full_accept_queue() as (host, port):
        async with aiobrpc.Channel(f"{host}:{port}", opts) as channel:
            with pytest.raises(aiobrpc.RpcError) as e:
                await aiobrpc.Stub(channel, SERVICE).Echo(interop_pb2.EchoRequest(message="x"))
            assert e.value.code == errors.ETIMEDOUT


async def test_a_caller_that_asks_after_the_single_connection_is_made_reuses_it():
    # Under load a call's connect task may first run after another call's connect finished.
    async with running_echo() as (server, _), \
            aiobrpc.Channel(f"127.0.0.1:{server.port}", aiobrpc.ChannelOptions()) as channel:
        (pool,) = channel.pools.values()
        loop = asyncio.get_running_loop()
        first = await pool.connect(loop, None, "single")
        assert await pool.connect(loop, None, "single") is first
        assert channel.connection_count() == 1 and channel.stats.connections_made == 1
