"""The gRPC layer over HTTP/2, sans-IO: message framing, compression, timeouts, status codes,
status messages and metadata. No asyncio and no HTTP/2 here: the h2 package carries the
frames, this module reads and writes what is inside them.

Wire facts (gRPC over HTTP/2, as grpc-go, gRPC C-core and brpc speak it):

* A request or response body is a sequence of length-prefixed messages, each a 5-byte prefix
  (a flag byte, 0 plain or 1 compressed, then the payload length as a big-endian uint32)
  followed by the payload. Messages are split across DATA frames at any byte.
* A compressed message is compressed with the stream's `grpc-encoding` (`identity`, `gzip`
  which is RFC 1952, `deflate` which is the zlib container of RFC 1950); the flag set on a
  stream whose encoding is `identity` is an error. `grpc-accept-encoding` lists the codings a
  peer accepts, comma-separated.
* `grpc-timeout` is 1 to 8 ASCII digits and one unit: `H` hours, `M` minutes, `S` seconds,
  `m` milliseconds, `u` microseconds, `n` nanoseconds.
* A call ends with trailers `grpc-status` (a decimal status, 0 OK to 16 UNAUTHENTICATED) and
  `grpc-message`, percent-encoded: bytes 0x20-0x7E except `%` are sent as they are, any other
  byte of the text's UTF-8 as `%XX`.
* Custom metadata are the other headers. Names are lower-case `[0-9a-z_.-]`; values are
  printable ASCII, except under a name ending in `-bin`, whose value is base64 (sent without
  padding, accepted with or without). `grpc-*` names are reserved to gRPC.

Errors the peer causes are `GrpcProtocolError`: a `RemoteProtocolError` that ends the one
stream (not the connection) with its `grpc_status`; its `code` is the brpc code of that status.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections import deque

from .. import errors
from ..errors import LocalProtocolError, RemoteProtocolError
from . import compress

# gRPC status codes (grpc/include/grpc/status.h; brpc's GrpcStatus in src/brpc/grpc.h).
OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
ALREADY_EXISTS = 6
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
FAILED_PRECONDITION = 9
ABORTED = 10
OUT_OF_RANGE = 11
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
DATA_LOSS = 15
UNAUTHENTICATED = 16

STATUS_NAMES = {
    OK: "OK", CANCELLED: "CANCELLED", UNKNOWN: "UNKNOWN", INVALID_ARGUMENT: "INVALID_ARGUMENT",
    DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED", NOT_FOUND: "NOT_FOUND", ALREADY_EXISTS: "ALREADY_EXISTS",
    PERMISSION_DENIED: "PERMISSION_DENIED", RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
    FAILED_PRECONDITION: "FAILED_PRECONDITION", ABORTED: "ABORTED", OUT_OF_RANGE: "OUT_OF_RANGE",
    UNIMPLEMENTED: "UNIMPLEMENTED", INTERNAL: "INTERNAL", UNAVAILABLE: "UNAVAILABLE",
    DATA_LOSS: "DATA_LOSS", UNAUTHENTICATED: "UNAUTHENTICATED",
}

# Linux's EEXIST, which brpc gives ALREADY_EXISTS; aiobrpc.errors does not list it.
EEXIST = 17


class GrpcProtocolError(RemoteProtocolError):
    """The peer sent gRPC data we cannot accept; the stream ends with `grpc_status`.

    `code` is brpc's code for that status (`brpc_code_of`); `fatal` is False because only the
    stream is bad, the HTTP/2 connection carries on.
    """

    def __init__(self, message: str, grpc_status: int = INTERNAL) -> None:
        super().__init__(message, code=brpc_code_of(grpc_status), fatal=False)
        self.grpc_status = grpc_status


# --- status codes -------------------------------------------------------------------------------
# brpc's ErrorCodeToGrpcStatus and GrpcStatusToErrorCode (src/brpc/grpc.cpp). The spec's
# errors.md has no gRPC table (it names the mapping only through server.md: ERPCAUTH is sent as a
# gRPC error), so brpc's source is the reference. Note brpc maps ETIMEDOUT (a connect timeout)
# to INTERNAL, not DEADLINE_EXCEEDED, and reads NOT_FOUND, UNAVAILABLE and UNKNOWN as EINTERNAL.

_GRPC_STATUS_OF_CODE = {
    0: OK,
    errors.ENOSERVICE: UNIMPLEMENTED,
    errors.ENOMETHOD: UNIMPLEMENTED,
    errors.ERPCAUTH: UNAUTHENTICATED,
    errors.EREQUEST: INVALID_ARGUMENT,
    errors.EINVAL: INVALID_ARGUMENT,
    errors.ELIMIT: RESOURCE_EXHAUSTED,
    errors.ELOGOFF: UNAVAILABLE,
    errors.EPERM: PERMISSION_DENIED,
    errors.ERPCTIMEDOUT: DEADLINE_EXCEEDED,
    errors.ETIMEDOUT: INTERNAL,
    errors.ECANCELED: CANCELLED,
}

_CODE_OF_GRPC_STATUS = {
    OK: 0,
    CANCELLED: errors.ECANCELED,
    UNKNOWN: errors.EINTERNAL,
    INVALID_ARGUMENT: errors.EINVAL,
    DEADLINE_EXCEEDED: errors.ERPCTIMEDOUT,
    NOT_FOUND: errors.EINTERNAL,
    ALREADY_EXISTS: EEXIST,
    PERMISSION_DENIED: errors.EPERM,
    RESOURCE_EXHAUSTED: errors.ELIMIT,
    FAILED_PRECONDITION: errors.EINTERNAL,
    ABORTED: errors.EINTERNAL,
    OUT_OF_RANGE: errors.EINTERNAL,
    UNIMPLEMENTED: errors.ENOMETHOD,
    INTERNAL: errors.EINTERNAL,
    UNAVAILABLE: errors.EINTERNAL,
    DATA_LOSS: errors.EINTERNAL,
    UNAUTHENTICATED: errors.ERPCAUTH,
}


def grpc_status_of(brpc_code: int) -> int:
    """The gRPC status a call failed with brpc code `brpc_code` ends with (INTERNAL for codes
    brpc does not list, user codes included)."""
    return _GRPC_STATUS_OF_CODE.get(brpc_code, INTERNAL)


def brpc_code_of(grpc_status: int) -> int:
    """The brpc code of a call that ended with `grpc_status` (EINTERNAL for unknown statuses)."""
    return _CODE_OF_GRPC_STATUS.get(grpc_status, errors.EINTERNAL)


# --- length-prefixed messages -------------------------------------------------------------------

PREFIX_SIZE = 5
_MAX_LENGTH = 0xFFFFFFFF


def encode_message(data, compressed: bool) -> list:
    """The buffers of one message: its 5-byte prefix, then `data` itself (not copied).

    >>> encode_message(b"hi", False)
    [b'\\x00\\x00\\x00\\x00\\x02', b'hi']
    """
    length = memoryview(data).nbytes
    if length > _MAX_LENGTH:
        raise LocalProtocolError(f"gRPC message of {length} bytes exceeds the 4 GiB - 1 a prefix can declare")
    return [(b"\x01" if compressed else b"\x00") + length.to_bytes(4, "big"), data]


class MessageDecoder:
    """Splits the DATA of one gRPC stream into messages, fed in pieces of any size.

    >>> d = MessageDecoder(max_message_size=1024)
    >>> d.feed(b"\\x00\\x00\\x00\\x00\\x02h")
    >>> d.feed(b"i\\x01\\x00\\x00")
    >>> [(c, bytes(p)) for c, p in d]
    [(False, b'hi')]
    >>> d.finish()
    Traceback (most recent call last):
    ...
    aiobrpc.protocol.grpc.GrpcProtocolError: stream ended inside a gRPC message prefix (3 of 5 bytes)

    Iterating yields `(compressed, payload)` for each complete message, in order. A payload
    that arrived in one piece is a memoryview of the object fed (not copied: do not reuse that
    object); one that arrived in several is a bytearray. What is held between feeds is at most
    one partial message and one partial prefix; the declared length is checked against
    `max_message_size` before any of the payload is kept. After an error every call raises it
    again.
    """

    __slots__ = ("max_message_size", "_prefix", "_body", "_compressed", "_need", "_ready", "_error")

    def __init__(self, max_message_size: int) -> None:
        self.max_message_size = max_message_size
        self._prefix = bytearray()  # a partial prefix, fewer than 5 bytes
        self._body: bytearray | None = None  # the partial payload, once its prefix is read
        self._compressed = False
        self._need = 0  # payload bytes still missing from _body
        self._ready: deque = deque()  # complete messages not yet iterated, oldest first
        self._error: GrpcProtocolError | None = None

    def feed(self, data) -> None:
        """Take the next bytes of the stream's DATA."""
        if self._error is not None:
            raise self._error
        view = memoryview(data).cast("B")
        pos = 0
        end = len(view)
        while pos < end:
            if self._body is not None:
                take = min(self._need, end - pos)
                self._body += view[pos:pos + take]
                pos += take
                self._need -= take
                if self._need == 0:
                    self._ready.append((self._compressed, self._body))
                    self._body = None
                continue
            if self._prefix or end - pos < PREFIX_SIZE:
                take = min(PREFIX_SIZE - len(self._prefix), end - pos)
                self._prefix += view[pos:pos + take]
                pos += take
                if len(self._prefix) < PREFIX_SIZE:
                    break
                flag, length = self._read_prefix(self._prefix, 0)
                self._prefix.clear()
            else:
                flag, length = self._read_prefix(view, pos)
                pos += PREFIX_SIZE
            self._compressed = flag == 1
            if end - pos >= length:
                self._ready.append((self._compressed, view[pos:pos + length]))
                pos += length
            else:
                self._body = bytearray()
                self._need = length

    def _read_prefix(self, buf, at: int) -> tuple[int, int]:
        flag = buf[at]
        length = int.from_bytes(buf[at + 1:at + PREFIX_SIZE], "big")
        if flag > 1:
            self._fail(f"gRPC message flag byte 0x{flag:02x} is neither 0 (plain) nor 1 (compressed)", INTERNAL)
        if length > self.max_message_size:
            self._fail(f"gRPC message of {length} bytes exceeds max_message_size={self.max_message_size}",
                       RESOURCE_EXHAUSTED)
        return flag, length

    def _fail(self, message: str, grpc_status: int):
        self._error = GrpcProtocolError(message, grpc_status)
        raise self._error

    def __iter__(self):
        ready = self._ready
        while ready:
            yield ready.popleft()

    def finish(self) -> None:
        """The stream ended: raise if it ended inside a message."""
        if self._error is not None:
            raise self._error
        if self._prefix:
            self._fail(f"stream ended inside a gRPC message prefix ({len(self._prefix)} of {PREFIX_SIZE} bytes)",
                       INTERNAL)
        if self._body is not None:
            got = len(self._body)
            self._fail(f"stream ended inside a gRPC message ({got} of {got + self._need} bytes)", INTERNAL)


