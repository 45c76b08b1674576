"""Every file of the seed corpus (fuzz/corpus/<harness>/*) replays through its harness without a
finding: no crash, hang, leak or undocumented exception (fuzz/README.md). Runs on every Python,
without atheris, on the twin of this process (the pure child of tests/conftest.py replays it on
the pure twin). The harnesses run in a subprocess: they take over aiobrpc's loggers and set an
event loop of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESSES = ("baidu_server", "http_server", "h2_server", "stream", "baidu_client", "grpc_client",
             "compress", "json_transcode", "naming", "codec", "collective", "lanes", "lane_messages",
             "tensor_meta", "ps_server")


def test_every_harness_has_a_corpus():
    for h in HARNESSES:
        d = os.path.join(ROOT, "fuzz", "corpus", h)
        assert os.path.isdir(d) and os.listdir(d), f"fuzz/corpus/{h} is empty"


@pytest.mark.timeout(240)
def test_corpus_replays_without_findings():
    # A hang is for ever: the per-input bound (6 s of loop time when fuzzing) is raised here,
    # where a busy machine stretches the inputs that wait on real timers (fuzz/collective's
    # group start, timeouts and close took past 6 s beside two CPU hogs and the other twin).
    env = {**os.environ, "FUZZ_HANG_SECONDS": "60"}
    proc = subprocess.run([sys.executable, "-m", "fuzz.replay"], cwd=ROOT, capture_output=True, text=True,
                          timeout=220, stdin=subprocess.DEVNULL, env=env)
    assert proc.returncode == 0, f"findings in the corpus:\n{proc.stdout}\n{proc.stderr[-20000:]}"
    for h in HARNESSES:
        assert h in proc.stdout
