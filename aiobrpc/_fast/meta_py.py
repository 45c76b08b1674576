"""RpcMeta codec, pure-Python twin of `meta.pyx`.

A hand-written proto2 codec for brpc's RpcMeta (brpc's src/brpc/policy/baidu_rpc_meta.proto) instead of the
generated protobuf class, for two reasons: it is the per-call hot path (the generated class
costs an object graph per call), and byte-exact output needs control that protobuf does not
give (field presence as C++ writes it, user_fields in the caller's order).

`RpcMeta` is flat: the request sub-message's fields and the response sub-message's fields live
on the same object, with `has_request` / `has_response` telling whether each sub-message is
present. Every other field is None when absent from the wire (proto2 presence).

Decoding follows protobuf's rules: unknown fields (any wire type, groups included) are
skipped, a known field with an unexpected wire type is treated as unknown, a repeated scalar
keeps the last value, a repeated sub-message merges, a missing required field of the request
sub-message fails. Anything malformed raises RemoteProtocolError.
"""

from __future__ import annotations

from ..errors import LocalProtocolError, RemoteProtocolError

_MASK64 = 0xFFFFFFFFFFFFFFFF
_MAX_GROUP_DEPTH = 32


class RpcMeta:
    """One frame's RpcMeta. Field names are brpc's; None means absent on the wire."""

    __slots__ = (
        "has_request", "service_name", "method_name", "log_id", "trace_id", "span_id",
        "parent_span_id", "request_id", "timeout_ms",
        "has_response", "error_code", "error_text",
        "compress_type", "correlation_id", "attachment_size", "chunk_info",
        "authentication_data", "stream_settings", "user_fields", "content_type",
        "checksum_type", "checksum_value", "checksum_with_attachment",
    )

    def __init__(self) -> None:
        self.has_request = False
        self.service_name = None
        self.method_name = None
        self.log_id = None
        self.trace_id = None
        self.span_id = None
        self.parent_span_id = None
        self.request_id = None
        self.timeout_ms = None
        self.has_response = False
        self.error_code = None
        self.error_text = None
        self.compress_type = None
        self.correlation_id = None
        self.attachment_size = None
        self.chunk_info = None
        self.authentication_data = None
        self.stream_settings = None
        self.user_fields = None
        self.content_type = None
        self.checksum_type = None
        self.checksum_value = None
        self.checksum_with_attachment = None

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__
                          if getattr(self, k) is not None and getattr(self, k) is not False)
        return f"RpcMeta({shown})"

    def __eq__(self, other: object) -> bool:
        if not hasattr(other, "has_request") or not hasattr(other, "checksum_with_attachment"):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in RpcMeta.__slots__)

    __hash__ = None  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------------
# encoding

def _varint(out: bytearray, v: int) -> None:
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def _int64(out: bytearray, tag: int, v: object, name: str) -> None:
    if not isinstance(v, int):
        raise LocalProtocolError(f"RpcMeta.{name} must be an int, got {type(v).__name__}")
    if not -(1 << 63) <= v <= _MASK64:
        raise LocalProtocolError(f"RpcMeta.{name}={v} does not fit in 64 bits")
    out.append(tag)
    _varint(out, v & _MASK64)


def _int32(out: bytearray, tag: int, v: object, name: str) -> None:
    if not isinstance(v, int):
        raise LocalProtocolError(f"RpcMeta.{name} must be an int, got {type(v).__name__}")
    if not -(1 << 31) <= v < (1 << 31):
        raise LocalProtocolError(f"RpcMeta.{name}={v} does not fit in int32")
    out.append(tag)
    _varint(out, v & _MASK64)


def _blob(out: bytearray, tag: int, v: object, name: str) -> None:
    if isinstance(v, str):
        v = v.encode()
    elif isinstance(v, memoryview):
        if v.format != "B" or v.ndim != 1:
            v = v.cast("B")  # the length prefix counts bytes, not items
    elif not isinstance(v, (bytes, bytearray)):
        raise LocalProtocolError(f"RpcMeta.{name} must be str or bytes, got {type(v).__name__}")
    out.append(tag)
    _varint(out, len(v))
    out += v


def encode_meta(meta: RpcMeta) -> bytes:
    """Serialize `meta` in field-number order, writing exactly the fields that are set."""
    out = bytearray()
    _encode_into(out, meta)
    return bytes(out)


