"""A bench's pure-Python twin runs in a process of its own where modules are compiled in place.

Every module of aiobrpc/_compiled.py, the kernels of aiobrpc._fast included, is chosen compiled
or Python once, when the process starts. A bench's pure row therefore runs in a process of its
own: the bench runs again with AIOBRPC_NO_EXTENSIONS=1 when this process has compiled modules.
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
    return _pure(args).returncode


def rerun_output(args: list[str]) -> str:
    """Run this script again with `args`, every module as Python; what it printed."""
    return _pure(args, stdout=subprocess.PIPE, text=True, check=True).stdout


def _pure(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, AIOBRPC_NO_EXTENSIONS="1")
    return subprocess.run([sys.executable, sys.argv[0], *args], env=env, **kwargs)
