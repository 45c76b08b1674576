"""A protobuf method called over HTTP: the body to the request message, the handler, the reply.

As brpc's HTTP access: `/<Service>/<Method>` (full or short service name), any verb. The body
is read by its Content-Type (the media type after `application/`, parameters ignored):
`proto` or `x-protobuf` binary, `proto-text` text format, `proto-json` canonical protobuf JSON,
anything else (`json`, none, `text/plain`) brpc's JSON (proto field names, bytes in base64,
enums by name or number; unknown fields ignored). The response is written the same way as the
request, with the request's Content-Type (none when the request had none). An error answers the
status of its code, `x-bd-error-code: <code>` and the text `[host:port][E<code>]<text>`.

Compression as brpc's: a body sent with `Content-Encoding: gzip` is inflated first (capped at
max_decompressed_size; any other encoding but identity is refused with 400), and a reply whose
handler set `cntl.response_compress_type = COMPRESS_GZIP` is gzipped when it is at least 512
bytes (brpc's -http_body_compress_threshold) and the caller accepts gzip.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor

from .. import _fast, tracing
from ..controller import Controller
from ..protocol import compress, utf8
from ..errors import (EINVAL, ELIMIT, ELOGOFF, ENOMETHOD, ENOSERVICE, EPERM, EREQUEST, ERESPONSE,
                      ERPCAUTH, ERPCTIMEDOUT, ETIMEDOUT, RpcError)
from .dispatch import handler_failed, limit_error, request_ended, set_failed, streaming_refusal

log = logging.getLogger(__name__)

_STATUS = {0: 200, ENOSERVICE: 404, ENOMETHOD: 404, ERPCAUTH: 401, EREQUEST: 400, EINVAL: 400,
           ELIMIT: 503, ELOGOFF: 503, EPERM: 403, ERPCTIMEDOUT: 504, ETIMEDOUT: 504}
_INT64 = (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64)


def http_status(code: int) -> int:
    """The HTTP status brpc answers for error `code` (its ErrorCodeToStatusCode)."""
    return _STATUS.get(code, 500)


class HttpReply:
    """What goes back: status, headers (after Content-Length), body."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: list, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


def error_reply(code: int, text: str, tag: str) -> HttpReply:
    return HttpReply(http_status(code), [("Content-Type", "text/plain"), ("x-bd-error-code", str(code))],
                     f"[{tag}][E{code}]{text}".encode())


def media_type(content_type: str | None) -> str:
    """"proto" for "application/proto; charset=x"; "" for none."""
    if not content_type:
        return ""
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind[len("application/"):] if kind.startswith("application/") else kind


def parse_body(message_class, body: bytes, content_type: str | None):
    """The request message in `body`; RpcError(EREQUEST) naming why it cannot be read."""
    msg = message_class()
    kind = media_type(content_type)
    name = msg.DESCRIPTOR.full_name
    try:
        if kind in ("proto", "x-protobuf"):
            msg.ParseFromString(body)
        elif kind == "proto-text":
            text_format.Parse(body.decode("utf-8"), msg)
        elif not body:
            missing = [f.name for f in msg.DESCRIPTOR.fields if _is_required(f)]
            if missing:
                raise RpcError(EREQUEST, f"{name} needs to be created from a non-empty json, it has required fields.")
        else:
            json_format.Parse(body.decode("utf-8"), msg, ignore_unknown_fields=True)
    except RpcError:
        raise
    except Exception as e:  # every parser's error: the caller sent something unreadable
        if kind in ("proto", "x-protobuf", "proto-text", "proto-json"):
            read_as = kind
        else:  # brpc's JSON, whatever else the Content-Type said (curl -d sends a form's)
            read_as = "JSON" + (f" (a Content-Type of {content_type} is read as JSON)" if kind not in ("", "json") else "")
        raise RpcError(EREQUEST, f"Fail to parse the body as {read_as} into {name}: {e}") from None
    bad = utf8.bad_field(msg)  # only a protobuf body can hold one (protocol/utf8.py)
    if bad:
        raise RpcError(EREQUEST, f"Fail to parse the body into {name}: string field {bad} is not UTF-8")
    return msg


def _is_required(field) -> bool:
    try:
        return field.is_required  # protobuf >= 5
    except AttributeError:
        return field.label == FieldDescriptor.LABEL_REQUIRED


