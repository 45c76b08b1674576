"""Only the Cython extensions; everything else is in pyproject.toml.

Set AIOBRPC_NO_EXTENSIONS=1 to install without compiling (the pure-Python twins are used).
"""

import os

from setuptools import setup

ext_modules = []
if not os.environ.get("AIOBRPC_NO_EXTENSIONS"):
    from Cython.Build import cythonize

    ext_modules = cythonize(
        ["aiobrpc/_fast/iobuf.pyx", "aiobrpc/_fast/meta.pyx", "aiobrpc/_fast/framing.pyx"],
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False,
                             "cdivision": True, "embedsignature": True},
    )

setup(ext_modules=ext_modules)
