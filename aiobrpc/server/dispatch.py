"""Service registry and the life of one request at the server (brpc's src/brpc/policy/baidu_rpc_protocol.cpp).

Checks run in brpc's order: stopping → overcrowded → max_concurrency → attachment size →
service/method lookup → request parse → user code. Every rejection is a meta-only error response and keeps
the connection.
"""

from __future__ import annotations

import inspect
import logging
import time

from google.protobuf.message import EncodeError

from .. import _fast, tracing
from ..controller import Controller
from ..errors import (EINTERNAL, ELIMIT, ELOGOFF, ENOMETHOD, ENOSERVICE, EOVERCROWDED, EREQUEST, ERESPONSE,
                      RemoteProtocolError, RpcError)
from ..metrics import MethodStatus
from ..protocol import baidu_std, checksum, compress, content, streaming, utf8
from ..stub import Servicer, message_class

log = logging.getLogger(__name__)


class MethodEntry:
    __slots__ = ("service_name", "method_name", "handler", "is_async", "request_class",
                 "response_class", "full_name", "place", "status", "descriptor", "client_streaming",
                 "server_streaming", "streaming", "bad_string")

    def __init__(self, descriptor, handler, place=None) -> None:
        self.place = place  # the servicer's receive_attachment_into, when it has its own
        self.descriptor = descriptor
        self.status = MethodStatus()
        self.service_name = descriptor.containing_service.full_name
        self.method_name = descriptor.name
        self.full_name = f"{self.service_name}/{self.method_name}"
        self.handler = handler
        self.is_async = is_async_handler(handler)
        self.request_class = message_class(descriptor.input_type)
        self.response_class = message_class(descriptor.output_type)
        self.bad_string = utf8.checker(self.request_class)  # None: no unchecked string field
        # `rpc M(stream A) returns (stream B)`: served over gRPC only (server/grpc/call.py)
        self.client_streaming = bool(descriptor.client_streaming)
        self.server_streaming = bool(descriptor.server_streaming)
        self.streaming = self.client_streaming or self.server_streaming


def is_async_handler(handler) -> bool:
    """Whether `handler` is an async def, also behind a decorator that keeps `__wrapped__`
    (functools.wraps) or as an object's `async def __call__`: it then runs on the loop, not in
    the thread pool."""
    try:
        unwrapped = inspect.unwrap(handler)
    except ValueError:  # a __wrapped__ cycle
        unwrapped = handler
    return (inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(unwrapped)
            or inspect.iscoroutinefunction(getattr(handler, "__call__", None)))


class Registry:
    """Services by full name, and by short name when that is unique (brpc resolves both)."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, MethodEntry]] = {}
        self._short: dict[str, str | None] = {}
        self.places = False  # some servicer chooses where attachments are received
        self.servicer_names: list[str] = []  # class names, for the server's default version
        self.by_path: dict[str, MethodEntry] = {}  # "/package.Service/Method", as gRPC names a method

    def add(self, servicer: Servicer) -> None:
        service = getattr(servicer, "SERVICE", None)
        if service is None or not hasattr(service, "methods"):
            raise TypeError(f"{type(servicer).__name__} needs SERVICE = <a protobuf ServiceDescriptor>")
        if service.full_name in self.services:
            raise ValueError(f"service {service.full_name} is already added")
        methods = {}
        own_place = getattr(type(servicer), "receive_attachment_into", None) is not Servicer.receive_attachment_into
        place = servicer.receive_attachment_into if own_place else None
        if place is not None:
            self.places = True
        for m in service.methods:
            handler = getattr(servicer, m.name, None)
            if handler is None or not callable(handler):
                handler = _not_implemented(m.name)
            methods[m.name] = entry = MethodEntry(m, handler, place)
            self.by_path[f"/{service.full_name}/{m.name}"] = entry
        self.services[service.full_name] = methods
        self.servicer_names.append(type(servicer).__name__)
        short = service.name
        self._short[short] = None if short in self._short else service.full_name

    def lookup(self, service_name: str, method_name: str) -> MethodEntry:
        if "." not in service_name:
            full = self._short.get(service_name)
            if full is None:
                raise RpcError(ENOSERVICE, f"Fail to find service={service_name}")
        else:
            full = service_name
        methods = self.services.get(full)
        entry = methods.get(method_name) if methods is not None else None
        if entry is None:
            raise RpcError(ENOMETHOD, f"Fail to find method={full}/{method_name}")
        return entry


def streaming_refusal(entry: MethodEntry) -> tuple[int, str]:
    """EREQUEST for a streaming rpc called by a protocol that carries one message each way."""
    return EREQUEST, f"{entry.method_name} is a streaming rpc: call it over gRPC"


def attachment_destination(registry: Registry, meta, data):
    """The buffer the servicer of `meta`'s method chose for its attachment, or None."""
    if meta.compress_type or meta.checksum_type or (meta.content_type or 0) != baidu_std.CONTENT_TYPE_PB:
        return None
    try:
        entry = registry.lookup(meta.service_name, meta.method_name)
    except RpcError:
        return None  # dispatch answers it
    if entry.place is None:
        return None
    try:
        request = entry.request_class.FromString(data)
    except Exception:  # noqa: BLE001 - dispatch reports a request that does not parse
        return None
    if entry.bad_string is not None and entry.bad_string(request):
        return None  # dispatch refuses it
    return entry.place(entry.method_name, request, meta.attachment_size)


