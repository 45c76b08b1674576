"""What the sources compiled in pure-Python mode read of the `cython` module, for the build that
has no Cython installed (Cython is needed to compile, not to run).

Such a source starts with `try: import cython` / `except ImportError: from .. import
_cython_shim as cython` and keeps C-only code under `if cython.compiled:`, which Cython
resolves when it compiles the file and which is False wherever the file runs as Python.
"""

compiled = False


def locals(**types):  # noqa: A001  (cython.locals: C types of a function's locals)
    return lambda function: function


Py_ssize_t = int
