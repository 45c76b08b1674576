"""The imports between layers go one way (issue 17): the ground modules every layer uses
(`errors.py`, `controller.py`, `options.py`), and everything they import, import nothing from
`client/` or `server/`. Read from the source (every import statement, also those inside
functions), so a lazy import counts as much as one at the top."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import aiobrpc
from aiobrpc.client.circuit_breaker import CircuitBreaker
from aiobrpc.options import CIRCUIT_BREAKER_DEFAULTS

PACKAGE = Path(aiobrpc.__file__).parent
GROUND = ("aiobrpc.errors", "aiobrpc.controller", "aiobrpc.options")
UPPER = ("aiobrpc.client", "aiobrpc.server")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The aiobrpc modules `name` imports. The root package's __init__ (the public API, which
    imports every layer) is not followed: importing `aiobrpc.x` runs it whatever x is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in modules and t != "aiobrpc")
    return out


def test_ground_modules_import_nothing_from_client_or_server():
    modules = _modules()
    seen: dict[str, str] = {}  # module -> the module that imported it first (for the message)
    todo = list(GROUND)
    while todo:
        name = todo.pop()
        for imported in _imports(name, modules[name], modules):
            if imported not in seen and imported not in GROUND:
                seen[imported] = name
                todo.append(imported)
    upward = {m: by for m, by in seen.items() if m.startswith(UPPER)}
    assert not upward, f"ground modules reach client/ or server/: {upward} (module: imported by)"
    assert "aiobrpc.protocol.checksum" in seen  # the walk does follow imports


def test_the_walk_sees_lazy_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from .client.call import Call\n    from . import errors\n")
    modules = _modules()
    assert _imports("aiobrpc.m", src, modules) == {"aiobrpc.client.call", "aiobrpc.errors"}


def test_circuit_breaker_defaults_are_the_options_defaults():
    params = inspect.signature(CircuitBreaker).parameters
    assert {n: p.default for n, p in params.items() if n != "clock"} == CIRCUIT_BREAKER_DEFAULTS


def test_moved_names_are_still_importable_where_they_were():
    from aiobrpc.client.call import AttemptInfo
    from aiobrpc.client.retry import RetryThrottle
    from aiobrpc.controller import AttemptInfo as ground_info
    assert AttemptInfo is ground_info and RetryThrottle is aiobrpc.RetryThrottle
