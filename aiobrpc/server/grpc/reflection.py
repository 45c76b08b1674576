"""gRPC server reflection (ServerOptions.grpc_reflection): `grpc.reflection.v1alpha` and
`grpc.reflection.v1` ServerReflectionInfo, which tools such as grpcurl and grpc_cli ask.

It lists the services added to the server, and answers the file that defines a file name, a
symbol (a service, method, message, enum or field by its full name) or an extension, each with
the files it imports, every file once per stream, from the protobuf descriptor pool of the
services' own .proto files. A name it does not know is answered NOT_FOUND in the response's
error_response; the stream carries on.
"""

from __future__ import annotations

from ... import stub
from ...protocol import grpc as codec
from ..._proto.grpc_reflection.v1 import reflection_pb2 as v1
from ..._proto.grpc_reflection.v1alpha import reflection_pb2 as v1alpha


class _Reflection(stub.Servicer):
    PB = v1

    def __init__(self, server) -> None:
        self.server = server

    async def ServerReflectionInfo(self, requests, cntl):
        pb = self.PB
        sent: set[str] = set()  # files this stream has sent: each goes once
        async for request in requests:
            response = pb.ServerReflectionResponse(valid_host=request.host, original_request=request)
            kind = request.WhichOneof("message_request")
            try:
                if kind == "list_services":
                    for name in self.server.registry.services:
                        response.list_services_response.service.add(name=name)
                elif kind == "file_by_filename":
                    self._files(response, self._pool().FindFileByName(request.file_by_filename), sent)
                elif kind == "file_containing_symbol":
                    self._files(response, self._pool().FindFileContainingSymbol(request.file_containing_symbol), sent)
                elif kind == "file_containing_extension":
                    pool = self._pool()
                    ext = request.file_containing_extension
                    found = pool.FindExtensionByNumber(pool.FindMessageTypeByName(ext.containing_type),
                                                       ext.extension_number)
                    self._files(response, found.file, sent)
                elif kind == "all_extension_numbers_of_type":
                    pool = self._pool()
                    message = pool.FindMessageTypeByName(request.all_extension_numbers_of_type)
                    numbers = response.all_extension_numbers_response
                    numbers.base_type_name = message.full_name
                    numbers.extension_number.extend(sorted(e.number for e in pool.FindAllExtensions(message)))
                else:
                    response.error_response.error_code = codec.UNIMPLEMENTED
                    response.error_response.error_message = f"{kind or 'an empty request'} is not supported"
            except KeyError as e:
                response.error_response.error_code = codec.NOT_FOUND
                response.error_response.error_message = f"not found: {e.args[0] if e.args else kind}"
            yield response

    def _pool(self):
        """The pool of the services' descriptors (the default pool for any generated _pb2)."""
        for methods in self.server.registry.services.values():
            for entry in methods.values():
                return entry.descriptor.containing_service.file.pool
        raise KeyError("no services")

    @staticmethod
    def _files(response, file, sent: set) -> None:
        out = response.file_descriptor_response.file_descriptor_proto
        todo = [file]
        while todo:
            f = todo.pop()
            if f.name in sent:
                continue
            sent.add(f.name)
            out.append(f.serialized_pb)
            todo.extend(f.dependencies)


class ReflectionV1(_Reflection):
    """grpc.reflection.v1.ServerReflection."""

    SERVICE = v1.DESCRIPTOR.services_by_name["ServerReflection"]
    PB = v1


class ReflectionV1alpha(_Reflection):
    """grpc.reflection.v1alpha.ServerReflection (what older tools ask)."""

    SERVICE = v1alpha.DESCRIPTOR.services_by_name["ServerReflection"]
    PB = v1alpha