def _encode_into(out: bytearray, m: RpcMeta) -> None:
    if m.has_request:
        sub = bytearray()
        if m.service_name is None or m.method_name is None:
            raise LocalProtocolError("a request meta needs service_name and method_name")
        _blob(sub, 0x0A, m.service_name, "service_name")
        _blob(sub, 0x12, m.method_name, "method_name")
        if m.log_id is not None:
            _int64(sub, 0x18, m.log_id, "log_id")
        if m.trace_id is not None:
            _int64(sub, 0x20, m.trace_id, "trace_id")
        if m.span_id is not None:
            _int64(sub, 0x28, m.span_id, "span_id")
        if m.parent_span_id is not None:
            _int64(sub, 0x30, m.parent_span_id, "parent_span_id")
        if m.request_id is not None:
            _blob(sub, 0x3A, m.request_id, "request_id")
        if m.timeout_ms is not None:
            _int32(sub, 0x40, m.timeout_ms, "timeout_ms")
        _blob(out, 0x0A, sub, "request")
    if m.has_response:
        sub = bytearray()
        if m.error_code is not None:
            _int32(sub, 0x08, m.error_code, "error_code")
        if m.error_text is not None:
            _blob(sub, 0x12, m.error_text, "error_text")
        _blob(out, 0x12, sub, "response")
    if m.compress_type is not None:
        _int32(out, 0x18, m.compress_type, "compress_type")
    if m.correlation_id is not None:
        _int64(out, 0x20, m.correlation_id, "correlation_id")
    if m.attachment_size is not None:
        _int32(out, 0x28, m.attachment_size, "attachment_size")
    if m.chunk_info is not None:
        _blob(out, 0x32, m.chunk_info, "chunk_info")
    if m.authentication_data is not None:
        _blob(out, 0x3A, m.authentication_data, "authentication_data")
    if m.stream_settings is not None:
        _blob(out, 0x42, m.stream_settings, "stream_settings")
    if m.user_fields is not None:
        for key, value in m.user_fields:
            entry = bytearray()
            _blob(entry, 0x0A, key, "user_fields key")
            _blob(entry, 0x12, value, "user_fields value")
            _blob(out, 0x4A, entry, "user_fields")
    if m.content_type is not None:
        _int32(out, 0x50, m.content_type, "content_type")
    if m.checksum_type is not None:
        _int32(out, 0x58, m.checksum_type, "checksum_type")
    if m.checksum_value is not None:
        _blob(out, 0x62, m.checksum_value, "checksum_value")
    if m.checksum_with_attachment is not None:
        out.append(0x68)
        out.append(1 if m.checksum_with_attachment else 0)


def pack_head(magic: bytes, meta: RpcMeta, payload_size: int) -> bytes:
    """The 12-byte header followed by the serialized meta, as one buffer.

    `payload_size` is everything after the meta (data and attachment).
    """
    if not isinstance(magic, bytes) or len(magic) != 4:
        raise LocalProtocolError(f"magic must be 4 bytes, got {magic!r}")
    if not isinstance(payload_size, int) or payload_size < 0:
        raise LocalProtocolError(f"payload_size must be an int >= 0, got {payload_size!r}")
    out = bytearray(magic)
    out += b"\0\0\0\0\0\0\0\0"
    _encode_into(out, meta)
    meta_size = len(out) - 12
    body_size = meta_size + payload_size
    if body_size > 0xFFFFFFFF:
        raise LocalProtocolError(f"frame body of {body_size} bytes does not fit the 32-bit body_size")
    out[4:12] = body_size.to_bytes(4, "big") + meta_size.to_bytes(4, "big")
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# decoding

# Entries of user_fields a decoded meta holds at most: one more says the frame had more (and
# was refused); those after it are skipped unread, so a frame of 100k tiny entries costs
# no more Python objects than this many (brpc has no limit).
MAX_USER_FIELDS = 1024


def _bad(what: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"RpcMeta does not parse: {what}")


