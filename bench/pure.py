"""A bench's pure-Python twin runs in a process of its own where modules are compiled in place.

`_fast.use("python")` switches only the kernels of aiobrpc._fast; the modules of
aiobrpc/_compiled.py are chosen when the process starts. A bench that measures the pure twin
therefore runs it again with AIOBRPC_NO_EXTENSIONS=1 when this process has compiled modules.
"""

from __future__ import annotations

import os
import subprocess
import sys

from aiobrpc import _compiled


def needs_own_process() -> bool:
    """This process runs modules compiled in place: the pure twin needs a process of its own."""
    return any(_compiled.compiled().values())


def rerun(args: list[str]) -> int:
    """Run this script again with `args`, every module as Python; its exit status."""
    env = dict(os.environ, AIOBRPC_NO_EXTENSIONS="1")
    return subprocess.run([sys.executable, sys.argv[0], *args], env=env).returncode
