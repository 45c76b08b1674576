"""In-memory connections: a pair of asyncio transports joined inside one process, no socket.

`serve(loop, protocol_factory, port)` registers an endpoint at `MEMORY_HOST:port`;
`connect(loop, protocol_factory, port)` joins a new protocol of the caller to a new protocol of
that endpoint. `Server.start("memory.invalid:0")` serves so, and a `Channel` given the address
the server then has connects so (transport/connect.py): every byte still goes through the
codecs, as over TCP, but nothing reaches the network.

Bytes written on one side reach the other side's protocol on a later loop iteration, as from a
socket, through `get_buffer`/`buffer_updated` (a BufferedProtocol) or `data_received`. A side
whose protocol paused reading gets nothing until it resumes; the writer's buffer meanwhile
grows and pauses the writer's protocol past the high-water mark, as a full socket does.
`close()` delivers what was written, then EOF, then `connection_lost(None)`; `abort()` drops
it and the peer's protocol gets `connection_lost(ConnectionResetError)`.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import os

MEMORY_HOST = "memory.invalid"  # .invalid never resolves (RFC 2606): it names no real host
_MAX_PORT = 65535  # a Channel takes ports 1..65535

_DEFAULT_HIGH_WATER = 64 * 1024  # asyncio's defaults for a socket transport
_endpoints: dict[int, MemoryServer] = {}
_last_port = 0
_clients = 0  # numbers the client side's "port", so the server's peers have distinct names


class MemoryServer:
    """An in-memory endpoint: the part of `asyncio.Server` that a `Server` uses."""

    def __init__(self, loop: asyncio.AbstractEventLoop, protocol_factory, port: int) -> None:
        self.loop = loop
        self.protocol_factory = protocol_factory
        self.port = port

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self.loop

    def is_serving(self) -> bool:
        return _endpoints.get(self.port) is self

    def close(self) -> None:
        """Refuse new connections (they fail with ECONNREFUSED); made ones stay open."""
        if _endpoints.get(self.port) is self:
            del _endpoints[self.port]

    async def wait_closed(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"<MemoryServer {MEMORY_HOST}:{self.port}{'' if self.is_serving() else ' closed'}>"


def serve(loop: asyncio.AbstractEventLoop, protocol_factory, port: int = 0) -> MemoryServer:
    """Accept in-memory connections at `MEMORY_HOST:port` (0: a free port) on `loop`."""
    global _last_port
    if port == 0:
        if len(_endpoints) >= _MAX_PORT:
            raise OSError(errno.EADDRINUSE, "every in-memory port is in use")
        port = _last_port
        while True:  # the next free one after the last given, as ephemeral ports go round
            port = port % _MAX_PORT + 1
            if port not in _endpoints:
                break
        _last_port = port
    elif not 0 < port <= _MAX_PORT:
        raise ValueError(f"an in-memory port is in 1..{_MAX_PORT} (0: any), got {port}")
    elif port in _endpoints:
        raise OSError(errno.EADDRINUSE, f"in-memory address {MEMORY_HOST}:{port} is in use")
    server = _endpoints[port] = MemoryServer(loop, protocol_factory, port)
    return server


async def connect(loop: asyncio.AbstractEventLoop, protocol_factory, port: int):
    """(transport, protocol): `protocol_factory()` connected to the endpoint at `port`.

    Raises ConnectionRefusedError where nothing serves, and OSError when the endpoint serves
    on another event loop (its protocols cannot run on this one)."""
    global _clients
    server = _endpoints.get(port)
    if server is None:
        raise ConnectionRefusedError(errno.ECONNREFUSED, os.strerror(errno.ECONNREFUSED))
    if server.loop is not loop:
        raise OSError(f"the in-memory server at {MEMORY_HOST}:{port} runs on another event loop; "
                      "connect from the loop it was started on")
    _clients += 1
    server_name, client_name = (MEMORY_HOST, port), (MEMORY_HOST, _clients)
    protocol = protocol_factory()
    peer_protocol = server.protocol_factory()
    transport = MemoryTransport(loop, protocol, sockname=client_name, peername=server_name)
    peer = MemoryTransport(loop, peer_protocol, sockname=server_name, peername=client_name)
    transport._peer, peer._peer = peer, transport
    peer_protocol.connection_made(peer)
    protocol.connection_made(transport)
    return transport, protocol


class MemoryTransport(asyncio.Transport):
    """One side of an in-memory connection. What it writes waits in its own buffer until the
    peer's protocol has taken it (`get_write_buffer_size()` counts it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, protocol: asyncio.BaseProtocol, *,
                 sockname: tuple, peername: tuple) -> None:
        super().__init__({"sockname": sockname, "peername": peername, "socket": None})
        self._loop = loop
        self._protocol = protocol
        self._peer: MemoryTransport | None = None
        self._buffer: collections.deque[bytes] = collections.deque()
        self._offset = 0  # of the first buffered bytes, already taken by the peer
        self._buffer_size = 0
        self._high = _DEFAULT_HIGH_WATER
        self._low = _DEFAULT_HIGH_WATER // 4
        self._writing_paused = False
        self._reading_paused = False
        self._closing = False
        self._eof = False  # write_eof(): the peer gets EOF once the buffer is delivered
        self._eof_sent = False
        self._eof_pending = False  # EOF came from the peer while this side's reading was paused
        self._lost = False  # connection_lost is called or scheduled
        self._delivery_scheduled = False

    # -- asyncio.BaseTransport -----------------------------------------------------------------
    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Deliver what is buffered, then EOF to the peer, then lose the connection."""
        if self._closing:
            return
        self._closing = True
        self._schedule_delivery()

    def abort(self) -> None:
        """Lose the connection now, dropping what is buffered; the peer sees a reset."""
        if self._lost:
            return
        self._drop_buffer()
        self._connection_lost(None)
        peer = self._peer
        if peer is not None:
            peer._connection_lost(ConnectionResetError(errno.ECONNRESET, os.strerror(errno.ECONNRESET)))

    # -- reading -------------------------------------------------------------------------------
    def is_reading(self) -> bool:
        return not self._reading_paused and not self._closing

    def pause_reading(self) -> None:
        if not self._closing:
            self._reading_paused = True

    def resume_reading(self) -> None:
        if self._closing or not self._reading_paused:
            return
        self._reading_paused = False
        if self._eof_pending:
            self._eof_pending = False
            self._loop.call_soon(self._receive_eof)
        if self._peer is not None:
            self._peer._schedule_delivery()

    # -- writing -------------------------------------------------------------------------------
    def write(self, data) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be a bytes-like object, got {type(data).__name__}")
        if self._eof:
            raise RuntimeError("Cannot call write() after write_eof()")
        if self._closing or not data:
            return
        data = bytes(data)  # the caller may change its buffer once write() returned
        self._buffer.append(data)
        self._buffer_size += len(data)
        self._schedule_delivery()
        if not self._writing_paused and self._buffer_size > self._high:
            self._writing_paused = True
            self._call_protocol("pause_writing")

    def write_eof(self) -> None:
        if self._eof or self._closing:
            return
        self._eof = True
        self._schedule_delivery()

    def can_write_eof(self) -> bool:
        return True

    def get_write_buffer_size(self) -> int:
        return self._buffer_size

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = _DEFAULT_HIGH_WATER if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        if not self._writing_paused and self._buffer_size > high:
            self._writing_paused = True
            self._call_protocol("pause_writing")

    # -- delivery to the peer ------------------------------------------------------------------
    def _schedule_delivery(self) -> None:
        if not self._delivery_scheduled and not self._lost:
            self._delivery_scheduled = True
            self._loop.call_soon(self._deliver)

    def _deliver(self) -> None:
        self._delivery_scheduled = False
        if self._lost:
            return
        peer = self._peer
        if peer._lost or peer._closing:  # the peer reads no more: the bytes are lost with it
            self._drop_buffer()
        buffer = self._buffer
        while buffer and not peer._reading_paused:
            data = buffer[0]
            taken = peer._receive(data, self._offset)
            if self._lost or peer._lost or peer._closing:  # closed by a protocol as it read
                self._drop_buffer()
                break
            self._buffer_size -= taken
            self._offset += taken
            if self._offset == len(data):
                buffer.popleft()
                self._offset = 0
        if self._writing_paused and self._buffer_size <= self._low:
            self._writing_paused = False
            self._call_protocol("resume_writing")
        if buffer or self._lost:
            return
        if (self._eof or self._closing) and not self._eof_sent:
            self._eof_sent = True
            if peer._reading_paused:
                peer._eof_pending = True  # it reads EOF once it resumes reading, as from a socket
            else:
                peer._receive_eof()
        if self._closing:
            self._connection_lost(None)

    def _receive(self, data: bytes, offset: int) -> int:
        """Hand `data[offset:]` to this side's protocol; the number of bytes it took (fewer
        when it paused reading, or a protocol that failed closed the connection)."""
        protocol = self._protocol
        if not isinstance(protocol, asyncio.BufferedProtocol):
            chunk = data[offset:] if offset else data
            self._call_protocol("data_received", chunk, fatal=True)
            return len(chunk)
        view = memoryview(data)
        taken = 0
        end = len(data)
        while offset < end and not self._reading_paused and not self._lost:
            try:
                buf = memoryview(protocol.get_buffer(end - offset)).cast("B")
                n = min(buf.nbytes, end - offset)
                if n == 0:
                    raise RuntimeError("get_buffer() returned an empty buffer")
                buf[:n] = view[offset:offset + n]
                protocol.buffer_updated(n)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as e:
                self._fatal_error(e, "protocol.buffer_updated() call failed.")
                return end - offset + taken
            offset += n
            taken += n
            protocol = self._protocol
        return taken

    def _receive_eof(self) -> None:
        if self._lost or self._closing:
            return
        if not self._call_protocol("eof_received", fatal=True):
            self.close()

    # -- the end -------------------------------------------------------------------------------
    def _drop_buffer(self) -> None:
        self._buffer.clear()
        self._offset = 0
        self._buffer_size = 0

    def _connection_lost(self, exc: BaseException | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._closing = True
        self._drop_buffer()
        self._loop.call_soon(self._call_protocol, "connection_lost", exc)

    def _fatal_error(self, exc: BaseException, message: str) -> None:
        self._loop.call_exception_handler({"message": f"Fatal error: {message}", "exception": exc,
                                           "transport": self, "protocol": self._protocol})
        self.abort()

    def _call_protocol(self, name: str, *args, fatal: bool = False):
        """protocol.name(*args); an exception it raises goes to the loop's exception handler
        (and, when `fatal`, aborts the connection), as asyncio's own transports do."""
        try:
            return getattr(self._protocol, name)(*args)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            if fatal:
                self._fatal_error(e, f"protocol.{name}() call failed.")
            else:
                self._loop.call_exception_handler({"message": f"protocol.{name}() failed", "exception": e,
                                                   "transport": self, "protocol": self._protocol})
            return None

    def __repr__(self) -> str:
        state = "closed" if self._lost else "closing" if self._closing else "open"
        sock, peer = self.get_extra_info("sockname"), self.get_extra_info("peername")
        return f"<MemoryTransport {sock[0]}:{sock[1]} -> {peer[0]}:{peer[1]} {state}>"
