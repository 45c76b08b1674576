"""baidu_std framing: one source, compiled by Cython (pure-Python mode, types in framing.pxd)
or run as Python (aiobrpc/_compiled.py chooses, once per process).

The 12-byte header shared by PRPC and STRM frames (brpc's docs/en/baidu_std.md):
magic (4 bytes), body_size and meta_size (u32 big-endian). `FrameReader` owns a ReadBuffer,
is fed by the kernel through get_buffer/buffer_updated (or by `feed`), and cuts complete
frames out of it as (kind, meta view, payload view). `split_payload` cuts a payload into data
and attachment, copying a small attachment out of the buffer it would otherwise keep alive.

Stricter than C++ brpc where docs/hostile_inputs.md says so: an unknown magic is rejected as soon
as the first bytes cannot be PRPC or STRM (A1), and meta_size > body_size closes the
connection instead of silently dropping the frame (A6).

Compiled, the header is read in C from the ReadBuffer's block (its fields are C struct
members), and sizes are uint32 from the wire held in 64-bit ints, so nothing near 2**32 wraps. The
public functions have a C path under `if cython.compiled:` for the inputs the call path gives
them (a flat buffer, exact ints); anything else, and every input in the Python build, takes
the Python code after it.
"""

from __future__ import annotations

try:
    import cython
except ImportError:  # the pure build runs without Cython
    from .. import _cython_shim as cython

from ..errors import LocalProtocolError, RemoteProtocolError
from .iobuf import DEFAULT_BLOCK_SIZE, DEFAULT_LARGE_THRESHOLD, HEADER_SIZE, ReadBuffer

if not cython.compiled:  # compiled, framing.pxd cimports them from iobuf's C API
    from .iobuf import _narrow, _view_len

KIND_PRPC = 1
KIND_STRM = 2
MAGIC_PRPC = b"PRPC"
MAGIC_STRM = b"STRM"
DEFAULT_MAX_BODY_SIZE = 64 * 1024 * 1024
# A received attachment stays a view of its frame's buffer only while that buffer is at most
# this many times its size; a smaller one is copied out (see split_payload).
ATTACHMENT_PIN_RATIO = 4
_HEADER = HEADER_SIZE  # C constants when compiled
_PIN_RATIO = ATTACHMENT_PIN_RATIO
_U32_MAX = 0xFFFFFFFF  # Cython compares ints past 2**31 as Python objects, C variables in C


def _kind_at(block: bytearray, at: int) -> int:
    """KIND_PRPC, KIND_STRM, or 0 for an unknown magic, of the 4 bytes at block[at:]."""
    if cython.compiled:
        p = cython.cast(cython.p_uchar, PyByteArray_AS_STRING(block)) + at
        if memcmp(p, b"PRPC", 4) == 0:
            return 1
        if memcmp(p, b"STRM", 4) == 0:
            return 2
        return 0
    else:
        magic = block[at:at + 4]
        return KIND_PRPC if magic == MAGIC_PRPC else KIND_STRM if magic == MAGIC_STRM else 0


def _u32_at(block: bytearray, at: int) -> int:
    """The big-endian uint32 at block[at:]."""
    if cython.compiled:
        return get_u32(cython.cast(cython.p_uchar, PyByteArray_AS_STRING(block)) + at)
    else:
        return int.from_bytes(block[at:at + 4], "big")


def _prefix_ok_at(block: bytearray, at: int, n: int) -> bool:
    """Can the n (< 12) bytes at block[at:] still be the start of a PRPC or STRM frame?"""
    if n > 4:
        n = 4
    if cython.compiled:
        p = cython.cast(cython.p_uchar, PyByteArray_AS_STRING(block)) + at
        return (memcmp(p, b"PRPC", cython.cast(cython.size_t, n)) == 0
                or memcmp(p, b"STRM", cython.cast(cython.size_t, n)) == 0)
    else:
        head = bytes(block[at:at + n])
        return MAGIC_PRPC[:n] == head or MAGIC_STRM[:n] == head


def _subview(base, start: int, n: int) -> memoryview:
    """A new view of base[start:start + n] (a block or frame stays exported while it lives)."""
    if cython.compiled:
        return _narrow(PyMemoryView_FromObject(base), start, n)
    else:
        return _narrow(memoryview(base), start, n)


