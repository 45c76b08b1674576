"""Servicer.receive_attachment_into: a large request attachment received by the kernel straight
into the buffer the servicer chose (a numpy array's slice here), over real connections."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.protocol import compress
from tests.helpers.interop_server import SERVICE

N = 1 << 18  # float32 elements: 1 MiB attachments


class Into(aiobrpc.Servicer):
    """Echo's attachment goes to row `request.log_id` of `self.rows` when `message` says so."""

    SERVICE = SERVICE

    def __init__(self, rows: int = 4) -> None:
        self.rows = np.zeros((rows, N), np.float32)
        self.asked: list[tuple[str, str, int]] = []
        self.seen: list[tuple[bool, int]] = []

    def receive_attachment_into(self, method, request, attachment_size):
        self.asked.append((method, request.message, attachment_size))
        how = request.message
        if how == "raise":
            raise RuntimeError("no room")
        if how == "short":
            return bytearray(attachment_size - 4)
        if how == "row":
            return self.rows[request.sleep_ms]
        return None

    async def Echo(self, request, cntl):
        att = cntl.request_attachment
        in_place = (request.message == "row" and len(att) == N * 4
                    and np.frombuffer(att, np.float32).ctypes.data == self.rows[request.sleep_ms].ctypes.data)
        self.seen.append((in_place, len(att)))
        return interop_pb2.EchoResponse(message=request.message, request_attachment_size=len(att))


async def start(servicer, **options):
    server = aiobrpc.Server(aiobrpc.ServerOptions(**options))
    server.add_service(servicer)
    await server.start("127.0.0.1:0")
    return server


async def stop(server, channel):
    await channel.close()
    await server.stop()
    await server.join(timeout=2)


async def test_attachments_land_in_the_rows_the_servicer_chose():
    svc = Into()
    server = await start(svc)
    channel = aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(timeout_ms=10_000))
    stub = aiobrpc.Stub(channel, SERVICE)
    data = [np.full(N, i + 1, np.float32) * np.arange(N, dtype=np.float32) for i in range(4)]
    # a row on the wire paced in small writes would also do; concurrently on one connection:
    await asyncio.gather(*[stub.Echo(interop_pb2.EchoRequest(message="row", sleep_ms=i),
                                     aiobrpc.Controller(request_attachment=data[i])) for i in range(4)])
    for i in range(4):
        assert np.array_equal(svc.rows[i], data[i])
    assert [a[1:] for a in svc.asked] == [("row", N * 4)] * 4
    # A read into the 256 KiB receive block never brings a whole 1 MiB request: all placed.
    assert svc.seen == [(True, N * 4)] * 4
    await stop(server, channel)


@pytest.mark.parametrize("how, logged", [("none", None), ("raise", "raised RuntimeError('no room')"),
                                         ("short", "is 1048572 bytes")])
async def test_a_refusal_or_a_fault_receives_the_request_as_usual(how, logged, caplog):
    svc = Into()
    server = await start(svc)
    channel = aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(timeout_ms=10_000))
    stub = aiobrpc.Stub(channel, SERVICE)
    payload = np.arange(N, dtype=np.float32)
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            resp = await stub.Echo(interop_pb2.EchoRequest(message=how),
                                   aiobrpc.Controller(request_attachment=payload))
            assert resp.request_attachment_size == N * 4
    assert not np.any(svc.rows)
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    if logged is None:
        assert messages == []
    else:
        assert messages and all(logged in m for m in messages)
    await stop(server, channel)


async def test_small_compressed_or_unauthenticated_requests_are_never_offered():
    class Auth:
        def verify_credential(self, credential, peer):
            return credential == b"ok"

    class Cred:
        def generate_credential(self):
            return b"ok"

    svc = Into()
    server = await start(svc, auth=Auth())
    channel = aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(timeout_ms=10_000, auth=Cred()))
    stub = aiobrpc.Stub(channel, SERVICE)
    # The first request of a connection is the one authenticated: never offered.
    await stub.Echo(interop_pb2.EchoRequest(message="row"), aiobrpc.Controller(request_attachment=bytes(N * 4)))
    await stub.Echo(interop_pb2.EchoRequest(message="row"), aiobrpc.Controller(request_attachment=b"small"))
    await stub.Echo(interop_pb2.EchoRequest(message="row", payload=bytes(1000)),
                    aiobrpc.Controller(request_attachment=bytes(N * 4), request_compress_type=compress.GZIP))
    assert svc.asked == []
    await stub.Echo(interop_pb2.EchoRequest(message="row", sleep_ms=1), aiobrpc.Controller(request_attachment=bytes(N * 4)))
    assert [a[1:] for a in svc.asked] == [("row", N * 4)]  # offered once authenticated
    await stop(server, channel)


async def test_a_servicer_without_the_hook_keeps_the_plain_decoder():
    from tests.helpers.interop_server import InteropEcho
    server = await start(InteropEcho())
    channel = aiobrpc.Channel(server.address)
    stub = aiobrpc.Stub(channel, SERVICE)
    await stub.Echo(interop_pb2.EchoRequest(message="x"))
    [conn] = server.connections
    assert type(conn.decoder).__name__ == "Decoder"
    await stop(server, channel)


async def test_unknown_methods_still_fail_as_before():
    svc = Into()
    server = await start(svc)
    channel = aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(timeout_ms=5000))
    cntl = aiobrpc.Controller(request_attachment=bytes(N * 4))
    with pytest.raises(aiobrpc.RpcError) as e:
        await channel.call_method("interop.EchoService", "Nope", interop_pb2.EchoRequest(message="row"),
                                      interop_pb2.EchoResponse, cntl)
    assert e.value.code == errors.ENOMETHOD
    await stop(server, channel)
