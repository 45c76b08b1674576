"""Load balancers through a Channel over list:// of three real servers: where calls go, the
request code of consistent hashing, feedback to the balancers that learn (exactly one per
selection, whatever ends the attempt), and cluster recovery's EREJECT."""

from __future__ import annotations

import asyncio
import collections
import socket

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.client.lb import RoundRobinLoadBalancer, create_load_balancer, register_load_balancer
from aiobrpc.client.naming import ServerNode
from tests.client.test_lb_consistent_hashing import reference_owner, reference_ring
from tests.helpers.interop_server import SERVICE, InteropEcho
from tests.helpers.waiting import wait_until

Req = interop_pb2.EchoRequest


class DelayedEcho(InteropEcho):
    """InteropEcho that waits `delay_s` before answering: a slow server."""

    delay_s = 0.0

    async def Echo(self, request, cntl):
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return await super().Echo(request, cntl)


@pytest_asyncio.fixture
async def cluster():
    """Three (server, servicer) pairs on 127.0.0.1, stopped at the end."""
    nodes = []
    for _ in range(3):
        servicer = DelayedEcho()
        server = aiobrpc.Server()
        server.add_service(servicer)
        await server.start("127.0.0.1:0")
        nodes.append((server, servicer))
    yield nodes
    for server, _ in nodes:
        await server.stop()
        await server.join(timeout=2)


def channel_of(cluster, load_balancer: str, tags=("", "", ""), extra: tuple = (),
               **opts) -> aiobrpc.Channel:
    opts.setdefault("timeout_ms", 2000)
    entries = [f"127.0.0.1:{server.port} {tag}".strip() for (server, _), tag in zip(cluster, tags)]
    return aiobrpc.Channel("list://" + ",".join(entries + list(extra)),
                           aiobrpc.ChannelOptions(**opts), load_balancer=load_balancer)


def served(cluster) -> list[int]:
    return [servicer.calls_served for _, servicer in cluster]


async def test_rr_spreads_calls_evenly(cluster):
    async with channel_of(cluster, "rr") as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        for i in range(30):
            assert (await stub.Echo(Req(message=str(i)))).message == str(i)
    assert served(cluster) == [10, 10, 10]


async def test_wrr_follows_the_weight_tags(cluster):
    async with channel_of(cluster, "wrr", tags=("1", "2", "3")) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        for _ in range(60):
            await stub.Echo(Req(message="w"))
    assert served(cluster) == [10, 20, 30]


async def test_c_murmurhash_sends_a_request_code_to_its_owner_every_time(cluster):
    nodes = [ServerNode("127.0.0.1", server.port) for server, _ in cluster]
    ring = reference_ring(nodes, "murmurhash", 100)
    async with channel_of(cluster, "c_murmurhash") as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        owners = set()
        # a code on each server's first virtual node too: the fixed codes alone may all land on one
        first_points = {node[4]: node[0] for node in reversed(ring)}
        codes = [0, 1, 77, 123456789, 2**31, 2**32 - 1, 987654321, 555, 31337, 4000000000]
        codes += sorted(first_points.values())
        for code in codes:
            owner = reference_owner(ring, code)
            owners.add(owner)
            for _ in range(4):
                cntl = aiobrpc.Controller(request_code=code)
                await stub.Echo(Req(message="k"), cntl)
                assert cntl.remote_side == owner.address
    assert len(owners) == len(cluster) and sum(served(cluster)) == 4 * len(codes)


async def test_consistent_hashing_without_a_request_code_fails_with_einval_unretried(cluster):
    async with channel_of(cluster, "c_md5", max_retry=3) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        for cntl in (aiobrpc.Controller(), aiobrpc.Controller(request_code=1 << 32)):
            with pytest.raises(aiobrpc.RpcError) as info:
                await stub.Echo(Req(message="x"), cntl)
            assert info.value.code == errors.EINVAL and "request_code" in info.value.text
            assert cntl.retried_count == 0
    assert served(cluster) == [0, 0, 0]
    with pytest.raises(TypeError, match="request_code"):
        aiobrpc.Controller(request_code="7")
    with pytest.raises(ValueError, match="request_code"):
        aiobrpc.Controller().request_code = -1


@pytest.mark.parametrize("lb", ["la", "p2c"])
async def test_a_slow_server_gets_fewer_calls(cluster, lb):
    """What the balancer learnt, not the share of calls (a busy machine bends shares): the slow
    server (an unmistakable 150 ms more per call) ends with the lower weight (la) or the higher
    latency estimate (p2c) than each fast one."""
    cluster[0][1].delay_s = 0.15
    async with channel_of(cluster, lb) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        for _ in range(40):
            await stub.Echo(Req(message="s"))
        nodes = [ServerNode("127.0.0.1", server.port) for server, _ in cluster]
        assert all(served(cluster)), served(cluster)  # each was tried, so each has feedback
        slow, *fast = nodes
        if lb == "la":
            weights = [channel.lb.weight_of(node) for node in nodes]
            assert weights[0] < min(weights[1:]), (weights, served(cluster))
        else:
            ewmas = [channel.lb.stat_of(node).ewma_us for node in nodes]
            assert ewmas[0] > max(ewmas[1:]), (ewmas, served(cluster))


@pytest.mark.parametrize("name,wants", [("rr", False), ("random", False), ("wrr", False),
                                        ("wr:default_weight=1", False), ("c_ketama", False),
                                        ("la", True), ("p2c", True)])
async def test_only_balancers_that_learn_get_feedback(cluster, name, wants):
    channel = channel_of(cluster, name)
    assert (channel._lb_feedback is not None) == wants == channel.lb.wants_feedback
    await channel.close()


