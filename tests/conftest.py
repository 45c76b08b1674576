"""Every test runs against both twins of aiobrpc._fast (compiled and pure), selected here."""

from __future__ import annotations

import asyncio

import pytest
import uvloop
from hypothesis import HealthCheck, settings

from aiobrpc import _fast

TWINS = _fast.available()

# The twin fixture selects an implementation for the whole test; it needs no reset per example.
settings.register_profile("aiobrpc", suppress_health_check=[HealthCheck.function_scoped_fixture],
                          deadline=None)
settings.load_profile("aiobrpc")


@pytest.fixture(params=TWINS, autouse=True)
def twin(request):
    """The implementation under test: "cython" or "python"."""
    before = _fast.IMPLEMENTATION
    _fast.use(request.param)
    yield request.param
    _fast.use(before)


def pytest_asyncio_loop_factories(config, item):
    """Every async test runs on plain asyncio and on uvloop."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
