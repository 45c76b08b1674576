"""Only the Cython extensions; everything else is in pyproject.toml.

The modules of the call path listed in aiobrpc/_compiled.py, the kernels of aiobrpc/_fast
among them, are .py files that Cython compiles in place (pure-Python mode). Set
AIOBRPC_NO_EXTENSIONS=1 to install without compiling (everything then runs as Python); where
compiling fails (no C compiler, no Python headers) the pure-Python build is installed too,
with one line saying why (docs/install.md).
"""

import ast
import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, PlatformError

PURE_FALLBACK = (
    "aiobrpc: the pure-Python build is installed, because its Cython extensions could not be "
    "compiled ({error}); it works the same, only slower. For the compiled build install a C "
    "compiler and the Python headers (Debian: apt-get install gcc python3-dev) and reinstall.")
BUILD_ERRORS = (CCompilerError, CompileError, ExecError, PlatformError, OSError)


class BuildExtOrPure(build_ext):
    """build_ext that falls back to the pure-Python build when the extensions cannot be compiled.

    All or nothing: a class compiled in one module and pure in another would not mix
    (aiobrpc/_compiled.py), so after any failure the extensions already built are removed and
    the package installs as its pure twin, with one line saying so.
    """

    def run(self):
        try:
            super().run()
        except BUILD_ERRORS as e:
            for path in self.get_outputs():
                if os.path.exists(path):
                    os.remove(path)
            self.extensions = []
            error = " ".join(str(e).split()) or type(e).__name__
            print(PURE_FALLBACK.format(error=error), file=sys.stderr, flush=True)


def compiled_in_place(name: str = "MODULES") -> list[str]:
    """The .py files of aiobrpc._compiled.MODULES, or of another list there (read, not
    imported: the package's dependencies need not be installed while it builds)."""
    with open("aiobrpc/_compiled.py") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == [name]:
            return [name.replace(".", "/") + ".py" for name in ast.literal_eval(node.value)]
    raise SystemExit(f"aiobrpc/_compiled.py has no {name}")


ext_modules = []
if os.environ.get("AIOBRPC_NO_EXTENSIONS", "") in ("", "0"):
    from Cython.Build import cythonize

    # The kernels index raw buffers: C semantics where they say so. Their types come from the
    # .pxd beside them and from cython.locals, not from annotations, which are documentation.
    c_semantics = compiled_in_place("C_SEMANTICS")
    ext_modules = cythonize(
        c_semantics,
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False,
                             "cdivision": True, "embedsignature": True, "annotation_typing": False},
    )
    # The other modules compiled in place must mean what they mean as Python (negative
    # indexes, floor division).
    ext_modules += cythonize(
        [path for path in compiled_in_place() if path not in c_semantics],
        compiler_directives={"language_level": "3", "annotation_typing": False},
    )
    for ext in ext_modules:
        if ext.name == "aiobrpc._fast.sgd" and os.name != "nt":
            # Each product and difference rounded as numpy rounds them: never fused into one
            # multiply-add (what -march=native with GCC's default contraction would do).
            ext.extra_compile_args.append("-ffp-contract=off")

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExtOrPure})
