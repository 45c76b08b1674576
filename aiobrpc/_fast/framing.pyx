"""baidu_std framing compiled: the twin of `framing_py.py`, whose docstrings are the design.

The header is read in C from the ReadBuffer's block (cimported, no Python calls); sizes are
uint32 from the wire held in uint64, so nothing near 2**32 wraps. Inputs the fast paths do
not model (a list instead of a buffer, a non-int size) go to the pure twin.
"""

from cpython.bytearray cimport (PyByteArray_AS_STRING, PyByteArray_CheckExact,
                                PyByteArray_FromStringAndSize, PyByteArray_GET_SIZE)
from cpython.buffer cimport PyBuffer_Release
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_Check
from cpython.ref cimport PyObject
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memmove

from ._bytes cimport HEADER, acquire_bytes, get_u32, put_u32
from .iobuf cimport ReadBuffer

from ..errors import LocalProtocolError, RemoteProtocolError
from . import framing_py
from .iobuf import DEFAULT_BLOCK_SIZE, DEFAULT_LARGE_THRESHOLD, HEADER_SIZE

cdef extern from "Python.h":
    Py_buffer* PyMemoryView_GET_BUFFER(object)
    object PyMemoryView_FromObject(object)
    const Py_ssize_t PY_SSIZE_T_MAX

cdef extern from *:
    """
    #define aiobrpc_buffer_obj(view) ((view)->obj)
    #define aiobrpc_view_released(mv) \
        ((((PyMemoryViewObject*)(mv))->flags & _Py_MEMORYVIEW_RELEASED) != 0)
    """
    # The exporter under a view, or NULL (Cython's own Py_buffer.obj is an object, never NULL).
    PyObject* _buffer_obj "aiobrpc_buffer_obj" (Py_buffer*)
    # A released view's buffer and exporter may be gone.
    bint _view_released "aiobrpc_view_released" (object)

KIND_PRPC = 1
KIND_STRM = 2
MAGIC_PRPC = b"PRPC"
MAGIC_STRM = b"STRM"
DEFAULT_MAX_BODY_SIZE = 64 * 1024 * 1024
ATTACHMENT_PIN_RATIO = 4

cdef enum:
    _PRPC = 1
    _STRM = 2
    _PIN_RATIO = 4  # ATTACHMENT_PIN_RATIO


cdef inline int _kind(const unsigned char* p) noexcept nogil:
    if memcmp(p, b"PRPC", 4) == 0:
        return _PRPC
    if memcmp(p, b"STRM", 4) == 0:
        return _STRM
    return 0


cdef inline bint _prefix_ok(const unsigned char* p, Py_ssize_t n) noexcept nogil:
    if n > 4:
        n = 4
    return memcmp(p, b"PRPC", <size_t>n) == 0 or memcmp(p, b"STRM", <size_t>n) == 0


cdef object _narrow(object view, Py_ssize_t start, Py_ssize_t n):
    """Turn a fresh 1-D byte memoryview nobody else has seen into view[start:start + n].

    Slicing would cost a slice object, two ints and one more memoryview per view: this edits
    the view's own copy of the Py_buffer, which is all slicing does to the new view. The range
    must lie inside the view.
    """
    cdef Py_buffer* b = PyMemoryView_GET_BUFFER(view)
    b.buf = <char*>b.buf + start
    b.len = n
    b.shape[0] = n
    return view


cdef inline object _subview(object base, Py_ssize_t start, Py_ssize_t n):
    # A new view on base's managed buffer (the block stays exported while it lives).
    return _narrow(PyMemoryView_FromObject(base), start, n)


cdef int _begin_large(ReadBuffer rbuf, uint64_t total) except -1:
    if total > <uint64_t>PY_SSIZE_T_MAX:  # a 32-bit build: no such buffer
        raise MemoryError()
    return rbuf._begin_large(<Py_ssize_t>total)


cdef object _bad_magic(const unsigned char* p, Py_ssize_t n):
    head = PyBytes_FromStringAndSize(<const char*>p, n)
    return RemoteProtocolError(f"unknown protocol: first bytes {head.hex()}", fatal=True)


