"""Servers shared by the channels of a process (brpc's SocketMap).

Channels that talk to the same server (address and tag) with the same connection options share
one `ServerPool`: its single connection (the calls of every channel multiplexed on it), its
idle pooled connections, its health check and its circuit breaker. So a hundred channels to a
server hold one connection to it, a server one channel found down is skipped by the others at
once, and one breaker sees every channel's failures, as in C++ brpc.

The options that make connections differ form the pool's signature (`signature`): brpc's
(auth, TLS, `connection_group`) and the other settings a pool applies to its connections
(timeouts, size limits, pool sizes, health checks, the breaker's windows). Channels with
different signatures never share; `ChannelOptions(connection_group="...")` keeps a channel's
connections apart on purpose.

asyncio objects belong to one event loop, so the map is keyed by loop too: channels of two
loops (two threads) do not share. A channel made outside any loop holds pools of no loop (they
have no connection yet) until its first call moves it to its loop (`rebind`). A pool lives
while a channel holds it; the last one to let it go closes it.
"""

from __future__ import annotations

import asyncio
import threading

from .connection import ClientStats
from .pool import ServerPool

# Read by a pool for its connections: equal values, or the same objects, to share one.
_CONNECTION_OPTIONS = ("protocol", "connection_group", "ssl", "ssl_handshake_timeout_ms", "auth",
                       "connect_timeout_ms", "max_body_size", "max_unwritten_bytes", "max_connection_pool_size",
                       "pool_idle_timeout_s", "health_check_interval_s", "health_check_timeout_ms", "socket_keepalive",
                       "socket_keepalive_idle_s", "socket_keepalive_interval_s", "socket_keepalive_count",
                       "tcp_user_timeout_ms")


def signature(options) -> tuple:
    """What of `options` must be equal for two channels to share a server's connections."""
    sig = [_same(getattr(options, name)) for name in _CONNECTION_OPTIONS]
    sig.append(tuple(sorted((k, _same(v)) for k, v in options.circuit_breaker_options.items())))
    return tuple(sig)


def _same(value):
    """`value` if it compares by value, else its identity (an authenticator, an SSLContext)."""
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))  # alive while the pool is: the pool keeps the options
    return value


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class SocketMap:
    """Pools by (event loop, server, signature), each with the stats of the channels holding it."""

    def __init__(self) -> None:
        self._pools: dict[tuple, ServerPool] = {}
        self._lock = threading.Lock()  # channels of loops in other threads acquire and release too

    def acquire(self, node, options, stats: ClientStats, loop) -> ServerPool:
        """The pool of `node` for a channel with `options` on `loop` (None: no loop yet),
        shared when one exists; `stats` counts what the pool does from now on."""
        key = (loop, node, signature(options))
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = ServerPool(node, options)
                pool.key = key
            pool.stats.holders.append(stats)
            return pool

    def release(self, pool: ServerPool, stats: ClientStats) -> bool:
        """A channel lets `pool` go; True when it was the last holder (the caller closes it)."""
        with self._lock:
            holders = pool.stats.holders
            holders.remove(stats)
            if holders:
                return False
            if self._pools.get(pool.key) is pool:
                del self._pools[pool.key]
            return True

    def rebind(self, pool: ServerPool, stats: ClientStats, loop) -> ServerPool:
        """The pool for the channel now used from `loop`, whose former loop (the pool's, or
        None) has ended: the pool itself, moved, when the channel held it alone and `loop` has
        none yet (a down server stays down and is checked from `loop`); else the one of `loop`."""
        old_loop = pool.key[0]
        if old_loop is loop:
            return pool
        key = (loop,) + pool.key[1:]
        with self._lock:
            moved = key not in self._pools and pool.stats.holders == [stats]
            if moved:
                if self._pools.get(pool.key) is pool:
                    del self._pools[pool.key]
                pool.key = key
                self._pools[key] = pool
        if moved:
            if old_loop is not None:
                pool.move_to(loop)
            return pool
        new = self.acquire(pool.node, pool.options, stats, loop)
        if self.release(pool, stats) and old_loop is not None:
            pool.drop()
        return new

    def abandon(self, pools: dict, stats: ClientStats) -> None:
        """A channel that was never closed is gone (garbage collected): its pools (by node) are
        let go, and the last holder's connections closed on their loop (dropped if it has ended)."""
        for pool in list(pools.values()):
            if not self.release(pool, stats):
                continue
            loop = pool.key[0]
            if loop is None:
                continue
            if loop.is_closed():
                pool.drop()
                continue
            try:
                loop.call_soon_threadsafe(pool.retire, "the channel was garbage collected")
            except RuntimeError:  # closed meanwhile
                pool.drop()

    def __len__(self) -> int:
        return len(self._pools)


SOCKET_MAP = SocketMap()
