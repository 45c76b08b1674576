"""bench/grpc_server_profile.py keeps running (it checks every call it times was answered)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_session_profile_runs_and_every_call_is_answered():
    out = subprocess.run([sys.executable, "bench/grpc_server_profile.py", "--batch", "4", "--rounds", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "us of server CPU per call (12 calls, 4 per read)" in out.stdout
