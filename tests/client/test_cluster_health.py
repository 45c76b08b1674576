"""A list:// cluster of three in-process servers under rr (brpc's docs/en/client.md): even spread,
a server stopped and restarted on its port (docs/hostile_inputs.md E5), ELOGOFF from a stopping
server, the circuit breaker isolating a failing server, a blackholed server behind backup
requests (E6), and 20k calls into a blackhole (F5).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import os

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from tests.helpers.fault_proxy import FaultProxy
from tests.helpers.health import wait_up
from tests.helpers.interop_server import SERVICE, InteropEcho

Req = interop_pb2.EchoRequest


class Failing(InteropEcho):
    """Answers every call with EINTERNAL (a broken server whose port is open)."""

    async def Echo(self, request, cntl):
        self.calls_served += 1
        raise aiobrpc.RpcError(errors.EINTERNAL, "broken backend")


async def start_server(servicer, port: int = 0) -> aiobrpc.Server:
    server = aiobrpc.Server()
    server.add_service(servicer)
    await server.start(f"127.0.0.1:{port}")
    return server


@pytest_asyncio.fixture
async def cluster():
    """Three (server, servicer) pairs; every server is stopped at the end, even a restarted one."""
    nodes = []
    for _ in range(3):
        servicer = InteropEcho()
        nodes.append([await start_server(servicer), servicer])
    yield nodes
    for server, _ in nodes:
        await server.stop()
        await server.join(timeout=2)


def cluster_channel(addresses, **opts):
    opts.setdefault("timeout_ms", 2000)
    opts.setdefault("health_check_interval_s", 0.2)
    channel = aiobrpc.Channel("list://" + ",".join(addresses), aiobrpc.ChannelOptions(**opts),
                              load_balancer="rr")
    return channel, aiobrpc.Stub(channel, SERVICE)


def addresses_of(nodes):
    return [f"127.0.0.1:{server.port}" for server, _ in nodes]


async def until(predicate, timeout: float = 10.0) -> float:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        if loop.time() - start > timeout:
            raise AssertionError(f"not true within {timeout}s")
        await asyncio.sleep(0.005)
    return loop.time() - start


class Load:
    """`workers` closed loops of calls until stopped; every call's outcome is counted."""

    def __init__(self, stub, workers: int = 8) -> None:
        self.stub = stub
        self.ok = 0
        self.failed: list = []
        self._stop = False
        self._tasks = [asyncio.ensure_future(self._loop(w)) for w in range(workers)]

    async def _loop(self, w: int) -> None:
        i = 0
        while not self._stop:
            msg = f"{w}.{i}"
            i += 1
            try:
                resp = await self.stub.Echo(Req(message=msg))
            except aiobrpc.RpcError as e:
                self.failed.append((e.code, e.text))
            else:
                assert resp.message == msg
                self.ok += 1
            await asyncio.sleep(0.001)

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)


def open_fds() -> dict[str, str]:
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd
            pass
    return fds


def new_fds(before: dict[str, str]) -> dict[str, str]:
    """fds opened since `before`, less the /dev/null fd uvloop (libuv) opens once per loop
    and keeps."""
    return {fd: target for fd, target in open_fds().items()
            if fd not in before and target != "/dev/null"}


# --- spread ------------------------------------------------------------------------------------

async def test_rr_spreads_calls_evenly(cluster):
    channel, stub = cluster_channel(addresses_of(cluster))
    for batch in range(10):
        await asyncio.gather(*[stub.Echo(Req(message=f"{batch}.{i}")) for i in range(30)])
    counts = [servicer.calls_served for _, servicer in cluster]
    assert sum(counts) == 300 and max(counts) - min(counts) <= 1, counts
    assert channel.server_states() == dict.fromkeys(addresses_of(cluster), "up")
    assert channel.connection_count() == 3 and channel.pending_calls() == 0
    await channel.close()


# --- E5: a server stops and restarts on its port ---------------------------------------------

async def test_stopped_server_is_avoided_then_revived_on_restart(cluster):
    addresses = addresses_of(cluster)
    channel, stub = cluster_channel(addresses)
    (s0, echo0), _, _ = cluster
    port = s0.port
    load = Load(stub)
    await until(lambda: echo0.calls_served >= 20)
    await s0.stop()
    await s0.join(timeout=2)
    # The connection broke: the server is marked down (a failed health check keeps it down).
    await until(lambda: channel.server_states()[addresses[0]] == "down", timeout=5)
    served_before = echo0.calls_served
    others_before = load.ok
    # Two health checks on a closed port, and calls enough to have tried it (as many as the load makes).
    await until(lambda: channel.stats.health_checks >= 2 and load.ok > others_before + 50, timeout=10)
    assert channel.server_states()[addresses[0]] == "down"
    assert echo0.calls_served == served_before  # the others took every call
    # Restarted on the same port: revived by the health check (its interval is 0.2 s; 5 s only
    # guards against a hang).
    await s0.start(f"127.0.0.1:{port}")
    await wait_up(channel, timeout=5)
    await until(lambda: echo0.calls_served > served_before + 20)
    await load.stop()
    assert load.failed == [], load.failed[:5]  # idempotent calls: retried elsewhere
    assert channel.stats.servers_marked_down == 1 and channel.stats.servers_revived == 1
    assert channel.pending_calls() == 0
    await channel.close()


