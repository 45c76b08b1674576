"""Modules compiled in place from their .py source (aiobrpc/_compiled.py): one twin per process."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest

import aiobrpc
from aiobrpc import _compiled, _fast


def test_this_process_runs_one_twin_throughout():
    compiled = _compiled.compiled()
    assert set(compiled) == set(_compiled.MODULES)
    if _fast.IMPLEMENTATION == "python":  # AIOBRPC_NO_EXTENSIONS=1, or nothing built
        assert not any(compiled.values())
        assert aiobrpc.implementation() == "python"
    else:  # the extensions are built together: the kernels and every module compiled in place
        assert all(compiled.values()), compiled


def _run(code: str, **env) -> str:
    full = {k: v for k, v in os.environ.items() if k != "AIOBRPC_NO_EXTENSIONS"}
    r = subprocess.run([sys.executable, "-c", code], env={**full, **env}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_no_extensions_loads_every_module_from_its_source():
    code = ("import aiobrpc, aiobrpc._compiled as c, sys\n"
            "print(aiobrpc.implementation(), sorted(set(c.compiled().values())),"
            " all(sys.modules[m].__file__.endswith('.py') for m in c.MODULES))")
    assert _run(code, AIOBRPC_NO_EXTENSIONS="1") == "python [False] True"
    built = any(Path(_fast.__file__).parent.glob(f"meta{suffix}")
                for suffix in importlib.machinery.EXTENSION_SUFFIXES)
    assert _run(code, AIOBRPC_NO_EXTENSIONS="0") == ("cython [True] False" if built else "python [False] True")


def test_the_source_finder_takes_only_listed_modules():
    finder = _compiled.PureSourceFinder
    path = [str(Path(aiobrpc.__file__).parent / "server")]
    spec = finder.find_spec("aiobrpc.server.inline", path)
    assert isinstance(spec.loader, importlib.machinery.SourceFileLoader)
    assert spec.origin.endswith("inline.py")
    assert finder.find_spec("aiobrpc.server.server", path) is None
    assert finder.find_spec("aiobrpc.server.inline", None) is None


def test_a_kernel_runs_from_its_source_without_cython_installed():
    # Cython compiles; it is not needed to run: the pure build reads `cython.compiled` from
    # aiobrpc/_cython_shim.py when `import cython` fails.
    code = ("import sys; sys.modules['cython'] = None\n"
            "from aiobrpc._fast import iobuf, meta as codec, FrameReader, RpcMeta\n"
            "r = FrameReader(); r.feed(b'PRPC' + (3).to_bytes(4, 'big') + (1).to_bytes(4, 'big') + b'mab')\n"
            "kind, meta, payload = r.next_frame()\n"
            "m = RpcMeta(); m.correlation_id = 7; m.user_fields = [('k', 'v')]\n"
            "head = codec.pack_head(b'PRPC', m, 0)\n"
            "print(iobuf.__file__.endswith('.py'), codec.__file__.endswith('.py'), kind, bytes(meta),\n"
            "      bytes(payload), r.rbuf.copied_bytes, codec.decode_meta(head[12:]) == m, head.hex())")
    assert _run(code, AIOBRPC_NO_EXTENSIONS="1") == (
        "True True 1 b'm' b'ab' 0 True 505250430000000a0000000a20074a060a016b120176")


def test_load_source_gives_the_python_build_beside_the_imported_one():
    source = _compiled.load_source("aiobrpc._fast.iobuf")
    assert source.__file__.endswith("iobuf.py") and source is _compiled.load_source("aiobrpc._fast.iobuf")
    assert source.ReadBuffer is not _fast.ReadBuffer
    rb = source.ReadBuffer(512, 128)
    rb.feed(b"x" * 100)
    assert bytes(rb.take(100)) == b"x" * 100
    with pytest.raises(ValueError, match="not compiled in place"):
        _compiled.load_source("aiobrpc.server.server")
