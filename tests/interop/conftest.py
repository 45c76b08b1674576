from tests.e2e.conftest import interop, loop_errors  # noqa: F401
