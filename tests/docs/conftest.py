"""The docs build depends on no twin of aiobrpc._fast: one run, not one per twin."""

import pytest


@pytest.fixture(autouse=True)
def twin():
    """Overrides the parametrized autouse fixture of tests/conftest.py."""
    return None
