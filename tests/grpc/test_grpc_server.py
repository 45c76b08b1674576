"""gRPC on the serving port, called by real grpcio clients: the blocking `grpc` API in a thread
of the executor, and `grpc.aio` on a plain asyncio loop of its own thread (grpc.aio under
uvloop, in the test's loop, is not reliable). Every method kind, deadlines, cancellation,
metadata, errors, large messages, gzip, TLS with ALPN h2, and baidu_std, HTTP/1.1 and gRPC
clients on one port at once."""

from __future__ import annotations

import asyncio
import http.client
import json

import grpc
import pytest
import trustme

from aiobrpc import Channel, ChannelOptions, Controller, RpcError, Server, ServerOptions, Servicer, Stub, errors
from aiobrpc._proto import grpc_test_pb2
from aiobrpc.protocol import compress
from aiobrpc.tls import ClientTlsOptions, ServerTlsOptions

Msg = grpc_test_pb2.GrpcMessage
SERVICE = grpc_test_pb2.DESCRIPTOR.services_by_name["GrpcTestService"]
PREFIX = "/aiobrpc.test.GrpcTestService/"
MIB = 1 << 20
BIG = 64 * MIB
GRPCIO_TIMEOUT_SLACK_MS = 100  # grpcio's grpc-timeout: rounded up, from a clock it caches
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", BIG), ("grpc.max_send_message_length", BIG)]


class GrpcTest(Servicer):
    SERVICE = SERVICE

    def __init__(self) -> None:
        self.cancelled = 0
        self.cntls: list[Controller] = []

    async def Unary(self, request, cntl):
        self.cntls.append(cntl)
        if request.sleep_ms:
            try:
                await asyncio.sleep(request.sleep_ms / 1000)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if request.error_code:
            raise RpcError(request.error_code, request.text)
        if request.text == "boom":
            raise ValueError("boom")
        for k, v in cntl.request_user_fields.items():
            if k.startswith("x-"):
                cntl.response_user_fields[k] = v
        if request.text == "gzip":
            cntl.response_compress_type = compress.GZIP
        return Msg(text=request.text, data=request.data, count=cntl.timeout_ms or -1)

    async def ServerStream(self, request, cntl):
        for i in range(request.count):
            yield Msg(text=request.text, count=i)
        if request.error_code:
            raise RpcError(request.error_code, request.text)

    async def ClientStream(self, requests, cntl):
        texts = [r.text async for r in requests]
        return Msg(text=",".join(texts), count=len(texts))

    async def Bidi(self, requests, cntl):
        while (r := await requests.read()) is not None:
            yield Msg(text=r.text.upper(), count=r.count)


async def started(servicer=None, **opts) -> tuple[Server, GrpcTest]:
    servicer = servicer or GrpcTest()
    server = Server(ServerOptions(**opts))
    server.add_service(servicer)
    await server.start("127.0.0.1:0")
    return server, servicer


async def stopped(server: Server) -> None:
    await server.stop()
    await server.join(2)


def blocking(fn):
    """Run `fn` (grpc's blocking API) in the executor."""
    return asyncio.get_running_loop().run_in_executor(None, fn)


def on_aio_loop(coro_fn):
    """Run `coro_fn()` (grpc.aio) on a plain asyncio loop in a thread of its own."""
    return asyncio.get_running_loop().run_in_executor(None, lambda: asyncio.run(coro_fn()))


def stubs(channel) -> dict:
    ser, de = Msg.SerializeToString, Msg.FromString
    return {"Unary": channel.unary_unary(PREFIX + "Unary", request_serializer=ser, response_deserializer=de),
            "ServerStream": channel.unary_stream(PREFIX + "ServerStream", request_serializer=ser,
                                                 response_deserializer=de),
            "ClientStream": channel.stream_unary(PREFIX + "ClientStream", request_serializer=ser,
                                                 response_deserializer=de),
            "Bidi": channel.stream_stream(PREFIX + "Bidi", request_serializer=ser, response_deserializer=de)}


async def test_every_kind_of_method_with_the_blocking_client():
    server, _ = await started()

    def calls():
        with grpc.insecure_channel(server.address) as ch:
            s = stubs(ch)
            unary = s["Unary"](Msg(text="hi"), timeout=5)
            streamed = [(m.text, m.count) for m in s["ServerStream"](Msg(text="s", count=3), timeout=5)]
            gathered = s["ClientStream"](iter([Msg(text="a"), Msg(text="b")]), timeout=5)
            bidi = [m.text for m in s["Bidi"](iter([Msg(text="x"), Msg(text="y")]), timeout=5)]
            return unary, streamed, gathered, bidi
    try:
        unary, streamed, gathered, bidi = await blocking(calls)
    finally:
        await stopped(server)
    # cntl.timeout_ms is what grpc-timeout said: grpcio rounds it up to 10 ms and counts it from a
    # cached clock, so it can read a little over the 5 s asked for (5010 seen beside a CPU hog)
    assert unary.text == "hi" and 1000 < unary.count <= 5000 + GRPCIO_TIMEOUT_SLACK_MS
    assert streamed == [("s", 0), ("s", 1), ("s", 2)]
    assert (gathered.text, gathered.count) == ("a,b", 2)
    assert bidi == ["X", "Y"]


