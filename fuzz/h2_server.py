"""Harness: HTTP/2 / gRPC server sessions (server/grpc/session.py and call.py) through the same
ServerConnection as baidu_server: bytes starting with the HTTP/2 client preface.

Input: a control byte (fuzz/_harness.control; bit 4: the server has an authenticator; bit 5: the
rest is *structured*), then the client's raw bytes (the preface is put in front when they lack
it), or a recipe decoded by `conversation()`: the preface, then HTTP/2 frames (HEADERS of gRPC
calls encoded with hpack, DATA with length-prefixed messages, optionally gzip, WINDOW_UPDATE,
RST_STREAM, PING, SETTINGS, PRIORITY, GOAWAY, CONTINUATION, and frames of any type and flags).

    python -m fuzz.h2_server fuzz/corpus/h2_server -max_total_time=60
"""

from __future__ import annotations

import gzip
import struct

from fuzz import _harness as H
from fuzz import _server

with H.instrumented():
    import hpack
    from aiobrpc._proto import interop_pb2

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
PATHS = ("/interop.EchoService/Echo", "/interop.EchoService/StartStream", "/grpc.health.v1.Health/Check",
         "/grpc.health.v1.Health/Watch", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
         "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", "/status", "/x/y", "/", "")
TIMEOUTS = ("1S", "100m", "5u", "0n", "99999999H", "x", "-1S", "10M")


def frame(typ: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([typ & 0xFF, flags & 0xFF]) + \
        (stream & 0xFFFFFFFF).to_bytes(4, "big") + payload


def grpc_message(p: H._Provider) -> bytes:
    if p.byte() % 8 == 0:
        msg = p.blob(100)
    else:
        m = interop_pb2.EchoRequest(message=p.blob(20).decode("utf-8", "replace"))
        f = p.byte()
        if f & 1:
            m.sleep_ms = p.int_in(0, 6)
        if f & 2:
            m.fail_code = p.int_in(0, 3000)
        if f & 4:
            m.payload = p.blob(100)
        if f & 8:
            m.close_connection = True
        msg = m.SerializeToString()
    compressed = p.byte() % 4 == 0
    if compressed:
        msg = gzip.compress(msg, mtime=0)
    length = len(msg) if p.byte() % 16 else p.int_in(0, (1 << 32) - 1)
    return bytes([int(compressed) if p.byte() % 16 else p.byte()]) + struct.pack(">I", length) + msg


def headers(p: H._Provider, enc: hpack.Encoder) -> bytes:
    hs = [(":method", "POST" if p.byte() % 8 else p.pick(("GET", "PUT", ""))),
          (":scheme", "http"), (":path", p.pick(PATHS)), (":authority", "fuzz")]
    f = p.byte()
    if not f & 1:
        hs.append(("content-type", "application/grpc" if p.byte() % 8 else
                   p.pick(("application/grpc+proto", "application/grpc+json", "text/plain", "application/json"))))
    if not f & 2:
        hs.append(("te", "trailers"))
    if f & 4:
        hs.append(("grpc-timeout", p.pick(TIMEOUTS)))
    if f & 8:
        hs.append(("grpc-encoding", p.pick(("gzip", "identity", "deflate", "snappy", "br"))))
    if f & 16:
        hs.append(("authorization", p.pick(("secret", "async-secret", "wrong", ""))))
    if f & 32:
        hs.append((p.pick(("x-user", "x-bin", "grpc-accept-encoding", "x-Upper", ":bogus", "connection")),
                   p.blob(10).decode("latin-1")))
    if f & 64:
        hs = hs[p.int_in(0, len(hs) - 1):]  # pseudo-headers missing or out of order
    try:
        return enc.encode(hs)
    except Exception:  # noqa: BLE001 - a header hpack cannot encode: raw bytes instead
        return p.blob(20)


def conversation(p: H._Provider) -> bytes:
    enc = hpack.Encoder()
    out = [PREFACE]
    if p.byte() % 8:
        out.append(frame(4, 0, 0, b""))  # the client's SETTINGS
    else:
        out.append(frame(4, p.byte(), p.int_in(0, 3), p.blob(24)))
    streams = [1]
    for _ in range(p.int_in(1, 12)):
        kind = p.byte() % 16
        sid = p.pick(streams) if p.byte() % 8 else p.int_in(0, 1 << 31)
        if kind < 4:  # a new call
            sid = streams[-1] + 2 if p.byte() % 8 else sid
            streams.append(sid)
            block = headers(p, enc)
            end_stream = p.byte() % 8 == 0
            if p.byte() % 8 == 0 and len(block) > 1:  # split into HEADERS + CONTINUATION
                cut = p.int_in(1, len(block) - 1)
                out.append(frame(1, 1 if end_stream else 0, sid, block[:cut]))
                out.append(frame(9, 4, sid, block[cut:]))
            else:
                out.append(frame(1, 4 | (1 if end_stream else 0), sid, block))
        elif kind < 8:  # DATA
            body = grpc_message(p)
            if p.byte() % 8 == 0:
                body += grpc_message(p)
            out.append(frame(0, 1 if p.byte() % 4 else 0, sid, body))
        elif kind == 8:  # trailers / headers ending the stream
            out.append(frame(1, 5, sid, headers(p, enc)))
        elif kind == 9:
            out.append(frame(8, 0, sid if p.bool() else 0, struct.pack(">I", p.int_in(0, (1 << 32) - 1))))
        elif kind == 10:
            out.append(frame(3, 0, sid, struct.pack(">I", p.int_in(0, 14))))
        elif kind == 11:
            out.append(frame(6, p.int_in(0, 1), 0, p.bytes(8).ljust(8, b"\0")))
        elif kind == 12:
            settings = b"".join(struct.pack(">HI", p.int_in(0, 9), p.int_in(0, (1 << 32) - 1))
                                for _ in range(p.int_in(0, 3)))
            out.append(frame(4, p.int_in(0, 1), 0, settings))
        elif kind == 13:
            out.append(frame(2, 0, sid, struct.pack(">IB", p.int_in(0, 1 << 31), p.byte())))
        elif kind == 14:
            out.append(frame(7, 0, 0, struct.pack(">II", p.int_in(0, 1 << 31), p.int_in(0, 14)) + p.blob(8)))
        else:  # any frame
            out.append(frame(p.byte() % 12, p.byte(), sid, p.blob(40)))
        if p.byte() % 32 == 0:  # a flood of small control frames (H2 flood rows)
            out.append(frame(6, 0, 0, b"\0" * 8) * p.int_in(1, 2000))
    return b"".join(out)


def one_input(data: bytes) -> str:
    chunk, eof, body = H.control(data)
    auth = bool(data[0] & 16) if data else False
    if data and data[0] & 32:
        body = conversation(H._Provider(body))
    elif not body.startswith(PREFACE[:len(body)]) or len(body) < len(PREFACE):
        body = PREFACE + body
    return H.run(lambda _: _server.drive(body, auth, chunk, eof), data)


if __name__ == "__main__":
    H.fuzz_main(one_input)
