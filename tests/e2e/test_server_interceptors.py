"""Server interceptors (aiobrpc/interceptors.py): around every handler, async and plain def,
in order, refusing, answering, failing; the error rules as the client sees them."""

from __future__ import annotations

import threading

import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from tests.helpers.interop_server import SERVICE, InteropEcho, running_echo

Req, Resp = interop_pb2.EchoRequest, interop_pb2.EchoResponse


async def call(server, request, **fields):
    async with aiobrpc.Channel(f"127.0.0.1:{server.port}", aiobrpc.ChannelOptions(max_retry=0, timeout_ms=3000,
                                                                                  connection_group="interceptors")) as ch:
        cntl = aiobrpc.Controller()
        if fields:
            cntl.request_user_fields = fields
        return await aiobrpc.Stub(ch, SERVICE).Echo(request, cntl)


async def test_interceptors_run_in_order_around_the_handler():
    seen = []

    def named(name):
        async def interceptor(request, cntl, proceed):
            seen.append(f"{name} before {cntl.service_name}/{cntl.method_name}")
            response = await proceed(request, cntl)
            seen.append(f"{name} after {response.message}")
            return response
        return interceptor

    async with running_echo(aiobrpc.ServerOptions(interceptors=[named("outer"), named("inner")])) as (server, _):
        assert (await call(server, Req(message="hi"))).message == "hi"
    assert seen == [f"outer before {SERVICE.full_name}/Echo", f"inner before {SERVICE.full_name}/Echo",
                    "inner after hi", "outer after hi"]


async def test_an_interceptor_refuses_without_running_the_handler():
    async def check_token(request, cntl, proceed):
        if cntl.request_user_fields.get("x-token") != "secret":
            raise aiobrpc.RpcError(errors.EPERM, "bad token")
        return await proceed(request, cntl)

    async with running_echo(aiobrpc.ServerOptions(interceptors=[check_token])) as (server, servicer):
        with pytest.raises(aiobrpc.RpcError) as ei:
            await call(server, Req(message="x"), **{"x-token": "guess"})
        assert ei.value.code == errors.EPERM and "bad token" in ei.value.text
        assert servicer.calls_served == 0
        assert (await call(server, Req(message="ok"), **{"x-token": "secret"})).message == "ok"
        assert server.stats.failed_requests == 1


class Raising(InteropEcho):
    async def Echo(self, request, cntl):
        if request.message == "raise":
            raise aiobrpc.RpcError(errors.EREQUEST, "refused by the handler")
        if request.message == "bug":
            raise ZeroDivisionError("handler bug")
        return await super().Echo(request, cntl)


async def test_an_interceptor_may_answer_for_a_failed_handler_and_sees_set_failed():
    seen = []

    async def fallback(request, cntl, proceed):
        try:
            response = await proceed(request, cntl)
        except aiobrpc.RpcError as e:
            seen.append(e.code)
            return Resp(message="fallback")
        seen.append(("set_failed", cntl.error_code, response))
        return response

    async with running_echo(aiobrpc.ServerOptions(interceptors=[fallback]), Raising()) as (server, _):
        assert (await call(server, Req(message="raise"))).message == "fallback"
        with pytest.raises(aiobrpc.RpcError) as ei:
            await call(server, Req(message="x", fail_code=errors.ELIMIT, fail_text="busy"))
        assert ei.value.code == errors.ELIMIT
    assert seen == [errors.EREQUEST, ("set_failed", errors.ELIMIT, None)]


async def test_errors_the_handler_raises_reach_the_interceptor_as_rpc_errors():
    seen = []

    async def watch(request, cntl, proceed):
        try:
            return await proceed(request, cntl)
        except aiobrpc.RpcError as e:
            seen.append((e.code, e.text))
            raise

    async with running_echo(aiobrpc.ServerOptions(interceptors=[watch]), Raising()) as (server, _):
        for message, code in (("raise", errors.EREQUEST), ("bug", errors.EINTERNAL)):
            with pytest.raises(aiobrpc.RpcError) as ei:
                await call(server, Req(message=message))
            assert ei.value.code == code
    assert seen == [(errors.EREQUEST, "refused by the handler"), (errors.EINTERNAL, "ZeroDivisionError: handler bug")]


@pytest.mark.parametrize("bug", ["raises", "returns a wrong type"])
async def test_a_broken_interceptor_fails_the_request_with_einternal(bug):
    async def broken(request, cntl, proceed):
        await proceed(request, cntl)
        if bug == "raises":
            raise KeyError("oops")
        return "not a message"

    async with running_echo(aiobrpc.ServerOptions(interceptors=[broken])) as (server, _):
        with pytest.raises(aiobrpc.RpcError) as ei:
            await call(server, Req(message="x"))
    if bug == "raises":
        assert ei.value.code == errors.EINTERNAL and "interceptor" in ei.value.text and "KeyError" in ei.value.text
    else:  # as a handler's wrong response
        assert ei.value.code == errors.ERESPONSE and "returned str, expected" in ei.value.text


class PlainDef(aiobrpc.Servicer):
    SERVICE = SERVICE

    def Echo(self, request, cntl):
        return Resp(message=f"{request.message} in {threading.current_thread().name}")


async def test_a_plain_def_handler_still_runs_in_the_thread_pool():
    threads = []

    async def where(request, cntl, proceed):
        threads.append(threading.current_thread().name)
        return await proceed(request, cntl)

    async with running_echo(aiobrpc.ServerOptions(interceptors=[where]), PlainDef()) as (server, _):
        resp = await call(server, Req(message="x"))
    assert threads == [threading.main_thread().name]
    assert not resp.message.endswith(threading.main_thread().name)


def test_server_interceptors_must_be_callables():
    with pytest.raises(TypeError, match="interceptors must hold async callables"):
        aiobrpc.ServerOptions(interceptors=["log"])