def _not_implemented(name: str):
    async def handler(request, cntl):
        raise RpcError(EINTERNAL, f"Method {name}() not implemented.")
    return handler


_U64 = (1 << 64) - 1


def server_controller(ev, conn, entry: MethodEntry) -> Controller:
    meta = ev.meta
    cntl = _new_controller(Controller)  # class defaults, no argument checks: fields set here
    if meta.log_id is not None:
        cntl.log_id = meta.log_id
    if meta.trace_id is not None:  # int64 on the wire, brpc's uint64 ids: unsigned again, as brpc prints them
        cntl.trace_id = meta.trace_id & _U64
        cntl.span_id = None if meta.span_id is None else meta.span_id & _U64
        cntl.parent_span_id = None if meta.parent_span_id is None else meta.parent_span_id & _U64
    if meta.timeout_ms is not None:
        cntl.timeout_ms = meta.timeout_ms
    if meta.request_id is not None:
        cntl.request_id = meta.request_id
    cntl.service_name = entry.service_name
    cntl.method_name = entry.method_name
    cntl.correlation_id = meta.correlation_id or 0
    if meta.compress_type:
        cntl.request_compress_type = meta.compress_type
    if meta.checksum_type:
        cntl.request_checksum_type = meta.checksum_type
    if meta.checksum_with_attachment:
        cntl.request_checksum_with_attachment = True
    cntl.request_attachment = ev.attachment
    if meta.user_fields:
        cntl.request_user_fields = dict(meta.user_fields)
    if conn.credential is not None:
        cntl.authentication_data = conn.credential
    cntl.remote_side = conn.peer
    cntl.local_side = conn.local
    return cntl


_new_controller = object.__new__


def parse_request(entry: MethodEntry, ev, max_decompressed_size: int):
    meta = ev.meta
    data = ev.data
    if not (meta.compress_type or meta.checksum_type or meta.content_type) and len(data) <= max_decompressed_size:
        # Plain protobuf, the usual case, parsed with no more calls; what is wrong with it is
        # named by the general way below.
        try:
            request = entry.request_class.FromString(data)
        except Exception:  # noqa: BLE001
            request = None
        if request is not None and request.IsInitialized():
            # A payload all ASCII holds no string that is bad UTF-8: checked so for a small one
            # (its copy is cheap), at a third of the cost of the field check.
            if entry.bad_string is not None and (len(data) > 4096 or not data.tobytes().isascii()):
                check_strings(entry, request)
            return request
    try:
        data = baidu_std.decode_data(meta, data, ev.attachment, max_decompressed_size)
        request = content.parse(entry.request_class, data, meta.content_type or 0)
    except RemoteProtocolError as e:
        raise RpcError(EREQUEST, (
            f"Fail to parse request={entry.request_class.DESCRIPTOR.full_name}, "
            f"ContentType={content.name(meta.content_type or 0)}, "
            f"CompressType={compress.name(meta.compress_type or 0)}, "
            f"ChecksumType={checksum.name(meta.checksum_type or 0)}, "
            f"request_size={len(ev.data)} ({e})")) from None
    if entry.bad_string is not None:
        check_strings(entry, request)
    return request


