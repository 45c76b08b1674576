"""A small keep-alive HTTP/1.1 client on h11 and asyncio streams: aiobrpc has no HTTP client.

`HttpPool.post_json(address, path, obj, timeout)` -> (status, parsed JSON or raw bytes).
Idle connections are kept per address and reused; a connection is reused only when h11 says
both sides finished the exchange cleanly (`start_next_cycle`), and closed on any error or
timeout. `close()` closes every idle connection.
"""

from __future__ import annotations

import asyncio
import json

import h11


class HttpError(Exception):
    """The exchange failed before a whole response came: `reason` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)
        self.reused = False

    def close(self) -> None:
        self.writer.transport.abort()  # nothing to flush: a reusable connection is closed idle

    async def exchange(self, host: str, path: str, body: bytes) -> tuple[int, bytes]:
        c = self.h11
        data = c.send(h11.Request(method="POST", target=path, headers=[
            ("Host", host), ("Content-Type", "application/json"), ("Content-Length", str(len(body))),
            ("Connection", "keep-alive")]))
        data += c.send(h11.Data(data=body)) + c.send(h11.EndOfMessage())
        self.writer.write(data)
        status, chunks = None, []
        while True:
            event = c.next_event()
            if event is h11.NEED_DATA:
                raw = await self.reader.read(65536)
                c.receive_data(raw)  # b"": EOF, and h11 raises RemoteProtocolError if mid-message
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.InformationalResponse):
                continue
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return status, b"".join(chunks)
            elif isinstance(event, h11.ConnectionClosed):
                raise HttpError("closed before a response")


class HttpPool:
    def __init__(self) -> None:
        self.idle: dict[str, list[_Conn]] = {}
        self.connects = 0
        self.busy: set[_Conn] = set()

    async def post_json(self, address: str, path: str, obj, timeout: float) -> tuple[int, object]:
        body = json.dumps(obj).encode()
        held: list[_Conn] = []  # the connection in use, for the cleanup below
        try:
            # wait_for, not asyncio.timeout: the soak runs on Python 3.10 too
            status, raw = await asyncio.wait_for(self._exchange(address, path, body, held), timeout)
        except asyncio.TimeoutError:
            self._drop(held)
            raise HttpError("timeout") from None
        except BaseException:
            self._drop(held)
            raise
        conn = held[0]
        self.busy.discard(conn)
        c = conn.h11
        if c.our_state is h11.DONE and c.their_state is h11.DONE:
            c.start_next_cycle()
            conn.reused = True
            self.idle.setdefault(address, []).append(conn)
        else:
            conn.close()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw

    async def _exchange(self, address: str, path: str, body: bytes, held: list[_Conn]) -> tuple[int, bytes]:
        conn = None
        idle = self.idle.get(address)
        while idle:  # the server may have closed an idle one meanwhile
            conn = idle.pop()
            if not conn.writer.transport.is_closing() and not conn.reader.at_eof():
                break
            conn.close()
            conn = None
        if conn is None:
            host, port = address.rsplit(":", 1)
            try:
                conn = _Conn(*await asyncio.open_connection(host, int(port)))
            except OSError as e:
                raise HttpError(f"connect: {e.__class__.__name__}") from None
            self.connects += 1
        held.append(conn)
        self.busy.add(conn)
        try:
            return await conn.exchange(address, path, body)
        except (OSError, h11.ProtocolError, RuntimeError) as e:  # uvloop: write on a closed transport
            raise HttpError(f"{'reused' if conn.reused else 'new'} connection: "
                            f"{e.__class__.__name__}") from None

    def _drop(self, held: list[_Conn]) -> None:
        for conn in held:
            conn.close()
            self.busy.discard(conn)

    def close(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn.close()
        self.idle.clear()
        for conn in self.busy:
            conn.close()
        self.busy.clear()
