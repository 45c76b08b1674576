# Types of meta.py when Cython compiles it (aiobrpc/_compiled.py): what it cimports, its C
# globals and the encoder's struct. The .py file is the source of both builds and declares its
# own C functions (cython.cfunc): declared here, they would be exported through the module's C
# API, and gcc then does not inline the small ones.

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_SetItem
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsUnsignedLongLong, PyLong_Check
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyTypeObject
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memmove

from ._bytes cimport HEADER, acquire_bytes, put_u32

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object, Py_ssize_t*) except NULL
    object PyUnicode_DecodeUTF8(const char*, Py_ssize_t, const char*)
    const Py_ssize_t PY_SSIZE_T_MAX
    Py_buffer* PyMemoryView_GET_BUFFER(object)
    Py_ssize_t PyUnicode_GET_LENGTH(object)
    void* PyUnicode_DATA(object)
    # the member descriptors that replace Cython's field properties (meta.py says why)
    ctypedef struct PyMemberDef:
        const char* name
        int type
        Py_ssize_t offset
        int flags
        const char* doc
    object PyDescr_NewMember(PyTypeObject*, PyMemberDef*)
    void PyType_Modified(PyTypeObject*)
    enum: T_OBJECT_EX

cdef enum:
    _NFIELDS = 23
    _NAME_SLOTS = 64  # power of two

cdef Py_ssize_t _STACK_SIZE, _MAX_GROUP_DEPTH, _NAME_MAX, _MAX_USER_FIELDS
cdef long long _U32_MAX
cdef list _names
cdef PyMemberDef _members[_NFIELDS]
cdef Py_ssize_t _offsets[_NFIELDS]


# an encoder's output: `n` of `cap` bytes used, on the stack or the heap
cdef struct _Out:
    unsigned char* buf
    Py_ssize_t n
    Py_ssize_t cap
    bint on_heap
