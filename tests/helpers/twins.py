"""Which twin a test process runs (see tests/conftest.py)."""

from __future__ import annotations

import os

# Set in the second pytest process that runs the pure twin beside a parent running the compiled one.
PURE_RUN_ENV = "AIOBRPC_PURE_TWIN_RUN"


def pure_run_of_parent() -> bool:
    """This process runs the pure twin while its parent runs the compiled one: a test that is
    run once only (torch's slow start-up) runs in the parent."""
    return os.environ.get(PURE_RUN_ENV, "") not in ("", "0")
