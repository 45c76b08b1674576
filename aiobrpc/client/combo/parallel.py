"""ParallelChannel: one call sent to every sub-channel at once, the responses merged (brpc's
ParallelChannel, docs/en/combo_channel.md).

>>> pchan = ParallelChannel(ParallelChannelOptions(timeout_ms=200, fail_limit=1))
>>> pchan.add_channel(Channel("10.0.0.1:8000"), call_mapper=ShardMapper(), response_merger=Concat())  # doctest: +SKIP
0
>>> resp = await Stub(pchan, SERVICE).Lookup(request)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from ...controller import Controller
from ...errors import (ECANCELED, EINTERNAL, EPCHANFINISH, EPERM, EREQUEST, ERESPONSE, ERPCTIMEDOUT,
                       ETOOMANYFAILS, RpcError, describe)
from .controllers import PARALLEL_SETTINGS, begin, fail, inherit_settings
from .mapping import DEFAULT_CALL_MAPPER, DEFAULT_RESPONSE_MERGER, MergeResult, MethodRef, SubCall
from .members import call_sub_channel, check_sub_channel, close_all, is_healthy

log = logging.getLogger(__name__)


def _limit(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None (all sub-calls) or an int >= 1, got {value!r}")


@dataclass
class ParallelChannelOptions:
    """Options of a ParallelChannel (brpc's ParallelChannelOptions).

    Attributes:
        timeout_ms: The deadline of a call, covering every sub-call (sub-calls have no deadline
            of their own); overridable per call by `Controller.timeout_ms`. -1: none.
        fail_limit: The call fails, and its sub-calls still running are cancelled, once this
            many sub-calls failed. None: the number of sub-calls made (the call fails only
            when all fail). Larger than the sub-calls made: as many as were made.
        success_limit: The call ends, the sub-calls still running cancelled (EPCHANFINISH),
            once this many sub-calls succeeded. Used only when `fail_limit` is None. None: all.
    """

    timeout_ms: int = 500
    fail_limit: int | None = None
    success_limit: int | None = None

    def __post_init__(self) -> None:
        t = self.timeout_ms
        if isinstance(t, bool) or not isinstance(t, int) or not -1 <= t <= 0x7FFFFFFF:
            raise ValueError(f"timeout_ms must be -1 or an int in 0..2**31-1, got {t!r}")
        _limit("fail_limit", self.fail_limit)
        _limit("success_limit", self.success_limit)


class _SubChannel:
    __slots__ = ("channel", "call_mapper", "response_merger", "own")

    def __init__(self, channel, call_mapper, response_merger, own: bool) -> None:
        self.channel = channel
        self.call_mapper = call_mapper
        self.response_merger = response_merger
        self.own = own


class ParallelChannel:
    """Sends each call to all its sub-channels concurrently and merges their responses.

    `add_channel(channel, call_mapper, response_merger)` adds a sub-channel: any aiobrpc
    channel, a combo channel included; the same channel may be added more than once. The
    mapper decides what each sub-channel is sent (the same request by default) or skips it;
    the merger merges each successful sub-response into the call's response, in sub-channel
    order, once every sub-call has ended (`MergeFrom` by default). Use it behind a `Stub` like
    a Channel.

    Rules (brpc's): every sub-call has a controller of its own (`combo.sub_controller(cntl, i)`)
    with the call's client settings (log_id, max_retry, backup_request_ms, connection type,
    compression, checksum, user fields) but no deadline: the ParallelChannel's deadline ends
    those still running (ECANCELED). A sub-channel retries as its own options say. Once
    `fail_limit` sub-calls failed the others are cancelled; once `success_limit` succeeded
    likewise (EPCHANFINISH, not a failure). The call succeeds when fewer than `fail_limit`
    sub-calls failed, even past its deadline. Otherwise it fails with the error already set
    (ERPCTIMEDOUT at the deadline, ERESPONSE from the merger) or with the sub-calls' common
    error code (ECANCELED aside), ETOOMANYFAILS when they differ, and the text
    `k/n channels failed, fail_limit=f [C<i>]<sub-call i's error text>...`.

    Cancelling the task awaiting a call cancels its sub-calls. Sub-channels are added before
    the calls that should use them (a call uses the sub-channels there are when it starts);
    `close()` closes the sub-channels added with `own=True` (the default).
    """

    def __init__(self, options: ParallelChannelOptions | None = None) -> None:
        if options is None:
            options = ParallelChannelOptions()
        elif not isinstance(options, ParallelChannelOptions):
            raise TypeError(f"options must be a ParallelChannelOptions, got {type(options).__name__}")
        self.options = options
        self._subs: list[_SubChannel] = []

    def add_channel(self, channel: Any, call_mapper: Any = None, response_merger: Any = None, *,
                    own: bool = True) -> int:
        """Add `channel` as the next sub-channel; returns its index. `call_mapper` (a
        `CallMapper`) and `response_merger` (a `ResponseMerger`) may be shared by several
        sub-channels. With `own`, `close()` closes the channel."""
        check_sub_channel(self, channel, len(self._subs))
        if call_mapper is not None and not (callable(getattr(call_mapper, "map", None))
                                            and callable(getattr(call_mapper, "map_controller", None))):
            raise TypeError(f"call_mapper must be a CallMapper (map and map_controller methods), "
                            f"got {type(call_mapper).__name__}")
        if response_merger is not None and not callable(getattr(response_merger, "merge", None)):
            raise TypeError(f"response_merger must be a ResponseMerger (a merge method), "
                            f"got {type(response_merger).__name__}")
        self._subs.append(_SubChannel(channel, call_mapper, response_merger, bool(own)))
        return len(self._subs) - 1

    @property
    def channel_count(self) -> int:
        return len(self._subs)

    def sub_channels(self) -> list:
        """The sub-channels, in index order."""
        return [sub.channel for sub in self._subs]

    def check_health(self) -> bool:
        """Whether enough sub-channels are healthy for a call to succeed: all of them, or with
        a `fail_limit` f, all but f - 1 (brpc's ParallelChannel::CheckHealth)."""
        n = len(self._subs)
        if n == 0:
            return False
        need = n - (self.options.fail_limit - 1 if self.options.fail_limit else 0)
        healthy = 0
        for sub in self._subs:
            healthy += is_healthy(sub.channel)
            if healthy >= need:
                return True
        return need <= 0

    async def call_method(self, service_name: str, method_name: str, request, response_class,
                          cntl: Controller | None = None):
        """Call `service_name`/`method_name` on every sub-channel; return the merged response.

        Raises RpcError on failure (also recorded in `cntl`)."""
        cntl = begin(cntl, service_name, method_name)
        return await self._call(service_name, method_name, request, response_class, cntl, None)

    async def _call(self, service_name: str, method_name: str, request, response_class,
                    cntl: Controller, started: float | None):
        """The call, its deadline counted from `started` (loop time; None: now)."""
        loop = asyncio.get_running_loop()
        start_ns = time.perf_counter_ns()
        if started is None:
            started = loop.time()
        subs = list(self._subs)
        nchan = len(subs)
        cntl._sub_controllers = [None] * nchan
        try:
            if nchan == 0:
                raise fail(cntl, EPERM, "No channels added")
            plan = self._map(subs, MethodRef(service_name, method_name, response_class), request, cntl)
            timeout_ms = self.options.timeout_ms if cntl.timeout_ms is None else cntl.timeout_ms
            deadline = None if timeout_ms < 0 else started + timeout_ms / 1000
            fan = _FanOut(loop, cntl, plan, self._limits(len(plan)), timeout_ms)
            await fan.run(service_name, method_name, response_class, deadline)
            return fan.merge(response_class)
        finally:
            cntl.latency_us = (time.perf_counter_ns() - start_ns) // 1000

    def _map(self, subs: list[_SubChannel], method: MethodRef, request, cntl: Controller) -> list:
        """(index, sub-channel, SubCall, sub-controller) of each sub-call to make."""
        nchan = len(subs)
        calls = []
        for i, sub in enumerate(subs):
            mapper = sub.call_mapper
            if mapper is None:
                calls.append((i, sub, SubCall(request)))
                continue
            try:
                sub_call = mapper.map(i, nchan, method, request)
            except Exception as e:
                log.error("call_mapper of channel[%d] raised %r", i, e, exc_info=e)
                raise fail(cntl, EREQUEST, f"call_mapper of channel[{i}] raised {e!r}") from None
            if not isinstance(sub_call, SubCall):
                raise fail(cntl, EREQUEST, f"call_mapper of channel[{i}] returned a {type(sub_call).__name__}, "
                                          f"not a SubCall")
            if sub_call.is_skip:
                continue
            if sub_call.is_bad:
                raise fail(cntl, EREQUEST, f"CallMapper of channel[{i}] returns Bad()")
            calls.append((i, sub, sub_call))
        if not calls:
            raise fail(cntl, ECANCELED, f"Skipped all channels({nchan})")
        plan = []
        for i, sub, sub_call in calls:
            sub_cntl = Controller()
            try:
                (sub.call_mapper or DEFAULT_CALL_MAPPER).map_controller(i, nchan, cntl, sub_cntl)
            except Exception as e:
                log.error("call_mapper.map_controller of channel[%d] raised %r", i, e, exc_info=e)
                raise fail(cntl, EREQUEST, f"call_mapper.map_controller of channel[{i}] raised {e!r}") from None
            inherit_settings(cntl, sub_cntl, PARALLEL_SETTINGS)
            plan.append((i, sub, sub_call, sub_cntl))
        return plan

    def _limits(self, ndone: int) -> tuple[int, int]:
        """(fail_limit, success_limit) of a call of `ndone` sub-calls (brpc's clamping)."""
        opts = self.options
        if opts.fail_limit is not None:
            return min(opts.fail_limit, ndone), ndone
        success = ndone if opts.success_limit is None else min(opts.success_limit, ndone)
        return ndone, success

    async def close(self) -> None:
        """Close the sub-channels added with `own=True` (each once)."""
        await close_all(sub.channel for sub in self._subs if sub.own)

    async def __aenter__(self) -> ParallelChannel:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<ParallelChannel {len(self._subs)} sub-channels>"


class _FanOut:
    """The sub-calls of one ParallelChannel call, counted as they end (brpc's
    ParallelChannelDone)."""

    def __init__(self, loop, cntl: Controller, plan: list, limits: tuple[int, int], timeout_ms: int) -> None:
        self.loop = loop
        self.cntl = cntl
        self.plan = plan
        self.fail_limit, self.success_limit = limits
        self.timeout_ms = timeout_ms
        self.tasks: dict[asyncio.Task, int] = {}  # -> position in plan
        self.cancelled: dict[int, tuple[int, str]] = {}  # position -> (code, text) we cancelled it with
        self.responses: dict[int, Any] = {}  # position -> response of a successful sub-call
        self.nfail = 0
        self.nsuccess = 0
        self.nended = 0
        self.all_ended = loop.create_future()

    async def run(self, service_name: str, method_name: str, response_class, deadline: float | None) -> None:
        subs = self.cntl._sub_controllers
        for pos, (i, sub, sub_call, sub_cntl) in enumerate(self.plan):
            subs[i] = sub_cntl
            task = self.loop.create_task(call_sub_channel(
                sub.channel, sub_call.service_name or service_name, sub_call.method_name or method_name,
                sub_call.request, sub_call.response_class or response_class, sub_cntl))
            self.tasks[task] = pos
            task.add_done_callback(self._ended)
        timer = None if deadline is None else self.loop.call_at(deadline, self._timed_out)
        try:
            await self.all_ended
        except asyncio.CancelledError:
            self._cancel_running(ECANCELED, "Cancelled with the ParallelChannel call")
            running = [t for t in self.tasks if not t.done()]
            if running:
                await asyncio.wait(running)  # their controllers settle before the caller looks
            fail(self.cntl, ECANCELED, "RPC was cancelled by the caller")
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _timed_out(self) -> None:
        if self.all_ended.done():
            return
        fail(self.cntl, ERPCTIMEDOUT, f"Reached timeout={self.timeout_ms}ms @ParallelChannel")
        self._cancel_running(ECANCELED, f"Cancelled at the deadline of the ParallelChannel "
                                        f"(timeout={self.timeout_ms}ms)")

    def _cancel_running(self, code: int, text: str) -> None:
        for task, pos in self.tasks.items():
            if not task.done() and pos not in self.cancelled:
                self.cancelled[pos] = (code, text)
                task.cancel()

    def _ended(self, task: asyncio.Task) -> None:
        pos = self.tasks[task]
        sub_cntl = self.plan[pos][3]
        ours = self.cancelled.get(pos)
        if task.cancelled():
            code, text = ours if ours is not None else (ECANCELED, "The sub-call was cancelled")
            sub_cntl.error_code, sub_cntl.error_text = code, text
        else:
            exc = task.exception()
            if exc is None:
                code = 0
                self.responses[pos] = task.result()
            elif isinstance(exc, RpcError):
                code = exc.code
                if ours is not None and code == ECANCELED:
                    code, text = ours
                    sub_cntl.error_code, sub_cntl.error_text = code, text
                elif sub_cntl.error_code != code:  # a foreign channel that did not record it
                    sub_cntl.error_code, sub_cntl.error_text = code, exc.text
            else:
                i = self.plan[pos][0]
                log.error("sub-channel[%d] call_method raised %r", i, exc, exc_info=exc)
                code = EINTERNAL
                sub_cntl.error_code, sub_cntl.error_text = code, f"sub-channel[{i}] raised {exc!r}"
        if code != 0 and code != EPCHANFINISH:
            self.nfail += 1
            if self.nfail == self.fail_limit:
                self._cancel_running(ECANCELED, f"Cancelled: fail_limit={self.fail_limit} reached")
        elif code == 0:
            self.nsuccess += 1
            if self.nsuccess == self.success_limit:
                self._cancel_running(EPCHANFINISH, f"{describe(EPCHANFINISH)}: "
                                                   f"success_limit={self.success_limit} reached")
        self.nended += 1
        if self.nended == len(self.tasks) and not self.all_ended.done():
            self.all_ended.set_result(None)

    def merge(self, response_class):
        """The call's response: the successful sub-responses merged in sub-channel order,
        when fewer than fail_limit sub-calls failed; else RpcError (brpc's OnComplete)."""
        cntl = self.cntl
        ndone = len(self.plan)
        nfailed = self.nfail
        response = response_class()
        if nfailed < self.fail_limit:
            for pos in sorted(self.responses):
                i, sub, _, sub_cntl = self.plan[pos]
                merger = sub.response_merger or DEFAULT_RESPONSE_MERGER
                try:
                    result = merger.merge(response, self.responses[pos])
                except Exception as e:
                    if sub.response_merger is not None:
                        log.error("response_merger of channel[%d] raised %r", i, e, exc_info=e)
                        text = f"response_merger of channel[{i}] raised {e!r}"
                    else:
                        text = f"Fail to merge response of channel[{i}]: {e}"
                    nfailed = ndone
                    fail(cntl, ERESPONSE, text)
                    break
                if result is None or result is MergeResult.MERGED:
                    continue
                if result is MergeResult.FAIL:
                    nfailed += 1
                    sub_cntl.error_code = ERESPONSE
                    sub_cntl.error_text = f"response_merger refused the response of channel[{i}]"
                    continue
                nfailed = ndone
                if result is MergeResult.FAIL_ALL:
                    fail(cntl, ERESPONSE, f"Fail to merge response of channel[{i}]")
                else:
                    fail(cntl, ERESPONSE, f"response_merger of channel[{i}] returned {result!r}, "
                                          f"not a MergeResult")
                break
        if nfailed >= self.fail_limit:
            if not cntl.failed:
                self._fail_with_sub_errors(nfailed)
            raise RpcError(cntl.error_code, cntl.error_text)
        # Fewer failures than fail_limit: a success, even past the deadline (brpc).
        cntl.__dict__.pop("error_code", None)
        cntl.__dict__.pop("error_text", None)
        return response

    def _fail_with_sub_errors(self, nfailed: int) -> None:
        code = ECANCELED
        for _, _, _, sub_cntl in self.plan:
            ec = sub_cntl.error_code
            if ec not in (0, ECANCELED, EPCHANFINISH):
                if code == ECANCELED:
                    code = ec
                elif code != ec:
                    code = ETOOMANYFAILS
                    break
        parts = [f"{nfailed}/{len(self.plan)} channels failed, fail_limit={self.fail_limit}"]
        for i, _, _, sub_cntl in self.plan:
            if sub_cntl.failed:
                parts.append(f" [C{i}]{sub_cntl.error_text}")
        fail(self.cntl, code, "".join(parts))
