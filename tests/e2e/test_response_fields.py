"""What a message carried, as the controller reports it (C++ brpc's response_compress_type,
response_checksum_type, response_checksum_attachment and their request twins), and the response
checksum a handler chooses: with or without the attachment, checked on the bytes and by the client."""

from __future__ import annotations

import asyncio
import contextlib
import struct

import crc32c
import pytest

import aiobrpc
from aiobrpc import errors
from aiobrpc._proto import brpc_meta_pb2, interop_pb2
from aiobrpc.protocol import checksum, compress
from tests.helpers.interop_server import SERVICE
from tests.helpers.peers import FakeServer
from tests.helpers.wire import frame, load_golden, rpc_meta

Req = interop_pb2.EchoRequest
Resp = interop_pb2.EchoResponse
SVC = "interop.EchoService"
ATTACHMENT = b"response attachment"
DEFAULT = None  # the handler leaves response_checksum_with_attachment alone


def masked_crc32c(*parts: bytes) -> bytes:
    """brpc's checksum_value, computed without aiobrpc: LevelDB-masked CRC-32C, big-endian."""
    crc = 0
    for part in parts:
        crc = crc32c.crc32c(part, crc)
    crc = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    return crc.to_bytes(4, "big")


def split_frame(raw: bytes) -> tuple[bytes, brpc_meta_pb2.RpcMeta, bytes, bytes]:
    """(meta bytes, meta parsed by protobuf, data, attachment) of one PRPC frame."""
    body_size, meta_size = struct.unpack(">II", raw[4:12])
    meta_bytes = raw[12:12 + meta_size]
    payload = raw[12 + meta_size:12 + body_size]
    meta = brpc_meta_pb2.RpcMeta.FromString(meta_bytes)
    cut = len(payload) - meta.attachment_size
    return meta_bytes, meta, payload[:cut], payload[cut:]


