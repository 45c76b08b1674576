"""`python -m aiobrpc.protoc ARGS`: protoc ARGS with protoc-gen-aiobrpc registered.

protoc is grpcio-tools' (which also finds google/protobuf/*.proto) or the one on PATH. The
plugin runs as `<this Python> -m aiobrpc.protoc.plugin` through a launcher script in a
temporary directory, so no installed script and no PATH entry is needed. mypy-protobuf's
`protoc-gen-mypy`, when installed beside this Python, is registered too (`--mypy_out=.`
writes the `_pb2.pyi` type stubs of the messages).

    python -m aiobrpc.protoc -I. --python_out=. --mypy_out=. --aiobrpc_out=. echo.proto
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile

from ..cli_proto import ProtoError, protoc_command


def write_launcher(directory: str) -> str:
    """An executable in `directory` that runs the plugin with this Python; its path."""
    if os.name == "nt":
        path = os.path.join(directory, "protoc-gen-aiobrpc.cmd")
        with open(path, "w") as f:
            f.write(f'@"{sys.executable}" -m aiobrpc.protoc.plugin %*\r\n')
        return path
    path = os.path.join(directory, "protoc-gen-aiobrpc")
    with open(path, "w") as f:
        # sh, not a `#!python` line: a shebang is cut at 127 bytes on older kernels.
        f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m aiobrpc.protoc.plugin \"$@\"\n")
    os.chmod(path, 0o755)
    return path


def _installed_plugin(name: str) -> str | None:
    path = os.path.join(sysconfig.get_path("scripts"), name + (".exe" if os.name == "nt" else ""))
    return path if os.path.isfile(path) else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        protoc = protoc_command()
    except ProtoError as e:
        print(e, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="aiobrpc-protoc-") as tmp:
        plugins = [f"--plugin=protoc-gen-aiobrpc={write_launcher(tmp)}"]
        mypy = _installed_plugin("protoc-gen-mypy")
        if mypy is not None and not any(a.startswith("--plugin=protoc-gen-mypy=") for a in args):
            plugins.append(f"--plugin=protoc-gen-mypy={mypy}")
        return subprocess.run([*protoc, *plugins, *args]).returncode


if __name__ == "__main__":
    raise SystemExit(main())
