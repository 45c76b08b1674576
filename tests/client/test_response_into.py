"""Controller(response_attachment_into=buf): a large response attachment received by the kernel
straight into the caller's buffer; never written there once the call has ended."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.protocol import baidu_std
from aiobrpc.protocol.placement import PlacingDecoder
from tests.helpers.interop_server import SERVICE
from tests.helpers.peers import FakeServer
from tests.helpers.waiting import wait_until
from tests.helpers.wire import frame, rpc_meta

N = 1 << 18  # float32 elements: 1 MiB


class Source(aiobrpc.Servicer):
    """Echo answers, after `sleep_ms`, with an attachment of `message` float32 (N when not a
    number): arange * the number of calls served so far, so each reply is told apart."""

    SERVICE = SERVICE

    def __init__(self) -> None:
        self.calls = 0

    async def Echo(self, request, cntl):
        self.calls += 1
        if request.sleep_ms:
            await asyncio.sleep(request.sleep_ms / 1000)
        size = int(request.message) if request.message.isdigit() else N
        cntl.response_attachment = (np.arange(size, dtype=np.float32) * (self.calls)).tobytes()
        return interop_pb2.EchoResponse(message=request.message)


@pytest.fixture
async def served():
    server = aiobrpc.Server()
    src = Source()
    server.add_service(src)
    await server.start("127.0.0.1:0")
    channel = aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(timeout_ms=5000))
    yield src, channel, aiobrpc.Stub(channel, SERVICE)
    await channel.close()
    await server.stop()
    await server.join(timeout=2)


async def test_the_response_attachment_lands_in_the_callers_array(served):
    src, channel, stub = served
    dest = np.zeros(N, np.float32)
    cntl = aiobrpc.Controller(response_attachment_into=dest)
    await stub.Echo(interop_pb2.EchoRequest(message="x"), cntl)
    assert np.array_equal(dest, np.arange(N, dtype=np.float32))
    att = np.frombuffer(cntl.response_attachment, np.float32)
    assert att.ctypes.data == dest.ctypes.data  # a view of the caller's array: no copy
    [conn] = [c for p in channel.pools.values() for c in p.connections]
    assert type(conn.decoder) is PlacingDecoder


async def test_many_calls_in_flight_each_into_its_own_array(served):
    src, channel, stub = served
    dests = [np.zeros(N, np.float32) for _ in range(6)]
    cntls = [aiobrpc.Controller(response_attachment_into=d) for d in dests]
    await asyncio.gather(*[stub.Echo(interop_pb2.EchoRequest(message="x"), c) for c in cntls])
    seen = sorted(int(d[1]) for d in dests)
    assert seen == [1, 2, 3, 4, 5, 6]  # each array holds one whole, distinct response
    for d, c in zip(dests, cntls):
        assert np.array_equal(d, np.arange(N, dtype=np.float32) * d[1])
        assert np.frombuffer(c.response_attachment, np.float32).ctypes.data == d.ctypes.data


async def test_another_size_or_a_small_one_is_received_as_usual(served):
    src, channel, stub = served
    dest = np.zeros(N, np.float32)
    for message, size in (("1000", 1000), (str(N + 1), N + 1)):
        cntl = aiobrpc.Controller(response_attachment_into=dest)
        await stub.Echo(interop_pb2.EchoRequest(message=message), cntl)
        assert len(cntl.response_attachment) == size * 4
        assert not np.any(dest)  # untouched


def _reply(cid: int, attachment: bytes) -> bytes:
    meta = rpc_meta(service=None, method=None, correlation_id=cid, attachment_size=len(attachment))
    return frame(meta, interop_pb2.EchoResponse(message="x").SerializeToString() + attachment)


async def test_after_a_timeout_the_array_is_never_written():
    """The reply of a call that timed out is dropped; were it being received into the caller's
    array, what is left of it goes elsewhere. Here the reply is 16 MiB and the deadline falls
    while it arrives, however fast the machine: a fake server sends its first MiB, and the rest
    only when the next request comes, once the call has timed out."""
    big = 4 << 20  # float32: 16 MiB
    first = 1 << 18  # float32: the first MiB
    dec = baidu_std.Decoder(baidu_std.SERVER)
    cids = []
    rest = []

    def on_data(writer, data):
        dec.feed(data)
        for ev in dec.events():
            cid = ev.meta.correlation_id
            cids.append(cid)
            if len(cids) == 1:
                reply = _reply(cid, (np.arange(big, dtype=np.float32) + 1).tobytes())
                head = len(reply) - (big - first) * 4  # the frame up to the end of the first MiB
                writer.write(reply[:head])
                rest.append(reply[head:])
            else:  # the rest of the first reply, then this one's
                writer.write(rest.pop())
                writer.write(_reply(cid, (np.arange(N, dtype=np.float32) + 7).tobytes()))

    async with FakeServer(on_data) as peer:
        channel = aiobrpc.Channel(f"127.0.0.1:{peer.port}", aiobrpc.ChannelOptions(timeout_ms=5000, max_retry=0))
        stub = aiobrpc.Stub(channel, SERVICE)
        dest = np.zeros(big, np.float32)
        # The deadline only has to come after the first MiB landed (1 s: ample); the rest never comes before it.
        cntl = aiobrpc.Controller(response_attachment_into=dest, timeout_ms=1000)
        call = asyncio.ensure_future(stub.Echo(interop_pb2.EchoRequest(message=str(big)), cntl))
        for _ in range(1000):
            if dest[first - 1] != 0 or call.done():
                break
            await asyncio.sleep(0.001)
        await wait_until(lambda: dest[first - 1] == first and not call.done())
        assert dest[first - 1] == first and not call.done()  # the first MiB landed in the array; the call waits
        with pytest.raises(aiobrpc.RpcError) as e:
            await call
        assert e.value.code == errors.ERPCTIMEDOUT
        snapshot = dest.copy()
        assert np.array_equal(snapshot[:first], np.arange(first, dtype=np.float32) + 1)
        # The next call brings the rest of the first reply, dropped, before its own: once it is
        # answered, all of the first reply came.
        dest2 = np.zeros(N, np.float32)
        await stub.Echo(interop_pb2.EchoRequest(message="x"), aiobrpc.Controller(response_attachment_into=dest2))
        assert np.array_equal(dest2, np.arange(N, dtype=np.float32) + 7)  # the connection is fine for it
        assert np.array_equal(dest, snapshot)  # not written after the timeout
        assert not np.any(dest[first:])
        assert len(cids) == 2
        await channel.close()


def test_the_buffer_is_checked():
    with pytest.raises(ValueError, match="writable"):
        aiobrpc.Controller(response_attachment_into=bytes(10))
    with pytest.raises(TypeError, match="writable buffer"):
        aiobrpc.Controller(response_attachment_into=42)
    with pytest.raises(ValueError, match="C-contiguous"):
        aiobrpc.Controller(response_attachment_into=np.zeros((4, 4))[:, 1])
    view = aiobrpc.Controller(response_attachment_into=np.zeros((2, 3), np.float64)).response_attachment_into
    assert view.nbytes == 48 and view.format == "B"
