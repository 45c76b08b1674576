"""How a fan-out call maps its request to each sub-channel and merges the sub-responses
(brpc's CallMapper, SubCall and ResponseMerger, src/brpc/parallel_channel.h).

>>> SubCall.skip().is_skip, SubCall.bad().is_bad
(True, True)
>>> ResponseMerger.FAIL is MergeResult.FAIL
True
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple


class MethodRef(NamedTuple):
    """The method a call to a combo channel names: what `CallMapper.map` is told."""

    service_name: str
    """The service's full name ("example.EchoService")."""
    method_name: str
    """The method's name ("Echo")."""
    response_class: type
    """The protobuf class of the call's response."""


class SubCall:
    """What one sub-channel is asked, as `CallMapper.map` returns it.

    `SubCall(request)` sends `request` to the call's method; `service_name`, `method_name` and
    `response_class` send it to another method (its response is what the merger gets).
    `SubCall.skip()` leaves the sub-channel out of this call; `SubCall.bad()` fails the whole
    call with EREQUEST before anything is sent.
    """

    __slots__ = ("request", "service_name", "method_name", "response_class", "_kind")

    _SEND, _SKIP, _BAD = 0, 1, 2

    def __init__(self, request: Any, *, service_name: str | None = None, method_name: str | None = None,
                 response_class: type | None = None) -> None:
        if request is None:
            raise TypeError("SubCall needs a request message; use SubCall.skip() or SubCall.bad() for none")
        for name, value in (("service_name", service_name), ("method_name", method_name)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"SubCall {name} must be a non-empty str, got {value!r}")
        if response_class is not None and not isinstance(response_class, type):
            raise TypeError(f"SubCall response_class must be a message class, got {response_class!r}")
        self.request = request
        self.service_name = service_name
        self.method_name = method_name
        self.response_class = response_class
        self._kind = SubCall._SEND

    @classmethod
    def skip(cls) -> SubCall:
        """Leave this sub-channel out of the call (brpc's SubCall::Skip())."""
        return cls._special(cls._SKIP)

    @classmethod
    def bad(cls) -> SubCall:
        """Fail the whole call with EREQUEST (brpc's SubCall::Bad())."""
        return cls._special(cls._BAD)

    @classmethod
    def _special(cls, kind: int) -> SubCall:
        sub = object.__new__(cls)
        sub.request = sub.service_name = sub.method_name = sub.response_class = None
        sub._kind = kind
        return sub

    @property
    def is_skip(self) -> bool:
        return self._kind == SubCall._SKIP

    @property
    def is_bad(self) -> bool:
        """True for `bad()` and `skip()` (as brpc's is_bad(): neither sends anything)."""
        return self._kind != SubCall._SEND

    def __repr__(self) -> str:
        if self._kind != SubCall._SEND:
            return "SubCall.skip()" if self.is_skip else "SubCall.bad()"
        return f"SubCall({type(self.request).__name__})"


class CallMapper:
    """Maps a call to the request of each sub-channel; this base sends the same request to
    every sub-channel (what a sub-channel added without a mapper gets).

    One mapper may serve several sub-channels. Subclass and override `map` (and
    `map_controller` to change a sub-call's controller). An exception raised by either fails
    the call with EREQUEST.
    """

    def map(self, channel_index: int, channel_count: int, method: MethodRef, request: Any) -> SubCall:
        """The sub-call of sub-channel `channel_index` (0-based) of `channel_count`."""
        return SubCall(request)

    def map_controller(self, channel_index: int, channel_count: int, main_cntl: Any, sub_cntl: Any) -> None:
        """Prepare the sub-call's controller; by default it sends the call's request
        attachment (the same buffer, not a copy). The call's client settings (retries, backup
        delay, connection type, compression, log_id ...) are applied to `sub_cntl` after this;
        its deadline is always the combo channel's."""
        sub_cntl.request_attachment = main_cntl.request_attachment


class MergeResult(enum.Enum):
    """What `ResponseMerger.merge` returns (brpc's ResponseMerger::Result)."""

    MERGED = "merged"
    """The sub-response was merged."""
    FAIL = "fail"
    """The sub-response was not merged: it counts as one more failed sub-call."""
    FAIL_ALL = "fail_all"
    """The whole call fails with ERESPONSE."""


class ResponseMerger:
    """Merges each successful sub-response into the call's response, one at a time, in
    sub-channel order; this base uses protobuf's `MergeFrom` (repeated fields appended, the
    others overwritten), what a sub-channel added without a merger gets.

    Subclass and override `merge`. Returning None counts as MERGED; an exception, or a return
    that is not a MergeResult, fails the call with ERESPONSE.
    """

    MERGED = MergeResult.MERGED
    FAIL = MergeResult.FAIL
    FAIL_ALL = MergeResult.FAIL_ALL

    def merge(self, response: Any, sub_response: Any) -> MergeResult | None:
        response.MergeFrom(sub_response)
        return MergeResult.MERGED


DEFAULT_CALL_MAPPER = CallMapper()
DEFAULT_RESPONSE_MERGER = ResponseMerger()
