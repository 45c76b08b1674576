"""Issue 29 R8: a gRPC connection's grpc-timeouts are entries of one TimerWheel; calls that end
before far deadlines leave nothing in it, heap included, however many a peer sends."""

from __future__ import annotations

import asyncio

from tests.grpc.test_grpc_hostile import PATH, Msg, Peer, server, trailers_of  # noqa: F401  (server: the fixture)
from tests.helpers.waiting import wait_until


def _call(peer: Peer, timeout: bytes, body: bytes) -> int:
    sid = peer.h2.get_next_available_stream_id()
    peer.h2.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH),
                               (b":authority", b"x"), (b"content-type", b"application/grpc"),
                               (b"grpc-timeout", timeout)])
    peer.h2.send_data(sid, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
    return sid


async def test_3000_calls_with_far_deadlines_leave_the_wheel_empty(server):
    peer = await Peer.connect(server)
    slow = _call(peer, b"5000S", Msg(sleep_ms=60_000).SerializeToString())  # in flight throughout
    peer.send()
    fast = Msg(text="fast").SerializeToString()
    for start in range(0, 3000, 90):  # within MAX_CONCURRENT_STREAMS, the slow call beside them
        sids = [_call(peer, f"{1_000_000 + i}m".encode(), fast) for i in range(start, min(start + 90, 3000))]
        peer.send()
        assert await peer.read_until(lambda ev: all(trailers_of(ev, s) for s in sids))
        assert {trailers_of(peer.events, s)[b"grpc-status"] for s in sids} == {b"0"}
        peer.events.clear()
    wheel = next(iter(server.connections)).http.deadlines
    assert len(wheel) == 1 and len(wheel.buckets) == 1  # the slow call's
    assert len(wheel.ticks) <= 2 + 64
    peer.h2.reset_stream(slow)
    peer.send()
    loop = asyncio.get_running_loop()
    end = loop.time() + 5
    while wheel.footprint() and loop.time() < end:
        await asyncio.sleep(0.01)
    await wait_until(lambda: len(wheel) == 0 and wheel.footprint() == 0)
    assert len(wheel) == 0 and wheel.footprint() == 0
    peer.close()
