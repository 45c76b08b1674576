"""brpc's streaming protocol, sans-IO (brpc's src/brpc/policy/streaming_rpc_protocol.cpp, stream.cpp).

A stream is carried in STRM frames on the connection of the call that created it: the same
12-byte header as PRPC (magic "STRM", body_size, meta_size), a `StreamFrameMeta`, and for
DATA frames the message bytes. In every frame `stream_id` is the receiver's id and
`source_stream_id` the sender's (absent in RST). Frame metas are encoded by hand, in the field
order and with the fields C++ writes, so frames are byte-identical to brpc's:

    DATA      1, 2, 3, 4 (has_continuation always written)   payload: message bytes
    FEEDBACK  1, 2, 3, 5 {consumed_size}                      no payload
    CLOSE     1, 2, 3                                         no payload
    RST       1, 3                                            no payload

>>> rst_frame(7).hex()
'5354524d000000040000000408071801'
>>> decode_frame_meta(bytes.fromhex("080110071802")).frame_type == CLOSE
True
"""

from __future__ import annotations

import mmap
import sys

from google.protobuf.message import DecodeError

from .. import _fast
from .._proto import brpc_streaming_pb2
from ..errors import LocalProtocolError, RemoteProtocolError

MAGIC = b"STRM"
UNKNOWN, RST, CLOSE, DATA, FEEDBACK = 0, 1, 2, 3, 4
FRAME_TYPE_NAMES = {UNKNOWN: "UNKNOWN", RST: "RST", CLOSE: "CLOSE", DATA: "DATA", FEEDBACK: "FEEDBACK"}
INVALID_STREAM_ID = -1  # brpc's INVALID_STREAM_ID (all ones as uint64)
DEFAULT_MAX_BUF_SIZE = 2 * 1024 * 1024
DEFAULT_MESSAGES_IN_BATCH = 128
# Messages larger than this go as several DATA frames (has_continuation), so that one large
# message neither holds the connection against other streams and calls nor makes a frame
# larger than a receiver's max_body_size. C++ brpc cuts at 512 MiB (-stream_write_max_segment_size);
# every brpc that knows has_continuation reassembles whatever the cut.
DEFAULT_MAX_SEGMENT_SIZE = 1024 * 1024

_U64 = (1 << 64) - 1
_SMALL_SEGMENT = 64 * 1024  # received into the shared block, not a buffer of its own
_Settings = brpc_streaming_pb2.StreamSettings
_FrameMeta = brpc_streaming_pb2.StreamFrameMeta


def _varint(n: int) -> bytes:
    n &= _U64  # int64: negative values are 10-byte varints, as protobuf writes them
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _header(body_size: int, meta_size: int) -> bytes:
    return MAGIC + body_size.to_bytes(4, "big") + meta_size.to_bytes(4, "big")


# -- frame metas --------------------------------------------------------------------------------

def data_meta(stream_id: int, source_stream_id: int, has_continuation: bool = False) -> bytes:
    """The StreamFrameMeta of a DATA frame."""
    return (b"\x08" + _varint(stream_id) + b"\x10" + _varint(source_stream_id)
            + (b"\x18\x03\x20\x01" if has_continuation else b"\x18\x03\x20\x00"))


def feedback_meta(stream_id: int, source_stream_id: int, consumed_size: int) -> bytes:
    fb = b"\x08" + _varint(consumed_size)
    return (b"\x08" + _varint(stream_id) + b"\x10" + _varint(source_stream_id) + b"\x18\x04\x2a"
            + _varint(len(fb)) + fb)


def feedback_meta_prefix(stream_id: int, source_stream_id: int) -> bytes:
    """What every FEEDBACK meta of one stream starts with (see feedback_frame_from)."""
    return b"\x08" + _varint(stream_id) + b"\x10" + _varint(source_stream_id) + b"\x18\x04\x2a"


def close_meta(stream_id: int, source_stream_id: int) -> bytes:
    return b"\x08" + _varint(stream_id) + b"\x10" + _varint(source_stream_id) + b"\x18\x02"


def rst_meta(stream_id: int) -> bytes:
    return b"\x08" + _varint(stream_id) + b"\x18\x01"


# -- whole frames ------------------------------------------------------------------------------

