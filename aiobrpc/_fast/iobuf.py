"""IOBuf-like buffers: one source, compiled by Cython (pure-Python mode, types in iobuf.pxd)
or run as Python (aiobrpc/_compiled.py chooses, once per process).

`IOBuf` is the send side: a queue of the caller's buffers, appended without a copy and cut
into memoryviews.

`ReadBuffer` is the receive side of an asyncio BufferedProtocol. Design:

* Small frames land in a shared *block* (one bytearray). Frames are handed out as memoryview
  slices of it, so nothing is copied after the kernel's read. A block is never written where
  a handed-out view can see it: data only goes after `end`, and the block is rewound to 0 only
  when nothing is unconsumed and no view of it is alive; otherwise a fresh block is started
  and the unconsumed tail (a partial small frame) is moved there.
* A frame larger than `large_threshold` gets a bytearray of its own (`begin_large`), of its
  size plus HEADER_SIZE: the bytes of it already read are moved there once, and the kernel
  fills the rest directly, so its payload is one contiguous view with no further copy. The
  spare HEADER_SIZE bytes at the end let the read that completes the frame bring the next
  frame's header with it (one read, not a second one for 12 bytes); what landed there is
  moved to the block when the frame is taken. The buffer has LARGE_ALIGN bytes more, and the
  frame is placed in it so that it *ends* on a LARGE_ALIGN boundary: an attachment is the
  end of its frame, so one whose size is a multiple of 2^k bytes (a tensor's) starts 2^k-byte
  aligned (k <= 6), and numpy or torch use it in place at full speed (an unaligned float
  array makes numpy's ufuncs copy it into aligned buffers first). Large buffers are reused, through a bounded
  per-process cache, once no view of them is alive (no fresh pages to fault in). After a
  large frame, reads at a frame boundary ask the kernel for the rest of the 12-byte header
  only, so a stream of large frames is received with at most 12 bytes per frame copied in
  user space; `copied_bytes` counts what was moved.

"No view of the block is alive" is decided from the block's reference count: every memoryview
of it (through its managed buffer) and every other holder owns a reference, and this object
keeps none beyond `_block`. Compiled, the count is read in C without taking a reference, and
the bytearray's buffer-export count is checked as well, so a live export cannot be missed.
The code under `if cython.compiled:` does in C what the line beside it does in Python: read a
view's length, edit a fresh view's bounds instead of slicing it, copy with memcpy.
"""

from __future__ import annotations

import ctypes
import sys
from collections import deque

try:
    import cython
except ImportError:  # the pure build runs without Cython
    from .. import _cython_shim as cython

from ..errors import LocalProtocolError

HEADER_SIZE = _HEADER = 12  # _HEADER and _ALIGN are C constants when compiled
DEFAULT_BLOCK_SIZE = 256 * 1024
DEFAULT_LARGE_THRESHOLD = 64 * 1024
LARGE_CACHE_MAX_BYTES = 64 * 1024 * 1024
LARGE_CACHE_MAX_BUFFERS = 16
LARGE_ALIGN = _ALIGN = 64


class LargeBufferCache:
    """Large receive buffers handed out recently, for reuse once nothing views them.

    A fresh multi-megabyte bytearray costs a page fault per 4 KiB page when the kernel first
    writes it; reusing a buffer of the same size whose views are all gone costs none. The
    cache is per process and bounded (bytes and count): the oldest entries leave first.
    """

    __slots__ = ("_buffers", "nbytes", "max_bytes", "max_buffers")

    def __init__(self, max_bytes: int = LARGE_CACHE_MAX_BYTES,
                 max_buffers: int = LARGE_CACHE_MAX_BUFFERS) -> None:
        self._buffers: list = []
        self.nbytes = 0
        self.max_bytes = max_bytes
        self.max_buffers = max_buffers

    def take(self, size: int):
        """A cached buffer of exactly `size` bytes that nothing else references, or None."""
        buffers = self._buffers
        for i in range(len(buffers)):
            buf = buffers[i]
            if len(buf) != size:
                continue
            if cython.compiled:
                unused = _refcnt(cython.cast(cython.pointer(PyObject), buf)) == 2  # the list, `buf`
            else:
                unused = sys.getrefcount(buf) == 3  # the list, `buf`, getrefcount's argument
            if unused:
                del buffers[i]
                self.nbytes -= size
                return buf
        return None

    def put(self, buf: bytearray) -> None:
        size = len(buf)
        if size > self.max_bytes:
            return
        self._buffers.append(buf)
        self.nbytes += size
        while self.nbytes > self.max_bytes or len(self._buffers) > self.max_buffers:
            self.nbytes -= len(self._buffers.pop(0))

    def clear(self) -> None:
        self._buffers.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._buffers)