async def test_every_kind_of_method_with_grpc_aio_and_bidi_interleaved():
    server, _ = await started()

    async def calls():
        async with grpc.aio.insecure_channel(server.address) as ch:
            s = stubs(ch)
            unary = await s["Unary"](Msg(text="hi"), timeout=5)
            streamed = [m.count async for m in s["ServerStream"](Msg(count=4), timeout=5)]

            async def requests():
                for t in ("a", "b", "c"):
                    yield Msg(text=t)
            gathered = await s["ClientStream"](requests(), timeout=5)
            call = s["Bidi"](timeout=5)
            echoed = []
            for t in ("p", "q"):  # each answer comes before the next request is sent
                await call.write(Msg(text=t))
                echoed.append((await call.read()).text)
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            return unary.text, streamed, gathered.text, echoed, await call.code()
    try:
        result = await on_aio_loop(calls)
    finally:
        await stopped(server)
    assert result == ("hi", [0, 1, 2, 3], "a,b,c", ["P", "Q"], grpc.StatusCode.OK)


@pytest.mark.parametrize("code, status", [
    (errors.ELIMIT, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.EREQUEST, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ERPCAUTH, grpc.StatusCode.UNAUTHENTICATED),
    (errors.EINTERNAL, grpc.StatusCode.INTERNAL),
    (5000, grpc.StatusCode.INTERNAL),  # a user code brpc does not list
])
async def test_errors_carry_the_status_brpc_maps_and_the_text(code, status):
    server, _ = await started()

    def call():
        with grpc.insecure_channel(server.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                stubs(ch)["Unary"](Msg(error_code=code, text="100% wrong: é"), timeout=5)
            return e.value.code(), e.value.details()
    try:
        got = await blocking(call)
    finally:
        await stopped(server)
    assert got == (status, "100% wrong: é")
    assert server.stats.failed_requests == 1


async def test_unknown_methods_a_failing_handler_and_a_failing_stream():
    server, _ = await started()

    def calls():
        with grpc.insecure_channel(server.address) as ch:
            out = []
            for path in ("/aiobrpc.test.GrpcTestService/Nope", "/no.Such/Method"):
                with pytest.raises(grpc.RpcError) as e:
                    ch.unary_unary(path)(b"", timeout=5)
                out.append((e.value.code(), e.value.details()))
            with pytest.raises(grpc.RpcError) as e:
                stubs(ch)["Unary"](Msg(text="boom"), timeout=5)
            out.append((e.value.code(), e.value.details()))
            it = stubs(ch)["ServerStream"](Msg(count=2, error_code=errors.EPERM, text="no more"), timeout=5)
            got = []
            with pytest.raises(grpc.RpcError) as e:
                for m in it:
                    got.append(m.count)
            out.append((got, e.value.code(), e.value.details()))
            return out
    try:
        out = await blocking(calls)
    finally:
        await stopped(server)
    assert out[0] == (grpc.StatusCode.UNIMPLEMENTED, "Fail to find method=aiobrpc.test.GrpcTestService/Nope")
    assert out[1] == (grpc.StatusCode.UNIMPLEMENTED, "Fail to find service=no.Such") or \
        out[1][0] is grpc.StatusCode.UNIMPLEMENTED
    assert out[2] == (grpc.StatusCode.INTERNAL, "ValueError: boom")
    assert out[3] == ([0, 1], grpc.StatusCode.PERMISSION_DENIED, "no more")


async def test_grpc_timeout_is_the_deadline_and_cancels_the_handler():
    server, servicer = await started()

    def calls():
        with grpc.insecure_channel(server.address) as ch:
            fast = stubs(ch)["Unary"](Msg(), timeout=3)
            with pytest.raises(grpc.RpcError) as e:
                stubs(ch)["Unary"](Msg(sleep_ms=3000), timeout=0.2)
            return fast.count, e.value.code()
    try:
        timeout_ms, code = await blocking(calls)
        for _ in range(100):
            if servicer.cancelled:
                break
            await asyncio.sleep(0.01)
    finally:
        await stopped(server)
    assert 1000 < timeout_ms <= 3000 + GRPCIO_TIMEOUT_SLACK_MS  # the handler saw the time left
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert servicer.cancelled == 1
    # whichever came first: our deadline, or the client's own timer and its RST_STREAM
    assert servicer.cntls[1].error_code in (errors.ERPCTIMEDOUT, errors.ECANCELED)


async def test_a_cancelled_call_cancels_its_handler():
    server, servicer = await started()

    async def cancel():
        async with grpc.aio.insecure_channel(server.address) as ch:
            call = stubs(ch)["Unary"](Msg(sleep_ms=5000), timeout=10)
            await asyncio.sleep(0.2)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
    try:
        await on_aio_loop(cancel)
        for _ in range(200):
            if servicer.cancelled:
                break
            await asyncio.sleep(0.01)
        assert servicer.cancelled == 1
        assert server.concurrency == 0
    finally:
        await stopped(server)


async def test_metadata_both_ways():
    server, servicer = await started()

    def call():
        with grpc.insecure_channel(server.address) as ch:
            return stubs(ch)["Unary"].with_call(
                Msg(text="m"), timeout=5, metadata=[("x-tenant", "a"), ("x-key-bin", b"\x00\xff"), ("other", "o")])
    try:
        _, rpc = await blocking(call)
    finally:
        await stopped(server)
    fields = servicer.cntls[0].request_user_fields
    assert fields["x-tenant"] == "a" and fields["x-key-bin"] == b"\x00\xff" and fields["other"] == "o"
    initial = dict(rpc.initial_metadata())
    assert initial["x-tenant"] == "a" and initial["x-key-bin"] == b"\x00\xff"


async def test_large_messages_both_ways():
    server, _ = await started(max_body_size=BIG)
    data = bytes(range(256)) * (8 * MIB // 256)

    def call():
        with grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS) as ch:
            return stubs(ch)["Unary"](Msg(data=data), timeout=20).data
    try:
        assert await blocking(call) == data
    finally:
        await stopped(server)


async def test_a_message_over_max_body_size_is_resource_exhausted():
    server, _ = await started(max_body_size=1024)

    def call():
        with grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS) as ch:
            with pytest.raises(grpc.RpcError) as e:
                stubs(ch)["Unary"](Msg(data=b"x" * 4096), timeout=5)
            ok = stubs(ch)["Unary"](Msg(text="after"), timeout=5).text  # the connection carries on
            return e.value.code(), ok
    try:
        assert await blocking(call) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "after")
    finally:
        await stopped(server)


