"""h2 is loaded by the first gRPC connection, not by `import aiobrpc`."""

from __future__ import annotations

import subprocess
import sys


def test_import_aiobrpc_leaves_h2_unloaded():
    code = "import sys, aiobrpc, aiobrpc.server; print(sorted(m for m in ('h2', 'hpack', 'hyperframe') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[]\n"
