"""RpcMeta codec compiled: the twin of `meta_py.py`, whose docstrings are the specification.

Encoding writes into a stack buffer (moved to the heap only if a meta outgrows it) with C
varints; a sub-message gets a one-byte length slot, widened in place in the rare case that it
turns out to be 128 bytes or more. Decoding walks a (pointer, length) cursor over the caller's
buffer. Inputs the fast paths do not model (a duck-typed meta object, a deleted field, a flag
that is not a bool, user_fields that are not a list or tuple of pairs, an odd magic or
payload_size) are handed to the pure twin, so their behaviour, errors included, is the pure
twin's by construction.
"""

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsUnsignedLongLong, PyLong_Check
from cpython.dict cimport PyDict_SetItem
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyTypeObject
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memmove

from ._bytes cimport HEADER, acquire_bytes, put_u32

from ..errors import LocalProtocolError, RemoteProtocolError
from . import meta_py

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object, Py_ssize_t*) except NULL
    object PyUnicode_DecodeUTF8(const char*, Py_ssize_t, const char*)
    const Py_ssize_t PY_SSIZE_T_MAX
    Py_buffer* PyMemoryView_GET_BUFFER(object)
    Py_ssize_t PyUnicode_GET_LENGTH(object)
    void* PyUnicode_DATA(object)

cdef enum:
    _STACK_SIZE = 512  # bytes of meta encoded without touching the heap
    _MAX_GROUP_DEPTH = 32
    _NAME_SLOTS = 64  # power of two
    _NAME_MAX = 64

# Entries of user_fields a decoded meta holds at most: one more says the frame had more (and
# was refused); those after it are skipped unread (meta_py.py says why).
MAX_USER_FIELDS = 1024
cdef Py_ssize_t _MAX_USER_FIELDS = MAX_USER_FIELDS

_FIELDS = (
    "has_request", "service_name", "method_name", "log_id", "trace_id", "span_id",
    "parent_span_id", "request_id", "timeout_ms",
    "has_response", "error_code", "error_text",
    "compress_type", "correlation_id", "attachment_size", "chunk_info",
    "authentication_data", "stream_settings", "user_fields", "content_type",
    "checksum_type", "checksum_value", "checksum_with_attachment",
)


@cython.freelist(64)
@cython.auto_pickle(False)  # its generated code would read deleted (NULL) fields
cdef class RpcMeta:
    """One frame's RpcMeta. Field names are brpc's; None means absent on the wire."""

    cdef public object has_request, service_name, method_name, log_id, trace_id, span_id
    cdef public object parent_span_id, request_id, timeout_ms
    cdef public object has_response, error_code, error_text
    cdef public object compress_type, correlation_id, attachment_size, chunk_info
    cdef public object authentication_data, stream_settings, user_fields, content_type
    cdef public object checksum_type, checksum_value, checksum_with_attachment

    def __cinit__(self):
        # The other fields start as None (Cython initialises object fields so).
        self.has_request = False
        self.has_response = False

    cdef tuple _values(self):
        if not _complete(self):  # a field was deleted: raise the pure twin's AttributeError
            return tuple([getattr(self, k) for k in _FIELDS])
        return (self.has_request, self.service_name, self.method_name, self.log_id,
                self.trace_id, self.span_id, self.parent_span_id, self.request_id,
                self.timeout_ms, self.has_response, self.error_code, self.error_text,
                self.compress_type, self.correlation_id, self.attachment_size, self.chunk_info,
                self.authentication_data, self.stream_settings, self.user_fields,
                self.content_type, self.checksum_type, self.checksum_value,
                self.checksum_with_attachment)

    def __repr__(self):
        shown = ", ".join([f"{k}={v!r}" for k, v in zip(_FIELDS, self._values())
                           if v is not None and v is not False])
        return f"RpcMeta({shown})"

    def __eq__(self, other):
        # Duck-typed like the pure twin, so pure and compiled metas compare equal.
        if not hasattr(other, "has_request") or not hasattr(other, "checksum_with_attachment"):
            return NotImplemented
        for k, v in zip(_FIELDS, self._values()):
            if not (v == getattr(other, k)):
                return False
        return True

    __hash__ = None

    def __reduce__(self):
        return _rebuild, (self._values(),)


