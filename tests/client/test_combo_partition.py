"""PartitionChannel and DynamicPartitionChannel (brpc's docs/en/combo_channel.md): servers
partitioned by their "i/n" tags, each partition sent its own part of a request, the parts
merged; several partitionings at once, traffic split by capacity and moving as servers come
and go; the _dynpart balancer; the partition parser; bad arguments."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.client.combo import (CallMapper, DynamicPartitionChannel, DynPartLoadBalancer, Partition,
                                  PartitionChannel, PartitionChannelOptions, PartitionParser, ResponseMerger, SubCall,
                                  sub_controller, sub_count)
from aiobrpc.client.naming import NamingService, ServerNode, register_naming_service
from aiobrpc.errors import RpcError
from tests.client.test_combo_parallel import Shard, dead_port, echo
from tests.helpers.interop_server import running_echo

Req = interop_pb2.EchoRequest
KEYS = [f"k{i}" for i in range(12)]


class ByKey(CallMapper):
    """Partition i of n gets the keys (comma-separated in the message) of index % n == i; a
    partition with no key is skipped."""

    def map(self, channel_index, channel_count, method, request):
        keys = [k for k in request.message.split(",") if int(k[1:]) % channel_count == channel_index]
        if not keys:
            return SubCall.skip()
        return SubCall(Req(message=",".join(keys)))


class Gather(ResponseMerger):
    """Joins the partitions' keys back into one comma-separated list."""

    def merge(self, response, sub_response):
        response.message = ",".join(filter(None, [response.message, sub_response.message]))


def options(**kw) -> PartitionChannelOptions:
    return PartitionChannelOptions(call_mapper=ByKey(), response_merger=Gather(), **kw)


def keys_of(message: str) -> list[str]:
    return sorted(message.split(","), key=lambda k: int(k[1:]))


