"""Harness: STRM frames on an accepted stream (stream.py, transport/streams.py,
protocol/streaming.py), at the server.

Each input opens a stream with a real StartStream request (whose stream settings the recipe
fuzzes), reads the server's reply to learn the id the server gave its stream, then sends the
recipe's STRM frames addressed to that id most of the time (DATA, FEEDBACK, CLOSE, RST, unknown
types, continuations, oversized messages, bad metas), mixed with unary requests. The server echoes
every message (FuzzEcho.StartStream) until the stream ends.

Input: a control byte (fuzz/_harness.control; bit 4: the server has an authenticator, the request
then carries the credential), then the recipe.

    python -m fuzz.stream fuzz/corpus/stream -max_total_time=60
"""

from __future__ import annotations

import struct

from fuzz import _harness as H
from fuzz import _server
from fuzz.baidu_server import lf, prpc, strm, vf

with H.instrumented():
    from aiobrpc._proto import brpc_meta_pb2, interop_pb2
    from aiobrpc.server.connection import ServerConnection

CLIENT_STREAM_ID = 7


def start_stream(p: H._Provider, auth: bool) -> bytes:
    settings = vf(1, CLIENT_STREAM_ID) + vf(2, int(p.byte() % 4 != 0)) + vf(3, int(p.byte() % 8 != 0))
    for i in range(p.int_in(0, 2) if p.byte() % 4 == 0 else 0):
        settings += vf(4, CLIENT_STREAM_ID + 1 + i)
    msg = interop_pb2.EchoRequest(message="open").SerializeToString()
    meta = lf(1, lf(1, b"interop.EchoService") + lf(2, b"StartStream")) + vf(4, 1) + lf(8, settings)
    if auth:
        meta += lf(7, b"secret")
    return b"PRPC" + struct.pack(">II", len(meta) + len(msg), len(meta)) + meta + msg


def server_stream_ids(out: bytes) -> list[int]:
    """The stream ids in the stream settings of the server's replies (the ids of its streams)."""
    ids = []
    pos = 0
    while pos + 12 <= len(out):
        body, meta_size = struct.unpack(">II", out[pos + 4:pos + 12])
        if out[pos:pos + 4] == b"STRM":  # a reply inside the offered stream (brpc's way): what it carries
            ids.extend(server_stream_ids(out[pos + 12 + meta_size:pos + 12 + body]))
        if out[pos:pos + 4] == b"PRPC":
            m = brpc_meta_pb2.RpcMeta.FromString(out[pos + 12:pos + 12 + meta_size])
            if m.HasField("stream_settings"):
                st = m.stream_settings
                ids.append(st.stream_id)
                ids.extend(st.extra_stream_ids)
        pos += 12 + body
    return ids


async def drive(data: bytes) -> str:
    chunk, eof, rest = H.control(data)
    auth = bool(data[0] & 16) if data else False
    p = H._Provider(rest)
    srv, servicer = await _server.server(auth)
    conn = ServerConnection(srv)
    t = H.FakeTransport(conn)
    conn.connection_made(t)
    ids: dict = {}
    try:
        await H.feed(conn, t, start_stream(p, auth), 0)
        await H.settle(lambda: conn.inflight == 0 or t.lost)
        server_ids = server_stream_ids(t.sent()) or [1 << 40]
        for sid in server_ids:
            ids.setdefault(sid, len(ids) + 1)
        frames = []
        for i in range(p.int_in(1, 16)):
            if p.byte() % 16 == 0:
                frames.append(prpc(p, 100 + i))
            else:
                frames.append(strm(p, p.pick(server_ids), CLIENT_STREAM_ID))
        await H.feed(conn, t, b"".join(frames), chunk)
    except H.Finding:
        raise
    except Exception as e:
        raise H.Finding(f"feeding the connection raised {e!r}") from e
    if not await H.settle(lambda: conn.inflight == 0 or t.lost):
        raise H.Finding(f"hang: {conn.inflight} requests still in flight after the input")
    open_streams = len(conn.streams) if conn.streams else 0
    if eof and not t.closed:
        if not conn.eof_received():
            t.close()
        if not await H.settle(lambda: t.closed):
            raise H.Finding(f"leak: open after EOF (inflight={conn.inflight})")
    end = "aborted" if t.aborted else "closed" if t.closed else "open"
    result = f"{end} streams_open={open_streams} " + "; ".join(H.baidu_frames(t.sent(), ids))
    t.peer_reset()
    if not await H.settle(lambda: conn not in srv.connections and not srv._tasks and not srv.concurrency
                          and not servicer.stream_tasks):
        raise H.Finding(f"leak: after the connection was lost: tasks={len(srv._tasks)}, "
                        f"concurrency={srv.concurrency}, stream tasks={len(servicer.stream_tasks)}")
    if conn.streams:
        raise H.Finding(f"leak: {len(conn.streams)} streams left in the connection's table")
    return result


def one_input(data: bytes) -> str:
    return H.run(drive, data)


if __name__ == "__main__":
    H.fuzz_main(one_input)
