"""Requests built through the public client path (Controller fields -> wire) are byte-identical
to what the C++ client sent in the captures; only the correlation id is copied."""

from __future__ import annotations

import asyncio

import pytest

import aiobrpc
from aiobrpc._proto import interop_pb2
from tests.helpers.interop_server import SERVICE
from tests.helpers.peers import FakeServer
from tests.helpers.wire import load_golden


def _first_request(name: str) -> tuple[dict, bytes]:
    cap = load_golden(name)
    fr = next(f for f in cap["frames"] if f["dir"] == "c2s")
    stream = bytes.fromhex(cap["c2s_hex"])
    return fr, stream[fr["offset"]:fr["offset"] + fr["length"]]


class _Cred:
    def generate_credential(self) -> bytes:
        return b"golden-credential"


CASES = {
    "basic_log_id": dict(log_id=12345),
    "attachment_4k": dict(attachment=True),
    "checksum_crc32c": dict(attachment=True, checksum=True),
    "checksum_crc32c_attachment": dict(attachment=True, checksum=True, with_attachment=True),
    "user_fields": dict(user_fields=True),
    "auth_success": dict(auth=True),
    "request_compress_gzip": dict(compress=2),
    "request_compress_zlib": dict(compress=3),
}


@pytest.mark.parametrize("name", sorted(CASES))
async def test_client_writes_cxx_bytes(name):
    case = CASES[name]
    fr, expected = _first_request(name)
    got = bytearray()
    async with FakeServer(lambda w, d: got.extend(d)) as peer:
        opts = aiobrpc.ChannelOptions(timeout_ms=200, max_retry=0,
                                      auth=_Cred() if case.get("auth") else None)
        channel = aiobrpc.Channel(f"127.0.0.1:{peer.port}", opts)
        await channel.connect()
        conn = channel._conn
        conn._next_cid = fr["meta_decoded"]["correlation_id"]
        cntl = aiobrpc.Controller(log_id=case.get("log_id"), max_retry=0)
        payload = bytes.fromhex(fr["payload_hex"])
        if case.get("attachment"):
            cntl.request_attachment = payload[len(payload) - fr["attachment_size"]:]
        if case.get("checksum"):
            cntl.request_checksum = True
            cntl.request_checksum_with_attachment = bool(case.get("with_attachment"))
        if case.get("user_fields"):
            for k, v in fr["meta_decoded"]["user_fields"]:
                cntl.request_user_fields[k] = v
        cntl.request_compress_type = case.get("compress", 0)
        request = interop_pb2.EchoRequest(**{k: bytes.fromhex(v) if k == "payload" else v
                                             for k, v in fr["data_decoded"].items()})
        with pytest.raises(aiobrpc.RpcError) as ei:
            await aiobrpc.Stub(channel, SERVICE).Echo(request, cntl)
        assert ei.value.code == aiobrpc.errors.ERPCTIMEDOUT
        await channel.close()
    assert bytes(got) == expected
