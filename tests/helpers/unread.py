"""A client that sends 400 requests for 256 KiB replies without reading any (hostile row F1),
over whatever stream it is given (plaintext or TLS)."""

from __future__ import annotations

import asyncio

from aiobrpc import errors
from aiobrpc._proto import interop_pb2
from aiobrpc.protocol import baidu_std
from tests.helpers.interop_server import SERVICE
from tests.helpers.wire import frame, rpc_meta

MIB = 1 << 20
REQUESTS = 400


async def flood_without_reading(srv, servicer, reader, writer, cap: int, sleep_ms: int = 0) -> None:
    """Send the requests, check the server holds at most `cap` (its max_unwritten_bytes) plus
    one reply and short errors, then read: every request is answered, served or EOVERCROWDED."""
    big = interop_pb2.EchoRequest(message="b", response_attachment_size=256 * 1024,
                                  sleep_ms=sleep_ms).SerializeToString()
    one = frame(rpc_meta(correlation_id=1, service=SERVICE.full_name), big)
    for _ in range(8):
        writer.write(one * 50)  # 400 requests for 256 KiB replies = 100 MiB if all were answered
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    (conn,) = srv.connections
    # bounded: max_unwritten_bytes, one reply that passed it, and short EOVERCROWDED errors
    # for the rest (their requests may have been admitted together, from one read)
    assert conn.unwritten_bytes() <= cap + 256 * 1024 + REQUESTS * 256
    assert servicer.calls_served < REQUESTS or sleep_ms
    # once the client reads, everything is answered (served or refused), nothing lost
    dec = baidu_std.Decoder(baidu_std.CLIENT, max_body_size=MIB)
    answered = 0
    while answered < REQUESTS:
        dec.feed(await asyncio.wait_for(reader.read(1 << 20), 5))
        for ev in dec.events():
            assert ev.meta.error_code in (0, errors.EOVERCROWDED)
            answered += 1
    writer.close()