async def test_single_server_down_fails_fast_with_ehostdown_then_revived():
    servicer = InteropEcho()
    server = await start_server(servicer)
    port = server.port
    channel = aiobrpc.Channel(f"127.0.0.1:{port}", aiobrpc.ChannelOptions(health_check_interval_s=0.2))
    stub = aiobrpc.Stub(channel, SERVICE)
    assert (await stub.Echo(Req(message="warm"))).message == "warm"
    await server.stop()
    await server.join(timeout=2)
    await until(lambda: channel.server_states() == {f"127.0.0.1:{port}": "down"}, timeout=5)
    for _ in range(5):
        cntl = aiobrpc.Controller()
        with pytest.raises(aiobrpc.RpcError) as ei:
            await stub.Echo(Req(message="down"), cntl)
        assert ei.value.code == errors.EHOSTDOWN and "Not connected to" in ei.value.text
        assert cntl.retried_count == 3  # EHOSTDOWN from the down server's state: no connect, no wait
    await server.start(f"127.0.0.1:{port}")
    await wait_up(channel, timeout=1)
    assert (await stub.Echo(Req(message="back"))).message == "back"
    assert servicer.calls_served == 2
    await channel.close()
    await server.stop()
    await server.join(timeout=2)


# --- ELOGOFF -----------------------------------------------------------------------------------

@pytest.mark.parametrize("ctype", ["single", "pooled", "short"])
async def test_elogoff_is_retried_elsewhere_and_logs_the_server_off(cluster, ctype):
    addresses = addresses_of(cluster)
    channel, stub = cluster_channel(addresses, connection_type=ctype,
                                    non_idempotent_methods={"interop.EchoService"})
    await asyncio.gather(*[stub.Echo(Req(message="warm")) for i in range(6)])  # connections to all
    (s1, echo1) = cluster[1]
    served_before = echo1.calls_served
    port = s1.port
    await s1.stop()  # no join: its open connections stay and answer ELOGOFF
    requests_before = s1.stats.requests
    for i in range(30):
        cntl = aiobrpc.Controller()
        assert (await stub.Echo(Req(message=str(i)), cntl)).message == str(i)
        assert cntl.remote_side != addresses[1]
    assert echo1.calls_served == served_before and channel.stats.retries == 1
    if ctype == "short":
        # No open connection to answer ELOGOFF: the connect is refused, the server is down.
        assert s1.stats.requests == requests_before
        assert channel.server_states()[addresses[1]] == "down"
    else:
        # One request reached the stopping server; ELOGOFF is retried although the method is
        # not idempotent (the server did not run it), and the server gets no more calls.
        assert s1.stats.requests == requests_before + 1
        assert channel.server_states()[addresses[1]] == "logged off"
    # The health check probes it like a failed server: the port is closed, so it stays out
    # of use (also once join closed its connections) until it restarts on its port.
    await s1.join(timeout=2)
    await asyncio.sleep(0.3)
    assert channel.server_states()[addresses[1]] != "up" and channel.stats.servers_revived == 0
    if ctype == "single":  # its connection is gone now: failed, no longer merely logged off
        assert channel.server_states()[addresses[1]] == "down"
    await s1.start(f"127.0.0.1:{port}")
    await wait_up(channel, timeout=2)
    await asyncio.gather(*[stub.Echo(Req(message=str(i))) for i in range(30)])
    assert echo1.calls_served == served_before + 10
    await channel.close()


# --- circuit breaker ---------------------------------------------------------------------------

