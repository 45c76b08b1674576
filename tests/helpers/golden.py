"""Conversions between golden-capture JSON and aiobrpc objects."""

from __future__ import annotations

from aiobrpc import _fast
from aiobrpc._proto import brpc_streaming_pb2, interop_pb2

_REQUEST = ("service_name", "method_name", "log_id", "trace_id", "span_id", "parent_span_id",
            "request_id", "timeout_ms")
_TOP = ("compress_type", "correlation_id", "attachment_size", "authentication_data",
        "stream_settings", "user_fields", "content_type", "checksum_type", "checksum_value",
        "checksum_with_attachment")


def settings_to_dict(raw: bytes) -> dict:
    s = brpc_streaming_pb2.StreamSettings.FromString(raw)
    return message_to_dict(s)


def settings_from_dict(d: dict) -> bytes:
    s = brpc_streaming_pb2.StreamSettings()
    for k, v in d.items():
        if k == "extra_stream_ids":
            s.extra_stream_ids.extend(v)
        else:
            setattr(s, k, v)
    return s.SerializeToString()


def message_to_dict(msg) -> dict:
    """Present fields only, bytes as hex: the capture's conventions."""
    out = {}
    for fd, value in msg.ListFields():
        if fd.type == fd.TYPE_BYTES:
            value = value.hex()
        elif fd.is_repeated:
            value = list(value)
        out[fd.name] = value
    return out


def meta_to_dict(m) -> dict:
    """Our RpcMeta in the capture's meta_decoded form (present fields only)."""
    out: dict = {}
    if m.has_request:
        out["request"] = {k: getattr(m, k) for k in _REQUEST if getattr(m, k) is not None}
    if m.has_response:
        out["response"] = {k: getattr(m, k) for k in ("error_code", "error_text")
                           if getattr(m, k) is not None}
    for k in _TOP:
        v = getattr(m, k)
        if v is None:
            continue
        if k in ("authentication_data", "checksum_value"):
            v = bytes(v).hex()
        elif k == "stream_settings":
            v = settings_to_dict(v)
        elif k == "user_fields":
            v = [list(kv) for kv in v]
        out[k] = v
    return out


def meta_from_dict(d: dict):
    m = _fast.RpcMeta()
    if "request" in d:
        m.has_request = True
        for k, v in d["request"].items():
            setattr(m, k, v)
    if "response" in d:
        m.has_response = True
        for k, v in d["response"].items():
            setattr(m, k, v)
    for k, v in d.items():
        if k in ("request", "response"):
            continue
        if k in ("authentication_data", "checksum_value"):
            v = bytes.fromhex(v)
        elif k == "stream_settings":
            v = settings_from_dict(v)
        elif k == "user_fields":
            v = [tuple(kv) for kv in v]
        setattr(m, k, v)
    return m


def data_message(frame: dict):
    cls = {"interop.EchoRequest": interop_pb2.EchoRequest,
           "interop.EchoResponse": interop_pb2.EchoResponse}[frame["data_type"]]
    return cls