def parse_header(buf):
    """(kind, body_size, meta_size) of a 12-byte header; kind is 0 for an unknown magic."""
    cdef Py_buffer view
    cdef const unsigned char* p
    if acquire_bytes(buf, &view) is None:
        return framing_py.parse_header(buf)
    try:
        if view.len < HEADER:
            raise LocalProtocolError(f"a header is {HEADER_SIZE} bytes, got {view.len}")
        p = <const unsigned char*>view.buf
        return _kind(p), get_u32(p + 4), get_u32(p + 8)
    finally:
        PyBuffer_Release(&view)


def pack_header(magic, body_size, meta_size):
    cdef int o1 = 0, o2 = 0
    cdef long long body = 0, meta = 0
    cdef Py_ssize_t n
    cdef unsigned char* out
    if type(magic) is not bytes or not PyLong_Check(body_size) or not PyLong_Check(meta_size):
        return framing_py.pack_header(magic, body_size, meta_size)
    body = PyLong_AsLongLongAndOverflow(body_size, &o1)
    meta = PyLong_AsLongLongAndOverflow(meta_size, &o2)
    if o1 or o2 or not 0 <= meta <= body <= 0xFFFFFFFF:
        raise LocalProtocolError(f"invalid sizes body_size={body_size} meta_size={meta_size}")
    n = len(<bytes>magic)
    result = PyBytes_FromStringAndSize(NULL, n + 8)
    out = <unsigned char*>PyBytes_AS_STRING(result)
    memcpy(out, PyBytes_AS_STRING(magic), <size_t>n)
    put_u32(out + n, <uint32_t>body)
    put_u32(out + n + 4, <uint32_t>meta)
    return result


def split_payload(payload, attachment_size):
    """(data, attachment) of a frame's payload view; the attachment is copied out when its
    buffer is more than ATTACHMENT_PIN_RATIO times its size (see the pure twin).

    The fast path takes what next_frame returns, a flat byte view of a bytearray; anything
    else goes to the pure twin, which also raises for a size outside the payload.
    """
    cdef Py_buffer* v
    cdef PyObject* owner
    cdef long long att
    cdef int overflow = 0
    cdef Py_ssize_t cut
    if (type(payload) is not memoryview or type(attachment_size) is not int
            or _view_released(payload)):
        return framing_py.split_payload(payload, attachment_size)
    v = PyMemoryView_GET_BUFFER(payload)
    owner = _buffer_obj(v)
    att = PyLong_AsLongLongAndOverflow(attachment_size, &overflow)
    if (overflow or owner == NULL or not PyByteArray_CheckExact(<object>owner)
            or v.ndim != 1 or v.itemsize != 1 or v.suboffsets != NULL
            or (v.strides != NULL and v.strides[0] != 1)
            or v.format == NULL or v.format[0] != b'B' or v.format[1] != 0
            or not 0 <= att <= v.len):
        return framing_py.split_payload(payload, attachment_size)
    cut = v.len - <Py_ssize_t>att
    data = _subview(payload, 0, cut)
    if att * _PIN_RATIO < PyByteArray_GET_SIZE(<object>owner):
        attachment = PyMemoryView_FromObject(
            PyByteArray_FromStringAndSize(<char*>v.buf + cut, <Py_ssize_t>att))
    else:
        attachment = _subview(payload, cut, <Py_ssize_t>att)
    return data, attachment


