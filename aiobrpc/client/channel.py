"""Channel: calls to one brpc server over one multiplexed connection (client.md §1, §3.1).

The connection is made on the first call and remade on the next call after it is lost. Each
call is one future in the pending map of the connection, completed from the protocol
callback; its deadline is one timer handle covering the whole call (connect, retries
included). A lost connection fails every call pending on it at once.

>>> channel = Channel("127.0.0.1:8000", ChannelOptions(timeout_ms=500))  # doctest: +SKIP
>>> await Stub(channel, echo_pb2.DESCRIPTOR.services_by_name["EchoService"]).Echo(req)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import os
import time

from google.protobuf.message import EncodeError

from .. import _fast
from ..controller import Controller
from ..errors import (DEFAULT_RETRYABLE, ECONNREFUSED, EFAILEDSOCKET, EOVERCROWDED, EREQUEST,
                      ERESPONSE, ERPCTIMEDOUT, ETIMEDOUT, RemoteProtocolError, RpcError)
from ..options import ChannelOptions
from ..protocol import baidu_std, content
from .connection import ClientConnection, ClientStats

log = logging.getLogger(__name__)

_EMPTY = b""


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port), with a clear error for anything else."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a str like '127.0.0.1:8000', got {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must look like 'host:port' with a port in 1..65535, got {address!r}")
    return host, int(port)


class Channel:
    """A client of one server at `address` ("host:port")."""

    def __init__(self, address: str, options: ChannelOptions | None = None) -> None:
        if options is None:
            options = ChannelOptions()
        elif not isinstance(options, ChannelOptions):
            raise TypeError(f"options must be a ChannelOptions, got {type(options).__name__}")
        if options.connection_type != "single" or options.backup_request_ms >= 0:
            # pooled/short connections and backup requests are not built yet: refuse them
            # rather than silently behaving as "single" without backups.
            raise ValueError("this version supports connection_type='single' without "
                             f"backup_request_ms; got connection_type={options.connection_type!r}, "
                             f"backup_request_ms={options.backup_request_ms}")
        self.host, self.port = parse_address(address)
        self.address = f"{self.host}:{self.port}" if ":" not in self.host else f"[{self.host}]:{self.port}"
        self.options = options
        self.stats = ClientStats()
        self._conn: ClientConnection | None = None
        self._connecting: asyncio.Future | None = None
        self._closed = False

    # -- connections -------------------------------------------------------------------------
    async def _connection(self, loop, deadline: float | None) -> ClientConnection:
        conn = self._conn
        if conn is not None and not conn.is_closed:
            return conn
        if self._closed:
            raise RpcError(EFAILEDSOCKET, f"Channel to {self.address} is closed")
        if self._connecting is None:
            self._connecting = loop.create_task(self._connect(loop))
        task = self._connecting
        if deadline is None:
            return await asyncio.shield(task)
        remaining = deadline - loop.time()
        try:
            return await asyncio.wait_for(asyncio.shield(task), max(remaining, 0))
        except asyncio.TimeoutError:
            raise RpcError(ERPCTIMEDOUT, f"Reached timeout while connecting to {self.address}") from None

    async def _connect(self, loop) -> ClientConnection:
        opts = self.options
        try:
            connect = loop.create_connection(
                lambda: ClientConnection(self.stats, opts.max_body_size, opts.max_unwritten_bytes,
                                         self._connection_closed),
                self.host, self.port)
            if opts.connect_timeout_ms >= 0:
                _, conn = await asyncio.wait_for(connect, opts.connect_timeout_ms / 1000)
            else:
                _, conn = await connect
        except asyncio.TimeoutError:
            raise RpcError(ETIMEDOUT, f"Fail to connect {self.address}: timed out after "
                                      f"connect_timeout_ms={opts.connect_timeout_ms}") from None
        except OSError as e:
            code = e.errno if e.errno in (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH,
                                          errno.ECONNRESET) else EFAILEDSOCKET
            if code == errno.ECONNREFUSED:
                code = ECONNREFUSED
            reason = os.strerror(e.errno) if e.errno else str(e)
            raise RpcError(code, f"Fail to connect {self.address}: {reason}") from None
        finally:
            self._connecting = None
        if self._closed:
            conn.close()
            raise RpcError(EFAILEDSOCKET, f"Channel to {self.address} is closed")
        self._conn = conn
        return conn

    def _connection_closed(self, conn: ClientConnection) -> None:
        if self._conn is conn:
            self._conn = None

    async def close(self) -> None:
        """Close the connection; calls in flight fail with EFAILEDSOCKET."""
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort(RpcError(EFAILEDSOCKET, f"Channel to {self.address} was closed"))
            await asyncio.sleep(0)

    async def __aenter__(self) -> Channel:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- calls -------------------------------------------------------------------------------
    async def call_method(self, service_name: str, method_name: str, request, response_class,
                          cntl: Controller | None = None):
        """Call `service_name`/`method_name` with a protobuf `request`; return the response.

        Raises RpcError on failure (also recorded in `cntl`).
        """
        if cntl is None:
            cntl = Controller()
        conn = self._conn
        # The connection's loop when there is one: get_running_loop() costs a getpid() on 3.11.
        loop = conn.loop if conn is not None and not conn.is_closed else asyncio.get_running_loop()
        opts = self.options
        start = loop.time()
        start_ns = time.perf_counter_ns()
        timeout_ms = opts.timeout_ms if cntl.timeout_ms is None else cntl.timeout_ms
        deadline = None if timeout_ms < 0 else start + timeout_ms / 1000
        max_retry = opts.max_retry if cntl.max_retry is None else cntl.max_retry
        cntl.service_name = service_name
        cntl.method_name = method_name
        cntl.reset_result()
        try:
            try:
                serialized = content.serialize(request, cntl.request_content_type)
            except (EncodeError, ValueError, TypeError) as e:
                raise RpcError(EREQUEST, f"Fail to serialize request: {e}") from None
            attempt = 0
            while True:
                try:
                    return await self._attempt(loop, service_name, method_name, serialized,
                                               response_class, cntl, deadline, timeout_ms)
                except RpcError as e:
                    if (e.code not in DEFAULT_RETRYABLE or attempt >= max_retry
                            or (deadline is not None and loop.time() >= deadline)):
                        raise
                    attempt += 1
                    cntl.retried_count = attempt
        except RpcError as e:
            cntl.error_code = e.code
            cntl.error_text = e.text
            raise
        finally:
            cntl.latency_us = (time.perf_counter_ns() - start_ns) // 1000

    async def _attempt(self, loop, service_name, method_name, serialized, response_class,
                       cntl: Controller, deadline, timeout_ms):
        opts = self.options
        conn = self._conn
        if conn is None or conn.is_closed:
            conn = await self._connection(loop, deadline)
        if not conn.writable():
            raise RpcError(EOVERCROWDED, f"{conn.unwritten_bytes()} bytes are waiting to be written to "
                                         f"{self.address} (max_unwritten_bytes={opts.max_unwritten_bytes})")
        meta = _fast.RpcMeta()
        meta.has_request = True
        meta.service_name = service_name if opts.use_full_service_name else service_name.rpartition(".")[2]
        meta.method_name = method_name
        if cntl.log_id is not None:
            meta.log_id = cntl.log_id
        if cntl.request_id:
            meta.request_id = cntl.request_id
        if opts.deliver_timeout_ms and deadline is not None:
            meta.timeout_ms = max(1, int((deadline - loop.time()) * 1000))
        cid = conn._next_cid
        conn._next_cid = cid + 1
        meta.correlation_id = cid
        if conn.needs_credential and opts.auth is not None:
            conn.needs_credential = False
            meta.authentication_data = await _credential(opts.auth, self.address)
        fields = cntl._request_user_fields
        if fields:
            meta.user_fields = list(fields.items())
        meta.content_type = cntl.request_content_type
        attachment = cntl.request_attachment
        if cntl.request_compress_type or cntl.request_checksum:
            data = baidu_std.encode_data(meta, serialized, cntl.request_compress_type, attachment,
                                         cntl.request_checksum, cntl.request_checksum_with_attachment)
        else:
            data = serialized
            meta.compress_type = 0
        if meta.checksum_type is None:
            meta.checksum_type = 0
            meta.checksum_value = _EMPTY
        bufs = baidu_std.pack(meta, data, attachment)
        nbytes = len(bufs[0]) + len(data) + (meta.attachment_size or 0)
        fut = loop.create_future()
        conn.pending[cid] = fut
        conn.write(bufs, nbytes)
        cntl.remote_side = conn.peer
        cntl.local_side = conn.local
        cntl.correlation_id = cid
        timer = None
        if deadline is not None:
            timer = loop.call_at(deadline, _expire, self.stats, conn, cid, fut, timeout_ms, self.address)
        try:
            ev = await fut
        except asyncio.CancelledError:
            conn.pending.pop(cid, None)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            # The failed future holds the exception whose traceback holds this frame: drop
            # it so a failed call leaves no cycle keeping the caller's objects alive.
            fut = None
        return _finish(ev, response_class, cntl, opts.max_decompressed_size)

    def __repr__(self) -> str:
        return f"<Channel {self.address} {self.options.connection_type}>"


def _expire(stats, conn, cid, fut, timeout_ms, address) -> None:
    conn.pending.pop(cid, None)
    if not fut.done():
        stats.timeouts += 1
        fut.set_exception(RpcError(ERPCTIMEDOUT, f"Reached timeout={timeout_ms}ms @{address}"))


def _finish(ev, response_class, cntl: Controller, max_decompressed_size: int):
    meta = ev.meta
    code = meta.error_code
    if code:
        raise RpcError(code, meta.error_text or "")
    if ev.error is not None:
        raise RpcError(ERESPONSE, str(ev.error))
    try:
        data = baidu_std.decode_data(meta, ev.data, ev.attachment, max_decompressed_size, ERESPONSE)
        response = content.parse(response_class, data, meta.content_type or 0)
    except RemoteProtocolError as e:
        raise RpcError(ERESPONSE, f"Fail to parse response: {e}") from None
    cntl.response_attachment = ev.attachment
    if meta.user_fields:
        cntl.response_user_fields = dict(meta.user_fields)
    return response


async def _credential(auth, address: str) -> bytes:
    try:
        cred = auth.generate_credential()
        if inspect.isawaitable(cred):
            cred = await cred
    except Exception as e:
        raise RpcError(EREQUEST, f"Fail to generate credential for {address}: {e!r}") from None
    if isinstance(cred, str):
        cred = cred.encode()
    if not isinstance(cred, (bytes, bytearray)):
        raise RpcError(EREQUEST, f"generate_credential() must return bytes, got {type(cred).__name__}")
    return bytes(cred)
