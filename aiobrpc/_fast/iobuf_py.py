"""IOBuf-like buffers, pure-Python twin of `iobuf.pyx`.

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
"""

from __future__ import annotations

import ctypes
import sys
from collections import deque

from ..errors import LocalProtocolError

HEADER_SIZE = 12
DEFAULT_BLOCK_SIZE = 256 * 1024
DEFAULT_LARGE_THRESHOLD = 64 * 1024
LARGE_CACHE_MAX_BYTES = 64 * 1024 * 1024
LARGE_CACHE_MAX_BUFFERS = 16
LARGE_ALIGN = 64


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
            # references: the list, `buf`, and getrefcount's argument
            if len(buf) == size and sys.getrefcount(buf) == 3:
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


large_buffers = LargeBufferCache()


def _address(buf: bytearray) -> int:
    """Where `buf`'s bytes are in memory (the export ctypes takes ends with this call)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


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

    def append(self, buf) -> None:
        mv = _as_bytes_view(buf)
        n = mv.nbytes
        if n:
            self._chunks.append(buf if type(buf) is bytes else mv)
            self._size += n

    def extend(self, bufs) -> None:
        for b in bufs:
            self.append(b)

    def cut(self, n: int) -> list:
        """Remove and return the first `n` bytes as a list of buffers (views, never copies)."""
        if n < 0 or n > self._size:
            raise LocalProtocolError(f"cannot cut {n} bytes from an IOBuf of {self._size}")
        out = []
        left = n
        chunks = self._chunks
        while left:
            head = chunks[0]
            size = len(head) if type(head) is bytes else head.nbytes
            if size <= left:
                out.append(chunks.popleft())
                left -= size
            else:
                mv = memoryview(head) if type(head) is bytes else head
                out.append(mv[:left])
                chunks[0] = mv[left:]
                left = 0
        self._size -= n
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
    """Receive buffer for asyncio.BufferedProtocol (get_buffer / buffer_updated)."""

    __slots__ = ("_block", "_block_size", "_start", "_end", "_large", "_large_filled", "_large_total",
                 "_large_pad", "_complete", "reused_large_buffers", "_header_only", "large_threshold",
                 "copied_bytes")

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE,
                 large_threshold: int = DEFAULT_LARGE_THRESHOLD) -> None:
        if block_size < 2 * large_threshold or large_threshold < HEADER_SIZE:
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
        if self._large is not None:
            if self._large_filled < self._large_total:
                pad = self._large_pad
                return memoryview(self._large)[pad + self._large_filled:pad + self._large_total + HEADER_SIZE]
            # Complete but not taken yet (a caller feeding before parsing): park it and go on
            # reading into the block.
            self._complete = self._finish_large()
        if self._start == self._end and self._unshared():
            self._start = self._end = 0
            if len(self._block) != self._block_size:
                self._block = bytearray(self._block_size)
        free = len(self._block) - self._end
        if free < HEADER_SIZE or (free < self.large_threshold and self._start != self._end):
            self._new_block()
        if self._header_only and self._end - self._start < HEADER_SIZE:
            # After a large frame: read just the rest of the next header, so a following large
            # frame is received straight into its own buffer.
            return memoryview(self._block)[self._end:self._start + HEADER_SIZE]
        return memoryview(self._block)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        room = (self._large_total + HEADER_SIZE - self._large_filled if self._large is not None
                else len(self._block) - self._end)
        if nbytes < 0 or nbytes > room:
            raise LocalProtocolError(
                f"buffer_updated({nbytes}) is outside the {room} bytes that get_buffer offered")
        if self._large is not None:
            self._large_filled += nbytes
        else:
            self._end += nbytes
            if self._header_only and self._end - self._start > HEADER_SIZE:
                self._header_only = False

    def feed(self, data) -> None:
        """Copy `data` in as if the kernel had read it (tests and non-buffered transports)."""
        mv = _as_bytes_view(data)
        pos, n = 0, mv.nbytes
        while pos < n:
            buf = self.get_buffer(n - pos)
            k = min(len(buf), n - pos)
            buf[:k] = mv[pos:pos + k]
            self.buffer_updated(k)
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
        self.skip(n)
        return memoryview(self._block)[s:s + n]

    def skip(self, n: int) -> None:
        if n < 0 or n > self._end - self._start:
            raise LocalProtocolError(
                f"cannot consume {n} bytes, {self._end - self._start} are available")
        self._start += n

    def begin_large(self, total: int) -> None:
        """The frame starting at the read position is `total` bytes: give it its own buffer."""
        have = self._end - self._start
        size = total + HEADER_SIZE + LARGE_ALIGN
        large = large_buffers.take(size)
        if large is not None:
            self.reused_large_buffers += 1
        else:
            large = bytearray(size)
        if have > total + HEADER_SIZE:  # only a direct begin_large() with a made-up total
            pad = 0
            large[:have] = memoryview(self._block)[self._start:self._end]
        else:
            pad = -(_address(large) + total) % LARGE_ALIGN
            large[pad:pad + have] = memoryview(self._block)[self._start:self._end]
        self.copied_bytes += have
        self._large_pad = pad
        self._start = self._end
        self._large = large
        self._large_filled = have
        self._large_total = total

    def large_pending(self) -> bool:
        return self._large is not None or self._complete is not None

    def take_large(self) -> memoryview | None:
        """The large frame's buffer once it is complete, else None."""
        if self._complete is not None:
            frame, self._complete = self._complete, None
            return frame
        if self._large is None or self._large_filled < self._large_total:
            return None
        return self._finish_large()

    def _finish_large(self) -> memoryview:
        """The complete large frame as a view; the bytes read past it go to the block."""
        large, total, filled, pad = self._large, self._large_total, self._large_filled, self._large_pad
        self._large = None
        self._large_filled = self._large_total = 0
        self._header_only = True
        spare = filled - total
        if spare:  # the start of the next frame (at most HEADER_SIZE bytes)
            if len(self._block) - self._end < spare:
                self._new_block()
            self._block[self._end:self._end + spare] = memoryview(large)[pad + total:pad + filled]
            self._end += spare
            self.copied_bytes += spare
        large_buffers.put(large)
        return memoryview(large)[pad:pad + total]

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
        # References: self._block and getrefcount's argument. Each live view of the block
        # holds one more (through its managed buffer).
        return sys.getrefcount(self._block) <= 2

    def _new_block(self) -> None:
        # Move the unconsumed tail to the front of a block with room for a small frame. The
        # tail is normally one partial frame under large_threshold; it is larger only when a
        # caller feeds many frames before consuming them, and then the block grows.
        have = self._end - self._start
        size = self._block_size if have <= self._block_size - self.large_threshold \
            else have + self._block_size
        if self._unshared() and len(self._block) >= size:
            block = self._block
            if have:
                block[:have] = block[self._start:self._end]
        else:
            block = bytearray(size)
            if have:
                block[:have] = memoryview(self._block)[self._start:self._end]
        self.copied_bytes += have
        self._block = block
        self._start = 0
        self._end = have
