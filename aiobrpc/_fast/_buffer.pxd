# Shared by meta.pyx and framing.pyx: the bytes of whatever buffer the caller passed.

from cpython.buffer cimport PyBUF_SIMPLE, PyObject_CheckBuffer, PyObject_GetBuffer


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
