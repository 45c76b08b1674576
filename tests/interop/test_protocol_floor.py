"""bench/protocol_floor.py speaks baidu_std: aiobrpc calls its server and serves its client.

The floor is a benchmark baseline that claims to do the protocol work of a call and nothing
else; these tests keep it honest, so that what it measures is a real baidu_std conversation.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest

import aiobrpc
from aiobrpc._proto import echo_pb2

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def floor():
    sys.path.insert(0, str(BENCH))
    try:
        import protocol_floor
        yield protocol_floor
    finally:
        sys.path.remove(str(BENCH))


class Echo(aiobrpc.Servicer):
    SERVICE = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]

    async def Echo(self, request, cntl):
        cntl.response_attachment = cntl.request_attachment
        return echo_pb2.EchoResponse(message=request.message + "!")


async def test_an_aiobrpc_channel_calls_the_floor_server(floor):
    server = await asyncio.get_running_loop().create_server(floor.FloorServer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with aiobrpc.Channel(f"127.0.0.1:{port}") as channel:
            stub = aiobrpc.Stub(channel, echo_pb2.DESCRIPTOR.services_by_name["EchoService"])
            for size in (0, 16, 4096, 300_000):
                payload = np.arange(size, dtype=np.uint8)
                cntl = aiobrpc.Controller()
                cntl.request_attachment = payload
                response = await stub.Echo(echo_pb2.EchoRequest(message="hi"), cntl)
                assert response.message == "hi"  # the floor's handler echoes the message
                assert bytes(cntl.response_attachment) == payload.tobytes()
    finally:
        server.close()


async def test_the_floor_client_calls_an_aiobrpc_server(floor):
    server = aiobrpc.Server(aiobrpc.ServerOptions())
    server.add_service(Echo())
    await server.start("127.0.0.1:0")
    client = await floor.FloorClient.connect("127.0.0.1", server.port)
    try:
        calls = [client.call(echo_pb2.EchoRequest(message=str(i)), np.full(i, i, np.uint8)) for i in range(64)]
        for i, (response, attachment) in enumerate(await asyncio.gather(*calls)):
            assert response.message == f"{i}!"
            assert bytes(attachment) == bytes([i]) * i
    finally:
        client.close()
        await server.stop()
        await server.join(timeout=5)


async def test_the_floor_server_closes_on_an_unknown_method(floor):
    server = await asyncio.get_running_loop().create_server(floor.FloorServer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        options = aiobrpc.ChannelOptions(max_retry=0, timeout_ms=5000)
        async with aiobrpc.Channel(f"127.0.0.1:{port}", options) as channel:
            with pytest.raises(aiobrpc.RpcError):
                await channel.call_method("example.EchoService", "Nope", echo_pb2.EchoRequest(message="x"),
                                          echo_pb2.EchoResponse)
    finally:
        server.close()
