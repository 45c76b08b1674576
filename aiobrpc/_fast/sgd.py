"""The parameter server's SGD step (aiobrpc/training/ps/optim.py), compiled in place
(aiobrpc/_compiled.py).

Compiled, `sub_scaled` makes one pass over memory with the GIL released (the update thread's
arithmetic then runs beside the server's loop); as Python (the pure build, or an array the
C path does not take) it is numpy's, through a small scratch. Both round each element as
numpy does: the product, then the difference, each in the array's own precision; the
extension is built with -ffp-contract=off so that no compiler fuses them into one
multiply-add, whose single rounding would change the weights a server holds.
"""

from __future__ import annotations

from typing import Any

try:
    import cython
except ImportError:  # the pure build runs without Cython
    from .. import _cython_shim as cython

# Elements of numpy's scratch: small enough to stay in cache, large enough that the numpy calls
# are few (an SGD step over 16 MiB of float32 here: 2.33 ms with 64 Ki elements, 1.66 ms
# with 256 Ki, 1.61 ms with 512 Ki).
CHUNK = 1 << 18


def sub_scaled(value: Any, grad: Any, alpha: float) -> None:
    """value -= alpha * grad, in place: numpy arrays, `grad` of `value`'s shape and dtype (the
    store checked)."""
    a = value.dtype.type(alpha)
    if cython.compiled:
        dtype = value.dtype
        if (grad.dtype == dtype and dtype.isnative and value.size == grad.size and value.flags.c_contiguous
                and value.flags.aligned and grad.flags.c_contiguous and grad.flags.aligned):
            if dtype.char == "f":  # float32
                if _sub[cython.float](value.reshape(-1), grad.reshape(-1), a):
                    return
            elif dtype.char == "d":  # float64
                if _sub[cython.double](value.reshape(-1), grad.reshape(-1), a):
                    return
    _sub_numpy(value, grad, a)


def _sub_numpy(value: Any, grad: Any, a: Any) -> None:
    import numpy as np  # here: aiobrpc._compiled.compiled() imports this module, numpy or not

    if value.size <= CHUNK:
        value -= grad * a  # no full-size temporary worth avoiding
        return
    v, g = value.reshape(-1), grad.reshape(-1)
    scratch = np.empty(CHUNK, value.dtype)
    for i in range(0, v.size, CHUNK):
        n = min(CHUNK, v.size - i)
        np.multiply(g[i:i + n], a, out=scratch[:n])
        np.subtract(v[i:i + n], scratch[:n], out=v[i:i + n])


def _sub(v, g, a) -> bool:
    """(float32 or float64.) False where `g` overlaps `v` other than element for element
    (numpy reads such a gradient as if copied first; the loop would read its own writes)."""
    n = v.shape[0] * cython.sizeof(a)
    if n:
        pv = cython.cast(cython.size_t, cython.address(v[0]))
        pg = cython.cast(cython.size_t, cython.address(g[0]))
        if pv != pg and pv < pg + n and pg < pv + n:
            return False
    with cython.nogil:
        for i in range(v.shape[0]):
            v[i] = v[i] - a * g[i]
    return True