async def one_reply(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        head = await asyncio.wait_for(reader.readexactly(12), 2)
        body_size = struct.unpack(">I", head[4:8])[0]
        return head + await asyncio.wait_for(reader.readexactly(body_size), 2)
    finally:
        writer.close()


class ChosenChecksum(aiobrpc.Servicer):
    """Echo whose handler sets the response's compress and checksum, and notes what each
    request carried."""

    SERVICE = SERVICE

    def __init__(self, checksum_type=checksum.NONE, with_attachment=DEFAULT, compress_type=compress.NONE):
        self.checksum_type = checksum_type
        self.with_attachment = with_attachment
        self.compress_type = compress_type
        self.seen: list[tuple[int, int, bool]] = []

    async def Echo(self, request, cntl):
        self.seen.append((cntl.request_compress_type, cntl.request_checksum_type,
                          cntl.request_checksum_with_attachment))
        cntl.response_compress_type = self.compress_type
        cntl.response_checksum_type = self.checksum_type
        if self.with_attachment is not DEFAULT:
            cntl.response_checksum_with_attachment = self.with_attachment
        cntl.response_attachment = ATTACHMENT
        return Resp(message=request.message)


@contextlib.asynccontextmanager
async def serving(servicer):
    server = aiobrpc.Server()
    server.add_service(servicer)
    await server.start("127.0.0.1:0")
    try:
        yield server
    finally:
        await server.stop()
        await server.join(timeout=2)


@contextlib.asynccontextmanager
async def stub_to(port: int):
    channel = aiobrpc.Channel(f"127.0.0.1:{port}", aiobrpc.ChannelOptions(timeout_ms=2000, max_retry=0))
    try:
        yield aiobrpc.Stub(channel, SERVICE)
    finally:
        await channel.close()


def response_readouts(cntl) -> tuple[int, int, bool]:
    return cntl.response_compress_type, cntl.response_checksum_type, cntl.response_checksum_with_attachment


# --- the client reads what the response carried ------------------------------------------------

@pytest.mark.parametrize("ctype", [compress.NONE, compress.SNAPPY, compress.GZIP, compress.ZLIB])
async def test_client_reads_response_compress_type(interop, ctype):
    server, _ = interop
    async with stub_to(server.port) as stub:
        cntl = aiobrpc.Controller()
        resp = await stub.Echo(Req(message="z" * 300, response_compress_type=ctype), cntl)
    assert resp.message == "z" * 300
    assert response_readouts(cntl) == (ctype, checksum.NONE, False)


@pytest.mark.parametrize("name,want", [
    ("response_compress_snappy", (compress.SNAPPY, checksum.NONE, False)),
    ("response_compress_gzip", (compress.GZIP, checksum.NONE, False)),
    ("response_compress_zlib", (compress.ZLIB, checksum.NONE, False)),
    ("checksum_crc32c", (compress.NONE, checksum.NONE, False)),  # C++ echoes the request's value, type 0
    ("checksum_crc32c_response", (compress.NONE, checksum.CRC32C, True)),
])
async def test_client_reads_what_a_cxx_server_sent(name, want):
    """The C++ server's captured reply, fed to our client: it verifies it and reports its meta."""
    cap = load_golden(name)
    reply = next(f for f in cap["frames"] if f["dir"] == "s2c")
    s2c = bytes.fromhex(cap["s2c_hex"])[reply["offset"]:reply["offset"] + reply["length"]]
    async with FakeServer(lambda writer, data: writer.write(s2c)) as peer:
        channel = aiobrpc.Channel(f"127.0.0.1:{peer.port}", aiobrpc.ChannelOptions(timeout_ms=2000, max_retry=0))
        await channel.connect()
        channel._conn._next_cid = reply["meta_decoded"]["correlation_id"]
        cntl = aiobrpc.Controller()
        resp = await aiobrpc.Stub(channel, SERVICE).Echo(Req(message="x"), cntl)
        await channel.close()
    assert resp.message == reply["data_decoded"]["message"]
    assert response_readouts(cntl) == want
    assert len(cntl.response_attachment) == reply["attachment_size"]


# --- the handler chooses the response checksum; the bytes show it -------------------------------

@pytest.mark.parametrize("ctype,with_attachment,ztype", [
    (checksum.CRC32C, DEFAULT, compress.NONE),   # C++ default: the data only
    (checksum.CRC32C, False, compress.NONE),
    (checksum.CRC32C, True, compress.NONE),
    (checksum.CRC32C, True, compress.GZIP),      # over the compressed data, then the attachment
    (checksum.NONE, True, compress.NONE),        # C++ writes the flag even without a checksum
    (checksum.NONE, DEFAULT, compress.NONE),
])
async def test_response_checksum_on_the_wire(ctype, with_attachment, ztype):
    servicer = ChosenChecksum(ctype, with_attachment, ztype)
    request_data = Req(message="wire").SerializeToString()
    request_att = b"request attachment"
    request_value = masked_crc32c(request_data, request_att)
    # The request's checksum covers its attachment: the response's coverage must not follow it.
    request = frame(rpc_meta(SVC, "Echo", correlation_id=7, attachment_size=len(request_att),
                             checksum_type=checksum.CRC32C, checksum_value=request_value,
                             checksum_with_attachment=True), request_data + request_att)
    async with serving(servicer) as server:
        raw = await one_reply(server.port, request)
    meta_bytes, meta, data, attachment = split_frame(raw)
    covers = with_attachment is True
    assert meta.response.error_code == 0 and attachment == ATTACHMENT
    assert meta.compress_type == ztype and meta.checksum_type == ctype
    assert meta.HasField("checksum_with_attachment") == covers
    if covers:
        assert meta_bytes.endswith(b"\x68\x01")  # field 13, true, written last as C++ does
    if ctype:
        assert meta.checksum_value == (masked_crc32c(data, attachment) if covers else masked_crc32c(data))
    else:
        assert meta.checksum_value == request_value  # C++ echoes the request's value
    assert servicer.seen == [(compress.NONE, checksum.CRC32C, True)]


@pytest.mark.parametrize("ztype", [compress.NONE, compress.SNAPPY])
@pytest.mark.parametrize("with_attachment", [False, True])
async def test_client_verifies_the_checksum_the_handler_chose(ztype, with_attachment):
    async with serving(ChosenChecksum(checksum.CRC32C, with_attachment, ztype)) as server:
        async with stub_to(server.port) as stub:
            cntl = aiobrpc.Controller()
            resp = await stub.Echo(Req(message="both ways"), cntl)
    assert resp.message == "both ways" and bytes(cntl.response_attachment) == ATTACHMENT
    assert response_readouts(cntl) == (ztype, checksum.CRC32C, with_attachment)


@pytest.mark.parametrize("ztype", [compress.NONE, compress.ZLIB])
@pytest.mark.parametrize("ctype", [checksum.NONE, checksum.CRC32C])
@pytest.mark.parametrize("with_attachment", [False, True])
async def test_handler_sees_what_the_request_carried(ztype, ctype, with_attachment):
    servicer = ChosenChecksum()
    async with serving(servicer) as server:
        async with stub_to(server.port) as stub:
            cntl = aiobrpc.Controller(request_compress_type=ztype, request_attachment=b"req att")
            cntl.request_checksum_type = ctype
            cntl.request_checksum_with_attachment = with_attachment
            await stub.Echo(Req(message="seen"), cntl)
    assert servicer.seen == [(ztype, ctype, with_attachment)]
    assert response_readouts(cntl) == (compress.NONE, checksum.NONE, False)


# --- a crafted reply: the client checks exactly what the meta says is covered -------------------

def crafted_reply(cid: int, with_attachment: bool, corrupt: str | None) -> bytes:
    data = Resp(message="crafted").SerializeToString()
    value = masked_crc32c(data, ATTACHMENT) if with_attachment else masked_crc32c(data)
    attachment = ATTACHMENT
    if corrupt == "checksum":
        value = bytes([value[0] ^ 0xFF]) + value[1:]
    elif corrupt == "data":
        data = Resp(message="crafteD").SerializeToString()
    elif corrupt == "attachment":
        attachment = b"R" + ATTACHMENT[1:]
    fields = dict(checksum_with_attachment=True) if with_attachment else {}
    meta = rpc_meta(None, None, correlation_id=cid, error_code=0, attachment_size=len(attachment),
                    checksum_type=checksum.CRC32C, checksum_value=value, **fields)
    return frame(meta, data + attachment)


def answering(with_attachment: bool, corrupt: str | None):
    def on_data(writer, data):
        meta_size = struct.unpack(">I", data[8:12])[0]
        cid = brpc_meta_pb2.RpcMeta.FromString(data[12:12 + meta_size]).correlation_id
        writer.write(crafted_reply(cid, with_attachment, corrupt))
    return on_data


@pytest.mark.parametrize("with_attachment", [False, True])
@pytest.mark.parametrize("corrupt", [None, "checksum", "data", "attachment"])
async def test_client_checks_a_crafted_response_checksum(with_attachment, corrupt):
    fails = corrupt in ("checksum", "data") or (corrupt == "attachment" and with_attachment)
    async with FakeServer(answering(with_attachment, corrupt)) as peer:
        async with stub_to(peer.port) as stub:
            cntl = aiobrpc.Controller()
            if fails:
                with pytest.raises(aiobrpc.RpcError) as ei:
                    await stub.Echo(Req(message="x"), cntl)
                assert ei.value.code == errors.ERESPONSE and "crc32c checksum mismatch" in ei.value.text
            else:
                assert (await stub.Echo(Req(message="x"), cntl)).message == "crafted"
    # Recorded before the check, as C++ brpc: a reply that failed it still shows what it declared.
    assert response_readouts(cntl) == (compress.NONE, checksum.CRC32C, with_attachment)


# --- defaults and the controller API ------------------------------------------------------------

async def test_readouts_are_per_call_and_unset_by_an_error_reply(interop):
    server, _ = interop
    async with stub_to(server.port) as stub:
        cntl = aiobrpc.Controller(request_attachment=b"a")
        cntl.request_user_fields["x-interop-response-checksum"] = "crc32c+attachment"
        await stub.Echo(Req(message="1", response_compress_type=compress.GZIP), cntl)
        assert response_readouts(cntl) == (compress.GZIP, checksum.CRC32C, True)
        with pytest.raises(aiobrpc.RpcError):
            await stub.Echo(Req(message="2", fail_code=1234), cntl)
        assert response_readouts(cntl) == (compress.NONE, checksum.NONE, False)  # C++: set on success only
        cntl.request_user_fields = {}
        await stub.Echo(Req(message="3"), cntl)
        assert response_readouts(cntl) == (compress.NONE, checksum.NONE, False)


async def test_request_flag_is_written_without_an_attachment():
    """As C++ PackRpcRequest: checksum_with_attachment goes whenever it is set."""
    got = bytearray()
    async with FakeServer(lambda writer, data: got.extend(data)) as peer:
        async with stub_to(peer.port) as stub:
            cntl = aiobrpc.Controller(request_checksum=True, request_checksum_with_attachment=True, timeout_ms=100)
            with pytest.raises(aiobrpc.RpcError):
                await stub.Echo(Req(message="no att"), cntl)
    meta_bytes, meta, data, attachment = split_frame(bytes(got))
    assert attachment == b"" and meta.checksum_with_attachment and meta_bytes.endswith(b"\x68\x01")
    assert meta.checksum_value == masked_crc32c(data)


async def test_unknown_checksum_types_are_refused_on_send():
    async with serving(ChosenChecksum(checksum_type=7)) as server:
        async with stub_to(server.port) as stub:
            with pytest.raises(aiobrpc.RpcError) as ei:
                await stub.Echo(Req(message="x"))
            assert ei.value.code == errors.ERESPONSE and "unknown checksum type 7" in ei.value.text
            cntl = aiobrpc.Controller()
            cntl.request_checksum_type = 7
            with pytest.raises(aiobrpc.RpcError) as ei:
                await stub.Echo(Req(message="x"), cntl)
            assert ei.value.code == errors.EREQUEST and "unknown checksum type 7" in ei.value.text


def test_controller_defaults_and_bool_aliases():
    cntl = aiobrpc.Controller()
    assert cntl.request_compress_type == cntl.request_checksum_type == 0 and not cntl.request_checksum_with_attachment
    assert response_readouts(cntl) == (0, 0, False)
    assert not cntl.request_checksum and not cntl.response_checksum
    cntl.response_checksum = True
    assert cntl.response_checksum_type == checksum.CRC32C and not cntl.response_checksum_with_attachment
    cntl.response_checksum = False
    assert cntl.response_checksum_type == checksum.NONE
    assert aiobrpc.Controller(request_checksum=True).request_checksum_type == checksum.CRC32C
