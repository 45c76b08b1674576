"""Harness: a baidu_std server connection (bytes in -> replies and closes out).

Input: a control byte (fuzz/_harness.control; bit 4: the server has an authenticator; bit 5: the
rest is *structured*), then either the client's raw bytes, or a recipe of frames decoded by
`frames()`: valid PRPC/STRM framing around fuzzed metas (built with plain protobuf), fuzzed
request messages, real compression and checksums, so the fuzzer gets past the framing into
dispatch, decompression, user fields, authentication and stream settings.

    python -m fuzz.baidu_server fuzz/corpus/baidu_server -max_total_time=60
"""

from __future__ import annotations

import gzip
import struct
import zlib

from fuzz import _harness as H
from fuzz import _server

with H.instrumented():
    import cramjam
    import crc32c
    from aiobrpc._proto import interop_pb2

SERVICES = ("interop.EchoService", "EchoService", "grpc.health.v1.Health", "", "x.Nope", "interop.EchoServic")
METHODS = ("Echo", "StartStream", "Check", "", "Nope")
CREDENTIALS = (b"secret", b"async-secret", b"", b"wrong")


def _compress(ctype: int, data: bytes) -> bytes:
    if ctype == 1:
        return bytes(cramjam.snappy.compress_raw(data))
    if ctype == 2:
        return gzip.compress(data, mtime=0)
    if ctype == 3:
        return zlib.compress(data)
    return data


def request_message(p: H._Provider) -> bytes:
    if p.byte() % 4 == 0:
        return p.blob(300)  # bytes that may not parse
    m = interop_pb2.EchoRequest(message=p.blob(40).decode("utf-8", "replace"))
    flags = p.byte()
    if flags & 1:
        m.sleep_ms = p.int_in(0, 6)
    if flags & 2:
        m.fail_code = p.int_in(-2, 3000) if p.bool() else p.int_in(-(1 << 31), (1 << 31) - 1)
        m.fail_text = p.blob(20).decode("utf-8", "replace")
    if flags & 4:
        m.response_compress_type = p.int_in(-1, 5)
    if flags & 8:
        m.echo_attachment = p.bool()
    if flags & 16:
        m.response_attachment_size = p.int_in(0, 70000)
    if flags & 32:
        m.close_connection = True
    if flags & 64:
        m.payload = p.blob(200)
    return m.SerializeToString()


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1  # negative: two's complement, as protobuf writes int64
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def vf(field: int, v: int) -> bytes:
    """A varint field (written by hand: any value, any order, no validation)."""
    return _varint(field << 3) + _varint(v)


def lf(field: int, b: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(b)) + b


def _text(p: H._Provider, n: int) -> bytes:
    return p.blob(n)


def stream_settings(p: H._Provider, stream_id: int | None = None) -> bytes:
    if p.byte() % 8 == 0:
        return p.blob(10)
    out = vf(1, stream_id if stream_id is not None else p.int_in(0, 1 << 33))
    if p.bool():
        out += vf(2, 1)
    if p.byte() % 4:
        out += vf(3, 1)
    for _ in range(p.int_in(0, 2) if p.byte() % 4 == 0 else 0):
        out += vf(4, p.int_in(0, 1 << 33))
    return out


