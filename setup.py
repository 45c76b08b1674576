"""Only the Cython extensions; everything else is in pyproject.toml.

The kernels of aiobrpc/_fast are .pyx files; the modules of the call path listed in
aiobrpc/_compiled.py are .py files that Cython compiles in place (pure-Python mode). Set
AIOBRPC_NO_EXTENSIONS=1 to install without compiling (everything then runs as Python).
"""

import ast
import os

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, PlatformError

NO_COMPILER_HINT = (
    "aiobrpc could not compile its Cython extension {name} ({error}). Install a C compiler and "
    "the Python headers (Debian: apt-get install gcc python3-dev), or install the pure-Python "
    "package without compiling: AIOBRPC_NO_EXTENSIONS=1 pip install ...")


class BuildExtOrExplain(build_ext):
    """build_ext whose failure says how to install without a compiler."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except (CCompilerError, CompileError, ExecError, PlatformError) as e:
            raise SystemExit(NO_COMPILER_HINT.format(name=ext.name, error=e)) from e


def compiled_in_place() -> list[str]:
    """The .py files of aiobrpc._compiled.MODULES (read, not imported: the package's
    dependencies need not be installed while it builds)."""
    with open("aiobrpc/_compiled.py") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["MODULES"]:
            return [name.replace(".", "/") + ".py" for name in ast.literal_eval(node.value)]
    raise SystemExit("aiobrpc/_compiled.py has no MODULES")


ext_modules = []
if os.environ.get("AIOBRPC_NO_EXTENSIONS", "") in ("", "0"):
    from Cython.Build import cythonize

    # The kernels index raw buffers: C semantics where they say so.
    ext_modules = cythonize(
        ["aiobrpc/_fast/iobuf.pyx", "aiobrpc/_fast/meta.pyx", "aiobrpc/_fast/framing.pyx"],
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False,
                             "cdivision": True, "embedsignature": True},
    )
    # The modules compiled in place must mean what they mean as Python (negative indexes,
    # floor division); their types come from the .pxd beside them, not from annotations,
    # which are documentation there.
    ext_modules += cythonize(
        compiled_in_place(),
        compiler_directives={"language_level": "3", "annotation_typing": False},
    )

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExtOrExplain})