def _read_varint(buf, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise _bad("truncated varint")
        b = buf[pos]
        pos += 1
        if shift == 63 and b > 1:
            raise _bad("varint longer than 64 bits")
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise _bad("varint longer than 10 bytes")


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def _signed32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= (1 << 31) else v


def _skip(buf, wt: int, field: int, pos: int, end: int, depth: int = 0) -> int:
    if wt == 0:
        return _read_varint(buf, pos, end)[1]
    if wt == 1:
        pos += 8
    elif wt == 5:
        pos += 4
    elif wt == 2:
        n, pos = _read_varint(buf, pos, end)
        pos += n
    elif wt == 3:
        if depth >= _MAX_GROUP_DEPTH:
            raise _bad("groups nested too deeply")
        while True:
            tag, pos = _read_varint(buf, pos, end)
            if tag >> 3 == 0:
                raise _bad("field number 0")
            if tag & 7 == 4:
                if tag >> 3 != field:
                    raise _bad("mismatched end of group")
                return pos
            pos = _skip(buf, tag & 7, tag >> 3, pos, end, depth + 1)
    else:
        raise _bad(f"invalid wire type {wt}")
    if pos > end:
        raise _bad("field runs past the end of the meta")
    return pos


def _read_len(buf, pos: int, end: int) -> tuple[int, int]:
    n, pos = _read_varint(buf, pos, end)
    if n > end - pos:
        raise _bad("length-delimited field runs past the end of the meta")
    return pos, pos + n


def _text(buf, start: int, stop: int, name: str) -> str:
    try:
        return bytes(buf[start:stop]).decode("utf-8")
    except UnicodeDecodeError:
        raise _bad(f"{name} is not valid UTF-8") from None


def _decode_request(m: RpcMeta, buf, pos: int, end: int) -> None:
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        field, wt = tag >> 3, tag & 7
        if field == 0:
            raise _bad("field number 0")
        if wt == 2 and field in (1, 2, 7):
            s, pos = _read_len(buf, pos, end)
            text = _text(buf, s, pos, "request string field")
            if field == 1:
                m.service_name = text
            elif field == 2:
                m.method_name = text
            else:
                m.request_id = text
        elif wt == 0 and field in (3, 4, 5, 6, 8):
            v, pos = _read_varint(buf, pos, end)
            if field == 3:
                m.log_id = _signed64(v)
            elif field == 4:
                m.trace_id = _signed64(v)
            elif field == 5:
                m.span_id = _signed64(v)
            elif field == 6:
                m.parent_span_id = _signed64(v)
            else:
                m.timeout_ms = _signed32(v)
        else:
            pos = _skip(buf, wt, field, pos, end)


def _decode_response(m: RpcMeta, buf, pos: int, end: int) -> None:
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        field, wt = tag >> 3, tag & 7
        if field == 0:
            raise _bad("field number 0")
        if field == 1 and wt == 0:
            v, pos = _read_varint(buf, pos, end)
            m.error_code = _signed32(v)
        elif field == 2 and wt == 2:
            s, pos = _read_len(buf, pos, end)
            m.error_text = _text(buf, s, pos, "error_text")
        else:
            pos = _skip(buf, wt, field, pos, end)


def _decode_entry(buf, pos: int, end: int) -> tuple[str, str]:
    key = value = ""
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        field, wt = tag >> 3, tag & 7
        if field == 0:
            raise _bad("field number 0")
        if wt == 2 and field in (1, 2):
            s, pos = _read_len(buf, pos, end)
            text = _text(buf, s, pos, "user_fields entry")
            if field == 1:
                key = text
            else:
                value = text
        else:
            pos = _skip(buf, wt, field, pos, end)
    return key, value


def decode_meta(buf) -> RpcMeta:
    """Parse a serialized RpcMeta (bytes, bytearray or memoryview)."""
    if not isinstance(buf, memoryview):
        buf = memoryview(buf)
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B")
    m = RpcMeta()
    pos, end = 0, len(buf)
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        field, wt = tag >> 3, tag & 7
        if field == 0:
            raise _bad("field number 0")
        if wt == 2:
            if field in (1, 2, 6, 7, 8, 9, 12):
                s, pos = _read_len(buf, pos, end)
                if field == 1:
                    m.has_request = True
                    _decode_request(m, buf, s, pos)
                elif field == 2:
                    m.has_response = True
                    _decode_response(m, buf, s, pos)
                elif field == 6:
                    m.chunk_info = bytes(buf[s:pos])
                elif field == 7:
                    m.authentication_data = bytes(buf[s:pos])
                elif field == 8:
                    m.stream_settings = bytes(buf[s:pos])
                elif field == 9:
                    if m.user_fields is None:
                        m.user_fields = []
                    if len(m.user_fields) <= MAX_USER_FIELDS:  # one past the limit shows it was passed
                        m.user_fields.append(_decode_entry(buf, s, pos))
                else:
                    m.checksum_value = bytes(buf[s:pos])
                continue
        elif wt == 0 and field in (3, 4, 5, 10, 11, 13):
            v, pos = _read_varint(buf, pos, end)
            if field == 3:
                m.compress_type = _signed32(v)
            elif field == 4:
                m.correlation_id = _signed64(v)
            elif field == 5:
                m.attachment_size = _signed32(v)
            elif field == 10:
                m.content_type = _signed32(v)
            elif field == 11:
                m.checksum_type = _signed32(v)
            else:
                m.checksum_with_attachment = v != 0
            continue
        pos = _skip(buf, wt, field, pos, end)
    if m.has_request and (m.service_name is None or m.method_name is None):
        missing = "service_name" if m.service_name is None else "method_name"
        raise _bad(f"required field request.{missing} is missing")
    return m
