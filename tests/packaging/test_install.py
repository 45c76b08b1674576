"""The package as users install it (issue 33): the sdist and the wheel, installed in fresh venvs.

Slow (a build and a pip install each, a few minutes in all), run by the normal suite with a
longer timeout. They skip
with the reason where a venv cannot be made. Build dependencies come from the running Python
(--no-build-isolation), so nothing is downloaded for the build itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

from tests.helpers.twins import pure_run_of_parent

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_FILES = (
    "aiobrpc/py.typed",
    "aiobrpc/_proto/echo_pb2.py",
    "aiobrpc/_proto/echo_pb2.pyi",
    "aiobrpc/_proto/echo_aiobrpc.py",
    "aiobrpc/_proto/brpc_meta_pb2.py",
    "aiobrpc/metrics.pxd",
    "aiobrpc/_fast/iobuf.pxd",
    "aiobrpc/_fast/sgd.pxd",
)
ECHO = textwrap.dedent("""
    import asyncio, aiobrpc
    from aiobrpc._proto import echo_pb2

    class Echo(aiobrpc.Servicer):
        SERVICE = echo_pb2.DESCRIPTOR.services_by_name["EchoService"]
        async def Echo(self, request, cntl):
            return echo_pb2.EchoResponse(message=request.message)

    async def main():
        server = aiobrpc.Server()
        server.add_service(Echo())
        await server.start("127.0.0.1:0")
        channel = aiobrpc.Channel(server.address)
        stub = aiobrpc.Stub(channel, Echo.SERVICE)
        resp = await stub.Echo(echo_pb2.EchoRequest(message="hi"), aiobrpc.Controller(timeout_ms=2000))
        await channel.close(); await server.stop(); await server.join()
        print("echo", resp.message)

    asyncio.run(main())
""")

# Independent of the twin: run once, in the parent process (not again in the pure-twin child).
pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(pure_run_of_parent(), reason="packaging runs once, in the compiled twin's process"),
]


def _run(cmd, cwd, env=None, timeout=600):
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


def _venv(path: Path) -> Path:
    try:
        venv.create(path, with_pip=True)
    except Exception as e:  # noqa: BLE001 - any failure to make a venv is a reason to skip
        pytest.skip(f"cannot make a venv here: {e}")
    return path / "bin" / "python"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AIOBRPC_NO_EXTENSIONS")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(out), str(ROOT)], cwd=out,
         env=_env())
    (path,) = out.glob("aiobrpc-*.tar.gz")
    return path


def test_sdist_has_sources(sdist):
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    for f in (*RUNTIME_FILES, "setup.py", "proto/echo.proto", "aiobrpc/_fast/meta.py", "aiobrpc/_fast/meta.pxd", "aiobrpc/_fast/framing.py", "aiobrpc/_fast/iobuf.py", "aiobrpc/client/call.py"):
        assert f in names, f"{f} missing from {sdist.name}"
    assert not [n for n in names if n.endswith(".so")]


def test_no_compiler_gives_pure_build(sdist, tmp_path):
    py = _venv(tmp_path / "venv")
    _run([py, "-m", "pip", "install", "-q", "setuptools>=77", "Cython>=3.2", "wheel"], cwd=tmp_path)
    env = _env(CC="/nonexistent/cc", CXX="/nonexistent/c++", LDSHARED="/nonexistent/cc -shared")
    p = _run([py, "-m", "pip", "install", "-v", "--no-build-isolation", str(sdist)], cwd=tmp_path, env=env)
    assert "the pure-Python build is installed" in p.stdout + p.stderr
    out = _run([py, "-m", "aiobrpc", "--version"], cwd=tmp_path, env=_env()).stdout
    assert "(pure python)" in out
    assert "echo hi" in _run([py, "-c", ECHO], cwd=tmp_path, env=_env(), timeout=120).stdout


def test_wheel_has_runtime_files_and_imports(sdist, tmp_path):
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(sdist)],
         cwd=tmp_path, env=_env())
    (wheel,) = wheels.glob("aiobrpc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in RUNTIME_FILES:
        assert f in names, f"{f} missing from {wheel.name}"
    assert any(n.startswith("aiobrpc/_fast/iobuf.") and n.endswith((".so", ".pyd")) for n in names)
    py = _venv(tmp_path / "venv")
    _run([py, "-m", "pip", "install", "-q", str(wheel)], cwd=tmp_path)
    out = _run([py, "-m", "aiobrpc", "--version"], cwd=tmp_path, env=_env()).stdout
    assert "compiled" in out
    assert "echo hi" in _run([py, "-c", ECHO], cwd=tmp_path, env=_env(), timeout=120).stdout
