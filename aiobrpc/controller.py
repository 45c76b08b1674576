"""Controller: the per-call settings and results, on both sides (brpc's docs/en/client.md).

>>> cntl = Controller(log_id=7, timeout_ms=100)
>>> cntl.request_user_fields["tenant"] = "a"
>>> cntl.failed
False
"""

from __future__ import annotations

from typing import Any

from .errors import EINTERNAL, describe
from .protocol.checksum import CRC32C, NONE as CHECKSUM_NONE


class AttemptInfo:
    """What one attempt of a call did, as `Controller.attempts` lists it."""

    __slots__ = ("remote_side", "correlation_id", "error_code", "backup")

    def __init__(self, remote_side: str, correlation_id: int, error_code: int | None, backup: bool) -> None:
        self.remote_side = remote_side
        self.correlation_id = correlation_id
        self.error_code = error_code  # 0: succeeded; None: abandoned without a result
        self.backup = backup

    def __repr__(self) -> str:
        what = "abandoned" if self.error_code is None else f"E{self.error_code}" if self.error_code else "ok"
        return f"<Attempt {self.remote_side} cid={self.correlation_id} {what}{' backup' if self.backup else ''}>"


def _writable_bytes(buf: Any) -> memoryview:
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"response_attachment_into must be a writable buffer, got {type(buf).__name__}") from None
    if view.readonly:
        raise ValueError("response_attachment_into must be writable, got a read-only buffer")
    if not view.c_contiguous:
        raise ValueError("response_attachment_into must be C-contiguous")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


# What a call leaves in a controller (its response fields first): forgotten before the next call.
_RESPONSE_FIELDS = frozenset(("response_attachment", "_response_user_fields", "response_compress_type",
                              "response_checksum_type", "response_checksum_with_attachment"))
_RESULT_FIELDS = _RESPONSE_FIELDS | frozenset((
    "error_code", "error_text", "retried_count", "has_backup_request", "_attempts", "remote_side",
    "local_side", "correlation_id", "latency_us", "_sub_controllers"))


