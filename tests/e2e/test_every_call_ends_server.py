"""Issue 15, server side: every call ends with a reply, never silence.

Whatever a handler raises or leaves in its controller, the caller gets an error reply at once
(or, if even that cannot be built, the connection closes); `join(timeout)` frees connections
whose peer never reads; an awaitable a handler returns is awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import threading

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from tests.helpers.interop_server import SERVICE, InteropEcho, running_echo
from tests.helpers.wire import frame, rpc_meta

Req = interop_pb2.EchoRequest
Resp = interop_pb2.EchoResponse
MIB = 1 << 20
HANG_LIMIT_S = 5  # a call that would wait forever fails the test after this


@contextlib.asynccontextmanager
async def serving(servicer, client_auth=None, **options):
    """(server, stub) of `servicer`; the stub's calls have no deadline and are never retried."""
    server = aiobrpc.Server(aiobrpc.ServerOptions(server_tag="t", **options))
    server.add_service(servicer)
    await server.start("127.0.0.1:0")
    channel = aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(timeout_ms=-1, max_retry=0, auth=client_auth))
    try:
        yield server, aiobrpc.Stub(channel, SERVICE)
    finally:
        await channel.close()
        await server.stop()
        await asyncio.wait_for(server.join(timeout=2), HANG_LIMIT_S)


async def call_error(method, request, cntl=None) -> aiobrpc.RpcError:
    with pytest.raises(aiobrpc.RpcError) as ei:
        await asyncio.wait_for(method(request, cntl), HANG_LIMIT_S)
    return ei.value


def server_errors_logged(caplog) -> list:
    return [r for r in caplog.records if r.name.startswith("aiobrpc.server") and r.levelno >= logging.ERROR]


# --- 1. a reply whatever the handler did ------------------------------------------------------

def _raise_rpc_error_code_0(cntl):
    raise aiobrpc.RpcError(0, "zero is success")


def _raise_cancelled(cntl):
    raise asyncio.CancelledError()


def _str_attachment(cntl):
    cntl.response_attachment = "text is not bytes"
    return Resp(message="ok")


def _int_user_field(cntl):
    cntl.response_user_fields = {"k": 1}
    return Resp(message="ok")


def _lone_surrogate_in_error_text(cntl):
    raise aiobrpc.RpcError(errors.EREQUEST, "no such file " + "\udcff")  # as os.fsdecode makes


def _lone_surrogate_in_exception(cntl):
    raise FileNotFoundError("no such file " + "\udcff")


def _code_beyond_int32(cntl):
    raise aiobrpc.RpcError(1 << 31, "too big")


def _set_failed_beyond_int32(cntl):
    cntl.set_failed(1 << 31, "too big")


FAULTS = {  # name: (what the handler does, the code replied, a needle of the reply's text)
    "rpc_error_code_0": (_raise_rpc_error_code_0, errors.EINTERNAL, "RpcError(0, 'zero is success')"),
    "cancelled_error": (_raise_cancelled, errors.EINTERNAL, "CancelledError"),
    "str_attachment": (_str_attachment, errors.ERESPONSE, "got str"),
    "int_user_field": (_int_user_field, errors.ERESPONSE, "user_fields value must be str or bytes, got int"),
    "lone_surrogate_in_error_text": (_lone_surrogate_in_error_text, errors.EINTERNAL, "no such file \\udcff"),
    "lone_surrogate_in_exception": (_lone_surrogate_in_exception, errors.EINTERNAL, "no such file \\udcff"),
    "code_beyond_int32": (_code_beyond_int32, errors.EINTERNAL, "2147483648 does not fit in int32"),
    "set_failed_beyond_int32": (_set_failed_beyond_int32, errors.EINTERNAL, "2147483648 does not fit in int32"),
}


class Faulty(aiobrpc.Servicer):
    """Echo (async) and StartStream (a plain def, in the thread pool) do what the request's
    message names in FAULTS, or answer "ok"."""

    SERVICE = SERVICE

    async def Echo(self, request, cntl):
        return self.act(request, cntl)

    def StartStream(self, request, cntl):
        return self.act(request, cntl)

    @staticmethod
    def act(request, cntl):
        if request.message == "ok":
            return Resp(message="ok")
        return FAULTS[request.message][0](cntl)


@pytest.mark.parametrize("method", ["Echo", "StartStream"])
@pytest.mark.parametrize("fault", FAULTS)
async def test_a_reply_whatever_the_handler_did(fault, method, caplog):
    _, code, needle = FAULTS[fault]
    async with serving(Faulty()) as (server, stub):
        e = await call_error(getattr(stub, method), Req(message=fault))
        assert e.code == code and needle in e.text, e
        assert e.text.startswith("[t]")
        assert len(server_errors_logged(caplog)) == 1
        assert (await asyncio.wait_for(stub.Echo(Req(message="ok")), HANG_LIMIT_S)).message == "ok"
        assert server.stats.failed_requests == 1 and server.concurrency == 0


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text for you")