def prpc(p: H._Provider, cid: int, message=None, settings: bytes | None = None) -> bytes:
    """A PRPC request frame with a fuzzed meta; `message` (bytes) and `settings` fixed if given."""
    flags = p.byte() | (p.byte() << 8)
    meta = b""
    if not flags & 1:
        req = lf(1, p.pick(SERVICES).encode() if p.byte() % 8 else _text(p, 30))
        req += lf(2, p.pick(METHODS).encode() if p.byte() % 8 else _text(p, 10))
        if flags & 2:
            req += vf(3, p.int_in(0, (1 << 64) - 1))
        if flags & 4:
            req += vf(8, p.int_in(-5, 10000) if p.bool() else p.int_in(0, (1 << 64) - 1))
        if flags & 8:
            req += vf(4, p.int_in(0, 1 << 40)) + vf(5, p.int_in(0, 1 << 40)) + vf(6, p.int_in(0, 3))
            req += lf(7, _text(p, 8))
        meta += lf(1, req)
    else:
        meta += lf(2, vf(1, p.int_in(0, 2000)) + lf(2, _text(p, 10)))  # a response sent to the server (B7)
    meta += vf(4, cid if not flags & 16 else p.int_in(0, (1 << 64) - 1))
    body = request_message(p) if message is None else message
    att = p.blob(100) if flags & 32 else b""
    if flags & 64:
        ctype = p.int_in(0, 4) if p.byte() % 8 else p.int_in(0, (1 << 64) - 1)
        meta += vf(3, ctype)
        if not flags & 128:
            body = _compress(ctype, body)
    if flags & 256:
        meta += lf(7, p.pick(CREDENTIALS) if p.byte() % 8 else p.blob(20))
    if flags & 512:
        for _ in range(p.int_in(0, 5)):
            meta += lf(9, lf(1, _text(p, 10)) + lf(2, _text(p, 10)))
    if flags & 1024:
        meta += vf(10, p.int_in(0, 5))
    if flags & 2048:
        with_att = p.bool()
        meta += vf(11, p.int_in(0, 2)) + vf(13, int(with_att))
        covered = body + att if with_att else body
        meta += lf(12, struct.pack("<I", crc32c.crc32c(covered)) if p.bool() else p.blob(6))
    if settings is not None:
        meta += lf(8, settings)
    elif flags & 4096:
        meta += lf(8, stream_settings(p))
    if att:
        meta += vf(5, len(att) if p.byte() % 8 else p.int_in(-3, 300))
    if flags & 8192:
        meta += p.blob(12)  # whatever else: unknown fields, bad wire types, truncation
    payload = body + att
    return b"PRPC" + struct.pack(">II", len(meta) + len(payload), len(meta)) + meta + payload


def strm(p: H._Provider, stream_id: int | None = None, source_id: int | None = None) -> bytes:
    """A STRM frame; `stream_id` (the receiver's id) is used most of the time when given."""
    meta = vf(1, stream_id if stream_id is not None and p.byte() % 8 else p.int_in(0, 1 << 33))
    if p.byte() % 4:
        meta += vf(2, source_id if source_id is not None and p.byte() % 8 else p.int_in(0, 1 << 33))
    ftype = p.int_in(1, 4) if p.byte() % 16 else p.int_in(0, 100)
    meta += vf(3, ftype)
    if p.byte() % 4 == 0:
        meta += vf(4, 1)
    if ftype == 4 or p.byte() % 16 == 0:
        meta += lf(5, vf(1, p.int_in(0, 1 << 20) if p.byte() % 4 else p.int_in(-1, (1 << 64) - 1)))
    if p.byte() % 32 == 0:
        meta = p.blob(12)
    data = p.blob(200) if p.byte() % 16 else b"\0" * p.int_in(0, 300000)
    return b"STRM" + struct.pack(">II", len(meta) + len(data), len(meta)) + meta + data


def frames(p: H._Provider) -> bytes:
    out = []
    for i in range(p.int_in(1, 8)):
        kind = p.byte() % 16
        if kind < 11:
            out.append(prpc(p, i + 1))
        elif kind < 14:
            out.append(strm(p))
        elif kind == 14:  # a header with any sizes
            out.append(p.pick((b"PRPC", b"STRM", b"PRPX")) + struct.pack(">II", p.int_in(0, (1 << 32) - 1),
                                                                         p.int_in(0, (1 << 32) - 1)))
        else:
            out.append(p.blob(40))
    return b"".join(out)


def one_input(data: bytes) -> str:
    return _server.one_input(data, frames)


if __name__ == "__main__":
    H.fuzz_main(one_input)