def meta_only_frame(meta: bytes) -> bytes:
    """A frame of `meta` and no payload (FEEDBACK, CLOSE, RST)."""
    n = len(meta)
    return _header(n, n) + meta


def feedback_frame(stream_id: int, source_stream_id: int, consumed_size: int) -> bytes:
    return meta_only_frame(feedback_meta(stream_id, source_stream_id, consumed_size))


def feedback_frame_from(prefix: bytes, consumed_size: int) -> bytes:
    """feedback_frame(), from the stream's feedback_meta_prefix: only the count is encoded."""
    fb = _varint(consumed_size)
    n = len(prefix) + 2 + len(fb)
    size = n.to_bytes(4, "big")
    return MAGIC + size + size + prefix + bytes((len(fb) + 1, 0x08)) + fb


def close_frame(stream_id: int, source_stream_id: int) -> bytes:
    return meta_only_frame(close_meta(stream_id, source_stream_id))


def rst_frame(stream_id: int) -> bytes:
    return meta_only_frame(rst_meta(stream_id))


def data_head(meta: bytes, data_size: int) -> bytes:
    """Header and meta of a DATA frame carrying `data_size` bytes."""
    n = len(meta)
    body = n + data_size
    if body > 0xFFFFFFFF:
        raise LocalProtocolError(f"a DATA frame of {data_size} bytes does not fit the 32-bit body_size")
    return _header(body, n) + meta


def data_frames(stream_id: int, source_stream_id: int, message,
                max_segment_size: int = DEFAULT_MAX_SEGMENT_SIZE) -> list:
    """The DATA frames of one message as a list of buffers: (head, payload view) per segment.

    `message` is any C-contiguous buffer, referenced, never copied. Segments of
    `max_segment_size` bytes carry has_continuation, the last one does not.
    """
    view = message_view(message)
    return segments(view, view.nbytes, data_meta(stream_id, source_stream_id, False),
                    data_meta(stream_id, source_stream_id, True), max_segment_size)


def segments(view: memoryview, size: int, last_meta: bytes, more_meta: bytes, max_segment_size: int) -> list:
    """`view` (of `size` bytes) cut into DATA frames: head, payload, head, payload, ..."""
    if max_segment_size <= 0:
        raise LocalProtocolError(f"max_segment_size must be > 0, got {max_segment_size}")
    if size <= max_segment_size:
        return [data_head(last_meta, size), view] if size else [data_head(last_meta, 0)]
    out = []
    more = data_head(more_meta, max_segment_size)
    for start in range(0, size, max_segment_size):
        end = start + max_segment_size
        if end >= size:
            out.append(data_head(last_meta, size - start))
            out.append(view[start:])
        else:
            out.append(more)
            out.append(view[start:end])
    return out


def message_view(message) -> memoryview:
    """A flat byte view of any C-contiguous buffer (bytes, bytearray, memoryview, numpy array)."""
    try:
        view = message if type(message) is memoryview else memoryview(message)
    except TypeError:
        raise TypeError(f"a stream message must be a buffer (bytes, bytearray, memoryview, "
                        f"an array), got {type(message).__name__}") from None
    if view.ndim != 1 or view.itemsize != 1 or view.format != "B":
        if not view.c_contiguous:
            raise ValueError("a stream message must be a C-contiguous buffer: send "
                             "np.ascontiguousarray(a) for a strided array")
        view = view.cast("B")
    elif not view.c_contiguous:
        raise ValueError("a stream message must be a C-contiguous buffer")
    return view


def wrap(stream_id: int, source_stream_id: int, bufs: list, nbytes: int) -> list:
    """A PRPC frame (`bufs`, `nbytes` long) inside one STRM DATA frame: how a server answers a
    call that offered streams."""
    return [data_head(data_meta(stream_id, source_stream_id, False), nbytes), *bufs]


# -- decoding ------------------------------------------------------------------------------------

