"""A proto2 string field holding bytes that are not UTF-8 (protobuf parses them unchecked and
gives them back as `bytes`): refused as EREQUEST naming the field before the handler runs, on
baidu_std, HTTP and gRPC; never written as JSON (the fuzz finding `regress_invalid_utf8_*`)."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2, struct_pb2
from google.protobuf.message import EncodeError

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import echo_pb2, interop_pb2
from aiobrpc.protocol import content, utf8
from aiobrpc.server import http_rpc
from tests.e2e.test_http import fetch
from tests.helpers.interop_server import InteropEcho

Req = interop_pb2.EchoRequest
SVC = "interop.EchoService"


def bad_request(payload: bytes = b"") -> Req:
    """An interop.EchoRequest whose `message` is the bytes b"\\xcf[" (not UTF-8), as a peer sends it."""
    raw = Req(message="ab", payload=payload).SerializeToString().replace(b"\x0a\x02ab", b"\x0a\x02\xcf[")
    req = Req.FromString(raw)
    assert req.message == b"\xcf["  # protobuf's own behaviour this file guards against
    return req


def test_the_checker_names_the_first_bad_field_at_any_depth():
    assert utf8.bad_field(bad_request()) == "message"
    assert utf8.bad_field(Req(message="ok")) == ""
    # repeated, nested and recursive: descriptor.proto is proto2, DescriptorProto holds itself
    good = descriptor_pb2.FileDescriptorProto()
    good.message_type.add(name="Outer").nested_type.add(name="Inner").field.add(name="f")
    bad = descriptor_pb2.FileDescriptorProto.FromString(good.SerializeToString().replace(b"Inner", b"In\xffer"))
    assert utf8.bad_field(good) == ""
    assert utf8.bad_field(bad) == "message_type[0].nested_type[0].name"
    repeated = descriptor_pb2.FileDescriptorProto(dependency=["a.proto", "b.proto"])
    bad = descriptor_pb2.FileDescriptorProto.FromString(repeated.SerializeToString().replace(b"b.proto", b"\xfe.proto"))
    assert utf8.bad_field(bad) == "dependency[1]"


def test_types_whose_strings_protobuf_checks_need_no_check():
    assert utf8.checker(struct_pb2.Struct) is None  # proto3: parsing checks UTF-8 itself
    assert utf8.checker(interop_pb2.EchoRequest) is not None
    assert utf8.checker(echo_pb2.EchoRequest) is not None


def test_json_writers_refuse_a_string_that_is_not_utf8():
    with pytest.raises(ValueError, match="string field message is not UTF-8"):
        http_rpc.write_body(bad_request(), "application/json")
    with pytest.raises(ValueError, match="string field message is not UTF-8"):
        http_rpc.write_body(bad_request(), "application/proto-json")
    for ctype in (content.JSON, content.PROTO_JSON):
        with pytest.raises(EncodeError, match="string field message is not UTF-8"):
            content.serialize(bad_request(), ctype)
    assert Req.FromString(http_rpc.write_body(bad_request(), "application/proto")) == bad_request()


class CountingEcho(InteropEcho):
    async def Echo(self, request, cntl):
        assert isinstance(request.message, str), "the handler got bytes for a string field"
        return await super().Echo(request, cntl)


@pytest.fixture
async def server():
    srv = aiobrpc.Server()
    servicer = CountingEcho()
    srv.add_service(servicer)
    await srv.start("127.0.0.1:0")
    yield srv, servicer
    await srv.stop()
    await srv.join(timeout=2)


@pytest.mark.parametrize("payload", [b"", b"p" * 5000], ids=["small", "over-4KiB"])  # the ASCII shortcut, or not
@pytest.mark.parametrize("protocol", ["baidu_std", "grpc"])
async def test_a_request_with_a_bad_string_is_erequest_and_never_handled(server, protocol, payload):
    srv, servicer = server
    async with aiobrpc.Channel(f"127.0.0.1:{srv.port}", aiobrpc.ChannelOptions(protocol=protocol, max_retry=0)) as ch:
        with pytest.raises(aiobrpc.RpcError) as ei:
            await ch.call_method(SVC, "Echo", bad_request(payload), interop_pb2.EchoResponse)
        # gRPC carries EREQUEST as INVALID_ARGUMENT, which a gRPC client reads as EINVAL
        assert ei.value.code == (errors.EREQUEST if protocol == "baidu_std" else errors.EINVAL)
        assert "string field message is not UTF-8" in ei.value.text
        assert servicer.calls_served == 0
        resp = await ch.call_method(SVC, "Echo", Req(message="fine"), interop_pb2.EchoResponse)
        assert resp.message == "fine" and servicer.calls_served == 1  # the connection serves on


async def test_an_http_proto_body_with_a_bad_string_is_400_and_never_handled(server):
    srv, servicer = server

    status, _, body = await fetch(srv, "POST", f"/{SVC}/Echo", bad_request().SerializeToString(),
                                  {"Content-Type": "application/proto"})
    assert status == 400 and b"string field message is not UTF-8" in body
    assert servicer.calls_served == 0


class BadReplyEcho(aiobrpc.Servicer):
    """A server that answers with a string field that is not UTF-8 (as a hostile or C++ one can)."""

    SERVICE = interop_pb2.DESCRIPTOR.services_by_name["EchoService"]

    def __init__(self, padding: str = "") -> None:
        self.padding = padding

    async def Echo(self, request, cntl):
        raw = interop_pb2.EchoResponse(message="ab", user_fields=[self.padding]).SerializeToString()
        return interop_pb2.EchoResponse.FromString(raw.replace(b"\x0a\x02ab", b"\x0a\x02\xcf["))


@pytest.mark.parametrize("padding", ["", "p" * 5000], ids=["small", "over-4KiB"])
@pytest.mark.parametrize("protocol", ["baidu_std", "grpc"])
async def test_a_reply_with_a_bad_string_fails_its_call_eresponse(protocol, padding):
    srv = aiobrpc.Server()
    srv.add_service(BadReplyEcho(padding))
    await srv.start("127.0.0.1:0")
    try:
        async with aiobrpc.Channel(f"127.0.0.1:{srv.port}",
                                   aiobrpc.ChannelOptions(protocol=protocol, max_retry=0)) as ch:
            with pytest.raises(aiobrpc.RpcError) as ei:
                await ch.call_method(SVC, "Echo", Req(message="x"), interop_pb2.EchoResponse)
            assert ei.value.code == errors.ERESPONSE
            assert "string field message is not UTF-8" in ei.value.text
    finally:
        await srv.stop()
        await srv.join(timeout=2)
