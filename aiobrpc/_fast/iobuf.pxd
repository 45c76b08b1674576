# Types of iobuf.py when Cython compiles it (aiobrpc/_compiled.py); framing.py cimports
# ReadBuffer and calls its C methods. The .py file is the source of both builds.

cimport cython
from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.ref cimport PyObject
from libc.string cimport memmove

cdef extern from "Python.h":
    ctypedef struct PyByteArrayObject:
        Py_ssize_t ob_exports
    Py_ssize_t _refcnt "Py_REFCNT" (PyObject*)
    Py_buffer* PyMemoryView_GET_BUFFER(object)


cdef class LargeBufferCache:
    cdef list _buffers
    cdef public Py_ssize_t nbytes
    cdef public Py_ssize_t max_bytes
    cdef public Py_ssize_t max_buffers

    @cython.locals(i=Py_ssize_t, buf=bytearray, unused=bint)
    cpdef object take(self, Py_ssize_t size)
    @cython.locals(size=Py_ssize_t)
    cpdef put(self, bytearray buf)


cdef Py_ssize_t _HEADER, _ALIGN
cdef LargeBufferCache _large_buffers

cdef size_t _address(bytearray buf)
cdef Py_ssize_t _view_len(object view)
@cython.locals(b="Py_buffer*")
cdef object _narrow(object view, Py_ssize_t start, Py_ssize_t n)
cdef void _copy(bytearray dst, Py_ssize_t at, bytearray src, Py_ssize_t start, Py_ssize_t n) noexcept


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

    @cython.locals(free=Py_ssize_t)
    cdef object _get_buffer(self)
    @cython.locals(room=Py_ssize_t)
    cdef int _buffer_updated(self, Py_ssize_t nbytes) except -1
    cdef int _consume(self, Py_ssize_t n) except -1
    @cython.locals(have=Py_ssize_t, size=Py_ssize_t, pad=Py_ssize_t)
    cdef int _begin_large(self, Py_ssize_t total) except -1
    cdef object _take_large(self)
    @cython.locals(large=bytearray, total=Py_ssize_t, pad=Py_ssize_t, spare=Py_ssize_t)
    cdef object _finish_large(self)
    @cython.locals(block="PyObject*")
    cdef bint _unshared(self) noexcept
    @cython.locals(have=Py_ssize_t, size=Py_ssize_t)
    cdef int _new_block(self) except -1
