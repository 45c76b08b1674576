"""Client interceptors (aiobrpc/interceptors.py): order, what each sees, short cuts, retries of
their own, and the error rules."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from tests.helpers.interop_server import SERVICE, running_echo

Req, Resp = interop_pb2.EchoRequest, interop_pb2.EchoResponse


@pytest_asyncio.fixture
async def echo():
    async with running_echo() as pair:
        yield pair


def stub_for(server, interceptors, **opts):
    opts.setdefault("max_retry", 0)
    channel = aiobrpc.Channel(f"127.0.0.1:{server.port}",
                              aiobrpc.ChannelOptions(timeout_ms=2000, interceptors=interceptors, **opts))
    return channel, aiobrpc.Stub(channel, SERVICE)


async def test_the_first_interceptor_is_the_outermost(echo):
    server, _ = echo
    seen = []

    def named(name):
        async def interceptor(request, cntl, proceed):
            seen.append(f"{name} before {cntl.service_name}/{cntl.method_name} {request.message}")
            response = await proceed(request, cntl)
            seen.append(f"{name} after {response.message} E{cntl.error_code}")
            return response
        return interceptor

    channel, stub = stub_for(server, [named("outer"), named("inner")])
    try:
        assert (await stub.Echo(Req(message="hi"))).message == "hi"
    finally:
        await channel.close()
    assert seen == [f"outer before {SERVICE.full_name}/Echo hi", f"inner before {SERVICE.full_name}/Echo hi", "inner after hi E0", "outer after hi E0"]


async def test_an_interceptor_changes_the_request_and_sees_the_controller(echo):
    server, _ = echo

    async def stamp(request, cntl, proceed):
        request.message += "!"
        cntl.request_user_fields = {"x-who": "interceptor"}
        return await proceed(request, cntl)

    channel, stub = stub_for(server, [stamp])
    cntl = aiobrpc.Controller()
    try:
        resp = await stub.Echo(Req(message="hi"), cntl)
    finally:
        await channel.close()
    assert resp.message == "hi!" and list(resp.user_fields) == ["x-who=interceptor"]
    assert not cntl.failed and cntl.latency_us > 0


async def test_an_error_is_seen_around_proceed_and_a_retry_of_its_own_succeeds(echo):
    server, _ = echo
    codes = []

    async def retry_once(request, cntl, proceed):
        try:
            return await proceed(request, cntl)
        except aiobrpc.RpcError as e:
            codes.append((e.code, cntl.error_code))
            request.ClearField("fail_code")
            return await proceed(request, cntl)

    channel, stub = stub_for(server, [retry_once])
    cntl = aiobrpc.Controller()
    try:
        resp = await stub.Echo(Req(message="x", fail_code=errors.EINTERNAL, fail_text="once"), cntl)
    finally:
        await channel.close()
    assert resp.message == "x" and codes == [(errors.EINTERNAL, errors.EINTERNAL)]
    assert not cntl.failed
    assert channel.status()[f"{SERVICE.full_name}/Echo"]["count"] == 2  # each proceed is a call


async def test_an_interceptor_may_answer_without_the_call_or_refuse_it(echo):
    server, servicer = echo

    async def cache(request, cntl, proceed):
        if request.message == "cached":
            return Resp(message="from cache")
        if request.message == "refused":
            raise aiobrpc.RpcError(errors.EPERM, "not allowed here")
        return await proceed(request, cntl)

    channel, stub = stub_for(server, [cache])
    cntl = aiobrpc.Controller()
    try:
        assert (await stub.Echo(Req(message="cached"))).message == "from cache"
        with pytest.raises(aiobrpc.RpcError) as ei:
            await stub.Echo(Req(message="refused"), cntl)
    finally:
        await channel.close()
    assert ei.value.code == cntl.error_code == errors.EPERM and cntl.error_text == "not allowed here"
    assert servicer.calls_served == 0


@pytest.mark.parametrize("bug", ["raises", "returns None"])
async def test_a_broken_interceptor_fails_the_call_with_einternal(echo, bug, caplog):
    server, _ = echo

    async def broken(request, cntl, proceed):
        await proceed(request, cntl)
        if bug == "raises":
            raise KeyError("oops")

    channel, stub = stub_for(server, [broken])
    cntl = aiobrpc.Controller()
    try:
        with pytest.raises(aiobrpc.RpcError) as ei:
            await stub.Echo(Req(message="x"), cntl)
    finally:
        await channel.close()
    assert ei.value.code == cntl.error_code == errors.EINTERNAL
    assert "interceptor" in ei.value.text and "broken" in ei.value.text
    assert ("KeyError('oops')" if bug == "raises" else "returned NoneType, not EchoResponse") in ei.value.text


async def test_cancelling_the_caller_cancels_through_the_interceptors(echo):
    server, _ = echo
    cancelled = []

    async def watch(request, cntl, proceed):
        try:
            return await proceed(request, cntl)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    channel, stub = stub_for(server, [watch])
    try:
        task = asyncio.ensure_future(stub.Echo(Req(message="slow", sleep_ms=2000)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cancelled == [True] and channel.pending_calls() == 0
    finally:
        await channel.close()


def test_interceptors_must_be_a_list_of_callables():
    with pytest.raises(TypeError, match="interceptors must hold async callables"):
        aiobrpc.ChannelOptions(interceptors=[1])
    with pytest.raises(TypeError, match="interceptors must be a list"):
        aiobrpc.ChannelOptions(interceptors="log")
    assert aiobrpc.ChannelOptions(interceptors=None).interceptors == ()
