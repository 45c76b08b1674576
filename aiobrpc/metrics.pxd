# Types of metrics.py when Cython compiles it in place (aiobrpc/_compiled.py): a slot's counters
# are C integers and record() runs in C but for the clock call. `sum` stays a Python int: the
# sum of clamped latencies could pass 2^63. The .py file is the source of both twins.

cimport cython

cdef class _Second:
    cdef public long long second, count, errors, max
    cdef public object sum, hist

    cpdef reset(self, long long second)


cdef class LatencyRecorder:
    cdef public object window, _slots, _clock, _born, _old_count, _old_errors, _old_sum, _max_ever
    cdef public _Second _cur

    @cython.locals(sec=cython.longlong, b=cython.int, u=cython.longlong, cur=_Second)
    cpdef record(self, us, bint failed=*)
    @cython.locals(slot=_Second)
    cpdef _Second _advance(self, long long sec)


cdef class MethodStatus:
    cdef public LatencyRecorder latency
    cdef public long long concurrency
    cdef public object limiter

    cpdef bint admits(self, timeout_ms=*)
    cpdef ended(self, us, long long error_code)
