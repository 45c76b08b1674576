"""Limits on connections (rows E11, F6 of docs/hostile_inputs.md): `idle_timeout_sec`,
`max_connections`, and what an idle connection costs the server."""

from __future__ import annotations

import asyncio
import gc
import resource
import socket
import tracemalloc

import pytest

import aiobrpc
from aiobrpc._proto import interop_pb2
from tests.helpers.interop_server import SERVICE, InteropEcho
from tests.helpers.peers import raw_exchange
from tests.helpers.waiting import wait_until
from tests.helpers.wire import frame, rpc_meta

Req = interop_pb2.EchoRequest


def req_frame(cid=1, **fields) -> bytes:
    fields.setdefault("message", "x")
    return frame(rpc_meta(service="interop.EchoService", correlation_id=cid), Req(**fields).SerializeToString())


async def _server(**options) -> aiobrpc.Server:
    srv = aiobrpc.Server(aiobrpc.ServerOptions(**options))
    srv.add_service(InteropEcho())
    await srv.start("127.0.0.1:0")
    return srv


async def _stop(srv: aiobrpc.Server) -> None:
    await srv.stop()
    await srv.join(timeout=2)


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server closes the connection within `seconds` (what it wrote before is read)."""
    try:
        await asyncio.wait_for(reader.read(), seconds)
        return True
    except asyncio.TimeoutError:
        return False
    except ConnectionResetError:
        return True


async def test_idle_connections_are_closed_and_busy_ones_kept():
    srv = await _server(idle_timeout_sec=0.4)
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", srv.port)
    idle_w.write(req_frame(1))
    await idle_r.read(1)  # answered: now idle
    busy_r, busy_w = await asyncio.open_connection("127.0.0.1", srv.port)
    busy_w.write(req_frame(2, sleep_ms=1500))  # in flight for longer than the idle time
    chatty_r, chatty_w = await asyncio.open_connection("127.0.0.1", srv.port)
    http_r, http_w = await asyncio.open_connection("127.0.0.1", srv.port)
    http_w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await http_r.readuntil(b"OK")).startswith(b"HTTP/1.1 200")

    async def chat():
        for i in range(12):  # a request every 0.1 s: never idle for 0.4 s
            chatty_w.write(req_frame(10 + i))
            await asyncio.sleep(0.1)
    chatting = asyncio.create_task(chat())
    assert await _closed_within(idle_r, 1.5)
    assert await _closed_within(http_r, 1.5)  # an idle keep-alive HTTP connection too
    await chatting
    assert not chatty_r.at_eof() and not busy_r.at_eof()
    assert len(srv.connections) == 2
    assert srv.stats.closed["idle_timeout"] == 2
    # the busy one is answered, then, idle in its turn, closed
    assert await _closed_within(busy_r, 3)
    for w in (idle_w, busy_w, chatty_w, http_w):
        w.close()
    await _stop(srv)


async def test_idle_timeout_is_off_by_default():
    srv = await _server()
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    writer.write(req_frame(1))
    await reader.read(1)
    assert not await _closed_within(reader, 1.3)  # the checker's period is 1 s
    writer.close()
    await _stop(srv)


async def test_one_connection_past_max_connections_is_closed_at_once():
    srv = await _server(max_connections=3)
    kept = [await asyncio.open_connection("127.0.0.1", srv.port) for _ in range(3)]
    for i, (r, w) in enumerate(kept):  # each served
        w.write(req_frame(i + 1))
        assert await r.read(1)
    refused_r, refused_w = await asyncio.open_connection("127.0.0.1", srv.port)
    refused_w.write(req_frame(9))
    assert await _closed_within(refused_r, 1)
    assert srv.stats.connections_refused == 1 and len(srv.connections) == 3
    kept[0][1].close()  # one leaves: the next is served again
    for _ in range(50):
        if len(srv.connections) < 3:
            break
        await asyncio.sleep(0.02)
    got, _ = await raw_exchange(srv.port, req_frame(7), want=1)
    assert got
    for _, w in kept[1:]:
        w.close()
    refused_w.close()
    await _stop(srv)


def _fd_room(want: int) -> int:
    """Connections this test may open (two fds each), raising the soft fd limit if it can."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * want + 200
    if soft < need and (hard == resource.RLIM_INFINITY or hard >= need):
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        soft = need
    return min(want, (soft - 200) // 2)


async def test_an_idle_connection_costs_the_server_little_memory(record_property):
    """F6: 1000 connections (fewer where the fd limit is lower), silent, then each served one
    request and left idle: the process's Python memory per connection, measured by tracemalloc
    (the client side is plain sockets), reported, and bounded at 20 KiB. A connection reads
    into a 256 KiB block: made at its first read, given back once it has been idle a second."""
    n = _fd_room(1000)
    assert n >= 200, "the fd limit leaves room for too few connections to measure"
    srv = await _server()
    await raw_exchange(srv.port, req_frame(1), want=1)  # the server's first-use allocations out of the way
    gc.collect()
    tracemalloc.start()
    socks = []
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(n):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", srv.port))
            except BlockingIOError:
                pass
            socks.append(s)
            if len(socks) % 50 == 0 or len(socks) == n:  # in waves within the listen backlog
                for _ in range(500):
                    if len(srv.connections) >= len(socks):
                        break
                    await asyncio.sleep(0.01)
        await wait_until(lambda: len(srv.connections) == n)
        assert len(srv.connections) == n
        gc.collect()
        silent = (tracemalloc.get_traced_memory()[0] - before) / n
        answered = srv.stats.requests
        for i, s in enumerate(socks):
            s.send(req_frame(i + 2))  # small: fits the socket buffer at once
        for _ in range(1000):
            if srv.stats.requests - answered >= n and srv.concurrency == 0:
                break
            await asyncio.sleep(0.01)
        await wait_until(lambda: srv.stats.requests - answered == n)
        assert srv.stats.requests - answered == n
        for _ in range(100):  # the replies out of the client sockets, unread by the test
            try:
                for s in socks:
                    s.recv(65536)
                break
            except BlockingIOError:
                await asyncio.sleep(0.02)
        # the peak, not the memory now: on a busy machine the housekeeper may already have
        # taken the first blocks back (idle a second) by the time the last reply is read
        peak = (tracemalloc.get_traced_memory()[1] - before) / n
        await asyncio.sleep(2.2)  # idle for a second, then the housekeeper's next round
        gc.collect()
        idle = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
        for s in socks:
            s.close()
    record_property("bytes_per_silent_connection", int(silent))
    record_property("bytes_per_idle_connection", int(idle))
    print(f"\n{n} connections, the server's Python memory each: silent {silent:.0f} B, "
          f"served once {peak:.0f} B, idle since {idle:.0f} B")
    assert peak > 200 * 1024  # each held a read block while it was served
    assert silent < 20 * 1024 and idle < 20 * 1024
    await _stop(srv)


@pytest.mark.parametrize("bad", [dict(idle_timeout_sec="soon"), dict(max_connections=0)])
def test_bad_connection_limits_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        aiobrpc.ServerOptions(**bad)