async def test_an_exception_whose_str_fails_is_still_answered():
    class Handler(aiobrpc.Servicer):
        SERVICE = SERVICE

        async def Echo(self, request, cntl):
            raise Unprintable()

    async with serving(Handler()) as (_, stub):
        e = await call_error(stub.Echo, Req(message="x"))
        assert e.code == errors.EINTERNAL and "Unprintable" in e.text


async def test_server_shutdown_still_cancels_handlers_without_a_reply():
    started, cancelled = asyncio.Event(), []

    class Endless(aiobrpc.Servicer):
        SERVICE = SERVICE

        async def Echo(self, request, cntl):
            started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(cntl.correlation_id)
                raise

    server = aiobrpc.Server()
    server.add_service(Endless())
    await server.start("127.0.0.1:0")
    channel = aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(timeout_ms=-1, max_retry=0))
    call = asyncio.ensure_future(aiobrpc.Stub(channel, SERVICE).Echo(Req(message="x")))
    await asyncio.wait_for(started.wait(), HANG_LIMIT_S)
    await server.stop()
    await asyncio.wait_for(server.join(timeout=0.1), HANG_LIMIT_S)
    assert len(cancelled) == 1 and not server.connections
    with pytest.raises(aiobrpc.RpcError) as ei:
        await asyncio.wait_for(call, HANG_LIMIT_S)
    assert ei.value.code != errors.EINTERNAL  # the connection closed; no "handler failed" reply
    await channel.close()


class CancellingAuth:
    def __init__(self, is_async: bool) -> None:
        self.is_async = is_async

    def verify_credential(self, credential, peer):
        if self.is_async:
            return self._verdict()
        raise asyncio.CancelledError()

    async def _verdict(self):
        raise asyncio.CancelledError()


class Cred:
    def generate_credential(self):
        return b"secret"


@pytest.mark.parametrize("is_async", [True, False])
async def test_an_authenticator_raising_cancelled_error_rejects(is_async):
    servicer = InteropEcho()
    async with serving(servicer, client_auth=Cred(), auth=CancellingAuth(is_async)) as (_, stub):
        e = await call_error(stub.Echo, Req(message="x"))
    assert e.code == errors.ERPCAUTH and servicer.calls_served == 0


# --- 2. join() frees connections whose peer never reads ---------------------------------------

async def _queue_unread_replies(server, sock, n: int, size: int) -> None:
    loop = asyncio.get_running_loop()
    ask = Req(message="big", response_attachment_size=size).SerializeToString()
    await loop.sock_sendall(sock, b"".join(
        frame(rpc_meta(service="interop.EchoService", correlation_id=i), ask) for i in range(n)))
    for _ in range(500):
        conn = next(iter(server.connections), None)
        if conn is not None and conn.hold_events and conn.unwritten_bytes() > 0:
            return  # its transport paused writing: the replies are queued, and requests wait unread
        await asyncio.sleep(0.01)
    raise AssertionError("the server queued no replies")


@pytest.mark.parametrize("timeout", [1, None])
async def test_join_aborts_connections_whose_peer_does_not_read(timeout):
    server = aiobrpc.Server()
    server.add_service(InteropEcho())
    await server.start("127.0.0.1:0")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
        await _queue_unread_replies(server, sock, 32, MIB)
        transports = [conn.transport for conn in server.connections]
        await server.stop()
        await asyncio.wait_for(server.join(timeout=timeout), HANG_LIMIT_S)
        assert not server.connections
        assert all(t.is_closing() and t.get_write_buffer_size() == 0 for t in transports)
    finally:
        sock.close()  # a failed test leaves nothing behind: the server sees the reset
        await server.stop()
        await asyncio.wait_for(server.join(timeout=1), HANG_LIMIT_S)


async def test_join_returns_when_a_handler_ignores_its_cancellation():
    started, released, finished = asyncio.Event(), asyncio.Event(), asyncio.Event()

    class Stubborn(aiobrpc.Servicer):
        SERVICE = SERVICE

        async def Echo(self, request, cntl):
            started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await released.wait()
            finally:
                finished.set()
            return Resp(message="late")

    server = aiobrpc.Server()
    server.add_service(Stubborn())
    await server.start("127.0.0.1:0")
    channel = aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(timeout_ms=-1, max_retry=0))
    call = asyncio.ensure_future(aiobrpc.Stub(channel, SERVICE).Echo(Req(message="x")))
    try:
        await asyncio.wait_for(started.wait(), HANG_LIMIT_S)
        await server.stop()
        await asyncio.wait_for(server.join(timeout=0.1), HANG_LIMIT_S)
        assert not server.connections
        with pytest.raises(aiobrpc.RpcError):  # the connection closed under the call
            await asyncio.wait_for(call, HANG_LIMIT_S)
    finally:
        released.set()
        await asyncio.wait_for(finished.wait(), HANG_LIMIT_S)
        await channel.close()
    assert server.stats.dropped_replies == 1


