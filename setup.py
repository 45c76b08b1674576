"""Only the Cython extensions; everything else is in pyproject.toml.

Set AIOBRPC_NO_EXTENSIONS=1 to install without compiling (the pure-Python twins are used).
"""

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


ext_modules = []
if not os.environ.get("AIOBRPC_NO_EXTENSIONS"):
    from Cython.Build import cythonize

    ext_modules = cythonize(
        ["aiobrpc/_fast/iobuf.pyx", "aiobrpc/_fast/meta.pyx", "aiobrpc/_fast/framing.pyx"],
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False,
                             "cdivision": True, "embedsignature": True},
    )

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExtOrExplain})