large_buffers = _large_buffers = LargeBufferCache()


def _address(buf: bytearray) -> int:
    """Where `buf`'s bytes are in memory (the export ctypes takes ends with this call)."""
    if cython.compiled:
        return cython.cast(cython.size_t, PyByteArray_AS_STRING(buf))
    else:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _view_len(view) -> int:
    """Bytes in a flat byte memoryview."""
    if cython.compiled:
        return PyMemoryView_GET_BUFFER(view).len
    else:
        return view.nbytes


def _narrow(view: memoryview, start: int, n: int) -> memoryview:
    """view[start:start + n] of a fresh 1-D byte memoryview nobody else has seen.

    Compiled, slicing would cost a slice object, two ints and one more memoryview: this edits
    the new view's own copy of the Py_buffer, which is all slicing does. The range must lie
    inside the view."""
    if cython.compiled:
        b = PyMemoryView_GET_BUFFER(view)
        b.buf = cython.cast(cython.p_char, b.buf) + start
        b.len = n
        b.shape[0] = n
        return view
    else:
        return view[start:start + n]


def _copy(dst: bytearray, at: int, src: bytearray, start: int, n: int) -> None:
    """dst[at:at + n] = src[start:start + n], both inside their buffers (they may overlap)."""
    if cython.compiled:
        memmove(PyByteArray_AS_STRING(dst) + at, PyByteArray_AS_STRING(src) + start,
                cython.cast(cython.size_t, n))
    elif n:
        dst[at:at + n] = memoryview(src)[start:start + n]


def _as_bytes_view(obj) -> memoryview:
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


def byte_view(obj) -> memoryview:
    """Public alias: a flat byte memoryview over `obj` without copying."""
    return _as_bytes_view(obj)


class IOBuf:
    """A chain of buffers. `append` keeps the object itself; `cut` returns views."""

    __slots__ = ("_chunks", "_size")

    def __init__(self) -> None:
        self._chunks: deque = deque()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @cython.locals(n=cython.Py_ssize_t)
    def append(self, buf) -> None:
        if type(buf) is bytes:
            n = len(buf)
            if n:
                self._chunks.append(buf)
                self._size += n
            return
        mv = _as_bytes_view(buf)
        n = _view_len(mv)
        if n:
            self._chunks.append(mv)
            self._size += n

    def extend(self, bufs) -> None:
        for b in bufs:
            self.append(b)

    @cython.locals(count=cython.Py_ssize_t, left=cython.Py_ssize_t, size=cython.Py_ssize_t)
    def cut(self, n: int) -> list:
        """Remove and return the first `n` bytes as a list of buffers (views, never copies)."""
        if n < 0 or n > self._size:
            raise LocalProtocolError(f"cannot cut {n} bytes from an IOBuf of {self._size}")
        count = left = n
        out = []
        chunks = self._chunks
        while left:
            head = chunks[0]
            size = len(head) if type(head) is bytes else _view_len(head)
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

    def cut_all(self) -> list:
        out = list(self._chunks)
        self._chunks.clear()
        self._size = 0
        return out

    def clear(self) -> None:
        self._chunks.clear()
        self._size = 0


