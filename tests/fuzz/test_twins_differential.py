"""The seed corpus replayed through the compiled and the pure build gives identical outcomes: the
same replies, the same errors, the same closes (fuzz/replay.py --json, each twin in its own
process: the modules compiled in place are chosen once per process).

The file name is in tests/conftest.py's _PARENT_ONLY: the parent process runs it once (it starts
both twins itself), the pure child skips it.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

from aiobrpc import _fast

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _replay(pure: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "AIOBRPC_NO_EXTENSIONS"}
    if pure:
        env["AIOBRPC_NO_EXTENSIONS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "fuzz.replay", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=220, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"findings in the corpus ({'pure' if pure else 'compiled'}):\n{proc.stderr[-20000:]}"
    return json.loads(proc.stdout)


@pytest.mark.timeout(480)
def test_compiled_and_pure_replay_the_same():
    if _fast.IMPLEMENTATION != "cython":
        pytest.skip("the compiled build is not present here (aiobrpc._fast extensions not built, or "
                    "AIOBRPC_NO_EXTENSIONS is set): there is no second twin to compare with")
    compiled, pure = _replay(False), _replay(True)
    assert compiled.keys() == pure.keys()
    # A harness over real sockets and timers (fuzz/collective.py) says its outcomes may differ
    # from run to run: its inputs are replayed above for findings, not compared.
    compared = [h for h in compiled if getattr(importlib.import_module(f"fuzz.{h}"), "DIFFERENTIAL", True)]
    assert len(compared) >= 10
    diffs = [f"{h}/{name}: compiled {out!r} pure {pure[h].get(name)!r}"
             for h in compared for name, out in compiled[h].items() if pure[h].get(name) != out]
    assert not diffs, "the twins differ:\n" + "\n".join(diffs[:20])