def check_strings(entry: MethodEntry, request) -> None:
    """RpcError(EREQUEST) where a string field of `request` is not UTF-8 (protocol/utf8.py)."""
    bad = entry.bad_string(request)
    if bad:
        raise RpcError(EREQUEST, f"Fail to parse request={entry.request_class.DESCRIPTOR.full_name}: "
                                 f"string field {bad} is not UTF-8")


def error_response(request_meta, code: int, text: str, tag: str) -> list:
    """A meta-only error response, with the fields C++ writes (brpc's src/brpc/policy/baidu_rpc_protocol.cpp)."""
    meta = _fast.RpcMeta()
    meta.has_response = True
    if code == -1:
        code = EINTERNAL
        meta.error_text = f"[{tag}]{text}"
    else:
        meta.error_text = f"[{tag}][E{code}]{text}"
    meta.error_code = code
    meta.compress_type = 0
    meta.correlation_id = request_meta.correlation_id if request_meta.correlation_id is not None else 0
    meta.content_type = 0
    meta.checksum_type = 0
    meta.checksum_value = request_meta.checksum_value if request_meta.checksum_value is not None else b""
    return baidu_std.pack(meta, b"")


def success_response(request_meta, response, cntl: Controller) -> list:
    """The reply carrying `response` as the handler's settings in `cntl` ask; RpcError(ERESPONSE)
    naming what the handler set that cannot be sent."""
    try:
        serialized = response.SerializeToString()
    except EncodeError as e:
        raise RpcError(ERESPONSE, f"Fail to serialize response={response.DESCRIPTOR.full_name}: {e}") from None
    attachment = cntl.response_attachment
    if attachment is not None and type(attachment) is not bytes:
        try:
            if type(attachment) is list or type(attachment) is tuple:
                attachment = baidu_std.attachment_views(attachment)
            else:
                attachment = _fast.byte_view(attachment)
        except Exception as e:
            raise RpcError(ERESPONSE, f"cntl.response_attachment cannot be sent: {exception_text(e)}") from None
    # Packed here, not in a function of its own: one Python call less per reply.
    try:
        meta = _fast.RpcMeta()
        meta.has_response = True
        meta.error_code = 0
        meta.correlation_id = request_meta.correlation_id if request_meta.correlation_id is not None else 0
        if cntl.response_compress_type or cntl.response_checksum_type or cntl.response_checksum_with_attachment:
            data = baidu_std.encode_data(meta, serialized, cntl.response_compress_type, attachment,
                                         cntl.response_checksum_type, cntl.response_checksum_with_attachment)
        else:
            data = serialized
            meta.compress_type = 0
        accepted = cntl._accepted_streams
        if accepted:
            first = accepted[0]
            meta.stream_settings = streaming.encode_settings(first.id, first._max_buf_size > 0, True,
                                                             [s.id for s in accepted[1:]])
        fields = cntl._response_user_fields
        if fields:
            meta.user_fields = list(fields.items())
        meta.content_type = 0
        if meta.checksum_type is None:
            # C++ quirk kept for byte-exact replies: with no response checksum, the request's
            # checksum_value is echoed (with checksum_type 0, so it is never verified).
            meta.checksum_type = 0
            meta.checksum_value = request_meta.checksum_value if request_meta.checksum_value is not None else b""
        return baidu_std.pack(meta, data, attachment)
    except Exception as e:  # what the handler set in cntl: user fields, compression, checksum
        raise RpcError(ERESPONSE, f"Fail to pack response={response.DESCRIPTOR.full_name}: "
                       f"{exception_text(e)}") from None


