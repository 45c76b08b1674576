"""baidu_std framing, pure-Python twin of `framing.pyx`.

The 12-byte header shared by PRPC and STRM frames (brpc's docs/en/baidu_std.md):
magic (4 bytes), body_size and meta_size (u32 big-endian). `FrameReader` owns a ReadBuffer,
is fed by the kernel through get_buffer/buffer_updated (or by `feed`), and cuts complete
frames out of it as (kind, meta view, payload view). `split_payload` cuts a payload into data
and attachment, copying a small attachment out of the buffer it would otherwise keep alive.

Stricter than C++ brpc where docs/hostile_inputs.md says so: an unknown magic is rejected as soon
as the first bytes cannot be PRPC or STRM (A1), and meta_size > body_size closes the
connection instead of silently dropping the frame (A6).
"""

from __future__ import annotations

from ..errors import LocalProtocolError, RemoteProtocolError
from .iobuf import DEFAULT_BLOCK_SIZE, DEFAULT_LARGE_THRESHOLD, HEADER_SIZE, ReadBuffer

KIND_PRPC = 1
KIND_STRM = 2
MAGIC_PRPC = b"PRPC"
MAGIC_STRM = b"STRM"
DEFAULT_MAX_BODY_SIZE = 64 * 1024 * 1024
# A received attachment stays a view of its frame's buffer only while that buffer is at most
# this many times its size; a smaller one is copied out (see split_payload).
ATTACHMENT_PIN_RATIO = 4


def parse_header(buf) -> tuple[int, int, int]:
    """(kind, body_size, meta_size) of a 12-byte header; kind is 0 for an unknown magic."""
    if len(buf) < HEADER_SIZE:
        raise LocalProtocolError(f"a header is {HEADER_SIZE} bytes, got {len(buf)}")
    magic = bytes(buf[0:4])
    kind = KIND_PRPC if magic == MAGIC_PRPC else KIND_STRM if magic == MAGIC_STRM else 0
    return kind, int.from_bytes(buf[4:8], "big"), int.from_bytes(buf[8:12], "big")


def pack_header(magic: bytes, body_size: int, meta_size: int) -> bytes:
    if not 0 <= meta_size <= body_size <= 0xFFFFFFFF:
        raise LocalProtocolError(f"invalid sizes body_size={body_size} meta_size={meta_size}")
    return magic + body_size.to_bytes(4, "big") + meta_size.to_bytes(4, "big")


def split_payload(payload: memoryview, attachment_size: int) -> tuple[memoryview, memoryview]:
    """(data, attachment) of a frame's payload view whose last `attachment_size` bytes are the
    attachment.

    The data is a view (it is parsed and dropped within the call). The attachment outlives the
    call when the user keeps it, and a view keeps the whole buffer under it alive: the shared
    block that small frames land in, or a large frame's own buffer, data included. So the
    attachment is a view only when that buffer (`payload.obj`) is at most ATTACHMENT_PIN_RATIO
    times its size; otherwise it is copied into a bytearray of its own, and a writable
    memoryview of that is returned either way. A kept attachment thus holds at most 4x its
    size: with the default 256 KiB block, one under 64 KiB received there is copied, and one
    that is most of a large frame's own buffer is not.
    """
    size = len(payload)
    if not 0 <= attachment_size <= size:
        raise LocalProtocolError(
            f"attachment_size={attachment_size} is outside a payload of {size} bytes")
    cut = size - attachment_size
    attachment = payload[cut:]
    if attachment_size * ATTACHMENT_PIN_RATIO < len(payload.obj):
        attachment = memoryview(bytearray(attachment))
    return payload[:cut], attachment


def magic_prefix_ok(buf) -> bool:
    """Can these first bytes (any length) still be the start of a PRPC or STRM frame?"""
    n = min(len(buf), 4)
    head = bytes(buf[:n])
    return MAGIC_PRPC[:n] == head or MAGIC_STRM[:n] == head


class FrameReader:
    """Cuts PRPC/STRM frames out of received bytes.

    `next_frame()` returns (kind, meta, payload) as memoryviews, or None when more bytes are
    needed. A framing violation raises a fatal RemoteProtocolError: the connection must close.
    """

    __slots__ = ("rbuf", "max_body_size", "frames")

    def __init__(self, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
                 block_size: int = DEFAULT_BLOCK_SIZE,
                 large_threshold: int = DEFAULT_LARGE_THRESHOLD) -> None:
        if not 0 < max_body_size <= 0xFFFFFFFF:
            raise LocalProtocolError(f"max_body_size must be in 1..4294967295, got {max_body_size}")
        self.rbuf = ReadBuffer(block_size, large_threshold)
        self.max_body_size = max_body_size
        self.frames = 0

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        rbuf = self.rbuf
        if rbuf.available() >= HEADER_SIZE and not rbuf.large_pending():
            # A large frame whose header is already here gets its own buffer before the
            # kernel reads more (next_frame reports any framing error).
            kind, body_size, meta_size = parse_header(rbuf.peek(HEADER_SIZE))
            total = HEADER_SIZE + body_size
            if (kind and meta_size <= body_size <= self.max_body_size
                    and total > rbuf.large_threshold and rbuf.available() < total):
                rbuf.begin_large(total)
        return rbuf.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.rbuf.buffer_updated(nbytes)

    def feed(self, data) -> None:
        """Copy `data` in as if the kernel had read it (tests and non-buffered transports)."""
        mv = memoryview(data).cast("B")
        pos, n = 0, mv.nbytes
        while pos < n:
            buf = self.get_buffer(n - pos)
            k = min(len(buf), n - pos)
            buf[:k] = mv[pos:pos + k]
            self.buffer_updated(k)
            pos += k

    def pending_bytes(self) -> int:
        return self.rbuf.pending_bytes()

    def next_frame(self):
        rbuf = self.rbuf
        if rbuf.large_pending():
            frame = rbuf.take_large()
            if frame is None:
                return None
            return self._split(frame)
        have = rbuf.available()
        if have < HEADER_SIZE:
            if have and not magic_prefix_ok(rbuf.peek(have)):
                raise self._bad_magic(rbuf.peek(have))
            return None
        kind, body_size, meta_size = parse_header(rbuf.peek(HEADER_SIZE))
        if kind == 0:
            raise self._bad_magic(rbuf.peek(min(have, 32)))
        if body_size > self.max_body_size:
            raise RemoteProtocolError(
                f"body_size={body_size} exceeds max_body_size={self.max_body_size}", fatal=True)
        if meta_size > body_size:
            raise RemoteProtocolError(
                f"meta_size={meta_size} is larger than body_size={body_size}", fatal=True)
        total = HEADER_SIZE + body_size
        if have >= total:
            return self._split(rbuf.take(total))
        if total > rbuf.large_threshold:
            rbuf.begin_large(total)
        return None

    def _split(self, frame: memoryview):
        self.frames += 1
        kind = KIND_PRPC if frame[0] == 0x50 else KIND_STRM
        meta_end = HEADER_SIZE + int.from_bytes(frame[8:12], "big")
        return kind, frame[HEADER_SIZE:meta_end], frame[meta_end:]

    @staticmethod
    def _bad_magic(head) -> RemoteProtocolError:
        return RemoteProtocolError(f"unknown protocol: first bytes {bytes(head).hex()}", fatal=True)
