"""A naming service or load balancer that fails is its own problem, never a call's hang: a watch
that raises is logged and watched again (the last list kept), a bad list is skipped, a load
balancer refusing a list leaves the old one in place, and calls waiting for a first list that
cannot come end at once with ENODATA naming the fault (even with timeout_ms=-1)."""

from __future__ import annotations

import asyncio
import logging

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.client import channel as channel_module
from aiobrpc.client.lb import register_load_balancer
from aiobrpc.client.lb.rr import RoundRobinLoadBalancer
from aiobrpc.client.naming import ServerNode, register_naming_service
from aiobrpc.client.naming.base import NamingService
from tests.helpers.interop_server import SERVICE, running_echo
from tests.helpers.waiting import wait_until

Req = interop_pb2.EchoRequest
HANG = 5


class ScriptedNaming(NamingService):
    """Each watch() plays the next script: a list of steps, each a server list to yield, an
    exception to raise, or "wait" (block until closed)."""

    scripts: list = []
    watches = 0

    def __init__(self, rest: str) -> None:
        ScriptedNaming.watches = 0

    async def watch(self):
        ScriptedNaming.watches += 1
        script = ScriptedNaming.scripts.pop(0) if ScriptedNaming.scripts else ["wait"]
        for step in script:
            if isinstance(step, BaseException):
                raise step
            if step == "wait":
                await asyncio.Event().wait()
            yield step


register_naming_service("scripted", ScriptedNaming)


class PickyRR(RoundRobinLoadBalancer):
    """Refuses any list with more than one server."""

    def set_servers(self, servers) -> None:
        if len(servers) > 1:
            raise RuntimeError("picky: one server only")
        super().set_servers(servers)


register_load_balancer("picky", lambda params: PickyRR())


@pytest.fixture(autouse=True)
def fast_naming_retry(monkeypatch):
    monkeypatch.setattr(channel_module, "NAMING_RETRY_MIN_S", 0.01)


def channel_for(lb: str = "rr") -> aiobrpc.Channel:
    return aiobrpc.Channel("scripted://x", aiobrpc.ChannelOptions(timeout_ms=-1, max_retry=1),
                           load_balancer=lb)


async def call(channel: aiobrpc.Channel, message: str = "x"):
    return await asyncio.wait_for(aiobrpc.Stub(channel, SERVICE).Echo(Req(message=message)), HANG)


@pytest.mark.parametrize("first", [RuntimeError("registry down"), "no list"])
async def test_no_first_list_ends_waiting_calls_at_once_naming_the_fault(first, caplog):
    ScriptedNaming.scripts = [[first] if isinstance(first, Exception) else []]
    async with channel_for() as channel:
        with pytest.raises(aiobrpc.RpcError) as ei:
            await call(channel)
    assert ei.value.code == errors.ENODATA
    assert ("registry down" if isinstance(first, Exception) else "stopped with no server") in ei.value.text
    assert any("naming service scripted://x" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)


async def test_a_watch_that_raises_keeps_the_last_list_and_is_watched_again():
    async with running_echo() as (a, _), running_echo() as (b, _):
        node_a, node_b = ServerNode("127.0.0.1", a.port), ServerNode("127.0.0.1", b.port)
        ScriptedNaming.scripts = [[[node_a], RuntimeError("lost the registry")], [[node_b], "wait"]]
        async with channel_for() as channel:
            assert (await call(channel)).message == "x"
            for _ in range(100):  # the restarted watch gives b
                if list(channel.server_states()) == [str(node_b)]:
                    break
                await asyncio.sleep(0.01)
            await wait_until(lambda: list(channel.server_states()) == [str(node_b)] and ScriptedNaming.watches == 2)
            assert list(channel.server_states()) == [str(node_b)] and ScriptedNaming.watches == 2
            cntl = aiobrpc.Controller()
            await aiobrpc.Stub(channel, SERVICE).Echo(Req(message="y"), cntl)
            assert cntl.remote_side == str(node_b)


@pytest.mark.parametrize("bad", [None, "127.0.0.1:80", ["127.0.0.1:80"], [object()]])
async def test_a_bad_list_is_skipped_and_the_watch_goes_on(bad, caplog):
    async with running_echo() as (a, _):
        node_a = ServerNode("127.0.0.1", a.port)
        ScriptedNaming.scripts = [[bad, [node_a], "wait"]]
        async with channel_for() as channel:
            assert (await call(channel)).message == "x"
            assert ScriptedNaming.watches == 1
    assert any("gave a bad server list" in r.getMessage() for r in caplog.records)


async def test_a_load_balancer_refusing_a_list_keeps_the_last_one(caplog):
    async with running_echo() as (a, _), running_echo() as (b, _):
        node_a, node_b = ServerNode("127.0.0.1", a.port), ServerNode("127.0.0.1", b.port)
        ScriptedNaming.scripts = [[[node_a], [node_a, node_b], "wait"]]
        async with channel_for("picky") as channel:
            assert (await call(channel)).message == "x"
            await asyncio.sleep(0.02)
            await wait_until(lambda: list(channel.server_states()) == [str(node_a)])
            assert list(channel.server_states()) == [str(node_a)]
            assert (await call(channel, "again")).message == "again"
    assert any("load_balancer.set_servers raised" in r.getMessage() for r in caplog.records)


async def test_close_ends_a_call_waiting_for_a_first_list_that_never_comes():
    ScriptedNaming.scripts = [["wait"]]
    channel = channel_for()
    pending = asyncio.ensure_future(call(channel))
    await asyncio.sleep(0.02)
    assert not pending.done()
    await channel.close()
    with pytest.raises(aiobrpc.RpcError) as ei:
        await pending
    assert ei.value.code == errors.EHOSTDOWN and "closed" in ei.value.text