# --- compression --------------------------------------------------------------------------------

IDENTITY = "identity"
GZIP = "gzip"
DEFLATE = "deflate"  # the zlib container (RFC 1950), as grpc-go and C-core send it

# grpc-encoding <-> brpc's compress types (aiobrpc.protocol.compress); snappy and lz4 have no gRPC name.
COMPRESS_TYPE_OF_ENCODING = {IDENTITY: compress.NONE, GZIP: compress.GZIP, DEFLATE: compress.ZLIB}
ENCODING_OF_COMPRESS_TYPE = {ctype: name for name, ctype in COMPRESS_TYPE_OF_ENCODING.items() if ctype}
ENCODINGS = tuple(COMPRESS_TYPE_OF_ENCODING)
# Our grpc-accept-encoding value, as C-core writes it.
ACCEPT_ENCODING = ",".join(ENCODINGS)


def parse_encoding(value) -> str:
    """The coding a `grpc-encoding` header names (`identity` when the header is absent: None).

    An unsupported coding raises GrpcProtocolError with UNIMPLEMENTED, as the gRPC spec asks:
    the reply should carry our `grpc-accept-encoding` (ACCEPT_ENCODING).
    """
    if value is None:
        return IDENTITY
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value).decode("latin-1")
    name = value.strip().lower()
    if name not in COMPRESS_TYPE_OF_ENCODING:
        raise GrpcProtocolError(f"grpc-encoding {value!r} is not supported ({ACCEPT_ENCODING})", UNIMPLEMENTED)
    return name


