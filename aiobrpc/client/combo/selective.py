"""SelectiveChannel: a load balancer over channels; each call goes to one sub-channel, and
its retries and backup request to others (brpc's SelectiveChannel, docs/en/combo_channel.md).

>>> schan = SelectiveChannel("rr", ChannelOptions(timeout_ms=300, max_retry=2))
>>> schan.add_channel(Channel("list://10.0.0.1:80,10.0.0.2:80", load_balancer="rr"))  # doctest: +SKIP
>>> resp = await Stub(schan, SERVICE).Echo(request)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

from ...controller import Controller
from ...errors import (EBACKUPREQUEST, ECANCELED, EHOSTDOWN, EINTERNAL, ENODATA, ERPCTIMEDOUT, RpcError)
from ...options import ChannelOptions
from ..lb import LoadBalancer, create_load_balancer
from ..naming.base import ServerNode
from ..retry import NEVER_RETRIED, RetryPolicy, retried_error_text, retry_allowed
from .callbacks import CallbackError, ask
from .controllers import SELECTIVE_SETTINGS, begin, fail, inherit_settings
from .members import call_sub_channel, check_sub_channel, close_all, is_healthy

log = logging.getLogger(__name__)

_DEFAULT_RETRY_POLICY = RetryPolicy()
_GOES_ON = object()  # what _ended returns when the call is not over
_MAX_EXCLUDED = 8
# Copied from the sub-call that ended the call (brpc copies remote_side and the attachment).
_RESULT_FIELDS = ("remote_side", "local_side", "correlation_id", "response_attachment", "_response_user_fields",
                  "response_compress_type", "response_checksum_type", "response_checksum_with_attachment")


def _consume(task: asyncio.Task) -> None:
    """Done callback of every sub-call task: an abandoned one's failure is not 'never retrieved'."""
    if not task.cancelled():
        task.exception()


