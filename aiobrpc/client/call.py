"""The life of one call (brpc's docs/en/client.md): attempts, retries, the backup request, the deadline.

A `Call` owns one future, the caller's, and completes it exactly once: with the response of
the first attempt that succeeds, or with the error that ends the call (the deadline, a
failure no retry may follow, cancellation), and counts it then, once, in the channel's
figures of its method (client/metrics.py). Attempts are issued synchronously when a
connection is ready and from a connect task otherwise; every reply or connection failure
comes back through `Attempt.on_response` / `Attempt.on_failed`, called by the connection
from its protocol callback, so a whole call costs no task when its connection is up.

Rules (brpc's docs/en/client.md, docs/hostile_inputs.md D5-D10):
* one deadline covers every attempt; ERPCTIMEDOUT, ECANCELED, EREQUEST... end the call;
* a failed attempt is retried when the retry policy says so, `max_retry` is not used up,
  the channel's retry throttle has tokens, and either the method is idempotent or the
  request cannot have run (not sent, or refused by the server with ELIMIT/ELOGOFF/
  EOVERCROWDED); the failed server is excluded from the next selections;
* the backup request: when no reply came within the backup delay, a second attempt goes
  (to another server when there is one); the first success wins, the loser is dropped and
  counted; a failed original is ignored while the backup is pending.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .. import _fast, tracing
from ..controller import AttemptInfo, Controller  # AttemptInfo: also importable from here, as before
from ..errors import (EBACKUPREQUEST, ECANCELED, EFAILEDSOCKET, EINTERNAL, ELIMIT, ELOGOFF, EOVERCROWDED,
                      EREQUEST, ERESPONSE, ERPCTIMEDOUT, LocalProtocolError, RemoteProtocolError, RpcError)
from ..options import RetryThrottle
from ..protocol import baidu_std, content, streaming
from ..protocol.utf8 import class_checker as _string_check
from ..stream import connect_streams, streams_failed
from ..tracing import current as _current_span
from ..tracing import new_id as new_trace_id
from .grpc_connection import GrpcConnection
from .pool import SINGLE
from .retry import NEVER_RETRIED, RetryPolicy, retried_error_text, retry_allowed

_EMPTY = b""
_DEFAULT_RETRY_POLICY = RetryPolicy()
_REFUSED_BY_SERVER = frozenset({ELIMIT, ELOGOFF, EOVERCROWDED})  # the handler did not run
_MAX_EXCLUDED = 8
_now_ns = time.perf_counter_ns

log = logging.getLogger(__name__)


class CallbackFailed(Exception):
    """A user callback (a policy, the load balancer) raised: `error` ends the call it served,
    without a retry (the same callback would decide it). Logged once, here."""

    def __init__(self, what: str, exc: Exception) -> None:
        super().__init__(what)
        log.error("%s raised %r; the call fails with EINTERNAL", what, exc, exc_info=exc)
        self.error = RpcError(EINTERNAL, f"{what} raised {exc!r}")


def _ask(what: str, callback, *args):
    """`callback(*args)`, a user's: what it raises becomes CallbackFailed."""
    try:
        return callback(*args)
    except Exception as e:
        raise CallbackFailed(what, e) from None


class Attempt:
    """One request sent (or about to be sent) for a call."""

    __slots__ = ("call", "pool", "conn", "cid", "sent", "start_ns", "backup", "task", "done")

    def __init__(self, call: Call, backup: bool) -> None:
        self.call = call
        self.pool = None
        self.conn = None
        self.cid = 0
        self.sent = False
        self.start_ns = _now_ns()
        self.backup = backup
        self.task = None
        self.done = False

    # The connection calls these from its protocol callbacks: nothing may escape to the loop.
    def on_response(self, ev) -> None:
        try:
            self.call._ended(self, ev, None)
        except Exception as e:
            self.call._fail(e)

    def on_failed(self, err: RpcError) -> None:
        try:
            self.call._ended(self, None, err)
        except Exception as e:
            self.call._fail(e)