# --- 3. an awaitable a handler returns is awaited ---------------------------------------------

def counted(fn):
    """A plain decorator: the wrapper is a def that returns what the async def returns."""
    @functools.wraps(fn)
    def wrapper(self, request, cntl):
        self.wrapper_threads.append(threading.get_ident())
        return fn(self, request, cntl)
    return wrapper


class Decorated(aiobrpc.Servicer):
    SERVICE = SERVICE

    def __init__(self) -> None:
        self.wrapper_threads: list[int] = []

    @counted
    async def Echo(self, request, cntl):
        await asyncio.sleep(0)
        return Resp(message="async " + request.message)

    def StartStream(self, request, cntl):  # a plain def, run in the thread pool
        return self._later(request)

    async def _later(self, request):
        await asyncio.sleep(0)
        return Resp(message="awaited " + request.message)


async def test_an_async_handler_behind_a_decorator_runs_on_the_loop():
    servicer = Decorated()
    async with serving(servicer) as (_, stub):
        resp = await asyncio.wait_for(stub.Echo(Req(message="hi")), HANG_LIMIT_S)
    assert resp.message == "async hi"
    assert servicer.wrapper_threads == [threading.get_ident()]


async def test_an_awaitable_a_sync_handler_returns_is_awaited_on_the_loop():
    async with serving(Decorated()) as (_, stub):
        resp = await asyncio.wait_for(stub.StartStream(Req(message="hi")), HANG_LIMIT_S)
    assert resp.message == "awaited hi"


async def test_a_bug_while_handling_one_connections_bytes_closes_only_that_connection(monkeypatch, caplog):
    """An exception from our own event handling (a bug) must not reach the loop as a fatal
    protocol error with no name: that connection closes with a log line naming the peer, its
    calls end with EFAILEDSOCKET, and other connections are served."""
    from aiobrpc.server.connection import ServerConnection

    original = ServerConnection.event_received
    poisoned: list = []

    def event_received(self, ev):
        if not poisoned:
            poisoned.append(self)
        if self is poisoned[0]:
            raise ZeroDivisionError("a bug")
        return original(self, ev)

    monkeypatch.setattr(ServerConnection, "event_received", event_received)
    async with running_echo() as (server, _):
        addr = f"127.0.0.1:{server.port}"
        async with aiobrpc.Channel(addr, aiobrpc.ChannelOptions(timeout_ms=-1, max_retry=0)) as first:
            with pytest.raises(aiobrpc.RpcError) as ei:
                await asyncio.wait_for(aiobrpc.Stub(first, SERVICE).Echo(Req(message="a")), HANG_LIMIT_S)
            assert ei.value.code in (errors.EEOF, errors.EFAILEDSOCKET)
            # A connection of its own (channels of one process share one otherwise).
            async with aiobrpc.Channel(addr, aiobrpc.ChannelOptions(timeout_ms=-1, connection_group="2")) as second:
                resp = await asyncio.wait_for(aiobrpc.Stub(second, SERVICE).Echo(Req(message="b")), HANG_LIMIT_S)
                assert resp.message == "b"
    assert any("handling its bytes raised ZeroDivisionError" in r.getMessage() for r in caplog.records)


async def test_a_bug_while_reading_one_request_fails_that_request_only(monkeypatch, caplog):
    from aiobrpc.server import server as server_module

    original, failures = server_module.parse_request, [1]

    def parse_request(*args):
        if failures:
            failures.pop()
            raise ZeroDivisionError("a bug")
        return original(*args)

    monkeypatch.setattr(server_module, "parse_request", parse_request)
    async with serving(InteropEcho()) as (server, stub):
        with pytest.raises(aiobrpc.RpcError) as ei:
            await asyncio.wait_for(stub.Echo(Req(message="a")), HANG_LIMIT_S)
        assert ei.value.code == errors.EINTERNAL and "ZeroDivisionError" in ei.value.text
        assert (await asyncio.wait_for(stub.Echo(Req(message="b")), HANG_LIMIT_S)).message == "b"
        assert stub.channel.stats.connections_made == 1
    assert any("raised ZeroDivisionError" in r.getMessage() for r in caplog.records)