class ReadBuffer:
    """Receive buffer for asyncio.BufferedProtocol (get_buffer / buffer_updated).

    Every method that moves the positions checks its input: compiled, a wrong size would be a
    wild pointer in the frame reader, not an odd view. The methods with a leading underscore
    are C functions when compiled (the frame reader calls them so); each public one is their
    Python entry.
    """

    if not cython.compiled:
        __slots__ = ("_block", "_block_size", "_start", "_end", "_large", "_large_filled",
                     "_large_total", "_large_pad", "_complete", "reused_large_buffers",
                     "_header_only", "large_threshold", "copied_bytes")

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE,
                 large_threshold: int = DEFAULT_LARGE_THRESHOLD) -> None:
        if block_size < 2 * large_threshold or large_threshold < _HEADER:
            raise LocalProtocolError(
                f"block_size ({block_size}) must be at least twice large_threshold ({large_threshold})")
        self._block_size = block_size
        self._block = bytearray()  # made at the first read: a silent connection holds no block
        self._start = 0
        self._end = 0
        self._large = None
        self._large_filled = 0
        self._large_pad = 0  # where the frame starts in _large (it ends LARGE_ALIGN-aligned)
        self._large_total = 0  # the frame's size; the buffer has HEADER_SIZE bytes more
        self._complete = None  # a complete large frame (a view) parked until taken
        self.reused_large_buffers = 0
        self._header_only = False
        self.large_threshold = large_threshold
        self.copied_bytes = 0

    # -- kernel side -------------------------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        return self._get_buffer()

    def _get_buffer(self) -> memoryview:
        if self._large is not None:
            if self._large_filled < self._large_total:
                return _narrow(memoryview(self._large), self._large_pad + self._large_filled,
                               self._large_total + _HEADER - self._large_filled)
            # Complete but not taken yet (a caller feeding before parsing): park it and go on
            # reading into the block.
            self._complete = self._finish_large()
        if self._start == self._end and self._unshared():
            self._start = self._end = 0
            if len(self._block) != self._block_size:
                self._block = bytearray(self._block_size)
        free = len(self._block) - self._end
        if free < _HEADER or (free < self.large_threshold and self._start != self._end):
            self._new_block()
        if self._header_only and self._end - self._start < _HEADER:
            # After a large frame: read just the rest of the next header, so a following large
            # frame is received straight into its own buffer.
            return _narrow(memoryview(self._block), self._end, self._start + _HEADER - self._end)
        return _narrow(memoryview(self._block), self._end, len(self._block) - self._end)

    def buffer_updated(self, nbytes: int) -> None:
        self._buffer_updated(nbytes)

    def _buffer_updated(self, nbytes: int) -> int:
        room = (self._large_total + _HEADER - self._large_filled if self._large is not None
                else len(self._block) - self._end)
        if nbytes < 0 or nbytes > room:
            raise LocalProtocolError(
                f"buffer_updated({nbytes}) is outside the {room} bytes that get_buffer offered")
        if self._large is not None:
            self._large_filled += nbytes
        else:
            self._end += nbytes
            if self._header_only and self._end - self._start > _HEADER:
                self._header_only = False
        return 0

    @cython.locals(pos=cython.Py_ssize_t, n=cython.Py_ssize_t, k=cython.Py_ssize_t)
    def feed(self, data) -> None:
        """Copy `data` in as if the kernel had read it (tests and non-buffered transports)."""
        mv = _as_bytes_view(data)
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
            self._buffer_updated(k)
            pos += k

    # -- parser side -------------------------------------------------------------------------
    def available(self) -> int:
        """Unconsumed bytes in the shared block (a large frame in progress is not counted)."""
        return self._end - self._start

    def peek(self, n: int) -> memoryview:
        return memoryview(self._block)[self._start:self._start + n]

    def take(self, n: int) -> memoryview:
        """Consume `n` bytes of the block, returned as a view (no copy)."""
        s = self._start
        self._consume(n)
        return memoryview(self._block)[s:self._start]

    def skip(self, n: int) -> None:
        self._consume(n)

    def _consume(self, n: int) -> int:
        if n < 0 or n > self._end - self._start:
            raise LocalProtocolError(
                f"cannot consume {n} bytes, {self._end - self._start} are available")
        self._start += n
        return 0

    def begin_large(self, total: int) -> None:
        """The frame starting at the read position is `total` bytes: give it its own buffer."""
        self._begin_large(total)

    def _begin_large(self, total: int) -> int:
        have = self._end - self._start
        size = total + _HEADER + _ALIGN
        large = _large_buffers.take(size)
        if large is not None:
            self.reused_large_buffers += 1
        else:
            large = bytearray(size)
        pad = 0
        if have > total + _HEADER:  # only a direct begin_large() with a made-up total
            large[:have] = memoryview(self._block)[self._start:self._end]  # may grow `large`
        else:
            # The frame ends LARGE_ALIGN-aligned, so its attachment (the frame's end) starts
            # aligned to its size's power of two (the module's docstring).
            pad = (_ALIGN - (_address(large) + total) % _ALIGN) % _ALIGN
            _copy(large, pad, self._block, self._start, have)
        self.copied_bytes += have
        self._large_pad = pad
        self._start = self._end
        self._large = large
        self._large_filled = have
        self._large_total = total
        return 0

    def large_pending(self) -> bool:
        return self._large is not None or self._complete is not None

    def take_large(self) -> memoryview | None:
        """The large frame's buffer once it is complete, else None."""
        return self._take_large()

    def _take_large(self):
        if self._complete is not None:
            frame, self._complete = self._complete, None
            return frame
        if self._large is None or self._large_filled < self._large_total:
            return None
        return self._finish_large()

    def _finish_large(self) -> memoryview:
        """The complete large frame as a view; the bytes read past it go to the block."""
        large, total, pad = self._large, self._large_total, self._large_pad
        spare = self._large_filled - total
        self._large = None
        self._large_filled = self._large_total = 0
        self._header_only = True
        if spare:  # the start of the next frame (at most HEADER_SIZE bytes)
            if len(self._block) - self._end < spare:
                self._new_block()
            _copy(self._block, self._end, large, pad + total, spare)
            self._end += spare
            self.copied_bytes += spare
        _large_buffers.put(large)
        return _narrow(memoryview(large), pad, total)

    def pending_bytes(self) -> int:
        """Bytes received but not yet consumed (a partial frame)."""
        done = len(self._complete) if self._complete is not None else 0
        return self._end - self._start + self._large_filled + done

    def clear(self) -> None:
        """Drop everything buffered (connection closed)."""
        self._large = None
        self._complete = None
        self._large_filled = self._large_total = 0
        self._start = self._end = 0
        self._block = bytearray()  # views of the old block keep it alive as long as they need

    def release(self) -> bool:
        """Let the block go when nothing is buffered and nothing views it, so an idle connection
        holds no block (the next read makes one). Whether one was released."""
        if (self._start != self._end or self._large is not None or self._complete is not None
                or not len(self._block) or not self._unshared()):
            return False
        self._block = bytearray()
        self._start = self._end = 0
        return True

    # -- internals ---------------------------------------------------------------------------
    def _unshared(self) -> bool:
        if cython.compiled:
            block = cython.cast(cython.pointer(PyObject), self._block)
            return _refcnt(block) == 1 and cython.cast(cython.pointer(PyByteArrayObject), block).ob_exports == 0
        else:
            # References: self._block and getrefcount's argument. Each live view of the block
            # holds one more (through its managed buffer).
            return sys.getrefcount(self._block) <= 2

    def _new_block(self) -> int:
        # Move the unconsumed tail to the front of a block with room for a small frame. The
        # tail is normally one partial frame under large_threshold; it is larger only when a
        # caller feeds many frames before consuming them, and then the block grows.
        have = self._end - self._start
        size = self._block_size if have <= self._block_size - self.large_threshold \
            else have + self._block_size
        if self._unshared() and len(self._block) >= size:
            _copy(self._block, 0, self._block, self._start, have)
        else:
            block = bytearray(size)
            _copy(block, 0, self._block, self._start, have)
            self._block = block
        self.copied_bytes += have
        self._start = 0
        self._end = have
        return 0
