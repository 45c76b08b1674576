"""What the sources compiled in pure-Python mode read of the `cython` module, for the build that
has no Cython installed (Cython is needed to compile, not to run).

Such a source starts with `try: import cython` / `except ImportError: from .. import
_cython_shim as cython` and keeps C-only code under `if cython.compiled:`, which Cython
resolves when it compiles the file and which is False wherever the file runs as Python. The
decorators below give C types and kinds of function; as Python they return what they decorate.
"""

compiled = False


def _types(*args, **kwargs):
    return lambda decorated: decorated


def _keep(decorated):
    return decorated


locals = returns = exceptval = freelist = _types  # noqa: A001  (cython.locals shadows a builtin)
cfunc = inline = cclass = _keep
Py_ssize_t = int


def fused_type(*types):  # a C type standing for each of `types`; as Python, any object
    return object