def write_body(msg, content_type: str | None) -> bytes:
    kind = media_type(content_type)
    if kind in ("proto", "x-protobuf"):
        return msg.SerializeToString()
    if kind == "proto-text":
        return text_format.MessageToString(msg).encode()
    bad = utf8.bad_field(msg)
    if bad:  # protobuf's JSON writer would write the bytes' repr (b'...') as the string
        raise ValueError(f"string field {bad} is not UTF-8: JSON cannot carry it")
    if kind == "proto-json":
        return json_format.MessageToJson(msg, indent=None).encode()
    return json.dumps(to_brpc_json(msg), separators=(",", ":"), ensure_ascii=False).encode()


def to_brpc_json(msg) -> dict:
    """The message as brpc's pb2json writes it: proto field names, 64-bit integers as numbers
    (canonical protobuf JSON writes them as strings)."""
    d = json_format.MessageToDict(msg, preserving_proto_field_name=True)
    _numbers(msg.DESCRIPTOR, d)
    return d


def _numbers(desc, d: dict) -> None:
    for f in desc.fields:
        if f.name not in d:
            continue
        v = d[f.name]
        if f.type in _INT64:
            d[f.name] = [int(x) for x in v] if isinstance(v, list) else int(v)
        elif f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
            value_field = f.message_type.fields_by_name["value"]
            if value_field.type in _INT64:
                d[f.name] = {k: int(x) for k, x in v.items()}
            elif value_field.type == FieldDescriptor.TYPE_MESSAGE:
                for x in v.values():
                    _numbers(value_field.message_type, x)
        elif f.type == FieldDescriptor.TYPE_MESSAGE and not f.message_type.full_name.startswith("google.protobuf."):
            for x in (v if isinstance(v, list) else [v]):
                _numbers(f.message_type, x)


def method_listing(methods: dict) -> str:
    """`rpc Echo (EchoRequest) returns (EchoResponse);` per method, as brpc lists them."""
    return "\n".join(f"rpc {m} ({e.request_class.DESCRIPTOR.name}) returns ({e.response_class.DESCRIPTOR.name});"
                     for m, e in methods.items())


async def call_over_http(server, conn, path: str, headers: dict, body: bytes) -> HttpReply | None:
    """Call the method `path` names with `body`; the reply, success or error, or None where
    the handler closed the connection instead (`cntl.close_connection`)."""
    tag = server.options.server_tag or conn.local
    parts = [p for p in path.split("/") if p]
    registry = server.registry
    full = parts[0] if "." in parts[0] else registry._short.get(parts[0])
    methods = registry.services.get(full) if full else None
    if methods is None:
        return error_reply(ENOSERVICE, f"Fail to find service on `{path}'", tag)
    entry = methods.get(parts[1]) if len(parts) > 1 else None
    if entry is None:
        if len(parts) == 1:
            return error_reply(ENOMETHOD, f"Missing method name for service {full}. Available methods:\n"
                               + method_listing(methods), tag)
        return error_reply(ENOMETHOD, f"Fail to find method on `{path}'", tag)
    if entry.streaming:
        return error_reply(*streaming_refusal(entry), tag)
    server.stats.requests += 1
    if server.stopping:
        return _refused(server, ELOGOFF, "Server is stopping", tag)
    limit = server.options.max_concurrency
    if limit and server.concurrency >= limit:
        return _refused(server, ELIMIT, f"Reached server's max_concurrency={limit}", tag)
    if not entry.status.admits():
        return _refused(server, *limit_error(entry), tag)
    content_type = headers.get("content-type")
    try:
        body = _inflated(body, headers.get("content-encoding"), server.options.max_decompressed_size)
        if entry.request_class.DESCRIPTOR.fields:
            request, attachment = parse_body(entry.request_class, body, content_type), b""
        else:  # a "pure HTTP" method: the body is left in the attachment
            request, attachment = entry.request_class(), body
    except RpcError as e:
        server.stats.failed_requests += 1
        return error_reply(e.code, e.text, tag)
    cntl = Controller()
    cntl.service_name, cntl.method_name = entry.service_name, entry.method_name
    cntl.remote_side = conn.peer
    cntl.request_attachment = attachment
    if conn.credential is not None:
        cntl.authentication_data = conn.credential
    log_id = headers.get("log-id", "")
    if log_id.isascii() and log_id.isdigit() and int(log_id) < 1 << 64:
        cntl.log_id = int(log_id)
    ids = [headers.get(h, "") for h in ("x-bd-trace-id", "x-bd-span-id", "x-bd-parent-span-id")]
    if _is_id(ids[0]):  # brpc's HTTP client sends its span's ids in these headers, in decimal
        cntl.trace_id = int(ids[0])
        cntl.span_id = int(ids[1]) if _is_id(ids[1]) else tracing.new_id()
        cntl.parent_span_id = int(ids[2]) if _is_id(ids[2]) else None
    response = await _run(server, conn, entry, request, cntl)
    if cntl._close_reason is not None:
        return None  # the handler asked to close the connection instead of answering
    if cntl.error_code:
        server.stats.failed_requests += 1
        return error_reply(cntl.error_code, cntl.error_text, tag)
    out_headers = [("Content-Type", content_type)] if content_type else []
    try:
        attachment = cntl.response_attachment
        if attachment is not None and (len(_fast.byte_view(attachment)) or not entry.response_class.DESCRIPTOR.fields):
            body = _fast.byte_view(attachment).tobytes()
        else:
            body = write_body(response, content_type)
        if (cntl.response_compress_type == compress.GZIP and len(body) >= GZIP_THRESHOLD
                and accepts_gzip(headers.get("accept-encoding", ""))):
            body = compress.compress(compress.GZIP, body)
            out_headers.append(("Content-Encoding", "gzip"))
        return HttpReply(200, out_headers, body)
    except Exception as e:  # noqa: BLE001 - a response that cannot be written is the server's error
        log.error("%s: the response cannot be written as %s: %r", entry.full_name, content_type, e)
        server.stats.failed_requests += 1
        return error_reply(ERESPONSE, f"Fail to write the response: {e}", tag)


