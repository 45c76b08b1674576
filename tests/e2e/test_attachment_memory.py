"""Kept attachments through real calls: what keeping them keeps alive.

A handler that keeps `cntl.request_attachment` and a caller that keeps
`cntl.response_attachment` hold the attachments' own bytes when they are small (copies), not
the connection's receive blocks; a large attachment is still the frame's own buffer, received
with no copy. See tests/fast/test_attachment_memory.py for the rule (at most 4x its size).
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc import _fast
from aiobrpc._proto import interop_pb2
from tests.helpers.interop_server import SERVICE, InteropEcho, running_echo

Req = interop_pb2.EchoRequest


class KeepingEcho(InteropEcho):
    """InteropEcho whose handler keeps every request attachment."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list = []

    async def Echo(self, request, cntl):
        self.kept.append(cntl.request_attachment)
        return await super().Echo(request, cntl)


@pytest_asyncio.fixture
async def keeping():
    """(server, servicer) of KeepingEcho on an ephemeral port."""
    async with running_echo(servicer=KeepingEcho()) as pair:
        yield pair


def held_by(views) -> int:
    """Bytes of the distinct buffers under `views`: what keeping them keeps alive."""
    owners = {id(v.obj): v.obj for v in views}
    return sum(memoryview(o).nbytes for o in owners.values())


async def test_kept_small_attachments_hold_their_own_bytes_on_both_sides(keeping):
    # 1,000 calls with a 4 KiB message and a 16 B attachment each way, 8 at a time; both the
    # handler and the caller keep every attachment. As views of the receive blocks they held
    # ~4 MiB on the server and a 256 KiB block on the client; copied, 16 B each.
    server, servicer = keeping
    n, size = 1000, 16
    channel = aiobrpc.Channel(f"127.0.0.1:{server.port}", aiobrpc.ChannelOptions(max_retry=0))
    stub = aiobrpc.Stub(channel, SERVICE)
    kept = []

    async def caller(first: int) -> None:
        for i in range(first, n, 8):
            cntl = aiobrpc.Controller(request_attachment=bytes([i & 0xFF]) * size)
            await stub.Echo(Req(message="keep", payload=bytes(4096)), cntl)
            kept.append((i, cntl.response_attachment))

    await asyncio.gather(*(caller(k) for k in range(8)))
    await channel.close()
    assert len(kept) == n and len(servicer.kept) == n
    sent = sorted(bytes([i & 0xFF]) * size for i in range(n))
    assert all(bytes(a) == bytes([i & 0xFF]) * size for i, a in kept)
    assert sorted(bytes(a) for a in servicer.kept) == sent
    client_views = [a for _, a in kept]
    for views in (client_views, servicer.kept):
        assert all(type(a) is memoryview and not a.readonly for a in views)
        assert held_by(views) == n * size


@pytest.mark.parametrize("size", [1 << 20, 4 << 20])
async def test_large_attachments_are_still_received_without_a_copy(keeping, size):
    server, servicer = keeping
    channel = aiobrpc.Channel(f"127.0.0.1:{server.port}",
                              aiobrpc.ChannelOptions(max_retry=0, timeout_ms=20000))
    stub = aiobrpc.Stub(channel, SERVICE)
    sent = bytes(range(256)) * (size // 256)
    cntl = aiobrpc.Controller(request_attachment=sent)
    await stub.Echo(Req(message="big"), cntl)
    await channel.close()
    [request_att] = servicer.kept
    for att in (request_att, cntl.response_attachment):
        assert att.nbytes == size and att == sent
        # The frame's own exact-size buffer (header, meta and message before the attachment),
        # not a copy (exactly its size) nor the shared block.
        assert type(att.obj) is bytearray and size < len(att.obj) <= size + 1024
        assert len(att.obj) <= _fast.ATTACHMENT_PIN_RATIO * size