def parse_accept_encoding(value) -> tuple[str, ...]:
    """The codings a `grpc-accept-encoding` header lists, lower-cased, in its order (unknown
    ones included; empty items dropped). None (no header) lists nothing."""
    if value is None:
        return ()
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value).decode("latin-1")
    return tuple(item for item in (part.strip().lower() for part in value.split(",")) if item)


def compress_message(encoding: str, data):
    """The payload of `data` compressed with `encoding` (one of ENCODINGS); a bytes-like
    object, `data` itself for identity."""
    ctype = COMPRESS_TYPE_OF_ENCODING.get(encoding)
    if ctype is None:
        raise LocalProtocolError(f"grpc-encoding {encoding!r} is not supported ({ACCEPT_ENCODING})")
    return compress.compress(ctype, data)


def decompress_message(encoding: str, data, max_size: int):
    """The payload of a message whose flag says compressed, inflated to at most `max_size` bytes.

    `encoding` is the stream's (from parse_encoding). A compressed message on an identity
    stream, or corrupt data, raises GrpcProtocolError with INTERNAL; output past `max_size`
    raises it with RESOURCE_EXHAUSTED before more than max_size + 64 KiB is inflated (a gzip
    stream declaring more in its trailer is refused before inflating at all).
    """
    if encoding == IDENTITY:
        raise GrpcProtocolError("gRPC message is flagged compressed but grpc-encoding is identity", INTERNAL)
    ctype = COMPRESS_TYPE_OF_ENCODING.get(encoding)
    if ctype is None:
        raise GrpcProtocolError(f"grpc-encoding {encoding!r} is not supported ({ACCEPT_ENCODING})", UNIMPLEMENTED)
    try:
        return compress.decompress(ctype, data, max_size)
    except RemoteProtocolError as e:
        # compress.py names its size limit in every message about size, and only in those.
        status = RESOURCE_EXHAUSTED if "max_decompressed_size" in str(e) else INTERNAL
        text = str(e).replace("max_decompressed_size", "max_message_size")
        raise GrpcProtocolError(f"grpc-encoding {encoding}: {text}", status) from None


