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
selected at run time as before (`_fast.use`).
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
)

# Modules of MODULES that index raw buffers: compiled with C semantics (no bounds checks, no
# negative indexes, C division), their C code written under `if cython.compiled:`.
C_SEMANTICS = ("aiobrpc._fast.iobuf",)

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
    whichever build `import` chose: tests and fuzzers compare the two in one process. Its
    classes are not the imported module's classes; each build works with its own."""
    if name not in MODULES:
        raise ValueError(f"{name} is not compiled in place")
    package, _, leaf = name.rpartition(".")
    private = f"{package}._source_of_{leaf}"
    if private in sys.modules:
        return sys.modules[private]
    path = importlib.import_module(package).__path__
    spec = importlib.machinery.FileFinder(path[0], PureSourceFinder._loader).find_spec(name)
    if spec is None:
        raise ImportError(f"no .py source of {name}")
    spec = importlib.util.spec_from_file_location(private, spec.origin)
    module = importlib.util.module_from_spec(spec)
    sys.modules[private] = module
    spec.loader.exec_module(module)
    return module