class FrameMeta:
    """A decoded StreamFrameMeta. `source_stream_id` and `consumed_size` are None when absent;
    `frame_type` is UNKNOWN (0) when absent or not one of brpc's (protobuf keeps an unknown
    enum value as an unknown field)."""

    __slots__ = ("stream_id", "source_stream_id", "frame_type", "has_continuation", "consumed_size")

    def __init__(self, stream_id: int, source_stream_id, frame_type: int, has_continuation: bool,
                 consumed_size) -> None:
        self.stream_id = stream_id
        self.source_stream_id = source_stream_id
        self.frame_type = frame_type
        self.has_continuation = has_continuation
        self.consumed_size = consumed_size

    def __repr__(self) -> str:
        return (f"FrameMeta(stream_id={self.stream_id}, source_stream_id={self.source_stream_id}, "
                f"{FRAME_TYPE_NAMES.get(self.frame_type, self.frame_type)}, "
                f"has_continuation={self.has_continuation}, consumed_size={self.consumed_size})")


def decode_frame_meta(buf) -> FrameMeta:
    """Parse a StreamFrameMeta; RemoteProtocolError(fatal=False) when it is not one (only that
    frame is bad: the framing around it held)."""
    try:
        m = _FrameMeta.FromString(buf)
    except DecodeError as e:
        raise RemoteProtocolError(f"unparsable StreamFrameMeta ({e})", fatal=False) from None
    if not m.HasField("stream_id"):
        raise RemoteProtocolError("StreamFrameMeta without its required stream_id", fatal=False)
    ftype = m.frame_type if m.HasField("frame_type") else UNKNOWN
    consumed = None
    if m.HasField("feedback"):
        consumed = m.feedback.consumed_size
    return FrameMeta(m.stream_id, m.source_stream_id if m.HasField("source_stream_id") else None,
                     ftype, m.has_continuation, consumed)


# -- StreamSettings (RpcMeta field 8) --------------------------------------------------------------

class Settings:
    """A decoded StreamSettings: the sender's first stream id, the ids of its other streams,
    whether it wants FEEDBACK (it has a finite window) and whether it reads (writable)."""

    __slots__ = ("stream_id", "need_feedback", "writable", "extra_stream_ids")

    def __init__(self, stream_id: int, need_feedback: bool, writable: bool, extra_stream_ids=()) -> None:
        self.stream_id = stream_id
        self.need_feedback = need_feedback
        self.writable = writable
        self.extra_stream_ids = list(extra_stream_ids)

    @property
    def stream_ids(self) -> list:
        return [self.stream_id, *self.extra_stream_ids]

    def __repr__(self) -> str:
        return (f"Settings(stream_id={self.stream_id}, need_feedback={self.need_feedback}, "
                f"writable={self.writable}, extra_stream_ids={self.extra_stream_ids})")


def encode_settings(stream_id: int, need_feedback: bool, writable: bool, extra_stream_ids=()) -> bytes:
    """StreamSettings as C++ writes it: fields 1, 2, 3 always, then one field 4 per extra id."""
    out = (b"\x08" + _varint(stream_id) + (b"\x10\x01" if need_feedback else b"\x10\x00")
           + (b"\x18\x01" if writable else b"\x18\x00"))
    for sid in extra_stream_ids:
        out += b"\x20" + _varint(sid)
    return out


def decode_settings(buf) -> Settings:
    """Parse StreamSettings; RemoteProtocolError(fatal=False) when it is not one."""
    try:
        s = _Settings.FromString(bytes(buf))
    except DecodeError as e:
        raise RemoteProtocolError(f"unparsable StreamSettings ({e})", fatal=False) from None
    if not s.HasField("stream_id"):
        raise RemoteProtocolError("StreamSettings without its required stream_id", fatal=False)
    return Settings(s.stream_id, s.need_feedback, s.writable, s.extra_stream_ids)


