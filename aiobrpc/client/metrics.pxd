# Types of metrics.py when Cython compiles it in place (aiobrpc/_compiled.py): ended() runs in C
# down to the recorder's record(). The .py file is the source of both twins.

cimport cython
from aiobrpc.metrics cimport LatencyRecorder

cdef class ClientMethodStatus:
    cdef public LatencyRecorder latency
    cdef public long long retries, backups


cdef class MethodTable:
    cdef public dict _by_service
    cdef public Py_ssize_t _size
    cdef public object max_methods
    cdef public ClientMethodStatus other

    @cython.locals(status=ClientMethodStatus, methods=dict)
    cpdef ended(self, str service, str method, us, bint failed, Py_ssize_t retried, bint backup)
    cpdef ClientMethodStatus _add(self, service, method)
