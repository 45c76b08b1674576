"""IOBuf-like buffers compiled: the twin of `iobuf_py.py`, whose docstrings are the design.

"No view of the block is alive" is decided as the pure twin decides it, from the block's
reference count: every memoryview of it (through its managed buffer) and every other holder
owns a reference, and this object keeps none beyond `_block`, so the count is 1 exactly when
nobody else can see the block. The bytearray's buffer-export count is checked as well, so a
live export can never be missed. Both are read in C without taking a reference.

Where the pure twin trusts its caller with a size (buffer_updated, take, skip), this twin
checks it: here a wrong size would be a wild pointer in framing.pyx, not an odd view.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.ref cimport PyObject
from libc.string cimport memcpy, memmove

from ._bytes cimport HEADER

from collections import deque

from ..errors import LocalProtocolError

cdef extern from "Python.h":
    ctypedef struct PyByteArrayObject:
        Py_ssize_t ob_exports
    Py_ssize_t _refcnt "Py_REFCNT" (PyObject*)
    Py_buffer* PyMemoryView_GET_BUFFER(object)

HEADER_SIZE = HEADER
DEFAULT_BLOCK_SIZE = 256 * 1024
DEFAULT_LARGE_THRESHOLD = 64 * 1024
LARGE_CACHE_MAX_BYTES = 64 * 1024 * 1024
LARGE_CACHE_MAX_BUFFERS = 16
cdef enum:
    _ALIGN = 64
LARGE_ALIGN = _ALIGN


cdef class LargeBufferCache:
    """Large receive buffers handed out recently, for reuse once nothing views them (see the
    pure twin). Per process, bounded in bytes and count; the oldest entries leave first."""

    cdef list _buffers
    cdef public Py_ssize_t nbytes
    cdef public Py_ssize_t max_bytes
    cdef public Py_ssize_t max_buffers

    def __cinit__(self, max_bytes=LARGE_CACHE_MAX_BYTES, max_buffers=LARGE_CACHE_MAX_BUFFERS):
        self._buffers = []
        self.nbytes = 0
        self.max_bytes = max_bytes
        self.max_buffers = max_buffers

    cpdef object take(self, Py_ssize_t size):
        """A cached buffer of exactly `size` bytes that nothing else references, or None."""
        cdef Py_ssize_t i
        cdef bytearray buf
        for i in range(len(self._buffers)):
            buf = <bytearray>self._buffers[i]
            # references: the list and `buf`
            if PyByteArray_GET_SIZE(buf) == size and _refcnt(<PyObject*>buf) == 2:
                del self._buffers[i]
                self.nbytes -= size
                return buf
        return None

    cpdef put(self, bytearray buf):
        cdef Py_ssize_t size = PyByteArray_GET_SIZE(buf)
        if size > self.max_bytes:
            return
        self._buffers.append(buf)
        self.nbytes += size
        while self.nbytes > self.max_bytes or len(self._buffers) > self.max_buffers:
            self.nbytes -= PyByteArray_GET_SIZE(self._buffers.pop(0))

    def clear(self):
        self._buffers.clear()
        self.nbytes = 0

    def __len__(self):
        return len(self._buffers)


cdef LargeBufferCache _large_buffers = LargeBufferCache()
large_buffers = _large_buffers


def _as_bytes_view(obj):
    """A flat unsigned-byte view of any C-contiguous buffer (bytes, numpy, torch ...)."""
    try:
        mv = memoryview(obj)
    except TypeError:
        raise LocalProtocolError(
            f"expected a bytes-like object (buffer protocol), got {type(obj).__name__}") from None
    if not mv.c_contiguous:
        raise LocalProtocolError("buffer must be C-contiguous to be sent without a copy")
    if mv.nbytes == 0:
        return memoryview(b"")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def byte_view(obj):
    """Public alias: a flat byte memoryview over `obj` without copying."""
    return _as_bytes_view(obj)


cdef class IOBuf:
    """A chain of buffers. `append` keeps the object itself; `cut` returns views."""

    def __cinit__(self):
        self._chunks = deque()
        self._size = 0

    def __len__(self):
        return self._size

    def append(self, buf):
        cdef Py_ssize_t n
        if type(buf) is bytes:
            n = len(<bytes>buf)
            if n:
                self._chunks.append(buf)
                self._size += n
            return
        mv = _as_bytes_view(buf)
        n = PyMemoryView_GET_BUFFER(mv).len
        if n:
            self._chunks.append(mv)
            self._size += n

    def extend(self, bufs):
        for b in bufs:
            self.append(b)

    def cut(self, n):
        """Remove and return the first `n` bytes as a list of buffers (views, never copies)."""
        cdef Py_ssize_t count, left, size
        if n < 0 or n > self._size:
            raise LocalProtocolError(f"cannot cut {n} bytes from an IOBuf of {self._size}")
        count = left = n
        out = []
        chunks = self._chunks
        while left:
            head = chunks[0]
            size = len(<bytes>head) if type(head) is bytes else PyMemoryView_GET_BUFFER(head).len
            if size <= left:
                out.append(chunks.popleft())
                left -= size
            else:
                mv = memoryview(head) if type(head) is bytes else head
                out.append(mv[:left])
                chunks[0] = mv[left:]
                left = 0
        self._size -= count
        return out

    def cut_all(self):
        out = list(self._chunks)
        self._chunks.clear()
        self._size = 0
        return out

    def clear(self):
        self._chunks.clear()
        self._size = 0


cdef object _narrow(object view, Py_ssize_t start, Py_ssize_t n):
    # view[start:start + n] of a fresh 1-D byte memoryview nobody else has seen: slicing
    # would make another view; this edits the new view's own Py_buffer, as slicing does.
    cdef Py_buffer* b = PyMemoryView_GET_BUFFER(view)
    b.buf = <char*>b.buf + start
    b.len = n
    b.shape[0] = n
    return view


cdef class ReadBuffer:
    """Receive buffer for asyncio.BufferedProtocol (get_buffer / buffer_updated)."""

    def __cinit__(self, block_size=DEFAULT_BLOCK_SIZE, large_threshold=DEFAULT_LARGE_THRESHOLD):
        if block_size < 2 * large_threshold or large_threshold < HEADER_SIZE:
            raise LocalProtocolError(f"block_size ({block_size}) must be at least twice "
                                     f"large_threshold ({large_threshold})")
        self._block_size = block_size
        self._block = bytearray()  # made at the first read: a silent connection holds no block
        self._start = 0
        self._end = 0
        self._large = None
        self._large_filled = 0
        self._large_total = 0
        self._large_pad = 0
        self._complete = None
        self.reused_large_buffers = 0
        self._header_only = False
        self.large_threshold = large_threshold
        self.copied_bytes = 0

    # -- kernel side -------------------------------------------------------------------------
    def get_buffer(self, sizehint=-1):
        return self._get_buffer()

    cdef object _get_buffer(self):
        cdef Py_ssize_t free
        if self._large is not None:
            if self._large_filled < self._large_total:
                return _narrow(memoryview(self._large), self._large_pad + self._large_filled,
                               self._large_total + HEADER - self._large_filled)
            # Complete but not taken yet (a caller feeding before parsing): park it and go on
            # reading into the block.
            self._complete = self._finish_large()
        if self._start == self._end and self._unshared():
            self._start = self._end = 0
            if PyByteArray_GET_SIZE(self._block) != self._block_size:
                self._block = bytearray(self._block_size)
        free = PyByteArray_GET_SIZE(self._block) - self._end
        if free < HEADER or (free < self.large_threshold and self._start != self._end):
            self._new_block()
        if self._header_only and self._end - self._start < HEADER:
            # After a large frame: read just the rest of the next header, so a following large
            # frame is received straight into its own buffer.
            return memoryview(self._block)[self._end:self._start + HEADER]
        return memoryview(self._block)[self._end:]

    def buffer_updated(self, nbytes):
        self._buffer_updated(nbytes)

    cdef int _buffer_updated(self, Py_ssize_t nbytes) except -1:
        cdef Py_ssize_t room = (self._large_total + HEADER - self._large_filled if self._large is not None
                                else PyByteArray_GET_SIZE(self._block) - self._end)
        if nbytes < 0 or nbytes > room:
            raise LocalProtocolError(
                f"buffer_updated({nbytes}) is outside the {room} bytes that get_buffer offered")
        if self._large is not None:
            self._large_filled += nbytes
        else:
            self._end += nbytes
            if self._header_only and self._end - self._start > HEADER:
                self._header_only = False
        return 0

    def feed(self, data):
        """Copy `data` in as if the kernel had read it (tests and non-buffered transports)."""
        cdef Py_buffer* src
        cdef Py_buffer* dst
        cdef Py_ssize_t pos = 0, k
        mv = _as_bytes_view(data)
        src = PyMemoryView_GET_BUFFER(mv)
        # `buf` stays alive until the next get_buffer returns, exactly as in the pure twin's
        # loop, so both twins see the same views alive and make the same block decisions.
        buf = None
        while pos < src.len:
            buf = self._get_buffer()  # never empty
            dst = PyMemoryView_GET_BUFFER(buf)
            k = min(dst.len, src.len - pos)
            memmove(dst.buf, <char*>src.buf + pos, <size_t>k)
            self._buffer_updated(k)
            pos += k

    # -- parser side -------------------------------------------------------------------------
    def available(self):
        """Unconsumed bytes in the shared block (a large frame in progress is not counted)."""
        return self._end - self._start

    def peek(self, n):
        return memoryview(self._block)[self._start:self._start + n]

    def take(self, n):
        """Consume `n` bytes of the block, returned as a view (no copy)."""
        cdef Py_ssize_t s = self._start
        self._consume(n)
        return memoryview(self._block)[s:self._start]

    def skip(self, n):
        self._consume(n)

    cdef int _consume(self, Py_ssize_t n) except -1:
        if n < 0 or n > self._end - self._start:
            raise LocalProtocolError(
                f"cannot consume {n} bytes, {self._end - self._start} are available")
        self._start += n
        return 0

    def begin_large(self, total):
        """The frame starting at the read position is `total` bytes: give it its own buffer."""
        self._begin_large(total)

    cdef int _begin_large(self, Py_ssize_t total) except -1:
        cdef Py_ssize_t have = self._end - self._start
        cdef Py_ssize_t size = total + HEADER + _ALIGN
        cdef Py_ssize_t pad = 0
        large = _large_buffers.take(size)
        if large is not None:
            self.reused_large_buffers += 1
        else:
            large = bytearray(size)
        if have > total + HEADER:  # only a direct begin_large() with a made-up total
            if have <= size:
                memcpy(PyByteArray_AS_STRING(large),
                       PyByteArray_AS_STRING(self._block) + self._start, <size_t>have)
            else:  # the pure twin's slice assignment grows the buffer; so does this
                large[:have] = memoryview(self._block)[self._start:self._end]
        else:
            # The frame ends LARGE_ALIGN-aligned, so its attachment (the frame's end) starts
            # aligned to its size's power of two (iobuf_py's docstring).
            pad = <Py_ssize_t>((-<size_t>(<size_t>PyByteArray_AS_STRING(large) + <size_t>total)) % _ALIGN)
            if have:
                memcpy(PyByteArray_AS_STRING(large) + pad,
                       PyByteArray_AS_STRING(self._block) + self._start, <size_t>have)
        self.copied_bytes += have
        self._large_pad = pad
        self._start = self._end
        self._large = large
        self._large_filled = have
        self._large_total = total
        return 0

    def large_pending(self):
        return self._large is not None or self._complete is not None

    def take_large(self):
        """The large frame's buffer once it is complete, else None."""
        return self._take_large()

    cdef object _take_large(self):
        if self._complete is not None:
            frame, self._complete = self._complete, None
            return frame
        if self._large is None or self._large_filled < self._large_total:
            return None
        return self._finish_large()

    cdef object _finish_large(self):
        """The complete large frame as a view; the bytes read past it go to the block."""
        cdef bytearray large = self._large
        cdef Py_ssize_t total = self._large_total
        cdef Py_ssize_t spare = self._large_filled - total
        cdef Py_ssize_t pad = self._large_pad
        self._large = None
        self._large_filled = self._large_total = 0
        self._header_only = True
        if spare:  # the start of the next frame (at most HEADER bytes)
            if PyByteArray_GET_SIZE(self._block) - self._end < spare:
                self._new_block()
            memcpy(PyByteArray_AS_STRING(self._block) + self._end,
                   PyByteArray_AS_STRING(large) + pad + total, <size_t>spare)
            self._end += spare
            self.copied_bytes += spare
        _large_buffers.put(large)
        return _narrow(memoryview(large), pad, total)

    def pending_bytes(self):
        """Bytes received but not yet consumed (a partial frame)."""
        cdef Py_ssize_t done = len(self._complete) if self._complete is not None else 0
        return self._end - self._start + self._large_filled + done

    def clear(self):
        """Drop everything buffered (connection closed)."""
        self._large = None
        self._complete = None
        self._large_filled = self._large_total = 0
        self._start = self._end = 0
        self._block = bytearray()  # views of the old block keep it alive as long as they need

    def release(self):
        """Let the block go when nothing is buffered and nothing views it (see the pure twin)."""
        if (self._start != self._end or self._large is not None or self._complete is not None
                or PyByteArray_GET_SIZE(self._block) == 0 or not self._unshared()):
            return False
        self._block = bytearray()
        self._start = self._end = 0
        return True

    # -- internals ---------------------------------------------------------------------------
    cdef bint _unshared(self) noexcept:
        cdef PyObject* block = <PyObject*>self._block
        return _refcnt(block) == 1 and (<PyByteArrayObject*>block).ob_exports == 0

    cdef int _new_block(self) except -1:
        # Move the unconsumed tail to the front of a block with room for a small frame; the
        # block grows when a caller feeds many frames before consuming them.
        cdef Py_ssize_t have = self._end - self._start
        cdef Py_ssize_t size = self._block_size
        cdef char* old
        if have > self._block_size - self.large_threshold:
            size = have + self._block_size
        if self._unshared() and PyByteArray_GET_SIZE(self._block) >= size:
            old = PyByteArray_AS_STRING(self._block)
            memmove(old, old + self._start, <size_t>have)
        else:
            block = bytearray(size)
            memcpy(PyByteArray_AS_STRING(block), PyByteArray_AS_STRING(self._block) + self._start,
                   <size_t>have)
            self._block = block
        self.copied_bytes += have
        self._start = 0
        self._end = have
        return 0
