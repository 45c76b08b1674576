"""Harness: the gRPC client (client/grpc_connection.py, protocol/grpc.py): a server's HTTP/2
bytes against 1-3 unary calls in flight on one connection (streams 1, 3, 5).

Input: a control byte (fuzz/_harness.control: bits 0-2 the server's write size, bit 3 reset
instead of close at the end; bit 5: the rest is *structured*), a byte giving the number of calls,
then the server's raw bytes, or a recipe decoded by `replies()`: the server's SETTINGS, then
per call HEADERS (:status, content-type, grpc-encoding), DATA with length-prefixed messages
(gzip or not, lengths true or not), trailers (grpc-status, grpc-message), mixed with RST_STREAM,
GOAWAY, WINDOW_UPDATE, PING, SETTINGS, PUSH_PROMISE and frames of any type.

    python -m fuzz.grpc_client fuzz/corpus/grpc_client -max_total_time=60
"""

from __future__ import annotations

import gzip
import struct

from fuzz import _client
from fuzz import _harness as H
from fuzz.h2_server import frame

with H.instrumented():
    import hpack
    from aiobrpc._proto import interop_pb2

STATUSES = ("200", "200", "200", "404", "500", "503", "429", "abc", "")
CTYPES = ("application/grpc", "application/grpc", "application/grpc+proto", "text/html", "application/json", "")


def message(p: H._Provider) -> bytes:
    if p.byte() % 8 == 0:
        msg = p.blob(100)
    else:
        msg = interop_pb2.EchoResponse(message=p.blob(10).decode("utf-8", "replace")).SerializeToString()
    flag = 0
    if p.byte() % 4 == 0:
        msg, flag = gzip.compress(msg, mtime=0), 1
    length = len(msg) if p.byte() % 16 else p.int_in(0, (1 << 32) - 1)
    return bytes([flag if p.byte() % 16 else p.byte()]) + struct.pack(">I", length) + msg


def header_block(p: H._Provider, enc: hpack.Encoder, trailers: bool) -> bytes:
    hs = []
    if not trailers or p.byte() % 8 == 0:
        hs += [(":status", p.pick(STATUSES)), ("content-type", p.pick(CTYPES))]
        if p.byte() % 4 == 0:
            hs.append(("grpc-encoding", p.pick(("gzip", "identity", "deflate", "zstd"))))
    if trailers or p.byte() % 8 == 0:
        code = p.pick(("0", "0", "1", "2", "4", "8", "13", "14", "16", "99", "-1", "x", ""))
        hs.append(("grpc-status", code))
        if p.bool():
            hs.append(("grpc-message", p.pick(("", "boom", "%E4%BD%A0", "%zz", "a" * 300))))
    if p.byte() % 8 == 0:
        hs.append((p.pick(("x-user", "x-bin", "grpc-status-details-bin", ":path")), p.blob(10).decode("latin-1")))
    try:
        return enc.encode(hs)
    except Exception:  # noqa: BLE001 - what hpack will not encode: raw bytes instead
        return p.blob(20)


def replies(p: H._Provider, ncalls: int) -> bytes:
    enc = hpack.Encoder()
    out = [frame(4, 0, 0, b"" if p.byte() % 8 else b"".join(
        struct.pack(">HI", p.int_in(0, 9), p.int_in(0, (1 << 32) - 1)) for _ in range(p.int_in(1, 3))))]
    out.append(frame(4, 1, 0, b""))  # ACK of the client's SETTINGS
    for _ in range(p.int_in(1, 10)):
        kind = p.byte() % 16
        sid = 2 * p.int_in(0, ncalls - 1) + 1 if p.byte() % 8 else p.int_in(0, 1 << 31)
        if kind < 4:
            out.append(frame(1, 4 | (1 if p.byte() % 16 == 0 else 0), sid, header_block(p, enc, False)))
        elif kind < 8:
            out.append(frame(0, 1 if p.byte() % 8 == 0 else 0, sid, message(p)))
        elif kind < 11:
            out.append(frame(1, 5, sid, header_block(p, enc, True)))
        elif kind == 11:
            out.append(frame(3, 0, sid, struct.pack(">I", p.int_in(0, 14))))
        elif kind == 12:
            out.append(frame(7, 0, 0, struct.pack(">II", p.int_in(0, 7), p.int_in(0, 14)) + p.blob(8)))
        elif kind == 13:
            out.append(frame(8, 0, sid if p.bool() else 0, struct.pack(">I", p.int_in(0, (1 << 31) - 1))))
        elif kind == 14:
            out.append(frame(p.pick((6, 4, 5, 2)), p.int_in(0, 1), 0 if p.bool() else sid, p.blob(12)))
        else:
            out.append(frame(p.byte() % 12, p.byte(), sid, p.blob(30)))
    return b"".join(out)


def one_input(data: bytes) -> str:
    chunk, reset, rest = H.control(data)
    ctl = data[0] if data else 0
    ncalls = (rest[0] % 3 + 1) if rest else 1
    rest = rest[1:]
    if ctl & 32:
        rest = replies(H._Provider(rest), ncalls)
    return H.run(lambda _: _client.drive(rest, chunk, reset, ncalls, "grpc"), data)


if __name__ == "__main__":
    H.fuzz_main(one_input)
