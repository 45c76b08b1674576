"""Issue 29 R1: with ServerOptions(auth=...), every HTTP request is authenticated, as brpc's
VerifyHttpRequest: its `Authorization` header is the credential; none, or one the authenticator
refuses, answers 401 with brpc's text and closes, and no handler runs. Builtin pages are exempt
on the internal port only. Sync and async authenticators alike."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio

import aiobrpc
from tests.e2e.test_http import SVC, fetch, header
from tests.helpers.interop_server import InteropEcho
from tests.helpers.peers import raw_exchange

ECHO = f"/{SVC}/Echo"
BODY = json.dumps({"message": "hi"}).encode()
JSON = {"Content-Type": "application/json"}


class Auth:
    """Lets b"secret" in; counts what it was asked."""

    def __init__(self) -> None:
        self.asked: list[bytes] = []

    def verify_credential(self, credential, peer):
        self.asked.append(bytes(credential))
        return credential == b"secret"


class AsyncAuth(Auth):
    async def verify_credential(self, credential, peer):
        await asyncio.sleep(0.01)
        return super().verify_credential(credential, peer)


class Servicer(InteropEcho):
    def __init__(self) -> None:
        super().__init__()
        self.credentials: list = []

    async def Echo(self, request, cntl):
        self.credentials.append(cntl.authentication_data)
        return await super().Echo(request, cntl)


@pytest_asyncio.fixture(params=[Auth, AsyncAuth], ids=["sync_auth", "async_auth"])
async def served(request):
    auth = request.param()
    servicer = Servicer()
    srv = aiobrpc.Server(aiobrpc.ServerOptions(auth=auth, server_tag="127.0.0.1:9110"))
    srv.add_service(servicer)
    await srv.start("127.0.0.1:0")
    yield srv, auth, servicer
    await srv.stop()
    await srv.join(timeout=2)


async def test_a_method_called_over_http_without_a_credential_is_401_and_never_runs(served):
    srv, auth, servicer = served
    status, headers, body = await fetch(srv, "POST", ECHO, BODY, JSON)
    assert status == 401 and header(headers, "x-bd-error-code") == "1004"
    assert body == b"[127.0.0.1:9110][E1004]Fail to authenticate"
    assert header(headers, "Connection") == "close"
    assert servicer.calls_served == 0 and auth.asked == []  # refused from its head


async def test_a_refused_credential_is_401_and_closes(served):
    srv, auth, servicer = served
    head = (f"POST {ECHO} HTTP/1.1\r\nHost: x\r\nAuthorization: wrong\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY
    # a second request pipelined behind the refused one is never answered: the connection closes
    got, closed = await raw_exchange(srv.port, head + head.replace(b"wrong", b"secret"), want=1 << 20)
    assert got.startswith(b"HTTP/1.1 401 Unauthorized\r\n") and got.count(b"HTTP/1.1") == 1
    assert closed and servicer.calls_served == 0 and auth.asked == [b"wrong"]


async def test_the_right_credential_is_served_and_asked_once_per_connection(served):
    srv, auth, servicer = served
    one = (f"POST {ECHO} HTTP/1.1\r\nHost: x\r\nAuthorization: secret\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY
    got, _ = await raw_exchange(srv.port, one * 3, read_timeout=10, until=lambda got: got.count(b"HTTP/1.1 ") >= 3)
    assert got.count(b"HTTP/1.1 200 OK") == 3
    assert auth.asked == [b"secret"] and servicer.credentials == [b"secret"] * 3
    # the same connection, a request without the credential: refused (every request carries it)
    got, closed = await raw_exchange(srv.port, one + one.replace(b"Authorization: secret\r\n", b""), want=1 << 20)
    assert got.count(b"HTTP/1.1 200 OK") == 1 and got.count(b"HTTP/1.1 401") == 1 and closed


async def test_builtin_pages_need_the_credential_on_the_servers_port(served):
    srv, auth, _ = served
    for page in ("/vars", "/status", "/flags", "/", "/health"):
        status, _, _ = await fetch(srv, "GET", page)
        assert status == 401, page
    status, _, body = await fetch(srv, "GET", "/health", headers={"Authorization": "secret"})
    assert (status, body) == (200, b"OK")


async def test_builtin_pages_are_exempt_on_the_internal_port_only():
    auth = Auth()
    async with aiobrpc.Server(aiobrpc.ServerOptions(auth=auth, internal_port=0)) as srv:
        srv.add_service(Servicer())
        await srv.start("127.0.0.1:0")

        class Internal:
            port = srv.internal_port

        status, _, body = await fetch(Internal, "GET", "/health")
        assert (status, body) == (200, b"OK")
        assert (await fetch(Internal, "GET", "/vars"))[0] == 200
        # a page first does not let a method in after it on the same connection (brpc's backdoor)
        page = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        call = (f"POST {ECHO} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY
        got, closed = await raw_exchange(srv.internal_port, page + call, want=1 << 20)
        assert got.startswith(b"HTTP/1.1 200 OK") and b"HTTP/1.1 401" in got and closed
        assert (await fetch(srv, "GET", "/health"))[0] == 401  # the public port: 401 before 403
        assert auth.asked == []


async def test_a_target_that_is_no_page_is_never_exempt_on_the_internal_port():
    """The exemption and the route read a target the same way: what is exempt is a page."""
    auth = Auth()
    async with aiobrpc.Server(aiobrpc.ServerOptions(auth=auth, internal_port=0)) as srv:
        srv.add_service(Servicer())
        await srv.start("127.0.0.1:0")
        for target, status in [(b"//health", 200), (b"//h]alth", 401), (b"http://[::1/health", 401),
                               (b"//interop.EchoService/Echo", 401), (b"http://x/health", 200)]:
            got, _ = await raw_exchange(srv.internal_port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                                        want=1 << 16, shutdown=True)
            assert got.startswith(f"HTTP/1.1 {status} ".encode()), (target, got[:80])
        assert auth.asked == []


async def test_the_authenticators_unauthorized_text_is_sent():
    class Texted(Auth):
        def unauthorized_error_text(self):
            return "ask the operator for a token"

    async with aiobrpc.Server(aiobrpc.ServerOptions(auth=Texted())) as srv:
        srv.add_service(Servicer())
        await srv.start("127.0.0.1:0")
        status, _, body = await fetch(srv, "POST", ECHO, BODY, {**JSON, "Authorization": "nope"})
        assert status == 401 and body.endswith(b"[E1004]Fail to authenticate: ask the operator for a token")


@pytest.mark.parametrize("failure", ["raises", "cancelled"])
async def test_an_authenticator_that_fails_refuses(failure):
    class Failing:
        async def verify_credential(self, credential, peer):
            if failure == "raises":
                raise RuntimeError("directory down")
            raise asyncio.CancelledError()

    servicer = Servicer()
    async with aiobrpc.Server(aiobrpc.ServerOptions(auth=Failing())) as srv:
        srv.add_service(servicer)
        await srv.start("127.0.0.1:0")
        status, _, _ = await fetch(srv, "POST", ECHO, BODY, {**JSON, "Authorization": "secret"})
        assert status == 401 and servicer.calls_served == 0
        assert (await fetch(srv, "GET", "/health", headers={"Authorization": "x"}))[0] == 401