class Reassembly:
    """The segments of one message received so far on one stream, capped at `max_size` bytes.

    `add(payload, has_continuation)` returns the whole message when it is complete, else None;
    RemoteProtocolError(fatal=False) once the message would pass `max_size` (the buffered
    segments are dropped then).

    Segments are kept as they came and joined once, at the end, with one copy; or, when the
    connection's decoder asks `place(n)` where the next segment goes, they are received by
    the kernel straight into one buffer for the whole message (no copy): an anonymous mmap of
    `max_size` bytes, whose pages exist only where bytes were written, reused for later
    messages once no view of the last one is alive (`MappedBuffers`).
    """

    __slots__ = ("parts", "size", "max_size", "target", "placed", "touched")

    def __init__(self, max_size: int) -> None:
        self.parts: list = []
        self.size = 0
        self.max_size = max_size
        self.target: mmap.mmap | None = None  # where the message is assembled, once placing
        self.placed = 0  # size of the segment being received into target now
        self.touched = 0  # bytes of target's pages that exist (written by an earlier message)

    @property
    def busy(self) -> bool:
        """Whether a message is in progress (some of its segments received)."""
        return bool(self.parts) or self.target is not None

    def place(self, n: int) -> memoryview | None:
        """Where the next segment, `n` bytes, is to be received; None: as usual."""
        size = self.size + n
        if size > self.max_size or self.placed:
            return None  # add() reports a message too large
        target = self.target
        if target is None:
            target, self.touched = mapped_buffers.take(self.max_size)
            self.target = target
            _copy_parts(target, self.parts)  # what came before, received as usual
            self.parts = []
        self.placed = n
        return memoryview(target)[self.size:size]

    def add(self, payload, has_continuation: bool):
        target = self.target
        parts = self.parts
        if target is None and not parts and not has_continuation:
            return payload
        n = len(payload)
        size = self.size + n
        if size > self.max_size:
            self.clear()
            raise RemoteProtocolError(f"a stream message passed max_body_size={self.max_size} "
                                      f"({size} bytes received of it so far)", fatal=False)
        if target is not None:
            if self.placed and n == self.placed and getattr(payload, "obj", None) is target:
                self.placed = 0  # received in its place
            else:
                self.placed = 0
                target[self.size:size] = payload
            self.size = size
            if has_continuation:
                return None
            self.target = None
            self.size = 0
            mapped_buffers.put(target, max(self.touched, size))
            return memoryview(target)[:size]
        if n > _SMALL_SEGMENT:
            parts.append(payload)
        elif parts and type(parts[-1]) is bytearray:
            parts[-1] += payload  # tiny segments cost their bytes, not an object (or a receive block) each
        else:
            parts.append(bytearray(payload))
        self.size = size
        if has_continuation:
            return None
        # Into a buffer of this size whose last message nobody holds any more (its pages are
        # already faulted in), else a new one; either way one copy.
        large_buffers = _fast.large_buffers
        buf = large_buffers.take(size) if size > _SMALL_SEGMENT else None
        if buf is None:
            buf = bytearray().join(parts)
        else:
            _copy_parts(buf, parts)
        if size > _SMALL_SEGMENT:
            large_buffers.put(buf)
        self.clear()
        return memoryview(buf)

    def clear(self) -> None:
        self.parts = []
        self.size = 0
        self.placed = 0
        if self.target is not None:
            mapped_buffers.put(self.target, max(self.touched, self.size))
            self.target = None


def _copy_parts(dest, parts: list) -> None:
    """The parts one after the other at the start of `dest`."""
    pos = 0
    for part in parts:
        n = len(part)
        dest[pos:pos + n] = part
        pos += n


class MappedBuffers:
    """Anonymous mmaps for whole stream messages, reused once nothing views them (their pages
    are then faulted in already). Kept: at most `max_buffers` maps whose written pages come to
    at most `max_bytes`, oldest out first (a map's untouched pages cost no memory; one that
    leaves is unmapped once its last message is dropped)."""

    def __init__(self, max_buffers: int = 4, max_bytes: int = 64 << 20) -> None:
        self._maps: list = []  # [map, bytes of it written so far]
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes

    def take(self, size: int) -> tuple[mmap.mmap, int]:
        """A map of `size` bytes nothing views, or a new one; and how much of it is written."""
        maps = self._maps
        for i in range(len(maps)):
            m = maps[i][0]
            # references: the list's pair, `m`, getrefcount's argument; any view holds one more
            if len(m) == size and sys.getrefcount(m) == 3:
                return m, maps.pop(i)[1]
        return mmap.mmap(-1, size), 0

    def put(self, m: mmap.mmap, touched: int) -> None:
        if touched > self.max_bytes:
            return  # more than the cap on its own: not kept
        maps = self._maps
        maps.append([m, touched])
        while len(maps) > self.max_buffers or sum(t for _, t in maps) > self.max_bytes:
            del maps[0]

    def nbytes(self) -> int:
        """Bytes of the kept maps' pages that exist."""
        return sum(t for _, t in self._maps)

    def __len__(self) -> int:
        return len(self._maps)


mapped_buffers = MappedBuffers()
