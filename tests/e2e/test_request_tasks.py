"""A request's handler runs at once and gets a task only when it suspends (issue 17): on every
Python the server behaves as if each request ran in its own task, whether the handler
suspends or not, raises before or after suspending, uses contextvars, or is cancelled by join()."""

from __future__ import annotations

import asyncio
import contextvars
import sys

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from tests.helpers.interop_server import SERVICE

Req = interop_pb2.EchoRequest
Resp = interop_pb2.EchoResponse
REQUEST = contextvars.ContextVar("REQUEST")


class Kinds(aiobrpc.Servicer):
    """Echo does what the request's message names."""

    SERVICE = SERVICE

    def __init__(self) -> None:
        self.tasks: list = []
        self.leaks: list = []
        self.blocked = asyncio.Event()
        self.cancelled = 0

    async def Echo(self, request, cntl):
        kind = request.message.partition(":")[0]
        leaked = REQUEST.get(None)
        if leaked is not None:
            self.leaks.append((request.message, leaked))
        REQUEST.set(request.message)
        self.tasks.append(asyncio.current_task())
        if kind == "plain":
            pass
        elif kind == "suspend":
            await asyncio.sleep(0.002)
        elif kind == "yield":
            await asyncio.sleep(0)
        elif kind == "raise-before":
            raise KeyError("before")
        elif kind == "raise-after":
            await asyncio.sleep(0)
            raise KeyError("after")
        elif kind == "rpcerror-after":
            await asyncio.sleep(0)
            raise aiobrpc.RpcError(4321, "after")
        elif kind == "timeout":
            if sys.version_info < (3, 11):  # no asyncio.timeout
                await asyncio.wait_for(asyncio.sleep(5), 0.005)
            async with asyncio.timeout(0.005):
                await asyncio.sleep(5)
        elif kind == "block":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return Resp(message=f"{request.message}|{REQUEST.get()}")


@pytest.fixture
async def served():
    servicer = Kinds()
    server = aiobrpc.Server()
    server.add_service(servicer)
    await server.start("127.0.0.1:0")
    channel = aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(max_retry=0, timeout_ms=3000))
    yield server, servicer, aiobrpc.Stub(channel, SERVICE)
    await channel.close()
    await server.stop()
    await server.join()


def idle(server) -> bool:
    return server.concurrency == 0 and not server._tasks


@pytest.mark.parametrize("kind", ["plain", "suspend", "yield"])
async def test_handlers_that_suspend_or_not_answer_and_leave_nothing(served, kind):
    server, servicer, stub = served
    replies = await asyncio.gather(*(stub.Echo(Req(message=f"{kind}:{i}")) for i in range(50)))
    assert [r.message for r in replies] == [f"{kind}:{i}|{kind}:{i}" for i in range(50)]
    assert all(t is not None for t in servicer.tasks)  # asyncio.current_task() works in a handler
    assert idle(server) and not servicer.leaks


@pytest.mark.parametrize("kind", ["raise-before", "raise-after"])
async def test_an_exception_before_or_after_suspending_is_einternal(served, kind):
    server, _, stub = served
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.Echo(Req(message=kind))
    assert ei.value.code == errors.EINTERNAL and "KeyError" in ei.value.text
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.Echo(Req(message="rpcerror-after"))
    assert ei.value.code == 4321
    assert idle(server) and server.stats.failed_requests == 2


async def test_asyncio_timeout_in_a_handler_becomes_einternal_timeouterror(served):
    server, _, stub = served
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.Echo(Req(message="timeout"))
    assert ei.value.code == errors.EINTERNAL and "TimeoutError" in ei.value.text
    assert idle(server)


async def test_each_request_runs_in_its_own_context(served):
    server, servicer, stub = served
    REQUEST.set("the caller's")
    kinds = ["plain", "suspend", "yield"] * 40
    replies = await asyncio.gather(*(stub.Echo(Req(message=f"{k}:{i}")) for i, k in enumerate(kinds)))
    assert [r.message for r in replies] == [f"{k}:{i}|{k}:{i}" for i, k in enumerate(kinds)]
    assert not servicer.leaks  # no request saw a value another one set
    assert idle(server)


async def test_join_cancels_suspended_handlers_and_counts_them_out(served):
    server, servicer, stub = served
    calls = [asyncio.ensure_future(stub.Echo(Req(message=f"block:{i}"))) for i in range(5)]
    calls += [asyncio.ensure_future(stub.Echo(Req(message=f"plain:{i}"))) for i in range(5)]
    # The plain ones end at once; wait for them too: requests go out in groups, so the last of
    # them may reach the server after the blocked five, and a stopped server refuses them.
    while server.concurrency < 5 or not all(c.done() for c in calls[5:]):
        await asyncio.sleep(0.005)
    await server.stop()
    await server.join(timeout=0.05)
    assert servicer.cancelled == 5 and idle(server)
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert [r.message for r in results[5:]] == [f"plain:{i}|plain:{i}" for i in range(5)]
    assert all(isinstance(r, aiobrpc.RpcError) for r in results[:5])  # no reply: the connection closed


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="3.12+ uses eager tasks, 3.10 a Task per request")
async def test_before_3_12_a_handler_that_does_not_suspend_costs_no_task(served):
    server, servicer, stub = served
    await stub.Echo(Req(message="plain:0"))
    await stub.Echo(Req(message="suspend:0"))
    inline, promoted = servicer.tasks
    assert not isinstance(inline, asyncio.Task) and inline.done()
    assert not isinstance(promoted, asyncio.Task)  # the inline one, forwarding to its task
    assert repr(promoted).startswith("<Task")