def exception_text(e: BaseException) -> str:
    """"Type: message" of an exception, sendable as an error text: also when its str() fails
    or holds lone surrogates (as `os.fsdecode` makes of undecodable bytes)."""
    try:
        text = f"{type(e).__name__}: {e}"
    except Exception:
        return f"{type(e).__name__} (its str() failed)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def auth_failure_response(request_meta, extra: str = "") -> list:
    meta = _fast.RpcMeta()
    meta.has_response = True
    meta.error_code = 1004
    meta.error_text = "Fail to authenticate" + (f": {extra}" if extra else "")
    meta.correlation_id = request_meta.correlation_id if request_meta.correlation_id is not None else 0
    return baidu_std.pack(meta, b"")


def set_failed(cntl, entry, code, text) -> None:
    """cntl.set_failed(code, text); a code it rejects (0, as brpc's SetFailed) becomes EINTERNAL."""
    try:
        cntl.set_failed(code, text)
    except Exception as e:
        why = f"the handler's error RpcError({code!r}, {text!r}) is invalid: {exception_text(e)}"
        log.error("%s: %s", entry.full_name, why)
        cntl.error_code, cntl.error_text = EINTERNAL, why


def handler_failed(cntl, entry, e: BaseException) -> None:
    """A handler raised `e` (not an RpcError): logged, and the call fails with EINTERNAL."""
    log.error("handler %s failed", entry.full_name, exc_info=e)
    set_failed(cntl, entry, EINTERNAL, exception_text(e))


def limit_error(entry) -> tuple[int, str]:
    """ELIMIT from a method's limiter, in brpc's words."""
    return ELIMIT, (f"Rejected by {entry.service_name}.{entry.method_name}'s ConcurrencyLimiter, "
                    f"concurrency={entry.status.concurrency + 1}")


def overcrowded_text(conn) -> str:
    return (f"{conn.unwritten_bytes()} bytes of replies are waiting to be written to {conn.peer} "
            f"(max_unwritten_bytes={conn.max_unwritten_bytes})")


def server_admission_error(server, conn):
    """The rejection any request gets from a stopping, overcrowded or full server, or None."""
    if server.stopping:
        return ELOGOFF, "Server is stopping"
    if not conn.writable():
        return EOVERCROWDED, overcrowded_text(conn)
    limit = server.options.max_concurrency
    if limit and server.concurrency >= limit:
        return ELIMIT, f"Reached server's max_concurrency={limit}"
    return None


def admission_error(server, conn, ev):
    """The rejection a request gets before its handler is looked up, or None."""
    rejected = server_admission_error(server, conn)
    if rejected is not None:
        return rejected
    if ev.error is not None:
        return ev.error.code, str(ev.error)
    meta = ev.meta
    if not meta.has_request:
        return EREQUEST, "the request meta (RpcMeta.request) is missing"
    if meta.user_fields:
        return user_fields_error(server.options, meta.user_fields)
    return None


def user_fields_error(options, fields: list):
    """EREQUEST naming the limit `fields` pass (max_user_fields, max_user_fields_bytes), or None."""
    if len(fields) > options.max_user_fields:
        return EREQUEST, (f"the request carries more than {options.max_user_fields} user_fields "
                          f"(max_user_fields={options.max_user_fields})")
    size = 0
    for key, value in fields:
        size += len(key) + len(value)
    if size > options.max_user_fields_bytes:
        return EREQUEST, (f"the request's user_fields hold {size} bytes "
                          f"(max_user_fields_bytes={options.max_user_fields_bytes})")
    return None


def request_ended(server, conn, entry, cntl, status, started_ns: int, protocol: str, otel) -> None:
    """What a request leaves behind when it ends, over either protocol: its time in its
    method's figures (`status`, where the request was counted in it), a record on /rpcz,
    and the end of its OpenTelemetry span."""
    us = (time.perf_counter_ns() - started_ns) // 1000
    if status is not None:
        status.ended(us, cntl.error_code)
    if server.rpcz is not None:
        server.rpcz.append((time.time(), cntl.trace_id, cntl.span_id, cntl.parent_span_id,
                            entry.full_name, conn.peer, us, cntl.error_code, protocol))
    if otel is not None:
        tracing.end_server_span(otel, cntl.error_code)
