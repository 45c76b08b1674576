"""Channels of a process share their servers (brpc's SocketMap, client/socket_map.py): one
connection per server and signature, one health state, one circuit breaker; the last channel
to let a server go closes its connections; idle connections give their read blocks back."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.client import pool as pool_module
from aiobrpc.server import server as server_module
from aiobrpc.client.socket_map import SOCKET_MAP, signature
from tests.helpers.interop_server import SERVICE, running_echo

Req = interop_pb2.EchoRequest


@pytest_asyncio.fixture
async def echo():
    async with running_echo() as pair:
        yield pair


def channel_to(server, address: str | None = None, **opts):
    opts.setdefault("max_retry", 0)
    opts.setdefault("timeout_ms", 2000)
    lb = "rr" if address and address.startswith("list://") else None
    channel = aiobrpc.Channel(address or f"127.0.0.1:{server.port}", aiobrpc.ChannelOptions(**opts),
                              load_balancer=lb)
    return channel, aiobrpc.Stub(channel, SERVICE)


async def until(predicate, timeout: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, f"not true within {timeout}s"
        await asyncio.sleep(0.005)


async def test_channels_to_one_server_share_one_connection(echo):
    server, _ = echo
    a, stub_a = channel_to(server)
    b, stub_b = channel_to(server, timeout_ms=100)  # a call's own settings do not split them
    c, stub_c = channel_to(server, f"list://127.0.0.1:{server.port}")  # nor does a cluster channel
    try:
        replies = await asyncio.gather(*[stub.Echo(Req(message=f"{i}"))
                                         for i in range(30) for stub in (stub_a, stub_b, stub_c)])
        assert len(replies) == 90
        assert server.stats.connections_accepted == 1
        assert a.pools[next(iter(a.pools))] is b._single is c.pools[next(iter(c.pools))]
        # Each channel counts the connection its calls used, and only its own calls.
        assert a.stats.connections_made == b.stats.connections_made == c.stats.connections_made == 1
        assert a.connection_count() == 1 and a.pending_calls() == 0
    finally:
        for ch in (a, b, c):
            await ch.close()


async def test_a_pending_call_is_counted_by_its_own_channel(echo):
    server, _ = echo
    a, stub_a = channel_to(server)
    b, _ = channel_to(server)
    try:
        task = asyncio.ensure_future(stub_a.Echo(Req(message="slow", sleep_ms=300)))
        await until(lambda: a.pending_calls() == 1)
        assert b.pending_calls() == 0
        await task
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("differs", [{"connection_group": "batch"}, {"connect_timeout_ms": 300},
                                     {"max_body_size": 1 << 20}, {"auth": "object"}])
async def test_different_connection_options_keep_connections_apart(echo, differs):
    server, _ = echo
    if differs.get("auth") == "object":
        class Auth:
            def generate_credential(self) -> bytes:
                return b"token"
        differs = {"auth": Auth()}
    a, stub_a = channel_to(server)
    b, stub_b = channel_to(server, **differs)
    try:
        await stub_a.Echo(Req(message="a"))
        await stub_b.Echo(Req(message="b"))
        assert server.stats.connections_accepted == 2
        assert a._single is not b._single
    finally:
        await a.close()
        await b.close()


def test_the_signature_compares_objects_by_identity_and_values_by_value():
    ctx = object()
    same = aiobrpc.ChannelOptions(timeout_ms=1, auth=ctx, circuit_breaker_options={"short_window": 10})
    other = aiobrpc.ChannelOptions(timeout_ms=2, auth=ctx, circuit_breaker_options={"short_window": 10})
    assert signature(same) == signature(other)
    assert signature(same) != signature(aiobrpc.ChannelOptions(auth=object()))
    assert signature(same) != signature(aiobrpc.ChannelOptions(auth=ctx, circuit_breaker_options={"short_window": 9}))
    with pytest.raises(TypeError, match="connection_group must be a str"):
        aiobrpc.ChannelOptions(connection_group=1)


async def test_closing_one_channel_leaves_the_others_calls_alone(echo):
    server, _ = echo
    a, stub_a = channel_to(server)
    b, stub_b = channel_to(server)
    try:
        await stub_a.Echo(Req(message="warm"))
        a_slow = asyncio.ensure_future(stub_a.Echo(Req(message="a", sleep_ms=200)))
        b_slow = asyncio.ensure_future(stub_b.Echo(Req(message="b", sleep_ms=200)))
        await until(lambda: a.pending_calls() == 1 and b.pending_calls() == 1)
        await a.close()
        with pytest.raises(aiobrpc.RpcError) as ei:
            await a_slow
        assert ei.value.code == errors.EFAILEDSOCKET
        assert (await b_slow).message == "b"
        assert (await stub_b.Echo(Req(message="after"))).message == "after"
        assert server.stats.connections_accepted == 1  # b kept the shared connection
    finally:
        await b.close()
    await until(lambda: not server.connections)  # the last channel closed it


async def test_a_server_one_channel_finds_down_is_down_for_all(echo):
    server, _ = echo
    a, stub_a = channel_to(server)
    b, stub_b = channel_to(server)
    try:
        await stub_b.Echo(Req(message="warm"))
        with pytest.raises(aiobrpc.RpcError):
            await stub_a.Echo(Req(message="bye", close_connection=True))
        with pytest.raises(aiobrpc.RpcError) as ei:  # b fails fast, without a connect of its own
            await stub_b.Echo(Req(message="b"))
        assert ei.value.code == errors.EHOSTDOWN
        assert a.stats.servers_marked_down == b.stats.servers_marked_down == 1
        await until(lambda: b.server_states() == {f"127.0.0.1:{server.port}": "up"})  # one health check revives both
        assert a.server_states() == b.server_states()
        assert (await stub_b.Echo(Req(message="again"))).message == "again"
        assert a.stats.health_checks == b.stats.health_checks >= 1
    finally:
        await a.close()
        await b.close()


async def test_one_breaker_per_server_isolates_it_for_every_channel(echo):
    server, _ = echo
    breaker = {"short_window": 10, "long_window": 20}
    a, stub_a = channel_to(server, enable_circuit_breaker=True, circuit_breaker_options=breaker)
    b, stub_b = channel_to(server, circuit_breaker_options=breaker)  # does not feed it, is guarded by it
    try:
        await stub_b.Echo(Req(message="warm"))
        for _ in range(50):
            if a.stats.breaker_trips:
                break
            with pytest.raises(aiobrpc.RpcError):
                await stub_a.Echo(Req(message="x", fail_code=errors.EINTERNAL, fail_text="no"))
        assert a.stats.breaker_trips == b.stats.breaker_trips == 1
        with pytest.raises(aiobrpc.RpcError) as ei:
            await stub_b.Echo(Req(message="b"))
        assert ei.value.code == errors.EHOSTDOWN
    finally:
        await a.close()
        await b.close()


async def test_a_channel_without_the_breaker_does_not_feed_it(echo):
    server, _ = echo
    breaker = {"short_window": 10, "long_window": 20}
    a, stub_a = channel_to(server, enable_circuit_breaker=True, circuit_breaker_options=breaker)
    b, stub_b = channel_to(server, circuit_breaker_options=breaker)
    try:
        for _ in range(30):
            with pytest.raises(aiobrpc.RpcError):
                await stub_b.Echo(Req(message="x", fail_code=errors.EINTERNAL, fail_text="no"))
        assert b.stats.breaker_trips == 0
        assert (await stub_a.Echo(Req(message="fine"))).message == "fine"
    finally:
        await a.close()
        await b.close()


async def test_a_server_left_by_one_cluster_channel_stays_for_another(echo):
    server, _ = echo
    address = f"list://127.0.0.1:{server.port}"
    a, stub_a = channel_to(server, address)
    b, stub_b = channel_to(server, address)
    try:
        await stub_a.Echo(Req(message="a"))
        await stub_b.Echo(Req(message="b"))
        a._set_servers([])  # as a naming service that dropped it
        assert (await stub_b.Echo(Req(message="still"))).message == "still"
        assert server.stats.connections_accepted == 1
        b._set_servers([])
        await until(lambda: not server.connections)
    finally:
        await a.close()
        await b.close()


async def test_a_channel_dropped_without_close_lets_its_server_go(echo):
    server, _ = echo
    before = len(SOCKET_MAP)
    a, stub_a = channel_to(server, connection_group="dropped")
    await stub_a.Echo(Req(message="a"))
    assert len(SOCKET_MAP) == before + 1
    del a, stub_a
    gc.collect()
    assert len(SOCKET_MAP) == before
    await until(lambda: not server.connections)  # closed on its loop


async def test_an_idle_connection_gives_its_read_block_back(echo, monkeypatch):
    monkeypatch.setattr(pool_module, "BLOCK_RELEASE_IDLE_S", 0.05)
    monkeypatch.setattr(server_module, "BLOCK_RELEASE_IDLE_S", 60.0)  # the server's block stays
    server, _ = echo
    a, stub_a = channel_to(server)
    tracemalloc.start()
    try:
        await stub_a.Echo(Req(message="a"))  # its first read made the 256 KiB block
        held = tracemalloc.get_traced_memory()[0]
        assert held > 200 * 1024
        busy = asyncio.ensure_future(stub_a.Echo(Req(message="busy", sleep_ms=300)))
        await asyncio.sleep(0.2)
        assert tracemalloc.get_traced_memory()[0] > held - 100 * 1024  # a call in flight keeps it
        await busy
        await until(lambda: tracemalloc.get_traced_memory()[0] < held - 200 * 1024)
        assert (await stub_a.Echo(Req(message="b"))).message == "b"  # a new block at the next read
    finally:
        tracemalloc.stop()
        await a.close()