class Controller:
    """Settings of one call (client) or the view of one request (server).

    Client side: set `log_id`, `timeout_ms`, `max_retry`, `backup_request_ms`,
    `connection_type`, `idempotent`, `request_compress_type`, `request_checksum_type` (or
    `request_checksum`), `request_checksum_with_attachment`, `request_attachment`,
    `request_user_fields`, `request_id`; after the call read `response_attachment`,
    `response_user_fields`, `response_compress_type`, `response_checksum_type`,
    `response_checksum_with_attachment`, `failed`, `error_code`, `error_text`, `latency_us`,
    `remote_side` (of the attempt that ended the call), `retried_count`, `has_backup_request`
    and `attempts`.

    Server side: the request's fields are filled in (`log_id`, `timeout_ms` is the deadline
    the client propagated or None, `request_attachment`, `request_user_fields`,
    `request_compress_type`, `request_checksum_type`, `request_checksum_with_attachment`,
    `authentication_data`, `remote_side`, `has_remote_stream`); the handler may set `response_attachment`,
    `response_user_fields`, `response_compress_type`, `response_checksum_type` (or
    `response_checksum`), `response_checksum_with_attachment`, call `set_failed(code, text)`
    or `close_connection(reason)`.

    Compression and checksums are per direction, as in C++ brpc: the side that sends a message
    sets its `*_compress_type` / `*_checksum_type` / `*_checksum_with_attachment`, and the
    side that receives it finds there what the message's meta declared.

    **Attachments** are raw bytes that travel after the message, never parsed or copied. To send
    one, set `request_attachment` (client) or `response_attachment` (handler) to any
    C-contiguous buffer: `bytes`, `bytearray`, `memoryview`, a numpy array. It is referenced,
    not copied, until it is written to the socket (again for each retry and backup), so do not
    change it while the call is in flight. A buffer that is not C-contiguous (a transposed or
    strided numpy view) fails the call with EREQUEST; send `np.ascontiguousarray(a)` instead.
    A list or tuple of such buffers is one attachment made of them one after the other, each
    written as it is (brpc's IOBuf of several blocks): `aiobrpc.tensor` sends many arrays so.
    A received attachment (`request_attachment` in a handler, `response_attachment` after a
    successful call) is a writable `memoryview`, empty when the message had none, valid for as
    long as it is referenced. A large one, at least a quarter of the buffer the message was
    received into (the 256 KiB block shared with other messages, or the message's own buffer
    when over 64 KiB), is a view of that buffer, not copied; a smaller one is a view of its own
    copy. So keeping one keeps at most 4 times its size alive; to keep only a large one's
    bytes, copy them: `bytes(view)`, or `.copy()` of an `np.frombuffer(view, dtype)` array.
    One that arrives in a buffer of its own ends 64-byte aligned in it; a smaller one may not be
    aligned for its dtype, which numpy handles.

    To receive a large response attachment straight into your own memory (a numpy array, a
    CPU tensor), pass `Controller(response_attachment_into=buf)`: when the response's
    attachment is exactly `buf`'s size and arrives after the response's head (over 64 KiB),
    the kernel writes it into `buf` and `response_attachment` is a view of `buf`. Otherwise
    (another size, a reply that came whole in one read, a backup or retry whose reply won while
    another was being placed) `response_attachment` is a buffer of aiobrpc's own: copy from it
    when it is not a view of `buf` (`tensor.unpack(..., out=)` does exactly that).
    Until the call has ended, `buf` may be written by any attempt of it; after, never.

    Attributes:
        log_id (int | None): Client: an id sent with the request for tracing (0..2**64-1).
            Server: the request's log_id, or None.
        timeout_ms (int | None): Client: this call's deadline, overriding
            `ChannelOptions.timeout_ms` (-1: none). Server: the time the client had left when it
            sent the request, when it sends one (`deliver_timeout_ms`), else None.
        request_id (str | None): Client: a request id sent in the meta. Server: the request's.
        request_code (int | None): Client: the key a consistent-hashing load balancer
            (c_murmurhash, c_md5, c_ketama) places the call by, an int in 0..2**64-1 (those
            balancers take 0..2**32-1 and fail the call with EINVAL past it, or without one);
            brpc's set_request_code. Setting a non-int raises TypeError, a negative or too
            large int ValueError. None (the default): not set.
        max_retry (int | None): Client: overrides `ChannelOptions.max_retry` for this call.
        backup_request_ms (int | None): Client: overrides `ChannelOptions.backup_request_ms`
            for this call.
        connection_type (str | None): Client: overrides `ChannelOptions.connection_type` for
            this call.
        idempotent (bool | None): Client: False never repeats this call once the request may
            have reached the server (no retry after sending, no backup); None: the channel's
            `non_idempotent_methods` decide.
        request_compress_type (int): Client: how the request data is compressed (0 none,
            1 snappy, 2 gzip, 3 zlib). Server: what the request declared.
        response_compress_type (int): Server: how the handler wants its response compressed.
            Client: what the response declared (0 after a failure).
        request_checksum_type (int): Client: 1 (CRC32C) to send a request checksum, 0 none.
            Server: what the request declared.
        request_checksum_with_attachment (bool): Whether the request checksum also covers the
            attachment (client sets, server reads).
        response_checksum_type (int): Server: 1 (CRC32C) to send a response checksum. Client:
            what the response declared (the client has verified it).
        response_checksum_with_attachment (bool): Whether the response checksum also covers
            the attachment (server sets, client reads).
        request_content_type (int): Client: how the request message is serialized: 0 protobuf
            (the default), 1 JSON, 2 proto-JSON, 3 proto text.
        request_attachment (Any): Client: the buffer to send after the request (see above).
            Server: the received attachment, a memoryview.
        response_attachment (Any): Server: the buffer to send after the response (see above).
            Client: after a successful call, the received attachment, a memoryview; None before
            a call and after a failed one.
        request_user_fields (dict[str, str]): Client: string pairs sent in the request meta
            (brpc's user fields). Server: the request's.
        response_user_fields (dict[str, str]): Server: string pairs sent in the response meta.
            Client: the response's.
        authentication_data (bytes | None): Server: the credential the connection's first
            request carried (`ServerOptions.auth`).
        failed (bool): Whether the call failed (`error_code != 0`).
        error_code (int): The brpc error code of a failed call (0: none); see `aiobrpc.errors`.
        error_text (str): What went wrong; with retries, brpc's form
            `[E<first>]<text> [R1][E<code>]<text> ...`, retries that failed alike told once
            (`[R1-R3][E<code>]<text>`, `[R1-R3] same`; docs/client_resilience.md).
        latency_us (int): Client: the call's duration in microseconds, every attempt included.
        remote_side (str): "ip:port" of the peer: the server of the attempt that ended the call,
            or the client of the request.
        local_side (str): "ip:port" of this end of that connection.
        retried_count (int): Client: attempts after the first (retries and the backup request).
        has_backup_request (bool): Client: whether a backup request was sent.
        attempts (list[AttemptInfo]): Client: what each attempt of the last call did (server,
            correlation id, error code or None if abandoned, whether it was the backup).
        service_name (str): The service's full name ("example.EchoService").
        method_name (str): The method's name ("Echo").
        correlation_id (int): The id that matched the request and its response on the wire.
    """

    # Defaults live on the class, so a Controller made for each call (and for each request
    # at the server) only stores what differs: no __slots__, which would have to be filled
    # one by one in __init__ (about 1 us per call for 27 fields).
    log_id: int | None = None
    #: int or None: brpc's trace ids (aiobrpc.tracing). Client: set trace_id to start a trace
    #: with this call (otherwise the current span's trace is continued); after the call, the
    #: ids it carried. Server: the ids the request carried (None when it was not traced).
    trace_id: int | None = None
    span_id: int | None = None
    parent_span_id: int | None = None
    timeout_ms: int | None = None
    request_id: str | None = None
    max_retry: int | None = None
    #: int, a `aiobrpc.protocol.compress` type (0 none, 1 snappy, 2 gzip, 3 zlib). Client: how
    #: the request data is compressed. Server: the compress type the request meta declared.
    request_compress_type = 0
    #: int, a compress type like `request_compress_type`. Server: how the handler wants its
    #: response data compressed (default 0, none). Client: after a successful reply, the
    #: compress type the response meta declared (0 after a failed call or an error reply).
    response_compress_type = 0
    #: int, `aiobrpc.protocol.checksum.NONE` (0) or `.CRC32C` (1). Client: the checksum the
    #: request carries (default none). Server: the checksum type the request meta declared.
    request_checksum_type = CHECKSUM_NONE
    #: bool. Client: whether the request checksum also covers the attachment, after the data
    #: (default False: the data only, as C++ brpc). Server: the request meta's
    #: checksum_with_attachment.
    request_checksum_with_attachment = False
    #: int, a checksum type like `request_checksum_type`. Server: the checksum the handler wants
    #: on its response (default none; C++ brpc does not mirror the request's). Client: after a
    #: successful reply, the checksum type the response meta declared, also when the checksum
    #: did not hold (the call then fails with ERESPONSE).
    response_checksum_type = CHECKSUM_NONE
    #: bool. Server: whether the response checksum also covers the response attachment (default
    #: False, the data only: C++ brpc's default, whatever the request asked for). Client: after
    #: a successful reply, the response meta's checksum_with_attachment.
    response_checksum_with_attachment = False
    request_attachment: Any = None
    response_attachment: Any = None
    #: Client: a writable buffer (a memoryview of it) where the response attachment is to be
    #: received by the kernel directly, when it is exactly this size (see the constructor).
    response_attachment_into: memoryview | None = None
    request_content_type = 0
    _request_user_fields: dict[str, str] | None = None
    _response_user_fields: dict[str, str] | None = None
    authentication_data: bytes | None = None
    remote_side = ""
    local_side = ""
    latency_us = 0
    error_code = 0
    error_text = ""
    retried_count = 0
    has_backup_request = False
    service_name = ""
    method_name = ""
    correlation_id = 0
    _close_reason: str | None = None
    # Client-side call settings that override the channel's (None: the channel's).
    idempotent: bool | None = None
    backup_request_ms: int | None = None
    connection_type: str | None = None
    _attempts: list | None = None
    _sub_controllers: list | None = None  # a combo channel's sub-calls (aiobrpc/client/combo)
    # Streams (aiobrpc/stream.py): offered with the next call (client), offered by the request
    # as (connection, settings) and accepted by the handler (server).
    _streams: list | None = None
    _stream_offer: tuple | None = None
    _accepted_streams: list | None = None

    def __init__(self, *, log_id: int | None = None, timeout_ms: int | None = None,
                 request_id: str | None = None, max_retry: int | None = None,
                 request_compress_type: int = 0,
                 request_checksum: bool = False, request_checksum_with_attachment: bool = False,
                 request_attachment: Any = None, idempotent: bool | None = None,
                 backup_request_ms: int | None = None, connection_type: str | None = None,
                 response_attachment_into: Any = None, request_code: int | None = None) -> None:
        if log_id is not None:
            if not (isinstance(log_id, int) and 0 <= log_id < 1 << 64):
                raise ValueError(f"log_id must be an int in 0..2**64-1, got {log_id!r}")
            self.log_id = log_id
        if timeout_ms is not None:
            if not isinstance(timeout_ms, int) or timeout_ms < -1:
                raise ValueError(f"timeout_ms must be -1 or an int >= 0, got {timeout_ms!r}")
            self.timeout_ms = timeout_ms
        if max_retry is not None:
            if not isinstance(max_retry, int) or not 0 <= max_retry <= 1000:
                raise ValueError(f"max_retry must be an int in 0..1000, got {max_retry!r}")
            self.max_retry = max_retry
        if idempotent is not None:
            self.idempotent = bool(idempotent)
        if backup_request_ms is not None:
            if not isinstance(backup_request_ms, int) or backup_request_ms < -1:
                raise ValueError(f"backup_request_ms must be -1 or an int >= 0, got {backup_request_ms!r}")
            self.backup_request_ms = backup_request_ms
        if connection_type is not None:
            if connection_type not in ("single", "pooled", "short"):
                raise ValueError(f"connection_type must be 'single', 'pooled' or 'short', got {connection_type!r}")
            self.connection_type = connection_type
        if request_id is not None:
            self.request_id = request_id
        if request_compress_type:
            self.request_compress_type = request_compress_type
        if request_checksum:
            self.request_checksum_type = CRC32C
        if request_checksum_with_attachment:
            self.request_checksum_with_attachment = True
        if request_attachment is not None:
            self.request_attachment = request_attachment
        if response_attachment_into is not None:
            self.response_attachment_into = _writable_bytes(response_attachment_into)
        if request_code is not None:
            self.request_code = request_code

    # Kept in the instance __dict__ under its own name, like the other settings (combo
    # channels copy a controller's settings from there); the property checks what is set.
    @property
    def request_code(self) -> int | None:
        """The call's key for consistent hashing (see the class); None when not set."""
        return self.__dict__.get("request_code")

    @request_code.setter
    def request_code(self, code: int | None) -> None:
        if code is not None:
            if not isinstance(code, int) or isinstance(code, bool):
                raise TypeError(f"request_code must be an int in 0..2**64-1, got {type(code).__name__}")
            if not 0 <= code < 1 << 64:
                raise ValueError(f"request_code must be an int in 0..2**64-1, got {code}")
        self.__dict__["request_code"] = code

    @property
    def request_checksum(self) -> bool:
        """Whether the request carries a checksum: `request_checksum_type` as a bool (True sets
        CRC32C, False none)."""
        return self.request_checksum_type != CHECKSUM_NONE

    @request_checksum.setter
    def request_checksum(self, on: bool) -> None:
        self.request_checksum_type = CRC32C if on else CHECKSUM_NONE

    @property
    def response_checksum(self) -> bool:
        """Whether the response carries a checksum: `response_checksum_type` as a bool (True sets
        CRC32C, False none)."""
        return self.response_checksum_type != CHECKSUM_NONE

    @response_checksum.setter
    def response_checksum(self, on: bool) -> None:
        self.response_checksum_type = CRC32C if on else CHECKSUM_NONE

    @property
    def request_user_fields(self) -> dict[str, str]:
        if self._request_user_fields is None:
            self._request_user_fields = {}
        return self._request_user_fields

    @request_user_fields.setter
    def request_user_fields(self, value: dict[str, str]) -> None:
        self._request_user_fields = dict(value)

    @property
    def response_user_fields(self) -> dict[str, str]:
        if self._response_user_fields is None:
            self._response_user_fields = {}
        return self._response_user_fields

    @response_user_fields.setter
    def response_user_fields(self, value: dict[str, str]) -> None:
        self._response_user_fields = dict(value)

    def sub_count(self) -> int:
        """Sub-calls of the last call made through a combo channel (0 for a plain channel)."""
        return len(self._sub_controllers) if self._sub_controllers is not None else 0

    def sub(self, index: int) -> "Controller | None":
        """The controller of sub-call `index` of a combo channel's call (ParallelChannel,
        PartitionChannel: one per sub-channel, None for one the mapper skipped; SelectiveChannel:
        the last one tried); None out of range."""
        subs = self._sub_controllers
        if subs is None or not isinstance(index, int) or not 0 <= index < len(subs):
            return None
        return subs[index]

    @property
    def attempts(self) -> list:
        """One `Attempt` per request sent or tried by the last call: server, correlation id,
        error code (0: it answered successfully), whether it was the backup request."""
        if self._attempts is not None:
            return self._attempts
        if self.remote_side and not self.error_code:  # one attempt, which succeeded
            return [AttemptInfo(self.remote_side, self.correlation_id, 0, False)]
        return []

    @property
    def has_remote_stream(self) -> bool:
        """Server: whether the request offers streams, to accept with `aiobrpc.Stream.accept(cntl)`."""
        return self._stream_offer is not None

    @property
    def failed(self) -> bool:
        return self.error_code != 0

    def set_failed(self, code: int = EINTERNAL, text: str = "") -> None:
        """Fail the call with `code` (brpc's -1 is sent as EINTERNAL) and `text`."""
        if not isinstance(code, int) or code == 0:
            raise ValueError(f"set_failed needs a non-zero int code, got {code!r}")
        if self.error_text and text:
            self.error_text += " " + text  # brpc appends repeated SetFailed texts
        else:
            self.error_text = text or describe(code)
        self.error_code = code

    def close_connection(self, reason: str = "") -> None:
        """Server side: close the connection after this handler instead of replying."""
        self._close_reason = reason or "closed by the service"

    def reset_result(self) -> None:
        """Forget the result of a previous call made with this controller."""
        d = self.__dict__
        # Only the names that are there: a controller's dict holds a few settings, so this
        # walks them instead of trying all fifteen names (every call that passes a controller;
        # a fresh one has none of them).
        if not _RESULT_FIELDS.isdisjoint(d):
            for name in _RESULT_FIELDS.intersection(d):
                del d[name]

    def _forget_response(self) -> None:
        d = self.__dict__
        if not _RESPONSE_FIELDS.isdisjoint(d):
            for name in _RESPONSE_FIELDS.intersection(d):
                del d[name]

    def __repr__(self) -> str:
        state = f"failed [E{self.error_code}]{self.error_text}" if self.failed else "ok"
        return f"<Controller {self.service_name}/{self.method_name} {state} {self.latency_us}us>"
