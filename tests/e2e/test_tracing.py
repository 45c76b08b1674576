"""brpc's trace ids across a client -> server -> server chain, /rpcz, and OpenTelemetry spans."""

from __future__ import annotations

import asyncio
import http.client
import json

import pytest

import aiobrpc
from aiobrpc import tracing
from aiobrpc._proto import echo_pb2, interop_pb2
from tests.helpers.interop_server import SERVICE, InteropEcho

ECHO = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]


class Front(aiobrpc.Servicer):
    """example.EchoService whose handler calls the back server, recording what it saw."""

    SERVICE = ECHO

    def __init__(self, back: str) -> None:
        self.back = back
        self.seen: list = []

    async def Echo(self, request, cntl):
        self.seen.append((cntl.trace_id, cntl.span_id, cntl.parent_span_id))
        ch = aiobrpc.Channel(self.back)
        try:
            inner = aiobrpc.Controller()
            await aiobrpc.Stub(ch, SERVICE).Echo(interop_pb2.EchoRequest(message=request.message), inner)
            self.seen.append((inner.trace_id, inner.span_id, inner.parent_span_id))
        finally:
            await ch.close()
        return echo_pb2.EchoResponse(message=request.message)


class Back(InteropEcho):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    async def Echo(self, request, cntl):
        self.seen.append((cntl.trace_id, cntl.span_id, cntl.parent_span_id))
        return await super().Echo(request, cntl)


async def _chain():
    back = aiobrpc.Server(aiobrpc.ServerOptions(rpcz=True))
    back_svc = Back()
    back.add_service(back_svc)
    await back.start("127.0.0.1:0")
    front = aiobrpc.Server(aiobrpc.ServerOptions(rpcz=True, rpcz_max_records=3))
    front_svc = Front(back.address)
    front.add_service(front_svc)
    await front.start("127.0.0.1:0")
    return back, back_svc, front, front_svc


async def _stop(*servers) -> None:
    for s in servers:
        await s.stop()
        await s.join(timeout=2)


async def test_trace_ids_follow_the_calls_and_rpcz_lists_them():
    back, back_svc, front, front_svc = await _chain()
    ch = aiobrpc.Channel(front.address)
    stub = aiobrpc.Stub(ch, ECHO)
    with tracing.trace() as root:
        cntl = aiobrpc.Controller()
        await stub.Echo(echo_pb2.EchoRequest(message="traced"), cntl)
    await stub.Echo(echo_pb2.EchoRequest(message="not traced"))
    await ch.close()

    assert (cntl.trace_id, cntl.parent_span_id) == (root.trace_id, root.span_id) and cntl.span_id
    (front_seen, front_call), untraced = front_svc.seen[:2], front_svc.seen[2]
    assert front_seen == (root.trace_id, cntl.span_id, root.span_id)  # the server saw the client's ids
    assert front_call[0] == root.trace_id and front_call[2] == cntl.span_id  # its call is a child
    assert back_svc.seen[0] == front_call
    assert untraced == (None, None, None) and back_svc.seen[1] == (None, None, None)

    rows = await _get_json(front.internal_port or front.port, f"/rpcz?trace_id={root.trace_id:x}&format=json")
    assert [(r["method"], r["trace_id"], r["span_id"]) for r in rows] == [
        ("example.EchoService/Echo", root.trace_id, cntl.span_id)]
    rows = await _get_json(back.port, "/rpcz?format=json")
    assert [r["trace_id"] for r in rows] == [None, root.trace_id]  # newest first
    text = await _get(back.port, "/rpcz")
    assert f"trace={root.trace_id:016x}" in text and "interop.EchoService/Echo" in text
    await _stop(front, back)


async def test_a_trace_id_set_on_one_call_starts_a_trace():
    back, back_svc, front, front_svc = await _chain()
    ch = aiobrpc.Channel(front.address)
    cntl = aiobrpc.Controller()
    cntl.trace_id = 0xABC
    await aiobrpc.Stub(ch, ECHO).Echo(echo_pb2.EchoRequest(message="m"), cntl)
    await ch.close()
    assert front_svc.seen[0] == (0xABC, cntl.span_id, None)
    assert back_svc.seen[0][0] == 0xABC and back_svc.seen[0][2] == cntl.span_id
    await _stop(front, back)


