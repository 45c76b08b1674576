"""End to end over 127.0.0.1: attachments, compression, checksums, errors, timeouts,
concurrency, auth, graceful stop, lost connections."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref

import numpy as np
import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from tests.helpers.health import wait_up
from tests.helpers.interop_server import SERVICE, InteropEcho
from tests.helpers.waiting import wait_until

Req = interop_pb2.EchoRequest
MIB = 1 << 20


def stub_for(server, **opts):
    opts.setdefault("max_retry", 0)
    channel = aiobrpc.Channel(f"127.0.0.1:{server.port}", aiobrpc.ChannelOptions(**opts))
    return channel, aiobrpc.Stub(channel, SERVICE)


@pytest.mark.parametrize("size", [0, 1, 4096, MIB, 64 * MIB - 4096])
async def test_attachment_roundtrip_numpy(interop, size):
    server, _ = interop
    channel, stub = stub_for(server, timeout_ms=20000)
    arr = (np.arange(size, dtype=np.uint32) % 251).astype(np.uint8)
    cntl = aiobrpc.Controller(request_attachment=arr)
    resp = await stub.Echo(Req(message="att"), cntl)
    assert resp.request_attachment_size == size
    out = np.frombuffer(cntl.response_attachment, dtype=np.uint8)
    assert out.shape == (size,) and np.array_equal(out, arr)
    await channel.close()


async def test_float_tensor_attachment_in_place(interop):
    server, _ = interop
    channel, stub = stub_for(server)
    arr = np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32)
    cntl = aiobrpc.Controller(request_attachment=arr)
    await stub.Echo(Req(message="t"), cntl)
    out = np.frombuffer(cntl.response_attachment, dtype=np.float32).reshape(256, 256)
    assert np.array_equal(out, arr)
    await channel.close()


@pytest.mark.parametrize("req_ct", [0, 1, 2, 3])
@pytest.mark.parametrize("resp_ct", [0, 1, 2, 3])
async def test_compression_each_way(interop, req_ct, resp_ct):
    server, _ = interop
    channel, stub = stub_for(server)
    cntl = aiobrpc.Controller(request_compress_type=req_ct)
    msg = "compress me " * 100
    resp = await stub.Echo(Req(message=msg, response_compress_type=resp_ct), cntl)
    assert resp.message == msg and resp.request_compress_type == req_ct
    await channel.close()


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("with_attachment", [False, True])
async def test_checksum_on_off(interop, checksum, with_attachment):
    server, _ = interop
    channel, stub = stub_for(server)
    cntl = aiobrpc.Controller(request_checksum=checksum, request_checksum_with_attachment=with_attachment,
                              request_attachment=b"attached bytes")
    cntl.request_user_fields["x-interop-response-checksum"] = "1"
    resp = await stub.Echo(Req(message="ck"), cntl)
    assert resp.request_attachment_size == 14 and bytes(cntl.response_attachment) == b"attached bytes"
    await channel.close()


async def test_meta_fields_reach_the_server(interop):
    server, _ = interop
    channel, stub = stub_for(server, deliver_timeout_ms=True, timeout_ms=1500)
    cntl = aiobrpc.Controller(log_id=(1 << 64) - 5)
    cntl.request_user_fields = {"a": "1", "b": "2"}
    resp = await stub.Echo(Req(message="m"), cntl)
    assert resp.log_id == -5  # int64 on the wire, as brpc
    assert list(resp.user_fields) == ["a=1", "b=2"]
    assert 1000 < resp.server_timeout_ms <= 1500
    assert cntl.response_user_fields == {"a": "1", "b": "2"}
    assert cntl.remote_side == f"127.0.0.1:{server.port}" and cntl.latency_us > 0
    await channel.close()


async def test_short_service_name_resolves(interop):
    server, _ = interop
    channel, _ = stub_for(server, use_full_service_name=False)
    resp = await channel.call_method("interop.EchoService", "Echo", Req(message="short"),
                                     interop_pb2.EchoResponse)
    assert resp.message == "short"
    await channel.close()


@pytest.mark.parametrize("code,text,want_code,want_text", [
    (1234, "interop failure", 1234, "[127.0.0.1:9110][E1234]interop failure"),
    (-1, "generic failure", errors.EINTERNAL, "[127.0.0.1:9110]generic failure"),
])
async def test_service_errors(interop, code, text, want_code, want_text):
    server, _ = interop
    channel, stub = stub_for(server)
    cntl = aiobrpc.Controller()
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.Echo(Req(message="x", fail_code=code, fail_text=text), cntl)
    assert (ei.value.code, ei.value.text) == (want_code, want_text)
    assert cntl.failed and cntl.error_code == want_code and cntl.error_text == want_text
    await channel.close()


class Raising(aiobrpc.Servicer):
    SERVICE = SERVICE

    async def Echo(self, request, cntl):
        if request.message == "rpc":
            raise aiobrpc.RpcError(4321, "raised by handler")
        if request.message == "bad-return":
            return "not a message"
        raise KeyError("boom")

    def StartStream(self, request, cntl):  # a plain def runs in the thread pool
        return interop_pb2.EchoResponse(message="sync " + request.message)


async def test_handler_exceptions_and_sync_handlers(caplog):
    server = aiobrpc.Server(aiobrpc.ServerOptions(server_tag="t"))
    server.add_service(Raising())
    await server.start("127.0.0.1:0")
    channel, stub = stub_for(server)
    for msg, code, needle in [("rpc", 4321, "raised by handler"), ("x", errors.EINTERNAL, "KeyError"),
                              ("bad-return", errors.ERESPONSE, "handler returned str")]:
        with pytest.raises(aiobrpc.RpcError) as ei:
            await stub.Echo(Req(message=msg))
        assert ei.value.code == code and needle in ei.value.text
    assert (await stub.StartStream(Req(message="hi"))).message == "sync hi"
    await channel.close()
    await server.stop()
    await server.join()


async def test_unknown_service_and_method(interop):
    server, _ = interop
    channel, _ = stub_for(server)
    with pytest.raises(aiobrpc.RpcError) as ei:
        await channel.call_method("NoSuchService", "Echo", Req(message="x"), interop_pb2.EchoResponse)
    assert ei.value.code == errors.ENOSERVICE and ei.value.text.endswith("Fail to find service=NoSuchService")
    with pytest.raises(aiobrpc.RpcError) as ei:
        await channel.call_method("interop.EchoService", "Nope", Req(message="x"), interop_pb2.EchoResponse)
    assert ei.value.code == errors.ENOMETHOD
    await channel.close()


async def test_request_serialization_error_is_erequest(interop):
    server, _ = interop
    channel, stub = stub_for(server)
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.Echo(Req())  # required `message` missing
    assert ei.value.code == errors.EREQUEST
    with pytest.raises(TypeError, match="takes a request of type interop.EchoRequest"):
        await stub.Echo(interop_pb2.EchoResponse(message="x"))
    await channel.close()


@pytest.mark.parametrize("request_", [{"message": "x"}, b"\n\x01x", None])
async def test_call_method_with_a_non_message_raises_typeerror_before_sending(interop, request_):
    server, _ = interop
    channel, _ = stub_for(server)
    cntl = aiobrpc.Controller()
    expected = rf"^interop\.EchoService\.Echo takes a protobuf message, got {type(request_).__name__}$"
    with pytest.raises(TypeError, match=expected):
        await channel.call_method("interop.EchoService", "Echo", request_, interop_pb2.EchoResponse, cntl)
    assert cntl.attempts == [] and not cntl.failed  # nothing was sent
    resp = await channel.call_method("interop.EchoService", "Echo", Req(message="x"), interop_pb2.EchoResponse)
    assert resp.message == "x"
    await channel.close()


async def test_timeout_late_reply_dropped_connection_kept(interop):
    server, _ = interop
    channel, stub = stub_for(server)
    loop = asyncio.get_running_loop()
    refs = []

    async def timed_out_call():
        cntl = aiobrpc.Controller(timeout_ms=50)
        refs.append(weakref.ref(cntl))
        t0 = loop.time()
        try:
            await stub.Echo(Req(message="slow", sleep_ms=200), cntl)
        except aiobrpc.RpcError as e:
            return e.code, e.text, loop.time() - t0
        return None

    code, text, elapsed = await asyncio.ensure_future(timed_out_call())
    assert code == errors.ERPCTIMEDOUT and "Reached timeout=50ms" in text
    assert elapsed >= 0.045  # never early; how late is up to the machine's load
    conn = channel._conn
    assert not conn.pending
    gc.collect()
    assert refs[0]() is None  # nothing in the library keeps the timed-out call alive
    await asyncio.sleep(0.25)
    await wait_until(lambda: channel.stats.late_or_unknown_responses == 1)
    assert channel.stats.late_or_unknown_responses == 1
    assert (await stub.Echo(Req(message="again"))).message == "again"
    assert channel._conn is conn and channel.stats.connections_made == 1
    await channel.close()


async def test_thousand_calls_in_flight_on_one_connection(interop):
    server, servicer = interop
    channel, stub = stub_for(server, timeout_ms=10000)
    results = await asyncio.gather(*[stub.Echo(Req(message=str(i), sleep_ms=i % 3)) for i in range(1000)])
    assert [r.message for r in results] == [str(i) for i in range(1000)]
    assert channel.stats.connections_made == 1 and not channel._conn.pending
    assert servicer.calls_served == 1000
    await channel.close()


async def test_slow_call_does_not_delay_others(interop):
    server, _ = interop
    channel, stub = stub_for(server, timeout_ms=30000)
    # the slow call is far slower than any busy machine makes 20 fast ones: the order holds under load
    slow = asyncio.ensure_future(stub.Echo(Req(message="slow", sleep_ms=20000)))
    for _ in range(20):
        assert (await stub.Echo(Req(message="fast"))).message == "fast"
    assert not slow.done()
    slow.cancel()
    with contextlib.suppress(asyncio.CancelledError, aiobrpc.RpcError):
        await slow
    await channel.close()


async def test_lost_connection_fails_pending_calls_then_reconnects(interop):
    server, _ = interop
    channel, stub = stub_for(server, timeout_ms=5000)
    pending = [asyncio.ensure_future(stub.Echo(Req(message="p", sleep_ms=1000))) for _ in range(10)]
    await asyncio.sleep(0.05)
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.Echo(Req(message="bye", close_connection=True))
    results = await asyncio.gather(*pending, return_exceptions=True)
    # failed with EEOF (below), not answered after their 1 s: no wall-clock bound needed
    assert ei.value.code == errors.EEOF
    assert all(isinstance(r, aiobrpc.RpcError) and r.code == errors.EEOF for r in results)
    # The lost connection marked the server failed: calls fail fast until the health check
    # (100 ms after the first failure) connects again, then the channel reconnects.
    assert channel.server_states() == {server.address: "down"}
    await wait_up(channel)  # the health check revives it (how soon is the machine's load)
    assert (await stub.Echo(Req(message="back"))).message == "back"
    assert channel.stats.connections_made == 2 and channel.stats.servers_revived == 1
    await channel.close()


async def test_eof_marks_the_only_server_down_until_revived(interop):
    """brpc's behaviour (brpc's docs/en/client.md): after an EOF the retries of a one-server channel
    find the server down and fail at once with EHOSTDOWN; the health check revives it."""
    server, servicer = interop
    channel, stub = stub_for(server, max_retry=3)
    await stub.Echo(Req(message="warm"))
    server_conn = next(iter(server.connections))
    server_conn.close()
    await asyncio.sleep(0.05)
    cntl = aiobrpc.Controller()
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.Echo(Req(message="during"), cntl)
    assert ei.value.code == errors.EHOSTDOWN and cntl.retried_count == 3
    assert ei.value.text.endswith(" [R1-R3] same")  # retries failed as the first (EHOSTDOWN, not a timeout)
    await wait_up(channel)
    assert (await stub.Echo(Req(message="after"))).message == "after"
    await channel.close()


async def test_cancelling_the_caller_ends_the_call_cleanly(interop):
    server, _ = interop
    channel, stub = stub_for(server, timeout_ms=5000)
    task = asyncio.ensure_future(stub.Echo(Req(message="c", sleep_ms=300)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not channel._conn.pending
    await asyncio.sleep(0.35)
    await wait_until(lambda: channel.stats.late_or_unknown_responses == 1)
    assert channel.stats.late_or_unknown_responses == 1
    await channel.close()


async def test_graceful_stop_loses_nothing():
    servicer = InteropEcho()
    server = aiobrpc.Server()
    server.add_service(servicer)
    await server.start("127.0.0.1:0")
    channel, stub = stub_for(server, timeout_ms=5000)
    await stub.Echo(Req(message="warm"))
    inflight = [asyncio.ensure_future(stub.Echo(Req(message=str(i), sleep_ms=200))) for i in range(20)]
    await asyncio.sleep(0.05)
    await server.stop()
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.Echo(Req(message="late"))
    assert ei.value.code == errors.ELOGOFF and "Server is stopping" in ei.value.text
    await server.join(timeout=5)
    results = await asyncio.gather(*inflight)
    assert [r.message for r in results] == [str(i) for i in range(20)]
    assert servicer.calls_served == 21
    await channel.close()


async def test_server_max_concurrency_limit():
    server = aiobrpc.Server(aiobrpc.ServerOptions(max_concurrency=4))
    server.add_service(InteropEcho())
    await server.start("127.0.0.1:0")
    channel, stub = stub_for(server, timeout_ms=5000)
    results = await asyncio.gather(*[stub.Echo(Req(message="x", sleep_ms=100)) for _ in range(10)],
                                   return_exceptions=True)
    limited = [r for r in results if isinstance(r, aiobrpc.RpcError)]
    assert len(limited) == 6 and all(r.code == errors.ELIMIT for r in limited)
    assert "max_concurrency=4" in limited[0].text
    await channel.close()
    await server.stop()
    await server.join()


class Auth:
    def __init__(self, delay=0.0, raises=False):
        self.delay, self.raises, self.calls = delay, raises, 0

    async def verify_credential(self, credential, peer):
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.raises:
            raise RuntimeError("authenticator broke")
        return credential == b"secret"


class Cred:
    def __init__(self, value):
        self.value = value

    def generate_credential(self):
        return self.value


async def test_a_refusal_carries_the_authenticators_unauthorized_text():
    class Texted(Auth):
        def unauthorized_error_text(self):
            return "ask the operator"

    server = aiobrpc.Server(aiobrpc.ServerOptions(auth=Texted()))
    server.add_service(InteropEcho())
    await server.start("127.0.0.1:0")
    channel, stub = stub_for(server, auth=Cred(b"wrong"))
    with pytest.raises(aiobrpc.RpcError) as ei:
        await stub.Echo(Req(message="x"))
    assert ei.value.code == errors.ERPCAUTH and ei.value.text == "Fail to authenticate: ask the operator"
    await channel.close()
    await server.stop()
    await server.join()


@pytest.mark.parametrize("cred,ok", [(b"secret", True), (b"wrong", False), (None, False)])
async def test_auth(cred, ok):
    auth = Auth()
    server = aiobrpc.Server(aiobrpc.ServerOptions(auth=auth))
    servicer = InteropEcho()
    server.add_service(servicer)
    await server.start("127.0.0.1:0")
    channel, stub = stub_for(server, auth=Cred(cred) if cred is not None else None)
    if ok:
        results = await asyncio.gather(*[stub.Echo(Req(message=str(i))) for i in range(5)])
        assert all(r.authentication_data == b"secret" for r in results)
        assert auth.calls == 1
    else:
        with pytest.raises(aiobrpc.RpcError) as ei:
            await stub.Echo(Req(message="x"))
        assert ei.value.code == errors.ERPCAUTH and ei.value.text == "Fail to authenticate"
        assert servicer.calls_served == 0
    await channel.close()
    await server.stop()
    await server.join()
