"""The client side of the harnesses: a real `aiobrpc.Channel` (baidu_std or gRPC) with calls in
flight, connected in memory (transport/memory.py, the library's own in-process transport, as
`aiobrpc.testing` uses it) to a scripted peer that answers every connection with the input's
bytes, then closes it (or resets it).

Fine: any result or RpcError for each call. Findings: a call that never ends once its connection
is gone (a hang), one that ends twice or with another exception, anything the loop's exception
handler gets, a traceback the library logs, calls or connections the channel keeps after it closed.
"""

from __future__ import annotations

import asyncio

from fuzz import _harness as H

with H.instrumented():
    import aiobrpc
    from aiobrpc._proto import interop_pb2
    from aiobrpc.transport import memory

MAX_BODY = 1 << 20


class ScriptedPeer(asyncio.Protocol):
    """The server end: after the client's first bytes, writes `script` in `chunk`-byte writes (a
    loop iteration apart), then closes (or aborts) the connection."""

    def __init__(self, script: bytes, chunk: int, reset: bool, log: list) -> None:
        self.script = script
        self.chunk = chunk
        self.reset = reset
        self.received = bytearray()
        self.transport = None
        self.started = False
        self.done = False
        self.lost = False
        self.log = log
        log.append(self)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received += data
        if not self.started:
            self.started = True
            asyncio.get_running_loop().create_task(self._play())

    def eof_received(self):
        return True

    def connection_lost(self, exc) -> None:
        self.lost = True
        self.done = True

    async def _play(self) -> None:
        pos, data, t = 0, self.script, self.transport
        while pos < len(data) and not t.is_closing():
            step = self.chunk if 0 < self.chunk and pos < H.DRIBBLE_BYTES else 65536
            t.write(data[pos:pos + step])
            pos += step
            await asyncio.sleep(0)
        for _ in range(1000):  # until the client took it all (not H.settle: that runs alone)
            if t.get_write_buffer_size() == 0 or t.is_closing():
                break
            await asyncio.sleep(0)
        self.done = True


async def drive(script: bytes, chunk: int, reset: bool, ncalls: int, protocol: str,
                streams: int = 0, timeout_ms: int = 2000) -> str:
    """`ncalls` Echo calls in flight on one connection answered by `script`; `streams` of them
    (baidu_std) offer a stream."""
    loop = asyncio.get_running_loop()
    peers: list = []
    endpoint = memory.serve(loop, lambda: ScriptedPeer(script, chunk, reset, peers))
    opts = aiobrpc.ChannelOptions(timeout_ms=timeout_ms, max_retry=0, max_body_size=MAX_BODY,
                                  max_decompressed_size=MAX_BODY, protocol=protocol,
                                  health_check_interval_s=3600.0)
    ch = aiobrpc.Channel(f"{memory.MEMORY_HOST}:{endpoint.port}", opts)
    results: list = [None] * ncalls
    ended = [0] * ncalls
    stream_objs: list = []

    async def one(i: int) -> None:
        cntl = aiobrpc.Controller()
        if i < streams:
            stream_objs.append(aiobrpc.Stream.create(cntl, max_buf_size=256 * 1024))
        req = interop_pb2.EchoRequest(message=f"m{i}")
        try:
            resp = await ch.call_method("interop.EchoService", "StartStream" if i < streams else "Echo",
                                        req, interop_pb2.EchoResponse, cntl)
            results[i] = f"ok:{H.short(resp.SerializeToString())}"
        except aiobrpc.RpcError as e:
            results[i] = f"E{e.code}"
        ended[i] += 1

    tasks = [loop.create_task(one(i)) for i in range(ncalls)]
    try:
        await H.settle(lambda: all(p.done for p in peers) and peers, 1.0)
        if not all(t.done() for t in tasks):
            for p in peers:  # the peer goes away: every call still waiting must end now (E3)
                if p.transport is not None and not p.transport.is_closing():
                    p.transport.abort() if reset else p.transport.close()
            if not await H.settle(lambda: all(t.done() for t in tasks), 1.0):
                raise H.Finding(f"hang: {sum(not t.done() for t in tasks)} calls still waiting "
                                f"{H.INPUT_LOOP_SECONDS} s after their connection was closed")
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                raise H.Finding(f"a call raised {t.exception()!r} (not an RpcError)") from t.exception()
        if any(n != 1 for n in ended):
            raise H.Finding(f"calls ended {ended} times")
        late = ch.stats.late_or_unknown_responses
    finally:
        endpoint.close()
        for t in tasks:
            t.cancel()
        for s in stream_objs:
            if not s.closed:
                await s.close()
        await ch.close()
        for p in peers:
            if p.transport is not None and not p.transport.is_closing():
                p.transport.abort()
    if not await H.settle(lambda: all(p.lost for p in peers), 1.0):
        raise H.Finding("leak: a connection of the closed channel stays open")
    if ch._calls:
        raise H.Finding(f"leak: {len(ch._calls)} calls kept by the closed channel")
    return f"{protocol} calls={','.join(results)} late={late} conns={len(peers)}"