async def test_circuit_breaker_isolates_a_failing_server_until_the_health_check(cluster):
    failing = Failing()
    bad = await start_server(failing)
    nodes = [cluster[0], cluster[1], [bad, failing]]
    addresses = addresses_of(nodes)
    channel, stub = cluster_channel(addresses, enable_circuit_breaker=True, max_retry=0)
    errors_seen = 0
    try:
        # brpc's defaults: while initializing, the long window (3000 samples, 5 %) allows 150
        # errors; the 151st isolates the server.
        while channel.stats.breaker_trips == 0:
            try:
                await stub.Echo(Req(message="x"))
            except aiobrpc.RpcError as e:
                assert e.code == errors.EINTERNAL
                errors_seen += 1
            assert errors_seen <= 151
        assert errors_seen == 151 and failing.calls_served == 151
        assert channel.server_states() == {addresses[0]: "up", addresses[1]: "up", addresses[2]: "down"}
        # Isolated for 100 ms: no call reaches it, none fails.
        results = await asyncio.gather(*[stub.Echo(Req(message=str(i))) for i in range(40)])
        assert [r.message for r in results] == [str(i) for i in range(40)]
        assert failing.calls_served == 151
        # Its port is open: the health check revives it, and it gets calls (and fails) again.
        await wait_up(channel, timeout=5)  # 5 s only guards against a hang (the interval is 0.2 s)
        assert channel.stats.servers_revived == 1 and channel.stats.breaker_trips == 1
        results = await asyncio.gather(*[stub.Echo(Req(message=str(i))) for i in range(30)],
                                       return_exceptions=True)
        assert sum(isinstance(r, aiobrpc.RpcError) for r in results) == 10
        assert failing.calls_served == 161
    finally:
        await channel.close()
        await bad.stop()
        await bad.join(timeout=2)


async def test_circuit_breaker_isolates_a_server_that_never_answers(cluster):
    """brpc's docs/en/client.md: every attempt reports (error_code, latency); brpc reports the attempt
    the deadline ended as ERPCTIMEDOUT, so a blackholed server is isolated too."""
    async with FaultProxy(("127.0.0.1", cluster[0][0].port), blackhole=True) as proxy:
        channel, stub = cluster_channel([proxy.address, *addresses_of(cluster)[1:]],
                                        enable_circuit_breaker=True, timeout_ms=300, max_retry=0)
        try:
            # Connected first: on a loaded machine calls that end while their connect is still
            # in flight would not count against the blackholed server. The deadline is long
            # enough for the healthy servers to answer 200 calls on a loaded machine.
            await channel.connect()
            for _ in range(4):  # 151 timeouts on the blackholed server trip its breaker
                await asyncio.gather(*[stub.Echo(Req(message="x")) for _ in range(200)],
                                     return_exceptions=True)
            assert channel.stats.breaker_trips == 1 and channel.stats.timeouts >= 151, channel.stats
        finally:
            await channel.close()


# --- E6: a blackholed server behind backup requests ---------------------------------------------

async def test_blackholed_server_is_covered_by_backup_requests(cluster):
    (s0, _), (_, echo1), (_, echo2) = cluster
    async with FaultProxy(("127.0.0.1", s0.port), blackhole=True) as proxy:
        # The backup delay is long enough for the healthy servers to answer first on a loaded
        # machine: only the blackholed server's calls get a backup.
        channel, stub = cluster_channel([proxy.address, *addresses_of(cluster)[1:]],
                                        timeout_ms=10_000, backup_request_ms=1000)
        results = await asyncio.gather(*[stub.Echo(Req(message=str(i))) for i in range(60)])
        # Every call answered: the blackholed ones by their backups, not at their deadline (ERPCTIMEDOUT).
        assert [r.message for r in results] == [str(i) for i in range(60)]
        assert echo1.calls_served + echo2.calls_served == 60
        assert channel.stats.backup_requests == 20 and proxy.bytes_discarded > 0
        assert channel.pending_calls() == 0
        await channel.close()


# --- F5: 20k calls into a blackhole -----------------------------------------------------------

def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_twenty_thousand_calls_into_a_blackhole_leave_nothing_behind():
    fds_before = open_fds()
    tasks_before = len(asyncio.all_tasks())
    async with FaultProxy(("127.0.0.1", 9), blackhole=True) as proxy, \
            aiobrpc.Channel(proxy.address, aiobrpc.ChannelOptions(timeout_ms=50)) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        req = Req(message="into the void")

        async def batch(n: int) -> None:
            results = await asyncio.gather(*[stub.Echo(req) for _ in range(n)], return_exceptions=True)
            codes = collections.Counter(getattr(r, "code", r) for r in results)
            assert codes == {errors.ERPCTIMEDOUT: n}  # each ended by its deadline (pytest-timeout: a hang)
            assert channel.pending_calls() == 0

        await batch(2000)  # warm up: connection, caches, free lists, hash tables grown
        gc.collect()
        rss_before = rss()
        for _ in range(9):
            await batch(2000)
        gc.collect()
        assert rss() - rss_before < 8 << 20, (rss_before, rss())
        assert channel.pending_calls() == 0 and channel.stats.timeouts == 20_000
        assert channel.connection_count() == 1 and proxy.connections_accepted == 1, channel.stats
        assert proxy.bytes_discarded > 20_000 * 20
    await asyncio.sleep(0)
    assert new_fds(fds_before) == {}
    assert len(asyncio.all_tasks()) == tasks_before
