# Types of framing.py when Cython compiles it (aiobrpc/_compiled.py). The .py file is the
# source of both builds.

cimport cython
from cpython.buffer cimport PyBuffer_Release
from cpython.bytearray cimport (PyByteArray_AS_STRING, PyByteArray_CheckExact,
                                PyByteArray_FromStringAndSize, PyByteArray_GET_SIZE)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_Check
from cpython.ref cimport PyObject
from libc.stdint cimport uint32_t
from libc.string cimport memcmp, memcpy, memmove

from ._bytes cimport acquire_bytes, get_u32, put_u32
from .iobuf cimport ReadBuffer, _narrow, _view_len

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

cdef Py_ssize_t _HEADER, _PIN_RATIO
cdef long long _U32_MAX

@cython.locals(p="const unsigned char*")
cdef int _kind_at(bytearray block, Py_ssize_t at) noexcept
@cython.locals(p="const unsigned char*")
cdef long long _u32_at(bytearray block, Py_ssize_t at) noexcept
@cython.locals(p="const unsigned char*")
cdef bint _prefix_ok_at(bytearray block, Py_ssize_t at, Py_ssize_t n) noexcept
cdef object _subview(object base, Py_ssize_t start, Py_ssize_t n)
cdef object _bad_magic(object head)
cdef int _begin_large(ReadBuffer rbuf, long long total) except -1

@cython.locals(view=Py_buffer, p="const unsigned char*", kind=int)
cpdef parse_header(buf)
@cython.locals(o1=int, o2=int, body="long long", meta="long long", n=Py_ssize_t,
               out="unsigned char*")
cpdef pack_header(magic, body_size, meta_size)
@cython.locals(v="Py_buffer*", owner="PyObject*", att="long long", overflow=int, at=Py_ssize_t)
cpdef split_payload(payload, attachment_size)
@cython.locals(view=Py_buffer, n=Py_ssize_t, p="const unsigned char*")
cpdef magic_prefix_ok(buf)


cdef class FrameReader:
    cdef readonly ReadBuffer rbuf
    cdef public long long max_body_size
    cdef public long long frames

    @cython.locals(rbuf=ReadBuffer, have=Py_ssize_t, s=Py_ssize_t, body_size="long long",
                   total="long long")
    cdef object _get_buffer(self)
    @cython.locals(rbuf=ReadBuffer, have=Py_ssize_t, s=Py_ssize_t, meta_end=Py_ssize_t,
                   body_size="long long", meta_size="long long", total="long long", kind=int,
                   block=bytearray)
    cpdef next_frame(self)
    @cython.locals(view="Py_buffer*", p="const unsigned char*", meta_end=Py_ssize_t, kind=int)
    cdef tuple _split_large(self, frame)
