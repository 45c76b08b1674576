"""Opening a TCP connection within a timeout that a busy event loop cannot fake.

`asyncio.wait_for(loop.create_connection(...), timeout)` reports a timeout whenever its timer
runs before the connection's last callback, and both become due in the same loop iteration
when the loop was blocked for longer than the timeout (2,000 calls started at once on a
loaded machine take that long). The handshake had long completed in the kernel, yet the
server would be marked failed. Here the handshake is a plain non-blocking `connect()` whose
timeout asks the kernel before it fails: a socket that is already connected is used. The
transport is then made over that socket, which waits for nothing on the network.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import ssl as ssl_module

from . import memory


class TlsHandshakeError(Exception):
    """The TLS handshake over a connected socket failed (the reason is the message)."""


async def open_connection(loop: asyncio.AbstractEventLoop, protocol_factory, host: str, port: int,
                          timeout: float | None, ssl: ssl_module.SSLContext | None = None,
                          server_hostname: str | None = None, ssl_handshake_timeout: float | None = None):
    """`loop.create_connection(protocol_factory, host, port)` bounded by `timeout` seconds.

    Raises what create_connection raises (OSError, socket.gaierror, UnicodeError for a
    malformed host name) and asyncio.TimeoutError once the time is spent. With `ssl`, the
    TLS handshake follows within `ssl_handshake_timeout` seconds; its failure, whatever the
    cause, raises TlsHandshakeError. `memory.MEMORY_HOST` connects in memory (transport/memory.py).
    """
    if host == memory.MEMORY_HOST:
        if ssl is not None:
            raise TlsHandshakeError("an in-memory connection has no TLS; leave ChannelOptions.ssl unset")
        return await memory.connect(loop, protocol_factory, port)
    deadline = None if timeout is None else loop.time() + timeout
    sock = await connect_socket(loop, host, port, deadline)
    try:
        if ssl is None:
            return await loop.create_connection(protocol_factory, sock=sock)
        try:
            return await loop.create_connection(protocol_factory, sock=sock, ssl=ssl,
                                                server_hostname=server_hostname or host,
                                                ssl_handshake_timeout=ssl_handshake_timeout)
        except (ssl_module.SSLError, ssl_module.CertificateError, OSError, EOFError, asyncio.TimeoutError) as e:
            raise TlsHandshakeError(_tls_reason(e, ssl_handshake_timeout)) from None
    except BaseException:
        sock.close()
        raise


def _tls_reason(e: BaseException, timeout: float | None) -> str:
    if isinstance(e, ssl_module.SSLCertVerificationError):
        return f"certificate verify failed: {e.verify_message}"
    if isinstance(e, ssl_module.SSLError):
        return e.reason or str(e)
    if isinstance(e, asyncio.TimeoutError) or "longer than" in str(e):  # asyncio's handshake timeout
        return f"no handshake within {timeout} s"
    return f"the connection failed during the handshake: {type(e).__name__} {e}".rstrip()


async def connect_socket(loop: asyncio.AbstractEventLoop, host: str, port: int,
                         deadline: float | None) -> socket.socket:
    """A connected non-blocking socket to the first address of `host` that accepts."""
    infos = await _resolve(loop, host, port, deadline)
    error: BaseException | None = None
    for family, type_, proto, _, address in infos:
        sock = socket.socket(family, type_, proto)
        try:
            sock.setblocking(False)
            await _handshake(loop, sock, address, deadline)
            return sock
        except OSError as e:
            sock.close()
            error = e
        except BaseException:
            sock.close()
            raise
    assert error is not None  # getaddrinfo never returns an empty list
    raise error


async def _resolve(loop, host: str, port: int, deadline: float | None) -> list:
    try:  # a numeric address needs no resolver thread
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass
    return await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM),
                                  _remaining(loop, deadline))


async def _handshake(loop, sock: socket.socket, address, deadline: float | None) -> None:
    """connect() now, in this call (loop.sock_connect may first resolve the address in a
    thread, as uvloop's does, so that no SYN is out when a blocked loop wakes past the
    deadline), then wait until the socket is writable."""
    err = sock.connect_ex(address)
    if err == 0:
        return
    if err not in (errno.EINPROGRESS, errno.EAGAIN, errno.EALREADY):
        raise OSError(err, f"Connect call failed {address}: {os.strerror(err)}")
    fd = sock.fileno()
    writable = loop.create_future()
    loop.add_writer(fd, _set_done, writable)
    try:
        await asyncio.wait_for(writable, _remaining(loop, deadline))
    except asyncio.TimeoutError:
        if not _connected(sock):
            raise
        return
    finally:
        loop.remove_writer(fd)
    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, f"Connect call failed {address}: {os.strerror(err)}")


def _set_done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _connected(sock: socket.socket) -> bool:
    """Whether a non-blocking connect() has completed successfully, asked without waiting."""
    try:
        sock.getpeername()  # ENOTCONN while the handshake is in progress or after it failed
    except OSError:
        return False
    return True


def _remaining(loop, deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - loop.time(), 0)