@pytest_asyncio.fixture
async def four():
    """Four echo servers on 127.0.0.1, as (server, Shard) pairs."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(running_echo(servicer=Shard())) for _ in range(4)]


def at(pair, tag: str) -> str:
    return f"127.0.0.1:{pair[0].port} {tag}"


# -- PartitionChannel ------------------------------------------------------------------------------
async def test_each_partition_gets_its_part_and_the_merger_joins_them(four, caplog):
    caplog.set_level(logging.WARNING)
    url = "list://" + ",".join([at(four[0], "0/2"), at(four[1], "1/2"), at(four[2], "bad"), at(four[3], "0/3")])
    async with PartitionChannel(2, url, "rr", options()) as pchan:
        assert pchan.partition_count == 2
        cntl = aiobrpc.Controller()
        resp = await echo(pchan, cntl, message=",".join(KEYS))
        assert keys_of(resp.message) == KEYS
        assert four[0][1].messages == ["k0,k2,k4,k6,k8,k10"] and four[1][1].messages == ["k1,k3,k5,k7,k9,k11"]
        assert not four[2][1].messages and not four[3][1].messages  # left out
        assert sub_count(cntl) == 2 and sub_controller(cntl, 1).remote_side == f"127.0.0.1:{four[1][0].port}"
    assert "tag 'bad' names no partition" in caplog.text
    assert "tag '0/3' is of 3 partitions, not 2" in caplog.text


async def test_a_partition_balances_over_its_servers(four):
    url = "list://" + ",".join([at(four[0], "0/2"), at(four[1], "1/2"), at(four[2], "1/2")])
    async with PartitionChannel(2, url, "rr", options()) as pchan:
        for _ in range(4):
            resp = await echo(pchan, message="k0,k1")
            assert keys_of(resp.message) == ["k0", "k1"]
    assert [len(s.messages) for _, s in four] == [4, 2, 2, 0]


async def test_a_partition_without_server_fails_its_part_under_fail_limit(four):
    url = "list://" + at(four[0], "0/2")
    async with PartitionChannel(2, url, options=options()) as pchan:
        cntl = aiobrpc.Controller()
        assert (await echo(pchan, cntl, message="k0,k1")).message == "k0"  # 1 failure < fail_limit 2
        missing = sub_controller(cntl, 1)
        assert missing.error_code == errors.ENODATA and "lists no server" in missing.error_text
    async with PartitionChannel(2, url, options=options(fail_limit=1)) as pchan:
        with pytest.raises(RpcError) as info:
            await echo(pchan, message="k0,k1")
        assert info.value.code == errors.ENODATA  # partition 0's sub-call, cancelled, does not count
        assert "channels failed, fail_limit=1" in info.value.text and " [C1][E61]Fail to select" in info.value.text


async def test_partition_deadline_and_retries_come_from_the_options(four):
    url = "list://" + ",".join([at(four[0], "0/2"), at(four[1], "1/2")])
    four[1][1].delay_ms = 400
    async with PartitionChannel(2, url, options=options(timeout_ms=100, fail_limit=1)) as pchan:
        with pytest.raises(RpcError) as info:
            await echo(pchan, message="k0,k1")
        assert info.value.code == errors.ERPCTIMEDOUT
    dead = f"127.0.0.1:{dead_port()} 1/2"
    async with PartitionChannel(2, "list://" + at(four[0], "0/2") + "," + dead, options=options(max_retry=1)) as pchan:
        cntl = aiobrpc.Controller()
        await echo(pchan, cntl, message="k0,k1")
        assert sub_controller(cntl, 1).retried_count == 1


class Script(NamingService):
    """A naming service whose lists the test pushes: `script://<name>`."""

    by_name: dict[str, Script] = {}

    def __init__(self, name: str) -> None:
        self.lists: asyncio.Queue | None = None
        self.pending: list[list[ServerNode]] = []
        Script.by_name[name] = self

    def push(self, entries: list[str]) -> None:
        servers = []
        for entry in entries:
            addr, tag = entry.split(" ", 1)
            servers.append(ServerNode("127.0.0.1", int(addr.rpartition(":")[2]), tag))
        if self.lists is None:
            self.pending.append(servers)
        else:
            self.lists.put_nowait(servers)

    async def watch(self):
        self.lists = asyncio.Queue()
        for servers in self.pending:
            self.lists.put_nowait(servers)
        while True:
            yield await self.lists.get()


register_naming_service("script", lambda rest: Script.by_name[rest])


async def settle(channel, servers_seen) -> None:
    """Wait until `channel` has taken the last list (naming services are followed by tasks)."""
    for _ in range(50):
        await asyncio.sleep(0.01)
        if servers_seen():
            return
    raise AssertionError("the list never arrived")


async def test_partition_channel_follows_a_changing_naming_service(four):
    ns = Script("pchan")
    ns.push([at(four[0], "0/2"), at(four[1], "1/2")])
    async with PartitionChannel(2, "script://pchan", options=options()) as pchan:
        assert keys_of((await echo(pchan, message="k0,k1")).message) == ["k0", "k1"]
        ns.push([at(four[2], "0/2"), at(four[1], "1/2")])
        moved = f"127.0.0.1:{four[2][0].port}(tag=0/2)"
        await settle(pchan, lambda: list(pchan.partitions.channels[0].server_states()) == [moved])
        assert keys_of((await echo(pchan, message="k0,k1")).message) == ["k0", "k1"]
    assert [len(s.messages) for _, s in four] == [1, 2, 1, 0]


async def test_a_naming_service_that_fails_before_any_list_fails_calls_with_enodata():
    class Broken(NamingService):
        async def watch(self):
            raise OSError("unreachable")
            yield []

    register_naming_service("brokentest", lambda rest: Broken())
    async with PartitionChannel(2, "brokentest://x", options=options()) as pchan:
        with pytest.raises(RpcError) as info:
            await echo(pchan, message="k0")
    assert info.value.code == errors.ENODATA and "unreachable" in info.value.text


# -- DynamicPartitionChannel -----------------------------------------------------------------------
async def test_two_partitionings_share_the_traffic_and_every_call_is_whole(four):
    # brpc's docs: the same server may serve every partition of a partitioning.
    url = "list://" + ",".join([at(four[0], "0/2"), at(four[0], "1/2"),
                                at(four[1], "0/3"), at(four[1], "1/3"), at(four[1], "2/3")])
    async with DynamicPartitionChannel(url, "rr", options()) as dchan:
        assert dchan.capacities() == {2: 1, 3: 1}
        widths = Counter()
        for _ in range(30):
            cntl = aiobrpc.Controller()
            resp = await echo(dchan, cntl, message=",".join(KEYS))
            assert keys_of(resp.message) == KEYS
            widths[sub_count(sub_controller(cntl, 0))] += 1
    assert widths[2] > 0 and widths[3] > 0 and widths[2] + widths[3] == 30
    assert len(four[0][1].messages) == 2 * widths[2] and len(four[1][1].messages) == 3 * widths[3]


async def test_traffic_moves_between_partitionings_as_servers_come_and_go(four):
    three = [at(four[0], "0/3"), at(four[0], "1/3"), at(four[0], "2/3")]
    two = [at(four[1], "0/2"), at(four[2], "1/2")]
    ns = Script("migration")
    ns.push(three)
    async with DynamicPartitionChannel("script://migration", options=options()) as dchan:
        for _ in range(5):
            await echo(dchan, message="k0,k1,k2")
        assert dchan.capacities() == {3: 1} and len(four[0][1].messages) == 15
        ns.push(three[:2] + two)  # the 3-partitioning lost partition 2: capacity 0
        await settle(dchan, lambda: dchan.capacities() == {2: 1, 3: 0})
        for _ in range(5):
            assert keys_of((await echo(dchan, message="k0,k1,k2")).message) == ["k0", "k1", "k2"]
        assert len(four[0][1].messages) == 15 and len(four[1][1].messages) == 5
        ns.push(two)  # the 3-partitioning is gone
        await settle(dchan, lambda: dchan.capacities() == {2: 1})
        ns.push(three + two + [at(four[3], "0/2"), at(four[3], "1/2")])  # capacities 1 and 2
        await settle(dchan, lambda: dchan.capacities() == {2: 2, 3: 1})
        for _ in range(30):
            await echo(dchan, message="k0,k1,k2")
    assert len(four[0][1].messages) > 15  # the 3-partitioning is back


async def test_a_partitioning_that_fails_is_retried_on_another(four):
    dead = dead_port()
    url = "list://" + ",".join([f"127.0.0.1:{dead} 0/2", f"127.0.0.1:{dead} 1/2",
                                at(four[0], "0/3"), at(four[0], "1/3"), at(four[0], "2/3")])
    async with DynamicPartitionChannel(url, options=options(fail_limit=1, max_retry=1)) as dchan:
        for _ in range(6):
            resp = await echo(dchan, message="k0,k1,k2")
            assert keys_of(resp.message) == ["k0", "k1", "k2"]
    assert len(four[0][1].messages) == 18


async def test_no_partitioning_means_enodata():
    async with DynamicPartitionChannel("list://", options=options(max_retry=0)) as dchan:
        with pytest.raises(RpcError) as info:
            await echo(dchan)
    assert info.value.code == errors.ENODATA


def test_dynpart_picks_in_proportion_to_capacity_and_skips_excluded():
    a, b, c = (ServerNode(h, 1) for h in "abc")
    weights = {a: 1, b: 2, c: 0}
    lb = DynPartLoadBalancer(weights.get, rng=random.Random(3))
    lb.set_servers([a, b, c])
    picks = Counter(lb.select().host for _ in range(3000))
    assert picks["c"] == 0 and 0.6 < picks["b"] / 3000 < 0.73
    assert {lb.select(excluded=[b]).host for _ in range(50)} == {"a"}
    assert {lb.select(available=lambda s: s is c).host for _ in range(5)} == {"c"}  # the only one, weight 0
    assert lb.select(excluded=[a, b, c], available=lambda s: s is b) is b  # all excluded: take one anyway
    weights.update({a: 0, b: 0})
    assert {lb.select().host for _ in range(200)} == {"a", "b", "c"}  # no capacity anywhere: uniform
    with pytest.raises(RpcError) as info:
        lb.select(available=lambda s: False)
    assert info.value.code == errors.EHOSTDOWN
    lb.set_servers([])
    with pytest.raises(RpcError) as info:
        lb.select()
    assert info.value.code == errors.ENODATA


# -- parser and arguments --------------------------------------------------------------------------
def test_the_default_parser_reads_n_slash_m():
    parse = PartitionParser().parse
    assert parse("0/3") == Partition(0, 3) and parse(" 2 / 4 ") == Partition(2, 4)
    for tag in ("", "3", "a/3", "1/b", "-1/3", "1/3/5", "1.0/3"):
        assert parse(tag) is None, tag


async def test_a_custom_parser_and_servers_it_cannot_place(four, caplog):
    class Shards(PartitionParser):
        def parse(self, tag):
            if tag == "raise":
                raise ValueError("no")
            if tag == "odd":
                return (0, 2)
            name, _, count = tag.partition("-of-")
            return Partition(int(name[5:]), int(count))

    caplog.set_level(logging.WARNING)
    url = "list://" + ",".join([at(four[0], "shard0-of-2"), at(four[1], "shard1-of-2"), at(four[2], "raise"),
                                at(four[2], "odd"), at(four[2], "shard5-of-2"), at(four[2], "shard0-of-0")])
    async with PartitionChannel(2, url, options=options(), partition_parser=Shards()) as pchan:
        assert keys_of((await echo(pchan, message="k0,k1")).message) == ["k0", "k1"]
    assert not four[2][1].messages
    for why in ("raised ValueError('no')", "returned (0, 2), not a Partition", "names partition 5 of 2",
                "names 0 partitions"):
        assert why in caplog.text, why


def test_bad_arguments_raise_saying_what_is_wrong():
    url = "list://127.0.0.1:1 0/1"
    for n in (0, -1, 1025, 1.5, True):
        with pytest.raises(ValueError, match="num_partition_kinds"):
            PartitionChannel(n, url)
    with pytest.raises(ValueError, match="naming service URL"):
        PartitionChannel(1, "127.0.0.1:1")
    with pytest.raises(ValueError, match="unknown naming service"):
        DynamicPartitionChannel("nope://x")
    with pytest.raises(ValueError, match="unknown load balancer"):
        PartitionChannel(1, url, "nope")
    with pytest.raises(TypeError, match="PartitionChannelOptions"):
        DynamicPartitionChannel(url, "rr", aiobrpc.ChannelOptions())
    with pytest.raises(TypeError, match="partition_parser"):
        PartitionChannel(1, url, partition_parser=lambda tag: None)
    with pytest.raises(ValueError, match="fail_limit"):
        PartitionChannelOptions(fail_limit=0)
    with pytest.raises(TypeError, match="call_mapper"):
        PartitionChannelOptions(call_mapper=object())
    with pytest.raises(ValueError, match="timeout_ms"):
        PartitionChannelOptions(timeout_ms=-5)  # ChannelOptions' own checks still apply