async def test_gzip_requests_and_responses():
    server, servicer = await started()

    def call():
        with grpc.insecure_channel(server.address, compression=grpc.Compression.Gzip) as ch:
            return stubs(ch)["Unary"](Msg(text="gzip", data=b"z" * 10000), timeout=5)
    try:
        response = await blocking(call)
    finally:
        await stopped(server)
    assert response.data == b"z" * 10000
    assert servicer.cntls[0].request_compress_type == compress.GZIP


async def test_tls_with_alpn_h2(tmp_path):
    ca = trustme.CA()
    cert = tmp_path / "server.pem"
    ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(cert))
    server, _ = await started(ssl=ServerTlsOptions(cert_file=str(cert)))

    def call():
        credentials = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
        with grpc.secure_channel(f"localhost:{server.port}", credentials) as ch:
            return stubs(ch)["Unary"](Msg(text="secret"), timeout=5).text
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    tls = ClientTlsOptions(ca_file=str(ca_file), server_hostname="localhost")
    try:
        assert await blocking(call) == "secret"
        async with Channel(server.address, ChannelOptions(protocol="grpc", ssl=tls, timeout_ms=5000)) as ch:
            cntl = Controller()
            assert (await Stub(ch, SERVICE).Unary(Msg(text="ours"), cntl)).text == "ours"  # aiobrpc over TLS too
    finally:
        await stopped(server)


async def test_baidu_std_http_and_grpc_clients_on_one_port_at_once():
    server, _ = await started()

    def grpc_calls():
        with grpc.insecure_channel(server.address) as ch:
            return [stubs(ch)["Unary"](Msg(text=f"g{i}"), timeout=5).text for i in range(20)]

    def http_calls():
        conn = http.client.HTTPConnection(server.host, server.port, timeout=5)
        try:
            out = []
            for i in range(20):
                conn.request("POST", PREFIX + "Unary", json.dumps({"text": f"h{i}"}))
                out.append(json.loads(conn.getresponse().read())["text"])
            conn.request("POST", PREFIX + "Bidi", json.dumps({"text": "h"}))
            refused = conn.getresponse()
            out.append((refused.status, refused.read().decode()))
            return out
        finally:
            conn.close()

    async def baidu_calls():
        async with Channel(server.address, ChannelOptions(timeout_ms=5000)) as ch:
            stub = Stub(ch, SERVICE)
            out = [(await stub.Unary(Msg(text=f"b{i}"))).text for i in range(20)]
            with pytest.raises(RpcError) as e:  # sent as baidu_std anyway (Stub refuses before sending)
                await ch.call_method(SERVICE.full_name, "Bidi", Msg(), Msg)
            return out, e.value.code, e.value.text

    async def aiobrpc_grpc_calls():
        async with Channel(server.address, ChannelOptions(timeout_ms=5000, protocol="grpc")) as ch:
            stub = Stub(ch, SERVICE)
            return await asyncio.gather(*(stub.Unary(Msg(text=f"a{i}")) for i in range(20)))
    try:
        g, h, (b, code, text), a = await asyncio.gather(
            blocking(grpc_calls), blocking(http_calls), baidu_calls(), aiobrpc_grpc_calls())
    finally:
        await stopped(server)
    assert g == [f"g{i}" for i in range(20)] and [r.text for r in a] == [f"a{i}" for i in range(20)]
    status, body = h.pop()
    assert status == 400 and "Bidi is a streaming rpc: call it over gRPC" in body
    assert h == [f"h{i}" for i in range(20)]
    assert b == [f"b{i}" for i in range(20)]
    assert code == errors.EREQUEST and "Bidi is a streaming rpc: call it over gRPC" in text
    assert "ChannelOptions" not in text  # the server's refusal, not the client's


