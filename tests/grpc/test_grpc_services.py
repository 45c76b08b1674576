"""The builtin gRPC services, asked by grpcio's own clients: health (grpcio-health-checking's
stubs) and server reflection (grpcio-reflection's descriptor database), and v1 reflection."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from aiobrpc import ServerOptions
from aiobrpc._proto.grpc_reflection.v1 import reflection_pb2 as v1
from tests.grpc.test_grpc_server import blocking, on_aio_loop, started, stopped

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def test_health_check_and_list():
    server, _ = await started(grpc_health=True)

    def calls():
        with grpc.insecure_channel(server.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            whole = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            one = stub.Check(health_pb2.HealthCheckRequest(service="aiobrpc.test.GrpcTestService"), timeout=5).status
            server.grpc_health.set_status("aiobrpc.test.GrpcTestService", False)
            down = stub.Check(health_pb2.HealthCheckRequest(service="aiobrpc.test.GrpcTestService"), timeout=5).status
            with pytest.raises(grpc.RpcError) as e:
                stub.Check(health_pb2.HealthCheckRequest(service="no.Such"), timeout=5)
            listed = dict(stub.List(health_pb2.HealthListRequest(), timeout=5).statuses)
            return whole, one, down, e.value.code(), {k: v.status for k, v in listed.items()}
    try:
        whole, one, down, code, listed = await blocking(calls)
    finally:
        await stopped(server)
    assert (whole, one, down, code) == (SERVING, SERVING, NOT_SERVING, grpc.StatusCode.NOT_FOUND)
    assert listed[""] == SERVING and listed["aiobrpc.test.GrpcTestService"] == NOT_SERVING


async def test_health_watch_sees_the_server_stop_and_ends():
    server, _ = await started(grpc_health=True)
    seen: list = []
    first = asyncio.get_running_loop().create_future()
    loop = asyncio.get_running_loop()

    async def watch():
        async with grpc.aio.insecure_channel(server.address) as ch:
            async for r in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10):
                seen.append(r.status)
                loop.call_soon_threadsafe(lambda: first.done() or first.set_result(None))
    watching = on_aio_loop(watch)
    await asyncio.wait_for(first, 5)
    await server.stop()
    await asyncio.wait_for(watching, 5)  # the stream ended when the server stopped
    await server.join(2)
    assert seen == [SERVING, NOT_SERVING]


async def test_reflection_v1alpha_with_grpcio_reflection():
    server, _ = await started(grpc_reflection=True)

    def calls():
        with grpc.insecure_channel(server.address) as ch:
            db = ProtoReflectionDescriptorDatabase(ch)
            services = set(db.get_services())
            pool = DescriptorPool(db)
            method = pool.FindServiceByName("aiobrpc.test.GrpcTestService").methods_by_name["Bidi"]
            message = pool.FindMessageTypeByName("aiobrpc.test.GrpcMessage")
            return services, method.client_streaming and method.server_streaming, [f.name for f in message.fields]
    try:
        services, bidi, fields = await blocking(calls)
    finally:
        await stopped(server)
    assert {"aiobrpc.test.GrpcTestService", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= services
    assert bidi and fields == ["text", "data", "count", "sleep_ms", "error_code"]


async def test_reflection_v1_answers_files_and_not_found():
    server, _ = await started(grpc_reflection=True)

    def calls():
        with grpc.insecure_channel(server.address) as ch:
            info = ch.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                    request_serializer=v1.ServerReflectionRequest.SerializeToString,
                                    response_deserializer=v1.ServerReflectionResponse.FromString)
            return list(info(iter([v1.ServerReflectionRequest(file_by_filename="grpc_test.proto"),
                                   v1.ServerReflectionRequest(file_containing_symbol="no.Such"),
                                   v1.ServerReflectionRequest(list_services="")]), timeout=5))
    try:
        by_name, missing, listed = await blocking(calls)
    finally:
        await stopped(server)
    assert len(by_name.file_descriptor_response.file_descriptor_proto) == 1
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "aiobrpc.test.GrpcTestService" in [s.name for s in listed.list_services_response.service]


def test_the_options_are_bools():
    with pytest.raises(TypeError, match="grpc_health must be a bool"):
        ServerOptions(grpc_health=1)


async def test_a_watcher_that_goes_away_leaves_the_other_watchers_watching():
    """fuzz/h2_server finding: a Watch cancelled (its client reset the stream) cancelled the one
    future every watcher waited on: the others failed, and every later Watch at once."""
    import h2.events

    from tests.grpc.test_grpc_hostile import Peer

    server, _ = await started(grpc_health=True)
    path = b"/grpc.health.v1.Health/Watch"
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path), (b":authority", b"x"),
               (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    body = health_pb2.HealthCheckRequest(service="aiobrpc.test.GrpcTestService").SerializeToString()

    def statuses(events, sid) -> list:
        data = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived) and e.stream_id == sid)
        out = []
        while len(data) >= 5:
            n = int.from_bytes(data[1:5], "big")
            out.append(health_pb2.HealthCheckResponse.FromString(data[5:5 + n]).status)
            data = data[5 + n:]
        return out

    def ended(events, sid) -> bool:
        return any(isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset)) and e.stream_id == sid
                   for e in events)

    try:
        peer = await Peer.connect(server)
        sids = []
        for _ in range(2):
            sid = peer.h2.get_next_available_stream_id()
            peer.h2.send_headers(sid, headers)
            peer.h2.send_data(sid, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
            sids.append(sid)
        peer.send()
        assert await peer.read_until(lambda ev: all(statuses(ev, s) == [SERVING] for s in sids))
        peer.h2.reset_stream(sids[0])  # the first watcher goes away
        peer.send()
        await asyncio.sleep(0.05)
        server.grpc_health.set_status("aiobrpc.test.GrpcTestService", False)
        assert await peer.read_until(lambda ev: statuses(ev, sids[1]) == [SERVING, NOT_SERVING])
        assert not ended(peer.events, sids[1])  # still watching
        peer.close()
    finally:
        await stopped(server)