class SelectiveChannel:
    """A channel of channels: each call is sent to one sub-channel that `load_balancer` picks.

    `load_balancer` is any registered load balancer name ("rr", the default, as for brpc's
    examples; parameters as in `"rr:key=value"`) or a `LoadBalancer` instance. Each
    sub-channel is one "server" of it, named by the handle `add_channel` returns, whose tag
    is the tag given there (weighted balancers read weights from tags).

    `options` (a ChannelOptions) give the selective channel's own `timeout_ms` (the deadline
    of a call, over every sub-call: sub-calls get none of their own), `max_retry`,
    `retry_policy`, `retry_throttle`, `backup_request_ms`, `backup_request_policy` and
    `non_idempotent_methods`; the other fields (connections, TLS, health checks) are the
    sub-channels' business and are not used. `Controller.timeout_ms`, `max_retry` and
    `backup_request_ms` override them per call.

    Rules (brpc's): a sub-call that fails with a retryable error is retried on another
    sub-channel (the failed one excluded while another is available) while `max_retry` and
    the deadline allow; a non-idempotent call is retried only when no sub-call was made. The
    backup request goes to another sub-channel after `backup_request_ms`; the first success
    wins. A sub-channel whose sub-call fails with ENODATA or EHOSTDOWN (no server to call) is
    marked failed and left out until a health check finds it able to serve again (checked at
    most every `channel_check_interval_s`, when a call looks for a sub-channel). The
    sub-channel retries within itself as its own options say. Error texts carry brpc's
    `[R<n>]` retry marks. After a call, `combo.sub_controller(cntl, 0)` is the controller of
    the sub-call that succeeded (or of the last one); the call's controller gets its
    remote_side, response attachment and user fields.

    Sub-channels may be added and removed at any time; a call in flight keeps the one it uses.
    At most 1024 sub-channels. `close()` closes the sub-channels added with `own=True`.
    """

    def __init__(self, load_balancer: str | LoadBalancer = "rr", options: ChannelOptions | None = None, *,
                 channel_check_interval_s: float = 1.0) -> None:
        if isinstance(load_balancer, str):
            self.lb = create_load_balancer(load_balancer)
        elif isinstance(load_balancer, LoadBalancer):
            self.lb = load_balancer
        else:
            raise TypeError(f"load_balancer must be a load balancer name or a LoadBalancer, "
                            f"got {type(load_balancer).__name__}")
        if options is None:
            options = ChannelOptions()
        elif not isinstance(options, ChannelOptions):
            raise TypeError(f"options must be a ChannelOptions, got {type(options).__name__}")
        v = channel_check_interval_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ValueError(f"channel_check_interval_s must be a number of seconds > 0, got {v!r}")
        self.options = options
        self.channel_check_interval_s = float(v)
        self._channels: dict[ServerNode, Any] = {}
        self._own: set[ServerNode] = set()
        self._failed: dict[ServerNode, float] = {}  # -> time.monotonic() of the last check
        self._ids = itertools.count(1)

    # -- sub-channels --------------------------------------------------------------------------
    def add_channel(self, channel: Any, tag: str = "", *, own: bool = True) -> ServerNode:
        """Add `channel`; returns its handle (for `remove_channel`). ValueError for a channel
        already added."""
        if not isinstance(tag, str):
            raise TypeError(f"tag must be a str, got {type(tag).__name__}")
        if any(ch is channel for ch in self._channels.values()):
            raise ValueError(f"{channel!r} was added to this SelectiveChannel already")
        check_sub_channel(self, channel, len(self._channels))
        handle = ServerNode(f"sub-channel-{next(self._ids)}", 1, tag)
        channels = dict(self._channels)
        channels[handle] = channel
        self.lb.set_servers(list(channels))  # may refuse (a weighted balancer, a bad tag): nothing changed
        self._channels = channels
        if own:
            self._own.add(handle)
        return handle

    def remove_channel(self, handle: ServerNode) -> Any:
        """Remove the sub-channel of `handle` and return it (not closed: calls in flight may
        still use it). KeyError for an unknown handle."""
        if handle not in self._channels:
            raise KeyError(f"no sub-channel has the handle {handle!r}")
        channels = dict(self._channels)
        channel = channels.pop(handle)
        self.lb.set_servers(list(channels))
        self._channels = channels
        self._own.discard(handle)
        self._failed.pop(handle, None)
        return channel

    @property
    def channel_count(self) -> int:
        return len(self._channels)

    def sub_channels(self) -> list:
        return list(self._channels.values())

    def _available(self, handle: ServerNode) -> bool:
        checked = self._failed.get(handle)
        if checked is None:
            return True
        now = time.monotonic()
        if now - checked < self.channel_check_interval_s:
            return False
        self._failed[handle] = now
        channel = self._channels.get(handle)
        if channel is None or not is_healthy(channel):
            return False
        del self._failed[handle]
        log.info("sub-channel %r of %r is revived", channel, self)
        return True

    def _mark_failed(self, handle: ServerNode, code: int) -> None:
        if handle in self._channels and handle not in self._failed:
            self._failed[handle] = time.monotonic()
            log.warning("sub-channel %r of %r is marked failed (E%d); checked again in %gs",
                        self._channels[handle], self, code, self.channel_check_interval_s)

    def check_health(self) -> bool:
        """Whether a sub-channel not marked failed is healthy."""
        return any(h not in self._failed and is_healthy(ch) for h, ch in self._channels.items())

    # -- calls ---------------------------------------------------------------------------------
    async def call_method(self, service_name: str, method_name: str, request, response_class,
                          cntl: Controller | None = None):
        """Call `service_name`/`method_name` through one sub-channel; return the response.

        Raises RpcError on failure (also recorded in `cntl`)."""
        cntl = begin(cntl, service_name, method_name)
        return await self._call(service_name, method_name, request, response_class, cntl, None)

    async def _call(self, service_name: str, method_name: str, request, response_class,
                    cntl: Controller, started: float | None):
        """The call, its deadline counted from `started` (loop time; None: now)."""
        call = _SelectiveCall(self, asyncio.get_running_loop(), cntl, service_name, method_name, request,
                              response_class, started)
        return await call.run()

    def is_idempotent(self, service_name: str, method_name: str) -> bool:
        names = self.options.non_idempotent_methods
        return not names or (service_name not in names and f"{service_name}/{method_name}" not in names)

    async def close(self) -> None:
        """Close the sub-channels added with `own=True` (each once)."""
        await close_all(ch for h, ch in self._channels.items() if h in self._own)

    async def __aenter__(self) -> SelectiveChannel:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        lb = getattr(self.lb, "name", type(self.lb).__name__)
        return f"<SelectiveChannel {lb} {len(self._channels)} sub-channels>"


