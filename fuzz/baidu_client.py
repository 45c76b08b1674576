"""Harness: the baidu_std client (client/connection.py, client/call.py, the response side of the
codec and of streams): a server's bytes against 1-3 calls in flight on one connection.

Input: a control byte (fuzz/_harness.control: bits 0-2 the server's write size, bit 3 reset
instead of close at the end, bit 4 one call offers a stream; bit 5: the rest is *structured*),
a byte giving the number of calls, then the server's raw bytes, or a recipe decoded by
`responses()`: response frames for correlation ids 1..3 (those the calls get) or any, with fuzzed
error codes and texts, compression (real or not), checksums, attachments, user fields, stream
settings, and STRM frames.

    python -m fuzz.baidu_client fuzz/corpus/baidu_client -max_total_time=60
"""

from __future__ import annotations

import struct

from fuzz import _client
from fuzz import _harness as H
from fuzz.baidu_server import _compress, lf, stream_settings, strm, vf

with H.instrumented():
    import crc32c
    from aiobrpc._proto import interop_pb2


def response_message(p: H._Provider) -> bytes:
    if p.byte() % 4 == 0:
        return p.blob(200)
    m = interop_pb2.EchoResponse(message=p.blob(20).decode("utf-8", "replace"))
    if p.bool():
        m.calls_served = p.int_in(0, 1 << 40)
        m.user_fields.append(p.blob(10).decode("utf-8", "replace"))
    return m.SerializeToString()


def response(p: H._Provider, ncalls: int) -> bytes:
    flags = p.byte() | (p.byte() << 8)
    cid = p.int_in(1, ncalls) if not flags & 1 else p.int_in(0, (1 << 64) - 1)
    meta = b""
    if not flags & 2:
        code = 0 if p.byte() % 4 else p.int_in(-1, 3000) if p.bool() else p.int_in(0, (1 << 64) - 1)
        resp = vf(1, code) if code or p.bool() else b""
        if code or flags & 4:
            resp += lf(2, p.blob(40) if p.byte() % 32 else b"x" * p.int_in(0, 1 << 20))  # J3
        meta += lf(2, resp)
    if flags & 8:
        meta += lf(1, lf(1, b"interop.EchoService") + lf(2, b"Echo"))  # a request part in a reply
    meta += vf(4, cid)
    body = response_message(p)
    att = p.blob(100) if flags & 16 else b""
    if flags & 32:
        ctype = p.int_in(0, 4)
        meta += vf(3, ctype)
        if p.byte() % 4:
            body = _compress(ctype, body)
    if flags & 64:
        for _ in range(p.int_in(0, 4)):
            meta += lf(9, lf(1, p.blob(8)) + lf(2, p.blob(8)))
    if flags & 128:
        with_att = p.bool()
        meta += vf(11, p.int_in(0, 2)) + vf(13, int(with_att))
        covered = body + att if with_att else body
        meta += lf(12, struct.pack("<I", crc32c.crc32c(covered)) if p.bool() else p.blob(6))
    if flags & 256:
        meta += lf(8, stream_settings(p))
    if att:
        meta += vf(5, len(att) if p.byte() % 8 else p.int_in(-3, 300))
    if flags & 512:
        meta += vf(10, p.int_in(0, 5))
    if flags & 1024:
        meta += p.blob(10)
    payload = body + att
    return b"PRPC" + struct.pack(">II", len(meta) + len(payload), len(meta)) + meta + payload


def responses(p: H._Provider, ncalls: int) -> bytes:
    out = []
    for _ in range(p.int_in(1, 6)):
        kind = p.byte() % 16
        if kind < 12:
            out.append(response(p, ncalls))
        elif kind < 15:
            out.append(strm(p, None, None))
        else:
            out.append(p.blob(30))
    return b"".join(out)


def one_input(data: bytes) -> str:
    chunk, reset, rest = H.control(data)
    ctl = data[0] if data else 0
    ncalls = (rest[0] % 3 + 1) if rest else 1
    rest = rest[1:]
    if ctl & 32:
        rest = responses(H._Provider(rest), ncalls)
    return H.run(lambda _: _client.drive(rest, chunk, reset, ncalls, "baidu_std",
                                         streams=1 if ctl & 16 else 0), data)


if __name__ == "__main__":
    H.fuzz_main(one_input)
