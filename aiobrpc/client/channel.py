"""Channel: calls to one brpc server, or to a cluster through a naming service and a load
balancer (brpc's docs/en/client.md).

`Channel("host:port")` talks to one server; `Channel("list://h1:p1,h2:p2", load_balancer="rr")`
to a cluster. The connection type (single / pooled / short), the deadline covering every
attempt, retries, the backup request and health checks are the channel options'
(`ChannelOptions`), overridable per call in the `Controller`. The life of a call is in
client/call.py, connections and server health in client/pool.py.

>>> channel = Channel("127.0.0.1:8000", ChannelOptions(timeout_ms=500))  # doctest: +SKIP
>>> await Stub(channel, echo_pb2.DESCRIPTOR.services_by_name["EchoService"]).Echo(req)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import weakref

from google.protobuf.message import EncodeError
from google.protobuf.message import Message as _Message

from ..controller import Controller
from ..errors import EFAILEDSOCKET, EHOSTDOWN, EINVAL, ENODATA, EREQUEST, RpcError
from ..interceptors import chain
from ..options import ChannelOptions
from ..protocol import content
from ..stub import wrong_request
from .call import Call, CallbackFailed
from ..deadlines import TimerWheel
from .connection import ClientStats
from .lb import create_load_balancer
from .metrics import MethodTable
from .naming.follow import follow_naming
from .naming import NamingService, ServerNode, create_naming_service, is_naming_url
from .naming.list import ListNamingService
from .pool import ServerPool, cancel_on_dead_loop
from .socket_map import SOCKET_MAP, running_loop

_new_controller = object.__new__

log = logging.getLogger(__name__)

# A naming service whose watch raised is watched again after this backoff, doubled per failure.
NAMING_RETRY_MIN_S = 0.1
NAMING_RETRY_MAX_S = 10.0


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port), with a clear error for anything else."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a str like '127.0.0.1:8000', got {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"address must look like 'host:port' with a port in 1..65535, got {address!r}")
    return host, int(port)


class Channel:
    """A client of one server ("host:port") or of a cluster (a naming-service URL plus
    `load_balancer`, e.g. "list://10.0.0.1:8000,10.0.0.2:8000" and "rr"; or a `NamingService`
    object of one's own instead of the URL).

    Channels of the process (of one event loop) to the same server with the same connection
    options share its connections, health check and circuit breaker, as in C++ brpc: a
    channel per request costs no connection (client/socket_map.py; `connection_group`
    in the options keeps them apart).

    It connects on the first call (or `connect()`), on the running event loop, and is used
    from one loop at a time. Once that loop has ended (`asyncio.run` returned), a call from a
    new loop connects anew: the connections, timers and tasks of the old one are dropped.
    `async with Channel(...) as channel:` closes it at the end.

    Attributes:
        options (ChannelOptions): The channel's options (defaults when none were given).
        address (str): The server ("host:port") or the naming-service URL.
        stats (ClientStats): Counters of what the channel did (retries, backups, timeouts,
            servers marked down and revived ...); `repr()` shows them all on one line.

    Each method's calls are counted as the server counts them (count, QPS, errors, latency
    percentiles), with their retries and backup requests: `status()` returns them, and
    `aiobrpc.client.prometheus.ChannelCollector` exports them (docs/client_resilience.md).
    """

    def __init__(self, address: str | NamingService, options: ChannelOptions | None = None, *,
                 load_balancer: str | None = None) -> None:
        if options is None:
            options = ChannelOptions()
        elif not isinstance(options, ChannelOptions):
            raise TypeError(f"options must be a ChannelOptions, got {type(options).__name__}")
        self.options = options
        self.stats = ClientStats()
        self._methods = MethodTable() if options.method_status else None  # Call._complete records
        self.pools: dict[ServerNode, ServerPool] = {}
        self.lb = None
        # The load balancer's attempt_ended when it wants feedback (Call reports every attempt's
        # end to it), else None: balancers that do not learn cost the call path nothing.
        self._lb_feedback = None
        self.naming = None
        self._single: ServerPool | None = None
        self._watch: asyncio.Task | None = None
        self._first_list: asyncio.Future | None = None
        self._naming_error = ""  # the naming service's last fault, until its next good list
        self._calls: set[Call] = set()  # started and not ended
        self._loop: asyncio.AbstractEventLoop | None = None  # where its connections, timers and tasks live
        # The deadlines and backup-request times of its calls, each on one loop timer.
        self._deadlines: TimerWheel | None = None
        self._backups: TimerWheel | None = None
        self._closed = False
        # A channel dropped without close() lets its servers go when it is collected.
        self._abandon = weakref.finalize(self, SOCKET_MAP.abandon, self.pools, self.stats)
        self._abandon.atexit = False
        if options.interceptors:  # the others' calls go straight to the class's call_method
            self._plain_call = Channel.call_method.__get__(self)
            self.call_method = self._intercepted_call
        if isinstance(address, NamingService) or isinstance(address, str) and is_naming_url(address):
            if not load_balancer:
                raise ValueError(f"{address!r} is a naming service: give load_balancer= too "
                                 "(e.g. 'rr'), or pass a plain 'host:port'")
            self.naming = address if isinstance(address, NamingService) else create_naming_service(address)
            self.lb = create_load_balancer(load_balancer)
            if self.lb.wants_feedback:
                self._lb_feedback = self.lb.attempt_ended
            pools = self.pools
            self._available = lambda node: pools[node].available
            self.address = address if isinstance(address, str) else str(address)
            if isinstance(self.naming, ListNamingService):
                self._set_servers(list(self.naming.servers))  # static: known at once
        else:
            if load_balancer:
                raise ValueError(f"load_balancer={load_balancer!r} needs a naming service URL "
                                 f"(like 'list://host:port,...'), got {address!r}")
            host, port = parse_address(address)
            node = ServerNode(host, port)
            self._single = self.pools[node] = SOCKET_MAP.acquire(node, options, self.stats, running_loop())
            self.address = node.address
        self.host, self.port = (self._single.host, self._single.port) if self._single else ("", 0)

    # -- servers -----------------------------------------------------------------------------
    def _set_servers(self, servers) -> None:
        """A new server list from the naming service: diffed by (address, tag).

        A list that is not ServerNode items, or that the load balancer refuses, raises before
        anything changes: the channel keeps its last list."""
        if isinstance(servers, (str, bytes)) or not hasattr(servers, "__iter__"):
            raise TypeError(f"a server list must be an iterable of ServerNode, got {type(servers).__name__}")
        servers = list(servers)
        for node in servers:
            if not isinstance(node, ServerNode):
                raise TypeError(f"a server list must hold ServerNode items, got {node!r}")
        wanted = dict.fromkeys(servers)
        try:
            self.lb.set_servers(list(wanted))
        except Exception as e:
            raise ValueError(f"load_balancer.set_servers raised {e!r}") from e
        for node in list(self.pools):
            if node not in wanted:
                pool = self.pools.pop(node)
                if SOCKET_MAP.release(pool, self.stats):
                    pool.retire()
        loop = self._loop or running_loop()
        for node in wanted:
            if node not in self.pools:
                self.pools[node] = SOCKET_MAP.acquire(node, self.options, self.stats, loop)
        self._naming_error = ""
        self._release_first_list_waiters()

    def _release_first_list_waiters(self) -> None:
        if self._first_list is not None and not self._first_list.done():
            self._first_list.set_result(None)

    async def _watch_naming(self) -> None:
        """Follow the naming service. Its faults are its own: a bad list is logged and skipped,
        a watch that raises is logged and started again after a backoff (the last list is kept),
        and calls waiting for a first list that did not come are released to fail with ENODATA
        naming the fault."""
        await follow_naming(self.naming, self._set_servers, self._naming_failed, lambda: bool(self.pools),
                            NAMING_RETRY_MIN_S, NAMING_RETRY_MAX_S)

    def _naming_failed(self, why: str) -> None:
        self._naming_error = f"naming service {self.address} {why}"
        log.warning("%s; keeping %d servers", self._naming_error, len(self.pools))
        self._release_first_list_waiters()

    def _select_server(self, excluded, cntl: Controller) -> ServerPool:
        """The server of the next attempt, chosen by the load balancer with the servers to
        avoid (`excluded`) and the call's `cntl.request_code`; RpcError(EHOSTDOWN/ENODATA, or
        what the balancer raises: EINVAL, EREJECT) when there is none."""
        pool = self._single
        if pool is not None:
            if pool.available:
                return pool
            raise RpcError(EHOSTDOWN, f"Not connected to {pool.address} yet: the server is "
                                      f"{'logged off' if pool.logged_off else 'down'}, health check running")
        pools = self.pools
        if not pools:
            why = f" ({self._naming_error})" if self._naming_error else ""
            raise RpcError(ENODATA, f"Fail to select server: {self.address} lists no server{why}")
        try:
            node = self.lb.select(excluded=excluded, available=self._available,
                                  request_code=cntl.request_code)
        except RpcError:
            raise
        except Exception as e:
            raise CallbackFailed("load_balancer.select", e) from None
        return pools[node]

    def is_idempotent(self, service_name: str, method_name: str) -> bool:
        names = self.options.non_idempotent_methods
        return not names or (service_name not in names and f"{service_name}/{method_name}" not in names)

    async def connect(self) -> None:
        """Connect to every server now instead of on the first call: the single connection,
        or one idle pooled connection, of each server (short: a connection made and closed,
        a reachability check). Raises RpcError when one fails."""
        loop = self._running_loop()
        ctype = self.options.connection_type
        for pool in list(self.pools.values()):
            if ctype == "single":
                if pool.ready(ctype) is None:
                    await pool.connect(loop, None, ctype)
            elif ctype == "short" or pool.idle_count() == 0:
                # Not a single connection: its loss would mark the server failed.
                pool.release(await pool.connect(loop, None, ctype), ctype, True)

    def server_states(self) -> dict[str, str]:
        """"up", "down" (health check running) or "logged off", by server address."""
        return {str(node): ("up" if p.available else "logged off" if p.logged_off else "down")
                for node, p in self.pools.items()}

    # -- gauges ------------------------------------------------------------------------------
    def pending_calls(self) -> int:
        """Requests of this channel waiting for their reply, over every connection."""
        return sum(1 for p in self.pools.values() for c in p.connections for a in list(c.pending.values())
                   if a.call.channel is self)

    def connection_count(self) -> int:
        """Open connections to the channel's servers (shared with the other channels of the
        process to the same servers: client/socket_map.py)."""
        return sum(len(p.connections) for p in self.pools.values())

    def status(self) -> dict[str, dict]:
        """Each method's figures, by "package.Service/Method": count, qps, error, eps, latency,
        latency_50 .. latency_9999, max_latency (the names of the server's /status; latencies in
        microseconds, rates over the last 10 s), retries and backups (requests sent again, and
        backup requests, by its calls). Past `aiobrpc.client.metrics.MAX_METHODS` (1024) methods,
        the calls of new ones are counted under "other". Empty with
        `ChannelOptions(method_status=False)`."""
        return self._methods.describe() if self._methods is not None else {}

    def _refused(self, service_name: str, method_name: str, cntl: Controller, code: int, text: str) -> RpcError:
        """A call that ends before it starts (closed channel, a request that does not serialize):
        it fails with (code, text), and is counted, as taking no time."""
        cntl.error_code, cntl.error_text = code, text
        if self._methods is not None:
            self._methods.ended(service_name, method_name, 0, True, 0, False)
        return RpcError(code, text)

    @property
    def _conn(self):
        """The single connection of a one-server channel (tests and tools), or None."""
        return self._single.single if self._single is not None else None

    # -- closing -----------------------------------------------------------------------------
    async def close(self) -> None:
        """End the channel: its calls in flight fail at once with EFAILEDSOCKET (no retry), and
        the connections of its servers close unless another channel still uses them."""
        self._running_loop()
        self._closed = True
        self._end_calls(RpcError(EFAILEDSOCKET, f"Channel to {self.address} was closed"))
        self._deadlines.close()
        self._backups.close()
        self._release_first_list_waiters()  # calls waiting for it find the channel closed
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None
        if self.naming is not None:
            try:
                await self.naming.close()
            except Exception as e:  # the connections close all the same
                log.error("naming service %s failed to close: %r", self.address, e, exc_info=e)
        self._abandon.detach()
        for node in list(self.pools):
            pool = self.pools.pop(node)
            if SOCKET_MAP.release(pool, self.stats):
                await pool.close()
        await asyncio.sleep(0)

    def _end_calls(self, err: RpcError) -> None:
        """End every call in flight now, wherever it is: on a connection, connecting, waiting
        for a retry's backoff (their attempts would otherwise fail one by one and be retried)."""
        calls, self._calls = self._calls, set()
        for call in calls:
            try:
                call.abort(RpcError(err.code, err.text))
            except RuntimeError:  # a call of a closed loop (the channel moved on): no one waits for it
                pass

    async def __aenter__(self) -> Channel:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- calls -------------------------------------------------------------------------------
    async def call_method(self, service_name: str, method_name: str, request, response_class,
                          cntl: Controller | None = None):
        """Call `service_name`/`method_name` with a protobuf `request`; return the response.

        Raises RpcError on failure (also recorded in `cntl`), and TypeError, before anything
        is sent, for a `request` that is not a protobuf message (a dict, say).
        """
        if not isinstance(request, _Message):  # check_request's test, inline: one call less per call
            raise wrong_request(service_name, method_name, _Message, request)
        if cntl is None:
            cntl = _new_controller(Controller)  # Controller() with no argument: nothing to check
        else:
            cntl.reset_result()
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            try:
                self._move_to(loop)
            except RpcError as e:
                raise self._refused(service_name, method_name, cntl, e.code, e.text) from None
        cntl.service_name = service_name
        cntl.method_name = method_name
        try:
            ctype = cntl.request_content_type
            serialized = request.SerializeToString() if ctype == content.PB else content.serialize(request, ctype)
        except (EncodeError, ValueError, TypeError) as e:
            raise self._refused(service_name, method_name, cntl, EREQUEST, f"Fail to serialize request: {e}") from None
        if self._closed:
            self._check_open(cntl)
        started = None
        if self.lb is not None and not self.pools and (self._first_list is None or not self._first_list.done()):
            started = loop.time()  # the wait for the first list is part of the call's time
            await self._wait_first_list(loop, cntl)
            self._check_open(cntl)  # closed while it waited
        call = Call(self, loop, service_name, method_name, serialized, response_class, cntl, started)
        call.start()
        try:
            return await call.fut
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            call = None  # the failed future's traceback holds this frame: no cycle to the call

    async def _intercepted_call(self, service_name: str, method_name: str, request, response_class,
                                cntl: Controller | None = None):
        """call_method through the options' interceptors (aiobrpc/interceptors.py)."""
        if cntl is None:
            cntl = Controller()
        cntl.service_name = service_name
        cntl.method_name = method_name
        call = self._plain_call

        async def innermost(req, c):
            return await call(service_name, method_name, req, response_class, c)
        try:
            response = await chain(self.options.interceptors, innermost, response_class)(request, cntl)
        except RpcError as e:
            cntl.error_code, cntl.error_text = e.code, e.text
            raise
        cntl.error_code, cntl.error_text = 0, ""
        return response

    # -- event loops -------------------------------------------------------------------------
    def _running_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._move_to(loop)
        return loop

    def _move_to(self, loop: asyncio.AbstractEventLoop) -> None:
        """Use the channel from `loop`. The loop it was used from before, if any, has ended
        (two `asyncio.run()` with one channel): what lived there is dropped, and made anew here."""
        old = self._loop
        if old is not None and old.is_running() and not old.is_closed():
            raise RpcError(EINVAL, f"Channel to {self.address} is in use by an event loop still running "
                                   "in another thread: a Channel belongs to one loop at a time")
        self._loop = loop
        self._deadlines = TimerWheel(loop, Call._timed_out)  # the old loop's (if any) ended with it
        self._backups = TimerWheel(loop, Call._backup_due)
        pools = self.pools
        for node, pool in list(pools.items()):
            pools[node] = SOCKET_MAP.rebind(pool, self.stats, loop)
        if self._single is not None and pools:
            self._single = pools[self._single.node]
        if old is None:
            return
        self._end_calls(RpcError(EFAILEDSOCKET, f"Channel to {self.address} moved to another event loop"))
        if self._watch is not None:
            cancel_on_dead_loop(self._watch)
            self._start_watching(loop)
            if self.pools:
                self._first_list.set_result(None)
        elif self._first_list is not None:
            self._first_list = None

    def _check_open(self, cntl: Controller) -> None:
        if self._closed:
            raise self._refused(cntl.service_name, cntl.method_name, cntl, EHOSTDOWN,
                                f"Channel to {self.address} is closed")

    async def _wait_first_list(self, loop, cntl: Controller) -> None:
        """A dynamic naming service: start watching, and wait (bounded) for its first list."""
        if self._first_list is None:
            self._start_watching(loop)
        timeout_ms = self.options.timeout_ms if cntl.timeout_ms is None else cntl.timeout_ms
        try:
            await asyncio.wait_for(asyncio.shield(self._first_list), None if timeout_ms < 0 else timeout_ms / 1000)
        except asyncio.TimeoutError:
            pass  # the call fails with ENODATA

    def _start_watching(self, loop: asyncio.AbstractEventLoop) -> None:
        self._first_list = loop.create_future()
        self._watch = loop.create_task(self._watch_naming())

    def __repr__(self) -> str:
        return f"<Channel {self.address} {self.options.connection_type} {len(self.pools)} servers>"
