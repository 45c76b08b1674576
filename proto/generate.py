"""Regenerate aiobrpc/_proto/*_pb2.py from proto/*.proto.

Run: python proto/generate.py            (writes the modules)
     python proto/generate.py --check    (exit 1 if the committed modules differ)

protoc writes `import x_pb2` for imports between our files; inside the package they must be
relative, so that one line is rewritten. grpcio-tools is pinned in the test extra so the
output is reproducible.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "aiobrpc" / "_proto"
SOURCES = ["brpc_options.proto", "brpc_streaming.proto", "brpc_meta.proto", "echo.proto", "interop.proto",
           "tensor.proto", "ps.proto", "collective.proto", "grpc_test.proto",
           "grpc_health/v1/health.proto", "grpc_reflection/v1alpha/reflection.proto",
           "grpc_reflection/v1/reflection.proto"]


def generate(out: pathlib.Path) -> None:
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={out}", *SOURCES]
    subprocess.run(cmd, check=True, cwd=PROTO_DIR)
    for py in out.rglob("*_pb2.py"):
        text = py.read_text()
        text = re.sub(r"^import (\w+_pb2) as ", r"from . import \1 as ", text, flags=re.M)
        py.write_text(text)


def main() -> int:
    if "--check" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            generate(pathlib.Path(tmp))
            made = sorted(p.relative_to(tmp) for p in pathlib.Path(tmp).rglob("*_pb2.py"))
            stale = [str(p) for p in made
                     if not (OUT_DIR / p).exists() or (OUT_DIR / p).read_text() != (pathlib.Path(tmp) / p).read_text()]
        if stale:
            print("stale generated modules:", ", ".join(stale))
            return 1
        return 0
    generate(OUT_DIR)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