class _Attempt:
    __slots__ = ("handle", "cntl", "task", "start_ns", "error", "reported")

    def __init__(self) -> None:
        self.handle: ServerNode | None = None
        self.cntl: Controller | None = None
        self.task: asyncio.Task | None = None
        self.start_ns = time.perf_counter_ns()
        self.error: tuple[int, str] | None = None  # the selection failed: no sub-call
        self.reported = False  # its end was told to the load balancer


class _SelectiveCall:
    """One call of a SelectiveChannel: its attempts, retries, backup request and deadline."""

    def __init__(self, schan: SelectiveChannel, loop, cntl: Controller, service_name: str, method_name: str,
                 request, response_class, started: float | None) -> None:
        opts = schan.options
        self.schan = schan
        self.loop = loop
        self.cntl = cntl
        self.service_name = service_name
        self.method_name = method_name
        self.request = request
        self.response_class = response_class
        self.start_ns = time.perf_counter_ns()
        started = loop.time() if started is None else started
        self.timeout_ms = opts.timeout_ms if cntl.timeout_ms is None else cntl.timeout_ms
        self.deadline = None if self.timeout_ms < 0 else started + self.timeout_ms / 1000
        self.max_retry = min(opts.max_retry if cntl.max_retry is None else cntl.max_retry, 1000)
        idempotent = cntl.idempotent
        self.idempotent = schan.is_idempotent(service_name, method_name) if idempotent is None else idempotent
        self.started = started
        self.backup_ms = -1
        self.backup_at: float | None = None
        self.retried = 0
        self.retry_at: float | None = None
        self.current: _Attempt | None = None
        self.unfinished: _Attempt | None = None  # the original, once the backup went
        self.last: _Attempt | None = None  # the attempt that made the last sub-call
        self.excluded: list[ServerNode] = []
        self.errors: list[tuple[int, str]] = []

    async def run(self):
        try:
            try:
                self._arm_backup()
                return await self._loop()
            except CallbackError as e:
                self._stop_others(None, e.error.code)
                raise self._end(None, None, e.error) from None
        except asyncio.CancelledError:
            self._stop_others(None, ECANCELED)
            self._end(None, None, RpcError(ECANCELED, "RPC was cancelled by the caller"))
            raise

    def _arm_backup(self) -> None:
        opts = self.schan.options
        cntl = self.cntl
        if not self.idempotent or (opts.backup_request_ms < 0 and opts.backup_request_policy is None
                                   and cntl.backup_request_ms is None):
            return
        ms = opts.backup_request_ms if cntl.backup_request_ms is None else cntl.backup_request_ms
        policy = opts.backup_request_policy
        if policy is not None:
            chosen = ask("backup_request_policy.backup_request_ms", policy.backup_request_ms, cntl)
            if chosen != -1:  # -1: the channel's (or controller's) delay
                ms = chosen if chosen >= 0 else -1
        if ms >= 0 and (self.timeout_ms < 0 or ms < self.timeout_ms):
            self.backup_ms = ms
            self.backup_at = self.started + ms / 1000

    async def _loop(self):
        loop = self.loop
        while True:
            now = loop.time()
            if self.deadline is not None and now >= self.deadline:
                return self._timed_out()
            if self.backup_at is not None and now >= self.backup_at:
                self.backup_at = None
                if self.current is not None:  # not while a retry waits for its turn (as a Channel)
                    self._send_backup()
                    continue
            if self.current is None and (self.retry_at is None or now >= self.retry_at):
                self.retry_at = None
                self.current = self._issue()
                if self.current.error is not None:
                    self._failed(self.current, *self.current.error)
                    continue
            waits = [a.task for a in (self.current, self.unfinished) if a is not None and a.task is not None]
            wake = [t for t in (self.deadline, self.retry_at, self.backup_at) if t is not None]
            timeout = max(0.0, min(wake) - now) if wake else None
            if not waits:
                await asyncio.sleep(timeout)  # a retry's backoff (it always has a wake time)
                continue
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for att in (self.current, self.unfinished):
                if att is not None and att.task in done:
                    response = self._ended(att)
                    if response is not _GOES_ON:
                        return response

    def _issue(self) -> _Attempt:
        """Pick a sub-channel and start the sub-call (an attempt with `error` when none could
        be picked)."""
        schan = self.schan
        cntl = self.cntl
        att = _Attempt()
        try:
            handle = schan.lb.select(excluded=self.excluded, available=schan._available,
                                     request_code=getattr(cntl, "request_code", None))
        except RpcError as e:
            att.error = (e.code, f"Fail to select channel, {e.text}")
            return att
        except Exception as e:
            raise CallbackError("load_balancer.select", e) from None
        channel = schan._channels.get(handle)
        if channel is None:
            raise CallbackError("load_balancer.select", LookupError(f"it chose {handle!r}, not a sub-channel"))
        sub_cntl = Controller()
        inherit_settings(cntl, sub_cntl, SELECTIVE_SETTINGS)
        sub_cntl.request_attachment = cntl.request_attachment
        if not self.idempotent:
            sub_cntl.idempotent = False
        att.handle = handle
        att.cntl = sub_cntl
        att.task = self.loop.create_task(call_sub_channel(
            channel, self.service_name, self.method_name, self.request, self.response_class, sub_cntl))
        att.task.add_done_callback(_consume)
        self.last = att
        return att

    def _ended(self, att: _Attempt):
        """A sub-call ended: its response when it succeeded (the call ends with it), else
        _GOES_ON after deciding what the call does next (RpcError when it ends failed)."""
        task = att.task
        if task.cancelled():
            code, text = ECANCELED, "The sub-call was cancelled"
        else:
            exc = task.exception()
            if exc is None:
                self._feedback(att, 0)
                throttle = self.schan.options.retry_throttle
                if throttle is not None:
                    ask("retry_throttle.on_success", throttle.on_success)
                response = task.result()
                self._stop_others(att, None)
                err = self._end(att, response, None)
                if err is not None:
                    raise err
                return response
            if isinstance(exc, RpcError):
                code, text = exc.code, exc.text
            else:
                log.error("sub-channel call_method raised %r", exc, exc_info=exc)
                code, text = EINTERNAL, f"sub-channel raised {exc!r}"
        if att.cntl.error_code != code:
            att.cntl.error_code, att.cntl.error_text = code, text
        self._feedback(att, code)
        if code in (ENODATA, EHOSTDOWN):
            self.schan._mark_failed(att.handle, code)  # it has no server to call: health-check it
        self._failed(att, code, text)
        return _GOES_ON

    def _feedback(self, att: _Attempt, code: int) -> None:
        """Tell the balancer how the attempt on `att.handle` ended (once), as a Channel does."""
        if att.reported:
            return
        att.reported = True
        lb = self.schan.lb
        if not getattr(lb, "wants_feedback", True):
            return
        latency_us = (time.perf_counter_ns() - att.start_ns) // 1000
        attempt_ended = getattr(lb, "attempt_ended", None)
        if attempt_ended is None:
            ask("load_balancer.feedback", lb.feedback, att.handle, code, latency_us)
        else:
            ask("load_balancer.attempt_ended", attempt_ended, att.handle, code, latency_us, self.timeout_ms,
                self.retried, self.max_retry)

    def _failed(self, att: _Attempt, code: int, text: str) -> None:
        self.errors.append((code, text))
        throttle = self.schan.options.retry_throttle
        if throttle is not None:
            ask("retry_throttle.on_failure", throttle.on_failure)
        if att is self.unfinished:
            self.unfinished = None  # the original failed: the backup may still succeed
            return
        if self._may_retry(att, code):
            self._retry(att)
            return
        if self.unfinished is not None:
            # The backup failed for good, but the original may still answer in time.
            self.current, self.unfinished = self.unfinished, None
            return
        self.current = None
        raise self._end(att, None, RpcError(code, self._error_text()))

    def _may_retry(self, att: _Attempt, code: int) -> bool:
        if self.retried >= self.max_retry or code in NEVER_RETRIED:
            return False
        if self.deadline is not None and self.loop.time() >= self.deadline:
            return False
        if att.task is not None and not self.idempotent:
            return False  # the sub-call may have run it: never repeat non-idempotent work
        opts = self.schan.options
        cntl = self.cntl
        cntl.error_code = code
        try:
            if not ask("retry_policy.do_retry", retry_allowed, opts.retry_policy or _DEFAULT_RETRY_POLICY, cntl):
                return False
        finally:
            cntl.__dict__.pop("error_code", None)
        throttle = opts.retry_throttle
        return throttle is None or bool(ask("retry_throttle.allow_retry", throttle.allow_retry))

    def _retry(self, att: _Attempt) -> None:
        now = self.loop.time()
        remaining_ms = float("inf") if self.deadline is None else round((self.deadline - now) * 1000, 3)
        policy = self.schan.options.retry_policy or _DEFAULT_RETRY_POLICY
        self.cntl.retried_count = self.retried + 1
        backoff_ms = ask("retry_policy.backoff_ms", policy.backoff_ms, self.cntl, remaining_ms)
        self._exclude(att)
        self.retried += 1
        self.current = None
        self.retry_at = now + backoff_ms / 1000 if 0 < backoff_ms < remaining_ms else now

    def _exclude(self, att: _Attempt) -> None:
        if att.handle is None:
            return
        self.excluded.append(att.handle)
        if len(self.excluded) > min(self.max_retry, _MAX_EXCLUDED):
            del self.excluded[0]

    def _send_backup(self) -> None:
        cur = self.current
        if cur.task is None or cur.task.done():
            return
        if self.retried >= self.max_retry:
            # brpc: with no retry left, the backup timer ends the call.
            self._stop_others(None, EBACKUPREQUEST)
            raise self._end(cur, None, RpcError(EBACKUPREQUEST, f"Reached backup timeout={self.backup_ms}ms "
                                                                f"@SelectiveChannel"))
        policy = self.schan.options.backup_request_policy
        if policy is not None and not ask("backup_request_policy.do_backup", policy.do_backup, self.cntl):
            return
        self._exclude(cur)
        self.unfinished = cur
        self.retried += 1
        self.cntl.retried_count = self.retried
        self.cntl.has_backup_request = True
        self.current = self._issue()
        if self.current.error is not None:
            self._failed(self.current, *self.current.error)

    def _timed_out(self):
        self._stop_others(None, ERPCTIMEDOUT)
        raise self._end(self.last, None, RpcError(ERPCTIMEDOUT, f"Reached timeout={self.timeout_ms}ms "
                                                                f"@SelectiveChannel"))

    def _stop_others(self, winner: _Attempt | None, code: int | None) -> None:
        """Cancel the sub-calls still running but `winner`'s; the balancer hears that they
        ended with `code` (None: the call succeeded, a lost backup race)."""
        for att in (self.current, self.unfinished):
            if att is None or att is winner or att.task is None:
                continue
            if not att.task.done():
                att.task.cancel()
            lost = code if code is not None else EBACKUPREQUEST if att is self.unfinished else ECANCELED
            try:
                self._feedback(att, lost)
            except CallbackError:
                pass  # logged; the call's outcome is decided already
        self.current = self.unfinished = None

    def _end(self, att: _Attempt | None, response, err: RpcError | None) -> RpcError | None:
        """Record the call's result in its controller; the error to raise, if it failed."""
        cntl = self.cntl
        side = att if att is not None and att.cntl is not None else self.last
        if side is not None:
            sub = side.cntl.__dict__
            for name in _RESULT_FIELDS:
                if name in sub:
                    cntl.__dict__[name] = sub[name]
            cntl._sub_controllers = [side.cntl]
        if err is not None:
            cntl.__dict__.pop("response_attachment", None)
            fail(cntl, err.code, err.text)
        cntl.retried_count = self.retried
        cntl.latency_us = (time.perf_counter_ns() - self.start_ns) // 1000
        policy = self.schan.options.backup_request_policy
        if policy is not None:
            try:
                policy.on_rpc_end(cntl)
            except Exception as e:
                err = CallbackError("backup_request_policy.on_rpc_end", e).error
                fail(cntl, err.code, err.text)
        return err

    def _error_text(self) -> str:
        """brpc's ErrorText, retries that failed alike told once (retry.retried_error_text)."""
        return retried_error_text(self.errors)