# --- grpc-timeout -------------------------------------------------------------------------------

_TIMEOUT = re.compile(rb"([0-9]{1,8})([HMSmun])")
_NS_PER_UNIT = {b"H": 3600 * 10**9, b"M": 60 * 10**9, b"S": 10**9, b"m": 10**6, b"u": 10**3, b"n": 1}
_MAX_TIMEOUT_VALUE = 10**8 - 1
# Units from the finest, as grpc-go tries them when writing.
_WRITE_UNITS = (("n", 1), ("u", 10**3), ("m", 10**6), ("S", 10**9), ("M", 60 * 10**9), ("H", 3600 * 10**9))


def parse_timeout_ns(value) -> int:
    """Nanoseconds of a `grpc-timeout` value (str or bytes); anything but 1-8 ASCII digits and
    one of H M S m u n raises GrpcProtocolError."""
    raw = value.encode("latin-1", "replace") if isinstance(value, str) else bytes(value)
    m = _TIMEOUT.fullmatch(raw)
    if m is None:
        raise GrpcProtocolError(f"grpc-timeout {value!r} is not 1-8 digits and a unit (H M S m u n)", INTERNAL)
    return int(m.group(1)) * _NS_PER_UNIT[m.group(2)]


def parse_timeout(value) -> float:
    """Seconds of a `grpc-timeout` value (see parse_timeout_ns)."""
    return parse_timeout_ns(value) / 1e9