def _bad_magic(head) -> RemoteProtocolError:
    return RemoteProtocolError(f"unknown protocol: first bytes {bytes(head).hex()}", fatal=True)


def parse_header(buf) -> tuple[int, int, int]:
    """(kind, body_size, meta_size) of a 12-byte header; kind is 0 for an unknown magic."""
    if cython.compiled:
        if acquire_bytes(buf, cython.address(view)) is not None:
            try:
                if view.len < _HEADER:
                    raise LocalProtocolError(f"a header is {HEADER_SIZE} bytes, got {view.len}")
                p = cython.cast(cython.p_uchar, view.buf)
                kind = 1 if memcmp(p, b"PRPC", 4) == 0 else 2 if memcmp(p, b"STRM", 4) == 0 else 0
                return kind, get_u32(p + 4), get_u32(p + 8)
            finally:
                PyBuffer_Release(cython.address(view))
    if len(buf) < HEADER_SIZE:
        raise LocalProtocolError(f"a header is {HEADER_SIZE} bytes, got {len(buf)}")
    magic = bytes(buf[0:4])
    kind = KIND_PRPC if magic == MAGIC_PRPC else KIND_STRM if magic == MAGIC_STRM else 0
    return kind, int.from_bytes(buf[4:8], "big"), int.from_bytes(buf[8:12], "big")


def pack_header(magic: bytes, body_size: int, meta_size: int) -> bytes:
    if cython.compiled:
        if type(magic) is bytes and PyLong_Check(body_size) and PyLong_Check(meta_size):
            body = PyLong_AsLongLongAndOverflow(body_size, cython.address(o1))
            meta = PyLong_AsLongLongAndOverflow(meta_size, cython.address(o2))
            if o1 or o2 or meta < 0 or meta > body or body > _U32_MAX:
                raise LocalProtocolError(f"invalid sizes body_size={body_size} meta_size={meta_size}")
            n = len(cython.cast(bytes, magic))
            result = PyBytes_FromStringAndSize(cython.NULL, n + 8)
            out = cython.cast(cython.p_uchar, PyBytes_AS_STRING(result))
            memcpy(out, PyBytes_AS_STRING(magic), cython.cast(cython.size_t, n))
            put_u32(out + n, cython.cast(cython.uint, body))
            put_u32(out + n + 4, cython.cast(cython.uint, meta))
            return result
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
    if cython.compiled:
        # The C path takes what next_frame returns: a flat byte view of a bytearray.
        if (type(payload) is memoryview and type(attachment_size) is int
                and not _view_released(payload)):
            v = PyMemoryView_GET_BUFFER(payload)
            owner = _buffer_obj(v)
            att = PyLong_AsLongLongAndOverflow(attachment_size, cython.address(overflow))
            if not (overflow or owner == cython.NULL
                    or not PyByteArray_CheckExact(cython.cast(object, owner))
                    or v.ndim != 1 or v.itemsize != 1 or v.suboffsets != cython.NULL
                    or (v.strides != cython.NULL and v.strides[0] != 1)
                    or v.format == cython.NULL or v.format[0] != b'B'[0] or v.format[1] != 0
                    or not 0 <= att <= v.len):
                at = v.len - att
                data = _subview(payload, 0, at)
                if att * _PIN_RATIO < PyByteArray_GET_SIZE(cython.cast(object, owner)):
                    attachment = PyMemoryView_FromObject(
                        PyByteArray_FromStringAndSize(cython.cast(cython.p_char, v.buf) + at, att))
                else:
                    attachment = _subview(payload, at, att)
                return data, attachment
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
    if cython.compiled:
        if acquire_bytes(buf, cython.address(view)) is not None:
            try:
                n = 4 if view.len > 4 else view.len
                p = cython.cast(cython.p_uchar, view.buf)
                return (memcmp(p, b"PRPC", cython.cast(cython.size_t, n)) == 0
                        or memcmp(p, b"STRM", cython.cast(cython.size_t, n)) == 0)
            finally:
                PyBuffer_Release(cython.address(view))
    n = min(len(buf), 4)
    head = bytes(buf[:n])
    return MAGIC_PRPC[:n] == head or MAGIC_STRM[:n] == head


