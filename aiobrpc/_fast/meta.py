"""RpcMeta codec: one source, compiled by Cython (pure-Python mode, types in meta.pxd) or run
as Python (aiobrpc/_compiled.py chooses, once per process).

A hand-written proto2 codec for brpc's RpcMeta (brpc's src/brpc/policy/baidu_rpc_meta.proto)
instead of the generated protobuf class, for two reasons: it is the per-call hot path (the
generated class costs an object graph per call), and byte-exact output needs control that
protobuf does not give (field presence as C++ writes it, user_fields in the caller's order).

`RpcMeta` is flat: the request sub-message's fields and the response sub-message's fields live
on the same object, with `has_request` / `has_response` telling whether each sub-message is
present. Every other field is None when absent from the wire (proto2 presence).

Decoding follows protobuf's rules: unknown fields (any wire type, groups included) are
skipped, a known field with an unexpected wire type is treated as unknown, a repeated scalar
keeps the last value, a repeated sub-message merges, a missing required field of the request
sub-message fails. Anything malformed raises RemoteProtocolError.

Each direction is one code for both builds; the few lines that differ sit under
`if cython.compiled:` in small helpers. Compiled, decoding walks a C pointer over the caller's
buffer with the position in a one-element C array, and encoding writes into a stack buffer
(moved to the heap only if a meta outgrows it) with C varints; as Python, a memoryview with the
position in a one-element list, and a bytearray.
"""

from __future__ import annotations

try:
    import cython
except ImportError:  # the pure build runs without Cython
    from .. import _cython_shim as cython

from ..errors import LocalProtocolError, RemoteProtocolError

_MASK64 = 0xFFFFFFFFFFFFFFFF
_MAX_GROUP_DEPTH = 32
_STACK_SIZE = 512  # bytes of meta encoded compiled without touching the heap (the locals below)
_NAME_MAX = 64
_U32_MAX = 0xFFFFFFFF  # Cython compares ints past 2**31 as Python objects, C variables in C

# Entries of user_fields a decoded meta holds at most: one more says the frame had more (and
# was refused); those after it are skipped unread, so a frame of 100k tiny entries costs
# no more Python objects than this many (brpc has no limit).
MAX_USER_FIELDS = 1024
_MAX_USER_FIELDS = MAX_USER_FIELDS

_FIELDS = (
    "has_request", "service_name", "method_name", "log_id", "trace_id", "span_id",
    "parent_span_id", "request_id", "timeout_ms",
    "has_response", "error_code", "error_text",
    "compress_type", "correlation_id", "attachment_size", "chunk_info",
    "authentication_data", "stream_settings", "user_fields", "content_type",
    "checksum_type", "checksum_value", "checksum_with_attachment",
)


@cython.freelist(64)  # here, not in meta.pxd: Cython reads a class's directives only here
@cython.cclass
class RpcMeta:
    """One frame's RpcMeta. Field names are brpc's; None means absent on the wire."""

    if cython.compiled:
        has_request = cython.declare(object, visibility="public")
        service_name = cython.declare(object, visibility="public")
        method_name = cython.declare(object, visibility="public")
        log_id = cython.declare(object, visibility="public")
        trace_id = cython.declare(object, visibility="public")
        span_id = cython.declare(object, visibility="public")
        parent_span_id = cython.declare(object, visibility="public")
        request_id = cython.declare(object, visibility="public")
        timeout_ms = cython.declare(object, visibility="public")
        has_response = cython.declare(object, visibility="public")
        error_code = cython.declare(object, visibility="public")
        error_text = cython.declare(object, visibility="public")
        compress_type = cython.declare(object, visibility="public")
        correlation_id = cython.declare(object, visibility="public")
        attachment_size = cython.declare(object, visibility="public")
        chunk_info = cython.declare(object, visibility="public")
        authentication_data = cython.declare(object, visibility="public")
        stream_settings = cython.declare(object, visibility="public")
        user_fields = cython.declare(object, visibility="public")
        content_type = cython.declare(object, visibility="public")
        checksum_type = cython.declare(object, visibility="public")
        checksum_value = cython.declare(object, visibility="public")
        checksum_with_attachment = cython.declare(object, visibility="public")
    else:
        __slots__ = _FIELDS

    def __cinit__(self):
        # Compiled: runs for RpcMeta.__new__ too, and the other fields start as None.
        self.has_request = False
        self.has_response = False

    if not cython.compiled:
        def __init__(self) -> None:
            self.has_request = False
            self.service_name = None
            self.method_name = None
            self.log_id = None
            self.trace_id = None
            self.span_id = None
            self.parent_span_id = None
            self.request_id = None
            self.timeout_ms = None
            self.has_response = False
            self.error_code = None
            self.error_text = None
            self.compress_type = None
            self.correlation_id = None
            self.attachment_size = None
            self.chunk_info = None
            self.authentication_data = None
            self.stream_settings = None
            self.user_fields = None
            self.content_type = None
            self.checksum_type = None
            self.checksum_value = None
            self.checksum_with_attachment = None

    @cython.cfunc
    @cython.returns(tuple)
    def _values(self) -> tuple:
        if cython.compiled:
            if _complete(self):
                return (self.has_request, self.service_name, self.method_name, self.log_id,
                        self.trace_id, self.span_id, self.parent_span_id, self.request_id,
                        self.timeout_ms, self.has_response, self.error_code, self.error_text,
                        self.compress_type, self.correlation_id, self.attachment_size,
                        self.chunk_info, self.authentication_data, self.stream_settings,
                        self.user_fields, self.content_type, self.checksum_type,
                        self.checksum_value, self.checksum_with_attachment)
        return tuple([getattr(self, k) for k in _FIELDS])  # a deleted field: AttributeError

    def __repr__(self) -> str:
        shown = ", ".join([f"{k}={v!r}" for k, v in zip(_FIELDS, self._values())
                           if v is not None and v is not False])
        return f"RpcMeta({shown})"

    def __eq__(self, other: object) -> bool:
        # Duck-typed, so metas of the two builds compare equal.
        if not hasattr(other, "has_request") or not hasattr(other, "checksum_with_attachment"):
            return NotImplemented
        for k, v in zip(_FIELDS, self._values()):
            if not (v == getattr(other, k)):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self):
        return _rebuild, (self._values(),)


