"""Modules of the call path that Cython compiles in place, from their own .py source.

setup.py compiles each module listed in MODULES to an extension module beside its source, e.g.
`aiobrpc/server/inline.cpython-311-x86_64-linux-gnu.so` next to `inline.py`. Python's import
system prefers an extension module to a source file of the same name, so the compiled module
shadows its source and every layer imports it by the same name as before: the layers stay
where they are. A module may have an augmenting `.pxd` beside it (Cython's pure-Python mode:
the `.py` stays plain Python): there its classes become extension types whose fields compiled
code reads as C struct members, and its methods call each other in C. A module is listed only
where compiling it measurably lowers the work per call (docs/benchmarks.md, "Issue 17, third
slice"): Cython's generic attribute access is slower than 3.11's specialized one, so code that
is mostly attribute access on untyped Python objects gets slower compiled.

The same source also runs as plain Python, the pure twin: where no extension was built, and in
a process started with AIOBRPC_NO_EXTENSIONS=1, where `install()` (run by `aiobrpc/__init__.py`
before any other aiobrpc module is imported) puts a finder first on `sys.meta_path` that loads
these modules from their .py files even where the extension exists. The choice is made once per
process: a class compiled in one module and pure in another would not mix, so the test suite
runs the pure twin in a second process (tests/conftest.py). The kernels of `aiobrpc._fast` are
among these modules.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

# Dotted names; setup.py compiles exactly these.
MODULES = (
    "aiobrpc.server.inline",
    "aiobrpc.protocol.baidu_std",
    "aiobrpc.client.call",
    "aiobrpc.metrics",
    "aiobrpc.client.metrics",
    "aiobrpc.deadlines",
    "aiobrpc.protocol.events",
    "aiobrpc._fast.iobuf",
    "aiobrpc._fast.framing",
    "aiobrpc._fast.meta",
    "aiobrpc._fast.sgd",
)

# Modules of MODULES that index raw buffers: compiled with C semantics (no bounds checks, no
# negative indexes, C division), their C code written under `if cython.compiled:`.
C_SEMANTICS = ("aiobrpc._fast.iobuf", "aiobrpc._fast.framing", "aiobrpc._fast.meta",
               "aiobrpc._fast.sgd")

ENV = "AIOBRPC_NO_EXTENSIONS"


def pure_requested() -> bool:
    """AIOBRPC_NO_EXTENSIONS is set (to anything but "" or "0"): run every module as Python."""
    return os.environ.get(ENV, "") not in ("", "0")


class PureSourceFinder:
    """Finds the modules of MODULES as their .py source, never as an extension module."""

    _loader = (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES)

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in MODULES or not path:
            return None
        for entry in path:
            spec = importlib.machinery.FileFinder(entry, cls._loader).find_spec(name, target)
            if spec is not None:
                return spec
        return None


def install() -> None:
    """Put PureSourceFinder first on sys.meta_path when AIOBRPC_NO_EXTENSIONS asks for it."""
    if pure_requested() and PureSourceFinder not in sys.meta_path:
        sys.meta_path.insert(0, PureSourceFinder)


def compiled() -> dict[str, bool]:
    """For each module of MODULES (imported here if it was not yet): is it the extension?"""
    out = {}
    for name in MODULES:
        module = sys.modules.get(name) or importlib.import_module(name)
        out[name] = isinstance(getattr(module, "__loader__", None), importlib.machinery.ExtensionFileLoader)
    return out


def load_source(name: str):
    """The Python build of module `name` (one of MODULES) as a separate module object, beside
    whichever build `import` chose: tests and fuzzers compare the two in one process. The
    modules of MODULES it imports are their Python builds too (framing's source reads the
    fields of iobuf's ReadBuffer, which only the Python build shows). Its classes are not the
    imported module's classes; each build works with its own."""
    if name not in MODULES:
        raise ValueError(f"{name} is not compiled in place")
    if name in _SOURCES:
        return _SOURCES[name]
    saved = {m: sys.modules.pop(m) for m in MODULES if m in sys.modules}
    parents = {m: getattr(sys.modules.get(m.rpartition(".")[0]), m.rpartition(".")[2], None)
               for m in MODULES}
    sys.meta_path.insert(0, PureSourceFinder)
    try:
        importlib.import_module(name)
        loaded = {m: sys.modules[m] for m in MODULES if m in sys.modules}
    finally:
        sys.meta_path.remove(PureSourceFinder)  # the one inserted above: the first
        for m in MODULES:
            sys.modules.pop(m, None)
        sys.modules.update(saved)
        for m, module in parents.items():
            parent = sys.modules.get(m.rpartition(".")[0])
            if parent is not None:
                if module is None:
                    parent.__dict__.pop(m.rpartition(".")[2], None)
                else:
                    setattr(parent, m.rpartition(".")[2], module)
    for m, module in loaded.items():
        _SOURCES.setdefault(m, module)
    return _SOURCES[name]


_SOURCES: dict = {}  # name -> its Python build, loaded by load_source
