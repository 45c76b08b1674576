"""The connections to one server and its health (brpc's docs/en/client.md).

`ServerPool` gives a call a connection of the configured type:
* single: one connection shared by every call, made on first use; concurrent callers wait
  for the same connect;
* pooled: a connection carries one call at a time and goes back to a bounded idle list when
  its reply came; a connection left without its reply (timeout, cancel, backup loser) is
  closed, never reused, since the late reply would answer the next call;
* short: a new connection per attempt, closed when the attempt ends.

It also keeps the server's health: a server is marked failed when its single connection
breaks (any cause), when a pooled/short connect is refused or unreachable (or times out
three times in a row), or when the circuit breaker trips. A failed server is unavailable to
the load balancer (or fails calls fast with EHOSTDOWN when it is the channel's only server)
until a health check connects to it again.

A pool is shared by every channel of the process (and of one event loop) that talks to the
same server with the same connection options: client/socket_map.py.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import os
import socket
import ssl

from ..errors import (ECONNREFUSED, EFAILEDSOCKET, EHOSTUNREACH, ENETUNREACH, EREQUEST, ERPCTIMEDOUT, ESSL,
                      ETIMEDOUT, RpcError)
from ..tls import client_context_of
from ..transport.connect import TlsHandshakeError, open_connection
from ..transport.sockopts import set_socket_options
from .circuit_breaker import CircuitBreaker
from .connection import ClientConnection, SharedStats
from .grpc_connection import GrpcConnection

log = logging.getLogger(__name__)

SINGLE, POOLED, SHORT = "single", "pooled", "short"
GRPC = "grpc"  # ChannelOptions.protocol of a channel whose connections speak gRPC (client/grpc_connection.py)
_CONNECT_TIMEOUTS_AS_UNREACHABLE = 3  # brpc's -connect_timeout_as_unreachable
_UNREACHABLE = (ECONNREFUSED, ENETUNREACH, EHOSTUNREACH)
# A connection found with no call in flight at two sweeps this far apart gives its read block
# back (256 KiB; its next read makes another), so idle connections cost little memory.
BLOCK_RELEASE_IDLE_S = 1.0


class ServerPool:
    """Connections to `node` ("host:port" and tag), and whether it is up, for the channels
    sharing it (`stats.holders`: their counters)."""

    def __init__(self, node, options) -> None:
        self.node = node
        self.host, self.port = node.host, node.port
        self.address = node.address
        self.options = options
        self.stats = SharedStats()
        self.key: tuple = ()  # its place in the socket map: (event loop, node, signature)
        self.available = True
        self.logged_off = False
        # Fed by the channels with enable_circuit_breaker (one trip isolates the server for all,
        # as brpc's breaker is per server); it also times the isolations: every failure waits
        # the same doubling duration before its first health check, as brpc's does.
        self.breaker = CircuitBreaker(**options.circuit_breaker_options)
        self.single: ClientConnection | None = None
        self._connecting: asyncio.Task | None = None
        self._idle: list[tuple[ClientConnection, float]] = []
        self._idle_timer: asyncio.TimerHandle | None = None
        self.connections: set[ClientConnection] = set()
        self._connect_timeouts = 0
        self._health: asyncio.Task | None = None
        self._sweep_timer: asyncio.TimerHandle | None = None
        self._quiet: set[ClientConnection] = set()  # no call in flight at the last sweep
        self.closed = False
        self.closed_why = ""

    # -- getting a connection ----------------------------------------------------------------
    def ready(self, ctype: str) -> ClientConnection | None:
        """A connection usable right now without waiting, or None."""
        if ctype == SINGLE:
            conn = self.single
            return conn if conn is not None and not conn.is_closed else None
        if ctype == POOLED:
            idle = self._idle
            while idle:
                conn, _ = idle.pop()
                if not conn.is_closed:
                    return conn
        return None

    async def connect(self, loop, deadline: float | None, ctype: str) -> ClientConnection:
        """A new connection (single: the shared one), within connect_timeout_ms and `deadline`."""
        if self.closed:
            raise RpcError(EFAILEDSOCKET, f"Not connecting to {self.address}: {self.closed_why}")
        if ctype != SINGLE:
            return await self._connect(loop, deadline, ctype)
        conn = self.ready(SINGLE)
        if conn is not None:  # made while this caller's task waited for its turn
            return conn
        if self._connecting is None:
            self._connecting = loop.create_task(self._connect(loop, None, SINGLE))
        task = self._connecting
        try:
            if deadline is None:
                return await asyncio.shield(task)
            return await asyncio.wait_for(asyncio.shield(task), max(deadline - loop.time(), 0))
        except asyncio.TimeoutError:
            raise RpcError(ERPCTIMEDOUT, f"Reached timeout while connecting to {self.address}") from None
        except asyncio.CancelledError:
            if task.cancelled() and self.closed:  # the shared connect was stopped, not this waiter
                raise RpcError(EFAILEDSOCKET, f"Connecting to {self.address} was stopped: "
                                              f"{self.closed_why}") from None
            raise

    def _tls(self, loop, deadline: float | None) -> tuple:
        """open_connection's TLS arguments: (context, server name, handshake timeout) or ()."""
        ctx = client_context_of(self.options)
        if ctx is None:
            return ()
        opts = self.options
        if opts.protocol == GRPC and not isinstance(opts.ssl, ssl.SSLContext):
            ctx.set_alpn_protocols(["h2"])  # a context of ours; a user's SSLContext is used as it is
        limit = opts.ssl_handshake_timeout_ms / 1000
        if deadline is not None:  # the call's deadline bounds the handshake too (at least 1 ms)
            limit = max(min(limit, deadline - loop.time()), 0.001)
        name = getattr(opts.ssl, "server_hostname", None)
        return ctx, name, limit

    async def _connect(self, loop, deadline: float | None, ctype: str) -> ClientConnection:
        opts = self.options
        timeout = None if opts.connect_timeout_ms < 0 else opts.connect_timeout_ms / 1000
        rpc_limited = False
        if deadline is not None:
            remaining = max(deadline - loop.time(), 0)
            if timeout is None or remaining < timeout:
                timeout, rpc_limited = remaining, True
        try:
            try:
                _, conn = await open_connection(loop, lambda: self._new_connection(ctype), self.host, self.port,
                                                timeout, *self._tls(loop, deadline))
            except TlsHandshakeError as e:
                raise RpcError(ESSL, f"Fail to connect {self.address}: TLS handshake failed: {e}") from None
            except asyncio.TimeoutError:
                if rpc_limited:
                    raise RpcError(ERPCTIMEDOUT, f"Reached timeout while connecting to {self.address}") from None
                raise RpcError(ETIMEDOUT, f"Fail to connect {self.address}: timed out after "
                                          f"connect_timeout_ms={opts.connect_timeout_ms}") from None
            except (socket.gaierror, UnicodeError) as e:  # UnicodeError: a malformed name (idna)
                raise RpcError(EHOSTUNREACH, f"Fail to connect {self.address}: "
                                             f"{_unresolvable(self.host, e)}") from None
            except OSError as e:
                code = {errno.ECONNREFUSED: ECONNREFUSED, errno.ENETUNREACH: ENETUNREACH,
                        errno.EHOSTUNREACH: EHOSTUNREACH}.get(e.errno, EFAILEDSOCKET)
                reason = os.strerror(e.errno) if e.errno else str(e)
                raise RpcError(code, f"Fail to connect {self.address}: {reason}") from None
            if opts.auth is not None:
                try:
                    conn.credential = await _credential(opts.auth, self.address)
                except BaseException:
                    conn.close()
                    raise
                if conn.is_closed:  # lost while the credential was made
                    raise RpcError(EFAILEDSOCKET, f"Connection to {self.address} was lost while "
                                                  "generating the credential")
        except RpcError as e:
            self._connect_failed(e.code, e.text, ctype)
            raise
        finally:
            if ctype == SINGLE:
                self._connecting = None
        self._connect_timeouts = 0
        set_socket_options(conn.transport, self.options)
        if self.closed:
            conn.close()
            raise RpcError(EFAILEDSOCKET, f"Not connecting to {self.address}: {self.closed_why}")
        self.connections.add(conn)
        if ctype == SINGLE:
            self.single = conn
        if self._sweep_timer is None:
            self._sweep_timer = loop.call_later(BLOCK_RELEASE_IDLE_S, self._sweep)
        return conn

    def _new_connection(self, ctype: str) -> ClientConnection:
        opts = self.options
        if opts.protocol == GRPC:
            return GrpcConnection(self.stats, opts, self.address, self._connection_lost, ctype)
        conn = ClientConnection(self.stats, opts.max_body_size, opts.max_unwritten_bytes, self._connection_lost,
                                ctype)
        conn.peer = self.address  # until the transport tells the peer's own address
        return conn

    def _connect_failed(self, code: int, text: str, ctype: str) -> None:
        if code == ERPCTIMEDOUT or code == EREQUEST:
            return  # the call's own deadline or credential, not the server's fault
        if ctype == SINGLE:
            self.mark_failed(text)
            return
        if code == ETIMEDOUT:
            self._connect_timeouts += 1
            if self._connect_timeouts < _CONNECT_TIMEOUTS_AS_UNREACHABLE:
                return
            self._connect_timeouts = 0
        elif code not in _UNREACHABLE:
            return
        self.mark_failed(text)

    def release(self, conn: ClientConnection, ctype: str, reusable: bool) -> None:
        """An attempt is over with `conn` (pooled/short). `reusable`: its reply was received."""
        if ctype == SINGLE:
            return
        if (ctype == POOLED and reusable and not conn.is_closed and not self.closed
                and len(self._idle) < self.options.max_connection_pool_size):
            self._idle.append((conn, conn.loop.time()))
            if self._idle_timer is None:
                self._idle_timer = conn.loop.call_later(self.options.pool_idle_timeout_s, self._close_idle)
            return
        conn.close()

    def _close_idle(self) -> None:
        self._idle_timer = None
        if not self._idle:
            return
        loop = self._idle[0][0].loop
        timeout = self.options.pool_idle_timeout_s
        # uvloop's timers tick in milliseconds and may fire a hair early: allow for it, or a
        # connection idle since the timer was armed would wait for the next sweep.
        limit = loop.time() - timeout + 0.002
        keep = []
        for conn, since in self._idle:
            if since <= limit:
                conn.close()
            else:
                keep.append((conn, since))
        self._idle = keep
        if keep:
            # The next sweep when the oldest kept one times out, not a whole timeout later.
            self._idle_timer = loop.call_at(min(since for _, since in keep) + timeout, self._close_idle)

    def idle_count(self) -> int:
        return len(self._idle)

    def _sweep(self) -> None:
        """Idle connections give their read blocks back; runs while the pool has connections."""
        self._sweep_timer = None
        quiet = set()
        for conn in self.connections:
            if not conn.pending and not conn.streams and not conn.is_closed and type(conn) is ClientConnection:
                if conn in self._quiet:
                    conn.decoder.reader.rbuf.release()
                quiet.add(conn)
        self._quiet = quiet
        if self.connections:
            self._sweep_timer = next(iter(self.connections)).loop.call_later(BLOCK_RELEASE_IDLE_S, self._sweep)

    def _connection_lost(self, conn: ClientConnection, exc) -> None:
        self.connections.discard(conn)
        if conn is self.single:
            self.single = None
            if not self.closed:
                self.mark_failed(f"connection to {self.address} lost: {exc or 'EOF'}")

    # -- health --------------------------------------------------------------------------------
    def feedback(self, error_code: int, latency_us: int) -> None:
        """One attempt of a channel with enable_circuit_breaker ended (circuit breaker input)."""
        breaker = self.breaker
        if not breaker.on_call_end(error_code, latency_us):
            self.stats.breaker_trips += 1
            self.mark_failed(f"circuit breaker of {self.address} isolated it "
                             f"({breaker.isolated_times} times)")

    def log_off(self) -> None:
        """The server answered ELOGOFF: no new calls until it is revived. Its connections
        stay (calls on them finish); the health check probes it as for a failure, so a
        server that restarts is used again (brpc waits for the connection to fail first,
        which never happens for pooled/short connections)."""
        if self.logged_off or self.closed:
            return
        self.logged_off = True
        self.mark_failed("it answered ELOGOFF (stopping)", abort=False)

    def mark_failed(self, why: str, abort: bool = True) -> None:
        """Take the server out of use and start its health check (brpc's docs/en/client.md)."""
        if self.closed:
            return
        was_available = self.available
        self.available = False
        breaker = self.breaker
        breaker.mark_as_broken()
        if abort:
            self.logged_off = False  # failed now, whatever it said before
            conn, self.single = self.single, None
            if conn is not None and not conn.is_closed:
                conn.abort(RpcError(EFAILEDSOCKET, f"Server {self.address} was marked failed: {why}"))
        if self._health is None:
            if was_available:
                self.stats.servers_marked_down += 1
                log.warning("server %s is marked failed (%s); health check in %d ms", self.address, why,
                            breaker.isolation_duration_ms)
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._health = loop.create_task(self._health_check(breaker.isolation_duration_ms / 1000))

    async def _health_check(self, delay: float) -> None:
        opts = self.options
        loop = asyncio.get_running_loop()
        try:
            await asyncio.sleep(delay)
            # Checks start at the isolation delay and back off to health_check_interval_s, so
            # a server that restarts quickly is back within a fraction of the interval.
            wait = max(delay, 0.05)
            while not self.closed:
                self.stats.health_checks += 1
                timeout = opts.health_check_timeout_ms / 1000 if opts.health_check_timeout_ms >= 0 else None
                try:
                    transport, _ = await open_connection(loop, asyncio.Protocol, self.host, self.port, timeout)
                except (OSError, UnicodeError, asyncio.TimeoutError):
                    wait = min(wait * 2, opts.health_check_interval_s)
                    await asyncio.sleep(wait)
                    continue
                transport.close()
                self._revive()
                return
        finally:
            self._health = None

    def _revive(self) -> None:
        self.available = True
        self.logged_off = False
        self.stats.servers_revived += 1
        self.breaker.reset()
        log.info("server %s is revived", self.address)

    # -- event loops ---------------------------------------------------------------------------
    def move_to(self, loop) -> None:
        """The loop of its connections, timers and tasks ended: drop them all; what is needed is
        made anew on `loop` (a down server is health-checked from there)."""
        checking = self._health is not None
        self.drop()
        if checking and not self.closed:
            self._health = loop.create_task(self._health_check(self.breaker.isolation_duration_ms / 1000))

    def drop(self) -> None:
        """Forget its connections, timers and tasks, whose event loop has ended."""
        for conn in self.connections:
            conn.drop()
        self.connections.clear()
        self.single = None
        self._idle.clear()
        self._quiet.clear()
        for handle in (self._connecting, self._health, self._idle_timer, self._sweep_timer):
            if handle is not None:
                cancel_on_dead_loop(handle)
        self._connecting = self._health = self._idle_timer = self._sweep_timer = None

    # -- closing -------------------------------------------------------------------------------
    def retire(self, why: str = "the server left the naming service's list") -> None:
        """No channel uses the server any more: no health checks, no new calls; the
        connections close (calls still on them fail over like any broken connection)."""
        self.closed = True
        self.closed_why = why
        for t in (self._connecting, self._health):
            if t is not None:
                t.cancel()
        self._stop_timers()
        for conn in list(self.connections):
            conn.close()
        self.single = None

    async def close(self) -> None:
        self.closed = True
        self.closed_why = "the channel was closed"
        tasks = [t for t in (self._connecting, self._health) if t is not None]
        for t in tasks:
            t.cancel()
        self._stop_timers()
        err = RpcError(EFAILEDSOCKET, f"Channel to {self.address} was closed")
        for conn in list(self.connections):
            conn.abort(err)
        self.single = None
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _stop_timers(self) -> None:
        for handle in (self._idle_timer, self._sweep_timer):
            if handle is not None:
                handle.cancel()
        self._idle_timer = self._sweep_timer = None
        self._idle.clear()
        self._quiet.clear()

    def __repr__(self) -> str:
        state = "up" if self.available else "logged off" if self.logged_off else "down"
        return f"<ServerPool {self.address} {state} {len(self.connections)} connections>"


def cancel_on_dead_loop(handle) -> None:
    try:
        handle.cancel()
    except RuntimeError:  # its loop is closed: nothing of it runs again anyway
        pass


def _unresolvable(host: str, e: Exception) -> str:
    """Why `host` has no address, in words (not gaierror's bare number)."""
    if isinstance(e, socket.gaierror):
        reason = e.strerror or f"getaddrinfo error {e.errno}"
    else:
        reason = "not a valid host name"
    return f"cannot resolve host {host!r}: {reason}"


async def _credential(auth, address: str) -> bytes:
    try:
        cred = auth.generate_credential()
        if inspect.isawaitable(cred):
            cred = await cred
    except Exception as e:
        log.error("auth.generate_credential() for %s raised %r", address, e, exc_info=e)
        raise RpcError(EREQUEST, f"Fail to generate credential for {address}: {e!r}") from None
    if isinstance(cred, str):
        cred = cred.encode()
    if not isinstance(cred, (bytes, bytearray)):
        raise RpcError(EREQUEST, f"generate_credential() must return bytes, got {type(cred).__name__}")
    return bytes(cred)
