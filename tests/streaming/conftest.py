"""Streaming fixtures: a test fails on any exception that reaches the loop's exception handler,
and on any stream, task or connection left behind."""

from __future__ import annotations

import asyncio
import contextlib

import pytest_asyncio

import aiobrpc
from aiobrpc._proto import interop_pb2
from tests.helpers.interop_server import SERVICE, running_echo
from tests.helpers.loop_errors import loop_errors  # noqa: F401  (autouse fixture)
from tests.helpers.waiting import wait_until

MIB = 1024 * 1024


@contextlib.asynccontextmanager
async def stream_pair(server_options: aiobrpc.ServerOptions | None = None,
                      channel_options: aiobrpc.ChannelOptions | None = None):
    """(server, servicer, channel, stub) of the interop EchoService, whose StartStream accepts
    the offered streams and echoes every message. On exit: no stream, connection or task left."""
    async with running_echo(server_options) as (server, servicer):
        channel = aiobrpc.Channel(server.address, channel_options or aiobrpc.ChannelOptions(timeout_ms=5000))
        stub = aiobrpc.Stub(channel, SERVICE)
        try:
            yield server, servicer, channel, stub
        finally:
            await channel.close()
            await asyncio.sleep(0.02)
            await wait_until(lambda: channel_stream_count(channel) == 0)
            assert channel_stream_count(channel) == 0
    assert server.stream_count() == 0


def channel_stream_count(channel: aiobrpc.Channel) -> int:
    return sum(len(c.streams) for p in channel.pools.values() for c in p.connections if c.streams is not None)


async def open_stream(stub, **options) -> tuple:
    """A stream created by a StartStream call: (stream, controller)."""
    cntl = aiobrpc.Controller()
    stream = aiobrpc.Stream.create(cntl, **options)
    await stub.StartStream(interop_pb2.EchoRequest(message="open"), cntl)
    return stream, cntl


@pytest_asyncio.fixture
async def echo_pair():
    async with stream_pair() as quad:
        yield quad