class Call:
    __slots__ = ("channel", "loop", "cntl", "service_name", "method_name", "serialized",
                 "response_class", "fut", "deadline", "timeout_ms", "max_retry", "idempotent",
                 "ctype", "retried", "current", "unfinished", "excluded", "timer",
                 "backup_timer", "retry_handle", "backup_ms", "errors", "start_ns", "finished", "streams",
                 "placer", "otel")

    def __init__(self, channel, loop, service_name: str, method_name: str, serialized,
                 response_class, cntl: Controller, started: float | None = None) -> None:
        opts = channel.options
        self.channel = channel
        self.loop = loop
        self.cntl = cntl
        self.service_name = service_name
        self.method_name = method_name
        self.serialized = serialized
        self.response_class = response_class
        self.fut = loop.create_future()
        self.start_ns = _now_ns()
        timeout_ms = opts.timeout_ms if cntl.timeout_ms is None else cntl.timeout_ms
        self.timeout_ms = timeout_ms
        self.deadline = None if timeout_ms < 0 else (started or loop.time()) + timeout_ms / 1000
        self.max_retry = opts.max_retry if cntl.max_retry is None else cntl.max_retry
        idempotent = cntl.idempotent
        if idempotent is None:  # is_idempotent's answer without its call where no method is listed
            idempotent = True if not opts.non_idempotent_methods else channel.is_idempotent(service_name, method_name)
        self.idempotent = idempotent
        self.ctype = opts.connection_type if cntl.connection_type is None else cntl.connection_type
        streams = self.streams = cntl._streams
        if streams is not None:
            # brpc: a call that carries streams is never repeated, and its streams live on the
            # connection it went on.
            cntl._streams = None
            self.max_retry = 0
            self.ctype = SINGLE
        self.retried = 0
        self.current: Attempt | None = None
        self.unfinished: Attempt | None = None  # the original, once a backup was sent
        self.excluded: list = []
        self.timer = None  # the key of the deadline in channel._deadlines (a TimerWheel)
        self.backup_timer = None  # the key of the backup's time in channel._backups
        self.retry_handle = None
        self.backup_ms = -1
        self.errors: list | None = None  # (code, text) of every failed attempt
        self.finished = False
        self.placer: Attempt | None = None  # the attempt whose reply goes to response_attachment_into
        self.otel = None  # the call's OpenTelemetry CLIENT span, for a traced call where opentelemetry is installed

    # -- start -------------------------------------------------------------------------------
    def start(self) -> None:
        loop = self.loop
        span = _current_span()
        if span is not None or self.cntl.trace_id is not None:
            self.otel = _trace(self.cntl, span, self.service_name, self.method_name)
        self.channel._calls.add(self)  # until _complete: closing the channel ends it
        if self.deadline is not None:
            self.timer = self.channel._deadlines.add(self.deadline, self)  # no TimerHandle per call
        opts = self.channel.options
        try:
            # A backup repeats the work, so never for non-idempotent methods.
            if self.idempotent and self.streams is None and (opts.backup_request_ms >= 0 or opts.backup_request_policy is not None
                                    or self.cntl.backup_request_ms is not None):
                ms = self._backup_delay_ms()
                if ms >= 0 and (self.timeout_ms < 0 or ms < self.timeout_ms):
                    self.backup_ms = ms
                    self.backup_timer = self.channel._backups.add(loop.time() + ms / 1000, self)
        except Exception as e:
            self._fail(e)
            return
        self._issue(False)

    def _backup_delay_ms(self) -> int:
        ms = self.cntl.backup_request_ms
        if ms is None:
            ms = self.channel.options.backup_request_ms
        policy = self.channel.options.backup_request_policy
        if policy is not None:
            chosen = _ask("backup_request_policy.backup_request_ms", policy.backup_request_ms, self.cntl)
            if chosen != -1:  # -1: the channel's (or controller's) delay
                ms = chosen if chosen >= 0 else -1
        return ms

    # -- attempts ----------------------------------------------------------------------------
    def _issue(self, backup: bool = False) -> None:
        self.retry_handle = None
        if self.finished:
            return
        att = Attempt(self, backup)
        self.current = att
        try:
            pool = self.channel._single
            if pool is None or not pool.available:  # else _select_server's answer, without its call
                try:
                    pool = self.channel._select_server(self.excluded, self.cntl)
                except RpcError as e:
                    self._ended(att, None, e)
                    return
            att.pool = pool
            if self.ctype == SINGLE:  # pool.ready's answer for it, without the call
                conn = pool.single
                if conn is not None and conn.is_closed:
                    conn = None
            else:
                conn = pool.ready(self.ctype)
            if conn is not None:
                self._send(att, conn)
            else:
                att.task = self.loop.create_task(self._connect_then_send(att))
        except Exception as e:  # also from a loop callback (a retry's backoff): it ends the call
            self._fail(e)

    async def _connect_then_send(self, att: Attempt) -> None:
        try:
            try:
                conn = await att.pool.connect(self.loop, self.deadline, self.ctype)
            except RpcError as e:
                att.task = None
                if e.code == ERPCTIMEDOUT and not self.finished and not att.done:
                    # The deadline passed while connecting: the connect's own wait saw it before
                    # the call's timer did; it is the call's timeout all the same.
                    self.channel.stats.timeouts += 1
                self._ended(att, None, e)
                return
            except asyncio.CancelledError:
                att.task = None
                if not att.done:  # not abandoned by the call: the loop is shutting down
                    self._ended(att, None, RpcError(ECANCELED, f"Connecting to {att.pool.address} was cancelled"))
                raise
            att.task = None
            if att.done:  # abandoned meanwhile: the connection serves later calls
                att.pool.release(conn, self.ctype, True)
                return
            self._send(att, conn)
        except Exception as e:  # anything else the connect raised ends the call, never the task
            att.task = None
            self._fail(e)

    def _send(self, att: Attempt, conn) -> None:
        channel = self.channel
        opts = channel.options
        cntl = self.cntl
        att.conn = conn
        if conn.is_closed:
            # Lost between its connect and this send (a reset right after the accept): the
            # request would be dropped and the attempt left waiting until the deadline.
            self._ended(att, None, RpcError(
                EFAILEDSOCKET, f"Connection to {conn.peer} was lost before the request was sent"))
            return
        if type(conn) is GrpcConnection:  # ChannelOptions(protocol="grpc"): the request is an HTTP/2 stream
            conn.send_call(self, att)
            return
        if not conn.writable():
            self._ended(att, None, RpcError(
                EOVERCROWDED, f"{conn.unwritten_bytes()} bytes are waiting to be written to {conn.peer} "
                              f"(max_unwritten_bytes={opts.max_unwritten_bytes})"))
            return
        meta = _fast.RpcMeta()
        meta.has_request = True
        service_name = self.service_name
        meta.service_name = service_name if opts.use_full_service_name else service_name.rpartition(".")[2]
        meta.method_name = self.method_name
        if cntl.log_id is not None:
            meta.log_id = cntl.log_id
        if cntl.trace_id is not None:
            meta.trace_id = cntl.trace_id
            meta.span_id = cntl.span_id
            if cntl.parent_span_id is not None:
                meta.parent_span_id = cntl.parent_span_id
        if cntl.request_id:
            meta.request_id = cntl.request_id
        if opts.deliver_timeout_ms and self.deadline is not None:
            meta.timeout_ms = max(1, int((self.deadline - self.loop.time()) * 1000))
        cid = conn._next_cid
        conn._next_cid = cid + 1
        meta.correlation_id = cid
        needs_credential = conn.needs_credential
        if needs_credential and conn.credential is not None:
            meta.authentication_data = conn.credential
        fields = cntl._request_user_fields
        if fields:
            meta.user_fields = list(fields.items())
        meta.content_type = cntl.request_content_type
        streams = self.streams
        if streams is not None:
            if _offered_before(streams):
                self._ended(att, None, RpcError(EREQUEST, "a stream can be offered by one call only"))
                return
            first = streams[0]
            meta.stream_settings = streaming.encode_settings(first.id, first._max_buf_size > 0, True,
                                                             [st.id for st in streams[1:]])
        attachment = cntl.request_attachment
        data = self.serialized
        try:
            if cntl.request_compress_type or cntl.request_checksum_type or cntl.request_checksum_with_attachment:
                data = baidu_std.encode_data(meta, data, cntl.request_compress_type, attachment,
                                             cntl.request_checksum_type, cntl.request_checksum_with_attachment)
            else:
                meta.compress_type = 0
            if meta.checksum_type is None:
                meta.checksum_type = 0
                meta.checksum_value = _EMPTY
            bufs = baidu_std.pack(meta, data, attachment)
        except (LocalProtocolError, ValueError, TypeError) as e:
            self._ended(att, None, RpcError(EREQUEST, f"Fail to pack request: {e}"))
            return
        streams = self.streams
        if streams is not None:
            table = conn.stream_table()
            for i, st in enumerate(streams):
                st._attach(conn, i == 0)  # the response comes as the first message of the first
                table.add(st)
        if needs_credential:
            conn.needs_credential = False  # only once the request that carries it is sure to go
        att.cid = cid
        conn.pending[cid] = att
        if cntl.response_attachment_into is not None:
            conn.place_responses()
        att.sent = True
        conn.write(bufs, len(bufs[0]) + len(data) + (meta.attachment_size or 0), len(conn.pending) == 1,
                   early=True)

    # -- results -----------------------------------------------------------------------------
    def _ended(self, att: Attempt, ev, err: RpcError | None) -> None:
        """An attempt got its reply (`ev`) or failed (`err`); decide what the call does."""
        if att.done:
            return
        att.done = True
        pool = att.pool
        conn = att.conn
        if conn is not None and self.ctype != SINGLE:
            pool.release(conn, self.ctype, ev is not None)
        if ev is not None:
            meta = ev.meta
            code = meta.error_code or 0
            if code == 0 and ev.error is not None:
                code, text = ERESPONSE, str(ev.error)
            else:
                text = meta.error_text or ""
            if meta.stream_settings is not None and (code or self.finished or self.streams is None):
                conn.reset_offered_streams(meta.stream_settings)  # streams no call of ours takes
        else:
            code, text = err.code, err.text
        if self.finished:
            return  # a loser of the backup race, or an attempt abandoned at the deadline
        response = None
        opts = self.channel.options
        if code == 0:
            try:
                response = _parse_response(ev, self.response_class, self.cntl, opts.max_decompressed_size)
            except RpcError as e:
                code, text = e.code, e.text
        if code or self.errors is not None or self.cntl.has_backup_request:
            self._record(att, code)  # a lone successful attempt is described by the controller
        if pool is not None:
            lb_feedback = self.channel._lb_feedback
            breaker_on = opts.enable_circuit_breaker
            if lb_feedback is not None or breaker_on:
                latency_us = (_now_ns() - att.start_ns) // 1000
                if lb_feedback is not None:
                    try:  # _ask's work, inline: this runs for every reply
                        lb_feedback(pool.node, code, latency_us, self.timeout_ms, self.retried, self.max_retry)
                    except Exception as e:
                        raise CallbackFailed("load_balancer.feedback", e) from None
                if breaker_on:
                    pool.feedback(code, latency_us)
            if code == ELOGOFF and ev is not None:
                pool.log_off()
        throttle = opts.retry_throttle
        if code == 0:
            if throttle is not None and (type(throttle) is not RetryThrottle or throttle.tokens < throttle.max_tokens):
                try:  # _ask's work, inline: this runs for every reply (ours: not when it is full)
                    throttle.on_success()
                except Exception as e:
                    raise CallbackFailed("retry_throttle.on_success", e) from None
            if opts.retry_policy is not None and self._policy_retries_success(att, opts.retry_policy):
                self._retry(att)  # brpc: a custom policy may retry a success (it is discarded)
                return
            if self.streams is not None:
                refused = connect_streams(self.streams, conn, ev.meta.stream_settings)
                if refused is not None:
                    self._complete(att, None, refused)
                    return
            self._complete(att, response, None)
            return
        if throttle is not None:
            if ev is None and conn is not None and att.sent:
                # One broken connection fails every call on it at once: it is one failure
                # for the throttle, not one per call (that would drain it in one event).
                if not conn.failure_counted:
                    conn.failure_counted = True
                    _ask("retry_throttle.on_failure", throttle.on_failure)
            else:
                _ask("retry_throttle.on_failure", throttle.on_failure)
        errors = self.errors
        if errors is None:
            errors = self.errors = []
        errors.append((code, text))
        if att is not self.current:
            return  # the original failed while its backup is pending: wait for the backup
        if self._may_retry(att, code, ev is not None):
            self._retry(att)
            return
        other = self.unfinished
        if other is not None and not other.done:
            # The backup failed for good, but the original may still answer in time.
            self.current, self.unfinished = other, None
            return
        self._complete(att, None, RpcError(code, self._error_text()))

    def _may_retry(self, att: Attempt, code: int, from_server: bool) -> bool:
        if self.retried >= self.max_retry or code in NEVER_RETRIED:
            return False
        if self.deadline is not None and self.loop.time() >= self.deadline:
            return False
        if att.sent and not self.idempotent and not (from_server and code in _REFUSED_BY_SERVER):
            return False  # the request may have run: never repeat non-idempotent work
        cntl = self.cntl
        cntl.error_code = code
        policy = self.channel.options.retry_policy or _DEFAULT_RETRY_POLICY
        try:
            if not _ask("retry_policy.do_retry", retry_allowed, policy, cntl):
                return False
        finally:
            cntl.error_code = 0
        throttle = self.channel.options.retry_throttle
        if throttle is not None and not _ask("retry_throttle.allow_retry", throttle.allow_retry):
            self.channel.stats.retries_throttled += 1
            return False
        return True

    def _policy_retries_success(self, att: Attempt, policy) -> bool:
        if (att is not self.current or not self.idempotent or self.retried >= self.max_retry
                or (self.deadline is not None and self.loop.time() >= self.deadline)):
            return False
        cntl = self.cntl
        cntl.error_code = 0
        if not _ask("retry_policy.do_retry", policy.do_retry, cntl):
            return False
        cntl._forget_response()  # the discarded reply's
        return True

    def _retry(self, att: Attempt) -> None:
        # Rounded to the microsecond: uvloop's clock moves in whole milliseconds, and without
        # rounding a retry in the call's first millisecond is told 300.0000000001 of 300 ms.
        remaining_ms = float("inf") if self.deadline is None else round((self.deadline - self.loop.time()) * 1000, 3)
        policy = self.channel.options.retry_policy or _DEFAULT_RETRY_POLICY
        self.cntl.retried_count = self.retried + 1  # what the policy reads
        try:
            backoff_ms = _ask("retry_policy.backoff_ms", policy.backoff_ms, self.cntl, remaining_ms)
        except CallbackFailed:
            self.cntl.retried_count = self.retried  # no retry was made
            raise
        self._exclude(att)  # counted once the policy did not fail the call
        self.retried += 1
        self.channel.stats.retries += 1
        if backoff_ms > 0 and backoff_ms < remaining_ms:
            self.retry_handle = self.loop.call_later(backoff_ms / 1000, self._issue)
        elif att.sent:
            self._issue(False)
        else:
            # A failure found before sending may repeat at once (no server up): the next
            # iteration issues the retry, so max_retry such failures never nest calls.
            self.retry_handle = self.loop.call_soon(self._issue)

    def _exclude(self, att: Attempt) -> None:
        if att.pool is None:
            return
        excluded = self.excluded
        excluded.append(att.pool.node)
        if len(excluded) > min(self.max_retry, _MAX_EXCLUDED):
            del excluded[0]

    def _backup_due(self) -> None:
        self.backup_timer = None
        if self.finished or self.retry_handle is not None:
            return  # a retry is already on its way
        try:
            self._send_backup()
        except Exception as e:
            self._fail(e)

    def _send_backup(self) -> None:
        cur = self.current
        if self.retried >= self.max_retry:
            # brpc: with no retry left, the backup timer ends the call (brpc's docs/en/client.md).
            where = cur.pool.address if cur is not None and cur.pool is not None else self.channel.address
            self._complete(None, None, RpcError(EBACKUPREQUEST, f"Reached backup timeout={self.backup_ms}ms @{where}"))
            return
        policy = self.channel.options.backup_request_policy
        if policy is not None and not _ask("backup_request_policy.do_backup", policy.do_backup, self.cntl):
            return
        if cur is not None:
            self._exclude(cur)
        self.unfinished = cur
        self.retried += 1
        self.cntl.retried_count = self.retried
        self.cntl.has_backup_request = True
        self.channel.stats.backup_requests += 1
        self._issue(True)

    def _timed_out(self) -> None:
        self.timer = None
        if self.finished:
            return
        try:
            self._end_at_deadline()
        except Exception as e:
            self._fail(e)

    def _end_at_deadline(self) -> None:
        self.channel.stats.timeouts += 1
        # Attempts still waiting failed at the deadline: their servers' breakers hear it, so a
        # server that never answers is isolated (brpc's docs/en/client.md); the load balancer
        # hears it when _complete abandons them.
        now = _now_ns()
        breaker_on = self.channel.options.enable_circuit_breaker
        for att in (self.current, self.unfinished):
            if breaker_on and att is not None and att.sent and not att.done and att.pool is not None:
                att.pool.feedback(ERPCTIMEDOUT, (now - att.start_ns) // 1000)
        cur = self.current
        where = cur.pool.address if cur is not None and cur.pool is not None else self.channel.address
        self._complete(None, None, RpcError(ERPCTIMEDOUT, f"Reached timeout={self.timeout_ms}ms @{where}"))

    def cancel(self) -> None:
        """The caller stopped waiting (its task was cancelled): end the call as ECANCELED."""
        if self.finished:
            return
        self.channel.stats.cancelled += 1
        self._complete(None, None, RpcError(ECANCELED, "RPC was cancelled by the caller"))

    def abort(self, err: RpcError) -> None:
        """End the call now with `err`, whatever it waits for (the channel is closing)."""
        self._complete(None, None, err)

    def _fail(self, e: Exception) -> None:
        """A step of the call raised `e` (a user callback, or a bug): the call ends with it."""
        if isinstance(e, CallbackFailed):
            err = e.error
        elif isinstance(e, RpcError):
            err = e
        else:
            log.error("call to %s/%s failed internally: %r", self.service_name, self.method_name, e, exc_info=e)
            err = RpcError(EINTERNAL, f"Internal error of the call: {e!r}")
        if not self.finished:
            self._complete(None, None, err)
        elif not self.fut.done():  # it raised while completing: the caller still gets its answer
            self.cntl.error_code = err.code
            self.cntl.error_text = err.text
            self.fut.set_exception(err)

    # -- completion --------------------------------------------------------------------------
    def _complete(self, att: Attempt | None, response, err: RpcError | None) -> None:
        if self.finished:
            return
        self.finished = True
        self.channel._calls.discard(self)
        side = att if att is not None else self.current  # whose server the controller names
        if self.timer is not None:
            self.channel._deadlines.remove(self.timer, self)
            self.timer = None
        if self.backup_timer is not None or self.retry_handle is not None or self.unfinished is not None:
            self._stop_others(att, err)
        elif self.current is not att and self.current is not None and not self.current.done:
            self._abandon(self.current, ECANCELED if err is None else err.code)
        self.current = None
        cntl = self.cntl
        if side is not None:
            if side.conn is not None:
                cntl.remote_side = side.conn.peer
                cntl.local_side = side.conn.local
                cntl.correlation_id = side.cid
            elif side.pool is not None:
                cntl.remote_side = side.pool.address
        if self.retried:  # else the controller's default, 0 (a call starts with it forgotten)
            cntl.retried_count = self.retried
        latency_us = cntl.latency_us = (_now_ns() - self.start_ns) // 1000
        if err is not None:
            cntl.error_code = err.code
            cntl.error_text = err.text
            if self.streams is not None:
                streams_failed(self.streams, err.code, err.text)
        policy = self.channel.options.backup_request_policy
        if policy is not None:
            try:
                policy.on_rpc_end(cntl)
            except Exception as e:
                err = CallbackFailed("backup_request_policy.on_rpc_end", e).error
                cntl.error_code = err.code
                cntl.error_text = err.text
        if self.otel is not None:
            tracing.end_client_span(self.otel, cntl)
            self.otel = None
        methods = self.channel._methods
        if methods is not None:  # before the caller can read it
            methods.ended(self.service_name, self.method_name, latency_us, err is not None, self.retried,
                          cntl.has_backup_request)
        fut = self.fut
        if not fut.done():
            if err is None:
                fut.set_result(response)
            else:
                fut.set_exception(err)

    def _stop_others(self, att: Attempt | None, err: RpcError | None) -> None:
        if self.backup_timer is not None:
            self.channel._backups.remove(self.backup_timer, self)
            self.backup_timer = None
        if self.retry_handle is not None:
            self.retry_handle.cancel()
            self.retry_handle = None
        unfinished = self.unfinished
        for other in (self.current, unfinished):
            if other is not None and other is not att and not other.done:
                if err is None and other.sent:
                    self.channel.stats.backup_losers += 1
                if err is not None:
                    code = err.code
                else:  # brpc's codes for the load balancer: the original lost to a later attempt, or the reverse
                    code = EBACKUPREQUEST if other is unfinished else ECANCELED
                self._abandon(other, code)
        self.unfinished = None

    def _abandon(self, att: Attempt, code: int) -> None:
        """Stop waiting for `att`: its late reply is dropped (and counted) by its connection; a
        load balancer that wants feedback hears that the attempt ended with `code`."""
        att.done = True
        if att.task is not None:
            att.task.cancel()
            att.task = None
        conn = att.conn
        if conn is not None:
            conn.forget(att.cid)
            if self.ctype != SINGLE:
                att.pool.release(conn, self.ctype, False)  # a reply is in flight: never reuse it
        lb_feedback = self.channel._lb_feedback
        if lb_feedback is not None and att.pool is not None:
            try:
                lb_feedback(att.pool.node, code, (_now_ns() - att.start_ns) // 1000, self.timeout_ms,
                            self.retried, self.max_retry)
            except Exception as e:  # the call's outcome is already decided: logged only
                CallbackFailed("load_balancer.feedback", e)
        self._record(att, None)

    def _record(self, att: Attempt, code: int | None) -> None:
        conn = att.conn
        info = AttemptInfo(conn.peer if conn is not None else (att.pool.address if att.pool else ""),
                           att.cid, code, att.backup)
        cntl = self.cntl
        if cntl._attempts is None:
            cntl._attempts = [info]
        else:
            cntl._attempts.append(info)

    def _error_text(self) -> str:
        """brpc's ErrorText, retries that failed alike told once (retry.retried_error_text)."""
        return retried_error_text(self.errors)


def _trace(cntl: Controller, span, service_name: str, method_name: str):
    """The trace ids of a call made in `span` (or starting cntl.trace_id), one span id for the
    call whatever its attempts; and its OpenTelemetry CLIENT span, where opentelemetry is
    installed, whose id becomes the call's span id so that the server's span names it as parent."""
    otel = None
    if cntl.span_id is None:
        if cntl.trace_id is None:
            cntl.trace_id = span.trace_id
            cntl.parent_span_id = span.span_id
        if tracing.OTEL is not None:
            otel = tracing.start_client_span(f"{service_name}/{method_name}", cntl)
        if cntl.span_id is None:
            cntl.span_id = new_trace_id()
    return otel


def _offered_before(streams) -> bool:
    for st in streams:
        if st._conn is not None or st.closed:
            return True
    return False


def _check_strings(check, response) -> None:
    bad = check(response)
    if bad:  # protocol/utf8.py: a proto2 string the parser left unchecked
        raise RpcError(ERESPONSE, f"Fail to parse response={response.DESCRIPTOR.full_name}: "
                                  f"string field {bad} is not UTF-8")


def _parse_response(ev, response_class, cntl: Controller, max_decompressed_size: int):
    meta = ev.meta
    data = ev.data
    if not (meta.compress_type or meta.checksum_type or meta.content_type or meta.checksum_with_attachment
            or meta.user_fields) and len(data) <= max_decompressed_size:
        # Plain protobuf, the usual case, parsed with no more calls; what is wrong with it is
        # named by the general way below.
        try:
            response = response_class.FromString(data)
        except Exception:  # noqa: BLE001
            response = None
        if response is not None and response.IsInitialized():
            check = _string_check(response_class)
            # A payload all ASCII holds no string that is bad UTF-8: checked so for a small one
            # (its copy is cheap), at a third of the cost of the field check.
            if check is not None and (len(data) > 4096 or not (
                    data.tobytes() if type(data) is memoryview else bytes(data)).isascii()):
                _check_strings(check, response)
            # The controller's response fields are at their defaults here (a call starts with
            # them forgotten, and so does a retry after a discarded reply) unless an earlier
            # attempt's reply failed its checks: read, they cost a third of being set.
            if cntl.response_compress_type or cntl.response_checksum_type or \
                    cntl.response_checksum_with_attachment:
                cntl.response_compress_type = 0
                cntl.response_checksum_type = 0
                cntl.response_checksum_with_attachment = False
            attachment = ev.attachment
            if attachment is not None or cntl.response_attachment is not None:
                cntl.response_attachment = attachment
            return response
    # Recorded before the checks, as C++ brpc does: a reply that fails them still shows what it declared.
    cntl.response_compress_type = meta.compress_type or 0
    cntl.response_checksum_type = meta.checksum_type or 0
    cntl.response_checksum_with_attachment = bool(meta.checksum_with_attachment)
    try:
        data = baidu_std.decode_data(meta, ev.data, ev.attachment, max_decompressed_size, ERESPONSE)
        response = content.parse(response_class, data, meta.content_type or 0)
    except RemoteProtocolError as e:
        raise RpcError(ERESPONSE, f"Fail to parse response: {e}") from None
    check = _string_check(response_class)
    if check is not None:
        _check_strings(check, response)
    cntl.response_attachment = ev.attachment
    if meta.user_fields:
        if len(meta.user_fields) > _fast.MAX_USER_FIELDS:
            raise RpcError(ERESPONSE, f"the response carries more than {_fast.MAX_USER_FIELDS} user_fields")
        cntl.response_user_fields = dict(meta.user_fields)
    return response
