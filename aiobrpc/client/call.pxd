# Types of call.py when Cython compiles it in place (aiobrpc/_compiled.py): Call and Attempt are
# extension types whose fields compiled code reads as C struct members; the methods one call
# runs call each other in C. The .py file is the source of both twins.

cdef class Attempt:
    cdef public Call call
    cdef public object pool, conn, cid, task
    cdef public long long start_ns
    cdef public bint sent, backup, done

    cpdef on_response(self, ev)
    cpdef on_failed(self, err)


cdef class Call:
    cdef public object channel, loop, cntl, service_name, method_name, serialized
    cdef public object response_class, fut, deadline, timeout_ms, max_retry, ctype
    cdef public object excluded, timer, backup_timer, retry_handle, backup_ms, errors, streams, otel
    cdef public Attempt current, unfinished, placer
    cdef public bint idempotent, finished
    cdef public Py_ssize_t retried
    cdef public long long start_ns

    cpdef start(self)
    cpdef _issue(self, bint backup=*)
    cpdef _send(self, Attempt att, conn)
    cpdef _ended(self, Attempt att, ev, err)
    cpdef _complete(self, Attempt att, response, err)
    cpdef _fail(self, e)
    cpdef _record(self, Attempt att, code)
    cpdef _abandon(self, Attempt att, int code)
    cpdef _stop_others(self, Attempt att, err)
