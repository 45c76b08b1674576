"""http://, https://, dns:// (every address of a name) and dlist:// (list:// re-resolved), resolved
again every refresh; a failed resolution keeps the last list (docs/naming.md).

Real resolution is checked on "localhost"; the tests of several addresses, of a changed answer
and of a failed one put a scripted answer in place of the resolver (`resolve.addresses`) and
run real servers on 127.0.0.2 and 127.0.0.3 (all of 127/8 is the loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.client.naming import ServerNode, create_naming_service, periodic, resolve
from aiobrpc.client.naming.dlist import DomainListNamingService
from aiobrpc.client.naming.dns import DnsNamingService
from tests.helpers.etcd import ListFeed
from tests.helpers.interop_server import SERVICE, InteropEcho

Req = interop_pb2.EchoRequest
REFRESH_S = 0.05


def naming_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "aiobrpc.client.naming" and r.levelno == logging.WARNING]


@pytest.fixture
def answers(monkeypatch):
    """host -> the addresses the resolver gives it, or an exception it raises; other names go
    to the real resolver. Refreshes every REFRESH_S."""
    table: dict = {}
    real = resolve.addresses

    async def scripted(host: str, port: int) -> list[str]:
        if host not in table:
            return await real(host, port)
        answer = table[host]
        if isinstance(answer, BaseException):
            raise answer
        return list(answer)

    monkeypatch.setattr(resolve, "addresses", scripted)
    monkeypatch.setattr(periodic, "REFRESH_S", REFRESH_S)
    return table


@contextlib.asynccontextmanager
async def servers_on(*hosts: str):
    """One InteropEcho server on each of `hosts`, all on the same port; yields the port."""
    for _ in range(20):
        started: list[aiobrpc.Server] = []
        try:
            port = 0
            for host in hosts:
                server = aiobrpc.Server()
                server.add_service(InteropEcho())
                started.append(server)
                await server.start(f"{host}:{port}")
                port = server.port
            break
        except OSError:  # that port was taken on a later host: another port
            for server in started:
                await server.stop()
                await server.join(timeout=1)
    else:
        raise RuntimeError(f"no port free on all of {hosts}")
    try:
        yield port
    finally:
        for server in started:
            await server.stop()
            await server.join(timeout=2)


async def sides(stub, n: int) -> set[str]:
    seen = set()
    for i in range(n):
        cntl = aiobrpc.Controller()
        await stub.Echo(Req(message=str(i)), cntl)
        seen.add(cntl.remote_side)
    return seen


async def eventually(predicate, timeout: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "not within the time"
        await asyncio.sleep(0.01)


def test_urls_give_host_and_port():
    assert create_naming_service("http://localhost").host_port == ("localhost", 80)
    assert create_naming_service("https://localhost/some/path?q=1").host_port == ("localhost", 443)
    assert create_naming_service("http://[::1]:8080").host_port == ("::1", 8080)
    assert create_naming_service("dns://svc.local:9000").host_port == ("svc.local", 9000)
    with pytest.raises(ValueError, match="no port"):
        create_naming_service("dns://svc.local")
    with pytest.raises(ValueError):
        create_naming_service("http://localhost:99999")
    with pytest.raises(ValueError, match="no host"):
        create_naming_service("http://:80")
    with pytest.raises(ValueError, match="refresh_s"):
        DnsNamingService("a:1", refresh_s=0)
    with pytest.raises(ValueError):
        create_naming_service("dlist://a:1,not-an-entry")


async def test_localhost_resolves_to_every_address_the_system_gives():
    expected = list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(
        "localhost", 8000, type=socket.SOCK_STREAM)))
    assert await resolve.addresses("localhost", 8000) == expected
    assert await resolve.addresses("::1", 1) == ["::1"]  # an address is itself, unresolved
    async with ListFeed(create_naming_service("http://localhost:8000/index.html")) as lists:
        assert await lists.next() == [ServerNode(ip, 8000) for ip in expected]
    with pytest.raises(OSError):
        await resolve.addresses("no-such-host.invalid", 80)


async def test_every_address_is_used_and_followed(answers, caplog):
    answers["svc.test"] = ["127.0.0.2", "127.0.0.3"]
    async with servers_on("127.0.0.2", "127.0.0.3") as port:
        async with aiobrpc.Channel(f"dns://svc.test:{port}", aiobrpc.ChannelOptions(timeout_ms=2000),
                                   load_balancer="rr") as channel:
            stub = aiobrpc.Stub(channel, SERVICE)
            assert await sides(stub, 6) == {f"127.0.0.2:{port}", f"127.0.0.3:{port}"}

            answers["svc.test"] = ["127.0.0.3"]  # an address gone from the answer
            await eventually(lambda: list(channel.server_states()) == [f"127.0.0.3:{port}"])
            assert await sides(stub, 4) == {f"127.0.0.3:{port}"}

            # The resolver fails: the last list stays, calls go on, the fault is logged once.
            answers["svc.test"] = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            await asyncio.sleep(10 * REFRESH_S)
            assert await sides(stub, 4) == {f"127.0.0.3:{port}"}
            faults = [w for w in naming_warnings(caplog) if "Temporary failure" in w]
            assert len(faults) == 1 and "keeping the last list (1 servers)" in faults[0]

            answers["svc.test"] = ["127.0.0.2"]  # it answers again
            await eventually(lambda: list(channel.server_states()) == [f"127.0.0.2:{port}"])
            assert await sides(stub, 2) == {f"127.0.0.2:{port}"}


async def test_a_name_that_never_resolved_fails_calls_at_once_naming_it(answers):
    answers["gone.test"] = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    channel = aiobrpc.Channel("http://gone.test", aiobrpc.ChannelOptions(timeout_ms=60_000),
                              load_balancer="rr")
    with pytest.raises(aiobrpc.RpcError) as ei:
        # At once: the naming fault releases the call, far before its 60 s deadline (10 s: a hang guard).
        await asyncio.wait_for(aiobrpc.Stub(channel, SERVICE).Echo(Req(message="x")), 10)
    assert ei.value.code == errors.ENODATA and "Name or service not known" in ei.value.text
    await channel.close()


async def test_dlist_resolves_each_entry_keeping_its_tag(answers, caplog):
    answers["a.test"] = ["127.0.0.2", "127.0.0.3"]
    answers["b.test"] = ["127.0.0.4"]
    service = DomainListNamingService("a.test:80 0/2, b.test:81, 10.0.0.1:82 x, a.test:80 0/2")
    async with ListFeed(service) as lists:
        assert await lists.next() == [ServerNode("127.0.0.2", 80, "0/2"), ServerNode("127.0.0.3", 80, "0/2"),
                                      ServerNode("127.0.0.4", 81), ServerNode("10.0.0.1", 82, "x")]
        answers["b.test"] = ["127.0.0.5"]
        assert await lists.next() == [ServerNode("127.0.0.2", 80, "0/2"), ServerNode("127.0.0.3", 80, "0/2"),
                                      ServerNode("127.0.0.5", 81), ServerNode("10.0.0.1", 82, "x")]
        # One name fails: its last addresses stay, the others are followed; logged once.
        answers["a.test"] = socket.gaierror(socket.EAI_AGAIN, "try again")
        answers["b.test"] = ["127.0.0.6"]
        assert await lists.next() == [ServerNode("127.0.0.2", 80, "0/2"), ServerNode("127.0.0.3", 80, "0/2"),
                                      ServerNode("127.0.0.6", 81), ServerNode("10.0.0.1", 82, "x")]
        await lists.none()
        faults = [w for w in naming_warnings(caplog) if "cannot resolve a.test" in w]
        assert len(faults) == 1


async def test_dlist_entry_that_never_resolved_is_left_out(answers, caplog):
    caplog.set_level(logging.INFO, logger="aiobrpc.client.naming")
    answers["late.test"] = socket.gaierror(socket.EAI_NONAME, "not yet")
    async with ListFeed(DomainListNamingService("late.test:80,127.0.0.1:81")) as lists:
        assert await lists.next() == [ServerNode("127.0.0.1", 81)]
        answers["late.test"] = ["127.0.0.7"]
        assert await lists.next() == [ServerNode("127.0.0.7", 80), ServerNode("127.0.0.1", 81)]
    messages = [r.getMessage() for r in caplog.records if r.name == "aiobrpc.client.naming"]
    assert any("cannot resolve late.test" in m for m in messages)
    assert any("works again" in m for m in messages)


async def test_dlist_refreshes_at_the_module_interval_unless_given_one(answers):
    answers["r.test"] = ["127.0.0.2"]
    service = DomainListNamingService("r.test:80", refresh_s=60)
    async with ListFeed(service) as lists:
        assert await lists.next() == [ServerNode("127.0.0.2", 80)]
        answers["r.test"] = ["127.0.0.3"]
        await lists.none(10 * REFRESH_S)  # its own 60 s, not the module's REFRESH_S
