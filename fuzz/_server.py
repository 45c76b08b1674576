"""The server side of the harnesses: a real `aiobrpc.Server` (started on the in-memory host, so
its start-up runs as it does for TCP, without a socket) serving `FuzzEcho`, and one
`ServerConnection` per input made as the accept path makes it, over a FakeTransport.

What an input may do and still be fine: anything the server answers (replies, errors, HTTP
statuses, GOAWAY) and any close. What is a finding: an exception out of the connection's
callbacks, anything the loop's exception handler gets, a traceback the library logs (its
"a bug of ours" paths), requests that never finish (a hang), a connection left open after EOF
with nothing in flight, and state the connection leaves behind once it is gone (the server's
connections, tasks, concurrency; stream tasks).
"""

from __future__ import annotations

from fuzz import _harness as H

with H.instrumented():
    import aiobrpc
    from aiobrpc.server.connection import ServerConnection
    from fuzz._servicer import Credential, FuzzEcho

MAX_BODY = 1 << 20
# A gRPC call's deadline due within this many seconds of the input's end is waited for before the
# outcome is read: whether a 100 ms Watch deadline fired first must not depend on how fast this
# twin fed the input (the twins once differed on that in CI). The harnesses' grpc-timeouts are
# either at most 1 s or minutes and more (fuzz/h2_server.py TIMEOUTS).
DEADLINE_HORIZON = 1.5
_servers: dict = {}


async def server(auth: bool):
    """(server, servicer), started once per process per kind."""
    got = _servers.get(auth)
    if got is None:
        servicer = FuzzEcho()
        opts = aiobrpc.ServerOptions(max_body_size=MAX_BODY, max_decompressed_size=MAX_BODY,
                                     auth=Credential() if auth else None, server_tag="fuzz",
                                     grpc_health=True, grpc_reflection=True, version="fuzz")
        srv = aiobrpc.Server(opts)
        srv.add_service(servicer)
        await srv.start("memory.invalid:0")
        got = _servers[auth] = (srv, servicer)
    return got


def outcome(conn, t: H.FakeTransport) -> str:
    out = t.sent()
    proto = conn.protocol or "none"
    if proto == "http":
        what = "http=" + ",".join(H.http_statuses(out))
    elif proto == "h2":
        what = "h2=" + " ".join(H.h2_frames(out))
    else:
        what = "frames=" + "; ".join(_replies_in_cid_order(H.baidu_frames(out)))
    end = "aborted" if t.aborted else "closed" if t.closed else "open"
    return f"{proto} {end} {what}"


def _replies_in_cid_order(frames: list[str]) -> list[str]:
    """The PRPC replies sorted among their own places (STRM frames stay where they were): a
    server answers pipelined requests as their handlers finish, and which of two sleeping
    handlers finishes first while the input is still dribbling in is a race with the clock
    (the twins differed on it beside a CPU hog), not a property of the bytes."""
    at = [i for i, f in enumerate(frames) if f.startswith("PRPC ")]
    out = list(frames)
    for i, f in zip(at, sorted((frames[i] for i in at), key=_cid_key)):
        out[i] = f
    return out


def _cid_key(frame: str):
    head = frame.split(" ", 2)[1]  # "cid=N"
    return (int(head[4:]) if head.startswith("cid=") and head[4:].isdigit() else -1, frame)


async def drive(data: bytes, auth: bool, chunk: int, eof: bool) -> str:
    """`data` from a client of a new connection; then EOF if `eof`; then a reset."""
    srv, servicer = await server(auth)
    conn = ServerConnection(srv)
    t = H.FakeTransport(conn)
    conn.connection_made(t)
    try:
        await H.feed(conn, t, data, chunk)
    except H.Finding:
        raise
    except Exception as e:
        raise H.Finding(f"feeding the connection raised {e!r}") from e
    if not await H.settle(lambda: ((conn.inflight == 0 or _waiting_for_peer(conn)) and not _http_busy(conn)
                           and not _deadline_due(conn)) or t.lost):
        raise H.Finding(f"hang: {conn.inflight} requests still in flight after the input")
    if eof and not t.closed:
        try:
            keep = conn.eof_received()
        except Exception as e:
            raise H.Finding(f"eof_received raised {e!r}") from e
        if not keep:
            t.close()
        if not await H.settle(lambda: t.closed):
            raise H.Finding(f"leak: the connection stays open after EOF (inflight={conn.inflight}, "
                            f"protocol={conn.protocol}, paused={t.reading_paused})")
    result = outcome(conn, t)
    t.peer_reset()
    if not await H.settle(lambda: conn not in srv.connections and not srv._tasks and not srv.concurrency
                          and not servicer.stream_tasks):
        raise H.Finding(f"leak: after the connection was lost: in server.connections={conn in srv.connections}, "
                        f"tasks={len(srv._tasks)}, concurrency={srv.concurrency}, "
                        f"stream tasks={len(servicer.stream_tasks)}")
    if conn.streams:
        raise H.Finding(f"leak: {len(conn.streams)} streams left in the connection's table")
    http = conn.http
    if http is not None and getattr(http, "calls", None):
        raise H.Finding(f"leak: {len(http.calls)} HTTP/2 calls left in the session")
    return result


def _waiting_for_peer(conn) -> bool:
    """Every HTTP/2 call still running may go on by design: its request not ended (a client or
    bidi stream), its reply held by the client's window, or a server stream (health's Watch
    streams until a status changes). Not a hang: the peer's reset after the input must end them
    (checked below). A unary call still running is one."""
    http = conn.http
    calls = getattr(http, "calls", None)
    if not calls:
        return False
    waiting = http.waiting_for_window
    return conn.inflight <= sum(1 for c in calls.values()
                                if not c.request_done or c in waiting or (c.entry is not None and c.entry.streaming))


def _deadline_due(conn) -> bool:
    """Whether a call of the connection has a deadline within DEADLINE_HORIZON seconds."""
    wheel = getattr(conn.http, "deadlines", None)
    if wheel is None or not wheel.buckets:
        return False
    return min(wheel.buckets) / 1000 <= wheel.loop.time() + DEADLINE_HORIZON


def _http_busy(conn) -> bool:
    http = conn.http
    if http is None:
        return False
    return bool(getattr(http, "busy", False))  # HTTP/1.1 answering; an HTTP/2 call may wait for the peer


def one_raw(data: bytes) -> str:
    """A raw input: control byte (fuzz/_harness.control, bit 4: the server with an authenticator),
    then the client's bytes."""
    chunk, eof, body = H.control(data)
    auth = bool(data[0] & 16) if data else False
    return H.run(lambda _: drive(body, auth, chunk, eof), data)


def one_input(data: bytes, build) -> str:
    """A harness's input: with bit 5 of the control byte, the rest is a recipe that `build`
    (given a _Provider) turns into the client's bytes; otherwise raw bytes (one_raw)."""
    if data and data[0] & 32:
        body = build(H._Provider(data[1:]))
        chunk, eof, _ = H.control(data)
        auth = bool(data[0] & 16)
        return H.run(lambda _: drive(body, auth, chunk, eof), data)
    return one_raw(data)
