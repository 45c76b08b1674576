"""Run only by tests/test_compiled.py, as `pytest tests/helpers/twin_probe.py`: it fails in the
twin that AIOBRPC_PROBE_FAIL names ("compiled" or "pure")."""

import os

from aiobrpc import _compiled, _fast


def test_probe():
    this = "pure" if _fast.IMPLEMENTATION == "python" else "compiled"
    print(f"probe ran: {this} {sorted(set(_compiled.compiled().values()))}")
    assert os.environ.get("AIOBRPC_PROBE_FAIL") != this
