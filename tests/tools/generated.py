"""The checked-in output of protoc-gen-aiobrpc and mypy-protobuf for proto/.

`aiobrpc/_proto/<name>_aiobrpc.py` (typed stubs and servicers) for each .proto with services,
and `<name>_pb2.pyi` (mypy-protobuf's types of the messages) for those and what they import.
The brpc meta protos are left out: they have no service and are no public API.

Run: python -m tests.tools.generated     (rewrites them)
tests/tools/test_protoc_plugin.py regenerates them into a temporary directory and compares.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "aiobrpc" / "_proto"
SOURCES = ["echo.proto", "interop.proto", "ps.proto", "tensor.proto", "collective.proto", "grpc_test.proto"]
PATTERNS = ("*_aiobrpc.py", "*_pb2.pyi")


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    """Write the files into `out`; their paths, sorted."""
    cmd = [sys.executable, "-m", "aiobrpc.protoc", f"-I{PROTO_DIR}", f"--mypy_out=quiet:{out}",
           f"--aiobrpc_out=relative_imports:{out}", *SOURCES]
    subprocess.run(cmd, check=True, cwd=PROTO_DIR, timeout=120)
    for pyi in out.glob("*_pb2.pyi"):
        # mypy-protobuf imports the other _pb2 modules absolutely; inside the package they are
        # relative, as proto/generate.py makes them in the _pb2 modules.
        text = pyi.read_text()
        pyi.write_text(re.sub(r"^import (\w+_pb2) as ", r"from . import \1 as ", text, flags=re.M))
    return sorted(p for pattern in PATTERNS for p in out.glob(pattern))


def main() -> int:
    for path in generate(OUT_DIR):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
