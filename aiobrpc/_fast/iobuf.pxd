# C-level interface of iobuf.pyx, cimported by framing.pyx.


cdef class IOBuf:
    cdef object _chunks
    cdef Py_ssize_t _size


cdef class ReadBuffer:
    # Invariant: 0 <= _start <= _end <= len(_block) (_block_size, or more after a feed of
    # many frames at once), and 0 <= _large_filled <= len(_large) for a pending large frame,
    # whose buffer is _large_total + HEADER + 64 bytes (or more, after a direct begin_large()).
    # Every method that moves these checks its input.
    cdef bytearray _block
    cdef Py_ssize_t _block_size
    cdef Py_ssize_t _start
    cdef Py_ssize_t _end
    cdef bytearray _large
    cdef Py_ssize_t _large_filled
    cdef Py_ssize_t _large_total
    cdef Py_ssize_t _large_pad  # where the frame starts in _large (it ends 64-byte aligned)
    cdef object _complete  # a complete large frame (a memoryview) parked until taken
    cdef public long long reused_large_buffers
    cdef bint _header_only
    cdef public Py_ssize_t large_threshold
    cdef public long long copied_bytes

    cdef object _get_buffer(self)
    cdef int _buffer_updated(self, Py_ssize_t nbytes) except -1
    cdef int _consume(self, Py_ssize_t n) except -1
    cdef int _begin_large(self, Py_ssize_t total) except -1
    cdef object _take_large(self)
    cdef object _finish_large(self)
    cdef bint _unshared(self) noexcept
    cdef int _new_block(self) except -1
