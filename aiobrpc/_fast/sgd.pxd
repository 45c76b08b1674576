# Types of sgd.py when Cython compiles it (aiobrpc/_compiled.py). The .py file is the
# source of both builds.

cimport cython

ctypedef fused real:
    float
    double

@cython.locals(n=size_t, pv=size_t, pg=size_t, i=Py_ssize_t)
cdef bint _sub(real[::1] v, const real[::1] g, real a)
