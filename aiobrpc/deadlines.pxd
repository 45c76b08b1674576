# Types of deadlines.py when Cython compiles it in place (aiobrpc/_compiled.py): a call's add()
# and remove() run in C, not as Python frames. The .py file is the source of both twins.

cimport cython


cdef class TimerWheel:
    cdef public object loop, expire, handle
    cdef public dict buckets
    cdef public list ticks
    cdef public object armed

    @cython.locals(bucket=dict)
    cpdef add(self, when, entry)
    @cython.locals(buckets=dict, bucket=dict, ticks=list)
    cpdef remove(self, tick, entry)
    cpdef _arm(self, tick)
