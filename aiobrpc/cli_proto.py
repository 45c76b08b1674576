"""Compile a .proto at run time and find a method in it, for `aiobrpc call`.

protoc writes a FileDescriptorSet (with its imports) that is loaded into a private
DescriptorPool: no generated module is imported, so two .proto files with the same name or
package never clash with each other or with modules already imported.

>>> method = find_method(compile_proto("proto/echo.proto", ["proto"]), "example.EchoService/Echo")  # doctest: +SKIP
>>> method.input_type.full_name  # doctest: +SKIP
'example.EchoRequest'
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor, MethodDescriptor


class ProtoError(Exception):
    """The .proto cannot be compiled or does not define what was asked for."""


def protoc_command() -> list[str]:
    # grpc_tools' __main__ adds the include dir of google/protobuf/*.proto by itself.
    if importlib.util.find_spec("grpc_tools") is not None:
        return [sys.executable, "-m", "grpc_tools.protoc"]
    protoc = shutil.which("protoc")
    if protoc is not None:
        return [protoc]
    raise ProtoError("no protobuf compiler: `pip install grpcio-tools` (or put protoc on PATH)")


def compile_proto(proto: str, include_dirs: list[str] | None = None) -> FileDescriptor:
    """Compile `proto` with `include_dirs` (-I) and return its FileDescriptor."""
    if not os.path.isfile(proto):
        raise ProtoError(f"proto file not found: {proto}")
    includes = [os.path.abspath(d) for d in include_dirs or ()]
    for d in includes:
        if not os.path.isdir(d):
            raise ProtoError(f"include directory not found: {d}")
    path = os.path.abspath(proto)
    root = next((d for d in includes if os.path.commonpath([d, path]) == d), None)
    if root is None:  # protoc refuses a file outside every -I: its own directory is the natural root
        root = os.path.dirname(path)
        includes.append(root)
    name = os.path.relpath(path, root).replace(os.sep, "/")
    with tempfile.TemporaryDirectory(prefix="aiobrpc-proto-") as tmp:
        out = os.path.join(tmp, "descriptor_set.pb")
        cmd = [*protoc_command(), *(f"-I{d}" for d in includes), "--include_imports",
               f"--descriptor_set_out={out}", name]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            detail = done.stderr.strip().replace("\n", "; ") or f"exit status {done.returncode}"
            raise ProtoError(f"protoc failed on {proto}: {detail}")
        with open(out, "rb") as f:
            fds = descriptor_pb2.FileDescriptorSet.FromString(f.read())
    pool = descriptor_pool.DescriptorPool()
    for file_proto in fds.file:  # protoc lists dependencies before their dependents
        pool.Add(file_proto)
    return pool.FindFileByName(name)


def find_method(file: FileDescriptor, full_method: str) -> MethodDescriptor:
    """`pkg.Service/Method` (or `Service/Method`, or `pkg.Service.Method`) in `file` or its imports."""
    service_name, sep, method_name = full_method.rpartition("/")
    if not sep:
        service_name, _, method_name = full_method.rpartition(".")
    if not service_name or not method_name:
        raise ProtoError(f"method must look like 'package.Service/Method', got {full_method!r}")
    try:
        service = file.pool.FindServiceByName(service_name)
    except KeyError:
        matches = [s for s in file.services_by_name.values() if s.name == service_name]
        if len(matches) != 1:
            known = ", ".join(s.full_name for s in file.services_by_name.values()) or "none"
            raise ProtoError(f"no service {service_name!r} in {file.name} (services: {known})") from None
        service = matches[0]
    method = service.methods_by_name.get(method_name)
    if method is None:
        known = ", ".join(m.name for m in service.methods) or "none"
        raise ProtoError(f"no method {method_name!r} in {service.full_name} (methods: {known})")
    return method