def parse_timeout_ms(value) -> int:
    """Whole milliseconds of a `grpc-timeout` value, rounded up, so at least 1 for any timeout
    (brpc's timeout_ms takes 0 to mean none; brpc itself rounds "1n" up to 1 microsecond)."""
    ns = parse_timeout_ns(value)
    return max(1, -(-ns // 10**6))


def format_timeout(seconds: float) -> str:
    """A `grpc-timeout` value for `seconds` left, as grpc-go writes it: the finest unit whose
    count fits in 8 digits, rounded up so the peer's deadline is never earlier than ours.
    Nothing left (0 or less) is "0n".

    >>> format_timeout(1.5), format_timeout(0.1), format_timeout(3600.0)
    ('1500000u', '100000u', '3600000m')
    """
    return format_timeout_ns(math.ceil(seconds * 1e9) if seconds > 0 else 0)


def format_timeout_ns(ns: int) -> str:
    """format_timeout for a whole number of nanoseconds."""
    if ns <= 0:
        return "0n"
    for unit, size in _WRITE_UNITS:
        count = -(-ns // size)
        if count <= _MAX_TIMEOUT_VALUE:
            return f"{count}{unit}"
    return f"{_MAX_TIMEOUT_VALUE}H"  # past 11 000 years: the most the header can say


# --- grpc-message -------------------------------------------------------------------------------

_HEX = "0123456789ABCDEF"
_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")


def encode_grpc_message(text: str) -> str:
    """`text` percent-encoded for `grpc-message`: bytes 0x20-0x7E except '%' as they are, any
    other byte of its UTF-8 as %XX (upper-case hex, as grpc-go writes it)."""
    if text.isascii() and text.isprintable() and "%" not in text:
        return text  # the common case: nothing to escape
    out = []
    for byte in text.encode("utf-8", "surrogatepass"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(chr(byte))
        else:
            out.append("%" + _HEX[byte >> 4] + _HEX[byte & 15])
    return "".join(out)


def decode_grpc_message(value) -> str:
    """The text of a `grpc-message` value (str or bytes): each %XX becomes its byte, and a '%'
    not followed by two hex digits stays as it is; bytes that are not UTF-8 become U+FFFD.
    Never raises: a status message is never lost for being malformed."""
    raw = value.encode("latin-1", "replace") if isinstance(value, str) else bytes(value)
    if b"%" in raw:
        raw = _ESCAPE.sub(lambda m: bytes((int(m.group(1), 16),)), raw)
    return raw.decode("utf-8", "replace")


# --- metadata -----------------------------------------------------------------------------------

# Headers that are HTTP/2's or gRPC's own, never user fields: pseudo-headers (':...') and
# 'grpc-...' are reserved by prefix; the rest are the gRPC spec's call definition headers
# and those HTTP/2 forbids (RFC 9113 8.2.2).
RESERVED_HEADERS = frozenset((
    "content-type", "te", "user-agent", "content-length", "host",
    "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade",
))
_NAME = re.compile(r"[0-9a-z_.\-]+")
_ASCII_VALUE = re.compile(r"[\x20-\x7e]*")


def _is_reserved(name: str) -> bool:
    return name.startswith((":", "grpc-")) or name in RESERVED_HEADERS


def user_fields_of_headers(headers) -> dict:
    """The user fields in a gRPC header or trailer block: (name, value) pairs as h2 gives them
    (str or bytes).

    Reserved headers (pseudo-headers, `grpc-*`, RESERVED_HEADERS) are skipped. Names are
    lower-cased. A value under a `-bin` name is base64-decoded (padded or not) to bytes; any
    other value is a str (bytes outside ASCII read as Latin-1, so nothing is lost). A name
    sent more than once keeps its values joined with "," (RFC 9110 5.3), except a `-bin` name,
    which keeps its last value (comma-separated `-bin` values too). Base64 that does not decode
    raises GrpcProtocolError naming the header.
    """
    fields: dict = {}
    for name, value in headers:
        if not isinstance(name, str):
            name = bytes(name).decode("latin-1")
        name = name.lower()
        if _is_reserved(name):
            continue
        if not isinstance(value, str):
            value = bytes(value).decode("latin-1")
        if name.endswith("-bin"):
            fields[name] = _b64decode(name, value.rpartition(",")[2].strip())
        elif name in fields:
            fields[name] = f"{fields[name]},{value}"
        else:
            fields[name] = value
    return fields


def _b64decode(name: str, value: str) -> bytes:
    try:
        return base64.b64decode(value + "=" * (-len(value) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise GrpcProtocolError(f"metadata {name!r}: value {value[:64]!r} is not base64", INTERNAL) from None


def headers_of_user_fields(fields) -> list[tuple[str, str]]:
    """(name, value) header pairs for a dict of user fields, names lower-cased.

    A bytes-like value must be under a name ending in `-bin`; a str under such a name is sent
    as its UTF-8 bytes. `-bin` values go as base64 without padding (the peer reads them back as
    bytes); other values must be printable ASCII with no surrounding space. A name that is not
    `[0-9a-z_.-]` after lower-casing, is reserved (pseudo-headers, `grpc-*`, RESERVED_HEADERS),
    or a value that breaks these rules raises ValueError naming it.
    """
    out = []
    for name, value in fields.items():
        if not isinstance(name, str) or not _NAME.fullmatch(lowered := name.lower()):
            raise ValueError(f"user field name {name!r} is not a valid gRPC metadata name ([0-9a-z_.-])")
        if _is_reserved(lowered):
            raise ValueError(f"user field name {name!r} is reserved for HTTP/2 or gRPC")
        if lowered.endswith("-bin"):
            if isinstance(value, str):
                value = value.encode("utf-8")
            elif not isinstance(value, (bytes, bytearray, memoryview)):
                raise ValueError(f"user field {name!r}: value must be str or bytes, got {type(value).__name__}")
            out.append((lowered, base64.b64encode(value).decode("ascii").rstrip("=")))
            continue
        if not isinstance(value, str):
            raise ValueError(f"user field {name!r}: a {type(value).__name__} value needs a name ending in -bin")
        if not _ASCII_VALUE.fullmatch(value) or value != value.strip(" "):
            raise ValueError(f"user field {name!r}: value {value!r} is not printable ASCII without surrounding space")
        out.append((lowered, value))
    return out
