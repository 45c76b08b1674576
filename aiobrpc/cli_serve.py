"""The servicers of a Python module, for `aiobrpc serve MODULE[:ATTR[,ATTR]]`.

MODULE is a file (`path/to/services.py`, its directory put first on sys.path so that its
sibling modules, such as its `_pb2.py`, import) or a dotted name importable from the current
directory (`pkg.services`). Without ATTR every `Servicer` subclass defined in the module is
made with no argument; a subclass that only serves as the base of others there is skipped.
An ATTR names a Servicer subclass (made with no argument) or a Servicer instance.

>>> [type(s).__name__ for s in load_servicers("aiobrpc.cli:EchoServiceImpl")]
['EchoServiceImpl']
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import types

from .stub import Servicer


class ServeError(Exception):
    """The module cannot be imported or does not define servicers that can be served."""


def load_servicers(spec: str) -> list[Servicer]:
    """The servicers named by `spec`, "MODULE" or "MODULE:ATTR[,ATTR...]"."""
    target, _, attrs = spec.rpartition(":") if _has_attrs(spec) else (spec, "", "")
    module = _import(target)
    if attrs:
        servicers = []
        for name in filter(None, (a.strip() for a in attrs.split(","))):
            if not hasattr(module, name):
                raise ServeError(f"module {module.__name__!r} ({target}) has no attribute {name!r}")
            servicers.append(_servicer(getattr(module, name), f"{target}:{name}"))
        if not servicers:
            raise ServeError(f"{spec!r}: no attribute named after ':'")
        return servicers
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, Servicer) and c is not Servicer
               and c.__module__ == module.__name__]
    bases = {b for c in classes for b in c.__mro__[1:]}
    classes = [c for c in classes if not (c in bases and not _has_service(c))]
    if not classes:
        raise ServeError(f"{target} defines no aiobrpc.Servicer subclass")
    return [_servicer(c, f"{target}:{c.__name__}") for c in classes]


def _has_attrs(spec: str) -> bool:
    # "C:\dir\x.py" is a Windows path, not MODULE:ATTR.
    head, sep, tail = spec.rpartition(":")
    return bool(sep) and bool(head) and not (len(head) == 1 and tail.startswith(("\\", "/")))


def _import(target: str) -> types.ModuleType:
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise ServeError(f"no such file: {target}")
        name = os.path.splitext(os.path.basename(path))[0]
        folder = os.path.dirname(path)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ServeError(f"cannot import {target}: not a Python module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # as an import would: decorators and dataclasses look it up
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(name, None)
            raise ServeError(f"importing {target} failed: {_one_line(e)}") from None
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name is not None and (target == e.name or target.startswith(e.name + ".")):
            raise ServeError(f"no module named {target!r} (a dotted name importable from here, or a .py file)") \
                from None
        raise ServeError(f"importing {target} failed: {_one_line(e)}") from None
    except Exception as e:
        raise ServeError(f"importing {target} failed: {_one_line(e)}") from None


def _servicer(obj, where: str) -> Servicer:
    if isinstance(obj, Servicer):
        instance = obj
    elif isinstance(obj, type) and issubclass(obj, Servicer):
        if not _has_service(obj):
            raise ServeError(f"{where} has no SERVICE: set SERVICE = <a protobuf ServiceDescriptor>, "
                             "e.g. foo_pb2.DESCRIPTOR.services_by_name['FooService']")
        try:
            inspect.signature(obj).bind()
        except TypeError as e:
            raise ServeError(f"{where} cannot be made with no argument ({e}): name an instance instead, "
                             f"e.g. MODULE:instance_name") from None
        except ValueError:  # no signature to inspect: let the call say
            pass
        try:
            instance = obj()
        except Exception as e:
            raise ServeError(f"{where}() failed: {_one_line(e)}") from None
    else:
        raise ServeError(f"{where} is {type(obj).__name__!r}, not an aiobrpc.Servicer subclass or instance")
    if not _has_service(instance):
        raise ServeError(f"{where} has no SERVICE: set SERVICE = <a protobuf ServiceDescriptor>")
    return instance


def _has_service(obj) -> bool:
    return hasattr(getattr(obj, "SERVICE", None), "methods")


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"
