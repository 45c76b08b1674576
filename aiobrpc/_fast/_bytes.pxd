# C helpers shared by meta.py, iobuf.py and framing.py compiled (inline: there is no _bytes module).

from cpython.buffer cimport PyBUF_SIMPLE, PyObject_CheckBuffer, PyObject_GetBuffer
from libc.stdint cimport uint32_t, uint64_t

cdef enum:
    HEADER = 12  # bytes in a baidu_std frame header (HEADER_SIZE)


cdef inline uint64_t get_u32(const unsigned char* p) noexcept nogil:
    """The big-endian uint32 at p, widened so that sums of sizes cannot wrap."""
    return ((<uint64_t>p[0] << 24) | (<uint64_t>p[1] << 16) | (<uint64_t>p[2] << 8)
            | <uint64_t>p[3])


cdef inline void put_u32(unsigned char* p, uint32_t v) noexcept nogil:
    p[0] = <unsigned char>(v >> 24)
    p[1] = <unsigned char>(v >> 16)
    p[2] = <unsigned char>(v >> 8)
    p[3] = <unsigned char>v


cdef inline object acquire_bytes(object obj, Py_buffer* view):
    """Fill `view` (PyBUF_SIMPLE, so flat bytes) over `obj`; the caller releases it.

    Returns the object the view is over: `obj` itself, or a contiguous copy when `obj` is a
    strided view (which the pure twins index happily and PyBUF_SIMPLE refuses). Returns None,
    leaving `view` unset, when `obj` has no buffer at all.
    """
    if not PyObject_CheckBuffer(obj):
        return None
    try:
        PyObject_GetBuffer(obj, view, PyBUF_SIMPLE)
        return obj
    except BufferError:
        pass
    obj = memoryview(obj).tobytes()
    PyObject_GetBuffer(obj, view, PyBUF_SIMPLE)
    return obj
