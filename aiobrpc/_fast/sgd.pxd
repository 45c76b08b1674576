# Types of sgd.py when Cython compiles it (aiobrpc/_compiled.py). The .py file is the
# source of both builds.

cimport cython

@cython.locals(n=size_t, pv=size_t, pg=size_t)
cdef bint _sub_f32(float[::1] v, const float[::1] g, float a)
@cython.locals(n=size_t, pv=size_t, pg=size_t)
cdef bint _sub_f64(double[::1] v, const double[::1] g, double a)

@cython.locals(i=Py_ssize_t)
cdef void _loop_f32(float[::1] v, const float[::1] g, float a) noexcept nogil
@cython.locals(i=Py_ssize_t)
cdef void _loop_f64(double[::1] v, const double[::1] g, double a) noexcept nogil
