"""bench/stream_bench.py runs in both of its shapes and prints its table (so it cannot rot)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shape", [["--processes", "2"], ["--processes", "1", "--clock", "cpu"]])
def test_the_stream_bench_prints_every_kind_for_a_size(twin, shape):
    env = dict(os.environ)
    env.pop("AIOBRPC_NO_EXTENSIONS", None)
    if twin == "python":
        env["AIOBRPC_NO_EXTENSIONS"] = "1"
    out = subprocess.run([sys.executable, "bench/stream_bench.py", "--rounds", "1", "--seconds", "0.1",
                          "--sizes", "4KiB", *shape], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"implementation={'python' if twin == 'python' else 'cython'}" in out.stdout
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("| 4 KiB |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    raw, windowed, stream, unary = (float(c) for c in cells[1:5])
    assert raw > 0 and windowed > 0 and stream > 0 and unary > 0, row