def _rebuild(values):
    m = RpcMeta()
    for k, v in zip(_FIELDS, values):
        setattr(m, k, v)
    return m


# Attribute access from Python, compiled. Cython exposes `public` fields through getset
# properties, which cost ~20 ns a read or write, 5x a __slots__ member (the Python build), and
# the protocol layer touches a dozen fields per call. So the properties are replaced by the
# same member descriptors __slots__ makes (T_OBJECT_EX), which the interpreter specialises.
# Like a slot, such a field can be deleted, leaving NULL where Cython expects an object: C code
# reads the fields of a caller's RpcMeta only after _complete() (decode fills a fresh one).

_member_names = tuple([k.encode() for k in _FIELDS])  # _members points into these


@cython.cfunc
@cython.inline
@cython.locals(m=RpcMeta, base="char*", i=int)
@cython.returns("bint")
@cython.exceptval(check=False)
def _complete(m: RpcMeta) -> bool:
    base = cython.cast(cython.p_char, cython.cast(cython.pointer(PyObject), m))
    for i in range(_NFIELDS):
        if cython.cast(cython.pointer(cython.pointer(PyObject)), base + _offsets[i])[0] == cython.NULL:
            return False
    return True


@cython.cfunc
@cython.locals(t="PyTypeObject*", words="PyObject**", i=cython.Py_ssize_t, w=cython.Py_ssize_t)
@cython.returns("int")
@cython.exceptval(-1)
def _use_member_descriptors() -> int:
    t = cython.cast(cython.pointer(PyTypeObject), RpcMeta)
    # Where each field lives: set it to a marker through the Cython property and find it.
    probe = RpcMeta.__new__(RpcMeta)
    markers = [object() for _ in _FIELDS]
    for k, marker in zip(_FIELDS, markers):
        setattr(probe, k, marker)
    words = cython.cast(cython.pointer(cython.pointer(PyObject)), cython.cast(cython.pointer(PyObject), probe))
    for i in range(_NFIELDS):
        _offsets[i] = -1
        for w in range(cython.cast(Py_ssize_t, cython.sizeof(PyObject) // cython.sizeof(cython.p_void)),
                       t.tp_basicsize // cython.cast(Py_ssize_t, cython.sizeof(cython.p_void))):
            if words[w] == cython.cast(cython.pointer(PyObject), markers[i]):
                _offsets[i] = w * cython.cast(Py_ssize_t, cython.sizeof(cython.p_void))
        if _offsets[i] < 0:
            raise ImportError(f"RpcMeta.{_FIELDS[i]} not found in the object layout")
    for i in range(_NFIELDS):
        _members[i].name = PyBytes_AS_STRING(_member_names[i])
        _members[i].type = T_OBJECT_EX
        _members[i].offset = _offsets[i]
        _members[i].flags = 0
        _members[i].doc = cython.NULL
        PyDict_SetItem(cython.cast(object, t.tp_dict), _FIELDS[i],
                       PyDescr_NewMember(t, cython.address(_members[i])))
    PyType_Modified(t)
    return 0


if cython.compiled:
    _use_member_descriptors()


# ---------------------------------------------------------------------------------------------
# encoding: one code for both builds. Compiled, `o` is an _Out, a byte buffer on the stack
# (moved to the heap only if a meta outgrows it) written with C varints; as Python, a
# bytearray. A sub-message gets a one-byte length slot (_open), widened in place by _close in
# the rare case that it turns out to be 128 bytes or more. Compiled, _encode_into reads an
# RpcMeta's fields as struct members where _fast_path says that no Python code can run while
# it encodes (no field deleted, flags that are bools, user_fields a list or tuple of pairs);
# anything else (a duck-typed meta among them) takes the same code with generic attribute
# access (the fused type below makes both), so it behaves as the Python build does.

MetaT = cython.fused_type(RpcMeta, object)


def _varint(out: bytearray, v: int) -> None:
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


@cython.cfunc
@cython.locals(o="_Out*", extra=cython.Py_ssize_t, cap=cython.Py_ssize_t, p="unsigned char*")
@cython.returns("int")
@cython.exceptval(-1)
def _grow(o, extra):  # compiled only
    if extra > PY_SSIZE_T_MAX - o.n:
        raise MemoryError()
    cap = o.cap * 2 if o.cap <= PY_SSIZE_T_MAX // 2 else PY_SSIZE_T_MAX
    if cap < o.n + extra:
        cap = o.n + extra
    if o.on_heap:
        p = cython.cast(cython.p_uchar, PyMem_Realloc(o.buf, cython.cast(cython.size_t, cap)))
    else:
        p = cython.cast(cython.p_uchar, PyMem_Malloc(cython.cast(cython.size_t, cap)))
        if p != cython.NULL:
            memcpy(p, o.buf, cython.cast(cython.size_t, o.n))
    if p == cython.NULL:
        raise MemoryError()
    o.buf = p
    o.cap = cap
    o.on_heap = True
    return 0


@cython.cfunc
@cython.inline
@cython.locals(o="_Out*", extra=cython.Py_ssize_t)
@cython.returns("int")
@cython.exceptval(-1)
def _reserve(o, extra):  # compiled only
    if extra > o.cap - o.n:
        _grow(o, extra)
    return 0


@cython.cfunc
@cython.inline
@cython.locals(v="uint64_t", k=int)
@cython.returns("int")
@cython.exceptval(check=False)
def _varint_size(v):  # compiled only
    k = 1
    while v > 0x7F:
        v >>= 7
        k += 1
    return k


@cython.cfunc
@cython.inline
@cython.locals(p="unsigned char*", v="uint64_t")
@cython.returns("void")
@cython.exceptval(check=False)
def _write_varint(p, v):  # compiled only
    while v > 0x7F:
        p[0] = cython.cast(cython.uchar, (v & 0x7F) | 0x80)
        p += 1
        v >>= 7
    p[0] = cython.cast(cython.uchar, v)


@cython.cfunc
@cython.inline
@cython.locals(o="_Out*", tag="unsigned char", v="uint64_t")
@cython.returns("int")
@cython.exceptval(-1)
def _put_varint(o, tag, v):
    if cython.compiled:
        _reserve(o, 11)
        o.buf[o.n] = tag
        _write_varint(o.buf + o.n + 1, v)
        o.n += 1 + _varint_size(v)
    else:
        o.append(tag)
        _varint(o, v)
    return 0


@cython.cfunc
@cython.locals(o="_Out*", tag="unsigned char", p="const char*", n=cython.Py_ssize_t)
@cython.returns("int")
@cython.exceptval(-1)
def _put_bytes(o, tag, p, n):  # compiled only
    _put_varint(o, tag, cython.cast(uint64_t, n))
    _reserve(o, n)
    memcpy(o.buf + o.n, p, cython.cast(cython.size_t, n))
    o.n += n
    return 0


@cython.cfunc
@cython.locals(o="_Out*", tag="unsigned char")
@cython.returns(cython.Py_ssize_t)
@cython.exceptval(-1)
def _open(o, tag):
    """Start a sub-message: its tag and a one-byte length slot. Returns where its bytes start."""
    if cython.compiled:
        _reserve(o, 2)
        o.buf[o.n] = tag
        o.buf[o.n + 1] = 0
        o.n += 2
        return o.n
    else:
        o.append(tag)
        o.append(0)
        return len(o)


@cython.cfunc
@cython.locals(o="_Out*", start=cython.Py_ssize_t, size=cython.Py_ssize_t, k=int)
@cython.returns("int")
@cython.exceptval(-1)
def _close(o, start):
    """End the sub-message started at `start`: its length into the slot before it."""
    if cython.compiled:
        size = o.n - start
        k = _varint_size(cython.cast(uint64_t, size))
        if k > 1:
            _reserve(o, k - 1)
            memmove(o.buf + start - 1 + k, o.buf + start, cython.cast(cython.size_t, size))
            o.n += k - 1
        _write_varint(o.buf + start - 1, cython.cast(uint64_t, size))
    else:
        slot = bytearray()
        _varint(slot, len(o) - start)
        o[start - 1:start] = slot
    return 0


@cython.cfunc
@cython.locals(o="_Out*", tag="unsigned char", name=str, overflow=int, s="long long",
               u="uint64_t")
@cython.returns("int")
@cython.exceptval(-1)
def _put_int64(o, tag, v, name):
    if not isinstance(v, int):
        raise LocalProtocolError(f"RpcMeta.{name} must be an int, got {type(v).__name__}")
    if cython.compiled:
        overflow = 0
        u = 0
        s = PyLong_AsLongLongAndOverflow(v, cython.address(overflow))
        if overflow == 0:
            u = cython.cast(uint64_t, s)
        elif overflow > 0:
            try:
                u = PyLong_AsUnsignedLongLong(v)
            except OverflowError:
                overflow = 2
        if overflow < 0 or overflow == 2:
            raise LocalProtocolError(f"RpcMeta.{name}={v} does not fit in 64 bits")
        return _put_varint(o, tag, u)
    else:
        if not -(1 << 63) <= v <= _MASK64:
            raise LocalProtocolError(f"RpcMeta.{name}={v} does not fit in 64 bits")
        o.append(tag)
        _varint(o, v & _MASK64)
        return 0


@cython.cfunc
@cython.locals(o="_Out*", tag="unsigned char", name=str, overflow=int, s="long long")
@cython.returns("int")
@cython.exceptval(-1)
def _put_int32(o, tag, v, name):
    # A negative int32 goes on the wire sign-extended to 64 bits (10 bytes), as protobuf does.
    if not isinstance(v, int):
        raise LocalProtocolError(f"RpcMeta.{name} must be an int, got {type(v).__name__}")
    if cython.compiled:
        overflow = 0
        s = PyLong_AsLongLongAndOverflow(v, cython.address(overflow))
        if overflow != 0 or s < -2147483648 or s > 2147483647:
            raise LocalProtocolError(f"RpcMeta.{name}={v} does not fit in int32")
        return _put_varint(o, tag, cython.cast(uint64_t, s))
    else:
        if not -(1 << 31) <= v < (1 << 31):
            raise LocalProtocolError(f"RpcMeta.{name}={v} does not fit in int32")
        o.append(tag)
        _varint(o, v & _MASK64)
        return 0


@cython.cfunc
@cython.locals(o="_Out*", tag="unsigned char", name=str, p="const char*",
               n=cython.Py_ssize_t, view="Py_buffer")
@cython.returns("int")
@cython.exceptval(-1)
def _put_blob(o, tag, v, name):
    if cython.compiled:
        if isinstance(v, str):
            p = PyUnicode_AsUTF8AndSize(v, cython.address(n))
            return _put_bytes(o, tag, p, n)
        if isinstance(v, bytes):
            return _put_bytes(o, tag, PyBytes_AS_STRING(v), len(cython.cast(bytes, v)))
        if isinstance(v, bytearray):  # read directly: a subclass's __buffer__ would be Python code
            return _put_bytes(o, tag, PyByteArray_AS_STRING(v), PyByteArray_GET_SIZE(v))
        if not isinstance(v, memoryview):
            raise LocalProtocolError(f"RpcMeta.{name} must be str or bytes, got {type(v).__name__}")
        try:
            PyObject_GetBuffer(v, cython.address(view), PyBUF_SIMPLE)
        except BufferError:
            # the Python build's `bytearray += v` reports a refused buffer as this TypeError
            raise TypeError(f"can't concat {type(v).__name__} to bytearray") from None
        try:
            if PyMemoryView_GET_BUFFER(v).ndim == 0:
                len(v)  # raises the Python build's TypeError (0-dim memory has no length)
            _put_bytes(o, tag, cython.cast(cython.p_const_char, view.buf), view.len)
        finally:
            PyBuffer_Release(cython.address(view))
        return 0
    else:
        if isinstance(v, str):
            v = v.encode()
        elif isinstance(v, memoryview):
            if v.format != "B" or v.ndim != 1:
                v = v.cast("B")  # the length prefix counts bytes, not items
        elif not isinstance(v, (bytes, bytearray)):
            raise LocalProtocolError(f"RpcMeta.{name} must be str or bytes, got {type(v).__name__}")
        o.append(tag)
        _varint(o, len(v))
        o += v
        return 0


@cython.cfunc
@cython.locals(m=RpcMeta)
@cython.returns("bint")
@cython.exceptval(-1)
def _fast_path(meta) -> bool:
    """Can _encode_into read `meta`'s fields as struct members? Only if encoding it runs no
    Python code: an RpcMeta of this class with no field deleted, flags that are bools (no
    __bool__ to call), user_fields a list or tuple of pairs."""
    if type(meta) is not RpcMeta or not _complete(cython.cast(RpcMeta, meta)):
        return False
    m = cython.cast(RpcMeta, meta)
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


@cython.cfunc
@cython.locals(o="_Out*", m=MetaT, start=cython.Py_ssize_t)
@cython.returns("int")
@cython.exceptval(-1)
def _encode_into(o, m):
    if m.has_request:
        if m.service_name is None or m.method_name is None:
            raise LocalProtocolError("a request meta needs service_name and method_name")
        start = _open(o, 0x0A)
        _put_blob(o, 0x0A, m.service_name, "service_name")
        _put_blob(o, 0x12, m.method_name, "method_name")
        if m.log_id is not None:
            _put_int64(o, 0x18, m.log_id, "log_id")
        if m.trace_id is not None:
            _put_int64(o, 0x20, m.trace_id, "trace_id")
        if m.span_id is not None:
            _put_int64(o, 0x28, m.span_id, "span_id")
        if m.parent_span_id is not None:
            _put_int64(o, 0x30, m.parent_span_id, "parent_span_id")
        if m.request_id is not None:
            _put_blob(o, 0x3A, m.request_id, "request_id")
        if m.timeout_ms is not None:
            _put_int32(o, 0x40, m.timeout_ms, "timeout_ms")
        _close(o, start)
    if m.has_response:
        start = _open(o, 0x12)
        if m.error_code is not None:
            _put_int32(o, 0x08, m.error_code, "error_code")
        if m.error_text is not None:
            _put_blob(o, 0x12, m.error_text, "error_text")
        _close(o, start)
    if m.compress_type is not None:
        _put_int32(o, 0x18, m.compress_type, "compress_type")
    if m.correlation_id is not None:
        _put_int64(o, 0x20, m.correlation_id, "correlation_id")
    if m.attachment_size is not None:
        _put_int32(o, 0x28, m.attachment_size, "attachment_size")
    if m.chunk_info is not None:
        _put_blob(o, 0x32, m.chunk_info, "chunk_info")
    if m.authentication_data is not None:
        _put_blob(o, 0x3A, m.authentication_data, "authentication_data")
    if m.stream_settings is not None:
        _put_blob(o, 0x42, m.stream_settings, "stream_settings")
    if m.user_fields is not None:
        for item in m.user_fields:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise LocalProtocolError("RpcMeta.user_fields must hold (key, value) pairs, got "
                                         + (f"a {type(item).__name__} of length {len(item)}"
                                            if isinstance(item, (tuple, list))
                                            else type(item).__name__))
            key, value = item
            start = _open(o, 0x4A)
            _put_blob(o, 0x0A, key, "user_fields key")
            _put_blob(o, 0x12, value, "user_fields value")
            _close(o, start)
    if m.content_type is not None:
        _put_int32(o, 0x50, m.content_type, "content_type")
    if m.checksum_type is not None:
        _put_int32(o, 0x58, m.checksum_type, "checksum_type")
    if m.checksum_value is not None:
        _put_blob(o, 0x62, m.checksum_value, "checksum_value")
    if m.checksum_with_attachment is not None:
        _put_varint(o, 0x68, 1 if m.checksum_with_attachment else 0)
    return 0


@cython.locals(stack="unsigned char[512]", o="_Out")
def encode_meta(meta: RpcMeta) -> bytes:
    """Serialize `meta` in field-number order, writing exactly the fields that are set."""
    if cython.compiled:
        o.buf = stack
        o.n = 0
        o.cap = _STACK_SIZE
        o.on_heap = False
        try:
            if _fast_path(meta):
                _encode_into(cython.address(o), cython.cast(RpcMeta, meta))
            else:
                _encode_into(cython.address(o), meta)
            return PyBytes_FromStringAndSize(cython.cast(cython.p_char, o.buf), o.n)
        finally:
            if o.on_heap:
                PyMem_Free(o.buf)
    else:
        out = bytearray()
        _encode_into(out, meta)
        return bytes(out)


@cython.locals(stack="unsigned char[512]", o="_Out", overflow=int, payload="long long",
               meta_size=cython.Py_ssize_t)
def pack_head(magic: bytes, meta: RpcMeta, payload_size: int) -> bytes:
    """The 12-byte header followed by the serialized meta, as one buffer.

    `payload_size` is everything after the meta (data and attachment).
    """
    if not isinstance(magic, bytes) or len(magic) != 4:
        raise LocalProtocolError(f"magic must be 4 bytes, got {magic!r}")
    if not isinstance(payload_size, int) or payload_size < 0:
        raise LocalProtocolError(f"payload_size must be an int >= 0, got {payload_size!r}")
    if cython.compiled:
        if PyBytes_GET_SIZE(magic) != 4:  # a bytes subclass whose len() is not its size
            raise LocalProtocolError(f"magic must be 4 bytes, got {magic!r}")
        o.buf = stack
        o.n = HEADER
        o.cap = _STACK_SIZE
        o.on_heap = False
        try:
            if _fast_path(meta):
                _encode_into(cython.address(o), cython.cast(RpcMeta, meta))
            else:
                _encode_into(cython.address(o), meta)
            meta_size = o.n - HEADER
            overflow = 0
            payload = PyLong_AsLongLongAndOverflow(payload_size, cython.address(overflow))
            if overflow != 0 or payload > _U32_MAX - meta_size:
                raise LocalProtocolError(f"frame body of {meta_size + payload_size} bytes does not "
                                         "fit the 32-bit body_size")
            memcpy(o.buf, PyBytes_AS_STRING(magic), 4)
            put_u32(o.buf + 4, cython.cast(uint32_t, meta_size + payload))
            put_u32(o.buf + 8, cython.cast(uint32_t, meta_size))
            return PyBytes_FromStringAndSize(cython.cast(cython.p_char, o.buf), o.n)
        finally:
            if o.on_heap:
                PyMem_Free(o.buf)
    else:
        out = bytearray(magic)
        if len(out) != 4:  # a bytes subclass whose len() is not its size
            raise LocalProtocolError(f"magic must be 4 bytes, got {magic!r}")
        out += b"\0\0\0\0\0\0\0\0"
        _encode_into(out, meta)
        meta_size = len(out) - 12
        body_size = meta_size + payload_size
        if body_size > 0xFFFFFFFF:
            raise LocalProtocolError(f"frame body of {body_size} bytes does not fit the 32-bit "
                                     "body_size")
        out[4:12] = body_size.to_bytes(4, "big") + meta_size.to_bytes(4, "big")
        return bytes(out)


# ---------------------------------------------------------------------------------------------
# decoding: one code for both builds. Compiled, `b` is a pointer to the caller's bytes and `cur`
# a one-element C array holding the position; as Python, `b` is a memoryview of bytes and `cur`
# a one-element list. A size read from the wire is compared with what is left (`end - cur[0]`)
# before anything is added to the position, so the position never passes `end`.

@cython.cfunc
@cython.locals(what=str)
def _bad(what: str) -> RemoteProtocolError:
    return RemoteProtocolError("RpcMeta does not parse: " + what)


@cython.cfunc
@cython.locals(b="const unsigned char*", cur="Py_ssize_t*", end=cython.Py_ssize_t,
               pos=cython.Py_ssize_t, result="uint64_t", c="uint64_t", shift=int)
@cython.returns("uint64_t")
@cython.exceptval(-1, check=True)
def _read_varint(b, cur, end):
    result = 0
    shift = 0
    pos = cur[0]
    while True:
        if pos >= end:
            raise _bad("truncated varint")
        c = b[pos]
        pos += 1
        if shift == 63 and c > 1:
            raise _bad("varint longer than 64 bits")
        result |= (c & 0x7F) << shift
        if c < 0x80:
            cur[0] = pos
            return result
        shift += 7
        if shift > 63:
            raise _bad("varint longer than 10 bytes")


@cython.cfunc
@cython.inline
@cython.locals(b="const unsigned char*", cur="Py_ssize_t*", end=cython.Py_ssize_t,
               pos=cython.Py_ssize_t)
@cython.returns("uint64_t")
@cython.exceptval(-1, check=True)
def _get_varint(b, cur, end):
    pos = cur[0]
    if pos < end and b[pos] < 0x80:
        cur[0] = pos + 1
        return b[pos]
    return _read_varint(b, cur, end)


@cython.cfunc
@cython.inline
@cython.locals(b="const unsigned char*", cur="Py_ssize_t*", end=cython.Py_ssize_t,
               tag="uint64_t")
@cython.returns("uint64_t")
@cython.exceptval(-1, check=True)
def _get_tag(b, cur, end):
    """A field's tag (field number << 3 | wire type); field number 0 does not exist."""
    tag = _get_varint(b, cur, end)
    if tag >> 3 == 0:
        raise _bad("field number 0")
    return tag


@cython.cfunc
@cython.inline
@cython.locals(b="const unsigned char*", cur="Py_ssize_t*", end=cython.Py_ssize_t,
               n="uint64_t")
@cython.returns(cython.Py_ssize_t)
@cython.exceptval(-1)
def _read_len(b, cur, end):
    """Read a length prefix; returns where the bytes start and moves `cur` past them."""
    n = _get_varint(b, cur, end)
    if n > end - cur[0]:
        raise _bad("length-delimited field runs past the end of the meta")
    cur[0] += n
    return cur[0] - n


@cython.cfunc
@cython.locals(b="const unsigned char*", wt="uint64_t", field="uint64_t", cur="Py_ssize_t*",
               end=cython.Py_ssize_t, depth=int, n="uint64_t", tag="uint64_t")
@cython.returns("int")
@cython.exceptval(-1)
def _skip(b, wt, field, cur, end, depth):
    """Move `cur` past a field of wire type `wt` whose tag was just read."""
    if wt == 0:
        _get_varint(b, cur, end)
        return 0
    if wt == 1:
        n = 8
    elif wt == 5:
        n = 4
    elif wt == 2:
        n = _get_varint(b, cur, end)
    elif wt == 3:
        if depth >= _MAX_GROUP_DEPTH:
            raise _bad("groups nested too deeply")
        while True:
            tag = _get_tag(b, cur, end)
            if tag & 7 == 4:
                if tag >> 3 != field:
                    raise _bad("mismatched end of group")
                return 0
            _skip(b, tag & 7, tag >> 3, cur, end, depth + 1)
    else:
        raise _bad(f"invalid wire type {wt}")
    if n > end - cur[0]:
        raise _bad("field runs past the end of the meta")
    cur[0] += n
    return 0


@cython.cfunc
@cython.locals(b="const unsigned char*", start=cython.Py_ssize_t, stop=cython.Py_ssize_t,
               name=str)
def _text(b, start, stop, name):
    try:
        if cython.compiled:
            return PyUnicode_DecodeUTF8(cython.cast(cython.p_char, b + start), stop - start,
                                        cython.NULL)
        else:
            return bytes(b[start:stop]).decode("utf-8")
    except UnicodeDecodeError:
        pass
    raise _bad(f"{name} is not valid UTF-8")


@cython.cfunc
@cython.inline
@cython.locals(b="const unsigned char*", start=cython.Py_ssize_t, stop=cython.Py_ssize_t)
def _bytes_at(b, start, stop):
    if cython.compiled:
        return PyBytes_FromStringAndSize(cython.cast(cython.p_char, b + start), stop - start)
    else:
        return bytes(b[start:stop])


# service_name and method_name repeat on every call of a connection: compiled, they are decoded
# once into this small direct-mapped table and come back as the same str object, whose hash
# (for the dispatch dict) is then computed once too. Only short ASCII names are kept.
_names = [None] * 64  # _NAME_SLOTS


@cython.cfunc
@cython.inline
@cython.locals(b="const unsigned char*", start=cython.Py_ssize_t, stop=cython.Py_ssize_t,
               n=cython.Py_ssize_t, i=cython.Py_ssize_t, h="uint32_t", high="unsigned char")
def _name(b, start, stop):
    if not cython.compiled:
        return _text(b, start, stop, "request string field")
    n = stop - start
    h = 2166136261
    high = 0
    if n > _NAME_MAX:
        return _text(b, start, stop, "request string field")
    for i in range(start, stop):
        high |= b[i]
        h = (h ^ b[i]) * 16777619
    if high & 0x80:
        return _text(b, start, stop, "request string field")
    cached = _names[h & (_NAME_SLOTS - 1)]
    if (cached is not None and PyUnicode_GET_LENGTH(cached) == n
            and memcmp(PyUnicode_DATA(cached), b + start, cython.cast(cython.size_t, n)) == 0):
        return cached
    text = PyUnicode_DecodeUTF8(cython.cast(cython.p_char, b + start), n, cython.NULL)  # ASCII
    _names[h & (_NAME_SLOTS - 1)] = text
    return text


@cython.cfunc
@cython.inline
@cython.locals(v="uint64_t")
def _signed64(v):
    if cython.compiled:
        return cython.cast(int64_t, v)
    else:
        return v - (1 << 64) if v >= (1 << 63) else v


@cython.cfunc
@cython.inline
@cython.locals(v="uint64_t")
def _signed32(v):
    if cython.compiled:
        return cython.cast(int32_t, cython.cast(uint32_t, v))
    else:
        v &= 0xFFFFFFFF
        return v - (1 << 32) if v >= (1 << 31) else v


@cython.cfunc
@cython.locals(m=RpcMeta, b="const unsigned char*", start=cython.Py_ssize_t,
               end=cython.Py_ssize_t, cur="Py_ssize_t[1]", tag="uint64_t", field="uint64_t",
               wt="uint64_t", s=cython.Py_ssize_t)
@cython.returns("int")
@cython.exceptval(-1)
def _decode_request(m, b, start, end):
    cur = [start]
    while cur[0] < end:
        tag = _get_tag(b, cur, end)
        field = tag >> 3
        wt = tag & 7
        if wt == 2 and (field == 1 or field == 2 or field == 7):
            s = _read_len(b, cur, end)
            if field == 7:
                m.request_id = _text(b, s, cur[0], "request string field")
            elif field == 1:
                m.service_name = _name(b, s, cur[0])
            else:
                m.method_name = _name(b, s, cur[0])
        elif wt == 0 and (3 <= field <= 6 or field == 8):
            if field == 3:
                m.log_id = _signed64(_get_varint(b, cur, end))
            elif field == 4:
                m.trace_id = _signed64(_get_varint(b, cur, end))
            elif field == 5:
                m.span_id = _signed64(_get_varint(b, cur, end))
            elif field == 6:
                m.parent_span_id = _signed64(_get_varint(b, cur, end))
            else:
                m.timeout_ms = _signed32(_get_varint(b, cur, end))
        else:
            _skip(b, wt, field, cur, end, 0)
    return 0


@cython.cfunc
@cython.locals(m=RpcMeta, b="const unsigned char*", start=cython.Py_ssize_t,
               end=cython.Py_ssize_t, cur="Py_ssize_t[1]", tag="uint64_t", field="uint64_t",
               wt="uint64_t", s=cython.Py_ssize_t)
@cython.returns("int")
@cython.exceptval(-1)
def _decode_response(m, b, start, end):
    cur = [start]
    while cur[0] < end:
        tag = _get_tag(b, cur, end)
        field = tag >> 3
        wt = tag & 7
        if field == 1 and wt == 0:
            m.error_code = _signed32(_get_varint(b, cur, end))
        elif field == 2 and wt == 2:
            s = _read_len(b, cur, end)
            m.error_text = _text(b, s, cur[0], "error_text")
        else:
            _skip(b, wt, field, cur, end, 0)
    return 0


@cython.cfunc
@cython.locals(b="const unsigned char*", start=cython.Py_ssize_t, end=cython.Py_ssize_t,
               cur="Py_ssize_t[1]", tag="uint64_t", field="uint64_t", wt="uint64_t",
               s=cython.Py_ssize_t)
@cython.returns(tuple)
def _decode_entry(b, start, end):
    key = value = ""
    cur = [start]
    while cur[0] < end:
        tag = _get_tag(b, cur, end)
        field = tag >> 3
        wt = tag & 7
        if wt == 2 and (field == 1 or field == 2):
            s = _read_len(b, cur, end)
            text = _text(b, s, cur[0], "user_fields entry")
            if field == 1:
                key = text
            else:
                value = text
        else:
            _skip(b, wt, field, cur, end, 0)
    return (key, value)


@cython.cfunc
@cython.inline
@cython.locals(m=RpcMeta, b="const unsigned char*", end=cython.Py_ssize_t,
               cur="Py_ssize_t[1]", tag="uint64_t", field="uint64_t", wt="uint64_t",
               v="uint64_t", s=cython.Py_ssize_t)
@cython.returns("int")
@cython.exceptval(-1)
def _decode(m, b, end):
    cur = [0]
    while cur[0] < end:
        tag = _get_tag(b, cur, end)
        field = tag >> 3
        wt = tag & 7
        if wt == 2:
            if field == 1:
                s = _read_len(b, cur, end)
                m.has_request = True
                _decode_request(m, b, s, cur[0])
                continue
            if field == 2:
                s = _read_len(b, cur, end)
                m.has_response = True
                _decode_response(m, b, s, cur[0])
                continue
            if field == 6 or field == 7 or field == 8 or field == 12:
                s = _read_len(b, cur, end)
                blob = _bytes_at(b, s, cur[0])
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
                s = _read_len(b, cur, end)
                if m.user_fields is None:
                    m.user_fields = []
                if len(m.user_fields) <= _MAX_USER_FIELDS:  # one past the limit shows it was passed
                    m.user_fields.append(_decode_entry(b, s, cur[0]))
                continue
        elif wt == 0 and (3 <= field <= 5 or 10 <= field <= 11 or field == 13):
            v = _get_varint(b, cur, end)
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
        _skip(b, wt, field, cur, end, 0)
    if m.has_request and (m.service_name is None or m.method_name is None):
        missing = "service_name" if m.service_name is None else "method_name"
        raise _bad(f"required field request.{missing} is missing")
    return 0


@cython.locals(view="Py_buffer", m=RpcMeta)
def decode_meta(buf) -> RpcMeta:
    """Parse a serialized RpcMeta (bytes, bytearray or memoryview)."""
    if cython.compiled:
        if acquire_bytes(buf, cython.address(view)) is None:
            memoryview(buf)  # no buffer: raises TypeError
        try:
            m = RpcMeta.__new__(RpcMeta)
            _decode(m, cython.cast(cython.p_uchar, view.buf), view.len)
            return m
        finally:
            PyBuffer_Release(cython.address(view))
    else:
        if not isinstance(buf, memoryview):
            buf = memoryview(buf)  # no buffer: TypeError
        if buf.format != "B" or buf.ndim != 1:
            buf = buf.cast("B")
        m = RpcMeta()
        _decode(m, buf, len(buf))
        return m
