"""protoc-gen-aiobrpc: reads protoc's CodeGeneratorRequest on stdin and writes a
CodeGeneratorResponse with one `<name>_aiobrpc.py` per .proto that defines services, placed
where protoc's Python generator places `<name>_pb2.py`.

A .proto its module could not be written for (an rpc named as a Python keyword, an unknown
parameter) is reported through the response's `error`: protoc prints it and exits 1.

>>> from google.protobuf.compiler import plugin_pb2
>>> generate(plugin_pb2.CodeGeneratorRequest(parameter="no_such_option")).error
'unknown parameter no_such_option (known: relative_imports)'
"""

from __future__ import annotations

import keyword
import sys
import textwrap
from collections.abc import Iterable

from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2

from .render import Method, Module, Service

PARAMETERS = ("relative_imports",)
SUFFIX = "_aiobrpc.py"

# Attributes the generated classes (or aiobrpc.Servicer) have already: an rpc of the same name
# would replace them.
_RESERVED = frozenset({"channel", "SERVICE", "receive_attachment_into"})

# Field numbers of FileDescriptorProto.service and ServiceDescriptorProto.method, the paths of
# source_code_info's locations.
_SERVICE_PATH = 6
_METHOD_PATH = 2


class PluginError(Exception):
    """The request cannot be turned into Python modules; the text says why."""


def module_name(proto_name: str) -> str:
    """The module protoc's Python generator writes for `proto_name`: `a/b-c.proto` -> `a.b_c_pb2`."""
    stem = proto_name[:-len(".proto")] if proto_name.endswith(".proto") else proto_name
    return stem.replace("-", "_").replace("/", ".") + "_pb2"


def _protoc_alias(module: str) -> str:
    # The name protoc's Python generator binds an imported _pb2 module to (a_dot_b__pb2).
    return module.replace("_", "__").replace(".", "_dot_")