def _rebuild(values):
    m = RpcMeta()
    for k, v in zip(_FIELDS, values):
        setattr(m, k, v)
    return m


# Attribute access from Python. Cython exposes `public` fields through getset properties,
# which cost ~20 ns a read or write, 5x a __slots__ member (the pure twin), and the protocol
# layer touches a dozen fields per call. So the properties are replaced by the same member
# descriptors __slots__ makes (T_OBJECT_EX), which the interpreter specialises. Like a slot,
# such a field can be deleted, leaving NULL where Cython expects an object: C code reads the
# fields of a caller's RpcMeta only after _complete() (decode fills a fresh one).

cdef extern from "Python.h":
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

cdef PyMemberDef _members[_NFIELDS]
cdef Py_ssize_t _offsets[_NFIELDS]
_member_names = tuple([k.encode() for k in _FIELDS])  # _members points into these


cdef inline bint _complete(RpcMeta m) noexcept:
    cdef char* base = <char*><PyObject*>m
    cdef int i
    for i in range(_NFIELDS):
        if (<PyObject**>(base + _offsets[i]))[0] == NULL:
            return False
    return True


cdef int _use_member_descriptors() except -1:
    cdef PyTypeObject* t = <PyTypeObject*>RpcMeta
    cdef PyObject** words
    cdef Py_ssize_t i, w
    # Where each field lives: set it to a marker through the Cython property and find it.
    probe = RpcMeta.__new__(RpcMeta)
    markers = [object() for _ in _FIELDS]
    for k, marker in zip(_FIELDS, markers):
        setattr(probe, k, marker)
    words = <PyObject**><PyObject*>probe
    for i in range(_NFIELDS):
        _offsets[i] = -1
        for w in range(<Py_ssize_t>(sizeof(PyObject) // sizeof(PyObject*)),
                       t.tp_basicsize // <Py_ssize_t>sizeof(PyObject*)):
            if words[w] == <PyObject*>markers[i]:
                _offsets[i] = w * <Py_ssize_t>sizeof(PyObject*)
        if _offsets[i] < 0:
            raise ImportError(f"RpcMeta.{_FIELDS[i]} not found in the object layout")
    for i in range(_NFIELDS):
        _members[i].name = PyBytes_AS_STRING(_member_names[i])
        _members[i].type = T_OBJECT_EX
        _members[i].offset = _offsets[i]
        _members[i].flags = 0
        _members[i].doc = NULL
        PyDict_SetItem(<object>t.tp_dict, _FIELDS[i], PyDescr_NewMember(t, &_members[i]))
    PyType_Modified(t)
    return 0


_use_member_descriptors()


# ---------------------------------------------------------------------------------------------
# encoding

cdef struct _Out:
    unsigned char* buf
    Py_ssize_t n
    Py_ssize_t cap
    bint on_heap


cdef int _grow(_Out* o, Py_ssize_t extra) except -1:
    cdef Py_ssize_t cap
    cdef unsigned char* p
    if extra > PY_SSIZE_T_MAX - o.n:
        raise MemoryError()
    cap = o.cap * 2 if o.cap <= PY_SSIZE_T_MAX // 2 else PY_SSIZE_T_MAX
    if cap < o.n + extra:
        cap = o.n + extra
    if o.on_heap:
        p = <unsigned char*>PyMem_Realloc(o.buf, <size_t>cap)
    else:
        p = <unsigned char*>PyMem_Malloc(<size_t>cap)
        if p != NULL:
            memcpy(p, o.buf, <size_t>o.n)
    if p == NULL:
        raise MemoryError()
    o.buf = p
    o.cap = cap
    o.on_heap = True
    return 0


cdef inline int _reserve(_Out* o, Py_ssize_t extra) except -1:
    if extra > o.cap - o.n:
        _grow(o, extra)
    return 0


cdef inline int _varint_size(uint64_t v) noexcept nogil:
    cdef int k = 1
    while v > 0x7F:
        v >>= 7
        k += 1
    return k


cdef inline void _write_varint(unsigned char* p, uint64_t v) noexcept nogil:
    while v > 0x7F:
        p[0] = <unsigned char>((v & 0x7F) | 0x80)
        p += 1
        v >>= 7
    p[0] = <unsigned char>v


cdef inline int _put_varint_field(_Out* o, unsigned char tag, uint64_t v) except -1:
    _reserve(o, 11)
    o.buf[o.n] = tag
    _write_varint(o.buf + o.n + 1, v)
    o.n += 1 + _varint_size(v)
    return 0


cdef int _put_bytes_field(_Out* o, unsigned char tag, const char* p, Py_ssize_t n) except -1:
    _reserve(o, 11)
    o.buf[o.n] = tag
    _write_varint(o.buf + o.n + 1, <uint64_t>n)
    o.n += 1 + _varint_size(<uint64_t>n)
    _reserve(o, n)
    memcpy(o.buf + o.n, p, <size_t>n)
    o.n += n
    return 0


cdef Py_ssize_t _open(_Out* o, unsigned char tag) except -1:
    """Start a sub-message: its tag and a one-byte length slot. Returns where its bytes start."""
    _reserve(o, 2)
    o.buf[o.n] = tag
    o.buf[o.n + 1] = 0
    o.n += 2
    return o.n


cdef int _close(_Out* o, Py_ssize_t start) except -1:
    cdef Py_ssize_t size = o.n - start
    cdef int k = _varint_size(<uint64_t>size)
    if k > 1:
        _reserve(o, k - 1)
        memmove(o.buf + start - 1 + k, o.buf + start, <size_t>size)
        o.n += k - 1
    _write_varint(o.buf + start - 1, <uint64_t>size)
    return 0


cdef int _int64(_Out* o, unsigned char tag, object v, str name) except -1:
    cdef int overflow = 0
    cdef long long s
    cdef uint64_t u = 0
    if not isinstance(v, int):
        raise LocalProtocolError(f"RpcMeta.{name} must be an int, got {type(v).__name__}")
    s = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow == 0:
        u = <uint64_t>s
    elif overflow > 0:
        try:
            u = PyLong_AsUnsignedLongLong(v)
        except OverflowError:
            overflow = 2
    if overflow < 0 or overflow == 2:
        raise LocalProtocolError(f"RpcMeta.{name}={v} does not fit in 64 bits")
    return _put_varint_field(o, tag, u)


cdef int _int32(_Out* o, unsigned char tag, object v, str name) except -1:
    cdef int overflow = 0
    cdef long long s
    if not isinstance(v, int):
        raise LocalProtocolError(f"RpcMeta.{name} must be an int, got {type(v).__name__}")
    s = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow != 0 or s < -2147483648LL or s > 2147483647LL:
        raise LocalProtocolError(f"RpcMeta.{name}={v} does not fit in int32")
    # A negative int32 goes on the wire sign-extended to 64 bits (10 bytes), as protobuf does.
    return _put_varint_field(o, tag, <uint64_t>s)


cdef int _blob(_Out* o, unsigned char tag, object v, str name) except -1:
    cdef const char* p
    cdef Py_ssize_t n
    cdef Py_buffer view
    if isinstance(v, str):
        p = PyUnicode_AsUTF8AndSize(v, &n)
        return _put_bytes_field(o, tag, p, n)
    if isinstance(v, bytes):
        return _put_bytes_field(o, tag, PyBytes_AS_STRING(v), len(<bytes>v))
    if isinstance(v, bytearray):  # read directly: a subclass's __buffer__ would be Python code
        return _put_bytes_field(o, tag, PyByteArray_AS_STRING(v), PyByteArray_GET_SIZE(v))
    if not isinstance(v, memoryview):
        raise LocalProtocolError(f"RpcMeta.{name} must be str or bytes, got {type(v).__name__}")
    try:
        PyObject_GetBuffer(v, &view, PyBUF_SIMPLE)
    except BufferError:
        # the pure twin's `bytearray += v` reports a refused buffer as this TypeError
        raise TypeError(f"can't concat {type(v).__name__} to bytearray") from None
    try:
        if PyMemoryView_GET_BUFFER(v).ndim == 0:
            len(v)  # raises the pure twin's TypeError (0-dim memory has no length)
        _put_bytes_field(o, tag, <const char*>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)
    return 0


cdef bint _fast_path(object meta):
    """Can _encode_into take `meta`? Only if encoding it runs no Python code: an RpcMeta of
    this class with no field deleted, flags that are bools (no __bool__ to call), user_fields
    a list or tuple of pairs. Anything else goes to the pure twin, which then defines the
    behaviour."""
    cdef RpcMeta m
    if type(meta) is not RpcMeta or not _complete(<RpcMeta>meta):
        return False
    m = <RpcMeta>meta
    if type(m.has_request) is not bool or type(m.has_response) is not bool:
        return False
    if m.checksum_with_attachment is not None and type(m.checksum_with_attachment) is not bool:
        return False
    if m.user_fields is None:
        return True
    if type(m.user_fields) is not list and type(m.user_fields) is not tuple:
        return False
    for item in m.user_fields:
        if (type(item) is not tuple and type(item) is not list) or len(item) != 2:
            return False
    return True


cdef int _encode_into(_Out* o, RpcMeta m) except -1:
    # Runs no Python code (see _fast_path), so reading fields straight from `m` is safe.
    cdef Py_ssize_t start
    if m.has_request:
        if m.service_name is None or m.method_name is None:
            raise LocalProtocolError("a request meta needs service_name and method_name")
        start = _open(o, 0x0A)
        _blob(o, 0x0A, m.service_name, "service_name")
        _blob(o, 0x12, m.method_name, "method_name")
        if m.log_id is not None:
            _int64(o, 0x18, m.log_id, "log_id")
        if m.trace_id is not None:
            _int64(o, 0x20, m.trace_id, "trace_id")
        if m.span_id is not None:
            _int64(o, 0x28, m.span_id, "span_id")
        if m.parent_span_id is not None:
            _int64(o, 0x30, m.parent_span_id, "parent_span_id")
        if m.request_id is not None:
            _blob(o, 0x3A, m.request_id, "request_id")
        if m.timeout_ms is not None:
            _int32(o, 0x40, m.timeout_ms, "timeout_ms")
        _close(o, start)
    if m.has_response:
        start = _open(o, 0x12)
        if m.error_code is not None:
            _int32(o, 0x08, m.error_code, "error_code")
        if m.error_text is not None:
            _blob(o, 0x12, m.error_text, "error_text")
        _close(o, start)
    if m.compress_type is not None:
        _int32(o, 0x18, m.compress_type, "compress_type")
    if m.correlation_id is not None:
        _int64(o, 0x20, m.correlation_id, "correlation_id")
    if m.attachment_size is not None:
        _int32(o, 0x28, m.attachment_size, "attachment_size")
    if m.chunk_info is not None:
        _blob(o, 0x32, m.chunk_info, "chunk_info")
    if m.authentication_data is not None:
        _blob(o, 0x3A, m.authentication_data, "authentication_data")
    if m.stream_settings is not None:
        _blob(o, 0x42, m.stream_settings, "stream_settings")
    if m.user_fields is not None:
        for item in m.user_fields:
            key, value = item
            start = _open(o, 0x4A)
            _blob(o, 0x0A, key, "user_fields key")
            _blob(o, 0x12, value, "user_fields value")
            _close(o, start)
    if m.content_type is not None:
        _int32(o, 0x50, m.content_type, "content_type")
    if m.checksum_type is not None:
        _int32(o, 0x58, m.checksum_type, "checksum_type")
    if m.checksum_value is not None:
        _blob(o, 0x62, m.checksum_value, "checksum_value")
    if m.checksum_with_attachment is not None:
        _put_varint_field(o, 0x68, 1 if m.checksum_with_attachment else 0)
    return 0


def encode_meta(meta):
    """Serialize `meta` in field-number order, writing exactly the fields that are set."""
    cdef unsigned char stack[_STACK_SIZE]
    cdef _Out o
    if not _fast_path(meta):
        return meta_py.encode_meta(meta)
    o.buf = stack
    o.n = 0
    o.cap = _STACK_SIZE
    o.on_heap = False
    try:
        _encode_into(&o, <RpcMeta>meta)
        return PyBytes_FromStringAndSize(<char*>o.buf, o.n)
    finally:
        if o.on_heap:
            PyMem_Free(o.buf)


def pack_head(magic, meta, payload_size):
    """The 12-byte header followed by the serialized meta, as one buffer.

    `payload_size` is everything after the meta (data and attachment).
    """
    cdef unsigned char stack[_STACK_SIZE]
    cdef _Out o
    cdef int overflow = 0
    cdef long long payload = 0
    cdef uint64_t meta_size, body_size
    if PyLong_Check(payload_size):
        payload = PyLong_AsLongLongAndOverflow(payload_size, &overflow)
    if (type(magic) is not bytes or len(<bytes>magic) != 4 or not PyLong_Check(payload_size)
            or overflow != 0 or payload < 0 or payload > 0xFFFFFFFF or not _fast_path(meta)):
        return meta_py.pack_head(magic, meta, payload_size)
    o.buf = stack
    o.n = HEADER
    o.cap = _STACK_SIZE
    o.on_heap = False
    try:
        _encode_into(&o, <RpcMeta>meta)
        meta_size = <uint64_t>(o.n - HEADER)
        body_size = meta_size + <uint64_t>payload
        if body_size > 0xFFFFFFFF:
            raise LocalProtocolError(
                f"frame body of {body_size} bytes does not fit the 32-bit body_size")
        memcpy(o.buf, PyBytes_AS_STRING(magic), 4)
        put_u32(o.buf + 4, <uint32_t>body_size)
        put_u32(o.buf + 8, <uint32_t>meta_size)
        return PyBytes_FromStringAndSize(<char*>o.buf, o.n)
    finally:
        if o.on_heap:
            PyMem_Free(o.buf)


# ---------------------------------------------------------------------------------------------
# decoding: positions are Py_ssize_t with pos <= end throughout; a size read from the wire
# (uint64) is compared with `end - pos` before anything is added to pos.

cdef object _bad(str what):
    return RemoteProtocolError("RpcMeta does not parse: " + what)


cdef Py_ssize_t _read_varint(const unsigned char* b, Py_ssize_t pos, Py_ssize_t end,
                             uint64_t* out) except -1:
    cdef uint64_t result = 0
    cdef uint64_t c
    cdef int shift = 0
    while True:
        if pos >= end:
            raise _bad("truncated varint")
        c = b[pos]
        pos += 1
        if shift == 63 and c > 1:
            raise _bad("varint longer than 64 bits")
        result |= (c & 0x7F) << shift
        if c < 0x80:
            out[0] = result
            return pos
        shift += 7
        if shift > 63:
            raise _bad("varint longer than 10 bytes")


cdef inline Py_ssize_t _varint(const unsigned char* b, Py_ssize_t pos, Py_ssize_t end,
                               uint64_t* out) except -1:
    if pos < end and b[pos] < 0x80:
        out[0] = b[pos]
        return pos + 1
    return _read_varint(b, pos, end, out)


cdef Py_ssize_t _skip(const unsigned char* b, uint64_t wt, uint64_t field, Py_ssize_t pos,
                      Py_ssize_t end, int depth) except -1:
    cdef uint64_t n, tag
    if wt == 0:
        return _varint(b, pos, end, &n)
    if wt == 1:
        n = 8
    elif wt == 5:
        n = 4
    elif wt == 2:
        pos = _varint(b, pos, end, &n)
    elif wt == 3:
        if depth >= _MAX_GROUP_DEPTH:
            raise _bad("groups nested too deeply")
        while True:
            pos = _varint(b, pos, end, &tag)
            if tag >> 3 == 0:
                raise _bad("field number 0")
            if tag & 7 == 4:
                if tag >> 3 != field:
                    raise _bad("mismatched end of group")
                return pos
            pos = _skip(b, tag & 7, tag >> 3, pos, end, depth + 1)
    else:
        raise _bad(f"invalid wire type {wt}")
    if n > <uint64_t>(end - pos):
        raise _bad("field runs past the end of the meta")
    return pos + <Py_ssize_t>n


cdef inline Py_ssize_t _read_len(const unsigned char* b, Py_ssize_t pos, Py_ssize_t end,
                                 Py_ssize_t* stop) except -1:
    """Read a length prefix; returns where the bytes start and sets `stop` to where they end."""
    cdef uint64_t n
    pos = _varint(b, pos, end, &n)
    if n > <uint64_t>(end - pos):
        raise _bad("length-delimited field runs past the end of the meta")
    stop[0] = pos + <Py_ssize_t>n
    return pos


cdef object _text(const unsigned char* b, Py_ssize_t start, Py_ssize_t stop, str name):
    try:
        return PyUnicode_DecodeUTF8(<const char*>(b + start), stop - start, NULL)
    except UnicodeDecodeError:
        pass
    raise _bad(f"{name} is not valid UTF-8")


# service_name and method_name repeat on every call of a connection: decoded once into this
# small direct-mapped table, they come back as the same str object, whose hash (for the
# dispatch dict) is then computed once too. Only short ASCII names are kept.
cdef list _names = [None] * _NAME_SLOTS


cdef object _name(const unsigned char* b, Py_ssize_t start, Py_ssize_t stop):
    cdef Py_ssize_t n = stop - start
    cdef Py_ssize_t i
    cdef uint32_t h = 2166136261U
    cdef unsigned char high = 0
    if n > _NAME_MAX:
        return _text(b, start, stop, "request string field")
    for i in range(start, stop):
        high |= b[i]
        h = (h ^ b[i]) * 16777619U
    if high & 0x80:
        return _text(b, start, stop, "request string field")
    cached = _names[h & (_NAME_SLOTS - 1)]
    if (cached is not None and PyUnicode_GET_LENGTH(cached) == n
            and memcmp(PyUnicode_DATA(cached), b + start, <size_t>n) == 0):
        return cached
    text = PyUnicode_DecodeUTF8(<const char*>(b + start), n, NULL)  # ASCII: 1 byte a char
    _names[h & (_NAME_SLOTS - 1)] = text
    return text


cdef inline object _signed64(uint64_t v):
    return <int64_t>v


cdef inline object _signed32(uint64_t v):
    return <int32_t><uint32_t>(v & 0xFFFFFFFFULL)


cdef int _decode_request(RpcMeta m, const unsigned char* b, Py_ssize_t pos,
                         Py_ssize_t end) except -1:
    cdef uint64_t tag, field, wt, v
    cdef Py_ssize_t s
    while pos < end:
        pos = _varint(b, pos, end, &tag)
        field = tag >> 3
        wt = tag & 7
        if field == 0:
            raise _bad("field number 0")
        if wt == 2 and (field == 1 or field == 2 or field == 7):
            s = _read_len(b, pos, end, &pos)
            if field == 7:
                text = _text(b, s, pos, "request string field")
            else:
                text = _name(b, s, pos)
            if field == 1:
                m.service_name = text
            elif field == 2:
                m.method_name = text
            else:
                m.request_id = text
        elif wt == 0 and (3 <= field <= 6 or field == 8):
            pos = _varint(b, pos, end, &v)
            if field == 3:
                m.log_id = _signed64(v)
            elif field == 4:
                m.trace_id = _signed64(v)
            elif field == 5:
                m.span_id = _signed64(v)
            elif field == 6:
                m.parent_span_id = _signed64(v)
            else:
                m.timeout_ms = _signed32(v)
        else:
            pos = _skip(b, wt, field, pos, end, 0)
    return 0


cdef int _decode_response(RpcMeta m, const unsigned char* b, Py_ssize_t pos,
                          Py_ssize_t end) except -1:
    cdef uint64_t tag, field, wt, v
    cdef Py_ssize_t s
    while pos < end:
        pos = _varint(b, pos, end, &tag)
        field = tag >> 3
        wt = tag & 7
        if field == 0:
            raise _bad("field number 0")
        if field == 1 and wt == 0:
            pos = _varint(b, pos, end, &v)
            m.error_code = _signed32(v)
        elif field == 2 and wt == 2:
            s = _read_len(b, pos, end, &pos)
            m.error_text = _text(b, s, pos, "error_text")
        else:
            pos = _skip(b, wt, field, pos, end, 0)
    return 0


cdef tuple _decode_entry(const unsigned char* b, Py_ssize_t pos, Py_ssize_t end):
    cdef uint64_t tag, field, wt
    cdef Py_ssize_t s
    key = value = ""
    while pos < end:
        pos = _varint(b, pos, end, &tag)
        field = tag >> 3
        wt = tag & 7
        if field == 0:
            raise _bad("field number 0")
        if wt == 2 and (field == 1 or field == 2):
            s = _read_len(b, pos, end, &pos)
            text = _text(b, s, pos, "user_fields entry")
            if field == 1:
                key = text
            else:
                value = text
        else:
            pos = _skip(b, wt, field, pos, end, 0)
    return (key, value)


cdef int _decode(RpcMeta m, const unsigned char* b, Py_ssize_t end) except -1:
    cdef uint64_t tag, field, wt, v
    cdef Py_ssize_t pos = 0
    cdef Py_ssize_t s
    while pos < end:
        pos = _varint(b, pos, end, &tag)
        field = tag >> 3
        wt = tag & 7
        if field == 0:
            raise _bad("field number 0")
        if wt == 2:
            if field == 1:
                s = _read_len(b, pos, end, &pos)
                m.has_request = True
                _decode_request(m, b, s, pos)
                continue
            if field == 2:
                s = _read_len(b, pos, end, &pos)
                m.has_response = True
                _decode_response(m, b, s, pos)
                continue
            if field == 6 or field == 7 or field == 8 or field == 12:
                s = _read_len(b, pos, end, &pos)
                blob = PyBytes_FromStringAndSize(<const char*>(b + s), pos - s)
                if field == 6:
                    m.chunk_info = blob
                elif field == 7:
                    m.authentication_data = blob
                elif field == 8:
                    m.stream_settings = blob
                else:
                    m.checksum_value = blob
                continue
            if field == 9:
                s = _read_len(b, pos, end, &pos)
                if m.user_fields is None:
                    m.user_fields = []
                if len(m.user_fields) <= _MAX_USER_FIELDS:  # one past the limit shows it was passed
                    m.user_fields.append(_decode_entry(b, s, pos))
                continue
        elif wt == 0 and (3 <= field <= 5 or 10 <= field <= 11 or field == 13):
            pos = _varint(b, pos, end, &v)
            if field == 3:
                m.compress_type = _signed32(v)
            elif field == 4:
                m.correlation_id = _signed64(v)
            elif field == 5:
                m.attachment_size = _signed32(v)
            elif field == 10:
                m.content_type = _signed32(v)
            elif field == 11:
                m.checksum_type = _signed32(v)
            else:
                m.checksum_with_attachment = v != 0
            continue
        pos = _skip(b, wt, field, pos, end, 0)
    if m.has_request and (m.service_name is None or m.method_name is None):
        missing = "service_name" if m.service_name is None else "method_name"
        raise _bad(f"required field request.{missing} is missing")
    return 0


def decode_meta(buf):
    """Parse a serialized RpcMeta (bytes, bytearray or memoryview)."""
    cdef Py_buffer view
    cdef RpcMeta m
    owner = acquire_bytes(buf, &view)
    if owner is None:
        memoryview(buf)  # raises the pure twin's TypeError
        return meta_py.decode_meta(buf)
    try:
        m = RpcMeta.__new__(RpcMeta)
        _decode(m, <const unsigned char*>view.buf, view.len)
        return m
    finally:
        PyBuffer_Release(&view)