async def test_rpcz_is_off_by_default_and_bounded():
    async with aiobrpc.Server() as srv:
        srv.add_service(InteropEcho())
        await srv.start("127.0.0.1:0")
        assert "rpcz is off" in await _get(srv.port, "/rpcz")
    back, back_svc, front, front_svc = await _chain()
    ch = aiobrpc.Channel(front.address)
    for i in range(5):
        await aiobrpc.Stub(ch, ECHO).Echo(echo_pb2.EchoRequest(message=str(i)))
    await ch.close()
    assert len(front.rpcz) == 3  # rpcz_max_records
    with pytest.raises(ValueError, match="trace_id must be an int"):
        with tracing.trace(0):
            pass
    await _stop(front, back)


@pytest.fixture
def otel_spans():
    """Finished OpenTelemetry spans, recorded by the SDK's in-memory exporter."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    original = tracing.OTEL.get_tracer
    tracing.OTEL.get_tracer = lambda *a, **k: tracer  # the global provider can be set only once
    try:
        yield exporter.get_finished_spans
    finally:
        tracing.OTEL.get_tracer = original


def _one(spans, name: str, kind: str):
    found = [s for s in spans if s.name == name and s.kind.name == kind]
    assert len(found) == 1, (name, kind, [(s.name, s.kind.name) for s in spans])
    return found[0]


async def test_opentelemetry_spans_carry_brpc_ids(otel_spans):
    back, back_svc, front, front_svc = await _chain()
    ch = aiobrpc.Channel(front.address)
    back_ch = aiobrpc.Channel(back.address)
    with tracing.trace() as root:
        cntl = aiobrpc.Controller()
        await aiobrpc.Stub(ch, ECHO).Echo(echo_pb2.EchoRequest(message="m"), cntl)
        failing = aiobrpc.Controller()
        with pytest.raises(aiobrpc.RpcError):
            await aiobrpc.Stub(back_ch, SERVICE).Echo(interop_pb2.EchoRequest(message="m", fail_code=1234), failing)
    await back_ch.close()
    await ch.close()
    spans = otel_spans()
    assert all(s.context.trace_id == root.trace_id for s in spans)
    # client -> front server -> its client -> back server: each span's parent is the one before it
    first = _one(spans, "example.EchoService/Echo", "CLIENT")
    assert first.parent.span_id == root.span_id  # trace()'s root: named as parent, not recorded
    assert first.context.span_id == cntl.span_id and first.attributes["brpc.span_id"] == cntl.span_id
    assert first.attributes["net.peer.name"] == front.address and first.status.is_ok
    front_span = _one(spans, "example.EchoService/Echo", "SERVER")
    assert front_span.parent.span_id == cntl.span_id and front_span.parent.is_remote
    assert front_span.attributes["brpc.span_id"] == cntl.span_id
    inner_trace, inner_span, inner_parent = front_svc.seen[1]
    inner = [s for s in spans if s.name == "interop.EchoService/Echo" and s.kind.name == "CLIENT"
             and s.context.span_id == inner_span]
    assert len(inner) == 1 and inner[0].parent.span_id == inner_parent == cntl.span_id
    back_spans = [s for s in spans if s.name == "interop.EchoService/Echo" and s.kind.name == "SERVER"]
    assert sorted(s.parent.span_id for s in back_spans) == sorted([inner_span, failing.span_id])
    failed_client = [s for s in spans if s.kind.name == "CLIENT" and s.context.span_id == failing.span_id][0]
    assert failed_client.attributes["rpc.brpc.error_code"] == 1234 and not failed_client.status.is_ok
    failed = [s for s in back_spans if s.attributes.get("rpc.brpc.error_code") == 1234]
    assert len(failed) == 1 and not failed[0].status.is_ok and failed[0].parent.span_id == failing.span_id
    # a span ends when its call does, after the server's
    assert first.end_time >= front_span.end_time
    await _stop(front, back)


async def test_one_client_span_for_a_call_and_its_retries(otel_spans):
    """A call retried after lost connections is one CLIENT span, its retries counted; a call
    to nowhere ends its span with the error."""
    server = aiobrpc.Server()
    server.add_service(InteropEcho())
    await server.start("127.0.0.1:0")
    flaky = aiobrpc.Channel(server.address, aiobrpc.ChannelOptions(max_retry=3))
    with tracing.trace():
        cntl = aiobrpc.Controller()
        with pytest.raises(aiobrpc.RpcError):
            await aiobrpc.Stub(flaky, SERVICE).Echo(interop_pb2.EchoRequest(message="x", close_connection=True), cntl)
    await flaky.close()
    address = server.address
    await _stop(server)
    gone = aiobrpc.Channel(address, aiobrpc.ChannelOptions(max_retry=0, connect_timeout_ms=300))
    lost = aiobrpc.Controller()
    lost.trace_id = 77
    with pytest.raises(aiobrpc.RpcError):
        await aiobrpc.Stub(gone, SERVICE).Echo(interop_pb2.EchoRequest(message="x"), lost)
    await gone.close()
    clients = [s for s in otel_spans() if s.kind.name == "CLIENT"]
    assert len(clients) == 2
    retried = [s for s in clients if s.context.span_id == cntl.span_id][0]
    assert retried.attributes["rpc.brpc.retried_count"] == cntl.retried_count == 3
    failed = [s for s in clients if s.context.span_id == lost.span_id][0]
    assert failed.context.trace_id == 77 and failed.attributes["rpc.brpc.error_code"] == lost.error_code
    assert not failed.status.is_ok and failed.parent is not None  # the implied, unrecorded root


async def test_untraced_calls_open_no_span_and_a_broken_tracer_fails_no_call(otel_spans):
    server = aiobrpc.Server()
    server.add_service(InteropEcho())
    await server.start("127.0.0.1:0")
    ch = aiobrpc.Channel(server.address)
    stub = aiobrpc.Stub(ch, SERVICE)
    await stub.Echo(interop_pb2.EchoRequest(message="plain"))
    assert otel_spans() == ()
    def broken(*a, **k):
        raise RuntimeError("tracer down")
    tracing.OTEL.get_tracer = broken
    with tracing.trace():
        cntl = aiobrpc.Controller()
        reply = await stub.Echo(interop_pb2.EchoRequest(message="traced"), cntl)
    assert reply.message == "traced" and cntl.span_id  # brpc's ids still go on the wire
    await ch.close()
    await _stop(server)


async def test_an_http_caller_s_x_bd_headers_trace_the_call_onward():
    """brpc's HTTP client sends its span as x-bd-trace-id / x-bd-span-id / x-bd-parent-span-id
    (decimal): the handler runs in that trace and its own calls carry it on."""
    back, back_svc, front, front_svc = await _chain()

    def post():
        c = http.client.HTTPConnection("127.0.0.1", front.port, timeout=5)
        try:
            c.request("POST", "/example.EchoService/Echo", body=b'{"message": "over http"}',
                      headers={"Content-Type": "application/json", "x-bd-trace-id": str(2**63 + 5),
                               "x-bd-span-id": "77", "x-bd-parent-span-id": "66"})
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()
    status, body = await asyncio.to_thread(post)
    assert status == 200 and b"over http" in body
    assert front_svc.seen[0] == (2**63 + 5, 77, 66)
    inner = front_svc.seen[1]
    assert inner[0] == 2**63 + 5 and inner[2] == 77  # the handler's call is a child of the HTTP span
    assert back_svc.seen[0] == inner
    rows = await _get_json(front.port, "/rpcz?format=json")
    assert rows[0]["trace_id"] == 2**63 + 5 and rows[0]["protocol"] == "http"
    # malformed ids are ignored, not an error
    def bad():
        c = http.client.HTTPConnection("127.0.0.1", front.port, timeout=5)
        try:
            c.request("POST", "/example.EchoService/Echo", body=b'{"message": "m"}',
                      headers={"Content-Type": "application/json", "x-bd-trace-id": "-1"})
            return c.getresponse().status
        finally:
            c.close()
    assert await asyncio.to_thread(bad) == 200
    assert front_svc.seen[2][0] is None
    await _stop(front, back)


async def _get(port: int, path: str) -> str:
    def go():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            c.request("GET", path)
            return c.getresponse().read().decode()
        finally:
            c.close()
    return await asyncio.to_thread(go)


async def _get_json(port: int, path: str):
    return json.loads(await _get(port, path))