GZIP_THRESHOLD = 512  # brpc's -http_body_compress_threshold


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding header admits gzip (`gzip`, `x-gzip` or `*`, q above 0)."""
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        if coding.strip().lower() in ("gzip", "x-gzip", "*"):
            q = params.strip().lower()
            if q.startswith("q="):
                try:
                    return float(q[2:]) > 0
                except ValueError:
                    return False
            return True
    return False


def _inflated(body: bytes, encoding: str | None, max_size: int) -> bytes:
    """The body with its Content-Encoding undone; RpcError(EREQUEST) where it cannot be."""
    if encoding is None or encoding.strip().lower() in ("", "identity"):
        return body
    if encoding.strip().lower() not in ("gzip", "x-gzip"):
        raise RpcError(EREQUEST, f"Content-Encoding {encoding!r} is not supported (gzip or identity)")
    try:
        return bytes(compress.decompress(compress.GZIP, body, max_size))
    except Exception as e:  # noqa: BLE001 - a corrupt or oversized body is the caller's error
        raise RpcError(EREQUEST, f"Fail to gunzip the body: {e}") from None


def _is_id(v: str) -> bool:
    return v.isascii() and v.isdigit() and 0 < int(v) < 1 << 64


def _refused(server, code: int, text: str, tag: str) -> HttpReply:
    server.stats.failed_requests += 1
    return error_reply(code, text, tag)


async def _run(server, conn, entry, request, cntl: Controller) -> Any:
    """The handler's response; cntl failed with the error it raised or left."""
    status = entry.status
    if not server.options.method_status and status.limiter is None:
        status = None
    server.concurrency += 1
    if status is not None:
        status.concurrency += 1
    conn.inflight += 1
    started = time.perf_counter_ns()
    response = None
    otel = None
    if cntl.trace_id is not None:  # a traced request: its span is current while the handler runs
        span = tracing.Span(cntl.trace_id, cntl.span_id, cntl.parent_span_id)
        tracing.enter(span)  # this request's own task: the span leaves with it
        if tracing.OTEL is not None:
            otel = tracing.start_server_span(entry.full_name, span, conn.peer)
    try:
        if entry.is_async:
            response = await entry.handler(request, cntl)
        else:
            response = await asyncio.get_running_loop().run_in_executor(
                server._thread_pool(), entry.handler, request, cntl)
        while inspect.isawaitable(response):
            response = await response
        if not cntl.error_code and not isinstance(response, entry.response_class):
            why = f"handler returned {type(response).__name__}, expected {entry.response_class.DESCRIPTOR.full_name}"
            log.error("%s: %s", entry.full_name, why)
            set_failed(cntl, entry, ERESPONSE, why)
    except RpcError as e:
        set_failed(cntl, entry, e.code, e.text)
    except Exception as e:  # noqa: BLE001 - the handler's bug: logged, answered as EINTERNAL
        handler_failed(cntl, entry, e)
    finally:
        request_ended(server, conn, entry, cntl, status, started, "http", otel)
        server.concurrency -= 1
        if server.concurrency == 0 and server._idle is not None and not server._idle.done():
            server._idle.set_result(None)
        conn.request_done()
    return response
