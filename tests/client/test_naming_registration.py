"""EtcdRegistration: a server registered under an etcd prefix with a lease, refreshed while it
runs, removed on stop, and gone when its process dies (the lease expires)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import aiobrpc
from aiobrpc._proto import interop_pb2
from tests.helpers.etcd import etcd, etcd_server  # noqa: F401  (fixtures)
from tests.helpers.interop_server import SERVICE, running_echo

Req = interop_pb2.EchoRequest
ROOT = Path(__file__).resolve().parents[2]


async def eventually(predicate, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        assert loop.time() < deadline, "not within the time"
        await asyncio.sleep(0.02)


async def test_registered_with_a_refreshed_lease_and_removed_on_stop(etcd):
    async with running_echo() as (server, _), etcd.client() as client:
        registration = aiobrpc.EtcdRegistration(server, etcd.url(), tag="0/2", ttl=1)
        assert not registration.registered
        await registration.start()
        key = f"{etcd.prefix}127.0.0.1:{server.port}"
        assert registration.key == key and registration.registered
        got = await client.get(key.encode())
        assert json.loads(got.value) == {"address": f"127.0.0.1:{server.port}", "tag": "0/2"}
        assert got.lease == registration.lease_id
        await asyncio.sleep(1.6)  # past the 1 s TTL: the refresh keeps it
        assert (await client.get(key.encode())) is not None
        await registration.stop()
        assert not registration.registered
        assert await client.get(key.encode()) is None
        await registration.stop()  # a second stop does nothing


async def test_a_channel_finds_registered_servers_and_loses_stopped_ones(etcd):
    async with running_echo() as (a, _), running_echo() as (b, _):
        async with aiobrpc.EtcdRegistration(a, etcd.url(), weight=2), \
                aiobrpc.EtcdRegistration(f"127.0.0.1:{b.port}", etcd.url(), name="b") as reg_b:
            async with aiobrpc.Channel(etcd.url(), aiobrpc.ChannelOptions(timeout_ms=2000),
                                       load_balancer="rr") as channel:
                stub = aiobrpc.Stub(channel, SERVICE)
                await stub.Echo(Req(message="x"))
                assert set(channel.server_states()) == {f"127.0.0.1:{a.port}(tag=2)", f"127.0.0.1:{b.port}"}
                assert reg_b.key == f"{etcd.prefix}b"
                await reg_b.stop()

                async def only_a() -> bool:
                    return list(channel.server_states()) == [f"127.0.0.1:{a.port}(tag=2)"]
                await eventually(only_a)
                for _ in range(3):
                    cntl = aiobrpc.Controller()
                    await stub.Echo(Req(message="y"), cntl)
                    assert cntl.remote_side == f"127.0.0.1:{a.port}"


async def test_the_registration_outlives_an_etcd_restart(etcd):
    async with running_echo() as (server, _):
        async with aiobrpc.EtcdRegistration(server, etcd.url(), ttl=1) as registration:
            etcd.server.kill()
            await asyncio.sleep(1.0)  # refreshes fail meanwhile
            etcd.server.start()
            async with etcd.client() as client:
                async def back() -> bool:
                    got = await client.get(registration.key.encode())
                    return got is not None and registration.faults.current is None
                await eventually(back, timeout=8)
                await asyncio.sleep(1.2)  # and kept, past the TTL
                assert (await client.get(registration.key.encode())) is not None
        async with etcd.client() as client:
            assert await client.get(registration.key.encode()) is None


async def test_a_stop_without_etcd_leaves_the_key_to_its_lease(etcd, caplog):
    async with running_echo() as (server, _):
        registration = aiobrpc.EtcdRegistration(server, etcd.url(), ttl=1)
        await registration.start()
        etcd.server.kill()
        await registration.stop()  # cannot revoke: logged, not raised
        assert any("cannot revoke the lease" in r.getMessage() for r in caplog.records)
        etcd.server.start()
        async with etcd.client() as client:
            async def gone() -> bool:
                return await client.get(registration.key.encode()) is None
            await eventually(gone)


async def test_a_lease_gone_while_running_is_replaced(etcd):
    """The lease ends under a running registration (revoked here; expired, when etcd was out
    of reach for longer than the TTL): the next refresh finds it gone and registers again."""
    async with running_echo() as (server, _), etcd.client() as client:
        async with aiobrpc.EtcdRegistration(server, etcd.url(), ttl=1) as registration:
            first = registration.lease_id
            await client.revoke_lease(first)
            assert await client.get(registration.key.encode()) is None

            async def back() -> bool:
                got = await client.get(registration.key.encode())
                return got is not None and got.lease == registration.lease_id != first
            await eventually(back)


def test_a_lease_left_to_expire_removes_the_key(etcd, twin):
    """A registered process killed (no stop): its key goes when its 1 s lease expires."""
    script = textwrap.dedent(f"""
        import asyncio, sys
        import aiobrpc
        from tests.helpers.interop_server import InteropEcho

        async def main():
            server = aiobrpc.Server()
            server.add_service(InteropEcho())
            await server.start("127.0.0.1:0")
            registration = aiobrpc.EtcdRegistration(server, {etcd.url()!r}, ttl=1)
            await registration.start()
            print(registration.key, flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
    """)
    env = {**os.environ, "AIOBRPC_NO_EXTENSIONS": "1" if twin == "python" else "0"}
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        key = proc.stdout.readline().decode().strip()
        assert key.startswith(etcd.prefix), key
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()

    async def gone_within(timeout: float) -> float:
        async with etcd.client() as client:
            assert await client.get(key.encode()) is not None  # the lease outlives the process
            t0 = time.monotonic()
            while await client.get(key.encode()) is not None:
                assert time.monotonic() - t0 < timeout, "the key outlived its lease"
                await asyncio.sleep(0.05)
            return time.monotonic() - t0

    assert asyncio.run(gone_within(5)) > 0


async def test_arguments_are_checked(etcd):
    url = etcd.url()
    with pytest.raises(ValueError, match="not both"):
        aiobrpc.EtcdRegistration("127.0.0.1:1", url, tag="a", weight=2)
    with pytest.raises(ValueError, match="weight"):
        aiobrpc.EtcdRegistration("127.0.0.1:1", url, weight=0)
    with pytest.raises(ValueError, match="ttl"):
        aiobrpc.EtcdRegistration("127.0.0.1:1", url, ttl=0)
    with pytest.raises(ValueError, match="name"):
        aiobrpc.EtcdRegistration("127.0.0.1:1", url, name="a/b")
    with pytest.raises(ValueError, match="prefix"):
        aiobrpc.EtcdRegistration("127.0.0.1:1", f"etcd://{etcd.server.endpoint}")
    with pytest.raises(RuntimeError, match="start the server"):
        await aiobrpc.EtcdRegistration(aiobrpc.Server(), url).start()
    server = aiobrpc.Server()
    await server.start("0.0.0.0:0")
    try:
        with pytest.raises(ValueError, match="every interface"):
            await aiobrpc.EtcdRegistration(server, url).start()
        async with aiobrpc.EtcdRegistration(server, url, address=f"127.0.0.1:{server.port}") as reg:
            assert reg.key == f"{etcd.prefix}127.0.0.1:{server.port}"
    finally:
        await server.stop()
        await server.join(timeout=1)


async def test_start_fails_when_no_etcd_answers(etcd):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    registration = aiobrpc.EtcdRegistration("127.0.0.1:1", f"etcd://127.0.0.1:{dead}/x", ttl=1)
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{dead}"):
        await registration.start()
    assert not registration.registered
