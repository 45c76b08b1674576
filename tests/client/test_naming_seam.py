"""The naming-service seam of Channel: a registered scheme whose list arrives later and changes
(brpc's docs/en/client.md), and an empty list:// (ENODATA)."""

from __future__ import annotations

import asyncio

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.client.naming import ServerNode, register_naming_service
from aiobrpc.client.naming.base import NamingService
from tests.helpers.interop_server import SERVICE, running_echo
from tests.helpers.waiting import wait_until

Req = interop_pb2.EchoRequest


class QueueNaming(NamingService):
    """A dynamic naming service fed by the test: each list put on `updates` is published."""

    instances: list = []

    def __init__(self, rest: str) -> None:
        self.updates: asyncio.Queue = asyncio.Queue()
        self.closed = False
        QueueNaming.instances.append(self)

    async def watch(self):
        while True:
            yield await self.updates.get()

    async def close(self) -> None:
        self.closed = True


register_naming_service("testqueue", QueueNaming)


async def test_calls_wait_for_the_first_list_then_follow_updates():
    QueueNaming.instances.clear()
    async with running_echo() as (a, _), running_echo() as (b, _):
        channel = aiobrpc.Channel("testqueue://anything", aiobrpc.ChannelOptions(timeout_ms=2000),
                                  load_balancer="rr")
        stub = aiobrpc.Stub(channel, SERVICE)
        [naming] = QueueNaming.instances
        call = asyncio.ensure_future(stub.Echo(Req(message="first")))
        await asyncio.sleep(0.05)
        assert not call.done()  # no list yet: the call waits for the first one (bounded)
        naming.updates.put_nowait([ServerNode("127.0.0.1", a.port)])
        assert (await call).message == "first"
        naming.updates.put_nowait([ServerNode("127.0.0.1", b.port)])  # a replaced by b
        await asyncio.sleep(0.01)
        await wait_until(lambda: list(channel.server_states()) == [f"127.0.0.1:{b.port}"])
        assert list(channel.server_states()) == [f"127.0.0.1:{b.port}"]
        cntl_sides = set()
        for i in range(4):
            cntl = aiobrpc.Controller()
            await stub.Echo(Req(message=str(i)), cntl)
            cntl_sides.add(cntl.remote_side)
        assert cntl_sides == {f"127.0.0.1:{b.port}"}
        await channel.close()
        assert naming.closed and channel.connection_count() == 0


async def test_no_first_list_within_the_deadline_fails_with_enodata():
    QueueNaming.instances.clear()
    channel = aiobrpc.Channel("testqueue://never", aiobrpc.ChannelOptions(timeout_ms=50),
                              load_balancer="rr")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(aiobrpc.RpcError) as ei:
        # No list ever comes: only the deadline ends the call (10 s only guards against a hang).
        await asyncio.wait_for(aiobrpc.Stub(channel, SERVICE).Echo(Req(message="x")), 10)
    # The wait for the first list is part of the call: it ends by its deadline (timeout_ms=50)
    # with ENODATA, or ERPCTIMEDOUT when the deadline fires before the last retry finds none.
    assert ei.value.code in (errors.ENODATA, errors.ERPCTIMEDOUT)
    assert loop.time() - t0 >= 0.045  # it waited for a list until the deadline
    await channel.close()


async def test_empty_list_fails_with_enodata():
    channel = aiobrpc.Channel("list://", aiobrpc.ChannelOptions(timeout_ms=200, max_retry=0),
                              load_balancer="rr")
    with pytest.raises(aiobrpc.RpcError) as ei:
        await aiobrpc.Stub(channel, SERVICE).Echo(Req(message="x"))
    assert ei.value.code == errors.ENODATA
    await channel.close()


def test_a_naming_url_needs_a_load_balancer_and_an_address_none():
    with pytest.raises(ValueError, match="give load_balancer="):
        aiobrpc.Channel("list://127.0.0.1:1")
    with pytest.raises(ValueError, match="needs a naming service URL"):
        aiobrpc.Channel("127.0.0.1:1", load_balancer="rr")
    with pytest.raises(ValueError, match="unknown naming service nope://"):
        aiobrpc.Channel("nope://x", load_balancer="rr")