class FrameReader:
    """Cuts PRPC/STRM frames out of received bytes.

    `next_frame()` returns (kind, meta, payload) as memoryviews, or None when more bytes are
    needed. A framing violation raises a fatal RemoteProtocolError: the connection must close.
    """

    if not cython.compiled:
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
        return self._get_buffer()

    def _get_buffer(self) -> memoryview:
        rbuf = self.rbuf
        have = rbuf._end - rbuf._start
        if have >= _HEADER and rbuf._large is None and rbuf._complete is None:
            # A large frame whose header is already here gets its own buffer before the
            # kernel reads more (next_frame reports any framing error).
            block, s = rbuf._block, rbuf._start
            body_size = _u32_at(block, s + 4)
            total = _HEADER + body_size
            if (_kind_at(block, s) != 0 and _u32_at(block, s + 8) <= body_size
                    and body_size <= self.max_body_size
                    and total > rbuf.large_threshold and have < total):
                _begin_large(rbuf, total)
        return rbuf._get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.rbuf._buffer_updated(nbytes)

    @cython.locals(pos=cython.Py_ssize_t, n=cython.Py_ssize_t, k=cython.Py_ssize_t)
    def feed(self, data) -> None:
        """Copy `data` in as if the kernel had read it (tests and non-buffered transports)."""
        mv = memoryview(data).cast("B")
        pos, n = 0, _view_len(mv)
        while pos < n:
            buf = self._get_buffer()  # never empty
            k = min(_view_len(buf), n - pos)
            if cython.compiled:
                memmove(PyMemoryView_GET_BUFFER(buf).buf,
                        cython.cast(cython.p_char, PyMemoryView_GET_BUFFER(mv).buf) + pos,
                        cython.cast(cython.size_t, k))
            else:
                buf[:k] = mv[pos:pos + k]
            self.rbuf._buffer_updated(k)
            pos += k

    def pending_bytes(self) -> int:
        return self.rbuf.pending_bytes()

    def next_frame(self):
        rbuf = self.rbuf
        if rbuf._large is not None or rbuf._complete is not None:
            frame = rbuf._take_large()
            if frame is None:
                return None
            return self._split_large(frame)
        have = rbuf._end - rbuf._start
        block, s = rbuf._block, rbuf._start
        if have < _HEADER:
            if have and not _prefix_ok_at(block, s, have):
                raise _bad_magic(block[s:s + have])
            return None
        kind = _kind_at(block, s)
        if kind == 0:
            raise _bad_magic(block[s:s + min(have, 32)])
        body_size = _u32_at(block, s + 4)
        meta_size = _u32_at(block, s + 8)
        if body_size > self.max_body_size:
            raise RemoteProtocolError(
                f"body_size={body_size} exceeds max_body_size={self.max_body_size}", fatal=True)
        if meta_size > body_size:
            raise RemoteProtocolError(
                f"meta_size={meta_size} is larger than body_size={body_size}", fatal=True)
        total = _HEADER + body_size
        if have >= total:
            rbuf._start = s + total
            self.frames += 1
            mv = memoryview(block)
            meta_end = s + _HEADER + meta_size
            meta = _subview(mv, s + _HEADER, meta_size)
            return kind, meta, _narrow(mv, meta_end, rbuf._start - meta_end)
        if total > rbuf.large_threshold:
            _begin_large(rbuf, total)
        return None

    def _split_large(self, frame: memoryview) -> tuple:
        if cython.compiled:
            view = PyMemoryView_GET_BUFFER(frame)
            p = cython.cast(cython.p_uchar, view.buf)
            # Only a direct begin_large() with a made-up total leaves a frame shorter than its
            # header or its meta: the Python code below cuts that one.
            if view.len >= _HEADER:
                meta_end = _HEADER + get_u32(p + 8)
                if meta_end <= view.len:
                    self.frames += 1
                    kind = 1 if p[0] == 0x50 else 2
                    meta = _subview(frame, _HEADER, meta_end - _HEADER)
                    return kind, meta, _narrow(frame, meta_end, view.len - meta_end)
        self.frames += 1
        kind = KIND_PRPC if frame[0] == 0x50 else KIND_STRM
        meta_end = HEADER_SIZE + int.from_bytes(frame[8:12], "big")
        return kind, frame[HEADER_SIZE:meta_end], frame[meta_end:]


def _begin_large(rbuf: ReadBuffer, total: int) -> None:
    if cython.compiled:
        if total > PY_SSIZE_T_MAX:  # a 32-bit build: no such buffer
            raise MemoryError()
    rbuf._begin_large(total)