async def test_a_stopping_server_refuses_new_calls_unavailable():
    server, _ = await started()

    def call():
        with grpc.insecure_channel(server.address) as ch:
            stubs(ch)["Unary"](Msg(), timeout=5)
            server.stopping = True  # what stop() sets, without closing the listener yet
            with pytest.raises(grpc.RpcError) as e:
                stubs(ch)["Unary"](Msg(), timeout=5)
            return e.value.code()
    try:
        assert await blocking(call) is grpc.StatusCode.UNAVAILABLE
    finally:
        await stopped(server)


class Blocking(GrpcTest):
    def Unary(self, request, cntl):  # a plain def: run in the server's thread pool
        return Msg(text=f"blocking {request.text}")


async def test_a_plain_def_handler_runs_in_the_thread_pool():
    server, _ = await started(Blocking())

    def call():
        with grpc.insecure_channel(server.address) as ch:
            return stubs(ch)["Unary"](Msg(text="x"), timeout=5).text
    try:
        assert await blocking(call) == "blocking x"
    finally:
        await stopped(server)


class Authenticator:
    def __init__(self) -> None:
        self.asked: list = []

    async def verify_credential(self, credential, peer):
        self.asked.append(credential)
        return credential == b"Bearer good"


async def test_authentication_once_per_connection_from_the_authorization_metadata():
    auth = Authenticator()
    server, servicer = await started(auth=auth)

    def calls():
        # grpcio shares a connection between channels of one target unless told not to
        own = [("grpc.use_local_subchannel_pool", 1)]
        with grpc.insecure_channel(server.address, options=own) as ch:
            ok = [stubs(ch)["Unary"](Msg(text="in"), timeout=5, metadata=[("authorization", "Bearer good")]).text
                  for _ in range(2)]
        with grpc.insecure_channel(server.address, options=own) as ch:
            with pytest.raises(grpc.RpcError) as e:
                stubs(ch)["Unary"](Msg(text="in"), timeout=5, metadata=[("authorization", "Bearer bad")])
        return ok, e.value.code()
    try:
        ok, code = await blocking(calls)
    finally:
        await stopped(server)
    assert ok == ["in", "in"] and code is grpc.StatusCode.UNAUTHENTICATED
    assert auth.asked == [b"Bearer good", b"Bearer bad"]  # once per connection
    assert servicer.cntls[0].authentication_data == b"Bearer good"
    assert server.stats.closed["auth_failed"] == 1


@pytest.mark.parametrize("refusal", ["texted", "cancelled"])
async def test_a_refusal_carries_the_authenticators_text_and_a_cancelled_check_refuses(refusal):
    """The same rules as baidu_std and HTTP (server/auth.py): unauthorized_error_text() follows
    "Fail to authenticate"; an authenticator whose awaitable is cancelled refuses, as one that
    raises, rather than failing the call INTERNAL."""
    class Texted(Authenticator):
        def unauthorized_error_text(self):
            return "ask the operator"

    class Cancelled(Authenticator):
        async def verify_credential(self, credential, peer):
            raise asyncio.CancelledError()

    server, servicer = await started(auth=Texted() if refusal == "texted" else Cancelled())

    def call():
        with grpc.insecure_channel(server.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                stubs(ch)["Unary"](Msg(text="in"), timeout=5, metadata=[("authorization", "Bearer bad")])
        return e.value.code(), e.value.details()
    try:
        code, details = await blocking(call)
    finally:
        await stopped(server)
    assert code is grpc.StatusCode.UNAUTHENTICATED and not servicer.cntls
    assert details == ("Fail to authenticate: ask the operator" if refusal == "texted" else "Fail to authenticate")
