"""etcd://: servers registered under a key prefix of a real etcd, followed with a watch; faults
keep the last list and reconnect (docs/naming.md). The etcd fixture: tests/helpers/etcd.py."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.client.naming import ServerNode, base, create_naming_service
from aiobrpc.client.naming.etcd_target import EtcdTarget
from tests.helpers.etcd import ListFeed, etcd, etcd_server  # noqa: F401  (fixtures)
from tests.helpers.interop_server import SERVICE, running_echo
from tests.helpers.waiting import wait_until

Req = interop_pb2.EchoRequest


def naming_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "aiobrpc.client.naming" and r.levelno == logging.WARNING]


async def eventually(predicate, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "not within the time"
        await asyncio.sleep(0.01)


class Caller:
    """Calls `stub.Echo` back to back in a task, counting where each went and what failed."""

    def __init__(self, stub) -> None:
        self.stub = stub
        self.sides: list[str] = []
        self.failures: list[aiobrpc.RpcError] = []
        self._begun = 0
        self._done: list[tuple[int, str]] = []  # (which call, where it went)
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            cntl = aiobrpc.Controller()
            n = self._begun
            self._begun += 1
            try:
                await self.stub.Echo(Req(message="m"), cntl)
                self.sides.append(cntl.remote_side)
                self._done.append((n, cntl.remote_side))
            except aiobrpc.RpcError as e:
                self.failures.append(e)
            await asyncio.sleep(0.005)

    def mark(self) -> int:
        """The calls begun so far. A call in flight at the mark was sent by the list before it:
        `since` and `count_since` leave it out."""
        return self._begun

    def since(self, mark: int) -> set[str]:
        return {side for n, side in self._done if n >= mark}

    def count_since(self, mark: int) -> int:
        return sum(1 for n, _ in self._done if n >= mark)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def test_urls():
    t = EtcdTarget.parse("10.0.0.1,[::1]:2380/services/echo/")
    assert t.endpoints == (("10.0.0.1", 2379), ("::1", 2380)) and t.prefix == "/services/echo/"
    for bad in ("10.0.0.1:2379", "10.0.0.1:2379/", "/services", "10.0.0.1:0/x", "::1/x"):
        with pytest.raises(ValueError):
            create_naming_service(f"etcd://{bad}")


async def test_follows_puts_and_deletes_and_skips_malformed_values(etcd, caplog):
    async with etcd.client() as client, ListFeed(create_naming_service(etcd.url())) as lists:
        p = etcd.prefix
        await client.put(f"{p}b".encode(), b"10.0.0.2:80 0/2")
        await client.put(f"{p}a".encode(), json.dumps({"address": "10.0.0.1:80", "weight": 3}).encode())
        await client.put(f"{p}c".encode(), b"this is not a server")
        await client.put(f"{p[:-1]}-other/x".encode(), b"10.0.0.9:80")  # beside the prefix: not in it
        assert await lists.next() == [ServerNode("10.0.0.1", 80, "3"), ServerNode("10.0.0.2", 80, "0/2")]
        [skipped] = naming_warnings(caplog)
        assert f"skipping key {p}c" in skipped
        caplog.clear()

        await client.put(f"{p}d".encode(), b'{"address": "[::1]:81", "tag": "canary"}')  # added
        assert await lists.next() == [ServerNode("10.0.0.1", 80, "3"), ServerNode("10.0.0.2", 80, "0/2"),
                                      ServerNode("::1", 81, "canary")]
        await client.delete(f"{p}a".encode())  # removed
        assert await lists.next() == [ServerNode("10.0.0.2", 80, "0/2"), ServerNode("::1", 81, "canary")]
        await client.put(f"{p}b".encode(), b"10.0.0.2:80 1/2")  # changed
        assert await lists.next() == [ServerNode("10.0.0.2", 80, "1/2"), ServerNode("::1", 81, "canary")]
        await client.put(f"{p}e".encode(), b"10.0.0.2:80 1/2")  # a second key for the same server
        await client.put(f"{p}x".encode(), b'{"address": "10.0.0.3:80", "tag": "a", "weight": 2}')
        await lists.none()
        [skipped] = naming_warnings(caplog)
        assert f"skipping key {p}x" in skipped and "not both" in skipped
        await client.put(f"{p}d".encode(), b"\xff\xfe")  # a member turned malformed: gone
        assert await lists.next() == [ServerNode("10.0.0.2", 80, "1/2")]
        await client.delete(f"{p}b".encode())
        await lists.none()  # {p}e still names it
        await client.delete_prefix(p.encode())
        assert await lists.next() == []


async def test_calls_move_as_members_are_registered_and_removed(etcd):
    async with running_echo() as (a, _), running_echo() as (b, _), etcd.client() as client:
        key_a, key_b = f"{etcd.prefix}a".encode(), f"{etcd.prefix}b".encode()
        await client.put(key_a, f"127.0.0.1:{a.port}".encode())
        async with aiobrpc.Channel(etcd.url(), aiobrpc.ChannelOptions(timeout_ms=2000),
                                   load_balancer="rr") as channel:
            caller = Caller(aiobrpc.Stub(channel, SERVICE))
            await eventually(lambda: len(caller.sides) >= 5)
            assert set(caller.sides) == {f"127.0.0.1:{a.port}"}

            await client.put(key_b, f"127.0.0.1:{b.port}".encode())  # b joins
            mark = caller.mark()
            await eventually(lambda: f"127.0.0.1:{b.port}" in caller.since(mark))
            assert len(channel.server_states()) == 2

            await client.delete(key_a)  # a leaves
            await eventually(lambda: list(channel.server_states()) == [f"127.0.0.1:{b.port}"])
            mark = caller.mark()
            await eventually(lambda: caller.count_since(mark) >= 10)
            assert caller.since(mark) == {f"127.0.0.1:{b.port}"}
            await caller.stop()
            assert caller.failures == []


async def test_etcd_killed_keeps_the_list_and_the_channel_recovers_when_it_returns(etcd, caplog):
    async with running_echo() as (a, _), running_echo() as (b, _):
        key_a, key_b = f"{etcd.prefix}a".encode(), f"{etcd.prefix}b".encode()
        async with etcd.client() as client:
            await client.put(key_a, f"127.0.0.1:{a.port}".encode())
        async with aiobrpc.Channel(etcd.url(), aiobrpc.ChannelOptions(timeout_ms=2000),
                                   load_balancer="rr") as channel:
            caller = Caller(aiobrpc.Stub(channel, SERVICE))
            await eventually(lambda: len(caller.sides) >= 5)

            etcd.server.kill()
            await eventually(lambda: any("connecting again" in w for w in naming_warnings(caplog)))
            mark = caller.mark()
            await asyncio.sleep(0.5)  # calls flow on the last list meanwhile
            await wait_until(lambda: caller.count_since(mark) > 10 and caller.since(mark) == {f"127.0.0.1:{a.port}"})
            assert caller.count_since(mark) > 10 and caller.since(mark) == {f"127.0.0.1:{a.port}"}
            assert caller.failures == []
            # Logged once per fault (the watch broken, then connections refused), not per retry.
            logged = len([w for w in naming_warnings(caplog) if "connecting again" in w])
            await asyncio.sleep(0.5)
            assert logged == len([w for w in naming_warnings(caplog) if "connecting again" in w]) <= 2

            etcd.server.start()  # same port, same data
            async with etcd.client() as client:
                await client.put(key_b, f"127.0.0.1:{b.port}".encode())
                await client.delete(key_a)
            await eventually(lambda: list(channel.server_states()) == [f"127.0.0.1:{b.port}"], timeout=8)
            mark = caller.mark()
            await eventually(lambda: caller.count_since(mark) >= 5)
            assert caller.since(mark) == {f"127.0.0.1:{b.port}"}
            await caller.stop()
            assert caller.failures == []


async def test_etcd_unreachable_before_a_first_list_fails_calls_at_once(etcd):
    # A port where nothing listens: the test etcd's peer port is taken by etcd, so use a closed one.
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    channel = aiobrpc.Channel(f"etcd://127.0.0.1:{dead}/x", aiobrpc.ChannelOptions(timeout_ms=60_000),
                              load_balancer="rr")
    with pytest.raises(aiobrpc.RpcError) as ei:
        # At once: the naming fault releases the call, far before its 60 s deadline (10 s: a hang guard).
        await asyncio.wait_for(aiobrpc.Stub(channel, SERVICE).Echo(Req(message="x")), 10)
    assert ei.value.code == errors.ENODATA and "no etcd endpoint answered" in ei.value.text
    assert f"127.0.0.1:{dead}" in ei.value.text
    await channel.close()


async def test_the_next_endpoint_is_tried(etcd):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    async with etcd.client() as client:
        await client.put(f"{etcd.prefix}a".encode(), b"10.0.0.1:80")
    url = f"etcd://127.0.0.1:{dead},{etcd.server.endpoint}{etcd.prefix}"
    async with ListFeed(create_naming_service(url)) as lists:
        assert await lists.next() == [ServerNode("10.0.0.1", 80)]


async def test_a_compacted_watch_reads_the_prefix_again(etcd, monkeypatch, caplog):
    """Keys change and the history is compacted between the read and the watch: the watch
    from the read's revision fails as compacted, and a fresh read finds the change."""
    import aetcd

    caplog.set_level(logging.INFO, logger="aiobrpc.client.naming")
    real = aetcd.Client.get_prefix
    reads = []

    async def read_then_compact(self, prefix, *args, **kwargs):
        result = await real(self, prefix, *args, **kwargs)
        reads.append(result.header.revision)
        if len(reads) == 1:
            async with etcd.client() as other:
                await other.put(prefix + b"late", b"10.0.0.2:80")
                put = await other.put(prefix + b"late", b"10.0.0.2:80")
                await other.compact(put.header.revision)  # the first put's revision is gone
        return result

    monkeypatch.setattr(aetcd.Client, "get_prefix", read_then_compact)
    async with etcd.client() as client:
        await client.put(f"{etcd.prefix}a".encode(), b"10.0.0.1:80")
    async with ListFeed(create_naming_service(etcd.url())) as lists:
        assert await lists.next() == [ServerNode("10.0.0.1", 80)]
        assert await lists.next() == [ServerNode("10.0.0.1", 80), ServerNode("10.0.0.2", 80)]
    assert len(reads) == 2
    assert any("compacted" in r.getMessage() and "reading the prefix again" in r.getMessage()
               for r in caplog.records)


async def test_members_are_capped_and_a_deletion_reads_again(etcd, monkeypatch, caplog):
    monkeypatch.setattr(base, "MAX_SERVERS", 2)
    p = etcd.prefix
    async with etcd.client() as client:
        for i in (1, 2, 3):
            await client.put(f"{p}{i}".encode(), f"10.0.0.{i}:80".encode())
        async with ListFeed(create_naming_service(etcd.url())) as lists:
            assert await lists.next() == [ServerNode("10.0.0.1", 80), ServerNode("10.0.0.2", 80)]
            assert any("the cap" in w for w in naming_warnings(caplog))
            await client.put(f"{p}4".encode(), b"10.0.0.4:80")
            await lists.none()
            await client.delete(f"{p}1".encode())  # room again: read afresh
            assert await lists.next() == [ServerNode("10.0.0.2", 80), ServerNode("10.0.0.3", 80)]