def _message_paths(files: Iterable[descriptor_pb2.FileDescriptorProto]) -> dict[str, tuple[str, str]]:
    """`.pkg.Outer.Inner` -> (the .proto that defines it, `Outer.Inner`), for every message."""
    paths: dict[str, tuple[str, str]] = {}

    def walk(file: str, scope: str, path: str, messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
        for m in messages:
            paths[f"{scope}.{m.name}"] = (file, f"{path}{m.name}")
            walk(file, f"{scope}.{m.name}", f"{path}{m.name}.", m.nested_type)

    for f in files:
        walk(f.name, f".{f.package}" if f.package else "", "", f.message_type)
    return paths


def _comments(file: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    found = {}
    for loc in file.source_code_info.location:
        if loc.leading_comments.strip():
            lines = textwrap.dedent(loc.leading_comments.strip("\n")).splitlines()
            found[tuple(loc.path)] = "\n".join(line.rstrip() for line in lines).strip("\n")
    return found


def _check_identifier(what: str, name: str) -> None:
    if keyword.iskeyword(name):
        raise PluginError(f"{what} is named {name!r}, a Python keyword: it cannot be written as an attribute")


class _Imports:
    """The `_pb2` modules one generated module uses, and the name each is bound to there.

    A module is bound to its own name (`echo_pb2`) unless two used modules share it; those are
    bound to protoc's alias (`a_dot_echo__pb2`). With `relative` the modules are imported
    relatively to the generated one, except protobuf's own (google/protobuf/*.proto), which
    come with the protobuf package."""

    def __init__(self, own_proto: str, used_protos: set[str], relative: bool) -> None:
        self._own_package = module_name(own_proto).split(".")[:-1]
        self._relative = relative
        modules = sorted(module_name(p) for p in used_protos)
        last = [m.rpartition(".")[2] for m in modules]
        self.alias = {m: (short if last.count(short) == 1 else _protoc_alias(m)) for m, short in zip(modules, last)}

    def name(self, proto: str) -> str:
        return self.alias[module_name(proto)]

    def lines(self) -> list[str]:
        return [self._line(m, alias) for m, alias in self.alias.items()]

    def _line(self, module: str, alias: str) -> str:
        *package, last = module.split(".")
        tail = "" if alias == last else f" as {alias}"
        if self._relative and not module.startswith("google.protobuf."):
            common = 0
            for a, b in zip(self._own_package, package):
                if a != b:
                    break
                common += 1
            dots = "." * (1 + len(self._own_package) - common)
            return f"from {dots}{'.'.join(package[common:])} import {last}{tail}"
        if package:
            return f"from {'.'.join(package)} import {last}{tail}"
        return f"import {last}{tail}"


def generate_file(file: descriptor_pb2.FileDescriptorProto, messages: dict[str, tuple[str, str]],
                  relative: bool) -> str | None:
    """The source of `file`'s `_aiobrpc` module, or None when it defines no service."""
    if not file.service:
        return None
    comments = _comments(file)
    used = {file.name}  # its DESCRIPTOR names the services
    for service in file.service:
        for m in service.method:
            for type_name in (m.input_type, m.output_type):
                if type_name not in messages:
                    raise PluginError(f"{file.name}: {service.name}.{m.name} uses {type_name.lstrip('.')}, "
                                      "which no file of the request defines")
                used.add(messages[type_name][0])
    imports = _Imports(file.name, used, relative)

    def python_type(type_name: str) -> str:
        proto, path = messages[type_name]
        for part in path.split("."):
            _check_identifier(f"message {type_name.lstrip('.')}", part)
        return f"{imports.name(proto)}.{path}"

    services = []
    classes: dict[str, str] = {}
    for si, service in enumerate(file.service):
        full_name = f"{file.package}.{service.name}" if file.package else service.name
        for cls in (f"{service.name}Stub", f"{service.name}SyncStub", f"{service.name}Servicer"):
            if cls in classes:
                raise PluginError(f"{file.name}: services {classes[cls]} and {full_name} both need a class {cls}")
            classes[cls] = full_name
        methods, streaming = [], []
        for mi, m in enumerate(service.method):
            what = f"rpc {full_name}.{m.name}"
            _check_identifier(what, m.name)
            if m.name in _RESERVED or m.name.startswith("__"):
                raise PluginError(f"{what} would replace the attribute {m.name!r} of the generated classes")
            if m.client_streaming or m.server_streaming:
                streaming.append(m.name)
            methods.append(Method(
                name=m.name, request_type=python_type(m.input_type), request_full_name=m.input_type.lstrip("."),
                response_type=python_type(m.output_type),
                comment=comments.get((_SERVICE_PATH, si, _METHOD_PATH, mi), ""),
                client_streaming=m.client_streaming, server_streaming=m.server_streaming))
        services.append(Service(name=service.name, full_name=full_name, methods=methods, streaming=streaming,
                                comment=comments.get((_SERVICE_PATH, si), "")))
    return Module(source=file.name, imports=imports.lines(), descriptor_module=imports.name(file.name),
                  services=services).render()


def generate(request: plugin_pb2.CodeGeneratorRequest) -> plugin_pb2.CodeGeneratorResponse:
    """The response to `request`: the modules, or `error` saying why there are none."""
    response = plugin_pb2.CodeGeneratorResponse(
        supported_features=(plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL
                            | plugin_pb2.CodeGeneratorResponse.FEATURE_SUPPORTS_EDITIONS),
        minimum_edition=descriptor_pb2.EDITION_PROTO2, maximum_edition=descriptor_pb2.EDITION_2024)
    options = [p.strip() for p in request.parameter.split(",") if p.strip()]
    unknown = [p for p in options if p not in PARAMETERS]
    if unknown:
        response.error = f"unknown parameter {', '.join(unknown)} (known: {', '.join(PARAMETERS)})"
        return response
    messages = _message_paths(request.proto_file)
    files = {f.name: f for f in request.proto_file}
    try:
        for name in request.file_to_generate:
            content = generate_file(files[name], messages, "relative_imports" in options)
            if content is not None:
                out = response.file.add()
                out.name = module_name(name).replace(".", "/")[:-len("_pb2")] + SUFFIX
                out.content = content
    except PluginError as e:
        del response.file[:]
        response.error = str(e)
    return response


def main() -> int:
    """Run as protoc's plugin: the request on stdin, the response on stdout."""
    request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
    sys.stdout.buffer.write(generate(request).SerializeToString())
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
