"""Server: listens, accepts, dispatches each request to its servicer, as its own task once it suspends.

>>> server = Server(ServerOptions())  # doctest: +SKIP
>>> server.add_service(Echo())  # doctest: +SKIP
>>> await server.start("127.0.0.1:0"); print(server.port)  # doctest: +SKIP
>>> await server.stop(); await server.join()  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import logging
import ssl
import sys
import time

from .. import tracing
from ..errors import EFAILEDSOCKET, EINTERNAL, EOVERCROWDED, EREQUEST, ERESPONSE, RemoteProtocolError, RpcError
from ..options import ServerOptions
from ..protocol import streaming
from ..stream import streams_failed
from ..stub import Servicer
from ..tls import ServerTlsOptions, server_context
from ..transport import memory
from ..transport.tcp import RateLimitedLog, buffers_size
from . import builtin
from .connection import ServerConnection
from .series import SeriesTable
from .intercept import intercept
from .inline import run_inline
from .dispatch import (Registry, admission_error, error_response, exception_text, handler_failed, limit_error,
                       overcrowded_text, parse_request, request_ended, server_controller, set_failed,
                       streaming_refusal, success_response)
from ..limiters import make_limiter

log = logging.getLogger(__name__)
_new_task = asyncio.Task
# The running task of a loop: before 3.12 asyncio.current_task is Python around the C dict.
_current_task = asyncio.current_task if sys.version_info >= (3, 12) else asyncio.tasks._current_tasks.get
_EAGER = {"eager_start": True} if sys.version_info >= (3, 12) else {}
# 3.11: run_inline does what eager tasks do. 3.10: a Task per request (run_inline hands a
# suspended coroutine to a Task made with `context=`, which 3.10's Task does not take).
_INLINE = sys.version_info[:2] == (3, 11)
_refuse_log = RateLimitedLog()
_now_ns = time.perf_counter_ns
BLOCK_RELEASE_IDLE_S = 1.0  # an idle connection gives its read block back after this long
_CLOSE_GRACE_SEC = 1.0  # join() without a timeout: how long peers get to read their last replies


class ServerStats:
    """Counters a server keeps (`server.stats`), plain integers updated in the hot path.

    Attributes:
        requests: Requests received (each frame that asked for a method).
        failed_requests: Requests answered with an error: refused (ELIMIT, EOVERCROWDED,
            ELOGOFF), not found, not parsed, or failed by their handler.
        dropped_replies: Replies not sent because the connection had closed meanwhile.
        connections_accepted: Connections accepted.
        connections_refused: Connections closed at once: `max_connections` reached, or
            the server stopping.
        stream_frames_dropped: Stream frames received and dropped: for a stream id unknown here
            (closed, or never opened), unparsable, of an unknown type, or before authentication.
        closed: Connections the server closed, by reason (a `collections.Counter`):
            "first_frame_timeout", "idle_timeout", "auth_failed", "bad_frame",
            "unknown_protocol", "close_connection", "bad_h2" (an HTTP/2 peer broke a rule or
            a limit: server/grpc/session.py).
    """

    __slots__ = ("requests", "failed_requests", "dropped_replies", "connections_accepted",
                 "connections_refused", "stream_frames_dropped", "closed")

    def __init__(self) -> None:
        self.requests = 0
        self.failed_requests = 0
        self.dropped_replies = 0
        self.connections_accepted = 0
        self.connections_refused = 0
        self.stream_frames_dropped = 0
        self.closed: collections.Counter = collections.Counter()

    def count_close(self, reason: str) -> None:
        self.closed[reason] += 1


class Server:
    """A baidu_std server. Add servicers, `await start(address)`, later `stop()` and `join()`.

    Each request runs in its own task (`async def` handlers, also behind a decorator) or in
    the thread pool (plain `def` handlers), so a slow handler never delays the others; an
    awaitable a handler returns is awaited on the loop. A handler returns its response
    message, or raises `RpcError(code, text)` to send that code and text (for a bad request:
    `errors.EREQUEST`); any other exception is logged and sent as EINTERNAL. A response that
    cannot be sent (of the wrong type, an attachment that is not a buffer, a user field that
    is not a string) is logged and sent as ERESPONSE, and an error that cannot be sent (code 0
    or beyond int32, text that is not UTF-8) as EINTERNAL: every request gets a reply.
    `async with Server(...) as server:` stops and joins it at the end.

    Attributes:
        options (ServerOptions): The server's options (defaults when none were given).
        stats (ServerStats): Counters of requests and connections.
        host (str): The address listened on, once started.
        port (int): The port listened on, once started (the one chosen for port 0).
    """

    def __init__(self, options: ServerOptions | None = None) -> None:
        if options is None:
            options = ServerOptions()
        elif not isinstance(options, ServerOptions):
            raise TypeError(f"options must be a ServerOptions, got {type(options).__name__}")
        self.options = options
        self.ssl_context = server_context(options.ssl)  # files are read now: a bad one fails here
        if isinstance(options.ssl, ServerTlsOptions):
            # gRPC clients insist on ALPN h2; an SSLContext of the user's is left as it is
            self.ssl_context.set_alpn_protocols(["h2", "http/1.1"])
        # plaintext is refused where TLS is forced, and by default where client certificates are required
        self.force_ssl = options.force_ssl if options.force_ssl is not None else (
            self.ssl_context is not None and self.ssl_context.verify_mode == ssl.CERT_REQUIRED)
        self.registry = Registry()
        self._intercepted = False  # the handlers are behind options.interceptors
        self.stats = ServerStats()
        self.connections: set[ServerConnection] = set()
        self.concurrency = 0
        self.stopping = False
        self.closing_connections = False
        self._cancelling_requests = False  # join() cancels them: a CancelledError then is not a failure
        self._listener: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._idle: asyncio.Future | None = None  # join() waits on it for concurrency to reach 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._housekeeper: asyncio.Task | None = None
        self.port = 0
        self.host = ""
        self.started_at = 0.0  # time.monotonic() at start()
        self.internal_port = 0  # where the builtin pages are, once started with options.internal_port >= 0
        # Each numeric variable's last 60 s and 60 min, for the pages' plots (sampled by the housekeeper).
        self.series = SeriesTable() if self.options.has_builtin_services else None
        # The last calls for /rpcz (options.rpcz): (wall time, trace_id, span_id, parent_span_id,
        # method, peer, latency_us, error_code, protocol)
        self.rpcz: collections.deque | None = (
            collections.deque(maxlen=options.rpcz_max_records) if options.rpcz else None)
        self._internal_listener: asyncio.AbstractServer | None = None
        # options.grpc_health's servicer, once started: grpc_health.set_status(service, serving)
        self.grpc_health = None

    def add_service(self, servicer: Servicer) -> None:
        """Serve the methods of `servicer` (a `Servicer` with its `SERVICE` set), before
        `start()`. A method of the service it does not define answers EINTERNAL."""
        if self._listener is not None:
            raise RuntimeError("add services before start()")
        self.registry.add(servicer)
        for entry in self.registry.services[servicer.SERVICE.full_name].values():
            entry.status.limiter = make_limiter(self.options.method_max_concurrency)

    def max_concurrency_of(self, method: str, setting) -> None:
        """The concurrency limiter of `method` ("pkg.Service.Method", a method of a service
        added), as brpc's MaxConcurrencyOf: 0 or "unlimited", an int N, "auto", "timeout",
        or {"timeout_ms": T, "max_concurrency": N}. Before `start()`."""
        if self._listener is not None:
            raise RuntimeError("set limits before start()")
        service, _, name = method.rpartition(".")
        entry = self.registry.services.get(service, {}).get(name)
        if entry is None:
            known = [f"{s}.{m}" for s, ms in self.registry.services.items() for m in ms]
            raise ValueError(f"no method {method!r} here; the methods are: {', '.join(known) or 'none'}")
        entry.status.limiter = make_limiter(setting)

    @property
    def address(self) -> str:
        """"host:port" listened on, once started: what a client's Channel takes."""
        return f"{self.host}:{self.port}"

    async def start(self, address: str | int = "127.0.0.1:0") -> None:
        """Listen on `address`: "host:port" (port 0: any free port, then read `port` or
        `address`), or a port number alone for every interface ("0.0.0.0").

        The host "memory.invalid" opens no socket: the server is reached in memory, by a
        `Channel` of this process and event loop given its `address` (`aiobrpc.testing`)."""
        if self._listener is not None:
            raise RuntimeError("server is already started")
        if isinstance(address, int):
            host, port = "0.0.0.0", address
        else:
            host, sep, port_s = address.rpartition(":")
            if not sep or not (port_s.isascii() and port_s.isdigit()):
                raise ValueError(f"address must look like 'host:port' (port 0 = any), got {address!r}")
            host, port = host.strip("[]") or "0.0.0.0", int(port_s)
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0 = any), got {port}")
        loop = asyncio.get_running_loop()
        self.stopping = False
        self.closing_connections = False
        self._cancelling_requests = False
        self._add_grpc_services()
        self._listener, bound = await _listen(loop, lambda: ServerConnection(self), host, port)
        self.host, self.port = bound[0], bound[1]
        if self.options.internal_port >= 0:
            try:
                self._internal_listener, bound = await _listen(
                    loop, lambda: ServerConnection(self, internal=True), host, self.options.internal_port)
            except BaseException:
                self._listener.close()
                self._listener = None
                raise
            self.internal_port = bound[1]
        self._intercept_handlers()
        self.started_at = time.monotonic()
        self._housekeeper = loop.create_task(self._housekeeping())

    async def stop(self) -> None:
        """Stop accepting; new requests on open connections get ELOGOFF; in-flight ones finish."""
        self.stopping = True
        if self.grpc_health is not None:
            self.grpc_health.changed()  # NOT_SERVING to the Watch streams, which then end
        if self._listener is not None:
            self._listener.close()
        if self._internal_listener is not None:
            self._internal_listener.close()

    async def join(self, timeout: float | None = None) -> None:
        """Wait for in-flight requests (up to `timeout` s, then cancel them) and close connections.

        Replies still unsent get what is left of `timeout` (without one, 1 s) to be read;
        then the connections of peers that do not read them are aborted, so that join()
        returns and frees them whatever the peers do.
        """
        if not self.stopping:
            await self.stop()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        await self._finish_requests(timeout)
        self.closing_connections = True
        for conn in list(self.connections):
            conn.close()
        if self._housekeeper is not None:
            self._housekeeper.cancel()
            await asyncio.gather(self._housekeeper, return_exceptions=True)
            self._housekeeper = None
        grace = _CLOSE_GRACE_SEC if deadline is None else max(0.0, deadline - loop.time())
        if not await self._connections_closed(grace):
            self._abort_connections(grace)
            await self._connections_closed(_CLOSE_GRACE_SEC)  # connection_lost comes a loop iteration later
        for listener in (self._listener, self._internal_listener):
            if listener is not None:
                await listener.wait_closed()  # from 3.12 it waits for every connection: all are closed now
        self._listener = self._internal_listener = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    async def _finish_requests(self, timeout: float | None) -> None:
        if self.concurrency:
            if self._idle is None or self._idle.done():
                self._idle = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._idle), timeout)
            except asyncio.TimeoutError:
                log.warning("cancelling %d requests still running after %ss", self.concurrency, timeout)
        self._cancelling_requests = True
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            _, running = await asyncio.wait(list(self._tasks), timeout=_CLOSE_GRACE_SEC)
            if running:
                log.warning("%d requests ignored their cancellation; their replies will be dropped",
                            len(running))

    async def _connections_closed(self, within: float) -> bool:
        """Whether every connection has closed, waiting up to `within` seconds."""
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        while self.connections and loop.time() < end:
            await asyncio.sleep(0.01)
        return not self.connections

    def _abort_connections(self, waited: float) -> None:
        unread = [conn for conn in self.connections if conn.unwritten_bytes()]
        if unread:
            log.warning("aborting %d connections whose peers did not read %d bytes of replies within %.3gs",
                        len(unread), sum(conn.unwritten_bytes() for conn in unread), waited)
        for conn in list(self.connections):
            conn.abort()

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()
        await self.join()

    # -- connections -------------------------------------------------------------------------
    def _connection_opened(self, conn: ServerConnection) -> bool:
        if len(self.connections) >= self.options.max_connections or self.stopping:
            self.stats.connections_refused += 1
            _refuse_log(logging.WARNING, "refusing connection from %s: %d connections open (max_connections=%d)",
                        conn.peer, len(self.connections), self.options.max_connections)
            conn.abort()
            return False
        self.stats.connections_accepted += 1
        self.connections.add(conn)
        return True

    def connection_closed(self, conn: ServerConnection) -> None:
        self.connections.discard(conn)

    def stream_count(self) -> int:
        """Streams open on the server's connections (accepted and not ended)."""
        return sum(len(c.streams) for c in self.connections if c.streams is not None)

    def _track(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _housekeeping(self) -> None:
        """Every second (or idle_timeout_sec, if shorter): the variables are sampled for the
        pages' plots (series.py), and a connection with nothing in flight
        for BLOCK_RELEASE_IDLE_S gives its read block back (256 KiB; the next read makes
        another), so idle connections cost little memory; past idle_timeout_sec one is closed."""
        limit = self.options.idle_timeout_sec
        period = min(1.0, limit) if limit > 0 else 1.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            if self.series is not None:
                self.series.sample_if_due(now, read=self._variables)
            for conn in list(self.connections):
                if conn.inflight:
                    continue
                idle = now - conn.last_active
                if limit > 0 and idle > limit and not conn.streams:
                    self.stats.count_close("idle_timeout")
                    conn.close()
                elif idle >= BLOCK_RELEASE_IDLE_S:
                    conn.decoder.reader.rbuf.release()

    def _variables(self) -> list:
        return builtin.variables(self)

    def _add_grpc_services(self) -> None:
        """The builtin gRPC services options.grpc_health and grpc_reflection ask for, once."""
        services = self.registry.services
        if self.options.grpc_health and self.grpc_health is None:
            from .grpc.health import HealthServicer
            self.grpc_health = HealthServicer(self)
            self.add_service(self.grpc_health)
        if self.options.grpc_reflection and "grpc.reflection.v1.ServerReflection" not in services:
            from .grpc.reflection import ReflectionV1, ReflectionV1alpha
            self.add_service(ReflectionV1(self))
            self.add_service(ReflectionV1alpha(self))

    def _intercept_handlers(self) -> None:
        """Every method's handler behind the options' interceptors, once (a restarted server
        keeps its chains)."""
        interceptors = self.options.interceptors
        if not interceptors or self._intercepted:
            return
        self._intercepted = True

        def run_in_pool(handler, request, cntl):
            return asyncio.get_running_loop().run_in_executor(self._thread_pool(), handler, request, cntl)
        for methods in self.registry.services.values():
            for entry in methods.values():
                if not entry.streaming:  # a streaming handler is an async generator: not a call to wrap
                    intercept(entry, interceptors, run_in_pool)

    # -- requests ----------------------------------------------------------------------------
    def _tag(self, conn: ServerConnection) -> str:
        return self.options.server_tag or conn.local

    def _dispatch(self, conn: ServerConnection, ev) -> None:
        self.stats.requests += 1
        meta = ev.meta
        offer = None
        try:
            if meta.stream_settings is not None:
                try:
                    offer = streaming.decode_settings(meta.stream_settings)
                except RemoteProtocolError as e:
                    raise RpcError(EREQUEST, f"the request's stream_settings: {e}") from None
            rejected = admission_error(self, conn, ev)
            if rejected is not None:
                raise RpcError(*rejected)
            entry = self.registry.lookup(meta.service_name, meta.method_name)
            if entry.streaming:
                raise RpcError(*streaming_refusal(entry))
            if not entry.status.admits(meta.timeout_ms):
                raise RpcError(*limit_error(entry))
            request = parse_request(entry, ev, self.options.max_decompressed_size)
        except Exception as e:
            if not isinstance(e, RpcError):  # a bug of ours: this request fails, the connection goes on
                log.error("reading a request of %s/%s from %s raised %r", meta.service_name,
                          meta.method_name, conn.peer, e, exc_info=e)
                e = RpcError(EINTERNAL, f"Fail to read the request: {e!r}")
            self.stats.failed_requests += 1
            bufs = error_response(meta, e.code, e.text, self._tag(conn))
            if offer is not None:  # brpc answers inside the offered stream even when refusing it
                bufs = streaming.wrap(offer.stream_id, streaming.INVALID_STREAM_ID, bufs, buffers_size(bufs))
            conn.write(bufs, buffers_size(bufs))
            return
        cntl = server_controller(ev, conn, entry)
        if offer is not None:
            cntl._stream_offer = (conn, offer)
        status = entry.status
        if self.options.method_status or status.limiter is not None:
            # counted when admitted, as the server's own concurrency: before 3.11 the handler
            # starts a loop iteration later, after the other requests of the same read
            status.concurrency += 1
        else:
            status = None
        self.concurrency += 1
        conn.inflight += 1
        # A task per request that suspends, so a slow handler never delays the others; one
        # that finishes without suspending runs at once and costs no task nor loop iteration:
        # from 3.12 an eager task, before it run_inline (a task only from the first suspension).
        loop = conn.loop
        coro = self._serve(conn, meta, entry, request, cntl, status)
        if _INLINE and _current_task(loop) is None:  # a task runs us when an async auth let the request in
            task = run_inline(coro, loop)
            if task is not None:
                self._tasks.add(task)  # _serve removes it, which is cheaper than a done callback
            return
        task = _new_task(coro, loop=loop, **_EAGER)
        if not task.done():
            self._tasks.add(task)

    async def _serve(self, conn: ServerConnection, meta, entry, request, cntl, status) -> None:
        # status: the method's MethodStatus where _dispatch counted the request in it, else None
        started = _now_ns()
        otel = None
        if cntl.trace_id is not None:  # a traced request: its span is current while the handler runs
            span = tracing.Span(cntl.trace_id, cntl.span_id or 0, cntl.parent_span_id)
            tracing.enter(span)
            if tracing.OTEL is not None:
                otel = tracing.start_server_span(entry.full_name, span, conn.peer)
        try:
            response = None
            try:
                if entry.is_async:
                    response = await entry.handler(request, cntl)
                else:
                    response = await conn.loop.run_in_executor(self._thread_pool(), entry.handler,
                                                               request, cntl)
                if type(response) is not entry.response_class:
                    while inspect.isawaitable(response):  # from a plain def, or a decorator's wrapper
                        response = await response
            except RpcError as e:
                set_failed(cntl, entry, e.code, e.text)
            except asyncio.CancelledError as e:
                if self._cancelling_requests:
                    raise
                handler_failed(cntl, entry, e)
            except Exception as e:
                handler_failed(cntl, entry, e)
            if conn.is_closed:
                self.stats.dropped_replies += 1
                if cntl._accepted_streams:
                    streams_failed(cntl._accepted_streams, EFAILEDSOCKET, f"Connection to {conn.peer} closed")
                return
            if cntl._close_reason is not None:
                self.stats.count_close("close_connection")
                conn.close()
                return
            if not conn.writable() and not cntl.error_code and cntl._stream_offer is None:
                # Replies the peer does not read stay bounded: past max_unwritten_bytes a reply
                # becomes a short EOVERCROWDED error (requests read together were all admitted
                # before any reply was queued).
                set_failed(cntl, entry, EOVERCROWDED, overcrowded_text(conn))
            bufs = None if cntl.error_code else _success_reply(meta, entry, response, cntl)
            if bufs is None:
                self.stats.failed_requests += 1
                bufs = _error_reply(conn, meta, entry, cntl, self._tag(conn))
            if cntl._stream_offer is not None:
                _stream_reply(conn, cntl, bufs)
            else:
                conn.write(bufs, buffers_size(bufs), conn.inflight == 1, early=True)
        except Exception:
            # Not even an error reply could be built: closing is how the caller learns it.
            log.exception("no reply to %s from %s could be built; closing the connection", entry.full_name,
                          conn.peer)
            conn.abort()
        finally:
            if self.rpcz is not None or otel is not None:
                request_ended(self, conn, entry, cntl, status, started, "baidu_std", otel)
            elif status is not None:  # request_ended's only work here, without its call
                status.ended((_now_ns() - started) // 1000, cntl.error_code)
            if self._tasks:
                self._tasks.discard(_current_task(conn.loop))
            self.concurrency -= 1
            if self.concurrency == 0 and self._idle is not None and not self._idle.done():
                self._idle.set_result(None)
            conn.request_done()

    def _thread_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                self.options.handler_threads, thread_name_prefix="aiobrpc-handler")
        return self._executor


async def _listen(loop, protocol_factory, host: str, port: int) -> tuple:
    """(listener, (host, port) it listens on) for connections made by `protocol_factory`."""
    if host == memory.MEMORY_HOST:
        listener = memory.serve(loop, protocol_factory, port)
        return listener, (host, listener.port)
    listener = await loop.create_server(protocol_factory, host, port, reuse_address=True)
    return listener, listener.sockets[0].getsockname()


# -- the reply to a request whose handler has returned ----------------------------------------
# Each step turns what the handler left that cannot be sent into an error that can, named in
# the reply and logged once: the caller always gets an answer.

def _success_reply(meta, entry, response, cntl) -> list | None:
    """The reply carrying `response`, or None with `cntl` failed by why it cannot be sent."""
    if not isinstance(response, entry.response_class):
        why = f"handler returned {type(response).__name__}, expected {entry.response_class.DESCRIPTOR.full_name}"
    else:
        try:
            return success_response(meta, response, cntl)
        except RpcError as e:
            why = e.text
    log.error("%s: %s", entry.full_name, why)
    set_failed(cntl, entry, ERESPONSE, why)
    return None


def _stream_reply(conn, cntl, bufs: list) -> None:
    """The reply to a request that offered streams goes inside a STRM DATA frame to the client's
    first stream; right after it the accepted streams connect (and send what the handler
    already wrote), or fail with the call's error."""
    offer = cntl._stream_offer[1]
    accepted = cntl._accepted_streams
    ok = accepted and not cntl.failed
    source = accepted[0].id if ok else streaming.INVALID_STREAM_ID
    conn.write(streaming.wrap(offer.stream_id, source, bufs, buffers_size(bufs)))
    if ok:
        for s in accepted:
            s._connected()
    elif accepted:
        streams_failed(accepted, cntl.error_code, cntl.error_text)


def _error_reply(conn, meta, entry, cntl, tag: str) -> list:
    """The reply carrying cntl's error, or an EINTERNAL one naming why that cannot be sent."""
    try:
        return error_response(meta, cntl.error_code, cntl.error_text, tag)
    except Exception as e:
        why = (f"the handler's error [E{cntl.error_code!r}]{cntl.error_text!r} cannot be sent: "
               f"{exception_text(e)}")
        log.error("%s: %s", entry.full_name, why)
        return error_response(meta, EINTERNAL, why, tag)