def magic_prefix_ok(buf):
    """Can these first bytes (any length) still be the start of a PRPC or STRM frame?"""
    cdef Py_buffer view
    if acquire_bytes(buf, &view) is None:
        return framing_py.magic_prefix_ok(buf)
    try:
        return _prefix_ok(<const unsigned char*>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


cdef class FrameReader:
    """Cuts PRPC/STRM frames out of received bytes.

    `next_frame()` returns (kind, meta, payload) as memoryviews, or None when more bytes are
    needed. A framing violation raises a fatal RemoteProtocolError: the connection must close.
    """

    cdef readonly ReadBuffer rbuf
    cdef public long long max_body_size
    cdef public long long frames

    def __cinit__(self, max_body_size=DEFAULT_MAX_BODY_SIZE, block_size=DEFAULT_BLOCK_SIZE,
                  large_threshold=DEFAULT_LARGE_THRESHOLD):
        if not 0 < max_body_size <= 0xFFFFFFFF:
            raise LocalProtocolError(f"max_body_size must be in 1..4294967295, got {max_body_size}")
        self.rbuf = ReadBuffer(block_size, large_threshold)
        self.max_body_size = max_body_size
        self.frames = 0

    def get_buffer(self, sizehint=-1):
        return self._get_buffer()

    cdef object _get_buffer(self):
        cdef ReadBuffer rbuf = self.rbuf
        cdef Py_ssize_t have = rbuf._end - rbuf._start
        cdef const unsigned char* p
        cdef uint64_t body_size, meta_size, total
        if have >= HEADER and rbuf._large is None and rbuf._complete is None:
            # A large frame whose header is already here gets its own buffer before the
            # kernel reads more (next_frame reports any framing error).
            p = <const unsigned char*>PyByteArray_AS_STRING(rbuf._block) + rbuf._start
            body_size = get_u32(p + 4)
            meta_size = get_u32(p + 8)
            total = HEADER + body_size
            if (_kind(p) != 0 and meta_size <= body_size
                    and <long long>body_size <= self.max_body_size
                    and <long long>total > rbuf.large_threshold and <uint64_t>have < total):
                _begin_large(rbuf, total)
        return rbuf._get_buffer()

    def buffer_updated(self, nbytes):
        self.rbuf._buffer_updated(nbytes)

    def feed(self, data):
        """Copy `data` in as if the kernel had read it (tests and non-buffered transports)."""
        cdef Py_buffer* src
        cdef Py_buffer* dst
        cdef Py_ssize_t pos = 0, k
        mv = memoryview(data).cast("B")
        src = PyMemoryView_GET_BUFFER(mv)
        buf = None  # alive until the next get_buffer returns, as in the pure twin's loop
        while pos < src.len:
            buf = self._get_buffer()  # never empty
            dst = PyMemoryView_GET_BUFFER(buf)
            k = min(dst.len, src.len - pos)
            memmove(dst.buf, <const char*>src.buf + pos, <size_t>k)
            self.rbuf._buffer_updated(k)
            pos += k

    def pending_bytes(self):
        return self.rbuf.pending_bytes()

    def next_frame(self):
        cdef ReadBuffer rbuf = self.rbuf
        cdef Py_ssize_t have, s, meta_end
        cdef const unsigned char* p
        cdef uint64_t body_size, meta_size, total
        cdef int kind
        if rbuf._large is not None or rbuf._complete is not None:
            frame = rbuf._take_large()
            if frame is None:
                return None
            return self._split_large(frame)
        have = rbuf._end - rbuf._start
        p = <const unsigned char*>PyByteArray_AS_STRING(rbuf._block) + rbuf._start
        if have < HEADER:
            if have and not _prefix_ok(p, have):
                raise _bad_magic(p, have)
            return None
        kind = _kind(p)
        if kind == 0:
            raise _bad_magic(p, min(have, 32))
        body_size = get_u32(p + 4)
        meta_size = get_u32(p + 8)
        if <long long>body_size > self.max_body_size:
            raise RemoteProtocolError(
                f"body_size={body_size} exceeds max_body_size={self.max_body_size}", fatal=True)
        if meta_size > body_size:
            raise RemoteProtocolError(
                f"meta_size={meta_size} is larger than body_size={body_size}", fatal=True)
        total = HEADER + body_size
        if <uint64_t>have >= total:
            s = rbuf._start
            rbuf._start = s + <Py_ssize_t>total
            self.frames += 1
            mv = memoryview(rbuf._block)
            meta_end = s + HEADER + <Py_ssize_t>meta_size
            meta = _subview(mv, s + HEADER, <Py_ssize_t>meta_size)
            return kind, meta, _narrow(mv, meta_end, rbuf._start - meta_end)
        if <long long>total > rbuf.large_threshold:
            _begin_large(rbuf, total)
        return None

    cdef tuple _split_large(self, frame):
        cdef Py_buffer* view = PyMemoryView_GET_BUFFER(frame)
        cdef const unsigned char* p = <const unsigned char*>view.buf
        cdef Py_ssize_t meta_end
        cdef int kind
        if view.len < HEADER:  # only after a direct begin_large() with a made-up total
            return framing_py.FrameReader._split(self, frame)
        meta_end = HEADER + <Py_ssize_t>get_u32(p + 8)
        if meta_end > view.len:  # only after a direct begin_large() with a made-up total
            return framing_py.FrameReader._split(self, frame)
        self.frames += 1
        kind = _PRPC if p[0] == 0x50 else _STRM
        meta = _subview(frame, HEADER, meta_end - HEADER)
        return kind, meta, _narrow(frame, meta_end, view.len - meta_end)