class CountingLB(RoundRobinLoadBalancer):
    """rr that counts its selections and the feedback of each, per server."""

    def __init__(self) -> None:
        super().__init__()
        self.inflight: collections.Counter = collections.Counter()
        self.selects = 0
        self.codes: list[int] = []

    def select(self, **kwargs):
        server = super().select(**kwargs)
        self.selects += 1
        self.inflight[server] += 1
        return server

    def attempt_ended(self, server, error_code, latency_us, timeout_ms, retried_count, max_retry):
        assert self.inflight[server] > 0, f"feedback without a selection for {server}"
        assert latency_us >= 0
        self.inflight[server] -= 1
        self.codes.append(error_code)

    def balanced(self) -> bool:
        return len(self.codes) == self.selects and not +self.inflight


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_every_selection_gets_exactly_one_feedback(cluster):
    lb = CountingLB()
    register_load_balancer("counting_for_tests", lambda params: lb)
    refused = f"127.0.0.1:{closed_port()}"  # nothing listens: connects are refused
    channel = channel_of(cluster, "counting_for_tests", extra=(refused,), max_retry=3,
                         health_check_interval_s=5)
    stub = aiobrpc.Stub(channel, SERVICE)
    loop = asyncio.get_running_loop()

    async def outcome(request, cntl=None):
        try:
            await stub.Echo(request, cntl)
            return 0
        except aiobrpc.RpcError as e:
            return e.code

    # Successes, and the connect that is refused (retried elsewhere).
    assert [await outcome(Req(message="ok")) for _ in range(8)] == [0] * 8
    assert errors.ECONNREFUSED in lb.codes and lb.balanced()
    # Failures retried on every server.
    assert await outcome(Req(message="f", fail_code=errors.ELIMIT)) == errors.ELIMIT
    assert lb.balanced()
    # Backup requests: the loser is abandoned (EBACKUPREQUEST for a losing original,
    # ECANCELED for a losing backup).
    for _, servicer in cluster:
        servicer.delay_s = 0.02
    cntls = [aiobrpc.Controller(backup_request_ms=5) for _ in range(6)]
    assert await asyncio.gather(*[outcome(Req(message="b"), c) for c in cntls]) == [0] * 6
    assert all(c.has_backup_request for c in cntls)
    assert {errors.EBACKUPREQUEST, errors.ECANCELED} & set(lb.codes) and lb.balanced()
    # The deadline ends both attempts of a call.
    for _, servicer in cluster:
        servicer.delay_s = 0.2
    cntl = aiobrpc.Controller(timeout_ms=30, backup_request_ms=5)
    assert await outcome(Req(message="d"), cntl) == errors.ERPCTIMEDOUT
    assert lb.codes[-2:] == [errors.ERPCTIMEDOUT] * 2 and lb.balanced()
    # The caller cancels.
    task = loop.create_task(outcome(Req(message="c")))
    await asyncio.sleep(0.02)
    await wait_until(lambda: +lb.inflight)
    assert +lb.inflight
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert lb.codes[-1] == errors.ECANCELED and lb.balanced()
    # The channel closes under calls in flight.
    tasks = [loop.create_task(outcome(Req(message="z"))) for _ in range(3)]
    await asyncio.sleep(0.02)
    await channel.close()
    assert await asyncio.gather(*tasks) == [errors.EFAILEDSOCKET] * 3
    assert lb.codes[-3:] == [errors.EFAILEDSOCKET] * 3 and lb.balanced()


async def test_la_and_p2c_in_flight_counts_return_to_zero(cluster):
    for _, servicer in cluster:
        servicer.delay_s = 0.01
    for name in ("la", "p2c"):
        async with channel_of(cluster, name, max_retry=2) as channel:
            stub = aiobrpc.Stub(channel, SERVICE)
            cntls = [aiobrpc.Controller(backup_request_ms=2, timeout_ms=(5 if i % 3 == 0 else 500))
                     for i in range(30)]
            await asyncio.gather(*[stub.Echo(Req(message="i"), c) for c in cntls], return_exceptions=True)
            lb = channel.lb
            if name == "la":
                assert [w.begin_time_count for w in lb._weights] == [0, 0, 0]
            else:
                assert [lb.stat_of(s).inflight for s in lb.servers] == [0, 0, 0]


async def test_cluster_recovery_rejects_with_ereject_and_no_retry(cluster):
    async with channel_of(cluster, "rr:min_working_instances=1000 hold_seconds=60", max_retry=3) as channel:
        stub = aiobrpc.Stub(channel, SERVICE)
        channel.lb._recovery.start()  # as after a selection that found no server up
        codes = collections.Counter()
        for _ in range(20):
            cntl = aiobrpc.Controller()
            try:
                await stub.Echo(Req(message="r"), cntl)
                codes[0] += 1
            except aiobrpc.RpcError as e:
                codes[e.code] += 1
                assert e.code == errors.EREJECT and cntl.retried_count == 0
                assert "3 of min_working_instances=1000" in e.text
        assert codes[errors.EREJECT] >= 17, codes  # passes with probability 3/1000 each
        assert sum(served(cluster)) == codes[0]


def test_lb_names_of_the_registry():
    for name in ("rr", "random", "wrr", "wr", "la", "p2c", "c_murmurhash", "c_md5", "c_ketama"):
        assert create_load_balancer(name).name == name
    with pytest.raises(ValueError, match="unknown load balancer 'nope'; known: .*c_ketama.*wrr"):
        create_load_balancer("nope")
